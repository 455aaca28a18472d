"""Benchmark of the full-vocabulary KL (forward + backward) against its matmul floor and peers.

Why this file exists: the KL's target is <= 1.3x its matmul floor and <= 2 GiB extra memory at
T=8192, H=4096, V=151936 bf16 (issue 5). This script measures, in one run and side by side:

- ``ours``: :func:`mopd.kernels.kl.fused_vocab_parallel_kl` (reverse KL, sum) at a few chunk
  memory budgets, with the CuPy row kernels (``auto``) and with the torch twin;
- ``naive torch``: both logits in fp32, two ``log_softmax``, autograd;
- ``torch chunked``: the same per 1024 tokens, backward per chunk (gradients accumulate);
- Liger-Kernel's ``LigerFusedLinearJSDLoss`` (beta=1: reverse KL) if importable (else a printed
  reason);

each as fwd+bwd time (CUDA events, warm-up, median), its ratio to the matmul floor
(``4 * 2 * T * H * V`` FLOP at the bf16 matmul rate measured in the same run), and the peak extra
memory (``torch.cuda.max_memory_allocated`` minus the baseline with the inputs allocated; the
gradients of the student's hidden states and weight count as extra for everyone). Each loss is
compared with ours (``loss_rel_diff``) as a sanity check. Rows are recorded with
:func:`mopd.profiling.results.record` under the name ``kl``.

Run: ``python -m mopd.profiling.bench_kl`` on a GPU; ``--quick`` for a small CPU run that only
checks the harness (nothing recorded unless ``--results-dir`` is given).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mopd.kernels.backend import cupy_available
from mopd.kernels.kl import KLConfig, choose_chunk_tokens, fused_vocab_parallel_kl
from mopd.profiling.results import environment, format_table, record
from mopd.profiling.timing import time_calls

__all__ = ["main"]

Row = dict[str, Any]
Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
GiB = 2**30


def _reverse_kl_sum(s_CV: torch.Tensor, u_CV: torch.Tensor) -> torch.Tensor:
    """Plain torch reverse KL summed over rows: ``[C, V]`` logits (any dtype) -> fp32 scalar."""
    log_ps = torch.log_softmax(s_CV.float(), dim=-1)
    log_pt = torch.log_softmax(u_CV.float(), dim=-1)
    return (log_ps.exp() * (log_ps - log_pt)).sum()


def naive_torch(x: Inputs) -> torch.Tensor:
    """Everything materialized: ``[T, V]`` fp32 logits, log-probabilities and products."""
    h_s, w_s, h_t, w_t = x
    with torch.no_grad():
        u = h_t @ w_t.T
    loss = _reverse_kl_sum(h_s @ w_s.T, u)
    loss.backward()
    return loss.detach()


def chunked_torch(x: Inputs, chunk: int = 1024) -> torch.Tensor:
    """The naive loss per ``chunk`` tokens, backward per chunk (gradients accumulate)."""
    h_s, w_s, h_t, w_t = x
    total = torch.zeros((), dtype=torch.float32, device=h_s.device)
    for c0 in range(0, h_s.shape[0], chunk):
        with torch.no_grad():
            u = h_t[c0 : c0 + chunk] @ w_t.T
        loss = _reverse_kl_sum(h_s[c0 : c0 + chunk] @ w_s.T, u)
        loss.backward()
        total += loss.detach()
    return total


def ours(x: Inputs, config: KLConfig) -> torch.Tensor:
    h_s, w_s, h_t, w_t = x
    loss = fused_vocab_parallel_kl(
        h_s, w_s, h_t, w_t, vocab_start=0, vocab_size=w_s.shape[0], config=config
    )
    loss.backward()
    return loss.detach()


def liger_or_reason() -> tuple[Callable[[Inputs], torch.Tensor] | None, str]:
    """Liger-Kernel's chunked distillation loss as a peer, or why it cannot run here."""
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss
    except Exception as exc:  # not installed (the usual case on the GPU image)
        return None, f"Liger-Kernel not importable ({type(exc).__name__}: {exc})"
    loss_fn = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=1.0)

    def run(x: Inputs) -> torch.Tensor:
        h_s, w_s, h_t, w_t = x
        labels = torch.zeros(h_s.shape[0], dtype=torch.long, device=h_s.device)
        loss = loss_fn(h_s, w_s, h_t, w_t, labels)
        loss.backward()
        return loss.detach()

    return run, "Liger-Kernel LigerFusedLinearJSDLoss(beta=1), its own reduction"


