"""torch.distributed helpers shared by the bridge, the LM-head reshard and the loss.

Why this file exists: two questions come up wherever the library talks to a process group, and
each has one answer here:

- which device does a group move tensors on (:func:`group_device`): read from the group's
  backend *config* (``"cpu:gloo,cuda:nccl"``), not ``dist.get_backend``, which can say
  ``"undefined"`` for a group made without a backend;
- how do all ranks raise the same ``ValueError`` when only some of them found a problem
  (:func:`same_verdict`): one small all-reduce when nothing is wrong; otherwise every rank learns
  who found what and raises the same text, so none is left waiting in a later collective;
- which ranks a group spans, and which one this process is (:func:`group_ranks`,
  :func:`rank_in`): a group of the default world answers in the world's global ranks; a group
  that spans several worlds (:mod:`mopd.bridge.worlds`, made without the default group and
  unknown to torch.distributed's registry) answers in its own rank space, the bridge's, as
  registered by :func:`register_linked_group`. Point-to-point batches go through
  :func:`batch_p2p`, which names peers in that same space.

Timeouts are ``timeout_s`` (seconds) everywhere in the library; :func:`wait` applies one to a
work object the way each transport allows, and :func:`all_reduce` is the library's one timed
all-reduce; :func:`all_gather_flat` its timed all-gather, :func:`all_gather_nodes` the same in
two levels (a node's ranks, then the nodes' leaders).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "KL_TIMEOUT_FACTOR",
    "MESSAGE_BYTES",
    "NodeGroups",
    "ReduceOpLike",
    "all_gather_flat",
    "all_gather_into",
    "all_gather_nodes",
    "all_reduce",
    "batch_p2p",
    "group_device",
    "group_ranks",
    "moves_cuda",
    "rank_in",
    "register_linked_group",
    "same_verdict",
    "unregister_linked_group",
    "wait",
]

#: What ``dist.all_reduce`` takes as ``op``: a ``ReduceOp`` or one of its members
#: (``dist.ReduceOp.SUM`` is a ``ReduceOp.RedOpType``).
ReduceOpLike = dist.ReduceOp | dist.ReduceOp.RedOpType

#: ``all_gather_into_tensor`` under the name torch >= 2.13 prefers (it deprecates the old one):
#: ``all_gather_into(output, input, group=..., async_op=...)``.
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: The library's one default wait, in seconds: the bridge's ``timeout_s``, a ``GroupPool``'s groups,
#: the LM-head reshard, the rollouts' log-probs and a Ray worker group; the KL's collectives wait
#: :data:`KL_TIMEOUT_FACTOR` times it (they follow a whole chunked forward of the vocabulary).
DEFAULT_TIMEOUT_S = 300.0
#: The KL's ``timeout_s`` in units of :data:`DEFAULT_TIMEOUT_S`.
KL_TIMEOUT_FACTOR = 2

#: Bytes of a problem's text carried to every rank by :func:`same_verdict`.
MESSAGE_BYTES = 4000


@dataclass(frozen=True)
class _Linked:
    """A group made outside the default world: its members and this process, in its rank space."""

    ranks: tuple[int, ...]
    rank: int
    cuda: bool


#: Groups that span several worlds, by identity (torch.distributed's registry does not know them).
_LINKED: dict[int, tuple[dist.ProcessGroup, _Linked]] = {}


def register_linked_group(
    group: dist.ProcessGroup, *, ranks: Sequence[int], rank: int, cuda: bool
) -> None:
    """Make a group built outside the default world answer :func:`group_ranks`,
    :func:`rank_in`, :func:`group_device` and :func:`batch_p2p`: ``ranks`` are its members in
    its own rank space (group rank ``i`` is ``ranks[i]``), ``rank`` this process's, ``cuda``
    whether it moves CUDA tensors (NCCL)."""
    _LINKED[id(group)] = (group, _Linked(tuple(ranks), int(rank), bool(cuda)))


def unregister_linked_group(group: dist.ProcessGroup) -> None:
    """Forget a group of :func:`register_linked_group` (its link closed)."""
    _LINKED.pop(id(group), None)


def _linked(group: dist.ProcessGroup | None) -> _Linked | None:
    if group is None:
        return None
    hit = _LINKED.get(id(group))
    return hit[1] if hit is not None and hit[0] is group else None


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """``group``'s members in its rank space, in group-rank order (the default world's global
    ranks for a group of that world; the bridge's ranks for a group across worlds)."""
    linked = _linked(group)
    if linked is not None:
        return list(linked.ranks)
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def rank_in(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group``'s rank space (see :func:`group_ranks`): the global rank
    of the default world, or the bridge rank of a group across worlds."""
    linked = _linked(group)
    return linked.rank if linked is not None else dist.get_rank()


class _GroupPeerOp(dist.P2POp):
    """A ``P2POp`` that names its peer by group rank only: ``P2POp`` itself translates the
    peer into the default world's ranks, which a group across worlds does not have."""

    def __init__(
        self, op: Any, tensor: torch.Tensor, group: dist.ProcessGroup, group_peer: int, tag: int
    ) -> None:
        self.op, self.tensor, self.group, self.tag = op, tensor, group, tag
        self.peer = self.group_peer = group_peer


def batch_p2p(
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[tuple[torch.Tensor, int]],
    *,
    group: dist.ProcessGroup | None,
    tag: int = 0,
) -> list[Any]:
    """Post ``sends`` then ``recvs`` (``(tensor, peer)``, peers in ``group``'s rank space: see
    :func:`group_ranks`) in one ``batch_isend_irecv`` on ``group``; returns its works (one per
    op, or one coalesced set on NCCL). Empty lists post nothing."""
    if not sends and not recvs:
        return []
    linked = _linked(group)
    if linked is None:
        ops = [dist.P2POp(dist.isend, t, p, group=group, tag=tag) for t, p in sends]
        ops += [dist.P2POp(dist.irecv, t, p, group=group, tag=tag) for t, p in recvs]
        return list(dist.batch_isend_irecv(ops))
    assert group is not None
    at = {r: i for i, r in enumerate(linked.ranks)}
    ops = [_GroupPeerOp(dist.isend, t, group, at[p], tag) for t, p in sends]
    ops += [_GroupPeerOp(dist.irecv, t, group, at[p], tag) for t, p in recvs]
    return list(dist.batch_isend_irecv(list(ops)))


def moves_cuda(group: dist.ProcessGroup | None) -> bool:
    """True if ``group`` moves CUDA tensors (it has an NCCL backend), False for gloo only."""
    linked = _linked(group)
    if linked is not None:
        return linked.cuda
    return "nccl" in str(dist.get_backend_config(group)).lower()


def group_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where tensors for ``group``'s collectives live: the current CUDA device for NCCL, else CPU."""
    if group is not None and moves_cuda(group) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def wait(work: Any, *, device: torch.device, timeout_s: float | None) -> None:
    """Wait on one work object whose tensors live on ``device``.

    CUDA tensors (NCCL): ``work.wait()`` without a timeout, which only makes the current stream
    wait (a timed wait would spin the host until the operation completes); hang detection is the
    process group's own timeout. Other tensors (gloo): a host wait of at most ``timeout_s``.
    """
    if work is None:
        return
    if device.type == "cuda" or timeout_s is None:
        work.wait()
    else:
        work.wait(datetime.timedelta(seconds=timeout_s))


def all_reduce(
    t: torch.Tensor,
    *,
    op: ReduceOpLike = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None,
    timeout_s: float | None,
) -> None:
    """In-place all-reduce of ``t`` over ``group``, waited for as :func:`wait` does: a host wait
    of at most ``timeout_s`` for CPU tensors, a stream wait for CUDA ones."""
    wait(
        dist.all_reduce(t, op=op, group=group, async_op=True),
        device=t.device,
        timeout_s=timeout_s,
    )


def same_verdict(
    problems: Sequence[str], *, group: dist.ProcessGroup | None, timeout_s: float | None, what: str
) -> None:
    """Raise the same ``ValueError`` on every rank of ``group`` if any rank found a problem.

    Collective over ``group``: every member calls it, each with the problems it found (often
    none). Nothing wrong anywhere: one all-reduce of one integer. Otherwise every rank raises
    ``ValueError("<what> rejected: <the first problem of the lowest group rank that found
    one> [(n ranks found problems; ...)]")``, the same text everywhere.
    """
    device = group_device(group)
    flag = torch.tensor([1 if problems else 0], dtype=torch.int64, device=device)
    if group is None or dist.get_world_size(group) == 1:
        if problems:
            raise ValueError(f"{what} rejected: {problems[0]}")
        return
    all_reduce(flag, op=dist.ReduceOp.MAX, group=group, timeout_s=timeout_s)
    if not int(flag):
        return
    n = dist.get_world_size(group)
    mine = torch.tensor([1 if problems else 0], dtype=torch.int64, device=device)
    every = torch.empty(n, dtype=torch.int64, device=device)
    wait(
        all_gather_into(every, mine, group=group, async_op=True),
        device=device,
        timeout_s=timeout_s,
    )
    who = torch.nonzero(every.cpu()).reshape(-1).tolist()
    first = who[0]
    text = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
    if group.rank() == first:
        raw = "; ".join(problems).encode()[:MESSAGE_BYTES]
        text[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    text = text.to(device)
    ranks = group_ranks(group)
    wait(
        dist.broadcast(text, group=group, group_src=first, async_op=True),
        device=device,
        timeout_s=timeout_s,
    )
    message = bytes(text.cpu().tolist()).rstrip(b"\0").decode(errors="replace")
    found_by = f"found by global rank {ranks[first]}"
    others = len(who) - 1
    tail = f"; {others} other rank(s) also found problems" if others else ""
    raise ValueError(f"{what} rejected ({found_by}{tail}): {message}")


def all_gather_flat(
    output: torch.Tensor,
    input_: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    timeout_s: float | None,
) -> None:
    """All-gather equal-sized ``input_`` into the concatenated ``output`` and wait.

    Through :data:`all_gather_into` (in place when ``input_`` is this rank's
    slice of ``output``). CPU tensors: a host wait of at most ``timeout_s``; CUDA tensors: a
    stream wait (:func:`wait`).
    """
    work = all_gather_into(output, input_, group=group, async_op=True)
    wait(work, device=output.device, timeout_s=timeout_s)


@dataclass(frozen=True, kw_only=True, eq=False)
class NodeGroups:
    """One rank's groups of the two-level metadata all-gather (:func:`all_gather_nodes`; made by
    :func:`mopd.bridge.groups.create_node_groups`).

    Attributes:
        node: gloo group over this rank's node (``node_members``).
        leaders: gloo group over every node's first rank; ``None`` on ranks that lead no node.
        node_members: global ranks of this rank's node, ascending (the first is its leader).
        leader_ranks: global ranks of every node's leader, in node order.
        node_size: ranks per node (the last node may hold fewer).
    """

    node: dist.ProcessGroup | None
    leaders: dist.ProcessGroup | None
    node_members: tuple[int, ...]
    leader_ranks: tuple[int, ...]
    node_size: int


def all_gather_nodes(
    output: torch.Tensor,
    input_: torch.Tensor,
    *,
    nodes: NodeGroups,
    timeout_s: float | None,
) -> None:
    """:func:`all_gather_flat` in two levels over ``nodes`` (CPU tensors, gloo groups).

    ``input_``: ``[c]`` this rank's part; ``output``: ``[n * c]`` every member's part in member
    order, the same bytes as the flat all-gather. 1. each node gathers its parts on its leader;
    2. the leaders all-gather the node blocks (``node_size * c``, the last one padded) in
    ``ceil(log2(leaders))`` point-to-point rounds (Bruck: in round ``j`` a leader passes the
    ``2^j`` blocks it holds to the leader ``2^j`` before it); 3. each leader broadcasts the
    result inside its node. The whole call waits at most ``timeout_s`` (one deadline shared by
    its waits, host waits on gloo).
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def left() -> float | None:
        return None if deadline is None else max(deadline - time.monotonic(), 1e-3)

    c = input_.numel()
    k = nodes.node_size
    members = nodes.node_members
    me = rank_in(nodes.node if nodes.node is not None else nodes.leaders)
    leader = members[0]
    dev = output.device
    n_total = output.numel() // max(c, 1) if c else 0
    if me == leader:
        parts = [torch.empty_like(input_) for _ in members] if len(members) > 1 else [input_]
    if len(members) > 1:
        work = dist.gather(
            input_, parts if me == leader else None, group=nodes.node, group_dst=0, async_op=True
        )
        wait(work, device=dev, timeout_s=left())
    if me == leader:
        n_lead = len(nodes.leader_ranks)
        at = nodes.leader_ranks.index(me)
        block = torch.zeros(k * c, dtype=input_.dtype, device=dev)
        block[: len(members) * c] = torch.cat([p.reshape(-1) for p in parts])
        held = [block]  # blocks of leaders at, at + 1, ... (mod n_lead)
        have, rnd = 1, 0
        while have < n_lead:
            cnt = min(have, n_lead - have)
            send = torch.cat(held[:cnt]) if cnt > 1 else held[0]
            recv = torch.empty(cnt * k * c, dtype=input_.dtype, device=dev)
            to = nodes.leader_ranks[(at - have) % n_lead]
            frm = nodes.leader_ranks[(at + have) % n_lead]
            for w in batch_p2p([(send, to)], [(recv, frm)], group=nodes.leaders, tag=rnd):
                wait(w, device=dev, timeout_s=left())
            held.extend(recv.split(k * c))
            have += cnt
            rnd += 1
        # held[i] is leader (at + i)'s block: rotate into node order and drop the padding
        ordered = held[n_lead - at :] + held[: n_lead - at]
        output.copy_(torch.cat(ordered)[: n_total * c])
    if len(members) > 1:
        work = dist.broadcast(output, group=nodes.node, group_src=0, async_op=True)
        wait(work, device=dev, timeout_s=left())
