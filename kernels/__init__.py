"""mopd.kernels: the vocab-parallel full-vocabulary KL, and the bridge's layout kernels.

Public: the KL (:func:`vocab_parallel_kl`, :func:`fused_vocab_parallel_kl`, :class:`KLConfig`)
and the one knob of the row kernels a user turns, :func:`set_default_variants` (the variants
``mopd bench kernels`` measured best on their GPU). The row kernels themselves (CuPy, with torch
twins) are the bridge's internals, in :mod:`.rows`.
"""

from __future__ import annotations

from mopd.kernels.kl import KLConfig, fused_vocab_parallel_kl, vocab_parallel_kl
from mopd.kernels.rows.cupy_rows import set_default_variants

__all__ = [
    "KLConfig",
    "fused_vocab_parallel_kl",
    "set_default_variants",
    "vocab_parallel_kl",
]
