"""CuPy launchers for the row kernels of ``rows.cu`` (pack, unpack, run copies).

Why this file exists: it turns torch tensors into a kernel launch (zero-copy through DLPack, on
torch's current stream, into outputs torch allocated) and owns the choices a launch needs: the
vector width a pair of row views allows, the variant, and the grid. The public entry points
with validation are in :mod:`mopd.kernels.rows`; the torch twins, with the same signatures, are
in :mod:`mopd.kernels.rows.torch_rows`.

Inputs here are already validated by :mod:`mopd.kernels.rows` (2-D row views whose rows are
contiguous, int64 indices in range, same device and dtype). Data is moved as bytes, so any dtype
works (bf16, fp16, fp32, int8, ...): each ``[rows, H]`` tensor is viewed as ``[rows, H * itemsize]``
``uint8`` before it crosses DLPack (CuPy before 14 cannot take bf16 through DLPack).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from mopd.common.log import log_once
from mopd.kernels.cupy_loader import get_kernel, on_torch_stream, to_cupy

__all__ = [
    "BLOCK",
    "BLOCKS_PER_SM",
    "DEFAULT_VARIANTS",
    "OPS",
    "VARIANTS",
    "VARIANT_SPECS",
    "Variant",
    "copy_runs_cupy",
    "default_variant",
    "gather_rows_cupy",
    "kernel_name",
    "launch_block",
    "launch_grid",
    "resolve_variant",
    "scatter_rows_cupy",
    "set_default_variants",
    "vector_bytes",
]

_SOURCE = "rows/rows.cu"
_log = logging.getLogger(__name__)

#: Threads per block of the vector kernels (``MOPD_BLOCK`` in rows.cu, their launch bounds).
BLOCK = 256
#: Resident blocks per SM at full occupancy (2048 threads per SM on sm_80/sm_90).
BLOCKS_PER_SM = 8
#: Largest grid.x a launch may have.
_MAX_GRID = 2**31 - 1
#: The public operations, as named in :data:`DEFAULT_VARIANTS` (rows.cu calls copy_runs "runs").
OPS: tuple[str, ...] = ("gather", "scatter", "copy_runs")
#: Group kinds: a row chunk per thread, warp or block; flat (torch's copy shape); bulk copies.
_THREAD, _WARP, _BLOCK, _FLAT, _BULK = range(5)


@dataclass(frozen=True, kw_only=True)
class Variant:
    """How one named variant launches: which kernel of rows.cu and what grid.

    ``kernel`` names the ``X(...)`` entry of ``MOPD_VARIANTS`` (or ``MOPD_BULK_VARIANTS``) in
    rows.cu; ``kind`` and ``unroll`` mirror it: 0, 1, 2: a group per row chunk is a thread, a
    warp or a block, each lane moving ``unroll`` vectors; 3: flat, each thread ``unroll``
    vectors of a flat numbering of all the rows' vectors (torch's copy shape); 4: bulk copies
    through shared memory, ``piece`` bytes per item, one warp per block. ``persistent``: at most
    ``blocks_per_sm`` blocks per SM that loop over the items; otherwise one group per item.
    ``fallback``: for bulk variants, the vector variant launched where bulk copies cannot run
    (a row width, address or stride not a multiple of 16 bytes, or a device before sm_90).
    """

    kernel: str
    kind: int
    unroll: int = 1
    persistent: bool = True
    blocks_per_sm: int = BLOCKS_PER_SM
    piece: int = 0
    fallback: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in range(5) or self.unroll < 1 or self.blocks_per_sm < 1:
            raise ValueError(
                f"bad variant geometry: kind={self.kind}, unroll={self.unroll}, "
                f"blocks_per_sm={self.blocks_per_sm}"
            )
        bulk = self.kind == _BULK
        if bulk != (self.piece > 0) or bulk != (self.fallback is not None):
            raise ValueError(
                f"piece and fallback are for bulk variants (kind 4) only, and required there: "
                f"kind={self.kind}, piece={self.piece}, fallback={self.fallback!r}"
            )
        if bulk and self.piece % 16:
            raise ValueError(f"bulk piece must be a multiple of 16 bytes, got {self.piece}")

    @property
    def block(self) -> int:
        """Threads per block of this variant's kernels."""
        return 32 if self.kind == _BULK else BLOCK


