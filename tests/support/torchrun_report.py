"""The pytest plugin each rank of a harness launch loads: run the chosen tests, write a report.

Why this file exists: under plain ``pytest`` the harness (``tests/support/torchrun.py``) runs a
tier-2 module in one torchrun launch and reports every test as its own item. This plugin, given
to the ranks' pytest with ``-p``, is how results come back without parsing anyone's stdout:

- it keeps only the tests the parent selected (a JSON list of test keys, see :func:`node_key`, in
  the file named by ``MOPD_TORCHRUN_SELECT``), in collection order;
- it appends one JSON line per event of its rank to ``$MOPD_TORCHRUN_REPORTS/rank-<RANK>.jsonl``:
  its pid, a test started, a test phase's report (serialized by pytest's own report hooks, as
  pytest-xdist does), a collection error, the session's exit status;
- on ``SIGUSR1`` it dumps every thread's Python stack to ``stacks-<RANK>.txt`` there, so that a
  launch killed at its timeout can say where each rank was stuck.

Without those variables (a module run directly under torchrun) it does nothing.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
from pathlib import Path
from typing import IO, Any

import pytest

__all__ = [
    "ENV_REPORTS",
    "ENV_SELECT",
    "PEER_FAILURE",
    "node_key",
    "report_file",
    "stacks_file",
]

ENV_REPORTS = "MOPD_TORCHRUN_REPORTS"
ENV_SELECT = "MOPD_TORCHRUN_SELECT"
# set on a rank's report when the rank passed but the rank agreement says a peer failed
PEER_FAILURE = "torchrun_peer_failure"

_OUT: IO[str] | None = None
_STACKS: IO[str] | None = None


def node_key(nodeid: str) -> str:
    """A test's node id without its file part (``test_x[a]``, ``TestC::test_y``).

    The parent and the ranks may spell the file part differently (a module outside the rootdir);
    the rest is the same on both sides.
    """
    return nodeid.split("::", 1)[1] if "::" in nodeid else nodeid


def report_file(directory: Path, rank: int) -> Path:
    """Where ``rank`` writes its JSON lines."""
    return directory / f"rank-{rank}.jsonl"


def stacks_file(directory: Path, rank: int) -> Path:
    """Where ``rank`` dumps its stacks on ``SIGUSR1``."""
    return directory / f"stacks-{rank}.txt"


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _write(record: dict[str, Any]) -> None:
    global _OUT
    directory = os.environ.get(ENV_REPORTS)
    if not directory:
        return
    if _OUT is None:
        _OUT = report_file(Path(directory), _rank()).open("a", encoding="utf-8")
    _OUT.write(json.dumps(record, default=str) + "\n")
    _OUT.flush()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    select = os.environ.get(ENV_SELECT)
    if not select:
        return
    wanted = set(json.loads(Path(select).read_text(encoding="utf-8")))
    keep = [item for item in items if node_key(item.nodeid) in wanted]
    dropped = [item for item in items if node_key(item.nodeid) not in wanted]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _write({"type": "collect", "nodeid": report.nodeid, "text": report.longreprtext})


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    _write({"type": "start", "key": node_key(nodeid)})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    config = _CONFIG
    if config is None:
        return
    data = config.hook.pytest_report_to_serializable(config=config, report=report)
    peer = bool(data.pop(PEER_FAILURE, False))
    _write({"type": "report", "key": node_key(report.nodeid), "peer": peer, "report": data})


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _write({"type": "finish", "exitstatus": int(exitstatus)})


_CONFIG: pytest.Config | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _CONFIG, _STACKS
    _CONFIG = config
    directory = os.environ.get(ENV_REPORTS)
    if directory and _STACKS is None:
        _STACKS = stacks_file(Path(directory), _rank()).open("w", encoding="utf-8")
        faulthandler.register(signal.SIGUSR1, file=_STACKS, all_threads=True)
        _write({"type": "hello", "pid": os.getpid()})


def pytest_unconfigure(config: pytest.Config) -> None:
    global _CONFIG, _OUT, _STACKS
    _CONFIG = None
    if _STACKS is not None:
        faulthandler.unregister(signal.SIGUSR1)
        _STACKS.close()
        _STACKS = None
    if _OUT is not None:
        _OUT.close()
        _OUT = None
