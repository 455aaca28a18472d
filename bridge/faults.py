"""One rank's failure verdicts: is an error a cause or a symptom, and what is recorded of it.

Why this file exists: the executor moves rows; judging a failure is another job, asked by the
executor, the step, the bridge's planning, the rollouts exchange and the Distiller alike. A
timeout or transport error is a symptom: it leads with the job's first failure when another rank
published one (:class:`~mopd.bridge.failures.FailureBoard`). Any other error is a cause,
published as the job's first failure unless one is there. Either way this rank's
:class:`~mopd.bridge.lifecycle.Lifecycle` refuses further work from then on. Where the rank is
(what a census of a failure reports) is noted here too, and a collective run under
:meth:`Faults.timed` fails as a named error.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from mopd.bridge.errors import BridgeCommError, BridgeError, BridgeTimeoutError
from mopd.bridge.failures import FailureBoard
from mopd.bridge.lifecycle import Lifecycle
from mopd.bridge.transport import comm_failure

__all__ = ["Faults"]

_T = TypeVar("_T")


class Faults:
    """Judges and records one rank's failures on its :class:`~mopd.bridge.lifecycle.Lifecycle`.

    Args:
        rank: this process's global rank.
        timeout_s: the timeout a named error quotes (:meth:`timed`).
        lifecycle: the state a failure ends (owned by the executor).
        board: where the job's first failure is published and read (``None``: this rank names
            only its own view); set to ``None`` when the bridge closes.
    """

    def __init__(
        self,
        *,
        rank: int,
        timeout_s: float,
        lifecycle: Lifecycle,
        board: FailureBoard | None = None,
    ) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.lifecycle = lifecycle
        self.board = board

    # --- where this rank is --------------------------------------------------------------------

    def at(self, step: int, phase: str, micro_batch: int | None = None) -> None:
        """Note where this rank is (what a census reports; the place a cause names)."""
        if self.board is not None:
            self.board.progress.at(step, phase, micro_batch)

    def waiting(self, peers: Sequence[int]) -> None:
        """The transport waits for ``peers`` now: part of this rank's progress (what a census
        of a failure reads)."""
        if self.board is not None:
            self.board.progress.waiting_for = tuple(peers)

    # --- verdicts ------------------------------------------------------------------------------

    def mark_failed(self, exc: BaseException) -> None:
        """Refuse further work, locally (:meth:`Lifecycle.check_usable`); keeps the first cause.

        The job's first failure is published or read (:attr:`board`): a timeout or transport
        error here is a symptom, and a bridge error of that kind then leads with another
        rank's first failure (:meth:`BridgeError.lead_with`); any other error is a cause,
        published as the first failure unless one is there."""
        if self.lifecycle.failure is None:
            text = f"{type(exc).__name__}: {exc}"
            board = self.board
            if board is not None:
                if isinstance(exc, BridgeTimeoutError | BridgeCommError):
                    first = board.lead(text, peers=exc.peers)
                    if first is not None:
                        exc.lead_with(first, rank=self.rank, where=board.progress.describe())
                        text = f"{type(exc).__name__}: {exc}"
                else:
                    board.cause(f"{type(exc).__name__}: {exc}")
            self.lifecycle.fail(text, hard=True)
        else:
            self.lifecycle.fail(None, hard=True)

    def mark_abandoned(
        self,
        text: str,
        *,
        cause: str | None = None,
        publish: bool = True,
        rank: int | None = None,
        where: str | None = None,
    ) -> None:
        """Refuse further work after a step its caller abandoned (:class:`State` ``ABANDONED``);
        keeps the first cause. ``cause`` (default ``text``) is published as the job's first
        failure unless one is there (``publish=False``: ``text`` only repeats what the matrix
        said of other ranks); ``rank``, ``where``: the rank it is about and its place (default
        this one, where it is)."""
        first = self.lifecycle.fail(text, hard=False)  # always recorded, published if first
        if first and publish and self.board is not None:
            self.board.cause(cause if cause is not None else text, rank=rank, where=where)

    def timed(self, fn: Callable[[], _T], what: str | Callable[[], str]) -> _T:
        """``fn()``'s value; a failure becomes a named timeout / comm error (``what``: the phase,
        or a function writing it, called only then) and refuses further work."""
        t0 = time.monotonic()
        try:
            return fn()
        except BridgeError:
            raise
        except Exception as exc:
            err = comm_failure(
                exc,
                rank=self.rank,
                what=what() if callable(what) else what,
                timeout_s=self.timeout_s,
                elapsed_s=time.monotonic() - t0,
            )
            self.mark_failed(err)
            raise err from exc
