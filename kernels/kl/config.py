"""The vocab-parallel KL's configuration and the chunk size it implies.

Why this file exists: :class:`KLConfig` is what a caller of :mod:`mopd.kernels.kl` sets (kind,
reduction, memory budget, backend, debug checks, collective timeout, how the fused path sums its
weight gradient), validated once on construction; :func:`choose_chunk_tokens` turns its budget
into the number of tokens per chunk.
Both are pure functions of their arguments, so TP ranks that agree on them agree on the chunks.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Literal

from mopd.common.dist import DEFAULT_TIMEOUT_S, KL_TIMEOUT_FACTOR
from mopd.kernels.backend import Backend

__all__ = [
    "DEFAULT_BUDGET_BYTES",
    "MAX_CHUNK_TOKENS",
    "KLConfig",
    "KLKind",
    "KLReduction",
    "WeightGradAccumulation",
    "choose_chunk_tokens",
]

KLKind = Literal["reverse", "forward", "mixed"]
KLReduction = Literal["sum", "mean", "none"]
WeightGradAccumulation = Literal["auto", "fp32", "weight"]

#: Largest chunk: one CUDA launch covers at most 65535 rows in the grid's y dimension.
MAX_CHUNK_TOKENS = 32768
#: Default working memory of one chunk's ``[C, V_local]`` blocks.
DEFAULT_BUDGET_BYTES = 512 * 2**20


@dataclass(frozen=True, kw_only=True)
class KLConfig:
    """How the loss is computed.

    Attributes:
        kind: ``"reverse"`` (KL(p_S || p_T), the default), ``"forward"`` or ``"mixed"``.
        mix_weight: weight of the reverse KL in ``"mixed"`` (the forward KL gets ``1 - w``);
            default 0.5 there; setting it with another ``kind`` warns (it is ignored).
        reduction: ``"sum"`` (of ``mask * KL``), ``"mean"`` (that sum over the mask's total
            weight; 0 when it is 0) or ``"none"`` (``[T]`` fp32 ``mask * KL``).
        memory_budget_bytes: working memory for one chunk's ``[C, V_local]`` blocks; sets ``C``.
        chunk_tokens: explicit chunk size; overrides the budget.
        backend: row-wise passes on ``"auto"`` / ``"cupy"`` / ``"torch"`` (see ``kl.rowwise``).
        debug: check inputs for NaN/inf and check, with one extra all-reduce, that the TP ranks
            agree on tokens, mask and teacher index.
        timeout_s: seconds each all-reduce of a CPU (gloo) group may wait, a positive finite
            number (``None``: the group's own timeout). CUDA (NCCL) tensors always use the
            group's own timeout (its watchdog): a timed wait there would block the host on every
            chunk.
        sum_hidden_grad_over_tp: fused path: all-reduce the student hidden-state gradient over
            the TP group (the hidden states are TP-replicated, as Megatron's
            copy-to-tensor-parallel-region does); ``False`` leaves this rank's partial sum.
            The logits path has no hidden states: ``False`` there is ignored, with a warning
            (once per process).
        weight_grad_accumulation: fused path with a bf16/fp16 weight: where the student LM-head
            gradient ``[V_local, H_s]`` sums its chunks. ``"fp32"``: in an fp32 buffer
            (``4 * V_local * H_s`` bytes beyond the budget while the loss runs), rounded to the
            weight's dtype once; ``"weight"``: in the weight's dtype, one rounding per chunk
            (the norm-wise error grows about as the square root of the number of chunks);
            ``"auto"`` (default): ``"fp32"`` when there is more than one chunk and that buffer
            fits in ``memory_budget_bytes``, else ``"weight"`` (with one chunk both round once).
            The logits path has no weight: another value there is ignored, with a warning (once
            per process).
    """

    kind: KLKind = "reverse"
    mix_weight: float | None = None
    reduction: KLReduction = "sum"
    memory_budget_bytes: int = DEFAULT_BUDGET_BYTES
    chunk_tokens: int | None = None
    backend: Backend = "auto"
    debug: bool = False
    timeout_s: float | None = KL_TIMEOUT_FACTOR * DEFAULT_TIMEOUT_S
    sum_hidden_grad_over_tp: bool = True
    weight_grad_accumulation: WeightGradAccumulation = "auto"

    def __post_init__(self) -> None:
        if self.kind not in ("reverse", "forward", "mixed"):
            raise ValueError(f"kind must be 'reverse', 'forward' or 'mixed', got {self.kind!r}")
        if self.reduction not in ("sum", "mean", "none"):
            raise ValueError(f"reduction must be 'sum', 'mean' or 'none', got {self.reduction!r}")
        if self.backend not in ("auto", "cupy", "torch"):
            raise ValueError(f"backend must be 'auto', 'cupy' or 'torch', got {self.backend!r}")
        if self.weight_grad_accumulation not in ("auto", "fp32", "weight"):
            raise ValueError(
                "weight_grad_accumulation must be 'auto', 'fp32' or 'weight', got "
                f"{self.weight_grad_accumulation!r}"
            )
        if self.mix_weight is not None:
            if not 0.0 <= self.mix_weight <= 1.0:
                raise ValueError(f"mix_weight must be in [0, 1], got {self.mix_weight}")
            if self.kind != "mixed":
                warnings.warn(
                    f"KLConfig.mix_weight={self.mix_weight} is ignored with kind={self.kind!r}",
                    stacklevel=3,
                )
        if self.memory_budget_bytes <= 0:
            raise ValueError(f"memory_budget_bytes must be > 0, got {self.memory_budget_bytes}")
        if self.chunk_tokens is not None and not 1 <= self.chunk_tokens <= MAX_CHUNK_TOKENS:
            raise ValueError(
                f"chunk_tokens must be in [1, {MAX_CHUNK_TOKENS}], got {self.chunk_tokens}"
            )
        if self.chunk_tokens is not None and self.memory_budget_bytes != DEFAULT_BUDGET_BYTES:
            warnings.warn(
                f"KLConfig.memory_budget_bytes={self.memory_budget_bytes} is ignored: "
                f"chunk_tokens={self.chunk_tokens} sets the chunk size",
                stacklevel=3,
            )
        if self.timeout_s is not None and (
            isinstance(self.timeout_s, bool)
            or not isinstance(self.timeout_s, int | float)
            or not 0 < self.timeout_s < math.inf
        ):
            raise ValueError(
                f"timeout_s must be a positive finite number of seconds or None, got "
                f"{self.timeout_s!r}"
            )

    @property
    def reverse_weight(self) -> float:
        """Weight of KL(p_S || p_T) in the loss."""
        if self.kind == "mixed":
            return 0.5 if self.mix_weight is None else self.mix_weight
        return 1.0 if self.kind == "reverse" else 0.0

    @property
    def forward_weight(self) -> float:
        """Weight of KL(p_T || p_S) in the loss."""
        return 1.0 - self.reverse_weight


def choose_chunk_tokens(
    config: KLConfig,
    *,
    v_local: int,
    element_size: int,
    backend: Literal["cupy", "torch"],
    fused: bool = True,
    logit_element_size: int | None = None,
) -> int:
    """Tokens per chunk so one chunk's ``[C, V_local]`` blocks fit ``config.memory_budget_bytes``.

    Args:
        config: its ``chunk_tokens``, when set, is the answer; else its budget.
        v_local: vocab rows of this rank's shard.
        element_size: bytes per element of the student's dtype (its gradient's).
        backend: where the row-wise passes run (the torch twin needs temporaries).
        fused: the fused path (student logits formed here) rather than the logits path.
        logit_element_size: bytes per element of the logits the loss forms (default: at least
            4, the fp32 logits of bf16/fp16 inputs).
    Returns:
        ``C`` in ``[1, MAX_CHUNK_TOKENS]``, rounded down to a multiple of 64 when it is at
        least 128.

    Per element of a chunk: the fused path holds its student logits, the teacher logits and a
    gradient buffer in the student's dtype (none when that is the logits' dtype: the gradient
    then overwrites the student logits); the logits path holds the teacher logits, the
    student's rows (when gathered) and a gradient buffer. The torch twin adds ~5 fp32
    temporaries.
    """
    if config.chunk_tokens is not None:
        return config.chunk_tokens
    wide = max(element_size, 4) if logit_element_size is None else logit_element_size
    if fused:
        per_elem = 2 * wide + (0 if element_size == wide else element_size)
    else:
        per_elem = wide + 2 * element_size
    per_elem += 0 if backend == "cupy" else 20
    chunk = config.memory_budget_bytes // max(1, v_local * per_elem)
    chunk = max(1, min(int(chunk), MAX_CHUNK_TOKENS))
    return chunk - chunk % 64 if chunk >= 128 else chunk
