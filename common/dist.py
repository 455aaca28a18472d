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
all-reduce.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "MESSAGE_BYTES",
    "ReduceOpLike",
    "all_gather_into",
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
