"""Benchmark: one rank's planning at 256 to 16,384 ranks, beside the retired global planner.

Why this file exists: the planner's promise is a cost that follows a rank's own work, flat in the
number of ranks at a fixed number of tokens per rank, where the previous planner computed the
whole job's plan on every rank. A timed test would be flaky, so this benchmark shows it: for each
rank count it simulates one step (no process group) of a colocated job, teacher tp8 cp2 and
student tp4 cp4 on the same ranks, THD on both sides with Megatron's SP padding, about
``--tokens-per-rank`` real tokens per rank, samples of random lengths assigned to DP ranks in
contiguous ranges (the teacher cuts by sample count, the student balances tokens, so the cuts
differ). Building every rank's metadata record and the gathered matrix is setup, not timed.

Timed, for a few representative ranks (each a teacher and a student rank; the first one checks a
source and a destination group): decoding the matrix (:class:`~mopd.bridge.metadata.StepMatrix`,
:meth:`~mopd.bridge.topology.Topology.catalog`), :func:`~mopd.bridge.plan.plan_rank` and
:func:`~mopd.bridge.plan.check_rank`; ``plan_ms`` is the slowest of their medians. Memory:
``peak_mib`` is what one rank holds to plan, the gathered matrix plus the planning's own peak
allocations (tracemalloc, a separate run); the setup's RSS is reported apart. Beside it, at the
recorded setup (the default sizes), the retired global planner's recorded figures (what every
rank used to run: the whole job's plan), read from ``profiling/results/`` in a checkout
(:data:`BASELINE`; the planner itself is gone). Each rank count prints a line on stderr as it
starts and ends. Figures are one CPU thread of this machine.

It also models the metadata all-gather at those sizes (see :func:`model_allgather`): bytes per
rank and in all, and a latency estimate for a flat ring and for a two-level (node) scheme.

Run: ``python -m mopd.profiling.bench_plan [--ranks N ...] [--json] [--results-dir DIR]``
(or ``mopd bench plan``). ``--json`` prints one JSON object per rank count; otherwise a table.
Records ``plan-scale-<machine>-<date>.{csv,md}`` and a log-log figure
``plan-scale-<machine>-<date>-vs-ranks.png`` in the results folder (``--results-dir``; by default ``profiling/results/`` inside a
checkout, ``./mopd-results/`` elsewhere; not with ``--no-record``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import statistics
import sys
import time
import tracemalloc
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mopd.bridge.layout import TokenLayout, packed_layout
from mopd.bridge.mesh import Mesh
from mopd.bridge.metadata import Section, StepMatrix, encode_step_record
from mopd.bridge.plan import check_rank, plan_rank
from mopd.bridge.topology import Topology
from mopd.profiling.extras import can_draw
from mopd.profiling.mesh_arg import OneLineParser
from mopd.profiling.results import environment, format_table, record

__all__ = [
    "BASELINE",
    "DEFAULT_RANKS",
    "AllGatherModel",
    "Step",
    "build_step",
    "main",
    "measure_local",
    "model_allgather",
    "recorded_global",
]

#: The retired global planner's recorded run (``global_plan_ms``, ``global_rss_growth_mib`` per
#: rank count at 4096 tokens per rank, samples up to 4096 long, seed 0), under ``results/``.
BASELINE = "plan-scale-cpu-2026-12-01"
_BASELINE_SETUP = {"tokens_per_rank": 4096, "max_len": 4096, "seed": 0}
#: Rank counts measured by default.
DEFAULT_RANKS: tuple[int, ...] = (256, 1024, 4096, 16384)
_T_TP, _T_CP, _S_TP, _S_CP = 8, 2, 4, 4
_BLOCK = _T_TP * _T_CP  # ranks per DP index (the same for both meshes)
#: Ring all-gather model: latency per ring step (inter-node NCCL hop) and bandwidth per rank.
ALPHA_S, BETA_BPS = 10e-6, 20e9
#: Inside a node (the two-level model): ranks per node, NVLink latency and bandwidth.
NODE, ALPHA_NVL_S, BETA_NVL_BPS = 8, 2e-6, 200e9


def _meshes(ranks: int) -> tuple[Mesh, Mesh]:
    if ranks % _BLOCK:
        raise ValueError(f"ranks must be a multiple of {_BLOCK}, got {ranks}")
    dp = ranks // _BLOCK
    return (
        Mesh(tp=_T_TP, cp=_T_CP, dp=dp, name="teacher"),
        Mesh(tp=_S_TP, cp=_S_CP, dp=dp, name="student"),
    )


@dataclass(frozen=True, kw_only=True, eq=False)
class _Samples:
    """The step's samples and how each side assigns them to its DP ranks (contiguous ids)."""

    lengths_S: np.ndarray
    teacher_parts: list[np.ndarray]
    student_parts: list[np.ndarray]


