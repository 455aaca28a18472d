"""A pytest plugin that lets plain ``pytest`` run the multi-process (torchrun) tier.

Why this file exists: tier-2 tests are ordinary pytest modules that expect a process group.
Run directly under ``torchrun --nproc-per-node N -m pytest tests/dist/test_x.py`` they run as
they are, one pytest per rank. Run under plain ``pytest``, a module that declares
``TORCHRUN_NPROC = N`` at module level is collected as a single item that launches that
``torchrun`` command in a subprocess, with a hard timeout, and fails with the ranks' output if
any rank fails, if the ranks hang, or if no test ran.

Module-level knobs (read with ``ast``, the module is not imported by the parent):
- ``TORCHRUN_NPROC``: number of ranks (required to opt in);
- ``TORCHRUN_TIMEOUT``: seconds for the whole launch (default 600).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from mopd.profiling.launch import kill_tree

__all__ = ["TorchrunFile", "TorchrunItem", "module_knobs", "under_torchrun"]

_KNOBS = ("TORCHRUN_NPROC", "TORCHRUN_TIMEOUT")


def under_torchrun() -> bool:
    """True inside a process started by torchrun (or any launcher that sets the env://)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ
    )


def module_knobs(path: Path) -> dict[str, int]:
    """The ``TORCHRUN_*`` integer constants assigned at the top level of ``path``."""
    knobs: dict[str, int] = {}
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and target.id in _KNOBS:
                value = ast.literal_eval(node.value)
                if not isinstance(value, int) or value < 1:
                    raise ValueError(f"{path}: {target.id} must be a positive int, got {value!r}")
                knobs[target.id] = value
    return knobs


class TorchrunItem(pytest.Item):
    """One torchrun launch of a whole test module."""

    def __init__(self, *, nproc: int, timeout: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.nproc = nproc
        self.timeout = timeout
        self.add_marker(pytest.mark.timeout(timeout + 30))

    def runtest(self) -> None:
        config = self.config
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={self.nproc}",
            "-m",
            "pytest",
            str(self.path),
            f"--rootdir={config.rootpath}",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "-p",  # this plugin, also for modules outside tests/ (a no-op when conftest loads it)
            "tests.support.torchrun",
        ]
        kexpr = config.getoption("keyword", default="")
        if kexpr:
            cmd += ["-k", kexpr]
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(config.rootpath), env.get("PYTHONPATH")])
        )
        # output goes to a file, not a pipe: a hung grandchild holding a pipe open cannot block us
        with tempfile.TemporaryFile("w+") as log:
            proc = subprocess.Popen(
                cmd,
                cwd=config.rootpath,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            try:
                proc.wait(timeout=self.timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                kill_tree(proc.pid)
                proc.wait()
                timed_out = True
            log.seek(0)
            out = log.read()
        if timed_out:
            raise TorchrunFailure(f"torchrun timed out after {self.timeout}s (ranks hung)", out)
        if proc.returncode == 5 or (" passed" not in out):
            raise TorchrunFailure(f"no test ran under torchrun (exit {proc.returncode})", out)
        if proc.returncode != 0:
            raise TorchrunFailure(f"torchrun exited {proc.returncode}", out)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, TorchrunFailure):
            msg, out = excinfo.value.args
            tail = "\n".join(out.splitlines()[-400:])
            return f"{msg}\n--- ranks' output (tail) ---\n{tail}"
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        return self.path, 0, f"torchrun[{self.nproc}] {self.path.name}"


class TorchrunFailure(Exception):
    """Raised by :class:`TorchrunItem` with (message, combined output)."""


class TorchrunFile(pytest.File):
    """A test module collected as one torchrun launch."""

    def collect(self):
        knobs = module_knobs(self.path)
        yield TorchrunItem.from_parent(
            self,
            name=f"torchrun[nproc={knobs['TORCHRUN_NPROC']}]",
            nproc=knobs["TORCHRUN_NPROC"],
            timeout=knobs.get("TORCHRUN_TIMEOUT", 600),
        )


def pytest_pycollect_makemodule(module_path: Path, parent):
    if under_torchrun():
        return None
    if "TORCHRUN_NPROC" not in module_knobs(module_path):
        return None
    return TorchrunFile.from_parent(parent, path=module_path)


# ---- inside torchrun: keep the ranks in lock-step on test outcomes ----------------------------


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """After each test's call phase, agree across ranks on whether any rank failed.

    A test that fails on one rank only would otherwise leave the other ranks entering the next
    test's collectives alone. The agreement is one small all_reduce on the default group (gloo,
    with the group's timeout); a rank that passed while another failed reports the failure too.
    """
    outcome = yield
    if not under_torchrun() or call.when != "call":
        return
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    report = outcome.get_result()
    flag = torch.tensor([1 if report.failed else 0], dtype=torch.int64)
    try:
        dist.all_reduce(flag, group=_sync_group())
    except Exception as exc:  # a peer died or timed out: this rank fails too, clearly
        report.outcome = "failed"
        report.longrepr = f"rank agreement after the test failed: {exc!r}"
        return
    if int(flag) and not report.failed:
        report.outcome = "failed"
        report.longrepr = f"{int(flag)} other rank(s) failed this test"


_SYNC = None


def _sync_group():
    """A gloo group over the world for the outcome agreement, created once."""
    global _SYNC
    import torch.distributed as dist

    if _SYNC is None:
        _SYNC = dist.new_group(backend="gloo")
    return _SYNC
