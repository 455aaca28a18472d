"""CuPy launchers for the KL's row-wise kernels (``kl_kernels.cu``).

Why this file exists: it maps torch tensors onto the two KL kernels (grid, column split, vector
alignment) and launches them; :mod:`mopd.kernels.kl.rowwise` decides when it is used, merges the
per-block statistics and holds the torch twins with the same contracts. Compilation and the torch-stream bridge are
:mod:`mopd.kernels.cupy_loader`'s. CuPy is only imported when a kernel runs.

Storage types per tensor (see :data:`STATS_KERNELS` / :data:`GRAD_KERNELS`): bf16 or fp32
student logits, fp32 (or bf16) teacher logits, a bf16 or fp32 gradient. bf16 tensors are handed
to CuPy as int16 views (CuPy before 14 cannot take bf16 through DLPack); the kernels reinterpret
the bits. Kernels run on torch's current CUDA stream.
"""

from __future__ import annotations

import torch

from mopd.kernels.cupy_loader import get_kernel, on_torch_stream, to_cupy

__all__ = [
    "GRAD_KERNELS",
    "STATS_KERNELS",
    "dtype_reason",
    "row_grad_cupy",
    "row_stats_partials_cupy",
    "unsupported_reason",
]

_SOURCE = "kl/kl_kernels.cu"
_THREADS = 256
_TARGET_BLOCKS = 1024  # enough blocks in flight to saturate HBM on a 132-SM part
_MIN_COLS_PER_BLOCK = 4096

_BF16, _F32 = torch.bfloat16, torch.float32
#: ``(s, u)`` storage dtypes -> suffix of the ``kl_row_stats_*`` kernel.
STATS_KERNELS: dict[tuple[torch.dtype, ...], str] = {
    (_BF16, _BF16): "bf16",
    (_F32, _F32): "f32",
    (_BF16, _F32): "bf16_f32",
}
#: ``(s, u, out)`` storage dtypes -> suffix of the ``kl_row_grad_*`` kernel.
GRAD_KERNELS: dict[tuple[torch.dtype, ...], str] = {
    (_BF16, _BF16, _BF16): "bf16",
    (_F32, _F32, _F32): "f32",
    (_BF16, _F32, _BF16): "bf16_f32_bf16",
    (_F32, _F32, _BF16): "f32_f32_bf16",
}


def dtype_reason(*dtypes: torch.dtype) -> str | None:
    """Why no kernel takes these storage dtypes, ``(s,)``, ``(s, u)`` or ``(s, u, out)``
    (``None`` when one does)."""
    if len(dtypes) == 1:
        ok = dtypes[0] in (_BF16, _F32)
    elif len(dtypes) == 2:
        ok = tuple(dtypes) in STATS_KERNELS
    else:
        ok = tuple(dtypes) in GRAD_KERNELS
    if ok:
        return None
    known = sorted(
        "(" + ", ".join(str(d).removeprefix("torch.") for d in k) + ")"
        for k in (*STATS_KERNELS, *GRAD_KERNELS)
    )
    got = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
    return f"dtypes ({got}): the kernels take (s, u) / (s, u, out) in {', '.join(known)}"


def unsupported_reason(*tensors: torch.Tensor) -> str | None:
    """Why the kernels cannot take these CUDA tensors ``(s, u[, out])`` (``None`` when they can)."""
    reason = dtype_reason(*(t.dtype for t in tensors))
    if reason is not None:
        return reason
    if any(t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1) for t in tensors):
        return "a tensor is not 2-D with contiguous columns"
    return None


def _as_cupy(t: torch.Tensor):
    """Zero-copy CuPy view; bf16 goes through as int16 (the kernels reinterpret the bits)."""
    return to_cupy(t.view(torch.int16) if t.dtype == torch.bfloat16 else t)


