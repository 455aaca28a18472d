"""One PNG bar chart per benchmark CSV, drawn headless (matplotlib Agg).

Why this file exists: ``mopd bench <name>`` records its figures as CSV (see
:mod:`mopd.profiling.results`); a picture of the headline column next to each CSV makes a run
readable at a glance. Benchmarks that need a particular picture draw their own (``mopd bench``
then leaves their CSVs alone); for the rest, the CSVs come from different benchmarks written by
different people, so the columns are chosen by rule, not by name:

- label: the first column that is not entirely numeric (made unique with the other text columns
  when it repeats); the row number when every column is numeric;
- value: the first all-numeric column whose header names a throughput, a time or a share, in this
  order of preference: ``GB/s`` (or ``TB/s``, ``TFLOP/s``), ``ms`` (or ``us``, ``ns``, ``s``), ``%``
  (or ``pct``, ``ratio``); failing that, the first all-numeric column. ``value_column`` overrides.

The value axis is logarithmic when the positive values span more than a decade, and a CSV
recorded on a CPU (``-cpu-`` in its name, as :func:`~mopd.profiling.results.record` tags it)
says in its title that its figures are functional, not performance.
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["byte_unit", "choose_columns", "draw_csv", "plot_csv", "read_csv", "spans_decades"]

# Header patterns, most preferred first. Matched case-insensitively against the whole header.
_VALUE_PATTERNS: tuple[re.Pattern[str], ...] = tuple(
    re.compile(p, re.IGNORECASE)
    for p in (
        r"[gt]b/s",
        r"t?flop/s|tflops",
        r"(^|[^a-z])ms($|[^a-z])",
        r"(^|[^a-z])(us|µs|ns)($|[^a-z])",
        r"(^|[^a-z])(s|sec|seconds)($|[^a-z])",
        r"%|(^|[^a-z])(pct|percent)($|[^a-z])",
        r"ratio|speedup|(^|[^a-z])x($|[^a-z])",
    )
)


def _as_float(cell: str) -> float | None:
    """The cell as a float; ``None`` for text. Empty cells and nan read as NaN."""
    text = cell.strip()
    if not text or text.lower() in {"nan", "n/a", "na", "-"}:
        return math.nan
    try:
        return float(text.rstrip("%x"))
    except ValueError:
        return None


def read_csv(csv_path: str | Path) -> tuple[list[str], list[dict[str, str]]]:
    """Header and rows of ``csv_path`` (all cells as text); ``ValueError`` when it has no rows."""
    path = Path(csv_path)
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        header = list(reader.fieldnames or [])
        rows = [{k: (v if v is not None else "") for k, v in row.items()} for row in reader]
    if not header or not rows:
        raise ValueError(f"{path}: no header or no data rows to plot")
    return header, rows


def _numeric(header: Sequence[str], rows: Sequence[dict[str, str]]) -> list[str]:
    """Columns whose every cell reads as a number (NaN allowed) and at least one is finite."""
    out: list[str] = []
    for col in header:
        values = [_as_float(row.get(col, "")) for row in rows]
        if all(v is not None for v in values) and any(
            v is not None and math.isfinite(v) for v in values
        ):
            out.append(col)
    return out


def choose_columns(
    header: Sequence[str], rows: Sequence[dict[str, str]], value_column: str | None = None
) -> tuple[str | None, str]:
    """``(label_column or None, value_column)`` by the rules in the module docstring."""
    numeric = _numeric(header, rows)
    text = [c for c in header if c not in numeric]
    if value_column is not None:
        if value_column not in numeric:
            raise ValueError(
                f"value_column {value_column!r} is not a numeric column; numeric: {numeric}"
            )
        value = value_column
    else:
        if not numeric:
            raise ValueError(f"no numeric column to plot among {list(header)}")
        value = next(
            (c for pattern in _VALUE_PATTERNS for c in numeric if pattern.search(c)), numeric[0]
        )
    return (text[0] if text else None), value


def _labels(
    header: Sequence[str], rows: Sequence[dict[str, str]], label: str | None, value: str
) -> list[str]:
    """One label per row: the label column, widened with the other text columns if it repeats."""
    if label is None:
        return [str(i) for i in range(len(rows))]
    labels = [row.get(label, "") for row in rows]
    if len(set(labels)) < len(labels):
        numeric = set(_numeric(header, rows))
        extra = [c for c in header if c not in numeric and c not in (label, value)]
        labels = [" | ".join([row.get(c, "") for c in (label, *extra)]) for row in rows]
    if len(set(labels)) < len(labels):
        labels = [f"{text} #{i}" for i, text in enumerate(labels)]
    return labels


def byte_unit(peak: float) -> tuple[str, int]:
    """``(unit, bytes per unit)`` for an axis whose largest value is ``peak`` bytes."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if peak >= scale:
            return unit, scale
    return "B", 1


def spans_decades(values: Sequence[float]) -> bool:
    """True when the finite positive values differ by more than 10x (a log axis reads better)."""
    pos = [v for v in values if math.isfinite(v) and v > 0]
    return bool(pos) and max(pos) > 10 * min(pos)


def _is_cpu_run(csv_path: Path) -> bool:
    return "-cpu-" in csv_path.name


def draw_csv(csv_path: str | Path, *, value_column: str | None = None) -> Figure:
    """The bar chart of :func:`plot_csv`, as a figure (not saved)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    csv_path = Path(csv_path)
    header, rows = read_csv(csv_path)
    label_col, value_col = choose_columns(header, rows, value_column)
    labels = _labels(header, rows, label_col, value_col)
    values = [_as_float(row.get(value_col, "")) for row in rows]
    finite = [v if v is not None and math.isfinite(v) else math.nan for v in values]
    log = spans_decades(finite)
    # no bar where there is no value (or, on a log axis, nothing positive to draw)
    heights = [0.0 if math.isnan(v) or (log and v <= 0) else v for v in finite]

    fig = Figure(figsize=(8.0, max(2.5, 0.45 * len(rows) + 1.4)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    positions = list(range(len(rows)))
    bars = ax.barh(positions, heights, color="#4472c4")
    ax.set_yticks(positions, labels)
    ax.invert_yaxis()
    if log:
        ax.set_xscale("log")
    ax.set_xlabel(value_col + (" (log scale)" if log else ""))
    if label_col is not None:
        ax.set_ylabel(label_col)
    title = csv_path.stem
    if _is_cpu_run(csv_path):
        from mopd.profiling.results import CPU_CAVEAT

        title += f"\n{CPU_CAVEAT}"
    ax.set_title(title, fontsize=10)
    ax.bar_label(
        bars,
        labels=[f"{v:.4g}" if not math.isnan(v) else "n/a" for v in finite],
        padding=3,
        fontsize=8,
    )
    ax.margins(x=0.15)
    ax.grid(axis="x", alpha=0.3, which="both" if log else "major")
    return fig


def plot_csv(
    csv_path: str | Path, png_path: str | Path, *, value_column: str | None = None
) -> Path:
    """Draw a horizontal bar chart of one numeric column by row label; return the PNG path.

    Rows keep the CSV's order top to bottom; each bar is annotated with its value. Empty or NaN
    cells draw no bar. Raises ``ValueError`` when the CSV has no rows or no numeric column.
    """
    png_path = Path(png_path)
    fig = draw_csv(csv_path, value_column=value_column)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=110)
    return png_path
