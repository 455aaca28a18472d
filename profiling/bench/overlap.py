"""Benchmark: how much of the teacher's time hides behind the student's on disjoint meshes.

Why this file exists: when the teacher and the student hold different ranks, the teacher's
forward-only pass runs on its ranks while megatron's schedule runs on the student's, and the
bridge sends each teacher micro-batch as soon as it is captured; the student's ``loss_func``
waits only for the micro-batch it needs. A step should then cost the slower side's time plus
filling (or draining) one micro-batch, not the sum of both. This shows, in one run, how close
the library gets, for teachers sized at chosen multiples of the student's time.

One teacher rank and one student rank (``Mesh(tp=1)`` each, disjoint), each pinned to its own
core, one thread each; real megatron-core GPTModels (``mopd.mcore.cpu`` on gloo), the student
under DDP and megatron's ``get_forward_backward_func()``, the step built by
``Distiller.step(rollouts, num_micro_batches=M)``: the job a user runs, less the sampling and the
optimizer (they do not overlap with the teacher). Per teacher-to-student ratio the teacher's
depth is calibrated in the run (its layer count scaled until ``T / S`` is near the ratio asked
for); the figure reports the ratio measured.

Per ratio, two modes, ``--steps`` steps each after a warm-up step, both ranks starting each step
together (a barrier, not timed) and the step's time the later rank's:

- ``lockstep``: the teacher's pass, then the student's schedule (the student rank waits for the
  teacher rank's ``Distiller.step`` to return before its schedule starts), what a job pays that
  runs the two one after the other. It gives the two sides' own times: ``teacher_ms`` (the
  teacher rank's ``Distiller.step``: metadata, plan and the forward pass with its sends) and
  ``student_ms`` (the student rank's ``Distiller.step``, schedule and ``finish``, less its wait).
- ``bridge``: no wait; what the library does by itself.

``floor_ms`` = max(teacher, student) + one micro-batch of fill, the faster side's time per
micro-batch (the student's first loss needs the teacher's first micro-batch; with a slower
teacher, the student's last micro-batch runs after the teacher's last):
``max(T, S) + min(T_pass, S_schedule) / M``. ``step_over_floor`` = bridge step / floor (1.0 is
perfect overlap); ``lockstep_over_floor`` the same for lockstep. Medians over the timed steps.

The two ranks must not share a core with anything else: on a busy machine the figures say more
about the machine than the library (the run prints the load average it saw). Times are one CPU
thread per rank, the ratios are the figure.

Run: ``python -m mopd.profiling.bench.overlap [--ratios 0.5 1 2] [--json] [--results-dir DIR]``
(or ``mopd bench overlap``). Each ratio says on stderr when it starts and what it measured
(``n of N``); then a table (``--json``: one JSON object per ratio, ``teacher_to_student``,
``step_over_floor``, ..., and nothing else on stdout) and a summary line. Records ``overlap-<machine>-<date>.{csv,md}`` in
the results folder (:func:`mopd.profiling.results.default_results_dir`; not with ``--no-record``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mopd.profiling.extras import can_draw
from mopd.profiling.launch import run_spawned
from mopd.profiling.mesh_arg import OneLineParser, prog_for

__all__ = ["build_parser", "floor_ms", "main", "plot", "summary"]

#: the global ranks: the teacher's, then the student's (disjoint meshes)
TEACHER_RANK, STUDENT_RANK = 0, 1
VOCAB = 256
#: rounds of resizing the teacher towards the ratio asked for
CALIBRATIONS = 3


def floor_ms(
    *, teacher_ms: float, student_ms: float, teacher_pass_ms: float, schedule_ms: float, m: int
) -> float:
    """The best a step can do when the two sides overlap perfectly: the slower side's time plus
    one micro-batch of the faster side's compute (``M = m`` micro-batches)."""
    return max(teacher_ms, student_ms) + min(teacher_pass_ms, schedule_ms) / m


