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
    """Base class of the bridge's runtime failures (not of bad input, which is ``ValueError``)."""


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
