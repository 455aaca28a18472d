"""``python -m mopd.profiling.demo``: the demo's command line."""

from __future__ import annotations

from mopd.profiling.demo.run import main

raise SystemExit(main())
