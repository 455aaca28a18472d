"""Process groups for the bridge: created once, collectively, in a documented order; looked up locally.

Why this file exists: ``torch.distributed.new_group`` is collective over the whole default group
and must be called by every rank in the same order, while the bridge runs on a subset of ranks
many times. Creation (collective, once) and lookup (local) are therefore separate. Nothing here is
a module global: the caller owns the :class:`GroupPool` and passes groups in.

Creation order of :func:`create_bridge_groups` (every global rank of the default group calls it,
with the same meshes, in the same program order as its other ``new_group`` calls):

1. the bridge group: the sorted union of every rank of every teacher mesh and the student mesh
   (the point-to-point transfers), with the pool's backend, a group of its own (not a model's
   group over the same ranks: it carries point-to-point only, after one set-up barrier);
2. for each student ``(dp_rank, cp_rank)`` shard in :meth:`Mesh.shards` order (dp major), the
   student's last-stage TP group, when ``student.tp > 1`` (the all-gather after the crossing).
   The pool creates a rank set once: when the student model's own groups came from the same pool
   (:func:`mopd.mcore.megatron_groups.megatron_process_groups`), this *is* Megatron's TP group;
3. a gloo group over the same ranks as 1. (the step metadata and verdicts run on the host there,
   so they never queue behind GPU work nor force a device sync), always a group of its own, also
   when the pool's backend is ``"gloo"``: the bridge's collectives and its point-to-point then
   never share a group (their per-rank counts differ, which ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
   reads as a collective mismatch), and CPU jobs have the GPU jobs' groups.
4. only when the bridge group has at least ``metadata_nodes_from`` members: the two-level
   metadata groups (gloo, :class:`NodeGroups`): the members cut in order into nodes of
   ``metadata_node_size``, one group per node (in node order), then one group of the nodes'
   first ranks (the leaders).
5. a gloo group over the same ranks as 1. for the routed step metadata's point-to-point rounds
   (:mod:`mopd.bridge.peers`; single sends and receives, never a collective): apart from 3.,
   whose collectives they would otherwise interleave with per-rank counts of their own.

The step metadata goes over 3. as one flat all-gather (:func:`all_gather_flat`), or, with the
groups of 4., in two levels (:func:`all_gather_nodes`): a gather to each node's leader, a
log-depth all-gather among the leaders, a broadcast inside each node. The result is the same
bytes; the flat ring costs ``n - 1`` latency hops, the two-level form about ``log2(n / k)``.
A step every rank agrees on routes each rank its peers' records over 5. instead
(:func:`mopd.bridge.peers.exchange_records`): only a step refused for its headers gathers them.

Group 1.'s members also pass one barrier on it when it is created: NCCL sets a
communicator up in the group's first collective, which needs every member, while the bridge's
first use of the group is a batched send/receive that ranks with nothing to move skip (done on
every backend, so CPU jobs take the GPU path).

Waiting: a gloo operation is waited on with a host timeout; an NCCL one (CUDA tensors) without
one, because ``Work.wait(timeout)`` on NCCL spins the host until the operation completes, while
``Work.wait()`` only makes the current CUDA stream wait on it (:func:`mopd.common.dist.wait`).
Hang detection for NCCL operations therefore rests on the process group's own timeout: create the
pool with ``GroupPool(timeout_s=...)`` (NCCL's watchdog aborts an operation older than that); a
pool made without one is bounded all the same (:meth:`GroupPool.bound_by`).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mopd.bridge.config import DEFAULT_TIMEOUT_S
from mopd.bridge.mesh import Mesh, bridge_members
from mopd.bridge.worlds import WorldLink
from mopd.common import dist as cdist
from mopd.common.dist import NodeGroups
from mopd.common.log import warn_once

__all__ = [
    "BridgeGroups",
    "GroupPool",
    "create_bridge_groups",
    "create_node_groups",
    "node_ranks",
]

#: The purposes of the bridge's own groups in a :class:`GroupPool`: groups of their own, never
#: shared with a model's groups over the same ranks (point-to-point and collectives apart).
_DATA, _META, _NODE = "bridge data", "bridge metadata", "bridge metadata nodes"
_ROUTES = "bridge metadata routes"


def node_ranks(members: Sequence[int], node_size: int) -> list[tuple[int, ...]]:
    """``members`` (sorted global ranks) cut in order into nodes of ``node_size``."""
    if node_size < 1:
        raise ValueError(f"node_size must be >= 1, got {node_size}")
    m = sorted(members)
    return [tuple(m[i : i + node_size]) for i in range(0, len(m), node_size)]


def create_node_groups(
    pool: GroupPool | WorldLink,
    members: Sequence[int],
    node_size: int,
    *,
    rank: int | None = None,
) -> NodeGroups | None:
    """Create (collectively over the default group, every rank in the same order) the groups of
    the two-level all-gather over ``members``: one gloo group per node, in node order, then the
    leaders' group. Returns this rank's (``None`` on ranks outside ``members``). ``pool``: or a
    :class:`~mopd.bridge.worlds.WorldLink` (``members`` and ``rank`` in its bridge ranks);
    ``rank``: this rank (default: its global rank)."""
    nodes = node_ranks(members, node_size)
    me = dist.get_rank() if rank is None else rank
    node: dist.ProcessGroup | None = None
    mine: tuple[int, ...] = ()
    for ranks in nodes:
        group = pool.create(ranks, backend="gloo", purpose=_NODE)
        if me in ranks:
            mine, node = ranks, group
    leaders = tuple(ranks[0] for ranks in nodes)
    lead = pool.create(leaders, backend="gloo", purpose=_NODE)
    if me not in members:
        return None
    return NodeGroups(
        node=node, leaders=lead, node_members=mine, leader_ranks=leaders, node_size=node_size
    )


class GroupPool:
    """Process groups keyed by ``(backend, sorted rank tuple)``.

    :meth:`create` is collective over the default group (every rank, same order); creating a
    (backend, rank set) twice returns the existing group without a collective, which is
    deterministic because every rank holds the same creation history. :meth:`get` is local.
    ``backend=None`` in :meth:`create` / :meth:`get` means the pool's backend. :meth:`close`
    (or leaving a ``with GroupPool(...) as pool:`` block) destroys every group it created.

    Args:
        backend: backend of the groups (``None``: the default group's).
        timeout_s: the groups' own timeout in seconds; for NCCL groups this is the only hang
            detection of the bridge's waits, so keep it <= ``BridgeConfig.timeout_s``.
            ``None``: bounded all the same: the groups wait at most
            :data:`~mopd.bridge.config.DEFAULT_TIMEOUT_S`, and a bridge's own timeout once one
            is built on the pool (:meth:`bound_by`; a :class:`~mopd.mcore.Distiller` does it).

    Attributes:
        timeout_s: what the groups wait, in seconds (finite).
    """

    def __init__(self, *, backend: str | None = None, timeout_s: float | None = None) -> None:
        if timeout_s is not None and not (
            isinstance(timeout_s, int | float)
            and not isinstance(timeout_s, bool)
            and 0 < timeout_s < float("inf")
        ):
            raise ValueError(
                f"timeout_s must be a positive finite number of seconds, got {timeout_s!r}"
            )
        self.backend = backend
        #: whether ``timeout_s`` was given (a given one is never changed by :meth:`bound_by`)
        self.explicit_timeout = timeout_s is not None
        self.timeout_s = float(timeout_s) if timeout_s is not None else DEFAULT_TIMEOUT_S
        self._groups: dict[tuple[str | None, tuple[int, ...], str], dist.ProcessGroup | None] = {}
        self.closed = False

    def close(self) -> None:
        """Destroy every group this pool created (``dist.destroy_process_group``; every rank
        calls it, as it created them). A gloo group's threads and sockets go when the last
        reference to it does: drop what was built on the groups too (models, a
        :class:`~mopd.mcore.Distiller` or bridge: close those first). Idempotent; the pool
        refuses :meth:`create` and :meth:`get` afterwards."""
        if self.closed:
            return
        self.closed = True
        me = dist.get_rank() if dist.is_initialized() else -1
        groups, self._groups = self._groups, {}
        for key, group in groups.items():
            if group is None or me not in key[1]:
                continue
            with contextlib.suppress(ValueError):  # destroyed already (with the world)
                dist.destroy_process_group(group)

    def __enter__(self) -> GroupPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("this GroupPool is closed: create a new GroupPool")

    def bound_by(self, timeout_s: float) -> None:
        """A bridge's own ``timeout_s`` for a pool made without one: from now on every group of
        the pool (those made already and later ones) waits at most that long (never longer
        than before). Local; a pool given ``timeout_s`` is left as it is. (gloo keeps an
        existing group's point-to-point timeout from its creation; megatron's pipeline waits
        on CPU ranks take the group's new one through :func:`mopd.mcore.cpu.apply`.)"""
        if self.explicit_timeout or not timeout_s < self.timeout_s:
            return
        self.timeout_s = float(timeout_s)
        wait = datetime.timedelta(seconds=self.timeout_s)
        me = dist.get_rank()
        for key, group in self._groups.items():
            if group is not None and me in key[1]:
                _set_timeout(group, wait)

    def _key(
        self, ranks: Sequence[int], backend: str | None, purpose: str = ""
    ) -> tuple[str | None, tuple[int, ...], str]:
        return (
            backend if backend is not None else self.backend,
            tuple(sorted(set(ranks))),
            purpose,
        )

    def create(
        self, ranks: Sequence[int], *, backend: str | None = None, purpose: str = ""
    ) -> dist.ProcessGroup | None:
        """Create (collectively) the group of ``ranks``; returns it on members, ``None`` elsewhere.
        ``purpose``: a group of its own for that use even where a group of the same ranks and
        backend exists (the bridge's host-side metadata)."""
        self._check_open()
        key = self._key(ranks, backend, purpose)
        if key not in self._groups:
            kwargs: dict[str, Any] = {"ranks": list(key[1])}
            if key[0] is not None:
                kwargs["backend"] = key[0]
            kwargs["timeout"] = datetime.timedelta(seconds=self.timeout_s)
            self._groups[key] = dist.new_group(**kwargs)
        return self.get(key[1], backend=key[0], purpose=purpose)

    def has(self, ranks: Sequence[int], *, backend: str | None = None, purpose: str = "") -> bool:
        """Whether :meth:`create` already made this group (local)."""
        return self._key(ranks, backend, purpose) in self._groups

    def get(
        self, ranks: Sequence[int], *, backend: str | None = None, purpose: str = ""
    ) -> dist.ProcessGroup | None:
        """The group of ``ranks`` (``None`` if this rank is not a member); ``KeyError`` if never created."""
        self._check_open()
        key = self._key(ranks, backend, purpose)
        group = self._groups[key]
        return None if dist.get_rank() not in key[1] else group


def _set_timeout(group: dist.ProcessGroup, wait: datetime.timedelta) -> None:
    """Set the timeout of ``group``'s later operations (torch has no public call for it; where
    its private one is missing the group keeps its timeout, with a warning)."""
    try:
        dist.distributed_c10d._set_pg_timeout(wait, group)
    except Exception as exc:  # another torch: the group keeps the timeout it was made with
        warn_once(
            f"GroupPool.bound_by: the timeout of an existing group could not be changed "
            f"({type(exc).__name__}: {exc}); it keeps the one it was created with"
        )


@dataclass(frozen=True, kw_only=True, eq=False)
class BridgeGroups:
    """This rank's groups for one bridge.

    Attributes:
        bridge: the group over every rank of every mesh (the point-to-point transfers);
            ``None`` on ranks outside all meshes.
        student_tp: this rank's student TP group on the last stage (``None`` when ``tp == 1``
            or the rank holds no student shard); a Megatron job may pass its model's own.
        members: global ranks of the bridge group, sorted.
        meta: a gloo group over ``members`` for the host-side step metadata and verdicts
            (``None``: use ``bridge``).
        (``rank``: this process in the meshes' rank space, read off the groups.)
        meta_nodes: the two-level metadata groups (:func:`all_gather_nodes`), or ``None``: the
            metadata goes as one flat all-gather over :attr:`metadata_group`.
        meta_routes: a gloo group over ``members`` for the routed metadata's point-to-point
            rounds (``None``: the bridge gathers every record, also on an agreed step).
        offline_rank: an offline bridge's rank (:meth:`offline`: no group at all); ``None``
            for a live one.
    """

    bridge: dist.ProcessGroup | None
    student_tp: dist.ProcessGroup | None
    members: tuple[int, ...]
    meta: dist.ProcessGroup | None = None
    meta_nodes: NodeGroups | None = None
    meta_routes: dist.ProcessGroup | None = None
    offline_rank: int | None = None

    @classmethod
    def offline(cls, *, members: Sequence[int], rank: int) -> BridgeGroups:
        """No group, for global rank ``rank`` of ``members``: an offline bridge's
        (:meth:`~mopd.bridge.api.HiddenStateBridge.offline`)."""
        return cls(bridge=None, student_tp=None, members=tuple(members), offline_rank=rank)

    @property
    def is_offline(self) -> bool:
        """Whether these are an offline bridge's (no group at all)."""
        return self.offline_rank is not None

    @property
    def rank(self) -> int:
        """This process's rank in the meshes' rank space: its global rank, or its bridge rank
        when the bridge spans several worlds (:mod:`mopd.bridge.worlds`); an offline bridge's
        own."""
        if self.offline_rank is not None:
            return self.offline_rank
        return cdist.rank_in(self.metadata_group)

    @property
    def metadata_group(self) -> dist.ProcessGroup | None:
        """The group the host-side metadata and verdicts go over: :attr:`meta`, else
        :attr:`bridge`."""
        return self.meta if self.meta is not None else self.bridge


#: Bridge groups of at least this many ranks exchange their step metadata in two levels.
METADATA_NODES_FROM = 512
#: Ranks per node of the two-level metadata exchange (the GPUs of one machine).
METADATA_NODE_SIZE = 8


def create_bridge_groups(
    pool: GroupPool,
    teachers: Sequence[Mesh],
    student: Mesh,
    *,
    metadata_nodes_from: int = METADATA_NODES_FROM,
    metadata_node_size: int = METADATA_NODE_SIZE,
    link: WorldLink | None = None,
) -> BridgeGroups:
    """Create the bridge's groups (collective over the default group, order in the module doc)
    and return this rank's.

    ``metadata_nodes_from``: from this many bridge ranks on, the step metadata goes in two
    levels over nodes of ``metadata_node_size`` consecutive ranks (:func:`all_gather_nodes`);
    below it, one flat all-gather.

    ``link``: the meshes span several worlds (:func:`~mopd.bridge.worlds.connect_worlds`; the
    meshes in bridge ranks, the student's world first): the bridge, metadata and node groups
    are the link's (every rank of every world calls this, in its own world), the student's TP
    groups its own world's ``pool``'s."""
    for name, v in (
        ("metadata_nodes_from", metadata_nodes_from),
        ("metadata_node_size", metadata_node_size),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    members = bridge_members(teachers, student)
    maker: GroupPool | WorldLink = pool if link is None else link
    if link is None:
        me, world = dist.get_rank(), dist.get_world_size()
        if members[-1] >= world:
            raise ValueError(
                f"meshes use global ranks up to {members[-1]} but the world has {world} ranks: "
                + ", ".join(str(m) for m in [*teachers, student])
            )
    else:
        me = link.rank
        _check_linked_meshes(link, members, student)
    fresh = not maker.has(members, purpose=_DATA)
    bridge = maker.create(members, purpose=_DATA)
    if bridge is not None and fresh:
        # NCCL builds a group's communicator lazily, in its first collective, and every member
        # must take part in that one; the bridge's first operation is a batched send/recv that
        # members without transfers skip. One barrier now builds it on every member (on any
        # backend: CPU jobs then take the same path, which the strict test mode checks).
        if cdist.moves_cuda(bridge) and torch.cuda.is_available():
            dist.barrier(group=bridge, device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier(group=bridge)
    # the student's TP groups are its own world's (across worlds: the host's, at offset 0)
    student_world = link is None or link.world == link.roster.names[0]
    if student.tp > 1 and student_world:
        for d, c in student.shards():
            pool.create(student.tp_group_ranks(dp_rank=d, cp_rank=c))
    meta = maker.create(members, backend="gloo", purpose=_META)
    nodes = None
    if len(members) >= metadata_nodes_from and 1 < metadata_node_size < len(members):
        nodes = create_node_groups(maker, members, metadata_node_size, rank=me)
    routes = maker.create(members, backend="gloo", purpose=_ROUTES)
    tp_group = None
    coord = student.coord(me)
    if student.tp > 1 and coord is not None and coord.pp_rank == student.pp - 1:
        tp_group = pool.get(student.tp_group_ranks(dp_rank=coord.dp_rank, cp_rank=coord.cp_rank))
    return BridgeGroups(
        bridge=bridge,
        student_tp=tp_group,
        members=members,
        meta=meta,
        meta_nodes=nodes,
        meta_routes=routes,
    )


def _check_linked_meshes(link: WorldLink, members: Sequence[int], student: Mesh) -> None:
    """Meshes across worlds fit the link's bridge ranks, the student's in the host's world."""
    if members[-1] >= link.roster.size:
        sizes = dict(zip(link.roster.names, link.roster.sizes, strict=True))
        raise ValueError(
            f"meshes use bridge ranks up to {members[-1]} but the link's worlds have "
            f"{link.roster.size} ranks ({sizes})"
        )
    if student.rank_offset + student.size > link.roster.sizes[0]:
        raise ValueError(f"the student's mesh {student} must lie in the host's (first) world")
