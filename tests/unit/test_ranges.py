"""mopd.common.ranges: ranges reach torch.profiler nested as opened, NVTX stays balanced,
and nothing at all is emitted when off."""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Iterator

import pytest
import torch
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile

from mopd.common import ranges


@pytest.fixture(autouse=True)
def _restore_switch() -> Iterator[None]:
    """Every test leaves the process-wide switch and backend as it found them."""
    enabled, backend = ranges.is_enabled(), ranges._backend
    phases = set(ranges.PHASES)
    yield
    ranges.enable(enabled)
    ranges._backend = backend
    ranges.PHASES.clear()
    ranges.PHASES.update(phases)


@pytest.fixture
def nvtx_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str | None]]:
    """Replace the NVTX emitter with a recorder of ("push", name) / ("pop", None)."""
    calls: list[tuple[str, str | None]] = []
    monkeypatch.setattr(
        ranges,
        "_backend",
        (
            "recorder",
            lambda name: calls.append(("push", name)),
            lambda: calls.append(("pop", None)),
        ),
    )
    return calls


def _mopd_events(prof: profile) -> list[FunctionEvent]:
    return [e for e in prof.events() if e.name.startswith(ranges.PREFIX)]


def _contains(outer: FunctionEvent, inner: FunctionEvent) -> bool:
    return (
        outer.time_range.start <= inner.time_range.start
        and inner.time_range.end <= outer.time_range.end
    )


def _work() -> torch.Tensor:
    return (torch.arange(64, dtype=torch.float32) * 2).sum()


def test_ranges_appear_nested_by_time(nvtx_calls: list[tuple[str, str | None]]) -> None:
    ranges.enable(True)
    with profile(activities=[ProfilerActivity.CPU]) as prof, ranges.span("step", 7):
        with ranges.span("pack", 3):
            _work()
        with ranges.span("send_recv"), ranges.span("wait"):
            _work()
        with ranges.span("unpack"):
            _work()
    events = {e.name: e for e in _mopd_events(prof)}
    assert sorted(events) == sorted(
        ["mopd/step:7", "mopd/pack:3", "mopd/send_recv", "mopd/wait", "mopd/unpack"]
    )
    step = events["mopd/step:7"]
    for child in ("mopd/pack:3", "mopd/send_recv", "mopd/wait", "mopd/unpack"):
        assert _contains(step, events[child]), child
    assert _contains(events["mopd/send_recv"], events["mopd/wait"])
    # Siblings are disjoint and in program order; pack does not contain wait.
    assert events["mopd/pack:3"].time_range.end <= events["mopd/send_recv"].time_range.start
    assert events["mopd/send_recv"].time_range.end <= events["mopd/unpack"].time_range.start
    assert not _contains(events["mopd/pack:3"], events["mopd/wait"])
    # The work ran inside its range: an aten op is contained by mopd/pack:3.
    ops = [e for e in prof.events() if e.name.startswith("aten::")]
    assert any(_contains(events["mopd/pack:3"], op) for op in ops)
    # NVTX saw the same ranges, LIFO-balanced.
    assert nvtx_calls == [
        ("push", "mopd/step:7"),
        ("push", "mopd/pack:3"),
        ("pop", None),
        ("push", "mopd/send_recv"),
        ("push", "mopd/wait"),
        ("pop", None),
        ("pop", None),
        ("push", "mopd/unpack"),
        ("pop", None),
        ("pop", None),
    ]


def test_off_emits_nothing_and_allocates_no_context(
    nvtx_calls: list[tuple[str, str | None]],
) -> None:
    ranges.enable(False)

    @ranges.traced("projection")
    def project() -> torch.Tensor:
        return _work()

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with ranges.span("pack", 1), ranges.span("loss_chunk"):
            _work()
        value = project()
    assert value.item() == 4032.0
    assert _mopd_events(prof) == []
    assert nvtx_calls == []
    # One shared null context, whatever the phase: no object is made per call.
    assert ranges.span("pack") is ranges.span("unpack", 5)
    # When off the phase is not even looked at (the off path does no work).
    assert ranges.span("no_such_phase") is ranges.span("pack")


