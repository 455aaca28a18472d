"""Layouts built as runs: ``padded_layout`` / ``packed_layout`` hand the exact runs of the
per-row path (sort the keys, cut where a run ends) on random shapes, CP, SP, packing and masks,
so the record's runs and digests do not depend on which path built them."""

from __future__ import annotations

import itertools
import pickle

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mopd.bridge.layout import (
    TokenLayout,
    _row_runs,
    layout_from_runs,
    layout_to_runs,
    megatron_padded_length,
    packed_layout,
    packed_layouts,
    padded_layout,
)

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _same_runs(layout: TokenLayout) -> None:
    built = layout.__dict__.get("_runs_K5")
    assert built is not None, "the constructor attached no runs"
    rows = _row_runs(layout)
    assert torch.equal(built, rows), (built.tolist(), rows.tolist())
    assert layout_to_runs(layout) is built
    back = layout_from_runs(built, layout.num_rows)
    assert back.same_as(layout)


@st.composite
def padded_cases(draw: st.DrawFn) -> dict:
    cp = draw(st.sampled_from([1, 1, 2, 3, 4]))
    sp = draw(st.sampled_from([1, 1, 2, 4]))
    unit = (2 * cp if cp > 1 else 1) * sp
    seq = unit * draw(st.integers(0, 6))
    b = draw(st.integers(0, 5))
    ids = draw(st.lists(st.integers(0, 40), min_size=b, max_size=b, unique=True))
    lengths = draw(st.one_of(st.none(), st.lists(st.integers(0, seq), min_size=b, max_size=b)))
    return {
        "sample_ids": ids,
        "seq_len": seq,
        "order": draw(st.sampled_from(["sbh", "bsh"])),
        "lengths": lengths,
        "cp_size": cp,
        "cp_rank": draw(st.integers(0, cp - 1)),
        "sp_size": sp,
        "sp_rank": draw(st.integers(0, sp - 1)),
    }


@given(case=padded_cases())
@SETTINGS
def test_padded_layout_runs_equal_the_per_row_runs(case: dict) -> None:
    _same_runs(padded_layout(**case))


@st.composite
def packed_cases(
    draw: st.DrawFn, cp: int | None = None, sp: int | None = None, unique: bool = True
) -> dict:
    cp = draw(st.sampled_from([1, 1, 2, 3, 4])) if cp is None else cp
    sp = draw(st.sampled_from([1, 1, 2, 4])) if sp is None else sp
    n = draw(st.integers(0, 6))
    ids = draw(st.lists(st.integers(0, 40), min_size=n, max_size=n, unique=unique))
    lens = draw(st.lists(st.integers(0, 37), min_size=n, max_size=n))
    extra = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))  # more padding than needed
    mult = megatron_padded_length(1, cp_size=cp, sp_size=sp)
    padded = [
        megatron_padded_length(x, cp_size=cp, sp_size=sp) + e * mult
        for x, e in zip(lens, extra, strict=True)
    ]
    cu = np.concatenate([[0], np.cumsum(padded)]).astype(np.int64).tolist()
    return {
        "sample_ids": ids,
        "seq_lens": lens,
        "cu_seqlens_padded": cu if draw(st.booleans()) else None,
        "cp_size": cp,
        "cp_rank": draw(st.integers(0, cp - 1)),
        "sp_size": sp,
        "sp_rank": draw(st.integers(0, sp - 1)),
    }


def _packed_rows(case: dict) -> tuple[list[int], list[int]]:
    """The packed layout's rows written out sequence by sequence (the oracle)."""
    cp, r = case["cp_size"], case["cp_rank"]
    lens = case["seq_lens"]
    cu = case["cu_seqlens_padded"]
    if cu is None:
        pads = [megatron_padded_length(x, cp_size=cp, sp_size=case["sp_size"]) for x in lens]
    else:
        pads = [b - a for a, b in itertools.pairwise(cu)]
    sample, pos = [], []
    for sid, n, pad in zip(case["sample_ids"], lens, pads, strict=True):
        if cp > 1:
            c = pad // (2 * cp)
            mine = [*range(r * c, (r + 1) * c), *range((2 * cp - 1 - r) * c, (2 * cp - r) * c)]
        else:
            mine = list(range(pad))
        for p in mine:
            sample.append(sid if p < n else -1)
            pos.append(p if p < n else -1)
    k = len(sample) // case["sp_size"]
    sl = slice(case["sp_rank"] * k, (case["sp_rank"] + 1) * k)
    return sample[sl], pos[sl]


@given(case=packed_cases())
@SETTINGS
def test_packed_layout_runs_equal_the_per_row_runs(case: dict) -> None:
    lay = packed_layout(**case)
    sample, pos = _packed_rows(case)  # the rows too: built from the runs, they must be right
    assert lay.sample_id_R.tolist() == sample and lay.position_R.tolist() == pos
    _same_runs(lay)


@st.composite
def packed_steps(draw: st.DrawFn) -> list[dict]:
    """A step's micro-batches on one rank (its CP and SP ranks); some may repeat a sample id
    (those build their rows), some may be empty."""
    cp = draw(st.sampled_from([1, 2, 3, 4]))
    sp = draw(st.sampled_from([1, 2, 4]))
    cp_rank, sp_rank = draw(st.integers(0, cp - 1)), draw(st.integers(0, sp - 1))
    n_mb = draw(st.integers(0, 5))
    cases = [draw(packed_cases(cp, sp, unique=draw(st.booleans()))) for _ in range(n_mb)]
    given_cu = draw(st.booleans())
    for c in cases:
        c.update(cp_rank=cp_rank, sp_rank=sp_rank)
        if not given_cu:
            c["cu_seqlens_padded"] = None
        elif c["cu_seqlens_padded"] is None:  # every micro-batch given its offsets
            pads = [megatron_padded_length(x, cp_size=cp, sp_size=sp) for x in c["seq_lens"]]
            c["cu_seqlens_padded"] = np.concatenate([[0], np.cumsum(pads)]).astype(int).tolist()
    return cases


