"""Tier 1 driving real 3-rank torchrun jobs: a rank that exits mid-exchange leaves clear errors.

Why a unit test: a rank that calls ``os._exit`` takes the pytest under torchrun down with it (and
the harness's per-test agreement), so the job runs this file as a plain script under
``torch.distributed.run`` and the survivors write what they saw (error type, message, elapsed)
as JSON into a directory given by ``MOPD_FAULT_DIR``; the test reads those files. Meshes: the
teacher is ``tp2`` on global ranks 0-1, the student ``tp1`` on rank 2; rank 1 exits.

- ``exit-before-send``: rank 1 exits after the metadata phase, before posting its sends -> the
  student (rank 2) gets ``BridgeCommError`` (connection closed) or ``BridgeTimeoutError`` naming
  rank 1, within the timeout; rank 0 (it only sends to rank 2) completes.
- ``exit-before-call``: rank 1 exits before calling the bridge -> ranks 0 and 2 fail in the
  metadata all-gather, within the timeout.
"""

from __future__ import annotations

import datetime
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


def _worker(scenario: str, out_dir: Path) -> None:
    """One rank of the job (run under torchrun)."""
    import torch
    import torch.distributed as dist

    from mopd.bridge import GroupPool, Mesh, padded_layout
    from mopd.profiling.synthetic import key_pattern
    from tests.support.bridges import make_bridge

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    teacher, student = Mesh(tp=2), Mesh(rank_offset=2)
    pool = GroupPool(backend="gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))

    def hook(point: str, blocks: list) -> None:
        if scenario == "exit-before-send" and point == "packed" and rank == 1:
            os._exit(0)

    bridge = make_bridge(pool, [teacher], student, [8], debug_hook=hook, timeout_s=TIMEOUT_S)
    lay = padded_layout([0, 1], 4)
    kw = (
        {"hidden": {0: key_pattern(lay, 8, torch.float32)}, "layouts": {0: lay}}
        if rank < 2
        else {"student_layout": lay}
    )
    dist.barrier()
    if scenario == "exit-before-call" and rank == 1:
        os._exit(0)
    t0 = time.monotonic()
    try:
        bridge.exchange(**kw).wait()
        seen = {"kind": "ok", "message": ""}
    except Exception as exc:  # the survivors report whatever they got
        seen = {"kind": type(exc).__name__, "message": str(exc)}
    seen["elapsed"] = time.monotonic() - t0
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
    return got


@pytest.mark.timeout(180)
def test_rank_exiting_before_its_sends(tmp_path: Path):
    got = _launch(tmp_path, "exit-before-send")
    assert got[0]["kind"] == "ok", got[0]  # rank 0's receiver was there
    kind, msg, elapsed = got[2]["kind"], got[2]["message"], got[2]["elapsed"]
    assert kind in ("BridgeCommError", "BridgeTimeoutError"), got[2]
    assert msg.startswith(
        "global rank 2: the bridge exchange (incomplete: receive from global rank 1"
    )
    assert elapsed <= TIMEOUT_S + SLACK_S, elapsed


@pytest.mark.timeout(180)
def test_rank_exiting_before_calling_the_bridge(tmp_path: Path):
    got = _launch(tmp_path, "exit-before-call")
    for r in (0, 2):
        kind, msg, elapsed = got[r]["kind"], got[r]["message"], got[r]["elapsed"]
        assert kind in ("BridgeCommError", "BridgeTimeoutError"), got[r]
        assert msg.startswith(
            f"global rank {r}: the bridge's metadata all-gather over global ranks [0, 1, 2]"
        )
        assert elapsed <= TIMEOUT_S + SLACK_S, elapsed


if __name__ == "__main__":
    _worker(sys.argv[1], Path(os.environ["MOPD_FAULT_DIR"]))
