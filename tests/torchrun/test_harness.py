"""The torchrun harness itself: ranks see one complete gloo world, and parametrized tests reach
the ranks as separate tests (each reported as its own item under plain ``pytest``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

TORCHRUN_NPROC = 2
TORCHRUN_TIMEOUT = 120


def test_world_is_gloo_and_complete():
    assert dist.get_world_size() == TORCHRUN_NPROC
    assert dist.get_backend() == "gloo"
    t = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(t)
    assert int(t) == TORCHRUN_NPROC * (TORCHRUN_NPROC + 1) // 2


@pytest.mark.parametrize(
    ("op", "expected"),
    [
        (dist.ReduceOp.SUM, TORCHRUN_NPROC * (TORCHRUN_NPROC - 1) // 2),
        (dist.ReduceOp.MAX, TORCHRUN_NPROC - 1),
    ],
    ids=["sum", "max"],
)
def test_each_parameter_runs_on_every_rank(op: dist.ReduceOp, expected: int):
    t = torch.tensor([dist.get_rank()])
    dist.all_reduce(t, op=op)
    assert int(t) == expected
