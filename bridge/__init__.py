"""mopd.bridge: move captured teacher hidden states into every student rank's own layout.

Once, on every rank (group creation is collective, in a fixed order)::

    pool = GroupPool(backend="nccl", timeout_s=300)
    groups = create_bridge_groups(pool, [teacher], student)
    bridge = HiddenStateBridge(teachers=[TeacherSpec(mesh=teacher, hidden_size=H,
                                                     dtype=torch.bfloat16)],
                               student=student, groups=groups)

Per step: :meth:`HiddenStateBridge.plan_step` outside the training schedule (one metadata
collective for all micro-batches), then per micro-batch ``step.send(i, {0: h_SBH})`` on teacher
ranks and ``step.receive(i)[0]`` on student ranks (point to point, safe inside Megatron's
``forward_step_func`` / ``loss_func``; each teacher's rows arrive compact, one per token it
owns, in the student's order, and :func:`layout_rows` puts them back in the layout's rows),
and ``step.finish()`` after the schedule on every rank.
:meth:`HiddenStateBridge.exchange` does one micro-batch in one call. The teachers' LM heads move
into the student's vocab partition once (:func:`reshard_lm_head`).

Nothing here imports megatron: what reads megatron's objects (process groups, meshes off its
groups, LM heads off its models) is :mod:`mopd.mcore`'s.

The bridge and its planning call are :mod:`.api`'s; a planned step (:class:`BridgeStep`,
:class:`ExchangeHandle`) is :mod:`.step`'s; the configs (:class:`TeacherSpec`,
:class:`BridgeConfig`) are :mod:`.config`'s; a bridge across worlds (a teacher job beside the
student's job) is made on :func:`connect_worlds`'s :class:`WorldLink` (:mod:`.worlds`). Internals live in their modules (:mod:`.checks`,
:mod:`.inputs`, :mod:`.plan`, :mod:`.record`, :mod:`.metadata`, :mod:`.topology`,
:mod:`.schedule`, :mod:`.order`, :mod:`.executor`, :mod:`.transport`, :mod:`.integrity`,
:mod:`.compact`).
"""

from __future__ import annotations

from mopd.bridge.api import HiddenStateBridge
from mopd.bridge.compact import compact_rows, layout_rows
from mopd.bridge.config import BridgeConfig, TeacherSpec
from mopd.bridge.errors import (
    BridgeCommError,
    BridgeError,
    BridgeIntegrityError,
    BridgeNonFiniteError,
    BridgeStateError,
    BridgeTimeoutError,
)
from mopd.bridge.groups import BridgeGroups, GroupPool, create_bridge_groups
from mopd.bridge.layout import (
    TokenLayout,
    concat_layouts,
    packed_layout,
    packed_layouts,
    padded_layout,
)
from mopd.bridge.lm_head import LMHeadShard, VocabSpec, reshard_lm_head
from mopd.bridge.mesh import Mesh, MeshCoord, mesh_from_groups
from mopd.bridge.step import BridgeStep, ExchangeHandle
from mopd.bridge.worlds import WorldLink, connect_worlds

__all__ = [
    "BridgeCommError",
    "BridgeConfig",
    "BridgeError",
    "BridgeGroups",
    "BridgeIntegrityError",
    "BridgeNonFiniteError",
    "BridgeStateError",
    "BridgeStep",
    "BridgeTimeoutError",
    "ExchangeHandle",
    "GroupPool",
    "HiddenStateBridge",
    "LMHeadShard",
    "Mesh",
    "MeshCoord",
    "TeacherSpec",
    "TokenLayout",
    "VocabSpec",
    "WorldLink",
    "compact_rows",
    "concat_layouts",
    "connect_worlds",
    "create_bridge_groups",
    "layout_rows",
    "mesh_from_groups",
    "packed_layout",
    "packed_layouts",
    "padded_layout",
    "reshard_lm_head",
]
