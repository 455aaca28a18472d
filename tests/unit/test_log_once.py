"""Tier 1: fallbacks in the kernels log once per cause and process (``mopd.common.log.log_once``)."""

from __future__ import annotations

import logging

import pytest
import torch

from mopd.common import log as backend_mod
from mopd.kernels.kl import rowwise as kl_rowwise


@pytest.fixture(autouse=True)
def _fresh() -> None:
    backend_mod.reset_once()


def test_log_once_per_logger_and_key(caplog: pytest.LogCaptureFixture) -> None:
    a, b = logging.getLogger("mopd.test.a"), logging.getLogger("mopd.test.b")
    with caplog.at_level(logging.WARNING):
        assert backend_mod.log_once(a, "k1", "first %s", "x")
        assert not backend_mod.log_once(a, "k1", "first %s", "again")
        assert backend_mod.log_once(a, "k2", "second")
        assert backend_mod.log_once(b, "k1", "other logger")
    assert [r.getMessage() for r in caplog.records] == ["first x", "second", "other logger"]
    backend_mod.reset_once()
    assert backend_mod.log_once(a, "k1", "after reset")


def test_kl_kernels_fall_back_once_per_reason(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``auto`` on tensors the CuPy KL kernels cannot take: the twin, one warning per reason."""
    monkeypatch.setattr(kl_rowwise, "_resolve_base", lambda backend, op, *ts: "cupy")
    f16, f32 = torch.zeros(2, 3, dtype=torch.float16), torch.zeros(2, 3)
    with caplog.at_level(logging.WARNING, logger=kl_rowwise.__name__):
        for _ in range(3):
            assert kl_rowwise.resolve_backend("auto", f16, f16) == "torch"
        assert kl_rowwise.resolve_backend("auto", f16, f32) == "torch"
        with pytest.raises(ValueError, match="backend='cupy' was requested but cannot run"):
            kl_rowwise.resolve_backend("cupy", f16, f16)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2 and all("using the torch twin (logged once)" in m for m in msgs), msgs
    assert "float16" in msgs[0] and "float32" in msgs[1]
