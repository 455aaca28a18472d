"""A pytest plugin that lets plain ``pytest`` run the multi-process (torchrun) tier test by test.

Why this file exists: tier-2 tests are ordinary pytest modules that expect a process group.
Run directly under ``torchrun --nproc-per-node N -m pytest tests/torchrun/test_x.py`` they run as
they are, one pytest per rank. Under plain ``pytest``, a module that declares
``TORCHRUN_NPROC = N`` at module level is collected by pytest as usual (parametrize, ``-k`` and
node ids behave natively; tier-2 modules only make process groups in fixtures, so they import
without one), but its tests do not run in the parent: the first selected test of the module
starts ONE torchrun launch that runs exactly the module's selected tests, and each item then
waits for its own test and reports the outcome the ranks reported (the first rank that failed
it, naming the ranks that failed; the lowest rank's report otherwise). The ranks send their
reports back as JSON lines (``tests/support/torchrun_report.py``); the launch and its hard
timeout live in ``tests/support/torchrun_launch.py``. When a launch hangs (killed at the
timeout) or crashes, every test it did not finish fails with the reason and a bounded tail of
the output; tests finished before keep their outcome. A module the parent cannot import is run
whole as one item (with a warning saying why).

Module-level knobs (read with ``ast``, before anything is imported):
- ``TORCHRUN_NPROC``: number of ranks (required to opt in);
- ``TORCHRUN_TIMEOUT``: seconds for the module's whole launch (default 600);
- ``TORCHRUN_STRICT_P2P = 1``: the ranks run with ``MOPD_STRICT_P2P=1`` (NCCL's point-to-point
  rules, ``tests/support/strict_p2p.py``);
- ``TORCHRUN_DEBUG_DETAIL = 1``: the ranks run with ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (torch
  checks every collective's order and shapes across ranks).

Inside torchrun this plugin keeps the ranks in lock-step on outcomes (see
:func:`pytest_runtest_makereport`).
"""

from __future__ import annotations

import ast
import copy
import os
import types
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

import pytest

from tests.support.torchrun_launch import Launch, Pick, pick_reports, rank_list
from tests.support.torchrun_report import PEER_FAILURE, node_key

__all__ = [
    "HarnessFailure",
    "TorchrunFailure",
    "TorchrunModule",
    "TorchrunModuleItem",
    "module_knobs",
    "under_torchrun",
]

_KNOBS = ("TORCHRUN_NPROC", "TORCHRUN_TIMEOUT", "TORCHRUN_STRICT_P2P", "TORCHRUN_DEBUG_DETAIL")
#: knob -> the environment it gives the module's ranks
_KNOB_ENV = {
    "TORCHRUN_STRICT_P2P": ("MOPD_STRICT_P2P", "1"),
    "TORCHRUN_DEBUG_DETAIL": ("TORCH_DISTRIBUTED_DEBUG", "DETAIL"),
}
DEFAULT_TIMEOUT = 600
_DETAIL_LINES = 60


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


def _bounded(text: str, lines: int = _DETAIL_LINES) -> str:
    kept = text.splitlines()
    if len(kept) <= lines:
        return text
    return "\n".join([*kept[:lines], f"[... {len(kept) - lines} more lines]"])


def _quoted(text: str) -> str:
    """Output of other processes, marked so that it cannot pass for this session's own."""
    return "\n".join(f"| {line}" for line in text.splitlines()) or "| (no output)"


class _Crash:
    """What pytest's short summary and junitxml read from a failure (``reprcrash``)."""

    def __init__(self, path: str, lineno: int, message: str) -> None:
        self.path, self.lineno, self.message = path, lineno, message


class HarnessFailure:
    """A failure the harness reports itself (a hang, a crash): one summary line, then text."""

    def __init__(self, message: str, text: str, location: tuple[str, int | None, str]) -> None:
        self.reprcrash = _Crash(location[0], (location[1] or 0) + 1, message)
        self.text = text

    def toterminal(self, tw: Any) -> None:
        for line in self.text.splitlines():
            tw.line(line)

    def __str__(self) -> str:
        return self.text


class TorchrunFailure(Exception):
    """Raised by :class:`TorchrunModuleItem` with (message, details)."""


# ---- collection in the parent ------------------------------------------------------------------


