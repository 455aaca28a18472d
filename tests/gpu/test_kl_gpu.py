"""Tier 3 (CUDA): the KL in bf16 on a GPU, and its CuPy row kernels against their torch twins.

- The CuPy kernels (``kl_row_stats_*``, ``kl_row_grad_*``) against the torch twins on the same
  inputs, for every storage-type combination the loss uses (uniform bf16 or fp32; bf16 student
  with fp32 teacher logits; fp32 logits with a bf16 gradient): aligned and unaligned rows (vector
  and scalar paths), strided row views, column counts that are not a multiple of the vector
  width, rows split over several column blocks, empty column ranges; outputs poisoned with NaN
  first. Row maxima exact; partition sums rtol 1e-5 (the two sum in a different order); the
  cross sums as expectations within 1e-5 of the logit spread; gradients rtol 2**-7 in bf16
  (1 ulp), 1e-5 in fp32, atol 1e-5 of the largest value.
- fp32 matmuls of bf16 operands take cuBLAS's ``out_dtype`` path (no fp32 copy of an operand)
  and are fp32-exact against float64.
- The loss at V = 151,936 in bf16 (the distillation regime, logit std 3 and 12, three kinds, one
  and two teachers, both entry points) against float64 from the same bf16 inputs, as tier 1:
  relative loss error <= 1e-5, relative gradient error <= 0.5%; the logits path also through a
  one-rank NCCL group.
- ``auto`` picks CuPy on CUDA for the dtype combinations it has.
- Extra memory of the fused path stays within the gradients, the fp32 hidden-state gradient,
  the fp32 weight-gradient buffer when asked for, and the chunk budget (+25%).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist

from mopd.kernels.backend import cupy_available
from mopd.kernels.kl import KLConfig, fused_vocab_parallel_kl, vocab_parallel_kl
from mopd.kernels.kl import matmul as kl_matmul
from mopd.kernels.kl.rowwise import resolve_backend, row_grad, row_stats
from tests.support.kl_reference import (
    distillation_case,
    kl_vs_float64,
    relative_error,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="tier 3 needs a CUDA device; none here"
    ),
]
needs_cupy = pytest.mark.skipif(
    not cupy_available(), reason="CuPy is not importable: the KL kernels cannot be checked"
)

DEV = torch.device("cuda", 0)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _pair(
    C: int,
    n: int,
    dtypes: tuple[torch.dtype, torch.dtype],
    *,
    ld: int | None = None,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Student and teacher ``[C, n]`` views of the given dtypes with row stride ``ld``, starting
    ``offset`` elements into their buffers (an odd offset makes every row start unaligned: the
    scalar path); the teacher is the student plus noise."""
    g = torch.Generator(device=DEV).manual_seed(C * 1000 + n)
    ld = n if ld is None else ld
    base = torch.randn(C * ld + offset, generator=g, device=DEV) * 4
    flats = (base, base + torch.randn(base.shape, generator=g, device=DEV) * 0.5)
    out = [
        f.to(dt).as_strided((C, n), (ld, 1), storage_offset=offset)
        for f, dt in zip(flats, dtypes, strict=True)
    ]
    return out[0], out[1]


SHAPES = [
    # (C, n, ld, offset): vector path; n % VEC != 0; strided rows; unaligned; wide rows (P > 1);
    (7, 64, None, 0),
    (5, 101, None, 0),
    (6, 200, 256, 0),
    (3, 77, 80, 1),
    (4, 40000, None, 0),
    (300, 5000, 5008, 0),
    (2, 0, None, 0),
]
BF16, F32 = torch.bfloat16, torch.float32
#: (student, teacher, gradient) storage dtypes of the kernels
DTYPES = [(BF16, BF16, BF16), (F32, F32, F32), (BF16, F32, BF16), (F32, F32, BF16)]