def plot(rows: Sequence[dict[str, Any]], png: Path, title: str) -> Path:
    """Per measured teacher-to-student ratio, the step over its floor: lockstep beside the
    bridge, with the floor (1.0) and the 1.15x goal drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 4.0), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    pos = list(range(len(rows)))
    width = 0.38
    for shift, key, label, color in (
        (-width / 2, "lockstep_over_floor", "lockstep (teacher, then student)", "#7f7f7f"),
        (width / 2, "step_over_floor", "bridge", "#4472c4"),
    ):
        values = [float(r[key]) for r in rows]
        bars = ax.bar([p + shift for p in pos], values, width, label=label, color=color)
        ax.bar_label(bars, labels=[f"{v:.2f}x" for v in values], padding=2, fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(1.15, color="#c00000", linewidth=0.8, linestyle="--", label="1.15x the floor")
    ax.set_xticks(pos, [f"teacher {float(r['teacher_to_student']):.2f}x student" for r in rows])
    ax.set_ylabel("step time / floor (max(T, S) + one micro-batch)")
    ax.legend(fontsize=8, loc="upper right")
    ax.set_ylim(0, max(2.0, *(float(r["lockstep_over_floor"]) * 1.15 for r in rows)))
    ax.set_title(title, fontsize=9)
    fig.savefig(png, dpi=110)
    return png


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog=prog_for("mopd.profiling.bench.overlap"), description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--ratios",
        type=float,
        nargs="+",
        default=[0.5, 1.0, 2.0],
        help="teacher-to-student time ratios to size the teacher for (default: 0.5 1 2)",
    )
    p.add_argument("--micro-batches", type=int, default=8, help="M per step (default: 8)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per mode (default: 5)")
    p.add_argument("--samples", type=int, default=4, help="samples per micro-batch (default: 4)")
    p.add_argument(
        "--length", type=int, default=64, help="tokens per sample, prompt + response (default: 64)"
    )
    p.add_argument("--hidden", type=int, default=256, help="hidden size of both (default: 256)")
    p.add_argument("--student-layers", type=int, default=2, help="the student's depth (default: 2)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, one timed step (a check)")
    p.add_argument("--json", action="store_true", help="one JSON object per ratio, no table")
    p.add_argument("--verbose", action="store_true", help="each step's parts per rank, on stderr")
    p.add_argument("--results-dir", type=Path, default=None)
    p.add_argument("--no-record", action="store_true", help="print only")
    return p


def _rollouts(args: argparse.Namespace, step: int) -> Any:
    """The step's samples, held by the student rank: fixed lengths (every step the same
    shapes), random tokens, a quarter of each sample its prompt."""
    import torch

    from mopd.mcore import Rollouts

    n = args.samples * args.micro_batches
    g = torch.Generator().manual_seed(step)
    prompt = max(1, args.length // 4)
    return Rollouts(
        prompts=[torch.randint(0, VOCAB, (prompt,), generator=g) for _ in range(n)],
        responses=[torch.randint(0, VOCAB, (args.length - prompt,), generator=g) for _ in range(n)],
        teachers=torch.zeros(n, dtype=torch.long),
    )


def _gpt(mesh: Any, pg: Any, *, layers: int, args: argparse.Namespace, seed: int) -> Any:
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=layers,
        hidden_size=args.hidden,
        num_attention_heads=4,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        calculate_per_token_loss=True,
    )
    return GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=args.length,
        pg_collection=pg,
    )


class _Job:
    """One rank of the benchmark: the student (built once) and a teacher of a chosen depth."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist
        from megatron.core.distributed import DistributedDataParallel as DDP
        from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads

        from mopd.bridge import GroupPool, Mesh
        from mopd.mcore import megatron_process_groups

        self.args = args
        self.rank = dist.get_rank()
        self.pool = GroupPool(timeout_s=300)
        self.teacher_mesh = Mesh(tp=1, rank_offset=TEACHER_RANK)
        self.student_mesh = Mesh(tp=1, rank_offset=STUDENT_RANK)
        self.teacher_pg = megatron_process_groups(self.teacher_mesh, self.pool)
        self.student_pg = megatron_process_groups(self.student_mesh, self.pool)
        self.sync = dist.new_group([TEACHER_RANK, STUDENT_RANK], backend="gloo")
        self.student = None
        if self.rank == STUDENT_RANK:
            model = _gpt(
                self.student_mesh, self.student_pg, layers=args.student_layers, args=args, seed=2
            )
            self.student = DDP(
                model.config,
                DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                model,
                pg_collection=self.student_pg,
            )
            self.student.config.finalize_model_grads_func = finalize_model_grads
        self.distiller: Any = None
        self.torch = torch
        self.dist = dist

    def use_teacher(self, layers: int) -> None:
        """A fresh teacher of ``layers`` layers and a Distiller for it (the last one closed)."""
        from mopd.mcore import Distiller, MeshModel

        if self.distiller is not None:
            self.distiller.close()
        teacher = None
        if self.rank == TEACHER_RANK:
            teacher = _gpt(
                self.teacher_mesh, self.teacher_pg, layers=layers, args=self.args, seed=1
            ).eval()
        self.distiller = Distiller(
            teachers=[
                MeshModel(
                    mesh=self.teacher_mesh,
                    model=teacher,
                    pg_collection=self.teacher_pg if teacher is not None else None,
                )
            ],
            student=MeshModel(
                mesh=self.student_mesh,
                model=self.student,
                pg_collection=self.student_pg if self.student is not None else None,
            ),
            pool=self.pool,
            vocab_size=VOCAB,
        )

    def step(self, step: int, *, lockstep: bool) -> dict[str, float]:
        """One timed step; returns this rank's seconds: ``total`` (from the common start),
        ``wait`` (lockstep: the student's wait for the teacher), ``own`` (its ``Distiller.step``),
        ``work`` (teacher: its forward pass; student: its schedule)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        args = self.args
        held = _rollouts(args, step) if self.rank == STUDENT_RANK else None
        self.dist.barrier(group=self.sync)
        t0 = time.perf_counter()
        wait = work = 0.0
        with self.distiller.step(held, num_micro_batches=args.micro_batches) as mopd:
            t1 = time.perf_counter()
            own = t1 - t0
            if self.rank == TEACHER_RANK:
                work = mopd.timings["teacher"]
            if lockstep:  # the teacher rank arrives once its pass is done
                self.dist.barrier(group=self.sync)
                wait = time.perf_counter() - t1
            if self.rank == STUDENT_RANK:
                assert self.student is not None
                t2 = time.perf_counter()
                get_forward_backward_func()(
                    forward_step_func=mopd.forward_step,
                    model=[self.student],
                    **mopd.schedule_kwargs(),
                    p2p_communicator=P2PCommunicator(
                        pp_group=self.student_pg.pp, config=self.student.config
                    ),
                    pg_collection=self.student_pg,
                )
                work = time.perf_counter() - t2
        total = time.perf_counter() - t0
        if self.student is not None:
            self.student.zero_grad_buffer()
        return {"total": total, "wait": wait, "own": own, "work": work}

    def exchange(self, mine: dict[str, float]) -> dict[str, dict[str, float]]:
        """Both ranks' figures of a step, on both ranks."""
        out: list[Any] = [None, None]
        self.dist.all_gather_object(out, mine, group=self.sync)
        both = {"teacher": out[TEACHER_RANK], "student": out[STUDENT_RANK]}
        if self.args.verbose and self.rank == 0:
            parts = "; ".join(
                f"{side} " + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in f.items())
                for side, f in both.items()
            )
            print(f"bench_overlap: step: {parts}", file=sys.stderr, flush=True)
        return both

    def measure(self, steps: int, *, lockstep: bool, first: int) -> dict[str, float]:
        """Medians over ``steps`` steps (after one warm-up step) of the step and its parts."""
        self.step(first, lockstep=lockstep)
        per = [self.exchange(self.step(first + 1 + k, lockstep=lockstep)) for k in range(steps)]

        def med(f: Any) -> float:
            return 1e3 * statistics.median(f(p) for p in per)

        return {
            "step_ms": med(lambda p: max(p["teacher"]["total"], p["student"]["total"])),
            "teacher_ms": med(lambda p: p["teacher"]["own"]),
            "teacher_pass_ms": med(lambda p: p["teacher"]["work"]),
            "student_ms": med(lambda p: p["student"]["total"] - p["student"]["wait"]),
            "schedule_ms": med(lambda p: p["student"]["work"]),
        }

    def close(self) -> None:
        if self.distiller is not None:
            self.distiller.close()
        self.pool.close()


