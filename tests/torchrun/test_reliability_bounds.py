"""Tier 2 (4 ranks, gloo): every wait under a ``Distiller`` on a ``GroupPool()`` is bounded by the
Distiller's ``timeout_s``, the model groups made before it included, in the README's topology.

The job is the README's (``tests/support/distill_job.py`` with ``readme=True``: teachers
``tp2 pp2`` and ``tp2 dp2``, student ``tp2 pp2``, a rollouts step around megatron-core's own
schedule) on a pool made without a timeout. Student rank 3 sleeps ``4 T`` before its first
forward: every other rank's first error is a named bridge error leading with rank 3 (alive,
busy outside any collective) within ``2 T + 4`` s, well before rank 3 wakes, so no wait
outlasts the Distiller's timeout: megatron's TP all-reduce, the bridge's waits, and megatron's
pipeline sends and receives on the pipeline groups made before the Distiller (gloo keeps a
group's point-to-point timeout from its creation, ``GroupPool()``'s 300 s: the CPU patches
bound those waits by the group's current timeout).

Strict point-to-point mode is off here: it bounds every wait by its group's current timeout
itself (NCCL's behaviour, where the Distiller's bound holds anyway), which would hide gloo's.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.support.distill_job import Job, sleep_at
from tests.support.megatron_cpu import megatron_world
from tests.support.reliability import everyone, outcome, own_view

TORCHRUN_NPROC = 4
TORCHRUN_TIMEOUT = 300

T_S = 3.0  # the Distiller's timeout (the pool has none)
NAMED = ("BridgeTimeoutError", "BridgeCommError", "BridgeStateError")

world = pytest.fixture(scope="module")(megatron_world)


def test_a_group_pool_without_a_timeout_bounds_every_wait_in_the_readme_topology(world: Any):
    job = Job(timeout_s=T_S, pool_timeout=False, readme=True)
    assert job.pool.timeout_s == T_S  # GroupPool() bounded by the Distiller's timeout
    t0 = time.monotonic()
    first = outcome(lambda: job.run_rollouts(job.rollouts(1), before=sleep_at(3, 0, 4 * T_S)))
    mine = {"first": first[:3], "own": own_view(first), "rank": job.rank}
    mine["elapsed"] = time.monotonic() - t0
    seen = everyone(mine)
    print("first errors:", [(s["first"][0], round(s["elapsed"], 1)) for s in seen])
    for s in seen:
        kind, msg, _ = s["first"]
        assert kind in NAMED, s
        assert msg.startswith("global rank 3 failed first (step 0, "), s
        assert "busy outside any collective, in before (" in msg, s
        if s["rank"] != 3:
            assert s["elapsed"] <= 2 * T_S + 4.0, s  # rank 3 sleeps 4 T: nobody waited for it
    job.close()
