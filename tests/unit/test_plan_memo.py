"""The plan memo: a step whose records all say their tables are unchanged since the memo's step
reuses the memo's records and plan keys without exchanging or reading any group's table; any
rank that changed, or another memo step, makes every rank exchange and read the tables again.
Keys and token counts are those a fresh reading gives, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mopd.bridge.metadata import (
    HEADER,
    MEMO_STEP,
    SIZE,
    UNCHANGED,
    StepMatrix,
    encode_step_record,
    record_heads,
    record_tables,
    reduced_summary,
    reuses_memo,
)
from mopd.bridge.offline import OfflineBridge
from mopd.bridge.peers import exchange_records
from mopd.bridge.record import read_step
from mopd.bridge.step import BridgeStep
from mopd.profiling.bench import plan_job as bench_plan_job


@pytest.fixture(scope="module", params=[False, True], ids=["replicas", "sp_shards"])
def step(request: pytest.FixtureRequest) -> bench_plan_job.Step:
    return bench_plan_job.build_step(
        64, tokens_per_rank=256, max_len=200, micro_batches=3, sp_shards=request.param
    )


def _plan(step: bench_plan_job.Step, bridge: OfflineBridge, matrix: StepMatrix) -> BridgeStep:
    t_lay, s_lay = bench_plan_job.rank_layouts(step, bridge.rank)
    return bridge.plan(matrix, bridge.record({0: t_lay}, s_lay))


def _summary(step: bench_plan_job.Step, memo_NH: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """The summary's all-reduce when every rank's record says ``(memo_step, unchanged)``."""
    head = step.matrix_NW[:, :HEADER].copy()
    head[:, MEMO_STEP], head[:, UNCHANGED] = memo_NH
    head[:, SIZE] = step.sizes_N
    return np.concatenate([reduced_summary(head), record_heads(step.matrix_NW[0], 1)])


def _exchanged(step: bench_plan_job.Step, rank: int, summary: np.ndarray) -> StepMatrix:
    """``rank``'s routed records (every member playing its part, simulated)."""
    member = step.topology.member_index(rank)
    sim = bench_plan_job.simulate_exchange(bench_plan_job.exchange_job(step), member)
    rows, members = exchange_records(
        step.matrix_NW[member, : step.sizes_N[member]],
        sim.wire(step.ranks),
        topology=step.topology,
        rank=rank,
        n_slots=3,
    )
    return StepMatrix(rows, summary, members)


def _fresh_keys(step: bench_plan_job.Step, rank: int, matrix: StepMatrix, extra: bytes) -> list:
    copy = StepMatrix(matrix.matrix.copy(), None, matrix.members)
    return read_step(step.topology, copy, 3).plan_keys(rank, extra)


def _every(step: bench_plan_job.Step, value: int) -> np.ndarray:
    return np.full(step.ranks, value, dtype=np.int64)


@pytest.mark.parametrize("pick", [0, 1, 2])
def test_a_repeated_step_reuses_the_memo_and_equals_a_fresh_reading(
    step: bench_plan_job.Step, pick: int
) -> None:
    rank = bench_plan_job.representative_ranks(step.ranks)[pick]
    bridge = bench_plan_job.offline_bridge(step, rank)
    first = _plan(step, bridge, _exchanged(step, rank, _summary(step, (_every(step, -1), 0))))
    assert "source_GIF" in first._view.__dict__  # no memo yet: the tables were read
    memo = bridge.bridge._memo
    assert memo is not None and memo.step == 0 and memo.members is not None
    summary = _summary(step, (_every(step, 0), 1))  # every record: memo step 0, unchanged
    assert reuses_memo(summary, 0)
    matrix = StepMatrix(memo.matrix, summary, memo.members)  # what the bridge then reads
    again = _plan(step, bridge, matrix)
    view = again._view
    assert "source_GIF" not in view.__dict__ and "dest_DIF" not in view.__dict__
    extra = bridge.bridge._key_extra(matrix)
    assert list(bridge.bridge._memo.keys) == _fresh_keys(step, rank, matrix, extra)
    want = read_step(step.topology, StepMatrix(step.matrix_NW), 3).tokens_I()
    assert again.global_tokens() == int(want.sum())
    assert [again.global_tokens(i) for i in range(3)] == want.tolist()
    assert bridge.executor.schedules_built == len(
        [s for s in first._slots if s.schedule is not None]
    )  # nothing planned twice


