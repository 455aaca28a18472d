"""The step's checks that every rank judges alike, off the exchanged step metadata.

Why this file exists: the fence (failed, abandoned or out-of-step ranks) and the agreed
micro-batch count are functions of every rank's header (a gathered matrix, when the summary
says some rank differs); each rank's share of the input checks is a function of its own record
and its peers' (every record, or the routed ones: :mod:`mopd.bridge.peers` brings a rank every
record those checks read) and of the bridge's fixed facts (its topology, teachers and rank).
:meth:`~mopd.bridge.api.HiddenStateBridge.plan_step` calls them between the exchange and the
verdict; they communicate nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np

from mopd.bridge.catalog import RunCatalog, StepRanges, dense_samples, read_runs
from mopd.bridge.config import TeacherSpec
from mopd.bridge.coverage import check_rank
from mopd.bridge.errors import BridgeStateError
from mopd.bridge.faults import Faults
from mopd.bridge.inputs import Agreement
from mopd.bridge.mesh import Mesh
from mopd.bridge.metadata import MAGIC, STATE_FAILED, STATE_OPEN, StepMatrix, code_dtype
from mopd.bridge.topology import Topology
from mopd.common import ranges

__all__ = [
    "agreed_slots",
    "agreed_state",
    "rank_checks",
]


def agreed_state(matrix: StepMatrix, *, members: Sequence[int], rank: int, faults: Faults) -> None:
    """The fence, from every rank's state in the matrix (the same verdict everywhere).

    A step failed or was abandoned on some rank: :class:`BridgeStateError` naming the first
    failure (the lowest rank's), and this bridge refuses from now on. Ranks at different
    step counts (a rank planned a step the others did not): the same. An earlier step with
    micro-batches some rank has not posted: ``ValueError`` (nothing of this step moves; the
    earlier step may still complete), because a new step's transfers would pair with the
    earlier step's on the wire.
    """
    state = matrix.state_N()
    steps = matrix.step_N()
    failed = (state == STATE_FAILED).ravel().nonzero()[0].tolist()
    first = ""
    if failed:
        first = f"first failure on global rank {members[failed[0]]}: {matrix.error(failed[0])}"
        if len(failed) > 1:
            first += f"; global ranks {[members[j] for j in failed[1:]]} failed too"
    elif (steps != steps[0]).any():
        by: dict[int, list[int]] = {}
        for j, k in enumerate(steps.tolist()):
            by.setdefault(k, []).append(members[j])
        first = "ranks are at different steps of this bridge: " + ", ".join(
            f"step {k} on global ranks {v}" for k, v in sorted(by.items())
        )
    if first:
        faults.mark_abandoned(first, publish=False)  # what the failed ranks said already
        raise BridgeStateError(
            f"global rank {rank}: this bridge cannot be used after a failed exchange "
            f"({first}); its process group may still hold sends/receives of that step, "
            "which a later one could match. Create new groups (a new GroupPool and "
            "create_bridge_groups) and a new HiddenStateBridge on every rank."
        )
    open_ = (state == STATE_OPEN).ravel().nonzero()[0].tolist()
    if open_:
        raise ValueError(
            f"step {int(steps[0])} planned while an earlier step of this bridge is not fully "
            "posted: "
            + "; ".join(matrix.error(j) for j in open_)
            + ". Its transfers would pair with that step's on the wire: finish the earlier "
            "step (leave its `with` block) before planning the next on the same bridge"
        )


def agreed_slots(matrix: StepMatrix, *, members: Sequence[int]) -> int:
    """The step's micro-batch count; raises what every rank can see in the matrix alike."""
    bad_magic = (matrix.magic_N() != MAGIC).ravel().nonzero()[0]
    if bad_magic.size:
        raise ValueError(
            f"global ranks {[members[j] for j in bad_magic.tolist()]} sent bridge metadata of "
            "another format (another version of mopd-bridge?)"
        )
    sigs = matrix.config_sig_N()
    if (sigs != sigs[0]).any():
        groups: dict[int, list[int]] = {}
        for j, s in enumerate(sigs.tolist()):
            groups.setdefault(s, []).append(members[j])
        raise ValueError(
            f"ranks were built with different meshes or settings: {list(groups.values())}"
        )
    bad = (matrix.error_bytes_N() > 0).ravel().nonzero()[0].tolist()
    if bad:
        raise ValueError(
            f"bridge input rejected on global rank(s) {[members[j] for j in bad]}: "
            + "; ".join(matrix.error(j) for j in bad)
        )
    slots = matrix.n_slots_N()
    given = slots[slots >= 0]
    known = [] if not given.size else [int(given.min())]
    if given.size and given.max() != given.min():
        known = np.unique(given).tolist()
    if len(known) != 1:
        by: dict[int, list[int]] = {}
        for j, s in enumerate(slots.tolist()):
            if s >= 0:
                by.setdefault(s, []).append(members[j])
        raise ValueError(
            "ranks give different micro-batch counts: "
            + ", ".join(f"{k} on global ranks {v}" for k, v in sorted(by.items()))
            if by
            else "no rank holds a layout: nothing to exchange"
        )
    return known[0]


def rank_checks(
    matrix: StepMatrix,
    catalogs: Sequence[RunCatalog],
    *,
    topology: Topology,
    teachers: Sequence[TeacherSpec],
    student: Mesh,
    rank: int,
    duplicate_samples: bool,
    skip: Sequence[bool] | None = None,
    agreements: Sequence[Agreement] = (),
) -> list[str]:
    """The problems this rank is responsible for finding (its share of the global checks);
    ``catalogs``: the step's micro-batches, in order; ``skip``: micro-batches whose plan
    inputs (:meth:`~mopd.bridge.record.StepView.plan_keys`) this rank saw pass before: the
    planner's verdicts on them are those of then (none), so they are not run again;
    ``agreements``: this rank's (the caller's), each compared with its first rank's."""
    n_slots = len(catalogs)
    skip = [False] * n_slots if skip is None else list(skip)
    n_sec = len(teachers) + 1
    me = topology.member_index(rank)
    topo = topology
    problems: list[str] = []
    problems += _disagreements(matrix, agreements, topology=topo, rank=rank)
    # replicas against their leader: same rows, same layout, same dtype / hidden / device
    mine_g = topo.index.source_groups.get(rank, ())  # this rank's groups, ascending
    for g in mine_g:
        source = topo.sources[g]
        if rank == source.ranks[0]:
            continue
        leader, o = int(topo.source_leader[g]), int(topo.source_section[g])
        if matrix.section_head(me, o) != matrix.section_head(leader, o):
            problems.append(
                f"teacher {o} on global rank {rank}: (dtype, hidden, device) codes "
                f"{matrix.section_head(me, o)[:3]} differ from its TP replica global rank "
                f"{source.ranks[0]}'s {matrix.section_head(leader, o)[:3]}"
            )
            continue
        i = _first_differing_slot(matrix, me, leader, o, n_slots, n_sec)
        if i is not None:
            problems.append(
                f"teacher {o} TP replicas {list(source.ranks)} ({source.label}) hold "
                f"different token layouts in micro-batch {i}"
            )
    for d in topo.index.dest_groups.get(rank, ()):
        dest = topo.dests[d]
        if rank == dest.ranks[0]:
            continue
        leader = int(topo.dest_leader[d])
        i = _first_differing_slot(matrix, me, leader, topo.student_section, n_slots, n_sec)
        if i is not None:
            problems.append(
                f"student TP ranks {list(dest.ranks)} ({dest.label}) want different "
                f"token layouts in micro-batch {i}"
            )
    # every teacher's leaders agree on (dtype, hidden, device): students size buffers by them
    # (sources are teacher-major, so this goes teacher by teacher as before)
    for g in mine_g:
        if topo.sources[g].ranks[0] != rank:
            continue
        o = int(topo.source_section[g])
        spec = teachers[o]
        first = topo.first_leader(o)
        head = matrix.section_head(me, o)
        first_head = matrix.teacher_head(o, first)
        if head[1] != spec.hidden_size:
            problems.append(
                f"teacher {o} on global rank {rank}: hidden size {head[1]}, "
                f"expected {spec.hidden_size}"
            )
        if head[:3] != first_head:
            problems.append(
                f"teacher {o}: global ranks {topo.members[first]} and {rank} hold "
                f"different dtypes or devices ({first_head} vs {head[:3]})"
            )
        if code_dtype(head[0]) is None:
            problems.append(f"teacher {o} on global rank {rank}: unsupported dtype")
    if not duplicate_samples:
        problems += _duplicate_samples(
            catalogs, skip, topology=topology, student=student, rank=rank
        )
    # the planner's checks: tokens held twice or by nobody (every new micro-batch of a step's
    # catalogs in one pass: check_rank of one checks every pending one)
    with ranges.span("plan", "checks"):
        todo = [i for i in range(n_slots) if not skip[i]]
        batch = catalogs[todo[0]].batch if todo else None
        if batch is not None:
            batch.expect(todo)
        for i in todo:
            problems += [f"micro-batch {i}: {p}" for p in check_rank(catalogs[i], rank)]
        if batch is not None:
            batch.done()
    return problems


def _disagreements(
    matrix: StepMatrix, agreements: Sequence[Agreement], *, topology: Topology, rank: int
) -> list[str]:
    """Where this rank's agreements differ from their first rank's (read off the matrix)."""
    problems: list[str] = []
    for a in agreements:
        first = a.ranks[0]
        try:
            j = topology.member_index(first)
        except ValueError:
            continue
        if first == rank:
            continue
        # a routed matrix holds the first rank's record when it gave this agreement
        theirs = matrix.agreements(j).get(a.key) if matrix.has(j) else None
        if theirs is None:
            problems.append(f"{a.what}: global rank {first} gives none, global rank {rank} does")
            continue
        text = a.differs(theirs.tolist(), me=rank)
        if text is not None:
            problems.append(text)
    return problems


def _duplicate_samples(
    catalogs: Sequence[RunCatalog],
    skip: Sequence[bool],
    *,
    topology: Topology,
    student: Mesh,
    rank: int,
) -> list[str]:
    """Sample ids the student wants on two DP ranks in one micro-batch (it would train on
    them twice). Each destination group's first rank checks its group against the earlier
    groups of other DP ranks whose sample range meets it (its peers, not the job; the groups
    of its own DP rank, its CP shards, want its samples by design); ``skip``: micro-batches
    whose inputs this rank has seen pass before."""
    topo = topology
    mine = [d for d in topo.index.dest_groups.get(rank, ()) if topo.dests[d].ranks[0] == rank]
    problems: list[str] = []
    todo = [i for i in range(len(catalogs)) if not skip[i]]
    if not mine or not todo:
        return problems
    dp_of = functools.partial(_dp_of, student, topo)
    flagged = _shared_samples([catalogs[i] for i in todo], mine, dp_of)
    for (k, d), earlier in sorted(flagged.items()):
        i = todo[k]
        catalog = catalogs[i]
        dp = dp_of(d)
        wanted = np.unique(catalog.dest_runs(d)[:, 0])
        first: dict[int, int] = {}  # sample -> DP rank of the first group wanting it
        for e in earlier.tolist():
            runs = catalog.dest_runs(e)
            for sample in np.intersect1d(wanted, runs[:, 0]).tolist():
                first.setdefault(sample, dp_of(e))
        for sample, dp0 in sorted(first.items()):
            if len(problems) < 4:
                problems.append(
                    f"micro-batch {i}: sample id {sample} is wanted by student DP ranks "
                    f"{dp0} and {dp}: it would be trained on twice; give each sample "
                    "to one DP rank, or BridgeConfig(duplicate_samples=True) if that is "
                    "meant"
                )
    return problems


def _shared_samples(
    catalogs: Sequence[RunCatalog], mine: Sequence[int], dp_of: Callable[[int], int]
) -> dict[tuple[int, int], np.ndarray]:
    """``(catalog, group) -> earlier groups``: where destination group ``group`` (of ``mine``)
    wants a sample that an earlier destination group of another DP rank, meeting its sample
    range there, wants too, those earlier groups (ascending); one pass per group over every
    catalog (sample ids made distinct per catalog)."""
    out: dict[tuple[int, int], np.ndarray] = {}
    ranges = StepRanges.of(catalogs, "d")
    for d in mine:
        mb_P, grp_P = ranges.meeting(*ranges.range_of(d))
        keep = grp_P < d
        if keep.any():
            dp = dp_of(d)
            keep[keep] = [dp_of(e) != dp for e in grp_P[keep].tolist()]
        if not keep.any():
            continue
        mb_P, grp_P = mb_P[keep], grp_P[keep]
        mbs = np.unique(mb_P)  # and in each of those micro-batches, the group itself
        runs, mb, tag = read_runs(
            catalogs,
            "d",
            np.concatenate([mb_P, mbs]),
            np.concatenate([grp_P, np.full(mbs.size, d, dtype=grp_P.dtype)]),
            raw=True,
        )
        own = tag == d
        ids = dense_samples(mb, runs[:, 0])
        shared = np.intersect1d(ids[own], ids[~own])
        for i in np.unique(mb[np.isin(ids, shared)]).tolist():
            out[(i, d)] = grp_P[mb_P == i]
    return out


def _dp_of(student: Mesh, topology: Topology, d: int) -> int:
    """The student DP rank of destination group ``d``."""
    c = student.coord(topology.dests[d].ranks[0])
    assert c is not None
    return c.dp_rank


def _first_differing_slot(
    matrix: StepMatrix, me: int, leader: int, section: int, n_slots: int, n_sections: int
) -> int | None:
    """The first micro-batch where member ``me``'s layout (rows, digest) differs from its
    replica leader's, or ``None`` (one read of both slot tables)."""
    t = matrix.slot_tables(
        np.asarray([me, leader]), section, n_sections=n_sections, n_slots=n_slots
    )
    differ = ((t[0, :, 0] != t[1, :, 0]) | (t[0, :, 5] != t[1, :, 5])).ravel().nonzero()[0]
    return int(differ[0]) if differ.size else None