#: Variant name -> launch recipe. The kernels mirror MOPD_VARIANTS / MOPD_BULK_VARIANTS in
#: rows.cu, which says what each does and why.
VARIANT_SPECS: dict[str, Variant] = {
    # naive grid-stride: one 16-byte vector per item, plain loads and stores (the baseline)
    "grid": Variant(kernel="grid", kind=_THREAD),
    # a warp per row chunk, 4 x 16-byte loads in flight per lane, plain loads and stores
    "warp": Variant(kernel="warp", kind=_WARP, unroll=4),
    # same, streaming (evict-first) loads and stores
    "warp_cs": Variant(kernel="warp_cs", kind=_WARP, unroll=4),
    # same as warp_cs, but one warp per chunk (no persistent loop; the block scheduler balances)
    "warp_cs_flat": Variant(kernel="warp_cs", kind=_WARP, unroll=4, persistent=False),
    # read-only loads that skip L1, streaming stores
    "warp_nc": Variant(kernel="warp_nc", kind=_WARP, unroll=4),
    # a warp per row chunk, 8 x 16-byte loads in flight per lane, streaming
    "warp8_cs": Variant(kernel="warp8_cs", kind=_WARP, unroll=8),
    # a warp per 8 KiB chunk (16 loads per lane before the stores), one warp per chunk
    "warp16": Variant(kernel="warp16", kind=_WARP, unroll=16, persistent=False),
    # a warp per 16 KiB chunk (a whole H = 8192 bf16 row), one warp per chunk
    "warp32": Variant(kernel="warp32", kind=_WARP, unroll=32, persistent=False),
    # a block per row chunk (16 KiB chunks), streaming
    "block_cs": Variant(kernel="block_cs", kind=_BLOCK, unroll=4),
    # torch's copy shape: 4 vectors per thread, block_dim apart, non-persistent
    "flat": Variant(kernel="flat", kind=_FLAT, unroll=4, persistent=False),
    # same, streaming
    "flat_cs": Variant(kernel="flat_cs", kind=_FLAT, unroll=4, persistent=False),
    # same, 8 vectors per thread
    "flat8": Variant(kernel="flat8", kind=_FLAT, unroll=8, persistent=False),
    # Hopper bulk copies through shared memory: 8 KiB pieces, 4 stages; 32 KiB of shared
    # memory per one-warp block, so 6 blocks per SM (228 KiB per SM, 1 KiB reserved per block)
    "bulk": Variant(kernel="bulk", kind=_BULK, piece=8192, blocks_per_sm=6, fallback="warp"),
    # same, 16 KiB pieces (whole H = 8192 bf16 rows), 2 stages
    "bulk16": Variant(kernel="bulk16", kind=_BULK, piece=16384, blocks_per_sm=6, fallback="warp"),
}
VARIANTS: tuple[str, ...] = tuple(VARIANT_SPECS)
#: The variant each op uses when none is named (keys: :data:`OPS`). Chosen from
#: profiling/bench/kernels.py on an H200 (its summary line prints the winners in this form);
#: the ops may differ. Round 1 (2026-11-30): ``warp`` led gather and scatter on random indices,
#: ``warp_cs_flat`` led copy_runs.
DEFAULT_VARIANTS: dict[str, str] = {
    "gather": "warp",
    "scatter": "warp",
    "copy_runs": "warp_cs_flat",
}


def set_default_variants(variants: dict[str, str]) -> dict[str, str]:
    """Change the variant ops use when none is named, for this process; returns the old ones.

    For a GPU other than the one :data:`DEFAULT_VARIANTS` was tuned on: run
    ``python -m mopd.profiling.bench.kernels`` there and pass the dict its summary prints.

    Args:
        variants: ``op -> variant`` for some or all of :data:`OPS`.
    Raises:
        ValueError: an unknown op or variant (nothing is changed then).
    """
    bad_ops = sorted(set(variants) - set(OPS))
    bad_variants = sorted(v for v in variants.values() if v not in VARIANT_SPECS)
    if bad_ops or bad_variants:
        raise ValueError(
            f"set_default_variants: unknown op(s) {bad_ops} (ops: {OPS}) or variant(s) "
            f"{bad_variants} (variants: {VARIANTS})"
        )
    old = dict(DEFAULT_VARIANTS)
    DEFAULT_VARIANTS.update(variants)
    return old


def default_variant(op: str) -> str:
    """The variant ``op`` (one of :data:`OPS`) uses when none is named."""
    if op not in DEFAULT_VARIANTS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    return DEFAULT_VARIANTS[op]


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


