"""Choosing between a CuPy kernel and its torch twin.

Why this file exists: every kernel in :mod:`mopd.kernels` has two implementations with the same
signature, a CuPy kernel for CUDA tensors and a torch twin (the CPU path and the reference). The
rule for which one runs lives here, once:

- ``"auto"``: CuPy when every tensor is on a CUDA device and ``import cupy`` works; the twin
  otherwise. Falling back to the twin *on CUDA tensors* (CuPy missing) logs a warning once per
  process; CPU tensors take the twin silently, that is the normal path.
- ``"cupy"``: an explicit request. CPU tensors raise ``ValueError``; a missing CuPy raises
  ``RuntimeError``. An explicit request is never quietly downgraded.
- ``"torch"``: always the twin.

A kernel whose source cannot be compiled (:class:`KernelCompileError`, raised before anything
is launched) is one more fallback: :func:`run_cupy_or_twin` runs the twin instead under ``"auto"``
and raises under ``"cupy"``.

Fallbacks anywhere in the kernels log through :func:`mopd.common.log.log_once`: one message per
cause per process.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Literal, TypeVar

import torch

from mopd.common.log import log_once

__all__ = [
    "BACKENDS",
    "Backend",
    "KernelCompileError",
    "Resolved",
    "cupy_available",
    "resolve_backend",
    "run_cupy_or_twin",
]

Backend = Literal["auto", "cupy", "torch"]
Resolved = Literal["cupy", "torch"]
BACKENDS: tuple[Backend, ...] = ("auto", "cupy", "torch")
T = TypeVar("T")

_log = logging.getLogger(__name__)


class KernelCompileError(RuntimeError):
    """A kernel source could not be built (NVRTC, then nvcc); remembered, never retried.

    Raised by :func:`mopd.kernels.cupy_loader.get_kernel` before anything is launched, so the
    caller can still run the torch twin instead (:func:`run_cupy_or_twin`).
    """


def run_cupy_or_twin(
    backend: str, op: str, cupy_call: Callable[[], T], twin_call: Callable[[], T]
) -> T:
    """``cupy_call()``; under ``backend="auto"`` a :class:`KernelCompileError` runs ``twin_call()``.

    For a call :func:`resolve_backend` already sent to CuPy. The fallback logs once per op;
    an explicit ``backend="cupy"`` re-raises. Both calls must take the same inputs and write
    the same outputs (a kernel and its twin).
    """
    try:
        return cupy_call()
    except KernelCompileError as exc:
        if backend == "cupy":
            raise
        log_once(_log, f"compile:{op}", "%s: %s; using the torch twin (logged once)", op, exc)
        return twin_call()


@functools.cache
def _cupy_import_error() -> str | None:
    """``None`` when ``import cupy`` works, else the reason it does not (checked once)."""
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # ImportError, or a broken CUDA install raising at import
        return f"{type(exc).__name__}: {exc}"
    return None


def cupy_available() -> bool:
    """Whether ``import cupy`` works in this process."""
    return _cupy_import_error() is None


def resolve_backend(backend: str, op: str, *tensors: torch.Tensor) -> Resolved:
    """The implementation to run for ``op`` on ``tensors`` under the request ``backend``.

    Args:
        backend: ``"auto"``, ``"cupy"`` or ``"torch"``.
        op: the public function's name, for messages.
        tensors: the data tensors the kernel reads and writes (any shapes).
    Raises:
        ValueError: unknown ``backend``, or ``"cupy"`` asked for non-CUDA tensors.
        RuntimeError: ``"cupy"`` asked for but ``import cupy`` fails.
    """
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    devices = sorted({str(t.device) for t in tensors})
    on_cuda = bool(tensors) and all(t.is_cuda for t in tensors)
    if backend == "cupy":
        if not on_cuda:
            raise ValueError(
                f"{op}: backend='cupy' needs CUDA tensors, got tensors on {devices}; "
                "use backend='auto' or 'torch' for CPU tensors"
            )
        reason = _cupy_import_error()
        if reason is not None:
            raise RuntimeError(f"{op}: backend='cupy' requested but CuPy is unusable ({reason})")
        return "cupy"
    if not on_cuda:
        return "torch"
    reason = _cupy_import_error()
    if reason is None:
        return "cupy"
    log_once(
        _log,
        op,
        "%s: CuPy is unusable (%s); falling back to the torch twin on %s (logged once)",
        op,
        reason,
        devices,
    )
    return "torch"
