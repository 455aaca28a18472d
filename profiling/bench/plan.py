"""Benchmark: one rank's host work on a changed step at 256 to 65,536 ranks, routed beside gathered.

Why this file exists: on-policy training has new lengths every step, so every step is a
*changed* step for the bridge, and its host work and the metadata a rank receives must follow
the rank's own work, not the job's. A timed test would be flaky, so this benchmark shows it:
for each rank count it simulates one step of ``--micro-batches`` micro-batches (no process
group) of a colocated job, teacher tp8 cp2 and student tp4 cp4 on the same ranks, THD on both
sides with Megatron's SP padding, about ``--tokens-per-rank`` real tokens per rank in the step,
samples of random lengths assigned to DP ranks in contiguous ranges (the teacher cuts by
sample count, the student balances tokens, so the cuts differ). Every rank's record is built by
the bridge's own rule (:mod:`mopd.bridge.record`) and stacked as an all-gather returns it, and
every member's part of the routed exchange (:mod:`mopd.bridge.peers`) is simulated by the
same rules (:func:`simulate_exchange`): setup, not timed.

Both source modes of the teacher are timed (``--sources``): ``replicas`` (its last-stage TP
groups send as replicas) and ``sp_shards`` (``TeacherSpec(sp_shards=True)``: every teacher
rank sends its own SP shard, tp times the sending groups); each row names its mode.

Timed for a few representative ranks (each a teacher and a student rank; the first one leads a
source and a destination group), every per-step host function of the live bridge, called on a
bridge object without process groups (:func:`offline_bridge`, whose wire answers each round
with what the simulated members send it):

- ``step_host_miss_ms``: a changed step (an empty schedule cache, every micro-batch planned):
  building its layouts and record, its part of the routed exchange
  (:func:`~mopd.bridge.peers.exchange_records`), the fence, the verdict checks, the plans and
  schedules from its peers' records (``_agree_and_plan``), the token counts;
- ``step_host_miss_gather_ms``: the same step planned from every record (the all-gather's
  matrix: the path before the routed exchange);
- ``step_host_ms``: a repeated step (every record says it is the plan memo's step's: nothing
  is exchanged, the memo's records and plan keys serve, no planner runs);
- ``step_calls_miss``: the calls the changed step makes at the slowest rank
  (:func:`count_calls`), a count free of the machine's noise, and ``us_per_call_miss``.

Each is the slowest rank's least of several steps; each measured rank's plans from its routed
records are checked equal to its plans from every record. ``allgather_bytes``: the metadata one
rank receives on a changed step (counted; the two small all-reduces modelled), beside
``allgather_bytes_gather`` (every record). ``plan_ms`` is, as before, decoding + ``plan_rank`` +
``check_rank`` of one micro-batch from every record; beside it, at the recorded setup (one
micro-batch, 4096 tokens per rank), the retired global planner's recorded figures, read from
``docs/results/`` in a checkout (:data:`BASELINE`). Each rank count prints a line on
stderr as it starts and ends. Figures are one CPU thread of this machine.

Run: ``python -m mopd.profiling.bench.plan [--ranks N ...] [--json] [--results-dir DIR]``
(or ``mopd bench plan``). ``--json`` prints one JSON object per rank count; otherwise a table.
Records ``plan-step-<machine>-<date>.{csv,md}`` and a log-log figure
``plan-step-<machine>-<date>-vs-ranks.png`` in the results folder (``--results-dir``; by default
``docs/results/`` inside a checkout, ``./mopd-results/`` elsewhere; not with ``--no-record``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import resource
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mopd.bridge.coverage import check_rank
from mopd.bridge.metadata import (
    HEADER,
    MEMO_STEP,
    SIZE,
    UNCHANGED,
    StepMatrix,
    record_heads,
    record_tables,
    reduced_summary,
)
from mopd.bridge.offline import OfflineBridge
from mopd.bridge.peers import (
    exchange_records,
)
from mopd.bridge.plan import plan_rank
from mopd.bridge.route import RADIX
from mopd.bridge.step import BridgeStep
from mopd.common.collector import paused_collector
from mopd.profiling.bench.plan_job import (
    ExchangeSim,
    Step,
    build_step,
    exchange_job,
    offline_bridge,
    rank_batches,
    rank_layouts,
    representative_ranks,
    simulate_exchange,
)
from mopd.profiling.extras import can_draw
from mopd.profiling.mesh_arg import OneLineParser, prog_for
from mopd.profiling.results import environment, format_table, record

__all__ = [
    "BASELINE",
    "DEFAULT_RANKS",
    "PREVIOUS",
    "SOURCES",
    "AllGatherModel",
    "count_calls",
    "main",
    "measure_local",
    "measure_step",
    "model_allgather",
    "recorded_global",
    "recorded_previous",
    "routed_exchange",
]

#: The retired global planner's recorded run (``global_plan_ms``, ``global_rss_growth_mib`` per
#: rank count at 4096 tokens per rank in one micro-batch, samples up to 4096 long, seed 0), under
#: ``results/``.
BASELINE = "plan-scale-cpu-2026-12-01"
#: The last recorded run of this benchmark, the figure it is set beside (``step_host_miss_ms``
#: per rank count and source mode at its default setup: routed records, a packed_layout call
#: per micro-batch, records stacked into one padded matrix), under ``results/``.
PREVIOUS = "plan-step-cpu-2026-12-04-4"
_PREVIOUS_SETUP = {"tokens_per_rank": 4096, "max_len": 4096, "seed": 0, "micro_batches": 8}
_BASELINE_SETUP = {"tokens_per_rank": 4096, "max_len": 4096, "seed": 0, "micro_batches": 1}
#: The teacher's source modes measured: TP replicas (one sending group per TP group), or every
#: teacher rank sending its own SP shard (``TeacherSpec(sp_shards=True)``: tp x the groups).
SOURCES: tuple[str, ...] = ("replicas", "sp_shards")
#: Rank counts measured by default.
DEFAULT_RANKS: tuple[int, ...] = (256, 1024, 4096, 16384, 65536)
#: Ring all-gather model: latency per ring step (inter-node NCCL hop) and bandwidth per rank.
ALPHA_S, BETA_BPS = 10e-6, 20e9
#: Inside a node (the two-level model): ranks per node, NVLink latency and bandwidth.
NODE, ALPHA_NVL_S, BETA_NVL_BPS = 8, 2e-6, 200e9


def _plan_one(step: Step, rank: int) -> tuple[Any, list[str]]:
    """What one rank does per micro-batch once the matrix is there (micro-batch 0)."""
    m = StepMatrix(step.matrix_NW)
    catalog = step.topology.catalog(m, 0)
    return plan_rank(catalog, rank, compact=True), check_rank(catalog, rank)


def _groups_read(step: Step, rank: int) -> int:
    """How many groups' runs ``rank`` reads to plan and check (not timed)."""
    m = StepMatrix(step.matrix_NW)
    cat = step.topology.catalog(m, 0)
    counting, source_ids, dest_ids = cat.recording_reads()
    plan_rank(counting, rank, compact=True)
    check_rank(counting, rank)
    return len(source_ids) + len(dest_ids)


