"""What a caller hands the bridge, checked: layouts (or callables building them) and buffers.

Why this file exists: planning (:mod:`mopd.bridge.api`) and the step's sends
(:mod:`mopd.bridge.step`) take the same kinds of argument; one set of rules turns them into a
:class:`~mopd.bridge.layout.TokenLayout` or flat ``[R, H]`` rows, and anything else into a
``ValueError`` naming the values (the guarded phase of planning gathers those).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mopd.bridge.layout import TokenLayout

__all__ = [
    "LayoutArg",
    "called",
    "check_buffer",
    "layout_list",
]

#: A layout, or a zero-argument callable building one inside the guarded phase (so that an error
#: it raises reaches every rank as the same ``ValueError`` instead of leaving them waiting).
LayoutArg = TokenLayout | Callable[[], TokenLayout]


def called(arg: Any, what: str, *, noun: str = "callable") -> Any:
    """``arg()`` when ``arg`` is a callable (not a layout), else ``arg``; whatever the callable
    raises reaches the caller as a ValueError (the guarded phase gathers those)."""
    if not callable(arg) or isinstance(arg, TokenLayout):
        return arg
    try:
        return arg()
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"{what}: the {noun} raised {type(exc).__name__}: {exc}") from exc


def _resolve_layout(arg: Any, what: str) -> TokenLayout:
    """``arg`` as a TokenLayout (calling it when it is a callable); any failure is a ValueError."""
    arg = called(arg, what, noun="layout callable")
    if not isinstance(arg, TokenLayout):
        raise ValueError(
            f"{what} must be a TokenLayout or a zero-argument callable returning one, "
            f"got {type(arg).__name__}"
        )
    return arg


def layout_list(arg: Any, what: str) -> list[TokenLayout]:
    """One layout per micro-batch (a sequence, or a callable returning one)."""
    arg = called(arg, what)
    if isinstance(arg, TokenLayout) or not isinstance(arg, Sequence) or not arg:
        raise ValueError(
            f"{what} must be a non-empty sequence with one layout per micro-batch, got "
            f"{type(arg).__name__}"
        )
    return [_resolve_layout(x, f"{what}[{i}]") for i, x in enumerate(arg)]


def _flat(t: Any, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() < 2:
        raise ValueError(f"{what} must have a hidden dim last (>= 2-D), got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous (the bridge moves rows of its flat view)")
    return t.view(-1, t.shape[-1])


def check_buffer(
    o: int, i: int, t: Any, lay: TokenLayout, hidden: int, dtype: Any, device: torch.device
) -> torch.Tensor:
    """Teacher ``o``'s buffer of micro-batch ``i`` as flat ``[R, H]`` rows; a ValueError when it
    does not match the layout, the hidden size, the dtype or the device."""
    f = _flat(t, f"teacher {o} hidden buffer")
    if f.shape[0] != lay.num_rows or f.shape[1] != hidden:
        raise ValueError(
            f"teacher {o} micro-batch {i}: buffer of {tuple(t.shape)} has "
            f"{f.shape[0]} rows of {f.shape[1]}, the plan wants {lay.num_rows} rows of {hidden}"
        )
    if f.dtype != dtype or f.device != device:
        raise ValueError(
            f"teacher {o} micro-batch {i}: buffer is {f.dtype} on {f.device}, "
            f"the plan wants {dtype} on {device}"
        )
    return f
