"""Tier 1: the local planner (``plan_rank`` / ``check_rank``) against the per-token oracle.

Random meshes (1-3 teachers, tp / cp / dp / pp, colocated or disjoint), random layouts
(``[S, B, H]``, ``[B, S, H]``, THD, rows reversed), ``local_copy`` on and off, one destination
per TP group or per rank: every rank's local plan, put together, is the oracle's global plan;
the plans deliver every key bit-exactly; both ends of every transfer derive the same segments;
chunks are balanced over the replicas; ``check_rank`` over all ranks finds exactly the oracle's
verdicts; and a rank reads only the groups whose sample range meets its own groups'.
"""

from __future__ import annotations

import random
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mopd.bridge import Mesh, TokenLayout
from mopd.bridge.catalog import DestGroup, GroupIndex, RunCatalog, SourceGroup
from mopd.bridge.coverage import check_rank, check_ranks
from mopd.bridge.plan import RankPlan, plan_rank, plan_ranks
from mopd.profiling.synthetic import SideFormat, synthetic_step
from tests.support.plan_oracle import (
    compose,
    normalise,
    oracle_plans,
    oracle_verdicts,
    token_pairs,
)
from tests.support.plan_sim import (
    SimStep,
    contiguous_step,
    deliver,
    expected_slice,
    key_sources,
    keys_of,
    simulate,
)

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_KINDS = ("sbh", "bsh", "thd")


# --- random exchanges ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, eq=False)
class Exchange:
    """A drawn exchange: meshes, layouts, and how the bridge plans it."""

    teachers: list[Mesh]
    student: Mesh
    teacher_layouts: list[dict[tuple[int, int], TokenLayout]]
    student_layouts: dict[tuple[int, int], TokenLayout]
    rank_layouts: dict[int, TokenLayout] | None
    route: dict[int, int] | None
    local_copy: bool

    def sim(self) -> SimStep:
        return simulate(
            self.teachers,
            self.student,
            self.teacher_layouts,
            self.student_layouts,
            per_rank_dests=self.rank_layouts is not None,
            student_rank_layouts=self.rank_layouts,
        )

    def dest_layout(self, rank: int) -> TokenLayout:
        if self.rank_layouts is not None:
            return self.rank_layouts[rank]
        c = self.student.coord(rank)
        assert c is not None
        return self.student_layouts[(c.dp_rank, c.cp_rank)]


def _flip(layout: TokenLayout) -> TokenLayout:
    """The same keys in reverse row order (runs with negative steps)."""
    return TokenLayout(
        sample_id_R=layout.sample_id_R.flip(0).contiguous(),
        position_R=layout.position_R.flip(0).contiguous(),
    )


def _rank_layouts(student: Mesh, shards: dict[tuple[int, int], TokenLayout]) -> dict:
    """Per last-stage student rank, its TP rank's contiguous part of its shard's rows."""
    out = {}
    for r in student.last_stage_ranks():
        c = student.coord(r)
        assert c is not None
        lay = shards[(c.dp_rank, c.cp_rank)]
        part = np.array_split(np.arange(lay.num_rows), student.tp)[c.tp_rank]
        rows = torch.from_numpy(part)
        out[r] = TokenLayout(
            sample_id_R=lay.sample_id_R[rows].contiguous(),
            position_R=lay.position_R[rows].contiguous(),
        )
    return out


@st.composite
def meshes(draw: st.DrawFn, offset: int) -> Mesh:
    return Mesh(
        tp=draw(st.integers(1, 3)),
        cp=draw(st.integers(1, 2)),
        dp=draw(st.integers(1, 3)),
        pp=draw(st.integers(1, 2)),
        rank_offset=offset,
    )


