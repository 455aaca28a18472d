"""mopd.common: the small mechanisms every part of the library shares, written once.

:mod:`.dist` (which device a process group moves, one verdict on every rank) and :mod:`.log`
(messages once per process). Nothing here imports megatron or CuPy.
"""

from __future__ import annotations

__all__: list[str] = []
