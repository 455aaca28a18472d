"""The transport: posts one micro-batch's messages between ranks and waits for them.

Why this file exists: the executor decides what moves where (schedules, staging, kernels); the
transport only moves bytes, behind two calls: :meth:`Transport.post` (a micro-batch's sends and
receives, one batch) and :meth:`Transport.wait` (its receives or its sends, against a deadline).
:class:`P2PTransport` is the point-to-point implementation (``batch_isend_irecv`` on the bridge
group; NCCL for CUDA tensors, gloo for CPU tensors). Integrity mode wraps it
(:class:`mopd.bridge.integrity.IntegrityTransport` adds a checksum message beside each), so the
data path has no branch for it.

Failures: a failed post or wait raises :class:`~mopd.bridge.errors.BridgeTimeoutError` or
:class:`~mopd.bridge.errors.BridgeCommError` (:func:`comm_failure`) naming this rank, what was
still pending and the timeout; the caller decides what that means for later work.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from mopd.bridge.errors import BridgeCommError, BridgeError, BridgeTimeoutError
from mopd.common import dist as cdist
from mopd.common import ranges

__all__ = [
    "TIMEOUT_WORDS",
    "TRANSPORT_WORDS",
    "Message",
    "P2PTransport",
    "Posted",
    "Transport",
    "comm_failure",
    "is_transport_failure",
    "says_timeout",
    "time_left",
]

#: Words of torch / gloo / NCCL errors that say a wait timed out.
TIMEOUT_WORDS = ("timed out", "timeout", "timing out", "time out")
#: Words of torch / gloo / NCCL errors that say a collective or a peer failed (timeouts too).
TRANSPORT_WORDS = (
    *TIMEOUT_WORDS,
    "connection closed",
    "connection reset",
    "gloo",
    "nccl",
    "broken pipe",
)


#: The peer a message's ``what`` names (``"send to global rank 3 (...)"``, ``"receive from ..."``).
_PEER = re.compile(r"(?:send to|receive from) global rank (\d+)")


def time_left(deadline: float) -> float:
    """Seconds until ``deadline`` (``time.monotonic()`` clock), at least 1 ms."""
    return max(deadline - time.monotonic(), 1e-3)


def says_timeout(exc: BaseException) -> bool:
    """Whether ``exc``'s message says a wait timed out (:data:`TIMEOUT_WORDS`)."""
    low = str(exc).lower()
    return any(k in low for k in TIMEOUT_WORDS)


def is_transport_failure(exc: BaseException) -> bool:
    """True for a timeout or a transport error (the process groups may be out of step), False
    for an error of the caller's own code: the bridge's own timeout and transport errors,
    ``TimeoutError``, ``torch.distributed.DistError``, and runtime errors whose message names
    one (:data:`TRANSPORT_WORDS`)."""
    if isinstance(exc, BridgeError):
        return isinstance(exc, BridgeTimeoutError | BridgeCommError)
    if isinstance(exc, TimeoutError | dist.DistError):
        return True
    if isinstance(exc, RuntimeError):
        low = str(exc).lower()
        return any(k in low for k in TRANSPORT_WORDS)
    return False


def comm_failure(
    exc: BaseException,
    *,
    rank: int,
    what: str,
    timeout_s: float,
    elapsed_s: float,
    peers: Sequence[int] | None = None,
) -> BridgeError:
    """A :class:`BridgeTimeoutError` or :class:`BridgeCommError` for a failed wait on ``what``.

    A failure counts as a timeout when the transport says so or when the full timeout elapsed.
    ``peers``: the global ranks the wait was for, when it was for some ranks in particular (the
    pending transfers), as :attr:`~mopd.bridge.errors.BridgeError.peers`.
    """
    msg = str(exc)
    said_timeout = says_timeout(exc)
    phase = _phase(what)
    err: BridgeError
    if said_timeout or elapsed_s >= 0.98 * timeout_s:
        err = BridgeTimeoutError(
            f"global rank {rank}: {what} did not complete within BridgeConfig.timeout_s="
            f"{timeout_s:g} s (waited {elapsed_s:.1f} s): a rank of the bridge group did not call "
            "the bridge (called on some ranks only), raised or exited before its part, or is "
            f"slower than the timeout. Transport said: {msg}"
        )
        err.summary = f"{phase} did not complete within BridgeConfig.timeout_s={timeout_s:g} s"
        err.peers = tuple(peers) if peers else None
        return err
    err = BridgeCommError(
        f"global rank {rank}: {what} failed after {elapsed_s:.1f} s (timeout_s={timeout_s:g}): "
        f"the transport reported an error, typically because a peer process died or aborted. "
        f"Transport said: {msg}"
    )
    err.summary = f"{phase} failed after {elapsed_s:.1f} s: the transport lost a peer"
    err.peers = tuple(peers) if peers else None
    return err


