"""Tier 2 (launch): ``mopd bench bridge`` on CPU ranks: the step API's rows exact, bytes at the minimum.

The benchmark starts its own gloo ranks (two here, tiny sizes); its times mean nothing on a
CPU, so what is checked is what a GPU run would move: every delivered row bit for bit, the
bytes across ranks plus local copies equal to the minimum (each token once), fewer than the
all-gather's, one pack and one unpack launch per rank and micro-batch, and the CPU label on
every row and in the plot's title.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mopd.profiling.bench import bridge as bench_bridge
from tests.support.processes import run_module

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def output() -> list[dict]:
    res = run_module(
        "mopd.profiling.bench.bridge", "--nproc", "2", "--iters", "1",
        "--samples", "4", "--max-len", "16", "--hidden", "8", "--json", "--no-record",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return [json.loads(line) for line in res.stdout.splitlines()]  # --json: nothing else


@pytest.fixture(scope="module")
def rows(output: list[dict]) -> list[dict]:
    return [r for r in output if "receive_memory" not in r]


def test_two_teacher_receive_memory_is_one_row_per_token(output: list[dict]) -> None:
    """Each teacher's rows arrive compact: a student rank's receive buffers hold one row per
    token (plus at most tp - 1 = 1 padding row per teacher and micro-batch), not K x [N, H]."""
    mem = [r["receive_memory"] for r in output if "receive_memory" in r]
    assert [r["student rank"] for r in mem] == [0, 1]
    row = 8 * 2  # bf16 rows of 8
    for r in mem:
        assert r["exact"] is True and r["teachers"] == 2
        tokens, got = r["tokens x H bytes"], r["receive bytes (compact)"]
        assert 0 < tokens <= got <= tokens + 2 * r["micro-batches"] * row
        assert got <= r["[N, H] bytes"] + 2 * r["micro-batches"] * row
        assert r["K x [N, H] bytes (before)"] >= 2 * r["[N, H] bytes"]


def test_two_cpu_ranks_every_case_exact_at_the_minimum(rows: list[dict]) -> None:
    assert [(r["case"], r["integrity"]) for r in rows] == [
        ("disjoint: tp1dp1 -> tp1dp1", "off"),
        ("colocated: tp2dp1 -> dp2", "off"),
        ("disjoint: tp1dp1 -> tp1dp1", "on"),
    ]
    for r in rows:
        assert r["world"] == 2 and r["exact"] is True
        assert r["figures"].startswith("functional (CPU: 2 gloo rank(s)")
        assert r["bytes across ranks"] + r["local copy bytes"] == r["minimum bytes"]
        assert r["minimum bytes"] == r["tokens"] * 8 * 2  # bf16 rows of 8
        assert r["all-gather bytes across ranks"] >= r["bytes across ranks"]
        assert r["launches/rank/micro-batch (max)"] <= 3  # pack, unpack, one local pass
        assert r["bridge step ms"] > 0 and r["plan_step ms"] > 0 and r["all-gather ms"] > 0
    disjoint, colocated, checked = rows
    assert disjoint["local copy bytes"] == 0 and disjoint["transfers"] == 1
    assert disjoint["pack bytes"] == disjoint["minimum bytes"]
    # compact delivery: the one teacher's rows land in place in the receive buffer, no unpack
    assert disjoint["unpack bytes"] == 0
    # both student ranks are replicas of the one teacher TP group: everything is a local copy
    assert colocated["local copy bytes"] == colocated["minimum bytes"] > 0
    assert colocated["bytes across ranks"] == colocated["transfers"] == 0
    assert checked["integrity cost"] > 0 and checked["integrity off ms"] > 0


def test_plot_names_the_cpu_caveat(rows: list[dict], tmp_path: Path) -> None:
    import matplotlib.image

    png = bench_bridge.plot(rows, tmp_path / "b.png", "bridge", caveat="CPU run: functional")
    assert png.read_bytes()[:8] == PNG_MAGIC
    img = matplotlib.image.imread(png)
    assert img.shape[0] > 300 and img.std() > 0.05


def test_cases_per_world() -> None:
    one = bench_bridge.cases_for(1, cuda=False)
    assert [c.name for c in one] == ["world 1, colocated, local copies"]
    assert [c.local_copy for c in bench_bridge.cases_for(1, cuda=True)] == [True, False]
    four = bench_bridge.cases_for(4, cuda=False)
    assert [c.micro_batches for c in four] == [1, 1, 2]
    for c in four:
        ranks = set(c.teacher.ranks) | set(c.student.ranks)
        assert ranks == {0, 1, 2, 3}, c.name


def test_bad_flags_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_bridge.main(["--nproc", "0"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    prog = "python -m mopd.profiling.bench.bridge"  # its usage names the command as typed
    assert err == f"{prog}: error: --nproc must be >= 1, got 0 (see {prog} --help)\n"
