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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mopd.profiling.extras import can_draw
from mopd.profiling.mesh_arg import MESH_EXAMPLE, MeshSpec, OneLineParser, mesh_type, parse_int_list

if TYPE_CHECKING:
    from mopd.bridge.catalog import RunCatalog
    from mopd.bridge.layout import TokenLayout
    from mopd.bridge.mesh import Mesh
    from mopd.bridge.metadata import StepMatrix
    from mopd.bridge.plan import RankPlan
    from mopd.bridge.topology import Topology

__all__ = [
    "PlanReport",
    "PlanRequest",
    "SimulatedStep",
    "build_layouts",
    "build_parser",
    "format_report",
    "inspect_plan",
    "main",
    "render_heatmap",
    "report_to_dict",
    "simulate_step",
]

EXIT_USAGE = 2
_DENSE_MAX_WORLD = 16
_I64 = np.int64


# --- inputs ---------------------------------------------------------------------------------


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
        micro_batches: the step's micro-batches (the same on both sides).
        teacher_sp, student_sp: sequence parallelism on that side (the student then keeps its
            SP slice: every student rank is its own destination, no all-gather).
        teacher_sp_shards: with teacher SP, each teacher TP rank sends from its own SP shard
            (every rank its own source, no all-gather on the teacher's TP links: the
            ``Distiller``'s default); ``False``: the capture all-gathers the sequence and the
            TP ranks send as replicas (``TeacherSpec(sp_shards=False)``).
        link_gbps, nvlink_gbps, pcie_gbps: per-rank, per-direction bandwidths in Gb/s.
    """

    teacher: Mesh
    student: Mesh
    lengths: tuple[int, ...]
    padded_seq_len: int | None
    hidden_size: int
    vocab_size: int
    dtype_bytes: int = 2
    micro_batches: int = 1
    teacher_sp: bool = False
    student_sp: bool = False
    teacher_sp_shards: bool = True
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
                f"a padded batch has every sample at seq_len {self.padded_seq_len}, got "
                f"{list(self.lengths)}"
            )
        for name in ("hidden_size", "vocab_size", "dtype_bytes", "micro_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("link_gbps", "nvlink_gbps", "pcie_gbps"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
        b, m = len(self.lengths), self.micro_batches
        if b % m:
            raise ValueError(f"--micro-batches {m} does not divide the batch of {b} samples")
        per_mb = b // m
        for side, mesh in (("teacher", self.teacher), ("student", self.student)):
            if per_mb % mesh.dp:
                raise ValueError(
                    f"a micro-batch of {per_mb} samples ({b} samples / {m} micro-batches) does "
                    f"not split over the {side}'s dp={mesh.dp} (Megatron gives every DP rank "
                    "the same number of samples)"
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

    @property
    def sources_from_shards(self) -> bool:
        """Each teacher TP rank is a source of its own SP shard (``TeacherSpec(sp_shards=True)``)."""
        return self.teacher_sp and self.teacher_sp_shards and self.teacher.tp > 1

    @property
    def keeps_sp_slice(self) -> bool:
        """The student keeps its SP slice (``BridgeConfig(keep_sp_shard=True)``)."""
        return self.student_sp and self.student.tp > 1


def _pad_rule(mesh: Mesh, *, sp: bool) -> dict[str, int]:
    """One side's keywords for :func:`~mopd.bridge.layout.megatron_padded_length`."""
    return {"cp_size": mesh.cp, "sp_size": mesh.tp if sp else 1}


def _micro_batch_ids(req: PlanRequest, i: int, mesh: Mesh, d: int) -> list[int]:
    """Sample ids DP rank ``d`` of ``mesh`` holds in micro-batch ``i``."""
    per_mb = len(req.lengths) // req.micro_batches
    per_rank = per_mb // mesh.dp
    start = i * per_mb + d * per_rank
    return list(range(start, start + per_rank))


def _layout(
    req: PlanRequest,
    ids: list[int],
    mesh: Mesh,
    cp_rank: int,
    *,
    pad: dict[str, int],
    order: str,
    sp: tuple[int, int] = (1, 0),
) -> TokenLayout:
    from mopd.bridge.layout import megatron_padded_length, packed_layout, padded_layout

    lens = [req.lengths[s] for s in ids]
    if req.padded_seq_len is not None:
        return padded_layout(
            ids,
            megatron_padded_length(req.padded_seq_len, **pad),
            order=order,  # type: ignore[arg-type]
            lengths=lens,
            cp_size=mesh.cp,
            cp_rank=cp_rank,
            sp_size=sp[0],
            sp_rank=sp[1],
        )
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + megatron_padded_length(n, **pad))
    return packed_layout(
        ids,
        lens,
        cu_seqlens_padded=cu,
        cp_size=mesh.cp,
        cp_rank=cp_rank,
        sp_size=sp[0],
        sp_rank=sp[1],
    )


def _side_layouts(
    req: PlanRequest, i: int, mesh: Mesh, pad: dict[str, int], order: str, *, per_rank: bool
) -> dict[Any, TokenLayout]:
    """One side's layouts of micro-batch ``i``: ``(dp, cp) ->`` the shard's rows in ``order``,
    or with ``per_rank`` ``global rank ->`` each TP rank's own SP slice (``[S/tp, B]`` order)."""
    out: dict[Any, TokenLayout] = {}
    for d, c in mesh.shards():
        ids = _micro_batch_ids(req, i, mesh, d)
        if per_rank:
            for j, r in enumerate(mesh.tp_group_ranks(dp_rank=d, cp_rank=c)):
                out[r] = _layout(req, ids, mesh, c, pad=pad, order="sbh", sp=(mesh.tp, j))
        else:
            out[(d, c)] = _layout(req, ids, mesh, c, pad=pad, order=order)
    return out


