"""Tier 1: the vocab-parallel KL (no TP) against a float64 reference that materializes everything.

Covers values and gradients for both entry points (logits; fused hidden + weight), all three KL
kinds and reductions, random shapes, padded vocab, bool and float masks, several teachers of
different hidden sizes in token or compact layouts, chunk-size invariance, the row-wise torch
twins, the configuration and the ValueErrors (raised before any collective). Autograd hygiene:
the recompute path (``reduction="none"``) raises autograd's version-counter error when an input
or a teacher tensor is changed in place between forward and backward, and matches the
precomputed path; the precomputed path keeps neither the student input nor the teacher's hidden
states alive (weakrefs); a bf16 gradient scaled by an fp32 upstream 1/3 is rounded once (bit
for bit); the fused-only settings (``sum_hidden_grad_over_tp=False``,
``weight_grad_accumulation``) on the logits path warn once. bf16 accuracy at a large vocabulary
is tests/unit/test_kl_numerics.py's.

Tolerances: the loss keeps its statistics in fp32, so with float64 inputs values and gradients
match the float64 reference to ~1e-6 relative; we assert rtol=1e-4, atol=1e-5 (scaled by the
reference's magnitude where stated).
"""

from __future__ import annotations

import itertools
import logging
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

from mopd.kernels.kl import (
    KLConfig,
    choose_chunk_tokens,
    fused_vocab_parallel_kl,
    vocab_parallel_kl,
)
from mopd.kernels.kl import loop as kl_loop
from mopd.kernels.kl import prepare as kl_prepare
from mopd.kernels.kl.rowwise import (
    combine_partials,
    resolve_backend,
    row_grad,
    row_grad_torch,
    row_stats,
    row_stats_torch,
)
from tests.support.kl_reference import reference_kl

KINDS = ("reverse", "forward", "mixed")
REDUCTIONS = ("sum", "mean", "none")


def _close(a: torch.Tensor, b: torch.Tensor, *, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol)


def _case(
    seed: int, *, n_teachers: int, compact: bool, dtype: torch.dtype = torch.float64
) -> tuple[Any, ...]:
    """Random inputs: T tokens, V_pad padded vocab with V_real real ids, teachers of sizes H_k."""
    g = torch.Generator().manual_seed(seed)
    T = int(torch.randint(1, 60, (1,), generator=g))
    V_pad = int(torch.randint(2, 90, (1,), generator=g))
    V_real = int(torch.randint(1, V_pad + 1, (1,), generator=g))
    hs = [int(torch.randint(1, 12, (1,), generator=g)) for _ in range(n_teachers)]
    index_T = torch.randint(0, n_teachers, (T,), generator=g)
    hidden, weight = [], []
    for k, H in enumerate(hs):
        rows = int((index_T == k).sum()) if compact else T
        hidden.append(torch.randn(rows, H, generator=g, dtype=dtype) * 2)
        weight.append(torch.randn(V_pad, H, generator=g, dtype=dtype))
    mask_T = torch.rand(T, generator=g) > 0.25
    student_T_V = torch.randn(T, V_pad, generator=g, dtype=dtype) * 3
    return T, V_pad, V_real, hidden, weight, index_T, mask_T, student_T_V, g


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("seed", range(4))
def test_logits_path_matches_reference(kind: str, reduction: str, seed: int) -> None:
    n_teachers = 1 + seed % 3
    T, _V_pad, V_real, hidden, weight, index_T, mask_T, s_TV, g = _case(
        seed, n_teachers=n_teachers, compact=seed % 2 == 1
    )
    mask_T = (
        mask_T.double() * torch.rand(T, generator=g, dtype=torch.float64) if seed == 3 else mask_T
    )
    s_TV.requires_grad_(True)
    cfg = KLConfig(
        kind=kind,
        reduction=reduction,
        chunk_tokens=1 + seed * 5,
        mix_weight=0.3 if kind == "mixed" else None,
    )
    index = index_T if n_teachers > 1 else None
    out = vocab_parallel_kl(
        s_TV, hidden, weight, vocab_start=0, vocab_size=V_real, loss_mask_T=mask_T,
        teacher_index_T=index, config=cfg,
    )  # fmt: skip
    ref = reference_kl(
        s_TV, hidden, weight, vocab_size=V_real, kind=kind, mix_weight=0.3, loss_mask_T=mask_T,
        teacher_index_T=index, reduction=reduction,
    )  # fmt: skip
    assert out.dtype == torch.float32
    assert out.shape == ref.shape
    _close(out, ref, atol=1e-5 * max(1.0, float(ref.detach().abs().max())))
    up = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    (got,) = torch.autograd.grad(out, s_TV, up.float())
    (want,) = torch.autograd.grad(ref, s_TV, up)
    assert got.dtype == s_TV.dtype
    _close(got, want, atol=1e-6 * max(1.0, float(up.abs().max())))
    assert torch.count_nonzero(got[:, V_real:]) == 0  # padded vocab gets no gradient


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("seed", range(3))
def test_fused_path_matches_reference(kind: str, reduction: str, seed: int) -> None:
    n_teachers = 1 + (seed + 1) % 3
    T, V_pad, V_real, hidden, weight, index_T, mask_T, _, g = _case(
        100 + seed, n_teachers=n_teachers, compact=seed == 2
    )
    H_s = int(torch.randint(1, 10, (1,), generator=g))
    h_TH = torch.randn(T, H_s, generator=g, dtype=torch.float64, requires_grad=True)
    w_VH = torch.randn(V_pad, H_s, generator=g, dtype=torch.float64, requires_grad=True)
    cfg = KLConfig(kind=kind, reduction=reduction, chunk_tokens=3 + 4 * seed)
    index = index_T if n_teachers > 1 else None
    out = fused_vocab_parallel_kl(
        h_TH, w_VH, hidden, weight, vocab_start=0, vocab_size=V_real, loss_mask_T=mask_T,
        teacher_index_T=index, config=cfg,
    )  # fmt: skip
    ref = reference_kl(
        h_TH @ w_VH.T, hidden, weight, vocab_size=V_real, kind=kind, loss_mask_T=mask_T,
        teacher_index_T=index, reduction=reduction,
    )  # fmt: skip
    _close(out, ref, atol=1e-5 * max(1.0, float(ref.detach().abs().max())))
    up = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, (h_TH, w_VH), up.float())
    want = torch.autograd.grad(ref, (h_TH, w_VH), up)
    scale = max(1.0, float(up.abs().max()))
    for a, b in zip(got, want, strict=True):
        _close(a, b, atol=1e-5 * scale * max(1.0, float(b.abs().max())))
    assert torch.count_nonzero(got[1][V_real:]) == 0


