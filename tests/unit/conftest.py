"""Tier 1 is one process: a test here that starts another one fails, naming the command.

Tests that need a child process (torchrun jobs, the CLI, compilers, pip) live in tests/launch.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def _one_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def refuse(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
        raise AssertionError(
            f"tier 1 is one process, but this test starts {args!r}: move it to tests/launch"
        )

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    yield
