"""How benchmarks report: one CSV and one Markdown table per run with the environment, and progress.

Why this file exists: every benchmark (kernels, KL, bridge, capture, ranges, planning) prints
figures side by side with its peers and records them with the machine, the versions and the
date, in one place: ``mopd-results/`` at the root of a checkout of this repository (which git
ignores: a run leaves no untracked file; the figures the repository keeps are copied to
``docs/results/`` by hand), ``./mopd-results/`` elsewhere (``--results-dir`` changes it). Long runs show their progress on stderr, and
only on a terminal, so that logs and ``--json`` output stay clean.
"""

from __future__ import annotations

import contextlib
import csv
import datetime as _dt
import io
import platform
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from mopd.common.units import human_number, human_seconds

__all__ = [
    "CPU_CAVEAT",
    "INSTALLED_RESULTS_DIR",
    "Progress",
    "checkout_root",
    "default_results_dir",
    "environment",
    "format_table",
    "record",
]

#: The results folder's name: at the root of a checkout (git ignores it), else in the cwd.
INSTALLED_RESULTS_DIR = Path("mopd-results")
#: What a figure measured on the CPU is worth: the tables, notes and plots of CPU runs say it.
CPU_CAVEAT = "CPU run: functional figures (the harness runs, outputs are checked), not performance"


def environment() -> dict[str, str]:
    """Machine and version facts worth keeping next to a figure (GPU, torch, CUDA, NCCL, CuPy)."""
    import torch

    env: dict[str, str] = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpu_count": str(__import__("os").cpu_count()),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = str(torch.version.cuda)
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # NCCL absent from this build
            env["nccl"] = "n/a"
    else:
        env["gpu"] = "none (CPU)"
    try:
        import cupy

        env["cupy"] = cupy.__version__
    except Exception:
        env["cupy"] = "not installed"
    from importlib import metadata

    try:
        env["megatron_core"] = metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        env["megatron_core"] = "not installed"
    return env


def _is_checkout(root: Path) -> bool:
    """``root`` is a checkout of this repository (its pyproject names mopd-bridge)."""
    try:
        text = (root / "pyproject.toml").read_text()
    except OSError:
        return False
    return 'name = "mopd-bridge"' in text and (root / "profiling" / "results.py").is_file()


def checkout_root() -> Path | None:
    """The checkout this code runs from (an editable install), else the current folder if it
    is one (a regular install used from the repository root), else ``None``."""
    for root in (Path(__file__).resolve().parent.parent, Path.cwd()):
        if _is_checkout(root):
            return root
    return None


def default_results_dir() -> Path:
    """``mopd-results`` at the root of the checkout (:func:`checkout_root`; git ignores it), else
    ``./mopd-results``."""
    root = checkout_root()
    return root / INSTALLED_RESULTS_DIR if root is not None else INSTALLED_RESULTS_DIR


class Progress:
    """A progress bar on stderr (tqdm), shown only on a terminal and when not ``quiet``.

    ``with Progress(total=N, desc="kernels") as bar: ...; bar.step("gather random")`` names the
    case being measured and counts it; elsewhere (a log file, ``--json``) every call is a no-op
    and nothing at all is written. Nothing ever goes to stdout. Lines printed while the bar is
    drawn go through :meth:`routed` so that none lands on the bar's line.

    Args:
        unit, leave: tqdm's (``leave``: keep the finished bar on screen).
        tool: on a terminal without tqdm, say once, naming ``tool``, that there is no bar and
            which extra adds it (default: silently none).
    """

    def __init__(
        self,
        *,
        total: int | None,
        desc: str,
        quiet: bool = False,
        unit: str = "it",
        leave: bool = False,
        tool: str | None = None,
    ) -> None:
        self._bar: Any = None
        if quiet or not sys.stderr.isatty():
            return
        if tool is not None:
            from mopd.profiling.extras import optional_module

            tqdm_module = optional_module("tqdm", purpose="no progress bar", tool=tool)
            if tqdm_module is None:
                return
        try:
            from tqdm import tqdm
        except ImportError:  # the profiling extra is not installed: no bar
            return
        self._bar = tqdm(
            total=total, desc=desc, unit=unit, file=sys.stderr, leave=leave, dynamic_ncols=True
        )

    @property
    def shown(self) -> bool:
        return self._bar is not None

    def start(self, case: str) -> None:
        """Say which case runs now (before measuring it)."""
        if self._bar is not None:
            self._bar.set_postfix_str(case, refresh=True)

    def step(self, case: str | None = None) -> None:
        """Count one finished case (``case``: its name, if :meth:`start` did not say it)."""
        if self._bar is not None:
            if case is not None:
                self._bar.set_postfix_str(case, refresh=True)
            self._bar.update(1)

    @contextlib.contextmanager
    def routed(self) -> Iterator[None]:
        """While the bar is drawn, ``sys.stdout`` and ``sys.stderr`` write whole lines with the
        bar cleared first and redrawn after (tqdm's own write path for our streams), so that no
        printed line lands on the bar's line; a no-op without a bar."""
        if self._bar is None:
            yield
            return
        out, err = sys.stdout, sys.stderr
        routed_out, routed_err = _BarSafe(self._bar, out), _BarSafe(self._bar, err)
        sys.stdout, sys.stderr = routed_out, routed_err  # type: ignore[assignment]
        try:
            yield
        finally:
            sys.stdout, sys.stderr = out, err
            routed_out.flush()
            routed_err.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _BarSafe(io.TextIOBase):
    """A text stream that writes whole lines to ``file`` around a tqdm ``bar``: clear, write,
    redraw (a partial line waits for its newline, or for :meth:`flush`)."""

    def __init__(self, bar: Any, file: Any) -> None:
        super().__init__()
        self._bar, self._file, self._pending = bar, file, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._pending += text
        if "\n" in self._pending:
            lines, _, self._pending = self._pending.rpartition("\n")
            self._emit(lines + "\n")
        return len(text)

    def flush(self) -> None:
        if self._pending:
            text, self._pending = self._pending, ""
            self._emit(text)
        self._file.flush()

    def _emit(self, text: str) -> None:
        self._bar.clear()
        self._file.write(text)
        self._file.flush()
        self._bar.refresh()