def build_layouts(
    req: PlanRequest,
) -> tuple[list[dict[Any, TokenLayout]], list[dict[Any, TokenLayout]]]:
    """Per micro-batch, the teacher's captured layouts (``(dp, cp) ->``, or ``global rank ->``
    when each TP rank sends its SP shard) and the student's wanted ones (``(dp, cp) ->``, or
    ``global rank ->`` when it keeps its SP slice)."""
    t, s = req.teacher, req.student
    t_pad = _pad_rule(t, sp=req.teacher_sp)
    s_pad = _pad_rule(s, sp=req.student_sp)
    teacher: list[dict[Any, TokenLayout]] = []
    student: list[dict[Any, TokenLayout]] = []
    for i in range(req.micro_batches):
        teacher.append(_side_layouts(req, i, t, t_pad, "sbh", per_rank=req.sources_from_shards))
        student.append(_side_layouts(req, i, s, s_pad, "bsh", per_rank=req.keeps_sp_slice))
    return teacher, student


# --- the simulated step ---------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, eq=False)
class SimulatedStep:
    """One step as every rank of a live bridge would see and plan it.

    Attributes:
        topology: the meshes' groups (:class:`~mopd.bridge.topology.Topology`).
        matrix: the gathered metadata of every rank (:class:`~mopd.bridge.metadata.StepMatrix`).
        catalogs: per micro-batch, the planner's view of it.
        plans: per micro-batch, every member rank's :class:`~mopd.bridge.plan.RankPlan`.
        teacher_layouts, student_layouts: per micro-batch, what :func:`build_layouts` made.
    """

    topology: Topology
    matrix: StepMatrix
    catalogs: tuple[RunCatalog, ...]
    plans: tuple[dict[int, RankPlan], ...]
    teacher_layouts: tuple[dict[Any, TokenLayout], ...]
    student_layouts: tuple[dict[Any, TokenLayout], ...]


def simulate_step(req: PlanRequest) -> SimulatedStep:
    """Every rank's record, the gathered matrix, every rank's verdicts and plan (no processes).

    Raises:
        ValueError: a verdict of :func:`~mopd.bridge.coverage.check_rank` (the bridge would refuse
            this step on every rank).
    """
    import torch

    from mopd.bridge.coverage import check_rank
    from mopd.bridge.metadata import StepMatrix, encode_step_record
    from mopd.bridge.plan import plan_rank
    from mopd.bridge.record import rank_roles, rank_sections, read_step, stack_records
    from mopd.bridge.topology import Topology

    t, s = req.teacher, req.student
    t_lay, s_lay = build_layouts(req)
    topo = Topology.build(
        [t], s, per_rank_dests=req.keeps_sp_slice, shard_sources=[req.sources_from_shards]
    )
    m = req.micro_batches
    cache: dict[tuple[Any, Any], np.ndarray] = {}
    records: list[np.ndarray] = []
    for r in topo.members:
        # what rank r contributes: the bridge's own rule (mopd.bridge.record)
        roles = rank_roles(
            r,
            [t],
            s,
            keep_sp_shard=req.keeps_sp_slice,
            shard_sources=[req.sources_from_shards],
        )
        tc, sc = t.coord(r), s.coord(r)
        t_key = s_key = None
        if roles[0] is not None and tc is not None:  # from shards: each rank its own layouts
            t_key = r if req.sources_from_shards else (tc.dp_rank, tc.cp_rank)
        if roles[1] is not None and sc is not None:
            s_key = r if req.keeps_sp_slice else (sc.dp_rank, sc.cp_rank)
        key = (t_key, s_key, roles)
        if key not in cache:  # replicas with one role share one encoding
            sections = rank_sections(
                roles,
                teacher_layouts={} if t_key is None else {0: [t_lay[i][t_key] for i in range(m)]},
                student_layouts=None if s_key is None else [s_lay[i][s_key] for i in range(m)],
                dtypes=[torch.bfloat16],  # the planner does not read it; bytes use dtype_bytes
                hiddens=[req.hidden_size],
            )
            rec = encode_step_record(config_sig=1, n_slots=m, error="", sections=sections)
            cache[key] = rec.numpy()
        records.append(cache[key])
    gathered, _ = stack_records(records)
    matrix = StepMatrix(gathered)
    view = read_step(topo, matrix, m)
    catalogs, plans = [], []
    for i in range(m):
        catalog = view.catalogs[i]
        verdicts = [v for r in topo.members for v in check_rank(catalog, r)]
        if verdicts:
            raise ValueError(f"the bridge would refuse micro-batch {i}: {verdicts[0]}")
        catalogs.append(catalog)
        plans.append({r: plan_rank(catalog, r, compact=True) for r in topo.members})
    return SimulatedStep(
        topology=topo,
        matrix=matrix,
        catalogs=tuple(catalogs),
        plans=tuple(plans),
        teacher_layouts=tuple(t_lay),
        student_layouts=tuple(s_lay),
    )


