"""The teacher's LM head resharded into the student's vocab partition, sizes read off the models.

Why this file exists: :func:`mopd.bridge.lm_head.reshard_lm_head` needs the teacher's weight
shard, the real vocabulary and both padded vocabularies; a megatron-core job has them on its
GPTModels or HybridModels (wrapped, or as virtual-pipeline chunks). :func:`lm_head_from_models` reads them there
and agrees them over the bridge group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mopd.bridge.groups import BridgeGroups
from mopd.bridge.lm_head import LMHeadShard, VocabSpec, reshard_lm_head
from mopd.bridge.mesh import Mesh
from mopd.capture.unwrap import find_output_layer, unwrap_model
from mopd.common import dist as cdist

__all__ = ["lm_head_from_models"]


def _head_of(model: Any) -> tuple[torch.Tensor, int] | None:
    """``(output weight shard, real vocab size)`` of a (wrapped) GPTModel or HybridModel on its
    last stage (both are megatron ``LanguageModule``s: ``output_layer``, ``vocab_size``)."""
    layer = find_output_layer(model)
    if layer is None:
        return None
    weight = getattr(layer, "weight", None)
    inner: Any = unwrap_model(model[-1] if isinstance(model, list | tuple) else model)
    if weight is None:  # tied embeddings: the last stage's copy of the word embeddings
        weight = inner.shared_embedding_or_output_weight()
    vocab = getattr(inner, "vocab_size", None)
    if not isinstance(vocab, int):
        raise ValueError(f"{type(inner).__name__} has no int vocab_size attribute")
    return weight.detach(), vocab


def lm_head_from_models(
    teacher_model: Any | None,
    student_model: Any | None,
    *,
    teacher: Mesh,
    student: Mesh,
    groups: BridgeGroups,
    timeout_s: float = 300.0,
    local_copy: bool = True,
) -> LMHeadShard | None:
    """:func:`reshard_lm_head` with every size read off the Megatron models.

    Collective over the bridge group. Each rank passes the teacher / student model it holds
    (``None`` where it holds none; either may be wrapped, or a list of virtual-pipeline chunks):
    the teacher's last stage contributes its ``output_layer`` weight shard, its ``vocab_size``
    and padded vocabulary (shard rows x tp); the student's last stage its padded vocabulary. The
    sizes are agreed over the group (one small all-reduce).
    """
    rank = dist.get_rank()
    meta = groups.metadata_group
    t_head = (
        _head_of(teacher_model)
        if teacher_model is not None and teacher.is_last_stage(rank)
        else None
    )
    s_head = (
        _head_of(student_model)
        if student_model is not None and student.is_last_stage(rank)
        else None
    )
    known = torch.full((4,), -1, dtype=torch.int64)  # vocab, teacher padded, student padded, H
    if t_head is not None:
        known[0], known[1], known[3] = (
            t_head[1],
            t_head[0].shape[0] * teacher.tp,
            t_head[0].shape[1],
        )
    if s_head is not None:
        known[2] = s_head[0].shape[0] * student.tp
        known[0] = max(int(known[0]), s_head[1])
    cdist.all_reduce(known, op=dist.ReduceOp.MAX, group=meta, timeout_s=timeout_s)
    vocab_size, t_padded, s_padded, hidden = (int(x) for x in known.tolist())
    if min(vocab_size, t_padded, s_padded, hidden) < 1:
        raise ValueError(
            "lm_head_from_models: no rank passed the teacher's last stage and the student's last "
            "stage models (vocab sizes unknown)"
        )
    weight = t_head[0].contiguous() if t_head is not None else None
    return reshard_lm_head(
        weight,
        teacher=teacher,
        student=student,
        vocab=VocabSpec(vocab_size=vocab_size, teacher_padded=t_padded, student_padded=s_padded),
        hidden_size=hidden,
        groups=groups,
        timeout_s=timeout_s,
        local_copy=local_copy,
    )
