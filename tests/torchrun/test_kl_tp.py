"""Tier 2 (torchrun, 4 ranks, gloo): the vocab-parallel KL over TP groups of 1, 2 and 4.

Every rank builds the same full inputs, computes the loss without TP (the whole padded vocab on
one rank), then again as a member of a TP group of 2 and of 4 (sub-groups made with
``dist.new_group``, every rank creating the same groups in the same order), holding only its
vocab shard. Loss and gradients must match the TP-1 run (fp32 statistics: rtol 1e-5). The vocab
is padded so that in TP 4 the last rank holds only padding in one case. Also: exactly one MAX and
one SUM all-reduce per chunk, validation that raises on every rank with no collective run, the
debug agreement check catching ranks that pass different masks, and (debug) a bad argument on one
rank only (its vocab_start, its shard size) raising the same ValueError on every rank, no hang.

bf16 at TP 2 and V = 151,936 (logit std 12, the distillation regime, one and two teachers, three
kinds, both entry points: the logits path on one TP pair, the fused path on the other, in the
same test): each rank's loss within 1e-5 and its gradient shards within 0.5% of
the float64 reference over the full vocabulary (tests/support/kl_reference.py).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist

from mopd.kernels.kl import KLConfig, fused_vocab_parallel_kl, vocab_parallel_kl
from tests.support.kl_reference import distillation_case, reference_kl, relative_error

TORCHRUN_NPROC = 4
TORCHRUN_TIMEOUT = 540  # the bf16 large-vocabulary cases take ~2 min on 2 loaded cores

V_PAD = 48  # 12 per rank at TP 4, 24 at TP 2


@pytest.fixture(scope="module")
def groups() -> dict[int, dist.ProcessGroup | None]:
    """``{tp: this rank's TP group}``; all ranks create every group in the same order."""
    from tests.support.dist import ensure_world

    ensure_world()
    world = dist.get_world_size()
    assert world == TORCHRUN_NPROC
    mine: dict[int, dist.ProcessGroup | None] = {1: None}
    for tp in (2, 4):
        for first in range(0, world, tp):
            ranks = list(range(first, first + tp))
            g = dist.new_group(ranks, backend="gloo")
            if dist.get_rank() in ranks:
                mine[tp] = g
    return mine


def _inputs(seed: int, v_real: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    T = 23
    hs = (7, 4)
    index_T = torch.randint(0, 2, (T,), generator=g)
    hidden = [
        torch.randn(T, hs[0], generator=g),
        torch.randn(int((index_T == 1).sum()), hs[1], generator=g),
    ]
    weight = [torch.randn(V_PAD, h, generator=g) for h in hs]
    mask_T = (torch.rand(T, generator=g) > 0.2).float()
    logits_TV = torch.randn(T, V_PAD, generator=g) * 2
    h_TH = torch.randn(T, 6, generator=g)
    w_VH = torch.randn(V_PAD, 6, generator=g)
    return dict(
        index_T=index_T, hidden=hidden, weight=weight, mask_T=mask_T, logits_TV=logits_TV,
        h_TH=h_TH, w_VH=w_VH, v_real=v_real,
    )  # fmt: skip


def _shard(tp: int) -> tuple[int, slice]:
    r = dist.get_rank() % tp
    v_local = V_PAD // tp
    return r * v_local, slice(r * v_local, (r + 1) * v_local)


def _logits_loss(
    x: dict[str, Any], tp: int, group: dist.ProcessGroup | None, cfg: KLConfig
) -> tuple[torch.Tensor, torch.Tensor, slice]:
    start, cols = _shard(tp)
    s = x["logits_TV"][:, cols].clone().requires_grad_(True)
    out = vocab_parallel_kl(
        s, x["hidden"], [w[cols] for w in x["weight"]], vocab_start=start,
        vocab_size=x["v_real"], loss_mask_T=x["mask_T"], teacher_index_T=x["index_T"],
        group=group, config=cfg,
    )  # fmt: skip
    up = torch.linspace(0.5, 1.5, out.numel()).reshape(out.shape)
    (grad,) = torch.autograd.grad(out, s, up)
    return out.detach(), grad, cols


def _fused_loss(
    x: dict[str, Any], tp: int, group: dist.ProcessGroup | None, cfg: KLConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, slice]:
    start, cols = _shard(tp)
    h = x["h_TH"].clone().requires_grad_(True)
    w = x["w_VH"][cols].clone().requires_grad_(True)
    out = fused_vocab_parallel_kl(
        h, w, x["hidden"], [t[cols] for t in x["weight"]], vocab_start=start,
        vocab_size=x["v_real"], loss_mask_T=x["mask_T"], teacher_index_T=x["index_T"],
        group=group, config=cfg,
    )  # fmt: skip
    up = torch.linspace(0.5, 1.5, out.numel()).reshape(out.shape)
    gh, gw = torch.autograd.grad(out, (h, w), up)
    return out.detach(), gh, gw, cols


@pytest.mark.parametrize("v_real", [41, 30])  # 30: rank 3 of TP 4 holds only padding
@pytest.mark.parametrize("kind", ["reverse", "forward", "mixed"])
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_logits_path_tp_matches_tp1(
    groups: dict[int, dist.ProcessGroup | None], v_real: int, kind: str, reduction: str
) -> None:
    x = _inputs(1, v_real)
    cfg = KLConfig(kind=kind, reduction=reduction, chunk_tokens=5)
    ref, ref_grad, _ = _logits_loss(x, 1, None, cfg)
    for tp in (2, 4):
        out, grad, cols = _logits_loss(x, tp, groups[tp], cfg)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, ref_grad[:, cols], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("v_real", [41, 30])
@pytest.mark.parametrize("kind", ["reverse", "mixed"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fused_path_tp_matches_tp1(
    groups: dict[int, dist.ProcessGroup | None], v_real: int, kind: str, reduction: str
) -> None:
    x = _inputs(2, v_real)
    cfg = KLConfig(kind=kind, reduction=reduction, chunk_tokens=4)
    ref, ref_gh, ref_gw, _ = _fused_loss(x, 1, None, cfg)
    for tp in (2, 4):
        out, gh, gw, cols = _fused_loss(x, tp, groups[tp], cfg)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        # summed over the group: a different summation order over V than TP 1 (fp32 rounding)
        torch.testing.assert_close(gh, ref_gh, rtol=1e-4, atol=1e-5 * float(ref_gh.abs().max()))
        torch.testing.assert_close(gw, ref_gw[cols], rtol=1e-5, atol=1e-6)


def test_one_max_and_one_sum_per_chunk(
    groups: dict[int, dist.ProcessGroup | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    x = _inputs(3, 41)
    real = dist.all_reduce
    ops: list[str] = []

    def counting(
        tensor: torch.Tensor,
        op: dist.ReduceOp = dist.ReduceOp.SUM,
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
    ) -> object:
        ops.append(str(op).rsplit(".", 1)[-1])
        return real(tensor, op=op, group=group, async_op=async_op)

    monkeypatch.setattr(dist, "all_reduce", counting)
    n_active = int((x["mask_T"] != 0).sum())
    chunk = 6
    _logits_loss(x, 4, groups[4], KLConfig(chunk_tokens=chunk))
    n_chunks = -(-n_active // chunk)
    assert ops == ["MAX", "SUM"] * n_chunks, ops
    ops.clear()
    _fused_loss(x, 4, groups[4], KLConfig(chunk_tokens=chunk))
    assert ops == ["MAX", "SUM"] * n_chunks + ["SUM"], ops  # + the hidden-gradient sum


def test_validation_raises_on_every_rank_without_collectives(
    groups: dict[int, dist.ProcessGroup | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    x = _inputs(4, 41)
    calls: list[int] = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: calls.append(1))
    start, cols = _shard(4)
    s = x["logits_TV"][:, cols]
    w = [t[cols] for t in x["weight"]]
    common = dict(loss_mask_T=x["mask_T"], teacher_index_T=x["index_T"], group=groups[4])
    # the padded vocab of a TP-4 group of 12-row shards is 48 < 60
    with pytest.raises(ValueError, match="exceeds the padded vocab 4 x 12"):
        vocab_parallel_kl(s, x["hidden"], w, vocab_start=start, vocab_size=60, **common)
    # shards laid out in another rank order: wrong on every rank
    with pytest.raises(ValueError, match="vocab_start"):
        vocab_parallel_kl(
            s, x["hidden"], w, vocab_start=(start + 12) % V_PAD, vocab_size=41, **common
        )
    with pytest.raises(ValueError, match="vocab rows"):
        vocab_parallel_kl(s, x["hidden"], [t[:5] for t in w],
                          vocab_start=start, vocab_size=41, **common)  # fmt: skip
    assert calls == []
    monkeypatch.setattr(dist, "all_reduce", real)
    flag = torch.ones(1)
    dist.all_reduce(flag)  # the world is still in step
    assert float(flag) == TORCHRUN_NPROC


def test_debug_catches_ranks_that_disagree_on_the_mask(
    groups: dict[int, dist.ProcessGroup | None],
) -> None:
    x = _inputs(5, 41)
    if dist.get_rank() % 4 == 2:
        x["mask_T"] = x["mask_T"].clone()
        x["mask_T"][0] = 1.0 - x["mask_T"][0]
    with pytest.raises(ValueError, match="TP ranks disagree"):
        _logits_loss(x, 4, groups[4], KLConfig(debug=True))


def test_debug_catches_nan_on_one_rank_on_every_rank(
    groups: dict[int, dist.ProcessGroup | None],
) -> None:
    x = _inputs(6, 41)
    if dist.get_rank() % 4 == 1:  # only this rank's vocab shard of teacher 0 is poisoned
        x["weight"] = [w.clone() for w in x["weight"]]
        x["weight"][0][12, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf in"):
        _logits_loss(x, 4, groups[4], KLConfig(debug=True))


@pytest.mark.parametrize("bad", ["vocab_start", "teacher_shard_rows"])
def test_debug_rank_specific_bad_argument_raises_on_every_rank(
    groups: dict[int, dist.ProcessGroup | None], bad: str
) -> None:
    """One rank's validation fails (its vocab_start, or its teacher shard size): with debug on,
    the failure joins the agreement and every rank raises the same ValueError, naming that rank
    and its error; a short collective timeout turns any hang into a different error."""
    x = _inputs(7, 41)
    start, cols = _shard(4)
    weight = [w[cols] for w in x["weight"]]
    bad_rank = 2
    if dist.get_rank() % 4 == bad_rank:
        if bad == "vocab_start":
            start += 1
        else:
            weight[1] = weight[1][:-1]
    s = x["logits_TV"][:, cols].clone().requires_grad_(True)
    cfg = KLConfig(debug=True, timeout_s=30.0)
    with pytest.raises(
        ValueError, match=r"KL arguments \(KLConfig\(debug=True\)\) rejected"
    ) as info:
        vocab_parallel_kl(
            s, x["hidden"], weight, vocab_start=start, vocab_size=x["v_real"],
            loss_mask_T=x["mask_T"], teacher_index_T=x["index_T"], group=groups[4], config=cfg,
        )  # fmt: skip
    msg = str(info.value)
    assert (
        "vocab_start=25" if bad == "vocab_start" else "teacher_weight[1] has 11 vocab rows"
    ) in msg
    assert re.findall(r"rank \d+ of the TP group: ", msg) == [f"rank {bad_rank} of the TP group: "]
    assert "found by global rank" in msg
    if dist.get_rank() % 4 == bad_rank:
        assert isinstance(info.value.__cause__, ValueError)  # the local error, chained
    msgs: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(msgs, msg)
    assert msgs == [msg] * dist.get_world_size(), msgs


V_BIG = 151936


@pytest.mark.parametrize("n_teachers", [1, 2])
@pytest.mark.parametrize("kind", ["reverse", "forward", "mixed"])
def test_bf16_tp2_large_vocab_matches_float64(
    groups: dict[int, dist.ProcessGroup | None], kind: str, n_teachers: int
) -> None:
    """Both paths at once: the logits path on one TP pair (ranks 0, 1), the fused path on the
    other (ranks 2, 3), each against its own float64 reference."""
    fused = dist.get_rank() // 2 == 1
    c = distillation_case(std=12.0, n_teachers=n_teachers, T=96, H=64, V=V_BIG)
    r = dist.get_rank() % 2
    v_local = V_BIG // 2
    cols = slice(r * v_local, (r + 1) * v_local)
    kwargs = dict(
        vocab_start=r * v_local, vocab_size=V_BIG, loss_mask_T=c["mask_T"],
        teacher_index_T=c["index_T"], group=groups[2],
        config=KLConfig(kind=kind, mix_weight=0.3 if kind == "mixed" else None),  # type: ignore[arg-type]
    )  # fmt: skip
    weight = [w[cols] for w in c["weight"]]
    ref_kwargs = dict(
        vocab_size=V_BIG, kind=kind, mix_weight=0.3, loss_mask_T=c["mask_T"],
        teacher_index_T=c["index_T"],
    )  # fmt: skip
    if fused:
        h = c["h_s"].clone().requires_grad_(True)
        w = c["w_s"][cols].clone().requires_grad_(True)
        out = fused_vocab_parallel_kl(h, w, c["hidden"], weight, **kwargs)
        grads = torch.autograd.grad(out, (h, w))
        h64 = c["h_s"].double().requires_grad_(True)
        w64 = c["w_s"].double().requires_grad_(True)
        ref = reference_kl(h64 @ w64.T, c["hidden"], c["weight"], **ref_kwargs)
        gh64, gw64 = torch.autograd.grad(ref, (h64, w64))
        wants = (gh64, gw64[cols])
    else:
        s = c["logits"][:, cols].clone().requires_grad_(True)
        out = vocab_parallel_kl(s, c["hidden"], weight, **kwargs)
        grads = torch.autograd.grad(out, (s,))
        s64 = c["logits"].double().requires_grad_(True)
        ref = reference_kl(s64, c["hidden"], c["weight"], **ref_kwargs)
        (g64,) = torch.autograd.grad(ref, s64)
        wants = (g64[:, cols],)
    loss, want = float(out.detach()), float(ref.detach())
    assert abs(loss - want) <= 1e-5 * abs(want), (loss, want)
    for got, w_ in zip(grads, wants, strict=True):
        assert got.dtype == torch.bfloat16
        assert relative_error(got, w_) <= 5e-3
