"""mopd.profiling: the tools around the pipeline, in three wings and a few shared modules.

The ``mopd`` command (:mod:`.cli`; also ``python -m mopd``) runs them:

- ``mopd demo``: :mod:`.demo` (the end-to-end job: its configuration, its build / step /
  verify / report, the student's rollouts), started by :mod:`.launch`, which reports each rank's
  phase from :mod:`.phases` when it kills a job;
- ``mopd plan``: :mod:`.plan` (the plan inspector: arguments, the simulated step, the report,
  the heatmap);
- ``mopd bench NAME``: :mod:`.bench` (one module per benchmark and their helpers), recorded by
  :mod:`.results`, drawn by :mod:`.plots`;
- ``mopd nsys``: ``nsys.sh``; the one-command GPU session: ``gpu_session.sh``.

Shared: the command-line syntax (:mod:`.mesh_arg`), what the tools do without an optional
dependency (:mod:`.extras`: one line naming the extra), synthetic steps (:mod:`.synthetic`),
timing helpers (:mod:`.timing`). Submodules are imported on use; this package imports nothing
heavy. Nothing in the library's data path (capture, bridge, kernels, mcore, common) imports from
here.
"""

from __future__ import annotations

__all__: list[str] = []
