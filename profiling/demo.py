"""``mopd demo``: a real multi-teacher MOPD training job on tiny models, started with one command.

Why this file exists: a user should see the whole pipeline work, end to end and verified, before
wiring it into a trainer. ``main`` starts torchrun itself (8 ranks on CPU with gloo by default,
NCCL when there are enough GPUs) and every rank runs ``--worker``:

- two (or more) frozen teacher GPTModels, each on its own mesh with its own hidden size
  (default teacher 0: TP2 DP2 on ranks 0-3, teacher 1: TP4 on ranks 4-7, both with SP on CPU),
  and a student GPTModel on its own mesh (default TP2 CP2 DP2 over all 8 ranks, THD-packed sequences, CP zigzag). Each
  model is built on explicit process groups (megatron's ``pg_collection``), so the meshes differ
  inside one job; megatron's global ``parallel_state`` is set up as plain data parallelism only
  for what still reads it (the global memory buffer, the RNG tracker);
- each step draws a batch of samples with global ids; sample ``i`` is routed to teacher
  ``i % num_teachers``. Teacher forward under the capture -> bridge (teacher ``[S, B, H]``
  padded layouts -> the student's packed CP layout) -> student forward (overlapping the
  transfer) -> full-vocabulary reverse KL with the teachers' LM-head shards (resharded once at
  start-up) -> backward -> gradient all-reduce over the student's DP x CP ranks -> Adam step;
- step 1's bridged buffers are checked on every student rank against an all-gather reference
  (every teacher's captured hidden states on every rank, joined by key); any mismatch makes the
  job exit non-zero; otherwise rank 0 prints ``verification: OK``;
- rank 0 shows a progress bar over steps and ends with a table: time per phase (max over ranks),
  loss per step, and bytes per link from the transfer plans.

On CPU the megatron patches and the stand-in CP/THD core attention come from the checkout's test
support (``tests/support/megatron_cpu.py``, ``tests/support/cpu_attention.py``); on GPUs only the
stand-in attention is used (megatron's local attention does neither CP nor THD).
The teachers are random-init models fed random tokens: the job shows data movement and training
mechanics, not distillation quality.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field

__all__ = [
    "PHASE_NAMES",
    "DemoConfig",
    "MeshArg",
    "main",
    "parse_mesh",
]

#: The timed phases of one step, in table order.
PHASE_NAMES: tuple[str, ...] = (
    "capture (teacher fwd)",
    "bridge",
    "student fwd",
    "loss",
    "backward",
    "grad sync",
    "optimizer",
)


@dataclass(frozen=True, kw_only=True)
class MeshArg:
    """A mesh as given on the command line: ``tp=2,cp=1,dp=2,at=0`` (``at``: first global rank)."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    at: int = 0

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "dp"):
            if getattr(self, name) < 1:
                raise ValueError(f"mesh {name} must be >= 1, got {getattr(self, name)}")
        if self.at < 0:
            raise ValueError(f"mesh at (first global rank) must be >= 0, got {self.at}")

    @property
    def size(self) -> int:
        return self.tp * self.cp * self.dp

    def __str__(self) -> str:
        return f"tp={self.tp},cp={self.cp},dp={self.dp},at={self.at}"


