"""Benchmark of the full-vocabulary KL: speed and memory against its matmul floor and peers
(GPU), and accuracy against float64 beside the same peers (any device).

Why this file exists: the KL's targets are <= 1.3x its matmul floor and <= 2 GiB extra memory at
T=8192, H=4096, V=151936 bf16 with fp32 teacher logits, and an accuracy that only the bf16
inputs limit. ``mopd bench kl`` runs two parts (``--part``):

``speed`` (needs CUDA; ``--quick`` checks the harness on the CPU): fwd+bwd of

- ``ours``: :func:`mopd.kernels.kl.fused_vocab_parallel_kl` (reverse KL, sum) at a few chunk
  memory budgets, with the CuPy row kernels (``auto``), once with the weight gradient summed in
  fp32 (``weight_grad_accumulation="fp32"``), and with the torch twin;
- ``naive torch``: both logits in fp32, two ``log_softmax``, autograd;
- ``torch chunked``: the same per 1024 tokens, backward per chunk (gradients accumulate);
- Liger-Kernel's ``LigerFusedLinearJSDLoss`` (beta=1: reverse KL) if importable (else a printed
  reason);

each as fwd+bwd time (CUDA events, warm-up, median), its ratio to the matmul floor
(``4 * 2 * T * H * V`` FLOP at the bf16 matmul rate measured in the same run) and the peak extra
memory (``torch.cuda.max_memory_allocated`` minus the baseline with the inputs allocated; the
gradients of the student's hidden states and weight count as extra for everyone). Each loss is
compared with ours (``loss_rel_diff``) as a sanity check. Recorded as ``kl``.

``numerics``: relative loss and gradient errors against float64 from the same bf16 inputs, for
this loss, a plain torch bf16 computation and (GPU, where it imports) Liger-Kernel, over logit
std 1-16 and V 32000 and 151936 (:mod:`mopd.profiling.bench.kl_numerics`). Recorded as
``kl-numerics`` with a log-scale plot (``...-errors.png``); ``--baseline CSV`` adds a table of
an earlier run's errors beside these (``kl-numerics-vs-baseline``).

On a CPU the figures are functional: the numerics are real measurements (errors do not depend on
speed), the quick speed rows only show that every method runs (no floor, no memory columns).
A CPU run says in one line what it skips (the speed part, the GPU peer); the numerics say each
case as it is measured (``n of N``, seconds so far: 12 cases take about 4.5 min on 2 CPU cores),
print the worst errors per method, path and kind (every row goes to the CSV) and end in a summary
line.

Run: ``python -m mopd.profiling.bench.kl`` (GPU: both parts; CPU: numerics);
``--quick`` for a small run of both parts that only checks the harness (nothing recorded unless
``--results-dir`` is given).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from mopd.kernels.backend import cupy_available
from mopd.kernels.kl import KLConfig, choose_chunk_tokens, fused_vocab_parallel_kl
from mopd.profiling.bench import kl_numerics
from mopd.profiling.extras import can_draw
from mopd.profiling.mesh_arg import OneLineParser, prog_for
from mopd.profiling.results import default_results_dir, environment, format_table, record
from mopd.profiling.timing import time_calls

__all__ = ["compare_to_baseline", "cpu_skips", "main", "numerics_summary", "worst_errors"]

Row = dict[str, Any]
Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
GiB = 2**30
PARTS = ("speed", "numerics")


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
) -> tuple[float, float | None, torch.Tensor]:
    """``(median fwd+bwd ms, peak extra GiB (None off CUDA), loss)`` of ``fn`` on ``x``."""
    device = x[0].device

    def clear() -> None:
        for t in x[:2]:
            t.grad = None

    last: dict[str, torch.Tensor] = {}

    def call(i: int) -> None:
        last["loss"] = fn(x)

    times = time_calls(call, device=device, iters=iters, warmup=warmup, before=clear)
    loss = last["loss"]
    extra = None
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
    M, N = 8192, 32768
    a = torch.randn(M, H, device=device).to(dtype)
    b = torch.randn(H, N, device=device).to(dtype)
    out = torch.empty(M, N, device=device, dtype=dtype)
    times = time_calls(
        lambda i: torch.matmul(a, b, out=out), device=device, iters=max(iters, 5), warmup=3
    )
    return 2 * M * N * H / (statistics.median(times) * 1e-3) / 1e12


def _methods(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> tuple[
    list[tuple[str, Callable[[Inputs], torch.Tensor]]], dict[str, int], str
]:  # fmt: skip
    """``(methods, chunk tokens of ours by name, Liger note)``."""
    liger, liger_note = liger_or_reason()
    backend = "cupy" if device.type == "cuda" and cupy_available() else "torch"
    methods: list[tuple[str, Callable[[Inputs], torch.Tensor]]] = []
    chunks: dict[str, int] = {}
    elem = torch.empty((), dtype=dtype).element_size()
    first = args.budgets_mib[0]
    variants = [(mib, backend, "auto") for mib in args.budgets_mib]
    if backend == "cupy":
        variants += [(first, "cupy", "fp32"), (first, "torch", "auto")]
    for mib, used, acc in variants:
        cfg = KLConfig(
            memory_budget_bytes=mib * 2**20,
            backend=used,  # type: ignore[arg-type]
            weight_grad_accumulation=acc,  # type: ignore[arg-type]
        )
        label = "torch twin" if used == "torch" and backend == "cupy" else used
        name = f"ours ({label}, budget {mib} MiB" + (
            ", weight grad fp32)" if acc == "fp32" else ")"
        )
        methods.append((name, lambda x, c=cfg: ours(x, c)))
        chunks[name] = choose_chunk_tokens(
            cfg,
            v_local=args.vocab,
            element_size=elem,
            backend=used,  # type: ignore[arg-type]
        )
    methods.append(("naive torch", naive_torch))
    methods.append(("torch chunked 1024", chunked_torch))
    if liger is not None:
        methods.append(("Liger-Kernel JSD(beta=1)", liger))
    return methods, chunks, liger_note


def bench_speed(args: argparse.Namespace) -> tuple[list[Row], str]:
    """The speed part: one row per (T, method); the summary line."""
    cuda = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32  # the CPU check: peers agree closely
    tflops = matmul_tflops(args.hidden, dtype, device, args.iters) if cuda else None
    if tflops is not None:
        print(f"matmul rate: {tflops:.3g} TFLOP/s ({dtype}, {device})")
    methods, chunks, liger_note = _methods(args, device, dtype)
    if not any(name.startswith("Liger") for name, _ in methods):
        print(f"skipping Liger-Kernel: {liger_note}")
    rows: list[Row] = []
    summary = []
    for T in args.tokens:
        x = make_inputs(T, args.hidden, args.vocab, dtype, device)
        floor_ms = None if tflops is None else 8 * T * args.hidden * args.vocab / (tflops * 1e9)
        ref_loss: float | None = None
        for name, fn in methods:
            row: Row = {"method": name, "T": T, "H": args.hidden, "V": args.vocab}
            try:
                ms, extra, loss = measure(fn, x, warmup=args.warmup, iters=args.iters)
            except Exception as exc:  # OOM (naive at large T), or a peer whose API differs
                if name.startswith("ours") and not isinstance(exc, torch.cuda.OutOfMemoryError):
                    raise
                oom = isinstance(exc, torch.cuda.OutOfMemoryError)
                row["fwd_bwd_ms"] = "OOM" if oom else f"error: {type(exc).__name__}: {exc}"
                rows.append(row)
                print(f"  {name} at T={T}: {row['fwd_bwd_ms']}")
                for t in x[:2]:
                    t.grad = None
                if cuda:
                    torch.cuda.empty_cache()
                continue
            value = float(loss)
            ref_loss = value if ref_loss is None else ref_loss
            row["fwd_bwd_ms"] = ms
            if floor_ms is not None and extra is not None:
                row.update(floor_ms=floor_ms, x_floor=ms / floor_ms, extra_GiB=extra)
            row["loss_rel_diff"] = abs(value - ref_loss) / max(abs(ref_loss), 1e-30)
            if name in chunks:
                row["chunk_tokens"] = chunks[name]
            rows.append(row)
            print(f"  {name} at T={T}: done")
        if floor_ms is not None:
            best = min(
                (r for r in rows if r["T"] == T and "x_floor" in r and r["method"][:4] == "ours"),
                key=lambda r: r["x_floor"],
            )
            summary.append(
                f"T={T}: best ours {best['method']} {best['fwd_bwd_ms']:.1f} ms = "
                f"{best['x_floor']:.2f}x floor, {best['extra_GiB']:.2f} GiB extra"
            )
        del x
        if cuda:
            torch.cuda.empty_cache()
    head = f"matmul {tflops:.3g} TFLOP/s; " if tflops is not None else ""
    body = "; ".join(summary) if summary else "functional check on the CPU: no performance figure"
    return rows, f"{head}{body}. {liger_note}"


def compare_to_baseline(rows: Sequence[Row], baseline_csv: Path) -> list[Row]:
    """This run's errors beside ``baseline_csv``'s, matched on (method, path, kind, V, std)."""
    with baseline_csv.open(newline="") as f:
        before = {
            (r["method"], r["path"], r["kind"], int(r["V"]), float(r["logit_std"])): r
            for r in csv.DictReader(f)
        }
    out: list[Row] = []
    for r in rows:
        key = (r["method"], r["path"], r["kind"], int(r["V"]), float(r["logit_std"]))
        b = before.get(key)
        if b is None:
            continue
        out.append(
            {
                "method": r["method"], "path": r["path"], "kind": r["kind"], "V": r["V"],
                "logit_std": r["logit_std"],
                "loss_rel_err_before": float(b["loss_rel_err"]),
                "loss_rel_err_after": r["loss_rel_err"],
                "grad_rel_err_before": float(b["grad_rel_err"]),
                "grad_rel_err_after": r["grad_rel_err"],
            }
        )  # fmt: skip
    return out


def bench_numerics(args: argparse.Namespace) -> tuple[list[Row], list[str]]:
    """The numerics part: the error table and its notes; a line per case as it is measured
    (``n of N``, seconds so far)."""
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    total = len(args.num_vocabs) * len(args.logit_stds)
    done = [0]
    start = time.perf_counter()

    def progress(line: str) -> None:
        done[0] += 1
        print(f"  {done[0]} of {total}: {line} ({time.perf_counter() - start:.0f} s)", flush=True)

    return kl_numerics.run_numerics(
        tokens=args.num_tokens,
        hidden=args.num_hidden,
        vocabs=args.num_vocabs,
        logit_stds=args.logit_stds,
        device=device,
        progress=progress,
    )


def _error(value: Any) -> float | None:
    """A row's error as a number (``None`` where the method recorded a failure instead)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def worst_errors(rows: Sequence[Row]) -> list[Row]:
    """Per (method, path, kind): the largest loss and gradient errors over every V and logit
    std, and how many cases that is (the numerics table at a glance)."""
    out: dict[tuple[str, str, str], Row] = {}
    for r in rows:
        key = (r["method"], r["path"], r["kind"])
        w = out.setdefault(
            key,
            {"method": key[0], "path": key[1], "kind": key[2], "cases": 0,
             "worst_loss_rel_err": 0.0, "worst_grad_rel_err": 0.0},
        )  # fmt: skip
        w["cases"] += 1
        for col in ("loss_rel_err", "grad_rel_err"):
            value = _error(r.get(col))
            if value is None:
                w[f"worst_{col}"] = f"failed: {r.get(col)}"
            elif isinstance(w[f"worst_{col}"], float):
                w[f"worst_{col}"] = max(w[f"worst_{col}"], value)
    return list(out.values())


