"""mopd.profiling.bench: the benchmarks ``mopd bench NAME`` runs, one module each.

``bridge``, ``capture``, ``kernels``, ``kl``, ``overlap``, ``plan`` (with its simulated job,
``plan_job``), ``ranges``, ``worlds``; each runs as ``python -m mopd.profiling.bench.NAME`` and
records its figures beside their peers (:mod:`mopd.profiling.results`). Helpers: allocator
counts (``allocations``) and the KL's float64 references (``kl_numerics``). Imported on use.
"""

from __future__ import annotations

__all__: list[str] = []
