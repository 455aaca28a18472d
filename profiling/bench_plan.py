"""Benchmark: one rank's per-step host work at 256 to 65,536 ranks, today's path beside the old.

Why this file exists: every per-step cost of the bridge on the host must follow the rank's own
work, not the job's. A timed test would be flaky, so this benchmark shows it: for each rank count
it simulates one step of ``--micro-batches`` micro-batches (no process group) of a colocated job,
teacher tp8 cp2 and student tp4 cp4 on the same ranks, THD on both sides with Megatron's SP
padding, about ``--tokens-per-rank`` real tokens per rank in the step, samples of random lengths
assigned to DP ranks in contiguous ranges (the teacher cuts by sample count, the student
balances tokens, so the cuts differ). Every rank's record is built by the bridge's own rule
(:mod:`mopd.bridge.record`) and stacked as the all-gather returns it: setup, not timed.

Both source modes of the teacher are timed (``--sources``): ``replicas`` (its last-stage TP
groups send as replicas) and ``sp_shards`` (``TeacherSpec(sp_shards=True)``: every teacher
rank sends its own SP shard, tp times the sending groups); each row names its mode.

Timed for a few representative ranks (each a teacher and a student rank; the first one leads a
source and a destination group), every per-step host function of the live bridge, called on a
bridge object without process groups (:func:`offline_bridge`):

- ``step_host_ms``: a step whose inputs the rank has seen (steady state: every rank repeats
  its step, so every record says it is the plan memo's step's but for its header, and the
  summary's all-reduce lets every rank skip gathering the records, the memo's matrix serving):
  building its layouts and record (``_local_record``), the fence and the verdict checks, the
  plan keys (the memo's) and schedule lookups (``_agree_and_plan``: no planner runs, no group's
  slot table read), the token counts (``global_tokens`` once for the step and once per
  micro-batch, as the loss does);
- ``step_host_miss_ms``: the same with an empty schedule cache (every micro-batch planned);
- ``step_host_old_ms``: the path before the record-keyed cache, in the same run: runs from the
  rows (key sort), a catalog per micro-batch through the records' offsets, every verdict and
  ``plan_rank`` every step (its schedule found by the plan's digest), the duplicate-sample check
  of every student group on one rank, ``global_tokens`` decoding every student group's runs.

Each is the slowest rank's least of several steps. ``plan_ms`` is, as before, decoding +
``plan_rank`` + ``check_rank`` of one micro-batch. Beside them, at the recorded setup (one micro-batch, 4096
tokens per rank), the retired global planner's recorded figures, read from ``profiling/results/``
in a checkout (:data:`BASELINE`). Each rank count prints a line on stderr as it starts and ends.
Figures are one CPU thread of this machine.

It also models the metadata all-gather at those sizes (:func:`model_allgather`): bytes per rank
and in all, the flat ring and the two-level exchange the bridge runs from
``create_bridge_groups(metadata_nodes_from=...)`` on (:func:`~mopd.bridge.groups.all_gather_nodes`).

Run: ``python -m mopd.profiling.bench_plan [--ranks N ...] [--json] [--results-dir DIR]``
(or ``mopd bench plan``). ``--json`` prints one JSON object per rank count; otherwise a table.
Records ``plan-step-<machine>-<date>.{csv,md}`` and a log-log figure
``plan-step-<machine>-<date>-vs-ranks.png`` in the results folder (``--results-dir``; by default
``profiling/results/`` inside a checkout, ``./mopd-results/`` elsewhere; not with ``--no-record``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import statistics
import sys
import time
import tracemalloc
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mopd.bridge.api import HiddenStateBridge
from mopd.bridge.checks import agreed_slots, agreed_state
from mopd.bridge.config import BridgeConfig, TeacherSpec
from mopd.bridge.executor import Executor
from mopd.bridge.groups import BridgeGroups
from mopd.bridge.layout import TokenLayout, packed_layout
from mopd.bridge.mesh import Mesh
from mopd.bridge.metadata import (
    HEADER,
    MEMO_STEP,
    UNCHANGED,
    StepMatrix,
    encode_step_record,
    record_tables,
    reduced_summary,
    reuses_memo,
)
from mopd.bridge.plan import check_rank, plan_rank
from mopd.bridge.record import rank_roles, rank_sections, stack_records
from mopd.bridge.step import BridgeStep
from mopd.bridge.topology import Topology
from mopd.profiling.extras import can_draw
from mopd.profiling.mesh_arg import OneLineParser, prog_for
from mopd.profiling.results import environment, format_table, record

__all__ = [
    "BASELINE",
    "DEFAULT_RANKS",
    "SOURCES",
    "AllGatherModel",
    "Step",
    "build_step",
    "main",
    "measure_local",
    "measure_step",
    "model_allgather",
    "offline_bridge",
    "recorded_global",
]

#: The retired global planner's recorded run (``global_plan_ms``, ``global_rss_growth_mib`` per
#: rank count at 4096 tokens per rank in one micro-batch, samples up to 4096 long, seed 0), under
#: ``results/``.
BASELINE = "plan-scale-cpu-2026-12-01"
_BASELINE_SETUP = {"tokens_per_rank": 4096, "max_len": 4096, "seed": 0, "micro_batches": 1}
#: The teacher's source modes measured: TP replicas (one sending group per TP group), or every
#: teacher rank sending its own SP shard (``TeacherSpec(sp_shards=True)``: tp x the groups).
SOURCES: tuple[str, ...] = ("replicas", "sp_shards")
#: Rank counts measured by default.
DEFAULT_RANKS: tuple[int, ...] = (256, 1024, 4096, 16384, 65536)
_T_TP, _T_CP, _S_TP, _S_CP = 8, 2, 4, 4
_BLOCK = _T_TP * _T_CP  # ranks per DP index (the same for both meshes)
_HIDDEN = 8192
#: Ring all-gather model: latency per ring step (inter-node NCCL hop) and bandwidth per rank.
ALPHA_S, BETA_BPS = 10e-6, 20e9
#: Inside a node (the two-level model): ranks per node, NVLink latency and bandwidth.
NODE, ALPHA_NVL_S, BETA_NVL_BPS = 8, 2e-6, 200e9


def _meshes(ranks: int) -> tuple[Mesh, Mesh]:
    if ranks % _BLOCK:
        raise ValueError(f"ranks must be a multiple of {_BLOCK}, got {ranks}")
    dp = ranks // _BLOCK
    return (
        Mesh(tp=_T_TP, cp=_T_CP, dp=dp, name="teacher"),
        Mesh(tp=_S_TP, cp=_S_CP, dp=dp, name="student"),
    )


@dataclass(frozen=True, kw_only=True, eq=False)
class _Samples:
    """One micro-batch's samples and how each side assigns them to its DP ranks (contiguous
    ids)."""

    lengths_S: np.ndarray
    teacher_parts: list[np.ndarray]
    student_parts: list[np.ndarray]


def _samples(ranks: int, tokens_per_rank: int, max_len: int, seed: int) -> _Samples:
    rng = np.random.default_rng(seed)
    total = tokens_per_rank * ranks
    lengths = rng.integers(1, max_len + 1, size=int(2.4 * total / (max_len + 1)) + 64)
    n = int(np.searchsorted(np.cumsum(lengths), total)) + 1
    if n > lengths.size:
        raise AssertionError("drew too few samples")
    lengths = lengths[:n]
    dp = ranks // _BLOCK
    ids = np.arange(n, dtype=np.int64)
    teacher = np.array_split(ids, dp)  # the same number of samples per DP rank
    cuts = np.searchsorted(np.cumsum(lengths), np.arange(1, dp) * (lengths.sum() / dp))
    student = np.split(ids, cuts)  # about the same number of tokens per DP rank
    return _Samples(lengths_S=lengths, teacher_parts=teacher, student_parts=student)


def _layout(
    ids: np.ndarray,
    lengths_S: np.ndarray,
    cp: int,
    cp_rank: int,
    mult: int,
    sp: int = 1,
    sp_rank: int = 0,
) -> TokenLayout:
    lens = lengths_S[ids]
    padded = (lens + mult - 1) // mult * mult
    cu = np.concatenate([[0], np.cumsum(padded)])
    return packed_layout(
        torch.from_numpy(ids),
        torch.from_numpy(lens),
        cu_seqlens_padded=torch.from_numpy(cu),
        cp_size=cp,
        cp_rank=cp_rank,
        sp_size=sp,
        sp_rank=sp_rank,
    )


def _mult(tp: int, cp: int) -> int:
    """Megatron's THD padding under CP with SP: each sequence to a multiple of ``2 * cp * tp``."""
    return 2 * cp * tp


