"""mopd.kernels: layout kernels (CuPy, with torch twins) and the vocab-parallel full-vocab KL."""

from __future__ import annotations

from mopd.kernels.cupy_rows import set_default_variants
from mopd.kernels.kl import KLConfig, fused_vocab_parallel_kl, vocab_parallel_kl
from mopd.kernels.rows import copy_runs, gather_rows, scatter_rows

__all__ = [
    "KLConfig",
    "copy_runs",
    "fused_vocab_parallel_kl",
    "gather_rows",
    "scatter_rows",
    "set_default_variants",
    "vocab_parallel_kl",
]
