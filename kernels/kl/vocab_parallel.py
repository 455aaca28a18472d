"""The student-side full-vocabulary KL, vocab-parallel over the student's TP group and chunked.

Why this file exists: MOPD trains the student on the exact per-token KL to a frozen teacher over
the whole vocabulary. The student holds a vocab shard ``[V_local]`` of its logits (what Megatron's
``output_layer`` returns) and the same vocab shard of each teacher's LM head; the teacher's logits
shard is rebuilt from the bridged hidden states. This module holds the two entry points (logits;
fused hidden states + LM head); the work is split by concern:

- :mod:`~mopd.kernels.kl.config`: :class:`KLConfig` and the chunk size its budget implies;
- :mod:`~mopd.kernels.kl.prepare`: validation (local, before any collective) and the job;
- :mod:`~mopd.kernels.kl.loop`: the chunk loop and the autograd function;
- :mod:`~mopd.kernels.kl.matmul`: fp32 logits and gradients from bf16 operands;
- :mod:`~mopd.kernels.kl.rowwise` (CuPy kernels on CUDA, a torch twin elsewhere): the two
  row-wise passes; :mod:`~mopd.kernels.kl.agreement`: the debug agreement check.

How: tokens are processed in chunks of ``C`` rows (``C`` from a memory budget), so extra memory is
``O(C x V_local)`` plus the gradients; a ``[T, V]`` fp32 tensor never exists. Per chunk the
softmax statistics need exactly two all-reduces over the TP group: one MAX (both row maxima) and
one SUM (both partition sums and the two cross terms, rescaled to the maxima). The gradient is
computed in the forward pass (Liger-Kernel style) when a backward can follow, so backward only
scales it; autograd keeps only the gradients, not the inputs. With ``reduction="none"`` the
upstream gradient is per token and backward recomputes instead, from tensors saved with
``save_for_backward`` (an in-place change to them in between raises).

The math, per token, with ``s``/``u`` the student/teacher logits, ``d = s - u``,
``Z_S = sum exp(s - m_S)``, ``A = sum exp(s - m_S) d``, ``B = sum exp(u - m_T) d``:

- reverse ``KL(p_S || p_T) = A / Z_S - (lse_S - lse_T)``, gradient ``p_S (d - A / Z_S)``;
- forward ``KL(p_T || p_S) = (lse_S - lse_T) - B / Z_T``, gradient ``p_S - p_T``;
- mixed ``w * reverse + (1 - w) * forward``;

with ``lse_S - lse_T = (m_S - m_T) + (log Z_S - log Z_T)``, never the difference of two large
log-sum-exps. Padded vocab rows (global ids ``>= vocab_size``) are excluded on both sides. Masked
tokens (weight 0) are skipped entirely. With several teachers, tokens are processed grouped by
teacher so each teacher's LM-head matmul runs on contiguous rows.

Precision (as accurate as the inputs allow): the teacher logits are formed in at least fp32 from
the teacher's hidden states and LM head, with fp32 accumulation and fp32 output (on CUDA cuBLAS's
``out_dtype``; elsewhere converted operand blocks; never an fp32 copy of a whole weight), and so
are the fused path's student logits; the logits path takes the caller's logits as they are.
Softmax statistics, the loss and the per-token coefficients are fp32. The logits gradient is
computed in fp32 and rounded to the student's dtype once; the fused path accumulates the
hidden-state gradient in fp32 (summed over the TP group in fp32) and the weight gradient as
``KLConfig.weight_grad_accumulation`` says, and rounds each once. The gradients are stored in the
inputs' dtypes at the end of the forward: an upstream gradient other than a power of two (1 is
the usual) rescales them in backward, in fp32, with one more rounding.

Cross-rank contract: every rank of the TP group passes the same ``T``, mask and teacher index
(they shard the vocabulary, not the tokens). Validation is local and raises before any collective.
An error specific to one rank (its ``vocab_start``, its shard size) then raises on that rank only,
and with ``debug`` off the other ranks hang in the first all-reduce until ``KLConfig.timeout_s``
(gloo) or the NCCL watchdog. ``KLConfig(debug=True)`` adds finiteness checks and one agreement
all-reduce that catches ranks passing different tokens and carries any rank's validation failure
(its message and rank), so every rank raises the same ValueError. The chunk size is derived from the
config, ``V_local``, the dtypes and the backend, so it agrees across ranks that agree on those.
Host syncs: none on the plain path (no mask, one teacher); a mask or a teacher index costs a few.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from mopd.common.log import warn_once
from mopd.kernels.kl.agreement import (
    check_agreement,
    collective_device,
    group_position,
    job_signature,
)
from mopd.kernels.kl.config import (
    KLConfig,
    KLKind,
    KLReduction,
    WeightGradAccumulation,
    choose_chunk_tokens,
)
from mopd.kernels.kl.loop import KLFunction
from mopd.kernels.kl.prepare import KLArgs, prepare

__all__ = [
    "KLConfig",
    "KLKind",
    "KLReduction",
    "WeightGradAccumulation",
    "choose_chunk_tokens",
    "fused_vocab_parallel_kl",
    "vocab_parallel_kl",
]


def _call(args: KLArgs) -> torch.Tensor:
    """Both entry points: validate, check agreement in debug mode, run the autograd function."""
    config, group = args.config, args.group
    debug = isinstance(config, KLConfig) and config.debug
    position = group_position(group) if debug else None
    try:
        job = prepare(args)
    except ValueError as exc:
        if position is None or position[0] == 1:
            raise
        # debug: the other ranks are about to enter the agreement all-reduce; join it with the
        # failure so that every rank raises the same error instead of waiting for this one
        assert group is not None
        device = collective_device(args.student_TX, group)
        check_agreement(group, position, device, config.timeout_s, failure=exc)
        raise AssertionError("the agreement check returned after a failure") from exc
    if debug and position is not None and position[0] > 1:
        assert group is not None
        check_agreement(
            group,
            position,
            job.weight_N.device,
            config.timeout_s,
            signature=job_signature(job, args.loss_mask_T, args.teacher_index_T),
            nonfinite=job.nonfinite,
        )
    # precompute gradients in the forward only when a backward can follow
    x_TX, weight_VH = args.student_TX, args.student_weight_VH
    want_grad = torch.is_grad_enabled() and (
        x_TX.requires_grad or (weight_VH is not None and weight_VH.requires_grad)
    )
    return KLFunction.apply(job, want_grad, x_TX, weight_VH)


#: The teachers' LM-head shards: one tensor, a sequence of them, or of resharded shards (objects
#: with ``weight_VH``, ``vocab_start`` and ``vocab_size``, as ``mopd.bridge.lm_head.LMHeadShard``).
TeacherWeights = Any


def _heads(
    teacher_weight: TeacherWeights, vocab_start: int | None, vocab_size: int | None
) -> tuple[torch.Tensor | list[torch.Tensor], int, int]:
    """``(weights, vocab_start, vocab_size)``: tensors out of resharded shards, the vocab range
    from them when not given (and checked against them when given)."""
    items = [teacher_weight] if not isinstance(teacher_weight, Sequence) else list(teacher_weight)
    shards = [w for w in items if hasattr(w, "weight_VH")]
    if not shards:
        if vocab_start is None or vocab_size is None:
            raise ValueError(
                "vocab_start and vocab_size are needed with plain weight tensors (resharded "
                "LMHeadShard objects carry them)"
            )
        return teacher_weight, vocab_start, vocab_size
    if len(shards) != len(items):
        raise ValueError("teacher_weight mixes LMHeadShard objects and plain tensors")
    starts = {int(w.vocab_start) for w in shards}
    sizes = {int(w.vocab_size) for w in shards}
    if len(starts) != 1 or len(sizes) != 1:
        raise ValueError(
            f"the teachers' LM-head shards cover different vocab ranges: starts {sorted(starts)}, "
            f"vocab sizes {sorted(sizes)}"
        )
    start, size = starts.pop(), sizes.pop()
    for name, given, have in (
        ("vocab_start", vocab_start, start),
        ("vocab_size", vocab_size, size),
    ):
        if given is not None and given != have:
            raise ValueError(f"{name}={given} but the LM-head shards say {have}")
    weights = [w.weight_VH for w in shards]
    return (weights[0] if not isinstance(teacher_weight, Sequence) else weights), start, size


def vocab_parallel_kl(
    student_logits_TV: torch.Tensor,
    teacher_hidden: torch.Tensor | Sequence[torch.Tensor],
    teacher_weight: TeacherWeights,
    *,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    loss_mask_T: torch.Tensor | None = None,
    teacher_index_T: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    config: KLConfig | None = None,
) -> torch.Tensor:
    """Full-vocabulary KL from the student's logits shard; differentiable into those logits.

    Args:
        student_logits_TV: ``[T, V_local]`` this rank's vocab shard of the student logits
            (Megatron's ``output_layer`` output flattened to tokens), columns contiguous.
        teacher_hidden: the bridged teacher hidden states, one tensor per teacher: ``[T, H_k]``
            (row t is token t) or ``[T_k, H_k]`` (only the tokens with ``teacher_index == k``,
            in token order; or only those of them the mask counts, ``loss_mask_T != 0``: the
            rows :meth:`mopd.bridge.BridgeStep.receive` delivers). Told apart by the row count
            (where two counts are equal the forms hold the same rows). No gradient flows to them.
        teacher_weight: one ``[V_local, H_k]`` LM-head shard per teacher, the same vocab range
            as the student's shard, or the resharded shards themselves
            (:class:`~mopd.bridge.lm_head.LMHeadShard`, which carry ``vocab_start`` and
            ``vocab_size``). No gradient flows to them.
        vocab_start: first global vocab id of this rank's shard (``rank_in_group * V_local``);
            taken from the shards when they are ``LMHeadShard``s.
        vocab_size: the real vocabulary; ids ``>= vocab_size`` are padding, excluded on both
            sides; taken from the shards when they are ``LMHeadShard``s.
        loss_mask_T: ``[T]`` bool or float weights (``None``: all tokens, weight 1).
        teacher_index_T: ``[T]`` int64/int32 teacher of each token (required with > 1 teacher).
        group: the student's TP group (``None``: no TP, this rank holds the whole vocabulary).
        config: :class:`KLConfig` (``None``: the defaults, reverse KL summed over tokens).
    Returns:
        fp32 scalar (``sum``/``mean``) or ``[T]`` fp32 ``mask * KL`` (``none``), identical on
        every rank of the group.
    Raises:
        ValueError: inconsistent shapes, dtypes, devices, vocab range or group size, before
            any collective. Such an error can be specific to one rank (its ``vocab_start``, its
            shard size); with ``config.debug`` off only that rank raises and the others block in
            the first chunk's all-reduce until ``KLConfig.timeout_s`` (gloo) or the NCCL
            watchdog ends them. With ``config.debug`` on, the failure joins the agreement
            all-reduce and every rank of the group raises the same ValueError.

    ``config.sum_hidden_grad_over_tp`` and ``config.weight_grad_accumulation`` have no meaning
    here (there are no hidden states, no weight): ``False`` for the one, anything but
    ``"auto"`` for the other, warns once per process.
    """
    config = config or KLConfig()
    if isinstance(config, KLConfig) and not config.sum_hidden_grad_over_tp:
        warn_once(
            "KLConfig.sum_hidden_grad_over_tp=False is ignored by vocab_parallel_kl (it applies "
            "to fused_vocab_parallel_kl's hidden-state gradient only)"
        )
    if isinstance(config, KLConfig) and config.weight_grad_accumulation != "auto":
        warn_once(
            f"KLConfig.weight_grad_accumulation={config.weight_grad_accumulation!r} is ignored by "
            "vocab_parallel_kl (it applies to fused_vocab_parallel_kl's weight gradient only)"
        )
    teacher_weight, vocab_start, vocab_size = _heads(teacher_weight, vocab_start, vocab_size)
    return _call(
        KLArgs(
            student_TX=student_logits_TV,
            student_weight_VH=None,
            teacher_hidden=teacher_hidden,
            teacher_weight=teacher_weight,
            vocab_start=vocab_start,
            vocab_size=vocab_size,
            loss_mask_T=loss_mask_T,
            teacher_index_T=teacher_index_T,
            group=group,
            config=config,
        )
    )


def fused_vocab_parallel_kl(
    student_hidden_TH: torch.Tensor,
    student_weight_VH: torch.Tensor,
    teacher_hidden: torch.Tensor | Sequence[torch.Tensor],
    teacher_weight: TeacherWeights,
    *,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    loss_mask_T: torch.Tensor | None = None,
    teacher_index_T: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    config: KLConfig | None = None,
) -> torch.Tensor:
    """The same loss from the student's hidden states and output-weight shard (fused LM head).

    The student logits are never materialized beyond one ``[C, V_local]`` chunk.

    Args:
        student_hidden_TH: ``[T, H_s]`` student hidden states (TP-replicated, before the LM head).
        student_weight_VH: ``[V_local, H_s]`` this rank's shard of the student's output weight,
            same dtype as ``student_hidden_TH``.
        Other arguments: as :func:`vocab_parallel_kl`.
    Returns:
        As :func:`vocab_parallel_kl`. Gradients flow to ``student_hidden_TH`` (accumulated in
        fp32 and summed over the TP group unless ``config.sum_hidden_grad_over_tp`` is off) and
        ``student_weight_VH`` (summed over chunks as ``config.weight_grad_accumulation`` says),
        each rounded to its input's dtype once.
    """
    if not isinstance(student_weight_VH, torch.Tensor):
        raise ValueError(
            f"student_weight_VH must be a torch.Tensor, got {type(student_weight_VH).__name__}"
        )
    teacher_weight, vocab_start, vocab_size = _heads(teacher_weight, vocab_start, vocab_size)
    return _call(
        KLArgs(
            student_TX=student_hidden_TH,
            student_weight_VH=student_weight_VH,
            teacher_hidden=teacher_hidden,
            teacher_weight=teacher_weight,
            vocab_start=vocab_start,
            vocab_size=vocab_size,
            loss_mask_T=loss_mask_T,
            teacher_index_T=teacher_index_T,
            group=group,
            config=config or KLConfig(),
        )
    )
