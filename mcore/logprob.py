"""The student's log-probability of given tokens from its vocab-parallel logits, and its
cross-entropy.

Why this file exists: the loss terms a job puts beside the teachers' KL (a policy-gradient term,
an SFT cross-entropy) need ``log p_S(y_t)`` of a token per row, and under tensor parallelism each
rank holds a slice of the vocabulary. megatron's ``vocab_parallel_cross_entropy`` (and
``GPTModel(labels=...)``) reduces over its global TP group, not over the student's own group
when the models live on their own meshes (:func:`mopd.mcore.megatron_groups.megatron_process_groups`):
with megatron's globals at TP 1 and a student on its own TP2 groups it treats each rank's slice
as the whole vocabulary. :func:`token_logprobs` and :func:`cross_entropy` take the group and the
real vocabulary explicitly. Three all-reduces over the group (max, sum of exponentials, target
logit); the gradient is ``onehot(y) - softmax`` on this rank's slice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mopd.common import dist as cdist
from mopd.common.dist import DEFAULT_TIMEOUT_S

__all__ = ["cross_entropy", "token_logprobs"]


def _all_reduce(
    x: torch.Tensor,
    group: dist.ProcessGroup | None,
    timeout_s: float | None,
    op: cdist.ReduceOpLike = dist.ReduceOp.SUM,
) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        cdist.all_reduce(x, op=op, group=group, timeout_s=timeout_s)


class _TokenLogprob(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits_TV: torch.Tensor,
        labels_T: torch.Tensor,
        vocab_start: int,
        valid_V: torch.Tensor | None,
        group: dist.ProcessGroup | None,
        timeout_s: float | None,
    ) -> torch.Tensor:
        x_TV = logits_TV.float()
        if valid_V is not None:
            x_TV = x_TV.masked_fill(~valid_V, float("-inf"))
        max_T = x_TV.max(dim=-1).values
        _all_reduce(max_T, group, timeout_s, dist.ReduceOp.MAX)
        exp_TV = torch.exp(x_TV - max_T[:, None])
        sum_T = exp_TV.sum(dim=-1)
        _all_reduce(sum_T, group, timeout_s)
        local_T = labels_T.to(torch.int64) - vocab_start
        inside_T = (local_T >= 0) & (local_T < x_TV.shape[-1])
        idx_T = local_T.clamp(0, x_TV.shape[-1] - 1)
        target_T = torch.where(inside_T, x_TV.gather(-1, idx_T[:, None])[:, 0], 0.0)
        _all_reduce(target_T, group, timeout_s)
        ctx.save_for_backward(exp_TV / sum_T[:, None], idx_T, inside_T)
        ctx.dtype = logits_TV.dtype
        return target_T - max_T - torch.log(sum_T)

    @staticmethod
    def backward(ctx: Any, grad_T: torch.Tensor) -> tuple[Any, ...]:
        softmax_TV, idx_T, inside_T = ctx.saved_tensors
        grad_TV = -softmax_TV * grad_T[:, None]
        grad_TV.scatter_add_(-1, idx_T[:, None], (grad_T * inside_T)[:, None])
        return grad_TV.to(ctx.dtype), None, None, None, None, None


def token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
) -> torch.Tensor:
    """``log p_S(labels)`` per row, fp32, differentiable into ``logits`` (collective over the TP
    group).

    Args:
        logits: ``[..., V_local]`` this rank's vocab slice of the student's logits (megatron's
            ``[B, S_local, V/tp]``), slice ``rank_in_group`` of the padded vocabulary.
        labels: ``[...]`` global token ids, the same on every rank of the group.
        tp_group: the student's TP group (``None``: the whole vocabulary is here).
        vocab_size: the real vocabulary; padded columns past it are excluded.
        timeout_s: seconds each all-reduce of a CPU (gloo) group may wait (CUDA tensors use the
            group's own timeout).
    Returns:
        ``labels.shape`` fp32, the same on every rank of the group.
    """
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"labels {tuple(labels.shape)} must match the logits' rows {tuple(logits.shape[:-1])}"
        )
    v_local = int(logits.shape[-1])
    rank = dist.get_rank(tp_group) if tp_group is not None else 0
    start = rank * v_local
    valid = None
    if vocab_size is not None and start + v_local > vocab_size:
        valid = torch.arange(start, start + v_local, device=logits.device) < vocab_size
    out_T = _TokenLogprob.apply(
        logits.reshape(-1, v_local), labels.reshape(-1), start, valid, tp_group, timeout_s
    )
    return out_T.reshape(labels.shape)


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
) -> torch.Tensor:
    """The per-row cross-entropy ``-log p_S(labels)`` (an SFT term), over ``tp_group`` and the
    real vocabulary: :func:`token_logprobs` negated, with its arguments, shapes and gradient."""
    return -token_logprobs(
        logits, labels, tp_group=tp_group, vocab_size=vocab_size, timeout_s=timeout_s
    )
