"""Tier 2 (4 ranks, gloo): 1,000 exchanges with changing layouts: exact, memory flat, nothing leaks.

The soak of issue 7. One bridge on one process group runs ``ITERS`` exchanges; each picks one of
``LAYOUTS`` seeded steps (different samples, lengths, THD / ``[S, B, H]`` / ``[B, S, H]``,
micro-batching) in a fixed pseudo-random order, with ``max_cached_plans`` smaller than the number
of layouts so the plan cache both hits and evicts. Half the exchanges pass reused output buffers,
half let the bridge allocate. Meshes: teacher ``tp2`` on global ranks 0-1, student ``tp2 dp2`` on
0-3 (local copies on 0-1, the network into 2-3, the student TP all-gather on both).

Checked: every exchange bit-exact (outputs poisoned first); after a warm-up that sees every
layout, no staging allocation and no growth of staging bytes, RSS growth under
``RSS_BUDGET_MIB`` (and under ``RSS_TAIL_BUDGET_MIB`` over the last 400), Python heap growth (tracemalloc over a window) under ``HEAP_BUDGET_KIB``,
caches bounded, no handle alive or in flight, no process group created. Figures are printed on
every rank (``pytest -s`` or the harness log) and, with ``MOPD_SOAK_REPORT=path``, written to a
file by global rank 0.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import time
import tracemalloc
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from mopd.bridge import (
    BridgeConfig,
    GroupPool,
    HiddenStateBridge,
    Mesh,
    TeacherSpec,
    create_bridge_groups,
)
from mopd.profiling.synthetic import SideFormat, key_pattern, synthetic_step

TORCHRUN_NPROC = 4
TORCHRUN_TIMEOUT = 240

ITERS = 1000
WARMUP = 100
LAYOUTS = 6
MAX_PLANS = 4
H = 16
DTYPE = torch.bfloat16
RSS_BUDGET_MIB = 8.0
HEAP_BUDGET_KIB = 64.0
TRACE_FROM = 300  # tracemalloc on from here; it sees only allocations made after it starts,
HEAP_WINDOW = (400, 600)  # so heap growth is read between two later points (caches turned over)
RSS_MID = 600  # RSS from here to the end: after tracemalloc's own memory came and went
RSS_TAIL_BUDGET_MIB = 2.0
TEACHER = Mesh(tp=2)
STUDENT = Mesh(tp=2, dp=2)
FORMATS = ("thd", "sbh", "bsh")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def steps() -> list[dict[str, Any]]:
    """Per layout index: this rank's arguments and the expected output (or ``None``)."""
    rank = dist.get_rank()
    out = []
    for i in range(LAYOUTS):
        step = synthetic_step(
            teachers=[TEACHER],
            student=STUDENT,
            num_samples=3 + i % 3,
            max_len=5 + 2 * i,
            teacher_formats=[SideFormat(kind=FORMATS[i % 3], micro_batch=2)],
            student_format=SideFormat(
                kind=FORMATS[(i + 1) % 3], micro_batch=1 + i % 2, pad_multiple=2
            ),
            seed=100 + i,
        )
        kw: dict[str, Any] = {}
        c = TEACHER.coord(rank)
        if c is not None:
            lay = step.teacher_layouts[0][(c.dp_rank, c.cp_rank)]
            kw.update(hidden={0: key_pattern(lay, H, DTYPE)}, layouts={0: lay})
        c = STUDENT.coord(rank)
        stu = step.student_layouts[(c.dp_rank, c.cp_rank)]
        want = key_pattern(stu, H, DTYPE)
        want[stu.sample_id_R < 0] = 0
        kw["student_layout"] = stu
        out.append({"kw": kw, "want": want, "out": torch.empty((stu.num_rows, H), dtype=DTYPE)})
    return out


