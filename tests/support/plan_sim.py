"""Pure simulation of a bridge step without process groups: records, matrix, every rank's plan.

Why this file exists: the planner's property tests and the planning benchmark need every rank's
metadata record and the gathered matrix of a step, built exactly as the live bridge builds them,
but in one process. :func:`simulate` encodes each rank's record by the bridge's own rule
(:func:`mopd.bridge.offline.step_records`), stacks them as the all-gather would, and :func:`deliver` moves key-pattern rows through every
rank's :class:`~mopd.bridge.plan.RankPlan` (a mailbox instead of a transport), so a test can
compare each destination row with the row its key names (:func:`key_sources`,
:func:`expected_slice`). :func:`contiguous_step` builds steps whose DP ranks hold contiguous
ranges of sample ids, as real jobs do, so that the sample ranges single out a group's peers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mopd.bridge.catalog import RunCatalog
from mopd.bridge.config import BridgeConfig, TeacherSpec
from mopd.bridge.inputs import Agreement
from mopd.bridge.layout import TokenLayout, concat_layouts, packed_layout, padded_layout
from mopd.bridge.mesh import Mesh
from mopd.bridge.metadata import StepMatrix
from mopd.bridge.offline import step_records as offline_records
from mopd.bridge.plan import RankPlan
from mopd.bridge.record import StepView, read_step, stack_records
from mopd.bridge.topology import Topology

__all__ = [
    "MicroBatchLayouts",
    "SimStep",
    "contiguous_step",
    "deliver",
    "expand_segments",
    "expected_slice",
    "key_sources",
    "keys_of",
    "simulate",
    "step_records",
]

#: ``key = sample_id * KEY_STRIDE + position`` in :func:`keys_of` (positions stay below it).
KEY_STRIDE = 1 << 20


@dataclass(frozen=True, kw_only=True, eq=False)
class SimStep:
    """A simulated one-micro-batch step: the topology, the matrix, the planner's catalog and
    the step as a rank reads it (:meth:`StepView.plan_keys`)."""

    topology: Topology
    matrix: StepMatrix
    catalog: RunCatalog
    view: StepView


def simulate(
    teachers: Sequence[Mesh],
    student: Mesh,
    teacher_layouts: Sequence[Mapping[Any, TokenLayout]],
    student_layouts: Mapping[tuple[int, int], TokenLayout],
    *,
    per_rank_dests: bool = False,
    student_rank_layouts: Mapping[int, TokenLayout] | None = None,
    shard_sources: Sequence[bool] | None = None,
) -> SimStep:
    """Every rank's record for one micro-batch, gathered; ``student_rank_layouts`` (global rank ->
    layout) replaces the shard layouts when each student rank is its own destination.

    A teacher's layouts are keyed by ``(dp, cp)`` shard, or by global rank where each rank holds
    its own SP shard (``shard_sources[o]``: each of its last-stage ranks is a source of its own,
    by the bridge's rule, :meth:`Topology.build` and :func:`rank_roles`)."""
    topo, records = step_records(
        teachers,
        student,
        [(teacher_layouts, student_layouts, student_rank_layouts)],
        per_rank_dests=per_rank_dests,
        shard_sources=shard_sources,
    )
    matrix, _ = stack_records(records)
    view = read_step(topo, StepMatrix(matrix), 1)
    return SimStep(topology=topo, matrix=view.matrix, catalog=view.catalogs[0], view=view)


#: One micro-batch of :func:`step_records`: per teacher its layouts (by ``(dp, cp)`` shard or
#: by global rank), the student's by shard, and (per-rank destinations) by global rank.
MicroBatchLayouts = tuple[
    Sequence[Mapping[Any, TokenLayout]],
    Mapping[tuple[int, int], TokenLayout],
    Mapping[int, TokenLayout] | None,
]


def step_records(
    teachers: Sequence[Mesh],
    student: Mesh,
    micro_batches: Sequence[MicroBatchLayouts],
    *,
    per_rank_dests: bool = False,
    shard_sources: Sequence[bool] | None = None,
    agreements: Mapping[int, Sequence[Agreement]] | None = None,
) -> tuple[Topology, list[torch.Tensor]]:
    """The topology and every member's record (member order) of a step of
    ``len(micro_batches)`` micro-batches, built by the bridge's rule
    (:func:`mopd.bridge.offline.step_records`; bf16 teachers of hidden size 8);
    ``agreements``: global rank -> the agreements it gives."""
    shards = [False] * len(teachers) if shard_sources is None else list(shard_sources)
    specs = [
        TeacherSpec(mesh=m, hidden_size=8, dtype=torch.bfloat16, sp_shards=s)
        for m, s in zip(teachers, shards, strict=True)
    ]

    def teacher_of(o: int) -> Callable[[Any], list[TokenLayout]]:
        return lambda key: [mb[0][o][key] for mb in micro_batches]

    def student_of(key: Any) -> list[TokenLayout]:
        return [(mb[2] or {})[key] if per_rank_dests else mb[1][key] for mb in micro_batches]

    return offline_records(
        specs,
        student,
        n_slots=len(micro_batches),
        teacher_layouts=[teacher_of(o) for o in range(len(teachers))],
        student_layouts=student_of,
        config=BridgeConfig(keep_sp_shard=per_rank_dests),
        agreements=agreements,
    )


def expand_segments(segments_S5: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(src_rows, dst_rows)`` of every token of a segment table, in order."""
    length = segments_S5[:, 4]
    seg = np.repeat(np.arange(segments_S5.shape[0]), length)
    i = np.arange(int(length.sum())) - np.repeat(np.cumsum(length) - length, length)
    src = segments_S5[seg, 0] + i * segments_S5[seg, 1]
    dst = segments_S5[seg, 2] + i * segments_S5[seg, 3]
    return src, dst


def deliver(
    plans: Mapping[int, RankPlan],
    sources: Mapping[tuple[int, int], np.ndarray],
) -> dict[int, dict[int, np.ndarray]]:
    """Run every rank's plan with a mailbox: ``rank -> owner -> [slice_rows] int64 values``.

    ``sources[(rank, owner)]`` is the ``[R]`` int64 value of each row of that rank's buffer of
    that owner (e.g. the row's key). Every send must meet the receive of the same
    ``(owner, src, dst)`` with the same rows; rows no transfer writes stay ``-2``.
    """
    box: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}
    for r, plan in plans.items():
        for t in plan.sends:
            src, dst = expand_segments(t.segments_S5)
            key = (t.owner, r, t.dst_rank)
            assert key not in box, f"two sends for {key}"
            box[key] = (sources[(r, t.owner)][src], dst)
    out: dict[int, dict[int, np.ndarray]] = {}
    for r, plan in plans.items():
        if plan.dest is None:
            continue
        owners = {o for (_, o) in sources}
        dest = plan.dest
        n = {o: dest.slice_real(o) if dest.compact else dest.slice_rows for o in owners}
        bufs = {o: np.full(n[o], -2, dtype=np.int64) for o in owners}
        for t in plan.recvs:
            values, dst_sent = box.pop((t.owner, t.src_rank, r))
            _, dst = expand_segments(t.segments_S5)
            assert np.array_equal(dst, dst_sent), f"rows of {(t.owner, t.src_rank, r)} disagree"
            bufs[t.owner][dst] = values
        for t in plan.locals:
            src, dst = expand_segments(t.segments_S5)
            bufs[t.owner][dst] = sources[(r, t.owner)][src]
        out[r] = bufs
    assert not box, f"sends nobody receives: {sorted(box)}"
    return out


def keys_of(layout: TokenLayout) -> np.ndarray:
    """``[R]`` int64 key of each row (``sample_id * KEY_STRIDE + position``; ``-1`` padding)."""
    sample, position = layout.sample_id_R.numpy(), layout.position_R.numpy()
    return np.where(sample >= 0, sample * KEY_STRIDE + position, -1)


def key_sources(
    teachers: Sequence[Mesh],
    teacher_layouts: Sequence[Mapping[Any, TokenLayout]],
    members: Sequence[int],
) -> dict[tuple[int, int], np.ndarray]:
    """:func:`deliver`'s ``sources``: every rank's rows of every owner hold their keys (an empty
    buffer where the rank holds nothing of that owner). A teacher's layouts are keyed by
    ``(dp, cp)`` shard, or by global rank where each rank holds its own SP shard."""
    out: dict[tuple[int, int], np.ndarray] = {}
    for o, mesh in enumerate(teachers):
        for r in members:
            c = mesh.coord(r)
            if c is None or c.pp_rank != mesh.pp - 1:
                out[(r, o)] = np.zeros(0, dtype=np.int64)
            else:
                held = teacher_layouts[o]
                out[(r, o)] = keys_of(held[r] if r in held else held[(c.dp_rank, c.cp_rank)])
    return out


def expected_slice(plan: RankPlan, dest_layout: TokenLayout, owner: int) -> np.ndarray:
    """What :func:`deliver` must leave in ``owner``'s slice of ``plan``'s rank: the key of every
    row that owner fills (``plan.owner_N``), ``-2`` (untouched) elsewhere; in compact form
    (``plan.dest.compact``) the keys of the rows that owner fills, in row order, this rank's
    slice of them."""
    assert plan.dest is not None and plan.owner_N is not None
    if plan.dest.compact:
        mine = keys_of(dest_layout)[plan.owner_N == owner]
        assert mine.size == plan.dest.out_rows(owner)
        a = plan.dest.slice_start(owner)
        return mine[a : a + plan.dest.slice_real(owner)]
    a = plan.dest.row_offset
    b = a + plan.dest.slice_rows
    return np.where(plan.owner_N[a:b] == owner, keys_of(dest_layout)[a:b], -2)


def _contiguous_parts(ids: np.ndarray, n: int, rng: np.random.Generator) -> list[np.ndarray]:
    """``ids`` cut into ``n`` contiguous parts at random places (some may be empty)."""
    cuts = np.sort(rng.integers(0, ids.size + 1, size=n - 1))
    return np.split(ids, cuts)


def _side(
    mesh: Mesh,
    parts: Sequence[np.ndarray],
    lengths: Mapping[int, int],
    kind: str,
    pad_multiple: int,
) -> dict[tuple[int, int], TokenLayout]:
    mult = (2 * mesh.cp if mesh.cp > 1 else 1) * pad_multiple
    out: dict[tuple[int, int], TokenLayout] = {}
    for d in range(mesh.dp):
        ids = parts[d].tolist()
        lens = [lengths[i] for i in ids]
        for c in range(mesh.cp):
            if not ids:
                out[(d, c)] = concat_layouts([])
            elif kind == "thd":
                padded = [-(-n // mult) * mult for n in lens]
                cu = np.concatenate([[0], np.cumsum(padded)]).tolist()
                out[(d, c)] = packed_layout(
                    ids, lens, cu_seqlens_padded=cu, cp_size=mesh.cp, cp_rank=c
                )
            else:
                seq = -(-max(lens) // mult) * mult
                out[(d, c)] = padded_layout(
                    ids, seq, order=kind, lengths=lens, cp_size=mesh.cp, cp_rank=c
                )
    return out


def contiguous_step(
    teachers: Sequence[Mesh],
    student: Mesh,
    *,
    num_samples: int,
    max_len: int,
    kinds: Sequence[str],
    seed: int,
) -> tuple[list[dict[tuple[int, int], TokenLayout]], dict[tuple[int, int], TokenLayout]]:
    """``(teacher_layouts, student_layouts)`` of a step whose DP ranks (on both sides) hold
    contiguous ranges of sample ids, cut independently per side; samples are routed to teachers
    in contiguous runs. ``kinds``: one per teacher, then the student's (sbh, bsh, thd); one
    micro-batch per shard."""
    rng = np.random.default_rng(seed)
    ids = np.arange(num_samples, dtype=np.int64) * 2 + 1  # sparse ids
    lens = rng.integers(1, max_len + 1, size=num_samples)
    lengths = dict(zip(ids.tolist(), lens.tolist(), strict=True))
    route = np.sort(rng.integers(0, len(teachers), size=num_samples))
    t_out = []
    for o, mesh in enumerate(teachers):
        parts = _contiguous_parts(ids[route == o], mesh.dp, rng)
        t_out.append(_side(mesh, parts, lengths, kinds[o], 1))
    parts = _contiguous_parts(ids, student.dp, rng)
    return t_out, _side(student, parts, lengths, kinds[-1], student.tp)
