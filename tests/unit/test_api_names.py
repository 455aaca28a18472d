"""Tier 1: the API reference pages (docs/api/) list exactly the packages' public names, each
with its docstring's first paragraph.

A reader takes the reference for the whole public surface: a name missing there, or listed but
gone, or described by a docstring that has since changed, is a broken promise either way.
"""

from __future__ import annotations

import importlib
import re
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
