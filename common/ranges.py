"""Named profiler ranges on every pipeline phase, seen by both nsys (NVTX) and torch.profiler.

Why this file exists: the pipeline (capture, gather, plan, pack, send/recv, unpack, projection,
loss chunks) has to be legible on an Nsight Systems timeline and in a torch.profiler trace, without
costing anything in a training step when nobody is profiling. This module is the one switch: off
by default, a ``with span("pack"):`` then costs one global boolean test and returns a shared null
context (no allocation, no new object); on, it pushes an NVTX range and, while a torch profiler
is collecting, a ``torch.profiler.record_function`` range, named ``mopd/<phase>`` or
``mopd/<phase>:<detail>``.

Turn it on with :func:`enable` or by setting ``MOPD_NVTX=1`` in the environment before import.
NVTX goes through the ``nvtx`` package when it is installed, else through ``torch.cuda.nvtx`` when
CUDA is available, else nowhere (torch.profiler still sees the ranges); the choice is logged once.

Usage::

    from mopd.common import ranges

    with ranges.span("pack", peer):          # mopd/pack:3 when on; free when off
        ...

    @ranges.traced("plan")
    def build_plan(...): ...
"""

from __future__ import annotations

import functools
import logging
import os
import re
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Final, TypeVar

import torch

__all__ = [
    "ENV_VAR",
    "PHASES",
    "PREFIX",
    "enable",
    "is_enabled",
    "nvtx_backend",
    "range_name",
    "register_phase",
    "span",
    "traced",
]

_log = logging.getLogger(__name__)

#: The environment variable that turns ranges on at import (``MOPD_NVTX=1``).
ENV_VAR: Final = "MOPD_NVTX"
#: What every range name starts with (``mopd/send_recv``).
PREFIX: Final = "mopd/"

#: The pipeline phases a range may name. ``register_phase`` adds more (e.g. for a new stage).
PHASES: set[str] = {
    "capture",  # teacher output_layer pre-hook: the captured [S_local, B, H] hidden states
    "gather",  # the capture's SP all-gather into its buffer
    "metadata",  # the bridge's per-step metadata all-gather
    "plan",  # this rank's local transfer plan (and its checks) for one micro-batch
    "verdict",  # the bridge's one-collective agreement on bad input
    "issue",  # one micro-batch's rows taken and its sends / receives posted
    "pack",  # rows -> per-peer contiguous staging buffers
    "send_recv",  # posting the batched NCCL / gloo point-to-point exchange
    "local_copy",  # rows whose source and destination are the same rank
    "recv_wait",  # waiting for a micro-batch's receives
    "unpack",  # staging buffers -> the student's layout
    "tp_all_gather",  # the student TP all-gather of the received slices
    "send_wait",  # waiting for a micro-batch's sends (staging released)
    "integrity",  # integrity mode's verdict
    "wait",  # waiting on an exchange handle
    "reshard",  # teacher LM-head rows -> the student's vocab partition
    "projection",  # h_teacher @ W_teacher_shard^T
    "loss_chunk",  # one token chunk of the vocab-parallel full-vocab KL
    "loss",  # a loss function call (e.g. the Megatron loss adapter)
    "teacher",  # the teacher's forward-only pass over a step's micro-batches
    "step",  # one whole training / demo step
    "forward",  # a model forward (teacher or student; detail says which)
    "backward",  # a backward pass
}

_PHASE_RE: Final = re.compile(r"^[a-z][a-z0-9_]*$")
_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"", "0", "false", "no", "off"})


class _NullSpan:
    """The off path's context manager: stateless, shared, re-entrant, thread-safe.

    Cheaper than ``contextlib.nullcontext`` (no ``*excinfo`` tuple on exit).
    """

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        return None


_NULL: Final = _NullSpan()


