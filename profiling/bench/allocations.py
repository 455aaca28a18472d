"""Counting the allocator calls a piece of code makes, on a CPU or a CUDA device.

Why this file exists: the capture's promise on its zero-allocation path ("no allocation per step
after the first at a steady shape; none at all with ``out=``") is a count, not a time, and it
must be measurable on the CPU machines the tests run on. On CUDA the caching allocator counts its
own allocations (``torch.cuda.memory_stats``). On a CPU nothing counts them, but the profiler with
``profile_memory=True`` records one allocation event per call into torch's CPU allocator, under
the op that made it; this reads those events and tells the caller's own allocations from those a
collective's backend makes for itself (gloo's CPU all-gather stages through temporaries, which no
caller can avoid; NCCL writes in place).
Allocations made outside torch's allocator (gloo's own scratch, Python objects) are not seen.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["Allocations", "count_allocations"]


#: Name prefixes of the profiler events of torch.distributed collectives (the c10d op and the
#: backend's work); allocations under them are the backend's staging, not the caller's.
_COLLECTIVE_PREFIXES = ("c10d::", "gloo:", "nccl:")


@dataclass(frozen=True, kw_only=True)
class Allocations:
    """What one call allocated: ``count`` allocator calls of ``nbytes`` bytes in all, of which
    ``collective_count`` / ``collective_nbytes`` inside torch.distributed collectives (a backend's
    own staging: gloo's CPU all-gather flattens through temporaries; counted on CPU only)."""

    count: int
    nbytes: int
    collective_count: int = 0
    collective_nbytes: int = 0

    @property
    def own_count(self) -> int:
        """Allocations outside collectives: what the measured code itself asked for."""
        return self.count - self.collective_count

    @property
    def own_nbytes(self) -> int:
        return self.nbytes - self.collective_nbytes


def _cpu_allocations(fn: Callable[[], object]) -> Allocations:
    # The profiler's event tree is the record of CPU allocator calls, each under the op that made
    # it; its types live in torch._C._profiler (there since torch 2.0).
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    if results is None:
        raise RuntimeError("the profiler recorded no results: cannot count allocations")
    count = nbytes = coll_count = coll_nbytes = 0
    stack = [(event, False) for event in results.experimental_event_tree()]
    while stack:
        event, in_collective = stack.pop()
        in_collective = in_collective or event.name.startswith(_COLLECTIVE_PREFIXES)
        stack.extend((child, in_collective) for child in event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.alloc_size > 0:
            size = int(event.extra_fields.alloc_size)
            count, nbytes = count + 1, nbytes + size
            if in_collective:
                coll_count, coll_nbytes = coll_count + 1, coll_nbytes + size
    return Allocations(
        count=count, nbytes=nbytes, collective_count=coll_count, collective_nbytes=coll_nbytes
    )


def count_allocations(fn: Callable[[], object], *, device: torch.device) -> Allocations:
    """Allocator calls made while ``fn()`` runs, on ``device``'s allocator.

    CUDA: the caching allocator's ``allocation.all.allocated`` and ``allocated_bytes.all.allocated``
    deltas (the work is synchronized first; no split by collective). CPU: allocation events of
    the profiler, split into those inside torch.distributed collectives and the rest (frees and
    allocations outside torch's allocator are not counted).
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        after = torch.cuda.memory_stats(device)
        key_n, key_b = "allocation.all.allocated", "allocated_bytes.all.allocated"
        return Allocations(count=after[key_n] - before[key_n], nbytes=after[key_b] - before[key_b])
    if device.type != "cpu":
        raise ValueError(f"count_allocations counts on cpu or cuda devices, got {device}")
    return _cpu_allocations(fn)
