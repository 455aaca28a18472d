"""Building a test bridge in one call: fresh bridge groups from a pool, one spec per teacher.

Why this file exists: most bridge tests want "a ``HiddenStateBridge`` from these teacher meshes to
this student mesh, with these hidden sizes and this config" and nothing more; spelling out the
groups, the ``TeacherSpec`` list and the ``BridgeConfig`` each time buried what a test varies.
Tests that look at the groups themselves, or at what the constructor warns or raises, still
build the bridge by hand.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mopd.bridge.api import BridgeConfig, HiddenStateBridge, TeacherSpec
from mopd.bridge.executor import DebugHook
from mopd.bridge.groups import GroupPool, create_bridge_groups
from mopd.bridge.mesh import Mesh

__all__ = ["make_bridge"]


def make_bridge(
    pool: GroupPool,
    teachers: Sequence[Mesh],
    student: Mesh,
    hidden_sizes: Sequence[int],
    *,
    debug_hook: DebugHook | None = None,
    **config: Any,
) -> HiddenStateBridge:
    """A bridge from ``teachers`` to ``student`` on groups freshly created from ``pool``.

    Args:
        pool: where the bridge groups come from (``create_bridge_groups`` is collective: every
            rank of the world calls this in the same order).
        teachers: the teacher meshes, in teacher-index order.
        student: the student mesh.
        hidden_sizes: teacher ``o``'s hidden size is ``hidden_sizes[o]`` (one per teacher).
        debug_hook: passed to the bridge (tests inject faults through it).
        config: :class:`~mopd.bridge.BridgeConfig` fields.
    Raises:
        ValueError: ``hidden_sizes`` does not have one entry per teacher (before any group is
            created), or anything the groups, specs or config reject.
    """
    teachers = list(teachers)
    if len(hidden_sizes) != len(teachers):
        raise ValueError(
            f"{len(teachers)} teacher meshes but {len(hidden_sizes)} hidden sizes "
            f"{list(hidden_sizes)}: need one per teacher"
        )
    groups = create_bridge_groups(pool, teachers, student)
    return HiddenStateBridge(
        teachers=[
            TeacherSpec(mesh=m, hidden_size=h) for m, h in zip(teachers, hidden_sizes, strict=True)
        ],
        student=student,
        groups=groups,
        config=BridgeConfig(**config),
        debug_hook=debug_hook,
    )