def test_float32_inputs_and_teacher_gets_no_grad() -> None:
    _T, _V_pad, V_real, hidden, weight, index_T, mask_T, s_TV, _ = _case(
        7, n_teachers=2, compact=False, dtype=torch.float32
    )
    for t in (*hidden, *weight):
        t.requires_grad_(True)
    s_TV.requires_grad_(True)
    out = vocab_parallel_kl(
        s_TV, hidden, weight, vocab_start=0, vocab_size=V_real, loss_mask_T=mask_T,
        teacher_index_T=index_T,
    )  # fmt: skip
    ref = reference_kl(
        s_TV, hidden, weight, vocab_size=V_real, loss_mask_T=mask_T, teacher_index_T=index_T
    )
    _close(out, ref, rtol=1e-4, atol=1e-4)
    out.backward()
    assert s_TV.grad is not None and torch.isfinite(s_TV.grad).all()
    assert all(t.grad is None for t in (*hidden, *weight))


@pytest.mark.parametrize("fused", [False, True])
def test_chunk_size_does_not_change_result(fused: bool) -> None:
    T, V_pad, V_real, hidden, weight, index_T, mask_T, s_TV, g = _case(
        11, n_teachers=3, compact=True, dtype=torch.float32
    )
    h_TH = torch.randn(T, 5, generator=g)
    w_VH = torch.randn(V_pad, 5, generator=g)
    results = []
    for chunk in (1, 2, 7, T, 10_000):
        cfg = KLConfig(kind="mixed", mix_weight=0.7, chunk_tokens=min(chunk, 32768))
        xs = (h_TH.clone().requires_grad_(), w_VH.clone().requires_grad_()) if fused else (
            s_TV.clone().requires_grad_(),
        )  # fmt: skip
        kwargs = dict(vocab_start=0, vocab_size=V_real, loss_mask_T=mask_T, teacher_index_T=index_T)
        if fused:
            out = fused_vocab_parallel_kl(*xs, hidden, weight, config=cfg, **kwargs)
        else:
            out = vocab_parallel_kl(*xs, hidden, weight, config=cfg, **kwargs)
        grads = torch.autograd.grad(out, xs)
        results.append((out, grads))
    out0, grads0 = results[0]
    for out, grads in results[1:]:
        _close(out, out0, rtol=1e-5, atol=1e-5)
        for a, b in zip(grads, grads0, strict=True):
            _close(a, b, rtol=1e-5, atol=1e-6)


