"""Starting a torchrun job from a console command, and stopping one for good.

Why this file exists: ``mopd demo`` (and the benchmarks) start torchrun themselves, so a user
types one command; a job that hangs must then be killed with every worker it started, and say
where each rank was. :func:`kill_tree` does the killing (the test harness uses it for hung
launches too); :func:`run_torchrun` gives the ranks a folder for their phase files
(:mod:`mopd.profiling.phases`) and prints them when it kills the job.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from mopd.profiling import phases

__all__ = ["free_port", "kill_tree", "run_torchrun"]


def free_port() -> int:
    """A TCP port on the loopback that no process listens on now, for a one-process rendezvous
    (``MASTER_PORT``): a fixed port collides with any other job on the machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, its process group and every descendant (torchrun's workers included)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo.extend(children.get(p, []))
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for p in seen:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


def run_torchrun(
    module: str,
    args: list[str],
    *,
    nproc: int,
    timeout_s: float,
    env: dict[str, str] | None = None,
    rendezvous: list[str] | None = None,
    ranks: Sequence[int] | None = None,
    tool: str = "mopd",
    timeout_hint: str = "",
) -> int:
    """Run ``python -m module args...`` under ``torchrun --nproc-per-node nproc``.

    ``rendezvous``: torchrun's rendezvous flags (default ``["--standalone"]``, one node). The
    whole job (torchrun and every worker, see :func:`kill_tree`) is killed after ``timeout_s``
    seconds; returns the exit code (124 on timeout). The ranks get a fresh folder for their
    phase files (``MOPD_PHASE_DIR``, removed afterwards; a folder the caller's environment
    already names is used instead, and kept); on a timeout ``tool`` prints, on stderr, the
    phase each rank of the job's was in and for how long (``ranks``: the global ranks started
    here, where known: default ``0 .. nproc - 1`` for a one-node rendezvous, else those that
    recorded a phase, see :func:`mopd.profiling.phases.timeout_report`), then ``timeout_hint``
    (e.g. which flag gives more time).
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *(rendezvous if rendezvous is not None else ["--standalone"]),
        f"--nproc-per-node={nproc}",
        "-m",
        module,
        *args,
    ]
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    full_env.update(env or {})
    given = full_env.get(phases.ENV_VAR)  # a caller's folder is used as it is, and kept
    with (
        contextlib.nullcontext(given)
        if given
        else tempfile.TemporaryDirectory(prefix="mopd-phases-")
    ) as phase_dir:
        full_env[phases.ENV_VAR] = phase_dir
        proc = subprocess.Popen(cmd, env=full_env, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            now = time.time()
            kill_tree(proc.pid)
            proc.wait()
            if ranks is None and rendezvous in (None, ["--standalone"]):
                ranks = range(nproc)  # one node: torchrun numbers its ranks 0 .. nproc - 1
            report = phases.timeout_report(
                phases.read(phase_dir), ranks=ranks, nproc=nproc, timeout_s=timeout_s, now=now
            )
            for line in [*report, *([timeout_hint] if timeout_hint else [])]:
                print(f"{tool}: {line}" if not line.startswith(" ") else line, file=sys.stderr)
            sys.stderr.flush()
            return 124
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            return 130
