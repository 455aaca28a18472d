"""The ``mopd`` command: ``mopd demo``, ``mopd plan``, ``mopd bench <name>``, ``mopd nsys``,
``mopd --version``.

Why this file exists: one entry point (the ``mopd`` console script, and ``python -m mopd``) for
everything a person runs by hand. It only dispatches:

- ``mopd demo [ARGS...]``: ``mopd.profiling.demo:main(ARGS)``;
- ``mopd plan [ARGS...]``: ``mopd.profiling.plan:main(ARGS)``;
- ``mopd nsys [ARGS...] [-- CMD...]``: the package's ``nsys.sh`` (one Nsight Systems report per
  rank of the demo or of CMD, the mopd ranges on) run with ``bash``, from the installed package;
- ``mopd bench [--results-dir DIR] [--no-plot] NAME [ARGS...]``: runs
  ``python -m mopd.profiling.bench.NAME [--results-dir DIR] ARGS`` in a child process, then
  draws one PNG next to each CSV that the run created or rewrote under DIR, unless the
  benchmark drew its own plot of it. DIR defaults to :func:`mopd.profiling.results.
  default_results_dir`: ``mopd-results/`` at the root of a checkout (git ignores it),
  ``./mopd-results/`` elsewhere.

Everything after the subcommand (after NAME for bench) is passed through untouched, ``--help``
included (``mopd bench NAME --help`` is the benchmark's help alone, its usage naming the command
as typed). Nothing heavy is imported here and the targets are imported lazily, so ``mopd --help``
and a mistyped command answer at once, in one line; a missing target exits with status 2 and
says which.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from mopd.profiling.mesh_arg import OneLineParser

__all__ = ["BENCHMARKS", "bench_module", "build_parser", "main", "nsys_script", "version"]

#: ``mopd bench NAME`` -> module ``mopd.profiling.bench.NAME``.
BENCHMARKS: tuple[str, ...] = (
    "capture", "bridge", "kernels", "kl", "ranges", "plan", "overlap", "worlds",
)  # fmt: skip

_ENTRY_POINTS: dict[str, str] = {
    "demo": "mopd.profiling.demo",
    "plan": "mopd.profiling.plan",
}

EXIT_USAGE = 2
_DIST = "mopd-bridge"


def bench_module(name: str) -> str:
    """The module ``mopd bench NAME`` runs with ``python -m``."""
    return f"mopd.profiling.bench.{name}"


def nsys_script() -> Path:
    """The ``nsys.sh`` shipped in the installed package (package data of ``mopd.profiling``)."""
    from importlib import resources

    return Path(str(resources.files("mopd.profiling") / "nsys.sh"))


def version() -> str:
    """The installed package's version (its metadata), or ``"unknown"`` outside an install."""
    from importlib import metadata

    try:
        return metadata.version(_DIST)
    except metadata.PackageNotFoundError:
        return "unknown"


