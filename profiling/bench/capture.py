"""Benchmark: the capture's paths per step (time and allocations) beside the naive gather-then-cat.

Why this file exists: the design's capture target is "no allocation per step after the first at a
steady shape" at no more bandwidth than one pass. This prints, side by side in one run, time per
step, effective GB/s and allocations per step of one capture step (the pre-hook, then
``get_hidden_states`` with its SP all-gather) on each of the capture's paths: ``out=`` (the
zero-allocation path), a recycled ``buffer=``, the default (a fresh tensor per capture, NeMo-RL's
answer), and the usual ``all_gather`` into a fresh list + ``torch.cat``; plus the forward-time
overhead of the capture hook on a Megatron GPTModel on a GPU.

Allocations are counted, not timed (:mod:`mopd.profiling.bench.allocations`): on a CPU, the caller's
own allocator calls apart from those the collective's backend makes for itself (gloo's CPU
all-gather stages through temporaries); on CUDA, the caching allocator's count (not split).

On a CPU the sizes are small and gloo is the backend: the times there are functional (the paths
run, the buffer is reused), not performance, and the table, the notes and the plot say so; the
allocation counts are exact. The plot puts each path beside the first row (``x`` = its time / the
``out=`` path's) on a log axis when the times span decades.

Run: ``python -m mopd.profiling.bench.capture [--quick] [--results-dir DIR]`` (one process: the
gather is a copy) or under ``torchrun --nproc-per-node N`` (the gather over N ranks; rank 0
records). Records ``capture-<machine>-<date>.{csv,md,png}`` (``capture-<N>ranks-...`` under
torchrun) under the results folder (:func:`mopd.profiling.results.default_results_dir`).
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
from mopd.profiling.launch import free_port
from mopd.profiling.mesh_arg import OneLineParser, prog_for

if TYPE_CHECKING:
    import torch

__all__ = ["main", "plot"]


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], list[float]]:
    """``timer(fn, n)``: milliseconds of each of ``n`` calls of ``fn()``, each waited for."""
    from mopd.profiling.timing import time_calls

    return lambda fn, n: time_calls(lambda i: fn(), device=device, iters=n)


def plot(
    rows: Sequence[dict[str, Any]], png: Path, title: str, *, cpu: bool, ranks: int = 1
) -> Path:
    """ms per step of every path, each against the first row (or the plain forward), with its
    allocations per step where the row has them."""
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
        what = "the plain forward" if hook else "the first row"
        allocs = r.get("allocations/step")
        tail = "" if allocs is None else f"; {allocs:g} allocation(s)/step"
        labels.append(f"{v:.3g} ms ({v / ref:.2f}x {what}){tail}")
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
    ax.margins(x=0.6)
    ax.grid(axis="x", alpha=0.3, which="both" if log else "major")
    ax.set_title(
        title + (f"\n{CPU_CAVEAT}\ngloo, {ranks} rank(s), small sizes" if cpu else ""), fontsize=9
    )
    fig.savefig(png, dpi=110)
    return png


def _init(cuda: bool) -> torch.device:
    """One process (world size 1), or the ranks torchrun started; this rank's device."""
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if dist.is_initialized():
        return device
    kw: dict[str, Any] = {"device_id": device} if cuda else {}
    timeout = datetime.timedelta(seconds=60)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: env://
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout, **kw)
        return device
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1, timeout=timeout, **kw)
    return device


