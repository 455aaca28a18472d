"""mopd.common.ranges on a CUDA device: the torch.cuda.nvtx fallback works (the GPU image has
no ``nvtx`` package), and torch.profiler sees the ranges around real CUDA work."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from mopd.common import ranges

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (tier 3)"),
]


@pytest.fixture(autouse=True)
def _restore() -> Iterator[None]:
    enabled, backend = ranges.is_enabled(), ranges._backend
    yield
    ranges.enable(enabled)
    ranges._backend = backend


def test_torch_cuda_nvtx_fallback_balances(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nvtx", None)  # as on an image without the nvtx package
    monkeypatch.setattr(ranges, "_backend", None)
    assert ranges.nvtx_backend() == "torch.cuda.nvtx"
    ranges.enable(True)
    x = torch.randn(1024, 1024, device="cuda")
    with ranges.span("step", 0):
        for chunk in range(3):
            with ranges.span("loss_chunk", chunk):
                x = x @ x.T / 1024
    torch.cuda.synchronize()
    assert torch.isfinite(x).all()
    # Off again: the shared null context, nothing pushed.
    ranges.enable(False)
    assert ranges.span("pack") is ranges.span("unpack")


def test_profiler_sees_ranges_around_cuda_work() -> None:
    ranges.enable(True)
    a = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with ranges.span("projection"):
            b = a @ a
        with ranges.span("pack", 1):
            c = b.index_select(0, torch.arange(0, 2048, 2, device="cuda"))
        torch.cuda.synchronize()
    assert c.shape == (1024, 2048)
    events = {e.name: e for e in prof.events() if e.name.startswith(ranges.PREFIX)}
    assert set(events) == {"mopd/projection", "mopd/pack:1"}
    launches = [e for e in prof.events() if "LaunchKernel" in e.name]
    proj = events["mopd/projection"].time_range
    assert any(proj.start <= e.time_range.start and e.time_range.end <= proj.end for e in launches)