class _Version(argparse.Action):
    """``--version``: reads the installed metadata only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kw: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kw: object) -> None:
        print(f"mopd ({_DIST}) {version()}")
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    """The ``mopd`` argument parser (subcommands demo, plan, bench)."""
    parser = OneLineParser(
        prog="mopd",
        description="mopd-bridge tools: the demo, the transfer-plan inspector, the benchmarks, "
        "nsys reports.",
        epilog="Meshes everywhere: tp=8,pp=2,cp=1,dp=1,rank_offset=16 (the keys of "
        "mopd.bridge.Mesh). 'python -m mopd' is the same command.",
    )
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", metavar="{demo,plan,bench,nsys}", required=True)
    sub.add_parser(
        "demo",
        help="run the end-to-end demo (arguments go to mopd.profiling.demo)",
        add_help=False,
        prefix_chars="\0",  # every token, --help included, is the demo's
    )
    sub.add_parser(
        "plan",
        help="show the bridge's transfers for two meshes and a batch, no GPU needed "
        "(mopd plan --help)",
        add_help=False,
        prefix_chars="\0",
    )
    bench = sub.add_parser(
        "bench",
        help="run a benchmark and plot the CSV it records",
        description="Run python -m mopd.profiling.bench.NAME [--results-dir DIR] ARGS, then plot "
        "each CSV it wrote that it did not plot itself. On a CPU the figures are functional "
        "(the harness runs, outputs are checked), not performance.",
    )
    bench.add_argument(
        "--results-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where the benchmark records (passed to it); default: mopd-results/ at the root of "
        "a checkout of mopd-bridge (git ignores it), ./mopd-results/ elsewhere",
    )
    bench.add_argument("--no-plot", action="store_true", help="do not draw PNGs")
    bench.add_argument("name", choices=BENCHMARKS, help="which benchmark")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark")
    sub.add_parser(
        "nsys",
        help="run the demo (or -- CMD) under Nsight Systems, one report per rank (mopd nsys --help)",
        add_help=False,
        prefix_chars="\0",
    )
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


def _snapshot(directory: Path, pattern: str) -> dict[Path, tuple[int, int]]:
    """``{path: (mtime_ns, size)}`` for the files matching ``pattern`` directly under ``directory``."""
    if not directory.is_dir():
        return {}
    return {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in directory.glob(pattern)}


def _results_dir_in(args: Sequence[str]) -> Path | None:
    """The ``--results-dir`` given to the benchmark itself (after NAME), if any."""
    for i, a in enumerate(args):
        if a == "--results-dir" and i + 1 < len(args):
            return Path(args[i + 1])
        if a.startswith("--results-dir="):
            return Path(a.split("=", 1)[1])
    return None


def _run_bench(name: str, args: list[str], results_dir: Path | None, plot: bool) -> int:
    module = bench_module(name)
    if importlib.util.find_spec(module) is None:
        print(f"mopd bench: error: benchmark module {module} is not installed", file=sys.stderr)
        return EXIT_USAGE
    inner = _results_dir_in(args)
    if results_dir is not None and inner is not None:
        print(
            f"mopd bench: error: --results-dir given twice ({results_dir} before {name}, {inner} "
            "after it); give it once",
            file=sys.stderr,
        )
        return EXIT_USAGE
    from mopd.profiling.extras import can_draw, child_env, has_module
    from mopd.profiling.mesh_arg import PROG_ENV

    if "-h" in args or "--help" in args:  # the benchmark's own help, and nothing else
        env = {**child_env(), PROG_ENV: f"mopd bench {name}"}
        return subprocess.call([sys.executable, "-m", module, *args], env=env)
    if results_dir is not None:
        args = ["--results-dir", str(results_dir), *args]
    else:
        from mopd.profiling.results import default_results_dir

        results_dir = inner if inner is not None else default_results_dir()
    # without matplotlib, the one note "no picture" is said here, after a run that recorded a
    # CSV (so not by the benchmark, not before its output, and not when nothing would be drawn)
    draw = plot and has_module("matplotlib")
    env = {
        **child_env(parent_says=["matplotlib"] if plot and not draw else []),
        PROG_ENV: f"mopd bench {name}",
    }
    csvs, pngs = _snapshot(results_dir, "*.csv"), _snapshot(results_dir, "*.png")
    rc = subprocess.call([sys.executable, "-m", module, *args], env=env)
    if rc != 0:
        if rc != EXIT_USAGE:  # a usage error has said why in its own one line
            print(f"mopd bench: {module} exited with status {rc}; nothing plotted", file=sys.stderr)
        return rc
    if not plot:
        return 0
    written = sorted(p for p, k in _snapshot(results_dir, "*.csv").items() if csvs.get(p) != k)
    drawn = [p for p, k in _snapshot(results_dir, "*.png").items() if pngs.get(p) != k]
    if not written:
        print(
            f"mopd bench: {module} recorded no CSV under {results_dir}; nothing plotted",
            file=sys.stderr,
        )
        return 0
    if not draw:
        can_draw("mopd bench")  # says, once, that no picture is drawn and which extra adds it
        return 0
    from mopd.profiling.plots import plot_csv

    for csv_path in written:
        own = [p for p in drawn if p.name.startswith(csv_path.stem)]
        if own:  # the benchmark drew this CSV its own way: keep it
            print(f"mopd bench: plot {', '.join(str(p) for p in sorted(own))} (the benchmark's)")
            continue
        try:
            png = plot_csv(csv_path, csv_path.with_suffix(".png"))
        except ValueError as exc:  # a CSV without a plottable column: say so, keep going
            print(f"mopd bench: not plotted: {exc}", file=sys.stderr)
            continue
        print(f"mopd bench: plot {png}")
    return 0


def _run_nsys(args: list[str]) -> int:
    """``bash nsys.sh ARGS``: its messages name ``mopd nsys``; its default command (the demo)
    and its torchrun rewriting use this interpreter."""
    import os

    env = {**os.environ, "MOPD_PROG": "mopd nsys"}
    env.setdefault("PYTHON", sys.executable)
    return subprocess.call(["bash", str(nsys_script()), *args], env=env)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mopd`` console script; returns the exit status.

    Misuse prints one line to stderr and exits with status 2 (``SystemExit``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return _run_bench(args.name, list(args.args), args.results_dir, plot=not args.no_plot)
    leading = argv[: argv.index(args.command)]
    if leading:
        parser.error(f"unrecognized arguments before {args.command!r}: {' '.join(leading)}")
    if args.command == "nsys":
        return _run_nsys(rest)
    module_name = _ENTRY_POINTS[args.command]
    entry = _load_main(module_name)
    if entry is None:
        print(f"mopd {args.command}: {module_name} is not available yet", file=sys.stderr)
        return EXIT_USAGE
    rc = entry(rest)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
