"""Benchmark of the row kernels against the device copy and torch's own row ops.

Why this file exists: the layout kernels' target is >= 95% of the measured device-to-device copy
bandwidth (the issue's naive grid-stride figure was 90-92% on an H200; our ``grid`` variant
measured 80-85% there, ``warp`` 92-93%). This script measures, in one run
and side by side, the ceiling (``dst.copy_(src)``), torch's ``index_select``, ``index_copy_`` and
an ``[S, B, H] -> [B, S, H]`` transpose copy, and every variant of every kernel (gather, scatter,
runs) on random and run-structured (mostly contiguous) indices, in GB/s and % of the ceiling,
then records the table with :func:`mopd.profiling.results.record`.

Method: bytes counted are read + written (2x the payload; index reads ignored, < 0.1%); buffers
>= 1 GiB, two sets used in turn so L2 cannot help; CUDA events around each call, warm-up first,
the median of ``--iters`` (>= 15) calls. Every kernel's output is compared bit for bit with
torch's once (``bit_exact`` column). A variant that raises becomes an ERROR row (the peers'
rows stay); a run cut short (Ctrl-C, or SIGTERM from a time limit) still prints and records the
rows measured so far, marked as cut short. The table is printed once, at the end; while it runs,
a progress bar on stderr names the case being measured (on a terminal only). The summary line names the best variant per op (gather, scatter, copy_runs), ranked
by its mean % of the copy over the index kinds, and prints them as a ``DEFAULT_VARIANTS`` dict
for :mod:`mopd.kernels.rows.cupy_rows`. With all variants it runs in well under a minute on an H200
(plus the one-time NVRTC compile of rows.cu when CuPy's cache is cold).

Run: ``python -m mopd.profiling.bench.kernels`` on a GPU; ``--quick`` for a small CPU run that
only checks the harness (torch twins, perf_counter timing: functional figures, not performance,
as its table, notes and plot say; nothing recorded unless ``--results-dir`` is given).
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from mopd.kernels.backend import cupy_available
from mopd.kernels.rows import copy_runs, gather_rows, scatter_rows
from mopd.kernels.rows.cupy_rows import DEFAULT_VARIANTS, OPS, VARIANTS
from mopd.profiling.mesh_arg import OneLineParser, prog_for
from mopd.profiling.results import CPU_CAVEAT, Progress, environment, format_table, record
from mopd.profiling.timing import time_calls

__all__ = ["main", "run_structured_index", "summarize"]

Row = dict[str, Any]


def run_structured_index(
    n_rows: int, min_run: int, max_run: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A permutation of ``[0, n_rows)`` made of contiguous runs, shuffled run by run.

    Returns ``(index_R, src_start_K, dst_start_K, length_K)`` on the CPU: ``index_R`` lists the
    runs' rows in their shuffled order, so gathering with it equals ``copy_runs`` with the runs.
    """
    lengths: list[int] = []
    total = 0
    while total < n_rows:
        length = int(torch.randint(min_run, max_run + 1, (1,), generator=gen))
        length = min(length, n_rows - total)
        lengths.append(length)
        total += length
    length_K = torch.tensor(lengths, dtype=torch.int64)
    starts_K = torch.cumsum(length_K, 0) - length_K
    order_K = torch.randperm(len(lengths), generator=gen)
    src_start_K = starts_K[order_K]
    length_K = length_K[order_K]
    dst_start_K = torch.cumsum(length_K, 0) - length_K
    index_R = torch.cat(
        [
            torch.arange(s, s + n)
            for s, n in zip(src_start_K.tolist(), length_K.tolist(), strict=True)
        ]
    )
    return index_R, src_start_K, dst_start_K, length_K


