"""Which tests the ranks ran, and in how many launches (one import per rank per launch)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.launch.torchrun_fixtures._common import record, world

TORCHRUN_NPROC = 2
TORCHRUN_TIMEOUT = 120

world()
record("import")


def test_alpha(request: pytest.FixtureRequest):
    record(request.node.name)


@pytest.mark.parametrize("n", [1, 2])
def test_beta(request: pytest.FixtureRequest, n: int):
    t = torch.full((1,), n)
    dist.all_reduce(t)
    record(request.node.name)


class TestGamma:
    def test_in_class(self, request: pytest.FixtureRequest):
        dist.barrier()
        record(request.node.name)
