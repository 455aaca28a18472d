"""Tier 3 (CUDA): the KL in bf16 on a GPU, and its CuPy row kernels against their torch twins.

- The CuPy kernels (``kl_row_stats_*``, ``kl_row_grad_*``) against the torch twins on the same
  inputs: aligned and unaligned rows (vector and scalar paths), strided row views, column counts
  that are not a multiple of the vector width, rows split over several column blocks, empty
  column ranges; outputs poisoned with NaN first. Row maxima exact; partition sums rtol 1e-5 (the
  two sum in a different order); the cross sums as expectations within 1e-5 of the logit spread;
  gradients rtol 2**-7 in bf16 (1 ulp), 1e-5 in fp32, atol 1e-5 of the largest value.
- The loss (both entry points, three kinds) in bf16 against the float64 reference evaluated at
  the same bf16-rounded logits (the loss rounds its matmul outputs to bf16 once, as Megatron's
  bf16 LM head does): relative error of the loss <= 1e-4 and of each gradient (Frobenius norm)
  <= 1e-2 (gradients are stored in bf16; ~3e-3 seen with the torch twin on CPU).
- ``auto`` picks CuPy on CUDA; the NCCL world of one rank works as a group.
- Extra memory of the fused path stays within gradients + the chunk budget (+25%).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from mopd.kernels.backend import cupy_available
from mopd.kernels.kl import KLConfig, fused_vocab_parallel_kl, vocab_parallel_kl
from mopd.kernels.kl_rowwise import resolve_backend, row_grad, row_stats
from tests.support.kl_reference import reference_kl

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
    C: int, n: int, dtype: torch.dtype, *, ld: int | None = None, offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Student and teacher ``[C, n]`` views with row stride ``ld`` starting ``offset`` elements
    into their buffers (an odd offset makes every row start unaligned: the scalar path)."""
    g = torch.Generator(device=DEV).manual_seed(C * 1000 + n)
    ld = n if ld is None else ld
    out = []
    for _ in range(2):
        flat = (torch.randn(C * ld + offset, generator=g, device=DEV) * 4).to(dtype)
        out.append(flat.as_strided((C, n), (ld, 1), storage_offset=offset))
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


@needs_cupy
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_cupy_row_kernels_match_twins(
    dtype: torch.dtype, shape: tuple[int, int, int | None, int]
) -> None:
    C, n, ld, offset = shape
    s, u = _pair(C, n, dtype, ld=ld, offset=offset)
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
        out_c = torch.full((C, n), float("nan"), dtype=dtype, device=DEV)
        out_t = torch.full((C, n), float("nan"), dtype=dtype, device=DEV)
        row_grad(s, u, coef, out_c, teacher_term=teacher_term, backend="cupy")
        row_grad(s, u, coef, out_t, teacher_term=teacher_term, backend="torch")
        assert not torch.isnan(out_c).any()
        # same fp32 math in another order; bf16 output: at most 1 ulp apart
        tol = 2**-7 if dtype == torch.bfloat16 else 1e-5
        scale = float(out_t.float().abs().amax()) if n else 1.0
        torch.testing.assert_close(out_c, out_t, rtol=tol, atol=1e-5 * scale)


@needs_cupy
def test_auto_picks_cupy_on_cuda() -> None:
    t = torch.zeros(2, 8, device=DEV, dtype=torch.bfloat16)
    assert resolve_backend("auto", t, t) == "cupy"
    assert resolve_backend("auto", t, t.half()) == "torch"  # mixed dtypes: twin (logged once)
    with pytest.raises(ValueError, match="cannot run"):
        resolve_backend("cupy", t.half(), t.half())


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


def _teacher_logits_bf16(
    hidden: list[torch.Tensor],
    weight: list[torch.Tensor],
    index_T: torch.Tensor | None,
    T: int,
    V_pad: int,
) -> torch.Tensor:
    """``[T, V_pad]`` teacher logits as the loss forms them: bf16 matmuls per teacher."""
    u_TV = torch.empty((T, V_pad), dtype=torch.bfloat16, device=DEV)
    for k, (h, w) in enumerate(zip(hidden, weight, strict=True)):
        rows = torch.arange(T, device=DEV) if index_T is None else torch.nonzero(index_T == k)[:, 0]
        u_TV[rows] = h[rows] @ w.T
    return u_TV