def test_token_layout_and_compact_teacher_rows_agree() -> None:
    _T, _V_pad, V_real, hidden, weight, index_T, mask_T, s_TV, _ = _case(
        21, n_teachers=3, compact=False
    )
    compact = [h[index_T == k] for k, h in enumerate(hidden)]
    kwargs = dict(vocab_start=0, vocab_size=V_real, loss_mask_T=mask_T, teacher_index_T=index_T)
    a = vocab_parallel_kl(s_TV, hidden, weight, config=KLConfig(reduction="none"), **kwargs)
    b = vocab_parallel_kl(s_TV, compact, weight, config=KLConfig(reduction="none"), **kwargs)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("n_teachers", [1, 2, 3])
@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
def test_compact_rows_of_the_counted_tokens_match_the_float64_reference(
    n_teachers: int, fused: bool
) -> None:
    """Teacher rows of only the counted tokens (``mask != 0`` and ``teacher_index == k``, in
    token order: what the bridge delivers) give the token layout's KL and gradient, against a
    float64 reference; the row counts tell the forms apart."""
    T, V_pad, V_real, hidden, weight, index_T, mask_T, s_TV, g = _case(
        51 + n_teachers, n_teachers=n_teachers, compact=False
    )
    mask_T[0] = False  # at least one uncounted token (its teacher's row is not sent)
    index_T[0] = 0
    index = index_T if n_teachers > 1 else None
    own_T = index_T if n_teachers > 1 else torch.zeros_like(index_T)
    counted = [h[(own_T == k) & mask_T] for k, h in enumerate(hidden)]
    assert counted[0].shape[0] < int((own_T == 0).sum())  # a third form, not the "all" one
    cfg = KLConfig(reduction="none", chunk_tokens=7)
    kw = dict(vocab_start=0, vocab_size=V_real, loss_mask_T=mask_T, teacher_index_T=index)
    if fused:
        H_s = 5
        x = torch.randn(T, H_s, generator=g, dtype=torch.float64, requires_grad=True)
        w_s = torch.randn(V_pad, H_s, generator=g, dtype=torch.float64)
        a = fused_vocab_parallel_kl(x, w_s, hidden, weight, config=cfg, **kw)
        b = fused_vocab_parallel_kl(x, w_s, counted, weight, config=cfg, **kw)
        logits = x @ w_s.T
    else:
        x = s_TV.requires_grad_(True)
        a = vocab_parallel_kl(x, hidden, weight, config=cfg, **kw)
        b = vocab_parallel_kl(x, counted, weight, config=cfg, **kw)
        logits = x
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    job = kl_prepare.prepare(kl_prepare.KLArgs(
        student_TX=s_TV, student_weight_VH=None, teacher_hidden=counted, teacher_weight=weight,
        vocab_start=0, vocab_size=V_real, loss_mask_T=mask_T, teacher_index_T=index, group=None,
        config=cfg,
    ))  # fmt: skip
    # the counted rows are already in the order the KL reads them: no gather of teacher rows
    assert all(t.rows_M is None for t in job.teachers)
    ref = reference_kl(
        logits, counted, weight, vocab_size=V_real, loss_mask_T=mask_T, teacher_index_T=index,
        reduction="none",
    )  # fmt: skip
    _close(b, ref)
    up = torch.randn(T, generator=g, dtype=torch.float64)
    (got,) = torch.autograd.grad(b, x, up.float())
    (want,) = torch.autograd.grad(ref, x, up)
    _close(got, want, atol=1e-6 * max(1.0, float(up.abs().max())))


def test_teacher_rows_of_no_known_count_name_all_three_forms() -> None:
    T, _V_pad, V_real, hidden, weight, index_T, mask_T, s_TV, _ = _case(
        57, n_teachers=2, compact=False
    )
    bad = [hidden[0][:1].repeat(T + 1, 1), hidden[1]]
    with pytest.raises(ValueError, match=r"expected T=.*teacher_index == 0.*loss mask counts"):
        vocab_parallel_kl(
            s_TV, bad, weight, vocab_start=0, vocab_size=V_real, loss_mask_T=mask_T,
            teacher_index_T=index_T,
        )  # fmt: skip