def summary(rows: Sequence[dict[str, Any]]) -> str:
    """One line: the bridge's step against its floor, beside lockstep's, over the ratios run."""

    def span(key: str, fmt: str) -> str:
        lo, hi = min(r[key] for r in rows), max(r[key] for r in rows)
        return f"{lo:{fmt}}x" if f"{lo:{fmt}}" == f"{hi:{fmt}}" else f"{lo:{fmt}}x-{hi:{fmt}}x"

    return (
        f"summary: over {len(rows)} teacher sizes ({span('teacher_to_student', '.2f')} the "
        f"student), the bridge's step is {span('step_over_floor', '.2f')} its floor, lockstep's "
        f"{span('lockstep_over_floor', '.2f')}"
    )


def _row(args: argparse.Namespace, ratio: float, layers: int, lock: dict, bridge: dict) -> dict:
    m = args.micro_batches
    floor = floor_ms(
        teacher_ms=lock["teacher_ms"],
        student_ms=lock["student_ms"],
        teacher_pass_ms=lock["teacher_pass_ms"],
        schedule_ms=lock["schedule_ms"],
        m=m,
    )
    return {
        "ratio_asked": ratio,
        "teacher_to_student": round(lock["teacher_ms"] / lock["student_ms"], 3),
        "teacher_layers": layers,
        "student_layers": args.student_layers,
        "micro_batches": m,
        "teacher_ms": round(lock["teacher_ms"], 2),
        "student_ms": round(lock["student_ms"], 2),
        "teacher_pass_ms": round(lock["teacher_pass_ms"], 2),
        "schedule_ms": round(lock["schedule_ms"], 2),
        "floor_ms": round(floor, 2),
        "lockstep_ms": round(lock["step_ms"], 2),
        "step_ms": round(bridge["step_ms"], 2),
        "step_over_floor": round(bridge["step_ms"] / floor, 3),
        "lockstep_over_floor": round(lock["step_ms"] / floor, 3),
        "bridge_teacher_ms": round(bridge["teacher_ms"], 2),
        "bridge_schedule_ms": round(bridge["schedule_ms"], 2),
    }


