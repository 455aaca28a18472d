"""mopd.profiling: the tools around the pipeline.

The ``mopd`` command (:mod:`.cli`; also ``python -m mopd``): ``mopd demo`` (:mod:`.demo`,
:mod:`.demo_job`, the student's rollouts :mod:`.sampling`, started by :mod:`.launch`, which
reports each rank's phase from :mod:`.phases` when it kills a job), ``mopd plan``
(:mod:`.plan_inspector`), ``mopd nsys`` (``nsys.sh``), ``mopd bench NAME``
(:mod:`.bench_kernels`, :mod:`.bench_kl` with :mod:`.kl_numerics`, :mod:`.bench_bridge`,
:mod:`.bench_capture`, :mod:`.bench_ranges`, :mod:`.bench_plan`, recorded by :mod:`.results`,
drawn by :mod:`.plots`), the command-line syntax they share (:mod:`.mesh_arg`), what they do
without an optional dependency (:mod:`.extras`: one line naming the extra), synthetic steps
(:mod:`.synthetic`), allocator counts (:mod:`.allocations`) and the one-command GPU session
(``gpu_session.sh``). Submodules are imported on use; this package imports nothing
heavy. Nothing in the library's data path (capture, bridge, kernels, mcore, common) imports from
here.
"""

from __future__ import annotations

__all__: list[str] = []
