"""Row movement between a tensor's rows and contiguous staging buffers.

Why this file exists: every bridge exchange packs rows of a local buffer into per-peer staging
buffers and unpacks received rows into the student's layout. These are the entry points the
bridge calls; each one has a CuPy kernel (on CUDA tensors) and a torch twin with the same
signature (the CPU path and the reference). Which one runs is decided by
:mod:`mopd.kernels.backend`.

All tensors are 2-D row views ``[rows, H]``: a ``[S, B, H]`` buffer is passed as its
``view(-1, H)`` (row ``s * B + b``), so the callers speak in flat row indices.
"""

from __future__ import annotations

import torch

__all__ = ["copy_runs", "gather_rows", "scatter_rows"]


def _check_rows(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, H], got shape {tuple(t.shape)}")


def _check_index(name: str, index_R: torch.Tensor, limit: int, device: torch.device) -> None:
    if index_R.dim() != 1 or index_R.dtype != torch.int64:
        raise ValueError(
            f"{name} must be a 1-D int64 tensor, got shape {tuple(index_R.shape)} dtype {index_R.dtype}"
        )
    if index_R.device != device:
        raise ValueError(f"{name} is on {index_R.device}, data is on {device}")
    if index_R.numel() and (int(index_R.min()) < 0 or int(index_R.max()) >= limit):
        raise ValueError(
            f"{name} out of range: values in [{int(index_R.min())}, {int(index_R.max())}], "
            f"valid range is [0, {limit})"
        )


def gather_rows(
    src_NH: torch.Tensor, index_R: torch.Tensor, *, out_RH: torch.Tensor | None = None
) -> torch.Tensor:
    """Pack: ``out_RH[r] = src_NH[index_R[r]]``.

    Args:
        src_NH: ``[N, H]`` source rows.
        index_R: ``[R]`` int64 row indices into ``src_NH``.
        out_RH: optional ``[R, H]`` destination (same dtype and device); allocated if ``None``.
    Returns:
        ``out_RH``.
    """
    _check_rows("src_NH", src_NH)
    _check_index("index_R", index_R, src_NH.shape[0], src_NH.device)
    if out_RH is None:
        out_RH = torch.empty((index_R.numel(), src_NH.shape[1]), dtype=src_NH.dtype, device=src_NH.device)
    torch.index_select(src_NH, 0, index_R, out=out_RH)
    return out_RH


def scatter_rows(src_RH: torch.Tensor, index_R: torch.Tensor, out_NH: torch.Tensor) -> torch.Tensor:
    """Unpack: ``out_NH[index_R[r]] = src_RH[r]``; rows not named keep their contents."""
    _check_rows("src_RH", src_RH)
    _check_rows("out_NH", out_NH)
    _check_index("index_R", index_R, out_NH.shape[0], out_NH.device)
    out_NH.index_copy_(0, index_R, src_RH)
    return out_NH


def copy_runs(
    src_NH: torch.Tensor,
    src_start_K: torch.Tensor,
    dst_start_K: torch.Tensor,
    length_K: torch.Tensor,
    out_MH: torch.Tensor,
) -> torch.Tensor:
    """Block copy: ``out_MH[dst_start[k] : dst_start[k] + length[k]] = src_NH[src_start[k] : ...]``."""
    for s, d, n in zip(src_start_K.tolist(), dst_start_K.tolist(), length_K.tolist()):
        out_MH[d : d + n].copy_(src_NH[s : s + n])
    return out_MH