# --- the figures ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, eq=False)
class PlanReport:
    """Every figure of one inspected step (bytes unless named otherwise).

    Attributes:
        request: what was asked.
        step: the simulated step (every rank's plan per micro-batch).
        world_size: ``W``, one past the highest global rank of either mesh.
        entries_E3: ``[E, 3]`` int64 nonzero ``(source, destination, bytes)`` of the transfer
            matrix, sorted; ``source == destination`` is a local copy.
        send_MW, recv_MW: ``[M, W]`` int64 bytes each rank sends / receives across ranks, per
            micro-batch (local copies apart).
        local_MW: ``[M, W]`` int64 bytes of local copies (by the receiving rank).
        allgather_MW: ``[M, W]`` int64 bytes each student rank sends (= receives) in the TP
            all-gather after the crossing.
        teacher_gather_MW: ``[M, W]`` int64 bytes each teacher rank receives (= sends) in the
            capture's SP all-gather over the teacher's TP group (replica sources under teacher
            SP; zero when the sources are the SP shards or the teacher has no SP).
        d2h_MW, h2d_MW: ``[M, W]`` int64 PCIe bytes per rank on the host path.
        teacher_rows, student_rows: rows of each side's buffer per shard, per micro-batch.
        tokens_per_group: real tokens each student ``(dp, cp)`` group needs (whole step), in
            ``mesh.shards()`` order.
        figures: the scalar figures (see :func:`report_to_dict`).
    """

    request: PlanRequest
    step: SimulatedStep
    world_size: int
    entries_E3: np.ndarray
    send_MW: np.ndarray
    recv_MW: np.ndarray
    local_MW: np.ndarray
    allgather_MW: np.ndarray
    teacher_gather_MW: np.ndarray
    d2h_MW: np.ndarray
    h2d_MW: np.ndarray
    teacher_rows: dict[Any, tuple[int, ...]]
    student_rows: dict[Any, tuple[int, ...]]
    tokens_per_group: tuple[int, ...]
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def send_W(self) -> np.ndarray:
        return self.send_MW.sum(axis=0)

    @property
    def recv_W(self) -> np.ndarray:
        return self.recv_MW.sum(axis=0)

    @property
    def local_W(self) -> np.ndarray:
        return self.local_MW.sum(axis=0)

    def dense(self) -> np.ndarray:
        """The ``[W, W]`` int64 transfer matrix (local copies on the diagonal)."""
        w = self.world_size
        m = np.zeros((w, w), dtype=_I64)
        e = self.entries_E3
        m[e[:, 0], e[:, 1]] = e[:, 2]
        return m


def _imbalance(v_W: np.ndarray) -> float:
    """``max / mean`` over the nonzero entries (1.0 when perfectly even; 0.0 when all are zero)."""
    nz = v_W[v_W > 0].astype(np.float64)
    return float(nz.max() / nz.mean()) if nz.size else 0.0


def _seconds(nbytes: int | float, gbps: float) -> float:
    return float(nbytes) * 8.0 / (gbps * 1e9)


def _slowest(v_MW: np.ndarray, gbps: float) -> float:
    """The step's time of a per-rank volume: per micro-batch the slowest rank, added up."""
    return sum(_seconds(int(v.max()) if v.size else 0, gbps) for v in v_MW)


