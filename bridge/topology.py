"""The groups a bridge's meshes form, and the planner's view of one exchanged micro-batch.

Why this file exists: the meshes fix, once, which ranks replicate which buffer (a teacher's
last-stage TP group per ``(dp, cp)`` shard, or each of its ranks alone when it sends from its own
sequence-parallel shard) and which ranks share one crossing (the student's last-stage TP group
per shard, or each rank alone when it keeps its SP slice). Every rank derives
the same :class:`Topology` from the meshes alone; per micro-batch, :meth:`Topology.catalog` turns
the exchanged step metadata into the planner's :class:`~mopd.bridge.catalog.RunCatalog` without
decoding more than the groups the caller asks about.

What is per rank and what is per job: the groups and their :class:`~mopd.bridge.catalog.GroupIndex`
(``O(ranks)``) are built once per topology; a catalog costs one vectorized read of the leaders'
slot tables, and its groups are built one by one when the planner looks at them, so a rank of a
large job pays for its peers, not for every group.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TypeVar

import numpy as np

from mopd.bridge.catalog import DestGroup, GroupIndex, RunCatalog, RunFetch, SourceGroup, StepBatch
from mopd.bridge.mesh import Mesh, bridge_members
from mopd.bridge.metadata import StepMatrix
from mopd.common.lazy import LazySequence

__all__ = ["Topology"]

_I64 = np.int64
_G = TypeVar("_G", SourceGroup, DestGroup)


def _groups(groups: Sequence[_G], rows_of: Callable[[int], int], noun: str) -> LazySequence[_G]:
    """One micro-batch's groups, each built on first access: the topology's group with the
    micro-batch's ``num_rows`` (``rows_of(j)``: group ``j``'s rows)."""
    return LazySequence(
        len(groups),
        lambda j: dataclasses.replace(groups[j], num_rows=rows_of(j)),
        noun=noun,
    )


@dataclass(frozen=True, kw_only=True, eq=False)
class Topology:
    """Source and destination groups of a bridge, with the member index of each group's leader.

    Attributes:
        members: the bridge group's global ranks, sorted (member index = position).
        sources: per teacher and ``(dp, cp)`` shard (teacher major, :meth:`Mesh.shards` order),
            the last-stage TP group (replicas of one buffer); for a teacher in
            ``shard_sources``, each rank of that group alone, in TP order (each holds its own
            sequence-parallel slice: disjoint rows). ``num_rows`` is 0 here (it varies per
            micro-batch).
        source_section: ``[G]`` the section (teacher index) of each source group.
        source_leader: ``[G]`` member index of each source group's first rank.
        dests: per student shard the last-stage TP group, or with ``per_rank_dests`` each
            last-stage student rank alone.
        dest_leader: ``[D]`` member index of each destination group's first rank.
        student_section: the section index of the student (``len(teachers)``).
        shard_sources: per teacher, whether its sources are single ranks holding their own
            sequence-parallel shard (``True``) or TP groups of replicas (``False``).

    :attr:`index` (the groups' :class:`~mopd.bridge.catalog.GroupIndex`) is built on first use and
    shared by every catalog of the topology.
    """

    members: tuple[int, ...]
    sources: tuple[SourceGroup, ...]
    source_section: np.ndarray
    source_leader: np.ndarray
    dests: tuple[DestGroup, ...]
    dest_leader: np.ndarray
    student_section: int
    shard_sources: tuple[bool, ...] = ()

    @staticmethod
    def build(
        teachers: Sequence[Mesh],
        student: Mesh,
        *,
        per_rank_dests: bool = False,
        shard_sources: Sequence[bool] | None = None,
    ) -> Topology:
        """The groups of ``teachers`` and ``student`` (pure, the same on every rank).

        ``shard_sources``: per teacher, make each of its last-stage ranks its own source (it
        sends from its sequence-parallel shard, ``[S/tp, B, H]``, rows no other rank holds)
        instead of one source group of TP replicas. Default: replicas for every teacher.
        """
        shards = (
            (False,) * len(teachers)
            if shard_sources is None
            else tuple(bool(x) for x in shard_sources)
        )
        if len(shards) != len(teachers):
            raise ValueError(
                f"shard_sources has {len(shards)} entries for {len(teachers)} teachers"
            )
        members = bridge_members(teachers, student)
        index = {r: i for i, r in enumerate(members)}
        sources, section, leader = [], [], []
        for o, mesh in enumerate(teachers):
            for d, c in mesh.shards():
                group = mesh.tp_group_ranks(dp_rank=d, cp_rank=c)
                label = f"teacher {o} (dp={d}, cp={c})"
                split = [(r,) for r in group] if shards[o] else [group]
                for t, ranks in enumerate(split):
                    sources.append(
                        SourceGroup(
                            owner=o,
                            ranks=ranks,
                            num_rows=0,
                            label=label[:-1] + f", tp={t})" if shards[o] else label,
                        )
                    )
                    section.append(o)
                    leader.append(index[ranks[0]])
        dests, dest_leader = [], []
        for d, c in student.shards():
            group = student.tp_group_ranks(dp_rank=d, cp_rank=c)
            if per_rank_dests:
                for t, r in enumerate(group):
                    dests.append(
                        DestGroup(ranks=(r,), num_rows=0, label=f"student (dp={d}, cp={c}, tp={t})")
                    )
                    dest_leader.append(index[r])
            else:
                dests.append(DestGroup(ranks=group, num_rows=0, label=f"student (dp={d}, cp={c})"))
                dest_leader.append(index[group[0]])
        return Topology(
            members=members,
            sources=tuple(sources),
            source_section=np.asarray(section, dtype=_I64),
            source_leader=np.asarray(leader, dtype=_I64),
            dests=tuple(dests),
            dest_leader=np.asarray(dest_leader, dtype=_I64),
            student_section=len(teachers),
            shard_sources=shards,
        )

    def first_leader(self, section: int) -> int:
        """Member index of the first rank of ``section``'s (a teacher's) first source group."""
        return self._first_leaders[section]

    @cached_property
    def _first_leaders(self) -> dict[int, int]:
        sec = self.source_section
        return {
            int(o): int(self.source_leader[(sec == o).ravel().nonzero()[0][0]])
            for o in np.unique(sec)
        }

    def member_index(self, global_rank: int) -> int:
        """``global_rank``'s member index (its position in :attr:`members`; a binary search)."""
        j = bisect.bisect_left(self.members, global_rank)
        if j == len(self.members) or self.members[j] != global_rank:
            raise ValueError(f"global rank {global_rank} is not a member of this bridge")
        return j

    @cached_property
    def index(self) -> GroupIndex:
        """The groups' ranks as arrays and per-rank lookups (built once, ``O(ranks)``)."""
        return GroupIndex.build(self.sources, self.dests)

    def fetcher(self, matrix: StepMatrix) -> RunFetch:
        """:attr:`~mopd.bridge.catalog.RunCatalog.fetch` for ``matrix``'s catalogs: the runs of
        ``(micro-batch, group)`` pairs, each from its group leader's record, in one read."""
        return _fetcher(self, matrix)

    def led_by(self, members: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source ids, dest ids)``, ascending: the groups whose first rank is one of
        ``members`` (member indices; the groups whose runs those records carry). Binary
        searches in the leaders sorted once, ``O(len(members) log groups)``."""
        out = []
        for order, leaders in (self._leaders_sorted("s"), self._leaders_sorted("d")):
            m = np.asarray(members, dtype=_I64)
            lo = leaders.searchsorted(m, side="left")
            hi = leaders.searchsorted(m, side="right")
            n = hi - lo
            at = lo.repeat(n) + (np.arange(int(n.sum()), dtype=_I64) - (n.cumsum() - n).repeat(n))
            out.append(np.sort(order[at]))
        return out[0], out[1]

    def _leaders_sorted(self, side: str) -> tuple[np.ndarray, np.ndarray]:
        """``(order, leaders[order])`` of the source (``"s"``) or destination groups' leader
        member indices (built once)."""
        return self._sorted_leaders[0 if side == "s" else 1]

    @cached_property
    def _sorted_leaders(self) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
        out = []
        for leaders in (self.source_leader, self.dest_leader):
            order = leaders.argsort(kind="stable").astype(_I64)
            out.append((order, leaders[order]))
        return tuple(out)

    def catalog(
        self,
        matrix: StepMatrix,
        slot: int,
        *,
        fields: tuple[np.ndarray, np.ndarray] | None = None,
        ids: tuple[np.ndarray, np.ndarray] | None = None,
        fetch: RunFetch | None = None,
        batch: StepBatch | None = None,
    ) -> RunCatalog:
        """The planner's view of micro-batch ``slot`` of an exchanged, validated step.

        Reads the leaders' slot tables (one vectorized read per teacher and one for the
        student) for rows and sample ranges; a group (with its ``num_rows``) is built when the
        planner looks at it, and its runs are read when the planner asks. ``ids``: the
        ``(source, dest)`` groups whose leaders' records ``matrix`` holds, when it holds some
        only (routed: :meth:`led_by` of its members); ``fields``: those groups' ``([G', 3],
        [D', 3])`` columns ``(n_rows, sample_min, sample_max)`` when the caller read them
        already (:func:`mopd.bridge.record.read_step`); ``fetch``: :meth:`fetcher` of
        ``matrix``, shared by the step's catalogs (one read serves several micro-batches);
        ``batch``: the step's catalogs it is planned and checked with.
        """
        src_ids, dst_ids = ids if ids is not None else (None, None)
        if fields is not None:
            src_fields, dst_fields = fields
        else:
            # (n_rows, sample_min, sample_max) of the groups: the only columns read for all
            cols = (0, 3, 4)
            sel_s = np.arange(len(self.sources)) if src_ids is None else src_ids
            sel_d = np.arange(len(self.dests)) if dst_ids is None else dst_ids
            src_fields = np.zeros((sel_s.size, 3), dtype=_I64)
            for o in np.unique(self.source_section[sel_s]).tolist():
                at = (self.source_section[sel_s] == o).ravel().nonzero()[0]
                src_fields[at] = matrix.slot_fields(self.source_leader[sel_s[at]], o, slot, cols)
            dst_fields = matrix.slot_fields(
                self.dest_leader[sel_d], self.student_section, slot, cols
            )
        rows_s = _rows_by_id(len(self.sources), src_ids, src_fields[:, 0])
        rows_d = _rows_by_id(len(self.dests), dst_ids, dst_fields[:, 0])
        sources = _groups(self.sources, rows_s, "source group")
        dests = _groups(self.dests, rows_d, "destination group")
        leaders_s, sections_s, leaders_d = self.source_leader, self.source_section, self.dest_leader
        student = self.student_section
        return RunCatalog(
            sources=sources,
            dests=dests,
            source_runs=lambda g: matrix.runs(int(leaders_s[g]), int(sections_s[g]), slot),
            dest_runs=lambda d: matrix.runs(int(leaders_d[d]), student, slot),
            fetch=self.fetcher(matrix) if fetch is None else fetch,
            slot=slot,
            dest_rows_D=np.ascontiguousarray(dst_fields[:, 0]),
            batch=batch,
            source_range_G2=np.ascontiguousarray(src_fields[:, 1:3]),
            dest_range_D2=np.ascontiguousarray(dst_fields[:, 1:3]),
            group_index=self.index,
            source_ids=src_ids,
            dest_ids=dst_ids,
        )


def _fetcher(topology: Topology, matrix: StepMatrix) -> RunFetch:
    leaders_s, sections_s = topology.source_leader, topology.source_section
    leaders_d, student = topology.dest_leader, topology.student_section

    def fetch(side: str, slots: np.ndarray, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if side == "s":
            return matrix.runs_many(leaders_s[groups], sections_s[groups], slots)
        return matrix.runs_many(leaders_d[groups], np.full(groups.size, student, _I64), slots)

    return fetch


def _rows_by_id(n: int, ids: np.ndarray | None, rows: np.ndarray) -> Callable[[int], int]:
    """Group ``j``'s rows in a micro-batch: ``rows[j]``, or with ``ids`` the row of id ``j``
    (0 for a group whose record is not here: the planner never builds one)."""
    if ids is None:
        rows = rows.copy()
        return lambda j: int(rows[j])
    ids, rows = ids.copy(), rows.copy()

    def of(j: int) -> int:
        at = int(ids.searchsorted(j))
        return int(rows[at]) if at < ids.size and int(ids[at]) == j else 0

    return of
