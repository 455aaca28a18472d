"""What ``mopd demo`` leaves behind: its one-line verdict, its results file and its loss curves.

Why this file exists: a run should end in one line that says whether it worked, and leave its
figures where a reader can open them. :func:`verdict` is that line (the rows bridged exactly,
and whether every teacher's held-out KL fell); :func:`write` records the run's results as JSON
with the machine and versions, and beside it :func:`plot_kl`'s picture of the rollout and
held-out KL per teacher per step. Rank 0 of the demo (:mod:`mopd.profiling.demo_job`) calls them
once the run is over.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_kl", "verdict", "write"]


def verdict(*, rows_ok: bool, bad_ranks: int, heldout: Sequence[Sequence[float]]) -> str:
    """The demo's last line.

    Args:
        rows_ok: step 1's bridged rows equal the all-gather reference on every student rank.
        bad_ranks: how many ranks found a mismatch (when not ``rows_ok``).
        heldout: per teacher, the held-out KL per step.
    """
    if not rows_ok:
        return (
            f"mopd demo: FAILED - bridged rows differ from the all-gather reference on "
            f"{bad_ranks} rank{'s' if bad_ranks != 1 else ''}"
        )
    if min(len(h) for h in heldout) < 2:
        return "mopd demo: OK - rows exact; one step, so no held-out trend to judge"
    ratios = [h[-1] / h[0] if h[0] > 0 else float("nan") for h in heldout]
    shown = " / ".join(f"{r:.2f}x" for r in ratios)
    learned = all(r < 1 for r in ratios)
    what = "student learned" if learned else "student did not learn"
    return f"mopd demo: OK - rows exact, {what}: held-out KL {shown}"


def plot_kl(
    *, rollout: Sequence[Sequence[float]], heldout: Sequence[Sequence[float]], png: Path
) -> Path:
    """One picture: per teacher, the rollout KL (solid) and the held-out KL (dashed) per step.

    ``rollout`` and ``heldout``: per teacher, one value per step (reverse KL per response token
    of the student that samples the step, before its update).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7.0, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    for k, (r, h) in enumerate(zip(rollout, heldout, strict=True)):
        steps = range(1, len(r) + 1)
        color = colors[k % len(colors)]
        ax.plot(steps, r, "-o", color=color, markersize=3, label=f"teacher {k}: rollouts")
        ax.plot(steps, h, "--s", color=color, markersize=3, label=f"teacher {k}: held-out set")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("reverse KL per response token")
    ax.set_title("mopd demo: the student's KL to each teacher")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    return png


def write(
    result: Mapping[str, Any], *, out_dir: Path, env: Mapping[str, str], draw: bool
) -> tuple[Path, Path | None]:
    """Write ``demo-<machine>-<date>.json`` (``result`` and ``env``) into ``out_dir`` and, with
    ``draw``, the :func:`plot_kl` picture beside it as ``.png``; returns both paths."""
    machine = env.get("gpu", "cpu")
    machine = "cpu" if machine.startswith("none") else machine.replace(" ", "_").lower()
    stem = f"demo-{machine}-{env['date'][:10]}"
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps({**result, "environment": dict(env)}, indent=1) + "\n")
    png = None
    if draw:
        png = plot_kl(
            rollout=result["rollout_kl"],
            heldout=result["heldout_kl"],
            png=json_path.with_suffix(".png"),
        )
    return json_path, png
