"""Tier 2 (launch): real 3-rank torchrun jobs where a rank exits during a step leave clear errors.

Why its own launch: a rank that calls ``os._exit`` takes the pytest under torchrun down with it (and
the harness's per-test agreement), so the job runs this file as a plain script under
``torch.distributed.run`` and the survivors write what they saw (error type, message, elapsed,
where they stopped, the micro-batches they received exact) as JSON into a directory given by
``MOPD_FAULT_DIR``; the test reads those files. Meshes: the teacher is ``tp2`` on global ranks
0-1, the student ``tp1`` on rank 2 (each teacher rank sends half of every micro-batch); steps of
``M`` micro-batches; rank 1 exits.

- ``exit-before-call``: rank 1 exits before planning -> ranks 0 and 2 fail in the metadata
  all-gather (``BridgeCommError``: connection closed, or ``BridgeTimeoutError``), within the
  timeout, their errors leading with ``global rank 1 failed first: does not respond`` (the
  census of the first to fail: rank 1 alone gave no answer).
- ``exit-before-send``: rank 1 exits after planning, while posting its first micro-batch -> the
  student fails in ``receive(0)`` naming rank 1 and micro-batch 0, within the timeout.
- ``exit-between-sends``: rank 1 sends micro-batch 0 (the rows have left), then exits -> the
  student got micro-batch 0 exact and fails in ``receive(1)`` naming rank 1 and micro-batch 1;
  rank 0, whose last micro-batch is never received, fails at ``finish()`` naming that send.
In every case every survivor's error leads with rank 1, and only it, as the rank that failed
first (their own view, in ``BridgeError.own``, names what they waited for), and their bridges
then refuse a new step at once (``BridgeStateError``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 5.0
SLACK_S = 8.0
M = 3
FAILED = ("BridgeCommError", "BridgeTimeoutError")
DEAD = "global rank 1 failed first: does not respond (the process died, or is stopped). "


def _worker(scenario: str, out_dir: Path) -> None:
    """One rank of the job (run under torchrun)."""
    import datetime

    import torch
    import torch.distributed as dist

    from mopd.bridge import Mesh, padded_layout
    from mopd.profiling.synthetic import key_pattern
    from tests.support.reliability import fresh_bridge

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    teacher, student = Mesh(tp=2), Mesh(rank_offset=2)
    posted = [0]

    def hook(point: str, blocks: list) -> None:
        if scenario == "exit-before-send" and point == "packed" and rank == 1:
            os._exit(0)

    bridge = fresh_bridge([teacher], student, [8], timeout_s=TIMEOUT_S, hook=hook)
    lays = [padded_layout([2 * i, 2 * i + 1], 4) for i in range(M)]
    seen: dict = {"where": "plan", "done": []}
    dist.barrier()
    if scenario == "exit-before-call" and rank == 1:
        os._exit(0)
    t0 = time.monotonic()
    try:
        step = bridge.plan_step(
            teacher_layouts={0: lays} if rank < 2 else None,
            student_layouts=lays if rank == 2 else None,
        )
        for i in range(M):
            if rank < 2:
                if scenario == "exit-between-sends" and rank == 1 and i == 1:
                    # dies later in its schedule: micro-batch 0's rows have left (an exit
                    # right after posting would lose them in flight too)
                    posted = step._slots[0].posted
                    assert posted is not None
                    for work in posted.send_works:
                        work.wait(datetime.timedelta(seconds=TIMEOUT_S))
                    os._exit(0)
                seen["where"] = f"send {i}"
                step.send(i, {0: key_pattern(lays[i], 8, torch.float32)})
                posted[0] += 1
            else:
                seen["where"] = f"receive {i}"
                got = step.receive(i)[0]
                if torch.equal(got, key_pattern(lays[i], 8, torch.float32)):
                    seen["done"].append(i)
        seen["where"] = "finish"
        step.finish()
        seen.update(kind="ok", message="")
    except Exception as exc:  # the survivors report whatever they got
        seen.update(kind=type(exc).__name__, message=str(exc), own=getattr(exc, "own", str(exc)))
    seen["elapsed"] = time.monotonic() - t0
    t1 = time.monotonic()
    try:
        bridge.plan_step(
            teacher_layouts={0: lays} if rank < 2 else None,
            student_layouts=lays if rank == 2 else None,
        )
        seen["next"] = ["ok", "", 0.0]
    except Exception as exc:
        seen["next"] = [type(exc).__name__, str(exc), time.monotonic() - t1]
    (out_dir / f"rank{rank}.json").write_text(json.dumps(seen))
    os._exit(0)  # no teardown: the group has a dead member


def _launch(tmp_path: Path, scenario: str) -> dict[int, dict]:
    env = dict(os.environ, MOPD_FAULT_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=3",
            str(Path(__file__).resolve()),
            scenario,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    got = {}
    for r in range(3):
        f = tmp_path / f"rank{r}.json"
        if f.exists():
            got[r] = json.loads(f.read_text())
    assert 1 not in got, "rank 1 exited, it cannot report"
    assert set(got) == {0, 2}, (res.returncode, res.stdout[-3000:], res.stderr[-3000:])
    for r in (0, 2):
        if got[r]["kind"] != "ok":  # named: rank 1, and no one else, failed first
            assert got[r]["message"].startswith(DEAD + f"As a result, global rank {r} ("), got[r]
    for r in (0, 2):  # and then the survivors' bridges refuse at once
        if got[r]["kind"] != "ok":
            kind, msg, elapsed = got[r]["next"]
            assert kind == "BridgeStateError" and elapsed < 1.0, got[r]
            assert "cannot be used after a failed exchange (Bridge" in msg, msg
    return got


@pytest.mark.timeout(180)
def test_rank_exiting_before_calling_the_bridge(tmp_path: Path):
    got = _launch(tmp_path, "exit-before-call")
    for r in (0, 2):
        s = got[r]
        assert s["kind"] in FAILED and s["where"] == "plan", s
        assert s["own"].startswith(
            f"global rank {r}: the bridge's metadata all-gather over global ranks [0, 1, 2]"
        ), s["own"]
        assert s["elapsed"] <= TIMEOUT_S + SLACK_S, s


@pytest.mark.timeout(180)
def test_rank_exiting_before_its_first_send(tmp_path: Path):
    got = _launch(tmp_path, "exit-before-send")
    s = got[2]
    assert s["kind"] in FAILED and s["where"] == "receive 0", s
    assert s["own"].startswith(
        "global rank 2: the bridge exchange (incomplete: receive from global rank 1 "
        "(micro-batch 0, teacher 0, 4 rows)"
    ), s["own"]
    assert "from global rank 0" not in s["own"]
    assert s["elapsed"] <= TIMEOUT_S + SLACK_S, s
    # rank 0 sent all; the student posted micro-batch 0 only, so 1 and 2 stay unmatched
    assert got[0]["kind"] in FAILED and got[0]["where"] == "finish", got[0]
    assert "(micro-batch 1, teacher 0, 4 rows)" in got[0]["own"], got[0]


@pytest.mark.timeout(180)
def test_rank_exiting_between_two_sends(tmp_path: Path):
    got = _launch(tmp_path, "exit-between-sends")
    s = got[2]
    assert s["done"] == [0], s  # micro-batch 0 arrived exact before rank 1 died
    assert s["kind"] in FAILED and s["where"] == "receive 1", s
    assert s["own"].startswith(
        "global rank 2: the bridge exchange (incomplete: receive from global rank 1 "
        "(micro-batch 1, teacher 0, 4 rows)"
    ), s["own"]
    assert "micro-batch 0" not in s["own"] and "from global rank 0" not in s["own"]
    assert s["elapsed"] <= TIMEOUT_S + SLACK_S, s
    s = got[0]
    assert s["kind"] in FAILED and s["where"] == "finish", s
    assert s["own"].startswith(
        "global rank 0: the bridge exchange (incomplete: send to global rank 2 (micro-batch 2, "
    ), s["own"]
    assert s["elapsed"] <= 2 * TIMEOUT_S + SLACK_S, s


if __name__ == "__main__":
    _worker(sys.argv[1], Path(os.environ["MOPD_FAULT_DIR"]))
