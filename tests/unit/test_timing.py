"""Tier 1: the benchmarks' timing loop (host clock on CPU)."""

from __future__ import annotations

import time

import pytest
import torch

from mopd.profiling.timing import time_calls

CPU = torch.device("cpu")


def test_calls_are_indexed_warmed_up_and_prepared_outside_the_timing() -> None:
    calls: list[tuple[str, int]] = []

    def before() -> None:
        calls.append(("before", -1))
        time.sleep(0.05)  # outside the timed region: must not show in the figures

    def fn(i: int) -> None:
        calls.append(("call", i))
        time.sleep(0.01)

    ms = time_calls(fn, device=CPU, iters=3, warmup=2, before=before)
    assert calls == [x for i in range(5) for x in (("before", -1), ("call", i))]
    assert len(ms) == 3
    assert all(9.0 <= t < 45.0 for t in ms), ms


def test_bad_counts_raise() -> None:
    with pytest.raises(ValueError, match="iters=0, warmup=0"):
        time_calls(lambda i: None, device=CPU, iters=0)
    with pytest.raises(ValueError, match="iters=1, warmup=-1"):
        time_calls(lambda i: None, device=CPU, iters=1, warmup=-1)
