"""Row movement between a tensor's rows and contiguous staging buffers.

Why this file exists: every bridge exchange packs rows of a local buffer into per-peer staging
buffers and unpacks received rows into the student's layout. These are the entry points the
bridge calls; each one has a CuPy kernel (on CUDA tensors, :mod:`mopd.kernels.rows.cupy_rows`) and a
torch twin with the same signature (the CPU path and the reference,
:mod:`mopd.kernels.rows.torch_rows`). Which one runs is decided by :mod:`mopd.kernels.backend`.
Inputs are validated here, once, before either runs, with the same ``ValueError`` on every rank.

All tensors are 2-D row views ``[rows, H]``: a ``[S, B, H]`` buffer is passed as its
``view(-1, H)`` (row ``s * B + b``), so the callers speak in flat row indices. Rows must be
contiguous in memory (``stride(1) == 1``); the row stride is free, so a column slice or a
view starting mid-buffer is fine. A ``[S, B, H] -> [B, S, H]`` transpose, CP zigzag or THD
packing is one gather or scatter with the right index: the receiver writes straight into its
final layout in one pass. Any dtype works (rows are moved as bytes). Source and destination
must not share memory (``ValueError``; :func:`rows_overlap`): the kernels read and write in
parallel. Should CuPy fail to compile a kernel, ``backend="auto"`` runs the twin (logged once).

Bounds: ``check_bounds=True`` (the default) checks index values, which on CUDA costs one device
sync; a caller whose indices come from a validated, cached plan (the bridge) passes ``False``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from mopd.kernels.backend import Backend, resolve_backend, run_cupy_or_twin
from mopd.kernels.rows.cupy_rows import (
    VARIANTS,
    copy_runs_cupy,
    gather_rows_cupy,
    scatter_rows_cupy,
)
from mopd.kernels.rows.torch_rows import copy_runs_torch, gather_rows_torch, scatter_rows_torch

__all__ = ["VARIANTS", "copy_runs", "gather_rows", "rows_overlap", "scatter_rows"]


def _check_rows(name: str, t: torch.Tensor, *, written: bool = False) -> None:
    """``t`` is a 2-D row view with contiguous rows (and, if written, rows that do not overlap)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, H], got shape {tuple(t.shape)}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(
            f"{name} rows must be contiguous (stride(1) == 1), got shape {tuple(t.shape)} "
            f"strides {t.stride()}; pass a view with contiguous rows or call .contiguous()"
        )
    if written and t.shape[0] > 1 and t.stride(0) < t.shape[1]:
        raise ValueError(
            f"{name} is written but its rows overlap: shape {tuple(t.shape)} strides {t.stride()}"
        )


