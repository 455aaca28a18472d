"""Tier 1: a tool missing an optional dependency says so once, in one line naming the extra."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from mopd.profiling import extras


def test_a_missing_module_is_none_and_said_once(capsys: pytest.CaptureFixture[str]) -> None:
    name = "mopd_test_no_such_module"
    assert extras.optional_module(name, purpose="no widget", tool="mopd x") is None
    assert extras.optional_module(name, purpose="no widget", tool="mopd x") is None
    err = capsys.readouterr().err
    assert err == (
        f"mopd x: no widget: {name} is not installed (pip install 'mopd-bridge[profiling]' "
        "adds it)\n"
    )
    assert extras.child_env()["MOPD_EXTRAS_SAID"].split(",").count(name) == 1


def test_an_installed_module_is_returned_silently(capsys: pytest.CaptureFixture[str]) -> None:
    assert extras.optional_module("json", purpose="p") is sys.modules["json"]
    assert capsys.readouterr().err == ""


def test_a_broken_module_is_not_taken_for_a_missing_one(tmp_path, monkeypatch) -> None:
    (tmp_path / "mopd_test_broken.py").write_text("import mopd_test_missing_inside\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="mopd_test_missing_inside"):
        extras.optional_module("mopd_test_broken", purpose="p")


def test_megatron_check_without_importing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith("megatron") else real(name, *a),
    )
    line = extras.missing_megatron("mopd demo")
    assert line is not None and "\n" not in line
    assert line.startswith("mopd demo: error: megatron-core is not installed")
    assert "'mopd-bridge[megatron]'" in line
    monkeypatch.setattr(importlib.util, "find_spec", real)
    assert extras.missing_megatron("mopd demo") is None  # installed here (the megatron extra)