@dataclass(frozen=True, kw_only=True, eq=False)
class Step:
    """One simulated step: meshes, topology, the gathered matrix and what it cost to build.

    ``micro``: per micro-batch the samples (what a rank builds its layouts from);
    ``sp_shards``: the teacher sends from its sequence-parallel shards (every teacher rank its
    own source, ``TeacherSpec(sp_shards=True)``) instead of from TP replicas."""

    ranks: int
    sp_shards: bool
    tokens: int
    samples: int
    teacher: Mesh
    student: Mesh
    topology: Topology
    matrix_NW: np.ndarray
    sizes_N: np.ndarray
    micro: tuple[_Samples, ...]
    setup_s: float
    topology_ms: float


def _rank_layouts(step: Step, rank: int) -> tuple[list[TokenLayout], list[TokenLayout]]:
    """``rank``'s teacher and student layouts, one per micro-batch (built as a rank builds
    them each step)."""
    tc, sc = step.teacher.coord(rank), step.student.coord(rank)
    assert tc is not None and sc is not None
    t_mult, s_mult = _mult(_T_TP, _T_CP), _mult(_S_TP, _S_CP)
    sp = (_T_TP, tc.tp_rank) if step.sp_shards else (1, 0)
    t = [
        _layout(m.teacher_parts[tc.dp_rank], m.lengths_S, _T_CP, tc.cp_rank, t_mult, *sp)
        for m in step.micro
    ]
    s = [
        _layout(m.student_parts[sc.dp_rank], m.lengths_S, _S_CP, sc.cp_rank, s_mult)
        for m in step.micro
    ]
    return t, s