def _geometry(t: torch.Tensor, *others: torch.Tensor) -> tuple[int, int, int]:
    """``(n, span, P)`` column split of ``t``'s rows into ``P`` blocks of ``span`` columns.

    ``span`` is a multiple of the kernels' vector step over ``t`` and ``others`` (8 columns when
    any of them is bf16, else 4).
    """
    C, n = t.shape
    vec = 16 // min(x.element_size() for x in (t, *others))
    per_row = max(1, min(-(-_TARGET_BLOCKS // max(C, 1)), -(-n // _MIN_COLS_PER_BLOCK)))
    span = -(-n // per_row)
    span = -(-span // vec) * vec
    P = max(1, -(-n // span)) if n else 1
    return n, span, P


def _vec_ok(*tensors: torch.Tensor) -> int:
    """1 when every row of every tensor starts on a 16-byte boundary."""
    for t in tensors:
        if t.data_ptr() % 16 or (t.shape[0] > 1 and (t.stride(0) * t.element_size()) % 16):
            return 0
    return 1


def _ld(t: torch.Tensor) -> int:
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


def _matrix(t: torch.Tensor) -> tuple[object, object]:
    """A ``[C, V]`` tensor as the kernels take it: its CuPy view and its int64 row stride."""
    import numpy as np

    return _as_cupy(t), np.int64(_ld(t))


def _launch(kernel_name: str, s_CV: torch.Tensor, P: int, args: tuple[object, ...]) -> None:
    """Launch ``kl_<kernel_name>`` on a ``(P, C)`` grid (one block row per token of ``s_CV``'s
    ``C`` rows, ``P`` column blocks) of ``_THREADS`` threads, on torch's stream."""
    kernel = get_kernel(_SOURCE, f"kl_{kernel_name}", s_CV.device)
    with on_torch_stream(s_CV.device):
        kernel((P, s_CV.shape[0]), (_THREADS,), args)


def row_stats_partials_cupy(
    s_CV: torch.Tensor, u_CV: torch.Tensor, *, need_forward: bool
) -> torch.Tensor:
    """The statistics of :func:`mopd.kernels.kl.rowwise.row_stats_torch` per column block.

    Returns ``[6, C, P]`` float32: for each of ``s_CV``'s ``C`` rows, the six statistics of each
    of its ``P >= 1`` column blocks relative to that block's maxima;
    :func:`mopd.kernels.kl.rowwise.combine_partials` merges them into ``[6, C]``.
    """
    import numpy as np

    C, _ = s_CV.shape
    n, span, P = _geometry(s_CV, u_CV)
    part_6CP = torch.empty((6, C, P), dtype=torch.float32, device=s_CV.device)
    if C == 0:
        return part_6CP
    if n == 0:
        part_6CP[:2] = float("-inf")
        part_6CP[2:] = 0.0
        return part_6CP
    args = (
        *_matrix(s_CV),
        *_matrix(u_CV),
        np.int32(n),
        np.int32(span),
        np.int32(_vec_ok(s_CV, u_CV)),
        np.int32(1 if need_forward else 0),
        _as_cupy(part_6CP),
        np.int32(C),
        np.int32(P),
    )
    _launch(f"row_stats_{STATS_KERNELS[s_CV.dtype, u_CV.dtype]}", s_CV, P, args)
    return part_6CP


def row_grad_cupy(
    s_CV: torch.Tensor,
    u_CV: torch.Tensor,
    coef_5C: torch.Tensor,
    out_CV: torch.Tensor,
    *,
    teacher_term: bool,
) -> torch.Tensor:
    """:func:`mopd.kernels.kl.rowwise.row_grad_torch`'s contract as a CuPy kernel."""
    import numpy as np

    C, _ = s_CV.shape
    n, span, P = _geometry(s_CV, u_CV, out_CV)
    if C == 0 or n == 0:
        return out_CV
    coef_5C = coef_5C.to(torch.float32).contiguous()
    args = (
        *_matrix(s_CV),
        *_matrix(u_CV),
        *_matrix(out_CV),
        np.int32(n),
        np.int32(span),
        np.int32(_vec_ok(s_CV, u_CV, out_CV)),
        _as_cupy(coef_5C),
        np.int32(C),
        np.int32(1 if teacher_term else 0),
    )
    _launch(f"row_grad_{GRAD_KERNELS[s_CV.dtype, u_CV.dtype, out_CV.dtype]}", s_CV, P, args)
    return out_CV
