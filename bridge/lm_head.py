"""Teacher LM-head reshard: the teacher's vocab-parallel output weight -> the student's vocab split.

Why this file exists: the student rebuilds teacher logits as ``h_teacher @ W_teacher_shard^T``
vocab-parallel over *its own* TP group, so each student TP rank needs the rows of the teacher's
``output_layer`` weight for its vocab partition. Teacher and student split (and pad) the
vocabulary differently. This is the token planner again, keyed by vocab row:

- source groups: for each teacher TP rank ``t``, the replicas holding vocab shard ``t`` (every
  ``(dp, cp)`` rank of the teacher's last stage at ``tp_rank == t``); rows
  ``[t * Vt / tp_T, (t + 1) * Vt / tp_T)`` of the teacher's padded vocabulary ``Vt``; rows
  at or past the real vocabulary are padding;
- destination groups: every student last-stage rank on its own (no all-gather: each needs a
  different vocab shard, ``[s * Vs / tp_S, (s + 1) * Vs / tp_S)`` of the student's padded ``Vs``);
- rows past the real vocabulary come out zero; :attr:`LMHeadShard.valid_V` masks them.

The reshard runs once per teacher (the teacher is frozen), through the same executor.
"""

from __future__ import annotations

import datetime
import hashlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mopd.bridge.executor import Executor
from mopd.bridge.groups import BridgeGroups, group_moves_cuda
from mopd.bridge.layout import vocab_layout
from mopd.bridge.mesh import Mesh
from mopd.bridge.metadata import encode_record, gather_records
from mopd.bridge.planner import DestGroup, SourceGroup, TransferPlan, plan_transfers

__all__ = ["LMHeadShard", "VocabSpec", "plan_lm_head", "reshard_lm_head"]


@dataclass(frozen=True, kw_only=True)
class VocabSpec:
    """Vocabulary sizes: the real one and each side's padded (divisible) one."""

    vocab_size: int
    teacher_padded: int
    student_padded: int

    def __post_init__(self) -> None:
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
    """This student rank's share of a teacher's LM head.

    Attributes:
        weight_VH: ``[Vs / tp_S, H_teacher]`` rows of the student's vocab partition, contiguous,
            the teacher weight's dtype, on the bridge's device (the current CUDA device for an
            NCCL bridge group, CPU for gloo).
        valid_V: ``[Vs / tp_S]`` bool, **on CPU** (built from sizes only, no device work), False
            for rows past the real vocabulary (zero rows); move it to ``weight_VH.device`` to
            mask on the GPU.
        num_padding: count of such rows.
        vocab_start: the first vocab row of this partition.
    """

    weight_VH: torch.Tensor
    valid_V: torch.Tensor
    num_padding: int
    vocab_start: int


def plan_lm_head(
    *,
    teacher: Mesh,
    student: Mesh,
    vocab: VocabSpec,
    hidden_size: int,
    itemsize: int = 2,
    local_copy: bool = True,
) -> TransferPlan:
    """Plan the reshard (pure: meshes and sizes only)."""
    if vocab.teacher_padded % teacher.tp or vocab.student_padded % student.tp:
        raise ValueError(
            f"padded vocab sizes must divide the TP sizes: teacher {vocab.teacher_padded} / tp {teacher.tp}, "
            f"student {vocab.student_padded} / tp {student.tp}"
        )
    last = teacher.pp - 1
    sources = []
    for t in range(teacher.tp):
        lay = vocab_layout(vocab.vocab_size, vocab.teacher_padded, teacher.tp, t)
        ranks = tuple(
            teacher.global_rank(tp_rank=t, cp_rank=c, dp_rank=d, pp_rank=last)
            for d, c in teacher.shards()
        )
        sources.append(
            SourceGroup(
                owner=0, ranks=ranks, key_R=lay.position_R, label=f"teacher vocab shard {t}"
            )
        )
    dests = []
    for r in student.last_stage_ranks():
        c = student.coord(r)
        assert c is not None
        lay = vocab_layout(vocab.vocab_size, vocab.student_padded, student.tp, c.tp_rank)
        dests.append(
            DestGroup(
                ranks=(r,), key_R=lay.position_R, label=f"student rank {r} vocab shard {c.tp_rank}"
            )
        )
    return plan_transfers(
        sources,
        dests,
        num_owners=1,
        row_bytes=[hidden_size * itemsize],
        local_copy=local_copy,
        describe_key=lambda k: f"vocab row {k}",
    )


