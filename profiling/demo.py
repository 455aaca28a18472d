"""``mopd demo``: a real multi-teacher MOPD training job on tiny models, started with one command.

Why this file exists: a user should see the whole pipeline work, end to end and verified, before
wiring it into a trainer. ``main`` checks the flags, then starts torchrun itself (8 CPU ranks with
gloo by default, NCCL when there are enough GPUs); every rank runs ``--worker``
(:mod:`mopd.profiling.demo_job`), which trains the way a megatron-core user does:

- two frozen teacher GPTModels, each on its own mesh with its own hidden size (default teacher 0:
  TP2 DP2 on ranks 0-3, teacher 1: TP4 on ranks 4-7, SP on), and a student GPTModel on its own
  mesh (default TP2 CP2 DP2 over all 8 ranks, THD-packed sequences, CP zigzag), each on explicit
  process groups (:func:`mopd.bridge.megatron_process_groups`), PP allowed on both sides;
- set-up once with :class:`mopd.mcore.Distiller` (bridge groups, the bridge, the teachers' LM
  heads resharded into the student's vocab partition);
- each step: a global batch of samples with global ids, cut into micro-batches (sample ``i`` goes
  to teacher ``i % num_teachers``); ``Distiller.step`` plans the bridge and runs the teachers'
  forward-only pass; megatron's ``get_forward_backward_func()`` runs the student (1F1B with PP)
  with the MOPD loss inside ``loss_func``; then Adam;
- step 1's bridged rows are checked on every student rank against an all-gather reference (the
  teachers' hidden states, from a second teacher pass, joined by key): any mismatch makes the job
  exit non-zero; otherwise rank 0 prints ``verification: OK``; it ends with time per phase, the
  loss per step and bytes per link (``--json``: one JSON object instead).

megatron-core runs on CPU ranks through :mod:`mopd.mcore.cpu` (shipped in the package). The
teachers are random-init models fed random tokens: the job shows data movement and training
mechanics, not distillation quality. Under your own launcher (several nodes, say), run the
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
from dataclasses import dataclass, field, replace

from mopd.profiling.mesh_arg import MeshSpec, OneLineParser, parse_int_list, parse_mesh

__all__ = ["DemoConfig", "main"]

_ARGV_ENV = "MOPD_DEMO_ARGV"
_T0_ENV = "MOPD_DEMO_T0"
_DEFAULT_TEACHERS = ("tp=2,dp=2,rank_offset=0", "tp=4,rank_offset=4")


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Everything a worker needs, validated identically on every rank (and in the launcher).

    Attributes:
        nproc: ranks in the job.
        teachers / teacher_hidden: one mesh and hidden size per teacher (same vocabulary).
        student / student_hidden: the student's mesh and hidden size.
        heads, layers, vocab, seq_len: model and batch shape (``seq_len`` = max sample length).
        samples: samples per step over the whole job (global ids ``step * samples + i``).
        micro_batches: micro-batches per step (each a contiguous share of the samples).
        per_token_loss: megatron's ``calculate_per_token_loss`` (else its default loss path).
        steps, lr, seed: the training run.
        teacher_init_std: the teachers' init std (large -> peaked teacher distributions).
        prompt_len: the first tokens of each sample are its prompt: the student's loss mask
            leaves them out (the KL counts the response), so the teachers never send them.
    """

    nproc: int
    teachers: tuple[MeshSpec, ...]
    teacher_hidden: tuple[int, ...]
    student: MeshSpec
    student_hidden: int
    heads: int = 4
    layers: int = 2
    vocab: int = 256
    seq_len: int = 32
    samples: int = 8
    micro_batches: int = 2
    per_token_loss: bool = True
    steps: int = 3
    lr: float = 3e-3
    seed: int = 1234
    teacher_init_std: float = 0.2
    prompt_len: int = 8
    min_len: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        for name in (
            "nproc",
            "heads",
            "layers",
            "vocab",
            "seq_len",
            "samples",
            "micro_batches",
            "steps",
            "student_hidden",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0 or not self.teacher_init_std > 0:
            raise ValueError(
                f"lr and teacher_init_std must be > 0, got {self.lr}, {self.teacher_init_std}"
            )
        if not self.teachers:
            raise ValueError("at least one teacher is needed")
        if len(self.teacher_hidden) != len(self.teachers):
            raise ValueError(
                f"{len(self.teachers)} teacher meshes but {len(self.teacher_hidden)} teacher "
                f"hidden sizes {list(self.teacher_hidden)}"
            )
        models = [
            (f"teacher {i}", m, h)
            for i, (m, h) in enumerate(zip(self.teachers, self.teacher_hidden, strict=True))
        ]
        models.append(("student", self.student, self.student_hidden))
        if any(m.rank_offset is None for _, m, _ in models):
            raise ValueError("every mesh needs its rank_offset (the parser defaults it to 0)")
        covered: set[int] = set()
        for label, m, h in models:
            end = m.rank_offset + m.size
            if end > self.nproc:
                raise ValueError(
                    f"{label} mesh ({m}) needs global ranks {m.rank_offset}..{end - 1}, the job "
                    f"has {self.nproc}"
                )
            covered |= set(range(m.rank_offset, end))
            if self.heads % m.tp:
                raise ValueError(
                    f"{label}: {self.heads} attention heads do not divide by tp={m.tp}"
                )
            if h < 1 or h % self.heads:
                raise ValueError(
                    f"{label}: hidden size {h} must be a positive multiple of {self.heads} heads"
                )
            if self.vocab % m.tp:
                raise ValueError(f"{label}: vocab {self.vocab} does not divide by tp={m.tp}")
            if self.layers % m.pp:
                raise ValueError(f"{label}: {self.layers} layers do not divide by pp={m.pp}")
        if covered != set(range(self.nproc)):
            raise ValueError(
                f"every rank must hold a model; ranks {sorted(set(range(self.nproc)) - covered)} "
                f"hold none (teachers {[str(t) for t in self.teachers]}, student {self.student}, "
                f"nproc {self.nproc})"
            )
        if self.samples % self.micro_batches:
            raise ValueError(
                f"samples per step ({self.samples}) must divide into {self.micro_batches} "
                "micro-batches"
            )
        per_mb = self.samples // self.micro_batches
        if per_mb % len(self.teachers):
            raise ValueError(
                f"samples per micro-batch ({per_mb}) must divide by the number of teachers "
                f"({len(self.teachers)})"
            )
        for i, t in enumerate(self.teachers):
            if t.cp != 1:
                raise ValueError(f"teacher {i}: the demo's teachers take cp=1, got cp={t.cp}")
            if self.seq_len % t.tp:
                raise ValueError(
                    f"teacher {i}: seq_len {self.seq_len} must divide by tp={t.tp} (sequence "
                    "parallelism)"
                )
            if per_mb // len(self.teachers) < t.dp:
                raise ValueError(
                    f"teacher {i} gets {per_mb // len(self.teachers)} samples per micro-batch, "
                    f"fewer than its dp={t.dp}"
                )
        if per_mb < self.student.dp:
            raise ValueError(
                f"{per_mb} samples per micro-batch are fewer than the student's dp={self.student.dp}"
            )
        object.__setattr__(self, "min_len", max(1, self.seq_len // 2))
        if not 0 <= self.prompt_len < self.min_len:
            raise ValueError(
                f"prompt_len must be in [0, {self.min_len}) (samples are {self.min_len}.."
                f"{self.seq_len} tokens), got {self.prompt_len}"
            )

    @property
    def num_teachers(self) -> int:
        return len(self.teachers)

    def as_dict(self) -> dict[str, object]:
        """The configuration as plain data (for ``--json``)."""
        return {
            "nproc": self.nproc,
            "teachers": [str(t) for t in self.teachers],
            "teacher_hidden": list(self.teacher_hidden),
            "student": str(self.student),
            "student_hidden": self.student_hidden,
            "samples": self.samples,
            "micro_batches": self.micro_batches,
            "seq_len": self.seq_len,
            "vocab": self.vocab,
            "steps": self.steps,
            "per_token_loss": self.per_token_loss,
            "prompt_len": self.prompt_len,
        }


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="mopd demo",
        description="A verified multi-teacher MOPD training run through megatron-core's schedule.",
        epilog="MESH: comma-separated tp=, cp=, dp=, pp= and rank_offset= (the mesh's first "
        "global rank), e.g. tp=2,dp=2,rank_offset=0; missing keys are 1 (rank_offset: 0). "
        "Teachers take cp=1. Sample i goes to teacher i % (number of teachers).",
    )
    p.add_argument("--nproc", type=int, default=8, help="ranks in the job (default 8)")
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
    p.add_argument("--teacher-hidden", default="64,96", help="hidden size per teacher (64,96)")
    p.add_argument("--student", default="tp=2,cp=2,dp=2", metavar="MESH", help="(tp=2,cp=2,dp=2)")
    p.add_argument("--student-hidden", type=int, default=48)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=32, help="max sample length (in [seq/2, seq])")
    p.add_argument("--samples", type=int, default=8, help="samples per step, whole job")
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step")
    p.add_argument(
        "--prompt-len",
        type=int,
        default=8,
        help="prompt tokens per sample, left out of the KL and never sent (default 8)",
    )
    p.add_argument(
        "--loss-path",
        choices=["per-token", "default"],
        default="per-token",
        help="megatron's loss normalization: calculate_per_token_loss=True, or its default",
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", action="store_true", help="print one JSON object of the results")
    p.add_argument("--trace", metavar="DIR", help="write a torch.profiler trace per rank to DIR")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before the job is killed")
    launch = p.add_argument_group("launching (passed to torchrun)")
    launch.add_argument("--nnodes", type=int, default=1)
    launch.add_argument(
        "--nproc-per-node", type=int, default=None, help="(default: --nproc / --nnodes)"
    )
    launch.add_argument("--node-rank", type=int, default=0)
    launch.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT")
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
    args = p.parse_args(argv)
    try:
        cfg = DemoConfig(
            nproc=args.nproc,
            teachers=tuple(_mesh(t, "--teacher") for t in (args.teacher or _DEFAULT_TEACHERS)),
            teacher_hidden=parse_int_list(args.teacher_hidden, what="--teacher-hidden size"),
            student=_mesh(args.student, "--student"),
            student_hidden=args.student_hidden,
            heads=args.heads,
            layers=args.layers,
            vocab=args.vocab,
            seq_len=args.seq_len,
            samples=args.samples,
            micro_batches=args.micro_batches,
            prompt_len=args.prompt_len,
            per_token_loss=args.loss_path == "per-token",
            steps=args.steps,
            lr=args.lr,
            seed=args.seed,
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
        from mopd.profiling.demo_job import worker

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
        f"{cfg.micro_batches} micro-batches; starting the ranks (each imports torch and "
        "megatron-core first)...",
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
    )


if __name__ == "__main__":
    sys.exit(main())