@st.composite
def exchanges(draw: st.DrawFn, *, contiguous: bool = False) -> Exchange:
    colocated = draw(st.booleans())
    teachers: list[Mesh] = []
    at = 0
    for _ in range(draw(st.integers(1, 3))):
        m = draw(meshes(draw(st.integers(0, 2)) if colocated else at))
        teachers.append(m)
        at += m.size
    student = draw(meshes(draw(st.integers(0, 2)) if colocated else at))
    kinds = [draw(st.sampled_from(_KINDS)) for _ in range(len(teachers) + 1)]
    seed = draw(st.integers(0, 2**31 - 1))
    route: dict[int, int] | None = None
    if contiguous:
        tl, sl = contiguous_step(
            teachers,
            student,
            num_samples=draw(st.integers(1, 16)),
            max_len=draw(st.integers(1, 13)),
            kinds=kinds,
            seed=seed,
        )
    else:
        step = synthetic_step(
            teachers=teachers,
            student=student,
            num_samples=draw(st.integers(1, 9)),
            max_len=draw(st.integers(1, 13)),
            teacher_formats=[
                SideFormat(kind=k, micro_batch=draw(st.integers(1, 3))) for k in kinds[:-1]
            ],
            student_format=SideFormat(
                kind=kinds[-1],
                micro_batch=draw(st.integers(1, 3)),
                pad_multiple=draw(st.integers(1, 3)),
            ),
            seed=seed,
        )
        tl = [dict(x) for x in step.teacher_layouts]
        sl = dict(step.student_layouts)
        route = dict(zip(step.sample_ids.tolist(), step.route.tolist(), strict=True))
    if draw(st.booleans()):  # some buffers hold their rows backwards
        o = draw(st.integers(0, len(teachers)))
        side = sl if o == len(teachers) else tl[o]
        side.update({k: _flip(v) for k, v in side.items()})
    per_rank = draw(st.sampled_from([False, False, True]))
    return Exchange(
        teachers=teachers,
        student=student,
        teacher_layouts=tl,
        student_layouts=sl,
        rank_layouts=_rank_layouts(student, sl) if per_rank else None,
        route=route,
        local_copy=draw(st.booleans()),
    )


def _source_group(sim: SimStep, owner: int, rank: int) -> int:
    (g,) = [
        g for g in sim.catalog.index().source_groups[rank] if sim.topology.sources[g].owner == owner
    ]
    return g


# --- (a) - (d): plans ------------------------------------------------------------------------


def _check_plans(
    ex: Exchange, sim: SimStep, plans: dict[int, RankPlan], *, compact: bool = False
) -> None:
    cat, members = sim.catalog, sim.topology.members
    # (a) the local plans, put together, are the oracle's global plan
    assert compose(plans) == compose(
        oracle_plans(cat, local_copy=ex.local_copy, ranks=members, compact=compact)
    )
    # (b) every destination row gets its key, bit-exact; rows nobody fills stay untouched
    sources = key_sources(ex.teachers, ex.teacher_layouts, members)
    got = deliver(plans, sources)
    for r, bufs in got.items():
        plan = plans[r]
        assert plan.dest is not None and plan.owner_N is not None
        for o, buf in bufs.items():
            assert np.array_equal(buf, expected_slice(plan, ex.dest_layout(r), o)), (r, o)
        real = keys_of(ex.dest_layout(r)) >= 0
        assert np.array_equal(plan.owner_N >= 0, real)  # every needed row has an owner
        if ex.route is not None:
            sample = ex.dest_layout(r).sample_id_R.numpy()
            want = np.asarray([ex.route.get(int(s), -1) for s in sample], dtype=np.int64)
            assert np.array_equal(plan.owner_N, np.where(real, want, -1))
    # (c) both ends of every transfer derive the same segments; rows stay in their buffers
    recvs = {(t.owner, t.src_rank, r): t for r, p in plans.items() for t in p.recvs}
    n_sends = 0
    for r, p in plans.items():
        for t in p.sends:
            n_sends += 1
            other = recvs[(t.owner, r, t.dst_rank)]
            assert np.array_equal(t.segments_S5, other.segments_S5)
        for t in p.locals:
            assert t.src_rank == t.dst_rank == r
        for t in (*p.sends, *p.recvs, *p.locals):
            src, dst = token_pairs(t.segments_S5)
            dest = plans[t.dst_rank].dest
            assert dest is not None
            n = dest.slice_real(t.owner) if dest.compact else dest.slice_rows
            assert ((dst >= 0) & (dst < n)).all()
            assert ((src >= 0) & (src < sources[(t.src_rank, t.owner)].size)).all()
            assert (np.diff(dst) > 0).all()  # destination-row order
            seg = t.segments_S5
            assert (seg[:, 4] > 0).all()
            # run form: no two consecutive segments of a step-1 transfer continue each other
            cont = (
                (seg[1:, 1] == seg[:-1, 1])
                & (seg[1:, 3] == seg[:-1, 3])
                & (seg[1:, 0] == seg[:-1, 0] + seg[:-1, 4] * seg[:-1, 1])
                & (seg[1:, 2] == seg[:-1, 2] + seg[:-1, 4] * seg[:-1, 3])
            )
            assert not cont.any()
    assert n_sends == len(recvs)
    # (d) a block's chunks go to distinct replicas and differ by at most one token
    for p in plans.values():
        by_group: dict[int, list[int]] = {}
        for t in p.recvs:
            g = _source_group(sim, t.owner, t.src_rank)
            by_group.setdefault(g, []).append(t.count)
        for g, counts in by_group.items():
            k = len(sim.topology.sources[g].ranks)
            assert max(counts) - min(counts) <= 1
            assert len(counts) == min(k, sum(counts))


