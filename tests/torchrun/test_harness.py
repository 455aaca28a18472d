"""The torchrun harness itself: ranks see one world and agree on outcomes."""

from __future__ import annotations

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