def make_inputs(T: int, H: int, V: int, dtype: torch.dtype, device: torch.device) -> Inputs:
    """Student/teacher hidden ``[T, H]`` and LM heads ``[V, H]`` scaled so logits have std ~3."""
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    h_s = rnd(T, H).requires_grad_(True)
    w_s = rnd(V, H, scale=3 / H**0.5).requires_grad_(True)
    return h_s, w_s, rnd(T, H), rnd(V, H, scale=3 / H**0.5)


def measure(
    fn: Callable[[Inputs], torch.Tensor], x: Inputs, *, warmup: int, iters: int
) -> tuple[float, float, torch.Tensor]:
    """``(median fwd+bwd ms, peak extra GiB or nan on CPU, loss)`` of ``fn`` on ``x``."""
    device = x[0].device

    def clear() -> None:
        for t in x[:2]:
            t.grad = None

    last: dict[str, torch.Tensor] = {}

    def call(i: int) -> None:
        last["loss"] = fn(x)

    times = time_calls(call, device=device, iters=iters, warmup=warmup, before=clear)
    loss = last["loss"]
    extra = float("nan")
    clear()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = fn(x)
        torch.cuda.synchronize()
        extra = (torch.cuda.max_memory_allocated() - base) / GiB
        clear()
    return statistics.median(times), extra, loss


def matmul_tflops(H: int, dtype: torch.dtype, device: torch.device, iters: int) -> float:
    """Measured matmul rate (TFLOP/s) on an ``[8192, H] x [H, 32768]`` GEMM in ``dtype``."""
    M, N = (8192, 32768) if device.type == "cuda" else (256, 1024)
    a = torch.randn(M, H, device=device).to(dtype)
    b = torch.randn(H, N, device=device).to(dtype)
    out = torch.empty(M, N, device=device, dtype=dtype)
    times = time_calls(
        lambda i: torch.matmul(a, b, out=out), device=device, iters=max(iters, 5), warmup=3
    )
    return 2 * M * N * H / (statistics.median(times) * 1e-3) / 1e12


