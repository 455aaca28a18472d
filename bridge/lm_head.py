"""Teacher LM-head reshard: the teacher's vocab-parallel output weight -> the student's vocab split.

Why this file exists: the student rebuilds teacher logits as ``h_teacher @ W_teacher_shard^T``
vocab-parallel over *its own* TP group, so each student TP rank needs the rows of the teacher's
``output_layer`` weight for its vocab partition. Teacher and student split (and pad) the
vocabulary differently. This is the token planner again, keyed by vocab row
(``sample 0, position = vocab row``):

- source groups: for each teacher TP rank ``t``, the replicas holding vocab shard ``t`` (every
  ``(dp, cp)`` rank of the teacher's last stage at ``tp_rank == t``), rows
  ``[t * Vt / tp_T, (t + 1) * Vt / tp_T)`` of the teacher's padded vocabulary; rows at or past
  the real vocabulary are padding;
- destination groups: every student last-stage rank on its own (each needs a different shard);
- rows past the real vocabulary come out zero; :attr:`LMHeadShard.valid_V` masks them.

Every rank knows every group from the sizes alone, so the only collectives are one small
all-gather of what each rank holds (sizes, dtype, its local problems) and, when something is
wrong, :func:`mopd.common.dist.same_verdict`. :func:`mopd.mcore.megatron_lm_head.lm_head_from_models`
reads the weight shard, the real vocabulary and both padded sizes off the Megatron models.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from mopd.bridge.catalog import DestGroup, RunCatalog, SourceGroup
from mopd.bridge.executor import Executor, Slot
from mopd.bridge.groups import BridgeGroups
from mopd.bridge.mesh import Mesh
from mopd.bridge.metadata import code_dtype, dtype_code
from mopd.bridge.plan import plan_rank
from mopd.common import dist as cdist
from mopd.common import ranges
from mopd.common.dist import DEFAULT_TIMEOUT_S, all_gather_flat

__all__ = ["LMHeadShard", "VocabSpec", "lm_head_catalog", "reshard_lm_head"]

_I64 = np.int64


@dataclass(frozen=True, kw_only=True)
class VocabSpec:
    """Vocabulary sizes: the real one and each side's padded (TP-divisible) one."""

    vocab_size: int
    teacher_padded: int
    student_padded: int

    def __post_init__(self) -> None:
        for name in ("vocab_size", "teacher_padded", "student_padded"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"VocabSpec.{name} must be an int, got {v!r}")
        if (
            self.vocab_size < 1
            or self.teacher_padded < self.vocab_size
            or self.student_padded < self.vocab_size
        ):
            raise ValueError(
                f"padded vocab sizes (teacher {self.teacher_padded}, student {self.student_padded}) "
                f"must be >= the vocab size {self.vocab_size} >= 1"
            )


@dataclass(frozen=True, kw_only=True, eq=False)
class LMHeadShard:
    """This student rank's share of a teacher's LM head (pass it to the loss as the teacher weight).

    Attributes:
        weight_VH: ``[Vs / tp_S, H_teacher]`` rows of the student's vocab partition, contiguous,
            the teacher weight's dtype, on the bridge's device.
        valid_V: ``[Vs / tp_S]`` bool on CPU, False for rows past the real vocabulary (zero rows).
        num_padding: count of such rows.
        vocab_start: the first vocab row of this partition.
        vocab_size: the real vocabulary.
    """

    weight_VH: torch.Tensor
    valid_V: torch.Tensor
    num_padding: int
    vocab_start: int
    vocab_size: int


def _vocab_runs(vocab_size: int, padded: int, tp: int, tp_rank: int) -> np.ndarray:
    """``[0 or 1, 5]`` run of the real vocab rows of shard ``tp_rank`` (sample 0)."""
    per = padded // tp
    lo = tp_rank * per
    n = max(0, min(per, vocab_size - lo))
    if n == 0:
        return np.empty((0, 5), dtype=_I64)
    return np.asarray([[0, lo, 0, 1, n]], dtype=_I64)


def lm_head_catalog(*, teacher: Mesh, student: Mesh, vocab: VocabSpec) -> RunCatalog:
    """The reshard's groups and runs (pure: meshes and sizes only)."""
    if vocab.teacher_padded % teacher.tp or vocab.student_padded % student.tp:
        raise ValueError(
            f"padded vocab sizes must divide the TP sizes: teacher {vocab.teacher_padded} / tp "
            f"{teacher.tp}, student {vocab.student_padded} / tp {student.tp}"
        )
    last = teacher.pp - 1
    sources, src_runs = [], []
    for t in range(teacher.tp):
        ranks = tuple(
            teacher.global_rank(tp_rank=t, cp_rank=c, dp_rank=d, pp_rank=last)
            for d, c in teacher.shards()
        )
        sources.append(
            SourceGroup(
                owner=0,
                ranks=ranks,
                num_rows=vocab.teacher_padded // teacher.tp,
                label=f"teacher vocab shard {t}",
            )
        )
        src_runs.append(_vocab_runs(vocab.vocab_size, vocab.teacher_padded, teacher.tp, t))
    dests, dst_runs = [], []
    for r in student.last_stage_ranks():
        c = student.coord(r)
        assert c is not None
        dests.append(
            DestGroup(
                ranks=(r,),
                num_rows=vocab.student_padded // student.tp,
                label=f"student rank {r} vocab shard {c.tp_rank}",
            )
        )
        dst_runs.append(_vocab_runs(vocab.vocab_size, vocab.student_padded, student.tp, c.tp_rank))

    def ranges_of(runs: list[np.ndarray]) -> np.ndarray:
        return np.asarray([[0, 0] if r.shape[0] else [1, 0] for r in runs], dtype=_I64)

    return RunCatalog(
        sources=tuple(sources),
        dests=tuple(dests),
        source_runs=lambda g: src_runs[g],
        dest_runs=lambda d: dst_runs[d],
        source_range_G2=ranges_of(src_runs),
        dest_range_D2=ranges_of(dst_runs),
    )


