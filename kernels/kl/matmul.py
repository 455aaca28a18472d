"""Matmuls of bf16 (or fp16) operands with an fp32 result, without an fp32 copy of the weight.

Why this file exists: the KL's logits must not be rounded to the inputs' dtype (a bf16 teacher
logit of magnitude 40 is off by up to 0.08, far more than the student-teacher differences the
loss measures), and its fp32 gradients should be accumulated before they are rounded. Every
product of two bf16 (or fp16) values is exact in fp32, so an fp32 result of bf16 operands needs
fp32 accumulation and an fp32 output, nothing more:

- CUDA: ``torch.mm(a, b, out_dtype=torch.float32)`` (cuBLAS, tensor cores, fp32 accumulation
  and output); an accumulation ``out += a @ b`` tries ``torch.addmm(..., out_dtype=...)`` into
  ``out`` and, where this torch rejects an fp32 ``out`` as the addend, adds the product of a
  bounded block of rows at a time. A CUDA build without these falls back as below (logged once).
- Elsewhere (CPU): the operands are converted to the result dtype a block of the largest
  dimension at a time (at most :data:`BLOCK_BYTES` of converted operand), so no fp32 copy of a
  ``[V, H]`` weight ever exists.

Operands of the result's dtype take the plain ``torch.mm`` / ``addmm_``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from mopd.common.log import log_once

__all__ = ["BLOCK_BYTES", "logit_dtype", "matmul_into"]

_log = logging.getLogger(__name__)

#: Largest block of converted operand (the CPU path) or of fp32 product (CUDA accumulation).
BLOCK_BYTES = 64 * 2**20

_REDUCED = (torch.bfloat16, torch.float16)
# per (device kind, op): whether torch took the out_dtype form here; learned on first use
_out_dtype_ok: dict[str, bool] = {}


def logit_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype logits of these operand dtypes are formed in: at least fp32 (fp64 stays)."""
    out = torch.float32
    for dt in dtypes:
        out = torch.promote_types(out, dt)
    return out


_FALLBACK = {
    "mm": "converting operand blocks to fp32 instead",
    "addmm": "adding the fp32 products of row blocks instead",
}


def _try_out_dtype(op: str, call: Callable[[], object]) -> bool:
    """Run ``call()``, a CUDA ``out_dtype`` matmul; False where this torch does not have it.

    The first call of each ``op`` finds out (the ``out_dtype`` checks run before any work, so a
    refused call leaves its output untouched); later calls take the answer. Out-of-memory, and
    any error once the form has worked, propagate.
    """
    state = _out_dtype_ok.get(op)
    if state is False:
        return False
    if state is True:
        call()
        return True
    try:
        call()
    except torch.cuda.OutOfMemoryError:
        raise
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        _out_dtype_ok[op] = False
        log_once(
            _log,
            f"out_dtype:{op}",
            "mopd.kernels.kl: torch.%s(..., out_dtype=torch.float32) is unavailable here (%s); "
            "%s (logged once)",
            op,
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
            _FALLBACK[op],
        )
        return False
    _out_dtype_ok[op] = True
    return True


