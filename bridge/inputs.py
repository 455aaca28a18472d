"""What a caller hands the bridge, checked: layouts (or callables building them) and buffers.

Why this file exists: planning (:mod:`mopd.bridge.api`) and the step's sends
(:mod:`mopd.bridge.step`) take the same kinds of argument; one set of rules turns them into a
:class:`~mopd.bridge.layout.TokenLayout` or flat ``[R, H]`` rows, and anything else into a
``ValueError`` naming the values (the guarded phase of planning gathers those).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mopd.bridge.layout import TokenLayout
from mopd.common.digest import Digest

__all__ = [
    "Agreement",
    "LayoutArg",
    "StepChecks",
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


@dataclass(frozen=True, kw_only=True)
class Agreement:
    """Words every rank of a group must give alike in a step: ``items`` records of
    ``len(fields)`` words each (e.g. one per micro-batch: a model replica's shapes, which
    megatron's pipeline and TP collectives need equal on every rank of the replica).

    The bridge carries them in the step's metadata and each rank of ``ranks`` but the first
    compares its words with the first's, item by item: a difference is the same ``ValueError``
    on every rank, naming both ranks, the item and the fields that differ (a field whose name
    ends in ``"digest"`` is said not to be the same, its value not shown).

    Attributes:
        what: what the words are (``"student micro-batch shapes"``); with ``ranks`` their key.
        item: what one record is (``"micro-batch"``).
        ranks: the global ranks that must agree (this rank among them), ascending.
        fields: the name of each word of a record.
        words: the records, flat.
    """

    what: str
    item: str = "micro-batch"
    ranks: tuple[int, ...]
    fields: tuple[str, ...]
    words: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.fields or len(self.words) % len(self.fields):
            raise ValueError(
                f"{self.what}: {len(self.words)} words are not records of {len(self.fields)}"
            )

    @property
    def key(self) -> int:
        """62 bits naming the agreement (``what`` and ``ranks``): the same on every rank."""
        return Digest(f"{self.what}|{self.ranks}", size=8).word(bits=62)

    def differs(self, theirs: Sequence[int], *, me: int) -> str | None:
        """Where ``theirs`` (the first rank's words) differ from this rank's, in words, or
        ``None``."""
        n = len(self.fields)
        if len(theirs) != len(self.words):
            return (
                f"{self.what}: global rank {me} gives {len(self.words) // n} {self.item}(s), "
                f"global rank {self.ranks[0]} {len(theirs) // n}"
            )
        for i in range(len(self.words) // n):
            mine, first = self.words[i * n : (i + 1) * n], tuple(theirs[i * n : (i + 1) * n])
            if mine == first:
                continue
            parts = []
            for name, a, b in zip(self.fields, mine, first, strict=True):
                if a == b:
                    continue
                if name.endswith("digest"):
                    parts.append(f"{name.removesuffix(' digest')} not the same")
                else:
                    parts.append(
                        f"{name} {a} on global rank {me}, {b} on global rank {self.ranks[0]}"
                    )
            return (
                f"{self.what} differ within global ranks {list(self.ranks)}: {self.item} {i}: "
                + ", ".join(parts)
            )
        return None


@dataclass(frozen=True)
class StepChecks(Mapping[str, int]):
    """What a caller's step check (``plan_step(check=...)``) commits this rank to: the
    micro-batch counts (a mapping ``what -> count``, as a plain mapping would be) and the
    :class:`Agreement` s its peers must match."""

    counts: Mapping[str, int]
    agreements: tuple[Agreement, ...] = field(default=())

    def __getitem__(self, key: str) -> int:
        return self.counts[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.counts)

    def __len__(self) -> int:
        return len(self.counts)
