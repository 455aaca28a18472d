"""The parent collects a test that the ranks do not: no test ran under torchrun."""

from __future__ import annotations

from tests.launch.torchrun_fixtures._common import in_ranks

TORCHRUN_NPROC = 2
TORCHRUN_TIMEOUT = 120

if not in_ranks():

    def test_only_outside_torchrun():
        pass
