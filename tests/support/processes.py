"""Running one of the package's modules as a user's command does, from a test.

Why this file exists: the launch tests start the benchmarks and tools as ``python -m MODULE``
in a child process, from the checkout's root, one thread per rank, outside any torchrun job
the test itself may run under (a ``RANK`` in the environment would make the child think it
is a rank). One helper holds that recipe.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["ROOT", "run_module"]

ROOT = Path(__file__).resolve().parents[2]


def run_module(module: str, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """``python -m module args...`` from the checkout's root, ``OMP_NUM_THREADS=1``, without
    torchrun's ``RANK`` / ``WORLD_SIZE``; its output captured as text."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
        env=env,
    )
