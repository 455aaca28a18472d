"""Tier 3 (GPU): a one-rank NCCL world shared by every GPU test module in the session.

NCCL cannot put two ranks on one GPU, so a one-GPU machine exercises NCCL at world size 1
(send/recv to self works). Tests take the ``nccl_world`` fixture; it is created once, lazily.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="session")
def nccl_world():
    """The default process group: NCCL, rank 0 of 1, on ``cuda:0``, 60 s timeout."""
    if not torch.cuda.is_available():
        pytest.skip("tier 3 needs a CUDA device; none here")
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group(
            "nccl",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=60),
            device_id=torch.device("cuda", 0),
        )
    yield dist.group.WORLD
