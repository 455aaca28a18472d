"""Tier 1: the routed metadata exchange, every member a thread (``tests.support.route_sim``).

What a rank relies on: on an agreed step it receives the records of the ranks it exchanges rows
with (and of those whose rows it must place its own among), not every record, and planning and
checking from them is planning and checking from every record:

- ``route_rows`` delivers every row to the member it names, once, for any member count, each
  member swapping with at most ``(radix - 1)`` members per round in ``ceil(log_radix n)``
  rounds;
- who are my peers, against the all-gather planner as the oracle (hypothesis, random meshes,
  layouts and routes): every group the planner and the checks read on the full matrix is among
  the groups whose records a rank receives, and its compact plan and verdicts from them are the
  full matrix's, for every rank;
- a step of several micro-batches whose samples move between DP ranks from one micro-batch to
  the next: the same, every micro-batch, and each rank's share of the token counts sums to the
  step's;
- the verdicts that read another rank's record alike: an agreement against its first rank (one
  that differs, one its first rank does not give), a sample two student DP ranks want;
- the exchange follows a rank's own work: a rank of 16 DP ranks holds about as many records
  as one of 4.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from mopd.bridge.catalog import GroupIndex, RunCatalog
from mopd.bridge.checks import rank_checks
from mopd.bridge.config import TeacherSpec
from mopd.bridge.coverage import check_rank, check_ranks
from mopd.bridge.inputs import Agreement
from mopd.bridge.layout import padded_layout
from mopd.bridge.mesh import Mesh
from mopd.bridge.metadata import (
    HEADER,
    SIZE,
    RaggedRecords,
    StepMatrix,
    record_heads,
    reduced_summary,
)
from mopd.bridge.peers import _stack_records, bundle_records, exchange_records
from mopd.bridge.plan import plan_rank, plan_ranks
from mopd.bridge.record import read_step, stack_records
from mopd.bridge.route import bruck_partners, route_rows
from mopd.bridge.topology import Topology
from mopd.profiling.bench import plan_job as bench_plan_job
from tests.support.plan_oracle import normalise
from tests.support.plan_sim import contiguous_step, step_records
from tests.support.route_sim import run_members
from tests.unit.test_plan import Exchange, exchanges


def _summary(records: list[torch.Tensor], n_teachers: int) -> np.ndarray:
    """What the summary's all-reduce returns for ``records`` (with the teachers' heads)."""
    matrix, sizes = stack_records(records)
    head = matrix[:, :HEADER].copy()
    head[:, SIZE] = sizes
    heads = np.stack([record_heads(r, n_teachers) for r in records]).max(axis=0)
    return np.concatenate([reduced_summary(head), heads])


def _routed(
    topo: Topology,
    records: list[torch.Tensor],
    n_slots: int,
    agreements: dict[int, list[Agreement]] | None = None,
) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """Every member's ``(records, members, words received)`` of the routed exchange."""

    def member(wire) -> tuple[np.ndarray, np.ndarray, int]:  # type: ignore[no-untyped-def]
        rank = topo.members[wire.member]
        rows, members = exchange_records(
            records[wire.member],
            wire,
            topology=topo,
            rank=rank,
            n_slots=n_slots,
            agreements=(agreements or {}).get(rank, ()),
        )
        return rows, members, wire.received_words

    return run_members(len(topo.members), member)


# --- route_rows -----------------------------------------------------------------------------


