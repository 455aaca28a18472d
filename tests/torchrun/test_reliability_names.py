"""Tier 2 (4 ranks, gloo): a failure is named on every rank, and a rebuilt job leaves nothing behind.

The job is the README's (``tests/support/distill_job.py``): a :class:`mopd.mcore.Distiller`
around megatron-core's own schedule, teacher ``tp2`` on global ranks 0-1, student ``tp2 dp2``
on ranks 0-3, on a pool of its own. One rank fails; every rank reports the first error it
got, and the assertions run once all have reported:

- a user exception on one rank (in the teacher's forward, or in the student's forward inside
  megatron's schedule) -> that rank raises its own exception; every other rank's first error
  is a bridge error that leads with ``global rank r failed first (step 0, <where>): Injected:
  ...`` (published by the failing rank in the job's store, read by the others; their own
  timeouts, megatron's included, follow in short);
- NaN in one teacher rank's hidden states -> the student ranks that receive them raise
  ``BridgeNonFiniteError`` naming that rank as the sender; every other rank's first error
  leads with ``global rank 1 failed first (step 0, its rows of micro-batch 1): it sent
  non-finite (NaN/Inf) teacher rows ...``;
- a rank asleep past the timeout before its first student forward, on a ``GroupPool()``
  without a timeout (the Distiller bounds it by its own) -> every rank's first error names
  the sleeper, found by the census (alive, busy outside any collective, where), within the
  bridge timeout + 30 s;
- three recoveries in the same processes (a fault, then ``Distiller.close()``,
  ``GroupPool.close()``, a new job): process groups, threads (Python's and the kernel's) and
  file descriptors stay flat, and the rebuilt job's loss is bit for bit the fault-free one.

A rank killed outright is ``tests/launch/test_reliability_kill.py`` (it takes its launch down).
"""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.support.distill_job import Injected, Job, sleep_at
from tests.support.megatron_cpu import megatron_world
from tests.support.reliability import everyone, outcome, own_view

TORCHRUN_NPROC = 4
TORCHRUN_TIMEOUT = 420
TORCHRUN_STRICT_P2P = 1  # NCCL's point-to-point rules (tests/support/strict_p2p.py)

T_S = 4.0  # the bridge's timeout (and its groups')
SLACK_S = 8.0
NAMED = ("BridgeTimeoutError", "BridgeCommError", "BridgeStateError")

world = pytest.fixture(scope="module")(megatron_world)


def first_errors(job: Job) -> list[dict[str, Any]]:
    """Every rank's first error in a faulty step (seed 1), and what its next step does."""
    first = outcome(lambda: job.run(1))
    nxt = outcome(lambda: job.run(2))
    return everyone({"first": first[:3], "own": own_view(first), "next": nxt[:3], "rank": job.rank})


def assert_named(seen: list[dict[str, Any]], *, culprit: int, lead: str, own: str | None = None):
    """The culprit raised its own ``own`` error (when given); every other rank's first error is
    a bridge error leading with ``lead``; every rank's next step is refused or named."""
    for s in seen:
        kind, msg, _ = s["first"]
        if s["rank"] == culprit and own is not None:
            assert kind == own, s
        else:
            assert kind in NAMED, s
            assert msg.startswith(lead), s
            if kind != "BridgeStateError":
                assert f"As a result, global rank {s['rank']} (" in msg, s
        assert s["next"][0] in NAMED and s["next"][2] <= 2 * T_S + SLACK_S, s


@pytest.mark.parametrize("where", ["teacher", "student"])
def test_a_user_exception_on_one_rank_is_named_on_every_rank(world, where):
    """Rank 1 raises in its teacher forward (before the schedule), or rank 3 in its student
    forward of micro-batch 1 (inside megatron's schedule)."""
    job = Job(timeout_s=T_S)
    culprit = 1 if where == "teacher" else 3
    if where == "teacher" and job.rank == 1:

        def broken(module: Any, args: Any) -> None:
            raise Injected("rank 1: the teacher's forward fails")

        job.teacher.decoder.register_forward_pre_hook(broken)
    if where == "student" and job.rank == 3:
        calls = [0]

        def fails_at_1(module: Any, args: Any) -> None:
            calls[0] += 1
            if calls[0] == 2:
                raise Injected("rank 3: the student's forward fails")

        job.student.decoder.register_forward_pre_hook(fails_at_1)
    seen = first_errors(job)
    if where == "teacher":
        lead = (
            "global rank 1 failed first (step 0, the teachers' forward of micro-batch 0): "
            "Injected: rank 1: the teacher's forward fails"
        )
    else:
        lead = (
            "global rank 3 failed first (step 0, the student's forward of micro-batch 1): "
            "Injected: rank 3: the student's forward fails"
        )
    assert_named(seen, culprit=culprit, lead=lead, own="Injected")
    job.close()