@needs_cupy
@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: "-".join(str(x)[6:] for x in d))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_cupy_row_kernels_match_twins(
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype], shape: tuple[int, int, int | None, int]
) -> None:
    C, n, ld, offset = shape
    s_dtype, u_dtype, out_dtype = dtypes
    s, u = _pair(C, n, (s_dtype, u_dtype), ld=ld, offset=offset)
    spread = float(s.float().abs().amax()) + float(u.float().abs().amax()) if n else 1.0
    for need_forward in (False, True):
        got = row_stats(s, u, need_forward=need_forward, backend="cupy")
        want = row_stats(s, u, need_forward=need_forward, backend="torch")
        assert not torch.isnan(got).any()
        torch.testing.assert_close(got[:2], want[:2], rtol=0, atol=0)  # maxima: exact
        torch.testing.assert_close(got[2:4], want[2:4], rtol=1e-5, atol=0)
        # the cross sums cancel: compare them as expectations E_p[s - u], scaled by the spread
        z = want[[2, 3]].clamp_min(1e-30)
        torch.testing.assert_close(got[4:] / z, want[4:] / z, rtol=0, atol=1e-5 * spread)
    stats = row_stats(s, u, need_forward=True, backend="torch")
    g = torch.Generator(device=DEV).manual_seed(1)
    coef = torch.randn(5, C, generator=g, device=DEV)
    coef[0], coef[1] = stats[0], stats[1]
    for teacher_term in (False, True):
        out_c = torch.full((C, n), float("nan"), dtype=out_dtype, device=DEV)
        out_t = torch.full((C, n), float("nan"), dtype=out_dtype, device=DEV)
        row_grad(s, u, coef, out_c, teacher_term=teacher_term, backend="cupy")
        row_grad(s, u, coef, out_t, teacher_term=teacher_term, backend="torch")
        assert not torch.isnan(out_c).any()
        # same fp32 math in another order; bf16 output: at most 1 ulp apart
        tol = 2**-7 if out_dtype == torch.bfloat16 else 1e-5
        scale = float(out_t.float().abs().amax()) if n else 1.0
        torch.testing.assert_close(out_c, out_t, rtol=tol, atol=1e-5 * scale)


@needs_cupy
def test_auto_picks_cupy_on_cuda() -> None:
    t = torch.zeros(2, 8, device=DEV, dtype=torch.bfloat16)
    assert resolve_backend("auto", t, t) == "cupy"
    assert resolve_backend("auto", t, t.float()) == "cupy"  # bf16 student, fp32 teacher
    assert resolve_backend("auto", t.float(), t.float(), t) == "cupy"  # fp32 logits, bf16 grad
    assert resolve_backend("auto", t, t.half()) == "torch"  # no kernel: twin (logged once)
    with pytest.raises(ValueError, match="cannot run"):
        resolve_backend("cupy", t.half(), t.half())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("accumulate", [False, True])
def test_matmul_into_takes_cublas_out_dtype_and_is_fp32_exact(
    dtype: torch.dtype, accumulate: bool, caplog: pytest.LogCaptureFixture
) -> None:
    g = torch.Generator(device=DEV).manual_seed(2)
    a = (torch.randn(300, 512, generator=g, device=DEV) * 4).to(dtype)
    b = (torch.randn(1000, 512, generator=g, device=DEV) * 4).to(dtype).T  # as w_VH.T
    out = torch.randn(300, 1000, generator=g, device=DEV)
    start = out.clone()
    with caplog.at_level("WARNING"):
        kl_matmul.matmul_into(a, b, out, accumulate=accumulate)
    want = a.double() @ b.double() + (start.double() if accumulate else 0.0)
    bound = 520 * 2**-24 * (a.double().abs() @ b.double().abs() + start.double().abs())
    assert bool(((out.double() - want).abs() <= bound).all())
    # the fast path was taken (cuBLAS with an fp32 output), not converted operand blocks
    ok = kl_matmul._out_dtype_ok
    if accumulate:  # addmm into fp32 where this torch takes it, else mm per row block
        assert ok.get("addmm") is True or ok.get("mm") is True, ok
    else:
        assert ok.get("mm") is True, ok
    assert not [r for r in caplog.records if "operand blocks" in r.getMessage()], caplog.text