@pytest.mark.parametrize("kind", ["reverse", "forward", "mixed"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_bf16_fused_matches_float64_reference(kind: str, backend: str) -> None:
    T, V_pad, V_real = 700, 4096, 4000
    index_T, hidden, weight, h_TH, w_VH, mask_T = _bf16_case(0, T, 320, V_pad, V_real, 2)
    h = h_TH.clone().requires_grad_(True)
    w = w_VH.clone().requires_grad_(True)
    cfg = KLConfig(kind=kind, reduction="mean", chunk_tokens=256, backend=backend)  # type: ignore[arg-type]
    out = fused_vocab_parallel_kl(
        h, w, hidden, weight, vocab_start=0, vocab_size=V_real, loss_mask_T=mask_T,
        teacher_index_T=index_T, config=cfg,
    )  # fmt: skip
    out.backward()
    # float64 reference on the bf16-rounded logits (the loss rounds them once, as a bf16 LM head
    # does): teacher logits enter as "hidden states" through an identity LM head
    s64 = (h_TH @ w_VH.T).double().requires_grad_(True)
    u_TV = _teacher_logits_bf16(hidden, weight, index_T, T, V_pad)
    eye = torch.eye(V_pad, dtype=torch.float64, device=DEV)
    ref = reference_kl(
        s64, [u_TV], [eye], vocab_size=V_real, kind=kind, loss_mask_T=mask_T, reduction="mean"
    )
    (g_s64,) = torch.autograd.grad(ref, s64)
    assert _rel(out.detach(), ref.detach()) <= 1e-4
    assert h.grad is not None and w.grad is not None
    assert _rel(h.grad, g_s64 @ w_VH.double()) <= 1e-2
    assert _rel(w.grad, g_s64.T @ h_TH.double()) <= 1e-2
    assert torch.count_nonzero(w.grad[V_real:]) == 0


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_bf16_logits_path_matches_float64_reference(
    reduction: str, nccl_world: dist.ProcessGroup
) -> None:
    _, hidden, weight, h_TH, w_VH, mask_T = _bf16_case(1, 513, 256, 4096, 4000, 1)
    logits = (h_TH @ w_VH.T).requires_grad_(True)  # bf16 [T, V_pad], as Megatron returns
    out = vocab_parallel_kl(
        logits, hidden, weight, vocab_start=0, vocab_size=4000, loss_mask_T=mask_T,
        group=nccl_world, config=KLConfig(reduction=reduction, chunk_tokens=100),
    )  # fmt: skip
    up = torch.ones_like(out)
    (grad,) = torch.autograd.grad(out, logits, up)
    l64 = logits.detach().double().requires_grad_(True)
    # float64 reference at the loss's bf16 teacher logits (through an identity LM head)
    u_TV = _teacher_logits_bf16(hidden, weight, None, logits.shape[0], 4096)
    eye = torch.eye(4096, dtype=torch.float64, device=DEV)
    ref = reference_kl(l64, [u_TV], [eye], vocab_size=4000, loss_mask_T=mask_T, reduction=reduction)
    (grad64,) = torch.autograd.grad(ref, l64, up.double())
    assert _rel(out.detach(), ref.detach()) <= 1e-4
    assert grad.dtype == torch.bfloat16
    assert _rel(grad, grad64) <= 1e-2


def test_fused_extra_memory_is_bounded() -> None:
    T, H, V = 4096, 1024, 32768
    _, hidden, weight, h_TH, w_VH, _ = _bf16_case(2, T, H, V, V, 1)
    hidden = [torch.randn(T, H, device=DEV).bfloat16()]
    weight = [(torch.randn(V, H, device=DEV) / 10).bfloat16()]
    h = h_TH.clone().requires_grad_(True)
    w = w_VH.clone().requires_grad_(True)
    budget = 64 * 2**20
    cfg = KLConfig(memory_budget_bytes=budget)
    _ = h_TH[:8] @ w_VH[:8].T  # cuBLAS workspace allocated before the baseline
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fused_vocab_parallel_kl(h, w, hidden, weight, vocab_start=0, vocab_size=V, config=cfg)
    out.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    grads = h.numel() * 2 + w.numel() * 2
    # the input gradients, one chunk's blocks (within the budget) and small per-token vectors
    assert extra <= grads + 1.25 * budget + 32 * 2**20, (extra, grads, budget)


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