@pytest.mark.parametrize("radix", [2, 3, 8])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 9, 17, 64])
def test_rows_reach_the_member_they_name_once_in_log_rounds(n: int, radix: int) -> None:
    rng = np.random.default_rng(n * 10 + radix)
    count = rng.integers(0, 6, size=n)
    sent = {
        m: np.stack(
            [rng.integers(0, n, size=count[m]), np.full(count[m], m), np.arange(count[m])],
            axis=1,
        ).astype(np.int64)
        for m in range(n)
    }
    rounds = 0
    while radix**rounds < n:
        rounds += 1

    def member(wire):  # type: ignore[no-untyped-def]
        got = route_rows(sent[wire.member], wire, radix=radix)
        partners = {p for _, sends, frm in wire.log for p in (*sends, *frm)}
        return got, len(wire.log), partners

    out = run_members(n, member)
    for m, (got, n_rounds, partners) in enumerate(out):
        want = np.concatenate([rows[rows[:, 0] == m] for rows in sent.values()])
        assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, want.tolist()))
        assert n_rounds == rounds
        assert len(partners) <= 2 * (radix - 1) * rounds
        assert m not in partners
    # the partners of a round are what both ends expect
    to, frm = bruck_partners(9, 4, 3, 3)
    assert to == [7, 1] and frm == [1, 7]


# --- who are my peers: the all-gather planner as the oracle ------------------------------------


def _same_as_gathered(
    topo: Topology, records: list[torch.Tensor], n_slots: int, *, local_copy: bool = True
) -> list[int]:
    """Route the step, and check every rank's plans and verdicts from its records against
    every record's; returns how many records each member holds."""
    dense, _ = stack_records(records)
    full = read_step(topo, StepMatrix(dense), n_slots)
    held = []
    for j, (rows, members, _) in enumerate(_routed(topo, records, n_slots)):
        rank = topo.members[j]
        routed = read_step(topo, StepMatrix(rows, None, members), n_slots)
        assert j in members.tolist()
        held.append(members.size)
        for i in range(n_slots):
            cat, source_ids, dest_ids = full.catalogs[i].recording_reads()
            want = normalise(plan_rank(cat, rank, local_copy=local_copy, compact=True))
            verdicts = check_rank(cat, rank)
            # every group the full matrix's planner and checks read that shares a sample with
            # the rank's own groups, or with the destinations its sources serve, is here: a
            # source that shares one with them, a destination that shares one with its sources
            # (two destinations that want one sample have nothing to exchange)
            src_s, dst_s = _samples(full.catalogs[i])  # (not through the recording catalog)
            ix = topo.index
            sent = src_s_of(ix, rank, src_s)
            own = sent | {x for d in ix.dest_groups.get(rank, ()) for x in dst_s[d]}
            served = set().union(*(dst_s[d] for d in dest_ids if dst_s[d] & sent))
            assert {g for g in source_ids if src_s[g] & (own | served)} <= set(
                routed.source_ids.tolist()
            ), (rank, i)
            assert {d for d in dest_ids if dst_s[d] & sent} <= set(routed.dest_ids.tolist()), (
                rank,
                i,
            )
            mine = routed.catalogs[i]
            got = normalise(plan_rank(mine, rank, local_copy=local_copy, compact=True))
            assert got == want, (rank, i)
            assert check_rank(mine, rank) == verdicts, (rank, i)
        # every micro-batch at once, from the routed records: each one's plan and verdicts
        cats = [routed.catalogs[i] for i in range(n_slots)]
        together = plan_ranks(cats, rank, local_copy=local_copy, compact=True)
        alone = [
            plan_rank(full.catalogs[i], rank, local_copy=local_copy, compact=True)
            for i in range(n_slots)
        ]
        assert [normalise(x) for x in together] == [normalise(x) for x in alone], rank
        assert check_ranks(cats, rank) == [
            check_rank(full.catalogs[i], rank) for i in range(n_slots)
        ]
    return held


def _samples(cat: RunCatalog) -> tuple[list[set[int]], list[set[int]]]:
    """Every source's and destination's sample ids in one micro-batch (from the full matrix)."""
    return (
        [set(cat.source_runs(g)[:, 0].tolist()) for g in range(len(cat.sources))],
        [set(cat.dest_runs(d)[:, 0].tolist()) for d in range(len(cat.dests))],
    )


def src_s_of(ix: GroupIndex, rank: int, src_s: list[set[int]]) -> set[int]:
    """The samples of ``rank``'s source groups."""
    return {x for g in ix.source_groups.get(rank, ()) for x in src_s[g]}