V_BIG = 151936


@functools.cache
def _big_case(std: float, n_teachers: int) -> dict[str, Any]:
    c = distillation_case(std=std, n_teachers=n_teachers, T=256, H=512, V=V_BIG)
    return {
        k: [x.to(DEV) for x in v] if isinstance(v, list) else v.to(DEV) if torch.is_tensor(v) else v
        for k, v in c.items()
    }


@pytest.mark.parametrize("std", [3.0, 12.0])
@pytest.mark.parametrize("n_teachers", [1, 2])
@pytest.mark.parametrize("kind", ["reverse", "forward", "mixed"])
def test_bf16_fused_large_vocab_matches_float64(kind: str, n_teachers: int, std: float) -> None:
    loss, want, grads, grads64 = kl_vs_float64(_big_case(std, n_teachers), kind, fused=True)
    assert abs(loss - want) <= 1e-5 * abs(want), (loss, want)
    for got, want_g in zip(grads, grads64, strict=True):
        assert got.dtype == torch.bfloat16
        assert relative_error(got, want_g) <= 5e-3


@pytest.mark.parametrize("std", [3.0, 12.0])
@pytest.mark.parametrize("n_teachers", [1, 2])
@pytest.mark.parametrize("kind", ["reverse", "forward", "mixed"])
def test_bf16_logits_large_vocab_matches_float64(
    kind: str, n_teachers: int, std: float, nccl_world: dist.ProcessGroup
) -> None:
    c = _big_case(std, n_teachers)
    loss, want, (grad,), (grad64,) = kl_vs_float64(
        c, kind, fused=False, group=nccl_world, chunk_tokens=100
    )
    assert abs(loss - want) <= 1e-5 * abs(want), (loss, want)
    assert grad.dtype == torch.bfloat16
    assert relative_error(grad, grad64) <= 5e-3


