"""Process-group set-up for the torchrun tier (gloo on CPU), with timeouts everywhere.

Why this file exists: every tier-2 module needs the same world: a gloo default group created
once per process with a bounded timeout, so a test that desynchronizes fails instead of hanging.
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

__all__ = ["COLLECTIVE_TIMEOUT", "ensure_world", "rank", "world_size"]

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("MOPD_TEST_TIMEOUT_S", "120")))


def ensure_world() -> None:
    """Initialize the default gloo group from torchrun's env:// once per process."""
    if not dist.is_initialized():
        dist.init_process_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)


def rank() -> int:
    return dist.get_rank()


def world_size() -> int:
    return dist.get_world_size()