def inspect_plan(req: PlanRequest) -> PlanReport:
    """Simulate ``req``'s step, plan it on every rank and derive every figure (no processes)."""
    step = simulate_step(req)
    t, s = req.teacher, req.student
    w = max(t.rank_offset + t.size, s.rank_offset + s.size)
    m, rb = req.micro_batches, req.row_bytes
    send = np.zeros((m, w), dtype=_I64)
    recv = np.zeros((m, w), dtype=_I64)
    local = np.zeros((m, w), dtype=_I64)
    allgather = np.zeros((m, w), dtype=_I64)
    h2d = np.zeros((m, w), dtype=_I64)
    pairs: dict[tuple[int, int], int] = {}
    messages = local_copies = 0
    for i, plans in enumerate(step.plans):
        sent: dict[tuple[int, int], int] = {}
        heard: dict[tuple[int, int], int] = {}
        for r, plan in plans.items():
            for x in plan.sends:
                n = x.count * rb
                send[i, r] += n
                pairs[(r, x.dst_rank)] = pairs.get((r, x.dst_rank), 0) + n
                sent[(r, x.dst_rank)] = sent.get((r, x.dst_rank), 0) + x.count
                messages += 1
            for x in plan.recvs:
                recv[i, r] += x.count * rb
                heard[(x.src_rank, r)] = heard.get((x.src_rank, r), 0) + x.count
            for x in plan.locals:  # source and destination are this rank
                n = x.count * rb
                local[i, r] += n
                pairs[(r, r)] = pairs.get((r, r), 0) + n
                local_copies += 1
            if plan.dest is not None:
                assert plan.owner_N is not None
                k = plan.dest.group_size
                if k > 1:  # a shared crossing: the teacher's (owner 0: the inspector models
                    # one) equal compact slices, all-gathered over the student TP group
                    allgather[i, r] = (k - 1) * plan.dest.slice_nominal(0) * rb
                h2d[i, r] = int((plan.owner_N >= 0).sum()) * rb
        if sent != heard:  # both ends of every transfer derive it alone: they must agree
            bad = sorted(set(sent.items()) ^ set(heard.items()))[:3]
            raise RuntimeError(f"micro-batch {i}: sends and receives disagree at {bad}")
    entries = np.asarray(sorted((a, b, n) for (a, b), n in pairs.items() if n), dtype=_I64).reshape(
        -1, 3
    )
    d2h = send + local  # on the host path every row leaves its teacher GPU, local ones too
    gather = _teacher_gather(req, step)

    tokens = []
    for d, c in s.shards():
        n = 0
        for lay in step.student_layouts:
            if req.keeps_sp_slice:
                n += sum(lay[r].num_tokens for r in s.tp_group_ranks(dp_rank=d, cp_rank=c))
            else:
                n += lay[(d, c)].num_tokens
        tokens.append(n)
    send_W, recv_W, local_W = send.sum(0), recv.sum(0), local.sum(0)
    cross, loc = int(send_W.sum()), int(local_W.sum())
    total = cross + loc
    needed = sum(tokens)
    s_tp = s.tp
    logits_full = needed * s_tp * req.vocab_size * req.dtype_bytes
    logits_sharded = needed * req.vocab_size * req.dtype_bytes
    link_MW = np.maximum(send, recv)
    t_cross = _slowest(link_MW, req.link_gbps)
    slowest = int(np.argmax(link_MW.sum(0))) if w else -1
    t_gather = _slowest(allgather, req.nvlink_gbps)
    t_d2h = _slowest(d2h, req.pcie_gbps)
    t_h2d = _slowest(h2d, req.pcie_gbps)
    t_host = t_d2h + t_cross + t_h2d
    rep = [
        _imbalance(send_W[list(g.ranks)])
        for g in step.topology.sources
        if send_W[list(g.ranks)].sum()
    ]
    pcie = int(d2h.sum() + h2d.sum())
    links = _link_classes(req, step, cross=cross, local=loc, gather=gather, allgather=allgather)
    figures: dict[str, Any] = {
        "tokens": req.num_tokens,
        "tokens_needed": needed,
        "micro_batches": m,
        "row_bytes": rb,
        "bytes_total": total,
        "bytes_minimum": needed * rb,
        "bytes_cross": cross,
        "bytes_local": loc,
        "transfers": messages + local_copies,
        "messages": messages,
        "local_copies": local_copies,
        "rank_pairs": sum(1 for a, b, _ in entries.tolist() if a != b),
        "senders": int((send_W > 0).sum()),
        "receivers": int((recv_W > 0).sum()),
        "max_send_bytes": int(send_W.max()) if w else 0,
        "max_recv_bytes": int(recv_W.max()) if w else 0,
        "mean_send_bytes": float(send_W[send_W > 0].mean()) if cross else 0.0,
        "mean_recv_bytes": float(recv_W[recv_W > 0].mean()) if cross else 0.0,
        "send_imbalance": _imbalance(send_W),
        "recv_imbalance": _imbalance(recv_W),
        "replica_imbalance": max(rep, default=0.0),
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
        "sources_from_shards": req.sources_from_shards,
        "teacher_tp_gather_bytes": int(gather.sum()),
        "time_teacher_tp_gather_s": _slowest(gather, req.nvlink_gbps),
        **links,
    }
    return PlanReport(
        request=req,
        step=step,
        world_size=w,
        entries_E3=entries,
        send_MW=send,
        recv_MW=recv,
        local_MW=local,
        allgather_MW=allgather,
        teacher_gather_MW=gather,
        d2h_MW=d2h,
        h2d_MW=h2d,
        teacher_rows={
            k: tuple(lay[k].num_rows for lay in step.teacher_layouts)
            for k in step.teacher_layouts[0]
        },
        student_rows={
            k: tuple(lay[k].num_rows for lay in step.student_layouts)
            for k in step.student_layouts[0]
        },
        tokens_per_group=tuple(tokens),
        figures=figures,
    )


#: The link classes of one step, in report order: ``(key, what)``.
_LINK_CLASSES = (
    ("cross", "cross-rank point-to-point (the bridge's crossing)"),
    ("local", "colocated local copies"),
    ("teacher_tp", "teacher TP links (the capture's SP all-gather)"),
    ("student_tp", "student TP links (all-gather after the crossing)"),
)


def _teacher_gather(req: PlanRequest, step: SimulatedStep) -> np.ndarray:
    """``[M, W]`` bytes each teacher last-stage rank receives in the capture's SP all-gather:
    ``(tp - 1) / tp`` of its ``(dp, cp)`` shard's full buffer (padding rows included: the gather
    moves the whole buffer) when the teacher runs SP and its TP ranks are replicas; else 0."""
    t = req.teacher
    w = max(t.rank_offset + t.size, req.student.rank_offset + req.student.size)
    out = np.zeros((req.micro_batches, w), dtype=_I64)
    if not (req.teacher_sp and t.tp > 1) or req.sources_from_shards:
        return out
    for i, held in enumerate(step.teacher_layouts):
        for (d, c), lay in held.items():
            share = lay.num_rows // t.tp  # one rank's shard; it receives the other tp - 1
            for r in t.tp_group_ranks(dp_rank=d, cp_rank=c):
                out[i, r] = (t.tp - 1) * share * req.row_bytes
    return out