def build_step(
    ranks: int,
    *,
    tokens_per_rank: int,
    max_len: int,
    seed: int = 0,
    micro_batches: int = 1,
    sp_shards: bool = False,
) -> Step:
    """Every rank's record (by the bridge's rule: :func:`~mopd.bridge.record.rank_roles`,
    :func:`~mopd.bridge.record.rank_sections`, :func:`~mopd.bridge.metadata.encode_step_record`)
    and the stacked matrix; ``tokens_per_rank`` over the whole step, split evenly into the
    micro-batches (each its own draw of samples); ``sp_shards``: the teacher's sources are its
    SP shards (each teacher rank sends its own slice of the CP-local sequence).

    Built one DP index (16 ranks) at a time; ranks whose records are identical (same shards,
    same roles) share one encoding.
    """
    t0 = time.perf_counter()
    teacher, student = _meshes(ranks)
    per_mb = max(tokens_per_rank // micro_batches, 1)
    micro = tuple(_samples(ranks, per_mb, max_len, seed + i) for i in range(micro_batches))
    t_mult, s_mult = _mult(_T_TP, _T_CP), _mult(_S_TP, _S_CP)
    records: list[np.ndarray] = []
    sp = _T_TP if sp_shards else 1
    for d in range(teacher.dp):
        t_lay = [
            [
                [_layout(m.teacher_parts[d], m.lengths_S, _T_CP, c, t_mult, sp, k) for m in micro]
                for k in range(sp)
            ]
            for c in range(_T_CP)
        ]
        s_lay = [
            [_layout(m.student_parts[d], m.lengths_S, _S_CP, c, s_mult) for m in micro]
            for c in range(_S_CP)
        ]
        same: dict[tuple[Any, ...], np.ndarray] = {}
        for r in range(d * _BLOCK, (d + 1) * _BLOCK):
            tc, sc = teacher.coord(r), student.coord(r)
            assert tc is not None and sc is not None
            roles = rank_roles(r, [teacher], student, shard_sources=[sp_shards])
            k = tc.tp_rank if sp_shards else 0
            key = (tc.cp_rank, k, sc.cp_rank, roles)
            if key not in same:
                sections = rank_sections(
                    roles,
                    teacher_layouts={0: t_lay[tc.cp_rank][k]},
                    student_layouts=s_lay[sc.cp_rank],
                    dtypes=[torch.bfloat16],
                    hiddens=[_HIDDEN],
                )
                rec = encode_step_record(
                    config_sig=1, n_slots=micro_batches, error="", sections=sections
                )
                same[key] = rec.numpy()
            records.append(same[key])
    matrix, sizes = stack_records(records)
    del records
    t1 = time.perf_counter()
    topo = Topology.build([teacher], student, shard_sources=[sp_shards])
    _ = topo.index
    topology_ms = 1e3 * (time.perf_counter() - t1)
    return Step(
        ranks=ranks,
        sp_shards=sp_shards,
        tokens=int(sum(m.lengths_S.sum() for m in micro)),
        samples=int(sum(m.lengths_S.size for m in micro)),
        teacher=teacher,
        student=student,
        topology=topo,
        matrix_NW=matrix,
        sizes_N=sizes,
        micro=micro,
        setup_s=time.perf_counter() - t0,
        topology_ms=topology_ms,
    )


def _plan_one(step: Step, rank: int) -> tuple[Any, list[str]]:
    """What one rank does per micro-batch once the matrix is there (micro-batch 0)."""
    m = StepMatrix(step.matrix_NW)
    catalog = step.topology.catalog(m, 0)
    return plan_rank(catalog, rank, compact=True), check_rank(catalog, rank)


def _groups_read(step: Step, rank: int) -> int:
    """How many groups' runs ``rank`` reads to plan and check (not timed)."""
    m = StepMatrix(step.matrix_NW)
    cat = step.topology.catalog(m, 0)
    counting, source_ids, dest_ids = cat.recording_reads()
    plan_rank(counting, rank, compact=True)
    check_rank(counting, rank)
    return len(source_ids) + len(dest_ids)


def representative_ranks(ranks: int) -> list[int]:
    """Rank 0 (teacher and student group leader: checks both), one in the middle (no leader),
    and the last teacher leader (a student leader too)."""
    return sorted({0, ranks // 2 + 5, ranks - _BLOCK // 2})


def measure_local(step: Step, ranks: Sequence[int], repeats: int) -> dict[str, float]:
    """``plan_ms`` (slowest median), ``plan_ms_min`` (fastest median), ``plan_alloc_mib``
    (largest tracemalloc peak) and ``groups_read`` (most groups read) over ``ranks``."""
    medians, peaks, reads = [], [], []
    for r in ranks:
        plan, verdicts = _plan_one(step, r)  # warm-up
        if verdicts or not (plan.sends or plan.recvs or plan.locals):
            raise RuntimeError(f"rank {r}: unexpected plan ({verdicts or 'no transfers'})")
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            _plan_one(step, r)
            times.append(time.perf_counter() - t)
        medians.append(statistics.median(times))
        gc.collect()
        tracemalloc.start()
        _plan_one(step, r)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        reads.append(_groups_read(step, r))
    return {
        "groups_read": max(reads),
        "plan_ms": 1e3 * max(medians),
        "plan_ms_min": 1e3 * min(medians),
        "plan_alloc_mib": max(peaks) / 2**20,
    }


# --- one rank's step, as the live bridge runs it ------------------------------------------------


def offline_bridge(step: Step, rank: int) -> HiddenStateBridge:
    """A :class:`~mopd.bridge.api.HiddenStateBridge` of ``step``'s meshes as global rank
    ``rank`` holds it, without process groups (this benchmark has none): the attributes its
    constructor derives from the groups are set here, so that its per-step methods
    (``_local_record``, ``_agree_and_plan``, :class:`~mopd.bridge.step.BridgeStep`) run as
    they do in a job, minus the collectives (the metadata group is ``None``: the verdict of a
    step without problems is then local)."""
    b = HiddenStateBridge.__new__(HiddenStateBridge)
    b.teachers = (
        TeacherSpec(
            mesh=step.teacher,
            hidden_size=_HIDDEN,
            dtype=torch.bfloat16,
            sp_shards=step.sp_shards,
        ),
    )
    b.student = step.student
    b.topology = step.topology
    b.groups = BridgeGroups(bridge=None, student_tp=None, members=step.topology.members)
    b.config = BridgeConfig()
    b.rank = rank
    b.device = torch.device("cpu")
    b._executor = Executor(rank=rank, timeout_s=b.config.timeout_s)
    b._tp_group_error = ""
    b._roles = rank_roles(rank, [step.teacher], step.student, shard_sources=[step.sp_shards])
    b.config_sig = 1
    b._open_steps = []
    b._memo = None
    b._live_steps = weakref.WeakSet()
    b.steps = 0
    b.closed = False
    return b


def _tokens(bs: BridgeStep) -> int:
    """What the loss reads per step: the step's tokens, and each micro-batch's."""
    return bs.global_tokens() + sum(bs.global_tokens(i) for i in range(bs.num_micro_batches))


def _fresh(step: Step, bridge: HiddenStateBridge, *, reuse: bool = True) -> StepMatrix:
    """The gathered matrix and the summary as the bridge's exchange gives them (not timed):
    with a plan memo every record repeats (``reuse``), the memo's matrix, nothing gathered
    (:func:`~mopd.bridge.metadata.reuses_memo`); otherwise a new copy of the matrix, so the
    step reads what the all-gather has just written, not what the previous step left in the
    caches. Every record's plan-memo words are those of ``bridge``'s rank (every rank repeats
    its step as this one does: with a memo from the step before, its record unchanged since)."""
    memo = bridge._memo
    words = (-1, 0) if memo is None else (memo.step, 1)
    header_NH = step.matrix_NW[:, :HEADER].copy()
    header_NH[:, MEMO_STEP], header_NH[:, UNCHANGED] = words
    summary_2H = reduced_summary(header_NH)  # what the all-reduce returns
    if reuse and memo is not None and reuses_memo(summary_2H, memo.step):
        return StepMatrix(memo.matrix, summary_2H)
    bridge._memo = None  # as the bridge drops a memo that cannot serve
    m = step.matrix_NW.copy()
    m[:, MEMO_STEP], m[:, UNCHANGED] = words
    return StepMatrix(m, summary_2H)


def _new_step(step: Step, bridge: HiddenStateBridge) -> dict[str, float]:
    """One step of ``bridge``'s rank on today's path; seconds per part."""
    tl = time.perf_counter()
    t_lay, s_lay = _rank_layouts(step, bridge.rank)
    t0 = time.perf_counter()
    record_, sections, _agreements = bridge._local_record({0: t_lay}, s_lay, None, None, [])
    t_enc = time.perf_counter()
    gathered = _fresh(step, bridge)  # the all-gather, after the record is built (not timed)
    t1 = time.perf_counter()
    bs = bridge._agree_and_plan(gathered, sections)
    t2 = time.perf_counter()
    _tokens(bs)
    t3 = time.perf_counter()
    bs.finished = True  # nothing moves here; the next step may be planned
    bridge._open_steps.clear()
    bridge.steps = 0
    if not np.array_equal(
        record_tables(record_),
        record_tables(gathered.matrix[step.topology.member_index(bridge.rank)]),
    ):
        raise AssertionError(f"rank {bridge.rank}: its record is not its row of the matrix")
    return {"layouts": t0 - tl, "encode": t_enc - t0, "verdict_plan": t2 - t1, "tokens": t3 - t2}


def _old_step(step: Step, bridge: HiddenStateBridge) -> dict[str, float]:
    """One step of ``bridge``'s rank on the path before the record-keyed cache (the calls the
    bridge made then, the retired ones written out here); seconds per part."""
    topo, rank = step.topology, bridge.rank
    tl = time.perf_counter()
    t_lay, s_lay = _rank_layouts(step, rank)
    t0 = time.perf_counter()
    # runs from the rows: the layouts as a caller-built TokenLayout (no runs attached)
    t_rows = [TokenLayout(sample_id_R=x.sample_id_R, position_R=x.position_R) for x in t_lay]
    s_rows = [TokenLayout(sample_id_R=x.sample_id_R, position_R=x.position_R) for x in s_lay]
    bridge._local_record({0: t_rows}, s_rows, None, None, [])
    t_enc = time.perf_counter()
    gathered = _fresh(step, bridge, reuse=False)  # the all-gather, after the record (not timed)
    t1 = time.perf_counter()
    matrix = StepMatrix(gathered.matrix)  # the headers were read off the matrix then
    agreed_state(matrix, members=topo.members, rank=rank, executor=bridge.executor)
    n_slots = agreed_slots(matrix, members=topo.members)
    catalogs = [topo.catalog(matrix, i) for i in range(n_slots)]
    me = topo.members.index(rank)
    for g in topo.index.source_groups.get(rank, ()):  # replicas against their leader
        leader, o = int(topo.source_leader[g]), int(topo.source_section[g])
        for i in range(n_slots):
            matrix.slot_fields(np.asarray([me, leader]), o, i)
    problems: list[str] = []
    if rank == topo.dests[0].ranks[0]:  # one rank read every student group's runs
        for catalog in catalogs:
            seen: dict[int, int] = {}
            for d, dest in enumerate(catalog.dests):
                c = step.student.coord(dest.ranks[0])
                assert c is not None
                for sample in np.unique(catalog.dest_runs(d)[:, 0]).tolist():
                    seen.setdefault(sample, c.dp_rank)
    for catalog in catalogs:
        problems += check_rank(catalog, rank)
    t2 = time.perf_counter()
    ex = bridge.executor
    row_bytes = [_HIDDEN * torch.bfloat16.itemsize]
    for catalog in catalogs:  # plan every step; the schedule found by the plan's digest
        plan = plan_rank(catalog, rank)
        if plan.sends or plan.recvs or plan.locals or plan.dest is not None:
            nominal = catalog.dests[plan.dest.group].slice_rows if plan.dest is not None else 0
            ex.schedule(plan, slice_rows=nominal, num_owners=1, row_bytes=row_bytes)
    t3 = time.perf_counter()
    total = 0
    for i in [None, *range(n_slots)]:  # global_tokens: every student group's runs, each call
        for catalog in catalogs if i is None else [catalogs[i]]:
            for d in range(len(catalog.dests)):
                total += int(catalog.dest_runs(d)[:, 4].sum())
    t4 = time.perf_counter()
    if problems:
        raise RuntimeError(f"rank {rank}: unexpected verdicts {problems[:2]}")
    return {
        "layouts": t0 - tl,
        "encode": t_enc - t0,
        "verdict": t2 - t1,
        "plan": t3 - t2,
        "tokens": t4 - t3,
    }


def _best_parts(
    run: Callable[[], dict[str, float]], repeats: int, budget_s: float
) -> dict[str, float]:
    """Per-part minima (ms) of ``repeats`` runs (fewer once ``budget_s`` is spent, at least
    one), ``total`` (the least sum) and ``bridge`` (the least sum without the layouts): on a
    shared machine the least disturbed run is the figure, old and new alike."""
    runs: list[dict[str, float]] = []
    start = time.perf_counter()
    while len(runs) < repeats and (not runs or time.perf_counter() - start < budget_s):
        runs.append(run())
    out = {k: 1e3 * min(r[k] for r in runs) for k in runs[0]}
    out["total"] = 1e3 * min(sum(r.values()) for r in runs)
    out["bridge"] = 1e3 * min(sum(r.values()) - r["layouts"] for r in runs)
    return out


def measure_step(step: Step, ranks: Sequence[int], repeats: int) -> dict[str, float]:
    """Per-step host time of each rank in ``ranks`` on today's path (cache hits; and an empty
    cache: ``miss``) and on the old one; for each figure the slowest rank's least of several
    steps (ms)."""
    new, miss, old = [], [], []
    for r in ranks:
        bridge = offline_bridge(step, r)
        _new_step(step, bridge)  # warm-up: plans and caches every micro-batch
        built = bridge.executor.schedules_built
        new.append(_best_parts(lambda b=bridge: _new_step(step, b), repeats, 5.0))
        if bridge.executor.schedules_built != built:
            raise AssertionError(f"rank {r}: a repeated step built schedules")

        def cold(r: int = r) -> dict[str, float]:
            return _new_step(step, offline_bridge(step, r))

        miss.append(_best_parts(cold, max(repeats // 3, 1), 5.0))
        ob = offline_bridge(step, r)
        _old_step(step, ob)  # warm-up: its schedules are built once, found by digest after
        old.append(_best_parts(lambda b=ob: _old_step(step, b), max(repeats // 3, 1), 10.0))

    def worst(rows: list[dict[str, float]], k: str) -> float:
        return max(x[k] for x in rows)

    return {
        "step_host_ms": worst(new, "total"),
        "bridge_host_ms": worst(new, "bridge"),
        "layouts_ms": worst(new, "layouts"),
        "encode_ms": worst(new, "encode"),
        "verdict_plan_ms": worst(new, "verdict_plan"),
        "tokens_ms": worst(new, "tokens"),
        "step_host_miss_ms": worst(miss, "total"),
        "step_host_old_ms": worst(old, "total"),
        "bridge_host_old_ms": worst(old, "bridge"),
        "encode_old_ms": worst(old, "encode"),
        "verdict_old_ms": worst(old, "verdict"),
        "plan_old_ms": worst(old, "plan"),
        "tokens_old_ms": worst(old, "tokens"),
    }


@dataclass(frozen=True, kw_only=True)
class AllGatherModel:
    """The metadata all-gather of one step at ``n`` ranks.

    Attributes:
        bytes_per_rank: mean record bytes (what a rank contributes before padding).
        padded_bytes_per_rank: the widest record (every record travels padded to it).
        gathered_bytes: what every rank receives and holds (``n`` padded records).
        ring_ms: flat ring: the summary's all-reduce (``s = 2 HEADER`` words: ``2 (n - 1)
            alpha + 2 s / beta``), then the records' all-gather (``(n - 1) (alpha + w /
            beta)``).
        hier_ms: the two-level exchange the bridge runs: the summary's all-reduce in log
            depth (``ceil(log2 n) (alpha + s / beta)``), then the records' two-level
            all-gather (:func:`~mopd.bridge.groups.all_gather_nodes`, nodes of ``NODE``
            ranks): a gather to the node leader over NVLink (``(k - 1) (alpha_nvl + w /
            beta_nvl)``), the leaders' log-depth all-gather (``ceil(log2(n / k)) alpha +
            (n - k) w / beta``), a binomial broadcast of the matrix inside the node
            (``ceil(log2 k) (alpha_nvl + n w / beta_nvl)``).
        repeat_ms: a repeated step's exchange (every record the plan memo's step's but for
            its header): the summary's all-reduce alone, in log depth.
    """

    bytes_per_rank: float
    padded_bytes_per_rank: int
    gathered_bytes: int
    ring_ms: float
    hier_ms: float
    repeat_ms: float


def _two_level_s(n: int, w: float) -> float:
    """Seconds of one two-level all-gather of ``w`` bytes per rank over ``n`` ranks."""
    k = min(NODE, n)
    leaders = -(-n // k)
    inside = (k - 1) * (ALPHA_NVL_S + w / BETA_NVL_BPS)
    across = math.ceil(math.log2(leaders)) * ALPHA_S + (leaders - 1) * k * w / BETA_BPS
    bcast = math.ceil(math.log2(k)) * (ALPHA_NVL_S + n * w / BETA_NVL_BPS)
    return inside + across + bcast


def model_allgather(n: int, sizes_N: np.ndarray) -> AllGatherModel:
    """The model of :class:`AllGatherModel` for records of ``sizes_N`` int64 words."""
    w = int(sizes_N.max()) * 8
    summary = 8 * 2 * HEADER
    reduce_ring = 2 * (n - 1) * ALPHA_S + 2 * summary / BETA_BPS
    reduce_tree = math.ceil(math.log2(max(n, 2))) * (ALPHA_S + summary / BETA_BPS)
    ring = reduce_ring + (n - 1) * (ALPHA_S + w / BETA_BPS)
    return AllGatherModel(
        bytes_per_rank=float(sizes_N.mean()) * 8,
        padded_bytes_per_rank=w,
        gathered_bytes=n * w,
        ring_ms=1e3 * ring,
        hier_ms=1e3 * (reduce_tree + _two_level_s(n, w)),
        repeat_ms=1e3 * reduce_tree,
    )


def recorded_global(results_dir: Path | None = None) -> dict[int, dict[str, float | None]]:
    """The retired global planner's recorded figures per rank count (empty where the record is
    not there, e.g. in an installed package, whose wheel leaves ``results/`` out)."""
    import csv

    path = (results_dir or Path(__file__).resolve().parent / "results") / f"{BASELINE}.csv"
    if not path.is_file():
        return {}
    out: dict[int, dict[str, float | None]] = {}
    with path.open(newline="") as f:
        for rec in csv.DictReader(f):
            out[int(rec["ranks"])] = {
                k: float(rec[k]) if rec.get(k) else None
                for k in ("global_plan_ms", "global_rss_growth_mib")
            }
    return out


def _row(
    step: Step,
    local: dict[str, float],
    host: dict[str, float],
    glob: dict[str, float | None],
    rss_mib: float,
) -> dict:
    model = model_allgather(step.ranks, step.sizes_N)
    matrix_mib = step.matrix_NW.nbytes / 2**20
    return {
        "ranks": step.ranks,
        "sources": "sp_shards" if step.sp_shards else "replicas",
        "micro_batches": len(step.micro),
        "tokens": step.tokens,
        "samples": step.samples,
        "step_host_ms": round(host["step_host_ms"], 4),
        "step_host_old_ms": round(host["step_host_old_ms"], 4),
        "step_host_miss_ms": round(host["step_host_miss_ms"], 4),
        "bridge_host_ms": round(host["bridge_host_ms"], 4),
        "bridge_host_old_ms": round(host["bridge_host_old_ms"], 4),
        "layouts_ms": round(host["layouts_ms"], 4),
        "encode_ms": round(host["encode_ms"], 4),
        "verdict_plan_ms": round(host["verdict_plan_ms"], 4),
        "tokens_ms": round(host["tokens_ms"], 4),
        "encode_old_ms": round(host["encode_old_ms"], 4),
        "verdict_old_ms": round(host["verdict_old_ms"], 4),
        "plan_old_ms": round(host["plan_old_ms"], 4),
        "tokens_old_ms": round(host["tokens_old_ms"], 4),
        "plan_ms": round(local["plan_ms"], 4),
        "plan_ms_min": round(local["plan_ms_min"], 4),
        "global_plan_ms": glob.get("global_plan_ms"),
        "groups_read": int(local["groups_read"]),
        "groups": len(step.topology.sources) + len(step.topology.dests),
        "metadata_bytes_per_rank": round(model.bytes_per_rank, 1),
        "metadata_padded_bytes_per_rank": model.padded_bytes_per_rank,
        "allgather_bytes": model.gathered_bytes,
        "allgather_ring_ms": round(model.ring_ms, 3),
        "allgather_hier_ms": round(model.hier_ms, 3),
        "repeat_exchange_ms": round(model.repeat_ms, 3),
        "peak_mib": round(matrix_mib + local["plan_alloc_mib"], 3),
        "matrix_mib": round(matrix_mib, 3),
        "plan_alloc_mib": round(local["plan_alloc_mib"], 3),
        "global_rss_growth_mib": glob.get("global_rss_growth_mib"),
        "setup_s": round(step.setup_s, 2),
        "setup_rss_mib": round(rss_mib, 1),
        "topology_build_ms": round(step.topology_ms, 2),
    }


def _plot(rows: Sequence[dict], png: Path, tokens_per_rank: int) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11.0, 4.4), layout="constrained")
    FigureCanvasAgg(fig)
    ax, bx = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for src, mark in zip(SOURCES, "os", strict=False):
        mode = [r for r in rows if r["sources"] == src]
        if not mode:
            continue
        m = [r["ranks"] for r in mode]
        for key, style, what in (
            ("step_host_ms", "-", "step host work, memo (step_host_ms)"),
            ("step_host_miss_ms", ":", "step host work, every plan (miss)"),
            ("step_host_old_ms", "--", "step host work, old path"),
            ("plan_ms", "-.", "plan + check, one micro-batch (plan_ms)"),
        ):
            ax.plot(m, [r[key] for r in mode], mark + style, label=f"{what}, {src}", ms=4)
    rows = [r for r in rows if r["sources"] == rows[0]["sources"]]  # the exchange: one mode
    n = [r["ranks"] for r in rows]
    ax.set(xscale="log", yscale="log", xlabel="ranks", ylabel="ms per step", title="host time")
    bx.plot(n, [r["allgather_ring_ms"] for r in rows], "^:", label="metadata, flat ring (model)")
    bx.plot(n, [r["allgather_hier_ms"] for r in rows], "v-", label="metadata, two-level (model)")
    g = [(r["ranks"], r["global_plan_ms"]) for r in rows if r["global_plan_ms"] is not None]
    if g:
        bx.plot(*zip(*g, strict=True), "s--", label=f"retired global planner ({BASELINE})")
    bx.set(xscale="log", yscale="log", xlabel="ranks", ylabel="ms per step", title="exchange")
    for x in (ax, bx):
        x.grid(alpha=0.3, which="both")
        x.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    fig.suptitle(
        f"One rank's step, ~{tokens_per_rank:,} tokens per rank (teacher tp8 cp2, student tp4 "
        f"cp4, colocated, THD, {rows[0]['micro_batches']} micro-batches); one CPU thread",
        fontsize=9,
    )
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def _notes(rows: Sequence[dict], args: argparse.Namespace, load: tuple[float, float]) -> str:
    lines = [
        f"One CPU thread of this machine (a shared {os.cpu_count()}-core box; load average "
        f"{load[0]:.1f} at the start and {load[1]:.1f} at the end of the run): absolute times "
        "are noisy, the shape against ranks is the figure. Per rank count: one simulated step "
        f"of {args.micro_batches} micro-batches, {args.tokens_per_rank} real tokens per rank in "
        f"the step on average, lengths uniform in [1, {args.max_len}], teacher tp8 cp2 and "
        "student tp4 cp4 colocated on the same ranks (rank r is both), THD both sides padded to "
        "2 cp tp per sequence, DP ranks holding contiguous sample ids (teacher: equal sample "
        "counts; student: equal tokens). Two source modes (`sources`): `replicas`, the "
        "teacher's last-stage TP groups as replicas (one sending group per TP group), and "
        "`sp_shards`, every teacher rank sending its own SP shard (TeacherSpec(sp_shards=True): "
        "tp = 8 times the sending groups).",
        "`step_host_ms`: one rank's per-step host work on a step it has seen (the steady "
        "state: every rank repeats its step, so every record says it is the plan memo's "
        "step's but for its header; the summary's all-reduce says so alike everywhere, so no "
        "rank gathers the records again (the memo's matrix serves) or reads another's header, "
        "and the rank reuses its plan keys and token counts, reading no group's slot table): building its 2 x micro-batches layouts (`layouts_ms`, the caller's "
        "packed_layout calls, which now derive the runs), its record (`encode_ms`), the fence, "
        "the verdict checks, plan keys and schedule lookups (`verdict_plan_ms`: no planner), "
        "the token counts (`tokens_ms`: the step's and each micro-batch's); `bridge_host_ms`: "
        "all but the layouts (the bridge's own functions). `step_host_miss_ms`: the same with an empty "
        "schedule cache (every micro-batch planned and checked). `step_host_old_ms`: the path "
        "before (runs from the rows, a catalog per micro-batch through the records' offsets, "
        "every verdict and plan_rank each step, one rank reading every student group for "
        "duplicate samples, global_tokens decoding every student group per call), with the same "
        "layout constructors (their runs dropped, so the record derives them from the rows); "
        "`*_old_ms` its parts. Each timed step builds its layouts and record, then reads a "
        "fresh copy of the gathered matrix (as after the all-gather, which follows the record; "
        "the copy is not timed; the old path reads the headers off it, as it did). "
        f"The least of up to {args.repeats} steps (old and miss: a third of that; on this "
        "shared machine the least disturbed step is the figure, for every path alike), "
        "the slowest of three ranks (rank 0, one in the middle, the last teacher leader).",
        "`plan_ms`: decode (StepMatrix + Topology.catalog) + plan_rank + check_rank of one "
        "micro-batch of one rank, as before; `global_plan_ms`: the retired global planner "
        f"recorded in profiling/results/{BASELINE}.md, only at its setup (one micro-batch of "
        "4096 tokens per rank). `peak_mib` = `matrix_mib` (the gathered metadata every rank "
        "holds) + `plan_alloc_mib` (tracemalloc peak of planning one micro-batch).",
        f"All-gather model: records padded to the widest (`metadata_padded_bytes_per_rank`), "
        f"two collectives (an all-reduce of the {2 * HEADER}-word header summary, then the "
        f"records); ring: 2 (n-1) alpha + 2 s / beta for the all-reduce, (n-1) (alpha + w / "
        f"beta) for the records, with alpha = "
        f"{ALPHA_S * 1e6:g} us per hop and beta = {BETA_BPS / 1e9:g} GB/s; two-level (what "
        f"the bridge runs from create_bridge_groups(metadata_nodes_from=...) on): nodes of "
        f"{NODE} (NVLink alpha {ALPHA_NVL_S * 1e6:g} us, {BETA_NVL_BPS / 1e9:g} GB/s), the "
        "summary's all-reduce in log depth, then a gather to the node leader, a log-depth (Bruck) all-gather among leaders, a binomial "
        "broadcast inside the node.",
    ]
    for src in SOURCES:
        by = {r["ranks"]: r for r in rows if r["sources"] == src}
        lo, hi, top = by.get(1024), by.get(16384), by.get(65536)
        if hi:
            ok = hi["step_host_ms"] <= 2
            lines.append(
                f"{src}: at 16,384 ranks {hi['step_host_ms']:.3g} ms of host work per step "
                f"({'meets' if ok else 'misses'} the <= 2 ms target; "
                f"{hi['bridge_host_ms']:.3g} ms without building the layouts, "
                f"{hi['layouts_ms']:.3g} ms building them), against "
                f"{hi['step_host_old_ms']:.4g} ms on the old path; the two-level exchange "
                f"modelled at {hi['allgather_hier_ms']:.3g} ms against "
                f"{hi['allgather_ring_ms']:.4g} ms for the flat ring "
                f"({'meets' if hi['allgather_hier_ms'] <= 10 else 'misses'} the <= 10 ms target) "
                "for a step whose records changed, and at "
                f"{hi['repeat_exchange_ms']:.3g} ms for a repeated one (the summary's "
                "all-reduce alone: no records gathered)."
            )
        if lo and top:
            ratio = top["step_host_ms"] / lo["step_host_ms"]
            lines.append(
                f"{src}: flatness, step_host_ms at 65,536 ranks is {ratio:.2f}x that at 1,024 "
                f"({top['step_host_ms']:.3g} against {lo['step_host_ms']:.3g} ms; target "
                f"<= 1.5x: {'met' if ratio <= 1.5 else 'missed'}; bridge_host_ms "
                f"{top['bridge_host_ms'] / lo['bridge_host_ms']:.2f}x, layouts_ms "
                f"{top['layouts_ms'] / lo['layouts_ms']:.2f}x); the old path "
                f"{top['step_host_old_ms'] / lo['step_host_old_ms']:.3g}x."
            )
    cross = [r["ranks"] for r in rows if r["allgather_hier_ms"] < r["allgather_ring_ms"]]
    if cross:
        lines.append(
            f"The two-level exchange models below the flat ring from {min(cross):,} ranks on "
            "(of those measured); below a few hundred ranks the flat all-gather is a handful of "
            "hops and needs no extra groups, hence create_bridge_groups' default "
            "metadata_nodes_from=512."
        )
    return "\n\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(
        prog=prog_for("mopd.profiling.bench_plan"), description=__doc__.splitlines()[0]
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=list(DEFAULT_RANKS))
    parser.add_argument(
        "--tokens-per-rank", type=int, default=4096, help="real tokens per rank in the step"
    )
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step")
    parser.add_argument("--max-len", type=int, default=4096, help="longest sample")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sources",
        nargs="+",
        choices=SOURCES,
        default=list(SOURCES),
        help="the teacher's sources: TP replicas, or each rank's SP shard",
    )
    parser.add_argument("--repeats", type=int, default=9, help="timed calls per rank")
    parser.add_argument("--json", action="store_true", help="one JSON object per rank count")
    parser.add_argument("--results-dir", type=Path, default=None)
    parser.add_argument("--no-record", action="store_true", help="print only")
    args = parser.parse_args(argv)
    same_setup = all(getattr(args, k) == v for k, v in _BASELINE_SETUP.items())
    baseline = recorded_global() if same_setup else {}
    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]
    rows = []
    runs = [(n, src) for src in args.sources for n in args.ranks]
    for i, (n, src) in enumerate(runs):
        t0 = time.perf_counter()
        what = f"[{i + 1}/{len(runs)}] {n} ranks, {src}"
        print(f"bench_plan: {what} ...", file=sys.stderr, flush=True)
        step = build_step(
            n,
            tokens_per_rank=args.tokens_per_rank,
            max_len=args.max_len,
            seed=args.seed,
            micro_batches=args.micro_batches,
            sp_shards=src == "sp_shards",
        )
        rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        reps = representative_ranks(n)
        local = measure_local(step, reps, args.repeats)
        host = measure_step(step, reps, args.repeats)
        row = _row(step, local, host, baseline.get(n, {}), rss_mib)
        del step
        gc.collect()
        rows.append(row)
        print(
            f"bench_plan: {what} done in "
            f"{time.perf_counter() - t0:.1f} s (one rank's step: {row['step_host_ms']:.3g} ms, "
            f"old path {row['step_host_old_ms']:.3g} ms)",
            file=sys.stderr,
            flush=True,
        )
        if args.json:
            print(json.dumps(row), flush=True)
    if not args.json:
        print(format_table(rows))
    if not args.no_record:
        env = environment()
        notes = _notes(rows, args, (load0, os.getloadavg()[0]))
        csv_path, md_path = record(
            "plan-step", rows, out_dir=args.results_dir, notes=notes, env=env
        )
        recorded = [csv_path, md_path]
        if can_draw("mopd bench plan"):
            png = csv_path.with_name(csv_path.stem + "-vs-ranks.png")
            _plot(rows, png, args.tokens_per_rank)
            recorded.append(png)
        print(f"recorded {', '.join(map(str, recorded))}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