class TorchrunModule(pytest.Module):
    """A tier-2 module collected in the parent; its tests run in one launch (:class:`_ModuleRun`).

    If the module cannot be imported outside torchrun, it is collected as one
    :class:`TorchrunModuleItem` instead.
    """

    import_error: str | None = None

    @cached_property
    def knobs(self) -> dict[str, int]:
        return module_knobs(self.path)

    @property
    def nproc(self) -> int:
        return self.knobs["TORCHRUN_NPROC"]

    @property
    def timeout(self) -> int:
        return self.knobs.get("TORCHRUN_TIMEOUT", DEFAULT_TIMEOUT)

    @property
    def env(self) -> dict[str, str]:
        """The environment the module's knobs give its ranks."""
        return dict(v for k, v in _KNOB_ENV.items() if self.knobs.get(k))

    def _getobj(self) -> Any:
        try:
            return super()._getobj()
        except Exception as exc:  # not importable here; it may still be under torchrun
            detail = str(exc) if isinstance(exc, self.CollectError) else f"{exc!r}"
            self.import_error = _bounded(detail, 20)
            stand_in = types.ModuleType(self.path.stem)
            stand_in.__file__ = str(self.path)  # where the warning below points
            return stand_in

    def collect(self) -> Iterator[pytest.Item | pytest.Collector]:
        self.obj  # noqa: B018 (imports the module, or records why it cannot be imported)
        if self.import_error is None:
            yield from super().collect()
            return
        self.warn(
            pytest.PytestWarning(
                f"{self.path.name} cannot be imported outside torchrun, so its tests run as one "
                f"item (-k cannot select inside it):\n{self.import_error}"
            )
        )
        yield TorchrunModuleItem.from_parent(
            self, name=f"torchrun-whole-module[nproc={self.nproc}]"
        )


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> Any:
    if under_torchrun():
        return None
    if "TORCHRUN_NPROC" not in module_knobs(module_path):
        return None
    return TorchrunModule.from_parent(parent, path=module_path)


def pytest_itemcollected(item: pytest.Item) -> None:
    """Give each item of a tier-2 module the launch's budget under pytest-timeout.

    Prepended, so that it is the closest mark in the parent even if the test has its own (which
    still applies inside the ranks).
    """
    module = item.getparent(TorchrunModule)
    if module is None or not item.config.pluginmanager.hasplugin("timeout"):
        return
    item.add_marker(pytest.mark.timeout(module.timeout + 60), append=False)


def _rank_args(config: pytest.Config) -> list[str]:
    """The parent's options that shape a rank's reports (verbosity, traceback style, locals)."""
    verbose = int(config.option.verbose or 0)
    args = ["-" + "v" * verbose] if verbose > 0 else ["-q"]
    tbstyle = getattr(config.option, "tbstyle", "auto")
    if tbstyle and tbstyle != "auto":
        args.append(f"--tb={tbstyle}")
    if getattr(config.option, "showlocals", False):
        args.append("-l")
    return args


# ---- running in the parent: one launch per module, each item reports its own test -----------

_RUNS = pytest.StashKey[dict[str, "_ModuleRun"]]()


