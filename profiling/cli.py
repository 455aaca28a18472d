"""The ``mopd`` command: ``mopd demo``, ``mopd plan``, ``mopd bench <name>``.

Why this file exists: one entry point (declared in pyproject.toml as
``mopd = "mopd.profiling.cli:main"``) for everything a person runs by hand. It only dispatches:

- ``mopd demo [ARGS...]``: ``mopd.profiling.demo:main(ARGS)``;
- ``mopd plan [ARGS...]``: ``mopd.profiling.plan_inspector:main(ARGS)``;
- ``mopd bench [--results-dir DIR] [--no-plot] NAME [ARGS...]``: runs
  ``python -m mopd.profiling.bench_NAME ARGS`` in a child process, then draws one PNG next to each
  CSV that the run created or rewrote under DIR (default: the results folder of
  :mod:`mopd.profiling.results`).

Everything after the subcommand (after NAME for bench) is passed through untouched, ``--help``
included. The target modules are imported lazily, so ``mopd --help`` stays fast and works before
they exist; a missing one exits with status 2 and says which.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["BENCHMARKS", "bench_module", "build_parser", "main"]

#: ``mopd bench NAME`` -> module ``mopd.profiling.bench_NAME``.
BENCHMARKS: tuple[str, ...] = ("capture", "bridge", "kernels", "kl", "ranges", "plan")

_ENTRY_POINTS: dict[str, str] = {
    "demo": "mopd.profiling.demo",
    "plan": "mopd.profiling.plan_inspector",
}

EXIT_USAGE = 2


def bench_module(name: str) -> str:
    """The module ``mopd bench NAME`` runs with ``python -m``."""
    return f"mopd.profiling.bench_{name}"


def build_parser() -> argparse.ArgumentParser:
    """The ``mopd`` argument parser (subcommands demo, plan, bench)."""
    parser = argparse.ArgumentParser(
        prog="mopd",
        description="mopd-bridge tools: the demo, the transfer-plan inspector, the benchmarks.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{demo,plan,bench}", required=True)
    sub.add_parser(
        "demo",
        help="run the end-to-end demo (arguments go to mopd.profiling.demo)",
        add_help=False,
        prefix_chars="\0",  # every token, --help included, is the demo's
    )
    sub.add_parser(
        "plan",
        help="inspect a transfer plan (arguments go to mopd.profiling.plan_inspector)",
        add_help=False,
        prefix_chars="\0",
    )
    bench = sub.add_parser(
        "bench",
        help="run a benchmark and plot the CSV it records",
        description="Run python -m mopd.profiling.bench_NAME ARGS, then plot each CSV it wrote.",
    )
    bench.add_argument(
        "--results-dir",
        type=Path,
        default=None,
        help="where the benchmark records its CSVs (default: mopd.profiling.results' folder)",
    )
    bench.add_argument("--no-plot", action="store_true", help="do not draw PNGs")
    bench.add_argument("name", choices=BENCHMARKS, help="which benchmark")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark")
    return parser


def _load_main(module_name: str) -> Callable[[list[str]], int | None] | None:
    """``module_name.main``, or ``None`` when that module itself does not exist."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            return None
        raise  # the module exists but something it imports is missing: show that
    return module.main


def _csv_snapshot(directory: Path) -> dict[Path, tuple[int, int]]:
    """``{csv path: (mtime_ns, size)}`` for the CSVs directly under ``directory``."""
    if not directory.is_dir():
        return {}
    return {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in directory.glob("*.csv")}


def _run_bench(name: str, args: Sequence[str], results_dir: Path | None, plot: bool) -> int:
    module = bench_module(name)
    if importlib.util.find_spec(module) is None:
        print(f"mopd bench: benchmark module {module} is not installed", file=sys.stderr)
        return EXIT_USAGE
    if results_dir is None:
        from mopd.profiling.results import default_results_dir

        results_dir = default_results_dir()
    before = _csv_snapshot(results_dir)
    rc = subprocess.call([sys.executable, "-m", module, *args])
    if rc != 0:
        print(f"mopd bench: {module} exited with status {rc}; nothing plotted", file=sys.stderr)
        return rc
    if not plot:
        return 0
    after = _csv_snapshot(results_dir)
    written = sorted(p for p, key in after.items() if before.get(p) != key)
    if not written:
        print(
            f"mopd bench: {module} recorded no CSV under {results_dir}; nothing plotted "
            "(use --results-dir if it writes elsewhere)",
            file=sys.stderr,
        )
        return 0
    from mopd.profiling.plots import plot_csv

    for csv_path in written:
        try:
            png = plot_csv(csv_path, csv_path.with_suffix(".png"))
        except ValueError as exc:  # a CSV without a plottable column: say so, keep going
            print(f"mopd bench: not plotted: {exc}", file=sys.stderr)
            continue
        print(f"mopd bench: plot {png}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mopd`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return _run_bench(args.name, args.args, args.results_dir, plot=not args.no_plot)
    leading = argv[: argv.index(args.command)]
    if leading:
        parser.error(f"unrecognized arguments before {args.command!r}: {' '.join(leading)}")
    module_name = _ENTRY_POINTS[args.command]
    entry = _load_main(module_name)
    if entry is None:
        print(f"mopd {args.command}: {module_name} is not available yet", file=sys.stderr)
        return EXIT_USAGE
    rc = entry(rest)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