#: Column-name endings that mark a column of times, and the unit its numbers are in (seconds).
_TIME_SUFFIXES: tuple[tuple[str, float], ...] = (
    ("_ns", 1e-9),
    (" ns", 1e-9),
    ("_us", 1e-6),
    (" us", 1e-6),
    ("_ms", 1e-3),
    (" ms", 1e-3),
    ("_s", 1.0),
)


def _time_column(name: str) -> tuple[str, float] | None:
    """``(header, seconds per unit)`` when ``name`` is a column of times (``time_ns``)."""
    for suffix, scale in _TIME_SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)], scale
    return None


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A GitHub-flavoured Markdown table of ``rows`` (columns in first-seen order).

    Numbers read as a person writes them: a column of times (its name ends in ``_ns``, ``_us``,
    ``_ms`` or ``_s``) is headed without the suffix and each of its numbers carries the unit
    that suits it (``time_ns`` 14950.3 -> ``time`` ``14.95 µs``); other floats get four
    significant figures, with no exponent for everyday sizes. The CSV keeps the raw numbers.
    """
    if not rows:
        return "(no rows)\n"
    cols: list[str] = []
    for row in rows:
        cols.extend(k for k in row if k not in cols)
    times = {c: _time_column(c) for c in cols}

    def cell(col: str, v: Any) -> str:
        unit = times[col]
        if isinstance(v, bool) or not isinstance(v, int | float):
            return str(v)
        if unit is not None:
            return human_seconds(float(v) * unit[1])
        return human_number(v) if isinstance(v, float) else str(v)

    heads = [t[0] if (t := times[c]) is not None else c for c in cols]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(c, r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def record(
    name: str,
    rows: Sequence[Mapping[str, Any]],
    *,
    out_dir: Path | None = None,
    notes: str = "",
    env: Mapping[str, str] | None = None,
) -> tuple[Path, Path]:
    """Write ``<name>-<tag>.csv`` and ``<name>-<tag>.md`` (table + environment) and return both.

    ``tag`` is the GPU name (or ``cpu``) and the date, so runs on different machines sit side by
    side instead of overwriting each other. A record never replaces another: a later run of the
    same name, machine and day takes the next free suffix (``<tag>-2``, ``<tag>-3``, ...).
    """
    env = dict(env or environment())
    out_dir = out_dir or default_results_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = env.get("gpu", "cpu")
    machine = "cpu" if machine.startswith("none") else machine
    tag = "-".join([machine.replace(" ", "_").lower(), env["date"][:10]])
    stem, k = f"{name}-{tag}", 1
    while (out_dir / f"{stem}.csv").exists() or (out_dir / f"{stem}.md").exists():
        k += 1
        stem = f"{name}-{tag}-{k}"
    csv_path = out_dir / f"{stem}.csv"
    md_path = out_dir / f"{stem}.md"
    cols: list[str] = []
    for row in rows:
        cols.extend(k for k in row if k not in cols)
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=cols)
        writer.writeheader()
        writer.writerows(rows)
    env_lines = "\n".join(f"- {k}: {v}" for k, v in env.items())
    md_path.write_text(
        f"# {name}\n\n{format_table(rows)}\n{notes}\n\n## Environment\n{env_lines}\n"
    )
    return csv_path, md_path