def test_soak_1000_exchanges_memory_flat_and_exact(capsys: pytest.CaptureFixture[str]):
    rank = dist.get_rank()
    groups_before = len(c10d._world.pg_map)
    pool = GroupPool(backend="gloo")
    groups = create_bridge_groups(pool, [TEACHER], STUDENT)
    groups_made = len(c10d._world.pg_map) - groups_before
    bridge = HiddenStateBridge(
        teachers=[TeacherSpec(mesh=TEACHER, hidden_size=H)],
        student=STUDENT,
        groups=groups,
        config=BridgeConfig(timeout_s=60, max_cached_plans=MAX_PLANS),
    )
    data = steps()
    order = torch.randint(0, LAYOUTS, (ITERS,), generator=torch.Generator().manual_seed(7))
    order[:LAYOUTS] = torch.arange(LAYOUTS)  # the warm-up sees every layout
    handles: list[weakref.ref] = []
    marks: dict[str, Any] = {}
    t0 = time.perf_counter()
    for it in range(ITERS):
        if it == WARMUP:
            gc.collect()
            marks["rss_warm"] = rss_mib()
            marks["stats_warm"] = bridge.executor.memory_stats()
            marks["pgs_warm"] = len(c10d._world.pg_map)
        if it == TRACE_FROM:
            tracemalloc.start()
        if it == HEAP_WINDOW[0]:
            gc.collect()
            marks["heap0"] = tracemalloc.get_traced_memory()[0]
        if it == HEAP_WINDOW[1]:
            gc.collect()
            marks["heap1"] = tracemalloc.get_traced_memory()[0]
            tracemalloc.stop()
        if it == RSS_MID:
            gc.collect()
            marks["rss_mid"] = rss_mib()
        d = data[int(order[it])]
        kw = dict(d["kw"])
        if it % 2 == 0:
            d["out"].fill_(float("nan"))
            kw["outputs"] = {0: d["out"]}
        handle = bridge.exchange(**kw)
        handles.append(weakref.ref(handle))
        got = handle.wait()[0]
        del handle
        assert torch.equal(bits(got), bits(d["want"])), f"exchange {it} (layout {int(order[it])})"
        assert len(bridge._plans) <= MAX_PLANS
    elapsed = time.perf_counter() - t0
    gc.collect()
    stats = bridge.executor.memory_stats()
    rss_end = rss_mib()
    alive = sum(1 for h in handles if h() is not None)
    figures = {
        "global_rank": rank,
        "exchanges": ITERS,
        "seconds": round(elapsed, 2),
        "ms_per_exchange": round(1e3 * elapsed / ITERS, 2),
        "rss_mib_after_warmup": round(marks["rss_warm"], 2),
        "rss_mib_end": round(rss_end, 2),
        "rss_growth_mib": round(rss_end - marks["rss_warm"], 3),
        "rss_growth_last_400_mib": round(rss_end - marks["rss_mid"], 3),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "python_heap_growth_kib_400_to_600": round((marks["heap1"] - marks["heap0"]) / 1024, 1),
        "staging_bytes": stats["staging_bytes"],
        "staging_buffers": stats["staging_buffers"],
        "staging_allocations_warm_end": (
            marks["stats_warm"]["staging_allocations"],
            stats["staging_allocations"],
        ),
        "plans_cached": len(bridge._plans),
        "schedules_cached": stats["schedules"],
        "handles_alive": alive,
        "groups_made": groups_made,
    }
    with capsys.disabled():
        print(f"\nsoak figures: {json.dumps(figures)}", flush=True)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, figures)
    path = os.environ.get("MOPD_SOAK_REPORT")
    if path and rank == 0:
        with open(path, "w") as f:
            json.dump(every, f, indent=1)
    assert stats["staging_allocations"] == marks["stats_warm"]["staging_allocations"]
    assert stats["staging_bytes"] == marks["stats_warm"]["staging_bytes"]
    assert stats["in_flight"] == 0 and alive == 0
    assert stats["schedules"] <= MAX_PLANS and len(bridge._plans) <= MAX_PLANS
    assert stats["exchanges"] == ITERS
    assert len(c10d._world.pg_map) == marks["pgs_warm"], "a process group was created mid-run"
    assert rss_end - marks["rss_warm"] < RSS_BUDGET_MIB, figures
    assert rss_end - marks["rss_mid"] < RSS_TAIL_BUDGET_MIB, figures
    assert marks["heap1"] - marks["heap0"] < HEAP_BUDGET_KIB * 1024, figures