def _check_pair(a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    """Same dtype, device and row width."""
    if a.dtype != b.dtype:
        raise ValueError(f"{a_name} is {a.dtype} but {b_name} is {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"{a_name} is on {a.device} but {b_name} is on {b.device}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(
            f"row widths differ: {a_name} has H={a.shape[1]}, {b_name} has H={b.shape[1]}"
        )


def _check_int64(name: str, t: torch.Tensor, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int64:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        dtype = t.dtype if isinstance(t, torch.Tensor) else None
        raise ValueError(f"{name} must be a 1-D int64 tensor, got shape {shape} dtype {dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, data is on {device}")


def _check_index(
    name: str, index_R: torch.Tensor, limit: int, device: torch.device, check_bounds: bool
) -> None:
    _check_int64(name, index_R, device)
    if check_bounds and index_R.numel():
        lo, hi = torch.stack(torch.aminmax(index_R)).tolist()  # one host read
        if lo < 0 or hi >= limit:
            raise ValueError(
                f"{name} out of range: values in [{lo}, {hi}], valid range is [0, {limit})"
            )


def _check_variant(variant: str | None) -> None:
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"variant must be None or one of {VARIANTS}, got {variant!r}")


def rows_overlap(a_NH: torch.Tensor, b_MH: torch.Tensor) -> bool:
    """Whether two row views (``[N, H]`` / ``[M, H']``, ``stride(1) == 1``) share a byte.

    Besides the byte spans, views whose rows repeat with one period (one row stride, or a
    single row against many) and whose column ranges are disjoint (e.g. two halves of the same
    rows) do not overlap. Different devices or an empty view: no overlap.
    """
    if a_NH.device != b_MH.device or a_NH.numel() == 0 or b_MH.numel() == 0:
        return False
    if a_NH.device.type not in ("cpu", "cuda"):
        return False
    size = a_NH.element_size()
    a0, b0 = a_NH.data_ptr(), b_MH.data_ptr()
    a_w, b_w = a_NH.shape[1] * size, b_MH.shape[1] * b_MH.element_size()
    a_s, b_s = a_NH.stride(0) * size, b_MH.stride(0) * b_MH.element_size()
    a1 = a0 + (a_NH.shape[0] - 1) * a_s + a_w
    b1 = b0 + (b_MH.shape[0] - 1) * b_s + b_w
    if a1 <= b0 or b1 <= a0:
        return False
    # rows repeat with one period (a one-row view takes the other's): compare column ranges
    a_rows, b_rows = a_NH.shape[0], b_MH.shape[0]
    if a_rows > 1 and b_rows > 1:
        period = a_s if a_s == b_s else 0
    else:
        period = b_s if b_rows > 1 else (a_s if a_rows > 1 else 0)
    if period and a_w <= period and b_w <= period:
        d = (b0 - a0) % period  # b's columns start d bytes into a's row period
        return not (a_w <= d and d + b_w <= period)
    return True


def _dispatch(
    backend: Backend,
    op: str,
    variant: str | None,
    pair: tuple[str, torch.Tensor, str, torch.Tensor],
    cupy_call: Callable[[], torch.Tensor],
    twin_call: Callable[[], torch.Tensor],
) -> torch.Tensor:
    """The last steps of every entry point: source and destination (``pair``: names and
    tensors) must not overlap, then the CuPy kernel or its twin runs (:func:`_pick`,
    :func:`~mopd.kernels.backend.run_cupy_or_twin`)."""
    src_name, src, out_name, out = pair
    _check_disjoint(src_name, src, out_name, out)
    if _pick(backend, op, variant, src, out) == "cupy":
        return run_cupy_or_twin(backend, op, cupy_call, twin_call)
    return twin_call()


def _check_disjoint(src_name: str, src: torch.Tensor, out_name: str, out: torch.Tensor) -> None:
    if rows_overlap(src, out):
        raise ValueError(
            f"{out_name} overlaps {src_name} in memory ({out_name} at {out.data_ptr():#x}, "
            f"shape {tuple(out.shape)}, strides {out.stride()}; {src_name} at "
            f"{src.data_ptr():#x}, shape {tuple(src.shape)}, strides {src.stride()}): the "
            "kernels read and write in parallel, so the result would depend on timing; "
            "copy through a separate buffer"
        )


def _pick(backend: Backend, op: str, variant: str | None, *tensors: torch.Tensor) -> str:
    resolved = resolve_backend(backend, op, *tensors)
    if resolved == "torch" and variant is not None:
        warnings.warn(
            f"{op}: variant={variant!r} is ignored, the torch twin runs (backend={backend!r}, "
            f"device {tensors[0].device})",
            stacklevel=4,  # the caller of the public function (via _dispatch)
        )
    return resolved


def gather_rows(
    src_NH: torch.Tensor,
    index_R: torch.Tensor,
    *,
    out_RH: torch.Tensor | None = None,
    backend: Backend = "auto",
    variant: str | None = None,
    check_bounds: bool = True,
) -> torch.Tensor:
    """Pack: ``out_RH[r] = src_NH[index_R[r]]``.

    Args:
        src_NH: ``[N, H]`` source rows (``stride(1) == 1``, any row stride, any dtype).
        index_R: ``[R]`` int64 row indices into ``src_NH``, on its device (repeats allowed).
        out_RH: optional ``[R, H]`` destination (same dtype and device); allocated if ``None``.
        backend: ``"auto"``, ``"cupy"`` or ``"torch"`` (see :mod:`mopd.kernels.backend`).
        variant: CuPy kernel variant (:data:`VARIANTS`); ``None`` for the op's default
            (``cupy_rows.DEFAULT_VARIANTS``).
        check_bounds: check index values (one device sync on CUDA).
    Returns:
        ``out_RH``.
    Raises:
        ValueError: bad shapes, strides, dtypes, devices, index dtype or values, or variant.
    """
    _check_rows("src_NH", src_NH)
    _check_index("index_R", index_R, src_NH.shape[0], src_NH.device, check_bounds)
    _check_variant(variant)
    if out_RH is None:
        out_RH = torch.empty(
            (index_R.shape[0], src_NH.shape[1]), dtype=src_NH.dtype, device=src_NH.device
        )
    _check_rows("out_RH", out_RH, written=True)
    _check_pair("src_NH", src_NH, "out_RH", out_RH)
    if out_RH.shape[0] != index_R.shape[0]:
        raise ValueError(
            f"out_RH has {out_RH.shape[0]} rows but index_R has {index_R.shape[0]} entries"
        )
    return _dispatch(
        backend,
        "gather_rows",
        variant,
        ("src_NH", src_NH, "out_RH", out_RH),
        lambda: gather_rows_cupy(src_NH, index_R, out_RH=out_RH, variant=variant),
        lambda: gather_rows_torch(src_NH, index_R, out_RH=out_RH),
    )


def scatter_rows(
    src_RH: torch.Tensor,
    index_R: torch.Tensor,
    out_NH: torch.Tensor,
    *,
    backend: Backend = "auto",
    variant: str | None = None,
    check_bounds: bool = True,
) -> torch.Tensor:
    """Unpack: ``out_NH[index_R[r]] = src_RH[r]``; rows not named keep their contents.

    Args:
        src_RH: ``[R, H]`` rows (e.g. a received staging buffer).
        index_R: ``[R]`` int64 destination rows, distinct (with repeats a row's contents are
            unspecified, possibly a mix of the competing rows), on the data's device.
        out_NH: ``[N, H]`` destination in its final layout, written in place.
        backend: ``"auto"``, ``"cupy"`` or ``"torch"``.
        variant: CuPy kernel variant (:data:`VARIANTS`); ``None`` for the op's default
            (``cupy_rows.DEFAULT_VARIANTS``).
        check_bounds: check index values (one device sync on CUDA).
    Returns:
        ``out_NH``.
    Raises:
        ValueError: as :func:`gather_rows`.
    """
    _check_rows("src_RH", src_RH)
    _check_rows("out_NH", out_NH, written=True)
    _check_pair("src_RH", src_RH, "out_NH", out_NH)
    _check_index("index_R", index_R, out_NH.shape[0], out_NH.device, check_bounds)
    _check_variant(variant)
    if src_RH.shape[0] != index_R.shape[0]:
        raise ValueError(
            f"src_RH has {src_RH.shape[0]} rows but index_R has {index_R.shape[0]} entries"
        )
    return _dispatch(
        backend,
        "scatter_rows",
        variant,
        ("src_RH", src_RH, "out_NH", out_NH),
        lambda: scatter_rows_cupy(src_RH, index_R, out_NH, variant=variant),
        lambda: scatter_rows_torch(src_RH, index_R, out_NH),
    )


def copy_runs(
    src_NH: torch.Tensor,
    src_start_K: torch.Tensor,
    dst_start_K: torch.Tensor,
    length_K: torch.Tensor,
    out_MH: torch.Tensor,
    *,
    num_rows: int | None = None,
    backend: Backend = "auto",
    variant: str | None = None,
    check_bounds: bool = True,
) -> torch.Tensor:
    """Block copy: ``out_MH[dst_start[k] : dst_start[k] + length[k]] = src_NH[src_start[k] : ...]``.

    The run form of a plan (contiguous runs of rows): one launch for all runs on CUDA, no
    Python loop and no host sync.

    Args:
        src_NH: ``[N, H]`` source rows.
        src_start_K, dst_start_K, length_K: ``[K]`` int64 run starts and lengths (lengths
            ``>= 0``), on the data's device. Destination runs must not overlap each other, and
            ``out_MH`` must not overlap ``src_NH``.
        out_MH: ``[M, H]`` destination, written in place.
        num_rows: ``sum(length_K)`` when the caller knows it (a plan does): the CUDA grid is
            sized to it and the torch twin skips its host read of the total (a device sync on
            CUDA). Must be exact: checked with ``check_bounds``, otherwise a wrong value is
            undefined behaviour (the twin may raise). ``None``: the kernel reads the total on
            the device and sizes its grid from a bound.
        backend: ``"auto"``, ``"cupy"`` or ``"torch"``.
        variant: CuPy kernel variant (:data:`VARIANTS`); ``None`` for the op's default
            (``cupy_rows.DEFAULT_VARIANTS``).
        check_bounds: check run bounds and ``num_rows`` (one device sync on CUDA).
    Returns:
        ``out_MH``.
    Raises:
        ValueError: bad shapes, strides, dtypes, devices, run arrays or bounds, or variant.
    """
    _check_rows("src_NH", src_NH)
    _check_rows("out_MH", out_MH, written=True)
    _check_pair("src_NH", src_NH, "out_MH", out_MH)
    for name, t in (
        ("src_start_K", src_start_K),
        ("dst_start_K", dst_start_K),
        ("length_K", length_K),
    ):
        _check_int64(name, t, src_NH.device)
    if not src_start_K.shape[0] == dst_start_K.shape[0] == length_K.shape[0]:
        raise ValueError(
            f"run arrays differ in length: src_start_K {src_start_K.shape[0]}, "
            f"dst_start_K {dst_start_K.shape[0]}, length_K {length_K.shape[0]}"
        )
    _check_variant(variant)
    if num_rows is not None and (
        isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 0
    ):
        raise ValueError(f"num_rows must be a non-negative int or None, got {num_rows!r}")
    if num_rows and not length_K.numel():
        raise ValueError(f"num_rows={num_rows} but there are no runs (length_K is empty)")
    if check_bounds and length_K.numel():
        src_end_K = src_start_K + length_K
        dst_end_K = dst_start_K + length_K
        facts = torch.stack(
            [
                length_K.min(),
                src_start_K.min(),
                dst_start_K.min(),
                src_end_K.max(),
                dst_end_K.max(),
                length_K.sum(),
            ]
        ).tolist()  # one host read
        min_len, min_src, min_dst, max_src_end, max_dst_end, total = facts
        if min_len < 0:
            raise ValueError(f"length_K has a negative run length ({min_len})")
        if num_rows is not None and num_rows != total:
            raise ValueError(f"num_rows={num_rows} but the runs hold {total} rows")
        if min_src < 0 or max_src_end > src_NH.shape[0]:
            raise ValueError(
                f"source runs out of range: starts >= {min_src}, ends <= {max_src_end}, "
                f"src_NH has {src_NH.shape[0]} rows"
            )
        if min_dst < 0 or max_dst_end > out_MH.shape[0]:
            raise ValueError(
                f"destination runs out of range: starts >= {min_dst}, ends <= {max_dst_end}, "
                f"out_MH has {out_MH.shape[0]} rows"
            )
    args = (src_NH, src_start_K, dst_start_K, length_K, out_MH)
    return _dispatch(
        backend,
        "copy_runs",
        variant,
        ("src_NH", src_NH, "out_MH", out_MH),
        lambda: copy_runs_cupy(*args, num_rows=num_rows, variant=variant),
        lambda: copy_runs_torch(*args, num_rows=num_rows),
    )
