"""Building a test bridge in one call: fresh bridge groups from a pool, one spec per teacher.

Why this file exists: most bridge tests want "a ``HiddenStateBridge`` from these teacher meshes to
this student mesh, with these hidden sizes, this dtype and this config" and nothing more;
spelling out the groups, the ``TeacherSpec`` list and the ``BridgeConfig`` each time buried what a
test varies. Tests that inject faults set ``bridge.executor.debug_hook`` on the result. Tests that
look at the groups themselves, or at what the constructor warns or raises, still build the bridge
by hand.

:func:`poison_outputs` makes the output buffers the bridge allocates start as NaN bit patterns
(the bridge allocates them itself now, so a test cannot hand in poisoned ones): a row that no
transfer, local copy or zero-fill writes then fails an exact comparison instead of passing by
the luck of what the allocator handed out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from unittest import mock

import torch

from mopd.bridge.api import HiddenStateBridge
from mopd.bridge.config import BridgeConfig, TeacherSpec
from mopd.bridge.groups import GroupPool, create_bridge_groups
from mopd.bridge.mesh import Mesh

__all__ = ["make_bridge", "poison", "poison_outputs"]


def make_bridge(
    pool: GroupPool,
    teachers: Sequence[Mesh],
    student: Mesh,
    hidden_sizes: Sequence[int],
    *,
    dtype: torch.dtype | Sequence[torch.dtype | None] | None = None,
    **config: Any,
) -> HiddenStateBridge:
    """A bridge from ``teachers`` to ``student`` on groups freshly created from ``pool``.

    Args:
        pool: where the bridge groups come from (``create_bridge_groups`` is collective: every
            rank of the world calls this in the same order).
        teachers: the teacher meshes, in teacher-index order.
        student: the student mesh.
        hidden_sizes: teacher ``o``'s hidden size is ``hidden_sizes[o]`` (one per teacher).
        dtype: every teacher's ``TeacherSpec.dtype`` (needed to :meth:`plan_step` before the
            teacher has run), or one per teacher; ``None``: unknown (``exchange`` reads it off
            the buffer).
        config: :class:`~mopd.bridge.BridgeConfig` fields.
    Raises:
        ValueError: ``hidden_sizes`` or a ``dtype`` sequence does not have one entry per
            teacher (before any group is created), or anything the groups, specs or config
            reject.
    """
    teachers = list(teachers)
    if len(hidden_sizes) != len(teachers):
        raise ValueError(
            f"{len(teachers)} teacher meshes but {len(hidden_sizes)} hidden sizes "
            f"{list(hidden_sizes)}: need one per teacher"
        )
    dtypes = list(dtype) if isinstance(dtype, Sequence) else [dtype] * len(teachers)
    if len(dtypes) != len(teachers):
        raise ValueError(f"{len(teachers)} teacher meshes but {len(dtypes)} dtypes {dtypes}")
    groups = create_bridge_groups(pool, teachers, student)
    return HiddenStateBridge(
        teachers=[
            TeacherSpec(mesh=m, hidden_size=h, dtype=d)
            for m, h, d in zip(teachers, hidden_sizes, dtypes, strict=True)
        ],
        student=student,
        groups=groups,
        config=BridgeConfig(**config),
    )


_INT_OF = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with all-ones bits (a NaN in every float dtype) in place; returns ``t``."""
    t.view(_INT_OF[t.element_size()]).fill_(-1)
    return t


def poison_outputs(bridge: HiddenStateBridge) -> HiddenStateBridge:
    """Make every output buffer ``bridge`` allocates from now on start poisoned (see the module
    doc); the bridge then zero-fills the rows nothing writes, as it always does. Returns it."""
    ex = bridge.executor
    allocate = ex._outputs

    def poisoned_outputs(slot: Any, sched: Any, output_specs: Any, device: Any) -> None:
        if sched.dest is None or slot.outputs:
            allocate(slot, sched, output_specs, device)
            return
        real_empty = torch.empty

        def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
            return poison(real_empty(*args, **kwargs))

        with mock.patch.object(torch, "empty", empty):
            allocate(slot, sched, output_specs, device)

    ex._outputs = poisoned_outputs  # type: ignore[method-assign]
    return bridge
