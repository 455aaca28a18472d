"""``mopd plan``: inspect the bridge's transfer plan for a teacher mesh, a student mesh and a batch.

Why this file exists: before a job is launched, a person wants to know what the bridge will move
and where: which global rank sends how many bytes to which, how balanced the ranks are, how that
compares with shipping logits or going through host memory, and about how long it takes on a
given link. All of that follows from the meshes and the batch shape alone, so this tool answers
it on a laptop: no GPU, no process group. It builds each side's token layouts with
:mod:`mopd.bridge.layout` and plans with :func:`mopd.bridge.plan_token_exchange` (the very
function every rank of a live bridge runs), then derives every figure from that plan.

Batch model (one training step of one teacher; sample ids ``0 .. B-1``):

- padded (``--batch B --seq-len S``): every sample has ``S`` real tokens; each side's buffer is
  Megatron's ``[S_pad / cp, b, H]`` per micro-batch (micro-batches stacked), ``S_pad`` being ``S``
  rounded up to a multiple of ``2 * cp`` (times ``tp`` under sequence parallelism, and always
  times the student's ``tp`` on the student side: the bridge splits a student shard's rows into
  ``tp`` equal slices); rows past ``S`` are padding and never move;
- packed (``--packed-lengths L0,L1,...``): THD, each sample padded to that multiple separately;
- data parallelism: DP rank ``d`` of a side holds samples ``[d * B / dp, (d + 1) * B / dp)``;
  ``--teacher-micro-batch`` / ``--student-micro-batch`` cut that into micro-batches (default:
  one micro-batch). Teacher and student shard independently, as in a real job.

Figures (all bytes; ``row = hidden_size * dtype_bytes``):

- transfer matrix ``[W, W]``: bytes from source global rank (row) to destination (column), from
  :meth:`TransferPlan.transfer_matrix`; the diagonal is local copies (colocated meshes);
- per rank: send (row sum) and receive (column sum) across ranks, the diagonal apart; imbalance
  is ``max / mean`` over the ranks that send (receive) anything;
- time at ``--link-gbps`` (per rank, each direction): ``max(send, recv) / bandwidth`` per rank,
  the step's crossing time is the maximum over ranks. Without student sequence parallelism the
  student then all-gathers its shard inside each student TP group (ring: each rank sends and
  receives ``(tp - 1) / tp`` of the shard's buffer), timed at ``--nvlink-gbps``;
- logits instead of hidden states: ``vocab_size * dtype_bytes`` per token to every student rank
  that needs it (all ``tp`` ranks of the token's student group), and the best case of sending
  each rank only its ``vocab / tp`` slice;
- through host memory (NeMo-RL's path): D2H on the teacher rank the plan picks, the same
  network bytes host to host, H2D of every row each student rank needs (its whole shard, or its
  SP slice); PCIe bytes = D2H + H2D, two extra hops per token, each stage timed at
  ``--pcie-gbps`` per rank and the stages added (no overlap).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mopd.bridge.layout import TokenLayout, concat_layouts, packed_layout, padded_layout
from mopd.bridge.mesh import Mesh, meshes_overlap
from mopd.bridge.planner import StudentBatch, TeacherBatch, TransferPlan, plan_token_exchange

__all__ = [
    "MeshSpec",
    "PlanReport",
    "PlanRequest",
    "build_batches",
    "build_parser",
    "format_report",
    "inspect_plan",
    "main",
    "parse_mesh",
    "render_heatmap",
    "report_to_dict",
]

EXIT_USAGE = 2
_I64 = torch.int64
_MESH_KEYS = ("tp", "cp", "dp", "pp", "offset")
_DENSE_MAX_WORLD = 16


# --- inputs ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MeshSpec:
    """A mesh as written on the command line: sizes, and a rank offset if one was given."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    offset: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "dp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.offset is not None and (not isinstance(self.offset, int) or self.offset < 0):
            raise ValueError(f"offset must be a non-negative int, got {self.offset!r}")

    @property
    def size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def mesh(self, *, rank_offset: int, name: str) -> Mesh:
        return Mesh(
            tp=self.tp, cp=self.cp, dp=self.dp, pp=self.pp, rank_offset=rank_offset, name=name
        )