@pytest.mark.parametrize("change", ["one rank changed", "another memo step"])
def test_a_step_that_differs_anywhere_reads_the_tables_again(
    step: bench_plan_job.Step, change: str
) -> None:
    rank = bench_plan_job.representative_ranks(step.ranks)[0]
    bridge = bench_plan_job.offline_bridge(step, rank)
    _plan(step, bridge, _exchanged(step, rank, _summary(step, (_every(step, -1), 0))))
    memo_N, unchanged_N = _every(step, 0), _every(step, 1)
    far = step.ranks - 1  # a rank far from this one's groups
    if change == "one rank changed":
        unchanged_N[far] = 0
    else:
        memo_N[far] = 5
    summary = _summary(step, (memo_N, unchanged_N))
    assert not reuses_memo(summary, 0)  # every rank exchanges its records again
    matrix = _exchanged(step, rank, summary)
    assert matrix.uniform_slots() == 3 and not matrix.unchanged_since(0)
    again = _plan(step, bridge, matrix)
    assert "source_GIF" in again._view.__dict__
    assert list(bridge.bridge._memo.keys) == _fresh_keys(
        step, rank, matrix, bridge.bridge._key_extra(matrix)
    )


def test_the_record_says_unchanged_only_for_equal_tables(step: bench_plan_job.Step) -> None:
    from mopd.bridge.layout import packed_layout
    from mopd.bridge.metadata import Section

    lay = [packed_layout([1, 2], [5, 3]), packed_layout([3], [4])]
    sec = [Section(layouts=lay, send_runs=True, dtype=torch.bfloat16, hidden=8), None]
    rec = encode_step_record(config_sig=1, n_slots=2, error="", sections=sec)
    tables = record_tables(rec)
    assert rec[MEMO_STEP] == -1 and rec[UNCHANGED] == 0
    same = encode_step_record(
        config_sig=1, n_slots=2, error="", sections=sec, memo_step=4, memo_tables=tables
    )
    assert same[MEMO_STEP] == 4 and same[UNCHANGED] == 1
    assert np.array_equal(record_tables(same), tables)
    other = [packed_layout([1, 2], [5, 2]), lay[1]]  # one token fewer in micro-batch 0
    sec2 = [Section(layouts=other, send_runs=True, dtype=torch.bfloat16, hidden=8), None]
    changed = encode_step_record(
        config_sig=1, n_slots=2, error="", sections=sec2, memo_step=4, memo_tables=tables
    )
    assert changed[MEMO_STEP] == 4 and changed[UNCHANGED] == 0


def test_a_changed_agreement_or_error_text_is_a_changed_record() -> None:
    """Unchanged means the whole record past its header: what another rank reads of it."""
    from mopd.bridge.inputs import Agreement
    from mopd.bridge.layout import packed_layout
    from mopd.bridge.metadata import Section

    lay = [packed_layout([1, 2], [5, 3])]
    sec = [Section(layouts=lay, send_runs=True, dtype=torch.bfloat16, hidden=8), None]
    agree = Agreement(what="shapes", ranks=(0, 1), fields=("s",), words=(16,))
    base = {"config_sig": 1, "n_slots": 1, "error": "", "sections": sec, "agreements": [agree]}
    tables = record_tables(encode_step_record(**base))
    again = encode_step_record(**base, memo_step=0, memo_tables=tables, step=1)
    assert again[UNCHANGED] == 1  # another step, the same record past the header
    other = Agreement(what="shapes", ranks=(0, 1), fields=("s",), words=(32,))
    changed = encode_step_record(
        **{**base, "agreements": [other]}, memo_step=0, memo_tables=tables, step=1
    )
    assert changed[UNCHANGED] == 0
