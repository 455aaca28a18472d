"""The first failure of a job's bridge, published where every rank can read it without a collective.

Why this file exists: when one rank fails (its code raised, it died, it stalled), its peers learn
of it only as a timeout or a closed connection that names nothing. The first rank to fail writes
its cause (global rank, step, micro-batch, phase, exception text) into the job's key-value store
(torch.distributed's default store, or one passed in) under the bridge's own namespace, and
every other rank's error leads with it. A rank whose failure is only a symptom (a timeout, a
lost peer) and finds no cause there takes a census: every rank's watcher thread, blocked on the
store until then (no traffic), answers with where its rank is (:class:`Progress`) and whether
its thread is waiting in a collective. A rank that does not answer died or is stopped; one
behind its peers, or busy outside every collective while they wait, stalled them. That is the
cause published; without one, the symptom itself is the first failure.

A board belongs to a metadata group (every bridge on that group shares it, and its first
failure: they share the groups that failed); it lives as long as a bridge on it does.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch.distributed as dist

from mopd.common.collector import paused_collector
from mopd.common.units import rank_list

__all__ = ["FailureBoard", "Progress"]

#: Longest a census waits for the answers of every rank (a dead rank costs all of it).
CENSUS_S = 2.0
#: Characters of a published cause.
CAUSE_CHARS = 600
#: A watcher's wait on the store between two wake-ups: long, but under the socket poll's limit.
_WATCH = datetime.timedelta(days=20)
#: Modules whose frames mean "waiting on other ranks" (a collective, a transfer, a store wait).
_COMM_MODULES = (
    "torch.distributed",
    "mopd.common.dist",
    "mopd.bridge.groups",
    "mopd.bridge.transport",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.tensor_parallel.mappings",
    __name__,  # a rank inside its own census, or waiting for another's
)
#: A rank's places in a step, in the order a step goes through them: phase -> (rank, words).
_PHASES = {
    "idle": (-1, "before any step"),
    "rollouts": (0, "the rollouts exchange"),
    "plan": (1, "planning"),
    "planned": (2, "after planning"),
    "teacher": (3, "the teachers' forward of micro-batch {i}"),
    "send": (3, "sending micro-batch {i}"),
    "ahead": (4, "the teachers' forward of a step submitted ahead, micro-batch {i}"),
    "forward": (4, "the student's forward of micro-batch {i}"),
    "receive": (4, "receiving micro-batch {i}"),
    "finish": (5, "finishing"),
    "done": (6, "done"),
    "mean_loss": (7, "mean_loss()"),
}
#: Within one micro-batch of a phase: the teacher's forward before its send, the student's
#: forward before its receive.
_SUB = {"teacher": 0, "send": 1, "forward": 0, "receive": 1}


@dataclass
class Progress:
    """Where this rank is: its step, phase and micro-batch, and the thread driving it (cheap to
    update: a few attribute writes, read only by a census)."""

    step: int = -1
    phase: str = "idle"
    micro_batch: int | None = None
    thread: int | None = field(default_factory=threading.get_ident)
    #: the ranks whose transfers it waits for now (a bridge wait), else empty
    waiting_for: tuple[int, ...] = ()

    def at(self, step: int, phase: str, micro_batch: int | None = None) -> None:
        assert phase in _PHASES, phase
        self.step, self.phase, self.micro_batch = step, phase, micro_batch
        self.thread = threading.get_ident()

    def key(self) -> tuple[int, int, int, int]:
        """Comparable progress: later places of the job compare greater."""
        order = _PHASES[self.phase][0]
        mb = -1 if self.micro_batch is None else self.micro_batch
        return (self.step, order, mb, _SUB.get(self.phase, 0))

    def describe(self) -> str:
        """``"step 0, receiving micro-batch 1"``."""
        words = _PHASES[self.phase][1].format(i=self.micro_batch)
        return words if self.step < 0 else f"step {self.step}, {words}"


def _where(frame: FrameType | None) -> tuple[str, bool]:
    """``(innermost place of the job's own code, waiting on other ranks?)`` of a stack."""
    place, waiting, depth = "", False, 0
    while frame is not None and depth < 40:
        module = str(frame.f_globals.get("__name__", ""))
        if depth < 8 and module.startswith(_COMM_MODULES):
            waiting = True
        if not place and not module.startswith(("threading", __name__)):
            path = frame.f_code.co_filename.replace(os.sep, "/").split("/")
            place = f"{frame.f_code.co_name} ({'/'.join(path[-3:])}:{frame.f_lineno})"
        frame = frame.f_back
        depth += 1
    return place or "an unknown place", waiting


def _frame_of(thread: int | None) -> FrameType | None:
    """The current frame of ``thread``, read with the garbage collector paused.

    ``sys._current_frames()`` allocates while it holds the interpreter's lock on its thread
    list. A collection started there runs finalizers under that lock, and one that reads frames
    again (a dropped bridge's watcher stopping, :func:`_stop`) or waits for a thread to end
    blocks forever.
    """
    if thread is None:
        return None
    with paused_collector():
        return sys._current_frames().get(thread)


def _answer(progress: Progress, *, where: str | None = None) -> dict[str, Any]:
    """What this rank tells a census: its progress and where its driving thread is, or
    ``where`` it stopped (then not waiting; its frames are not read)."""
    if where is None:
        place, waiting = _where(_frame_of(progress.thread))
    else:
        place, waiting = where, False
    return {
        "key": list(progress.key()),
        "at": progress.describe(),
        "where": place,
        "waiting": waiting,
        "waiting_for": list(progress.waiting_for),
    }


class _Watcher:
    """The thread that answers a census for this rank: blocked on its own connection to the
    store until woken (by a census, or by :meth:`stop`), then answers once and ends."""

    def __init__(self, store: dist.Store, *, rank: int, progress: Progress) -> None:
        self.rank = rank
        self.progress = progress
        self.main = store  # what wakes it (its own connection is blocked by its wait)
        # its own connection: a wait blocks that connection only
        self.store: dist.Store | None = store.clone()  # type: ignore[attr-defined]
        self.answered = threading.Lock()  # held by whoever answers (the thread, or stop)
        self.thread = threading.Thread(target=self._run, name=f"mopd-bridge-watcher-{rank}")
        self.thread.daemon = True
        self.thread.start()
        _LIVE.add(self)

    def _say(self, store: dist.Store, answer: dict[str, Any]) -> None:
        """Answer a census (once: later calls do nothing)."""
        if self.answered.acquire(blocking=False):
            store.set(f"alive/{self.rank}", json.dumps(answer))
            store.add("answers", 1)

    def _run(self) -> None:
        store = self.store
        assert store is not None
        key = f"wake/{self.rank}"
        try:
            while True:
                try:
                    store.wait([key], _WATCH)
                    break
                except dist.DistStoreError as exc:
                    if "timeout" not in str(exc).lower():
                        return  # the store is gone (the job ends)
            if store.get(key) == b"census":
                self._say(store, _answer(self.progress))
        except Exception:  # the store went away: nothing to answer
            return

    def stop(self, where: str = "the bridge's close()") -> None:
        """Leave an answer for a later census (this rank closed its bridge, or its process
        ends: ``where``), wake the thread through the main connection and let it end; close
        its own connection. A thread left blocked in the store when the interpreter shuts down
        would be torn down inside C++ (``std::terminate``): the process stops every live
        watcher at exit (``atexit``) too."""
        _LIVE.discard(self)
        if self.store is None:
            return
        try:
            self._say(self.main, _answer(self.progress, where=where))
            self.main.set(f"wake/{self.rank}", "close")
        except Exception:  # the store is gone: the thread's wait ends with it
            pass
        if self.thread is not threading.current_thread():  # a finalizer may run on it
            self.thread.join(timeout=5.0)
        self.store = None


class FailureBoard:
    """One metadata group's first failure, in the job's store (see the module doc).

    Args:
        store: the job's key-value store (keys go under ``namespace``).
        namespace: the board's prefix (the same on every rank: the group's name).
        rank: this global rank.
        members: every global rank of the group (ascending).
        census_s: how long a census waits for answers.
        names: rewrites a published text's rank names (a bridge across worlds names each
            rank by its world: :meth:`~mopd.bridge.worlds.WorldLink.names`).
        store_host: the global rank whose process serves ``store``, when one does (a link's
            store: the student's world's rank 0); ``None``: another process, or not known.
            A store that went away is then named as that rank's failure.
    """

    def __init__(
        self,
        *,
        store: dist.Store,
        namespace: str,
        rank: int,
        members: Sequence[int],
        census_s: float = CENSUS_S,
        names: Callable[[str], str] | None = None,
        store_host: int | None = None,
    ) -> None:
        self.store = dist.PrefixStore(namespace, store)
        self.names = names
        self.store_host = store_host
        self._lost = False  # the store stopped answering (its process ended)
        self.rank = rank
        self.members = tuple(members)
        self.census_s = census_s
        self.progress = Progress()
        #: the first failure as this rank knows it (read once, then kept)
        self.first: str | None = None
        self._mine: str | None = None  # the text this rank published, if its own came first
        self._blamed = False  # what this rank published names another rank
        self._watcher: _Watcher | None = None
        if len(self.members) > 1:
            try:
                self._watcher = _Watcher(self.store, rank=rank, progress=self.progress)
            except Exception:  # a store that cannot be cloned: no census answers from here
                self._watcher = None
        self._finalizer = weakref.finalize(self, _stop, self._watcher)
        self._finalizer.atexit = False  # at exit every live watcher is stopped (_stop_live)

    @classmethod
    def of(
        cls,
        group: dist.ProcessGroup | None,
        *,
        rank: int,
        members: Sequence[int],
        timeout_s: float,
        store: dist.Store | None = None,
        names: Callable[[str], str] | None = None,
        store_host: int | None = None,
    ) -> FailureBoard | None:
        """The board of ``group`` (shared by every bridge on it in this process), or ``None``
        off the group or when there is no store to publish in."""
        if group is None:
            return None
        if store is None:
            try:
                store = dist.distributed_c10d._get_default_store()
            except Exception:  # no default store (a group made without one): local names only
                return None
        name = f"{id(store)}:{group.group_name}"
        board = _BOARDS.get(name)
        if board is None:
            board = cls(
                store=store,
                namespace=f"mopd-bridge/{group.group_name}",
                rank=rank,
                members=members,
                census_s=min(CENSUS_S, timeout_s / 2),
                names=names,
                store_host=store_host,
            )
            _BOARDS[name] = board
        return board

    def close(self) -> None:
        """Stop the watcher thread and close its connection (also done once no bridge holds the
        board). Local."""
        self._finalizer()

    # --- publishing ----------------------------------------------------------------------------

    def cause(self, error: str, *, rank: int | None = None, where: str | None = None) -> str:
        """Publish ``error`` as the job's first failure unless one is there already (first one
        wins); returns the first failure. ``rank``: the rank it is about (default this one);
        ``where``: its place (default this rank's progress)."""
        r = self.rank if rank is None else rank
        place = self.progress.describe() if where is None else where
        text = f"global rank {r} failed first ({place}): {error}"[:CAUSE_CHARS]
        return self._publish(text, blames=r != self.rank)

    def lead(self, symptom: str, *, peers: Sequence[int] | None = None) -> str | None:
        """For a failure of this rank that is a symptom (a timeout, a lost peer): the job's
        first failure to lead its error with, or ``None`` when this very failure is the first
        (then published). Takes a census when nothing is published yet (at most
        :attr:`census_s`, plus as long for another rank's census). ``peers``: the ranks this
        rank waited for in particular (the first suspects)."""
        first = self.read()
        if first is None:
            # whoever took a census but went down before publishing it: take it again
            for key in ("census", "census again"):
                blame = self._census(peers or (), key=key)
                if blame is not None or not self._census_elsewhere(key):
                    break
                first = self._wait_first(self.census_s + 2.0)
                if first is not None:
                    break
            if first is None:
                first = self._publish(*blame) if blame else self.cause(symptom)
        if self._lost and first == self._mine:  # nobody else can read it: the store is gone
            return self._store_gone()
        if first == self._mine and not self._blamed:
            return None
        return first

    def _store_gone(self) -> str:
        """The lead of a failure seen once the store went away: its host's process ended."""
        if self.store_host is None:
            text = (
                "the job's store failed first: it does not respond (the process serving it "
                "ended, with its job)"
            )
        else:
            text = (
                f"global rank {self.store_host} failed first: does not respond (its process, "
                "which served the job's store, ended)"
            )
        return self.names(text) if self.names is not None else text

    def read(self) -> str | None:
        """The first failure published so far (``None``: none, or the store is unreachable)."""
        if self.first is None:
            try:
                if self.store.check(["first"]):
                    self.first = self.store.get("first").decode(errors="replace")
            except Exception:
                self._lost = True
                return None
        return self.first

    def _publish(self, text: str, blames: bool) -> str:
        if self.names is not None:
            text = self.names(text)
        try:
            got = self.store.compare_set("first", "", text).decode(errors="replace")
        except Exception:  # the store is gone: this rank's view is all there is
            self._lost = True
            got = text
        if got == text:
            self._mine, self._blamed = text, blames
        self.first = got
        return got

    def _wait_first(self, seconds: float) -> str | None:
        try:
            self.store.wait(["first"], datetime.timedelta(seconds=seconds))
        except Exception:
            return None
        return self.read()

    # --- the census ----------------------------------------------------------------------------

    def _census_elsewhere(self, key: str = "census") -> bool:
        """Whether another rank took the census of ``key``."""
        try:
            return bool(self.store.check([key])) and self.store.get(key).decode() != str(self.rank)
        except Exception:
            return False

    def _census(self, suspects: Sequence[int], key: str = "census") -> tuple[str, bool] | None:
        """Ask every rank where it is; ``(cause naming the ranks at fault, True)``, or ``None``
        (another rank takes the census, the store is gone, or nobody is at fault). ``key``:
        who takes it (the first rank to claim the key); a second census reads the answers the
        first one collected (a rank answers once)."""
        others = [r for r in self.members if r != self.rank]
        if not others:
            return None
        try:
            me = str(self.rank)
            if self.store.compare_set(key, "", me).decode() != me:
                return None
            wake = [f"wake/{r}" for r in others]
            self.store.multi_set(wake, ["census"] * len(others))  # type: ignore[attr-defined]
            deadline = time.monotonic() + self.census_s
            while time.monotonic() < deadline:
                if int(self.store.add("answers", 0)) >= len(others):
                    break
                time.sleep(0.02)
            answers: dict[int, dict[str, Any]] = {}
            for r in others:
                if self.store.check([f"alive/{r}"]):
                    answers[r] = json.loads(self.store.get(f"alive/{r}"))
        except Exception:
            return None
        mine = _answer(self.progress)
        mine["waiting"] = True  # it just gave up waiting on the others
        if suspects:
            mine["waiting_for"] = list(suspects)  # the transfers still pending, precisely
        answers[self.rank] = mine
        blame = _blame(answers, self.members)
        return None if blame is None else (blame[:CAUSE_CHARS], True)


def _blame(answers: dict[int, dict[str, Any]], members: Sequence[int]) -> str | None:
    """Who held the others up, from a census (see the module doc), or ``None``, in this order:
    ranks that did not answer (dead, or stopped); ranks that others wait for in their
    transfers and that wait for none themselves (they raised, stalled or went on without their
    part: the busy ones first); a rank busy outside any collective while the others wait; a
    rank behind the others."""
    silent = [r for r in members if r not in answers]
    if silent:
        who = f"global rank {silent[0]}" if len(silent) == 1 else f"global ranks {silent}"
        verb = "does" if len(silent) == 1 else "do"
        return f"{who} failed first: {verb} not respond (the process died, or is stopped)"
    blocked = {r for r, a in answers.items() if a["waiting_for"]}
    waited = {p for a in answers.values() for p in a["waiting_for"] if p in answers}
    if waited - blocked:
        culprits = _first_of(sorted(waited - blocked), answers)
        waiters = sorted(r for r, a in answers.items() if set(a["waiting_for"]) & set(culprits))
        a = answers[culprits[0]]
        how = "waiting" if a["waiting"] else "busy"
        return (
            f"{_who(culprits)} failed first ({a['at']}): {rank_list(waiters, noun='global rank', style='list')} wait for its "
            f"transfers, and it is {how} in {a['where']}"
        )
    busy = [r for r, a in answers.items() if not a["waiting"]]
    if busy and len(busy) < len(answers):
        culprits = _first_of(busy, answers)
        a = answers[culprits[0]]
        return (
            f"{_who(culprits)} failed first ({a['at']}): it is alive but busy outside any "
            f"collective, in {a['where']}, while its peers wait"
        )
    low = min(tuple(a["key"]) for a in answers.values())
    behind = sorted(r for r, a in answers.items() if tuple(a["key"]) == low)
    if len(behind) < len(answers):
        a = answers[behind[0]]
        return (
            f"{_who(behind)} failed first ({a['at']}): it is behind its peers, waiting in "
            f"{a['where']}, while they wait for it"
        )
    return None


def _first_of(ranks: Sequence[int], answers: dict[int, dict[str, Any]]) -> list[int]:
    """Of ``ranks``: the busy ones if any, and of those the least advanced."""
    busy = [r for r in ranks if not answers[r]["waiting"]] or list(ranks)
    low = min(tuple(answers[r]["key"]) for r in busy)
    return sorted(r for r in busy if tuple(answers[r]["key"]) == low)


def _who(ranks: Sequence[int]) -> str:
    more = f" (and global ranks {list(ranks[1:])})" if len(ranks) > 1 else ""
    return f"global rank {ranks[0]}{more}"


def _stop(watcher: _Watcher | None) -> None:
    if watcher is not None:
        watcher.stop()


#: Every watcher whose thread may still run (stopped at exit, before the interpreter ends).
_LIVE: weakref.WeakSet[_Watcher] = weakref.WeakSet()


@atexit.register
def _stop_live() -> None:
    for watcher in list(_LIVE):
        watcher.stop("its process's exit")


#: Boards by store and group name: every bridge of a process on one group shares its board.
_BOARDS: weakref.WeakValueDictionary[str, FailureBoard] = weakref.WeakValueDictionary()