def parse_mesh(text: str) -> MeshSpec:
    """``"tp=8,pp=2,dp=1,cp=1[,offset=0]"`` -> :class:`MeshSpec` (missing sizes are 1).

    Raises:
        ValueError: an unknown or repeated key, an item without ``=``, a value that is not a
            non-negative integer, or a size below 1.
    """
    values: dict[str, int] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        key, eq, raw = item.partition("=")
        key = key.strip().lower()
        if not eq:
            raise ValueError(f"mesh item {item!r} in {text!r} is not KEY=VALUE")
        if key not in _MESH_KEYS:
            raise ValueError(
                f"unknown mesh key {key!r} in {text!r} (known: {', '.join(_MESH_KEYS)})"
            )
        if key in values:
            raise ValueError(f"mesh key {key!r} given twice in {text!r}")
        try:
            value = int(raw.strip())
        except ValueError:
            raise ValueError(f"mesh {key}={raw.strip()!r} in {text!r} is not an integer") from None
        values[key] = value
    if not values:
        raise ValueError(f"empty mesh {text!r}; write e.g. tp=8,pp=2")
    return MeshSpec(**values)


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """Everything the inspector needs; validated before any planning.

    Attributes:
        teacher, student: the meshes (global ranks included).
        lengths: ``[B]`` real length of each sample (sample id = index).
        padded_seq_len: ``S`` for a padded batch, ``None`` for packed (THD) batches.
        hidden_size: the teacher's ``H`` (what crosses).
        vocab_size: for the logits comparison.
        dtype_bytes: bytes per element on the wire (2 for bf16).
        teacher_micro_batch, student_micro_batch: samples per micro-batch (``None``: all of a DP
            rank's samples in one).
        teacher_sp, student_sp: sequence parallelism on that side.
        link_gbps, nvlink_gbps, pcie_gbps: per-rank, per-direction bandwidths in Gb/s.
    """

    teacher: Mesh
    student: Mesh
    lengths: tuple[int, ...]
    padded_seq_len: int | None
    hidden_size: int
    vocab_size: int
    dtype_bytes: int = 2
    teacher_micro_batch: int | None = None
    student_micro_batch: int | None = None
    teacher_sp: bool = False
    student_sp: bool = False
    link_gbps: float = 400.0
    nvlink_gbps: float = 3600.0
    pcie_gbps: float = 400.0

    def __post_init__(self) -> None:
        if not self.lengths:
            raise ValueError("the batch has no samples")
        if any((not isinstance(n, int)) or n < 1 for n in self.lengths):
            raise ValueError(f"sample lengths must be positive ints, got {list(self.lengths)}")
        if self.padded_seq_len is not None and any(n != self.padded_seq_len for n in self.lengths):
            raise ValueError(
                f"a padded batch has every sample at seq_len {self.padded_seq_len}, got {list(self.lengths)}"
            )
        for name in ("hidden_size", "vocab_size", "dtype_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("link_gbps", "nvlink_gbps", "pcie_gbps"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
        b = len(self.lengths)
        for side, mesh, mb in (
            ("teacher", self.teacher, self.teacher_micro_batch),
            ("student", self.student, self.student_micro_batch),
        ):
            if b % mesh.dp:
                raise ValueError(
                    f"batch of {b} samples does not split over the {side}'s dp={mesh.dp} "
                    f"(Megatron gives every DP rank the same number of samples)"
                )
            per_rank = b // mesh.dp
            if mb is not None:
                if not isinstance(mb, int) or mb < 1:
                    raise ValueError(f"{side} micro-batch must be a positive int, got {mb!r}")
                if per_rank % mb:
                    raise ValueError(
                        f"{side} micro-batch {mb} does not divide the {per_rank} samples of each "
                        f"{side} DP rank ({b} samples / dp={mesh.dp})"
                    )
        if self.teacher_sp and self.teacher.tp == 1:
            warnings.warn("teacher sequence parallelism ignored: teacher tp=1", stacklevel=2)
        if self.student_sp and self.student.tp == 1:
            warnings.warn("student sequence parallelism ignored: student tp=1", stacklevel=2)

    @property
    def row_bytes(self) -> int:
        return self.hidden_size * self.dtype_bytes

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _pad_multiple(mesh: Mesh, *, sp: bool, is_student: bool) -> int:
    """Multiple each (padded) sequence length is rounded to on one side (see the module doc)."""
    mult = 2 * mesh.cp if mesh.cp > 1 else 1
    return mult * mesh.tp if (sp or is_student) else mult


def _side_layouts(
    mesh: Mesh, req: PlanRequest, *, micro_batch: int | None, mult: int
) -> dict[tuple[int, int], TokenLayout]:
    """``(dp_rank, cp_rank) -> layout`` of one side's buffer (all its micro-batches stacked)."""
    b = len(req.lengths)
    per_rank = b // mesh.dp
    mb = micro_batch or per_rank
    out: dict[tuple[int, int], TokenLayout] = {}
    for d, c in mesh.shards():
        ids = list(range(d * per_rank, (d + 1) * per_rank))
        parts = []
        for i in range(0, per_rank, mb):
            chunk = ids[i : i + mb]
            lens = [req.lengths[s] for s in chunk]
            if req.padded_seq_len is not None:
                seq = _round_up(req.padded_seq_len, mult)
                parts.append(padded_layout(chunk, seq, lengths=lens, cp_size=mesh.cp, cp_rank=c))
            else:
                cu = [0]
                for n in lens:
                    cu.append(cu[-1] + _round_up(n, mult))
                parts.append(
                    packed_layout(chunk, lens, cu_seqlens_padded=cu, cp_size=mesh.cp, cp_rank=c)
                )
        out[(d, c)] = concat_layouts(parts)
    return out


def build_batches(req: PlanRequest) -> tuple[TeacherBatch, StudentBatch]:
    """The planner's inputs for ``req``: the teacher's captured layouts and the student's wanted ones."""
    t_mult = _pad_multiple(req.teacher, sp=req.teacher_sp, is_student=False)
    s_mult = _pad_multiple(req.student, sp=req.student_sp, is_student=True)
    teacher = TeacherBatch(
        mesh=req.teacher,
        layouts=_side_layouts(req.teacher, req, micro_batch=req.teacher_micro_batch, mult=t_mult),
        hidden_size=req.hidden_size,
        itemsize=req.dtype_bytes,
    )
    student = StudentBatch(
        mesh=req.student,
        layouts=_side_layouts(req.student, req, micro_batch=req.student_micro_batch, mult=s_mult),
    )
    return teacher, student


# --- the figures ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, eq=False)
class PlanReport:
    """Every figure of one inspected plan (bytes unless named otherwise).

    Attributes:
        request: what was asked.
        plan: the planner's :class:`TransferPlan`.
        world_size: ``W``, one past the highest global rank of either mesh.
        matrix_WW: ``[W, W]`` int64 bytes, source global rank (row) -> destination (column).
        send_W, recv_W: ``[W]`` int64 bytes each rank sends / receives across ranks (diagonal apart).
        local_W: ``[W]`` int64 bytes of local copies (the diagonal).
        teacher_rows, student_rows: rows of each side's buffer per ``(dp, cp)`` shard.
        tokens_per_group: real tokens each student ``(dp, cp)`` group needs, in ``mesh.shards()`` order.
        allgather_W: ``[W]`` int64 bytes each student rank sends (= receives) in the TP all-gather.
        d2h_W, h2d_W: ``[W]`` int64 PCIe bytes per rank on the host path.
        figures: the scalar figures (see :func:`report_to_dict`).
    """

    request: PlanRequest
    plan: TransferPlan
    world_size: int
    matrix_WW: torch.Tensor
    send_W: torch.Tensor
    recv_W: torch.Tensor
    local_W: torch.Tensor
    teacher_rows: dict[tuple[int, int], int]
    student_rows: dict[tuple[int, int], int]
    tokens_per_group: tuple[int, ...]
    allgather_W: torch.Tensor
    d2h_W: torch.Tensor
    h2d_W: torch.Tensor
    figures: dict[str, Any] = field(default_factory=dict)


def _imbalance(v_W: torch.Tensor) -> float:
    """``max / mean`` over the nonzero entries (1.0 when perfectly even; 0.0 when all are zero)."""
    nz = v_W[v_W > 0].double()
    return float(nz.max() / nz.mean()) if nz.numel() else 0.0


def _seconds(nbytes: int | float, gbps: float) -> float:
    return float(nbytes) * 8.0 / (gbps * 1e9)


def inspect_plan(req: PlanRequest) -> PlanReport:
    """Plan ``req`` with the bridge's planner and derive every figure (pure; no process group)."""
    teacher, student = build_batches(req)
    plan = plan_token_exchange([teacher], student)
    w = max(req.teacher.rank_offset + req.teacher.size, req.student.rank_offset + req.student.size)
    m = plan.transfer_matrix(w)
    diag = torch.diagonal(m).clone()
    send = m.sum(dim=1) - diag
    recv = m.sum(dim=0) - diag
    rb = req.row_bytes
    s_mesh = req.student

    tokens = tuple(student.layouts[k].num_tokens for k in s_mesh.shards())
    allgather = torch.zeros(w, dtype=_I64)
    h2d = torch.zeros(w, dtype=_I64)
    for dest in plan.dests:
        tp = len(dest.ranks)
        real_N = dest.owner_N >= 0
        for j, rank in enumerate(dest.ranks):
            if not req.student_sp and tp > 1:
                allgather[rank] += (tp - 1) * dest.slice_rows * rb
            if req.student_sp:
                lo = j * dest.slice_rows
                h2d[rank] += int(real_N[lo : lo + dest.slice_rows].sum()) * rb
            else:
                h2d[rank] += int(real_N.sum()) * rb
    d2h = send + diag  # the host path copies out every row the plan has a teacher rank send

    cross = int(send.sum())
    local = int(diag.sum())
    total = cross + local
    needed = sum(tokens)
    s_tp = s_mesh.tp
    logits_full = needed * s_tp * req.vocab_size * req.dtype_bytes
    logits_sharded = needed * req.vocab_size * req.dtype_bytes
    pcie = int(d2h.sum() + h2d.sum())

    link = torch.maximum(send, recv)
    t_rank = [_seconds(int(x), req.link_gbps) for x in link.tolist()]
    t_cross = max(t_rank, default=0.0)
    slowest = int(torch.argmax(link)) if w else -1
    t_gather = _seconds(int(allgather.max()) if w else 0, req.nvlink_gbps)
    t_d2h = _seconds(int(d2h.max()) if w else 0, req.pcie_gbps)
    t_h2d = _seconds(int(h2d.max()) if w else 0, req.pcie_gbps)
    t_host = t_d2h + t_cross + t_h2d
    summary = plan.summary()
    figures: dict[str, Any] = {
        "tokens": req.num_tokens,
        "tokens_needed": needed,
        "row_bytes": rb,
        "bytes_total": total,
        "bytes_cross": cross,
        "bytes_local": local,
        "messages": int(((m > 0) & ~torch.eye(w, dtype=torch.bool)).sum()),
        "local_copies": summary["local_copies"],
        "transfers": summary["transfers"],
        "senders": int((send > 0).sum()),
        "receivers": int((recv > 0).sum()),
        "max_send_bytes": int(send.max()) if w else 0,
        "max_recv_bytes": int(recv.max()) if w else 0,
        "mean_send_bytes": float(send[send > 0].double().mean()) if cross else 0.0,
        "mean_recv_bytes": float(recv[recv > 0].double().mean()) if cross else 0.0,
        "send_imbalance": _imbalance(send),
        "recv_imbalance": _imbalance(recv),
        "replica_imbalance": summary["replica_imbalance"] + 1.0 if cross else 0.0,
        "link_gbps": req.link_gbps,
        "nvlink_gbps": req.nvlink_gbps,
        "pcie_gbps": req.pcie_gbps,
        "time_cross_s": t_cross,
        "slowest_rank": slowest,
        "student_allgather_bytes": int(allgather.sum()),
        "time_student_allgather_s": t_gather,
        "time_bridge_s": t_cross + t_gather,
        "logits_full_bytes": logits_full,
        "logits_sharded_bytes": logits_sharded,
        "logits_full_ratio": logits_full / total if total else 0.0,
        "logits_sharded_ratio": logits_sharded / total if total else 0.0,
        # same routing, every row replaced by its logits (all of them, or this rank's vocab slice)
        "time_logits_full_s": t_cross * s_tp * req.vocab_size / req.hidden_size,
        "time_logits_sharded_s": t_cross * req.vocab_size / req.hidden_size,
        "host_d2h_bytes": int(d2h.sum()),
        "host_h2d_bytes": int(h2d.sum()),
        "host_pcie_bytes": pcie,
        "host_network_bytes": cross,
        "host_pcie_ratio": pcie / total if total else 0.0,
        "host_bytes_ratio": (pcie + cross) / total if total else 0.0,
        "host_hops_per_token": 3,
        "bridge_hops_per_token": 1,
        "time_host_d2h_s": t_d2h,
        "time_host_h2d_s": t_h2d,
        "time_host_s": t_host,
        "host_time_ratio": t_host / (t_cross + t_gather) if (t_cross + t_gather) else 0.0,
    }
    return PlanReport(
        request=req,
        plan=plan,
        world_size=w,
        matrix_WW=m,
        send_W=send,
        recv_W=recv,
        local_W=diag,
        teacher_rows={k: v.num_rows for k, v in teacher.layouts.items()},
        student_rows={k: v.num_rows for k, v in student.layouts.items()},
        tokens_per_group=tokens,
        allgather_W=allgather,
        d2h_W=d2h,
        h2d_W=h2d,
        figures=figures,
    )


# --- output ---------------------------------------------------------------------------------


def _fmt_bytes(n: float) -> str:
    """``1536 -> '1.50 KiB'`` (binary units)."""
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{int(x)} B" if unit == "B" else f"{x:.2f} {unit}"
        x /= 1024
    raise AssertionError("unreachable")


def _fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} us"