def _link_classes(
    req: PlanRequest,
    step: SimulatedStep,
    *,
    cross: int,
    local: int,
    gather: np.ndarray,
    allgather: np.ndarray,
) -> dict[str, Any]:
    """Bytes per link class of the step beside the minimum (``link_bytes``,
    ``link_bytes_minimum``, their totals and ``links_at_minimum``).

    The minimum: each needed row once to each student ``(dp, cp)`` group (the crossing and the
    local copies together: which of the two serves a row depends on placement), nothing on the
    teacher's TP links (the rows are where the capture left them), and the student TP
    all-gather its layout needs (``tp - 1`` of ``tp`` equal slices of each group's tokens to
    every rank, or nothing when each rank keeps its SP slice).
    """
    s, rb = req.student, req.row_bytes
    needed = sum(
        lay.num_tokens for held in step.student_layouts for lay in held.values()
    )  # each student group's tokens once (SP slices are disjoint)
    student_min = 0
    if not req.keeps_sp_slice and s.tp > 1:
        for held in step.student_layouts:
            for lay in held.values():
                per = -(-lay.num_tokens // s.tp)  # the shared crossing's slice, rounded up
                student_min += s.tp * (s.tp - 1) * per * rb
    got = {
        "cross": cross,
        "local": local,
        "teacher_tp": int(gather.sum()),
        "student_tp": int(allgather.sum()),
    }
    floor = {"cross_plus_local": needed * rb, "teacher_tp": 0, "student_tp": student_min}
    total = sum(got.values())
    total_min = sum(floor.values())
    return {
        "link_bytes": got,
        "link_bytes_minimum": floor,
        "link_bytes_total": total,
        "link_bytes_total_minimum": total_min,
        "links_at_minimum": total == total_min
        and got["cross"] + got["local"] == floor["cross_plus_local"],
    }


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


def _row_entries(dst: Sequence[int], nbytes: Sequence[int]) -> str:
    """One matrix row's entries (ascending destinations), consecutive equal ones merged."""
    parts: list[str] = []
    i = 0
    while i < len(dst):
        j = i
        while j + 1 < len(dst) and dst[j + 1] == dst[j] + 1 and nbytes[j + 1] == nbytes[i]:
            j += 1
        who = str(dst[i]) if i == j else f"{dst[i]}-{dst[j]}"
        each = " each" if j > i else ""
        parts.append(f"{who}: {_fmt_bytes(nbytes[i])}{each}")
        i = j + 1
    return "; ".join(parts)


def _mesh_line(mesh: Mesh, sp: bool) -> str:
    return (
        f"TP{mesh.tp} CP{mesh.cp} DP{mesh.dp} PP{mesh.pp}{' SP' if sp and mesh.tp > 1 else ''}, "
        f"global ranks {mesh.rank_offset}..{mesh.rank_offset + mesh.size - 1}, "
        f"last stage {_ranges(mesh.last_stage_ranks())}"
    )


def _rows_text(rows: Mapping[Any, tuple[int, ...]]) -> str:
    return str(sorted({n for v in rows.values() for n in v}))


def format_report(report: PlanReport, *, top: int = 8) -> str:
    """The printed summary: setup, matrix, per-rank volumes, comparisons, times."""
    from mopd.bridge.layout import megatron_padded_length
    from mopd.bridge.mesh import meshes_overlap

    req, f = report.request, report.figures
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
    m = req.micro_batches
    add(f"batch: {batch}; {f['tokens']} tokens; {m} micro-batch{'es' if m > 1 else ''}")
    per_mb = b // m
    sp_note = ", each rank its own SP slice" if req.keeps_sp_slice else ""
    add(
        f"buffers per micro-batch: teacher {_rows_text(report.teacher_rows)} rows per "
        f"{'TP rank (its SP shard) of a ' if req.sources_from_shards else ''}(dp, cp) "
        f"shard ({per_mb // t.dp} samples), student {_rows_text(report.student_rows)} rows "
        f"({per_mb // s.dp} samples{sp_note}); padding rows never move"
    )
    add(
        f"row: hidden {req.hidden_size} x {req.dtype_bytes} B = {_fmt_bytes(req.row_bytes)}; "
        f"vocab {req.vocab_size}"
    )
    if req.padded_seq_len is not None:
        for side, mesh, sp in (("teacher", t, req.teacher_sp), ("student", s, req.student_sp)):
            pad = _pad_rule(mesh, sp=sp)
            padded = megatron_padded_length(req.padded_seq_len, **pad)
            mult = megatron_padded_length(1, **pad)
            if padded != req.padded_seq_len:
                add(
                    f"note: {side} sequences padded to {padded} (a multiple of {mult}); "
                    f"positions {req.padded_seq_len}.. are padding"
                )
    if req.teacher_sp and t.tp > 1:
        add(
            "note: teacher SP: each teacher TP rank sends from its own SP shard (its own source, "
            "no all-gather on the teacher's TP links)"
            if req.sources_from_shards
            else "note: teacher SP with replica sources: the capture all-gathers the sequence "
            "over the teacher's TP group before the bridge (--teacher-sp-replicas)"
        )
    add("")
    add("== plan (mopd.bridge.plan.plan_rank on every rank, every micro-batch) ==")
    add(
        f"{f['transfers']} transfers: {f['messages']} messages between ranks "
        f"({f['rank_pairs']} rank pairs), {f['local_copies']} local copies; "
        f"{f['tokens_needed']} token rows delivered, each once per student "
        f"{'rank (SP slice)' if req.keeps_sp_slice else '(dp, cp) group'}"
    )
    minimum = (
        "= the minimum"
        if f["bytes_total"] == f["bytes_minimum"]
        else (f"!= the minimum {f['bytes_minimum']} B")
    )
    add(
        f"bytes: {_fmt_bytes(f['bytes_total'])} total = {_fmt_bytes(f['bytes_cross'])} across ranks "
        f"+ {_fmt_bytes(f['bytes_local'])} local copies ({f['bytes_total']} B, {minimum}: "
        "tokens x row)"
    )
    add("")
    add("== bytes per link class, per step (beside the minimum) ==")
    links, floor = f["link_bytes"], f["link_bytes_minimum"]
    add(f"{'link class':<52}{'bytes':>14}{'minimum':>14}")
    for key, what in _LINK_CLASSES:
        low = "" if key in ("cross", "local") else _fmt_bytes(floor[key])
        add(f"{what:<52}{_fmt_bytes(links[key]):>14}{low:>14}")
    add(
        f"{'  crossing + local copies (each needed row once)':<52}"
        f"{_fmt_bytes(links['cross'] + links['local']):>14}"
        f"{_fmt_bytes(floor['cross_plus_local']):>14}"
    )
    add(
        f"{'total':<52}{_fmt_bytes(f['link_bytes_total']):>14}"
        f"{_fmt_bytes(f['link_bytes_total_minimum']):>14}"
    )
    add(
        "at the minimum"
        if f["links_at_minimum"]
        else f"above the minimum by {_fmt_bytes(f['link_bytes_total'] - f['link_bytes_total_minimum'])}"
        + (
            " (the teacher's SP all-gather: send from the shards, the default)"
            if links["teacher_tp"]
            else ""
        )
    )
    add("")
    add("== transfer matrix: bytes, source global rank (row) -> destination (column) ==")
    e = report.entries_E3
    if w <= _DENSE_MAX_WORLD:
        dense = report.dense()
        unit, scale = ("MiB", 2**20) if int(dense.max(initial=0)) >= 2**20 else ("KiB", 2**10)
        add(f"(in {unit}; '.' = nothing; the diagonal is local copies)")
        add("src\\dst " + "".join(f"{j:>8}" for j in range(w)))
        for i in range(w):
            cells = "".join(
                f"{int(x) / scale:>8.1f}" if int(x) else f"{'.':>8}" for x in dense[i].tolist()
            )
            add(f"{i:>7} {cells}")
    by_src: dict[int, tuple[list[int], list[int]]] = {}
    for a, b_, n in e.tolist():
        dst, nb = by_src.setdefault(a, ([], []))
        dst.append(b_)
        nb.append(n)
    order = sorted(by_src, key=lambda r: (-sum(by_src[r][1]), r))
    shown_rows = order[:top]
    add(f"{len(by_src)} source ranks, {e.shape[0]} nonzero entries; top {len(shown_rows)} rows:")
    for r in shown_rows:
        dst, nb = by_src[r]
        add(f"  {r:>5} ({_fmt_bytes(sum(nb))}) -> {_row_entries(dst, nb)}")
    if len(order) > len(shown_rows):
        rest = sum(sum(by_src[r][1]) for r in order[len(shown_rows) :])
        add(f"  ... {len(order) - len(shown_rows)} more source ranks, {_fmt_bytes(rest)}")
    add(f"  total {_fmt_bytes(int(e[:, 2].sum()))}")
    add("")
    add("== per-rank volume across ranks (local copies apart) ==")
    for what, v in (("send", report.send_W), ("recv", report.recv_W)):
        nz = np.flatnonzero(v).tolist()
        if not nz:
            add(f"{what}: nobody")
            continue
        vals = v[nz]
        groups: dict[int, list[int]] = {}
        for r in nz:
            groups.setdefault(int(v[r]), []).append(r)
        add(
            f"{what}: {len(nz)} ranks, max {_fmt_bytes(int(vals.max()))}, "
            f"mean {_fmt_bytes(float(vals.mean()))}, min {_fmt_bytes(int(vals.min()))}, "
            f"imbalance max/mean {f[what + '_imbalance']:.4f}"
        )
        for val, ranks in sorted(groups.items(), key=lambda kv: -kv[0])[:top]:
            add(f"  {_fmt_bytes(val)}: ranks {_ranges(ranks)}")
        if len(groups) > top:
            add(f"  ... {len(groups) - top} more distinct volumes")
    if f["bytes_local"]:
        nz = np.flatnonzero(report.local_W).tolist()
        add(f"local copies: ranks {_ranges(nz)}, {_fmt_bytes(f['bytes_local'])} in all")
    if not req.sources_from_shards:  # a source is one rank: nothing to balance within it
        add(f"teacher TP replica balance: max/mean {f['replica_imbalance']:.4f}")
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
        f"({'SP slices' if req.keeps_sp_slice else 'every TP rank loads its whole shard'}); "
        f"{f['host_hops_per_token']} hops per token (D2H, network, H2D) vs "
        f"{f['bridge_hops_per_token']} (GPU->GPU)"
    )
    add(
        f"student TP all-gather after the crossing: {_fmt_bytes(f['student_allgather_bytes'])} "
        + (
            "(none: the student keeps SP slices)"
            if req.keeps_sp_slice or s.tp == 1
            else "(ring, inside each TP group)"
        )
    )
    add("")
    per = "per micro-batch the slowest rank's max(send, recv) / link, added over micro-batches"
    add(
        f"== time (model: {per if m > 1 else 'the slowest rank max(send, recv) / link'}; "
        f"link {req.link_gbps:g} Gb/s per rank, NVLink {req.nvlink_gbps:g} Gb/s, "
        f"PCIe {req.pcie_gbps:g} Gb/s) =="
    )
    slow = f["slowest_rank"]
    add(
        f"bridge crossing: {_fmt_time(f['time_cross_s'])} (slowest rank {slow}: send "
        f"{_fmt_bytes(int(report.send_W[slow]))}, recv {_fmt_bytes(int(report.recv_W[slow]))})"
    )
    add(f"student TP all-gather (NVLink): {_fmt_time(f['time_student_allgather_s'])}")
    if f["teacher_tp_gather_bytes"]:
        add(
            "teacher SP all-gather before the bridge (NVLink): "
            f"{_fmt_time(f['time_teacher_tp_gather_s'])}"
        )
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


