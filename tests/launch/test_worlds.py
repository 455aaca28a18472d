"""Tier 2 (launch): the teacher in its own torchrun job, the student in another, one bridge.

What a user of two jobs relies on, each world a separate ``torchrun`` with its own default
group (gloo, its own master port), connected by one address
(:mod:`tests.support.worlds_job`: a GRPO step from ``Rollouts``, teacher TP2 PP2 and student
TP2 DP2 + SP):

- with the teacher one step ahead (``Distiller(steps_ahead=1)``, three steps), the rows every
  student rank receives in each step are bit-equal to the same steps run as one 8-rank world in
  lockstep, the loss and every finalized ``main_grad`` match float64 (loss rtol 1e-5, grads
  1e-4), and the teacher world's pass over step ``k + 1`` runs while the student's schedule of
  step ``k`` does (their wall-clock spans overlap), its rows held in between;
- two teacher worlds, each sample routed to one of them, are exact the same way;
- a teacher rank SIGKILLed while it scores the next step ahead is named, by its world, on
  every student rank within the timeout (and the teacher job ends; one killed in a lockstep
  step's forward is tests/launch/test_ray.py's case, named by both worlds and the driver); a
  student rank SIGKILLed while the teacher scores ahead is a named error on every rank
  of the teacher world, naming the student world's ranks it lost (torchrun ends the whole job
  of a rank that died, the link's host with it);
- bad rollouts on one student rank are the same ``ValueError`` on every rank of both worlds.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.launch

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 600


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _job(world: str, nproc: int, out: Path, *args: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-port", str(_port()), "-m", "tests.support.worlds_job", "--world", world,
        "--out", str(out), *args,
    ]  # fmt: skip
    log = open(out / f"{world}.log", "w")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _run(out: Path, teachers: int, fault: str | None = None, *more: str) -> list[int]:
    """The student job and ``teachers`` teacher jobs, connected; their exit codes."""
    address = f"127.0.0.1:{_port()}"
    names = ["student"] + [f"teacher-{k}" for k in range(teachers)]
    extra = (["--fault", fault] if fault else []) + list(more)
    jobs = [_job("student", 4, out, "--worlds", ",".join(names), "--address", address, *extra)]
    jobs += [_job(n, 4, out, "--address", address, *extra) for n in names[1:]]
    try:
        return [j.wait(timeout=TIMEOUT) for j in jobs]
    finally:
        for j in jobs:
            if j.poll() is None:
                j.kill()


def _student(out: Path, world: str = "student") -> list[dict[str, Any]]:
    return [torch.load(out / f"{world}-{r}.pt", weights_only=False) for r in range(4)]


def _tail(out: Path) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(out.glob("*.log")))


STEPS = 3


def test_teacher_world_one_step_ahead_is_bit_equal_to_one_world_and_overlaps(
    tmp_path: Path,
) -> None:
    codes = _run(tmp_path, 1, None, "--steps", str(STEPS), "--ahead", "1")
    assert codes == [0, 0], _tail(tmp_path)
    one = _job("one", 8, tmp_path, "--steps", str(STEPS))
    assert one.wait(timeout=TIMEOUT) == 0, _tail(tmp_path)
    served = [json.loads((tmp_path / f"teacher-0-{r}.json").read_text()) for r in range(4)]
    assert [s["served"] for s in served] == [STEPS] * 4
    for two, ref in zip(_student(tmp_path), _student(tmp_path, "one"), strict=True):
        assert len(two["steps"]) == len(ref["steps"]) == STEPS
        for k, (got, want) in enumerate(zip(two["steps"], ref["steps"], strict=True)):
            assert not got["problems"], (k, got["problems"])
            assert got["loss"] == want["loss"], k
            assert sorted(got["rows"]) == sorted(want["rows"]) == [0, 1]
            for i, rows in got["rows"].items():
                assert sorted(rows) == sorted(want["rows"][i])
                for o, r in rows.items():
                    assert r.numel() > 0 and torch.equal(r, want["rows"][i][o]), (k, i, o)
        losses = [s["loss"] for s in two["steps"]]
        assert len(set(losses)) == STEPS  # each step its own samples: a step's rows are its own
    # the teacher's last stage (ranks 2, 3 of its world) scored step k + 1 ahead while the
    # student's schedule ran step k, and held its rows in between
    spans = [s["span"] for s in _student(tmp_path)[0]["steps"]]
    for r in (2, 3):
        steps = [e for e in served[r]["history"] if e["kind"] == "next"]
        assert [e["kind"] for e in served[r]["history"][:2]] == ["submit", "submit"]
        assert len(steps) == STEPS
        for k in range(STEPS - 1):
            start, end = steps[k]["ahead_span"]
            overlap = min(end, spans[k][1]) - max(start, spans[k][0])
            assert overlap > 0, (k, steps[k], spans[k])
            assert steps[k]["held_bytes"] > 0
        assert steps[-1]["held_bytes"] == 0 and steps[-1]["timings"]["ahead"] < 0.05


def test_two_teacher_worlds_routed_match_float64(tmp_path: Path) -> None:
    codes = _run(tmp_path, teachers=2)
    assert codes == [0, 0, 0], _tail(tmp_path)
    for rep in _student(tmp_path):
        assert not rep["problems"], rep["problems"]
        assert rep["loss_err"] < 1e-5
        owners = {k for rows in rep["rows"].values() for k in rows}
        assert owners == {0, 1}  # both teacher worlds delivered rows here


def test_a_teacher_rank_killed_scoring_ahead_is_named_in_both_worlds(tmp_path: Path) -> None:
    codes = _run(tmp_path, 1, "kill-teacher-ahead", "--steps", str(STEPS), "--ahead", "1")
    assert codes[0] == 0 and codes[1] != 0, _tail(tmp_path)
    dead = 'global rank 1 of world "teacher-0"'
    for rep in _student(tmp_path):
        last = rep["steps"][-1]
        # a transport error, or (where the dead peer's sockets are not seen closing) the wait's
        # timeout: either way named by the census, the dead rank first
        assert last["error"] in ("BridgeCommError", "BridgeTimeoutError"), last
        assert dead in last["text"].split("failed first")[0], last
        assert last["elapsed_s"] < 60 + 30


def test_a_student_rank_killed_while_the_teacher_scores_ahead_is_named_there(
    tmp_path: Path,
) -> None:
    codes = _run(tmp_path, 1, "kill-student", "--steps", str(STEPS), "--ahead", "1")
    assert codes[0] != 0 and codes[1] == 0, _tail(tmp_path)  # torchrun ends the student job
    for r in range(4):  # every rank of the teacher world: a named error about the student's
        seen = json.loads((tmp_path / f"teacher-0-{r}.json").read_text())
        assert seen["error"] in ("BridgeCommError", "BridgeTimeoutError"), (r, seen)
        assert 'of world "student"' in seen["text"], (r, seen)


def test_bad_rollouts_are_one_value_error_in_both_worlds(tmp_path: Path) -> None:
    codes = _run(tmp_path, teachers=1, fault="bad-rollouts")
    assert codes == [0, 0], _tail(tmp_path)
    texts = {rep["text"] for rep in _student(tmp_path)}
    texts |= {json.loads((tmp_path / f"teacher-0-{r}.json").read_text())["text"] for r in range(4)}
    errors = {rep["error"] for rep in _student(tmp_path)}
    assert errors == {"ValueError"} and len(texts) == 1, texts
    assert "teacher" in texts.pop()
