"""mopd.kernels.rows: the bridge's row kernels, pack, unpack and run copies.

The front door of the row family (what the bridge's executor calls): :func:`gather_rows`,
:func:`scatter_rows`, :func:`copy_runs`, validated once in ``ops``; each has a CuPy kernel
(``cupy_rows`` launches ``rows.cu``) and a torch twin of the same signature (``torch_rows``),
chosen by :mod:`mopd.kernels.backend`.
"""

from __future__ import annotations

from mopd.kernels.rows.ops import VARIANTS, copy_runs, gather_rows, rows_overlap, scatter_rows

__all__ = ["VARIANTS", "copy_runs", "gather_rows", "rows_overlap", "scatter_rows"]