def _shard_key(k: Any) -> str:
    return f"dp{k[0]}_cp{k[1]}" if isinstance(k, tuple) else f"rank{k}"


def report_to_dict(report: PlanReport) -> dict[str, Any]:
    """Every number of ``report`` as JSON-ready data (the matrix as its nonzero entries)."""
    req = report.request

    def mesh(x: Mesh, sp: bool, **more: Any) -> dict[str, Any]:
        return {
            "tp": x.tp,
            "pp": x.pp,
            "cp": x.cp,
            "dp": x.dp,
            "rank_offset": x.rank_offset,
            "sp": sp,
            **more,
        }

    return {
        "teacher": mesh(req.teacher, req.teacher_sp, sp_shards=req.sources_from_shards),
        "sources_from_shards": req.sources_from_shards,
        "student": mesh(req.student, req.student_sp),
        "batch": {
            "kind": "padded" if req.padded_seq_len is not None else "packed",
            "lengths": list(req.lengths),
            "seq_len": req.padded_seq_len,
            "micro_batches": req.micro_batches,
        },
        "hidden_size": req.hidden_size,
        "vocab_size": req.vocab_size,
        "dtype_bytes": req.dtype_bytes,
        "world_size": report.world_size,
        "matrix": report.entries_E3.tolist(),
        "send_bytes": report.send_W.tolist(),
        "recv_bytes": report.recv_W.tolist(),
        "local_bytes": report.local_W.tolist(),
        "send_bytes_per_micro_batch": report.send_MW.tolist(),
        "recv_bytes_per_micro_batch": report.recv_MW.tolist(),
        "student_allgather_bytes_per_rank": report.allgather_MW.sum(0).tolist(),
        "teacher_tp_gather_bytes_per_rank": report.teacher_gather_MW.sum(0).tolist(),
        "host_d2h_bytes_per_rank": report.d2h_MW.sum(0).tolist(),
        "host_h2d_bytes_per_rank": report.h2d_MW.sum(0).tolist(),
        "teacher_rows": {_shard_key(k): list(v) for k, v in sorted(report.teacher_rows.items())},
        "student_rows": {
            _shard_key(k): list(v)
            for k, v in sorted(report.student_rows.items(), key=lambda kv: str(kv[0]))
        },
        "tokens_per_student_group": {
            _shard_key(k): n
            for k, n in zip(req.student.shards(), report.tokens_per_group, strict=True)
        },
        "figures": dict(report.figures),
    }


