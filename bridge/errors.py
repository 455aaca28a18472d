"""The bridge's runtime errors: what went wrong between ranks, in words a user can act on.

Why this file exists: bad *input* is a ``ValueError`` raised identically on every rank before any
data moves (:mod:`mopd.bridge.api`). Failures of the *run* are different: a peer that never came,
died, or is too slow, and bytes that arrived wrong. Those surface from torch as bare
``RuntimeError('Operation timed out!')`` or gloo/NCCL transport messages; the bridge turns them
into the classes below, naming this rank, the phase, the peers and the configured timeout, so a
log line says what happened and what to do. Every class is a :class:`BridgeError`
(a ``RuntimeError``), so ``except RuntimeError`` keeps working.
"""

from __future__ import annotations

__all__ = [
    "BridgeCommError",
    "BridgeError",
    "BridgeIntegrityError",
    "BridgeNonFiniteError",
    "BridgeStateError",
    "BridgeTimeoutError",
]


class BridgeError(RuntimeError):
    """Base class of the bridge's runtime failures (not of bad input, which is ``ValueError``).

    Attributes:
        first: the job's first failure when it was another rank's (published by that rank:
            :mod:`mopd.bridge.failures`): the message then leads with it, and this rank's own
            view follows in short (in full in :attr:`own` and in a note of the traceback);
            ``None`` otherwise.
        own: this rank's own view of the failure (the whole message when ``first`` is None).
        summary: that view in a few words, without the peers it names (set by the bridge on
            timeouts and transport errors; ``None``: the whole view is used).
        peers: the global ranks this rank waited for in particular (a transfer's peers), when
            the wait was for some ranks and not a whole group; else ``None``.
    """

    first: str | None = None
    summary: str | None = None
    peers: tuple[int, ...] | None = None

    @property
    def own(self) -> str:
        return self._own if hasattr(self, "_own") else str(self)

    def lead_with(self, first: str, *, rank: int, where: str) -> None:
        """Lead the message with ``first``, the job's first failure, another rank's: ``"<first>.
        As a result, global rank r (<where>) stopped: <summary>"`` (the full view as a note)."""
        if self.first is not None:
            return
        own = str(self)
        self._own = own
        self.first = first
        tail = self.summary or own
        self.args = (f"{first}. As a result, global rank {rank} ({where}) stopped: {tail}",)
        self.add_note(f"global rank {rank}'s own view: {own}")


class BridgeTimeoutError(BridgeError, TimeoutError):
    """A collective or transfer did not complete within ``BridgeConfig.timeout_s``.

    Typical causes: the bridge was called on some ranks only, a peer raised before its part of
    the exchange, or a peer is slower than the timeout.
    """


class BridgeCommError(BridgeError):
    """The transport failed before the timeout, typically because a peer process died."""


class BridgeIntegrityError(BridgeError):
    """Integrity mode found received rows whose checksum differs from the sender's."""


class BridgeNonFiniteError(BridgeError):
    """Teacher rows that arrived on a student rank hold NaN or Inf (the teacher produced them):
    named by teacher, micro-batch, receiving rank and sending rank before the loss reads them."""


class BridgeStateError(BridgeError):
    """The bridge cannot be used any more (an earlier exchange failed) or is used out of order."""