def test_non_finite_rows_of_one_teacher_rank_are_named_on_every_rank(world):
    """Rank 1's teacher hidden states of micro-batch 1 turn NaN (rank 0, its TP replica, stays
    finite): the student ranks that receive rank 1's rows name it as their sender; every other
    rank's first error leads with it."""
    job = Job(timeout_s=T_S)
    calls = [0]
    if job.rank == 1:

        def poison(module: Any, args: Any, out: torch.Tensor) -> None:
            if calls[0] == 1:
                out.fill_(float("nan"))
            calls[0] += 1

        job.teacher.decoder.final_layernorm.register_forward_hook(poison)
    seen = first_errors(job)
    lead = (
        "global rank 1 failed first (step 0, its rows of micro-batch 1): it sent non-finite "
        "(NaN/Inf) teacher rows in micro-batch 1 of step 0 (found by global rank "
    )
    found = [s for s in seen if s["first"][0] == "BridgeNonFiniteError"]
    assert found, seen
    for s in found:  # each names rank 1 as where its first bad row came from
        msg = s["first"][1]
        assert msg.startswith(
            f"global rank {s['rank']}: non-finite (NaN/Inf) teacher rows arrived in micro-batch 1"
        ), s
        assert msg.endswith(
            (
                "sent by global rank 1)",
                "sent to it by global rank 1, via the student TP all-gather)",
                "the slice of global rank 1, its local copy, via the student TP all-gather)",
                "a local copy on global rank 1)",  # rank 1 is a student too
            )
        ), s
    assert_named([s for s in seen if s not in found], culprit=-1, lead=lead)
    job.close()


def test_a_rank_asleep_past_the_timeout_is_named_on_every_rank(world):
    """Rank 3 sleeps ``T_S + 4`` s before its first student forward, on a pool made without a
    timeout: its TP peer times out in megatron's own all-reduce and the teachers at
    ``finish()`` (their sends to it wait), each within the bridge timeout + 30 s; the census
    finds rank 3 alive and busy outside any collective, and every rank's first error (its own,
    once it wakes, too) leads with that."""
    job = Job(timeout_s=T_S, pool_timeout=False)
    assert job.pool.timeout_s == T_S  # GroupPool() bounded by the Distiller's timeout
    t0 = time.monotonic()
    first = outcome(lambda: job.run(1, before=sleep_at(3, 0, T_S + 4.0)))
    mine = {"first": first[:3], "own": own_view(first), "rank": job.rank}
    mine["elapsed"] = time.monotonic() - t0
    seen = everyone(mine)
    lead = "global rank 3 failed first (step 0, after planning): "
    for s in seen:
        kind, msg, _ = s["first"]
        assert kind in NAMED, s
        assert msg.startswith(lead) and "busy in before (tests/support/distill_job.py" in msg, s
        if s["rank"] != 3:
            assert s["elapsed"] <= T_S + 30.0, s
    job.close()


def counts() -> dict[str, int]:
    """This process's process groups, Python threads, kernel threads and file descriptors."""
    gc.collect()
    return {
        "groups": len(dist.distributed_c10d._world.pg_map),
        "threads": threading.active_count(),
        "tasks": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
    }


def test_three_recoveries_in_the_same_processes_leave_nothing_behind(world):
    """Each recovery: a step fails (rank 3 raises in its student forward), the job closes its
    Distiller and pool and drops its models, and a new one runs the step exact (its loss is
    bit for bit the fault-free job's). Groups, threads and descriptors are what they were
    before the first recovery, after every one."""
    ref = Job(timeout_s=T_S)
    want = ref.run(5)
    ref.close()
    del ref
    before = counts()
    after, losses = [], []
    for _ in range(3):
        failed = Job(timeout_s=T_S)
        outcome(lambda job=failed: job.run(1, before=_raise_on_3(job)))
        failed.close()
        del failed
        dist.barrier()  # every rank out of the failed step before new groups are made
        job = Job(timeout_s=T_S)
        losses.append(job.run(5))
        job.close()
        del job
        after.append(counts())
    seen = everyone({"before": before, "after": after, "losses": losses, "want": want})
    for s in seen:
        assert all(a == s["before"] for a in s["after"]), s
        assert all(x == s["want"] for x in s["losses"]), s  # None off the last stage
    print("before, after 3 recoveries (rank 0):", seen[0]["before"], seen[0]["after"])


def _raise_on_3(job: Job) -> Any:
    def before(i: int) -> None:
        if job.rank == 3 and i == 1:
            raise Injected("rank 3: the student's forward fails")

    return before