def _phase(what: str) -> str:
    """The phase a ``what`` names, without its details (``"the bridge exchange (incomplete:
    ...)"`` -> ``"the bridge exchange"``; ``"... over global ranks [...]"`` cut there)."""
    for cut in (" (", " over "):
        if cut in what:
            what = what[: what.index(cut)]
    return what


@dataclass(frozen=True, kw_only=True, eq=False)
class Message:
    """One send or receive of a micro-batch.

    Attributes:
        peer: the other end's global rank.
        rows: ``[R, ...]`` contiguous tensor sent from / received into (owned by the caller
            until the matching wait returns).
        what: for messages (``"send to global rank 3 (micro-batch 0, teacher 0, 4 rows)"``).
        checksums: integrity mode, a send: ``[R]`` int64 checksums of its rows (a wrapping
            transport sends them beside it); ignored by :class:`P2PTransport`.
    """

    peer: int
    rows: torch.Tensor
    what: str
    checksums: torch.Tensor | None = None


@dataclass(kw_only=True, eq=False)
class Posted:
    """A micro-batch's messages in flight: the transport's handles, with what each covers.

    ``recv_checksums``: integrity mode, one ``[R]`` int64 buffer per receive (in order) that the
    sender's checksums land in; empty otherwise.
    """

    device: torch.device
    send_works: list[Any] = field(default_factory=list)
    recv_works: list[Any] = field(default_factory=list)
    send_descs: list[str] = field(default_factory=list)
    recv_descs: list[str] = field(default_factory=list)
    #: the global ranks the sends go to / the receives come from (both: every peer, when one
    #: set of works covers both directions)
    send_peers: list[int] = field(default_factory=list)
    recv_peers: list[int] = field(default_factory=list)
    recv_checksums: list[torch.Tensor] = field(default_factory=list)

    @property
    def coalesced(self) -> bool:
        """One set of works covers both directions (NCCL's coalesced batch)."""
        return bool(self.send_works) and self.send_works is self.recv_works


class Transport(Protocol):
    """What the executor needs to move a micro-batch (see the module doc)."""

    rank: int
    timeout_s: float

    def post(
        self,
        sends: Sequence[Message],
        recvs: Sequence[Message],
        *,
        index: int,
        device: torch.device,
        group: dist.ProcessGroup | None,
        tag: int,
    ) -> Posted:
        """Post ``sends`` and ``recvs`` in one batch (sends first, each list in order)."""
        ...

    def wait(self, posted: Posted, *, sends: bool, deadline: float) -> None:
        """Wait for ``posted``'s sends (``sends=True``) or receives, until ``deadline``."""
        ...

    def sends_done(self, posted: Posted) -> bool:
        """True once every send of ``posted`` has completed (a poll, no wait)."""
        ...


