"""Tier 1: the metadata gather's summary (an all-reduce of every header word's largest and
smallest value) decides the fence exactly as reading every header does.

What a rank relies on: when the summary says the step is agreed, it is (every rank ready, at
one step, one config, error-free, one micro-batch count among those that give one, one memo
state), and the rank reads no other rank's header; when any rank differs, the summary says so
and the rank falls back to the headers, which name the difference as before.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mopd.bridge.layout import packed_layout
from mopd.bridge.metadata import (
    MEMO_STEP,
    N_SLOTS,
    SIZE,
    STATE_FAILED,
    STATE_OPEN,
    UNCHANGED,
    Section,
    StepMatrix,
    encode_step_record,
    header_summary,
    reduced_summary,
    uniform_count,
)
from mopd.bridge.record import stack_records


def _records(n: int, **change: dict[int, dict]) -> list[torch.Tensor]:
    """``n`` records of one agreed 2-micro-batch step (rank 0 holds nothing), with the
    per-rank keyword changes in ``change["at"]``."""
    lay = [packed_layout([1, 2], [5, 3]), packed_layout([3], [4])]
    sec = [Section(layouts=lay, send_runs=True, dtype=torch.bfloat16, hidden=8), None]
    out = []
    for j in range(n):
        kw: dict = {"config_sig": 7, "n_slots": 2, "error": "", "sections": sec, "step": 3}
        if j == 0:
            kw.update(n_slots=-1, sections=[None, None])
        kw.update(change.get("at", {}).get(j, {}))
        out.append(encode_step_record(**kw))
    return out


def _matrix(records: list[torch.Tensor]) -> tuple[StepMatrix, StepMatrix]:
    """The gathered matrix read with the summary, and read off its headers (no summary)."""
    m, _ = stack_records(records)
    return StepMatrix(m, reduced_summary(m[:, : SIZE + 1])), StepMatrix(m.copy())


def test_an_agreed_step_is_read_from_the_summary_alone() -> None:
    with_summary, headers = _matrix(_records(5))
    assert with_summary.uniform_slots() == 2 == headers.uniform_slots()
    assert with_summary._header is None  # no rank's header was read
    assert not with_summary.unchanged_since(0)  # no memo anywhere


@pytest.mark.parametrize(
    "change",
    [
        {"step": 4},
        {"config_sig": 8},
        {"n_slots": 3, "sections": [None, None]},
        {"state": STATE_OPEN, "error": "step 2 open"},
        {"state": STATE_FAILED, "error": "boom"},
        {"error": "bad input here"},
    ],
    ids=lambda c: next(iter(c)) if len(c) == 1 else "state",
)
def test_one_rank_that_differs_sends_every_rank_to_the_headers(change: dict) -> None:
    with_summary, headers = _matrix(_records(5, at={3: change}))
    assert with_summary.uniform_slots() is None and headers.uniform_slots() is None


def _memo(recs: list[torch.Tensor], ranks: range, step: int) -> list[torch.Tensor]:
    """The records with ``ranks`` saying their tables are those of ``step``'s memo."""
    out = [r.clone() for r in recs]
    for j in ranks:
        out[j][MEMO_STEP], out[j][UNCHANGED] = step, 1
    return out


def test_a_memo_every_record_shares_is_seen_in_the_summary() -> None:
    with_summary, headers = _matrix(_memo(_records(4), range(4), 2))
    assert with_summary.uniform_slots() == 2
    assert with_summary.unchanged_since(2) and headers.unchanged_since(2)
    assert not with_summary.unchanged_since(1)
    assert with_summary._header is None


@pytest.mark.parametrize("who", [range(1, 4), range(3)], ids=["rank 0 not", "rank 3 not"])
def test_a_memo_one_rank_lacks_is_no_memo(who: range) -> None:
    with_summary, headers = _matrix(_memo(_records(4), who, 2))
    assert with_summary.uniform_slots() == 2 == headers.uniform_slots()  # the fence holds
    assert not with_summary.unchanged_since(2) and not headers.unchanged_since(2)


def test_no_rank_holding_a_layout_is_no_count() -> None:
    recs = _records(3, at={j: {"n_slots": -1, "sections": [None, None]} for j in range(3)})
    with_summary, _ = _matrix(recs)
    assert with_summary.uniform_slots() is None


def test_the_summary_of_one_header_is_its_words_and_their_negation() -> None:
    rec = _records(2)[0]
    s = header_summary(rec[: SIZE + 1].numpy()).numpy()
    assert s[N_SLOTS] == -1 and -s[SIZE + 1 + N_SLOTS] > 2**60  # holds nothing: no count
    assert s[MEMO_STEP] == -1 and s[SIZE] == rec.numel()
    summed = np.maximum(s, header_summary(_records(2)[1][: SIZE + 1].numpy()).numpy())
    assert uniform_count(summed) == 2
