"""One rank's step of the bridge without processes: its record, then its verdicts and plans.

Why this file exists: the ``mopd plan`` inspector, ``mopd bench plan`` and the tests run a
step's host work as one rank of a live job runs it (the record it contributes, the fence, the
shared verdict, the plan keys, the plans and schedules) with no process group. They build every
member's record by the bridge's rule in one place (:func:`step_records`), and step one rank
through one door (:class:`OfflineBridge`, on a bridge made by
:meth:`~mopd.bridge.api.HiddenStateBridge.offline`), so that what they run is the live bridge's
own code and never a copy of its fields.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mopd.bridge.api import BridgeConfig, HiddenStateBridge, TeacherSpec
from mopd.bridge.executor import Executor
from mopd.bridge.inputs import Agreement
from mopd.bridge.layout import TokenLayout
from mopd.bridge.mesh import Mesh
from mopd.bridge.metadata import Section, StepMatrix, encode_step_record
from mopd.bridge.record import config_signature, rank_roles, rank_sections
from mopd.bridge.route import Wire
from mopd.bridge.step import BridgeStep
from mopd.bridge.topology import Topology

__all__ = ["LocalRecord", "OfflineBridge", "holder_key", "step_records"]


@dataclass(frozen=True, kw_only=True, eq=False)
class LocalRecord:
    """What one rank contributes to a step: ``record`` (``[W]`` int64, the words it sends in the
    metadata exchange) and what it keeps for planning (its sections and agreements)."""

    record: torch.Tensor
    sections: list[Section | None]
    agreements: tuple[Agreement, ...]


class OfflineBridge:
    """Global rank ``rank``'s bridge over these meshes, stepped without processes.

    A step is :meth:`record` (this rank's record for its layouts), then, from the records the
    caller exchanged (every member's stacked, or this rank's routed ones, as a
    :class:`~mopd.bridge.metadata.StepMatrix`), :meth:`plan`: the fence, the verdict (its one
    sum goes over ``wire``), the plan keys and the plans or cached schedules, as a live rank
    runs them. Nothing moves: the planned step is finished at once, and every step is this
    bridge's step 0 (the caller's records, built once, serve every step). The plan memo stays
    between steps as a live bridge keeps it (:meth:`forget_memo` drops it).

    Args:
        teachers, student, config: as for :class:`~mopd.bridge.api.HiddenStateBridge`.
        rank: the global rank.
        topology: the meshes' topology, when the caller has it (the same for every rank).
        wire: ``deadline ->`` the metadata rounds' and the verdict sum's transport.
    """

    def __init__(
        self,
        *,
        teachers: Sequence[TeacherSpec],
        student: Mesh,
        rank: int,
        config: BridgeConfig | None = None,
        topology: Topology | None = None,
        wire: Callable[[float], Wire] | None = None,
    ) -> None:
        self.bridge = HiddenStateBridge.offline(
            teachers=teachers,
            student=student,
            rank=rank,
            config=config,
            topology=topology,
            wire=wire,
        )

    @property
    def rank(self) -> int:
        """The global rank this bridge is."""
        return self.bridge.rank

    @property
    def topology(self) -> Topology:
        """The meshes' topology."""
        return self.bridge.topology

    @property
    def config_sig(self) -> int:
        """The configuration word every record of this job carries."""
        return self.bridge.config_sig

    @property
    def executor(self) -> Executor:
        """The schedule cache and its figures."""
        return self.bridge.executor

    @property
    def memo_step(self) -> int | None:
        """The step whose records the plan memo holds (``None``: no memo)."""
        memo = self.bridge._memo
        return None if memo is None else memo.step

    def memo_matrix(self, summary: np.ndarray) -> StepMatrix | None:
        """The plan memo's records as a repeated step's, when ``summary`` (the header
        summary's all-reduce) says every record repeats the memo's step; else ``None``, and
        the memo is dropped (as the live bridge decides)."""
        return self.bridge._memo_matrix(summary)

    def use_wire(self, wire: Callable[[float], Wire]) -> None:
        """The metadata transport of the steps from now on."""
        self.bridge._offline_wire = wire

    def forget_memo(self) -> None:
        """Drop the plan memo, as the bridge does when a step's records cannot reuse it."""
        self.bridge.forget_plan_memo()

    def record(
        self,
        teacher_layouts: Mapping[int, Sequence[TokenLayout]] | None,
        student_layouts: Sequence[TokenLayout] | None,
    ) -> LocalRecord:
        """This rank's record for its layouts: per teacher index one layout per micro-batch
        of the rows it sends, and one per micro-batch of the rows it receives (``None``
        where it holds none; the arguments of
        :meth:`~mopd.bridge.api.HiddenStateBridge.plan_step`). Local: bad input becomes the
        record's error text, which every rank reads after the exchange."""
        record, sections, agreements = self.bridge._local_record(
            teacher_layouts or None, student_layouts, None, None, []
        )
        return LocalRecord(record=record, sections=sections, agreements=agreements)

    def plan(self, matrix: StepMatrix, local: LocalRecord) -> BridgeStep:
        """The step from the exchanged records: fence, verdict, plan keys, plans and schedules
        (a ``ValueError`` when the verdict refuses the input, as on every live rank). The step
        is finished here (nothing moves); its schedules stay readable."""
        bridge = self.bridge
        step = bridge._agree_and_plan(matrix, local.sections, local.agreements)
        step.finished = True
        bridge._open_steps.clear()
        bridge.steps = 0
        return step