def _capture_step(
    local_SBH: torch.Tensor, group: Any, **capture_kwargs: Any
) -> Callable[[], object]:
    """One capture step on an output layer that sees ``local_SBH`` (sequence-parallel over
    ``group``): the pre-hook inside ``capture_context``, then ``get_hidden_states``."""
    import torch

    from mopd.capture import OutputLayerInputCapture

    class Head(torch.nn.Module):  # an output layer that computes nothing
        sequence_parallel = True
        tp_group = group

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    holder = torch.nn.Module()
    holder.output_layer = Head()
    cap = OutputLayerInputCapture(holder, **capture_kwargs)

    def step() -> object:
        with cap.capture_context():
            holder.output_layer(local_SBH)
        return cap.get_hidden_states()

    return step


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(
        prog=prog_for("mopd.profiling.bench.capture"), description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--quick", action="store_true", help="small sizes (harness check on CPU)")
    p.add_argument("--results-dir", type=Path, default=None)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-record", action="store_true", help="print only")
    args = p.parse_args(argv)
    if args.iters < 1:
        p.error(f"--iters must be >= 1, got {args.iters}")
    import torch
    import torch.distributed as dist

    from mopd.capture import ReusableBuffer
    from mopd.profiling.bench.allocations import count_allocations
    from mopd.profiling.results import CPU_CAVEAT, format_table, record

    cuda = torch.cuda.is_available()
    device = _init(cuda)
    group = dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    S, B, H = (256, 2, 512) if args.quick or not cuda else (8192, 4, 4096)
    S = S // world * world
    dtype = torch.bfloat16
    local = torch.randn(S // world, B, H, device=device).to(dtype)
    nbytes = S * B * H * local.element_size()
    timer = _timer(device)

    def naive() -> None:
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local, group=group)
        torch.cat(parts, dim=0)

    paths = (
        (
            "capture, out= (mopd zero-allocation path)",
            _capture_step(local, group, out=torch.empty(S, B, H, device=device, dtype=dtype)),
        ),
        ("capture, buffer= (mopd, recycled)", _capture_step(local, group, buffer=ReusableBuffer())),
        ("capture, default (mopd = NeMo-RL: fresh tensor)", _capture_step(local, group)),
        ("all_gather + cat (naive)", naive),
    )
    counted = 5  # steps whose allocations are counted, after the timed ones
    rows = []
    for name, fn in paths:
        timer(fn, 3)
        ms = statistics.median(timer(fn, args.iters))
        allocs = [count_allocations(fn, device=device) for _ in range(counted)]
        rows.append(
            {
                "path": name,
                "shape": f"[{S},{B},{H}] bf16, {world} rank(s)",
                "ms/step": ms,
                "GB/s (read+write)": 2 * nbytes / ms / 1e6,
                "allocations/step": sum(a.own_count for a in allocs) / counted,
                "bytes allocated/step": sum(a.own_nbytes for a in allocs) / counted,
                "backend allocations/step": (
                    "n/a (CUDA: not split)"
                    if cuda
                    else sum(a.collective_count for a in allocs) / counted
                ),
            }
        )

    try:
        if world == 1:
            rows += _hook_overhead(device, timer, args)
    except ImportError as exc:
        print(f"(hook overhead skipped: {exc})")
    for row in rows:
        row["figures"] = "functional (CPU)" if not cuda else "measured"
    if rank == 0:
        if not cuda:
            print(f"{CPU_CAVEAT}.")
        print(format_table(rows))
    if not args.no_record and rank == 0:
        gather = "a copy" if world == 1 else f"an all-gather over {world} ranks"
        notes = (
            f"{'NCCL' if cuda else 'gloo'}, {world} rank(s): the gather is {gather}. "
            "allocations/step: the caller's own allocator calls per capture step (counted over "
            f"{counted} steps after the timed ones); backend allocations/step: those the "
            "collective's backend makes for itself (gloo's CPU all-gather stages through "
            "temporaries)." + (f" {CPU_CAVEAT}." if not cuda else "")
        )
        name = "capture" if world == 1 else f"capture-{world}ranks"
        csv_path, md_path = record(name, rows, out_dir=args.results_dir, notes=notes)
        recorded = [csv_path, md_path]
        if can_draw("mopd bench capture"):
            recorded.append(
                plot(
                    rows,
                    csv_path.with_suffix(".png"),
                    f"{csv_path.stem}: the capture's paths",
                    cpu=not cuda,
                    ranks=world,
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
