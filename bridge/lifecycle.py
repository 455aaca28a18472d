"""A bridge's lifecycle on one rank: open, failed (after an abandoned step, or hard), closed.

Why this file exists: whether a rank's bridge may still be used, and why not, is asked from
the step, the bridge's planning, the Distiller and the executor alike; the answer is one state
object (:class:`Lifecycle`) that they ask, instead of three flags they each read and combine.
"""

from __future__ import annotations

import enum

from mopd.bridge.errors import BridgeStateError

__all__ = ["Lifecycle", "State"]

#: Characters of a failure's text kept (the first failure names the job's cause).
FAILURE_CHARS = 800


class State(enum.Enum):
    """Where a rank's bridge is."""

    #: usable
    OPEN = "open"
    #: a step its caller abandoned: refused here; every rank hears of it at the next plan
    ABANDONED = "abandoned"
    #: a failed wait or transfer: the transport may be out of step, refused locally
    FAILED = "failed"
    #: :meth:`Lifecycle.close` was called
    CLOSED = "closed"


class Lifecycle:
    """One rank's bridge state and the first failure that ended its use (:attr:`failure`).

    A failure never changes once set (the first cause is the one every message names);
    :meth:`fail` with ``hard=True`` marks the transport as possibly out of step, even after a
    softer failure; :meth:`close` wins over both.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        #: the first failure's text (``None``: none)
        self.failure: str | None = None
        self._hard = False
        self._closed = False

    @property
    def state(self) -> State:
        """The state (:class:`State`)."""
        if self._closed:
            return State.CLOSED
        if self._hard:
            return State.FAILED
        return State.OPEN if self.failure is None else State.ABANDONED

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @property
    def hard(self) -> bool:
        """Whether a failure left the transport in an unknown state (refuse locally, without
        communication)."""
        return self._hard

    def fail(self, text: str | None, *, hard: bool) -> bool:
        """Record a failure (``text`` kept only if it is the first); returns whether it was."""
        first = self.failure is None and text is not None
        if first:
            assert text is not None
            self.failure = text[:FAILURE_CHARS]
        self._hard = self._hard or hard
        return first

    def close(self) -> None:
        """Refuse every later call (local, idempotent)."""
        self._closed = True

    def check_usable(self) -> None:
        """Raise :class:`~mopd.bridge.errors.BridgeStateError` unless the bridge is open (local,
        no communication)."""
        if self._closed:
            raise BridgeStateError(
                f"global rank {self.rank}: this bridge is closed; build a new one (on new "
                "groups: a new GroupPool) to go on"
            )
        if self.failure is not None:
            raise BridgeStateError(
                f"global rank {self.rank}: this bridge cannot be used after a failed exchange "
                f"({self.failure}); its process group may still hold sends/receives of that "
                "exchange, which a later one could match. Create new groups (a new GroupPool and "
                "create_bridge_groups) and a new HiddenStateBridge on every rank."
            )