@contextlib.contextmanager
def _frozen_heap() -> Iterator[None]:
    """The simulation's objects (every rank's topology, samples and messages: what no rank
    holds) moved out of the garbage collector's sight while timing (``gc.freeze``): a
    collection of them would otherwise land in some measured step. A step's own objects are
    collected as usual."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def measure_local(step: Step, ranks: Sequence[int], repeats: int) -> dict[str, float]:
    """``plan_ms`` (slowest median), ``plan_ms_min`` (fastest median), ``plan_alloc_mib``
    (largest tracemalloc peak) and ``groups_read`` (most groups read) over ``ranks``."""
    medians, peaks, reads = [], [], []
    for r in ranks:
        plan, verdicts = _plan_one(step, r)  # warm-up
        if verdicts or not (plan.sends or plan.recvs or plan.locals):
            raise RuntimeError(f"rank {r}: unexpected plan ({verdicts or 'no transfers'})")
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            _plan_one(step, r)
            times.append(time.perf_counter() - t)
        medians.append(statistics.median(times))
        gc.collect()
        tracemalloc.start()
        _plan_one(step, r)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        reads.append(_groups_read(step, r))
    return {
        "groups_read": max(reads),
        "plan_ms": 1e3 * max(medians),
        "plan_ms_min": 1e3 * min(medians),
        "plan_alloc_mib": max(peaks) / 2**20,
    }


# --- one rank's step, as the live bridge runs it ------------------------------------------------


def _tokens(bs: BridgeStep) -> int:
    """What the loss reads per step: the step's tokens, and each micro-batch's."""
    return bs.global_tokens() + sum(bs.global_tokens(i) for i in range(bs.num_micro_batches))


def _summary(step: Step, memo_step: int, unchanged: int) -> np.ndarray:
    """What the summary's all-reduce returns when every rank's record says ``(memo_step,
    unchanged)`` (every rank repeats its step as the timed one does)."""
    header_NH = step.matrix_NW[:, :HEADER].copy()
    header_NH[:, MEMO_STEP], header_NH[:, UNCHANGED] = memo_step, unchanged
    header_NH[:, SIZE] = step.sizes_N
    heads = record_heads(step.matrix_NW[0, : step.sizes_N[0]], 1)
    return np.concatenate([reduced_summary(header_NH), heads])


def _step_parts(
    step: Step,
    bridge: OfflineBridge,
    sim: ExchangeSim,
    how: str,
    now: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """One step of ``bridge``'s rank; seconds per part. ``how``: ``"repeat"`` (every record
    the memo step's: nothing exchanged, the memo's records serve), ``"routed"`` (a changed
    step: the routed exchange, :func:`~mopd.bridge.peers.exchange_records` on ``sim``'s
    wire), ``"gathered"`` (a changed step as before: every record, read off the all-gather's
    matrix, a fresh copy so that the step reads what the collective wrote). ``now``: the
    clock read at each part's ends (:func:`count_calls` passes a call counter)."""
    rank = bridge.rank
    batches = rank_batches(step, rank)  # the data loader's (not timed)
    tl = now()
    t_lay, s_lay = rank_layouts(step, rank, batches)
    t0 = now()
    local = bridge.record({0: t_lay}, s_lay)
    t1 = now()
    memo_step = bridge.memo_step
    n = len(step.topology.members)
    summary = _summary(step, -1, 0) if memo_step is None else _summary(step, memo_step, 1)
    t1x = now()  # the summary's all-reduce (not timed)
    if how == "repeat":
        matrix = bridge.memo_matrix(summary)
        if matrix is None:
            raise AssertionError(f"rank {rank}: a repeated step without a memo that serves")
    else:
        bridge.forget_memo()  # as the bridge drops a memo that cannot serve
        if how == "gathered":
            m = step.matrix_NW.copy()  # the all-gather's result (not timed)
            if memo_step is not None:
                m[:, MEMO_STEP], m[:, UNCHANGED] = memo_step, 1
            t1x = now()
            matrix = StepMatrix(m, summary)
        else:
            rows, members = exchange_records(
                local.record,
                sim.wire(n),
                topology=step.topology,
                rank=rank,
                n_slots=len(step.micro),
                agreements=local.agreements,
            )
            matrix = StepMatrix(rows, summary, members)
    t2 = now()
    bs = bridge.plan(matrix, local)
    t3 = now()
    _tokens(bs)
    t4 = now()
    mine = matrix.row(step.topology.member_index(rank))
    if not np.array_equal(record_tables(local.record), record_tables(mine)):
        raise AssertionError(f"rank {rank}: its record is not its row of the exchanged records")
    if how == "routed" and not np.array_equal(matrix.members, sim.held):
        raise AssertionError(f"rank {rank}: routed records of {matrix.members.size} members")
    return {
        "layouts": t0 - tl,
        "encode": t1 - t0,
        "exchange": t2 - t1x,
        "verdict_plan": t3 - t2,
        "tokens": t4 - t3,
    }


