"""mopd.bridge: move captured teacher hidden states into every student rank's own layout.

Meshes (:mod:`.mesh`), token layouts (:mod:`.layout`), the pure planner (:mod:`.planner`),
process groups (:mod:`.groups`), layout metadata (:mod:`.metadata`), the executor
(:mod:`.executor`), the live bridge (:mod:`.api`) and the teacher LM-head reshard (:mod:`.lm_head`);
:mod:`.synthetic` builds seeded steps (layouts of both sides, key-derived rows) for tests, the
benchmark, the demo and the plan inspector.

One step, on every rank of every mesh::

    pool = GroupPool(backend="nccl", timeout=timedelta(seconds=300))  # once; NCCL's watchdog
    groups = create_bridge_groups(pool, [teacher], student)  # once, collective, fixed order
    bridge = HiddenStateBridge(teachers=[TeacherSpec(mesh=teacher, hidden_size=H)],
                               student=student, groups=groups)
    handle = bridge.exchange(hidden={0: h_SBH}, layouts={0: layout},   # teacher last stage
                             student_layout=my_layout)                 # student last stage
    ...                                                    # student forward overlaps
    h_teacher = handle.wait()[0]                           # [N, H] in the student's row order

Every rank calls ``handle.wait()`` (teacher-only ranks too). On CUDA it makes the current stream
wait and returns at once; the pool's timeout is then what turns a hung peer into an error.
"""

from __future__ import annotations

from mopd.bridge.api import BridgeConfig, HiddenStateBridge, PreparedExchange, TeacherSpec
from mopd.bridge.errors import (
    BridgeCommError,
    BridgeError,
    BridgeIntegrityError,
    BridgeStateError,
    BridgeTimeoutError,
)
from mopd.bridge.executor import ExchangeHandle, Executor
from mopd.bridge.groups import BridgeGroups, GroupPool, create_bridge_groups, lookup_bridge_groups
from mopd.bridge.layout import (
    TokenLayout,
    concat_layouts,
    cp_positions,
    encode_keys,
    layout_from_runs,
    layout_to_runs,
    packed_layout,
    padded_layout,
    vocab_layout,
)
from mopd.bridge.lm_head import LMHeadShard, VocabSpec, plan_lm_head, reshard_lm_head
from mopd.bridge.mesh import (
    Mesh,
    MeshCoord,
    mesh_from_groups,
    mesh_from_parallel_state,
    mesh_from_pg_collection,
    meshes_overlap,
)
from mopd.bridge.planner import (
    DestGroup,
    DestPlan,
    SourceGroup,
    StudentBatch,
    TeacherBatch,
    TransferPlan,
    plan_token_exchange,
    plan_transfers,
)
from mopd.bridge.schedule import RankSchedule

__all__ = [
    "BridgeCommError",
    "BridgeConfig",
    "BridgeError",
    "BridgeGroups",
    "BridgeIntegrityError",
    "BridgeStateError",
    "BridgeTimeoutError",
    "DestGroup",
    "DestPlan",
    "ExchangeHandle",
    "Executor",
    "GroupPool",
    "HiddenStateBridge",
    "LMHeadShard",
    "Mesh",
    "MeshCoord",
    "PreparedExchange",
    "RankSchedule",
    "SourceGroup",
    "StudentBatch",
    "TeacherBatch",
    "TeacherSpec",
    "TokenLayout",
    "TransferPlan",
    "VocabSpec",
    "concat_layouts",
    "cp_positions",
    "create_bridge_groups",
    "encode_keys",
    "layout_from_runs",
    "layout_to_runs",
    "lookup_bridge_groups",
    "mesh_from_groups",
    "mesh_from_parallel_state",
    "mesh_from_pg_collection",
    "meshes_overlap",
    "packed_layout",
    "padded_layout",
    "plan_lm_head",
    "plan_token_exchange",
    "plan_transfers",
    "reshard_lm_head",
    "vocab_layout",
]
