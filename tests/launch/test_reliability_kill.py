"""Tier 2 (launch): a rank SIGKILLed inside megatron's schedule is named, alone, on every survivor.

Why its own launch: the killed process takes any harness running in it down. Four processes
are started here directly (``env://``, global rank 0 hosting the job's store; torchrun would
tear the survivors down as soon as one rank dies), each running the reliability job
(``tests/support/distill_job.py``: a :class:`mopd.mcore.Distiller` around megatron-core's
schedule, teacher ``tp2`` on ranks 0-1, student ``tp2 dp2`` on 0-3). Student rank 3 kills
itself (``SIGKILL``) in its forward of micro-batch 1; its TP peer (rank 2) loses it inside
megatron's own all-reduce, the teachers at ``finish()`` (their sends to ranks 2 and 3 wait).
Each survivor writes what it got (``MOPD_FAULT_DIR``): its first error leads with
``global rank 3 failed first: does not respond (the process died, or is stopped)`` and names
no other rank but itself (the first survivor to fail took a census: rank 3 alone gave no
answer), within the bridge timeout and the census.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NPROC = 4
TIMEOUT_S = 5.0
SLACK_S = 10.0
NAMED = ("BridgeCommError", "BridgeTimeoutError")
DEAD = "global rank 3 failed first: does not respond (the process died, or is stopped). "


def _worker(out_dir: Path) -> None:
    """One rank of the job."""
    from typing import Any

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from tests.support.dist import ensure_world
    from tests.support.distill_job import Job
    from tests.support.megatron_cpu import apply

    ensure_world()
    apply()
    parallel_state.initialize_model_parallel(1, create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(7)
    job = Job(timeout_s=TIMEOUT_S)
    rank = dist.get_rank()
    if rank == 3:
        calls = [0]

        def killed(module: Any, args: Any) -> None:
            calls[0] += 1
            if calls[0] == 2:  # the student's forward of micro-batch 1
                os.kill(os.getpid(), signal.SIGKILL)

        job.student.decoder.register_forward_pre_hook(killed)
    dist.barrier()
    t0 = time.monotonic()
    seen: dict[str, Any] = {"kind": "ok", "message": "", "own": ""}
    try:
        job.run(1)
    except Exception as exc:  # the survivors report whatever they got
        seen.update(kind=type(exc).__name__, message=str(exc), own=getattr(exc, "own", str(exc)))
    seen["elapsed"] = time.monotonic() - t0
    (out_dir / f"rank{rank}.json").write_text(json.dumps(seen))
    os._exit(0)  # no teardown: the job has a dead member


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(240)
def test_a_rank_killed_inside_the_schedule_is_named_alone_on_every_survivor(tmp_path: Path):
    env = dict(
        os.environ,
        MOPD_FAULT_DIR=str(tmp_path),
        OMP_NUM_THREADS="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE=str(NPROC),
        MOPD_TEST_TIMEOUT_S="60",
    )
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    procs = [
        subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve())],
            cwd=ROOT,
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(NPROC)
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=200)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[3].returncode == -signal.SIGKILL, outputs[3][-3000:]
    got = {}
    for r in range(NPROC):
        f = tmp_path / f"rank{r}.json"
        if f.exists():
            got[r] = json.loads(f.read_text())
    assert set(got) == {0, 1, 2}, [o[-2000:] for o in outputs]
    for r, s in got.items():
        assert s["kind"] in NAMED, (r, s)
        assert s["message"].startswith(DEAD + f"As a result, global rank {r} ("), (r, s)
        named = {int(x) for x in re.findall(r"global rank (\d+)", s["message"])}
        assert named == {3, r}, (r, s)  # the dead rank and the reporting one, nobody else
        assert s["elapsed"] <= 2 * TIMEOUT_S + SLACK_S, (r, s)


if __name__ == "__main__":
    _worker(Path(os.environ["MOPD_FAULT_DIR"]))
