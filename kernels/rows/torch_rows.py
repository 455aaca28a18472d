"""Torch twins of the row kernels: the CPU path and the reference for the CuPy kernels.

Why this file exists: every CuPy kernel has a torch twin with the same signature, used on CPU
tensors (tests, the CPU demo, gloo runs), as the automatic fallback where CuPy is missing, and
as the reference the GPU tests compare the kernels against bit for bit. Like the kernels, the
twins move bytes outside autograd (tensors are detached; outputs are written in place). Inputs
are validated by :mod:`mopd.kernels.rows`; the ``variant`` keyword names a CuPy kernel variant
and means nothing here (:mod:`mopd.kernels.rows` warns when a user sets it and the twin runs).
"""

from __future__ import annotations

import torch

__all__ = ["copy_runs_torch", "gather_rows_torch", "run_rows", "scatter_rows_torch"]


def gather_rows_torch(
    src_NH: torch.Tensor,
    index_R: torch.Tensor,
    *,
    out_RH: torch.Tensor | None = None,
    variant: str | None = None,
) -> torch.Tensor:
    """Pack: ``out_RH[r] = src_NH[index_R[r]]`` (``index_select``).

    Args:
        src_NH: ``[N, H]`` rows.
        index_R: ``[R]`` int64 row indices into ``src_NH``.
        out_RH: ``[R, H]`` destination; allocated if ``None``.
        variant: ignored (CuPy only).
    Returns:
        ``out_RH``.
    """
    del variant
    if out_RH is None:
        out_RH = torch.empty(
            (index_R.shape[0], src_NH.shape[1]), dtype=src_NH.dtype, device=src_NH.device
        )
    out = out_RH.detach()
    if out.is_contiguous():
        torch.index_select(src_NH.detach(), 0, index_R, out=out)
    else:
        out.copy_(torch.index_select(src_NH.detach(), 0, index_R))
    return out_RH


def scatter_rows_torch(
    src_RH: torch.Tensor,
    index_R: torch.Tensor,
    out_NH: torch.Tensor,
    *,
    variant: str | None = None,
) -> torch.Tensor:
    """Unpack: ``out_NH[index_R[r]] = src_RH[r]`` (``index_copy_``); other rows keep their contents.

    Args:
        src_RH: ``[R, H]`` rows.
        index_R: ``[R]`` int64 distinct destination rows.
        out_NH: ``[N, H]`` destination, written in place.
        variant: ignored (CuPy only).
    Returns:
        ``out_NH``.
    """
    del variant
    out_NH.detach().index_copy_(0, index_R, src_RH.detach())
    return out_NH


def run_rows(
    src_start_K: torch.Tensor,
    dst_start_K: torch.Tensor,
    length_K: torch.Tensor,
    total: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expand runs into per-row indices ``(src_rows_T, dst_rows_T)``, ``T = sum(length_K)``.

    Row ``t`` of run ``k`` (``0 <= j < length_K[k]``, in run order) maps
    ``src_start_K[k] + j -> dst_start_K[k] + j``. Vectorized; one host read of ``T`` unless
    ``total`` gives it (it must be exact).
    """
    if total is None:
        total = int(length_K.sum())
    run_T = torch.repeat_interleave(
        torch.arange(length_K.shape[0], device=length_K.device), length_K, output_size=total
    )
    first_K = torch.cumsum(length_K, 0) - length_K
    offset_T = torch.arange(total, device=length_K.device) - first_K[run_T]
    return src_start_K[run_T] + offset_T, dst_start_K[run_T] + offset_T


def copy_runs_torch(
    src_NH: torch.Tensor,
    src_start_K: torch.Tensor,
    dst_start_K: torch.Tensor,
    length_K: torch.Tensor,
    out_MH: torch.Tensor,
    *,
    num_rows: int | None = None,
    variant: str | None = None,
) -> torch.Tensor:
    """Block copies: ``out_MH[dst_start[k] + j] = src_NH[src_start[k] + j]`` for ``j < length[k]``.

    Args:
        src_NH: ``[N, H]`` rows.
        src_start_K, dst_start_K, length_K: ``[K]`` int64 run starts and lengths.
        out_MH: ``[M, H]`` destination, written in place.
        num_rows: ``sum(length_K)`` if known (exact), saving a host read; else ``None``.
        variant: ignored (CuPy only).
    Returns:
        ``out_MH``.
    """
    del variant
    if length_K.shape[0] == 0:
        return out_MH
    src_rows_T, dst_rows_T = run_rows(src_start_K, dst_start_K, length_K, num_rows)
    out_MH.detach().index_copy_(0, dst_rows_T, src_NH.detach().index_select(0, src_rows_T))
    return out_MH
