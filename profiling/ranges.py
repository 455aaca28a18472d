"""Deprecated alias of :mod:`mopd.common.ranges`, kept for one release.

Why this file exists: the profiler ranges sit on the data path (capture, bridge, kernels, mcore),
which must not import the tools package, so they moved down to :mod:`mopd.common.ranges`. Code
that still reads ``mopd.profiling.ranges`` gets the same objects (one switch, one state) with a
``DeprecationWarning`` naming the new place.
"""

from __future__ import annotations

from mopd.common import ranges as _ranges
from mopd.common.deprecation import moved_names

__all__: list[str] = []

__getattr__ = moved_names(__name__, dict.fromkeys(_ranges.__all__, _ranges.__name__))
