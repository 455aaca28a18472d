"""Starting a torchrun job from a console command, and stopping one for good.

Why this file exists: ``mopd demo`` (and the benchmarks) start torchrun, or their own ranks
(:func:`run_spawned`), themselves, so a user types one command; a job that hangs must then be killed with every worker it started, and say
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
from collections.abc import Callable, Sequence
from typing import Any

import psutil

from mopd.profiling import phases

__all__ = ["free_port", "kill_tree", "run_spawned", "run_torchrun"]


def free_port() -> int:
    """A TCP port on the loopback that no process listens on now, for a one-process rendezvous
    (``MASTER_PORT``): a fixed port collides with any other job on the machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, its process group and every descendant (torchrun's workers included).

    The descendants are listed (psutil) before anything is killed, so none is missed by being
    handed to init when its parent dies first.
    """
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for proc in tree:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            proc.kill()


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


def _spawned_rank(
    run: Callable[[Any], int | None], rank: int, nproc: int, port: int, argd: dict[str, Any]
) -> None:
    import argparse

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rc = run(argparse.Namespace(**argd))
    if rc:
        raise SystemExit(rc)


def run_spawned(
    run: Callable[[Any], int | None], argd: dict[str, Any], *, nproc: int, tool: str
) -> int:
    """Run ``run(argparse.Namespace(**argd))`` on ``nproc`` spawned local ranks (env:// set for
    a one-node job on a free loopback port) and return 0, or 1 once any rank failed: the first
    failure ends the other ranks (none is left waiting on it), and ``tool`` names the failed
    ranks and their exit codes on stderr. ``run`` must be a module-level function (spawn
    pickles it by name)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_spawned_rank, args=(run, r, nproc, port, argd)) for r in range(nproc)
    ]
    for p in procs:
        p.start()
    while any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):
            for p in procs:
                if p.is_alive():
                    p.terminate()
        time.sleep(0.05)
    for p in procs:
        p.join()
    failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        print(f"{tool}: rank(s) failed (rank, exit code): {failed}", file=sys.stderr)
        return 1
    return 0
