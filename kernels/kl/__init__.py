"""mopd.kernels.kl: the student-side full-vocabulary KL, vocab-parallel and chunked.

The front door of the KL family: :func:`vocab_parallel_kl` (teacher logits rebuilt from hidden
states and an LM-head shard), :func:`fused_vocab_parallel_kl` and their :class:`KLConfig`. The
modules behind it: ``config`` (settings), ``prepare`` (validation, the job), ``loop`` (the
chunked forward and backward), ``matmul`` and ``rowwise`` (per-chunk math; ``cupy_kernels``
launches ``kl_kernels.cu``, with torch twins), ``agreement`` (the TP group's debug agreement,
over :mod:`mopd.common.dist`'s collectives).
"""

from __future__ import annotations

from mopd.kernels.kl.vocab_parallel import (
    KLConfig,
    KLKind,
    KLReduction,
    WeightGradAccumulation,
    choose_chunk_tokens,
    fused_vocab_parallel_kl,
    vocab_parallel_kl,
)

__all__ = [
    "KLConfig",
    "KLKind",
    "KLReduction",
    "WeightGradAccumulation",
    "choose_chunk_tokens",
    "fused_vocab_parallel_kl",
    "vocab_parallel_kl",
]
