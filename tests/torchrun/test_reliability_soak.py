"""Tier 2 (4 ranks, gloo): hundreds of steps with changing layouts: exact, memory flat, no leak.

One bridge (integrity on) on one set of groups runs ``ITERS`` steps; each picks one of
``LAYOUTS`` seeded steps of ``M`` micro-batches (different samples, lengths, THD / ``[S, B, H]``
/ ``[B, S, H]``, micro-batching) in a fixed pseudo-random order, with ``max_cached_plans``
smaller than the schedules of one step, so the schedule cache both hits and evicts. Even
iterations run the step API (``plan_step``, then ``send(i)`` / ``receive(i)`` per micro-batch,
``finish()``), odd ones one ``exchange()`` of the layout's first micro-batch. Meshes: teacher
``tp2`` on global ranks 0-1, student ``tp2 dp2`` on 0-3 (local copies on 0-1, the network into
2-3, the student TP all-gather on both).

Checked: every micro-batch bit-exact; staging buffers bounded by the slots of one step, and
over the second half no staging allocation and no growth of staging or zero-row bytes (the pool
first grows to the largest sizes the layouts' order brings: a buffer too small for a slot is
replaced by a larger one); RSS growth after a warm-up that sees every layout under
``RSS_BUDGET_MIB`` (and under ``RSS_TAIL_BUDGET_MIB`` over the second half), Python heap growth (tracemalloc over a
window) under ``HEAP_BUDGET_KIB``, schedules and device index caches within
``max_cached_plans``, no step or handle alive (but the last) or unfinished, no process group
created. Figures
are printed on every rank (``pytest -s`` or the harness log) and, with
``MOPD_SOAK_REPORT=path``, written to a file by global rank 0.
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

from mopd.bridge import GroupPool, Mesh
from mopd.profiling.synthetic import SideFormat, key_pattern, synthetic_step
from tests.support.reliability import fresh_bridge

TORCHRUN_NPROC = 4
TORCHRUN_TIMEOUT = 300

ITERS = 400  # steps (half with M micro-batches, half one exchange): 800 micro-batches
M = 3
WARMUP = 40
LAYOUTS = 6
MAX_PLANS = 4
H = 16
DTYPE = torch.bfloat16
RSS_BUDGET_MIB = 8.0
HEAP_BUDGET_KIB = 64.0
TRACE_FROM = 120  # tracemalloc on from here; it sees only allocations made after it starts,
HEAP_WINDOW = (160, 240)  # so heap growth is read between two later points (caches turned over)
RSS_MID = 240  # RSS from here to the end: after tracemalloc's own memory came and went
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
    """Per layout index: this rank's layouts, rows and expected rows of each micro-batch."""
    rank = dist.get_rank()
    out = []
    for k in range(LAYOUTS):
        d: dict[str, list[Any]] = {"t": [], "rows": [], "s": [], "want": []}
        for i in range(M):
            step = synthetic_step(
                teachers=[TEACHER],
                student=STUDENT,
                num_samples=3 + (k + i) % 3,
                max_len=5 + 2 * k + i,
                teacher_formats=[SideFormat(kind=FORMATS[k % 3], micro_batch=2)],
                student_format=SideFormat(
                    kind=FORMATS[(k + 1) % 3], micro_batch=1 + k % 2, pad_multiple=2
                ),
                seed=100 * k + i,
            )
            c = TEACHER.coord(rank)
            if c is not None:
                lay = step.teacher_layouts[0][(c.dp_rank, c.cp_rank)]
                d["t"].append(lay)
                d["rows"].append(key_pattern(lay, H, DTYPE, salt=i))
            c = STUDENT.coord(rank)
            stu = step.student_layouts[(c.dp_rank, c.cp_rank)]
            want = key_pattern(stu, H, DTYPE, salt=i)[stu.sample_id_R >= 0]  # compact
            d["s"].append(stu)
            d["want"].append(want)
        out.append(d)
    return out


