"""``mopd plan``'s figures: bytes per rank and link, balance, times, and the paths compared.

Why this file exists: every figure the inspector prints or draws derives from the simulated
step's plans; :func:`inspect_plan` derives them once, into a :class:`PlanReport`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    pass

from mopd.profiling.plan.request import PlanRequest
from mopd.profiling.plan.simulate import SimulatedStep, simulate_step

__all__ = [
    "DENSE_MAX_WORLD",
    "LINK_CLASSES",
    "PlanReport",
    "imbalance",
    "inspect_plan",
]

_I64 = np.int64


DENSE_MAX_WORLD = 16


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


def imbalance(v_W: np.ndarray) -> float:
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
        imbalance(send_W[list(g.ranks)])
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
        "send_imbalance": imbalance(send_W),
        "recv_imbalance": imbalance(recv_W),
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
LINK_CLASSES = (
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
