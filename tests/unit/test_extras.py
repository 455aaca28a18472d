"""Tier 1: a tool missing an optional dependency says so once, in one line naming the extra;
and the extras ``pyproject.toml`` declares are exactly what the package imports."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

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


# ---- the declared dependencies and extras against what the package imports ---------------------

ROOT = Path(__file__).resolve().parents[2]
_PACKAGE_DIRS = ("capture", "bridge", "kernels", "mcore", "common", "profiling", "mopd")
#: distribution name -> the module it installs
_MODULE_OF = {
    "torch": "torch",
    "numpy": "numpy",
    "psutil": "psutil",
    "megatron-core": "megatron",
    "cupy-cuda12x": "cupy",
    "cupy-cuda13x": "cupy",
    "nvtx": "nvtx",
    "matplotlib": "matplotlib",
    "tqdm": "tqdm",
    "liger-kernel": "liger_kernel",
    "ray": "ray",
}
#: the test extra's tools: used by the tests and CI, never imported by the package
_TOOLS = {"pytest", "pytest-timeout", "hypothesis", "ruff", "mypy", "setuptools"}


def _third_party_imports() -> set[str]:
    import ast

    found: set[str] = set()
    for folder in _PACKAGE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                found.update(n.split(".")[0] for n in names)
    return found - set(sys.stdlib_module_names) - {"mopd", "__future__"}


def test_the_extras_match_the_imports() -> None:
    """Every third-party module the package imports comes with a dependency or an extra, and
    every package an extra (or the base) declares is imported by the package."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {"": project["dependencies"], **project["optional-dependencies"]}

    def dist(requirement: str) -> str:
        return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower()

    dists = {dist(r) for reqs in declared.values() for r in reqs} - _TOOLS
    unknown = dists - set(_MODULE_OF)
    assert not unknown, f"add the module name of {sorted(unknown)} to _MODULE_OF"
    imported = _third_party_imports()
    assert imported <= {_MODULE_OF[d] for d in dists}, sorted(
        imported - {_MODULE_OF[d] for d in dists}
    )
    unused = {d for d in dists if _MODULE_OF[d] not in imported}
    assert not unused, f"declared but never imported: {sorted(unused)}"
