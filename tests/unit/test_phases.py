"""Tier 1: the phase files a job's ranks write and the report a launcher prints from them on a
timeout (``mopd.profiling.phases``): what a user reads when ``mopd demo`` is killed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mopd.profiling import phases


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(phases.ENV_VAR, str(tmp_path))
    monkeypatch.setattr(phases, "_started", None)
    return tmp_path


def test_a_rank_records_its_phase_and_when_it_began(folder: Path, monkeypatch) -> None:
    clock = iter([100.0, 130.0])
    monkeypatch.setattr(phases.time, "time", lambda: next(clock))
    monkeypatch.setenv("RANK", "3")
    phases.enter("building")
    phases.enter("step 1 of 3")
    assert [p.name for p in folder.iterdir()] == ["rank3.json"]  # replaced, no temporaries left
    got = phases.read(folder)
    assert got == {3: phases.RankPhase(rank=3, phase="step 1 of 3", since=130.0, up_since=100.0)}


def test_nothing_is_written_without_the_launchers_folder(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(phases.ENV_VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    phases.enter("anything", rank=0)
    assert list(tmp_path.iterdir()) == []


def test_a_folder_that_went_away_is_no_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(phases.ENV_VAR, str(tmp_path / "gone"))
    phases.enter("late", rank=0)  # the launcher removed its folder: the rank carries on


def test_unreadable_files_are_left_out(folder: Path) -> None:
    phases.enter("ok", rank=0)
    (folder / "rank1.json").write_text("{not json")
    (folder / "rank2.json").write_text(json.dumps({"phase": "no times"}))
    (folder / "rankX.json").write_text(json.dumps({"phase": "p", "since": 1, "up_since": 1}))
    assert sorted(phases.read(folder)) == [0]


def _phase(rank: int, phase: str, since: float, up: float = 0.0) -> phases.RankPhase:
    return phases.RankPhase(rank=rank, phase=phase, since=since, up_since=up)


def test_the_report_groups_ranks_by_phase_with_their_durations() -> None:
    recorded = {
        0: _phase(0, "step 2 of 3", since=880.0),
        1: _phase(1, "step 2 of 3", since=875.0),
        2: _phase(2, "building the models", since=400.0),
        3: _phase(3, "step 2 of 3", since=899.6),
        5: _phase(5, "building the models", since=410.0, up=20.0),
    }
    lines = phases.timeout_report(recorded, ranks=range(8), nproc=8, timeout_s=900, now=900.0)
    assert lines == [
        "the job timed out after 900 s and was killed; where its ranks were:",
        "  ranks 0, 1, 3: step 2 of 3, for 0.4-25 s (up 900 s)",
        "  ranks 2, 5: building the models, for 490-500 s (up 880-900 s)",
        "  ranks 4, 6, 7: no phase recorded (its Python had not started yet)",
    ]


def test_one_node_of_several_lists_what_its_ranks_recorded_and_counts_the_rest() -> None:
    """Where the rendezvous numbers the ranks, the launcher does not know which it started."""
    recorded = {r: _phase(r, "step 1 of 1", since=10.0) for r in (5, 6, 7)}
    lines = phases.timeout_report(recorded, ranks=None, nproc=4, timeout_s=20, now=20.0)
    assert lines[1:] == [
        "  ranks 5-7: step 1 of 1, for 10 s (up 20 s)",
        "  1 more rank of this node: no phase recorded (its Python had not started yet)",
    ]
    lines = phases.timeout_report({}, ranks=range(1), nproc=1, timeout_s=5, now=5.0)
    assert lines[1:] == ["  rank 0: no phase recorded (its Python had not started yet)"]
