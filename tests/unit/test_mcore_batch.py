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
            ids, tokens, lengths=lens, row_mask_BS=mask_BS, cp_size=cp, cp_rank=r
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
        mb = packed_micro_batch(ids, seqs, row_masks=masks, cp_size=cp, cp_rank=r, sp_size=sp)
        assert mb.loss_mask.shape == mb.tokens.shape
        got |= _keys(micro_batch_layout(mb, rows="logits", cp_size=cp, cp_rank=r))
    assert got == _want(ids, masks, lens)


def _rows_and_labels(mb, cp: int, r: int) -> dict[int, tuple[bool, int]]:
    """``key -> (row counts, label)`` of a CP rank's real rows (keys ``sample * 1000 + pos``)."""
    lay = micro_batch_layout(mb, rows="logits", cp_size=cp, cp_rank=r, use_loss_mask=False)
    keys = encode_keys(lay.sample_id_R, lay.position_R, 1000)
    mask = mb.loss_mask.reshape(-1)
    labels = mb.labels.reshape(-1)
    return {
        int(k): (bool(m), int(y))
        for k, m, y in zip(keys.tolist(), mask.tolist(), labels.tolist(), strict=True)
        if k >= 0
    }


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "thd"])
def test_a_response_mask_counts_exactly_the_rows_that_predict_response_tokens(
    cp: int, packed: bool
) -> None:
    """Row p counts exactly when token p + 1 is a response token (none of a sequence's last
    row, nothing wrapped), and its label is token p + 1, whatever the CP rank holds."""
    g = torch.Generator().manual_seed(1)
    ids, lens, prompts = [5, 11, 2], [16, 9, 3], [4, 1, 2]
    seqs = [torch.randint(1, 50, (n,), generator=g) for n in lens]
    responses = [torch.arange(n) >= p for n, p in zip(lens, prompts, strict=True)]
    responses[0][9] = False  # a hole inside a response (a tool's output, say)
    got: dict[int, tuple[bool, int]] = {}
    for r in range(cp):
        if packed:
            mb = packed_micro_batch(ids, seqs, response_masks=responses, cp_size=cp, cp_rank=r)
        else:
            tokens = torch.zeros(3, S, dtype=torch.int64)
            resp = torch.zeros(3, S, dtype=torch.bool)
            for b, (t, m) in enumerate(zip(seqs, responses, strict=True)):
                tokens[b, : t.numel()], resp[b, : t.numel()] = t, m
            mb = padded_micro_batch(
                ids, tokens, lengths=lens, response_mask_BS=resp, cp_size=cp, cp_rank=r
            )
        assert mb.labels.shape == mb.tokens.shape == mb.loss_mask.shape
        got |= _rows_and_labels(mb, cp, r)
    want = {}
    for s, t, m in zip(ids, seqs, responses, strict=True):
        n = t.numel()
        for p in range(n):
            counts = p + 1 < n and bool(m[p + 1])
            want[s * 1000 + p] = (counts, int(t[p + 1]) if p + 1 < n else 0)
    assert got == want
    assert sum(c for c, _ in got.values()) == sum(int(m[1:].sum()) for m in responses)


