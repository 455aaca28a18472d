"""Tier 2 (4 ranks, gloo): faults mid-exchange end in clear errors within the timeout, never hangs.

Fault injection of issue 7 (a rank that *exits* is in tests/unit/test_reliability_exit.py: it
kills its torchrun launch). Each case builds fresh groups from a new :class:`GroupPool` whose
transport timeout equals ``BridgeConfig.timeout_s`` (a failed exchange leaves its group unusable
by design), then breaks one rank:

- the bridge called on some ranks only -> the callers get ``BridgeTimeoutError`` from the
  metadata all-gather within the timeout; a later call is refused at once (``BridgeStateError``);
- a rank raises after the metadata phase, before posting its sends -> its receivers time out in
  ``wait()``, naming it; a rank with nothing to receive from it completes;
- a student rank raises inside ``wait()`` (data arrived, before the TP all-gather) -> its TP peer
  times out in the all-gather, which the error names;
- a slow rank (sleeps longer than the timeout) -> the others time out; the sleeper fails too when
  it arrives; a rank slower than its peers but within the timeout changes nothing (exact rows).

Every rank records ``(error type, message, elapsed)``; assertions compare them with the timeout.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from mopd.bridge import GroupPool, HiddenStateBridge, Mesh, padded_layout
from mopd.bridge.api import BridgeError, BridgeStateError, BridgeTimeoutError
from mopd.profiling.synthetic import key_pattern
from tests.support.bridges import make_bridge

TORCHRUN_NPROC = 4
TORCHRUN_TIMEOUT = 240

TEACHER = Mesh(tp=2)  # global ranks 0, 1
STUDENT = Mesh(tp=2, rank_offset=2)  # global ranks 2, 3
H = 8
T_S = 4.0  # BridgeConfig.timeout_s in these tests
SLACK_S = 6.0  # scheduling slack on 2 loaded cores


class Injected(RuntimeError):
    """The fault a test injects on one rank."""


def fresh_bridge(hook=None) -> HiddenStateBridge:
    pool = GroupPool(backend="gloo", timeout=datetime.timedelta(seconds=T_S))
    return make_bridge(pool, [TEACHER], STUDENT, [H], debug_hook=hook, timeout_s=T_S)


def kwargs() -> dict[str, Any]:
    rank = dist.get_rank()
    lay = padded_layout([0, 1], 4)
    if TEACHER.is_last_stage(rank):
        return {"hidden": {0: key_pattern(lay, H, torch.float32)}, "layouts": {0: lay}}
    return {"student_layout": lay, "outputs": {0: torch.full((8, H), float("nan"))}}


def outcome(fn: Callable[[], Any]) -> tuple[str, str, float, Any]:
    """``(error type or "ok", message, elapsed seconds, result)`` of ``fn`` on this rank."""
    t0 = time.monotonic()
    try:
        got = fn()
    except Exception as exc:  # the test inspects whatever was raised
        return type(exc).__name__, str(exc), time.monotonic() - t0, exc
    return "ok", "", time.monotonic() - t0, got


def everyone(result: tuple[str, str, float, Any]) -> list[tuple[str, str, float]]:
    mine = result[:3]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def exact(got: dict[int, torch.Tensor]) -> bool:
    want = key_pattern(padded_layout([0, 1], 4), H, torch.float32)
    return torch.equal(got[0].view(torch.int32), want.view(torch.int32))


def test_bridge_called_on_some_ranks_only_times_out_on_the_callers():
    b = fresh_bridge()
    rank = dist.get_rank()
    res = outcome(lambda: b.exchange(**kwargs()).wait()) if rank != 3 else ("skipped", "", 0, None)
    if rank != 3:
        assert isinstance(res[3], BridgeTimeoutError), res[:2]
        msg = res[1]
        assert f"global rank {rank}: the bridge's metadata all-gather over global ranks" in msg
        assert "timeout_s=4 s" in msg and "called on some ranks only" in msg
        assert T_S * 0.9 <= res[2] <= T_S + SLACK_S, res[2]
        # the bridge now refuses at once, locally
        again = outcome(lambda: b.exchange(**kwargs()))
        assert isinstance(again[3], BridgeStateError) and again[2] < 1.0, again[:3]
        assert "cannot be used after a failed exchange" in again[1]
    everyone(res)  # the world (not the broken bridge group) is still in step


def test_rank_raising_before_its_sends_leaves_its_receivers_with_a_timeout_naming_it():
    b = fresh_bridge()
    rank = dist.get_rank()

    def run() -> Any:
        prepared = b.prepare(**kwargs())
        if rank == 1:
            raise Injected("rank 1 fails between prepare and start")
        return b.start(prepared).wait()

    res = outcome(run)
    seen = everyone(res)
    assert seen[1][0] == "Injected"
    assert seen[0][0] == "ok"  # rank 0 only sends, and its receivers were there
    for r in (2, 3):
        kind, msg, elapsed = seen[r]
        assert kind == "BridgeTimeoutError", seen[r]
        assert (
            f"global rank {r}: the bridge exchange (incomplete: receive from global rank 1" in msg
        )
        assert T_S * 0.9 <= elapsed <= T_S + SLACK_S, elapsed


def test_student_rank_raising_inside_wait_leaves_its_tp_peer_in_the_all_gather():
    rank = dist.get_rank()

    def hook(point: str, blocks: list) -> None:
        if point == "received" and rank == 2:
            raise Injected("rank 2 fails after its rows arrived")

    b = fresh_bridge(hook)
    res = outcome(lambda: b.exchange(**kwargs()).wait())
    seen = everyone(res)
    assert [s[0] for s in seen[:3]] == ["ok", "ok", "Injected"], seen
    kind, msg, elapsed = seen[3]
    assert kind == "BridgeTimeoutError", seen[3]
    assert "global rank 3: the student TP all-gather after the crossing did not complete" in msg
    assert elapsed <= T_S + SLACK_S, elapsed
    if rank == 2:  # the failing rank's bridge is marked failed too
        assert isinstance(outcome(lambda: b.exchange(**kwargs()))[3], BridgeStateError)


def test_rank_slower_than_the_timeout():
    b = fresh_bridge()
    rank = dist.get_rank()

    def run() -> Any:
        if rank == 3:
            time.sleep(T_S + 2.0)
        return b.exchange(**kwargs()).wait()

    res = outcome(run)
    seen = everyone(res)
    for r in (0, 1, 2):
        kind, msg, elapsed = seen[r]
        assert kind == "BridgeTimeoutError", seen[r]
        assert "metadata all-gather" in msg
        assert elapsed <= T_S + SLACK_S, elapsed
    kind, msg, elapsed = seen[3]  # the sleeper fails too, once it arrives, within the timeout
    assert kind in ("BridgeTimeoutError", "BridgeCommError"), seen[3]
    assert "global rank 3: the bridge's metadata all-gather" in msg
    assert elapsed <= (T_S + 2.0) + T_S + SLACK_S, elapsed
    if rank == 3:
        assert isinstance(res[3], BridgeError)


@pytest.mark.parametrize("delay_s", [0.5, T_S / 2])
def test_rank_slower_than_its_peers_but_within_the_timeout(delay_s):
    b = fresh_bridge()
    rank = dist.get_rank()

    def run() -> Any:
        if rank == 1:
            time.sleep(delay_s)
        return b.exchange(**kwargs()).wait()

    res = outcome(run)
    seen = everyone(res)
    assert all(s[0] == "ok" for s in seen), seen
    if STUDENT.is_last_stage(rank):
        assert exact(res[3])
    # and the same bridge keeps working
    got = b.exchange(**kwargs()).wait()
    if STUDENT.is_last_stage(rank):
        assert exact(got)
