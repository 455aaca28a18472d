"""Tier 2 (launch): the torchrun harness reports each tier-2 test as its own item with its own outcome.

Why this file exists: the harness (tests/support/torchrun.py) is what every tier-2 result goes
through under plain ``pytest``; these tests run a plain ``pytest`` on the small modules in
``tests/launch/torchrun_fixtures/`` (real 2-rank torchrun launches, one per module) and check the
per-test outcomes, the failing rank's report, ``-k`` and node-id selection, a hang killed at the
timeout, a crash, "no test ran", the whole-module fallback and the exit codes. The choice of
which rank's report stands for a test is checked without launching anything.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.support.torchrun_launch import RankRecord, pick_reports, rank_list, tail_text
from tests.support.torchrun_report import node_key

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "torchrun_fixtures"
REL = FIXTURES.relative_to(ROOT).as_posix()


def _pytest(
    *args: str, record: Path | None = None, timeout: int = 240
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("HARNESS_RECORD", None)
    env["COLUMNS"] = "300"  # short summary lines keep their message
    if record is not None:
        env["HARNESS_RECORD"] = str(record)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            *args,
            "-v",
            "-rA",
            "-o",
            "addopts=",
            "-p",
            "no:cacheprovider",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _junit(path: Path) -> dict[str, tuple[str, str]]:
    """``{test name: (failure/skipped/passed, message)}`` from a junitxml file."""
    found: dict[str, tuple[str, str]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        kinds = [c for c in case if c.tag in ("failure", "error", "skipped")]
        kind, message = (kinds[0].tag, kinds[0].get("message", "")) if kinds else ("passed", "")
        found[case.get("name", "")] = (kind, message)
    return found


def _outcomes(out: str) -> dict[str, str]:
    """``{node id: PASSED/FAILED/SKIPPED/XFAIL/ERROR}`` from ``-v`` progress lines."""
    found: dict[str, str] = {}
    for m in re.finditer(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|XFAIL|XPASS|ERROR)\b", out, re.M):
        found[m.group(1)] = m.group(2)
    return found


def _section(out: str, title: str) -> str:
    """The failure report of one test (between its ``___ title ___`` banner and the next)."""
    m = re.search(rf"^_+ {re.escape(title)} _+$(.*?)(?=^_{{3,}} |^={{3,}} )", out, re.M | re.S)
    assert m, f"no report for {title} in:\n{out}"
    return m.group(1)


def test_each_test_is_an_item_with_its_own_outcome_and_the_failing_ranks_report(tmp_path: Path):
    res = _pytest(f"{REL}/case_outcomes.py", f"--junitxml={tmp_path / 'junit.xml'}")
    out = res.stdout
    assert res.returncode == 1, out
    mod = f"{REL}/case_outcomes.py"
    assert _outcomes(out) == {
        f"{mod}::test_ok": "PASSED",
        f"{mod}::test_rank1_fails": "FAILED",
        f"{mod}::test_skip": "SKIPPED",
        f"{mod}::test_xfail": "XFAIL",
        f"{mod}::test_param[1]": "PASSED",
        f"{mod}::test_param[2]": "PASSED",
    }, out
    assert "1 failed, 3 passed, 1 skipped, 1 xfailed" in out
    failure = _section(out, "test_rank1_fails")
    assert "AssertionError: rank 1 disagrees" in failure
    assert "failed on rank 1 of 2" in failure
    assert "rank 0 failed only because a peer did" in failure
    assert "output of rank 1" in failure  # rank 1's captured output, not rank 0's
    assert "output of rank 0" not in failure
    assert "other rank(s) failed this test" not in out  # rank 0's echo of the failure is not shown
    assert f"FAILED {mod}::test_rank1_fails - [rank 1] AssertionError: rank 1 disagrees" in out
    assert re.search(r"SKIPPED \[1\] \S*case_outcomes.py:\d+: skipped for a stated reason", out)
    assert f"XFAIL {mod}::test_xfail - known to fail" in out
    junit = _junit(tmp_path / "junit.xml")  # what CI reads sees the same per-test outcomes
    assert junit["test_rank1_fails"][0] == "failure"
    assert junit["test_rank1_fails"][1].startswith("[rank 1] AssertionError: rank 1 disagrees")
    assert junit["test_skip"] == ("skipped", "skipped for a stated reason")
    assert junit["test_param[2]"] == ("passed", "")


@pytest.mark.parametrize(
    ("args", "ran"),
    [
        pytest.param(["case_select.py", "-k", "beta and 2"], ["test_beta[2]"], id="keyword"),
        pytest.param(
            ["case_select.py::TestGamma::test_in_class"], ["TestGamma::test_in_class"], id="node-id"
        ),
    ],
)
def test_selection_runs_exactly_the_selected_tests_in_one_launch(
    tmp_path: Path, args: list[str], ran: list[str]
):
    record = tmp_path / "ran.txt"
    res = _pytest(f"{REL}/{args[0]}", *args[1:], record=record)
    assert res.returncode == 0, res.stdout
    assert _outcomes(res.stdout) == {f"{REL}/case_select.py::{t}": "PASSED" for t in ran}
    lines = sorted(record.read_text().splitlines())
    names = [t.split("::")[-1] for t in ran]
    expected = [f"{rank} {what}" for rank in (0, 1) for what in ["import", *names]]
    assert lines == sorted(expected)  # one import per rank: one launch, only the selected tests


def test_a_keyword_matching_nothing_launches_nothing(tmp_path: Path):
    record = tmp_path / "ran.txt"
    res = _pytest(f"{REL}/case_select.py", "-k", "no_such_test", record=record)
    assert res.returncode == 5, res.stdout  # pytest's "no tests collected"
    assert "4 deselected" in res.stdout
    assert not record.exists()


@pytest.mark.timeout(180)
def test_a_hang_is_killed_and_finished_tests_keep_their_outcome():
    t0 = time.monotonic()
    res = _pytest(f"{REL}/case_hang.py")
    elapsed = time.monotonic() - t0
    out = res.stdout
    mod = f"{REL}/case_hang.py"
    assert res.returncode == 1, out
    assert _outcomes(out) == {
        f"{mod}::test_first": "PASSED",
        f"{mod}::test_hang": "FAILED",
        f"{mod}::test_after": "FAILED",
    }, out
    hang = _section(out, "test_hang")
    assert "timed out after 20s (ranks hung) and was killed" in hang
    assert "Started, not finished, on ranks 0, 1." in hang
    stacks = hang.split("--- rank 1's stacks at the timeout ---")[1]
    assert re.search(r'case_hang.py", line \d+ in test_hang', stacks), hang  # where rank 1 was
    assert "--- tail of the ranks' output ---" in hang
    after = _section(out, "test_after")
    assert "before this test started (it stopped in test_hang)" in after
    assert "tail of the ranks' output" not in after  # the tail is shown once
    assert elapsed < 20 + 60, elapsed


def test_a_crash_no_test_ran_and_an_unimportable_module(tmp_path: Path):
    res = _pytest(
        f"{REL}/case_crash.py",
        f"{REL}/case_nothing.py",
        f"{REL}/case_unimportable.py",
        f"--junitxml={tmp_path / 'junit.xml'}",
    )
    out = res.stdout
    assert res.returncode == 1, out
    assert _outcomes(out) == {
        f"{REL}/case_crash.py::test_first": "PASSED",
        f"{REL}/case_crash.py::test_crash": "FAILED",
        f"{REL}/case_crash.py::test_after": "FAILED",
        f"{REL}/case_nothing.py::test_only_outside_torchrun": "FAILED",
        f"{REL}/case_unimportable.py::torchrun-whole-module[nproc=2]": "PASSED",
    }, out
    crash = _section(out, "test_crash")
    assert re.search(
        r"did not finish on every rank: the torchrun launch of case_crash.py \(2 ranks\) exited [1-9]",
        crash,
    )
    assert "no test ran under torchrun" in _section(out, "test_only_outside_torchrun")
    assert "case_unimportable.py cannot be imported outside torchrun" in out  # the warning
    kind, message = _junit(tmp_path / "junit.xml")["test_only_outside_torchrun"]
    assert kind == "failure" and message.startswith("no test ran under torchrun: the torchrun")


def test_every_tier2_module_is_collected_test_by_test_in_the_parent():
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "tests/torchrun",
            "--collect-only",
            "-q",
            "-o",
            "addopts=",
            "-rs",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    ids = [line for line in res.stdout.splitlines() if "::" in line]
    modules = {i.split("::")[0] for i in ids}
    # a module this environment cannot run skips whole, saying why (e.g. HybridModel on 0.16)
    skipped = set(
        re.findall(r"^SKIPPED \[\d+\] (tests/torchrun/test_\w+\.py):\d+: \S", res.stdout, re.M)
    )
    files = {f"tests/torchrun/{p.name}" for p in (ROOT / "tests/torchrun").glob("test_*.py")}
    assert modules | skipped == files and not modules & skipped, files - modules - skipped
    assert "whole-module" not in res.stdout and "cannot be imported" not in res.stdout
    assert len(ids) > 2 * len(modules)


# ---- without launching anything ---------------------------------------------------------------


def _rec(outcome: str, when: str = "call", peer: bool = False) -> RankRecord:
    return RankRecord({"outcome": outcome, "when": when}, peer)


def test_the_report_shown_is_the_first_rank_that_failed_on_its_own():
    passed = {w: _rec("passed", w) for w in ("setup", "teardown")}
    picks = pick_reports(
        {
            0: {**passed, "call": _rec("failed", peer=True)},
            1: {**passed, "call": _rec("passed")},
            2: {**passed, "call": _rec("failed")},
            3: {**passed, "call": _rec("failed")},
        }
    )
    assert [(p.when, p.rank) for p in picks] == [("setup", 0), ("call", 2), ("teardown", 0)]
    assert picks[1].failed == [2, 3] and picks[1].peers == [0]
    assert picks[0].failed == [] and picks[0].peers == []


def test_without_failures_the_lowest_rank_stands_for_the_test():
    picks = pick_reports({1: {"call": _rec("skipped")}, 0: {"call": _rec("passed")}})
    assert [(p.rank, p.record.outcome) for p in picks] == [(0, "passed")]
    assert pick_reports({}) == []


def test_the_output_tail_is_bounded(tmp_path: Path):
    log = tmp_path / "out.log"
    log.write_text("".join(f"line {i}\n" for i in range(1000)) + "x" * 5000 + "\n")
    tail = tail_text(log, lines=10).splitlines()
    assert len(tail) == 10
    assert tail[0] == "line 991"
    assert tail[-1].endswith("[...]") and len(tail[-1]) < 500
    assert tail_text(tmp_path / "missing.log") == ""


def test_small_helpers():
    assert node_key("tests/torchrun/test_x.py::TestC::test_y[a::b]") == "TestC::test_y[a::b]"
    assert node_key("::test_y") == "test_y"
    assert rank_list([1]) == "rank 1"
    assert rank_list([0, 2]) == "ranks 0, 2"
