"""Benchmark: what a ``mopd.common.ranges`` span costs, off and on, next to its peers.

Why this file exists: the ranges sit on every phase of every step, so their cost when off must be
shown, not assumed (a timed unit test would be flaky; a benchmark line is the project's rule).
Peers in the same run: an empty loop, a fresh ``contextlib.nullcontext()``, a bare NVTX push/pop
and a bare ``torch.profiler.record_function``; each row's ratio is against ``nullcontext``.

These are host-side costs, so a CPU run measures them as well as a GPU machine's (the figures
are per machine). The plot is on a log scale: it exists to show the near-zero cost of the OFF
rows beside peers that cost tens of times more.

Run: ``python -m mopd.profiling.bench.ranges [--iters N] [--repeat R] [--results-dir DIR]``
(or ``mopd bench ranges``). Records ``ranges-<machine>-<date>.{csv,md,png}`` under the results
folder (:func:`mopd.profiling.results.default_results_dir`).
"""

from __future__ import annotations

import contextlib
import statistics
import timeit
from collections.abc import Callable, Sequence
from pathlib import Path

from mopd.profiling.extras import can_draw
from mopd.profiling.mesh_arg import OneLineParser, prog_for

__all__ = ["main", "measure", "plot"]


def measure(fn: Callable[[], object], iters: int, repeat: int) -> tuple[float, float]:
    """(median, best) over ``repeat`` runs of the per-call time of ``fn``, in nanoseconds."""
    times = timeit.repeat(fn, number=iters, repeat=repeat)
    return statistics.median(times) / iters * 1e9, min(times) / iters * 1e9


def _cases() -> list[tuple[str, bool, Callable[[], object]]]:
    """(case, ranges on?, one call) for every row."""
    import torch

    from mopd.common import ranges

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


def plot(rows: Sequence[dict[str, object]], png: Path, title: str) -> Path:
    """Per-call time of every row on a log axis: OFF rows, ON rows and the peers apart."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cases = [str(r["case"]) for r in rows]
    ns = [float(r["time_ns"]) for r in rows]  # type: ignore[arg-type]
    colors = [
        "tab:green" if " OFF" in c else "tab:orange" if " ON " in c else "#7f7f7f" for c in cases
    ]
    fig = Figure(figsize=(9.0, 0.42 * len(rows) + 1.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    pos = list(range(len(rows)))
    bars = ax.barh(pos, ns, color=colors)
    ax.set_yticks(pos, cases, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("ns per call (median; log scale)")
    ax.bar_label(
        bars,
        labels=[
            f"{v:.0f} ns ({float(r['x_vs_nullcontext']):.2f}x)"
            for v, r in zip(ns, rows, strict=True)
        ],  # type: ignore[arg-type]
        padding=3,
        fontsize=7,
    )
    ax.margins(x=0.25)
    ax.grid(axis="x", alpha=0.3, which="both")
    from matplotlib.patches import Patch

    legend = [
        Patch(color="tab:green", label="ranges off (what every unprofiled run pays)"),
        Patch(color="tab:orange", label="ranges on, no profiler attached"),
        Patch(color="#7f7f7f", label="peers; (x) = time / nullcontext"),
    ]
    ax.legend(handles=legend, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    ax.set_title(title, fontsize=9)
    fig.savefig(png, dpi=110)
    return png


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(
        prog=prog_for("mopd.profiling.bench.ranges"), description=__doc__.splitlines()[0]
    )
    parser.add_argument("--iters", type=int, default=50_000, help="calls per timing run")
    parser.add_argument("--repeat", type=int, default=5, help="timing runs (median taken)")
    parser.add_argument("--results-dir", type=Path, default=None, help="results folder")
    parser.add_argument("--no-record", action="store_true", help="print only")
    args = parser.parse_args(argv)
    if args.iters < 1 or args.repeat < 1:
        parser.error(f"--iters and --repeat must be >= 1, got {args.iters}, {args.repeat}")
    from mopd.common import ranges
    from mopd.profiling.results import Progress, format_table, record

    previous = ranges.enable(False)
    rows: list[dict[str, object]] = []
    cases = _cases()
    try:
        with Progress(total=len(cases), desc="ranges") as bar:
            for case, on, fn in cases:
                bar.start(case)
                ranges.enable(on)
                median_ns, best_ns = measure(fn, args.iters, args.repeat)
                rows.append({"case": case, "time_ns": median_ns, "best_ns": best_ns})
                bar.step()
    finally:
        ranges.enable(previous)
    base = next(r["time_ns"] for r in rows if str(r["case"]).startswith("contextlib"))
    for row in rows:
        row["x_vs_nullcontext"] = float(row["time_ns"]) / float(base)  # type: ignore[arg-type]
    print(format_table(rows))
    if args.no_record:
        return 0
    notes = (
        f"Per-call cost (time_ns: median, best_ns: minimum) of {args.repeat} runs x {args.iters} "
        f"calls; NVTX backend: {ranges.nvtx_backend()}; no profiler or nsys attached (the cost "
        "an unprofiled run pays). Host-side costs: a CPU machine measures them as a GPU one does."
    )
    csv_path, md_path = record("ranges", rows, out_dir=args.results_dir, notes=notes)
    recorded = [csv_path, md_path]
    if can_draw("mopd bench ranges"):
        recorded.append(
            plot(rows, csv_path.with_suffix(".png"), f"{csv_path.stem}: one span, off and on")
        )
    print(f"recorded {', '.join(map(str, recorded))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
