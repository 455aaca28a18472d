"""A module that cannot be imported outside torchrun: run whole, as one item."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.launch.torchrun_fixtures._common import in_ranks, world

TORCHRUN_NPROC = 2
TORCHRUN_TIMEOUT = 120

if not in_ranks():
    raise RuntimeError("this module needs a process group at import")
world()


def test_sum():
    t = torch.ones(1)
    dist.all_reduce(t)
    assert int(t) == 2