def parse_mesh(text: str) -> MeshArg:
    """``"tp=2,dp=2,at=0"`` -> :class:`MeshArg`; missing keys default (1, 1, 1, 0)."""
    values: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, raw = part.partition("=")
        if not sep or key not in ("tp", "cp", "dp", "at"):
            raise ValueError(
                f"mesh {text!r}: expected comma-separated tp=/cp=/dp=/at=, got {part!r}"
            )
        try:
            values[key] = int(raw)
        except ValueError:
            raise ValueError(f"mesh {text!r}: {key} must be an integer, got {raw!r}") from None
    return MeshArg(**values)


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Everything a worker needs, validated identically on every rank (and in the launcher).

    Attributes:
        nproc: ranks in the job.
        teachers / teacher_hidden: one mesh and hidden size per teacher (same vocabulary).
        student / student_hidden: the student's mesh and hidden size.
        heads, layers, vocab, seq_len: model and batch shape (``seq_len`` = max sample length).
        samples: samples per step over the whole job (global ids ``step * samples + i``).
        steps, lr, seed: the training run.
        teacher_init_std: the teachers' init std (large -> peaked teacher distributions).
        overlap: run the student forward while the bridge transfer is in flight.
    """

    nproc: int
    teachers: tuple[MeshArg, ...]
    teacher_hidden: tuple[int, ...]
    student: MeshArg
    student_hidden: int
    heads: int = 4
    layers: int = 2
    vocab: int = 256
    seq_len: int = 32
    samples: int = 8
    steps: int = 3
    lr: float = 3e-3
    seed: int = 1234
    teacher_init_std: float = 0.2
    overlap: bool = True
    min_len: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        for name in (
            "nproc",
            "heads",
            "layers",
            "vocab",
            "seq_len",
            "samples",
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
                f"{len(self.teachers)} teacher meshes but {len(self.teacher_hidden)} teacher hidden sizes "
                f"{list(self.teacher_hidden)}"
            )
        models = [
            (f"teacher {i}", m, h)
            for i, (m, h) in enumerate(zip(self.teachers, self.teacher_hidden, strict=True))
        ]
        models.append(("student", self.student, self.student_hidden))
        covered: set[int] = set()
        for label, m, h in models:
            end = m.at + m.size
            if end > self.nproc:
                raise ValueError(
                    f"{label} mesh ({m}) needs global ranks {m.at}..{end - 1}, the job has {self.nproc}"
                )
            covered |= set(range(m.at, end))
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
        if covered != set(range(self.nproc)):
            raise ValueError(
                f"every rank must hold a model; ranks {sorted(set(range(self.nproc)) - covered)} hold none "
                f"(teachers {[str(t) for t in self.teachers]}, student {self.student}, nproc {self.nproc})"
            )
        for i, t in enumerate(self.teachers):
            if t.cp != 1:
                raise ValueError(
                    f"teacher {i}: context parallelism is not supported in the demo (cp={t.cp})"
                )
            if self.seq_len % t.tp:
                raise ValueError(
                    f"teacher {i}: seq_len {self.seq_len} must divide by tp={t.tp} (sequence parallel)"
                )
            per_teacher = len(range(i, self.samples, len(self.teachers)))
            if per_teacher < t.dp:
                raise ValueError(
                    f"teacher {i} gets {per_teacher} of {self.samples} samples per step, fewer than its dp={t.dp}"
                )
        if self.student.cp > 1 and self.seq_len % (2 * self.student.cp):
            raise ValueError(
                f"seq_len {self.seq_len} must divide by 2*cp = {2 * self.student.cp} (student context parallelism)"
            )
        if self.samples % len(self.teachers):
            raise ValueError(
                f"samples per step ({self.samples}) must divide by the number of teachers ({len(self.teachers)})"
            )
        if self.samples < self.student.dp:
            raise ValueError(
                f"{self.samples} samples per step are fewer than the student's dp={self.student.dp}"
            )
        object.__setattr__(self, "min_len", max(1, self.seq_len // 2))

    @property
    def num_teachers(self) -> int:
        return len(self.teachers)


_ARGV_ENV = "MOPD_DEMO_ARGV"
_DEFAULT_TEACHERS = ("tp=2,dp=2,at=0", "tp=4,at=4")


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, DemoConfig]:
    p = argparse.ArgumentParser(
        prog="mopd demo",
        description=__doc__.split("\n\n")[0],
        epilog="MESH: comma-separated tp=, cp=, dp= and at= (the mesh's first global rank), "
        "e.g. tp=2,dp=2,at=0; missing keys are 1 (at: 0). Teachers take cp=1. Sample i goes "
        "to teacher i % (number of teachers).",
    )
    p.add_argument("--nproc", type=int, default=8, help="ranks (default 8)")
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
        "--teacher-hidden", default="64,96", help="hidden size per teacher (default 64,96)"
    )
    p.add_argument(
        "--student",
        default="tp=2,cp=2,dp=2",
        metavar="MESH",
        help="student mesh (default tp=2,cp=2,dp=2)",
    )
    p.add_argument("--student-hidden", type=int, default=48)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument(
        "--seq-len", type=int, default=32, help="max sample length (lengths vary in [seq/2, seq])"
    )
    p.add_argument("--samples", type=int, default=8, help="samples per step, whole job")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--no-overlap", action="store_true", help="wait for the bridge before the student forward"
    )
    p.add_argument(
        "--trace", metavar="DIR", help="write a torch.profiler chrome trace per rank into DIR"
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before the job is killed")
    p.add_argument("--inject-mismatch", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        teachers = tuple(parse_mesh(t) for t in (args.teacher or _DEFAULT_TEACHERS))
        hidden = tuple(int(h) for h in args.teacher_hidden.split(",") if h.strip())
        cfg = DemoConfig(
            nproc=args.nproc,
            teachers=teachers,
            teacher_hidden=hidden,
            student=parse_mesh(args.student),
            student_hidden=args.student_hidden,
            heads=args.heads,
            layers=args.layers,
            vocab=args.vocab,
            seq_len=args.seq_len,
            samples=args.samples,
            steps=args.steps,
            lr=args.lr,
            seed=args.seed,
            overlap=not args.no_overlap,
        )
    except ValueError as exc:
        p.error(str(exc))
    return args, cfg


def _resolve_backend(args: argparse.Namespace) -> str:
    if args.backend != "auto":
        return args.backend
    import torch

    return (
        "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= args.nproc else "gloo"
    )


def main(argv: list[str] | None = None) -> int:
    """Launch the demo under torchrun (or, with ``--worker``, be one of its ranks)."""
    if argv is None:
        argv = sys.argv[1:]
    if argv == ["--worker"]:  # a rank: the user's arguments come through the environment
        argv = [*json.loads(os.environ[_ARGV_ENV]), "--worker"]
    args, cfg = _parse(argv)
    if args.worker:
        from mopd.profiling.demo_job import worker

        return worker(args, cfg)
    from mopd.profiling.launch import cpu_support_root, run_torchrun

    backend = _resolve_backend(args)
    if backend == "nccl":
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < cfg.nproc:
            print(
                f"mopd demo: --backend nccl needs {cfg.nproc} GPUs, found {gpus}", file=sys.stderr
            )
            return 2
    env = {"MOPD_DEMO_BACKEND": backend}
    try:  # the stand-in CP/THD attention comes from the checkout on every backend
        env["MOPD_CHECKOUT"] = str(cpu_support_root())
    except ValueError as exc:
        print(f"mopd demo: {exc}", file=sys.stderr)
        return 2
    print(f"mopd demo: {cfg.nproc} ranks, backend {backend}, {cfg.steps} steps", flush=True)
    # not on torchrun's command line: its parser would claim options like --nproc (a prefix)
    env[_ARGV_ENV] = json.dumps(list(argv))
    return run_torchrun(
        "mopd.profiling.demo",
        ["--worker"],
        nproc=cfg.nproc,
        timeout_s=args.timeout,
        env=env,
    )


if __name__ == "__main__":
    sys.exit(main())