def count_calls(step: Step, rank: int, sim: ExchangeSim) -> int:
    """The calls one changed (routed) step of ``rank`` makes in its timed parts: Python
    functions and built-in (C) functions and methods, as :func:`sys.setprofile` sees them
    (NumPy's operators and ufuncs are not calls there). The same every time once the job's
    shared caches are warm (:func:`measure_step` counts after a checked step): what the step's
    time is made of, free of the machine's noise."""
    calls = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call" or event == "c_call":
            calls += 1

    bridge = offline_bridge(step, rank, sim)
    gc.collect()  # no collection inside: the finalizers it would run are not the step's calls
    with paused_collector():
        sys.setprofile(count)
        try:
            parts = _step_parts(step, bridge, sim, "routed", now=lambda: float(calls))
        finally:
            sys.setprofile(None)
    return int(sum(parts.values()))


def _check_plans(step: Step, rank: int, sim: ExchangeSim) -> int:
    """The measured rank's plans from its routed records equal those from every record (not
    timed); returns the words it received in the exchange."""
    bridge = offline_bridge(step, rank, sim)
    routed = _step_plans(step, bridge, sim, "routed")
    gathered = _step_plans(step, offline_bridge(step, rank, sim), sim, "gathered")
    if routed[0] != gathered[0]:
        raise AssertionError(f"rank {rank}: routed plans differ from every record's")
    return routed[1]


def _step_plans(
    step: Step, bridge: OfflineBridge, sim: ExchangeSim, how: str
) -> tuple[list[str], int]:
    wire = sim.wire(len(step.topology.members))
    bridge.use_wire(lambda deadline: wire)
    t_lay, s_lay = rank_layouts(step, bridge.rank)
    local = bridge.record({0: t_lay}, s_lay)
    if how == "routed":
        rows, members = exchange_records(
            local.record,
            wire,
            topology=step.topology,
            rank=bridge.rank,
            n_slots=len(step.micro),
            agreements=local.agreements,
        )
        matrix = StepMatrix(rows, _summary(step, -1, 0), members)
    else:
        matrix = StepMatrix(step.matrix_NW.copy(), _summary(step, -1, 0))
    received = wire.received_words
    bs = bridge.plan(matrix, local)
    digests = []
    for i in range(bs.num_micro_batches):
        sched = bs.schedule(i)
        digests.append(sched.digest if sched else "")
    return digests, received


