"""``mopd plan``: the bridge's transfers for a teacher mesh, a student mesh and a batch, job-wide.

Why this file exists: before a job is launched, a person wants to know what the bridge will move
and where: which global rank sends how many bytes to which, how balanced the ranks are, how that
compares with shipping logits or going through host memory, and about how long it takes on a
given link. All of that follows from the meshes and the batch shape alone, so this tool answers
it on a laptop: no GPU, no process group. It simulates one step as the live bridge sees it:
every rank's metadata record (:mod:`mopd.bridge.metadata`) for every micro-batch, stacked as the
all-gather would, then :func:`mopd.bridge.plan.plan_rank` and
:func:`mopd.bridge.coverage.check_rank` on every rank (the functions each rank of a live bridge
runs). The job's plan is the union of those rank plans, and every figure is derived from it.

Batch model (one training step of one teacher; sample ids ``0 .. B-1``):

- the step has ``--micro-batches M`` micro-batches; micro-batch ``i`` is samples
  ``[i B / M, (i + 1) B / M)`` on both sides (the bridge pairs micro-batch ``i`` of the teacher
  with micro-batch ``i`` of the student), and each side's DP rank ``d`` holds the ``d``-th
  contiguous part of it (Megatron: the same number of samples on every DP rank);
- padded (``--batch B --seq-len S``): every sample has ``S`` real tokens. The teacher's rows are
  its capture's ``[S_pad / cp, b, H]``; the student wants its logits' ``[b, S_pad / cp]`` order
  (each SP slice's ``[S_pad / cp / tp, b]`` rows when it keeps its SP slice). ``S_pad`` is ``S``
  rounded up to a multiple of ``2 cp`` (times ``tp`` under sequence parallelism); rows past
  ``S`` are padding and never move. Under teacher SP each teacher TP rank holds its own
  ``[S_pad / cp / tp, b, H]`` slice and is a source of its own (``--teacher-sp-replicas``: the
  capture's gathered buffer on every TP rank, replicas);
- packed (``--packed-lengths L0,L1,...``): THD, each sample padded to that multiple separately.

Figures (bytes; ``row = hidden_size * dtype_bytes``; sums over the step's micro-batches):

- transfer matrix ``[W, W]``: bytes from source global rank (row) to destination (column); the
  diagonal is local copies (a student rank that is a teacher replica copies its rows);
- per rank: send and receive across ranks, local copies apart; imbalance is ``max / mean`` over
  the ranks that send (receive) anything;
- time at ``--link-gbps`` per rank and direction: per micro-batch ``max(send, recv) / bandwidth``
  of the slowest rank, added over the micro-batches. Without student sequence parallelism the
  student then all-gathers each micro-batch inside each student TP group (ring: each rank sends
  and receives ``tp - 1`` slices), timed at ``--nvlink-gbps``;
- bytes per link class (the step's): the crossing (point to point between ranks), colocated
  local copies, the teacher's TP links (the capture's SP all-gather, ``(tp - 1) / tp`` of each
  teacher buffer to every TP rank, when a teacher under SP sends from replicas; nothing when
  each TP rank sends its own SP shard, the default) and the student's TP all-gather, beside the
  minimum: each needed row once to each student ``(dp, cp)`` group (crossing and local copies
  together), nothing on the teacher's TP links, and the student TP all-gather its layout needs;
- logits instead of hidden states: ``vocab_size * dtype_bytes`` per token to every student rank
  that needs it (all ``tp`` ranks of the token's student group), and the best case of sending
  each rank only its ``vocab / tp`` slice;
- through host memory (NeMo-RL's path): D2H on the teacher rank the plan picks, the same
  network bytes host to host, H2D of every row each student rank needs (its whole shard, or its
  SP slice); PCIe bytes = D2H + H2D, two extra hops per token, each stage timed at
  ``--pcie-gbps`` per rank and the stages added (no overlap).

Nothing heavy is imported before the arguments are parsed: a bad flag is one line, at once.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from mopd.profiling.extras import can_draw
from mopd.profiling.mesh_arg import MESH_EXAMPLE, MeshSpec, OneLineParser, mesh_type, parse_int_list

if TYPE_CHECKING:
    pass

from mopd.profiling.plan.figures import inspect_plan
from mopd.profiling.plan.heatmap import render_heatmap
from mopd.profiling.plan.report import format_report, report_to_dict
from mopd.profiling.plan.request import PlanRequest

__all__ = [
    "build_parser",
    "main",
]


EXIT_USAGE = 2


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} must be > 0")
    return value


def _lengths(text: str) -> tuple[int, ...]:
    try:
        return parse_int_list(text, what="length")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _out_file(text: str) -> Path:
    """A file to write: its folder must exist (nothing is created but the file), ``-``: stdout."""
    if text == "-":
        return Path("-")
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file name")
    parent = path.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: folder {parent} does not exist")
    return path


def build_parser() -> argparse.ArgumentParser:
    """The ``mopd plan`` argument parser."""
    p = OneLineParser(
        prog="mopd plan",
        description=(
            "Show what the bridge moves for a teacher mesh, a student mesh and a batch: the "
            "bytes each global rank sends to each other (every rank's own plan, as the live "
            "bridge makes it), balance, bytes against logits and the host path, and time at a "
            "link bandwidth. No GPU or process group needed."
        ),
        epilog=f"MESH: comma-separated KEY=VALUE with the keys of mopd.bridge.Mesh, e.g. "
        f"{MESH_EXAMPLE}; missing sizes are 1.",
    )
    p.add_argument("--teacher", type=mesh_type, required=True, metavar="MESH")
    p.add_argument(
        "--student",
        type=mesh_type,
        required=True,
        metavar="MESH",
        help="default rank_offset: right after the teacher's ranks (disjoint meshes)",
    )
    p.add_argument("--colocated", action="store_true", help="both meshes on global ranks 0..N-1")
    batch = p.add_mutually_exclusive_group(required=True)
    batch.add_argument("--batch", type=_positive_int, metavar="B", help="padded batch of B samples")
    batch.add_argument(
        "--packed-lengths",
        type=_lengths,
        metavar="L0,L1,...",
        help="packed (THD): one length per sample",
    )
    p.add_argument(
        "--seq-len", type=_positive_int, metavar="S", help="padded batch: tokens per sample"
    )
    p.add_argument(
        "--micro-batches",
        type=_positive_int,
        default=1,
        metavar="M",
        help="micro-batches per step, the same on both sides (1)",
    )
    p.add_argument("--hidden-size", type=_positive_int, default=4096, help="teacher hidden size")
    p.add_argument("--vocab-size", type=_positive_int, default=151936, help="for logits")
    p.add_argument(
        "--dtype-bytes", type=_positive_int, default=2, help="bytes per element (2: bf16)"
    )
    p.add_argument(
        "--sequence-parallel",
        choices=("teacher", "student", "both"),
        default=None,
        help="teacher: pads sequences to a multiple of tp, each teacher TP rank sends its own "
        "SP shard; student: each TP rank keeps its SP slice (keep_sp_shard: no all-gather "
        "after the crossing)",
    )
    p.add_argument(
        "--teacher-sp-replicas",
        action="store_true",
        help="with teacher SP: the capture all-gathers the sequence and the teacher TP ranks "
        "send as replicas (TeacherSpec(sp_shards=False); shows its bytes on the teacher's TP "
        "links)",
    )
    p.add_argument("--link-gbps", type=_positive_float, default=400.0, help="per rank, Gb/s")
    p.add_argument(
        "--nvlink-gbps",
        type=_positive_float,
        default=None,
        help="student TP all-gather, Gb/s (3600)",
    )
    p.add_argument(
        "--pcie-gbps", type=_positive_float, default=400.0, help="host path D2H/H2D, Gb/s"
    )
    p.add_argument("--top", type=_positive_int, default=8, help="matrix rows / volumes listed")
    p.add_argument(
        "--png",
        type=_out_file,
        default=Path("plan.png"),
        metavar="PATH",
        help="the picture: matrix, per-rank volumes (its folder must exist)",
    )
    p.add_argument("--no-png", action="store_true", help="do not draw the picture")
    p.add_argument(
        "--json",
        type=_out_file,
        default=None,
        metavar="PATH",
        help="write every number as JSON ('-': to stdout, instead of the text)",
    )
    p.add_argument(
        "--markdown",
        type=_out_file,
        default=None,
        metavar="PATH",
        help="write the summary with the environment",
    )
    return p


def _request(args: argparse.Namespace) -> PlanRequest:
    """Meshes, placement and batch from parsed flags (``ValueError`` with the values on misuse)."""
    t_spec, s_spec = args.teacher, args.student
    assert isinstance(t_spec, MeshSpec) and isinstance(s_spec, MeshSpec)
    if args.batch is not None:
        if args.seq_len is None:
            raise ValueError("--batch needs --seq-len")
        lengths = (args.seq_len,) * args.batch
        seq_len: int | None = args.seq_len
    else:
        if args.seq_len is not None:
            raise ValueError(
                "--seq-len applies to padded batches (--batch); packed lengths come from "
                "--packed-lengths"
            )
        lengths, seq_len = args.packed_lengths, None
    if args.colocated:
        given = [
            n
            for n, x in (("teacher", t_spec), ("student", s_spec))
            if x.rank_offset not in (None, 0)
        ]
        if given:
            raise ValueError(
                f"--colocated puts both meshes at rank_offset 0; drop rank_offset= from {given}"
            )
        if t_spec.size != s_spec.size:
            raise ValueError(
                f"--colocated needs meshes of one world size (every GPU holds a teacher and a "
                f"student shard), got teacher {t_spec.size} ranks and student {s_spec.size}; "
                "give explicit rank_offset= values instead to model a partial overlap"
            )
        t_off, s_off = 0, 0
    else:
        t_off = t_spec.rank_offset or 0
        s_off = s_spec.rank_offset if s_spec.rank_offset is not None else t_off + t_spec.size
    teacher = t_spec.mesh(name="teacher", rank_offset=t_off)
    student = s_spec.mesh(name="student", rank_offset=s_off)
    sp = args.sequence_parallel
    student_sp = sp in ("student", "both")
    teacher_sp = sp in ("teacher", "both")
    if args.teacher_sp_replicas and not (teacher_sp and teacher.tp > 1):
        warnings.warn(
            f"--teacher-sp-replicas ignored: the teacher runs no sequence parallelism "
            f"(tp={teacher.tp}, --sequence-parallel {sp})",
            stacklevel=2,
        )
    nvlink = args.nvlink_gbps if args.nvlink_gbps is not None else 3600.0
    if args.nvlink_gbps is not None and (student_sp or student.tp == 1):
        warnings.warn(
            f"--nvlink-gbps {args.nvlink_gbps:g} ignored: the student does no TP all-gather "
            f"(tp={student.tp}, sequence parallel {student_sp})",
            stacklevel=2,
        )
    return PlanRequest(
        teacher=teacher,
        student=student,
        lengths=lengths,
        padded_seq_len=seq_len,
        hidden_size=args.hidden_size,
        vocab_size=args.vocab_size,
        dtype_bytes=args.dtype_bytes,
        micro_batches=args.micro_batches,
        teacher_sp=teacher_sp,
        student_sp=student_sp,
        teacher_sp_shards=not args.teacher_sp_replicas,
        link_gbps=args.link_gbps,
        nvlink_gbps=nvlink,
        pcie_gbps=args.pcie_gbps,
    )


def _markdown(text: str, argv: Sequence[str], png: Path | None) -> str:
    from mopd.profiling.results import environment

    env = "\n".join(f"- {k}: {v}" for k, v in environment().items())
    pic = f"\n![transfer matrix]({png.name})\n" if png is not None else ""
    return (
        "# mopd plan\n\n"
        f"Command: `mopd plan {' '.join(argv)}`\n\n"
        "Every rank's own plan (`mopd.bridge.plan.plan_rank`, as the live bridge runs it) on a "
        "simulated step, on the CPU; times are the stated model, not measurements.\n\n"
        f"```\n{text}```\n{pic}\n## Environment\n{env}\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``mopd plan``: print the plan's figures, draw the picture, write JSON; returns the exit status.

    Bad flags or values print one line naming them to stderr and return 2, before anything
    heavy is imported and before any file is written.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed why
        return int(exc.code or 0) if isinstance(exc.code, int) else EXIT_USAGE
    try:
        req = _request(args)
        report = inspect_plan(req)
    except ValueError as exc:
        print(f"mopd plan: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    to_stdout = args.json is not None and str(args.json) == "-"
    text = format_report(report, top=args.top)
    if to_stdout:
        sys.stdout.write(json.dumps(report_to_dict(report), indent=1) + "\n")
    else:
        sys.stdout.write(text)
    log = sys.stderr if to_stdout else sys.stdout
    png = None
    if not args.no_png and can_draw("mopd plan"):
        png = render_heatmap(report, args.png)
        print(f"picture: {png}", file=log)
    if args.json is not None and not to_stdout:
        args.json.write_text(json.dumps(report_to_dict(report), indent=1) + "\n")
        print(f"json: {args.json}", file=log)
    if args.markdown is not None:
        md = _markdown(text, argv, png)
        if str(args.markdown) == "-":
            sys.stdout.write(md)
        else:
            args.markdown.write_text(md)
            print(f"markdown: {args.markdown}", file=log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