def _bf16_case(
    seed: int, T: int, H_s: int, V_pad: int, V_real: int, n_teachers: int
) -> tuple[Any, ...]:
    """(teacher index or None, teacher hidden, teacher weights, student hidden, weight, mask)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    hs = [256, 192][:n_teachers]
    index_T = torch.randint(0, n_teachers, (T,), generator=g, device=DEV)
    hidden = [torch.randn(T, h, generator=g, device=DEV).bfloat16() for h in hs]
    weight = [(torch.randn(V_pad, h, generator=g, device=DEV) / h**0.5 * 3).bfloat16() for h in hs]
    h_TH = torch.randn(T, H_s, generator=g, device=DEV).bfloat16()
    w_VH = (torch.randn(V_pad, H_s, generator=g, device=DEV) / H_s**0.5 * 3).bfloat16()
    mask_T = torch.rand(T, generator=g, device=DEV) > 0.1
    return index_T if n_teachers > 1 else None, hidden, weight, h_TH, w_VH, mask_T


@pytest.mark.parametrize("accumulation", ["auto", "fp32"])
def test_fused_extra_memory_is_bounded(accumulation: str) -> None:
    T, H, V = 4096, 1024, 32768
    _, _, _, h_TH, w_VH, _ = _bf16_case(2, T, H, V, V, 1)
    hidden = [torch.randn(T, H, device=DEV).bfloat16()]
    weight = [(torch.randn(V, H, device=DEV) / 10).bfloat16()]
    h = h_TH.clone().requires_grad_(True)
    w = w_VH.clone().requires_grad_(True)
    budget = 64 * 2**20
    cfg = KLConfig(memory_budget_bytes=budget, weight_grad_accumulation=accumulation)  # type: ignore[arg-type]
    _ = h_TH[:8] @ w_VH[:8].T  # cuBLAS workspace allocated before the baseline
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fused_vocab_parallel_kl(h, w, hidden, weight, vocab_start=0, vocab_size=V, config=cfg)
    out.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    grads = h.numel() * 2 + w.numel() * 2
    hidden_fp32 = h.numel() * 4
    # 4 * V * H = 128 MiB does not fit the 64 MiB budget: "auto" sums in bf16
    weight_fp32 = w.numel() * 4 if accumulation == "fp32" else 0
    # the input gradients, the fp32 sums, one chunk's blocks (within the budget) and small
    # per-token vectors; an fp32 copy of the weight (128 MiB) would not fit
    bound = grads + hidden_fp32 + weight_fp32 + 1.25 * budget + 32 * 2**20
    assert extra <= bound, (extra, bound)


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
def test_cuda_upstream_scale_rounds_once_in_bf16(fused: bool) -> None:
    """The backward's scaling by a CUDA fp32 upstream gradient (1/3, as a loss averaged over 3
    micro-batches gets) rounds once: bit-equal to ``round_bf16(g * (1/3))`` on the device (a plain
    ``bf16.mul_(cuda fp32 0-dim)`` casts the scale to bf16 first)."""
    _, hidden, weight, h_TH, w_VH, mask_T = _bf16_case(3, 300, 128, 1024, 1000, 1)
    cfg = KLConfig(chunk_tokens=64)
    kwargs = dict(vocab_start=0, vocab_size=1000, loss_mask_T=mask_T, config=cfg)

    def grads(upstream: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = h_TH.clone().requires_grad_(True)
        w = w_VH.clone().requires_grad_(True)
        if fused:
            out = fused_vocab_parallel_kl(h, w, hidden, weight, **kwargs)
            return torch.autograd.grad(out, (h, w), upstream)
        logits = (h_TH @ w_VH.T).requires_grad_(True)
        return torch.autograd.grad(
            vocab_parallel_kl(logits, hidden, weight, **kwargs), logits, upstream
        )

    third = torch.tensor(1.0 / 3.0, device=DEV)
    for unit, scaled in zip(grads(torch.tensor(1.0, device=DEV)), grads(third), strict=True):
        assert scaled.dtype == torch.bfloat16 and torch.count_nonzero(unit) > 0
        want = (unit.float() * third).bfloat16()
        assert torch.equal(scaled, want), int((scaled != want).sum())


def test_cuda_recompute_path_raises_on_in_place_change() -> None:
    """reduction='none' on CUDA: logits scaled in place after forward (Megatron's CE does this)
    raise autograd's version-counter error in backward."""
    _, hidden, weight, h_TH, w_VH, mask_T = _bf16_case(4, 200, 128, 512, 500, 1)
    base = (h_TH @ w_VH.T).requires_grad_(True)
    logits = base * 1.0
    out = vocab_parallel_kl(
        logits, hidden, weight, vocab_start=0, vocab_size=500, loss_mask_T=mask_T,
        config=KLConfig(reduction="none"),
    )  # fmt: skip
    with torch.no_grad():
        logits.mul_(3.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_cuda_precomputed_path_frees_the_logits() -> None:
    """sum (default): once the caller drops its [T, V] logits after forward, their memory is
    released (autograd keeps only the gradient)."""
    _, hidden, weight, h_TH, w_VH, _ = _bf16_case(5, 2048, 128, 8192, 8000, 1)
    base = (h_TH @ w_VH.T).requires_grad_(True)
    logits = base * 1.0  # a non-leaf, as Megatron's output_layer returns
    out = vocab_parallel_kl(logits, hidden, weight, vocab_start=0, vocab_size=8000)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    nbytes = logits.numel() * logits.element_size()
    del logits
    torch.cuda.synchronize()
    assert before - torch.cuda.memory_allocated() >= nbytes
    out.backward()
    assert base.grad is not None and torch.isfinite(base.grad.float()).all()
