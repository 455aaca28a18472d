"""Tier 2 (4 ranks, gloo): the strict point-to-point mode catches what NCCL would not forgive.

``tests/support/strict_p2p.py`` is what the bridge, reliability and megatron-loop modules run
under (``TORCHRUN_STRICT_P2P = 1``). Here each rule is broken on purpose and must be a
``StrictP2PError`` on the rank that waits, while gloo alone would deliver every byte:

- two messages of one pair received in the other order (gloo pairs them by tag; NCCL in issue
  order) -> the first wait names both operations;
- a send whose receive is never posted -> its wait times out (NCCL blocks), and
  ``is_completed()`` stays false until the peer posts it; a ``wait()`` without a timeout times
  out after the group's own timeout (a fault test under the mode takes the time it tests);
- ``batch_isend_irecv`` on a 4-rank group no collective has touched -> refused at the call;
- a correct exchange passes, its rows exact.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from tests.support import strict_p2p
from tests.support.reliability import everyone, outcome

TORCHRUN_NPROC = 4
TORCHRUN_TIMEOUT = 200
TORCHRUN_STRICT_P2P = 1


@pytest.fixture(autouse=True)
def strict() -> None:
    assert strict_p2p.installed()  # the knob above turned it on in every rank


def test_messages_received_in_another_order_than_sent():
    group = dist.new_group([0, 1], backend="gloo")
    dist.barrier(group=group) if dist.get_rank() < 2 else None
    got: tuple = ("outside",)
    if dist.get_rank() == 0:
        a, b = torch.arange(4.0), torch.arange(8.0)
        w = [dist.isend(a, 1, group=group, tag=1), dist.isend(b, 1, group=group, tag=2)]
        got = outcome(lambda: [x.wait(datetime.timedelta(seconds=5)) for x in w])[:2]
    elif dist.get_rank() == 1:
        b, a = torch.empty(8), torch.empty(4)
        w = [dist.irecv(b, 0, group=group, tag=2), dist.irecv(a, 0, group=group, tag=1)]
        got = outcome(lambda: [x.wait(datetime.timedelta(seconds=5)) for x in w])[:2]
        # the strict check raised at the first wait, before the other receive was waited for:
        # on a loaded machine its bytes may still be in flight, so give them a few seconds
        deadline = time.monotonic() + 5.0

        def arrived() -> bool:
            return torch.equal(a, torch.arange(4.0)) and torch.equal(b, torch.arange(8.0))

        while not arrived() and time.monotonic() < deadline:
            time.sleep(0.01)
        got = (*got, arrived())
    seen = everyone(got)
    for r in (0, 1):
        kind, msg = seen[r][:2]
        assert kind == "StrictP2PError", seen[r]
        assert "NCCL pairs point-to-point operations per peer in issue order" in msg, msg
    assert "send #0 from global rank 0 to 1" in seen[0][1]
    assert "is (4,) torch.float32 tag 1 but the operation the peer posted" in seen[0][1]
    assert "is (8,) torch.float32 tag 2" in seen[0][1]
    assert seen[1][2] is True  # gloo itself delivered every byte: only the order was wrong


def test_a_send_completes_only_once_its_receive_is_posted():
    group = dist.new_group([2, 3], backend="gloo")
    got: tuple = ("outside",)
    if dist.get_rank() == 2:
        w = dist.isend(torch.ones(3), 3, group=group)
        time.sleep(0.5)  # gloo has sent it by now
        early = w.is_completed()
        dist.barrier(group=group)  # rank 3 posts its receive after this
        w.wait(datetime.timedelta(seconds=10))
        lonely = dist.isend(torch.ones(3), 3, group=group)  # never received
        got = (
            early,
            w.is_completed(),
            outcome(lambda: lonely.wait(datetime.timedelta(seconds=1)))[:2],
        )
    elif dist.get_rank() == 3:
        dist.barrier(group=group)
        buf = torch.empty(3)
        dist.irecv(buf, 2, group=group).wait()
        got = (torch.equal(buf, torch.ones(3)),)
    seen = everyone(got)
    early, later, lonely = seen[2]
    assert early is False and later is True, seen[2]
    assert lonely[0] == "StrictP2PError" and "timed out" in lonely[1], lonely
    assert "the peer never posted the matching receive" in lonely[1], lonely
    assert seen[3] == [True] or seen[3] == (True,), seen[3]


def test_a_wait_without_a_timeout_follows_the_groups_timeout():
    group = dist.new_group([0, 1], backend="gloo", timeout=datetime.timedelta(seconds=2))
    got: tuple = ("outside",)
    if dist.get_rank() == 0:
        assert strict_p2p.group_timeout_s(group) == 2.0
        lonely = dist.isend(torch.ones(3), 1, group=group)  # never received
        got = outcome(lonely.wait)[:3]
    seen = everyone(got)
    kind, msg, elapsed = seen[0]
    assert kind == "StrictP2PError" and "timed out after 2.0 s" in msg, seen[0]
    assert 1.5 <= elapsed <= 10.0, seen[0]  # the group's 2 s, not a fixed wait of its own


def test_a_batch_on_a_group_no_collective_set_up_is_refused():
    fresh = dist.new_group([0, 1, 2, 3], backend="gloo")
    me = dist.get_rank()
    buf = torch.zeros(2)
    op = dist.P2POp(dist.isend if me % 2 == 0 else dist.irecv, buf, me ^ 1, group=fresh)
    got = outcome(lambda: dist.batch_isend_irecv([op]))
    assert got[0] == "StrictP2PError", got
    assert "before any collective on it: NCCL creates the group's communicator" in got[1]
    dist.barrier(group=fresh)  # set up: the same batch now runs, exact
    buf = torch.full((2,), float(me))
    op = dist.P2POp(dist.isend if me % 2 == 0 else dist.irecv, buf, me ^ 1, group=fresh)
    for w in dist.batch_isend_irecv([op]):
        w.wait(datetime.timedelta(seconds=10))
    if me % 2:
        assert torch.equal(buf, torch.full((2,), float(me ^ 1)))