def test_decorator_ranges_each_call_and_reads_switch_at_call_time(
    nvtx_calls: list[tuple[str, str | None]],
) -> None:
    @ranges.traced("plan", "build")
    def build_plan(x: int, *, y: int) -> int:
        """Docstring kept."""
        return x + y

    assert build_plan.__name__ == "build_plan" and build_plan.__doc__ == "Docstring kept."
    ranges.enable(False)
    assert build_plan(1, y=2) == 3
    assert nvtx_calls == []
    ranges.enable(True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert build_plan(2, y=3) == 5
        assert build_plan(4, y=5) == 9
    assert [e.name for e in _mopd_events(prof)] == ["mopd/plan:build", "mopd/plan:build"]
    assert nvtx_calls == [("push", "mopd/plan:build"), ("pop", None)] * 2


def test_no_record_function_without_a_torch_profiler(
    monkeypatch: pytest.MonkeyPatch, nvtx_calls: list[tuple[str, str | None]]
) -> None:
    made: list[str] = []
    real = torch.autograd.profiler.record_function

    def spy(name: str) -> torch.autograd.profiler.record_function:
        made.append(name)
        return real(name)

    monkeypatch.setattr(torch.autograd.profiler, "record_function", spy)
    ranges.enable(True)
    with ranges.span("pack", 2):  # nsys-only case: NVTX, no record_function
        _work()
    assert made == []
    assert nvtx_calls == [("push", "mopd/pack:2"), ("pop", None)]
    with profile(activities=[ProfilerActivity.CPU]) as prof, ranges.span("pack", 2):
        _work()
    assert made == ["mopd/pack:2"]
    assert [e.name for e in _mopd_events(prof)] == ["mopd/pack:2"]


def test_exception_closes_both_ranges(nvtx_calls: list[tuple[str, str | None]]) -> None:
    ranges.enable(True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with pytest.raises(RuntimeError, match="boom"), ranges.span("capture"):
            _work()
            raise RuntimeError("boom")
        with ranges.span("gather"):
            _work()
    events = {e.name: e for e in _mopd_events(prof)}
    assert set(events) == {"mopd/capture", "mopd/gather"}
    assert events["mopd/capture"].time_range.end <= events["mopd/gather"].time_range.start
    assert nvtx_calls == [
        ("push", "mopd/capture"),
        ("pop", None),
        ("push", "mopd/gather"),
        ("pop", None),
    ]


def test_bad_names_and_settings_raise() -> None:
    ranges.enable(True)
    with pytest.raises(ValueError, match="'no_such_phase'"):
        ranges.span("no_such_phase")
    with pytest.raises(ValueError, match="'packing'"):
        ranges.traced("packing")
    with pytest.raises(ValueError, match="'Bad Phase'"):
        ranges.register_phase("Bad Phase")
    with pytest.raises(ValueError, match="got 1 of type int"):
        ranges.enable(1)  # type: ignore[arg-type]
    ranges.register_phase("teacher_step")
    assert ranges.range_name("teacher_step", "mb0") == "mopd/teacher_step:mb0"


def test_enable_returns_previous_state() -> None:
    ranges.enable(False)
    assert ranges.enable(True) is False
    assert ranges.is_enabled()
    assert ranges.enable(False) is True
    assert not ranges.is_enabled()


@pytest.mark.parametrize(
    ("value", "expected", "warns"),
    [
        ("1", True, False),
        ("on", True, False),
        ("0", False, False),
        ("", False, False),
        ("maybe", False, True),
    ],
)
def test_env_var_read_at_import(
    monkeypatch: pytest.MonkeyPatch, value: str, expected: bool, warns: bool
) -> None:
    monkeypatch.setenv(ranges.ENV_VAR, value)
    try:
        if warns:
            with pytest.warns(RuntimeWarning, match="MOPD_NVTX='maybe'"):
                importlib.reload(ranges)
        else:
            importlib.reload(ranges)
        assert ranges.is_enabled() is expected
    finally:
        monkeypatch.delenv(ranges.ENV_VAR)
        importlib.reload(ranges)


def test_backend_falls_back_and_logs_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "nvtx", None)  # import nvtx -> ImportError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(ranges, "_backend", None)
    with caplog.at_level(logging.INFO, logger=ranges.__name__):
        assert ranges.nvtx_backend() == "none"
        ranges.enable(True)
        with profile(activities=[ProfilerActivity.CPU]) as prof, ranges.span("reshard"):
            _work()
        assert ranges.nvtx_backend() == "none"
    assert [e.name for e in _mopd_events(prof)] == ["mopd/reshard"]
    assert sum("torch.profiler only" in r.getMessage() for r in caplog.records) == 1


def test_nvtx_package_preferred_when_present() -> None:
    pytest.importorskip("nvtx", reason="the nvtx package is not installed here")
    ranges._backend = None
    assert ranges.nvtx_backend() == "nvtx"
    ranges.enable(True)
    with ranges.span("pack", 0):  # the real package: must not raise without a profiler attached
        _work()
