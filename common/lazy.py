"""A read-only sequence whose items are built on first access and kept.

Why this file exists: a rank of a large job reads a few groups of a step and a few micro-batches
of it, never all; the bridge's per-micro-batch groups and a step's catalogs are therefore
sequences that build an item only when it is looked at. One class carries the indexing rules
(negative indices, slices, bounds) for both.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import TypeVar, overload

__all__ = ["LazySequence"]

_T = TypeVar("_T")


class LazySequence(Sequence[_T]):
    """``length`` items, item ``j`` built by ``build(j)`` on its first access and kept.

    Args:
        length: the number of items.
        build: builds item ``j`` (``0 <= j < length``).
        noun: what an item is, for the ``IndexError`` (``"group"``, ``"micro-batch"``).
    """

    def __init__(self, length: int, build: Callable[[int], _T], *, noun: str = "item") -> None:
        self._length = length
        self._build = build
        self._noun = noun
        self._built: dict[int, _T] = {}

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, i: int) -> _T: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[_T, ...]: ...
    def __getitem__(self, i: int | slice) -> _T | tuple[_T, ...]:
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        j = operator.index(i)
        if j < 0:
            j += self._length
        if not 0 <= j < self._length:
            raise IndexError(f"{self._noun} {i} of {self._length}")
        got = self._built.get(j)
        if got is None:
            got = self._built[j] = self._build(j)
        return got
