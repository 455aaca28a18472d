"""The teacher signal of a student micro-batch, and the loss in the shape megatron expects.

Why this file exists: on-policy distillation trains with the per-token KL to the teachers as one
term among others (a policy-gradient loss that takes it as a dense reward, an SFT cross-entropy,
per-teacher weights). :func:`teacher_signal` is that term as a building block: inside megatron's
``loss_func`` it receives the micro-batch's teacher rows from the bridge and returns, in the
order of the logits, the per-token KL to each token's teacher (with gradient into the student
logits), which tokens count, which teacher owns each and the token counts.
:func:`megatron_loss_output` turns a loss summed over counted tokens into what megatron's
schedule expects, under either of its normalisations, so the gradient is that of the step's
mean loss per counted token:

- ``calculate_per_token_loss=True``: ``loss_func`` returns ``(loss_sum, num_tokens, logs)``; the
  schedule adds up ``num_tokens`` and ``finalize_model_grads`` divides the gradients by the total
  over DP x CP. Exact as is.
- the default path: ``loss_func`` returns ``(loss, logs)``; the schedule multiplies it by the CP
  size and divides by the number of micro-batches ``M``, and megatron's DDP averages gradients
  over DP x CP. A micro-batch's loss sum must therefore be scaled by ``M * dp / G`` (``G``: the
  step's counted tokens over the whole student, known from the bridge's step metadata).

The stock loss (:func:`kl_loss_func`) is the weighted KL summed over counted tokens. The logged
value is ``[loss_sum, num_tokens]`` of this rank's tokens (the same on every TP rank): reduce it
over DP x CP only (:meth:`mopd.mcore.distill_step.DistillationStep.mean_loss`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mopd.bridge.layout import TokenLayout
from mopd.bridge.lm_head import LMHeadShard
from mopd.bridge.step import BridgeStep
from mopd.common import ranges
from mopd.kernels.kl import KLConfig, KLKind, vocab_parallel_kl

__all__ = ["LOG_KEY", "TeacherSignal", "kl_loss_func", "megatron_loss_output", "teacher_signal"]

#: The key of the logged ``[loss_sum, num_tokens]`` in the loss function's dict.
LOG_KEY = "mopd kl"


@dataclass(frozen=True, kw_only=True, eq=False)
class TeacherSignal:
    """The teachers' signal for one student micro-batch on this rank, in the order of its logits.

    ``T`` is the number of logit rows: ``B * S_local`` (padded, ``[B, S_local]`` flattened) or
    ``T_local`` (THD); ``x_T.view(signal.shape)`` gives megatron's ``[B, S_local]`` / ``[1, T]``.

    Attributes:
        micro_batch: the student micro-batch's index in the step.
        shape: the logits' leading shape (``logits.shape[:-1]``).
        kl_T: ``kind -> [T]`` fp32 per-token KL of the student to the token's teacher (``reverse``
            ``KL(p_S || p_T)``, ``forward`` ``KL(p_T || p_S)``, ``mixed``), differentiable into the
            student's logits, ``0`` where ``mask_T`` is false; the same on every TP rank.
        mask_T: ``[T]`` bool: the token counts (a real token, in the student's ``loss_mask``).
        owner_T: ``[T]`` int64: the teacher of each counted token, ``-1`` elsewhere.
        weight_T: ``[T]`` fp32: the owner's weight (``teacher_weights``), ``0`` where not counted.
        num_tokens: counted tokens of this rank (the same on every TP rank).
        global_tokens: counted tokens of the whole step over the whole student (each once).
        sample_id_T: ``[T]`` int64: the global sample id of each row, ``-1`` for padding
            (every real row, counted or not; THD and CP included), or ``None`` where the
            caller gave no layout.
        position_T: ``[T]`` int64: each row's position in its sample (row ``p`` predicts the
            token at ``p + 1``), ``-1`` for padding; ``None`` with ``sample_id_T``.
        advantage_T: ``[T]`` fp32: the row's sample's advantage
            (:attr:`~mopd.mcore.rollouts.Rollouts.advantages`), ``0`` where not counted;
            ``None`` when the step's rollouts carry none.
    """

    micro_batch: int
    shape: tuple[int, ...]
    kl_T: Mapping[str, torch.Tensor]
    mask_T: torch.Tensor
    owner_T: torch.Tensor
    weight_T: torch.Tensor
    num_tokens: int
    global_tokens: int
    sample_id_T: torch.Tensor | None = None
    position_T: torch.Tensor | None = None
    advantage_T: torch.Tensor | None = None

    def weighted_kl_sum(self, kind: str | None = None) -> torch.Tensor:
        """``sum_t weight_T * kl_T[kind]`` (fp32 scalar, differentiable): the stock MOPD loss
        sum; ``kind`` defaults to the first computed."""
        kl = self.kl_T[kind or next(iter(self.kl_T))]
        return (self.weight_T * kl).sum()


def teacher_signal(
    step: BridgeStep,
    micro_batch: int,
    logits: torch.Tensor,
    *,
    lm_heads: Sequence[LMHeadShard],
    tp_group: dist.ProcessGroup | None,
    teacher_weights: Sequence[float] | None = None,
    kinds: Sequence[KLKind] = ("reverse",),
    config: KLConfig | None = None,
    global_tokens: int | None = None,
    layout: TokenLayout | None = None,
    advantages: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> TeacherSignal:
    """Receive ``micro_batch``'s teacher rows and compute the per-token KL (see the class).

    The rows arrive compact per teacher (:meth:`~mopd.bridge.step.BridgeStep.receive`) and go
    to the KL as they are, with the step's owner per row as ``teacher_index_T``.

    Collective over the student's TP group (the vocab-parallel KL); call it on the student's
    last stage, inside ``loss_func``, once per micro-batch.

    Args:
        step: the bridge step (its :meth:`~mopd.bridge.step.BridgeStep.receive` runs inside).
        logits: ``[B, S_local, V_local]`` (or ``[1, T_local, V_local]``) as megatron's GPTModel
            returns them, rows in the order of the student's ``"logits"`` layout.
        lm_heads: one resharded LM-head shard per teacher (:func:`~mopd.mcore.megatron_lm_head.
            lm_head_from_models`), the student's vocab partition.
        tp_group: the student's TP group (``None`` without TP).
        teacher_weights: one weight per teacher (default: all 1).
        kinds: which KLs to compute (each is one pass over the vocabulary).
        config: the KL's chunking and backend (its ``kind`` and ``reduction`` are set here).
        global_tokens: the step's counted tokens if known (else read off the step's metadata).
        layout: the micro-batch's logit rows (the student's ``"logits"`` layout without its
            loss mask): fills ``sample_id_T`` and ``position_T``.
        advantages: ``(sorted sample ids [N], advantages [N])``: fills ``advantage_T``
            (needs ``layout``).
    """
    if not lm_heads:
        raise ValueError("need one LM-head shard per teacher")
    n_teachers = len(lm_heads)
    weights = _weights(teacher_weights, n_teachers)
    if not kinds or any(k not in ("reverse", "forward", "mixed") for k in kinds):
        raise ValueError(f"kinds must name 'reverse', 'forward' or 'mixed', got {list(kinds)}")
    config = config or KLConfig()
    rows = step.receive(micro_batch)
    logits_TV = logits.reshape(-1, logits.shape[-1])
    T = logits_TV.shape[0]
    owner = step.owner(micro_batch)
    if owner is None:  # a rank whose rows are all padding
        owner = torch.full((T,), -1, dtype=torch.int64, device=logits.device)
    if owner.numel() != T:
        raise ValueError(
            f"micro-batch {micro_batch}: {T} logit rows (output {tuple(logits.shape)}) but the "
            f"student layout has {owner.numel()} rows"
        )
    owner = owner.to(logits.device)
    mask_T = owner >= 0
    n = int(mask_T.sum())
    kl_T: dict[str, torch.Tensor] = {}
    for kind in kinds:
        if n == 0:  # nothing counts here (and on the TP peers, which share the layout)
            kl_T[kind] = logits_TV.sum(-1).float() * 0.0
            continue
        # each teacher's rows arrive compact (its counted tokens, in order): the KL reads them
        # as they are, no scatter into [T, H] buffers
        hidden = []
        for o, head in enumerate(lm_heads):
            h = rows.get(o)
            if h is None:  # a teacher with no rows here
                n_o = int((owner == o).sum())
                h = head.weight_VH.new_zeros((n_o, head.weight_VH.shape[1]))
            hidden.append(h)
        kl_T[kind] = vocab_parallel_kl(
            logits_TV,
            hidden,
            list(lm_heads),  # the resharded shards carry their vocab range
            loss_mask_T=mask_T,
            teacher_index_T=owner.clamp(min=0) if n_teachers > 1 else None,
            group=tp_group,
            config=dataclasses.replace(
                config,
                kind=kind,
                reduction="none",
                mix_weight=config.mix_weight if kind == "mixed" else None,
            ),
        )
    w = torch.tensor(weights, dtype=torch.float32, device=logits.device)
    zero = torch.zeros((), device=logits.device)
    weight_T = torch.where(mask_T, w[owner.clamp(min=0)], zero)
    sample_id_T = position_T = advantage_T = None
    if layout is not None:
        if layout.num_rows != T:
            raise ValueError(
                f"micro-batch {micro_batch}: {T} logit rows but its layout has {layout.num_rows}"
            )
        sample_id_T = layout.sample_id_R.to(logits.device)
        position_T = layout.position_R.to(logits.device)
        if advantages is not None:
            ids_N, adv_N = advantages
            at = torch.searchsorted(ids_N, layout.sample_id_R.clamp(min=0)).clamp(
                max=max(ids_N.numel() - 1, 0)
            )
            adv_T = adv_N[at].to(device=logits.device, dtype=torch.float32)
            advantage_T = torch.where(mask_T, adv_T, zero)
    return TeacherSignal(
        micro_batch=micro_batch,
        shape=tuple(logits.shape[:-1]),
        kl_T=kl_T,
        mask_T=mask_T,
        owner_T=owner,
        weight_T=weight_T,
        num_tokens=n,
        global_tokens=step.global_tokens() if global_tokens is None else global_tokens,
        sample_id_T=sample_id_T,
        position_T=position_T,
        advantage_T=advantage_T,
    )


def _weights(teacher_weights: Sequence[float] | None, n_teachers: int) -> list[float]:
    if teacher_weights is None:
        return [1.0] * n_teachers
    weights = [float(w) for w in teacher_weights]
    if len(weights) != n_teachers or any(not w >= 0 for w in weights):
        raise ValueError(
            f"teacher_weights must be {n_teachers} non-negative numbers, got {list(teacher_weights)}"
        )
    return weights


def megatron_loss_output(
    loss_sum: torch.Tensor,
    num_tokens: int,
    *,
    per_token: bool,
    default_scale: float,
    logs: Mapping[str, Any] | None = None,
) -> tuple[Any, ...]:
    """What megatron's ``loss_func`` returns for a loss summed over ``num_tokens`` counted
    tokens of this rank, so the gradient is that of the step's mean per counted token.

    Args:
        loss_sum: fp32 scalar, differentiable, the same on every TP rank.
        per_token: the model config's ``calculate_per_token_loss``.
        default_scale: ``M * dp / G`` for the default path (see the module doc).
        logs: more entries for the logging dict (besides ``LOG_KEY``: ``[loss_sum, tokens]``).
    """
    logged = torch.stack(
        [
            loss_sum.detach().to(torch.float64).reshape(()),
            torch.tensor(float(num_tokens), dtype=torch.float64, device=loss_sum.device),
        ]
    )
    out = {LOG_KEY: logged, **(logs or {})}
    if per_token:
        return loss_sum, torch.tensor(num_tokens, dtype=torch.int, device=loss_sum.device), out
    return loss_sum * default_scale, out


def kl_loss_func(
    step: BridgeStep,
    micro_batch: int,
    *,
    lm_heads: Sequence[LMHeadShard],
    tp_group: dist.ProcessGroup | None,
    per_token: bool,
    default_scale: float,
    config: KLConfig | None = None,
    teacher_weights: Sequence[float] | None = None,
    global_tokens: int | None = None,
    record: Callable[[int, torch.Tensor], None] | None = None,
) -> Callable[[torch.Tensor], tuple[Any, ...]]:
    """A megatron ``loss_func`` for ``micro_batch``: the weighted full-vocabulary KL to the
    bridged teachers summed over counted tokens (:func:`teacher_signal`, then
    :func:`megatron_loss_output`).

    Args:
        config: the KL's settings (its ``kind`` is the loss's); its reduction must be ``"sum"``.
        record: called with ``(micro_batch, [loss_sum, num_tokens])`` for logging.
    Returns:
        ``loss_func(logits_BSV)`` (see :func:`teacher_signal` for the logits).
    """
    config = config or KLConfig(reduction="sum")
    if config.reduction != "sum":
        raise ValueError(
            f"the Megatron loss needs KLConfig(reduction='sum'), got {config.reduction!r}"
        )
    _weights(teacher_weights, len(lm_heads))

    def loss_func(output: torch.Tensor, non_loss_data: bool = False) -> tuple[Any, ...]:
        with ranges.span("loss", micro_batch):
            signal = teacher_signal(
                step,
                micro_batch,
                output,
                lm_heads=lm_heads,
                tp_group=tp_group,
                teacher_weights=teacher_weights,
                kinds=(config.kind,),
                config=config,
                global_tokens=global_tokens,
            )
            out = megatron_loss_output(
                signal.weighted_kl_sum(),
                signal.num_tokens,
                per_token=per_token,
                default_scale=default_scale,
            )
            if record is not None:
                record(micro_batch, out[-1][LOG_KEY])
            return out

    return loss_func
