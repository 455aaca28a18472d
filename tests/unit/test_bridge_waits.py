"""Tier 1: how the executor waits (host wait on gloo, stream wait on NCCL, one deadline per call),
how it decides CUDA vs CPU from a group, and its warning about exchanges nobody waits on.

Fake work objects stand in for ``torch.distributed`` works: they record how they were waited on,
which is the point (an NCCL ``Work.wait(timeout)`` spins the host; ``Work.wait()`` does not).
"""

from __future__ import annotations

import datetime
import time
import warnings
from typing import Any

import pytest
import torch

from mopd.bridge import groups as groups_mod
from mopd.bridge.executor import Executor, _Flight
from mopd.bridge.groups import group_moves_cuda, wait_work
from mopd.bridge.mesh import Mesh
from mopd.bridge.planner import StudentBatch, TeacherBatch, plan_token_exchange
from mopd.profiling.synthetic import SideFormat, key_pattern, synthetic_step

TIMEOUT = datetime.timedelta(seconds=30)


class FakeWork:
    """Records each ``wait`` call's arguments; optionally sleeps in it."""

    def __init__(self, sleep_s: float = 0.0) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.sleep_s = sleep_s

    def wait(self, *args: Any) -> bool:
        self.calls.append(args)
        time.sleep(self.sleep_s)
        return True

    def is_completed(self) -> bool:
        return True


def test_wait_work_never_passes_a_timeout_for_cuda_tensors():
    w = FakeWork()
    wait_work(w, device=torch.device("cuda", 0), timeout=TIMEOUT)
    assert w.calls == [()]
    w = FakeWork()
    wait_work(w, device=torch.device("cpu"), timeout=TIMEOUT)
    assert w.calls == [(TIMEOUT,)]


def _flight(work: FakeWork, device: torch.device, finished: list[float]) -> _Flight:
    return _Flight(
        works=[work],
        descs=["fake"],
        finish=finished.append,
        device=device,
        staged=[],
        outputs=[],
    )


def test_executor_waits_on_cuda_transfers_without_a_host_timeout():
    ex = Executor(rank=0, timeout=TIMEOUT)
    works = [FakeWork(), FakeWork()]
    finished: list[float] = []
    flights = [_flight(w, torch.device("cuda", 0), finished) for w in works]
    ex._flights.extend(flights)
    ex._complete_through(flights[1])
    assert [w.calls for w in works] == [[()], [()]]
    assert len(finished) == 2 and all(f.done for f in flights)


def test_one_deadline_covers_every_flight_a_wait_completes():
    """Two flights each taking 0.3 s under a 1 s timeout: the second gets what is left (~0.7 s)."""
    ex = Executor(rank=0, timeout=datetime.timedelta(seconds=1.0))
    works = [FakeWork(sleep_s=0.3), FakeWork(sleep_s=0.3)]
    finished: list[float] = []
    flights = [_flight(w, torch.device("cpu"), finished) for w in works]
    ex._flights.extend(flights)
    t0 = time.monotonic()
    ex._complete_through(flights[1])
    (first,), (second,) = works[0].calls[0], works[1].calls[0]
    assert first.total_seconds() <= 1.0
    assert second.total_seconds() <= 0.75, second  # not a fresh full timeout
    # both flights finish (TP all-gather, verdict) against the same deadline, set at the call
    assert finished[0] == finished[1]
    assert t0 + 1.0 <= finished[0] <= t0 + 1.0 + 0.2


def test_group_backend_is_read_from_the_backend_config(monkeypatch):
    """``get_backend`` may say 'undefined' for a default group made without a backend."""
    monkeypatch.setattr(groups_mod.dist, "get_backend", lambda group=None: "undefined")
    monkeypatch.setattr(
        groups_mod.dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl"
    )
    assert group_moves_cuda(object())
    monkeypatch.setattr(groups_mod.dist, "get_backend_config", lambda group=None: "cpu:gloo")
    assert not group_moves_cuda(object())
    monkeypatch.setattr(groups_mod.dist, "get_backend_config", lambda group=None: "NCCL")
    assert group_moves_cuda(object())


def _local_plan(seed: int):
    mesh = Mesh()
    step = synthetic_step(
        teachers=[mesh],
        student=mesh,
        num_samples=3,
        max_len=5,
        student_format=SideFormat(kind="sbh", micro_batch=2),
        seed=seed,
    )
    t_lay, s_lay = step.teacher_layouts[0][(0, 0)], step.student_layouts[(0, 0)]
    plan = plan_token_exchange(
        [TeacherBatch(mesh=mesh, layouts={(0, 0): t_lay}, hidden_size=4, itemsize=4)],
        StudentBatch(mesh=mesh, layouts={(0, 0): s_lay}),
    )
    return plan, t_lay, s_lay


def test_warns_once_when_more_exchanges_are_in_flight_than_cached_plans():
    plan, t_lay, s_lay = _local_plan(1)
    src = key_pattern(t_lay, 4, torch.float32)
    ex = Executor(rank=0, timeout=TIMEOUT, max_schedules=2)
    outs = [torch.empty((s_lay.num_rows, 4)) for _ in range(5)]
    handles = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for out in outs[:2]:
            handles.append(ex.start(plan, sources={0: src}, outputs={0: out}, group=None))
    with pytest.warns(UserWarning, match=r"3 bridge exchanges are in flight.*call \.wait\(\)"):
        handles.append(ex.start(plan, sources={0: src}, outputs={0: outs[2]}, group=None))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        handles.append(ex.start(plan, sources={0: src}, outputs={0: outs[3]}, group=None))
    handles[-1].wait()  # completes every earlier flight too
    assert all(h.done for h in handles) and ex.memory_stats()["in_flight"] == 0
