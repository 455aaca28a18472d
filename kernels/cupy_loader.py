"""Loading the ``.cu`` sources of :mod:`mopd.kernels` into CuPy, compiled once and cached.

Why this file exists: the CUDA sources live as ``.cu`` files next to the Python code of their
family, ``kl/`` and ``rows/`` (so nvcc can check them, see tests/launch/test_kernels_compile.py);
CuPy compiles them with NVRTC on first use (and keeps the binary in its on-disk kernel cache).
This module, shared by both families, is the one place that reads a source, builds the
``cupy.RawModule`` and hands out kernels per device, and the one place that bridges torch's CUDA
stream and tensors to CuPy.

CuPy is imported lazily, inside the functions: importing this module never needs CuPy.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from mopd.common.log import log_once
from mopd.kernels.backend import KernelCompileError

__all__ = ["get_kernel", "kernel_source", "on_torch_stream", "to_cupy"]

_lock = threading.Lock()
_log = logging.getLogger(__name__)

#: (file, device, compiler, defines) -> the error its build raised: CuPy does not remember a
#: failed compile, and every kernel name of the module would otherwise compile it again.
_failures: dict[tuple[str, int, str, tuple[str, ...]], KernelCompileError] = {}


def kernel_source(filename: str) -> str:
    """The text of ``kernels/<filename>`` (a path under kernels/, e.g. ``"rows/rows.cu"``)."""
    return (Path(__file__).resolve().parent / filename).read_text()


@functools.cache
def _module(filename: str, device_index: int, compiler: str, defines: tuple[str, ...] = ()) -> Any:
    import cupy

    options = tuple(f"-D{d}" for d in defines)
    with cupy.cuda.Device(device_index):
        return cupy.RawModule(code=kernel_source(filename), backend=compiler, options=options)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else repr(exc)


def _function(
    filename: str, name: str, device_index: int, compiler: str, defines: tuple[str, ...]
) -> Any:
    """``name`` from the module built by ``compiler``; a failed build is remembered and re-raised."""
    key = (filename, device_index, compiler, defines)
    failed = _failures.get(key)
    if failed is not None:
        raise failed
    try:
        return _module(filename, device_index, compiler, defines).get_function(name)
    except Exception as exc:  # CompileException, a missing compiler (OSError), a driver error
        err = KernelCompileError(
            f"{compiler} could not build {filename} {list(defines)} for {name}: {_first_line(exc)}"
        )
        _failures[key] = err
        raise err from exc


@functools.cache
def _kernel(filename: str, name: str, device_index: int, defines: tuple[str, ...] = ()) -> Any:
    import cupy

    with cupy.cuda.Device(device_index):
        try:
            return _function(filename, name, device_index, "nvrtc", defines)
        except KernelCompileError as exc:
            # The sources are checked with nvcc (tier 1); should NVRTC disagree, use nvcc.
            log_once(_log, f"{filename} {defines} {device_index}", "%s; compiling with nvcc", exc)
            return _function(filename, name, device_index, "nvcc", defines)


def get_kernel(
    filename: str, name: str, device: torch.device, *, defines: tuple[str, ...] = ()
) -> Any:
    """The ``cupy.RawKernel`` ``name`` of ``kernels/<filename>`` on CUDA ``device`` (``filename``
    is a path under kernels/, e.g. ``"kl/kl_kernels.cu"``).

    Compiled on first use (NVRTC, or CuPy's on-disk cache; nvcc if NVRTC fails, with a
    warning), then kept for the process. ``defines`` (``"NAME=VALUE"`` or ``"NAME"``) are
    passed as ``-D`` options: each distinct tuple is its own module, so a source can be built
    in parts that fail to compile independently.

    Raises:
        KernelCompileError: neither compiler could build the module (or ``name`` is not in
            it); the failure is remembered for the process.
    """
    index = torch.cuda.current_device() if device.index is None else device.index
    with _lock:
        return _kernel(filename, name, index, defines)


@contextmanager
def on_torch_stream(device: torch.device) -> Iterator[Any]:
    """Make torch's current stream on ``device`` CuPy's current stream (and device).

    Kernels launched and DLPack exchanges made inside run in torch's stream order, with no
    synchronization added: CuPy passes this same stream to ``__dlpack__``, so torch has nothing
    to wait for.
    """
    import cupy

    index = torch.cuda.current_device() if device.index is None else device.index
    stream_ptr = torch.cuda.current_stream(index).cuda_stream
    with cupy.cuda.Device(index):
        stream = cupy.cuda.ExternalStream(stream_ptr)
        with stream:
            yield stream


def to_cupy(tensor: torch.Tensor) -> Any:
    """Zero-copy CuPy view of a CUDA tensor, through DLPack (call inside :func:`on_torch_stream`).

    Dtypes CuPy may not take through DLPack (bf16 before CuPy 14) must be viewed by width first,
    e.g. as ``torch.uint8``; the row kernels always pass bytes. The tensor is detached first
    (torch refuses to export tensors that require grad; kernels work outside autograd).
    """
    import cupy

    return cupy.from_dlpack(tensor.detach())
