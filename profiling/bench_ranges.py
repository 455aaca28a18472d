"""Benchmark: what a ``mopd.profiling.ranges`` span costs, off and on, next to its peers.

Why this file exists: the ranges sit on every phase of every step, so their cost when off must be
shown, not assumed (a timed unit test would be flaky; a benchmark line is the project's rule).
Peers in the same run: an empty loop, a fresh ``contextlib.nullcontext()``, a bare NVTX push/pop
and a bare ``torch.profiler.record_function``; each row's ratio is against ``nullcontext``.

Run: ``python -m mopd.profiling.bench_ranges [--iters N] [--repeat R] [--results-dir DIR]``
(or ``mopd bench ranges``). Records ``ranges-<machine>-<date>.{csv,md}`` under
``profiling/results/``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import timeit
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from mopd.profiling import ranges
from mopd.profiling.results import format_table, record

__all__ = ["main", "measure"]


def measure(fn: Callable[[], object], iters: int, repeat: int) -> tuple[float, float]:
    """(median, best) over ``repeat`` runs of the per-call time of ``fn``, in nanoseconds."""
    times = timeit.repeat(fn, number=iters, repeat=repeat)
    return statistics.median(times) / iters * 1e9, min(times) / iters * 1e9


def _cases() -> list[tuple[str, bool, Callable[[], object]]]:
    """(case, ranges on?, one call) for every row."""
    span = ranges.span
    null = contextlib.nullcontext

    def empty() -> None:
        pass

    def fresh_null() -> None:
        with null():
            pass

    def span_off() -> None:
        with span("pack"):
            pass

    def span_off_detail() -> None:
        with span("loss_chunk", 7):
            pass

    @ranges.traced("plan")
    def traced_fn() -> None:
        pass

    def record_fn() -> None:
        with torch.autograd.profiler.record_function("mopd/bench"):
            pass

    cases: list[tuple[str, bool, Callable[[], object]]] = [
        ("empty call (floor)", False, empty),
        ("contextlib.nullcontext() fresh", False, fresh_null),
        ("ranges.span('pack') OFF", False, span_off),
        ("ranges.span('loss_chunk', 7) OFF", False, span_off_detail),
        ("@ranges.traced('plan') call OFF", False, traced_fn),
        ("record_function alone (no profiler)", False, record_fn),
    ]
    backend = ranges.nvtx_backend()
    if backend != "none":
        _, push, pop = ranges._resolve_backend()

        def nvtx_alone() -> None:
            push("mopd/bench")
            pop()

        cases.append((f"NVTX push+pop alone ({backend})", False, nvtx_alone))
    cases += [
        ("ranges.span('pack') ON (no torch profiler)", True, span_off),
        ("ranges.span('loss_chunk', 7) ON (no torch profiler)", True, span_off_detail),
        ("@ranges.traced('plan') call ON (no torch profiler)", True, traced_fn),
    ]
    return cases


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=50_000, help="calls per timing run")
    parser.add_argument("--repeat", type=int, default=5, help="timing runs (median taken)")
    parser.add_argument("--results-dir", type=Path, default=None, help="results folder")
    args = parser.parse_args(argv)
    if args.iters < 1 or args.repeat < 1:
        raise ValueError(f"--iters and --repeat must be >= 1, got {args.iters}, {args.repeat}")

    previous = ranges.enable(False)
    rows: list[dict[str, object]] = []
    try:
        for case, on, fn in _cases():
            ranges.enable(on)
            median_ns, best_ns = measure(fn, args.iters, args.repeat)
            rows.append({"case": case, "time_ns": median_ns, "best_ns": best_ns})
    finally:
        ranges.enable(previous)
    base = next(r["time_ns"] for r in rows if str(r["case"]).startswith("contextlib"))
    for row in rows:
        row["x_vs_nullcontext"] = float(row["time_ns"]) / float(base)  # type: ignore[arg-type]
    print(format_table(rows))
    notes = (
        f"Per-call cost (time_ns: median, best_ns: minimum) of {args.repeat} runs x {args.iters} calls; NVTX backend: "
        f"{ranges.nvtx_backend()}; no profiler or nsys attached (the cost an unprofiled run pays)."
    )
    csv_path, md_path = record("ranges", rows, out_dir=args.results_dir, notes=notes)
    print(f"recorded {csv_path} and {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