def bench(args: argparse.Namespace) -> tuple[list[Row], str]:
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tflops = matmul_tflops(args.hidden, dtype, device, args.iters)
    print(f"matmul rate: {tflops:.3g} TFLOP/s ({dtype}, {device})")
    liger, liger_note = liger_or_reason()
    if liger is None:
        print(f"skipping Liger-Kernel: {liger_note}")
    backend = "cupy" if device.type == "cuda" and cupy_available() else "torch"
    methods: list[tuple[str, Callable[[Inputs], torch.Tensor]]] = []
    chunks: dict[str, int] = {}
    elem = torch.empty((), dtype=dtype).element_size()
    for mib, twin in [(m, False) for m in args.budgets_mib] + [(args.budgets_mib[0], True)]:
        if twin and backend == "torch":
            continue  # the twin is already what runs
        used = "torch" if twin else backend
        cfg = KLConfig(memory_budget_bytes=mib * 2**20, backend=used)  # type: ignore[arg-type]
        name = f"ours ({'torch twin' if twin else used}, budget {mib} MiB)"
        methods.append((name, lambda x, c=cfg: ours(x, c)))
        chunks[name] = choose_chunk_tokens(cfg, v_local=args.vocab, element_size=elem, backend=used)  # type: ignore[arg-type]
    methods.append(("naive torch", naive_torch))
    methods.append(("torch chunked 1024", chunked_torch))
    if liger is not None:
        methods.append(("Liger-Kernel JSD(beta=1)", liger))

    rows: list[Row] = []
    summary = []
    for T in args.tokens:
        x = make_inputs(T, args.hidden, args.vocab, dtype, device)
        floor_ms = 8 * T * args.hidden * args.vocab / (tflops * 1e12) * 1e3
        ref_loss: float | None = None
        for name, fn in methods:
            row: Row = {"method": name, "T": T, "H": args.hidden, "V": args.vocab}
            row["dtype"] = str(dtype).replace("torch.", "")
            try:
                ms, extra, loss = measure(fn, x, warmup=args.warmup, iters=args.iters)
            except Exception as exc:  # OOM (naive at large T), or a peer whose API differs
                if name.startswith("ours") and not isinstance(exc, torch.cuda.OutOfMemoryError):
                    raise
                oom = isinstance(exc, torch.cuda.OutOfMemoryError)
                row.update(fwd_bwd_ms="OOM" if oom else f"error: {type(exc).__name__}: {exc}")
                row["floor_ms"] = floor_ms
                rows.append(row)
                print(f"{name} at T={T}: {row['fwd_bwd_ms']}")
                for t in x[:2]:
                    t.grad = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            value = float(loss)
            if ref_loss is None:
                ref_loss = value
            row.update(
                fwd_bwd_ms=ms,
                floor_ms=floor_ms,
                x_floor=ms / floor_ms,
                extra_GiB=extra,
                loss_rel_diff=abs(value - ref_loss) / max(abs(ref_loss), 1e-30),
            )
            if name in chunks:
                row["chunk_tokens"] = chunks[name]
            rows.append(row)
            print(format_table([row]).splitlines()[-1])
        best = min(
            (r for r in rows if r["T"] == T and r["method"].startswith("ours")),
            key=lambda r: r.get("x_floor", float("inf")),
        )
        summary.append(
            f"T={T}: best ours {best['method']} {best['fwd_bwd_ms']:.1f} ms = "
            f"{best['x_floor']:.2f}x floor, {best['extra_GiB']:.2f} GiB extra"
        )
        del x
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows, f"matmul {tflops:.3g} TFLOP/s; " + "; ".join(summary) + f". {liger_note}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small CPU run: harness check only")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="T values")
    parser.add_argument("--hidden", type=int, default=None, help="H (student = teacher)")
    parser.add_argument("--vocab", type=int, default=None, help="V")
    parser.add_argument(
        "--budgets-mib", type=int, nargs="+", default=[512, 768, 1024], help="our chunk budgets"
    )
    parser.add_argument("--iters", type=int, default=None, help="timed calls (median)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--results-dir", type=Path, default=None, help="where results go")
    parser.add_argument("--no-record", action="store_true", help="print only")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens = args.tokens or [96, 160]
        args.hidden = args.hidden or 32
        args.vocab = args.vocab or 1000
        args.iters = args.iters or 2
        args.warmup = min(args.warmup, 1)
        args.budgets_mib = [1]
    else:
        if not torch.cuda.is_available():
            parser.error(
                "a measured run needs a CUDA device; use --quick for the CPU harness check"
            )
        args.tokens = args.tokens or [8192, 16384]
        args.hidden = args.hidden or 4096
        args.vocab = args.vocab or 151936
        args.iters = args.iters or 5
    rows, summary = bench(args)
    print(format_table(rows))
    print(summary)
    notes = (
        f"Reverse KL summed over tokens, fwd+bwd into the student's hidden states and LM-head "
        f"weight; teacher under no_grad. Median of {args.iters} after {args.warmup} warm-up "
        "calls (CUDA events); floor = 4 matmuls of 2*T*H*V FLOP at the matmul rate measured in "
        "this run; extra = max_memory_allocated - baseline (inputs allocated, grads None), so "
        "the student's weight and hidden gradients count for every method. loss_rel_diff is "
        f"against the first method's loss. {summary}"
        + (" QUICK CPU RUN: harness check, not a measurement." if args.quick else "")
    )
    if not args.no_record and (args.results_dir is not None or not args.quick):
        csv_path, md_path = record(
            "kl", rows, out_dir=args.results_dir, notes=notes, env=environment()
        )
        print(f"recorded {csv_path} and {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
