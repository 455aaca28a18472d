"""Rank 1 dies in the second test: torchrun stops the launch."""

from __future__ import annotations

import os

import torch.distributed as dist

from tests.launch.torchrun_fixtures._common import world

TORCHRUN_NPROC = 2
TORCHRUN_TIMEOUT = 120

world()


def test_first():
    dist.barrier()


def test_crash():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def test_after():
    dist.barrier()