def numerics_summary(rows: Sequence[Row]) -> str:
    """One line: each method's largest loss and gradient errors over every case."""
    parts = []
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        loss = [e for r in mine if (e := _error(r["loss_rel_err"])) is not None]
        grad = [e for r in mine if (e := _error(r["grad_rel_err"])) is not None]
        failed = len(mine) - len(loss)
        text = f"{method} up to {max(loss, default=0):.2g} (loss), {max(grad, default=0):.2g} (gradients)"
        parts.append(text + (f", {failed} failed" if failed else ""))
    return f"summary over {len(rows)} rows, relative error against float64: " + "; ".join(parts)


def cpu_skips(args: argparse.Namespace, *, cuda: bool) -> str | None:
    """The one line that names what a run on a machine without CUDA leaves out, or ``None``."""
    if cuda:
        return None
    skipped = []
    if "speed" not in args.part:
        skipped.append("the speed part (it needs CUDA; --quick checks its harness on the CPU)")
    skipped.append("Liger-Kernel in the numerics (a GPU peer)")
    return "mopd bench kl on a CPU: skipped " + " and ".join(skipped)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(
        prog=prog_for("mopd.profiling.bench.kl"), description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="small CPU run: harness check only")
    parser.add_argument("--part", nargs="+", choices=PARTS, default=None, help="which parts")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="speed: T values")
    parser.add_argument("--hidden", type=int, default=None, help="speed: H (student = teacher)")
    parser.add_argument("--vocab", type=int, default=None, help="speed: V")
    parser.add_argument(
        "--budgets-mib", type=int, nargs="+", default=[512, 768, 1024], help="our chunk budgets"
    )
    parser.add_argument("--iters", type=int, default=None, help="speed: timed calls (median)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--num-tokens", type=int, default=None, help="numerics: T")
    parser.add_argument("--num-hidden", type=int, default=None, help="numerics: H")
    parser.add_argument("--num-vocabs", type=int, nargs="+", default=None, help="numerics: V")
    parser.add_argument(
        "--logit-stds", type=float, nargs="+", default=None, help="numerics: teacher logit stds"
    )
    parser.add_argument(
        "--baseline", type=Path, default=None, help="numerics: an earlier kl-numerics CSV"
    )
    parser.add_argument("--results-dir", type=Path, default=None, help="where results go")
    parser.add_argument("--no-record", action="store_true", help="print only")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if args.part is None:
        args.part = list(PARTS) if cuda or args.quick else ["numerics"]
    if "speed" in args.part and not cuda and not args.quick:
        parser.error("the speed part needs a CUDA device; use --quick for the CPU harness check")
    if args.quick:
        args.tokens = args.tokens or [96, 160]
        args.hidden = args.hidden or 32
        args.vocab = args.vocab or 1000
        args.iters = args.iters or 2
        args.warmup = min(args.warmup, 1)
        args.budgets_mib = [1]
        args.num_tokens = args.num_tokens or 16
        args.num_hidden = args.num_hidden or 32
        args.num_vocabs = args.num_vocabs or [1000]
        args.logit_stds = args.logit_stds or [1.0, 12.0]
    else:
        args.tokens = args.tokens or [8192, 16384]
        args.hidden = args.hidden or 4096
        args.vocab = args.vocab or 151936
        args.iters = args.iters or 5
        args.num_tokens = args.num_tokens or 128
        args.num_hidden = args.num_hidden or 1024
        args.num_vocabs = args.num_vocabs or [32000, 151936]
        args.logit_stds = args.logit_stds or [1.0, 2.0, 4.0, 8.0, 12.0, 16.0]
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    record_it = not args.no_record and (args.results_dir is not None or not args.quick)
    out_dir = args.results_dir or default_results_dir()
    env = environment()
    on_cpu = args.quick or not torch.cuda.is_available()
    skips = cpu_skips(args, cuda=torch.cuda.is_available())
    if skips is not None:
        print(skips, flush=True)
    if "speed" in args.part:
        print(
            "== speed"
            + (" (functional check on the CPU: not performance figures)" if on_cpu else "")
        )
        rows, summary = bench_speed(args)
        print(format_table(rows))
        print(summary)
        notes = (
            "Reverse KL summed over tokens, fwd+bwd into the student's hidden states and "
            "LM-head weight; teacher under no_grad. "
            + (
                "FUNCTIONAL CPU RUN (fp32): shows that every method runs and agrees; times are "
                "not performance figures, and the floor and memory columns are left out. "
                if args.quick
                else f"bf16. Median of {args.iters} after {args.warmup} warm-up calls (CUDA events); "
                "floor = 4 matmuls of 2*T*H*V FLOP at the bf16 matmul rate measured in this run; "
                "extra = max_memory_allocated - baseline (inputs allocated, grads None), so the "
                "student's weight and hidden gradients count for every method. "
            )
            + f"loss_rel_diff is against the first method's loss. {summary}"
        )
        if record_it:
            paths = record("kl", rows, out_dir=out_dir, notes=notes, env=env)
            print(f"recorded {paths[0]} and {paths[1]}")
    if "numerics" in args.part:
        where = "the CPU" if on_cpu else torch.cuda.get_device_name(0)
        cases = len(args.num_vocabs) * len(args.logit_stds)
        print(
            f"== numerics on {where} (errors against float64 from the same bf16 inputs): "
            f"{cases} cases (V x logit std), each every KL kind and path"
        )
        rows, peer_notes = bench_numerics(args)
        print("worst over every V and logit std:")
        print(format_table(worst_errors(rows)))
        notes = (
            f"Relative errors against float64 from the same bf16 inputs: loss |L - L64| / |L64| "
            f"(KL summed over T={args.num_tokens} tokens), gradients ||g - g64|| / ||g64|| "
            f"(grad_rel_err: the worst of the inputs' gradients, logits or hidden + weight). "
            f"H={args.num_hidden}, student logits within noise 0.25 of the teacher's "
            "(mopd.profiling.bench.kl_numerics). Errors do not depend on speed: a CPU run is a "
            "measurement of the CPU path. "
            + " ".join(peer_notes)
            + (" QUICK RUN: harness check." if args.quick else "")
        )
        if record_it:
            csv_path, md_path = record("kl-numerics", rows, out_dir=out_dir, notes=notes, env=env)
            recorded = [csv_path, md_path]
            if can_draw("mopd bench kl"):
                recorded.append(
                    kl_numerics.plot_errors(
                        rows, csv_path.with_name(csv_path.stem + "-errors.png"), csv_path.stem
                    )
                )
            print(f"recorded {', '.join(map(str, recorded))} (every row: the CSV)")
        else:
            print(format_table(rows))  # nothing recorded: every row here
        print(numerics_summary(rows), flush=True)
        if args.baseline is not None:
            compared = compare_to_baseline(rows, args.baseline)
            print(f"== numerics beside {args.baseline.name}")
            print(format_table(compared))
            if record_it and compared:
                paths = record(
                    "kl-numerics-vs-baseline", compared, out_dir=out_dir, env=env,
                    notes=f"Before: {args.baseline.name}; after: this run. {notes}",
                )  # fmt: skip
                print(f"recorded {paths[0]} and {paths[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