@given(ex=exchanges())
@SETTINGS
def test_local_plans_compose_to_the_oracle_and_deliver_every_key(ex: Exchange) -> None:
    sim = ex.sim()
    members = sim.topology.members
    assert all(check_rank(sim.catalog, r) == [] for r in members)
    plans = {r: plan_rank(sim.catalog, r, local_copy=ex.local_copy) for r in members}
    _check_plans(ex, sim, plans)


@given(ex=exchanges())
@SETTINGS
def test_compact_plans_compose_to_the_oracle_and_deliver_each_owners_rows_in_order(
    ex: Exchange,
) -> None:
    """Compact space: owner ``k``'s rows of a destination group, one per token it owns there in
    layout-row order, sliced into ``ceil(N_k / ranks)`` rows per rank; both ends agree."""
    sim = ex.sim()
    members = sim.topology.members
    plans = {r: plan_rank(sim.catalog, r, local_copy=ex.local_copy, compact=True) for r in members}
    _check_plans(ex, sim, plans, compact=True)
    for p in plans.values():
        if p.dest is None or p.owner_N is None:
            continue
        for o in range(len(ex.teachers)):
            assert p.dest.out_rows(o) == int((p.owner_N == o).sum())
            assert 0 <= p.dest.padded(o) - p.dest.out_rows(o) < max(p.dest.group_size, 1)


