"""Tier 2 (launch): the failure board's unit tests, alone in a process of their own, end.

What a user relies on: a census never hangs a rank. ``tests/unit/test_failures.py`` drops
boards (their watchers stop from a finalizer) while others answer censuses; run alone, its
collections come at the moment that once deadlocked it: inside ``sys._current_frames()``, which
a dropped board's finalizer then called again. Inside the whole tier-1 run they do not, so this
runs the module by itself, in a subprocess with a time limit.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.launch

ROOT = Path(__file__).resolve().parents[2]


def test_the_failure_board_tests_alone_end() -> None:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    cmd += ["tests/unit/test_failures.py"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{' '.join(cmd[2:])} still ran after 120 s (a deadlock)") from exc
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout.splitlines()[-1], proc.stdout[-500:]
