"""Process groups for the bridge: created once, collectively, in a documented order; looked up locally.

Why this file exists: ``torch.distributed.new_group`` is collective over the whole default group
and must be called by every rank in the same order, while the bridge runs on a subset of ranks
many times. Creation (collective, once) and lookup (local, every call) are therefore separate.
Nothing here is a module global: the caller owns the :class:`GroupPool` and passes groups in.

Creation order of :func:`create_bridge_groups` (every global rank of the default group calls it,
with the same meshes, in the same program order as its other ``new_group`` calls):

1. the bridge group: the sorted union of every rank of every teacher mesh and the student mesh
   (all of them take part in the metadata exchange; ranks that hold nothing move nothing);
2. for each student ``(dp_rank, cp_rank)`` shard in :meth:`Mesh.shards` order (dp major), the
   student's last-stage TP group, when ``student.tp > 1`` (the all-gather after the crossing).

A live Megatron job may pass its own student TP group instead of 2. (``BridgeGroups(student_tp=...)``).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from mopd.bridge.mesh import Mesh

__all__ = [
    "BridgeGroups",
    "GroupPool",
    "all_gather_flat",
    "create_bridge_groups",
    "lookup_bridge_groups",
]


def all_gather_flat(output: Any, input_: Any, *, group: Any, timeout: datetime.timedelta) -> None:
    """All-gather equal-sized ``input_`` into the concatenated ``output`` and wait (timeout).

    ``all_gather_single`` where torch has it (``all_gather_into_tensor`` is deprecated there),
    else ``all_gather_into_tensor``; in place when ``input_`` is this rank's slice of ``output``.
    """
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = fn(output, input_, group=group, async_op=True)
    if work is not None:
        work.wait(timeout)


class GroupPool:
    """Process groups keyed by their sorted rank tuple.

    :meth:`create` is collective over the default group (every rank, same order); creating a
    rank set twice returns the existing group without a collective, which is deterministic
    because every rank holds the same creation history. :meth:`get` is local.
    """

    def __init__(
        self, *, backend: str | None = None, timeout: datetime.timedelta | None = None
    ) -> None:
        self.backend = backend
        self.timeout = timeout
        self._groups: dict[tuple[int, ...], Any] = {}

    def create(self, ranks: Sequence[int]) -> Any | None:
        """Create (collectively) the group of ``ranks``; returns it on members, ``None`` elsewhere."""
        key = tuple(sorted(set(ranks)))
        if key not in self._groups:
            kwargs: dict[str, Any] = {"ranks": list(key)}
            if self.backend is not None:
                kwargs["backend"] = self.backend
            if self.timeout is not None:
                kwargs["timeout"] = self.timeout
            self._groups[key] = dist.new_group(**kwargs)
        return self.get(key)

    def get(self, ranks: Sequence[int]) -> Any | None:
        """The group of ``ranks`` (``None`` if this rank is not a member); ``KeyError`` if never created."""
        key = tuple(sorted(set(ranks)))
        group = self._groups[key]
        return None if dist.get_rank() not in key else group


@dataclass(frozen=True, kw_only=True, eq=False)
class BridgeGroups:
    """This rank's groups for one bridge.

    Attributes:
        bridge: the group over every rank of every mesh (metadata exchange, the point-to-point
            batch); ``None`` on ranks outside all meshes.
        student_tp: this rank's student TP group on the last stage (``None`` when ``tp == 1``
            or the rank holds no student shard).
        members: global ranks of the bridge group.
    """

    bridge: Any | None
    student_tp: Any | None
    members: tuple[int, ...]


def _bridge_members(teachers: Sequence[Mesh], student: Mesh) -> tuple[int, ...]:
    ranks: set[int] = set(student.ranks)
    for t in teachers:
        ranks |= set(t.ranks)
    return tuple(sorted(ranks))


def create_bridge_groups(pool: GroupPool, teachers: Sequence[Mesh], student: Mesh) -> BridgeGroups:
    """Create the bridge's groups (collective over the default group, order in the module doc)."""
    members = _bridge_members(teachers, student)
    world = dist.get_world_size()
    if members[-1] >= world:
        raise ValueError(
            f"meshes use global ranks up to {members[-1]} but the world has {world} ranks: "
            + ", ".join(str(m) for m in [*teachers, student])
        )
    pool.create(members)
    if student.tp > 1:
        for d, c in student.shards():
            pool.create(student.tp_group_ranks(dp_rank=d, cp_rank=c))
    return lookup_bridge_groups(pool, teachers, student)


def lookup_bridge_groups(pool: GroupPool, teachers: Sequence[Mesh], student: Mesh) -> BridgeGroups:
    """This rank's groups, from a pool where :func:`create_bridge_groups` already ran (local)."""
    members = _bridge_members(teachers, student)
    me = dist.get_rank()
    tp_group = None
    c = student.coord(me)
    if student.tp > 1 and c is not None and c.pp_rank == student.pp - 1:
        tp_group = pool.get(student.tp_group_ranks(dp_rank=c.dp_rank, cp_rank=c.cp_rank))
    return BridgeGroups(bridge=pool.get(members), student_tp=tp_group, members=members)
