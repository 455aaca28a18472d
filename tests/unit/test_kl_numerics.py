"""Tier 1: the KL in bf16 is as accurate as its inputs allow, against float64 at V = 151,936.

The inputs are bf16 in the distillation regime (teacher logits of standard deviation up to 12,
student logits within ~0.25 of them); the float64 reference (tests/support/kl_reference.py) is
computed from the same bf16 values. Bounds: relative loss error <= 1e-5 and relative
(Frobenius) gradient error <= 0.5% for reverse, forward and mixed, one and two teachers (one in
the compact row layout, with a mask), both entry points. A plain bf16 computation (teacher logits
rounded to bf16) misses these bounds by orders of magnitude here, which the last test of the
group checks, so the bounds can fail.

Also: the fused path's weight gradient summed over many chunks in fp32 rounds once (the
``"weight"`` mode's per-chunk rounding is measurably worse), ``"auto"`` picks fp32 when it fits
the budget; :func:`mopd.kernels.kl.matmul.matmul_into` is fp32-exact for bf16/fp16 operands on
every blocking branch (hypothesis); the loss opens one profiler range per chunk and per teacher
matmul.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mopd.common import ranges
from mopd.kernels.kl import KLConfig, fused_vocab_parallel_kl, vocab_parallel_kl
from mopd.kernels.kl import matmul as kl_matmul
from mopd.kernels.kl import prepare as kl_prepare
from tests.support.kl_reference import (
    case_reference,
    distillation_case,
    kl_vs_float64,
    reference_kl,
    relative_error,
)

V_BIG = 151936
T, H, NOISE = 96, 64, 0.25
LOSS_RTOL, GRAD_RTOL = 1e-5, 5e-3
KINDS = ("reverse", "forward", "mixed")


@functools.cache
def _case(std: float, n_teachers: int) -> dict[str, Any]:
    return distillation_case(std=std, n_teachers=n_teachers, T=T, H=H, V=V_BIG, noise=NOISE)


@pytest.mark.parametrize("std", [3.0, 12.0])
@pytest.mark.parametrize("n_teachers", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_logits_path_bf16_is_float64_accurate(kind: str, n_teachers: int, std: float) -> None:
    loss, want, (grad,), (grad64,) = kl_vs_float64(_case(std, n_teachers), kind, fused=False)
    assert grad.dtype == torch.bfloat16
    assert abs(loss - want) <= LOSS_RTOL * abs(want), (loss, want)
    assert relative_error(grad, grad64) <= GRAD_RTOL


@pytest.mark.parametrize("std", [3.0, 12.0])
@pytest.mark.parametrize("n_teachers", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_fused_path_bf16_is_float64_accurate(kind: str, n_teachers: int, std: float) -> None:
    loss, want, grads, grads64 = kl_vs_float64(_case(std, n_teachers), kind, fused=True)
    assert abs(loss - want) <= LOSS_RTOL * abs(want), (loss, want)
    for got, want_g in zip(grads, grads64, strict=True):
        assert got.dtype == torch.bfloat16
        assert relative_error(got, want_g) <= GRAD_RTOL


def test_bf16_teacher_logits_would_miss_these_bounds() -> None:
    """The same loss with the teacher logits rounded to bf16 (what a plain bf16 LM head gives)
    is off by far more than the bounds above: they test the fp32 teacher logits."""
    c = _case(12.0, 1)
    s64 = c["logits"].double().requires_grad_(True)
    exact = case_reference(c, "reverse", s64)
    (g_exact,) = torch.autograd.grad(exact, s64)
    u_bf16 = (c["hidden"][0] @ c["weight"][0].T).double()  # bf16 matmul, bf16 output
    s64b = c["logits"].double().requires_grad_(True)
    log_ps = torch.log_softmax(s64b, 1)
    log_pt = torch.log_softmax(u_bf16, 1)
    rounded = (log_ps.exp() * (log_ps - log_pt)).sum()
    (g_rounded,) = torch.autograd.grad(rounded, s64b)
    got, want = float(rounded.detach()), float(exact.detach())
    assert abs(got - want) > 100 * LOSS_RTOL * abs(want), (got, want)
    assert relative_error(g_rounded, g_exact) > 10 * GRAD_RTOL


# ---- the fused weight gradient over many chunks -------------------------------------------------


def _many_chunks(mode: str) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """Fused reverse KL over 32 chunks; ``(grad_h, grad_w, their errors vs float64)``."""
    g = torch.Generator().manual_seed(5)
    T_, H_, V_ = 512, 32, 4096
    h_t = torch.randn(T_, H_, generator=g).bfloat16()
    w_t = (torch.randn(V_, H_, generator=g) * (4 / H_**0.5)).bfloat16()
    h_s = (h_t.float() + 0.05 * torch.randn(T_, H_, generator=g)).bfloat16()
    h = h_s.clone().requires_grad_(True)
    w = w_t.clone().requires_grad_(True)
    cfg = KLConfig(chunk_tokens=16, weight_grad_accumulation=mode)  # type: ignore[arg-type]
    out = fused_vocab_parallel_kl(h, w, h_t, w_t, vocab_start=0, vocab_size=V_, config=cfg)
    gh, gw = torch.autograd.grad(out, (h, w))
    h64, w64 = h_s.double().requires_grad_(True), w_t.double().requires_grad_(True)
    ref = reference_kl(h64 @ w64.T, [h_t], [w_t], vocab_size=V_)
    gh64, gw64 = torch.autograd.grad(ref, (h64, w64))
    return gh, gw, relative_error(gh, gh64), relative_error(gw, gw64)


def test_weight_gradient_summed_in_fp32_rounds_once() -> None:
    _, gw_fp32, err_h, err_fp32 = _many_chunks("fp32")
    _, gw_weight, _, err_weight = _many_chunks("weight")
    _, gw_auto, _, _ = _many_chunks("auto")
    # one rounding of a bf16 value costs ~0.15% (norm-wise); 32 roundings about sqrt(16) x that
    assert err_h <= 3e-3 and err_fp32 <= 3e-3, (err_h, err_fp32)
    assert err_weight > 2 * err_fp32, (err_weight, err_fp32)
    assert torch.equal(gw_auto, gw_fp32)  # 4 * V * H bytes fit the default budget: fp32
    assert gw_fp32.dtype == gw_weight.dtype == torch.bfloat16


def _job(config: KLConfig, n_tokens: int, v: int, h: int) -> kl_prepare.KLJob:
    x = torch.zeros(n_tokens, h, dtype=torch.bfloat16)
    w = torch.zeros(v, h, dtype=torch.bfloat16)
    return kl_prepare.prepare(
        kl_prepare.KLArgs(
            student_TX=x, student_weight_VH=w, teacher_hidden=x, teacher_weight=w,
            vocab_start=0, vocab_size=v, loss_mask_T=None, teacher_index_T=None, group=None,
            config=config,
        )
    )  # fmt: skip


def test_auto_weight_gradient_dtype() -> None:
    # several chunks, 4 * V * H = 32 KiB fits: fp32; one chunk: the weight's dtype (one rounding)
    assert _job(KLConfig(chunk_tokens=4), 16, 64, 128).weight_grad_dtype == torch.float32
    assert _job(KLConfig(chunk_tokens=16), 16, 64, 128).weight_grad_dtype == torch.bfloat16
    # the fp32 buffer does not fit the budget: the weight's dtype, unless asked for
    tight = KLConfig(memory_budget_bytes=16 * 2**10)
    assert _job(tight, 64, 64, 128).chunk < 64
    assert _job(tight, 64, 64, 128).weight_grad_dtype == torch.bfloat16
    forced = KLConfig(memory_budget_bytes=16 * 2**10, weight_grad_accumulation="fp32")
    assert _job(forced, 64, 64, 128).weight_grad_dtype == torch.float32
    job = _job(KLConfig(), 8, 64, 16)
    assert (job.student_logit_dtype, job.teacher_logit_dtype) == (torch.float32, torch.float32)


# ---- fp32 matmuls of bf16 operands -------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 24),
    k=st.integers(1, 24),
    n=st.integers(1, 24),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    accumulate=st.booleans(),
    block_bytes=st.sampled_from([4, 64, 2**20]),
    seed=st.integers(0, 2**16),
)
def test_matmul_into_is_fp32_exact(
    m: int, k: int, n: int, dtype: torch.dtype, accumulate: bool, block_bytes: int, seed: int
) -> None:
    """fp32 result of bf16/fp16 operands within fp32 accumulation error of float64, on every
    blocking branch (tiny blocks make every loop turn); the operands are never rounded."""
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=g) * 8).to(dtype)
    b = (torch.randn(n, k, generator=g) * 8).to(dtype).T  # a transposed view, as w_VH.T
    out = torch.randn(m, n, generator=g)
    start = out.clone()
    old = kl_matmul.BLOCK_BYTES
    kl_matmul.BLOCK_BYTES = block_bytes
    try:
        kl_matmul.matmul_into(a, b, out, accumulate=accumulate)
    finally:
        kl_matmul.BLOCK_BYTES = old
    want = a.double() @ b.double() + (start.double() if accumulate else 0.0)
    bound = (k + 2) * 2**-24 * (a.double().abs() @ b.double().abs() + start.double().abs())
    assert bool(((out.double() - want).abs() <= bound + 1e-30).all())


def test_matmul_into_rejects_what_it_cannot_do() -> None:
    a = torch.zeros(2, 3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="operand dtypes differ"):
        kl_matmul.matmul_into(a, torch.zeros(3, 2), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="narrower"):
        kl_matmul.matmul_into(a.float(), a.float().T, torch.zeros(2, 2, dtype=torch.bfloat16))
    assert kl_matmul.logit_dtype(torch.bfloat16) == torch.float32
    assert kl_matmul.logit_dtype(torch.bfloat16, torch.float64) == torch.float64


def test_out_dtype_probe_learns_once_and_never_hides_oom(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The CUDA ``out_dtype`` form is tried once per op: a refusal is remembered and logged once
    (later calls skip it), a success is remembered (later errors propagate), OOM propagates."""
    from mopd.common.log import reset_once as reset_log_once

    monkeypatch.setattr(kl_matmul, "_out_dtype_ok", {})
    reset_log_once()
    calls: list[str] = []

    def refuse() -> None:
        calls.append("refuse")
        raise RuntimeError("out_dtype must be the same as input dtype")

    with caplog.at_level("WARNING"):
        assert kl_matmul._try_out_dtype("mm", refuse) is False
        assert kl_matmul._try_out_dtype("mm", refuse) is False
    assert calls == ["refuse"]
    assert len([r for r in caplog.records if "torch.mm(" in r.getMessage()]) == 1
    assert kl_matmul._try_out_dtype("addmm", lambda: calls.append("ok")) is True
    with pytest.raises(RuntimeError, match="later"):
        kl_matmul._try_out_dtype("addmm", lambda: (_ for _ in ()).throw(RuntimeError("later")))
    monkeypatch.setattr(kl_matmul, "_out_dtype_ok", {})

    def oom() -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.cuda.OutOfMemoryError):
        kl_matmul._try_out_dtype("mm", oom)
    assert "mm" not in kl_matmul._out_dtype_ok  # not learned from an OOM


