"""Tier 2 (launch): ``make dev`` stays editable; the regular install follows the sources.

What a developer relies on: after ``make dev``, ``make test`` never reinstalls the package
non-editably over the editable install, however many sources changed (only a change to
``pyproject.toml`` reinstalls, editably again); without ``make dev`` a changed source reinstalls
the regular package, so the tests see what ``pip install .`` ships. Read off ``make -n`` (what
make would run) against a stand-in environment folder whose stamp predates every source.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def _make_n(venv: Path, target: str) -> list[str]:
    proc = subprocess.run(
        ["make", "-n", "-C", str(ROOT), target, f"VENV={venv}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return [line for line in proc.stdout.splitlines() if "pip install" in line]


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    """A stand-in .venv whose install stamp is older than every source."""
    (tmp_path / "bin").mkdir()
    stamp = tmp_path / ".stamp"
    stamp.touch()
    os.utime(stamp, (0, 0))
    return tmp_path


def test_after_make_dev_test_does_not_reinstall_over_the_editable_install(venv: Path) -> None:
    (venv / ".editable").touch()
    assert (ROOT / "bridge" / "api.py").stat().st_mtime > (venv / ".stamp").stat().st_mtime
    # pyproject.toml is newer than the 1970 stamp too: the one reinstall is editable again
    installs = [line for line in _make_n(venv, "test") if "[" in line]
    assert installs and all("-e " in line for line in installs), installs


def test_without_make_dev_a_changed_source_reinstalls_the_regular_package(venv: Path) -> None:
    installs = [line for line in _make_n(venv, "test") if "[" in line]
    assert installs and all("-e " not in line for line in installs), installs


def test_an_up_to_date_editable_install_runs_the_tests_alone(venv: Path) -> None:
    (venv / ".editable").touch()
    (venv / ".stamp").touch()  # newer than pyproject.toml
    assert _make_n(venv, "test") == []