def _ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5] -> '0-2,5'``."""
    out: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(out)


def _row_entries(row_W: torch.Tensor) -> str:
    """Nonzero entries of one matrix row, consecutive destinations with equal bytes merged."""
    dst = torch.nonzero(row_W).reshape(-1).tolist()
    parts: list[str] = []
    i = 0
    while i < len(dst):
        j = i
        v = int(row_W[dst[i]])
        while j + 1 < len(dst) and dst[j + 1] == dst[j] + 1 and int(row_W[dst[j + 1]]) == v:
            j += 1
        who = str(dst[i]) if i == j else f"{dst[i]}-{dst[j]}"
        each = " each" if j > i else ""
        parts.append(f"{who}: {_fmt_bytes(v)}{each}")
        i = j + 1
    return "; ".join(parts)


def _mesh_line(mesh: Mesh, sp: bool) -> str:
    return (
        f"TP{mesh.tp} CP{mesh.cp} DP{mesh.dp} PP{mesh.pp}{' SP' if sp and mesh.tp > 1 else ''}, "
        f"global ranks {mesh.rank_offset}..{mesh.rank_offset + mesh.size - 1}, "
        f"last stage {_ranges(mesh.last_stage_ranks())}"
    )


def format_report(report: PlanReport, *, top: int = 8) -> str:
    """The printed summary: setup, matrix, per-rank volumes, comparisons, times."""
    req, f, m = report.request, report.figures, report.matrix_WW
    t, s = req.teacher, req.student
    w = report.world_size
    lines: list[str] = []
    add = lines.append
    placement = "colocated (shared ranks)" if meshes_overlap([t, s]) else "disjoint"
    add(f"teacher: {_mesh_line(t, req.teacher_sp)}")
    add(f"student: {_mesh_line(s, req.student_sp)}")
    add(f"placement: {placement}; world size {w}")
    b = len(req.lengths)
    if req.padded_seq_len is not None:
        batch = f"padded, B={b} x S={req.padded_seq_len}"
    else:
        shown = ",".join(map(str, req.lengths[:8])) + (",..." if b > 8 else "")
        batch = f"packed (THD), {b} samples, lengths {shown}"
    add(f"batch: {batch}; {f['tokens']} tokens")
    tm = req.teacher_micro_batch or b // t.dp
    sm = req.student_micro_batch or b // s.dp
    add(
        f"buffers: teacher {sorted(set(report.teacher_rows.values()))} rows per (dp, cp) shard "
        f"(micro-batch {tm}), student {sorted(set(report.student_rows.values()))} rows "
        f"(micro-batch {sm}); padding rows never move"
    )
    add(
        f"row: hidden {req.hidden_size} x {req.dtype_bytes} B = {_fmt_bytes(req.row_bytes)}; "
        f"vocab {req.vocab_size}"
    )
    if req.padded_seq_len is not None:
        for side, mesh, sp, is_student in (
            ("teacher", t, req.teacher_sp, False),
            ("student", s, req.student_sp, True),
        ):
            mult = _pad_multiple(mesh, sp=sp, is_student=is_student)
            padded = _round_up(req.padded_seq_len, mult)
            if padded != req.padded_seq_len:
                add(
                    f"note: {side} sequences padded to {padded} (a multiple of {mult}); "
                    f"positions {req.padded_seq_len}.. are padding"
                )
    if req.teacher_sp and t.tp > 1:
        add(
            "note: teacher SP only changes padding: capture all-gathers the sequence over the "
            "teacher's TP group before the bridge"
        )
    add("")
    add("== plan (mopd.bridge.plan_token_exchange) ==")
    add(
        f"{f['transfers']} transfers: {f['messages']} messages between ranks, "
        f"{f['local_copies']} local copies; {f['tokens_needed']} token rows delivered, each once "
        f"per student (dp, cp) group"
    )
    add(
        f"bytes: {_fmt_bytes(f['bytes_total'])} total = {_fmt_bytes(f['bytes_cross'])} across ranks "
        f"+ {_fmt_bytes(f['bytes_local'])} local copies ({f['bytes_total']} B)"
    )
    add("")
    add("== transfer matrix: bytes, source global rank (row) -> destination (column) ==")
    if w <= _DENSE_MAX_WORLD:
        unit, scale = ("MiB", 2**20) if int(m.max()) >= 2**20 else ("KiB", 2**10)
        add(f"(in {unit}; '.' = nothing)")
        add("src\\dst " + "".join(f"{j:>8}" for j in range(w)))
        for i in range(w):
            cells = "".join(
                f"{int(x) / scale:>8.1f}" if int(x) else f"{'.':>8}" for x in m[i].tolist()
            )
            add(f"{i:>7} {cells}")
    rows = torch.nonzero(m.sum(dim=1)).reshape(-1).tolist()
    order = sorted(rows, key=lambda r: (-int(m[r].sum()), r))
    shown_rows = order[:top]
    add(
        f"{len(rows)} source ranks, {int((m > 0).sum())} nonzero entries; top {len(shown_rows)} rows:"
    )
    for r in shown_rows:
        add(f"  {r:>5} ({_fmt_bytes(int(m[r].sum()))}) -> {_row_entries(m[r])}")
    if len(order) > len(shown_rows):
        rest = sum(int(m[r].sum()) for r in order[len(shown_rows) :])
        add(f"  ... {len(order) - len(shown_rows)} more source ranks, {_fmt_bytes(rest)}")
    add(f"  total {_fmt_bytes(int(m.sum()))}")
    add("")
    add("== per-rank volume across ranks (local copies apart) ==")
    for what, v in (("send", report.send_W), ("recv", report.recv_W)):
        nz = torch.nonzero(v).reshape(-1).tolist()
        if not nz:
            add(f"{what}: nobody")
            continue
        vals = v[nz]
        groups: dict[int, list[int]] = {}
        for r in nz:
            groups.setdefault(int(v[r]), []).append(r)
        add(
            f"{what}: {len(nz)} ranks, max {_fmt_bytes(int(vals.max()))}, "
            f"mean {_fmt_bytes(float(vals.double().mean()))}, min {_fmt_bytes(int(vals.min()))}, "
            f"imbalance max/mean {f[what + '_imbalance']:.4f}"
        )
        for val, ranks in sorted(groups.items(), key=lambda kv: -kv[0])[:top]:
            add(f"  {_fmt_bytes(val)}: ranks {_ranges(ranks)}")
        if len(groups) > top:
            add(f"  ... {len(groups) - top} more distinct volumes")
    if f["bytes_local"]:
        nz = torch.nonzero(report.local_W).reshape(-1).tolist()
        add(f"local copies: ranks {_ranges(nz)}, {_fmt_bytes(f['bytes_local'])} in all")
    add(f"teacher TP replica balance (planner): max/mean {f['replica_imbalance']:.4f}")
    add("")
    add("== bytes compared (ratio = bytes / this plan's total) ==")
    tot = f["bytes_total"]
    add(f"{'path':<58}{'bytes':>14}{'ratio':>10}")
    table = [
        ("bridge: hidden states GPU->GPU (this plan)", tot),
        (f"logits: full vocab to each of the student's tp={s.tp} ranks", f["logits_full_bytes"]),
        ("logits: vocab slice to each student TP rank (best case)", f["logits_sharded_bytes"]),
        ("host path: PCIe bytes (D2H + H2D)", f["host_pcie_bytes"]),
        ("host path: PCIe + host-to-host network bytes", f["host_pcie_bytes"] + f["bytes_cross"]),
    ]
    for name, nbytes in table:
        ratio = nbytes / tot if tot else 0.0
        add(f"{name:<58}{_fmt_bytes(nbytes):>14}{ratio:>9.2f}x")
    add(
        f"host path: D2H {_fmt_bytes(f['host_d2h_bytes'])} on teacher ranks, "
        f"H2D {_fmt_bytes(f['host_h2d_bytes'])} on student ranks "
        f"({'SP slices' if req.student_sp else 'every TP rank loads its whole shard'}); "
        f"{f['host_hops_per_token']} hops per token (D2H, network, H2D) vs "
        f"{f['bridge_hops_per_token']} (GPU->GPU)"
    )
    add(
        f"student TP all-gather after the crossing: {_fmt_bytes(f['student_allgather_bytes'])} "
        + (
            "(none: the student keeps SP slices)"
            if req.student_sp or s.tp == 1
            else "(ring, inside each TP group)"
        )
    )
    add("")
    add(
        f"== time (model: per rank max(send, recv) / link; step = max over ranks; "
        f"link {req.link_gbps:g} Gb/s per rank, NVLink {req.nvlink_gbps:g} Gb/s, "
        f"PCIe {req.pcie_gbps:g} Gb/s) =="
    )
    slow = f["slowest_rank"]
    add(
        f"bridge crossing: {_fmt_time(f['time_cross_s'])} (slowest rank {slow}: send "
        f"{_fmt_bytes(int(report.send_W[slow]))}, recv {_fmt_bytes(int(report.recv_W[slow]))})"
    )
    add(f"student TP all-gather (NVLink): {_fmt_time(f['time_student_allgather_s'])}")
    add(f"bridge total: {_fmt_time(f['time_bridge_s'])}")
    add(
        f"logits, same routing: full {_fmt_time(f['time_logits_full_s'])}, "
        f"vocab slice {_fmt_time(f['time_logits_sharded_s'])}"
    )
    add(
        f"host path (stages in sequence): D2H {_fmt_time(f['time_host_d2h_s'])} + network "
        f"{_fmt_time(f['time_cross_s'])} + H2D {_fmt_time(f['time_host_h2d_s'])} = "
        f"{_fmt_time(f['time_host_s'])} ({f['host_time_ratio']:.2f}x the bridge)"
    )
    return "\n".join(lines) + "\n"


def report_to_dict(report: PlanReport) -> dict[str, Any]:
    """Every number of ``report`` as JSON-ready data (the matrix as its nonzero entries)."""
    req = report.request
    m = report.matrix_WW
    nz = torch.nonzero(m)

    def mesh(x: Mesh, sp: bool) -> dict[str, Any]:
        return {"tp": x.tp, "cp": x.cp, "dp": x.dp, "pp": x.pp, "offset": x.rank_offset, "sp": sp}

    def key(k: tuple[int, int]) -> str:
        return f"dp{k[0]}_cp{k[1]}"

    return {
        "teacher": mesh(req.teacher, req.teacher_sp),
        "student": mesh(req.student, req.student_sp),
        "batch": {
            "kind": "padded" if req.padded_seq_len is not None else "packed",
            "lengths": list(req.lengths),
            "seq_len": req.padded_seq_len,
            "teacher_micro_batch": req.teacher_micro_batch,
            "student_micro_batch": req.student_micro_batch,
        },
        "hidden_size": req.hidden_size,
        "vocab_size": req.vocab_size,
        "dtype_bytes": req.dtype_bytes,
        "world_size": report.world_size,
        "matrix": [[int(i), int(j), int(m[i, j])] for i, j in nz.tolist()],
        "send_bytes": report.send_W.tolist(),
        "recv_bytes": report.recv_W.tolist(),
        "local_bytes": report.local_W.tolist(),
        "student_allgather_bytes_per_rank": report.allgather_W.tolist(),
        "host_d2h_bytes_per_rank": report.d2h_W.tolist(),
        "host_h2d_bytes_per_rank": report.h2d_W.tolist(),
        "teacher_rows": {key(k): v for k, v in sorted(report.teacher_rows.items())},
        "student_rows": {key(k): v for k, v in sorted(report.student_rows.items())},
        "tokens_per_student_group": {
            key(k): n for k, n in zip(req.student.shards(), report.tokens_per_group, strict=True)
        },
        "plan_summary": report.plan.summary(),
        "figures": dict(report.figures),
    }


def render_heatmap(report: PlanReport, path: Path) -> Path:
    """Write a PNG heatmap of the transfer matrix (empty cells blank; mesh extents drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    req = report.request
    peak = int(report.matrix_WW.max()) if report.world_size else 0
    unit, scale = (
        next(
            (u, k)
            for u, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))
            if peak >= k
        )
        if peak
        else ("B", 1)
    )
    m = report.matrix_WW.double().numpy() / scale
    data = np.ma.masked_equal(m, 0.0)
    w = report.world_size
    size = min(14.0, max(5.0, 4.0 + w / 12))
    fig, ax = plt.subplots(figsize=(size + 1.5, size))
    im = ax.imshow(
        data,
        cmap="viridis",
        interpolation="nearest",
        origin="upper",
        vmin=0.0,
        vmax=max(float(m.max()), 1e-9),
    )
    fig.colorbar(im, ax=ax, label=f"{unit} per (source, destination)")
    # mesh extents: teacher on the left / top edges, student on the right / bottom edges
    for mesh, color, label, edge in (
        (req.teacher, "tab:red", "teacher", (0.0, 0.012)),
        (req.student, "tab:blue", "student", (0.988, 1.0)),
    ):
        lo, hi = mesh.rank_offset - 0.5, mesh.rank_offset + mesh.size - 0.5
        ax.axhspan(lo, hi, xmin=edge[0], xmax=edge[1], color=color, alpha=0.9)
        ax.axvspan(lo, hi, ymin=1.0 - edge[1], ymax=1.0 - edge[0], color=color, alpha=0.9)
        for x in (lo, hi):
            ax.axhline(x, color=color, lw=0.6, alpha=0.4)
            ax.axvline(x, color=color, lw=0.6, alpha=0.4)
        ax.plot([], [], color=color, lw=4, label=f"{label} ranks {_ranges(list(mesh.ranks))}")
    ax.set_xlabel("destination global rank")
    ax.set_ylabel("source global rank")
    t, s = req.teacher, req.student
    f = report.figures
    ax.set_title(
        f"teacher TP{t.tp} CP{t.cp} DP{t.dp} PP{t.pp} -> student TP{s.tp} CP{s.cp} DP{s.dp} PP{s.pp}\n"
        f"{_fmt_bytes(f['bytes_cross'])} across ranks, {_fmt_bytes(f['bytes_local'])} local; "
        f"send imbalance {f['send_imbalance']:.3f}",
        fontsize=10,
    )
    ax.legend(loc="lower left", fontsize=8)
    ax.set_xlim(-0.5, w - 0.5)
    ax.set_ylim(w - 0.5, -0.5)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- command line ---------------------------------------------------------------------------


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
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"lengths must be positive integers, got {text!r}")
    return values


