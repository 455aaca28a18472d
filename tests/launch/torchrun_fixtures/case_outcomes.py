"""One launch, every outcome: pass, a failure on rank 1 only, a skip, an xfail, parameters."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.launch.torchrun_fixtures._common import world

TORCHRUN_NPROC = 2
TORCHRUN_TIMEOUT = 120

world()


def test_ok():
    t = torch.ones(1)
    dist.all_reduce(t)
    assert int(t) == 2


def test_rank1_fails():
    print(f"output of rank {dist.get_rank()}")
    assert dist.get_rank() == 0, "rank 1 disagrees"


def test_skip():
    pytest.skip("skipped for a stated reason")


@pytest.mark.xfail(reason="known to fail", strict=True)
def test_xfail():
    assert dist.get_world_size() == 3


@pytest.mark.parametrize("n", [1, 2])
def test_param(n: int):
    t = torch.full((1,), n)
    dist.all_reduce(t)  # the failure above left no rank behind
    assert int(t) == 2 * n