def _run(args: argparse.Namespace) -> int:
    """One rank: calibrate a teacher per ratio, time both modes, rank 0 prints and records."""
    import torch
    import torch.distributed as dist

    from mopd.mcore import cpu

    cpu.quiet()  # megatron-core's known CPU notices, before it is imported
    cpu.apply()  # the CPU patches, before megatron-core is imported: its fusions plain
    cores = sorted(os.sched_getaffinity(0))
    rank = int(os.environ["RANK"])
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    job = _Job(args)
    load = os.getloadavg()[0]
    rows = []
    step = 0
    try:
        # the teacher's cost per layer against the student's whole step, from a 1-layer teacher
        job.use_teacher(1)
        probe = job.measure(1, lockstep=True, first=step)
        step += 2
        per_layer = probe["teacher_ms"] / probe["student_ms"]
        for i, ratio in enumerate(args.ratios):
            if rank == 0:  # each ratio takes a while: say which one runs
                print(
                    f"bench_overlap: {i + 1} of {len(args.ratios)}: teacher at {ratio:g}x the "
                    "student: sizing it, then timing lockstep and the bridge...",
                    file=sys.stderr,
                    flush=True,
                )
            layers = max(1, round(ratio / per_layer))
            job.use_teacher(layers)
            for _ in range(CALIBRATIONS):  # the per-layer cost is not all of the teacher's step
                lock = job.measure(2, lockstep=True, first=step)
                step += 3
                measured = lock["teacher_ms"] / lock["student_ms"]
                better = max(1, round(layers * ratio / measured))
                if better == layers:
                    break
                layers = better
                job.use_teacher(layers)
            lock = job.measure(args.steps, lockstep=True, first=step)
            step += args.steps + 1
            bridge = job.measure(args.steps, lockstep=False, first=step)
            step += args.steps + 1
            rows.append(_row(args, ratio, layers, lock, bridge))
            if rank == 0:
                r = rows[-1]
                print(
                    f"bench_overlap: {i + 1} of {len(args.ratios)}: teacher {r['teacher_layers']} "
                    f"layers = {r['teacher_to_student']:g}x the student: step "
                    f"{r['step_ms']:.1f} ms = {r['step_over_floor']:.3f}x its floor (lockstep "
                    f"{r['lockstep_over_floor']:.3f}x)",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        job.close()
    if rank == 0:
        _report(args, rows, load_start=load, load_end=os.getloadavg()[0])
    dist.destroy_process_group()
    return 0


def _report(
    args: argparse.Namespace, rows: list[dict], *, load_start: float, load_end: float
) -> None:
    from mopd.profiling.results import format_table, record

    if args.json:
        for row in rows:
            print(json.dumps(row), flush=True)
    else:
        print(format_table(rows), flush=True)
    print(summary(rows), file=sys.stderr if args.json else sys.stdout, flush=True)
    if args.no_record:
        return
    notes = (
        f"Disjoint meshes: one teacher rank and one student rank (tp1 each), each pinned to its own "
        f"core, one thread each; {args.micro_batches} micro-batches of {args.samples} samples x "
        f"{args.length} tokens, hidden {args.hidden}, student {args.student_layers} layers under DDP "
        f"and megatron's schedule, the teacher's depth calibrated per ratio; medians of "
        f"{args.steps} steps per mode after a warm-up step. Load average {load_start:.2f} at the "
        f"start, {load_end:.2f} at the end.\n\n"
        "`teacher_ms`, `student_ms`: each side's own time in lockstep (the teacher rank's "
        "Distiller.step: metadata, plan and forward pass with its sends; the student rank's "
        "Distiller.step, schedule and finish, less its wait for the teacher); "
        "`teacher_to_student` their ratio. `floor_ms` = max(teacher, student) + one micro-batch of "
        "the faster side's compute. `lockstep_ms`: the teacher's pass, then the student's "
        "schedule; `step_ms`: the bridge as it runs (no wait). `step_over_floor` = step_ms / "
        "floor_ms. Below 1.0 is possible: the floor's fill is a whole micro-batch, while only "
        "part of one is exposed (the student's forward of its first micro-batch runs beside the "
        "teacher's; after the teacher's last send only the student's last loss and backward "
        "remain). `bridge_teacher_ms`, `bridge_schedule_ms`: the teacher rank's Distiller.step and "
        "the student's schedule in the bridge mode (the schedule then includes its waits for "
        f"rows). {summary(rows)}"
    )
    csv_path, md_path = record("overlap", rows, out_dir=args.results_dir, notes=notes)
    recorded = [csv_path, md_path]
    if can_draw("mopd bench overlap"):
        title = (
            f"{csv_path.stem}: a teacher rank and a student rank, disjoint meshes\n"
            f"one CPU core each, {args.micro_batches} micro-batches; the ratios are the figure"
        )
        recorded.append(plot(rows, csv_path.with_suffix(".png"), title))
    print(f"bench_overlap: recorded {', '.join(map(str, recorded))}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("micro_batches", "steps", "samples", "length", "hidden", "student_layers"):
        value = getattr(args, name)
        if value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.length < 2:
        parser.error(f"--length must be >= 2 (a prompt and a response token), got {args.length}")
    if any(not r > 0 for r in args.ratios):
        parser.error(f"--ratios must be positive, got {args.ratios}")
    if args.quick:
        args.steps, args.samples, args.length, args.hidden = 1, 2, 16, 64
        args.micro_batches = min(args.micro_batches, 4)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if os.environ["WORLD_SIZE"] != "2":
            parser.error(
                f"runs on 2 ranks (a teacher and a student), got {os.environ['WORLD_SIZE']}"
            )
        return _run(args)
    return run_spawned(_run, vars(args), nproc=2, tool="bench_overlap")


if __name__ == "__main__":
    raise SystemExit(main())
