"""mopd.profiling.demo: the end-to-end MOPD demo (``mopd demo``, ``python -m mopd.profiling.demo``).

``run`` parses the command line and launches the ranks; ``config`` holds its settings; ``job``
builds the models and steps them; ``report`` prints and draws what the run did; ``sampling``
is the student's own rollouts.
"""

from __future__ import annotations

from mopd.profiling.demo.run import DemoConfig, main

__all__ = ["DemoConfig", "main"]