def render_heatmap(report: PlanReport, path: Path) -> Path:
    """Write a PNG of the transfer matrix with each rank's send / receive volume beside it.

    What the text cannot show at a glance: where the bytes go (the matrix of sends, local
    copies marked apart, on a log colour scale when the values span decades), how each rank's
    volume compares with the others' (bars per source rank on the right, per destination rank
    below, local copies stacked on the sends, the mean dashed), and which ranks form the
    teacher's TP groups and the student's destinations (alternating bands on the edges).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LogNorm, Normalize
    from matplotlib.figure import Figure

    from mopd.profiling.plots import byte_unit, spans_decades

    req, f = report.request, report.figures
    w = report.world_size
    e = report.entries_E3
    send_W, recv_W, local_W = report.send_W, report.recv_W, report.local_W
    local_src = np.zeros(w, dtype=_I64)  # local copies by the serving rank (= the receiver)
    loc = e[e[:, 0] == e[:, 1]]
    np.add.at(local_src, loc[:, 0], loc[:, 2])
    peak = int(max((send_W + local_src).max(initial=0), (recv_W + local_W).max(initial=0)))
    unit, scale = byte_unit(peak)
    bins = max(1, -(-w // 512))  # large jobs: ranks summed in bins, so the image stays small
    nb = -(-w // bins)
    cross = e[e[:, 0] != e[:, 1]]
    img = np.zeros((nb, nb), dtype=np.float64)
    np.add.at(img, (cross[:, 0] // bins, cross[:, 1] // bins), cross[:, 2] / scale)
    nz = img[img > 0]
    log = spans_decades(nz.tolist())
    norm = (
        LogNorm(vmin=float(nz.min()), vmax=float(nz.max()))
        if log
        else Normalize(vmin=0.0, vmax=float(nz.max()) if nz.size else 1.0)
    )
    size = min(13.0, max(7.0, 6.0 + w / 16))
    fig = Figure(figsize=(size + 2.4, size + 0.4), layout="constrained")
    FigureCanvasAgg(fig)
    gs = fig.add_gridspec(2, 2, width_ratios=(4.0, 1.3), height_ratios=(4.0, 1.3))
    ax = fig.add_subplot(gs[0, 0])
    ax_s = fig.add_subplot(gs[0, 1], sharey=ax)
    ax_r = fig.add_subplot(gs[1, 0], sharex=ax)
    ax_i = fig.add_subplot(gs[1, 1])
    im = ax.imshow(
        np.ma.masked_equal(img, 0.0),
        cmap="viridis",
        norm=norm,
        interpolation="nearest",
        extent=(-0.5, nb * bins - 0.5, nb * bins - 0.5, -0.5),
        aspect="auto",
    )
    handles = []
    if loc.shape[0]:
        handles.append(
            ax.scatter(
                loc[:, 0],
                loc[:, 1],
                marker="s",
                s=max(4.0, min(90.0, 2400.0 / w)),
                facecolors="none",
                edgecolors="tab:orange",
                linewidths=1.4,
                label=f"local copy: {_fmt_bytes(f['bytes_local'])} in all, not sent",
            )
        )
    # the teacher's source groups (rows) and the student's destinations (columns), alternating
    sources, dests = report.step.topology.sources, report.step.topology.dests
    for k, g in enumerate(sources):
        lo, hi = min(g.ranks) - 0.5, max(g.ranks) + 0.5
        ax.axhspan(lo, hi, xmin=0.0, xmax=0.015, color=("tab:red", "lightcoral")[k % 2])
        if len(sources) <= 64:
            ax.axhline(lo, color="tab:red", lw=0.4, alpha=0.3)
    for k, d in enumerate(dests):
        lo, hi = min(d.ranks) - 0.5, max(d.ranks) + 0.5
        ax.axvspan(lo, hi, ymin=0.0, ymax=0.015, color=("tab:blue", "lightskyblue")[k % 2])
        if len(dests) <= 64:
            ax.axvline(lo, color="tab:blue", lw=0.4, alpha=0.3)
    dest = "student rank (its own SP slice)" if req.keeps_sp_slice else "student TP group"
    handles += [
        ax.plot([], [], color="tab:red", lw=4, label="teacher TP group (replicas; left edge)")[0],
        ax.plot([], [], color="tab:blue", lw=4, label=f"{dest} (destination; bottom edge)")[0],
    ]
    b_note = f" (bins of {bins})" if bins > 1 else ""
    ax.set_ylabel("source global rank" + b_note)
    ax.set_xlim(-0.5, w - 0.5)
    ax.set_ylim(w - 0.5, -0.5)
    t, s = req.teacher, req.student
    minimum = "the minimum" if f["bytes_total"] == f["bytes_minimum"] else "NOT the minimum"
    fig.suptitle(
        f"mopd plan: teacher TP{t.tp} CP{t.cp} DP{t.dp} PP{t.pp} -> student TP{s.tp} CP{s.cp} "
        f"DP{s.dp} PP{s.pp}, {req.micro_batches} micro-batch(es)\n"
        f"{_fmt_bytes(f['bytes_cross'])} across ranks + {_fmt_bytes(f['bytes_local'])} local "
        f"copies = {minimum} (each token once); send max/mean {f['send_imbalance']:.3f}, "
        f"recv max/mean {f['recv_imbalance']:.3f}",
        fontsize=9,
    )

    edges = np.arange(w + 1) - 0.5
    sent, got = send_W / scale, recv_W / scale
    ax_s.stairs(sent, edges, orientation="horizontal", fill=True, color="#4472c4", label="sent")
    ax_r.stairs(got, edges, fill=True, color="#4472c4", label="received")
    if loc.shape[0]:
        ax_s.stairs(
            sent + local_src / scale,
            edges,
            baseline=sent,
            orientation="horizontal",
            fill=True,
            color="tab:orange",
            label="local copy",
        )
        ax_r.stairs(
            got + local_W / scale,
            edges,
            baseline=got,
            fill=True,
            color="tab:orange",
            label="local copy",
        )
    for axis, v, line, who in (
        (ax_s, sent, ax_s.axvline, "senders"),
        (ax_r, got, ax_r.axhline, "receivers"),
    ):
        if (v > 0).any():
            line(float(v[v > 0].mean()), color="black", lw=0.8, ls="--", label=f"mean of {who}")
        axis.legend(fontsize=7, loc="lower right" if axis is ax_s else "upper left")
        axis.grid(alpha=0.3)
    bar_log = spans_decades(np.concatenate([send_W + local_src, recv_W + local_W]).tolist())
    if bar_log:
        ax_s.set_xscale("log")
        ax_r.set_yscale("log")
    ax_s.set_xlabel(f"{unit} per source rank{', log' if bar_log else ''}")
    ax_s.tick_params(labelleft=False)
    ax_r.set_ylabel(f"{unit} per destination{', log' if bar_log else ''}", fontsize=8)
    ax_r.set_xlabel("destination global rank" + b_note)

    ax_i.axis("off")
    ax_i.legend(handles=handles, loc="upper left", fontsize=7, frameon=False)
    cax = ax_i.inset_axes((0.05, 0.42, 0.9, 0.08))
    fig.colorbar(im, cax=cax, orientation="horizontal")
    cax.set_title(f"{unit} per (source, destination){', log scale' if log else ''}", fontsize=7)
    cax.tick_params(labelsize=7)
    timing = [  # one phrase a line: matplotlib's own wrapping cuts phrases in two
        f"modelled: crossing {_fmt_time(f['time_cross_s'])} at {req.link_gbps:g} Gb/s",
        f"+ student TP all-gather {_fmt_time(f['time_student_allgather_s'])}",
        f"teacher logits instead: {f['logits_full_ratio']:.1f}x the bytes",
        f"host path: {f['host_bytes_ratio']:.1f}x the bytes, {f['host_time_ratio']:.2f}x the time",
    ]
    ax_i.text(
        0.0,
        0.25,
        "\n".join(timing),
        fontsize=7,
        va="top",
        transform=ax_i.transAxes,
    )
    fig.savefig(path, dpi=110)
    return path


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
    sys.exit(main())
