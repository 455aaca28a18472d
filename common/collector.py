"""Pausing the garbage collector around a short stretch of code, and restoring it after.

Why this file exists: a collection runs finalizers wherever it starts. Some stretches must not
run them: one that holds a lock a finalizer takes again (reading the threads' frames), and one
that counts the calls of a step (a finalizer's calls are not the step's). Both pause the
collector the same way, here.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["paused_collector"]


@contextlib.contextmanager
def paused_collector() -> Iterator[None]:
    """No automatic collection inside the block; the collector is enabled again after it only
    where it was enabled before (a caller that keeps it off keeps it off)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
