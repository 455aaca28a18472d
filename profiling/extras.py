"""What the tools do when an optional dependency is missing: one line naming the extra to install.

Why this file exists: ``pip install 'mopd-bridge[megatron]'`` must run every command the README
shows with it. The progress bar (tqdm) and the pictures (matplotlib) come with the ``profiling``
extra; without them the tools still run and say once, in one line, what the extra would add.
megatron-core is not optional for the demo: its launcher checks for it before any rank starts, so
that a missing install is one line instead of a traceback per rank.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Iterable
from types import ModuleType

__all__ = [
    "MEGATRON_EXTRA",
    "PROFILING_EXTRA",
    "can_draw",
    "child_env",
    "has_module",
    "missing_megatron",
    "optional_module",
]

#: The extra that carries the tools' progress bars and pictures.
PROFILING_EXTRA = "mopd-bridge[profiling]"
#: The extra that carries megatron-core.
MEGATRON_EXTRA = "mopd-bridge[megatron]"

#: The environment variable that tells a child process which notes its parent already printed.
_SAID_ENV = "MOPD_EXTRAS_SAID"
_said: set[str] = set(filter(None, os.environ.get(_SAID_ENV, "").split(",")))


def optional_module(name: str, *, purpose: str, tool: str = "mopd") -> ModuleType | None:
    """Import ``name`` (e.g. ``"tqdm"``, ``"matplotlib"``), or ``None`` when it is not installed.

    When it is missing, print one line on stderr (once per ``name`` and process) saying what is
    skipped (``purpose``, e.g. ``"no progress bar"``) and which extra adds it.
    """
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name.split(".")[0] and exc.name != name:
            raise  # the module is there but broken: show that
        if name not in _said:
            _said.add(name)
            print(
                f"{tool}: {purpose}: {name} is not installed (pip install '{PROFILING_EXTRA}' adds it)",
                file=sys.stderr,
                flush=True,
            )
        return None


def child_env(*, parent_says: Iterable[str] = ()) -> dict[str, str]:
    """``os.environ`` for a child tool, marked with the notes already printed (not said twice)
    and with those the parent will print itself afterwards (``parent_says``: module names)."""
    return {**os.environ, _SAID_ENV: ",".join(sorted(_said | set(parent_says)))}


def has_module(name: str) -> bool:
    """Whether ``name`` is installed, asked without importing it and without saying anything."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def can_draw(tool: str) -> bool:
    """``True`` when matplotlib is installed; else one line (once) saying no picture is drawn."""
    return optional_module("matplotlib", purpose="no picture", tool=tool) is not None


def missing_megatron(tool: str) -> str | None:
    """The one-line error for ``tool`` when megatron-core cannot be found, else ``None``.

    Looks the package up without importing it (no rank has started yet when this is asked).
    """
    try:
        found = importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:  # no top-level ``megatron`` package at all
        found = False
    if found:
        return None
    return (
        f"{tool}: error: megatron-core is not installed; "
        f"install it with pip install '{MEGATRON_EXTRA}' (or '.[megatron]' in a checkout)"
    )
