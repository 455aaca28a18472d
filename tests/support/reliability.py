"""Helpers of the reliability tier-2 modules: fresh bridges, per-rank outcomes, shared verdicts.

Why this file exists: the fault, integrity and misuse modules all break one rank on purpose and
then compare what *every* rank saw. A broken bridge leaves its process groups unusable by
design, so each case builds its bridge on groups from a new :class:`GroupPool` whose transport
timeout equals ``BridgeConfig.timeout_s``; the comparisons run over the world group, which no
case breaks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from mopd.bridge import (
    BridgeConfig,
    GroupPool,
    HiddenStateBridge,
    Mesh,
    TeacherSpec,
    create_bridge_groups,
)
from mopd.bridge.executor import DebugHook

__all__ = ["Outcome", "everyone", "fresh_bridge", "outcome", "own_view", "same_everywhere"]

#: ``(error type name or "ok", message, elapsed seconds, the exception or the result)``
Outcome = tuple[str, str, float, Any]


def fresh_bridge(
    teachers: Sequence[Mesh],
    student: Mesh,
    hidden_sizes: Sequence[int],
    *,
    timeout_s: float,
    dtype: torch.dtype | None = torch.float32,
    hook: DebugHook | None = None,
    pool: GroupPool | None = None,
    **config: Any,
) -> HiddenStateBridge:
    """A bridge on new gloo groups (transport timeout ``timeout_s``), its test hook set.

    Collective over the world (group creation): every rank calls it in the same order.
    ``pool`` reuses existing groups instead (cases that break nothing); ``dtype=None`` leaves
    the teachers' dtype to be read off the buffers (``exchange()`` only).
    """
    pool = pool or GroupPool(backend="gloo", timeout_s=timeout_s)
    groups = create_bridge_groups(pool, list(teachers), student)
    bridge = HiddenStateBridge(
        teachers=[
            TeacherSpec(mesh=m, hidden_size=h, dtype=dtype)
            for m, h in zip(teachers, hidden_sizes, strict=True)
        ],
        student=student,
        groups=groups,
        config=BridgeConfig(timeout_s=timeout_s, **config),
    )
    bridge.executor.debug_hook = hook
    return bridge


def outcome(fn: Callable[[], Any]) -> Outcome:
    """What ``fn`` did on this rank: ``(error type or "ok", message, elapsed s, exc or result)``."""
    t0 = time.monotonic()
    try:
        got = fn()
    except Exception as exc:  # the test inspects whatever was raised
        return type(exc).__name__, str(exc), time.monotonic() - t0, exc
    return "ok", "", time.monotonic() - t0, got


def own_view(res: Outcome) -> str:
    """The raising rank's own view of an outcome's error: a bridge error that leads with
    another rank's first failure keeps it apart (``BridgeError.own``); else its message."""
    return str(getattr(res[3], "own", res[1])) if res[0] != "ok" else ""


def everyone(value: Any) -> list[Any]:
    """``value`` of every rank (an all-gather over the world group), in rank order."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def same_everywhere(msg: str) -> str:
    """Assert every rank holds the same ``msg``; return it."""
    out = everyone(msg)
    assert all(m == out[0] for m in out), out
    return out[0]