def _timer(
    device: torch.device, *, iters: int, warmup: int
) -> Callable[[Callable[[int], object]], float]:
    """Median milliseconds of ``fn(i)``: calls queued back to back, each timed on the device."""

    def median_ms(fn: Callable[[int], object]) -> float:
        times = time_calls(fn, device=device, iters=iters, warmup=warmup, back_to_back=True)
        return statistics.median(times)

    return median_ms


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _gather(
    srcs: list[torch.Tensor],
    dsts: list[torch.Tensor],
    idx: torch.Tensor,
    kw: dict[str, Any],
    i: int,
) -> None:
    gather_rows(srcs[i % 2], idx, out_RH=dsts[i % 2], **kw)


def _scatter(
    srcs: list[torch.Tensor],
    dsts: list[torch.Tensor],
    idx: torch.Tensor,
    kw: dict[str, Any],
    i: int,
) -> None:
    scatter_rows(srcs[i % 2], idx, dsts[i % 2], **kw)


def _runs(
    srcs: list[torch.Tensor],
    dsts: list[torch.Tensor],
    runs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    kw: dict[str, Any],
    i: int,
) -> None:
    copy_runs(srcs[i % 2], *runs, dsts[i % 2], **kw)


def bench(args: argparse.Namespace, rows: list[Row] | None = None) -> tuple[list[Row], str]:
    """Run every measurement; returns the rows and a summary line.

    ``rows``: a list the rows are appended to as they are measured (a caller that is
    interrupted keeps the rows so far).
    """
    cuda = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16
    h = args.hidden
    row_bytes = h * 2
    n = max(16, int(args.gib * 2**30) // row_bytes) // 16 * 16  # divisible by B = 16
    payload = n * row_bytes
    gen = torch.Generator().manual_seed(0)
    timer = _timer(device, iters=args.iters, warmup=args.warmup)

    # two buffer sets, used in turn
    gen_dev = torch.Generator(device=device).manual_seed(1)
    srcs = [torch.randn(n, h, dtype=dtype, device=device, generator=gen_dev) for _ in range(2)]
    dsts = [torch.empty(n, h, dtype=dtype, device=device) for _ in range(2)]
    rand_idx = torch.randperm(n, generator=gen).to(device)
    run_idx, src_start, dst_start, length = (
        t.to(device) for t in run_structured_index(n, args.min_run, args.max_run, gen)
    )
    indices = {"random": rand_idx, "runs": run_idx}
    b_len = 16
    s_len = n // b_len
    b_idx, s_idx = torch.meshgrid(
        torch.arange(b_len, device=device), torch.arange(s_len, device=device), indexing="ij"
    )
    transpose_idx = (s_idx * b_len + b_idx).reshape(-1)

    rows = [] if rows is None else rows
    wanted = [v for v in VARIANTS if args.variants is None or v in args.variants]
    variants: list[str | None] = wanted if cuda and cupy_available() else [None]
    per_variant = [7 if v in (None, DEFAULT_VARIANTS["gather"]) else 5 for v in variants]
    bar = Progress(total=6 + sum(per_variant), desc="kernels", quiet=args.no_progress)

    def add(
        op: str, indices_kind: str, impl: str, ms: float, exact: object = "", nbytes: int = 0
    ) -> None:
        nbytes = nbytes or payload
        row = {
            "op": op,
            "indices": indices_kind,
            "impl": impl,
            "payload_GiB": nbytes / 2**30,
            "ms": ms,
            "GB/s": 2 * nbytes / (ms * 1e-3) / 1e9,
            "bit_exact": exact,
        }
        rows.append(row)
        share = 100.0 * row["GB/s"] / rows[0]["GB/s"]  # rows[0] is the copy ceiling
        bar.step(f"{op} | {indices_kind} | {impl}: {row['GB/s']:.0f} GB/s, {share:.1f}% of copy")

    add("copy (ceiling)", "-", "tensor.copy_", timer(lambda i: dsts[i % 2].copy_(srcs[i % 2])))
    for kind, idx in indices.items():
        add(
            "gather",
            kind,
            "torch.index_select",
            timer(lambda i, idx=idx: torch.index_select(srcs[i % 2], 0, idx, out=dsts[i % 2])),
        )
        add(
            "scatter",
            kind,
            "torch.index_copy_",
            timer(lambda i, idx=idx: dsts[i % 2].index_copy_(0, idx, srcs[i % 2])),
        )
    add(
        "transpose [S,B,H]->[B,S,H]",
        "-",
        "torch copy_(transpose)",
        timer(
            lambda i: (
                dsts[i % 2]
                .view(b_len, s_len, h)
                .copy_(srcs[i % 2].view(s_len, b_len, h).transpose(0, 1))
            )
        ),
    )

    def measure(name: str, variant: str | None, kw: dict[str, Any]) -> None:
        for kind, idx in indices.items():
            ms = timer(partial(_gather, srcs, dsts, idx, kw))
            add("gather", kind, name, ms, _bits_equal(dsts[0], torch.index_select(srcs[0], 0, idx)))
            ms = timer(partial(_scatter, srcs, dsts, idx, kw))
            ref = torch.empty_like(srcs[0]).index_copy_(0, idx, srcs[0])
            add("scatter", kind, name, ms, _bits_equal(dsts[0], ref))
            del ref
        ms = timer(partial(_runs, srcs, dsts, (src_start, dst_start, length), kw))
        exact = _bits_equal(dsts[0], torch.index_select(srcs[0], 0, run_idx))
        add("copy_runs", f"runs (K={length.numel()})", name, ms, exact)
        if variant in (None, DEFAULT_VARIANTS["gather"]):
            ms = timer(partial(_gather, srcs, dsts, transpose_idx, kw))
            exact = _bits_equal(
                dsts[0].view(b_len, s_len, h), srcs[0].view(s_len, b_len, h).transpose(0, 1)
            )
            add("transpose [S,B,H]->[B,S,H]", "computed", f"gather {name}", ms, exact)
            # views starting at element 1 (misaligned by 2 bytes): the 2-byte path
            m = n - 1
            mis_srcs = [t.view(-1)[1 : 1 + m * h].view(m, h) for t in srcs]
            mis_dsts = [t.view(-1)[1 : 1 + m * h].view(m, h) for t in dsts]
            idx_mis = rand_idx[rand_idx < m]
            ms = timer(partial(_gather, mis_srcs, mis_dsts, idx_mis, kw))
            exact = _bits_equal(mis_dsts[0], mis_srcs[0][idx_mis])
            add("gather (views at element 1)", "random", name, ms, exact, m * row_bytes)

    backend = "cupy" if variants[0] is not None else "torch"
    for variant in variants:
        name = f"{backend}:{variant}" if variant else "twin (torch)"
        kw: dict[str, Any] = {"backend": backend, "variant": variant, "check_bounds": False}
        try:
            measure(name, variant, kw)
        except Exception as exc:  # keep the peers' figures if one variant breaks
            rows.append({"op": "ERROR", "indices": "-", "impl": name, "bit_exact": repr(exc)})
            print(f"{name} failed: {exc!r}", file=sys.stderr, flush=True)
    bar.close()

    ceiling = rows[0]["GB/s"]
    for row in rows:
        if "GB/s" in row:
            row["%_of_copy"] = 100.0 * row["GB/s"] / ceiling
    return rows, summarize(rows)


def summarize(rows: list[Row]) -> str:
    """The best CuPy variant per op, ranked by mean % of the copy over the op's index kinds.

    Only the plain ops count (``gather``, ``scatter``, ``copy_runs`` on aligned rows), only
    bit-exact rows, and a variant must have every index kind of the op measured. Returns a line
    naming each winner with its figures, and the ``DEFAULT_VARIANTS`` dict they make.
    """
    per_op: dict[str, dict[str, dict[str, float]]] = {op: {} for op in OPS}
    kinds: dict[str, set[str]] = {op: set() for op in OPS}
    for row in rows:
        op, impl = row["op"], str(row["impl"])
        if op not in per_op or "%_of_copy" not in row or not impl.startswith("cupy:"):
            continue
        kinds[op].add(row["indices"])
        if row["bit_exact"] is True:
            per_op[op].setdefault(impl.removeprefix("cupy:"), {})[row["indices"]] = row["%_of_copy"]
    parts: list[str] = []
    winners: dict[str, str] = {}
    for op in OPS:
        complete = {v: f for v, f in per_op[op].items() if set(f) == kinds[op]}
        if not complete:
            continue
        best = max(complete, key=lambda v: sum(complete[v].values()) / len(complete[v]))
        winners[op] = best
        figures = ", ".join(f"{k} {x:.1f}%" for k, x in sorted(complete[best].items()))
        mean = sum(complete[best].values()) / len(complete[best])
        parts.append(f"best {op}: {best} (mean {mean:.1f}% of copy: {figures})")
    if not parts:
        return "no CuPy kernels measured (CPU or CuPy missing): harness check only"
    return "; ".join(parts) + f". As defaults: DEFAULT_VARIANTS = {winners!r}"


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(
        prog=prog_for("mopd.profiling.bench.kernels"), description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="small CPU run: harness check only")
    parser.add_argument("--gib", type=float, default=None, help="payload per buffer (>= 1 on GPU)")
    parser.add_argument("--hidden", type=int, default=8192, help="H (bf16 elements per row)")
    parser.add_argument("--iters", type=int, default=None, help="timed calls (median)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--min-run", type=int, default=64, help="shortest run, rows")
    parser.add_argument("--max-run", type=int, default=512, help="longest run, rows")
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        default=None,
        help="measure only these CuPy variants (default: all)",
    )
    parser.add_argument("--results-dir", type=Path, default=None, help="where results go")
    parser.add_argument("--no-record", action="store_true", help="print only")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = parser.parse_args(argv)
    if args.gib is None:
        args.gib = 1 / 128 if args.quick else 1.0
    if args.iters is None:
        args.iters = 3 if args.quick else 15
    if args.quick:
        args.hidden = min(args.hidden, 1024)
        args.min_run, args.max_run = min(args.min_run, 8), min(args.max_run, 32)
    elif args.iters < 15 or args.gib < 1.0:
        raise ValueError(
            f"a measured run needs --iters >= 15 and --gib >= 1, got {args.iters}, {args.gib}"
        )

    rows: list[Row] = []
    cut_short = False

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # a time limit's SIGTERM: keep what was measured

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        rows, summary = bench(args, rows)
    except KeyboardInterrupt:
        cut_short = True
        for row in rows:
            if "GB/s" in row and rows and "GB/s" in rows[0]:
                row["%_of_copy"] = 100.0 * row["GB/s"] / rows[0]["GB/s"]
        summary = summarize(rows) if rows else "no row measured"
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not rows:
        print("bench_kernels: cut short before the first row", file=sys.stderr)
        return 130
    on_cpu = args.quick or not torch.cuda.is_available()  # bench() measures on the CPU then
    if on_cpu:
        print(f"{CPU_CAVEAT}{' (--quick: a harness check)' if args.quick else ''}.")
    if cut_short:
        print(f"CUT SHORT after {len(rows)} rows.")
    print(format_table(rows))
    print(summary)
    notes = (
        f"bf16 rows of H={args.hidden}; bytes = read + written; median of {args.iters} after "
        f"{args.warmup} warm-up calls, two buffer sets in turn; random = a permutation, runs = "
        f"contiguous runs of {args.min_run}-{args.max_run} rows in shuffled order. "
        f"Default variants: {DEFAULT_VARIANTS}. {summary}"
        + (" QUICK CPU RUN: harness check, not a measurement." if args.quick else "")
        + (f" {CPU_CAVEAT}." if on_cpu else "")
        + (f" CUT SHORT after {len(rows)} rows." if cut_short else "")
    )
    if not args.no_record and (args.results_dir is not None or not args.quick):
        csv_path, md_path = record(
            "kernels", rows, out_dir=args.results_dir, notes=notes, env=environment()
        )
        print(f"recorded {csv_path} and {md_path}")
    return 130 if cut_short else 0


if __name__ == "__main__":
    raise SystemExit(main())
