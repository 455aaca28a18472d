"""Tier 2 (launch): ``mopd bench worlds`` on a local Ray cluster: one JSON object per
configuration, each naming its peer, each figure what its definition says.

The benchmark starts its own Ray actors (a teacher world and a student world of one rank each,
then a 2-rank world) and runs the bridge across the two worlds in lockstep and one step ahead,
the host path through Ray's object store the same two ways, and one world. At ``--quick`` sizes
its times mean little, so what is checked is the harness: the five configurations with the
fields a reader compares, each ratio computed from the rows it names, the bytes each path
moves through host memory, and the record written. Running it at all also checks that one link
serves several bridges in a row (two Distillers, two TeacherServers, each pair on its own
session).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from mopd.profiling import cli
from mopd.profiling.bench import worlds as bench_worlds
from tests.support.processes import run_module
from tests.support.rounding import ratio_of_rounded

CONFIGS = [
    "bridge, lockstep",
    "bridge, 1 step ahead",
    "host, lockstep",
    "host, 1 step ahead",
    "one world",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path, str]:
    out = tmp_path_factory.mktemp("worlds")
    res = run_module("mopd.profiling.bench.worlds", "--quick", "--json", "--results-dir", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines()]  # --json: nothing else
    return rows, out, res.stderr


def test_one_object_per_configuration_each_naming_its_peer(run: tuple) -> None:
    rows, _, _ = run
    by = {r["config"]: r for r in rows}
    assert [r["config"] for r in rows] == CONFIGS
    for r in rows:
        assert r["step_ms"] > 0 and r["teacher_ms"] > 0, r
        assert r["peer"] in by and r["peer"] != r["config"], r
        peer = by[r["peer"]]
        assert ratio_of_rounded(r["over_peer"], r["step_ms"], peer["step_ms"])
        assert r["steps_ahead"] == (1 if "ahead" in r["config"] else 0)
        assert r["figures"] == "functional (CPU ranks)"
    assert by["bridge, lockstep"]["peer"] == "host, lockstep"
    assert by["bridge, 1 step ahead"]["peer"] == "host, 1 step ahead"


def test_hidden_time_is_the_lockstep_step_less_the_step_ahead(run: tuple) -> None:
    by = {r["config"]: r for r in run[0]}
    for path in ("bridge", "host"):
        lock, ahead = by[f"{path}, lockstep"], by[f"{path}, 1 step ahead"]
        assert lock["hidden_ms"] == 0
        want = max(lock["step_ms"] - ahead["step_ms"], 0.0)
        assert ahead["hidden_ms"] == pytest.approx(want, abs=0.02)
        assert ratio_of_rounded(
            ahead["hidden_of_teacher"], ahead["hidden_ms"], ahead["teacher_ms"]
        ), ahead


def test_the_host_path_copies_its_payload_through_host_memory_the_bridge_none(
    run: tuple,
) -> None:
    for r in run[0]:
        assert r["payload_bytes"] > 0 and r["link_bytes"] == r["payload_bytes"], r
        if r["config"].startswith("host"):
            assert r["host_bytes"] == 3 * r["payload_bytes"], r
        else:
            assert r["host_bytes"] == 0, r


def test_the_record_and_the_summary(run: tuple) -> None:
    rows, out, err = run
    (csv_path,) = out.glob("worlds-*.csv")
    with csv_path.open() as f:
        recorded = list(csv.DictReader(f))
    assert [r["config"] for r in recorded] == CONFIGS
    md = csv_path.with_suffix(".md").read_text()
    assert "Load average" in md and "## Environment" in md and "host path" in md
    assert "summary: the bridge's step is" in err, err[-2000:]
    assert bench_worlds.summary(rows).startswith("summary: the bridge's step is")


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--micro-batches", "0"], "--micro-batches must be >= 1"),
        (["--length", "1"], "--length must be >= 2"),
    ],
)
def test_bad_flags_are_one_line(argv: list[str], says: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_worlds.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_mopd_bench_knows_it() -> None:
    assert "worlds" in cli.BENCHMARKS
    assert cli.bench_module("worlds") == "mopd.profiling.bench.worlds"
