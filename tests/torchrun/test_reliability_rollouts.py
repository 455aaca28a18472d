"""Tier 2 (4 ranks, gloo): the on-policy surface (``Distiller.step(rollouts, ...)``) is as reliable
as the rest.

The job is the reliability job (``tests/support/distill_job.py``: real GPTModels, a Distiller
around megatron-core's own schedule, forward only, so a step's loss depends only on its rows and
is compared bit for bit), fed :class:`~mopd.mcore.Rollouts`:

- sample ids anywhere in their documented range (every non-negative int64, ``0 <= id <
  2**63``) give exactly the loss of the same samples under ids ``0..7``.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.distill_job import N_ROLLOUTS, Job
from tests.support.megatron_cpu import megatron_world
from tests.support.reliability import everyone

TORCHRUN_NPROC = 4
TORCHRUN_TIMEOUT = 500
TORCHRUN_STRICT_P2P = 1  # NCCL's point-to-point rules (tests/support/strict_p2p.py)

T_S = 4.0  # the bridge's and the groups' timeout

world = pytest.fixture(scope="module")(megatron_world)


@pytest.fixture(scope="module")
def job(world: Any) -> Any:
    """One job shared by the cases that leave it usable (student ``tp2 pp2``: its rows cross a
    pipeline)."""
    j = Job(timeout_s=T_S, student_pp=2)
    yield j
    j.close()


#: sample ids at the edges of the documented range, and spread over it
EDGE_IDS = {
    "top": [2**63 - N_ROLLOUTS + j for j in range(N_ROLLOUTS)],
    "spread": [j * 2**59 + 1 for j in range(N_ROLLOUTS)],
    "mixed": [2**63 - 1, 0, 2**62, 5, 2**63 - 2, 2**32, 1, 2**61 + 3],
}


def test_sample_ids_anywhere_in_their_range_give_exactly_the_loss_of_small_ids(job: Any) -> None:
    """The same samples (tokens, teachers, advantages) under ids ``0..7`` and under ids at the
    top of int64, spread over it in steps of ``2**59``, or mixed: the same loss, bit for bit,
    on every rank of the student's last stage (the ids only name the samples)."""
    small = job.run_rollouts(job.rollouts(3, ids=list(range(N_ROLLOUTS))))
    got = {name: job.run_rollouts(job.rollouts(3, ids=ids)) for name, ids in EDGE_IDS.items()}
    seen = everyone({"small": small, **got})
    for r, s in enumerate(seen):
        if job.smesh.is_last_stage(r):
            assert s["small"] is not None and s["small"] > 0, s
            assert all(s[name] == s["small"] for name in EDGE_IDS), (r, s)
    print("losses (rank 2):", seen[2])
