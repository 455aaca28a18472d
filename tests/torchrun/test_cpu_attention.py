"""Tier 2: the stand-in CP / THD core attention (:mod:`mopd.mcore.cpu`), 4 ranks, gloo.

A student GPTModel built on explicit process groups (``pg_collection``) with context parallelism
(zigzag) and THD-packed sequences must give the same logits, row by row (mapped by the key
``(sequence, position)``), as a TP=1 CP=1 GPTModel with the same weights running megatron's own
local attention on each sequence alone; its gradients, summed over the DP x CP ranks, must equal
the reference's. Cases: CP2 x DP2 and CP2 x TP2, packed; CP2 x DP2 on a padded ``[S, B]`` batch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from mopd.bridge import GroupPool, Mesh, packed_layout
from mopd.mcore import megatron_process_groups
from mopd.mcore.cpu import cpu_gpt_layer_spec, packed_rows, zigzag_positions
from tests.support import megatron_cpu as mc
from tests.support.dist import COLLECTIVE_TIMEOUT

TORCHRUN_NPROC = 4
TORCHRUN_TIMEOUT = 300

V, H, MAX_LEN = 64, 32, 16
# the sequences of each DP shard (real lengths); padded to a multiple of 2 * cp in the pack
LENGTHS = ([5, 8, 3], [7, 4])


def _tokens(num_seq: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (num_seq, MAX_LEN), generator=g)


def _loss_weights(num_seq: int, seed: int = 1) -> torch.Tensor:
    """``[num_seq, MAX_LEN, V]`` fixed weights: the test loss is ``sum(logits * w)`` over real tokens."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_seq, MAX_LEN, V, generator=g)


