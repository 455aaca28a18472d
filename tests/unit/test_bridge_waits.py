"""Tier 1: how the bridge waits (host wait on gloo, stream wait on NCCL, one deadline per call),
and how it decides CUDA vs CPU from a group.

Fake work objects stand in for ``torch.distributed`` works: they record how they were waited on,
which is the point (an NCCL ``Work.wait(timeout)`` spins the host; ``Work.wait()`` does not). The
step's own ``receive`` / ``finish`` run against a recording executor: every micro-batch they
complete (earlier ones first, in order) and every send they wait for shares the one deadline set
at the call, so a call never waits longer than ``BridgeConfig.timeout_s`` in all.
"""

from __future__ import annotations

import datetime
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from mopd.bridge.errors import BridgeStateError, BridgeTimeoutError
from mopd.bridge.executor import Executor, Slot
from mopd.bridge.lifecycle import Lifecycle
from mopd.bridge.order import StepOrder
from mopd.bridge.step import BridgeStep
from mopd.bridge.transport import Posted
from mopd.common import dist as cdist

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


class FakeWork:
    """Records each ``wait`` call's arguments; optionally sleeps in it or raises."""

    def __init__(self, sleep_s: float = 0.0, fail: str = "") -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.sleep_s = sleep_s
        self.fail = fail

    def wait(self, *args: Any) -> bool:
        self.calls.append(args)
        time.sleep(self.sleep_s)
        if self.fail:
            raise RuntimeError(self.fail)
        return True

    def is_completed(self) -> bool:
        return not self.fail and bool(self.calls)


def test_wait_never_passes_a_timeout_for_cuda_tensors():
    w = FakeWork()
    cdist.wait(w, device=CUDA, timeout_s=30.0)
    assert w.calls == [()]
    w = FakeWork()
    cdist.wait(w, device=CPU, timeout_s=30.0)
    assert w.calls == [(datetime.timedelta(seconds=30),)]
    w = FakeWork()
    cdist.wait(w, device=CPU, timeout_s=None)
    assert w.calls == [()]
    cdist.wait(None, device=CPU, timeout_s=1.0)  # nothing to wait for


def _issued_slot(works: list[FakeWork], device: torch.device) -> Slot:
    """A slot whose sends are in flight (a schedule object is all ``release`` looks at)."""
    return Slot(
        index=0,
        schedule=SimpleNamespace(),  # type: ignore[arg-type]
        issued=True,
        posted=Posted(
            device=device,
            send_works=list(works),
            send_descs=[f"send {i}" for i in range(len(works))],
        ),
        device=device,
    )


def test_release_waits_on_cuda_sends_without_a_host_timeout():
    ex = Executor(rank=0, timeout_s=30.0)
    works = [FakeWork(), FakeWork()]
    slot = _issued_slot(works, CUDA)
    ex.release(slot, deadline=time.monotonic() + 30.0)
    assert [w.calls for w in works] == [[()], [()]]
    assert slot.released
    ex.release(slot, deadline=time.monotonic() + 30.0)  # idempotent: no second wait
    assert [len(w.calls) for w in works] == [1, 1]


def test_release_on_gloo_waits_on_the_host_with_what_is_left_of_the_deadline():
    """Two sends each taking 0.3 s under a 1 s deadline: the second gets what is left (~0.7 s),
    not a fresh full timeout."""
    ex = Executor(rank=0, timeout_s=1.0)
    works = [FakeWork(sleep_s=0.3), FakeWork(sleep_s=0.3)]
    ex.release(_issued_slot(works, CPU), deadline=time.monotonic() + 1.0)
    (first,), (second,) = works[0].calls[0], works[1].calls[0]
    assert 0.9 <= first.total_seconds() <= 1.0
    assert second.total_seconds() <= 0.75, second


def test_a_failed_wait_names_what_was_pending_and_retires_the_executor():
    ex = Executor(rank=3, timeout_s=1.0)
    works = [FakeWork(), FakeWork(fail="Operation timed out!"), FakeWork()]
    slot = _issued_slot(works, CPU)
    assert slot.posted is not None
    slot.posted.send_descs = [
        "send to global rank 1",
        "send to global rank 2",
        "send to global rank 5",
    ]
    with pytest.raises(BridgeTimeoutError, match="global rank 3") as info:
        ex.release(slot, deadline=time.monotonic() + 1.0)
    msg = str(info.value)
    assert "send to global rank 2" in msg and "send to global rank 5" in msg
    assert "send to global rank 1" not in msg  # completed before the failure
    assert "timeout_s=1" in msg and "Operation timed out!" in msg
    with pytest.raises(BridgeStateError, match="cannot be used after a failed exchange"):
        ex.lifecycle.check_usable()


def test_sends_done_polls_without_waiting():
    ex = Executor(rank=0, timeout_s=1.0)
    w = FakeWork()
    slot = _issued_slot([w], CPU)
    assert not ex.sends_done(slot)  # not completed yet
    assert w.calls == []  # a poll, not a wait
    w.calls.append(())
    assert ex.sends_done(slot)


