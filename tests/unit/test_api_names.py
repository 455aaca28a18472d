"""Tier 1: the README's API lists are exactly the packages' public names, and moved names still
resolve for one release, with a warning that says where they went.

A reader takes the README's list for the whole public surface: a name missing there, or listed
but gone, is a broken promise either way.
"""

from __future__ import annotations

import importlib
import re
import warnings
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
# "- `mopd.bridge` (23, no megatron): `A`, `B`, ... ."
LIST_RE = re.compile(r"^- `(mopd(?:\.\w+)+)` \((\d+)[,)][^:]*: (.*)\.$", re.M)
LISTED = ("mopd.mcore", "mopd.capture", "mopd.bridge", "mopd.kernels", "mopd.common.ranges")

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


def readme_lists() -> dict[str, tuple[int, list[str]]]:
    found = {}
    for module, count, names in LIST_RE.findall(README.read_text()):
        assert module not in found, f"{module} listed twice"
        found[module] = (int(count), re.findall(r"`(\w+)`", names))
    return found


def test_readme_lists_every_public_package() -> None:
    assert sorted(readme_lists()) == sorted(LISTED)


@pytest.mark.parametrize("module", LISTED)
def test_readme_list_is_the_modules_all(module: str) -> None:
    count, names = readme_lists()[module]
    public = importlib.import_module(module).__all__
    assert count == len(names), f"README says {count} names for {module} and lists {len(names)}"
    assert names == sorted(public) == list(public)
    for name in public:
        getattr(importlib.import_module(module), name)  # every listed name exists


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