def _one_micro_batch(ex: Exchange) -> tuple[Topology, list[torch.Tensor]]:
    return step_records(
        ex.teachers,
        ex.student,
        [(ex.teacher_layouts, ex.student_layouts, ex.rank_layouts)],
        per_rank_dests=ex.rank_layouts is not None,
    )


@given(ex=exchanges())
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_routed_records_plan_and_check_as_every_record_does(ex: Exchange) -> None:
    topo, records = _one_micro_batch(ex)
    _same_as_gathered(topo, records, 1, local_copy=ex.local_copy)


@given(ex=exchanges(contiguous=True))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_routed_records_of_contiguous_samples_plan_as_every_record_does(ex: Exchange) -> None:
    topo, records = _one_micro_batch(ex)
    _same_as_gathered(topo, records, 1, local_copy=ex.local_copy)


def test_a_step_whose_samples_move_between_micro_batches() -> None:
    teachers = [Mesh(tp=2, dp=4), Mesh(tp=1, dp=3, rank_offset=2)]
    student = Mesh(tp=2, cp=2, dp=3)
    micro = []
    for i in range(4):
        tl, sl = contiguous_step(
            teachers, student, num_samples=12, max_len=9, kinds=["thd", "sbh", "bsh"], seed=i
        )
        micro.append((tl, sl, None))
    topo, records = step_records(teachers, student, micro)
    held = _same_as_gathered(topo, records, 4)
    assert min(held) < len(topo.members)  # some rank does not read every record
    # each rank's share of the token counts: the step's, summed over the ranks
    dense, _ = stack_records(records)
    full = read_step(topo, StepMatrix(dense), 4)
    shares = sum(full.led_tokens_I(r) for r in topo.members)
    assert np.array_equal(shares, full.tokens_I())


# --- the verdicts that read another rank's record --------------------------------------------

TEACHER, STUDENT = Mesh(tp=2, dp=4), Mesh(tp=2, dp=4)


def _verdicts(
    records: list[torch.Tensor], topo: Topology, agreements: dict[int, list[Agreement]]
) -> tuple[list[list[str]], list[list[str]]]:
    """Every rank's :func:`rank_checks` from every record and from its routed ones."""
    summary = _summary(records, 1)
    dense, _ = stack_records(records)
    spec = [TeacherSpec(mesh=TEACHER, hidden_size=8, dtype=torch.bfloat16)]
    out: tuple[list[list[str]], list[list[str]]] = ([], [])
    routed = _routed(topo, records, 2, agreements)
    for j, rank in enumerate(topo.members):
        rows, members, _ = routed[j]
        for k, matrix in enumerate(
            (StepMatrix(dense, summary), StepMatrix(rows, summary, members))
        ):
            view = read_step(topo, matrix, 2)
            out[k].append(
                rank_checks(
                    matrix,
                    view.catalogs,
                    topology=topo,
                    teachers=spec,
                    student=STUDENT,
                    rank=rank,
                    duplicate_samples=False,
                    agreements=agreements.get(rank, ()),
                )
            )
    return out


def test_agreements_and_duplicate_samples_are_judged_alike() -> None:
    micro = []
    for i in range(2):
        layouts = {(d, 0): padded_layout([10 * i + d, 10 * i + d + 4], 6) for d in range(4)}
        wanted = dict(layouts)
        if i == 1:  # DP 3 also wants DP 1's first sample
            wanted[(3, 0)] = padded_layout([11, 13, 17], 6, order="bsh")
        micro.append(([layouts], wanted, None))
    replica = tuple(range(0, 8, 2))
    agreements = {
        r: [
            Agreement(what="shapes", ranks=replica, fields=("s",), words=(16 + (r == 4),)),
            # rank 6's first rank (7) gives none of these
            *([Agreement(what="more", ranks=(7, 6), fields=("s",), words=(1,))] if r == 6 else []),
        ]
        for r in replica
    }
    topo, records = step_records([TEACHER], STUDENT, micro, agreements=agreements)
    full, routed = _verdicts(records, topo, agreements)
    assert full == routed
    text = "\n".join(p for ps in full for p in ps)
    assert "global rank 7 gives none, global rank 6 does" in text
    assert "s 17 on global rank 4, 16 on global rank 0" in text
    assert "sample id 11 is wanted by student DP ranks 1 and 3" in text