class P2PTransport:
    """Point to point over ``torch.distributed``: one ``batch_isend_irecv`` per micro-batch.

    Args:
        rank: this process's global rank (messages).
        timeout_s: the phase timeout the messages name (each wait runs against its deadline:
            a host wait on gloo; a stream wait on NCCL, whose hangs the process groups' own
            timeout catches).
        on_wait: told, as a wait goes on, the peers of the messages it still waits for (an
            empty list when it is done): where this rank is, for a census of a failure.
    """

    def __init__(
        self,
        *,
        rank: int,
        timeout_s: float,
        on_wait: Callable[[Sequence[int]], None] | None = None,
    ) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.on_wait = on_wait

    def post(
        self,
        sends: Sequence[Message],
        recvs: Sequence[Message],
        *,
        index: int,
        device: torch.device,
        group: dist.ProcessGroup | None,
        tag: int,
    ) -> Posted:
        """Post every message in one batch (``tag``: the step's fence on the wire; gloo matches
        by it, NCCL pairs in issue order)."""
        posted = Posted(
            device=device,
            send_descs=[m.what for m in sends],
            recv_descs=[m.what for m in recvs],
            send_peers=[m.peer for m in sends],
            recv_peers=[m.peer for m in recvs],
        )
        try:
            with ranges.span("send_recv", index):
                works = cdist.batch_p2p(
                    [(m.rows, m.peer) for m in sends],
                    [(m.rows, m.peer) for m in recvs],
                    group=group,
                    tag=tag,
                )
        except Exception as exc:
            raise comm_failure(
                exc,
                rank=self.rank,
                what="posting the bridge's sends/receives",
                timeout_s=self.timeout_s,
                elapsed_s=0.0,
            ) from exc
        if len(works) == len(sends) + len(recvs):
            posted.send_works = list(works[: len(sends)])
            posted.recv_works = list(works[len(sends) :])
        else:  # one coalesced work for the whole batch (NCCL): it covers both directions
            posted.send_works = posted.recv_works = list(works)
            both = ["; ".join(posted.send_descs + posted.recv_descs)]
            posted.send_descs = posted.recv_descs = both
            posted.send_peers = posted.recv_peers = posted.send_peers + posted.recv_peers
        return posted

    def wait(self, posted: Posted, *, sends: bool, deadline: float) -> None:
        works = posted.send_works if sends else posted.recv_works
        descs = posted.send_descs if sends else posted.recv_descs
        peers = posted.send_peers if sends else posted.recv_peers
        self.wait_works(works, descs, posted.device, deadline, peers=peers)
        if self.on_wait is not None:  # done (a failed wait leaves them: they never came)
            self.on_wait([])

    def wait_works(
        self,
        works: Sequence[Any],
        descs: Sequence[str],
        device: torch.device,
        deadline: float,
        *,
        peers: Sequence[int] = (),
    ) -> None:
        """Wait for ``works`` in order against ``deadline``; a failure names what is pending.
        ``peers``: each work's peer (in order; one set of works covering several peers: all of
        them), told to :attr:`on_wait` as the wait goes on."""
        t0 = time.monotonic()
        for i, w in enumerate(works):
            if self.on_wait is not None and peers and not _completed(w):  # it will block
                self.on_wait(_pending_peers(works, peers, i))
            try:
                cdist.wait(w, device=device, timeout_s=time_left(deadline))
            except Exception as exc:
                pending = []
                tail = list(descs)[i:] if len(descs) == len(works) else [""] * (len(works) - i)
                for w2, d in zip(works[i:], tail, strict=True):
                    try:
                        completed = bool(w2.is_completed()) and w2 is not w
                    except Exception:
                        completed = False
                    if not completed and d and d not in pending:
                        pending.append(d)
                raise comm_failure(
                    exc,
                    rank=self.rank,
                    what="the bridge exchange (incomplete: " + "; ".join(pending) + ")",
                    timeout_s=self.timeout_s,
                    elapsed_s=time.monotonic() - t0,
                    peers=sorted({int(r) for d in pending for r in _PEER.findall(d)}),
                ) from exc

    def sends_done(self, posted: Posted) -> bool:
        try:
            return all(bool(w.is_completed()) for w in posted.send_works)
        except Exception:
            return False


def _completed(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:
        return False


def _pending_peers(works: Sequence[Any], peers: Sequence[int], i: int) -> list[int]:
    """The peers of ``works[i:]`` not completed yet (``works[i]``'s always: it is waited on
    next); every peer when one work covers them all."""
    if len(peers) != len(works):
        return sorted(set(peers))
    out = {peers[i]}
    out.update(p for w, p in zip(works[i + 1 :], peers[i + 1 :], strict=True) if not _completed(w))
    return sorted(out)
