"""Rank 1 hangs in the second test: the launch is killed at its timeout."""

from __future__ import annotations

import time

import torch.distributed as dist

from tests.launch.torchrun_fixtures._common import world

TORCHRUN_NPROC = 2
TORCHRUN_TIMEOUT = 20

world()


def test_first():
    dist.barrier()


def test_hang():
    if dist.get_rank() == 1:
        time.sleep(600)


def test_after():
    dist.barrier()
