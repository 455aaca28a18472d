"""Point-to-point rounds of int64 words among a group's members: to named peers, or to any member.

Why this file exists: the routed metadata exchange (:mod:`mopd.bridge.peers`) moves small int64
tables between members that only the data names, and must not fall back to a collective whose
cost grows with the job. Two mechanisms serve it, on any :class:`Wire`:

- :meth:`Wire.swap`: one round of messages to peers both ends know (a member sends to each peer
  that expects it, possibly an empty message). Sizes the receiver does not know travel first
  (one word per message), then the payloads; where both ends know them
  (:meth:`Wire.swap_sized`), the payloads alone, received into one buffer.
- :func:`route_rows`: rows whose destination is any member, delivered in
  ``ceil(log_radix(n))`` rounds of :meth:`Wire.swap` (a radix-``radix`` Bruck schedule: in round
  ``j`` a row moves ``t * radix**j`` members ahead when digit ``j`` of its offset to its
  destination is ``t``), so that no member needs to know who sends to it, and none exchanges
  with more than ``(radix - 1) * rounds`` members.

:class:`GroupWire` is the live wire: sends and receives on a gloo group of the bridge's members
(host tensors; its sums on the metadata group), every wait bounded by one deadline for the
whole exchange. A message to oneself never touches the group. Members are positions in the
group's sorted global ranks.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from mopd.common import dist as cdist

__all__ = ["RADIX", "GroupWire", "Wire", "bruck_partners", "route_rows", "split_words"]

_I64 = np.int64
#: Partners per round of :func:`route_rows` plus one: rounds are ``ceil(log_radix(n))``.
RADIX = 8


class Wire(Protocol):
    """One member's end of a group's point-to-point rounds.

    Attributes:
        member: this member's index (``0 .. size - 1``).
        size: the members.
    """

    member: int
    size: int

    def swap(
        self, sends: Mapping[int, np.ndarray], recv_from: Sequence[int]
    ) -> dict[int, np.ndarray]:
        """One round: ``sends[p]`` (1-D int64, may be empty) to member ``p``; one message from
        each member in ``recv_from``, returned by member. Every member calls it in the same
        round; ``sends`` names exactly the members whose ``recv_from`` names this one. Sizes
        travel first (one word per message)."""
        ...

    def swap_sized(
        self, sends: Mapping[int, np.ndarray], recv_from: Sequence[int], sizes_P: Sequence[int]
    ) -> np.ndarray:
        """One round whose sizes both ends know (no size travels; every member of the round
        calls this form): as :meth:`swap`, the message from ``recv_from[i]`` being
        ``sizes_P[i]`` words; returns ``[sum(sizes_P)]`` int64, the messages one after another
        in ``recv_from`` order, in one buffer."""
        ...

    def reduce_sum(self, words: np.ndarray) -> np.ndarray:
        """``[k]`` int64: the sum over every member of its ``words`` (each member calls it in
        the same round, with ``k`` words)."""
        ...

    @property
    def received_words(self) -> int:
        """Words this member received so far (sizes and payloads of its rounds)."""
        ...


def split_words(
    words_W: np.ndarray, members: Sequence[int], sizes_P: Sequence[int]
) -> dict[int, np.ndarray]:
    """``member -> `` its message: views of ``words_W``, the messages of ``members`` one after
    another, ``sizes_P[i]`` words each (what :meth:`Wire.swap_sized` returns)."""
    off = np.cumsum([0, *sizes_P]).tolist()
    return {p: words_W[off[i] : off[i + 1]] for i, p in enumerate(members)}


def bruck_partners(n: int, me: int, step: int, radix: int) -> tuple[list[int], list[int]]:
    """``(to, from_)``: the members ``me`` sends to and receives from in the round that moves
    rows ``t * step`` ahead (``t = 1 .. radix - 1``, ``t * step < n``)."""
    ts = [t for t in range(1, radix) if t * step < n]
    return [(me + t * step) % n for t in ts], [(me - t * step) % n for t in ts]


def route_rows(rows_RW: np.ndarray, wire: Wire, *, radix: int = RADIX) -> np.ndarray:
    """Deliver rows to the members their column 0 names: ``[M, W]`` int64, every row any
    member routed to this one (in no particular order).

    Collective over the wire's members (each calls it, with its own rows, possibly none):
    ``ceil(log_radix(n))`` rounds of :meth:`Wire.swap`. ``rows_RW``: ``[R, W]`` int64, column 0
    the destination member.
    """
    n, me = wire.size, wire.member
    held = np.ascontiguousarray(rows_RW, dtype=_I64).reshape(-1, rows_RW.shape[-1])
    w = held.shape[1]
    step = 1
    while step < n:
        digit = ((held[:, 0] - me) % n // step) % radix
        to, from_ = bruck_partners(n, me, step, radix)
        order = digit.argsort(kind="stable")
        held = held[order]  # by digit: each partner's rows one slice
        cuts = digit[order].searchsorted(np.arange(radix + 1)).tolist()
        sends = {p: held[cuts[t + 1] : cuts[t + 2]].reshape(-1) for t, p in enumerate(to)}
        got = wire.swap(sends, from_)
        held = np.concatenate([held[: cuts[1]], *(got[p].reshape(-1, w) for p in from_)], axis=0)
        step *= radix
    if held.shape[0] and bool((held[:, 0] != me).any()):
        raise AssertionError(f"member {me}: rows for other members left after routing")
    return held


class GroupWire:
    """:class:`Wire` over gloo process groups (host tensors), waits bounded by ``deadline``.

    Args:
        group: the group of the point-to-point rounds (the bridge's metadata routes group:
            only point-to-point goes there); ``None`` only with one member.
        members: the group's global ranks, sorted (member ``p`` is ``members[p]``).
        member: this rank's member index.
        deadline: ``time.monotonic()`` by which every wait of the exchange must end.
        sums: the group of :meth:`reduce_sum` (the bridge's metadata group, over the same
            ranks: its collectives never share a group with point-to-point rounds).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        members: Sequence[int],
        member: int,
        deadline: float,
        sums: dist.ProcessGroup | None = None,
    ) -> None:
        self.group = group
        self.sums = sums
        self.members = tuple(members)
        self.member = member
        self.size = len(self.members)
        self.deadline = deadline
        self._tag = 0
        self._received = 0

    def _left(self) -> float:
        return max(self.deadline - time.monotonic(), 1e-3)

    def reduce_sum(self, words: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(np.ascontiguousarray(words, dtype=_I64).copy())
        if self.size > 1:
            if self.sums is None:
                raise AssertionError("a wire of several members sums over a group of its own")
            cdist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.sums, timeout_s=self._left())
        return t.numpy()

    @property
    def received_words(self) -> int:
        return self._received

    def _post(self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor]) -> None:
        """Post every send and receive of a round, then wait for them all (single operations,
        not a batch: a batch on a group that saw no collective is what NCCL refuses)."""
        self._tag += 1
        works = [
            dist.isend(t, group=self.group, group_dst=p, tag=self._tag) for p, t in sends.items()
        ]
        works += [
            dist.irecv(t, group=self.group, group_src=p, tag=self._tag) for p, t in recvs.items()
        ]
        for work in works:
            cdist.wait(work, device=torch.device("cpu"), timeout_s=self._left())

    def swap(
        self, sends: Mapping[int, np.ndarray], recv_from: Sequence[int]
    ) -> dict[int, np.ndarray]:
        me = self.member
        froms = [p for p in recv_from if p != me]
        counts = {
            p: torch.full((1,), np.size(a), dtype=torch.int64) for p, a in sends.items() if p != me
        }
        got = {p: torch.empty(1, dtype=torch.int64) for p in froms}
        self._post(counts, got)
        self._received += len(froms)
        sizes = {p: int(t) for p, t in got.items()}
        if me in recv_from:
            sizes[me] = int(np.size(sends[me]))
        sizes_P = [sizes[p] for p in recv_from]
        return split_words(self.swap_sized(sends, recv_from, sizes_P), recv_from, sizes_P)

    def swap_sized(
        self, sends: Mapping[int, np.ndarray], recv_from: Sequence[int], sizes_P: Sequence[int]
    ) -> np.ndarray:
        me = self.member
        if len(sizes_P) != len(recv_from):
            raise AssertionError(f"{len(sizes_P)} sizes for {len(recv_from)} messages")
        off = np.cumsum([0, *sizes_P]).tolist()
        flat = torch.empty(off[-1], dtype=torch.int64)
        bufs, own = {}, 0
        for i, p in enumerate(recv_from):
            if p == me:
                flat[off[i] : off[i + 1]] = torch.from_numpy(np.asarray(sends[me], dtype=_I64))
                own += off[i + 1] - off[i]
            elif off[i + 1] > off[i]:
                bufs[p] = flat[off[i] : off[i + 1]]
        away = {
            p: torch.from_numpy(np.ascontiguousarray(a, dtype=_I64))
            for p, a in sends.items()
            if p != me and np.size(a)
        }
        self._post(away, bufs)
        self._received += off[-1] - own
        return flat.numpy()