def test_rotation_spreads_the_remainders_over_the_replicas() -> None:
    """One group of 4 replicas, 8 single-rank slots of ``4 q + 1`` tokens each: chunk 0 is the
    big one, and the rotation hands it to each replica twice."""
    q, k, n_slots = 3, 4, 8
    n = k * q + 1
    src = np.asarray([[0, 0, 0, 1, n * n_slots]], dtype=np.int64)
    dst = [np.asarray([[0, s * n, 0, 1, n]], dtype=np.int64) for s in range(n_slots)]
    cat = RunCatalog(
        sources=(SourceGroup(owner=0, ranks=tuple(range(k)), num_rows=n * n_slots),),
        dests=tuple(DestGroup(ranks=(10 + s,), num_rows=n) for s in range(n_slots)),
        source_runs=lambda g: src,
        dest_runs=lambda d: dst[d],
        source_range_G2=np.asarray([[0, 0]]),
        dest_range_D2=np.zeros((n_slots, 2), dtype=np.int64),
    )
    load = Counter()
    for r in range(k):
        for t in plan_rank(cat, r).sends:
            load[r] += t.count
    assert set(load.values()) == {n * n_slots // k}


# --- (e): verdicts ---------------------------------------------------------------------------


def _with(layout: TokenLayout, row: int, sample: int, position: int) -> TokenLayout:
    s, p = layout.sample_id_R.clone(), layout.position_R.clone()
    s[row], p[row] = sample, position
    return TokenLayout(sample_id_R=s, position_R=p)


def _real_rows(layout: TokenLayout) -> list[int]:
    return torch.nonzero(layout.sample_id_R >= 0).reshape(-1).tolist()


def _inject(ex: Exchange, kind: str, rng: random.Random) -> str | None:
    """Break ``ex``'s layouts in place; the verdict text that must appear, or ``None``."""
    tl, sl = ex.teacher_layouts, ex.student_layouts
    o = rng.randrange(len(tl))
    key = rng.choice(sorted(tl[o]))
    lay = tl[o][key]
    real = _real_rows(lay)
    label = f"teacher {o} (dp={key[0]}, cp={key[1]})"
    if kind == "held twice in a group" and len(real) >= 2:
        a, b = rng.sample(real, 2)
        tl[o][key] = _with(lay, b, int(lay.sample_id_R[a]), int(lay.position_R[a]))
        return f"is held twice by {label}"
    if kind == "held twice across groups" and real:
        o2 = rng.randrange(len(tl))
        key2 = rng.choice(sorted(k for k in tl[o2] if (o2, k) != (o, key)) or [None])
        if key2 is None or not _real_rows(tl[o2][key2]):
            return None
        a, b = rng.choice(real), rng.choice(_real_rows(tl[o2][key2]))
        tl[o2][key2] = _with(tl[o2][key2], b, int(lay.sample_id_R[a]), int(lay.position_R[a]))
        return "is held twice: by"
    if kind == "needed but held by nobody":
        k2 = rng.choice(sorted(sl))
        rows = _real_rows(sl[k2])
        if not rows:
            return None
        sl[k2] = _with(sl[k2], rng.choice(rows), 10**6 + rng.randrange(3), rng.randrange(5))
        return "but no teacher holds it"
    if kind == "dropped by its teacher" and real:
        tl[o][key] = _with(lay, rng.choice(real), -1, -1)
        return "but no teacher holds it"
    return None


@given(
    ex=exchanges(),
    errors=st.lists(
        st.sampled_from(
            [
                "held twice in a group",
                "held twice across groups",
                "needed but held by nobody",
                "dropped by its teacher",
            ]
        ),
        max_size=2,
    ),
    seed=st.integers(0, 2**31 - 1),
)
@SETTINGS
def test_check_rank_finds_exactly_the_injected_errors(
    ex: Exchange, errors: list[str], seed: int
) -> None:
    rng = random.Random(seed)
    expect = [_inject(ex, kind, rng) for kind in errors]
    ex = Exchange(**{**ex.__dict__, "rank_layouts": None})  # shard layouts changed in place
    sim = ex.sim()
    want = oracle_verdicts(sim.catalog)
    got = {}
    for r in sim.topology.members:
        fresh = sim.topology.catalog(sim.matrix, 0)  # what rank r decodes on its own
        found = check_rank(fresh, r)
        if found:
            got[r] = found
        # several micro-batches at once (the same samples in each: keys of one never meet
        # another's), each judged as alone
        again = sim.topology.catalog(sim.matrix, 0)
        assert check_ranks([fresh, again], r) == [found, found]
    assert got == want
    every = [m for ms in got.values() for m in ms]
    if len(errors) == 1 and expect[0] is not None:
        assert any(expect[0] in m for m in every), (expect[0], every)
    if not every:  # whatever an injection did, the plans still hold
        plans = {
            r: plan_rank(sim.catalog, r, local_copy=ex.local_copy) for r in sim.topology.members
        }
        _check_plans(ex, sim, plans)
        for r in sim.topology.members:  # and each micro-batch of several planned at once
            two = [sim.topology.catalog(sim.matrix, 0) for _ in range(2)]
            both = plan_ranks(two, r, local_copy=ex.local_copy, compact=True)
            one = normalise(plan_rank(two[0], r, local_copy=ex.local_copy, compact=True))
            assert [normalise(x) for x in both] == [one, one]


def _catalog(src: list[np.ndarray], dst: list[np.ndarray], **kw: object) -> RunCatalog:
    def rng(runs: list[np.ndarray]) -> np.ndarray:
        return np.asarray(
            [[r[:, 0].min(), r[:, 0].max()] if r.size else [1, 0] for r in runs], dtype=np.int64
        )

    return RunCatalog(
        sources=kw.get(
            "sources",
            tuple(
                SourceGroup(owner=0, ranks=(2 * g, 2 * g + 1), num_rows=64, label=f"T{g}")
                for g in range(len(src))
            ),
        ),
        dests=tuple(
            DestGroup(ranks=(10 + d,), num_rows=64, label=f"S{d}") for d in range(len(dst))
        ),
        source_runs=lambda g: src[g],
        dest_runs=lambda d: dst[d],
        source_range_G2=rng(src),
        dest_range_D2=rng(dst),
    )


def _runs(*rows: tuple[int, int, int, int, int]) -> np.ndarray:
    return np.asarray(rows, dtype=np.int64).reshape(-1, 5)


def test_verdict_messages_name_token_groups_ranks_rows_and_counts() -> None:
    cat = _catalog(
        [_runs((5, 0, 0, 1, 4)), _runs((5, 2, 0, 1, 3)), _runs((7, 0, 0, 1, 3), (7, 1, 10, 2, 2))],
        [_runs((5, 0, 0, 1, 6)), _runs((7, 0, 9, -1, 3), (8, 4, 20, 1, 2))],
    )
    assert check_rank(cat, 2) == [
        "token (sample_id=5, position=2) is held twice: by T0 (ranks [0, 1], row 2) and by T1 "
        "(ranks [2, 3], row 0); 2 keys are held by both"
    ]
    assert check_rank(cat, 4) == [
        "token (sample_id=7, position=1) is held twice by T2 (ranks [4, 5], rows 1 and 10); "
        "2 keys are held more than once there"
    ]
    assert check_rank(cat, 10) == [
        "token (sample_id=5, position=5) is needed by S0 (ranks [10], row 5) but no teacher "
        "holds it; 1 needed tokens are missing in all"
    ]
    # rows 9, 8, 7 want positions 0, 1, 2 of sample 7 (held); rows 20, 21 want sample 8
    assert check_rank(cat, 11) == [
        "token (sample_id=8, position=4) is needed by S1 (ranks [11], row 20) but no teacher "
        "holds it; 2 needed tokens are missing in all"
    ]
    assert check_rank(cat, 0) == check_rank(cat, 1) == check_rank(cat, 3) == []
    want = oracle_verdicts(cat)
    assert {r: check_rank(cat, r) for r in want} == want


# --- (f): a rank reads only its peers --------------------------------------------------------


def _meets(range_X2: np.ndarray, lo: int, hi: int) -> set[int]:
    a, b = range_X2[:, 0], range_X2[:, 1]
    return set(np.flatnonzero((a <= b) & (a <= hi) & (b >= lo) & (lo <= hi)).tolist())


def _reads(
    sim: SimStep, rank: int, local_copy: bool, *, compact: bool = False
) -> tuple[set[int], set[int], RankPlan]:
    """Source and destination groups whose runs ``rank`` reads to plan and check."""
    cat = sim.topology.catalog(sim.matrix, 0)
    counting, read_s, read_d = cat.recording_reads()
    plan = plan_rank(counting, rank, local_copy=local_copy, compact=compact)
    assert check_rank(counting, rank) == []
    return read_s, read_d, plan


def _allowed(sim: SimStep, rank: int, *, compact: bool = False) -> tuple[set[int], set[int]]:
    """What ``rank`` may read: its groups, the groups whose sample range meets theirs and, in
    compact space, for each destination group it sends to, the source groups of the same
    owner whose range meets that group (its peers' peers of its own teacher, nothing wider)."""
    cat = sim.catalog
    ix = cat.index()
    own_s, own_d = set(ix.source_groups.get(rank, ())), set(ix.dest_groups.get(rank, ()))
    ok_s, ok_d = set(own_s), set(own_d)
    for d in own_d:
        ok_s |= _meets(cat.source_range_G2, *cat.dest_range_D2[d].tolist())
    for g in own_s:
        ok_s |= _meets(cat.source_range_G2, *cat.source_range_G2[g].tolist())
        ds = _meets(cat.dest_range_D2, *cat.source_range_G2[g].tolist())
        ok_d |= ds
        if compact:
            for d in ds:
                same = _meets(cat.source_range_G2, *cat.dest_range_D2[d].tolist())
                ok_s |= {h for h in same if ix.owner_G[h] == ix.owner_G[g]}
    return ok_s, ok_d


@given(ex=exchanges(contiguous=True))
@settings(SETTINGS, max_examples=25)
def test_a_rank_reads_only_groups_whose_sample_range_meets_its_own(ex: Exchange) -> None:
    sim = ex.sim()
    plans = {}
    for r in sim.topology.members:
        read_s, read_d, plans[r] = _reads(sim, r, ex.local_copy)
        ok_s, ok_d = _allowed(sim, r)
        assert read_s <= ok_s and read_d <= ok_d, (r, read_s - ok_s, read_d - ok_d)
    _check_plans(ex, sim, plans)
    compact = {}
    for r in sim.topology.members:  # compact space: its owner's peers of its peers, no wider
        read_s, read_d, compact[r] = _reads(sim, r, ex.local_copy, compact=True)
        ok_s, ok_d = _allowed(sim, r, compact=True)
        assert read_s <= ok_s and read_d <= ok_d, (r, read_s - ok_s, read_d - ok_d)
    _check_plans(ex, sim, compact, compact=True)


def test_contiguous_samples_make_the_reads_local() -> None:
    teacher = Mesh(tp=2, cp=2, dp=6)
    student = Mesh(tp=2, cp=1, dp=8)
    tl, sl = contiguous_step(
        [teacher], student, num_samples=96, max_len=9, kinds=["thd", "thd"], seed=1
    )
    ex = Exchange(
        teachers=[teacher],
        student=student,
        teacher_layouts=tl,
        student_layouts=sl,
        rank_layouts=None,
        route=None,
        local_copy=True,
    )
    sim = ex.sim()
    n_groups = len(sim.topology.sources) + len(sim.topology.dests)
    plans = {}
    for r in sim.topology.members:
        read_s, read_d, plans[r] = _reads(sim, r, True)
        assert len(read_s) + len(read_d) <= n_groups // 2, (r, read_s, read_d)
    _check_plans(ex, sim, plans)


# --- catalogs from a topology ----------------------------------------------------------------


def test_topology_catalog_builds_groups_on_access_with_the_micro_batch_rows() -> None:
    teachers = [Mesh(tp=2, dp=2), Mesh(tp=1, cp=2, rank_offset=4)]
    student = Mesh(tp=2, cp=2)
    step = synthetic_step(teachers=teachers, student=student, num_samples=5, max_len=7, seed=0)
    sim = simulate(teachers, student, step.teacher_layouts, step.student_layouts)
    cat = sim.catalog
    assert len(cat.sources) == len(sim.topology.sources) == 4
    for g, s in enumerate(sim.topology.sources):
        o = sim.topology.source_section[g]
        lay = step.teacher_layouts[o][teachers[o].shards()[g - (2 if o else 0)]]
        assert cat.sources[g] == SourceGroup(
            owner=s.owner, ranks=s.ranks, num_rows=lay.num_rows, label=s.label
        )
    assert cat.sources[-1] == cat.sources[3]
    assert cat.dests[0:2] == (cat.dests[0], cat.dests[1])
    assert [d.num_rows for d in cat.dests] == [
        step.student_layouts[sh].num_rows for sh in student.shards()
    ]
    with pytest.raises(IndexError):
        cat.dests[len(cat.dests)]
    assert cat.slot_offsets().tolist() == [0, 2, 4]


# --- the benchmark ---------------------------------------------------------------------------


def test_bench_plan_json_has_one_object_per_rank_count(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from mopd.profiling import cli
    from mopd.profiling.bench import plan as bench_plan

    assert "plan" in cli.BENCHMARKS
    argv = ["--ranks", "16", "32", "--tokens-per-rank", "64", "--max-len", "40", "--repeats", "2"]
    assert bench_plan.main([*argv, "--json", "--no-record"]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    # both source modes by default, each at every rank count
    assert [(r["ranks"], r["sources"]) for r in rows] == [
        (16, "replicas"),
        (32, "replicas"),
        (16, "sp_shards"),
        (32, "sp_shards"),
    ]
    # progress on stderr, one line as each run starts and ends
    assert "[1/4] 16 ranks, replicas ..." in err and "[4/4] 32 ranks, sp_shards done in" in err
    # SP-shard sources: every teacher rank its own source group (tp = 8 of them per TP group)
    for rep, shard in zip(rows[:2], rows[2:], strict=True):
        n_sources = rep["ranks"] // 8
        assert shard["groups"] - rep["groups"] == 7 * n_sources, (rep, shard)
    for r in rows:
        # the changed step leads: its host work and the metadata a rank receives, routed and
        # gathered
        assert list(r)[:7] == [
            "ranks",
            "sources",
            "step_host_miss_ms",
            "step_host_miss_gather_ms",
            "step_host_miss_recorded_ms",
            "allgather_bytes",
            "allgather_bytes_gather",
        ]
        assert r["step_host_miss_ms"] > 0 and r["allgather_bytes"] > 0 and r["peers"] > 0
        # beside the time, the calls it is made of, and their mean cost
        assert isinstance(r["step_calls_miss"], int) and r["step_calls_miss"] > 0
        assert r["us_per_call_miss"] == pytest.approx(
            1e3 * r["step_host_miss_ms"] / r["step_calls_miss"], rel=1e-2, abs=1e-3
        )
        assert {"ranks", "tokens", "plan_ms", "global_plan_ms", "metadata_bytes_per_rank"} <= set(r)
        # another setup than the recorded one: no baseline beside it
        assert r["global_plan_ms"] is None and r["plan_ms"] > 0 and r["peak_mib"] > 0
        assert r["tokens"] >= 64 * r["ranks"]


def test_bench_plan_counts_a_changed_steps_calls_in_its_timed_parts_alone() -> None:
    """The call count is the same every time once the job's caches are warm, as the benchmark
    counts it (a figure free of the machine's noise), and it counts the timed parts only: the
    step's untimed work (the data loader's batches, the summary's all-reduce, the checks after
    it) is left out."""
    from mopd.profiling.bench import plan as bench_plan
    from mopd.profiling.bench.plan_job import (
        build_step,
        exchange_job,
        representative_ranks,
        simulate_exchange,
    )

    step = build_step(32, tokens_per_rank=64, max_len=40, seed=0, micro_batches=2)
    rank = representative_ranks(32)[1]
    sim = simulate_exchange(exchange_job(step), step.topology.member_index(rank))
    cold = bench_plan.count_calls(step, rank, sim)  # may fill the job's caches: more calls
    first = bench_plan.count_calls(step, rank, sim)
    assert cold >= first > 100
    assert [bench_plan.count_calls(step, rank, sim) for _ in range(3)] == [first] * 3
    # the whole step, untimed work included, makes more calls
    calls = 0

    def count(frame: object, event: str, arg: object) -> None:
        nonlocal calls
        calls += event in ("call", "c_call")

    bridge = bench_plan.offline_bridge(step, rank, sim)
    sys.setprofile(count)
    try:
        bench_plan._step_parts(step, bridge, sim, "routed")
    finally:
        sys.setprofile(None)
    assert calls > first
    # a clock that ticks once per read: the parts' differences count the reads between them
    ticks = iter(range(100))
    parts = bench_plan._step_parts(
        step,
        bench_plan.offline_bridge(step, rank, sim),
        sim,
        "routed",
        now=lambda: float(next(ticks)),
    )
    assert set(parts) == {"layouts", "encode", "exchange", "verdict_plan", "tokens"}
    assert all(v == 1.0 for v in parts.values()), parts


def test_bench_plan_baseline_is_the_retired_planners_record(tmp_path: Path) -> None:
    """The global planner is gone; its recorded figures are the baseline, read per rank count."""
    from mopd.profiling.bench import plan as bench_plan

    # the checkout's record, as written (the tests run the installed package, whose wheel leaves
    # docs/results out, so the folder is named here)
    recorded = bench_plan.recorded_global(Path(__file__).resolve().parents[2] / "docs/results")
    assert recorded[256]["global_plan_ms"] == 32.33
    assert recorded[16384]["global_rss_growth_mib"] == 3717.4
    assert bench_plan.recorded_global(tmp_path) == {}  # no record there: no baseline


def test_replica_lookup_is_group_membership() -> None:
    """``GroupIndex.is_replica`` (what decides a local copy) answers, for every rank and
    group, whether the rank is among the group's replicas: ranks in any order, a rank in
    several groups, a group of one, ranks outside every group."""
    sources = [
        SourceGroup(owner=0, ranks=(5, 1, 3), num_rows=4),
        SourceGroup(owner=0, ranks=(2,), num_rows=4),
        SourceGroup(owner=1, ranks=(3, 0), num_rows=4),
    ]
    ix = GroupIndex.build(sources, [DestGroup(ranks=(0, 1), num_rows=4)])
    rank_B = np.repeat(np.arange(-1, 8, dtype=np.int64), len(sources))
    group_B = np.tile(np.arange(len(sources), dtype=np.int64), 9)
    want = [int(r) in sources[int(g)].ranks for r, g in zip(rank_B, group_B, strict=True)]
    assert ix.is_replica(rank_B, group_B).tolist() == want
