"""Deprecated alias of :mod:`mopd.common.ranges`, kept for one release.

Why this file exists: the profiler ranges sit on the data path (capture, bridge, kernels, mcore),
which must not import the tools package, so they moved down to :mod:`mopd.common.ranges`. Code
that still reads ``mopd.profiling.ranges`` gets the same objects (one switch, one state) with a
``DeprecationWarning`` naming the new place.
"""

from __future__ import annotations

import warnings

from mopd.common import ranges as _ranges

__all__: list[str] = []


def __getattr__(name: str) -> object:
    value = getattr(_ranges, name)
    warnings.warn(
        f"mopd.profiling.ranges is deprecated and goes in the next release; use "
        f"mopd.common.ranges.{name}",
        DeprecationWarning,
        stacklevel=2,
    )
    return value