def _mesh_arg(text: str) -> MeshSpec:
    try:
        return parse_mesh(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    """The ``mopd plan`` argument parser."""
    p = argparse.ArgumentParser(
        prog="mopd plan",
        description=(
            "Show the bridge's transfer plan for a teacher mesh, a student mesh and a batch: the "
            "bytes each global rank sends to each other, balance, bytes against logits and the "
            "host path, and time at a link bandwidth. No GPU or process group needed."
        ),
    )
    p.add_argument(
        "--teacher", type=_mesh_arg, required=True, metavar="tp=8,pp=2,dp=1,cp=1[,offset=0]"
    )
    p.add_argument(
        "--student",
        type=_mesh_arg,
        required=True,
        metavar="tp=4,cp=2,dp=2[,offset=N]",
        help="default offset: right after the teacher's ranks (disjoint meshes)",
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
        "--hidden-size", type=_positive_int, default=4096, help="teacher hidden size (4096)"
    )
    p.add_argument("--vocab-size", type=_positive_int, default=151936, help="for logits (151936)")
    p.add_argument(
        "--dtype-bytes", type=_positive_int, default=2, help="bytes per element (2: bf16)"
    )
    p.add_argument("--teacher-micro-batch", type=_positive_int, default=None, metavar="N")
    p.add_argument("--student-micro-batch", type=_positive_int, default=None, metavar="N")
    p.add_argument(
        "--sequence-parallel",
        choices=("teacher", "student", "both"),
        default=None,
        help="teacher: pads sequences to a multiple of tp (capture undoes SP); student: each TP "
        "rank keeps its SP slice (no all-gather after the crossing)",
    )
    p.add_argument("--link-gbps", type=_positive_float, default=400.0, help="per rank, Gb/s (400)")
    p.add_argument(
        "--nvlink-gbps",
        type=_positive_float,
        default=None,
        help="student TP all-gather, Gb/s (3600)",
    )
    p.add_argument(
        "--pcie-gbps", type=_positive_float, default=400.0, help="host path D2H/H2D, Gb/s (400)"
    )
    p.add_argument("--top", type=_positive_int, default=8, help="matrix rows / volumes listed (8)")
    p.add_argument("--png", type=Path, default=Path("plan.png"), help="heatmap (plan.png)")
    p.add_argument("--no-png", action="store_true", help="do not draw the heatmap")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write every number")
    p.add_argument(
        "--markdown",
        type=Path,
        default=None,
        metavar="PATH",
        help="write the summary with the environment",
    )
    return p


def _request(args: argparse.Namespace) -> PlanRequest:
    """Meshes, placement and batch from parsed flags (``ValueError`` with the values on misuse)."""
    t_spec, s_spec = args.teacher, args.student
    if args.colocated:
        given = [
            n for n, x in (("teacher", t_spec), ("student", s_spec)) if x.offset not in (None, 0)
        ]
        if given:
            raise ValueError(f"--colocated puts both meshes at offset 0; drop offset= from {given}")
        if t_spec.size != s_spec.size:
            raise ValueError(
                f"--colocated needs meshes of one world size (every GPU holds a teacher and a student "
                f"shard), got teacher {t_spec.size} ranks and student {s_spec.size}; give explicit "
                f"offset= values instead to model a partial overlap"
            )
        t_off, s_off = 0, 0
    else:
        t_off = t_spec.offset or 0
        s_off = s_spec.offset if s_spec.offset is not None else t_off + t_spec.size
    teacher = t_spec.mesh(rank_offset=t_off, name="teacher")
    student = s_spec.mesh(rank_offset=s_off, name="student")
    if args.batch is not None:
        if args.seq_len is None:
            raise ValueError("--batch needs --seq-len")
        lengths = (args.seq_len,) * args.batch
        seq_len: int | None = args.seq_len
    else:
        if args.seq_len is not None:
            raise ValueError(
                "--seq-len applies to padded batches (--batch); packed lengths come from --packed-lengths"
            )
        lengths, seq_len = args.packed_lengths, None
    sp = args.sequence_parallel
    student_sp = sp in ("student", "both")
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
        teacher_micro_batch=args.teacher_micro_batch,
        student_micro_batch=args.student_micro_batch,
        teacher_sp=sp in ("teacher", "both"),
        student_sp=student_sp,
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
        "Computed by the bridge's own planner (`mopd.bridge.plan_token_exchange`) on the CPU; "
        "times are the stated model, not measurements.\n\n"
        f"```\n{text}```\n{pic}\n## Environment\n{env}\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``mopd plan``: print the plan's figures, draw the heatmap, write JSON; returns the exit status.

    Bad flags or values print a message naming them to stderr and return 2.
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
    text = format_report(report, top=args.top)
    sys.stdout.write(text)
    png = None
    if not args.no_png:
        png = render_heatmap(report, args.png)
        print(f"heatmap: {png}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report_to_dict(report), indent=1) + "\n")
        print(f"json: {args.json}")
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(_markdown(text, argv, png))
        print(f"markdown: {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
