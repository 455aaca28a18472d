"""One timing loop for the benchmarks: milliseconds per call, CUDA events on a GPU.

Why this file exists: every benchmark times calls the same way (warm-up calls, then one figure per
call: host wall time on the CPU, a pair of CUDA events around the call on a GPU), and the ways of
getting that subtly wrong (timing the host's launch instead of the device, a sync inside the timed
region, the warm-up left out) are best solved once. Benchmarks take the median of what
:func:`time_calls` returns. Multi-rank timings with barriers (``bench_bridge``) keep their own
loop: there the figure is the slowest rank's wall time, not one device's.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

__all__ = ["time_calls"]


def time_calls(
    fn: Callable[[int], object],
    *,
    device: torch.device,
    iters: int,
    warmup: int = 0,
    before: Callable[[], object] | None = None,
    back_to_back: bool = False,
) -> list[float]:
    """Milliseconds of each of ``iters`` calls ``fn(i)`` (``i`` counts from 0), after ``warmup``.

    Args:
        fn: the call to time; gets the call's index (warm-up calls too), e.g. to alternate
            buffers so that no call finds the previous one's data in L2.
        device: a CUDA device: each call is timed by CUDA events on the current stream (device
            time); otherwise by the host clock.
        iters: timed calls (>= 1).
        warmup: calls before timing (not timed; on CUDA, synchronized before timing starts).
        before: run before every call (warm-up and timed), outside the timed region (e.g.
            clearing gradients).
        back_to_back: CUDA only: queue every timed call without waiting for the previous one
            and synchronize once at the end (throughput of a stream of calls, no host gaps
            between them as long as the host launches faster than the device runs); otherwise
            each call is waited for before the next.
    Returns:
        ``[iters]`` milliseconds, in call order.
    Raises:
        ValueError: ``iters < 1`` or ``warmup < 0``.
    """
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    for i in range(warmup):
        if before is not None:
            before()
        fn(i)
    if device.type != "cuda":
        out = []
        for i in range(warmup, warmup + iters):
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn(i)
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    torch.cuda.synchronize(device)
    pairs = []
    for i in range(warmup, warmup + iters):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i)
        end.record()
        if not back_to_back:
            end.synchronize()
        pairs.append((start, end))
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in pairs]
