"""mopd.profiling: the tools around the pipeline.

``mopd demo`` (:mod:`.demo`, :mod:`.demo_job`), ``mopd plan`` (:mod:`.plan_inspector`),
``mopd bench NAME`` (:mod:`.bench_kernels`, :mod:`.bench_kl`, :mod:`.bench_bridge`,
:mod:`.bench_capture`, :mod:`.bench_ranges`, recorded by :mod:`.results`, drawn by :mod:`.plots`),
NVTX / torch.profiler ranges (:mod:`.ranges`), ``nsys.sh`` and the one-command GPU session
(``gpu_session.sh``). Submodules are imported on use; this package imports nothing heavy.
"""

from __future__ import annotations

__all__: list[str] = []
