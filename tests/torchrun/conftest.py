"""Tier 2 (torchrun, gloo, CPU): one gloo world per process, CPU patches for megatron applied."""

from __future__ import annotations

import pytest

from tests.support.torchrun import under_torchrun


@pytest.fixture(scope="session", autouse=True)
def _world():
    if not under_torchrun():
        yield
        return
    from tests.support import megatron_cpu
    from tests.support.dist import ensure_world

    ensure_world()
    megatron_cpu.apply()
    yield
