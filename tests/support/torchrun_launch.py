"""One torchrun launch of one tier-2 module, and what its ranks reported, test by test.

Why this file exists: the harness (``tests/support/torchrun.py``) starts a module's launch once,
then each of the module's items waits here for its own test. A :class:`Launch` owns the
subprocess (hard timeout, :func:`mopd.profiling.launch.kill_tree` on a hang), reads the JSON
lines the ranks write (``tests/support/torchrun_report.py``) as they arrive, and keeps a bounded
tail of the combined output for the failures that only the output can explain; before killing a
hung launch it asks each rank for its Python stacks. Choosing which rank's report stands for a
test (:func:`pick_reports`) is a pure function, tested on its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mopd.profiling.launch import kill_tree
from tests.support.torchrun_report import ENV_REPORTS, ENV_SELECT, report_file, stacks_file

__all__ = [
    "PHASES",
    "Launch",
    "Pick",
    "RankRecord",
    "pick_reports",
    "rank_list",
    "stack_text",
    "tail_text",
]

PHASES = ("setup", "call", "teardown")
TAIL_LINES = 80
TAIL_LINE_CHARS = 400
STACK_LINES = 30
_TAIL_BYTES = 256 * 1024
_POLL_S = 0.05
_STACKS_WAIT_S = 3.0


@dataclass
class RankRecord:
    """One rank's serialized report of one phase of one test."""

    report: dict[str, Any]
    peer: bool = False  # the rank failed only because the rank agreement said a peer did

    @property
    def outcome(self) -> str:
        return str(self.report.get("outcome"))


@dataclass
class Pick:
    """The report that stands for one phase of a test, and who failed it."""

    when: str
    rank: int
    record: RankRecord
    failed: list[int] = field(default_factory=list)  # ranks that failed on their own
    peers: list[int] = field(default_factory=list)  # ranks that failed because a peer did


def rank_list(ranks: Sequence[int]) -> str:
    """``rank 1`` or ``ranks 0, 2``."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def pick_reports(by_rank: dict[int, dict[str, RankRecord]]) -> list[Pick]:
    """For each phase any rank reported: the first rank that failed it on its own (else the first
    that failed it at all), or, when no rank failed it, the lowest rank's report."""
    picks: list[Pick] = []
    for when in PHASES:
        have = {r: phases[when] for r, phases in sorted(by_rank.items()) if when in phases}
        if not have:
            continue
        failed = [r for r, rec in have.items() if rec.outcome == "failed"]
        own = [r for r in failed if not have[r].peer]
        peers = [r for r in failed if have[r].peer]
        rank = (own or failed or list(have))[0]
        picks.append(Pick(when, rank, have[rank], failed=own, peers=peers))
    return picks