def test_the_old_mask_names_are_row_aligned_and_warn() -> None:
    tokens = torch.arange(S)[None].repeat(2, 1)
    row = torch.zeros(2, S, dtype=torch.bool)
    row[:, 3:7] = True
    with pytest.warns(DeprecationWarning, match="loss_mask_BS is deprecated.*row_mask_BS"):
        old = padded_micro_batch([1, 2], tokens, loss_mask_BS=row)
    new = padded_micro_batch([1, 2], tokens, row_mask_BS=row)
    assert torch.equal(old.loss_mask, new.loss_mask) and torch.equal(new.loss_mask, row)
    seq = [torch.arange(6)]
    with pytest.warns(DeprecationWarning, match="loss_masks is deprecated.*row_masks"):
        old_p = packed_micro_batch([1], seq, loss_masks=[torch.arange(6) >= 2])
    assert torch.equal(
        old_p.loss_mask, packed_micro_batch([1], seq, row_masks=[torch.arange(6) >= 2]).loss_mask
    )


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
    with pytest.raises(ValueError, match=r"row_mask_BS has shape \(2, 8\)"):
        padded_micro_batch([1, 2], tokens, row_mask_BS=torch.ones(2, 8))
    with pytest.raises(ValueError, match=r"response_mask_BS has shape \(2, 8\)"):
        padded_micro_batch([1, 2], tokens, response_mask_BS=torch.ones(2, 8))
    with pytest.raises(ValueError, match="not both"):
        padded_micro_batch(
            [1, 2], tokens, response_mask_BS=torch.ones(2, S), row_mask_BS=torch.ones(2, S)
        )
    with pytest.raises(ValueError, match="0/1 values"):
        MicroBatch(sample_ids=[1], seq_len=S, loss_mask=torch.full((1, S), 0.5))
    mb = MicroBatch(sample_ids=[1, 2], seq_len=S, loss_mask=torch.ones(2, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"loss_mask has shape \(2, 8\) \(16 tokens\).*32 rows"):
        micro_batch_layout(mb, rows="logits")
    with pytest.raises(ValueError, match="row_masks lengths"):
        packed_micro_batch([1], [torch.ones(4, dtype=torch.int64)], row_masks=[torch.ones(3)])
    with pytest.raises(ValueError, match="response_masks lengths"):
        packed_micro_batch([1], [torch.ones(4, dtype=torch.int64)], response_masks=[torch.ones(3)])


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


#: sample ids at the top of int64, spread over it, and mixed (products with a stride wrap)
EDGE_IDS = [
    [2**63 - 4 + j for j in range(4)],
    [j * 2**59 + 1 for j in range(4)],
    [2**63 - 1, 0, 2**62, 7],
]


@pytest.mark.parametrize("ids", EDGE_IDS, ids=["top", "spread", "mixed"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "thd"])
def test_a_loss_mask_keeps_the_same_tokens_under_any_sample_ids(
    ids: list[int], packed: bool
) -> None:
    """The rows a loss mask keeps do not depend on the sample ids' values: ids near ``2**63``
    (whose ``id * stride + position`` wraps int64) keep exactly the tokens ids ``0..3`` keep,
    row for row, in the logits' and the hidden states' (SP-sliced) layouts."""
    g = torch.Generator().manual_seed(1)
    lens = [16, 12, 10, 8][: len(ids)]
    seqs = [torch.randint(0, 50, (n,), generator=g) for n in lens]
    masks = [torch.arange(n) >= 3 for n in lens]
    masks[0][9] = False  # a hole inside a response

    def rows(sample_ids: list[int]) -> list[tuple[int, int]]:
        if packed:
            mb = packed_micro_batch(sample_ids, seqs, row_masks=masks, sp_size=2)
        else:
            tokens = torch.zeros(len(lens), S, dtype=torch.int64)
            mask_BS = torch.zeros(len(lens), S, dtype=torch.bool)
            for b, (t, m) in enumerate(zip(seqs, masks, strict=True)):
                tokens[b, : t.numel()], mask_BS[b, : m.numel()] = t, m
            mb = padded_micro_batch(sample_ids, tokens, lengths=lens, row_mask_BS=mask_BS)
        index = {s: k for k, s in enumerate(sample_ids)}
        out = []
        for lay in [micro_batch_layout(mb, rows="logits")] + [
            micro_batch_layout(mb, rows="hidden", sp_size=2, sp_rank=r) for r in range(2)
        ]:
            out += [
                (index[s], p) if s >= 0 else (-1, -1)
                for s, p in zip(lay.sample_id_R.tolist(), lay.position_R.tolist(), strict=True)
            ]
        return out

    want = rows(list(range(len(ids))))
    assert sum(k >= 0 for k, _ in want) > 0
    assert rows(ids) == want


def test_token_keys_are_exact_for_every_int64_sample_id_and_encode_keys_refuses_to_wrap() -> None:
    from mopd.bridge.layout import token_keys

    top = 2**63 - 1
    ids_a = torch.tensor([top, top - 1, -1, 0, 2**62])
    pos_a = torch.tensor([5, 5, -1, 5, 0])
    ids_b = torch.tensor([top - 1, 2**62, top, 3])
    pos_b = torch.tensor([5, 1, 4, 5])
    ka, kb = token_keys([ids_a, ids_b], [pos_a, pos_b])
    assert ka[2] == -1 and bool((ka[[0, 1, 3, 4]] >= 0).all())
    pairs_a = list(zip(ids_a.tolist(), pos_a.tolist(), strict=True))
    pairs_b = list(zip(ids_b.tolist(), pos_b.tolist(), strict=True))
    for i, x in enumerate(pairs_a):  # equal keys exactly for equal (sample id, position)
        for j, y in enumerate(pairs_b):
            if x[0] >= 0:
                assert (int(ka[i]) == int(kb[j])) == (x == y), (x, y)
    assert encode_keys(torch.tensor([3]), torch.tensor([2]), 10).tolist() == [32]
    with pytest.raises(ValueError, match=r"sample id 4611686018427387904 \* stride 10"):
        encode_keys(torch.tensor([2**62]), torch.tensor([2]), 10)
