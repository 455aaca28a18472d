"""mopd.bridge (being rebuilt around per-micro-batch slots)."""

from __future__ import annotations

from mopd.bridge.layout import TokenLayout, concat_layouts, packed_layout, padded_layout
from mopd.bridge.mesh import Mesh, MeshCoord

__all__ = ["Mesh", "MeshCoord", "TokenLayout", "concat_layouts", "packed_layout", "padded_layout"]