def tail_text(path: Path, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of a text file, each cut at ``TAIL_LINE_CHARS`` characters."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - _TAIL_BYTES))
            text = fh.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""
    kept = text.splitlines()[-lines:]
    return "\n".join(
        line if len(line) <= TAIL_LINE_CHARS else line[:TAIL_LINE_CHARS] + " [...]" for line in kept
    )


_STACK_NOISE = ("/pluggy/", "/_pytest/", "/pytest/__main__.py", "<frozen runpy>")


def stack_text(dump: str, lines: int = STACK_LINES) -> str:
    """A faulthandler dump without pytest's and pluggy's frames, innermost first, bounded."""
    kept = [line for line in dump.splitlines() if not any(n in line for n in _STACK_NOISE)]
    more = [f"[... {len(kept) - lines} more lines]"] if len(kept) > lines else []
    return "\n".join(kept[:lines] + more)


class Launch:
    """``torchrun --nproc-per-node N -m pytest MODULE`` for the tests in ``select`` (all if None).

    Nothing runs until :meth:`start`. The ranks' reports are read by :meth:`poll`, which every
    wait calls; the launch is killed when ``timeout`` seconds have passed since the start.
    """

    def __init__(
        self,
        path: Path,
        *,
        nproc: int,
        timeout: float,
        rootpath: Path,
        select: list[str] | None,
        pytest_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.path = path
        self.env = dict(env or {})  # set for the ranks (the module's knobs)
        self.nproc = nproc
        self.timeout = timeout
        self.rootpath = rootpath
        self.select = select
        self.pytest_args = list(pytest_args)
        # key -> rank -> phase -> record
        self.reports: dict[str, dict[int, dict[str, RankRecord]]] = {}
        self.started: dict[str, set[int]] = {}
        self.collect_errors: dict[int, list[str]] = {}
        self.exitstatus: dict[int, int] = {}  # each rank's pytest exit status
        self.pids: dict[int, int] = {}
        self.stacks: dict[int, str] = {}  # where each rank was when the timeout killed it
        self.returncode: int | None = None
        self.timed_out = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._tail: str | None = None  # kept when the files are dropped
        self._offsets: dict[int, int] = {}
        self._t0 = 0.0

    # ---- lifecycle -----------------------------------------------------------------------

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={self.nproc}",
            "-m",
            "pytest",
            str(self.path),
            f"--rootdir={self.rootpath}",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "-p",  # first: imported by the next one, it would miss assertion rewriting
            "tests.support.torchrun_report",
            "-p",  # the harness, also for modules outside tests/ (a no-op when conftest loads it)
            "tests.support.torchrun",
            *self.pytest_args,
        ]

    def start(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="mopd-torchrun-")
        directory = Path(self._dir.name)
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(self.rootpath), env.get("PYTHONPATH")])
        )
        env.update(self.env)
        env[ENV_REPORTS] = str(directory)
        env.pop(ENV_SELECT, None)
        if self.select is not None:
            select = directory / "select.json"
            select.write_text(json.dumps(self.select), encoding="utf-8")
            env[ENV_SELECT] = str(select)
        # output goes to a file, not a pipe: a hung grandchild holding a pipe open cannot block us
        with (directory / "output.log").open("wb") as log:
            self._t0 = time.monotonic()
            self._proc = subprocess.Popen(
                self.command(),
                cwd=self.rootpath,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def running(self) -> bool:
        return self._proc is not None and self.returncode is None

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self._t0

    def poll(self) -> None:
        """Read what the ranks wrote since the last call; notice an exit; enforce the timeout."""
        if self._proc is None:
            return
        if self.returncode is None:
            rc = self._proc.poll()
            if rc is None and self.elapsed > self.timeout:
                self._dump_stacks()
                kill_tree(self._proc.pid)
                rc = self._proc.wait()
                self.timed_out = True
            self.returncode = rc
        self._read()

    def wait_until(self, done: Any) -> None:
        """Poll until ``done()`` is true or the launch has ended (exited or killed)."""
        try:
            while True:
                self.poll()
                if done() or not self.running:
                    return
                time.sleep(_POLL_S)
        except BaseException:
            self.close()
            raise

    def wait_for(self, key: str) -> None:
        self.wait_until(lambda: self.complete(key))

    def finish(self) -> None:
        """Wait for the launch to end (by itself, or killed at the timeout)."""
        self.wait_until(lambda: False)

    def close(self) -> None:
        """Kill the launch if it still runs; drop its files (read what is left first)."""
        if self._proc is not None and self._proc.poll() is None:
            kill_tree(self._proc.pid)
            self._proc.wait()
        if self._proc is not None and self.returncode is None:
            self.returncode = self._proc.returncode
        if self._dir is not None:
            self._read()
            self._tail = self.tail()
            self._dir.cleanup()
            self._dir = None

    def _dump_stacks(self) -> None:
        """Ask every rank for its Python stacks (``SIGUSR1``), wait a little for them."""
        if self._dir is None:
            return
        self._read()
        directory = Path(self._dir.name)
        for pid in self.pids.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGUSR1)
        deadline = time.monotonic() + _STACKS_WAIT_S
        files = {r: stacks_file(directory, r) for r in self.pids}
        while time.monotonic() < deadline:
            if all(f.exists() and f.stat().st_size for f in files.values()):
                time.sleep(0.2)  # let the dumps complete
                break
            time.sleep(_POLL_S)
        for rank, f in sorted(files.items()):
            text = f.read_text(encoding="utf-8", errors="replace") if f.exists() else ""
            if text.strip():
                self.stacks[rank] = stack_text(text)

    # ---- results -------------------------------------------------------------------------

    def complete(self, key: str) -> bool:
        """Every rank reported the test's teardown (so all its phases)."""
        by_rank = self.reports.get(key, {})
        return len(by_rank) == self.nproc and all("teardown" in p for p in by_rank.values())

    def any_failed(self) -> bool:
        return any(
            rec.outcome == "failed"
            for by_rank in self.reports.values()
            for phases in by_rank.values()
            for rec in phases.values()
        )

    def tail(self) -> str:
        """The bounded tail of the ranks' combined output (torchrun's too)."""
        if self._dir is not None:
            return tail_text(Path(self._dir.name) / "output.log")
        return self._tail or ""

    def ended(self) -> str:
        """How the launch ended, as a sentence fragment (for failure messages)."""
        if self.timed_out:
            return f"timed out after {self.timeout:g}s (ranks hung) and was killed"
        if self.returncode is None:
            return "is still running"
        return f"exited {self.returncode}"

    def _read(self) -> None:
        if self._dir is None:
            return
        directory = Path(self._dir.name)
        for rank in range(self.nproc):
            path = report_file(directory, rank)
            offset = self._offsets.get(rank, 0)
            try:
                with path.open("rb") as fh:
                    fh.seek(offset)
                    chunk = fh.read()
            except FileNotFoundError:
                continue
            end = chunk.rfind(b"\n") + 1  # a line still being written waits for the next read
            if not end:
                continue
            self._offsets[rank] = offset + end
            for line in chunk[:end].decode("utf-8", errors="replace").splitlines():
                if line.strip():
                    self._record(rank, json.loads(line))

    def _record(self, rank: int, rec: dict[str, Any]) -> None:
        kind = rec.get("type")
        if kind == "report":
            report = rec["report"]
            phases = self.reports.setdefault(rec["key"], {}).setdefault(rank, {})
            phases[str(report.get("when"))] = RankRecord(report, bool(rec.get("peer")))
        elif kind == "start":
            self.started.setdefault(rec["key"], set()).add(rank)
        elif kind == "collect":
            self.collect_errors.setdefault(rank, []).append(str(rec.get("text", "")))
        elif kind == "hello":
            self.pids[rank] = int(rec["pid"])
        elif kind == "finish":
            self.exitstatus[rank] = int(rec["exitstatus"])