def test_unmasked_sorted_tokens_take_the_gather_free_path() -> None:
    """All tokens active and grouped by teacher: no processing order is built (slices only)."""
    _T, _V_pad, V_real, hidden, weight, index_T, _, s_TV, _ = _case(31, n_teachers=2, compact=True)
    index_T = torch.sort(index_T).values
    hidden = [
        torch.randn(int((index_T == k).sum()), h.shape[1], dtype=h.dtype)
        for k, h in enumerate(hidden)
    ]
    job = kl_prepare.prepare(kl_prepare.KLArgs(
        student_TX=s_TV, student_weight_VH=None, teacher_hidden=hidden, teacher_weight=weight,
        vocab_start=0, vocab_size=V_real, loss_mask_T=None, teacher_index_T=index_T, group=None,
        config=KLConfig(),
    ))  # fmt: skip
    assert job.order_N is None and all(t.rows_M is None for t in job.teachers)
    s_TV.requires_grad_(True)
    out = vocab_parallel_kl(
        s_TV, hidden, weight, vocab_start=0, vocab_size=V_real, teacher_index_T=index_T,
        config=KLConfig(chunk_tokens=4),
    )  # fmt: skip
    ref = reference_kl(s_TV, hidden, weight, vocab_size=V_real, teacher_index_T=index_T)
    _close(out, ref)
    _close(torch.autograd.grad(out, s_TV)[0], torch.autograd.grad(ref, s_TV)[0])


def test_all_masked_gives_zero_loss_and_gradient() -> None:
    T, _V_pad, V_real, hidden, weight, _, _, s_TV, _ = _case(41, n_teachers=1, compact=False)
    s_TV.requires_grad_(True)
    for reduction in REDUCTIONS:
        out = vocab_parallel_kl(
            s_TV, hidden, weight, vocab_start=0, vocab_size=V_real,
            loss_mask_T=torch.zeros(T, dtype=torch.bool), config=KLConfig(reduction=reduction),
        )  # fmt: skip
        assert torch.count_nonzero(out) == 0
        (grad,) = torch.autograd.grad(out.sum(), s_TV)
        assert torch.count_nonzero(grad) == 0


