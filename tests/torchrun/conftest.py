"""Tier 2 (torchrun, gloo, CPU): one gloo world per process, CPU patches for megatron applied
(before the test modules import it);
NCCL's point-to-point rules enforced when ``MOPD_STRICT_P2P=1`` (tests/support/strict_p2p.py)."""

from __future__ import annotations

import os

import pytest

from tests.support.torchrun import under_torchrun


def pytest_configure(config: pytest.Config) -> None:
    """The CPU patches before any test module imports megatron-core (its fusions plain)."""
    if under_torchrun():
        from tests.support import megatron_cpu

        megatron_cpu.apply()


@pytest.fixture(scope="session", autouse=True)
def _world():
    if not under_torchrun():
        yield
        return
    from tests.support import strict_p2p
    from tests.support.dist import ensure_world

    ensure_world()
    if os.environ.get(strict_p2p.ENV) == "1":  # NCCL's point-to-point rules (see the module)
        strict_p2p.install()
    yield
