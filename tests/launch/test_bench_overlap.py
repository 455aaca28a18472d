"""Tier 2 (launch): ``mopd bench overlap`` on two CPU ranks: one JSON object per ratio, each
figure what its definition says.

The benchmark starts its own two gloo ranks (a teacher rank and a student rank) and sizes the
teacher in the run; at ``--quick`` sizes its times mean little, so what is checked is the
harness: one object per ratio asked with the fields a reader compares, the floor and the
ratios computed from the row's own figures, the lockstep mode really waiting for the teacher
(its step longer than either side alone), and the record (CSV, Markdown, PNG) written.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

from mopd.profiling import cli
from mopd.profiling.bench import overlap as bench_overlap
from tests.support.processes import run_module
from tests.support.rounding import ratio_of_rounded

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RATIOS = (0.5, 2.0)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path, str]:
    out = tmp_path_factory.mktemp("overlap")
    res = run_module(
        "mopd.profiling.bench.overlap", "--quick", "--json",
        "--ratios", *map(str, RATIOS), "--results-dir", str(out),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines()]  # --json: nothing else
    return rows, out, res.stderr


def test_one_object_per_ratio_with_the_figures_a_reader_compares(run: tuple) -> None:
    rows, _, _ = run
    assert [r["ratio_asked"] for r in rows] == list(RATIOS)
    for r in rows:
        for key in ("teacher_to_student", "step_over_floor", "lockstep_over_floor", "floor_ms"):
            assert r[key] > 0, (key, r)
        assert r["teacher_layers"] >= 1 and r["micro_batches"] == 4


def test_floor_and_ratios_follow_from_the_row(run: tuple) -> None:
    for r in run[0]:
        floor = bench_overlap.floor_ms(
            teacher_ms=r["teacher_ms"],
            student_ms=r["student_ms"],
            teacher_pass_ms=r["teacher_pass_ms"],
            schedule_ms=r["schedule_ms"],
            m=r["micro_batches"],
        )
        assert r["floor_ms"] == pytest.approx(floor, abs=0.02)  # the row's figures are rounded
        assert ratio_of_rounded(r["step_over_floor"], r["step_ms"], r["floor_ms"]), r
        assert ratio_of_rounded(r["lockstep_over_floor"], r["lockstep_ms"], r["floor_ms"]), r
        assert ratio_of_rounded(r["teacher_to_student"], r["teacher_ms"], r["student_ms"]), r
        assert r["teacher_pass_ms"] < r["teacher_ms"]  # the pass is part of the teacher's step


def test_lockstep_waits_for_the_teacher(run: tuple) -> None:
    """The lockstep step is the two sides one after the other: longer than either alone (a
    wait that did not happen would make it the longer side's time)."""
    for r in run[0]:
        assert r["lockstep_ms"] > max(r["teacher_ms"], r["student_ms"]), r


def test_the_record_is_written(run: tuple) -> None:
    rows, out, _ = run
    (csv_path,) = out.glob("overlap-*.csv")
    with csv_path.open() as f:
        recorded = list(csv.DictReader(f))
    assert [float(r["step_over_floor"]) for r in recorded] == [r["step_over_floor"] for r in rows]
    md = csv_path.with_suffix(".md").read_text()
    assert "Load average" in md and "## Environment" in md
    assert csv_path.with_suffix(".png").read_bytes().startswith(PNG_MAGIC)
    # every figure the notes name by its column name is a column of the table
    named = set(re.findall(r"`(\w+_(?:ms|floor|student))`", md))
    assert named and named <= set(recorded[0]), named - set(recorded[0])


def test_progress_n_of_n_and_a_summary_line_no_raw_dicts(run: tuple) -> None:
    rows, _, err = run
    done = re.findall(
        r"^bench_overlap: (\d) of 2: teacher \d+ layers = [\d.]+x the student: step", err, re.M
    )
    assert done == ["1", "2"], err[-3000:]
    assert "{" not in err, err[-3000:]  # no Python dict printed
    assert err.rstrip().splitlines()[-2].startswith("summary: over 2 teacher sizes"), err[-1000:]
    assert bench_overlap.summary(rows).split(" (")[0] == "summary: over 2 teacher sizes"


def test_floor_is_the_slower_side_plus_one_faster_micro_batch() -> None:
    kw = {"teacher_pass_ms": 80.0, "schedule_ms": 160.0, "m": 8}
    assert bench_overlap.floor_ms(teacher_ms=100.0, student_ms=200.0, **kw) == 210.0
    assert bench_overlap.floor_ms(teacher_ms=300.0, student_ms=200.0, **kw) == 310.0


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--ratios", "0"], "--ratios must be positive"),
        (["--micro-batches", "0"], "--micro-batches must be >= 1"),
        (["--length", "1"], "--length must be >= 2"),
    ],
)
def test_bad_flags_are_one_line(argv: list[str], says: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_overlap.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_mopd_bench_knows_it() -> None:
    assert "overlap" in cli.BENCHMARKS
    assert cli.bench_module("overlap") == "mopd.profiling.bench.overlap"
