"""Tier 1: the first failure of a job, published and read in one process (``mopd.bridge.failures``).

Boards of several "ranks" share one in-process store, each with its watcher thread, so the
whole protocol runs here: the first cause wins and every symptom leads with it; a census wakes
the other ranks' watchers, and their answers name a rank that never answers (dead or stopped),
the rank others' transfers wait for, a rank busy outside any collective, or one behind the
others; a symptom with nobody to blame is the first failure itself. A bridge error led by
another rank's cause keeps its own view (``own``, a traceback note) and says its phase in
short; closing a board ends its thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

from mopd.bridge.errors import BridgeCommError, BridgeTimeoutError
from mopd.bridge.failures import FailureBoard, Progress, _blame
from mopd.bridge.transport import comm_failure


@pytest.fixture
def store() -> dist.Store:
    return dist.HashStore()


def board(store: dist.Store, rank: int, members: list[int], census_s: float = 1.0) -> FailureBoard:
    return FailureBoard(store=store, namespace="job", rank=rank, members=members, census_s=census_s)


@pytest.fixture
def sleeper() -> Iterator[threading.Thread]:
    """A thread busy outside any collective (in ``time.sleep``), standing for a stalled rank's
    main thread."""
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, args=(30.0,), daemon=True)
    t.start()
    yield t
    stop.set()
    t.join()


def test_progress_orders_a_step_and_says_where():
    p = Progress()
    assert p.describe() == "before any step" and p.key() < (0, 0, -1, 0)
    keys, words = [], []
    for phase, i in [
        ("rollouts", None),
        ("plan", None),
        ("planned", None),
        ("teacher", 0),
        ("send", 0),
        ("teacher", 1),
        ("forward", 0),
        ("receive", 0),
        ("forward", 1),
        ("finish", None),
        ("done", None),
        ("mean_loss", None),
    ]:
        p.at(2, phase, i)
        keys.append(p.key())
        words.append(p.describe())
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert words[0] == "step 2, the rollouts exchange"
    assert words[3] == "step 2, the teachers' forward of micro-batch 0"
    assert words[7] == "step 2, receiving micro-batch 0"
    p.at(3, "plan")
    assert p.key() > keys[-1]


def test_the_first_cause_wins_and_symptoms_lead_with_it(store):
    a, b = board(store, 0, [0]), board(store, 1, [1])  # one-rank groups: no census
    a.progress.at(0, "forward", 1)
    first = a.cause("Injected: boom")
    assert (
        first
        == "global rank 0 failed first (step 0, the student's forward of micro-batch 1): Injected: boom"
    )
    assert b.cause("ValueError: later") == first  # a later cause does not replace it
    assert b.lead("BridgeTimeoutError: waited") == first
    assert a.lead("BridgeTimeoutError: waited") is None  # its own: nothing to lead with
    c = board(dist.HashStore(), 2, [2])
    assert c.lead("BridgeTimeoutError: nobody to blame") is None  # its own symptom is first
    assert (
        c.read()
        == "global rank 2 failed first (before any step): BridgeTimeoutError: nobody to blame"
    )


def test_a_census_names_the_rank_that_does_not_answer(store):
    a = board(store, 0, [0, 1, 2], census_s=0.3)
    b = board(store, 1, [0, 1, 2])  # rank 2 has no board: it died
    b.progress.at(0, "receive", 1)
    t0 = time.monotonic()
    first = a.lead("BridgeCommError: connection closed")
    assert 0.3 <= time.monotonic() - t0 < 5.0
    assert first == "global rank 2 failed first: does not respond (the process died, or is stopped)"
    assert b.read() == first


def test_a_census_names_a_rank_busy_outside_any_collective(store, sleeper):
    a = board(store, 0, [0, 1])
    b = board(store, 1, [0, 1])
    b.progress.at(0, "planned")
    b.progress.thread = sleeper.ident
    first = a.lead("BridgeTimeoutError: the metadata all-gather")
    assert first is not None and first.startswith(
        "global rank 1 failed first (step 0, after planning): it is alive but busy outside any "
        "collective, in "
    ), first
    assert "while its peers wait" in first


def test_a_census_names_the_rank_whose_transfers_the_others_wait_for(store, sleeper):
    """Rank 0 waits for ranks 1 and 2's transfers; rank 1 waits for rank 2's (it is blocked
    too): rank 2, which waits for nobody, is named, with the ranks waiting for it."""
    a, b, c = board(store, 0, [0, 1, 2]), board(store, 1, [0, 1, 2]), board(store, 2, [0, 1, 2])
    b.progress.at(0, "receive", 0)
    b.progress.waiting_for = (2,)
    c.progress.at(1, "plan")  # it went on to the next step
    a.progress.at(0, "finish")
    first = a.lead("BridgeTimeoutError: the bridge exchange", peers=[1, 2])
    assert first is not None and first.startswith(
        "global rank 2 failed first (step 1, planning): global ranks [0, 1] wait for its "
        "transfers, and it is "
    ), first


def test_blame_rules_in_order():
    def ans(key, waiting, waiting_for=()):
        return {
            "key": key,
            "at": f"at {key}",
            "where": "f (x.py:1)",
            "waiting": waiting,
            "waiting_for": list(waiting_for),
        }

    same = (0, 3, 0, 0)
    assert _blame({0: ans(same, True), 1: ans(same, True)}, [0, 1]) is None  # all alike
    assert _blame({0: ans(same, False), 1: ans(same, False)}, [0, 1]) is None
    behind = _blame({0: ans(same, True), 1: ans((0, 1, -1, 0), True)}, [0, 1])
    assert behind == (
        "global rank 1 failed first (at (0, 1, -1, 0)): it is behind its peers, waiting in "
        "f (x.py:1), while they wait for it"
    )
    busy = _blame({0: ans(same, True), 1: ans((0, 4, -1, 0), False)}, [0, 1])  # busy, ahead
    assert busy is not None and busy.startswith("global rank 1 failed first")
    # several busy ranks: the least advanced of them
    many = _blame(
        {0: ans(same, True), 1: ans((0, 5, -1, 0), False), 2: ans((0, 4, -1, 0), False)},
        [0, 1, 2],
    )
    assert many is not None and many.startswith("global rank 2 failed first")


def test_a_led_bridge_error_keeps_its_own_view():
    err = comm_failure(
        RuntimeError("Timed out waiting 3000ms for recv operation to complete"),
        rank=2,
        what="the bridge exchange (incomplete: receive from global rank 1 (micro-batch 0, teacher 0, 2 rows))",
        timeout_s=3.0,
        elapsed_s=3.0,
        peers=[1],
    )
    assert isinstance(err, BridgeTimeoutError) and err.peers == (1,)
    own = str(err)
    err.lead_with(
        "global rank 1 failed first (step 0, planning): Injected: x",
        rank=2,
        where="step 0, receiving micro-batch 0",
    )
    assert str(err) == (
        "global rank 1 failed first (step 0, planning): Injected: x. As a result, global rank 2 "
        "(step 0, receiving micro-batch 0) stopped: the bridge exchange did not complete within "
        "BridgeConfig.timeout_s=3 s"
    )
    assert err.own == own and err.first is not None
    assert err.__notes__ == [f"global rank 2's own view: {own}"]
    lost = comm_failure(
        RuntimeError("Connection closed by peer"),
        rank=0,
        what="the bridge's metadata all-gather over global ranks [0, 1]",
        timeout_s=5.0,
        elapsed_s=0.1,
    )
    assert isinstance(lost, BridgeCommError) and lost.peers is None
    assert (
        lost.summary
        == "the bridge's metadata all-gather failed after 0.1 s: the transport lost a peer"
    )


def _new_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """The threads started since ``before`` (other tests' threads may end meanwhile)."""
    return [t for t in threading.enumerate() if t not in before]


def test_closing_a_board_ends_its_watcher(store):
    before = set(threading.enumerate())
    a = board(store, 0, [0, 1])
    (watcher,) = _new_threads(before)
    assert watcher.name == "mopd-bridge-watcher-0" and watcher.is_alive()
    a.close()
    assert not watcher.is_alive() and _new_threads(before) == []
    b = board(store, 1, [0, 1])
    (watcher,) = _new_threads(before)
    assert watcher.name == "mopd-bridge-watcher-1"
    del b  # the last reference gone: its watcher ends too
    assert not watcher.is_alive() and _new_threads(before) == []


def test_a_store_that_went_away_is_named_as_its_hosts_failure():
    """A rank whose failure comes after the store's host process ended (a link's host: the
    student's world's rank 0) cannot read or publish: its error leads with that host, named by
    the board's names, instead of standing alone."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=_short())

    def names(text: str) -> str:
        return text.replace("global rank 0", 'global rank 0 of world "student"')

    b = FailureBoard(
        store=client, namespace="job", rank=5, members=[0, 5], census_s=0.2, names=names,
        store_host=0,
    )  # fmt: skip
    del server  # its process's store ends
    first = b.lead("BridgeCommError: lost a peer", peers=None)
    assert first == (
        'global rank 0 of world "student" failed first: does not respond (its process, which '
        "served the job's store, ended)"
    )
    plain = FailureBoard(store=client, namespace="j2", rank=5, members=[0, 5], census_s=0.2)
    assert plain.lead("BridgeCommError: lost a peer").startswith("the job's store failed first")
    b.close()
    plain.close()


def _short() -> Any:
    import datetime

    return datetime.timedelta(seconds=2)
