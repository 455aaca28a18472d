"""``mopd plan``'s simulated step: every rank's record, the gathered matrix, every rank's plan.

Why this file exists: the inspector reports on the plans the live bridge's ranks would make, so
it builds every member's record by the bridge's rule (:func:`mopd.bridge.offline.step_records`)
and runs each rank's verdicts and planner on them, without processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mopd.bridge.catalog import RunCatalog
    from mopd.bridge.layout import TokenLayout
    from mopd.bridge.metadata import StepMatrix
    from mopd.bridge.plan import RankPlan
    from mopd.bridge.topology import Topology

from mopd.profiling.plan.request import PlanRequest, build_layouts

__all__ = [
    "SimulatedStep",
    "simulate_step",
]


@dataclass(frozen=True, kw_only=True, eq=False)
class SimulatedStep:
    """One step as every rank of a live bridge would see and plan it.

    Attributes:
        topology: the meshes' groups (:class:`~mopd.bridge.topology.Topology`).
        matrix: the gathered metadata of every rank (:class:`~mopd.bridge.metadata.StepMatrix`).
        catalogs: per micro-batch, the planner's view of it.
        plans: per micro-batch, every member rank's :class:`~mopd.bridge.plan.RankPlan`.
        teacher_layouts, student_layouts: per micro-batch, what :func:`build_layouts` made.
    """

    topology: Topology
    matrix: StepMatrix
    catalogs: tuple[RunCatalog, ...]
    plans: tuple[dict[int, RankPlan], ...]
    teacher_layouts: tuple[dict[Any, TokenLayout], ...]
    student_layouts: tuple[dict[Any, TokenLayout], ...]


def simulate_step(req: PlanRequest) -> SimulatedStep:
    """Every rank's record, the gathered matrix, every rank's verdicts and plan (no processes).

    Raises:
        ValueError: a verdict of :func:`~mopd.bridge.coverage.check_rank` (the bridge would refuse
            this step on every rank).
    """
    import torch

    from mopd.bridge.config import BridgeConfig, TeacherSpec
    from mopd.bridge.coverage import check_rank
    from mopd.bridge.metadata import StepMatrix
    from mopd.bridge.offline import step_records
    from mopd.bridge.plan import plan_rank
    from mopd.bridge.record import read_step, stack_records

    t, s = req.teacher, req.student
    t_lay, s_lay = build_layouts(req)
    m = req.micro_batches
    # every rank's record by the bridge's rule; layouts by holder key (a (dp, cp) shard, or a
    # rank where each holds its own rows), as build_layouts keys them
    topo, records = step_records(
        [
            TeacherSpec(
                mesh=t,
                hidden_size=req.hidden_size,
                dtype=torch.bfloat16,  # the planner does not read it; bytes use dtype_bytes
                sp_shards=req.sources_from_shards,
            )
        ],
        s,
        n_slots=m,
        teacher_layouts=[lambda key: [t_lay[i][key] for i in range(m)]],
        student_layouts=lambda key: [s_lay[i][key] for i in range(m)],
        config=BridgeConfig(keep_sp_shard=req.keeps_sp_slice),
    )
    gathered, _ = stack_records(records)
    matrix = StepMatrix(gathered)
    view = read_step(topo, matrix, m)
    catalogs, plans = [], []
    for i in range(m):
        catalog = view.catalogs[i]
        verdicts = [v for r in topo.members for v in check_rank(catalog, r)]
        if verdicts:
            raise ValueError(f"the bridge would refuse micro-batch {i}: {verdicts[0]}")
        catalogs.append(catalog)
        plans.append({r: plan_rank(catalog, r, compact=True) for r in topo.members})
    return SimulatedStep(
        topology=topo,
        matrix=matrix,
        catalogs=tuple(catalogs),
        plans=tuple(plans),
        teacher_layouts=tuple(t_lay),
        student_layouts=tuple(s_lay),
    )
