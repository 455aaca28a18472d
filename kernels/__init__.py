"""mopd.kernels: layout kernels (CuPy, with torch twins) and the vocab-parallel full-vocab KL."""

from __future__ import annotations

from mopd.kernels.rows import copy_runs, gather_rows, scatter_rows

__all__ = ["copy_runs", "gather_rows", "scatter_rows"]
