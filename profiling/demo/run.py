"""``mopd demo``: a real multi-teacher MOPD training job on tiny models, started with one command.

Why this file exists: a user should see the whole pipeline work, end to end and verified, before
wiring it into a trainer. ``main`` checks the flags, then starts torchrun itself (8 CPU ranks with
gloo by default, NCCL when there are enough GPUs); every rank runs ``--worker``
(:mod:`mopd.profiling.demo.job`), which trains the way a megatron-core user does:

- two frozen teacher GPTModels, each on its own mesh with its own hidden size (default teacher 0:
  TP2 DP2 on ranks 0-3, teacher 1: TP4 on ranks 4-7, SP on), and a student GPTModel on its own
  mesh (default TP2 CP2 DP2 over all 8 ranks, THD-packed sequences, CP zigzag), each on explicit
  process groups (:func:`mopd.mcore.megatron_process_groups`), PP allowed on both sides;
- set-up once with :class:`mopd.mcore.Distiller` (bridge groups, the bridge, the teachers' LM
  heads resharded into the student's vocab partition);
- each step, on-policy: the step's prompts with global ids (sample ``i`` goes to teacher
  ``i % num_teachers``; its prompt starts with that teacher's domain tag); each student DP
  replica samples the responses to its share under the student's own TP/CP/PP
  (:mod:`mopd.profiling.demo.sampling`: temperature, a stop token, a maximum length); each
  replica's first rank passes them as :class:`mopd.mcore.Rollouts` to
  ``Distiller.step(rollouts, num_micro_batches=M)`` (the other ranks pass ``None``), which
  moves their token ids where they are used, builds every model's micro-batches (the student's
  THD-packed, the row mask derived from each response), plans the bridge and runs the
  teachers' forward-only pass; megatron's ``get_forward_backward_func()`` runs the student
  (1F1B with PP, ``**schedule_kwargs()``) with the MOPD loss inside ``loss_func``; then Adam;
- before each step, a held-out KL per teacher: the student against its teachers on a fixed
  held-out set (fixed prompts with the continuations the untrained student sampled), through a
  forward-only ``Distiller.step``, so the run shows whether the student gets closer to them;
- step 1's bridged rows are checked on every student rank against an all-gather reference (the
  teachers' hidden states, from a second teacher pass, joined by key): any mismatch makes the job
  exit non-zero; otherwise rank 0 prints ``verification: OK``; a line per step off a terminal (a
  progress bar on one); then time per phase, the rollout and held-out KL per step (and what
  they did), the bytes moved (``--links``: per link); the results JSON and a PNG of the KL
  curves go to the results folder (:mod:`mopd.profiling.demo.report`), and the last line is the
  verdict, ``mopd demo: OK - rows exact, student learned: held-out KL 0.60x / 0.68x``
  (``--json``: the results as one JSON object on stdout instead, the rest on stderr).

``--preset 4`` / ``--preset 8`` (the default) pick the job's ranks and meshes; bad flags are one
line leading with the failing flag and value, then the rule and its fix.

megatron-core runs on CPU ranks through :mod:`mopd.mcore.cpu` (shipped in the package). The
models are tiny and random-init (teachers included), so the job shows the data movement and
the on-policy mechanics, and a student moving towards its teachers, at toy scale. Under your
own launcher (several nodes, say), run the
workers directly: ``torchrun ... -m mopd.profiling.demo --worker [FLAGS]`` with ``--nproc`` the
job's world size; ``mopd demo --nnodes N --node-rank R --rdzv-endpoint HOST:PORT`` does that for
one node of a multi-node job.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

from mopd.profiling.demo.config import DemoConfig
from mopd.profiling.mesh_arg import MeshSpec, OneLineParser, parse_int_list, parse_mesh

__all__ = ["DemoConfig", "main"]

_ARGV_ENV = "MOPD_DEMO_ARGV"
_T0_ENV = "MOPD_DEMO_T0"
_DEFAULT_TEACHERS = ("tp=2,dp=2,rank_offset=0", "tp=4,rank_offset=4")
#: ``--preset N``: the job's ranks, teacher meshes and student mesh (flags given as well win).
PRESETS: dict[int, tuple[int, tuple[str, ...], str]] = {
    8: (8, _DEFAULT_TEACHERS, "tp=2,cp=2,dp=2"),
    4: (4, ("tp=2,rank_offset=0", "tp=2,rank_offset=2"), "tp=2,cp=2"),
}
#: Teacher hidden sizes when ``--teacher-hidden`` is not given: these in turn, one per teacher.
DEFAULT_TEACHER_HIDDEN = (64, 96)
#: The default ``--timeout``: a start-up allowance, then per rank on the node (each imports
#: torch and megatron-core, all at once) and per step.
TIMEOUT_BASE_S, TIMEOUT_PER_RANK_S, TIMEOUT_PER_STEP_S = 600.0, 60.0, 60.0


def default_timeout_s(ranks_per_node: int, steps: int) -> float:
    """The default ``--timeout`` of a job of ``ranks_per_node`` ranks here and ``steps`` steps."""
    return TIMEOUT_BASE_S + TIMEOUT_PER_RANK_S * ranks_per_node + TIMEOUT_PER_STEP_S * steps


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="mopd demo",
        description="A verified multi-teacher MOPD training run through megatron-core's schedule.",
        epilog="MESH: comma-separated tp=, cp=, dp=, pp= and rank_offset= (the mesh's first "
        "global rank), e.g. tp=2,dp=2,rank_offset=0; missing keys are 1 (rank_offset: 0). "
        "Teachers take cp=1. Sample i goes to teacher i % (number of teachers).",
    )
    p.add_argument(
        "--preset",
        type=int,
        choices=sorted(PRESETS),
        default=None,
        help="a job of 4 or 8 ranks: 8 is the default run; 4: teachers tp=2 (ranks 0-1) and "
        "tp=2,rank_offset=2, student tp=2,cp=2 (it sets --nproc, --teacher and --student; "
        "any of them given as well wins)",
    )
    p.add_argument("--nproc", type=int, default=8, help="ranks in the job")
    p.add_argument(
        "--backend",
        choices=["auto", "gloo", "nccl"],
        default="auto",
        help="auto: NCCL when there are enough GPUs, else gloo on CPU",
    )
    p.add_argument(
        "--teacher",
        action="append",
        metavar="MESH",
        help=f"a teacher mesh, repeat per teacher (default: {' and '.join(_DEFAULT_TEACHERS)})",
    )
    p.add_argument(
        "--teacher-hidden",
        default=None,
        help="hidden size per teacher (default: 64, 96, 64, ... in turn, one per teacher)",
    )
    p.add_argument("--student", default="tp=2,cp=2,dp=2", metavar="MESH", help="the student's mesh")
    p.add_argument("--student-hidden", type=int, default=48, help="the student's hidden size")
    p.add_argument("--heads", type=int, default=4, help="attention heads (every model)")
    p.add_argument("--layers", type=int, default=2, help="layers (every model)")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary (every model)")
    p.add_argument("--seq-len", type=int, default=32, help="longest sample: prompt + response")
    p.add_argument("--samples", type=int, default=16, help="prompts per step, whole job")
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step")
    p.add_argument(
        "--prompt-len",
        type=int,
        default=8,
        help="prompt tokens per sample, left out of the KL and never sent",
    )
    p.add_argument(
        "--loss-path",
        choices=["per-token", "default"],
        default="per-token",
        help="megatron's loss normalization: calculate_per_token_loss=True, or its default",
    )
    p.add_argument("--steps", type=int, default=16, help="training steps")
    p.add_argument("--lr", type=float, default=6e-3, help="the student's Adam learning rate")
    p.add_argument("--seed", type=int, default=1234, help="weights, prompts and sampling")
    p.add_argument(
        "--temperature", type=float, default=1.0, help="the student's sampling temperature"
    )
    p.add_argument(
        "--heldout-samples", type=int, default=16, help="fixed held-out samples, scored every step"
    )
    p.add_argument(
        "--teacher-init-std", type=float, default=0.15, help="teachers' init std (peakedness)"
    )
    p.add_argument(
        "--json", action="store_true", help="print the results as one JSON object on stdout"
    )
    p.add_argument(
        "--links", action="store_true", help="also print the bytes per teacher-to-student link"
    )
    p.add_argument(
        "--results-dir",
        default=None,
        metavar="DIR",
        help="where the results JSON and the loss-curve PNG go (default: mopd-results/ at the "
        "root of a checkout, which git ignores; ./mopd-results/ elsewhere)",
    )
    p.add_argument("--trace", metavar="DIR", help="write a torch.profiler trace per rank to DIR")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds before the job is killed (then it says where each rank was); default: "
        f"{TIMEOUT_BASE_S:.0f} + {TIMEOUT_PER_RANK_S:.0f} per rank on this node + "
        f"{TIMEOUT_PER_STEP_S:.0f} per step ({default_timeout_s(8, 16):.0f} for 8 ranks, 16 steps: "
        "a busy machine starts 8 ranks slowly)",
    )
    launch = p.add_argument_group("launching (passed to torchrun)")
    launch.add_argument("--nnodes", type=int, default=1, help="nodes in the job")
    launch.add_argument(
        "--nproc-per-node", type=int, default=None, help="(default: --nproc / --nnodes)"
    )
    launch.add_argument("--node-rank", type=int, default=0, help="this node's place in the job")
    launch.add_argument(
        "--rdzv-endpoint", default=None, metavar="HOST:PORT", help="rendezvous (multi-node)"
    )
    p.add_argument("--inject-mismatch", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def _mesh(text: str, what: str) -> MeshSpec:
    try:
        spec = parse_mesh(text)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
    return spec if spec.rank_offset is not None else replace(spec, rank_offset=0)


def _parse(argv: list[str]) -> tuple[argparse.Namespace, DemoConfig]:
    p = _parser()
    preset, _ = p.parse_known_args(argv)
    teachers = _DEFAULT_TEACHERS
    if preset.preset is not None:  # the preset's values as defaults: flags given win
        nproc, teachers, student = PRESETS[preset.preset]
        p.set_defaults(nproc=nproc, student=student)
    args = p.parse_args(argv)
    args.teacher = args.teacher or list(teachers)
    try:
        if args.teacher_hidden is None:
            hidden = tuple(
                DEFAULT_TEACHER_HIDDEN[i % len(DEFAULT_TEACHER_HIDDEN)]
                for i in range(len(args.teacher))
            )
        else:
            hidden = parse_int_list(args.teacher_hidden, what="--teacher-hidden size")
        cfg = DemoConfig(
            nproc=args.nproc,
            teachers=tuple(_mesh(t, "--teacher") for t in args.teacher),
            teacher_hidden=hidden,
            student=_mesh(args.student, "--student"),
            student_hidden=args.student_hidden,
            heads=args.heads,
            layers=args.layers,
            vocab=args.vocab,
            seq_len=args.seq_len,
            samples=args.samples,
            heldout_samples=args.heldout_samples,
            micro_batches=args.micro_batches,
            prompt_len=args.prompt_len,
            per_token_loss=args.loss_path == "per-token",
            steps=args.steps,
            lr=args.lr,
            seed=args.seed,
            temperature=args.temperature,
            teacher_init_std=args.teacher_init_std,
        )
        if args.nnodes < 1 or args.nproc % args.nnodes:
            raise ValueError(f"--nproc {args.nproc} must divide into --nnodes {args.nnodes}")
        per_node = args.nproc_per_node or args.nproc // args.nnodes
        if per_node * args.nnodes != args.nproc:
            raise ValueError(
                f"--nproc-per-node {per_node} x --nnodes {args.nnodes} != --nproc {args.nproc}"
            )
        if args.nnodes > 1 and not args.rdzv_endpoint:
            raise ValueError("a multi-node job needs --rdzv-endpoint HOST:PORT")
        args.nproc_per_node = per_node  # resolved once; the launch reads it
        if args.timeout is None:  # resolved here: the launcher and every rank see one value
            args.timeout = default_timeout_s(per_node, cfg.steps)
        elif not args.timeout > 0:
            raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout}")
    except ValueError as exc:
        p.error(str(exc))
    return args, cfg


def _resolve_backend(args: argparse.Namespace) -> str:
    if args.backend != "auto":
        return args.backend
    import torch

    per_node = args.nproc_per_node
    enough = torch.cuda.is_available() and torch.cuda.device_count() >= per_node
    return "nccl" if enough else "gloo"


def main(argv: list[str] | None = None) -> int:
    """Launch the demo under torchrun (or, with ``--worker``, be one of its ranks)."""
    if argv is None:
        argv = sys.argv[1:]
    if argv == ["--worker"] and _ARGV_ENV in os.environ:  # a rank started by this launcher
        argv = [*json.loads(os.environ[_ARGV_ENV]), "--worker"]
    args, cfg = _parse(argv)
    if args.worker:
        from mopd.profiling import phases

        phases.enter("starting: importing torch and megatron-core")
        from mopd.profiling.demo.job import worker

        return worker(args, cfg)
    from mopd.profiling.extras import missing_megatron

    missing = missing_megatron("mopd demo")
    if missing is not None:  # one line here rather than a traceback from every rank
        print(missing, file=sys.stderr)
        return 2
    from mopd.profiling.launch import run_torchrun

    backend = _resolve_backend(args)
    per_node = args.nproc_per_node
    if backend == "nccl":
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < per_node:
            print(f"mopd demo: --backend nccl needs {per_node} GPUs, found {gpus}", file=sys.stderr)
            return 2
    out = sys.stderr if args.json else sys.stdout
    print(
        f"mopd demo: {cfg.nproc} ranks, backend {backend}, {cfg.steps} steps of "
        f"{cfg.micro_batches} micro-batches, killed after {args.timeout:.0f} s (--timeout); "
        "starting the ranks (each imports torch and megatron-core first)...",
        file=out,
        flush=True,
    )
    # the user's flags travel in the environment: torchrun's own parser would claim some
    env = {
        "MOPD_DEMO_BACKEND": backend,
        _ARGV_ENV: json.dumps(list(argv)),
        _T0_ENV: str(time.time()),
    }
    rdzv = (
        ["--standalone"]
        if args.nnodes == 1
        else [
            f"--nnodes={args.nnodes}",
            f"--node-rank={args.node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={args.rdzv_endpoint}",
        ]
    )
    return run_torchrun(
        "mopd.profiling.demo",
        ["--worker"],
        nproc=per_node,
        timeout_s=args.timeout,
        env=env,
        rendezvous=rdzv,
        tool="mopd demo",
        timeout_hint=f"give it more time with --timeout SECONDS (this run had {args.timeout:.0f}; "
        "a busy or slow machine starts the ranks slowly)",
    )


if __name__ == "__main__":
    sys.exit(main())
