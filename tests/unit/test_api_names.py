"""Tier 1: the API reference pages (docs/api/) list exactly the packages' public names, each
with its docstring's first paragraph, and moved names still resolve for one release, with a
warning that says where they went.

A reader takes the reference for the whole public surface: a name missing there, or listed but
gone, or described by a docstring that has since changed, is a broken promise either way.
"""

from __future__ import annotations

import importlib
import re
import warnings
from pathlib import Path

import pytest

from tests.support.api_pages import PACKAGES, page_path, render

ROOT = Path(__file__).resolve().parents[2]
# a row of a page's table: "| `Name` | kind | what it is |"
ROW_RE = re.compile(r"^\| `(\w+)` \| (\w+) \| (.*) \|$", re.M)


def page_rows(package: str) -> list[tuple[str, str, str]]:
    return ROW_RE.findall(page_path(package).read_text())


def test_every_public_package_has_a_page_and_the_index_links_them() -> None:
    pages = sorted(p.name for p in (ROOT / "docs" / "api").glob("mopd.*.md"))
    assert pages == sorted(f"{p}.md" for p in PACKAGES)
    index = (ROOT / "docs" / "api" / "README.md").read_text()
    for package in PACKAGES:
        assert f"]({package}.md)" in index, package


@pytest.mark.parametrize("package", PACKAGES)
def test_page_lists_the_packages_all_each_with_a_line(package: str) -> None:
    module = importlib.import_module(package)
    rows = page_rows(package)
    assert [name for name, _, _ in rows] == list(module.__all__) == sorted(module.__all__)
    for name, kind, line in rows:
        getattr(module, name)  # every listed name exists
        assert kind in ("class", "exception", "function", "constant"), (name, kind)
        assert len(line) > 10, f"{package}.{name} has no description (a docstring or #: comment)"
    assert f"({len(module.__all__)}, its `__all__`" in page_path(package).read_text()


@pytest.mark.parametrize("package", PACKAGES)
def test_page_is_what_the_docstrings_say(package: str) -> None:
    assert page_path(package).read_text() == render(package), (
        f"docs/api/{package}.md is out of date: run python -m tests.support.api_pages"
    )


#: old place -> (name, new place) for every name moved in this release.
MOVED = [
    ("mopd.bridge", "megatron_process_groups", "mopd.mcore"),
    ("mopd.bridge", "mesh_from_parallel_state", "mopd.mcore"),
    ("mopd.bridge", "mesh_from_pg_collection", "mopd.mcore"),
    ("mopd.bridge", "lm_head_from_models", "mopd.mcore"),
    ("mopd.mcore", "kl_loss_func", "mopd.mcore.loss"),
    ("mopd.mcore", "run_teacher", "mopd.mcore.teacher"),
    ("mopd.kernels", "gather_rows", "mopd.kernels.rows"),
    ("mopd.kernels", "scatter_rows", "mopd.kernels.rows"),
    ("mopd.kernels", "copy_runs", "mopd.kernels.rows"),
    ("mopd.capture", "unwrap_model", "mopd.capture.unwrap"),
    ("mopd.profiling.ranges", "enable", "mopd.common.ranges"),
]


def test_moved_names_are_listed_in_the_reference() -> None:
    moved = (ROOT / "docs" / "api" / "README.md").read_text().split("## Moved in this release")[1]
    for old, name, new in MOVED:
        assert name in moved and old in moved and new in moved, (old, name, new)


@pytest.mark.parametrize(("old", "name", "new"), MOVED)
def test_moved_name_warns_and_is_the_same_object(old: str, name: str, new: str) -> None:
    old_module = importlib.import_module(old)
    assert name not in getattr(old_module, "__all__", [])
    with pytest.warns(DeprecationWarning, match=re.escape(f"use {new}.{name}")):
        value = getattr(old_module, name)
    assert value is getattr(importlib.import_module(new), name)


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    bridge = importlib.import_module("mopd.bridge")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="no_such_name"):
            _ = bridge.no_such_name


def test_the_bridge_api_module_still_offers_the_names_it_held() -> None:
    """``mopd.bridge.api`` held the step, its handle and the configs before they got modules of
    their own; code that imports them from there gets the same objects as from their homes."""
    api = importlib.import_module("mopd.bridge.api")
    homes = {
        "BridgeConfig": "mopd.bridge.config",
        "BridgeStep": "mopd.bridge.step",
        "ExchangeHandle": "mopd.bridge.step",
        "HiddenStateBridge": "mopd.bridge.api",
        "LayoutArg": "mopd.bridge.inputs",
        "TeacherSpec": "mopd.bridge.config",
    }
    assert sorted(api.__all__) == sorted(homes)
    for name, home in homes.items():
        assert getattr(api, name) is getattr(importlib.import_module(home), name), name
    bridge = importlib.import_module("mopd.bridge")
    for name in set(homes) & set(bridge.__all__):
        assert getattr(bridge, name) is getattr(api, name), name