class RecordingExecutor:
    """Stands in for the step's executor: records what it is asked to complete and release."""

    def __init__(self, sleep_s: float) -> None:
        self.lifecycle = Lifecycle(0)
        self.sleep_s = sleep_s
        self.completed: list[tuple[int, float]] = []
        self.released: list[tuple[int, float]] = []

    def at(self, step: int, phase: str, micro_batch: int | None = None) -> None:
        pass

    def check_usable(self) -> None:
        pass

    def complete(self, slot: Slot, *, tp_group: Any, deadline: float) -> None:
        time.sleep(self.sleep_s)
        slot.received = True
        self.completed.append((slot.index, deadline))

    def sends_done(self, slot: Slot) -> bool:
        return False

    def release(self, slot: Slot, *, deadline: float) -> None:
        slot.released = True
        self.released.append((slot.index, deadline))


def _step(n: int, timeout_s: float, sleep_s: float) -> tuple[BridgeStep, RecordingExecutor]:
    """A planned step of ``n`` micro-batches, all issued, none received (nothing to send)."""
    ex = RecordingExecutor(sleep_s)
    step = BridgeStep.__new__(BridgeStep)
    step._bridge = SimpleNamespace(  # type: ignore[assignment]
        config=SimpleNamespace(timeout_s=timeout_s, integrity=False),
        executor=ex,
        lifecycle=ex.lifecycle,
        faults=ex,
        groups=SimpleNamespace(student_tp=None),
    )
    step.num_micro_batches = n
    step.seq = 0
    step.finished = False
    step._slots = [Slot(index=i, schedule=None, issued=True) for i in range(n)]
    step._order = StepOrder(
        step._slots,
        executor=ex,
        rank=0,
        output_specs={},
        device=CPU,
        group=None,
        tag=1,
        tp_group=None,
    )
    step._order.posted = n
    return step, ex


def test_receive_completes_earlier_micro_batches_first_against_one_deadline():
    step, ex = _step(4, timeout_s=10.0, sleep_s=0.05)
    t0 = time.monotonic()
    assert step.receive(2) == {}  # schedule None: a rank that receives nothing
    assert [i for i, _ in ex.completed] == [0, 1, 2]
    deadlines = {d for _, d in ex.completed}
    assert len(deadlines) == 1, "each earlier micro-batch got a fresh deadline"
    (deadline,) = deadlines
    assert t0 + 10.0 <= deadline <= t0 + 10.0 + 0.05  # set at the call, before any wait
    step.receive(0)  # already completed: nothing more to wait for
    step.receive(1)
    assert [i for i, _ in ex.completed] == [0, 1, 2]
    step.receive(3)
    assert [i for i, _ in ex.completed] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"micro-batch 4 outside \[0, 4\)"):
        step.receive(4)


def test_finish_completes_and_releases_against_one_deadline():
    step, ex = _step(3, timeout_s=5.0, sleep_s=0.05)
    step.receive(0)
    t0 = time.monotonic()
    step.finish()
    assert [i for i, _ in ex.completed] == [0, 1, 2]
    assert [i for i, _ in ex.released] == [0, 1, 2]
    at_finish = {d for _, d in ex.completed[1:]} | {d for _, d in ex.released}
    assert len(at_finish) == 1
    assert t0 + 5.0 <= at_finish.pop() <= t0 + 5.0 + 0.05
    assert step.finished
    step.finish()  # idempotent
    assert len(ex.released) == 3
    with pytest.raises(BridgeStateError, match="this step is finished"):
        step.receive(0)


def test_group_backend_is_read_from_the_backend_config(monkeypatch):
    """``get_backend`` may say 'undefined' for a default group made without a backend."""
    monkeypatch.setattr(cdist.dist, "get_backend", lambda group=None: "undefined")
    monkeypatch.setattr(cdist.dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    assert cdist.moves_cuda(object())
    monkeypatch.setattr(cdist.dist, "get_backend_config", lambda group=None: "cpu:gloo")
    assert not cdist.moves_cuda(object())
    assert cdist.group_device(object()) == CPU
    monkeypatch.setattr(cdist.dist, "get_backend_config", lambda group=None: "NCCL")
    assert cdist.moves_cuda(object())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cdist.group_device(object()) == CPU  # NCCL without a device here: CPU tensors
    assert cdist.group_device(None) == CPU


@pytest.mark.parametrize("coalesced", [False, True], ids=["separate", "coalesced"])
def test_releasing_the_sends_keeps_the_receives_to_wait_for(coalesced: bool) -> None:
    """A slot's sends may be released (its staging returned) before its receives complete, the
    step does that as soon as they are done; the receives must still be waited for. A slot with
    no sends counts as done at once, so this happens on every receive-only rank."""
    ex = Executor(rank=0, timeout_s=5.0)
    recv = FakeWork()
    slot = _issued_slot([] if not coalesced else [recv], CPU)
    posted = slot.posted
    assert posted is not None
    posted.recv_works = posted.send_works if coalesced else [recv]
    posted.recv_descs = ["receive"]
    assert ex.sends_done(slot) or coalesced
    ex.release(slot, deadline=time.monotonic() + 5.0)
    assert posted.recv_works == [recv]  # still there to wait for
    ex.transport.wait(posted, sends=False, deadline=time.monotonic() + 5.0)
    assert recv.calls, "the receive was never waited for"