def test_no_gradient_work_without_autograd(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under no_grad (or with inputs that need no grad) the row-gradient pass never runs."""
    _T, _V_pad, V_real, hidden, weight, _, mask_T, s_TV, _ = _case(43, n_teachers=1, compact=False)
    calls: list[int] = []
    real = kl_loop.row_grad
    monkeypatch.setattr(kl_loop, "row_grad", lambda *a, **k: calls.append(1) or real(*a, **k))
    kwargs = dict(vocab_start=0, vocab_size=V_real, loss_mask_T=mask_T)
    with_grad = s_TV.clone().requires_grad_(True)
    with torch.no_grad():
        a = vocab_parallel_kl(with_grad, hidden, weight, **kwargs)
    b = vocab_parallel_kl(s_TV, hidden, weight, **kwargs)
    assert calls == [] and not a.requires_grad and not b.requires_grad
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    vocab_parallel_kl(with_grad, hidden, weight, **kwargs).backward()
    assert calls and with_grad.grad is not None


def test_kl_is_zero_when_student_equals_teacher() -> None:
    g = torch.Generator().manual_seed(5)
    h_TH = torch.randn(9, 4, generator=g, dtype=torch.float64)
    w_VH = torch.randn(13, 4, generator=g, dtype=torch.float64)
    for kind in KINDS:
        out = fused_vocab_parallel_kl(
            h_TH, w_VH, h_TH, w_VH, vocab_start=0, vocab_size=13,
            config=KLConfig(kind=kind, reduction="none"),
        )  # fmt: skip
        assert float(out.abs().max()) < 1e-5


def test_vocab_sharded_statistics_combine_like_one_rank() -> None:
    """The rescale-and-sum used across TP ranks equals the statistics of the whole row."""
    g = torch.Generator().manual_seed(3)
    s_CV = torch.randn(6, 40, generator=g) * 4
    u_CV = torch.randn(6, 40, generator=g) * 4
    whole = row_stats_torch(s_CV, u_CV, need_forward=True)
    cuts = [0, 7, 7, 25, 40]  # includes an empty block (a rank holding only padding)
    parts = [
        row_stats_torch(s_CV[:, a:b], u_CV[:, a:b], need_forward=True)
        for a, b in itertools.pairwise(cuts)
    ]
    merged = combine_partials(torch.stack(parts, dim=-1))
    torch.testing.assert_close(merged, whole, rtol=1e-5, atol=1e-5)


def test_row_twins_against_float64() -> None:
    g = torch.Generator().manual_seed(4)
    s64 = torch.randn(5, 33, generator=g, dtype=torch.float64) * 3
    u64 = torch.randn(5, 33, generator=g, dtype=torch.float64) * 3
    st = row_stats_torch(s64.float(), u64.float(), need_forward=True).double()
    m_s, m_t = s64.amax(1), u64.amax(1)
    e_s, e_t = (s64 - m_s[:, None]).exp(), (u64 - m_t[:, None]).exp()
    want = torch.stack(
        [m_s, m_t, e_s.sum(1), e_t.sum(1), (e_s * (s64 - u64)).sum(1), (e_t * (s64 - u64)).sum(1)]
    )
    torch.testing.assert_close(st, want, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(row_stats_torch(s64, u64, need_forward=False)[5]) == 0
    coef = torch.randn(5, 5, generator=g, dtype=torch.float64)
    coef[0], coef[1] = m_s, m_t
    out = torch.full((5, 33), float("nan"))  # poisoned: every element must be written
    row_grad_torch(s64.float(), u64.float(), coef.float(), out, teacher_term=True)
    c = coef[:, :, None]
    ref = (s64 - c[0]).exp() * (c[2] * (s64 - u64) + c[3]) + c[4] * (u64 - c[1]).exp()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    out.fill_(float("nan"))
    row_grad(s64.float(), u64.float(), coef.float(), out, teacher_term=False, backend="auto")
    torch.testing.assert_close(out.double(), ref - c[4] * (u64 - c[1]).exp(), rtol=1e-5, atol=1e-5)
    stats = row_stats(s64.float(), u64.float(), need_forward=True, backend="torch")
    torch.testing.assert_close(stats, st.float())


def test_backend_rules_on_cpu(caplog: pytest.LogCaptureFixture) -> None:
    t = torch.zeros(2, 3)
    with caplog.at_level(logging.WARNING):
        assert resolve_backend("auto", t) == "torch"
    assert not caplog.records  # CPU tensors: the twin is the natural choice, not a fallback
    assert resolve_backend("torch", t) == "torch"
    with pytest.raises(ValueError, match="backend='cupy' needs CUDA tensors"):
        resolve_backend("cupy", t)
    with pytest.raises(ValueError, match="backend must be"):
        resolve_backend("triton", t)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend='cupy'"):
        vocab_parallel_kl(t, torch.zeros(2, 2), torch.zeros(3, 2), vocab_start=0, vocab_size=3,
                          config=KLConfig(backend="cupy"))  # fmt: skip


def test_chunk_size_from_budget() -> None:
    """The budget covers one chunk's blocks: fp32 logits of bf16 inputs (student and teacher on
    the fused path, 4 + 4 bytes, plus the 2-byte bf16 gradient; teacher 4 + gathered student 2 +
    gradient 2 on the logits path), and the next multiple of 64 tokens would not fit."""
    budget = 512 * 2**20
    cfg = KLConfig(memory_budget_bytes=budget)
    V = 151936
    for fused, per_elem in ((True, 10), (False, 8)):
        c = choose_chunk_tokens(cfg, v_local=V, element_size=2, backend="cupy", fused=fused)
        assert c % 64 == 0 and c * V * per_elem <= budget < (c + 64) * V * per_elem, (fused, c)
    # fp32 inputs: fp32 logits, the fused gradient overwrites the student logits (8 bytes)
    c32 = choose_chunk_tokens(cfg, v_local=V, element_size=4, backend="cupy")
    assert c32 * V * 8 <= budget < (c32 + 64) * V * 8
    # float64 inputs keep float64 logits
    c64 = choose_chunk_tokens(cfg, v_local=V, element_size=8, backend="cupy", fused=False)
    assert c64 * V * 24 <= budget < (c64 + 64) * V * 24
    c_torch = choose_chunk_tokens(cfg, v_local=V, element_size=2, backend="torch")
    assert c_torch < choose_chunk_tokens(cfg, v_local=V, element_size=2, backend="cupy")
    assert choose_chunk_tokens(KLConfig(memory_budget_bytes=1), v_local=10, element_size=4,
                               backend="torch") == 1  # fmt: skip
    assert choose_chunk_tokens(KLConfig(chunk_tokens=17), v_local=10, element_size=4,
                               backend="torch") == 17  # fmt: skip


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="kind must be"):
        KLConfig(kind="js")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reduction must be"):
        KLConfig(reduction="max")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mix_weight must be in"):
        KLConfig(kind="mixed", mix_weight=1.5)
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        KLConfig(memory_budget_bytes=0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        KLConfig(chunk_tokens=0)
    with pytest.raises(ValueError, match="weight_grad_accumulation must be"):
        KLConfig(weight_grad_accumulation="fp64")  # type: ignore[arg-type]
    for bad in (0, -1.0, float("inf"), float("nan"), True, "5"):
        with pytest.raises(ValueError, match=r"timeout_s must be a positive finite number"):
            KLConfig(timeout_s=bad)  # type: ignore[arg-type]
    assert KLConfig(timeout_s=None).timeout_s is None
    assert KLConfig(timeout_s=2).timeout_s == 2
    with pytest.warns(UserWarning, match="mix_weight=0.2 is ignored"):
        KLConfig(kind="reverse", mix_weight=0.2)
    with pytest.warns(UserWarning, match="memory_budget_bytes=1024 is ignored"):
        KLConfig(chunk_tokens=8, memory_budget_bytes=1024)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = KLConfig(kind="mixed", mix_weight=0.2)
    assert (cfg.reverse_weight, cfg.forward_weight) == (0.2, pytest.approx(0.8))
    assert KLConfig(kind="mixed").reverse_weight == 0.5
    assert KLConfig(kind="forward").reverse_weight == 0.0


def _bad_inputs() -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
    T, V, H = 6, 10, 4
    s = torch.randn(T, V)
    h = torch.randn(T, H)
    w = torch.randn(V, H)
    ok = dict(vocab_start=0, vocab_size=V)
    two = ([h, torch.randn(T, 3)], [w, torch.randn(V, 3)])
    idx = torch.tensor([0, 1, 0, 1, 1, 0])
    return [
        ("must be 2-D", (s[0], h, w), ok),
        ("floating tensor", (s.long(), h, w), ok),
        ("vocab rows", (s, h, torch.randn(V + 1, H)), ok),
        ("disagree on the teacher's hidden size", (s, h, torch.randn(V, H + 1)), ok),
        ("dtype", (s, h.double(), w), ok),
        ("rows: expected T=6", (s, torch.randn(T + 1, H), w), ok),
        ("one teacher hidden tensor per", (s, [h, h], [w]), ok),
        ("no teacher_index_T", (s, *two), ok),
        ("valid is \\[0, 2\\)", (s, *two), dict(ok, teacher_index_T=idx * 2)),
        ("int64 or int32", (s, *two), dict(ok, teacher_index_T=idx.float())),
        ("teacher_index_T must be a \\[T=6\\]", (s, *two), dict(ok, teacher_index_T=idx[:5])),
        ("loss_mask_T must be a \\[T=6\\]", (s, h, w), dict(ok, loss_mask_T=torch.ones(5))),
        ("bool or floating", (s, h, w), dict(ok, loss_mask_T=torch.ones(T, dtype=torch.int64))),
        ("vocab_size must be >= 1", (s, h, w), dict(ok, vocab_size=0)),
        ("exceeds the padded vocab", (s, h, w), dict(ok, vocab_size=V + 1)),
        ("starts at 0", (s, h, w), dict(ok, vocab_start=V)),
        ("must be ints", (s, h, w), dict(ok, vocab_size=float(V))),
        ("contiguous columns", (torch.randn(V, T).T, h, w), ok),
    ]


@pytest.mark.parametrize("case", _bad_inputs(), ids=lambda c: c[0])
def test_bad_input_raises_before_any_collective(
    case: tuple[str, tuple[Any, ...], dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    match, args, kwargs = case
    calls: list[str] = []
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: calls.append("all_reduce"))
    with pytest.raises(ValueError, match=match):
        vocab_parallel_kl(*args, **kwargs)
    assert calls == []


def test_fused_specific_errors() -> None:
    h = torch.randn(6, 4)
    w = torch.randn(10, 4)
    t_h, t_w = torch.randn(6, 3), torch.randn(10, 3)
    with pytest.raises(ValueError, match="disagree on the hidden size"):
        fused_vocab_parallel_kl(h, torch.randn(10, 5), t_h, t_w, vocab_start=0, vocab_size=10)
    with pytest.raises(ValueError, match="student_weight_VH dtype"):
        fused_vocab_parallel_kl(h, w.double(), t_h, t_w, vocab_start=0, vocab_size=10)
    with pytest.raises(ValueError, match=r"student_weight_VH must be a torch\.Tensor"):
        fused_vocab_parallel_kl(h, None, t_h, t_w, vocab_start=0, vocab_size=10)  # type: ignore[arg-type]


def test_debug_mode_detects_non_finite_inputs() -> None:
    s = torch.randn(4, 6)
    h, w = torch.randn(4, 3), torch.randn(6, 3)
    h_bad = h.clone()
    h_bad[2, 1] = float("inf")
    cfg = KLConfig(debug=True)
    with pytest.raises(ValueError, match=r"teacher_hidden\[0\] contain\(s\) NaN or inf"):
        vocab_parallel_kl(s, h_bad, w, vocab_start=0, vocab_size=6, config=cfg)
    s_bad = s.clone()
    s_bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"student input contain\(s\) NaN"):
        vocab_parallel_kl(s_bad, h, w, vocab_start=0, vocab_size=6, config=cfg)
    # without debug the NaN propagates instead of raising
    assert torch.isnan(vocab_parallel_kl(s_bad, h, w, vocab_start=0, vocab_size=6))


# ---- autograd hygiene: saved tensors, what ctx keeps alive, upstream scaling ------------------


def _tensors_for(fused: bool, compact: bool) -> dict[str, torch.Tensor | list[torch.Tensor]]:
    """fp32 inputs with two teachers; the student input is a non-leaf (as Megatron's logits)."""
    T, V_pad, V_real, hidden, weight, index_T, mask_T, s_TV, g = _case(
        61, n_teachers=2, compact=compact, dtype=torch.float32
    )
    base = (torch.randn(T, 5, generator=g) if fused else s_TV).requires_grad_(True)
    w_VH = torch.randn(V_pad, 5, generator=g, requires_grad=True)
    return dict(
        base=base, x=base * 1.0, w=w_VH, hidden=hidden, weight=weight, index_T=index_T,
        mask_T=mask_T, v_real=torch.tensor(V_real),
    )  # fmt: skip


def _loss(t: dict[str, Any], fused: bool, cfg: KLConfig) -> torch.Tensor:
    kwargs = dict(
        vocab_start=0, vocab_size=int(t["v_real"]), loss_mask_T=t["mask_T"],
        teacher_index_T=t["index_T"], config=cfg,
    )  # fmt: skip
    if fused:
        return fused_vocab_parallel_kl(t["x"], t["w"], t["hidden"], t["weight"], **kwargs)
    return vocab_parallel_kl(t["x"], t["hidden"], t["weight"], **kwargs)


_TARGETS = [
    (fused, target)
    for fused in (False, True)
    for target in ("student", "student_weight", "teacher_hidden", "teacher_weight")
    if fused or target != "student_weight"  # the logits path has no student weight
]


@pytest.mark.parametrize(("fused", "target"), _TARGETS, ids=lambda v: str(v))
@pytest.mark.parametrize("compact", [False, True], ids=["token_rows", "compact_rows"])
def test_recompute_path_raises_on_in_place_change(fused: bool, target: str, compact: bool) -> None:
    """reduction='none' recomputes in backward: an in-place change in between must raise
    autograd's version-counter error (before the fix: a silently wrong gradient)."""
    t = _tensors_for(fused, compact)
    out_T = _loss(t, fused, KLConfig(reduction="none", chunk_tokens=4))
    victim = {
        "student": t["x"],
        "student_weight": t["w"],
        "teacher_hidden": t["hidden"][1],
        "teacher_weight": t["weight"][0],
    }[target]
    with torch.no_grad():
        victim.mul_(3.0)  # Megatron's CE scales logits in place; a capture buffer is reused
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out_T.sum().backward()


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
@pytest.mark.parametrize("compact", [False, True], ids=["token_rows", "compact_rows"])
def test_recompute_path_gradient_equals_precomputed(fused: bool, compact: bool) -> None:
    """Saved tensors rebuilt into the job in backward (teacher slots, compact rows) give the same
    gradient as the forward-precomputed path: sum(none) vs sum, exact fp32 math, same chunks."""
    grads = []
    for reduction in ("none", "sum"):
        t = _tensors_for(fused, compact)
        out = _loss(t, fused, KLConfig(reduction=reduction, chunk_tokens=4))
        (out.sum() if reduction == "none" else out).backward()
        grads.append((t["base"].grad, t["w"].grad if fused else None))
    (gx_none, gw_none), (gx_sum, gw_sum) = grads
    assert gx_none is not None and torch.count_nonzero(gx_none) > 0
    torch.testing.assert_close(gx_none, gx_sum, rtol=1e-5, atol=1e-6)
    if fused:
        torch.testing.assert_close(gw_none, gw_sum, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
def test_precomputed_path_does_not_keep_inputs_alive(fused: bool) -> None:
    """sum/mean: ctx keeps only the gradients. The caller's logits (or hidden states) and the
    teacher's hidden states can be freed after forward; backward still gives the right gradient."""
    import gc
    import weakref

    t = _tensors_for(fused, compact=False)
    want = _tensors_for(fused, compact=False)
    _loss(want, fused, KLConfig(chunk_tokens=4)).backward()
    loss = _loss(t, fused, KLConfig(chunk_tokens=4))
    x_ref, h_ref = weakref.ref(t["x"]), weakref.ref(t["hidden"][0])
    del t["x"], t["hidden"]
    gc.collect()
    assert x_ref() is None, "autograd keeps the student input alive after forward"
    assert h_ref() is None, "autograd keeps the teacher hidden states alive after forward"
    loss.backward()
    torch.testing.assert_close(t["base"].grad, want["base"].grad, rtol=0, atol=0)
    if fused:
        torch.testing.assert_close(t["w"].grad, want["w"].grad, rtol=0, atol=0)


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
@pytest.mark.parametrize("budget", [512 * 2**20, 64])
def test_upstream_scale_rounds_once_in_bf16(fused: bool, budget: int) -> None:
    """A bf16 gradient times an fp32 upstream 1/3 is round(g * (1/3)): one rounding, no bf16
    rounding of the scale first (that gave a x1.0018 bias). budget=64: one token per chunk."""
    T, V_pad, V_real, hidden, weight, _, mask_T, s_TV, g = _case(71, n_teachers=1, compact=False)
    hidden_b = [h.bfloat16() for h in hidden]
    weight_b = [w.bfloat16() for w in weight]
    x0 = (torch.randn(T, 6, generator=g) if fused else s_TV).bfloat16()
    w0 = torch.randn(V_pad, 6, generator=g).bfloat16()
    cfg = KLConfig(memory_budget_bytes=budget)
    kwargs = dict(vocab_start=0, vocab_size=V_real, loss_mask_T=mask_T, config=cfg)

    def grads(upstream: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = x0.clone().requires_grad_(True)
        w = w0.clone().requires_grad_(True)
        if fused:
            out = fused_vocab_parallel_kl(x, w, hidden_b, weight_b, **kwargs)
            return torch.autograd.grad(out, (x, w), upstream)
        return torch.autograd.grad(vocab_parallel_kl(x, hidden_b, weight_b, **kwargs), x, upstream)

    third = torch.tensor(1.0 / 3.0)
    for unit, scaled in zip(grads(torch.tensor(1.0)), grads(third), strict=True):
        assert scaled.dtype == torch.bfloat16 and torch.count_nonzero(unit) > 0
        want = (unit.float() * third).bfloat16()
        assert torch.equal(scaled, want), int((scaled != want).sum())


def test_scale_forms_the_product_in_fp32() -> None:
    """The upstream scale as a 0-dim tensor would not take part in type promotion; scale_ makes
    it one that does: bit-equal to the fp32 product rounded once, for bf16 and fp16."""
    g = torch.Generator().manual_seed(8)
    third = torch.tensor(1.0 / 3.0)
    for dtype in (torch.bfloat16, torch.float16):
        grad = (torch.randn(50, 30, generator=g) * 3).to(dtype)
        want = (grad.float() * third).to(dtype)
        assert torch.equal(kl_loop.scale_(grad.clone(), third), want)
    grad64 = torch.randn(4, 5, generator=g, dtype=torch.float64)
    assert torch.equal(kl_loop.scale_(grad64.clone(), third), grad64 * third.double())


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"sum_hidden_grad_over_tp": False}, "sum_hidden_grad_over_tp=False is ignored"),
        ({"weight_grad_accumulation": "fp32"}, "weight_grad_accumulation='fp32' is ignored"),
    ],
)
def test_logits_path_warns_once_that_a_fused_only_setting_is_ignored(
    monkeypatch: pytest.MonkeyPatch, setting: dict[str, Any], message: str
) -> None:
    from mopd.common.log import reset_once

    reset_once()
    t = _tensors_for(False, compact=False)
    cfg = KLConfig(**setting)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _loss(t, False, cfg)
        _loss(t, False, cfg)
        _loss(_tensors_for(True, compact=False), True, cfg)  # meaningful there: no warning
        _loss(t, False, KLConfig())
    hits = [w for w in caught if message in str(w.message)]
    assert len(hits) == 1, [str(w.message) for w in caught]
    assert hits[0].filename == __file__  # points at the caller