def reshard_lm_head(
    weight_VH: torch.Tensor | None,
    *,
    teacher: Mesh,
    student: Mesh,
    vocab: VocabSpec,
    hidden_size: int,
    groups: BridgeGroups,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    local_copy: bool = True,
) -> LMHeadShard | None:
    """Move the teacher's ``output_layer`` weight rows into the student's vocab partitions.

    Collective over the bridge group: every member calls it (run it once: the teacher is frozen).
    Bad input raises the same ``ValueError`` on every rank, before data moves.

    Args:
        weight_VH: on teacher last-stage ranks, this rank's ``[Vt / tp_T, H]`` shard of the
            teacher's ``output_layer`` weight (contiguous, on the bridge's device); ``None`` on
            other ranks.
        teacher, student: the meshes; vocab: the vocabulary sizes; hidden_size: the teacher's H.
        groups: this rank's bridge groups.
        timeout_s: deadline of each wait on other ranks.
        local_copy: serve colocated rows by a local copy.
    Returns:
        The :class:`LMHeadShard` on student last-stage ranks, ``None`` elsewhere.
    """
    rank = groups.rank
    device = cdist.group_device(groups.bridge)
    meta = groups.metadata_group
    problems: list[str] = []
    holds = teacher.is_last_stage(rank)
    tc = teacher.coord(rank)
    code = -1
    try:
        catalog = lm_head_catalog(teacher=teacher, student=student, vocab=vocab)
    except ValueError as exc:
        catalog = None
        problems.append(str(exc))
    if holds != (weight_VH is not None):
        problems.append(
            f"global rank {rank} {'must' if holds else 'must not'} pass the teacher's weight shard"
        )
    elif weight_VH is not None:
        assert tc is not None
        rows = vocab.teacher_padded // teacher.tp
        if not isinstance(weight_VH, torch.Tensor):
            problems.append(f"the teacher's weight shard is a {type(weight_VH).__name__}")
        elif (
            weight_VH.dim() != 2
            or tuple(weight_VH.shape) != (rows, hidden_size)
            or not weight_VH.is_contiguous()
        ):
            problems.append(
                f"global rank {rank}: teacher weight shard has shape {tuple(weight_VH.shape)}, "
                f"expected a contiguous [{rows}, {hidden_size}] ({vocab.teacher_padded} padded "
                f"rows / tp {teacher.tp})"
            )
        elif weight_VH.device != device:
            problems.append(
                f"global rank {rank}: teacher weight shard is on {weight_VH.device}, the bridge "
                f"moves tensors on {device}"
            )
        else:
            code = dtype_code(weight_VH.dtype)
            if code < 0:
                problems.append(f"global rank {rank}: unsupported dtype {weight_VH.dtype}")
    # what everyone needs to know: the weight's dtype (students allocate with it)
    codes = torch.full((len(groups.members),), -1, dtype=torch.int64)
    mine = torch.tensor([code], dtype=torch.int64)
    all_gather_flat(codes, mine, group=meta, timeout_s=timeout_s)
    held = sorted({int(c) for c in codes.tolist() if c >= 0})
    if len(held) > 1 and code >= 0 and code != held[0]:
        problems.append(
            f"global rank {rank}: teacher weight dtype {code_dtype(code)} differs from "
            f"{code_dtype(held[0])} on another teacher rank"
        )
    cdist.same_verdict(problems, group=meta, timeout_s=timeout_s, what="LM-head reshard")
    assert catalog is not None
    if not held:
        raise ValueError("LM-head reshard rejected: no rank passed a teacher weight shard")
    dtype = code_dtype(held[0])
    assert dtype is not None
    with ranges.span("reshard"):
        plan = plan_rank(catalog, rank, local_copy=local_copy)
        ex = Executor(rank=rank, timeout_s=timeout_s)
        sched = None
        if plan.busy:
            nominal = catalog.dests[plan.dest.group].slice_rows if plan.dest is not None else 0
            sched = ex.schedule(
                plan,
                slice_rows=nominal,
                num_owners=1,
                row_bytes=[hidden_size * dtype.itemsize],
            )
        slot = Slot(index=0, schedule=sched)
        sources = {0: weight_VH} if weight_VH is not None else {}
        deadline = time.monotonic() + timeout_s
        specs = {0: (hidden_size, dtype)}
        need = bool(sched is not None and (sched.sends or sched.locals))
        if need:
            ex.take(slot, sources, output_specs=specs, device=device)
        ex.post(slot, output_specs=specs, device=device, group=groups.bridge)
        ex.complete(slot, tp_group=None, deadline=deadline)
        ex.release(slot, deadline=deadline)
    if plan.dest is None:
        return None
    sc = student.coord(rank)
    assert sc is not None
    out = slot.outputs[0][: plan.dest.num_rows]
    start = sc.tp_rank * out.shape[0]
    valid = torch.arange(start, start + out.shape[0]) < vocab.vocab_size
    return LMHeadShard(
        weight_VH=out,
        valid_V=valid,
        num_padding=int((~valid).sum()),
        vocab_start=start,
        vocab_size=vocab.vocab_size,
    )