def resolve_variant(variant: str, width: int, capability: tuple[int, int]) -> str:
    """The variant that actually launches for ``variant`` at vector ``width`` on a device.

    Vector variants launch as named. A bulk variant launches as named when ``width == 16``
    (16-byte aligned rows, strides and bases) on sm_90+, else as its vector ``fallback``.

    Args:
        variant: a name in :data:`VARIANTS`.
        width: the vector width :func:`vector_bytes` chose.
        capability: the device's (major, minor) compute capability.
    """
    spec = VARIANT_SPECS[variant]
    if spec.fallback is None or (width == 16 and capability >= (9, 0)):
        return variant
    return spec.fallback


def launch_grid(variant: str, rows_bound: int, vecs_per_row: int, sm_count: int) -> int:
    """Blocks to launch: enough for the work; at most ``blocks_per_sm * sm_count`` if persistent.

    Args:
        variant: a name in :data:`VARIANTS` (as launched: see :func:`resolve_variant`).
        rows_bound: an upper bound on the rows to copy.
        vecs_per_row: vectors per row (16-byte vectors for a bulk variant).
        sm_count: multiprocessors on the device.
    """
    spec = VARIANT_SPECS[variant]
    if spec.kind == _FLAT:
        blocks = -(-rows_bound * vecs_per_row // (BLOCK * spec.unroll))
    elif spec.kind == _BULK:
        blocks = rows_bound * -(-vecs_per_row * 16 // spec.piece)  # one item per block
    else:
        group_size = (1, 32, BLOCK)[spec.kind]
        groups_per_block = BLOCK // group_size
        chunks = -(-vecs_per_row // (group_size * spec.unroll))
        blocks = -(-rows_bound * chunks // groups_per_block)
    cap = spec.blocks_per_sm * sm_count if spec.persistent else _MAX_GRID
    return max(1, min(blocks, cap))


def launch_block(variant: str) -> int:
    """Threads per block for ``variant`` (as launched)."""
    return VARIANT_SPECS[variant].block


def kernel_name(op: str, variant: str, width: int) -> str:
    """The rows.cu kernel for ``op`` (gather, scatter, runs), ``variant`` and vector ``width``.

    ``variant`` is the one that launches (:func:`resolve_variant`); a bulk variant names a
    kernel only at width 16 (the others are its fallback's).
    """
    spec = VARIANT_SPECS[variant]
    if spec.kind == _BULK and width != 16:
        spec = VARIANT_SPECS[spec.fallback or ""]
    return f"mopd_{op}_{spec.kernel}_v{width}"


@functools.cache
def _device_facts(device_index: int) -> tuple[int, tuple[int, int]]:
    props = torch.cuda.get_device_properties(device_index)
    return props.multi_processor_count, (props.major, props.minor)


def _plan(op: str, variant: str | None, width: int, device: torch.device) -> tuple[str, int, int]:
    """(launched variant, SM count, threads per block) for ``op`` on ``device``.

    Raises ``ValueError`` when a bulk variant is named explicitly on a device before sm_90; a
    default that cannot run there falls back to its vector variant, logged once.
    """
    index = torch.cuda.current_device() if device.index is None else device.index
    sm_count, capability = _device_facts(index)
    public_op = "copy_runs" if op == "runs" else op
    named = _check_variant(variant, public_op)
    spec = VARIANT_SPECS[named]
    if spec.fallback is not None and capability < (9, 0):
        if variant is not None:
            raise ValueError(
                f"variant {variant!r} needs an sm_90+ device (bulk copies), "
                f"{device} is sm_{capability[0]}{capability[1]}"
            )
        log_once(
            _log,
            public_op,
            "%s: default variant %r needs sm_90+, %s is sm_%d%d; using %r (logged once)",
            public_op,
            named,
            device,
            *capability,
            spec.fallback,
        )
    launched = resolve_variant(named, width, capability)
    return launched, sm_count, launch_block(launched)


def _defines(launched: str) -> tuple[str, ...]:
    """The rows.cu kernel set holding ``launched``'s kernels (MOPD_KERNEL_SET: 1 vector, 2 bulk).

    Two NVRTC modules, so that a bulk kernel failing to compile costs the bulk variants only.
    """
    return (
        ("MOPD_KERNEL_SET=2",) if VARIANT_SPECS[launched].kind == _BULK else ("MOPD_KERNEL_SET=1",)
    )


def _check_variant(variant: str | None, op: str) -> str:
    variant = default_variant(op) if variant is None else variant
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
    """(vector bytes, vectors per row, src row stride, out row stride), strides in bytes.

    The stride of a one-row tensor is never used (only row 0 is read or written) and torch may
    report any value for a size-1 dim (e.g. 1): it is taken as ``row_bytes``, so that it does
    not narrow the vector width.
    """
    itemsize = src_NH.element_size()
    row_bytes = src_NH.shape[1] * itemsize
    src_stride = row_bytes if src_NH.shape[0] == 1 else src_NH.stride(0) * itemsize
    dst_stride = row_bytes if out_MH.shape[0] == 1 else out_MH.stride(0) * itemsize
    width = vector_bytes(row_bytes, src_NH.data_ptr(), out_MH.data_ptr(), src_stride, dst_stride)
    return width, row_bytes // width, src_stride, dst_stride


def _launch_index(
    op: str, src: torch.Tensor, index_R: torch.Tensor, out: torch.Tensor, variant: str | None
) -> None:
    """Gather (``op="gather"``) or scatter (``"scatter"``) rows; see rows.cu for the math."""
    import numpy as np

    _check_variant(variant, op)
    rows = index_R.shape[0]
    if rows == 0 or src.shape[1] == 0:
        return
    width, vecs_per_row, src_stride, dst_stride = _geometry(src, out)
    device = src.device
    launched, sm_count, block = _plan(op, variant, width, device)
    kernel = get_kernel(
        _SOURCE, kernel_name(op, launched, width), device, defines=_defines(launched)
    )
    index_R = index_R.contiguous()
    grid = launch_grid(launched, rows, vecs_per_row, sm_count)
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
        kernel((grid,), (block,), args)


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
        variant: a kernel variant from :data:`VARIANTS` (default: :data:`DEFAULT_VARIANTS`).
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
        index_R: ``[R]`` int64 destination rows, distinct (with repeats the row's contents
            are unspecified: a mix of the competing rows is possible, not one of them whole).
        out_NH: ``[N, H]`` destination, the final layout (any row stride, rows contiguous).
        variant: a kernel variant from :data:`VARIANTS` (default: :data:`DEFAULT_VARIANTS`).
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
    num_rows: int | None = None,
    variant: str | None = None,
) -> torch.Tensor:
    """Block copies on the GPU: ``out_MH[dst_start[k] + j] = src_NH[src_start[k] + j]``.

    One launch for all K runs (no Python loop, no host sync: the kernel reads the total from a
    device-side prefix sum). Destination runs must not overlap each other or ``src_NH``.

    Args:
        src_NH: ``[N, H]`` CUDA rows.
        src_start_K, dst_start_K, length_K: ``[K]`` int64 on the same device.
        out_MH: ``[M, H]`` destination.
        num_rows: ``sum(length_K)`` if known: sizes the grid to the work. ``None``: the grid is
            sized from a bound (``min(K * N, M)`` rows). Here only a grid hint (the kernels
            loop over the device-side total); the bridge's :func:`mopd.kernels.rows.copy_runs`
            requires it exact.
        variant: a kernel variant from :data:`VARIANTS` (default: :data:`DEFAULT_VARIANTS`).
    Returns:
        ``out_MH``, written on torch's current stream.
    """
    import numpy as np

    _check_variant(variant, "copy_runs")
    n_runs = length_K.shape[0]
    if n_runs == 0 or src_NH.shape[1] == 0 or src_NH.shape[0] == 0 or out_MH.shape[0] == 0:
        return out_MH
    width, vecs_per_row, src_stride, dst_stride = _geometry(src_NH, out_MH)
    device = src_NH.device
    launched, sm_count, block = _plan("runs", variant, width, device)
    kernel = get_kernel(
        _SOURCE, kernel_name("runs", launched, width), device, defines=_defines(launched)
    )
    if num_rows is not None:
        rows_bound = num_rows
    else:  # destination runs do not overlap, so at most M rows are copied
        rows_bound = min(n_runs * src_NH.shape[0], out_MH.shape[0])
    prefix_K1 = torch.zeros(n_runs + 1, dtype=torch.int64, device=device)
    torch.cumsum(length_K, 0, out=prefix_K1[1:])
    grid = launch_grid(launched, rows_bound, vecs_per_row, sm_count)
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
        kernel((grid,), (block,), args)
    return out_MH
