"""The vocab-parallel KL's configuration and the chunk size it implies.

Why this file exists: :class:`KLConfig` is what a caller of :mod:`mopd.kernels.kl` sets (kind,
reduction, memory budget, backend, debug checks, collective timeout), validated once on
construction; :func:`choose_chunk_tokens` turns its budget into the number of tokens per chunk.
Both are pure functions of their arguments, so TP ranks that agree on them agree on the chunks.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Literal

from mopd.kernels.backend import Backend

__all__ = [
    "DEFAULT_BUDGET_BYTES",
    "MAX_CHUNK_TOKENS",
    "KLConfig",
    "KLKind",
    "KLReduction",
    "choose_chunk_tokens",
]

KLKind = Literal["reverse", "forward", "mixed"]
KLReduction = Literal["sum", "mean", "none"]

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
            It also bounds the fp32 buffer backward uses to scale a bf16/fp16 gradient.
        chunk_tokens: explicit chunk size; overrides the budget.
        backend: row-wise passes on ``"auto"`` / ``"cupy"`` / ``"torch"`` (see kl_rowwise).
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
    """

    kind: KLKind = "reverse"
    mix_weight: float | None = None
    reduction: KLReduction = "sum"
    memory_budget_bytes: int = DEFAULT_BUDGET_BYTES
    chunk_tokens: int | None = None
    backend: Backend = "auto"
    debug: bool = False
    timeout_s: float | None = 600.0
    sum_hidden_grad_over_tp: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("reverse", "forward", "mixed"):
            raise ValueError(f"kind must be 'reverse', 'forward' or 'mixed', got {self.kind!r}")
        if self.reduction not in ("sum", "mean", "none"):
            raise ValueError(f"reduction must be 'sum', 'mean' or 'none', got {self.reduction!r}")
        if self.backend not in ("auto", "cupy", "torch"):
            raise ValueError(f"backend must be 'auto', 'cupy' or 'torch', got {self.backend!r}")
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
) -> int:
    """Tokens per chunk so one chunk's ``[C, V_local]`` blocks fit ``config.memory_budget_bytes``.

    Per element of a chunk, in the compute dtype: the student and teacher logits (the fused
    path writes the gradient over its own student logits) plus, for the logits path, a gradient
    buffer; the torch twin adds ~5 fp32 temporaries. ``C`` is rounded down to a multiple of 64
    when it is at least 128.
    """
    if config.chunk_tokens is not None:
        return config.chunk_tokens
    per_elem = (2 if fused else 3) * element_size + (0 if backend == "cupy" else 20)
    chunk = config.memory_budget_bytes // max(1, v_local * per_elem)
    chunk = max(1, min(int(chunk), MAX_CHUNK_TOKENS))
    return chunk - chunk % 64 if chunk >= 128 else chunk