def _blocked(
    a_MK: torch.Tensor, b_KN: torch.Tensor, out_MN: torch.Tensor, accumulate: bool
) -> None:
    """``out (+)= a @ b`` with the operands converted to ``out``'s dtype a block at a time,
    along the largest of ``M``, ``N``, ``K``."""
    wide = out_MN.dtype
    M, K = a_MK.shape
    N = b_KN.shape[1]
    size = wide.itemsize
    if K >= M and K >= N:
        step = max(1, BLOCK_BYTES // max(1, (M + N) * size))
        if not accumulate:
            out_MN.zero_()
        for k0 in range(0, K, step):
            out_MN.addmm_(a_MK[:, k0 : k0 + step].to(wide), b_KN[k0 : k0 + step].to(wide))
    elif M >= N:
        step = max(1, BLOCK_BYTES // max(1, K * size))
        b_w = b_KN.to(wide)
        for m0 in range(0, M, step):
            rows = out_MN[m0 : m0 + step]
            if accumulate:
                rows.addmm_(a_MK[m0 : m0 + step].to(wide), b_w)
            else:
                torch.mm(a_MK[m0 : m0 + step].to(wide), b_w, out=rows)
    else:
        step = max(1, BLOCK_BYTES // max(1, K * size))
        a_w = a_MK.to(wide)
        for n0 in range(0, N, step):
            part_MN = a_w @ b_KN[:, n0 : n0 + step].to(wide)
            cols = out_MN[:, n0 : n0 + step]
            if accumulate:
                cols.add_(part_MN)
            else:
                cols.copy_(part_MN)


def _mm_f32(a_MK: torch.Tensor, b_KN: torch.Tensor, out_MN: torch.Tensor) -> None:
    torch.mm(a_MK, b_KN, out_dtype=torch.float32, out=out_MN)


def _accumulate_by_row_blocks(a_MK: torch.Tensor, b_KN: torch.Tensor, out_MN: torch.Tensor) -> bool:
    """CUDA ``out += a @ b``: each block of rows' fp32 product (``torch.mm(..., out_dtype)``)
    into a bounded buffer, then added. False, with ``out`` untouched, where that form fails."""
    M, N = out_MN.shape
    step = max(1, min(M, BLOCK_BYTES // max(1, N * 4)))
    part = torch.empty((step, N), dtype=torch.float32, device=out_MN.device)
    first = part[: min(step, M)]
    if not _try_out_dtype("mm", lambda: _mm_f32(a_MK[:step], b_KN, first)):
        return False
    out_MN[:step].add_(first)
    for m0 in range(step, M, step):
        rows = out_MN[m0 : m0 + step]
        p = part[: rows.shape[0]]
        _mm_f32(a_MK[m0 : m0 + step], b_KN, p)
        rows.add_(p)
    return True


def matmul_into(
    a_MK: torch.Tensor, b_KN: torch.Tensor, out_MN: torch.Tensor, *, accumulate: bool = False
) -> torch.Tensor:
    """``out = a @ b`` (or ``out += a @ b``) in ``out``'s dtype, accumulated in it.

    Args:
        a_MK, b_KN: operands of one dtype (any strides; e.g. ``w_VH.T`` views).
        out_MN: the result, of the operands' dtype or wider (fp32 for bf16 operands); rows
            contiguous (a row range of a larger buffer is fine).
        accumulate: add to ``out`` instead of overwriting it.
    Returns:
        ``out_MN``.
    Raises:
        ValueError: the operands disagree on their dtype, or ``out`` is narrower than them.
    """
    if a_MK.dtype != b_KN.dtype:
        raise ValueError(f"matmul_into: operand dtypes differ: {a_MK.dtype} and {b_KN.dtype}")
    if torch.promote_types(a_MK.dtype, out_MN.dtype) != out_MN.dtype:
        raise ValueError(f"matmul_into: out dtype {out_MN.dtype} is narrower than {a_MK.dtype}")
    if a_MK.dtype == out_MN.dtype:
        if accumulate:
            out_MN.addmm_(a_MK, b_KN)
        else:
            torch.mm(a_MK, b_KN, out=out_MN)
        return out_MN
    if out_MN.is_cuda and out_MN.dtype == torch.float32 and a_MK.dtype in _REDUCED:
        if not accumulate and _try_out_dtype("mm", lambda: _mm_f32(a_MK, b_KN, out_MN)):
            return out_MN
        if accumulate and _try_out_dtype(
            "addmm",
            lambda: torch.addmm(out_MN, a_MK, b_KN, out_dtype=torch.float32, out=out_MN),
        ):
            return out_MN
        if accumulate and _accumulate_by_row_blocks(a_MK, b_KN, out_MN):
            return out_MN
    _blocked(a_MK, b_KN, out_MN, accumulate)
    return out_MN
