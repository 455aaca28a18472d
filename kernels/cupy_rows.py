"""CuPy launchers for the row kernels of ``rows.cu`` (pack, unpack, run copies).

Why this file exists: it turns torch tensors into a kernel launch (zero-copy through DLPack, on
torch's current stream, into outputs torch allocated) and owns the choices a launch needs: the
vector width a pair of row views allows, the variant, and the grid. The public entry points
with validation are in :mod:`mopd.kernels.rows`; the torch twins, with the same signatures, are
in :mod:`mopd.kernels.rows_torch`.

Inputs here are already validated by :mod:`mopd.kernels.rows` (2-D row views whose rows are
contiguous, int64 indices in range, same device and dtype). Data is moved as bytes, so any dtype
works (bf16, fp16, fp32, int8, ...): each ``[rows, H]`` tensor is viewed as ``[rows, H * itemsize]``
``uint8`` before it crosses DLPack (CuPy before 14 cannot take bf16 through DLPack).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from mopd.kernels.cupy_loader import get_kernel, on_torch_stream, to_cupy

__all__ = [
    "BLOCK",
    "BLOCKS_PER_SM",
    "DEFAULT_VARIANT",
    "VARIANTS",
    "VARIANT_SPECS",
    "Variant",
    "copy_runs_cupy",
    "gather_rows_cupy",
    "kernel_name",
    "launch_grid",
    "scatter_rows_cupy",
    "vector_bytes",
]

_SOURCE = "rows.cu"

#: Threads per block (``MOPD_BLOCK`` in rows.cu, which the kernels' launch bounds assume).
BLOCK = 256
#: Resident blocks per SM at full occupancy (2048 threads per SM on sm_80/sm_90).
BLOCKS_PER_SM = 8
#: Largest grid.x a launch may have.
_MAX_GRID = 2**31 - 1


@dataclass(frozen=True, kw_only=True)
class Variant:
    """How one named variant launches: which kernel of rows.cu and what grid.

    ``kernel`` names the ``X(...)`` entry of ``MOPD_VARIANTS`` in rows.cu; ``kind`` (0: a group
    is a thread, 1: a warp, 2: a block) and ``unroll`` mirror it. ``persistent``: at most
    :data:`BLOCKS_PER_SM` blocks per SM that loop over the items; otherwise one group per item.
    """

    kernel: str
    kind: int
    unroll: int
    persistent: bool = True

    def __post_init__(self) -> None:
        if self.kind not in (0, 1, 2) or self.unroll < 1:
            raise ValueError(f"bad variant geometry: kind={self.kind}, unroll={self.unroll}")


#: Variant name -> launch recipe. The kernels mirror MOPD_VARIANTS in rows.cu.
VARIANT_SPECS: dict[str, Variant] = {
    # naive grid-stride: one 16-byte vector per item, plain loads and stores (the baseline)
    "grid": Variant(kernel="grid", kind=0, unroll=1),
    # a warp per row chunk, 4 x 16-byte loads in flight per lane, plain loads and stores
    "warp": Variant(kernel="warp", kind=1, unroll=4),
    # same, streaming (evict-first) loads and stores
    "warp_cs": Variant(kernel="warp_cs", kind=1, unroll=4),
    # same as warp_cs, but one warp per chunk (no persistent loop; the block scheduler balances)
    "warp_cs_flat": Variant(kernel="warp_cs", kind=1, unroll=4, persistent=False),
    # read-only loads that skip L1, streaming stores
    "warp_nc": Variant(kernel="warp_nc", kind=1, unroll=4),
    # a warp per row chunk, 8 x 16-byte loads in flight per lane, streaming
    "warp8_cs": Variant(kernel="warp8_cs", kind=1, unroll=8),
    # a block per row chunk (16 KiB chunks), streaming
    "block_cs": Variant(kernel="block_cs", kind=2, unroll=4),
}
VARIANTS: tuple[str, ...] = tuple(VARIANT_SPECS)
#: The variant used when none is named. Chosen from profiling/bench_kernels.py on an H200.
DEFAULT_VARIANT = "warp_cs"


def vector_bytes(row_bytes: int, *addresses: int) -> int:
    """The widest access (16, 8, 4, 2 or 1 bytes) dividing ``row_bytes`` and every address/stride.

    Args:
        row_bytes: bytes per row.
        addresses: base addresses and row strides in bytes of the views involved.
    """
    for width in (16, 8, 4, 2):
        if row_bytes % width == 0 and all(a % width == 0 for a in addresses):
            return width
    return 1


def launch_grid(variant: str, rows_bound: int, vecs_per_row: int, sm_count: int) -> int:
    """Blocks to launch: enough for the work; at most ``BLOCKS_PER_SM * sm_count`` if persistent.

    Args:
        variant: a name in :data:`VARIANTS`.
        rows_bound: an upper bound on the rows to copy.
        vecs_per_row: vectors per row.
        sm_count: multiprocessors on the device.
    """
    spec = VARIANT_SPECS[variant]
    group_size = (1, 32, BLOCK)[spec.kind]
    groups_per_block = BLOCK // group_size
    chunks = -(-vecs_per_row // (group_size * spec.unroll))
    blocks = -(-rows_bound * chunks // groups_per_block)
    cap = BLOCKS_PER_SM * sm_count if spec.persistent else _MAX_GRID
    return max(1, min(blocks, cap))


def kernel_name(op: str, variant: str, width: int) -> str:
    """The rows.cu kernel for ``op`` (gather, scatter, runs), ``variant`` and vector ``width``."""
    return f"mopd_{op}_{VARIANT_SPECS[variant].kernel}_v{width}"


@functools.cache
def _sm_count_of(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    index = torch.cuda.current_device() if device.index is None else device.index
    return _sm_count_of(index)


def _check_variant(variant: str | None) -> str:
    variant = DEFAULT_VARIANT if variant is None else variant
    if variant not in VARIANT_SPECS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    return variant


def _as_bytes(rows_NH: torch.Tensor) -> torch.Tensor:
    """``[N, H]`` rows (``stride(1) == 1``) viewed as ``[N, H * itemsize]`` uint8, no copy.

    Detached first: the kernels move bytes outside autograd, like the twins' in-place ops.
    """
    rows_NH = rows_NH.detach()
    if rows_NH.dtype == torch.uint8:
        return rows_NH
    if rows_NH.shape[1] == 1 and rows_NH.stride(1) != 1:
        rows_NH = rows_NH.as_strided(rows_NH.shape, (rows_NH.stride(0), 1))
    return rows_NH.view(torch.uint8)


def _geometry(src_NH: torch.Tensor, out_MH: torch.Tensor) -> tuple[int, int, int, int]:
    """(vector bytes, vectors per row, src row stride, out row stride), strides in bytes."""
    itemsize = src_NH.element_size()
    row_bytes = src_NH.shape[1] * itemsize
    src_stride = src_NH.stride(0) * itemsize
    dst_stride = out_MH.stride(0) * itemsize
    width = vector_bytes(row_bytes, src_NH.data_ptr(), out_MH.data_ptr(), src_stride, dst_stride)
    return width, row_bytes // width, src_stride, dst_stride


def _launch_index(
    op: str, src: torch.Tensor, index_R: torch.Tensor, out: torch.Tensor, variant: str | None
) -> None:
    """Gather (``op="gather"``) or scatter (``"scatter"``) rows; see rows.cu for the math."""
    import numpy as np

    variant = _check_variant(variant)
    rows = index_R.shape[0]
    if rows == 0 or src.shape[1] == 0:
        return
    width, vecs_per_row, src_stride, dst_stride = _geometry(src, out)
    device = src.device
    kernel = get_kernel(_SOURCE, kernel_name(op, variant, width), device)
    index_R = index_R.contiguous()
    grid = launch_grid(variant, rows, vecs_per_row, _sm_count(device))
    with on_torch_stream(device):
        args = (
            to_cupy(_as_bytes(src)),
            to_cupy(_as_bytes(out)),
            to_cupy(index_R),
            np.int64(rows),
            np.int64(vecs_per_row),
            np.int64(src_stride),
            np.int64(dst_stride),
        )
        kernel((grid,), (BLOCK,), args)


def gather_rows_cupy(
    src_NH: torch.Tensor,
    index_R: torch.Tensor,
    *,
    out_RH: torch.Tensor | None = None,
    variant: str | None = None,
) -> torch.Tensor:
    """Pack on the GPU: ``out_RH[r] = src_NH[index_R[r]]``.

    Args:
        src_NH: ``[N, H]`` CUDA rows, ``stride(1) == 1``, any row stride, any dtype.
        index_R: ``[R]`` int64 row indices into ``src_NH``, same device.
        out_RH: ``[R, H]`` destination (same dtype/device, rows contiguous); allocated by torch
            if ``None``.
        variant: a kernel variant from :data:`VARIANTS` (default :data:`DEFAULT_VARIANT`).
    Returns:
        ``out_RH``, written on torch's current stream (no synchronization).
    """
    if out_RH is None:
        out_RH = torch.empty(
            (index_R.shape[0], src_NH.shape[1]), dtype=src_NH.dtype, device=src_NH.device
        )
    _launch_index("gather", src_NH, index_R, out_RH, variant)
    return out_RH


def scatter_rows_cupy(
    src_RH: torch.Tensor,
    index_R: torch.Tensor,
    out_NH: torch.Tensor,
    *,
    variant: str | None = None,
) -> torch.Tensor:
    """Unpack on the GPU: ``out_NH[index_R[r]] = src_RH[r]``; other rows keep their contents.

    Args:
        src_RH: ``[R, H]`` CUDA rows (e.g. a received staging buffer).
        index_R: ``[R]`` int64 destination rows, distinct (duplicates: one of them wins).
        out_NH: ``[N, H]`` destination, the final layout (any row stride, rows contiguous).
        variant: a kernel variant from :data:`VARIANTS` (default :data:`DEFAULT_VARIANT`).
    Returns:
        ``out_NH``, written on torch's current stream (no synchronization).
    """
    _launch_index("scatter", src_RH, index_R, out_NH, variant)
    return out_NH


def copy_runs_cupy(
    src_NH: torch.Tensor,
    src_start_K: torch.Tensor,
    dst_start_K: torch.Tensor,
    length_K: torch.Tensor,
    out_MH: torch.Tensor,
    *,
    variant: str | None = None,
) -> torch.Tensor:
    """Block copies on the GPU: ``out_MH[dst_start[k] + j] = src_NH[src_start[k] + j]``.

    One launch for all K runs (no Python loop, no host sync: the kernel reads the total from a
    device-side prefix sum). Destination runs must not overlap each other or ``src_NH``.

    Args:
        src_NH: ``[N, H]`` CUDA rows.
        src_start_K, dst_start_K, length_K: ``[K]`` int64 on the same device.
        out_MH: ``[M, H]`` destination.
        variant: a kernel variant from :data:`VARIANTS` (default :data:`DEFAULT_VARIANT`).
    Returns:
        ``out_MH``, written on torch's current stream.
    """
    import numpy as np

    variant = _check_variant(variant)
    n_runs = length_K.shape[0]
    if n_runs == 0 or src_NH.shape[1] == 0 or src_NH.shape[0] == 0 or out_MH.shape[0] == 0:
        return out_MH
    width, vecs_per_row, src_stride, dst_stride = _geometry(src_NH, out_MH)
    device = src_NH.device
    kernel = get_kernel(_SOURCE, kernel_name("runs", variant, width), device)
    prefix_K1 = torch.zeros(n_runs + 1, dtype=torch.int64, device=device)
    torch.cumsum(length_K, 0, out=prefix_K1[1:])
    # destination runs do not overlap, so at most M rows are copied
    rows_bound = min(n_runs * src_NH.shape[0], out_MH.shape[0])
    grid = launch_grid(variant, rows_bound, vecs_per_row, _sm_count(device))
    with on_torch_stream(device):
        args = (
            to_cupy(_as_bytes(src_NH)),
            to_cupy(_as_bytes(out_MH)),
            to_cupy(src_start_K.contiguous()),
            to_cupy(dst_start_K.contiguous()),
            to_cupy(prefix_K1),
            np.int64(n_runs),
            np.int64(vecs_per_row),
            np.int64(src_stride),
            np.int64(dst_stride),
        )
        kernel((grid,), (BLOCK,), args)
    return out_MH