class _ModuleRun:
    """The launch of one module's selected items, and the reports each item gets from it."""

    def __init__(self, module: TorchrunModule, items: list[pytest.Item]) -> None:
        self.module = module
        self.config = module.config
        self.keys = [self.key(i) for i in items]
        self.launch = Launch(
            module.path,
            nproc=module.nproc,
            timeout=module.timeout,
            rootpath=self.config.rootpath,
            select=self.keys,
            pytest_args=_rank_args(self.config),
            env=module.env,
        )
        self.first_unfinished: str | None = None
        self.launch.start()

    def key(self, item: pytest.Item) -> str:
        return node_key(item.nodeid)

    def reports(self, item: pytest.Item) -> list[pytest.TestReport]:
        key = self.key(item)
        launch = self.launch
        launch.wait_for(key)
        if launch.complete(key):
            reports = [self._replay(item, pick) for pick in pick_reports(launch.reports[key])]
        else:
            reports = [self._unfinished(item, key)]
        if key == self.keys[-1]:
            launch.finish()
            launch.close()
            if launch.complete(key) and self._unexplained():
                reports.append(self._after_last(item))
        return reports

    # a test every rank finished: the report that stands for each phase, annotated on failure

    def _replay(self, item: pytest.Item, pick: Pick, annotate: bool = True) -> pytest.TestReport:
        config = self.config
        data = copy.deepcopy(pick.record.report)
        report: pytest.TestReport = config.hook.pytest_report_from_serializable(
            config=config, data=data
        )
        report.nodeid = item.nodeid
        report.location = item.location
        if isinstance(report.longrepr, list):  # JSON made the skip location a list
            report.longrepr = tuple(report.longrepr)
        report.sections = [tuple(s) for s in report.sections]
        if annotate and (pick.failed or pick.peers):
            self._annotate(report, pick)
        return report

    def _annotate(self, report: pytest.TestReport, pick: Pick) -> None:
        n = self.module.nproc
        who = pick.failed or pick.peers
        note = f"failed on {rank_list(who)} of {n}; the report shown is rank {pick.rank}'s"
        if pick.failed and pick.peers:
            note += f"; {rank_list(pick.peers)} failed only because a peer did"
        longrepr = report.longrepr
        if hasattr(longrepr, "addsection"):
            longrepr.addsection(f"torchrun ({pick.when})", note)
        crash = getattr(longrepr, "reprcrash", None)
        if crash is not None:
            crash.message = f"[rank {pick.rank}] {crash.message}"
        elif isinstance(longrepr, str):
            report.longrepr = HarnessFailure(
                f"[rank {pick.rank}] {longrepr.splitlines()[0] if longrepr else ''}",
                f"{longrepr}\n--- torchrun ({pick.when}) ---\n{note}",
                report.location,
            )

    # a test the launch did not finish on every rank

    def _unfinished(self, item: pytest.Item, key: str) -> pytest.TestReport:
        launch = self.launch
        name = self.module.path.name
        n = self.module.nproc
        by_rank = launch.reports.get(key, {})
        done = [r for r in range(n) if "teardown" in by_rank.get(r, {})]
        begun = sorted(launch.started.get(key, set()) - set(done))
        ended = f"the torchrun launch of {name} ({n} ranks) {launch.ended()}"
        if not launch.started:
            message = f"no test ran under torchrun: {ended}"
            body = [message]
        elif begun or done:
            message = f"did not finish on every rank: {ended}"
            body = [f"this test {message}."]
            if done:
                body.append(f"Finished on {rank_list(done)}.")
            body.append(f"Started, not finished, on {rank_list(begun)}." if begun else "")
            never = [r for r in range(n) if r not in done and r not in begun]
            if never:
                body.append(f"Never started on {rank_list(never)}.")
        elif len(launch.exitstatus) == n:  # every rank's session ended without running it
            message = f"not run: no rank ran this test ({ended})"
            body = [f"{message}: is it collected differently under torchrun?"]
        else:
            where = f" (it stopped in {self.first_unfinished})" if self.first_unfinished else ""
            message = f"not run: {ended} before this test started"
            body = [f"{message}{where}."]
        failed = [p for p in pick_reports(by_rank) if p.failed or p.peers]
        if failed:
            text = self._replay(item, failed[0], annotate=False).longreprtext
            body.append(f"rank {failed[0].rank} reported ({failed[0].when}):\n{_bounded(text)}")
        if self.first_unfinished is None:
            self.first_unfinished = key
            for rank in begun:
                if rank in launch.stacks:
                    body.append(
                        f"--- rank {rank}'s stacks at the timeout ---\n{launch.stacks[rank]}"
                    )
            for rank, errors in sorted(launch.collect_errors.items()):
                body.append(f"--- rank {rank} could not collect ---\n{_bounded(errors[0])}")
                break
            body.append(f"--- tail of the ranks' output ---\n{_quoted(launch.tail())}")
        else:
            body.append(f"(the ranks' output is in the report of {self.first_unfinished})")
        return self._failure(item, "call", message, "\n".join(line for line in body if line))

    # every test finished, but the launch did not end as its reports say it should

    def _unexplained(self) -> bool:
        launch = self.launch
        if launch.timed_out:
            return True
        if any(status not in (0, 1) for status in launch.exitstatus.values()):
            return True
        return launch.returncode != 0 and not launch.any_failed()

    def _after_last(self, item: pytest.Item) -> pytest.TestReport:
        launch = self.launch
        name = self.module.path.name
        message = f"the torchrun launch of {name} {launch.ended()} after its tests had finished"
        statuses = ", ".join(f"rank {r}: {s}" for r, s in sorted(launch.exitstatus.items()))
        text = f"{message} (pytest exit status per rank: {statuses or 'none reported'})"
        tail = _quoted(launch.tail())
        return self._failure(
            item, "teardown", message, f"{text}\n--- tail of the ranks' output ---\n{tail}"
        )

    def _failure(self, item: pytest.Item, when: str, message: str, text: str) -> pytest.TestReport:
        return pytest.TestReport(
            nodeid=item.nodeid,
            location=item.location,
            keywords=dict.fromkeys(item.keywords, 1),
            outcome="failed",
            longrepr=HarnessFailure(message, text, item.location),
            when=when,  # type: ignore[arg-type]
            duration=0.0,
        )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    """In the parent, a tier-2 test's run is: wait for its module's launch, report its outcome."""
    if under_torchrun() or not isinstance(item, pytest.Function):
        return None
    module = item.getparent(TorchrunModule)
    if module is None:
        return None
    runs = item.config.stash.setdefault(_RUNS, {})
    run = runs.get(module.nodeid)
    if run is None:
        selected = [
            i
            for i in item.session.items
            if isinstance(i, pytest.Function) and i.getparent(TorchrunModule) is module
        ]
        run = runs[module.nodeid] = _ModuleRun(module, selected)
    ihook = item.ihook
    ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for report in run.reports(item):
        ihook.pytest_runtest_logreport(report=report)
    ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A session that stops early (``-x``, Ctrl-C) leaves no launch behind."""
    for run in session.config.stash.get(_RUNS, {}).values():
        run.launch.close()


# ---- a module the parent cannot import: one item for the whole module --------------------------


class TorchrunModuleItem(pytest.Item):
    """One torchrun launch of a whole module, passing only if every test passed on every rank."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        module = self.getparent(TorchrunModule)
        assert module is not None
        self.nproc = module.nproc
        self.timeout = module.timeout
        self.env = module.env

    def runtest(self) -> None:
        config = self.config
        args = _rank_args(config)
        kexpr = config.getoption("keyword", default="")
        if kexpr:
            args += ["-k", kexpr]
        launch = Launch(
            self.path,
            nproc=self.nproc,
            timeout=self.timeout,
            rootpath=config.rootpath,
            select=None,
            pytest_args=args,
            env=self.env,
        )
        launch.start()
        try:
            launch.finish()
        finally:
            launch.close()
        if not launch.started:
            errors = [e for errs in launch.collect_errors.values() for e in errs[:1]]
            detail = "\n".join([*(_bounded(e) for e in errors[:1]), _quoted(launch.tail())])
            raise TorchrunFailure(
                f"no test ran under torchrun (the launch {launch.ended()})", detail
            )
        problems: list[str] = []
        first: Pick | None = None
        for key, by_rank in launch.reports.items():
            if not launch.complete(key):
                problems.append(f"{key}: did not finish on every rank")
            for pick in pick_reports(by_rank):
                if pick.failed or pick.peers:
                    who = rank_list(pick.failed or pick.peers)
                    problems.append(f"{key} ({pick.when}): failed on {who}")
                    first = first or pick
        if launch.timed_out or problems or launch.returncode != 0:
            detail = ""
            if first is not None:
                report = config.hook.pytest_report_from_serializable(
                    config=config, data=copy.deepcopy(first.record.report)
                )
                detail = f"rank {first.rank}'s report:\n{_bounded(report.longreprtext, 200)}\n"
            for rank, stacks in sorted(launch.stacks.items()):
                detail += f"--- rank {rank}'s stacks at the timeout ---\n{stacks}\n"
            raise TorchrunFailure(
                f"the launch {launch.ended()}:\n" + "\n".join(problems),
                f"{detail}--- tail of the ranks' output ---\n{_quoted(launch.tail())}",
            )

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, TorchrunFailure):
            msg, detail = excinfo.value.args
            return f"{msg}\n{detail}"
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, f"torchrun[{self.nproc}] {self.path.name} (whole module)"


# ---- inside torchrun: keep the ranks in lock-step on test outcomes ----------------------------


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """After each test's call phase, agree across ranks on whether any rank failed.

    A test that fails on one rank only would otherwise leave the other ranks entering the next
    test's collectives alone. The agreement is one small all_reduce on the default group (gloo,
    with the group's timeout); a rank that passed while another failed reports the failure too
    (marked, so that the parent shows the rank that really failed).
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
        setattr(report, PEER_FAILURE, True)
        return
    if int(flag) and not report.failed:
        report.outcome = "failed"
        report.longrepr = f"{int(flag)} other rank(s) failed this test"
        setattr(report, PEER_FAILURE, True)


_SYNC = None


def _sync_group() -> Any:
    """A gloo group over the world for the outcome agreement, created once."""
    global _SYNC
    import torch.distributed as dist

    if _SYNC is None:
        _SYNC = dist.new_group(backend="gloo")
    return _SYNC
