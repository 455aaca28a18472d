"""``python -m mopd.profiling.plan``: the plan inspector's command line."""

from __future__ import annotations

from mopd.profiling.plan.inspector import main

raise SystemExit(main())
