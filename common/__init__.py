"""mopd.common: the small mechanisms every part of the library shares, written once.

:mod:`.collector` (the garbage collector paused around a stretch that must run no finalizer),
:mod:`.dist` (which device a process group moves, one verdict on every rank), :mod:`.log`
(messages once per process) and :mod:`.ranges` (NVTX / torch.profiler ranges on every phase of
the data path, free when off). Nothing here imports megatron or CuPy.
"""

from __future__ import annotations

__all__: list[str] = []
