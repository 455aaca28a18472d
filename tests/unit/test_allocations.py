"""Tier 1: counting allocator calls on a CPU (what the capture's zero-allocation claim rests on)."""

from __future__ import annotations

import pytest
import torch

from mopd.profiling.bench.allocations import count_allocations

CPU = torch.device("cpu")


def test_counts_each_allocation_and_its_bytes():
    x, out = torch.randn(64, 4), torch.empty(64, 4)
    assert count_allocations(lambda: out.copy_(x), device=CPU).count == 0
    one = count_allocations(lambda: torch.empty(64, 4), device=CPU)
    assert (one.count, one.nbytes, one.own_count) == (1, 64 * 4 * 4, 1)
    three = count_allocations(lambda: [torch.empty(8) for _ in range(3)], device=CPU)
    assert (three.count, three.nbytes) == (3, 3 * 8 * 4)
    cat = count_allocations(lambda: torch.cat([x, x]), device=CPU)
    assert (cat.count, cat.nbytes) == (1, 2 * x.numel() * 4)


def test_allocations_inside_a_collective_are_told_apart(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        parts, x = [torch.empty(16)], torch.randn(16)
        got = count_allocations(lambda: dist.all_gather(parts, x), device=CPU)
        assert got.collective_count == got.count > 0 and got.own_count == 0
        mixed = count_allocations(lambda: (torch.empty(4), dist.all_gather(parts, x)), device=CPU)
        assert mixed.own_count == 1 and mixed.own_nbytes == 16
    finally:
        dist.destroy_process_group()


def test_other_devices_are_refused():
    with pytest.raises(ValueError, match="cpu or cuda"):
        count_allocations(lambda: None, device=torch.device("meta"))