def _env_enabled() -> bool:
    """``MOPD_NVTX`` as a boolean; an unrecognised value warns and counts as off."""
    raw = os.environ.get(ENV_VAR, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value not in _FALSE:
        warnings.warn(
            f"{ENV_VAR}={raw!r} is not one of {sorted(_TRUE | (_FALSE - {''}))}; "
            "profiler ranges stay off",
            RuntimeWarning,
            stacklevel=3,
        )
    return False


_enabled: bool = _env_enabled()

# NVTX backend, resolved lazily on first use when on: (name, push(str), pop()).
_backend: tuple[str, Callable[[str], Any], Callable[[], Any]] | None = None


def _noop_push(name: str) -> None:
    del name


def _noop_pop() -> None:
    pass


def _resolve_backend() -> tuple[str, Callable[[str], Any], Callable[[], Any]]:
    """Pick the NVTX emitter once: ``nvtx`` package, else ``torch.cuda.nvtx``, else none."""
    global _backend
    if _backend is not None:
        return _backend
    try:
        import nvtx

        def _push(name: str) -> None:
            nvtx.push_range(name)

        def _pop() -> None:
            nvtx.pop_range()

        _backend = ("nvtx", _push, _pop)
    except ImportError:
        if torch.cuda.is_available():
            _backend = ("torch.cuda.nvtx", torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop)
            _log.info("mopd ranges: the nvtx package is absent; NVTX through torch.cuda.nvtx")
        else:
            _backend = ("none", _noop_push, _noop_pop)
            _log.info(
                "mopd ranges: neither the nvtx package nor CUDA is available; ranges go to "
                "torch.profiler only"
            )
    return _backend


def nvtx_backend() -> str:
    """The NVTX emitter in use: ``"nvtx"``, ``"torch.cuda.nvtx"`` or ``"none"``."""
    return _resolve_backend()[0]


def enable(on: bool = True) -> bool:
    """Turn ranges on (or off) for the whole process; returns the previous state."""
    global _enabled
    if not isinstance(on, bool):
        raise ValueError(f"enable() takes a bool, got {on!r} of type {type(on).__name__}")
    previous = _enabled
    if on:
        _resolve_backend()
    _enabled = on
    return previous


def is_enabled() -> bool:
    """Whether ranges are currently emitted."""
    return _enabled


def register_phase(phase: str) -> None:
    """Allow ``phase`` (lower-case identifier) as a range name in addition to :data:`PHASES`."""
    if not isinstance(phase, str) or not _PHASE_RE.match(phase):
        raise ValueError(f"phase must be a lower-case identifier like 'pack', got {phase!r}")
    PHASES.add(phase)


def range_name(phase: str, detail: object = None) -> str:
    """``mopd/<phase>`` or ``mopd/<phase>:<detail>``; raises ``ValueError`` on an unknown phase."""
    if phase not in PHASES:
        raise ValueError(
            f"unknown profiling phase {phase!r}; known: {sorted(PHASES)} "
            "(add one with ranges.register_phase)"
        )
    return f"{PREFIX}{phase}" if detail is None else f"{PREFIX}{phase}:{detail}"


def _always() -> bool:
    return True


# Whether a torch (autograd / kineto) profiler is collecting, ~30 ns. A record_function costs
# ~5 us even when nobody collects, so under nsys alone only the NVTX range is paid for.
_torch_profiler_on: Callable[[], bool] = getattr(
    getattr(torch._C, "_autograd", None), "_profiler_enabled", _always
)


class _Span:
    """One open range: NVTX push/pop around a ``torch.profiler.record_function``.

    The record_function is opened only while a torch profiler is collecting (checked on entry).
    """

    __slots__ = ("_name", "_pop", "_record")

    def __init__(self, name: str) -> None:
        self._name = name
        self._pop: Callable[[], Any] = _noop_pop
        self._record: torch.autograd.profiler.record_function | None = None

    def __enter__(self) -> None:
        _, push, pop = _backend or _resolve_backend()
        push(self._name)
        self._pop = pop  # pop with the emitter that pushed
        if not _torch_profiler_on():
            return
        try:
            record = torch.autograd.profiler.record_function(self._name)
            record.__enter__()
        except BaseException:
            pop()
            raise
        self._record = record

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        record, self._record = self._record, None
        try:
            if record is not None:
                record.__exit__(exc_type, exc, tb)
        finally:
            self._pop()


def span(phase: str, detail: object = None) -> AbstractContextManager[None]:
    """A context manager ranging ``mopd/<phase>[:<detail>]``; a shared no-op when off.

    ``detail`` is formatted with ``str`` only when ranges are on, so pass the raw value (an int
    peer rank, a chunk index) rather than a pre-formatted string to keep the off path free.
    The phase is validated only when on (the off path does nothing at all).
    """
    if not _enabled:
        return _NULL
    return _Span(range_name(phase, detail))


_F = TypeVar("_F", bound=Callable[..., Any])


def traced(phase: str, detail: object = None) -> Callable[[_F], _F]:
    """Decorator form of :func:`span`; the switch is read at each call, the phase checked now."""
    name = range_name(phase, detail)

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not _enabled:
                return fn(*args, **kwargs)
            with _Span(name):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
