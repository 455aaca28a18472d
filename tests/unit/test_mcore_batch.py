"""Tier 1: micro-batch layouts as the student's loss mask, empty shards and fixed-capacity packing
shape them (:mod:`mopd.mcore.batch`).

What a user relies on: a token the loss mask excludes is padding in the student's layout in any
row order (so the bridge never moves it and no count sees it), whatever the CP rank and SP slice;
a rank with no sample still gets a micro-batch megatron can run, all padding; a fixed-capacity
packer's trailing repeated offsets are accepted; wrong input fails early with the values named.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from mopd.bridge.layout import encode_keys
from mopd.mcore import micro_batch_layout, packed_micro_batch, padded_micro_batch
from mopd.mcore.batch import MicroBatch

S = 16


def _keys(layout) -> set[int]:
    k = encode_keys(layout.sample_id_R, layout.position_R, 1000)
    return {int(x) for x in k if x >= 0}


def _want(ids, masks, lens) -> set[int]:
    return {
        s * 1000 + p
        for s, m, n in zip(ids, masks, lens, strict=True)
        for p in range(n)
        if bool(m[p])
    }


@pytest.mark.parametrize("cp", [1, 2])
def test_padded_loss_mask_keeps_exactly_the_counted_tokens(cp: int) -> None:
    g = torch.Generator().manual_seed(0)
    ids, lens = [7, 30, 12], [16, 9, 4]
    tokens = torch.randint(0, 50, (3, S), generator=g)
    prompt = [5, 3, 1]
    mask_BS = torch.zeros(3, S, dtype=torch.bool)
    for b, (p, n) in enumerate(zip(prompt, lens, strict=True)):
        mask_BS[b, p:n] = True
    mask_BS[0, 10] = False  # a hole inside a response
    got_logits, got_hidden, unmasked = set(), set(), set()
    for r in range(cp):
        mb = padded_micro_batch(
            ids, tokens, lengths=lens, loss_mask_BS=mask_BS, cp_size=cp, cp_rank=r
        )
        assert mb.loss_mask.shape == (3, S // cp)
        lo = micro_batch_layout(mb, rows="logits", cp_size=cp, cp_rank=r)
        assert lo.num_rows == 3 * S // cp  # rows are kept (the logits' shape), only emptied
        got_logits |= _keys(lo)
        for sp in range(2):
            hi = micro_batch_layout(mb, rows="hidden", cp_size=cp, cp_rank=r, sp_size=2, sp_rank=sp)
            got_hidden |= _keys(hi)
        full = micro_batch_layout(mb, rows="hidden", cp_size=cp, cp_rank=r, use_loss_mask=False)
        unmasked |= _keys(full)
    want = _want(ids, mask_BS, lens)
    assert got_logits == want
    assert got_hidden == want
    assert unmasked == _want(ids, torch.ones(3, S, dtype=torch.bool), lens)


@pytest.mark.parametrize(("cp", "sp"), [(1, 1), (2, 1), (2, 2)])
def test_packed_loss_mask_keeps_exactly_the_counted_tokens(cp: int, sp: int) -> None:
    ids, lens = [4, 9, 2], [5, 11, 3]
    seqs = [torch.arange(n) + 1 for n in lens]
    masks = [torch.arange(n) >= n // 2 for n in lens]
    got = set()
    for r in range(cp):
        mb = packed_micro_batch(ids, seqs, loss_masks=masks, cp_size=cp, cp_rank=r, sp_size=sp)
        assert mb.loss_mask.shape == mb.tokens.shape
        got |= _keys(micro_batch_layout(mb, rows="logits", cp_size=cp, cp_rank=r))
    assert got == _want(ids, masks, lens)


def test_empty_shards_are_all_padding_placeholders() -> None:
    mb = padded_micro_batch([], torch.zeros(0, S, dtype=torch.int64), cp_size=2, cp_rank=1)
    assert mb.tokens.shape == (1, S // 2)
    lo = micro_batch_layout(mb, rows="logits", cp_size=2, cp_rank=1)
    assert lo.num_rows == S // 2 and lo.num_tokens == 0
    wide = padded_micro_batch([], torch.ones(2, S, dtype=torch.int64))
    assert wide.tokens.shape == (2, S)  # the other micro-batches' shape, kept for the pipeline
    assert micro_batch_layout(wide, rows="hidden").num_tokens == 0
    for cp, sp in [(1, 1), (2, 1), (2, 2)]:
        pk = packed_micro_batch([], [], cp_size=cp, sp_size=sp)
        psp = pk.packed_seq_params
        assert psp.cu_seqlens_q.tolist() == [0, 0]
        assert int(psp.cu_seqlens_q_padded[-1]) == (2 * cp if cp > 1 else 1) * sp
        lay = micro_batch_layout(pk, rows="logits", cp_size=cp, cp_rank=0)
        assert lay.num_rows == pk.tokens.shape[1] and lay.num_tokens == 0


def test_fixed_capacity_cu_seqlens_drop_trailing_repeats() -> None:
    from megatron.core.packed_seq_params import PackedSeqParams

    real = torch.tensor([0, 5, 9, 9, 9], dtype=torch.int32)
    padded = torch.tensor([0, 6, 10, 10, 10], dtype=torch.int32)
    psp = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=real, cu_seqlens_q_padded=padded, max_seqlen_q=6
    )
    mb = MicroBatch(sample_ids=[3, 8], packed_seq_params=psp)
    lay = micro_batch_layout(mb, rows="logits")
    assert lay.num_rows == 10
    assert _keys(lay) == {3000 + p for p in range(5)} | {8000 + p for p in range(4)}
    short = MicroBatch(sample_ids=[3], packed_seq_params=psp)
    with pytest.raises(ValueError, match=r"1 sample ids but cu_seqlens_q has 5 offsets"):
        micro_batch_layout(short, rows="logits")


def test_bad_masks_are_named() -> None:
    tokens = torch.zeros(2, S, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"loss_mask_BS has shape \(2, 8\)"):
        padded_micro_batch([1, 2], tokens, loss_mask_BS=torch.ones(2, 8))
    with pytest.raises(ValueError, match="0/1 values"):
        MicroBatch(sample_ids=[1], seq_len=S, loss_mask=torch.full((1, S), 0.5))
    mb = MicroBatch(sample_ids=[1, 2], seq_len=S, loss_mask=torch.ones(2, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"loss_mask has shape \(2, 8\) \(16 tokens\).*32 rows"):
        micro_batch_layout(mb, rows="logits")
    with pytest.raises(ValueError, match="loss_masks lengths"):
        packed_micro_batch([1], [torch.ones(4, dtype=torch.int64)], loss_masks=[torch.ones(3)])


def test_pipelined_micro_batches_of_different_shapes_need_variable_seq_lengths() -> None:
    from mopd.mcore.teacher import check_pipeline_shapes
    from tests.support.megatron_cpu import tiny_config

    mbs = [
        packed_micro_batch([1], [torch.ones(5, dtype=torch.int64)]),
        packed_micro_batch([2], [torch.ones(9, dtype=torch.int64)]),
    ]
    fixed = tiny_config(pipeline_model_parallel_size=2)
    with pytest.raises(
        ValueError,
        match=r"student: packed \(THD\).*\[\(5, 1\), \(9, 1\)\].*"
        r"set variable_seq_lengths=True",
    ):
        check_pipeline_shapes(mbs, config=fixed, pp=2, cp_size=1, what="student")
    check_pipeline_shapes(mbs, config=fixed, pp=1, cp_size=1, what="student")  # no pipeline
    variable = tiny_config(
        pipeline_model_parallel_size=2,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
    )
    check_pipeline_shapes(mbs, config=variable, pp=2, cp_size=1, what="student")
    same = [
        padded_micro_batch([1, 2], torch.zeros(2, S, dtype=torch.int64)),
        padded_micro_batch([], torch.zeros(2, S, dtype=torch.int64)),
    ]
    check_pipeline_shapes(same, config=fixed, pp=2, cp_size=1, what="teacher")  # one shape
