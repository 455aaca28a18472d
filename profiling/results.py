"""How benchmarks report: one CSV and one Markdown table per run with the environment, and progress.

Why this file exists: every benchmark (kernels, KL, bridge, capture, ranges, planning) prints
figures side by side with its peers and records them with the machine, the versions and the
date, in one place: inside a checkout of this repository ``profiling/results/``, elsewhere
``./mopd-results/`` (``--results-dir`` changes it). Long runs show their progress on stderr, and
only on a terminal, so that logs and ``--json`` output stay clean.
"""

from __future__ import annotations

import csv
import datetime as _dt
import platform
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

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

#: Where an installed package records when it runs outside a checkout (relative to the cwd).
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
    """``profiling/results`` of the checkout (:func:`checkout_root`), else ``./mopd-results``."""
    root = checkout_root()
    return root / "profiling" / "results" if root is not None else INSTALLED_RESULTS_DIR


class Progress:
    """A progress bar on stderr (tqdm), shown only on a terminal and when not ``quiet``.

    ``with Progress(total=N, desc="kernels") as bar: ...; bar.step("gather random")`` names the
    case being measured and counts it; elsewhere (a log file, ``--json``) every call is a no-op
    and nothing at all is written. Nothing ever goes to stdout.
    """

    def __init__(self, *, total: int | None, desc: str, quiet: bool = False) -> None:
        self._bar: Any = None
        if quiet or not sys.stderr.isatty():
            return
        try:
            from tqdm import tqdm
        except ImportError:  # the profiling extra is not installed: no bar
            return
        self._bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)

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

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A GitHub-flavoured Markdown table of ``rows`` (columns in first-seen order)."""
    if not rows:
        return "(no rows)\n"
    cols: list[str] = []
    for row in rows:
        cols.extend(k for k in row if k not in cols)

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in cols) + " |" for r in rows]
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
    side instead of overwriting each other.
    """
    env = dict(env or environment())
    out_dir = out_dir or default_results_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = env.get("gpu", "cpu")
    machine = "cpu" if machine.startswith("none") else machine
    tag = "-".join([machine.replace(" ", "_").lower(), env["date"][:10]])
    csv_path = out_dir / f"{name}-{tag}.csv"
    md_path = out_dir / f"{name}-{tag}.md"
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