def test_resharded_lm_head_shards_are_taken_directly() -> None:
    """The loss takes ``LMHeadShard``s as teacher weights (their vocab range with them), the same
    loss as with the tensors and an explicit range; a range that contradicts them is refused."""
    from mopd.bridge.lm_head import LMHeadShard

    g = torch.Generator().manual_seed(3)
    T, H, V = 6, 8, 20
    s = torch.randn(T, V, generator=g)
    h = torch.randn(T, H, generator=g)
    w = torch.randn(V + 4, H, generator=g)  # padded vocabulary: 4 rows past the real 20
    shard = LMHeadShard(
        weight_VH=w, valid_V=torch.arange(V + 4) < V, num_padding=4, vocab_start=0, vocab_size=V
    )
    s_pad = torch.cat([s, torch.zeros(T, 4)], dim=1)
    want = vocab_parallel_kl(s_pad, h, w, vocab_start=0, vocab_size=V)
    got = vocab_parallel_kl(s_pad, h, shard)
    assert torch.equal(got, want)
    assert torch.equal(vocab_parallel_kl(s_pad, [h], [shard]), want)
    with pytest.raises(ValueError, match="vocab_size=21 but the LM-head shards say 20"):
        vocab_parallel_kl(s_pad, h, shard, vocab_size=21)
    with pytest.raises(ValueError, match="vocab_start and vocab_size are needed"):
        vocab_parallel_kl(s_pad, h, w)