def reshard_lm_head(
    weight_VH: torch.Tensor | None,
    *,
    teacher: Mesh,
    student: Mesh,
    vocab: VocabSpec,
    hidden_size: int,
    groups: BridgeGroups,
    timeout_s: float = 300.0,
    rank: int | None = None,
    local_copy: bool = True,
) -> LMHeadShard | None:
    """Move the teacher's ``output_layer`` weight rows into the student's vocab partitions.

    Collective over the bridge group: every member calls it. Bad input raises the same
    ``ValueError`` on every rank (gathered, before data moves).

    Args:
        weight_VH: on teacher last-stage ranks, this rank's ``[Vt / tp_T, H]`` shard of the
            teacher's ``output_layer`` weight (contiguous, on the bridge's device: the current
            CUDA device for an NCCL bridge group, CPU for gloo); ``None`` on other ranks.
        teacher, student: the meshes; vocab: the vocabulary sizes; hidden_size: the teacher's H.
        groups: this rank's bridge groups (the metadata goes over ``groups.meta`` when set).
        timeout_s: host-side deadline of the metadata all-gather and, on gloo, of the transfer.
        rank: this process's global rank (default ``dist.get_rank()``).
        local_copy: serve colocated rows by a local copy.
    Returns:
        The :class:`LMHeadShard` on student last-stage ranks, ``None`` elsewhere. On CUDA the
        rows are ready in stream order (the wait does not block the host).
    """
    rank = dist.get_rank() if rank is None else rank
    timeout = datetime.timedelta(seconds=timeout_s)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if group_moves_cuda(groups.bridge)
        else torch.device("cpu")
    )
    meta_group = groups.meta if groups.meta is not None else groups.bridge
    meta_device = (
        torch.device("cuda", torch.cuda.current_device())
        if group_moves_cuda(meta_group)
        else torch.device("cpu")
    )
    error = ""
    src: list[Any] = [None]
    tc = teacher.coord(rank)
    holds = teacher.is_last_stage(rank)
    try:
        if holds != (weight_VH is not None):
            raise ValueError(
                f"this rank {'must' if holds else 'must not'} pass the teacher's weight shard"
            )
        if weight_VH is not None:
            if not isinstance(weight_VH, torch.Tensor):
                raise ValueError(
                    f"the teacher's weight shard must be a torch.Tensor, got {type(weight_VH).__name__}"
                )
            assert tc is not None
            lay = vocab_layout(vocab.vocab_size, vocab.teacher_padded, teacher.tp, tc.tp_rank)
            if (
                weight_VH.dim() != 2
                or weight_VH.shape[0] != lay.num_rows
                or not weight_VH.is_contiguous()
            ):
                raise ValueError(
                    f"teacher weight shard has shape {tuple(weight_VH.shape)}, expected a contiguous "
                    f"[{lay.num_rows}, H] ({vocab.teacher_padded} padded rows / tp {teacher.tp})"
                )
            src[0] = (lay, weight_VH.shape[1], weight_VH.dtype, weight_VH.device)
    except ValueError as exc:
        error = f"global rank {rank}: {exc}"
    sig_text = repr(
        (teacher.as_ints(), student.as_ints(), vocab, hidden_size, local_copy, groups.members)
    )
    sig = int.from_bytes(hashlib.blake2b(sig_text.encode(), digest_size=7).digest(), "little")
    try:
        record = encode_record(
            config_sig=sig, error=error, sources=src, student=None, outputs=[None]
        )
    except ValueError as exc:
        error = error or f"global rank {rank}: {exc}"
        record = encode_record(
            config_sig=sig, error=error, sources=[None], student=None, outputs=[None]
        )
    records = gather_records(
        record, group=meta_group, members=groups.members, device=meta_device, timeout=timeout
    )
    if len({r.config_sig for r in records}) > 1:
        raise ValueError(
            "ranks called reshard_lm_head with different meshes, vocab sizes or hidden sizes"
        )
    bad = [r for r in records if r.error]
    if bad:
        raise ValueError(
            f"LM-head reshard rejected on global rank(s) {[r.rank for r in bad]}: "
            + "; ".join(r.error for r in bad)
        )
    dtypes = set()
    for r in records:
        s = r.sources[0]
        if s is None:
            continue
        if s.hidden != hidden_size:
            raise ValueError(
                f"teacher weight on global rank {r.rank} has hidden size {s.hidden}, expected {hidden_size}"
            )
        if s.device != device.type:
            raise ValueError(
                f"teacher weight on global rank {r.rank} is on {s.device}, the bridge group moves {device.type}"
            )
        dtypes.add(s.dtype)
    if len(dtypes) != 1 or None in dtypes:
        raise ValueError(
            f"teacher weight shards have dtypes {sorted(map(str, dtypes))}; need one supported dtype"
        )
    dtype = dtypes.pop()
    assert dtype is not None
    itemsize = dtype.itemsize
    plan = plan_lm_head(
        teacher=teacher,
        student=student,
        vocab=vocab,
        hidden_size=hidden_size,
        itemsize=itemsize,
        local_copy=local_copy,
    )
    out = None
    outputs: dict[int, torch.Tensor] = {}
    sc = student.coord(rank)
    if student.is_last_stage(rank):
        assert sc is not None
        rows = vocab.student_padded // student.tp
        out = torch.empty((rows, hidden_size), dtype=dtype, device=device)
        outputs[0] = out
    sources = {0: weight_VH} if weight_VH is not None else {}
    Executor(rank=rank, timeout=timeout).start(
        plan, sources=sources, outputs=outputs, group=groups.bridge, meta_group=groups.meta
    ).wait()
    if out is None:
        return None
    assert sc is not None
    rows = out.shape[0]
    start = sc.tp_rank * rows
    valid = torch.arange(start, start + rows) < vocab.vocab_size
    return LMHeadShard(
        weight_VH=out, valid_V=valid, num_padding=int((~valid).sum()), vocab_start=start
    )