@given(cases=packed_steps())
@SETTINGS
def test_packed_layouts_of_a_step_are_each_micro_batch_s_packed_layout(cases: list[dict]) -> None:
    """One call for a step's micro-batches gives every micro-batch the rows and runs its own
    :func:`packed_layout` gives (bit-equal; no runs where that has none)."""
    kw = {k: cases[0][k] for k in ("cp_size", "cp_rank", "sp_size", "sp_rank")} if cases else {}
    given_cu = bool(cases) and cases[0]["cu_seqlens_padded"] is not None
    step = packed_layouts(
        [torch.tensor(c["sample_ids"], dtype=torch.int64) for c in cases],
        [c["seq_lens"] for c in cases],
        cu_seqlens_padded=[c["cu_seqlens_padded"] for c in cases] if given_cu else None,
        **kw,
    )
    assert len(step) == len(cases)
    for lay, c in zip(step, cases, strict=True):
        one = packed_layout(**c)
        sample, pos = _packed_rows(c)
        num_rows = lay.num_rows  # read before the rows are made (a layout of runs makes them late)
        copy = pickle.loads(pickle.dumps(lay))  # what is pickled is the rows, made here
        assert lay.sample_id_R.tolist() == sample and lay.position_R.tolist() == pos
        assert num_rows == len(sample) and copy.same_as(lay) and copy.num_rows == num_rows
        assert lay.same_as(one)
        if "_runs_K5" in one.__dict__:
            assert torch.equal(lay.__dict__["_runs_K5"], one.__dict__["_runs_K5"])
            _same_runs(lay)
        else:
            assert "_runs_K5" not in lay.__dict__


def test_packed_layouts_name_the_micro_batch_of_bad_input() -> None:
    kw = {"cp_size": 2, "cp_rank": 0}
    with pytest.raises(
        ValueError,
        match=r"micro-batch 1: packed sequence 0 \(sample 9\) has "
        r"padded length 6, not divisible by 2\*cp = 4",
    ):
        packed_layouts([[1], [9]], [[3], [5]], cu_seqlens_padded=[[0, 4], [0, 6]], **kw)
    with pytest.raises(ValueError, match=r"micro-batch 2: 2 sample ids but 1 sequence lengths"):
        packed_layouts([[1], [2], [3, 4]], [[1], [1], [1]], **kw)
    with pytest.raises(ValueError, match=r"2 micro-batches of sample ids but 1 of sequence"):
        packed_layouts([[1], [2]], [[1]], **kw)
    with pytest.raises(ValueError, match=r"micro-batch 1: cu_seqlens_padded must be 2 offsets "):
        packed_layouts([[1], [2]], [[3], [4]], cu_seqlens_padded=[[0, 4], [1, 4]], **kw)
    with pytest.raises(ValueError, match=r"micro-batch 0: cu_seqlens_padded must be 2 offsets "):
        packed_layouts([[1], [2]], [[3], [4]], cu_seqlens_padded=[[0], [0, 4]], **kw)
    with pytest.raises(ValueError, match=r"micro-batch 1: sample ids and sequence lengths must"):
        packed_layouts([[1], [2]], [[1], [-1]], **kw)
    with pytest.raises(ValueError, match=r"^packed sequence 0 \(sample 9\)"):  # one: no prefix
        packed_layout([9], [5], cu_seqlens_padded=[0, 6], **kw)


def test_packed_layout_with_a_repeated_sample_id_builds_its_rows() -> None:
    case = {
        "sample_ids": [5, 5, 2],
        "seq_lens": [3, 6, 1],
        "cu_seqlens_padded": None,
        "cp_size": 2,
        "cp_rank": 1,
        "sp_size": 2,
        "sp_rank": 0,
    }
    lay = packed_layout(**case)
    assert "_runs_K5" not in lay.__dict__
    sample, pos = _packed_rows(case)
    assert lay.sample_id_R.tolist() == sample and lay.position_R.tolist() == pos


def test_a_repeated_sample_id_takes_the_per_row_path() -> None:
    lay = padded_layout([3, 3], 4, lengths=[2, 4])
    assert "_runs_K5" not in lay.__dict__
    assert torch.equal(layout_to_runs(lay), _row_runs(lay))


def test_per_row_runs_of_sample_ids_near_the_top_of_int64_stay_in_key_order() -> None:
    """Rows of ids near ``2**63`` (a combined ``id * stride + position`` key would wrap) give
    runs sorted by ``(sample_id, position)``, one per sample, inverted exactly."""
    top = 2**63 - 1
    sample_R = torch.tensor([top, 7, top, 7, top, 2**62, -1, 2**62])
    pos_R = torch.tensor([0, 0, 1, 1, 2, 0, -1, 1])
    layout = TokenLayout(sample_id_R=sample_R, position_R=pos_R)
    runs = _row_runs(layout)
    assert runs[:, 0].tolist() == [7, 2**62, top]
    assert runs[:, 1].tolist() == [0, 0, 0] and runs[:, 4].tolist() == [2, 2, 3]
    assert layout_from_runs(runs, layout.num_rows).same_as(layout)
