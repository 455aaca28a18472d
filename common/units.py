"""Numbers as a person reads them: bytes, seconds, plain numbers and lists of ranks, each written one way.

Why this file exists: the tools' reports and the library's error messages name sizes, durations
and groups of ranks; one helper per unit keeps them written alike everywhere (and a change to
how they read is made once). Pure functions of plain numbers; nothing is imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

__all__ = ["human_bytes", "human_number", "human_seconds", "rank_list"]

_BYTE_UNITS: tuple[str, ...] = ("B", "KiB", "MiB", "GiB", "TiB")
_TIME_UNITS: tuple[tuple[str, float], ...] = (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9))


def human_bytes(n: float, *, decimals: int = 2) -> str:
    """``n`` bytes in binary units (B to TiB), whole bytes below 1 KiB: ``1536 -> '1.50 KiB'``,
    ``1536, decimals=1 -> '1.5 KiB'``, ``512 -> '512 B'``."""
    x = float(n)
    for unit in _BYTE_UNITS:
        if abs(x) < 1024 or unit == _BYTE_UNITS[-1]:
            return f"{int(x)} B" if unit == "B" else f"{x:.{decimals}f} {unit}"
        x /= 1024
    raise AssertionError("unreachable")


def human_seconds(seconds: float, *, coarse: bool = False) -> str:
    """A duration in the unit that puts it in [1, 1000) (s, ms, µs, ns), four significant
    figures at most: ``1.495e-05`` -> ``"14.95 µs"``, ``0.25`` -> ``"250 ms"``.

    ``coarse``: for waits a person watches, always in seconds, whole from 10 s on and tenths
    below (never negative): ``12.3`` -> ``"12 s"``, ``0.42`` -> ``"0.4 s"``.
    """
    if coarse:
        x = max(seconds, 0.0)
        return f"{x:.0f} s" if seconds >= 10 else f"{x:.1f} s"
    if seconds == 0 or seconds != seconds:  # zero, NaN
        return f"{seconds:g} s"
    unit, scale = next(((u, f) for u, f in _TIME_UNITS if abs(seconds) >= f), _TIME_UNITS[-1])
    return f"{human_number(seconds / scale)} {unit}"


def human_number(v: float) -> str:
    """Four significant figures, without an exponent where the number is of everyday size
    (``14950.3`` -> ``"14950"``, not ``"1.495e+04"``)."""
    if 1e4 <= abs(v) < 1e9:
        return f"{v:.0f}"
    return f"{v:.4g}"


def rank_list(
    ranks: Sequence[int],
    *,
    noun: str = "",
    style: Literal["runs", "span", "list"] = "runs",
    sep: str = ", ",
) -> str:
    """A group of ranks in one phrase.

    ``style``: ``"runs"`` writes each run of consecutive ranks as ``first-last``
    (``[0, 1, 2, 5] -> "0-2, 5"``); ``"span"`` does so only when the whole group is one run, and
    lists each rank otherwise (``"0-3"``, ``"0, 1, 3"``); ``"list"`` is Python's list
    (``"[0, 1, 3]"``). ``sep`` joins the parts of ``"runs"`` and ``"span"``. A lone rank is its
    number. ``noun`` leads, with an ``s`` before a group of several: ``noun="rank"`` ->
    ``"rank 3"``, ``"ranks 0-3"``.
    """
    ranks = list(ranks)
    if len(ranks) == 1:
        body = str(ranks[0])
    elif style == "list":
        body = str(ranks)
    elif style == "span":
        whole = len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1))
        body = f"{ranks[0]}-{ranks[-1]}" if whole else sep.join(map(str, ranks))
    else:
        out: list[str] = []
        i = 0
        while i < len(ranks):
            j = i
            while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
                j += 1
            out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
            i = j + 1
        body = sep.join(out)
    if not noun:
        return body
    return f"{noun}{'s' if len(ranks) > 1 else ''} {body}"
