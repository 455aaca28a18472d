"""Parallel meshes: a model's grid of global ranks, in Megatron's ``tp-cp-ep-dp-pp`` order.

Why this file exists: the bridge must know, for any global rank, whether it holds a teacher
shard, a student shard or both, and at which (tp, cp, dp, pp) coordinates. Teacher and student
meshes are independent grids that may be disjoint or share global ranks (colocated). Everything
else in :mod:`mopd.bridge` speaks in these coordinates.

Rank order (Megatron's default ``tp-cp-ep-dp-pp``, expert parallelism folded into dp because the
dense LM head and the hidden states do not see it; tp varies fastest)::

    global_rank = rank_offset + tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

A mesh is built from explicit sizes (:class:`Mesh`), or from live process groups
(:func:`mesh_from_groups`; from megatron's objects, :mod:`mopd.mcore.megatron_groups`), which are checked against the formula above (``ValueError`` on mismatch; the check is local to
each rank, so call them on every rank of the mesh before the bridge's first collective).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

__all__ = [
    "Mesh",
    "MeshCoord",
    "bridge_members",
    "mesh_from_groups",
    "meshes_overlap",
]


@dataclass(frozen=True, kw_only=True)
class MeshCoord:
    """The coordinates of one global rank inside a :class:`Mesh`."""

    tp_rank: int
    cp_rank: int
    dp_rank: int
    pp_rank: int


@dataclass(frozen=True, kw_only=True)
class Mesh:
    """A ``tp x cp x dp x pp`` grid of consecutive global ranks starting at ``rank_offset``.

    Attributes:
        tp, cp, dp, pp: parallel sizes (ep folded into ``dp``).
        rank_offset: the global rank of coordinate (0, 0, 0, 0).
        name: a label for messages (``"teacher0"``, ``"student"``).
    """

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    rank_offset: int = 0
    name: str = ""

    def __post_init__(self) -> None:
        for field in ("tp", "cp", "dp", "pp"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"mesh {self.name!r}: {field} must be a positive int, got {value!r}"
                )
        if not isinstance(self.rank_offset, int) or self.rank_offset < 0:
            raise ValueError(
                f"mesh {self.name!r}: rank_offset must be a non-negative int, got {self.rank_offset!r}"
            )

    @property
    def size(self) -> int:
        """Number of global ranks in the mesh."""
        return self.tp * self.cp * self.dp * self.pp

    @property
    def ranks(self) -> range:
        """The global ranks of the mesh."""
        return range(self.rank_offset, self.rank_offset + self.size)

    def global_rank(
        self, *, tp_rank: int = 0, cp_rank: int = 0, dp_rank: int = 0, pp_rank: int = 0
    ) -> int:
        """The global rank at the given coordinates (Megatron order, tp fastest)."""
        for name, value, size in (
            ("tp_rank", tp_rank, self.tp),
            ("cp_rank", cp_rank, self.cp),
            ("dp_rank", dp_rank, self.dp),
            ("pp_rank", pp_rank, self.pp),
        ):
            if not 0 <= value < size:
                raise ValueError(f"mesh {self.name!r}: {name}={value} outside [0, {size})")
        return (
            self.rank_offset
            + tp_rank
            + self.tp * (cp_rank + self.cp * (dp_rank + self.dp * pp_rank))
        )

    def coord(self, global_rank: int) -> MeshCoord | None:
        """The coordinates of ``global_rank``, or ``None`` if the rank is not in the mesh."""
        local = global_rank - self.rank_offset
        if not 0 <= local < self.size:
            return None
        tp_rank = local % self.tp
        local //= self.tp
        cp_rank = local % self.cp
        local //= self.cp
        dp_rank = local % self.dp
        return MeshCoord(
            tp_rank=tp_rank, cp_rank=cp_rank, dp_rank=dp_rank, pp_rank=local // self.dp
        )

    def is_last_stage(self, global_rank: int) -> bool:
        """True if ``global_rank`` is in the mesh and on its last pipeline stage."""
        c = self.coord(global_rank)
        return c is not None and c.pp_rank == self.pp - 1

    def shards(self) -> list[tuple[int, int]]:
        """The ``(dp_rank, cp_rank)`` token shards, in plan order (dp major, cp minor)."""
        return [(d, c) for d in range(self.dp) for c in range(self.cp)]

    def tp_group_ranks(
        self, *, dp_rank: int, cp_rank: int, pp_rank: int | None = None
    ) -> tuple[int, ...]:
        """Global ranks of the TP group at ``(dp_rank, cp_rank)`` (last stage by default)."""
        pp_rank = self.pp - 1 if pp_rank is None else pp_rank
        return tuple(
            self.global_rank(tp_rank=t, cp_rank=cp_rank, dp_rank=dp_rank, pp_rank=pp_rank)
            for t in range(self.tp)
        )

    def last_stage_ranks(self) -> tuple[int, ...]:
        """Global ranks on the last pipeline stage, ascending."""
        start = self.rank_offset + (self.pp - 1) * self.tp * self.cp * self.dp
        return tuple(range(start, start + self.tp * self.cp * self.dp))

    def as_ints(self) -> tuple[int, int, int, int, int]:
        """``(tp, cp, dp, pp, rank_offset)``: what travels in metadata."""
        return (self.tp, self.cp, self.dp, self.pp, self.rank_offset)

    def __str__(self) -> str:
        label = f"{self.name} " if self.name else ""
        return (
            f"{label}Mesh(tp={self.tp}, cp={self.cp}, dp={self.dp}, pp={self.pp}, "
            f"ranks={self.rank_offset}..{self.rank_offset + self.size - 1})"
        )


def _group_ranks(group: dist.ProcessGroup) -> list[int]:
    return sorted(dist.get_process_group_ranks(group))


def mesh_from_groups(
    *,
    global_rank: int,
    tp_group: dist.ProcessGroup | None,
    cp_group: dist.ProcessGroup | None = None,
    dp_group: dist.ProcessGroup | None = None,
    pp_group: dist.ProcessGroup | None = None,
    name: str = "",
) -> Mesh:
    """Build the mesh of a live setup from its process groups and check it against them.

    ``dp_group`` is the data-parallel group *without* context parallelism (Megatron's
    ``get_data_parallel_group(with_context_parallel=False)``). ``None`` means size 1.

    Raises:
        ValueError: when the groups are not the ``tp-cp-dp-pp`` grid the mesh describes (another
            rank order, or groups of another mesh). This check is local to the calling rank.
    """
    groups = {"tp": tp_group, "cp": cp_group, "dp": dp_group, "pp": pp_group}
    ranks = {k: (_group_ranks(g) if g is not None else [global_rank]) for k, g in groups.items()}
    for k, r in ranks.items():
        if global_rank not in r:
            raise ValueError(
                f"mesh {name!r}: global rank {global_rank} is not in its own {k} group {r}"
            )
    sizes = {k: len(r) for k, r in ranks.items()}
    index = {k: r.index(global_rank) for k, r in ranks.items()}
    local = index["tp"] + sizes["tp"] * (
        index["cp"] + sizes["cp"] * (index["dp"] + sizes["dp"] * index["pp"])
    )
    offset = global_rank - local
    if offset < 0:
        raise ValueError(f"mesh {name!r}: groups {ranks} do not follow the tp-cp-dp-pp order")
    mesh = Mesh(
        tp=sizes["tp"],
        cp=sizes["cp"],
        dp=sizes["dp"],
        pp=sizes["pp"],
        rank_offset=offset,
        name=name,
    )
    c = mesh.coord(global_rank)
    assert c is not None
    expected = {
        "tp": [
            mesh.global_rank(tp_rank=t, cp_rank=c.cp_rank, dp_rank=c.dp_rank, pp_rank=c.pp_rank)
            for t in range(mesh.tp)
        ],
        "cp": [
            mesh.global_rank(tp_rank=c.tp_rank, cp_rank=x, dp_rank=c.dp_rank, pp_rank=c.pp_rank)
            for x in range(mesh.cp)
        ],
        "dp": [
            mesh.global_rank(tp_rank=c.tp_rank, cp_rank=c.cp_rank, dp_rank=x, pp_rank=c.pp_rank)
            for x in range(mesh.dp)
        ],
        "pp": [
            mesh.global_rank(tp_rank=c.tp_rank, cp_rank=c.cp_rank, dp_rank=c.dp_rank, pp_rank=x)
            for x in range(mesh.pp)
        ],
    }
    for k in ranks:
        if ranks[k] != sorted(expected[k]):
            raise ValueError(
                f"mesh {name!r} on global rank {global_rank}: live {k} group has ranks {ranks[k]}, "
                f"but {mesh} in tp-cp-dp-pp order puts {sorted(expected[k])} there"
            )
    return mesh


def bridge_members(teachers: Sequence[Mesh], student: Mesh) -> tuple[int, ...]:
    """Every global rank of ``teachers`` and ``student``, sorted: the bridge group's members."""
    ranks: set[int] = set(student.ranks)
    for t in teachers:
        ranks |= set(t.ranks)
    return tuple(sorted(ranks))


def meshes_overlap(meshes: Sequence[Mesh]) -> bool:
    """True if any two meshes share a global rank (colocated)."""
    seen: set[int] = set()
    for m in meshes:
        r = set(m.ranks)
        if seen & r:
            return True
        seen |= r
    return False
