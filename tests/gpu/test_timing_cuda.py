"""Tier 3 (GPU): the benchmarks' timing loop measures device time with CUDA events."""

from __future__ import annotations

import pytest
import torch

from mopd.profiling.timing import time_calls

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (tier 3)"),
]

DEVICE = torch.device("cuda", 0)
CYCLES = 50_000_000  # tens of ms of GPU time, far above launch costs


@pytest.mark.parametrize("back_to_back", [False, True])
def test_device_time_of_a_known_kernel(back_to_back: bool) -> None:
    ms = time_calls(
        lambda i: torch.cuda._sleep(CYCLES),
        device=DEVICE,
        iters=4,
        warmup=1,
        back_to_back=back_to_back,
    )
    assert len(ms) == 4 and min(ms) > 1.0, ms
    # every call runs the same kernel: the figures agree within 20%
    assert max(ms) < 1.2 * min(ms), ms