def _samples(ranks: int, tokens_per_rank: int, max_len: int, seed: int) -> _Samples:
    rng = np.random.default_rng(seed)
    total = tokens_per_rank * ranks
    lengths = rng.integers(1, max_len + 1, size=int(2.4 * total / (max_len + 1)) + 64)
    n = int(np.searchsorted(np.cumsum(lengths), total)) + 1
    if n > lengths.size:
        raise AssertionError("drew too few samples")
    lengths = lengths[:n]
    dp = ranks // _BLOCK
    ids = np.arange(n, dtype=np.int64)
    teacher = np.array_split(ids, dp)  # the same number of samples per DP rank
    cuts = np.searchsorted(np.cumsum(lengths), np.arange(1, dp) * (lengths.sum() / dp))
    student = np.split(ids, cuts)  # about the same number of tokens per DP rank
    return _Samples(lengths_S=lengths, teacher_parts=teacher, student_parts=student)


def _layout(
    ids: np.ndarray, lengths_S: np.ndarray, cp: int, cp_rank: int, mult: int
) -> TokenLayout:
    lens = lengths_S[ids]
    padded = (lens + mult - 1) // mult * mult
    cu = np.concatenate([[0], np.cumsum(padded)])
    return packed_layout(
        torch.from_numpy(ids),
        torch.from_numpy(lens),
        cu_seqlens_padded=torch.from_numpy(cu),
        cp_size=cp,
        cp_rank=cp_rank,
    )


def _mult(tp: int, cp: int) -> int:
    """Megatron's THD padding under CP with SP: each sequence to a multiple of ``2 * cp * tp``."""
    return 2 * cp * tp


@dataclass(frozen=True, kw_only=True, eq=False)
class Step:
    """One simulated step: meshes, topology, the gathered matrix and what it cost to build."""

    ranks: int
    tokens: int
    samples: int
    topology: Topology
    matrix_NW: np.ndarray
    sizes_N: np.ndarray
    setup_s: float
    topology_ms: float


def build_step(ranks: int, *, tokens_per_rank: int, max_len: int, seed: int = 0) -> Step:
    """Every rank's record (:func:`~mopd.bridge.metadata.encode_step_record`) and the matrix.

    Built one DP index (16 ranks) at a time; ranks whose records are identical (same shards,
    same leader roles) share one encoding.
    """
    t0 = time.perf_counter()
    teacher, student = _meshes(ranks)
    smp = _samples(ranks, tokens_per_rank, max_len, seed)
    records: list[np.ndarray] = []
    for d in range(teacher.dp):
        t_lay = [
            _layout(smp.teacher_parts[d], smp.lengths_S, _T_CP, c, _mult(_T_TP, _T_CP))
            for c in range(_T_CP)
        ]
        s_lay = [
            _layout(smp.student_parts[d], smp.lengths_S, _S_CP, c, _mult(_S_TP, _S_CP))
            for c in range(_S_CP)
        ]
        same: dict[tuple[int, bool, int, bool], np.ndarray] = {}
        for r in range(d * _BLOCK, (d + 1) * _BLOCK):
            tc, sc = teacher.coord(r), student.coord(r)
            assert tc is not None and sc is not None
            key = (tc.cp_rank, tc.tp_rank == 0, sc.cp_rank, sc.tp_rank == 0)
            if key not in same:
                sections = [
                    Section(
                        layouts=[t_lay[tc.cp_rank]],
                        send_runs=tc.tp_rank == 0,
                        dtype=torch.bfloat16,
                        hidden=8192,
                    ),
                    Section(layouts=[s_lay[sc.cp_rank]], send_runs=sc.tp_rank == 0),
                ]
                rec = encode_step_record(config_sig=1, n_slots=1, error="", sections=sections)
                same[key] = rec.numpy()
            records.append(same[key])
    sizes = np.asarray([x.size for x in records], dtype=np.int64)
    matrix = np.zeros((ranks, int(sizes.max())), dtype=np.int64)
    for j, x in enumerate(records):
        matrix[j, : x.size] = x
    del records
    t1 = time.perf_counter()
    topo = Topology.build([teacher], student)
    _ = topo.index
    topology_ms = 1e3 * (time.perf_counter() - t1)
    return Step(
        ranks=ranks,
        tokens=int(smp.lengths_S.sum()),
        samples=int(smp.lengths_S.size),
        topology=topo,
        matrix_NW=matrix,
        sizes_N=sizes,
        setup_s=time.perf_counter() - t0,
        topology_ms=topology_ms,
    )


