"""A job for tests/launch/test_launch_timeout.py: every rank but the last records a phase (rank r:
``step r of 3``), then all sleep until the launcher kills them."""

from __future__ import annotations

import os
import time

from mopd.profiling import phases

if __name__ == "__main__":
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank < world - 1:
        phases.enter(f"step {rank} of 3")
    time.sleep(600)
