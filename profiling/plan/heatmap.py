"""``mopd plan``'s heatmap: the transfer matrix and per-rank bytes as a PNG.

Why this file exists: a picture of who sends how much to whom (matplotlib, an optional extra),
kept apart from the text report so the inspector needs no plotting library to run.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    pass

from mopd.common.units import human_bytes, human_seconds
from mopd.profiling.plan.figures import PlanReport

__all__ = [
    "render_heatmap",
]

_I64 = np.int64


def render_heatmap(report: PlanReport, path: Path) -> Path:
    """Write a PNG of the transfer matrix with each rank's send / receive volume beside it.

    What the text cannot show at a glance: where the bytes go (the matrix of sends, local
    copies marked apart, on a log colour scale when the values span decades), how each rank's
    volume compares with the others' (bars per source rank on the right, per destination rank
    below, local copies stacked on the sends, the mean dashed), and which ranks form the
    teacher's TP groups and the student's destinations (alternating bands on the edges).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LogNorm, Normalize
    from matplotlib.figure import Figure

    from mopd.profiling.plots import byte_unit, spans_decades

    req, f = report.request, report.figures
    w = report.world_size
    e = report.entries_E3
    send_W, recv_W, local_W = report.send_W, report.recv_W, report.local_W
    local_src = np.zeros(w, dtype=_I64)  # local copies by the serving rank (= the receiver)
    loc = e[e[:, 0] == e[:, 1]]
    np.add.at(local_src, loc[:, 0], loc[:, 2])
    peak = int(max((send_W + local_src).max(initial=0), (recv_W + local_W).max(initial=0)))
    unit, scale = byte_unit(peak)
    bins = max(1, -(-w // 512))  # large jobs: ranks summed in bins, so the image stays small
    nb = -(-w // bins)
    cross = e[e[:, 0] != e[:, 1]]
    img = np.zeros((nb, nb), dtype=np.float64)
    np.add.at(img, (cross[:, 0] // bins, cross[:, 1] // bins), cross[:, 2] / scale)
    nz = img[img > 0]
    log = spans_decades(nz.tolist())
    norm = (
        LogNorm(vmin=float(nz.min()), vmax=float(nz.max()))
        if log
        else Normalize(vmin=0.0, vmax=float(nz.max()) if nz.size else 1.0)
    )
    size = min(13.0, max(7.0, 6.0 + w / 16))
    fig = Figure(figsize=(size + 2.4, size + 0.4), layout="constrained")
    FigureCanvasAgg(fig)
    gs = fig.add_gridspec(2, 2, width_ratios=(4.0, 1.3), height_ratios=(4.0, 1.3))
    ax = fig.add_subplot(gs[0, 0])
    ax_s = fig.add_subplot(gs[0, 1], sharey=ax)
    ax_r = fig.add_subplot(gs[1, 0], sharex=ax)
    ax_i = fig.add_subplot(gs[1, 1])
    im = ax.imshow(
        np.ma.masked_equal(img, 0.0),
        cmap="viridis",
        norm=norm,
        interpolation="nearest",
        extent=(-0.5, nb * bins - 0.5, nb * bins - 0.5, -0.5),
        aspect="auto",
    )
    handles = []
    if loc.shape[0]:
        handles.append(
            ax.scatter(
                loc[:, 0],
                loc[:, 1],
                marker="s",
                s=max(4.0, min(90.0, 2400.0 / w)),
                facecolors="none",
                edgecolors="tab:orange",
                linewidths=1.4,
                label=f"local copy: {human_bytes(f['bytes_local'])} in all, not sent",
            )
        )
    # the teacher's source groups (rows) and the student's destinations (columns), alternating
    sources, dests = report.step.topology.sources, report.step.topology.dests
    for k, g in enumerate(sources):
        lo, hi = min(g.ranks) - 0.5, max(g.ranks) + 0.5
        ax.axhspan(lo, hi, xmin=0.0, xmax=0.015, color=("tab:red", "lightcoral")[k % 2])
        if len(sources) <= 64:
            ax.axhline(lo, color="tab:red", lw=0.4, alpha=0.3)
    for k, d in enumerate(dests):
        lo, hi = min(d.ranks) - 0.5, max(d.ranks) + 0.5
        ax.axvspan(lo, hi, ymin=0.0, ymax=0.015, color=("tab:blue", "lightskyblue")[k % 2])
        if len(dests) <= 64:
            ax.axvline(lo, color="tab:blue", lw=0.4, alpha=0.3)
    dest = "student rank (its own SP slice)" if req.keeps_sp_slice else "student TP group"
    handles += [
        ax.plot([], [], color="tab:red", lw=4, label="teacher TP group (replicas; left edge)")[0],
        ax.plot([], [], color="tab:blue", lw=4, label=f"{dest} (destination; bottom edge)")[0],
    ]
    b_note = f" (bins of {bins})" if bins > 1 else ""
    ax.set_ylabel("source global rank" + b_note)
    ax.set_xlim(-0.5, w - 0.5)
    ax.set_ylim(w - 0.5, -0.5)
    t, s = req.teacher, req.student
    minimum = "the minimum" if f["bytes_total"] == f["bytes_minimum"] else "NOT the minimum"
    fig.suptitle(
        f"mopd plan: teacher TP{t.tp} CP{t.cp} DP{t.dp} PP{t.pp} -> student TP{s.tp} CP{s.cp} "
        f"DP{s.dp} PP{s.pp}, {req.micro_batches} micro-batch(es)\n"
        f"{human_bytes(f['bytes_cross'])} across ranks + {human_bytes(f['bytes_local'])} local "
        f"copies = {minimum} (each token once); send max/mean {f['send_imbalance']:.3f}, "
        f"recv max/mean {f['recv_imbalance']:.3f}",
        fontsize=9,
    )

    edges = np.arange(w + 1) - 0.5
    sent, got = send_W / scale, recv_W / scale
    ax_s.stairs(sent, edges, orientation="horizontal", fill=True, color="#4472c4", label="sent")
    ax_r.stairs(got, edges, fill=True, color="#4472c4", label="received")
    if loc.shape[0]:
        ax_s.stairs(
            sent + local_src / scale,
            edges,
            baseline=sent,
            orientation="horizontal",
            fill=True,
            color="tab:orange",
            label="local copy",
        )
        ax_r.stairs(
            got + local_W / scale,
            edges,
            baseline=got,
            fill=True,
            color="tab:orange",
            label="local copy",
        )
    for axis, v, line, who in (
        (ax_s, sent, ax_s.axvline, "senders"),
        (ax_r, got, ax_r.axhline, "receivers"),
    ):
        if (v > 0).any():
            line(float(v[v > 0].mean()), color="black", lw=0.8, ls="--", label=f"mean of {who}")
        axis.legend(fontsize=7, loc="lower right" if axis is ax_s else "upper left")
        axis.grid(alpha=0.3)
    bar_log = spans_decades(np.concatenate([send_W + local_src, recv_W + local_W]).tolist())
    if bar_log:
        ax_s.set_xscale("log")
        ax_r.set_yscale("log")
    ax_s.set_xlabel(f"{unit} per source rank{', log' if bar_log else ''}")
    ax_s.tick_params(labelleft=False)
    ax_r.set_ylabel(f"{unit} per destination{', log' if bar_log else ''}", fontsize=8)
    ax_r.set_xlabel("destination global rank" + b_note)

    ax_i.axis("off")
    ax_i.legend(handles=handles, loc="upper left", fontsize=7, frameon=False)
    cax = ax_i.inset_axes((0.05, 0.42, 0.9, 0.08))
    fig.colorbar(im, cax=cax, orientation="horizontal")
    cax.set_title(f"{unit} per (source, destination){', log scale' if log else ''}", fontsize=7)
    cax.tick_params(labelsize=7)
    timing = [  # one phrase a line: matplotlib's own wrapping cuts phrases in two
        f"modelled: crossing {human_seconds(f['time_cross_s'])} at {req.link_gbps:g} Gb/s",
        f"+ student TP all-gather {human_seconds(f['time_student_allgather_s'])}",
        f"teacher logits instead: {f['logits_full_ratio']:.1f}x the bytes",
        f"host path: {f['host_bytes_ratio']:.1f}x the bytes, {f['host_time_ratio']:.2f}x the time",
    ]
    ax_i.text(
        0.0,
        0.25,
        "\n".join(timing),
        fontsize=7,
        va="top",
        transform=ax_i.transAxes,
    )
    fig.savefig(path, dpi=110)
    return path
