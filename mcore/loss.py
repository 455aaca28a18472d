"""The MOPD loss in the shape megatron's schedule expects from ``loss_func``.

Why this file exists: megatron's schedule calls ``loss_func(output_tensor)`` on the last stage
and normalizes what it returns in one of two ways, and a distillation loss must give the right
gradient under both (the global mean KL per real token of the step):

- ``calculate_per_token_loss=True``: ``loss_func`` returns ``(kl_sum, num_tokens, logs)``; the
  schedule adds up ``num_tokens`` and ``finalize_model_grads`` divides the gradients by the total
  over DP x CP. Exact as is.
- the default path: ``loss_func`` returns ``(loss, logs)``; the schedule multiplies it by the CP
  size and divides by the number of micro-batches ``M``, and megatron's DDP averages gradients
  over DP x CP. A micro-batch's KL sum must therefore be scaled by ``M * dp / G`` (``G``: the
  step's real tokens over the whole student, known from the bridge's step metadata).

The logged value is ``[kl_sum, num_tokens]`` of this rank's tokens (the loss is the same on every
TP rank): reduce it over DP x CP only (:meth:`mopd.mcore.distill.DistillationStep.mean_loss`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mopd.bridge.api import BridgeStep
from mopd.bridge.lm_head import LMHeadShard
from mopd.kernels.kl import KLConfig, vocab_parallel_kl
from mopd.profiling import ranges

__all__ = ["LOG_KEY", "kl_loss_func"]

#: The key of the logged ``[kl_sum, num_tokens]`` in the loss function's dict.
LOG_KEY = "mopd kl"


def kl_loss_func(
    step: BridgeStep,
    micro_batch: int,
    *,
    lm_heads: Sequence[LMHeadShard],
    tp_group: Any,
    per_token: bool,
    default_scale: float,
    config: KLConfig | None = None,
    record: Callable[[int, torch.Tensor], None] | None = None,
) -> Callable[[torch.Tensor], tuple[Any, ...]]:
    """A megatron ``loss_func`` for ``micro_batch``: full-vocabulary KL to the bridged teachers.

    Args:
        step: the bridge step (its :meth:`~mopd.bridge.api.BridgeStep.receive` runs inside).
        lm_heads: one resharded LM-head shard per teacher (:func:`~mopd.bridge.lm_head.
            lm_head_from_models`), the student's vocab partition.
        tp_group: the student's TP group (``None`` without TP).
        per_token: the model config's ``calculate_per_token_loss``.
        default_scale: ``M * dp / G`` for the default path (see the module doc).
        config: the KL's settings (kind, chunking); its reduction must be ``"sum"``.
        record: called with ``(micro_batch, [kl_sum, num_tokens])`` for logging.
    Returns:
        ``loss_func(logits_BSV)``: logits ``[B, S_local, V_local]`` (or ``[1, T_local, V_local]``)
        as megatron's GPTModel returns them, rows in the order of the student's ``"logits"``
        layout.
    """
    config = config or KLConfig(reduction="sum")
    if config.reduction != "sum":
        raise ValueError(
            f"the Megatron loss needs KLConfig(reduction='sum'), got {config.reduction!r}"
        )
    if not lm_heads:
        raise ValueError("need one LM-head shard per teacher")

    def loss_func(output: torch.Tensor, non_loss_data: bool = False) -> tuple[Any, ...]:
        with ranges.span("loss", micro_batch):
            rows = step.receive(micro_batch)
            owner = step.owner(micro_batch)
            if owner is None:
                raise ValueError("loss_func ran on a rank that receives no teacher rows")
            logits_TV = output.reshape(-1, output.shape[-1])
            if logits_TV.shape[0] != owner.numel():
                raise ValueError(
                    f"micro-batch {micro_batch}: {logits_TV.shape[0]} logit rows (output "
                    f"{tuple(output.shape)}) but the student layout has {owner.numel()} rows"
                )
            kl_sum = vocab_parallel_kl(
                logits_TV,
                [rows[o] for o in range(len(lm_heads))],
                list(lm_heads),  # the resharded shards carry their vocab range
                loss_mask_T=owner >= 0,
                teacher_index_T=owner.clamp(min=0) if len(lm_heads) > 1 else None,
                group=tp_group,
                config=config,
            )
            n = step.num_tokens(micro_batch)
            logged = torch.stack(
                [
                    kl_sum.detach().to(torch.float64),
                    torch.tensor(float(n), dtype=torch.float64, device=kl_sum.device),
                ]
            )
            if record is not None:
                record(micro_batch, logged)
            if per_token:
                num = torch.tensor(n, dtype=torch.int, device=output.device)
                return kl_sum, num, {LOG_KEY: logged}
            return kl_sum * default_scale, {LOG_KEY: logged}

    return loss_func
