"""Tier 2 (launch): a rank SIGKILLed inside megatron's schedule, or inside the rollouts exchange,
is named, alone, on every survivor, whose next step is the library's ``BridgeStateError``.

Why its own launch: the killed process takes any harness running in it down. Four processes
are started here directly (``env://``, global rank 0 hosting the job's store, and keeping it until
the other survivors have reported; torchrun would tear the survivors down as soon as one rank
dies), each running the reliability job
(``tests/support/distill_job.py``: a :class:`mopd.mcore.Distiller` around megatron-core's
schedule, teacher ``tp2`` on ranks 0-1, student ``tp2 dp2`` on 0-3). Student rank 3 kills
itself (``SIGKILL``) in its forward of micro-batch 1 (its TP peer, rank 2, loses it inside
megatron's own all-reduce, the teachers at ``finish()``: their sends to ranks 2 and 3 wait), or
inside ``Distiller.step(rollouts)``'s exchange, between the headers' all-gather and the tokens'
all-to-all (every survivor loses it there). Each survivor writes what it got
(``MOPD_FAULT_DIR``): its first error leads with ``global rank 3 failed first: does not respond
(the process died, or is stopped)`` and names no other rank but itself (the first survivor to
fail took a census: rank 3 alone gave no answer), within the bridge timeout and the census; its
next step is ``BridgeStateError`` at once, never a transport error.
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
    from mopd.mcore import rollouts

    job = Job(timeout_s=TIMEOUT_S)
    rank = dist.get_rank()
    where = os.environ["MOPD_KILL_IN"]
    if rank == 3 and where == "schedule":
        calls = [0]

        def killed(module: Any, args: Any) -> None:
            calls[0] += 1
            if calls[0] == 2:  # the student's forward of micro-batch 1
                os.kill(os.getpid(), signal.SIGKILL)

        job.student.decoder.register_forward_pre_hook(killed)
    if rank == 3 and where == "rollouts":

        def killed_sending(*args: Any, **kwargs: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)

        rollouts._send_tokens = killed_sending  # type: ignore[assignment]

    def step(seed: int) -> Any:
        return job.run(seed) if where == "schedule" else job.run_rollouts(job.rollouts(seed))

    dist.barrier()
    seen: dict[str, Any] = {}
    for key, seed in (("first", 1), ("next", 2)):
        got: dict[str, Any] = {"kind": "ok", "message": "", "own": ""}
        t0 = time.monotonic()
        try:
            step(seed)
        except Exception as exc:  # the survivors report whatever they got
            got.update(kind=type(exc).__name__, message=str(exc), own=getattr(exc, "own", str(exc)))
        got["elapsed"] = time.monotonic() - t0
        seen[key] = got
    (out_dir / f"rank{rank}.json").write_text(json.dumps(seen))
    if rank == 0:  # it hosts the store: the other survivors may still read the board in it
        others = [out_dir / f"rank{r}.json" for r in (1, 2)]
        deadline = time.monotonic() + 2 * TIMEOUT_S + SLACK_S
        while not all(f.exists() for f in others) and time.monotonic() < deadline:
            time.sleep(0.05)
    os._exit(0)  # no teardown: the job has a dead member


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("where", ["schedule", "rollouts"], ids=["schedule", "rollouts-exchange"])
def test_a_rank_killed_is_named_alone_on_every_survivor(tmp_path: Path, where: str):
    env = dict(
        os.environ,
        MOPD_FAULT_DIR=str(tmp_path),
        MOPD_KILL_IN=where,
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
    phase = "step 0, the rollouts exchange" if where == "rollouts" else "step 0, "
    for r, seen in got.items():
        s = seen["first"]
        assert s["kind"] in NAMED, (r, s)
        assert s["message"].startswith(DEAD + f"As a result, global rank {r} ({phase}"), (r, s)
        named = {int(x) for x in re.findall(r"global rank (\d+)", s["message"])}
        assert named == {3, r}, (r, s)  # the dead rank and the reporting one, nobody else
        assert s["elapsed"] <= 2 * TIMEOUT_S + SLACK_S, (r, s)
        nxt = seen["next"]
        assert nxt["kind"] == "BridgeStateError" and nxt["elapsed"] < 2.0, (r, nxt)
        assert DEAD in nxt["message"], (r, nxt)


if __name__ == "__main__":
    _worker(Path(os.environ["MOPD_FAULT_DIR"]))
