"""Benchmark: the capture's SP gather into a reused buffer against the naive gather-then-cat.

Why this file exists: the design's capture target is "no allocation per step after the first at a
steady shape" at no more bandwidth than one pass. This prints, side by side in one run, time per
step, effective GB/s and allocations per step for (a) ``gather_sequence_parallel`` into a
:class:`ReusableBuffer` and (b) the usual ``all_gather`` into a fresh list + ``torch.cat``, and
the forward-time overhead of the capture hook on a Megatron GPTModel when megatron-core is there.

On a CPU (gloo at world size 1) the "gather" is a local copy and the sizes are small: the
figures there are functional (the paths run, the buffer is reused), not performance, and the
table, the notes and the plot say so. The plot puts each path beside the reused buffer
(``x`` = its time / the reused buffer's) on a log axis when the times span decades.

Run: ``python -m mopd.profiling.bench_capture [--quick] [--results-dir DIR]`` (one process; NCCL
at world size 1 on a GPU, gloo on CPU). Records ``capture-<machine>-<date>.{csv,md,png}`` under
the results folder (:func:`mopd.profiling.results.default_results_dir`).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mopd.profiling.extras import can_draw
from mopd.profiling.mesh_arg import OneLineParser

if TYPE_CHECKING:
    import torch

__all__ = ["main", "plot"]


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], list[float]]:
    """``timer(fn, n)``: milliseconds of each of ``n`` calls of ``fn()``, each waited for."""
    from mopd.profiling.timing import time_calls

    return lambda fn, n: time_calls(lambda i: fn(), device=device, iters=n)


def _allocs(device: torch.device) -> int | None:
    import torch

    return torch.cuda.memory_stats()["allocation.all.allocated"] if device.type == "cuda" else None


def plot(rows: Sequence[dict[str, Any]], png: Path, title: str, *, cpu: bool) -> Path:
    """ms per step of every path, each against the reused buffer (or the plain forward)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from mopd.profiling.plots import spans_decades
    from mopd.profiling.results import CPU_CAVEAT

    ms = [float(r["ms/step"]) for r in rows]
    by_path = {str(r["path"]): v for r, v in zip(rows, ms, strict=True)}
    labels = []
    for r, v in zip(rows, ms, strict=True):
        hook = str(r["path"]).startswith("GPT")
        ref = by_path["GPT forward, no capture"] if hook else ms[0]
        what = "the plain forward" if hook else "the reused buffer"
        labels.append(f"{v:.3g} ms ({v / ref:.2f}x {what})")
    fig = Figure(figsize=(9.0, 0.55 * len(rows) + 2.0), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    pos = list(range(len(rows)))
    bars = ax.barh(
        pos, ms, color=["#4472c4" if "mopd" in str(r["path"]) else "#7f7f7f" for r in rows]
    )
    ax.set_yticks(pos, [f"{r['path']}\n{r['shape']}" for r in rows], fontsize=8)
    ax.invert_yaxis()
    log = spans_decades(ms)
    if log:
        ax.set_xscale("log")
    ax.set_xlabel("ms per step (median)" + ("; log scale" if log else ""))
    ax.bar_label(bars, labels=labels, padding=3, fontsize=7)
    ax.margins(x=0.35)
    ax.grid(axis="x", alpha=0.3, which="both" if log else "major")
    ax.set_title(
        title + (f"\n{CPU_CAVEAT}: gloo at world size 1, small sizes" if cpu else ""), fontsize=9
    )
    fig.savefig(png, dpi=110)
    return png


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="bench_capture", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes (harness check on CPU)")
    p.add_argument("--results-dir", type=Path, default=None)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-record", action="store_true", help="print only")
    args = p.parse_args(argv)
    if args.iters < 1:
        p.error(f"--iters must be >= 1, got {args.iters}")
    import torch
    import torch.distributed as dist

    from mopd.capture import ReusableBuffer, gather_sequence_parallel
    from mopd.profiling.results import CPU_CAVEAT, format_table, record

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if not dist.is_initialized():
        kw = {"device_id": device} if cuda else {}
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=60),
            **kw,
        )
    group = dist.group.WORLD
    S, B, H = (256, 2, 512) if args.quick or not cuda else (8192, 4, 4096)
    dtype = torch.bfloat16
    local = torch.randn(S, B, H, device=device).to(dtype)
    nbytes = local.numel() * local.element_size()
    timer = _timer(device)
    rows = []

    buf = ReusableBuffer()

    def reused() -> None:
        gather_sequence_parallel(local, group, buf.get((S, B, H), dtype, device))

    def naive() -> None:
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local, group=group)
        torch.cat(parts, dim=0)

    for name, fn in (("reused buffer (mopd)", reused), ("all_gather + cat (naive)", naive)):
        timer(fn, 3)
        before = _allocs(device)
        ms = statistics.median(timer(fn, args.iters))
        after = _allocs(device)
        per_step = None if before is None else (after - before) / args.iters
        rows.append(
            {
                "path": name,
                "shape": f"[{S},{B},{H}] bf16",
                "ms/step": ms,
                "GB/s (read+write)": 2 * nbytes / ms / 1e6,
                "allocations/step": "n/a (CPU)" if per_step is None else per_step,
            }
        )

    try:
        rows += _hook_overhead(device, timer, args)
    except ImportError as exc:
        print(f"(hook overhead skipped: {exc})")
    for row in rows:
        row["figures"] = "functional (CPU)" if not cuda else "measured"
    if not cuda:
        print(f"{CPU_CAVEAT}.")
    print(format_table(rows))
    if not args.no_record:
        notes = (
            "NCCL/gloo world size 1: the gather is a copy; the figure is the buffer's reuse, not "
            "link speed." + (f" {CPU_CAVEAT}." if not cuda else "")
        )
        csv_path, md_path = record("capture", rows, out_dir=args.results_dir, notes=notes)
        recorded = [csv_path, md_path]
        if can_draw("mopd bench capture"):
            recorded.append(
                plot(
                    rows,
                    csv_path.with_suffix(".png"),
                    f"{csv_path.stem}: capture's SP gather",
                    cpu=not cuda,
                )
            )
        print(f"recorded {', '.join(map(str, recorded))}")
    dist.destroy_process_group()
    return 0


def _hook_overhead(device: torch.device, timer: Any, args: argparse.Namespace) -> list[dict]:
    if device.type != "cuda":
        raise ImportError("megatron-core forward on CPU needs the test harness's patches")
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mopd.capture import OutputLayerInputCapture

    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    H = 256 if args.quick else 2048
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=H,
        num_attention_heads=16,
        bf16=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    from megatron.core.transformer.module import Float16Module

    inner = GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=32768,
        max_sequence_length=2048,
    ).to(device)
    model = Float16Module(cfg, inner).eval()
    ids = torch.randint(0, 32768, (4, 2048), device=device)
    pos = torch.arange(2048, device=device).expand(4, -1)
    cap = OutputLayerInputCapture(model)

    def plain() -> None:
        with torch.no_grad():
            model(ids, pos, None)

    def captured() -> None:
        with torch.no_grad(), cap.capture_context():
            model(ids, pos, None)
        cap.get_hidden_states()

    out = []
    for name, fn in (("GPT forward, no capture", plain), ("GPT forward + capture", captured)):
        timer(fn, 3)
        out.append(
            {
                "path": name,
                "shape": f"[2048,4,{H}] 2 layers",
                "ms/step": statistics.median(timer(fn, args.iters)),
            }
        )
    parallel_state.destroy_model_parallel()
    return out


if __name__ == "__main__":
    raise SystemExit(main())
