"""The teacher's LM head resharded into the student's vocab partition, sizes read off the models.

Why this file exists: :func:`mopd.bridge.lm_head.reshard_lm_head` needs the teacher's weight
shard, the real vocabulary and both padded vocabularies; a megatron-core job has them on its
GPTModels or HybridModels (wrapped, or as virtual-pipeline chunks). :func:`lm_head_from_models`
reads them there
and agrees them over the bridge group.

The vocabulary rule lives here too (:func:`resolve_vocab_size`): megatron-LM builds its models
with a padded vocabulary (``GPTModel(vocab_size=padded_vocab_size)``, a multiple of
``make_vocab_size_divisible_by * tp``), so a model's ``vocab_size`` attribute is its padded size,
and teacher and student with different parallelism pad differently. The real vocabulary is said
once by the caller (``vocab_size=``); without it the models' attribute is taken, and only where
every model agrees on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from mopd.bridge.groups import BridgeGroups
from mopd.bridge.lm_head import LMHeadShard, VocabSpec, reshard_lm_head
from mopd.bridge.mesh import Mesh
from mopd.capture.unwrap import find_output_layer, unwrap_model
from mopd.common import dist as cdist
from mopd.common.dist import DEFAULT_TIMEOUT_S

__all__ = [
    "MEGATRON_VOCAB_MULTIPLE",
    "VOCAB_ATTRIBUTE",
    "head_shard_problem",
    "lm_head_from_models",
    "looks_padded",
    "model_vocab_size",
    "resolve_vocab_size",
]

#: megatron-LM's default ``make_vocab_size_divisible_by``: it pads the tokenizer's vocabulary to
#: a multiple of this times the tensor-parallel size.
MEGATRON_VOCAB_MULTIPLE = 128

#: The attribute a model's vocabulary is read from (megatron's GPTModel and HybridModel).
VOCAB_ATTRIBUTE = "vocab_size"


def _inner(model: Any) -> Any:
    """The model under its wrappers (the last chunk of a virtual-pipeline list)."""
    return unwrap_model(model[-1] if isinstance(model, list | tuple) else model)


def model_vocab_size(model: Any) -> int:
    """A (wrapped) megatron model's ``vocab_size`` attribute: its padded vocabulary where the
    job padded it (megatron-LM does). ``ValueError`` if it has none."""
    inner = _inner(model)
    vocab = getattr(inner, VOCAB_ATTRIBUTE, None)
    if isinstance(vocab, bool) or not isinstance(vocab, int):
        raise ValueError(f"{type(inner).__name__} has no int {VOCAB_ATTRIBUTE} attribute")
    return vocab


def looks_padded(vocab_size: int, largest_token_id: int) -> bool:
    """Whether a vocabulary read off a model looks like megatron-LM's padding: a multiple of
    :data:`MEGATRON_VOCAB_MULTIPLE` while larger than any token id seen (``largest + 1``)."""
    return vocab_size % MEGATRON_VOCAB_MULTIPLE == 0 and largest_token_id + 1 < vocab_size


def resolve_vocab_size(
    vocab_size: int | None, model_sizes: Sequence[tuple[str, int]]
) -> tuple[int, bool]:
    """The real vocabulary: ``(V, given)``.

    Args:
        vocab_size: the caller's (the tokenizer's vocabulary), or ``None``.
        model_sizes: ``(what, size)`` per model: each model's ``vocab_size`` attribute (its
            padded vocabulary where the job padded it), e.g. ``("teacher 0", 1024)``.
    Returns:
        ``(vocab_size, True)`` when given (each model's size must be at least it), else the
        models' common size and ``False``.
    Raises:
        ValueError: a given size that is not a positive int or exceeds a model's; without one,
            models whose sizes differ (they were padded differently: only the caller knows the
            real vocabulary). The text depends on the arguments alone, so ranks that agree on
            them raise the same error.
    """
    listed = ", ".join(f"{what} {size}" for what, size in model_sizes)
    if vocab_size is not None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        small = [(what, size) for what, size in model_sizes if size < vocab_size]
        if small:
            raise ValueError(
                f"vocab_size={vocab_size} is larger than the vocabulary of "
                + ", ".join(f"{what} ({size})" for what, size in small)
                + f": every model must be built with at least the real vocabulary ({listed})"
            )
        return vocab_size, True
    sizes = {size for _, size in model_sizes}
    if len(sizes) > 1:
        raise ValueError(
            f"the models' {VOCAB_ATTRIBUTE} attributes differ ({listed}): they were built with "
            "vocabularies padded differently (megatron-LM pads to a multiple of "
            "make_vocab_size_divisible_by x tp), so the real vocabulary cannot be read off them; "
            f"pass vocab_size=<the tokenizer's vocabulary, at most {min(sizes)}>"
        )
    return sizes.pop(), False


def _head_of(model: Any) -> tuple[torch.Tensor, int, Any, torch.Tensor] | None:
    """``(output weight shard detached, vocab_size attribute, output layer, the weight as the
    model holds it)`` of a (wrapped) GPTModel or HybridModel on its last stage (both are
    megatron ``LanguageModule``s: ``output_layer``, ``vocab_size``)."""
    layer = find_output_layer(model)
    if layer is None:
        return None
    weight = getattr(layer, "weight", None)
    inner: Any = _inner(model)
    if weight is None:  # tied embeddings: the last stage's copy of the word embeddings
        weight = inner.shared_embedding_or_output_weight()
    return weight.detach(), model_vocab_size(model), layer, weight


def head_shard_problem(
    layer: Any, weight: torch.Tensor, *, vocab: int, tp: int, what: str
) -> str | None:
    """Why ``weight`` is not this rank's whole TP shard of a model's LM head (``None``: it is).

    Megatron's output layer holds ``vocab / tp`` rows per TP rank (``vocab``: the model's
    ``vocab_size`` attribute, its padded vocabulary). megatron-core's generalized tensor
    parallelism (GTP, 0.19+) can shard it further, over a ``gtp_remat`` group (the layer's
    ``gtp_remat_size``, a ``GTPShardedParam`` weight): each rank then holds a slice of its TP
    shard (padded), which the LM-head reshard would read as the whole shard, a partial head.
    Such a model is refused by name: a GTP marker on the layer or the weight, or fewer rows
    than the TP shard has. Local, never raises.
    """
    rows = int(weight.shape[0]) if weight.dim() == 2 else -1
    want = vocab // tp if tp > 0 and vocab % tp == 0 else -1
    remat = getattr(layer, "gtp_remat_size", None)
    marked = (
        (isinstance(remat, int) and not isinstance(remat, bool) and remat > 1)
        or "GTP" in type(weight).__name__
        or bool(getattr(weight, "is_gtp_weight_remat", False))
    )
    if not marked and (want < 0 or rows >= want):
        return None
    how = f"gtp_remat_size={remat}" if isinstance(remat, int) and remat > 1 else "GTP"
    return (
        f"{what}: its output_layer.weight holds {rows} rows ({tuple(weight.shape)}, a "
        f"{type(weight).__name__}) where its TP shard has {want} (vocab_size {vocab} / tp {tp}): "
        f"megatron-core's generalized tensor parallelism ({how}) shards the LM head below the "
        "TP shard, and the LM-head reshard reads whole TP shards (it would read a partial "
        "head); build this model's output layer without GTP (its "
        "tensor_parallel_num_weight_shards equal to its tensor_model_parallel_size)"
    )


def lm_head_from_models(
    teacher_model: Any | None,
    student_model: Any | None,
    *,
    teacher: Mesh,
    student: Mesh,
    groups: BridgeGroups,
    vocab_size: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    local_copy: bool = True,
) -> LMHeadShard | None:
    """:func:`reshard_lm_head` with every size read off the Megatron models.

    Collective over the bridge group. Each rank passes the teacher / student model it holds
    (``None`` where it holds none; either may be wrapped, or a list of virtual-pipeline chunks):
    the teacher's last stage contributes its ``output_layer`` weight shard, its ``vocab_size``
    attribute and padded vocabulary (shard rows x tp); the student's last stage its padded
    vocabulary and ``vocab_size`` attribute. The sizes are agreed over the group (one small
    all-reduce).

    Args:
        vocab_size: the real vocabulary (the tokenizer's); each model may be padded to its own
            size ``>=`` it, and rows and columns past it never count. ``None``: the models'
            ``vocab_size`` attribute, which must then be the same on both (see
            :func:`resolve_vocab_size`).
    Raises:
        ValueError: the same on every rank, for sizes that do not fit (see
            :func:`resolve_vocab_size`, :class:`~mopd.bridge.lm_head.VocabSpec`), and for a
            model whose output layer is sharded below its TP shard (megatron-core's GTP:
            :func:`head_shard_problem`), before any row moves.
    """
    rank = groups.rank
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
    problems = []
    for what, head, mesh in (("the teacher", t_head, teacher), ("the student", s_head, student)):
        if head is not None:
            found = head_shard_problem(head[2], head[3], vocab=head[1], tp=mesh.tp, what=what)
            if found is not None:
                problems.append(f"global rank {rank}: {found}")
    cdist.same_verdict(problems, group=meta, timeout_s=timeout_s, what="the LM head")
    # teacher vocab attribute, teacher padded, student padded, teacher H, student vocab attribute
    known = torch.full((5,), -1, dtype=torch.int64)
    if t_head is not None:
        known[0], known[1], known[3] = (
            t_head[1],
            t_head[0].shape[0] * teacher.tp,
            t_head[0].shape[1],
        )
    if s_head is not None:
        known[2], known[4] = s_head[0].shape[0] * student.tp, s_head[1]
    cdist.all_reduce(known, op=dist.ReduceOp.MAX, group=meta, timeout_s=timeout_s)
    t_vocab, t_padded, s_padded, hidden, s_vocab = (int(x) for x in known.tolist())
    if min(t_vocab, t_padded, s_padded, hidden, s_vocab) < 1:
        raise ValueError(
            "lm_head_from_models: no rank passed the teacher's last stage and the student's last "
            "stage models (vocab sizes unknown)"
        )
    real, _ = resolve_vocab_size(
        vocab_size,
        [("the teacher", t_vocab), ("the student", s_vocab)],
    )
    weight = t_head[0].contiguous() if t_head is not None else None
    return reshard_lm_head(
        weight,
        teacher=teacher,
        student=student,
        vocab=VocabSpec(vocab_size=real, teacher_padded=t_padded, student_padded=s_padded),
        hidden_size=hidden,
        groups=groups,
        timeout_s=timeout_s,
        local_copy=local_copy,
    )
