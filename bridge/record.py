"""What one rank contributes to a step, and what it reads back of everyone's: one rule, no group.

Why this file exists: the live bridge (:meth:`~mopd.bridge.api.HiddenStateBridge.plan_step`),
the plan inspector, the plan benchmark and the tests must build a step's records and read the
exchanged records by the same rule, or a change to the record leaves the tools checking
another rule than the one that runs. Everything here is pure (no process group): the exchange
between :func:`rank_sections` / :func:`~mopd.bridge.metadata.encode_step_record` and
:func:`read_step` is the caller's (the bridge's routed exchange,
:func:`~mopd.bridge.peers.exchange_records`, or its gather,
:func:`~mopd.bridge.metadata.gather_step_matrix`, or :func:`stack_records` in one process).
A routed step's matrix holds some members' records: the view then covers the groups whose
leaders' records are there (:attr:`StepView.source_ids`), every group that shares a sample
with the rank's own among them.

The rule (:func:`rank_roles`): a rank holds a teacher's section when it is on that teacher's
last pipeline stage, the student's when it is on the student's last stage. The first rank of a
group of replicas (a TP group) sends its runs; the others send only their slot tables, whose
digests must match the leader's. With ``keep_sp_shard`` every student rank is its own
destination and sends its own runs.

Reading back (:func:`read_step`) costs one strided slice of the leaders' slot tables per
section for the whole step (rows, sample ranges, digests, token counts of every group and
micro-batch), then per micro-batch a lazy :class:`~mopd.bridge.catalog.RunCatalog`. From the same
tables, :meth:`StepView.plan_keys` hashes what a rank's plan and checks of a micro-batch depend
on: its own groups and the groups whose sample range meets theirs (ids, rows, ranges, digests).
Equal keys, equal plans: a rank's schedule cache is keyed on them, so a repeated micro-batch
runs no planner. The tables are read when first looked at: a bridge whose every record says
its tables are unchanged since the step of its plan memo reuses that step's keys and token
counts and never reads them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from mopd.bridge.catalog import RunCatalog, StepBatch
from mopd.bridge.config import BridgeConfig, TeacherSpec
from mopd.bridge.layout import TokenLayout
from mopd.bridge.mesh import Mesh
from mopd.bridge.metadata import SLOT_COLUMNS, Section, StepMatrix
from mopd.bridge.topology import Topology
from mopd.common.digest import Digest
from mopd.common.lazy import LazySequence

__all__ = [
    "StepView",
    "config_signature",
    "rank_roles",
    "rank_sections",
    "read_step",
    "stack_records",
]

_I64 = np.int64
_ROWS, _SMIN, _SMAX, _DIGEST, _TOKENS = (
    SLOT_COLUMNS.index(c) for c in ("n_rows", "sample_min", "sample_max", "digest", "n_tokens")
)
_KEY_COLS = np.asarray([_ROWS, _SMIN, _SMAX, _DIGEST], dtype=_I64)


def rank_roles(
    global_rank: int,
    teachers: Sequence[Mesh],
    student: Mesh,
    *,
    keep_sp_shard: bool = False,
    shard_sources: Sequence[bool] | None = None,
) -> tuple[bool | None, ...]:
    """What ``global_rank`` contributes, per section (teachers in order, then the student):
    ``None`` where it holds no such rows (not on that mesh's last stage), else whether it sends
    the section's runs (``True``: the first rank of its TP group, every rank of a teacher in
    ``shard_sources`` (each sends from its own sequence-parallel shard), or every student rank
    with ``keep_sp_shard``; ``False``: a replica that sends its digests)."""
    shards = [False] * len(teachers) if shard_sources is None else list(shard_sources)
    if len(shards) != len(teachers):
        raise ValueError(f"shard_sources has {len(shards)} entries for {len(teachers)} teachers")
    roles: list[bool | None] = []
    for mesh, shard in zip(teachers, shards, strict=True):
        c = mesh.coord(global_rank)
        if c is None or c.pp_rank != mesh.pp - 1:
            roles.append(None)
        else:
            roles.append(bool(shard) or c.tp_rank == 0)
    c = student.coord(global_rank)
    if c is None or c.pp_rank != student.pp - 1:
        roles.append(None)
    else:
        roles.append(keep_sp_shard or c.tp_rank == 0)
    return tuple(roles)


def rank_sections(
    roles: Sequence[bool | None],
    *,
    teacher_layouts: Mapping[int, Sequence[TokenLayout]],
    student_layouts: Sequence[TokenLayout] | None,
    dtypes: Sequence[torch.dtype | None],
    hiddens: Sequence[int],
    device: torch.device | str = "cpu",
) -> list[Section | None]:
    """The sections of a rank with ``roles`` (:func:`rank_roles`), for
    :func:`~mopd.bridge.metadata.encode_step_record`: teacher ``o``'s from
    ``teacher_layouts[o]`` with ``dtypes[o]`` / ``hiddens[o]``, the student's from
    ``student_layouts`` (each one layout per micro-batch; the caller has checked that the rank
    gives exactly the layouts its roles call for)."""
    n = len(roles) - 1
    sections: list[Section | None] = []
    for o in range(n):
        send = roles[o]
        if send is None:
            sections.append(None)
            continue
        sections.append(
            Section(
                layouts=teacher_layouts[o],
                send_runs=send,
                dtype=dtypes[o],
                hidden=hiddens[o],
                device=device,
            )
        )
    send = roles[n]
    if send is None or student_layouts is None:
        sections.append(None)
    else:
        sections.append(Section(layouts=student_layouts, send_runs=send, device=device))
    return sections


def stack_records(records: Sequence[torch.Tensor | np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """What the metadata all-gather returns, in one process: ``([n, width] int64, sizes [n])``,
    record ``j`` in row ``j`` zero-padded to the widest."""
    arrays = [r.numpy() if isinstance(r, torch.Tensor) else np.asarray(r) for r in records]
    sizes = np.asarray([a.size for a in arrays], dtype=_I64)
    matrix = np.zeros((len(arrays), int(sizes.max()) if arrays else 0), dtype=_I64)
    for j, a in enumerate(arrays):
        matrix[j, : a.size] = a
    return matrix, sizes


def _catalogs(view: StepView) -> LazySequence[RunCatalog]:
    """A step's catalogs, each built on first access (a micro-batch a rank has planned before
    needs none), planned and checked together (one :class:`~mopd.bridge.catalog.StepBatch`,
    :attr:`StepView.batch`); the columns they read (``(n_rows, sample_min, sample_max)`` of
    every group here, ``[I, X, 3]``) are copied once, on the first."""
    fields: list[tuple[np.ndarray, np.ndarray]] = []

    def build(j: int) -> RunCatalog:
        if not fields:
            cols = [_ROWS, _SMIN, _SMAX]
            src, dst = view.source_GIF, view.dest_DIF
            fields.append(
                (
                    np.ascontiguousarray(src[:, :, cols].transpose(1, 0, 2)),
                    np.ascontiguousarray(dst[:, :, cols].transpose(1, 0, 2)),
                )
            )
        src_I, dst_I = fields[0]
        ids = None if view.source_ids is None else (view.source_ids, view.dest_ids)
        return view.topology.catalog(
            view.matrix,
            j,
            fields=(src_I[j], dst_I[j]),
            ids=ids,  # type: ignore[arg-type]
            fetch=fetch,
            batch=view.batch,
        )

    fetch = view.topology.fetcher(view.matrix)
    out = LazySequence(view.n_slots, build, noun="micro-batch")
    view.batch.catalogs = out
    return out


@dataclass(frozen=True, kw_only=True, eq=False)
class StepView:
    """One rank's reading of an exchanged, agreed step (:func:`read_step`); nothing is read
    before it is looked at.

    Attributes:
        topology: the bridge's groups.
        matrix: the records: every member's, or (routed) the members' this rank reads.
        n_slots: micro-batches of the step.
        source_ids, dest_ids: ``[G']`` / ``[D']`` the groups whose leaders' records the
            matrix holds, ascending (``None``: every group, the matrix holds every record).
        source_GIF: ``[G', n_slots, SLOT_FIELDS]`` those source group leaders' slot tables
            (:data:`~mopd.bridge.metadata.SLOT_COLUMNS`; read on first use; row ``r`` is group
            ``source_ids[r]``, or group ``r``).
        dest_DIF: ``[D', n_slots, SLOT_FIELDS]`` those destination group leaders' (the same).
        catalogs: per micro-batch, the planner's lazy catalog (each built on first access).
        batch: :attr:`catalogs` as one :class:`~mopd.bridge.catalog.StepBatch`.
    """

    topology: Topology
    matrix: StepMatrix
    n_slots: int

    @cached_property
    def _ids(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        m = self.matrix
        if m.members is None:
            return None, None
        return self.topology.led_by(m.members)

    @property
    def source_ids(self) -> np.ndarray | None:
        return self._ids[0]

    @property
    def dest_ids(self) -> np.ndarray | None:
        return self._ids[1]

    def _source_rows(self, groups: np.ndarray) -> np.ndarray:
        return groups if self.source_ids is None else self.source_ids.searchsorted(groups)

    def _dest_rows(self, groups: np.ndarray) -> np.ndarray:
        return groups if self.dest_ids is None else self.dest_ids.searchsorted(groups)

    @cached_property
    def source_GIF(self) -> np.ndarray:
        topology, matrix, n_slots = self.topology, self.matrix, self.n_slots
        n_sec = topology.student_section + 1
        ids = self.source_ids
        leader = topology.source_leader if ids is None else topology.source_leader[ids]
        if topology.student_section == 1:  # one teacher: every source group is its
            return matrix.slot_tables(leader, 0, n_sections=n_sec, n_slots=n_slots)
        section = topology.source_section if ids is None else topology.source_section[ids]
        src = np.zeros((leader.size, n_slots, len(SLOT_COLUMNS)), dtype=_I64)
        for o in range(topology.student_section):
            sel = (section == o).ravel().nonzero()[0]
            if sel.size:
                src[sel] = matrix.slot_tables(leader[sel], o, n_sections=n_sec, n_slots=n_slots)
        return src

    @cached_property
    def dest_DIF(self) -> np.ndarray:
        topology, ids = self.topology, self.dest_ids
        return self.matrix.slot_tables(
            topology.dest_leader if ids is None else topology.dest_leader[ids],
            topology.student_section,
            n_sections=topology.student_section + 1,
            n_slots=self.n_slots,
        )

    @cached_property
    def catalogs(self) -> Sequence[RunCatalog]:
        return _catalogs(self)

    @cached_property
    def batch(self) -> StepBatch:
        """The step's catalogs as planned and checked together: :meth:`StepBatch.expect` the
        micro-batches about to be planned, then ``plan_rank`` / ``check_rank`` each."""
        return StepBatch(catalogs=())

    def tokens_I(self) -> np.ndarray:
        """``[n_slots]`` real tokens the student wants per micro-batch over all its
        destination groups (each token once): a sum of the leaders' ``n_tokens`` (every
        record's: a gathered matrix; a routed one has :meth:`led_tokens_I`)."""
        if self.dest_ids is not None:
            raise AssertionError("a routed step holds some destination groups only")
        return self.dest_DIF[:, :, _TOKENS].sum(axis=0)

    def led_tokens_I(self, rank: int) -> np.ndarray:
        """``[n_slots]`` real tokens of the destination group ``rank`` leads, off its own
        record (zeros if it leads none): its share of :meth:`tokens_I` (every group has one
        leader, so the shares over all ranks sum to it)."""
        topo = self.topology
        led = [d for d in topo.index.dest_groups.get(rank, ()) if topo.dests[d].ranks[0] == rank]
        if not led:
            return np.zeros(self.n_slots, dtype=_I64)
        table = self.matrix.slot_tables(
            np.asarray([topo.member_index(rank)], dtype=_I64),
            topo.student_section,
            n_sections=topo.student_section + 1,
            n_slots=self.n_slots,
        )
        return table[0, :, _TOKENS].copy()  # a rank is in one destination group

    def plan_keys(self, rank: int, extra: bytes = b"") -> list[bytes]:
        """Per micro-batch, a hash of everything ``rank``'s plan and verdicts of it read.

        ``plan_rank`` and ``check_rank`` read the rank's own source and destination groups and
        the groups whose sample range meets one of theirs, nothing else (among the groups
        here: a routed step holds every group that shares a sample with them). The key covers
        its own groups and every group here whose range meets the hull of their ranges (a
        superset: a key that covers more only misses more often): their indices, rows, sample
        ranges and layout digests; ``extra``: what else the caller's schedule depends on (row
        widths). One vectorized comparison per side for the whole step; hashing is per
        micro-batch.
        """
        ix = self.topology.index
        own_s = self._source_rows(np.asarray(ix.source_groups.get(rank, ()), dtype=_I64))
        own_d = self._dest_rows(np.asarray(ix.dest_groups.get(rank, ()), dtype=_I64))
        src, dst = self.source_GIF, self.dest_DIF
        ids_s = np.arange(src.shape[0]) if self.source_ids is None else self.source_ids
        ids_d = np.arange(dst.shape[0]) if self.dest_ids is None else self.dest_ids
        # [I, G] sample ranges, micro-batch major; a live group's range is not empty
        lo_s, hi_s = src[:, :, _SMIN].T, src[:, :, _SMAX].T
        lo_d, hi_d = dst[:, :, _SMIN].T, dst[:, :, _SMAX].T
        n_i = self.n_slots
        if own_s.size or own_d.size:
            own_lo = np.concatenate([lo_s[:, own_s], lo_d[:, own_d]], axis=1)
            own_hi = np.concatenate([hi_s[:, own_s], hi_d[:, own_d]], axis=1)
            lo_I, hi_I = _hull(own_lo, own_hi, own_lo <= own_hi)
            meet_s = _meets(lo_s, hi_s, lo_I, hi_I)
            meet_d = _meets(lo_d, hi_d, lo_I, hi_I)
            # a second hop: in compact delivery a sender places its rows among those of the
            # other sources that meet the destinations it serves, so the key covers every
            # group meeting the hull of the groups met by the rank's own
            lo2, hi2 = _hull(lo_s, hi_s, meet_s & (lo_s <= hi_s))
            lo3, hi3 = _hull(lo_d, hi_d, meet_d & (lo_d <= hi_d))
            lo_I = np.minimum(lo_I, np.minimum(lo2, lo3))
            hi_I = np.maximum(hi_I, np.maximum(hi2, hi3))
            meet_s = _meets(lo_s, hi_s, lo_I, hi_I)
            meet_d = _meets(lo_d, hi_d, lo_I, hi_I)
        else:
            meet_s = np.zeros((n_i, src.shape[0]), dtype=bool)
            meet_d = np.zeros((n_i, dst.shape[0]), dtype=bool)
        meet_s[:, own_s] = True
        meet_d[:, own_d] = True
        # per side, micro-batch major: each micro-batch's groups, each as its id and key columns
        at_I, rows_P = [], []
        for meet_IG, ids, table_GIF in ((meet_s, ids_s, src), (meet_d, ids_d, dst)):
            i_P, g_P = meet_IG.nonzero()
            at_I.append(i_P.searchsorted(np.arange(n_i + 1)))
            rows = np.empty((g_P.size, 1 + _KEY_COLS.size), dtype=_I64)
            rows[:, 0] = ids[g_P]
            rows[:, 1:] = table_GIF[g_P, i_P][:, _KEY_COLS]
            rows_P.append(rows)
        count_I2 = np.stack([a[1:] - a[:-1] for a in at_I], axis=1)
        (at_s, at_d), (rows_s, rows_d) = [a.tolist() for a in at_I], rows_P
        return [
            Digest(extra, count_I2[i], rows_s[at_s[i] : at_s[i + 1]], size=16)
            .update(rows_d[at_d[i] : at_d[i + 1]])
            .digest()
            for i in range(n_i)
        ]


def _meets(lo_IX: np.ndarray, hi_IX: np.ndarray, lo_I: np.ndarray, hi_I: np.ndarray) -> np.ndarray:
    """``[I, X]`` whether group ``x``'s range in micro-batch ``i`` meets ``[lo_I, hi_I]`` (a
    superset of the planner's test: an empty group's ``(1, 0)`` may count as meeting)."""
    return (hi_I[:, None] >= lo_IX) & (lo_I[:, None] <= hi_IX) & (lo_I <= hi_I)[:, None]


def _hull(
    lo_IX: np.ndarray, hi_IX: np.ndarray, live_IX: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``([I], [I])`` smallest and largest sample id over the groups ``live_IX[i]`` selects of
    ``[I, X]`` sample ranges, per micro-batch (none: the lowest int64 above the highest, which
    meets nothing)."""
    big = np.iinfo(_I64)
    lo_I = np.where(live_IX, lo_IX, big.max).min(axis=1, initial=big.max)
    hi_I = np.where(live_IX, hi_IX, big.min).max(axis=1, initial=big.min)
    return lo_I, hi_I


def read_step(topology: Topology, matrix: StepMatrix, n_slots: int) -> StepView:
    """The step as one rank reads it: every group leader's slot tables (one strided slice per
    section, the same column in every record: :meth:`~mopd.bridge.metadata.StepMatrix.
    slot_tables`, read when first looked at) and the per-micro-batch catalogs on them (built
    when first looked at: a micro-batch whose schedule is cached is never decoded). The step
    must be agreed (same ``n_slots`` everywhere, no errors: the bridge's fence and checks
    ran)."""
    return StepView(topology=topology, matrix=matrix, n_slots=n_slots)


def config_signature(
    teachers: Sequence[TeacherSpec],
    student: Mesh,
    config: BridgeConfig,
    *,
    members: Sequence[int],
    routed: bool,
) -> int:
    """The configuration word every record of a job carries (the same on every rank of one
    bridge): its meshes, teachers, settings, members and whether its metadata is routed."""
    sig = repr(
        [(*t.mesh.as_ints(), t.hidden_size, t.sp_shards) for t in teachers]
        + [
            student.as_ints(),
            config.local_copy,
            config.keep_sp_shard,
            config.integrity,
            tuple(members),
            routed,
        ]
    )
    return Digest(sig, size=7).word()