def _best_parts(
    run: Callable[[], dict[str, float]], repeats: int, budget_s: float
) -> dict[str, float]:
    """Per-part minima (ms) of ``repeats`` runs (fewer once ``budget_s`` is spent, at least
    one), ``total`` (the least sum) and ``bridge`` (the least sum without the layouts): on a
    shared machine the least disturbed run is the figure, every path alike."""
    runs: list[dict[str, float]] = []
    start = time.perf_counter()
    while len(runs) < repeats and (not runs or time.perf_counter() - start < budget_s):
        runs.append(run())
    out = {k: 1e3 * min(r[k] for r in runs) for k in runs[0]}
    out["total"] = 1e3 * min(sum(r.values()) for r in runs)
    out["bridge"] = 1e3 * min(sum(r.values()) - r["layouts"] for r in runs)
    return out


def measure_step(step: Step, ranks: Sequence[int], repeats: int) -> dict[str, float]:
    """Per-step host time of each rank in ``ranks``: a changed step on the routed exchange
    (``miss``: every micro-batch planned), the same on every record (``gather``: today's
    path before this one), a repeated step (the memo); for each figure the slowest rank's
    least of several steps (ms), and the most words a rank received in the exchange."""
    job = exchange_job(step)
    new, miss, gather = [], [], []
    words, peers, calls = [], [], []
    for r in ranks:
        sim = simulate_exchange(job, step.topology.member_index(r))
        words.append(_check_plans(step, r, sim))
        peers.append(sim.held.size - 1)
        calls.append(count_calls(step, r, sim))

        def cold(r: int = r, sim: ExchangeSim = sim, how: str = "routed") -> dict[str, float]:
            return _step_parts(step, offline_bridge(step, r, sim), sim, how)

        miss.append(_best_parts(cold, repeats, 5.0))
        gather.append(_best_parts(lambda c=cold: c(how="gathered"), max(repeats // 3, 1), 5.0))
        bridge = offline_bridge(step, r, sim)
        _step_parts(step, bridge, sim, "routed")  # the first step: plans, caches, the memo
        built = bridge.executor.schedules_built
        new.append(
            _best_parts(lambda b=bridge, s=sim: _step_parts(step, b, s, "repeat"), repeats, 5.0)
        )
        if bridge.executor.schedules_built != built:
            raise AssertionError(f"rank {r}: a repeated step built schedules")

    def worst(rows: list[dict[str, float]], k: str) -> float:
        return max(x[k] for x in rows)

    slowest = max(range(len(miss)), key=lambda i: miss[i]["total"])
    return {
        "step_host_miss_ms": worst(miss, "total"),
        "step_calls_miss": float(calls[slowest]),
        "us_per_call_miss": 1e3 * miss[slowest]["total"] / max(calls[slowest], 1),
        "step_host_miss_gather_ms": worst(gather, "total"),
        "bridge_host_miss_ms": worst(miss, "bridge"),
        "layouts_ms": worst(miss, "layouts"),
        "encode_ms": worst(miss, "encode"),
        "exchange_ms": worst(miss, "exchange"),
        "verdict_plan_miss_ms": worst(miss, "verdict_plan"),
        "verdict_plan_gather_ms": worst(gather, "verdict_plan"),
        "step_host_ms": worst(new, "total"),
        "bridge_host_ms": worst(new, "bridge"),
        "verdict_plan_ms": worst(new, "verdict_plan"),
        "tokens_ms": worst(new, "tokens"),
        "received_words": float(max(words)),
        "peers": float(max(peers)),
    }


@dataclass(frozen=True, kw_only=True)
class AllGatherModel:
    """The metadata exchange of one step at ``n`` ranks.

    Attributes:
        bytes_per_rank: mean record bytes (what a rank contributes before padding).
        padded_bytes_per_rank: the widest record (every record travels padded to it).
        gathered_bytes: what every rank receives and holds when it gathers every record
            (``n`` padded records: a changed step before the routed exchange).
        ring_ms: flat ring: the summary's all-reduce (``s = 2 HEADER`` words: ``2 (n - 1)
            alpha + 2 s / beta``), then the records' all-gather (``(n - 1) (alpha + w /
            beta)``).
        hier_ms: the two-level gather: the summary's all-reduce in log depth
            (``ceil(log2 n) (alpha + s / beta)``), then the records' two-level all-gather
            (:func:`~mopd.common.dist.all_gather_nodes`, nodes of ``NODE`` ranks): a gather
            to the node leader over NVLink (``(k - 1) (alpha_nvl + w / beta_nvl)``), the
            leaders' log-depth all-gather (``ceil(log2(n / k)) alpha + (n - k) w / beta``), a
            binomial broadcast of the matrix inside the node (``ceil(log2 k) (alpha_nvl + n w
            / beta_nvl)``).
        repeat_ms: a repeated step's exchange (every record the plan memo's step's but for
            its header): the summary's all-reduce alone, in log depth.
    """

    bytes_per_rank: float
    padded_bytes_per_rank: int
    gathered_bytes: int
    ring_ms: float
    hier_ms: float
    repeat_ms: float


def _two_level_s(n: int, w: float) -> float:
    """Seconds of one two-level all-gather of ``w`` bytes per rank over ``n`` ranks."""
    k = min(NODE, n)
    leaders = -(-n // k)
    inside = (k - 1) * (ALPHA_NVL_S + w / BETA_NVL_BPS)
    across = math.ceil(math.log2(leaders)) * ALPHA_S + (leaders - 1) * k * w / BETA_BPS
    bcast = math.ceil(math.log2(k)) * (ALPHA_NVL_S + n * w / BETA_NVL_BPS)
    return inside + across + bcast


def model_allgather(n: int, sizes_N: np.ndarray) -> AllGatherModel:
    """The model of :class:`AllGatherModel` for records of ``sizes_N`` int64 words."""
    w = int(sizes_N.max()) * 8
    summary = 8 * (2 * HEADER + 6)
    reduce_ring = 2 * (n - 1) * ALPHA_S + 2 * summary / BETA_BPS
    reduce_tree = math.ceil(math.log2(max(n, 2))) * (ALPHA_S + summary / BETA_BPS)
    ring = reduce_ring + (n - 1) * (ALPHA_S + w / BETA_BPS)
    return AllGatherModel(
        bytes_per_rank=float(sizes_N.mean()) * 8,
        padded_bytes_per_rank=w,
        gathered_bytes=n * w,
        ring_ms=1e3 * ring,
        hier_ms=1e3 * (reduce_tree + _two_level_s(n, w)),
        repeat_ms=1e3 * reduce_tree,
    )


def routed_exchange(n: int, n_slots: int, received_words: int) -> tuple[int, float]:
    """``(bytes, ms)`` one rank receives and waits for on a changed step's routed exchange:
    the summary's all-reduce (``2 HEADER + 6`` words) and the verdict's sum (``1 + n_slots``)
    in log depth (a rank receives ``ceil(log2 n)`` times each), and ``received_words`` of the
    point-to-point rounds (counted); time: every round's latency (``2`` per Bruck round and
    per round whose sizes travel first, :func:`~mopd.bridge.route.route_rows`: ``ceil(log_8
    n)`` rounds, then replies, introductions, records, forwarded records) plus the bytes at
    ``beta``."""
    depth = math.ceil(math.log2(max(n, 2)))
    reduced = 8 * depth * ((2 * HEADER + 6) + (1 + n_slots))
    total = reduced + 8 * received_words
    bruck = math.ceil(math.log(max(n, 2)) / math.log(RADIX) - 1e-9)
    hops = 2 * depth + 2 * bruck + 2 + 2 + 1 + 2
    return total, 1e3 * (hops * ALPHA_S + total / BETA_BPS)


def recorded_global(results_dir: Path | None = None) -> dict[int, dict[str, float | None]]:
    """The retired global planner's recorded figures per rank count (empty where the record is
    not there, e.g. in an installed package, whose wheel leaves ``results/`` out)."""
    import csv

    path = (
        results_dir or Path(__file__).resolve().parents[2] / "docs" / "results"
    ) / f"{BASELINE}.csv"
    if not path.is_file():
        return {}
    out: dict[int, dict[str, float | None]] = {}
    with path.open(newline="") as f:
        for rec in csv.DictReader(f):
            out[int(rec["ranks"])] = {
                k: float(rec[k]) if rec.get(k) else None
                for k in ("global_plan_ms", "global_rss_growth_mib")
            }
    return out


def recorded_previous(results_dir: Path | None = None) -> dict[tuple[int, str], float]:
    """``(ranks, sources) -> step_host_miss_ms`` of the last recorded run (:data:`PREVIOUS`;
    empty where the record is not there)."""
    import csv

    path = (
        results_dir or Path(__file__).resolve().parents[2] / "docs" / "results"
    ) / f"{PREVIOUS}.csv"
    if not path.is_file():
        return {}
    with path.open(newline="") as f:
        return {
            (int(r["ranks"]), r["sources"]): float(r["step_host_miss_ms"])
            for r in csv.DictReader(f)
        }


def _row(
    step: Step,
    local: dict[str, float],
    host: dict[str, float],
    glob: dict[str, float | None],
    rss_mib: float,
    previous: float | None = None,
) -> dict:
    model = model_allgather(step.ranks, step.sizes_N)
    routed_bytes, routed_ms = routed_exchange(
        step.ranks, len(step.micro), int(host["received_words"])
    )
    matrix_mib = step.matrix_NW.nbytes / 2**20
    held_mib = (host["peers"] + 1) * model.padded_bytes_per_rank / 2**20
    return {
        "ranks": step.ranks,
        "sources": "sp_shards" if step.sp_shards else "replicas",
        "step_host_miss_ms": round(host["step_host_miss_ms"], 4),
        "step_host_miss_gather_ms": round(host["step_host_miss_gather_ms"], 4),
        "step_host_miss_recorded_ms": previous,
        "allgather_bytes": routed_bytes,
        "allgather_bytes_gather": model.gathered_bytes,
        "step_calls_miss": int(host["step_calls_miss"]),
        "us_per_call_miss": round(host["us_per_call_miss"], 3),
        "peers": int(host["peers"]),
        "micro_batches": len(step.micro),
        "tokens": step.tokens,
        "samples": step.samples,
        "bridge_host_miss_ms": round(host["bridge_host_miss_ms"], 4),
        "layouts_ms": round(host["layouts_ms"], 4),
        "encode_ms": round(host["encode_ms"], 4),
        "exchange_ms": round(host["exchange_ms"], 4),
        "verdict_plan_miss_ms": round(host["verdict_plan_miss_ms"], 4),
        "verdict_plan_gather_ms": round(host["verdict_plan_gather_ms"], 4),
        "exchange_model_ms": round(routed_ms, 3),
        "allgather_hier_ms": round(model.hier_ms, 3),
        "allgather_ring_ms": round(model.ring_ms, 3),
        "step_host_ms": round(host["step_host_ms"], 4),
        "bridge_host_ms": round(host["bridge_host_ms"], 4),
        "verdict_plan_ms": round(host["verdict_plan_ms"], 4),
        "tokens_ms": round(host["tokens_ms"], 4),
        "repeat_exchange_ms": round(model.repeat_ms, 3),
        "plan_ms": round(local["plan_ms"], 4),
        "plan_ms_min": round(local["plan_ms_min"], 4),
        "global_plan_ms": glob.get("global_plan_ms"),
        "groups_read": int(local["groups_read"]),
        "groups": len(step.topology.sources) + len(step.topology.dests),
        "metadata_bytes_per_rank": round(model.bytes_per_rank, 1),
        "metadata_padded_bytes_per_rank": model.padded_bytes_per_rank,
        "held_mib": round(held_mib, 3),
        "matrix_mib": round(matrix_mib, 3),
        "plan_alloc_mib": round(local["plan_alloc_mib"], 3),
        "peak_mib": round(held_mib + local["plan_alloc_mib"], 3),
        "global_rss_growth_mib": glob.get("global_rss_growth_mib"),
        "setup_s": round(step.setup_s, 2),
        "setup_rss_mib": round(rss_mib, 1),
        "topology_build_ms": round(step.topology_ms, 2),
    }


def _plot(rows: Sequence[dict], png: Path, tokens_per_rank: int) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14.0, 4.6), layout="constrained")
    FigureCanvasAgg(fig)
    ax, bx, cx = (fig.add_subplot(1, 3, k) for k in (1, 2, 3))
    for src, mark in zip(SOURCES, "os", strict=False):
        mode = [r for r in rows if r["sources"] == src]
        if not mode:
            continue
        m = [r["ranks"] for r in mode]
        for key, style, what in (
            ("step_host_miss_ms", "-", "changed step, routed"),
            ("step_host_miss_gather_ms", "--", "changed step, every record"),
            ("step_host_ms", ":", "repeated step"),
        ):
            ax.plot(m, [r[key] for r in mode], mark + style, label=f"{what}, {src}", ms=4)
        for key, style, what in (
            ("allgather_bytes", "-", "routed"),
            ("allgather_bytes_gather", "--", "every record"),
        ):
            mib = [r[key] / 2**20 for r in mode]
            bx.plot(m, mib, mark + style, label=f"{what}, {src}", ms=4)
        cx.plot(m, [r["exchange_model_ms"] for r in mode], mark + "-", label=f"routed, {src}")
        cx.plot(m, [r["allgather_hier_ms"] for r in mode], mark + "--", label=f"two-level, {src}")
    ax.axhline(5.0, color="grey", lw=0.8)
    bx.axhline(8.0, color="grey", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="ranks", ylabel="ms", title="one rank's host work")
    bx.set(xscale="log", yscale="log", xlabel="ranks", ylabel="MiB", title="metadata received")
    cx.set(xscale="log", yscale="log", xlabel="ranks", ylabel="ms", title="exchange (model)")
    for x in (ax, bx, cx):
        x.grid(alpha=0.3, which="both")
        x.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    fig.suptitle(
        f"A changed step, ~{tokens_per_rank:,} tokens per rank (teacher tp8 cp2, student tp4 "
        f"cp4, colocated, THD, {rows[0]['micro_batches']} micro-batches); one CPU thread",
        fontsize=9,
    )
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def _notes(rows: Sequence[dict], args: argparse.Namespace, load: tuple[float, float]) -> str:
    lines = []
    for src in SOURCES:
        by = {r["ranks"]: r for r in rows if r["sources"] == src}
        lo, hi, top = by.get(1024), by.get(16384), by.get(65536)
        parts = [f"{src}:"]
        if hi:
            ok = hi["step_host_miss_ms"] <= 5
            parts.append(
                f"a changed step costs one rank {hi['step_host_miss_ms']:.3g} ms of host work at "
                f"16,384 ranks ({'meets' if ok else 'misses'} the <= 5 ms target; "
                f"{hi['layouts_ms']:.3g} ms of it the caller's layouts, "
                f"{hi['exchange_ms']:.3g} ms the routed exchange, "
                f"{hi['verdict_plan_miss_ms']:.3g} ms the verdict and the plans; "
                f"{hi['step_calls_miss']:,} calls, {hi['us_per_call_miss']:.3g} us each), against "
                f"{hi['step_host_miss_gather_ms']:.3g} ms planning from every record"
                + (
                    f" ({hi['step_host_miss_recorded_ms']:.3g} ms in the last recorded run)"
                    if hi.get("step_host_miss_recorded_ms")
                    else ""
                )
                + ";"
            )
        if lo and top:
            ratio = top["step_host_miss_ms"] / lo["step_host_miss_ms"]
            before = top["step_host_miss_gather_ms"] / lo["step_host_miss_gather_ms"]
            parts.append(
                f"65,536 / 1,024 = {ratio:.2f}x ({top['step_host_miss_ms']:.3g} against "
                f"{lo['step_host_miss_ms']:.3g} ms; target <= 1.5x: "
                f"{'met' if ratio <= 1.5 else 'missed'}; every record: {before:.3g}x);"
            )
        if top:
            mib = top["allgather_bytes"] / 2**20
            parts.append(
                f"at 65,536 ranks a rank receives {mib:.3g} MiB of metadata on a changed step "
                f"(target <= 8 MiB: {'met' if mib <= 8 else 'missed'}; the records of "
                f"{top['peers']} peers) against {top['allgather_bytes_gather'] / 2**20:.4g} MiB "
                "gathering every record; the exchange models at "
                f"{top['exchange_model_ms']:.3g} ms against {top['allgather_hier_ms']:.3g} ms "
                "for the two-level gather. A repeated step: "
                f"{top['step_host_ms']:.3g} ms (the memo's records serve, nothing exchanged)."
            )
        if len(parts) > 1:
            lines.append(" ".join(parts))
    lines += [
        "`step_host_miss_ms`: one rank's host work on a changed step (new lengths, as every "
        "on-policy step: an empty schedule cache, every micro-batch planned and checked): "
        "building its 2 x micro-batches layouts (`layouts_ms`, the caller's packed_layouts "
        "calls, one per side for the step, from the sample ids, lengths and padded offsets "
        "its data loader gives, which are not timed), its record (`encode_ms`), the routed "
        "exchange's "
        "own work (`exchange_ms`: registrations, the Bruck rounds' partitions, the replies it "
        "serves as a home and reads, its introductions, its peers' and leaders' records one "
        "after another; the "
        "messages themselves come from a simulation of every member playing the same rules, "
        "mopd.bridge.peers' own functions, not timed), the fence, the verdict checks, plan "
        "keys, plans and schedules (`verdict_plan_miss_ms`), the token counts (the step's and "
        "each micro-batch's). `step_calls_miss`: the calls that step makes at the slowest "
        "rank (Python functions and built-in functions and methods, as sys.setprofile counts "
        "them; NumPy's operators and ufuncs are not among them), a count free of the "
        "machine's noise; `us_per_call_miss`: its time over its calls. "
        "`step_host_miss_gather_ms`: the same step planned from every "
        "record (the all-gather's matrix, a fresh copy, not timed; `verdict_plan_gather_ms` "
        "its verdict and plans), by the same planner: what routing saves; "
        f"`step_host_miss_recorded_ms`: the last recorded run, docs/results/{PREVIOUS}.md "
        "(the code before this change; another run, another load). "
        "`step_host_ms`: a repeated step (the "
        "plan memo's records serve; no planner runs). Each: the least of up to "
        f"{args.repeats} steps (every record: a third of that), the slowest of three ranks "
        "(rank 0, one in the middle, the last teacher leader); each measured rank's plans from "
        "its routed records are checked equal to those from every record. While timing, the "
        "simulation's objects (every rank's topology, samples and messages, which no rank "
        "holds) are frozen out of the garbage collector (gc.freeze); a step's own objects are "
        "collected as usual.",
        "`allgather_bytes`: the metadata bytes one rank receives on a changed step: its "
        "point-to-point rounds counted word for word (the most of the three ranks), and the "
        "summary's all-reduce (26 words) and the verdict's sum (1 + micro-batches words) "
        "modelled in log depth (ceil(log2 n) times each); `allgather_bytes_gather`: every "
        "padded record, what a rank received before. `peers`: the records a rank holds besides "
        "its own. `exchange_model_ms`: the routed exchange, every round's latency at alpha = "
        f"{ALPHA_S * 1e6:g} us (two per round whose sizes travel first; ceil(log_{RADIX} n) "
        "Bruck rounds) plus its bytes at "
        f"{BETA_BPS / 1e9:g} GB/s; `allgather_hier_ms`: the two-level all-gather of every "
        f"record (nodes of {NODE}, NVLink alpha {ALPHA_NVL_S * 1e6:g} us, "
        f"{BETA_NVL_BPS / 1e9:g} GB/s), the path before.",
        f"One CPU thread of this machine (a shared {os.cpu_count()}-core box; load average "
        f"{load[0]:.1f} at the start and {load[1]:.1f} at the end of the run): absolute times "
        "are noisy, the ratios within the run are the figure. Per rank count: one simulated "
        f"step of {args.micro_batches} micro-batches, {args.tokens_per_rank} real tokens per "
        f"rank in the step on average, lengths uniform in [1, {args.max_len}], teacher tp8 cp2 "
        "and student tp4 cp4 colocated on the same ranks (rank r is both), THD both sides "
        "padded to 2 cp tp per sequence, DP ranks holding contiguous sample ids (teacher: equal "
        "sample counts; student: equal tokens). Two source modes (`sources`): `replicas`, the "
        "teacher's last-stage TP groups as replicas, and `sp_shards`, every teacher rank "
        "sending its own SP shard (TeacherSpec(sp_shards=True): tp = 8 times the sending "
        "groups). `plan_ms`: decode + plan_rank + check_rank of one micro-batch of one rank "
        "from every record; `global_plan_ms`: the retired global planner recorded in "
        f"docs/results/{BASELINE}.md, only at its setup. `held_mib`: the records a rank "
        "holds (its peers' and its own, padded), `matrix_mib`: every record (what it held "
        "before); `plan_alloc_mib`: tracemalloc peak of planning one micro-batch.",
    ]
    return "\n\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(
        prog=prog_for("mopd.profiling.bench.plan"), description=__doc__.splitlines()[0]
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=list(DEFAULT_RANKS))
    parser.add_argument(
        "--tokens-per-rank", type=int, default=4096, help="real tokens per rank in the step"
    )
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step")
    parser.add_argument("--max-len", type=int, default=4096, help="longest sample")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sources",
        nargs="+",
        choices=SOURCES,
        default=list(SOURCES),
        help="the teacher's sources: TP replicas, or each rank's SP shard",
    )
    parser.add_argument(
        "--repeats", type=int, default=15, help="timed calls per rank (the least is the figure)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per rank count")
    parser.add_argument("--results-dir", type=Path, default=None)
    parser.add_argument("--no-record", action="store_true", help="print only")
    args = parser.parse_args(argv)
    same_setup = all(getattr(args, k) == v for k, v in _BASELINE_SETUP.items())
    baseline = recorded_global() if same_setup else {}
    previous = (
        recorded_previous()
        if all(getattr(args, k) == v for k, v in _PREVIOUS_SETUP.items())
        else {}
    )
    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]
    rows = []
    runs = [(n, src) for src in args.sources for n in args.ranks]
    for i, (n, src) in enumerate(runs):
        t0 = time.perf_counter()
        what = f"[{i + 1}/{len(runs)}] {n} ranks, {src}"
        print(f"bench_plan: {what} ...", file=sys.stderr, flush=True)
        step = build_step(
            n,
            tokens_per_rank=args.tokens_per_rank,
            max_len=args.max_len,
            seed=args.seed,
            micro_batches=args.micro_batches,
            sp_shards=src == "sp_shards",
        )
        rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        reps = representative_ranks(n)
        with _frozen_heap():
            local = measure_local(step, reps, args.repeats)
            host = measure_step(step, reps, args.repeats)
        row = _row(step, local, host, baseline.get(n, {}), rss_mib, previous.get((n, src)))
        del step
        gc.collect()
        rows.append(row)
        print(
            f"bench_plan: {what} done in "
            f"{time.perf_counter() - t0:.1f} s (one rank's changed step: "
            f"{row['step_host_miss_ms']:.3g} ms, from every record "
            f"{row['step_host_miss_gather_ms']:.3g} ms)",
            file=sys.stderr,
            flush=True,
        )
        if args.json:
            print(json.dumps(row), flush=True)
    if not args.json:
        print(format_table(rows))
    if not args.no_record:
        env = environment()
        notes = _notes(rows, args, (load0, os.getloadavg()[0]))
        csv_path, md_path = record(
            "plan-step", rows, out_dir=args.results_dir, notes=notes, env=env
        )
        recorded = [csv_path, md_path]
        if can_draw("mopd bench plan"):
            png = csv_path.with_name(csv_path.stem + "-vs-ranks.png")
            _plot(rows, png, args.tokens_per_rank)
            recorded.append(png)
        print(f"recorded {', '.join(map(str, recorded))}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