def _plan_one(step: Step, rank: int) -> tuple[Any, list[str]]:
    """What one rank does per micro-batch once the matrix is there."""
    m = StepMatrix(step.matrix_NW)
    catalog = step.topology.catalog(m, 0)
    return plan_rank(catalog, rank), check_rank(catalog, rank)


def _groups_read(step: Step, rank: int) -> int:
    """How many groups' runs ``rank`` reads to plan and check (not timed)."""
    m = StepMatrix(step.matrix_NW)
    cat = step.topology.catalog(m, 0)
    counting, source_ids, dest_ids = cat.recording_reads()
    plan_rank(counting, rank)
    check_rank(counting, rank)
    return len(source_ids) + len(dest_ids)


def representative_ranks(ranks: int) -> list[int]:
    """Rank 0 (teacher and student group leader: checks both), one in the middle (no leader),
    and the last teacher leader (a student leader too)."""
    return sorted({0, ranks // 2 + 5, ranks - _BLOCK // 2})


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


@dataclass(frozen=True, kw_only=True)
class AllGatherModel:
    """The metadata all-gather of one step at ``n`` ranks.

    Attributes:
        bytes_per_rank: mean record bytes (what a rank contributes before padding).
        padded_bytes_per_rank: the widest record (every record travels padded to it).
        gathered_bytes: what every rank receives and holds (``n`` padded records).
        ring_ms: flat ring, two all-gathers (sizes, then records):
            ``2 (n - 1) alpha + (n - 1) w / beta``.
        hier_ms: two levels (nodes of ``NODE`` ranks): gather to a node leader over NVLink, a
            ring over the ``n / NODE`` leaders carrying ``NODE`` records a step, a broadcast of
            the matrix inside the node; both collectives.
    """

    bytes_per_rank: float
    padded_bytes_per_rank: int
    gathered_bytes: int
    ring_ms: float
    hier_ms: float


def model_allgather(n: int, sizes_N: np.ndarray) -> AllGatherModel:
    """The model of :class:`AllGatherModel` for records of ``sizes_N`` int64 words."""
    w = int(sizes_N.max()) * 8
    ring = 2 * (n - 1) * ALPHA_S + (n - 1) * w / BETA_BPS
    leaders = max(n // NODE, 1)
    inside = 2 * (NODE - 1) * ALPHA_NVL_S + (NODE - 1) * w / BETA_NVL_BPS
    across = 2 * (leaders - 1) * ALPHA_S + (leaders - 1) * NODE * w / BETA_BPS
    bcast = 2 * math.log2(NODE) * ALPHA_NVL_S + n * w / BETA_NVL_BPS
    return AllGatherModel(
        bytes_per_rank=float(sizes_N.mean()) * 8,
        padded_bytes_per_rank=w,
        gathered_bytes=n * w,
        ring_ms=1e3 * ring,
        hier_ms=1e3 * (inside + across + bcast),
    )


def recorded_global(results_dir: Path | None = None) -> dict[int, dict[str, float | None]]:
    """The retired global planner's recorded figures per rank count (empty where the record is
    not there, e.g. in an installed package, whose wheel leaves ``results/`` out)."""
    import csv

    path = (results_dir or Path(__file__).resolve().parent / "results") / f"{BASELINE}.csv"
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


def _row(
    step: Step, local: dict[str, float], glob: dict[str, float | None], rss_mib: float
) -> dict:
    model = model_allgather(step.ranks, step.sizes_N)
    matrix_mib = step.matrix_NW.nbytes / 2**20
    return {
        "ranks": step.ranks,
        "tokens": step.tokens,
        "samples": step.samples,
        "plan_ms": round(local["plan_ms"], 4),
        "plan_ms_min": round(local["plan_ms_min"], 4),
        "global_plan_ms": glob.get("global_plan_ms"),
        "groups_read": int(local["groups_read"]),
        "groups": len(step.topology.sources) + len(step.topology.dests),
        "metadata_bytes_per_rank": round(model.bytes_per_rank, 1),
        "metadata_padded_bytes_per_rank": model.padded_bytes_per_rank,
        "allgather_bytes": model.gathered_bytes,
        "allgather_ring_ms": round(model.ring_ms, 3),
        "allgather_hier_ms": round(model.hier_ms, 3),
        "peak_mib": round(matrix_mib + local["plan_alloc_mib"], 3),
        "matrix_mib": round(matrix_mib, 3),
        "plan_alloc_mib": round(local["plan_alloc_mib"], 3),
        "global_rss_growth_mib": glob.get("global_rss_growth_mib"),
        "setup_s": round(step.setup_s, 2),
        "setup_rss_mib": round(rss_mib, 1),
        "topology_build_ms": round(step.topology_ms, 2),
    }


def _plot(rows: Sequence[dict], png: Path, tokens_per_rank: int) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11.0, 4.4), layout="constrained")
    FigureCanvasAgg(fig)
    n = [r["ranks"] for r in rows]
    ax, bx = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    ax.plot(n, [r["plan_ms"] for r in rows], "o-", label="local plan, one rank (plan_ms)")
    g = [(r["ranks"], r["global_plan_ms"]) for r in rows if r["global_plan_ms"] is not None]
    if g:
        ax.plot(
            *zip(*g, strict=True), "s--", label=f"retired global planner (every rank; {BASELINE})"
        )
    ax.plot(
        n, [r["allgather_ring_ms"] for r in rows], "^:", label="metadata all-gather, ring (model)"
    )
    ax.plot(
        n,
        [r["allgather_hier_ms"] for r in rows],
        "v:",
        label="metadata all-gather, 2-level (model)",
    )
    ax.set(xscale="log", yscale="log", xlabel="ranks", ylabel="ms per step", title="time")
    bx.plot(n, [r["peak_mib"] for r in rows], "o-", label="local plan: matrix + planning peak")
    bx.plot(n, [r["plan_alloc_mib"] for r in rows], "o:", label="local plan: planning peak alone")
    m = [(r["ranks"], r["global_rss_growth_mib"]) for r in rows if r["global_rss_growth_mib"]]
    if m:
        bx.plot(*zip(*m, strict=True), "s--", label="retired global planner: RSS growth (recorded)")
    bx.set(xscale="log", yscale="log", xlabel="ranks", ylabel="MiB", title="memory")
    for x in (ax, bx):
        x.grid(alpha=0.3, which="both")
        x.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    fig.suptitle(
        f"Planning one step, ~{tokens_per_rank:,} tokens per rank (teacher tp8 cp2, student tp4 "
        "cp4, colocated, THD); one CPU thread",
        fontsize=9,
    )
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def _notes(rows: Sequence[dict], args: argparse.Namespace, load: tuple[float, float]) -> str:
    by = {r["ranks"]: r for r in rows}
    lines = [
        f"One CPU thread of this machine (a shared {os.cpu_count()}-core box; load average "
        f"{load[0]:.1f} at the start and {load[1]:.1f} at the end of the run): absolute times "
        "are noisy, the shape against ranks is the figure. Per rank count: one simulated step, "
        f"{args.tokens_per_rank} real tokens per rank on average, lengths uniform in "
        f"[1, {args.max_len}], teacher tp8 cp2 and student tp4 cp4 colocated on the same ranks "
        "(rank r is both), THD both sides padded to 2 cp tp per sequence, DP ranks holding "
        "contiguous sample ids (teacher: equal sample counts; student: equal tokens).",
        f"`plan_ms`: decode (StepMatrix + Topology.catalog) + plan_rank + check_rank of one rank, "
        f"median of {args.repeats}, the slowest of three ranks (rank 0, one in the middle, the "
        "last teacher leader); `plan_ms_min` the fastest. `groups_read`: the most groups (of `groups`) whose runs one of them reads. "
        "`global_plan_ms`: the retired global planner (every rank planned the whole job), as "
        f"recorded in profiling/results/{BASELINE}.md at the same setup; empty at another "
        "setup or rank count, or where the record is absent.",
        "`peak_mib` = `matrix_mib` (the gathered metadata every rank holds) + `plan_alloc_mib` "
        "(tracemalloc peak of decoding and planning). `global_rss_growth_mib`: the retired "
        "planner's recorded RSS high-water mark above its inputs. `setup_rss_mib`: this process's peak "
        "RSS after building the records (setup, not planning).",
        f"All-gather model: records padded to the widest (`metadata_padded_bytes_per_rank`), "
        f"two collectives (sizes, records); ring: 2 (n-1) alpha + (n-1) w / beta with alpha = "
        f"{ALPHA_S * 1e6:g} us per hop and beta = {BETA_BPS / 1e9:g} GB/s; 2-level: nodes of "
        f"{NODE} (NVLink alpha {ALPHA_NVL_S * 1e6:g} us, {BETA_NVL_BPS / 1e9:g} GB/s), a ring "
        "over node leaders, a broadcast inside the node.",
    ]
    lo, hi = by.get(1024), by.get(16384)
    if lo and hi:
        lines.append(
            f"Flatness: plan_ms at 16,384 ranks is {hi['plan_ms'] / lo['plan_ms']:.2f}x that at "
            "1,024 (target <= 2x)."
        )
    mid = by.get(4096)
    if mid:
        ok = mid["plan_ms"] <= 20 and mid["peak_mib"] <= 200
        lines.append(
            f"At 4,096 ranks: {mid['plan_ms']:.2f} ms and {mid['peak_mib']:.1f} MiB "
            f"({'meets' if ok else 'misses'} the <= 20 ms, <= 200 MiB target)."
        )
    ratios = [
        f"{r['ranks']:,} ranks: {2e3 * (r['ranks'] - 1) * ALPHA_S:.3g} ms latency against "
        f"{1e3 * (r['ranks'] - 1) * r['metadata_padded_bytes_per_rank'] / BETA_BPS:.2g} ms "
        "bandwidth"
        for r in rows
    ]
    lines.append(
        "Where the all-gather must become hierarchical: a record is a few KiB, so the flat ring "
        f"is latency-bound at every size ({'; '.join(ratios)}). It passes 10 ms a step at about "
        f"{int(1 + 1e-2 / (2 * ALPHA_S)):,} ranks: from 1,024 ranks on it should go through node "
        "leaders (the 2-level column: n / 8 ring steps) or a log-depth all-gather "
        "(2 log2(n) steps, which leaves the bandwidth term: a few ms at 16,384). Past 4,096 "
        "ranks the gathered matrix itself (every rank holds n padded records, `matrix_mib`) is "
        "the largest memory cost of planning: gather only the slot tables (sample ranges, "
        "rows) from everyone and the runs from the peers they name."
    )
    return "\n\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=list(DEFAULT_RANKS))
    parser.add_argument("--tokens-per-rank", type=int, default=4096)
    parser.add_argument("--max-len", type=int, default=4096, help="longest sample")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=9, help="timed calls per rank")
    parser.add_argument("--json", action="store_true", help="one JSON object per rank count")
    parser.add_argument("--results-dir", type=Path, default=None)
    parser.add_argument("--no-record", action="store_true", help="print only")
    args = parser.parse_args(argv)
    same_setup = all(getattr(args, k) == v for k, v in _BASELINE_SETUP.items())
    baseline = recorded_global() if same_setup else {}
    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]
    rows = []
    for i, n in enumerate(args.ranks):
        t0 = time.perf_counter()
        print(f"bench_plan: [{i + 1}/{len(args.ranks)}] {n} ranks ...", file=sys.stderr, flush=True)
        step = build_step(
            n, tokens_per_rank=args.tokens_per_rank, max_len=args.max_len, seed=args.seed
        )
        rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        local = measure_local(step, representative_ranks(n), args.repeats)
        row = _row(step, local, baseline.get(n, {}), rss_mib)
        del step
        gc.collect()
        rows.append(row)
        print(
            f"bench_plan: [{i + 1}/{len(args.ranks)}] {n} ranks done in "
            f"{time.perf_counter() - t0:.1f} s (one rank plans in {row['plan_ms']:.3g} ms)",
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
            "plan-scale", rows, out_dir=args.results_dir, notes=notes, env=env
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