@pytest.mark.parametrize("held", ["in_order", "as_received"])
def test_unpadded_records_read_as_the_padded_matrix(held: str) -> None:
    """What a routed exchange holds (some members' records only, unpadded) reads word for
    word as the all-gather's zero-padded matrix: rows, slot fields and tables, runs,
    agreements and section heads. ``in_order``: the records one after another by member;
    ``as_received``: where the exchange received them (its own, its peers', a forwarded
    bundle with its header words between them and a stale second copy of a peer's record,
    which must not be read)."""
    micro = []
    for i in range(2):
        layouts = {(d, 0): padded_layout([10 * i + d, 10 * i + d + 4], 6) for d in range(4)}
        micro.append(([layouts], dict(layouts), None))
    agreements = {
        r: [Agreement(what="shapes", ranks=(0, 2), fields=("s",), words=(16,))] for r in (0, 2)
    }
    topo, records = step_records([TEACHER], STUDENT, micro, agreements=agreements)
    dense, sizes = stack_records(records)
    some = np.asarray([0, 2, 3, 6], dtype=np.int64)  # members whose records are held
    rec = {j: dense[j, : sizes[j]].copy() for j in some.tolist()}
    if held == "in_order":
        ragged = RaggedRecords.of([rec[j] for j in some.tolist()])
    else:
        stale = rec[6] + 1  # a second copy that differs: the first copy is the one read
        ragged, members = _stack_records(
            2,
            rec[2],
            [0, 6],
            np.concatenate([rec[0], rec[6]]),
            [rec[0].size, rec[6].size],
            [bundle_records({3: rec[3], 6: stale})],
        )
        assert members.tolist() == some.tolist()
    full, routed = StepMatrix(dense), StepMatrix(ragged, None, some)
    n_sec = topo.student_section + 1
    for j in some.tolist():
        assert np.array_equal(routed.row(j), dense[j, : sizes[j]])
        assert routed.agreements(j).keys() == full.agreements(j).keys()
        for sec in range(n_sec):
            if full.row(j)[HEADER + sec]:
                assert routed.section_head(j, sec) == full.section_head(j, sec)
    for sec in range(n_sec):
        holders = [j for j in some.tolist() if full.row(j)[HEADER + sec]]
        if not holders:
            continue
        m = np.asarray(holders, dtype=np.int64)
        for slot in range(2):
            assert np.array_equal(routed.slot_fields(m, sec, slot), full.slot_fields(m, sec, slot))
        kw = {"n_sections": n_sec, "n_slots": 2}
        assert np.array_equal(routed.slot_tables(m, sec, **kw), full.slot_tables(m, sec, **kw))
        senders = [j for j in holders if full.slot_fields(np.asarray([j]), sec, 0)[0, 1] >= 0]
        if senders:
            x = np.asarray(senders, dtype=np.int64)
            args = (x, np.full(x.size, sec), np.zeros(x.size, dtype=np.int64))
            got, want = routed.runs_many(*args), full.runs_many(*args)
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    with pytest.raises(AssertionError, match="were not routed here"):
        routed.row(1)


# --- the exchange follows a rank's own work ------------------------------------------------------


def test_a_rank_holds_as_many_records_in_a_larger_job() -> None:
    held = {}
    for ranks in (64, 256):
        step = bench_plan_job.build_step(ranks, tokens_per_rank=1024, max_len=512, micro_batches=2)
        records = [
            torch.from_numpy(step.matrix_NW[j, : step.sizes_N[j]].copy()) for j in range(ranks)
        ]
        out = _routed(step.topology, records, 2)
        held[ranks] = max(members.size for _, members, _ in out)
    assert held[256] <= 1.5 * held[64] < 64, held