def test_soak_hundreds_of_steps_memory_flat_and_exact(capsys: pytest.CaptureFixture[str]):
    rank = dist.get_rank()
    teacher = TEACHER.is_last_stage(rank)
    groups_before = len(c10d._world.pg_map)
    bridge = fresh_bridge(
        [TEACHER],
        STUDENT,
        [H],
        timeout_s=60,
        dtype=DTYPE,
        pool=GroupPool(backend="gloo", timeout_s=120),
        max_cached_plans=MAX_PLANS,
        integrity=True,
    )
    groups_made = len(c10d._world.pg_map) - groups_before
    data = steps()
    order = torch.randint(0, LAYOUTS, (ITERS,), generator=torch.Generator().manual_seed(7))
    order[: 2 * LAYOUTS] = torch.arange(LAYOUTS).repeat_interleave(2)  # both kinds, every layout
    alive: list[weakref.ref] = []
    marks: dict[str, Any] = {}
    micro_batches = 0
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
            marks["stats_mid"] = bridge.executor.memory_stats()
        k = int(order[it])
        d = data[k]
        got: list[torch.Tensor] = []
        if it % 2 == 0:
            step = bridge.plan_step(
                teacher_layouts={0: d["t"]} if teacher else None, student_layouts=d["s"]
            )
            for i in range(M):
                if teacher:
                    step.send(i, {0: d["rows"][i]})
                got.append(step.receive(i)[0])
            step.finish()
            alive.append(weakref.ref(step))
            del step
        else:
            kw: dict[str, Any] = {"student_layout": d["s"][0]}
            if teacher:
                kw.update(hidden={0: d["rows"][0]}, layouts={0: d["t"][0]})
            handle = bridge.exchange(**kw)
            got.append(handle.wait()[0])
            alive.append(weakref.ref(handle))
            del handle
        for i, rows in enumerate(got):
            assert torch.equal(bits(rows), bits(d["want"][i])), f"step {it} (layout {k}) mb {i}"
        micro_batches += len(got)
        stats = bridge.executor.memory_stats()
        assert stats["schedules"] <= MAX_PLANS and stats["device_caches"] <= MAX_PLANS, stats
    elapsed = time.perf_counter() - t0
    del got
    gc.collect()
    stats = bridge.executor.memory_stats()
    rss_end = rss_mib()
    n_alive = sum(1 for h in alive[:-1] if h() is not None)  # the bridge keeps its last step
    open_steps = [s for s in bridge._open_steps if not s.finished]
    figures = {
        "global_rank": rank,
        "steps": ITERS,
        "micro_batches": micro_batches,
        "seconds": round(elapsed, 2),
        "ms_per_micro_batch": round(1e3 * elapsed / micro_batches, 2),
        "rss_mib_after_warmup": round(marks["rss_warm"], 2),
        "rss_mib_end": round(rss_end, 2),
        "rss_growth_mib": round(rss_end - marks["rss_warm"], 3),
        "rss_growth_tail_mib": round(rss_end - marks["rss_mid"], 3),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "python_heap_growth_kib": round((marks["heap1"] - marks["heap0"]) / 1024, 1),
        "staging_bytes": stats["staging_bytes"],
        "staging_buffers": stats["staging_buffers"],
        "staging_allocations_warm_mid_end": (
            marks["stats_warm"]["staging_allocations"],
            marks["stats_mid"]["staging_allocations"],
            stats["staging_allocations"],
        ),
        "staging_bytes_warm_mid_end": (
            marks["stats_warm"]["staging_bytes"],
            marks["stats_mid"]["staging_bytes"],
            stats["staging_bytes"],
        ),
        "zeros_bytes": stats["zeros_bytes"],
        "schedules_cached": stats["schedules"],
        "device_caches": stats["device_caches"],
        "schedules_built": bridge.executor.schedules_built,
        "steps_alive": n_alive,
        "steps_unfinished": len(open_steps),
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
    # the pool grows to the largest sizes the layouts' order brings (a buffer too small for a
    # slot is replaced by a larger one), then allocates nothing more
    mid = marks["stats_mid"]
    for key in ("staging_allocations", "staging_bytes", "staging_buffers", "zeros_bytes"):
        assert stats[key] == mid[key], (key, figures)
    assert stats["staging_buffers"] <= 3 * M, figures  # per kind (send, send1, recv), one a slot
    assert n_alive == 0 and not open_steps, figures
    assert bridge.executor.schedules_built > MAX_PLANS, "the cache must have evicted"
    assert len(c10d._world.pg_map) == marks["pgs_warm"], "a process group was created mid-run"
    assert rss_end - marks["rss_warm"] < RSS_BUDGET_MIB, figures
    assert rss_end - marks["rss_mid"] < RSS_TAIL_BUDGET_MIB, figures
    assert marks["heap1"] - marks["heap0"] < HEAP_BUDGET_KIB * 1024, figures
