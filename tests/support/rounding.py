"""Checks on figures a bench prints rounded: a ratio divided from unrounded figures may differ
from the ratio of the printed ones, by more when the figures are small."""

from __future__ import annotations

__all__ = ["ratio_of_rounded"]


def ratio_of_rounded(ratio: float, num: float, den: float, *, places: int = 2) -> bool:
    """Whether ``ratio`` (rounded to 3 places) is ``n / d`` for some ``n`` and ``d`` that
    round (to ``places``) to the printed ``num`` and ``den``."""
    half = 0.5 * 10.0**-places
    lo = max(num - half, 0.0) / (den + half)
    hi = (num + half) / max(den - half, 1e-12)
    slack = 5e-4 + 1e-9  # the ratio's own rounding
    return lo - slack <= ratio <= hi + slack