#: Where a rank's layouts are looked up (:func:`holder_key`): its global rank, or its
#: ``(dp_rank, cp_rank)`` shard.
HolderKey = Hashable


def holder_key(mesh: Mesh, global_rank: int, *, per_rank: bool) -> HolderKey:
    """The key of ``global_rank``'s layouts on ``mesh``: the rank itself where each rank holds
    its own rows (``per_rank``: a teacher's SP-shard sources, a student that keeps its SP
    shard), else its ``(dp_rank, cp_rank)`` shard, whose TP replicas hold the same rows."""
    if per_rank:
        return global_rank
    c = mesh.coord(global_rank)
    assert c is not None, (global_rank, mesh)
    return (c.dp_rank, c.cp_rank)


def step_records(
    teachers: Sequence[TeacherSpec],
    student: Mesh,
    *,
    n_slots: int,
    teacher_layouts: Sequence[Callable[[HolderKey], Sequence[TokenLayout]]],
    student_layouts: Callable[[HolderKey], Sequence[TokenLayout]],
    config: BridgeConfig | None = None,
    topology: Topology | None = None,
    agreements: Mapping[int, Sequence[Agreement]] | None = None,
) -> tuple[Topology, list[torch.Tensor]]:
    """Every member's record of a step of ``n_slots`` micro-batches, as the bridge's ranks
    would contribute them (their roles, sections and configuration word), in member order.

    Args:
        teacher_layouts: per teacher, ``holder key -> `` one layout per micro-batch (the rows
            that shard or rank sends; :func:`holder_key`, per rank for ``sp_shards``).
        student_layouts: ``holder key -> `` one layout per micro-batch of the rows it receives
            (per rank with ``config.keep_sp_shard``).
        topology: the meshes' topology when the caller has it; else built here.
        agreements: global rank -> the agreements it gives.

    Ranks with the same holder keys and roles (TP replicas) share one encoding; the layouts
    are looked up in member order, once per distinct key (a caller may build them lazily).
    """
    cfg = config or BridgeConfig()
    meshes = [t.mesh for t in teachers]
    shards = [t.sp_shards for t in teachers]
    topo = topology or Topology.build(
        meshes, student, per_rank_dests=cfg.keep_sp_shard, shard_sources=shards
    )
    # the configuration word of every record: an offline bridge's own
    sig = config_signature(teachers, student, cfg, members=topo.members, routed=False)
    dtypes = [t.dtype for t in teachers]
    hiddens = [t.hidden_size for t in teachers]
    given = agreements or {}
    shared: dict[Hashable, torch.Tensor] = {}
    records: list[torch.Tensor] = []
    for r in topo.members:
        roles = rank_roles(
            r, meshes, student, keep_sp_shard=cfg.keep_sp_shard, shard_sources=shards
        )
        t_keys = tuple(
            None if roles[o] is None else holder_key(m, r, per_rank=shards[o])
            for o, m in enumerate(meshes)
        )
        s_key = None if roles[-1] is None else holder_key(student, r, per_rank=cfg.keep_sp_shard)
        key = (t_keys, s_key, roles)
        mine = given.get(r, ())
        rec = shared.get(key) if not mine else None
        if rec is None:
            sections = rank_sections(
                roles,
                teacher_layouts={
                    o: teacher_layouts[o](k) for o, k in enumerate(t_keys) if k is not None
                },
                student_layouts=None if s_key is None else student_layouts(s_key),
                dtypes=dtypes,
                hiddens=hiddens,
            )
            rec = encode_step_record(
                config_sig=sig, n_slots=n_slots, error="", sections=sections, agreements=mine
            )
            if not mine:
                shared[key] = rec
        records.append(rec)
    return topo, records