def test_row_block_accumulation_leaves_out_untouched_when_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where ``torch.mm(..., out_dtype=)`` is refused (as on the CPU), the CUDA accumulation by
    row blocks gives up before adding anything, so the caller's fallback starts from ``out``."""
    monkeypatch.setattr(kl_matmul, "_out_dtype_ok", {})
    a = torch.ones(5, 3, dtype=torch.bfloat16)
    out = torch.full((5, 4), 7.0)
    b = torch.ones(3, 4, dtype=torch.bfloat16)
    assert kl_matmul._accumulate_by_row_blocks(a, b, out) is False
    assert torch.equal(out, torch.full((5, 4), 7.0))


# ---- profiler ranges ----------------------------------------------------------------------------


@pytest.fixture
def recorded_ranges(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, str | None]]]:
    calls: list[tuple[str, str | None]] = []
    monkeypatch.setattr(
        ranges,
        "_backend",
        (
            "recorder",
            lambda name: calls.append(("push", name)),
            lambda: calls.append(("pop", None)),
        ),
    )
    was = ranges.enable(True)
    try:
        yield calls
    finally:
        ranges.enable(was)


def test_one_range_per_chunk_and_teacher_matmul(
    recorded_ranges: list[tuple[str, str | None]],
) -> None:
    g = torch.Generator().manual_seed(3)
    s = torch.randn(10, 12, generator=g)
    hidden = [torch.randn(10, 4, generator=g), torch.randn(10, 3, generator=g)]
    weight = [torch.randn(12, 4, generator=g), torch.randn(12, 3, generator=g)]
    index_T = torch.tensor([0] * 6 + [1] * 4)
    vocab_parallel_kl(
        s, hidden, weight, vocab_start=0, vocab_size=12, teacher_index_T=index_T,
        config=KLConfig(chunk_tokens=4),
    )  # fmt: skip
    pushed = [name for op, name in recorded_ranges if op == "push"]
    # chunks [0, 4) teacher 0; [4, 8) teachers 0 and 1; [8, 10) teacher 1
    assert pushed == [
        "mopd/loss_chunk:0", "mopd/projection:0",
        "mopd/loss_chunk:1", "mopd/projection:0", "mopd/projection:1",
        "mopd/loss_chunk:2", "mopd/projection:1",
    ]  # fmt: skip
    assert sum(op == "pop" for op, _ in recorded_ranges) == len(pushed)