def _models(mesh: Mesh, tp: int, cp: int) -> tuple[Any, Any, Any]:
    """``(reference, parallel model, its pg_collection)`` holding the same weights."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    mc.init_parallel(tp=1)
    pool = GroupPool(timeout_s=COLLECTIVE_TIMEOUT.total_seconds())
    ref_pg = megatron_process_groups(Mesh(tp=1, dp=dist.get_world_size()), pool)
    pg = megatron_process_groups(mesh, pool)
    assert isinstance(ref_pg, ProcessGroupCollection) and isinstance(pg, ProcessGroupCollection)
    torch.manual_seed(7)
    ref = mc.build_gpt(
        mc.tiny_config(hidden_size=H), vocab_size=V, max_seq_len=MAX_LEN, pg_collection=ref_pg
    )
    model = mc.build_gpt(
        mc.tiny_config(hidden_size=H, tensor_model_parallel_size=tp, context_parallel_size=cp),
        vocab_size=V,
        max_seq_len=MAX_LEN,
        layer_spec=cpu_gpt_layer_spec(),
        pg_collection=pg,
    )
    full = {n: p.detach().clone() for n, p in ref.named_parameters()}
    # poison first: a parameter the load misses makes the comparison fail
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    mc.load_full_state(model, full, pg.tp.rank(), tp)
    return ref, model, pg


def _reference(ref: Any, tokens: torch.Tensor, lengths: list[int], w: torch.Tensor):
    """Per-sequence logits ``[L_i, V]`` of the reference (alone, megatron's local attention) and
    its parameter gradients for ``sum_i sum(logits_i * w_i)``."""
    ref.zero_grad(set_to_none=True)
    logits, loss = [], torch.zeros(())
    for i, n in enumerate(lengths):
        out = ref(tokens[i, :n][None], torch.arange(n)[None], None)[0]  # [n, V]
        logits.append(out.detach())
        loss = loss + (out * w[i, :n]).sum()
    loss.backward()
    return logits, {name: p.grad.clone() for name, p in ref.named_parameters()}


def _check_grads(model: Any, ref_grads: dict[str, torch.Tensor], pg: Any, tp: int) -> None:
    """Gradients summed over DP x CP equal the reference's (this rank's TP shard of them)."""
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name}: no gradient"
        g = p.grad.clone()
        dist.all_reduce(g, group=pg.dp_cp)
        want = ref_grads[name]
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            want = want.chunk(tp, dim=p.partition_dim)[pg.tp.rank()]
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(("tp", "cp", "dp"), [(1, 2, 2), (2, 2, 1)], ids=["cp2-dp2", "cp2-tp2"])
def test_thd_cp_matches_per_sequence_reference(tp: int, cp: int, dp: int) -> None:
    from megatron.core.packed_seq_params import PackedSeqParams

    mesh = Mesh(tp=tp, cp=cp, dp=dp)
    ref, model, pg = _models(mesh, tp, cp)
    coord = mesh.coord(dist.get_rank())
    assert coord is not None
    # DP shard d packs LENGTHS[d] (dp=1: every sequence); global sequence index = row of tokens
    shards = list(LENGTHS) if dp == 2 else [[n for part in LENGTHS for n in part]]
    all_lengths = [n for part in shards for n in part]
    first = sum(len(part) for part in shards[: coord.dp_rank])
    lengths = shards[coord.dp_rank]
    tokens, w = _tokens(len(all_lengths)), _loss_weights(len(all_lengths))
    ref_logits, ref_grads = _reference(ref, tokens, all_lengths, w)

    lens = torch.tensor(lengths)
    padded = (lens + 2 * cp - 1) // (2 * cp) * (2 * cp)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(padded, 0)])
    seq_T, pos_T = packed_rows(cu, cp, coord.cp_rank)
    assert seq_T.numel() == int(cu[-1]) // cp
    gseq_T = seq_T + first
    psp = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu.to(torch.int32),
        cu_seqlens_kv=cu.to(torch.int32),
        cu_seqlens_q_padded=cu.to(torch.int32),
        cu_seqlens_kv_padded=cu.to(torch.int32),
        max_seqlen_q=int(padded.max()),
        max_seqlen_kv=int(padded.max()),
    )
    logits = model(tokens[gseq_T, pos_T][None], pos_T[None], None, packed_seq_params=psp)[0]
    assert logits.shape == (seq_T.numel(), V // tp)
    full_TV = mc.gather_vocab_shards(logits.detach(), pg.tp)
    real = (pos_T < lens[seq_T]).nonzero().reshape(-1)
    assert real.numel() > 0
    want = torch.stack([ref_logits[int(gseq_T[t])][int(pos_T[t])] for t in real])
    torch.testing.assert_close(full_TV[real], want, rtol=1e-5, atol=1e-5)

    vocab = slice(pg.tp.rank() * (V // tp), (pg.tp.rank() + 1) * (V // tp))
    loss = (logits[real] * w[gseq_T[real], pos_T[real]][:, vocab]).sum()
    loss.backward()
    _check_grads(model, ref_grads, pg, tp)


def test_padded_sbh_cp2_matches_reference() -> None:
    mesh = Mesh(cp=2, dp=2)
    ref, model, pg = _models(mesh, 1, 2)
    coord = mesh.coord(dist.get_rank())
    assert coord is not None
    B = 2
    tokens, w = _tokens(2 * B, seed=3), _loss_weights(2 * B, seed=4)
    ref_logits, ref_grads = _reference(ref, tokens, [MAX_LEN] * (2 * B), w)
    mine = torch.arange(coord.dp_rank * B, (coord.dp_rank + 1) * B)
    pos_S = zigzag_positions(MAX_LEN, 2, coord.cp_rank)
    ids_BS = tokens[mine][:, pos_S]
    logits_BSV = model(ids_BS, pos_S.expand(B, -1), None)
    assert logits_BSV.shape == (B, MAX_LEN // 2, V)
    want = torch.stack([ref_logits[int(i)][pos_S] for i in mine])
    torch.testing.assert_close(logits_BSV.detach(), want, rtol=1e-5, atol=1e-5)
    (logits_BSV * w[mine][:, pos_S]).sum().backward()
    _check_grads(model, ref_grads, pg, 1)


@pytest.mark.parametrize("cp_rank", [0, 1])
def test_packed_rows_agree_with_the_bridge_layout(cp_rank: int) -> None:
    """Two independent implementations of megatron's THD zigzag agree row for row."""
    lens = [5, 8, 3, 1]
    cu = [0, 8, 16, 20, 24]
    seq_T, pos_T = packed_rows(cu, 2, cp_rank)
    lay = packed_layout([10, 11, 12, 13], lens, cu_seqlens_padded=cu, cp_size=2, cp_rank=cp_rank)
    real = pos_T < torch.tensor(lens)[seq_T]
    assert torch.equal(lay.sample_id_R, torch.where(real, seq_T + 10, -1))
    assert torch.equal(lay.position_R, torch.where(real, pos_T, -1))


def test_mismatched_cu_seqlens_raise() -> None:
    from megatron.core.packed_seq_params import PackedSeqParams

    mesh = Mesh(cp=2, dp=2)
    _, model, _ = _models(mesh, 1, 2)
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)  # 16 / cp = 8 local rows, but 6 are given
    psp = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=8,
        max_seqlen_kv=8,
    )
    with pytest.raises(ValueError, match="cu_seqlens_q_padded ends at 16"):
        model(
            torch.zeros(1, 6, dtype=torch.int64), torch.arange(6)[None], None, packed_seq_params=psp
        )
