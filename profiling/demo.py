"""``mopd demo``: the main job. Starts torchrun itself and runs the pipeline on tiny models.

Why this file exists: a user should see the pipeline work, end to end and verified, with one
command on a fresh machine before wiring it into a trainer. Today the demo covers the first stage:
a frozen teacher GPTModel (tensor- and sequence-parallel over the ranks) runs a forward pass under
the capture, and every rank checks the captured ``[S, B, H]`` against the model's own logits
(``captured @ W_full^T == logits``). It exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

__all__ = ["main"]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mopd demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks (teacher TP size); default 2")
    p.add_argument(
        "--backend",
        choices=["auto", "gloo", "nccl"],
        default="auto",
        help="auto: NCCL when there are enough GPUs, else gloo on CPU",
    )
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before the job is killed")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("nproc", "seq_len", "batch", "hidden", "vocab", "layers"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.seq_len % args.nproc or args.vocab % args.nproc:
        p.error(
            f"--seq-len {args.seq_len} and --vocab {args.vocab} must divide by --nproc {args.nproc}"
        )
    if args.hidden % 4:
        p.error(f"--hidden {args.hidden} must divide by 4 (attention heads)")
    return args


def _resolve_backend(args: argparse.Namespace) -> str:
    if args.backend != "auto":
        return args.backend
    import torch

    return (
        "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= args.nproc else "gloo"
    )


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.worker:
        return _worker(args)
    from mopd.profiling.launch import cpu_support_root, run_torchrun

    backend = _resolve_backend(args)
    env = {"MOPD_DEMO_BACKEND": backend}
    if backend == "gloo":
        try:
            env["MOPD_CHECKOUT"] = str(cpu_support_root())
        except ValueError as exc:
            print(f"mopd demo: {exc}", file=sys.stderr)
            return 2
    print(f"mopd demo: {args.nproc} ranks, backend {backend}")
    passthrough = list(argv) if argv is not None else sys.argv[1:]
    return run_torchrun(
        "mopd.profiling.demo",
        [*passthrough, "--worker"],
        nproc=args.nproc,
        timeout_s=args.timeout,
        env=env,
    )


def _worker(args: argparse.Namespace) -> int:
    import warnings

    import torch

    # megatron-core without TE/apex warns on import and on each deprecated c10d call it makes
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings(
        "ignore", message=r".*is deprecated\. Please use", category=FutureWarning
    )
    import torch.distributed as dist

    backend = os.environ.get("MOPD_DEMO_BACKEND", "gloo")
    if backend == "gloo":
        sys.path.insert(0, os.environ["MOPD_CHECKOUT"])
        from tests.support import megatron_cpu

        megatron_cpu.apply()
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend=backend,
        timeout=datetime.timedelta(seconds=120),
        **({"device_id": device} if backend == "nccl" else {}),
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        ok = _capture_stage(args, device, rank, world)
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


def _capture_stage(args: argparse.Namespace, device, rank: int, world: int) -> bool:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mopd.capture import get_opd_full_capture_context

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=world, create_gloo_process_groups=False
    )
    model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=4,
        tensor_model_parallel_size=world,
        sequence_parallel=world > 1,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
    )
    teacher = (
        GPTModel(
            config=cfg,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=args.vocab,
            max_sequence_length=args.seq_len,
        )
        .to(device)
        .eval()
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=g).to(device)
    pos = torch.arange(args.seq_len, device=device).expand(args.batch, -1)

    ctx, capture = get_opd_full_capture_context(teacher, enabled=True)
    t0 = time.perf_counter()
    with torch.no_grad(), ctx:
        logits_local = teacher(ids, pos, None)
    hidden_SBH = capture.get_hidden_states()
    capture_ms = (time.perf_counter() - t0) * 1e3

    # verify: captured @ W_full^T equals the gathered logits
    tp = parallel_state.get_tensor_model_parallel_group()
    w_local = teacher.output_layer.weight.detach()
    w_parts = [torch.empty_like(w_local) for _ in range(world)]
    dist.all_gather(w_parts, w_local, group=tp)
    l_parts = [torch.empty_like(logits_local) for _ in range(world)]
    dist.all_gather(l_parts, logits_local.contiguous(), group=tp)
    ref = (hidden_SBH @ torch.cat(w_parts).t()).transpose(0, 1)
    err = (torch.cat(l_parts, dim=-1) - ref).abs().max().item()
    ok = err <= 1e-4
    flag = torch.tensor([0 if ok else 1], device=hidden_SBH.device)
    dist.all_reduce(flag)
    if rank == 0:
        S, B, H = hidden_SBH.shape
        rows = [
            ("ranks (teacher TP, SP on)", f"{world}"),
            ("hook saw, per rank", f"[{S // world if world > 1 else S}, {B}, {H}]"),
            (
                "captured (SP undone)",
                f"[{S}, {B}, {H}] {str(hidden_SBH.dtype).replace('torch.', '')}",
            ),
            (
                "bytes / token: hidden vs logits",
                f"{H * hidden_SBH.element_size()} vs {args.vocab * 4}",
            ),
            ("forward + capture", f"{capture_ms:.1f} ms"),
            ("max |logits - captured @ W^T|", f"{err:.2e}"),
            ("verification (all ranks)", "OK" if int(flag) == 0 else "MISMATCH"),
        ]
        width = max(len(k) for k, _ in rows)
        print("\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows), flush=True)
    parallel_state.destroy_model_parallel()
    return int(flag) == 0


if __name__ == "__main__":
    sys.exit(main())
