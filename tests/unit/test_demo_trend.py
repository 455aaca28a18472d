"""Tier 1: the demo's trend line says what its numbers did (:func:`mopd.profiling.demo.report._trend`).

What a reader relies on: the line gives first -> last and their ratio, and names every step at
which the series went up; "fell every step" only when every step went down.
"""

from __future__ import annotations

import pytest

from mopd.profiling.demo.report import _trend


@pytest.mark.parametrize(
    ("values", "line"),
    [
        ([1.62, 1.3, 1.19], "1.6200 -> 1.1900 (0.73x), fell every step"),
        ([1.598, 1.55, 1.558], "1.5980 -> 1.5580 (0.97x), rose at step 3"),
        ([1.0, 1.1, 0.9, 0.95, 0.8], "1.0000 -> 0.8000 (0.80x), rose at steps 2, 4"),
        ([1.0, 1.0, 0.5], "1.0000 -> 0.5000 (0.50x), never rose (flat at some step)"),
        ([0.7], "0.7000 (one step)"),
    ],
)
def test_trend_line(values: list[float], line: str) -> None:
    assert _trend(values) == line
    assert "decreasing" not in _trend(values)
