"""Recording benchmark results: one CSV and one Markdown table per run, with the environment.

Why this file exists: every benchmark (kernels, KL, bridge, capture) prints figures side by side
with its peers and records them under ``profiling/results/`` with the machine, the versions and
the date. This is the one place that knows how.
"""

from __future__ import annotations

import csv
import datetime as _dt
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["default_results_dir", "environment", "format_table", "record"]


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


def default_results_dir() -> Path:
    """``profiling/results`` of the source tree when run from a checkout, else ``./results``."""
    here = Path(__file__).resolve().parent / "results"
    return (
        here if here.parent.joinpath("results.py").exists() and here.exists() else Path("results")
    )


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
