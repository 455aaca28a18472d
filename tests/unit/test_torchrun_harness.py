"""Tier 1: the torchrun harness fails loudly when one rank fails, when ranks hang, or when no
test ran, and passes when every rank passes (it launches real 2-rank torchrun jobs)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PRELUDE = """
import datetime, os, time
import torch, torch.distributed as dist
TORCHRUN_NPROC = 2
TORCHRUN_TIMEOUT = {timeout}
if "RANK" in os.environ and not dist.is_initialized():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=15))
"""


def _run(tmp_path: Path, body: str, timeout: int = 60) -> subprocess.CompletedProcess[str]:
    mod = tmp_path / "test_selfcheck.py"
    mod.write_text(PRELUDE.format(timeout=timeout) + textwrap.dedent(body))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(mod),
            "-q",
            "-p",
            "tests.support.torchrun",
            f"--rootdir={ROOT}",
            "-o",
            "addopts=",
            "-p",
            "no:cacheprovider",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout + 60,
    )


def test_all_ranks_pass(tmp_path: Path):
    res = _run(
        tmp_path,
        """
        def test_ok():
            t = torch.ones(1)
            dist.all_reduce(t)
            assert int(t) == 2
    """,
    )
    assert res.returncode == 0, res.stdout
    assert "1 passed" in res.stdout


def test_one_failing_rank_fails_the_item_and_its_peer(tmp_path: Path):
    res = _run(
        tmp_path,
        """
        def test_rank1_fails():
            assert dist.get_rank() == 0, "rank 1 disagrees"

        def test_after():
            t = torch.ones(1)
            dist.all_reduce(t)
    """,
    )
    assert res.returncode == 1
    assert "rank 1 disagrees" in res.stdout
    assert "other rank(s) failed this test" in res.stdout  # rank 0 reports the peer's failure
    assert "torchrun exited" in res.stdout


@pytest.mark.timeout(120)
def test_hanging_ranks_are_killed_at_the_timeout(tmp_path: Path):
    res = _run(
        tmp_path,
        """
        def test_hang():
            if dist.get_rank() == 1:
                time.sleep(600)
    """,
        timeout=20,
    )
    assert res.returncode == 1
    assert "timed out after 20s" in res.stdout


def test_no_test_ran_is_a_failure(tmp_path: Path):
    res = _run(
        tmp_path,
        """
        def helper_not_a_test():
            pass
    """,
    )
    assert res.returncode == 1
    assert "no test ran under torchrun" in res.stdout
