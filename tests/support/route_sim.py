"""An in-process wire for the routed metadata exchange: every member a thread, messages in queues.

Why this file exists: :func:`mopd.bridge.peers.exchange_records` and
:func:`mopd.bridge.route.route_rows` are collective over a group's members; unit tests run
every member's side of them in one process (:func:`run_members`), each on a
:class:`LocalWire` of one :class:`LocalNet`, so that the rounds, their symmetry (every message
sent is expected, every expected one sent) and their results are checked without a process
group. A member that waits for a message nobody sends fails after ``timeout_s``, naming it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["LocalNet", "LocalWire", "run_members"]


class LocalNet:
    """Mailboxes of ``n`` members: one queue per ``(sender, receiver, round)``."""

    def __init__(self, n: int, *, timeout_s: float = 30.0) -> None:
        self.n = n
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._boxes: dict[tuple[int, int, int], queue.Queue[np.ndarray]] = {}
        self._sums: dict[int, list[np.ndarray]] = {}
        self._sum_done: dict[int, threading.Event] = {}

    def box(self, src: int, dst: int, rnd: int) -> queue.Queue[np.ndarray]:
        with self._lock:
            return self._boxes.setdefault((src, dst, rnd), queue.Queue())

    def wire(self, member: int) -> LocalWire:
        return LocalWire(self, member)

    def add(self, rnd: int, words: np.ndarray) -> np.ndarray:
        with self._lock:
            got = self._sums.setdefault(rnd, [])
            done = self._sum_done.setdefault(rnd, threading.Event())
            got.append(np.asarray(words, dtype=np.int64))
            if len(got) == self.n:
                done.set()
        if not done.wait(self.timeout_s):
            raise TimeoutError(f"sum of round {rnd}: {len(got)} of {self.n} members came")
        return np.sum(got, axis=0).astype(np.int64)


class LocalWire:
    """One member's :class:`~mopd.bridge.route.Wire` on a :class:`LocalNet`."""

    def __init__(self, net: LocalNet, member: int) -> None:
        self.net = net
        self.member = member
        self.size = net.n
        self._round = 0
        self._received = 0
        #: ``(round, sends, recv_from)`` of every swap, for tests that look at the rounds
        self.log: list[tuple[int, dict[int, int], tuple[int, ...]]] = []

    @property
    def received_words(self) -> int:
        return self._received

    def swap(
        self, sends: Mapping[int, np.ndarray], recv_from: Sequence[int]
    ) -> dict[int, np.ndarray]:
        return self._round_of(sends, recv_from, None)

    def swap_sized(
        self, sends: Mapping[int, np.ndarray], recv_from: Sequence[int], sizes_P: Sequence[int]
    ) -> np.ndarray:
        got = self._round_of(sends, recv_from, dict(zip(recv_from, sizes_P, strict=True)))
        return np.concatenate([np.empty(0, np.int64), *(got[p] for p in recv_from)])

    def _round_of(
        self,
        sends: Mapping[int, np.ndarray],
        recv_from: Sequence[int],
        sizes: Mapping[int, int] | None,
    ) -> dict[int, np.ndarray]:
        self._round += 1
        rnd = self._round
        self.log.append((rnd, {p: int(np.size(a)) for p, a in sends.items()}, tuple(recv_from)))
        for p, a in sends.items():
            if not 0 <= p < self.size:
                raise AssertionError(f"member {self.member} sends to member {p} of {self.size}")
            self.net.box(self.member, p, rnd).put(np.array(a, dtype=np.int64).reshape(-1))
        out: dict[int, np.ndarray] = {}
        for p in recv_from:
            try:
                got = self.net.box(p, self.member, rnd).get(timeout=self.net.timeout_s)
            except queue.Empty:
                raise TimeoutError(
                    f"member {self.member} waited for member {p} in round {rnd}"
                ) from None
            if sizes is not None and got.size != sizes[p]:
                raise AssertionError(
                    f"member {self.member} expected {sizes[p]} words from {p}, got {got.size}"
                )
            out[p] = got
            self._received += got.size + (0 if sizes is not None or p == self.member else 1)
        return out

    def reduce_sum(self, words: np.ndarray) -> np.ndarray:
        self._round += 1
        return self.net.add(self._round, words)


def run_members(n: int, fn: Callable[[LocalWire], Any], *, timeout_s: float = 30.0) -> list[Any]:
    """``fn(wire)`` on every member of a fresh :class:`LocalNet`, each in a thread; their
    results in member order (the first exception raised is re-raised)."""
    net = LocalNet(n, timeout_s=timeout_s)
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(m: int) -> None:
        try:
            results[m] = fn(net.wire(m))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(m,), daemon=True) for m in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * 4)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"members still running after {timeout_s * 4} s")
    return results
