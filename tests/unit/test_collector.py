"""Tier 1: the collector is paused inside the block and restored as it was after it."""

from __future__ import annotations

import gc

import pytest

from mopd.common.collector import paused_collector


@pytest.mark.parametrize("before", [True, False])
def test_paused_collector_pauses_and_restores_the_callers_state(before: bool) -> None:
    was = gc.isenabled()
    (gc.enable if before else gc.disable)()
    try:
        with paused_collector():
            assert not gc.isenabled()
        assert gc.isenabled() is before
        with pytest.raises(RuntimeError), paused_collector():
            raise RuntimeError("inside")
        assert gc.isenabled() is before  # an exception leaves it as it was too
    finally:
        (gc.enable if was else gc.disable)()
