"""Tier 2 (launch): a job killed at its time limit says where each rank was, and how to give it
more time.

``run_torchrun`` (what ``mopd demo`` starts its ranks with) on a job whose ranks record a phase
and then hang (``torchrun_fixtures/phase_sleeper.py``): exit 124, one line per phase with the
ranks in it and how long, the rank that recorded nothing named as such, the hint, and no
process of the job left. Then ``mopd demo`` itself with a limit shorter than its start-up: the
same report for its 8 ranks, naming ``--timeout``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from mopd.profiling.launch import run_torchrun

ROOT = Path(__file__).resolve().parents[2]
LIMIT_S = 20.0  # torchrun and two workers that import no torch start in seconds on a busy machine


def _job_processes(marker: str) -> list[int]:
    """Pids whose command line names ``marker``."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker in cmdline.read_bytes().decode(errors="replace"):
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue
    return pids


def test_a_killed_job_says_where_each_rank_was(capfd) -> None:
    start = time.monotonic()
    rc = run_torchrun(
        "tests.launch.torchrun_fixtures.phase_sleeper",
        [],
        nproc=3,
        timeout_s=LIMIT_S,
        env={"PYTHONPATH": str(ROOT), "MOPD_PHASE_DIR": ""},
        tool="mopd test",
        timeout_hint="give it more time with --timeout SECONDS",
    )
    elapsed = time.monotonic() - start
    err = capfd.readouterr().err
    assert rc == 124, err
    assert elapsed < LIMIT_S + 30, elapsed  # killed at the limit, not at the sleep's end
    report = err[err.index("mopd test: the job timed out") :].splitlines()
    assert (
        report[0]
        == f"mopd test: the job timed out after {LIMIT_S:.0f} s and was killed; where its ranks were:"
    )
    assert re.fullmatch(r"  rank 0: step 0 of 3, for [\d.]+ s \(up [\d.]+ s\)", report[1]), report
    assert re.fullmatch(r"  rank 1: step 1 of 3, for [\d.]+ s \(up [\d.]+ s\)", report[2]), report
    assert report[3] == "  rank 2: no phase recorded (its Python had not started yet)"
    assert report[4] == "mopd test: give it more time with --timeout SECONDS"
    assert _job_processes("phase_sleeper") == []  # the whole job is gone


def test_mopd_demo_killed_at_its_limit_names_the_phase_and_the_flag() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("MOPD_PHASE_DIR", None)
    proc = subprocess.run(
        [sys.executable, "-m", "mopd.profiling.demo", "--timeout", "4"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 124, proc.stdout + proc.stderr
    assert "killed after 4 s (--timeout)" in proc.stdout  # said before it starts
    lines = proc.stderr[proc.stderr.index("mopd demo: the job timed out") :].splitlines()
    assert (
        lines[0] == "mopd demo: the job timed out after 4 s and was killed; where its ranks were:"
    )
    seen = []
    for line in lines[1:-1]:  # every rank of the 8, in a phase of the start-up or not yet up
        m = re.fullmatch(r"  ranks? ([\d, -]+): (.+)", line)
        assert m, line
        assert m[2].startswith(("starting: importing torch", "joining", "no phase recorded")), line
        for part in m[1].split(", "):
            lo, _, hi = part.partition("-")
            seen += range(int(lo), int(hi or lo) + 1)
    assert sorted(seen) == list(range(8))
    assert lines[-1].startswith(
        "mopd demo: give it more time with --timeout SECONDS (this run had 4"
    )
    assert "Traceback" not in proc.stderr
