"""Names that moved, kept for one release under their old place with a ``DeprecationWarning``.

Why this file exists: when a public name moves (to the layer its users look in, or out of a
package's public list), old code keeps working for one release and is told where the name lives
now. One mechanism for every package: a module-level ``__getattr__`` (PEP 562) that resolves the
old name on access, by the new module's name, so the old place imports nothing at load time (in
particular nothing from a higher layer).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping

__all__ = ["moved_names"]


def moved_names(old_module: str, moved: Mapping[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``old_module`` serving ``moved = {name: new_module}``.

    Accessing ``old_module.name`` warns once per access site (``DeprecationWarning``, naming
    ``new_module.name``) and returns the object itself; any other missing name raises the usual
    ``AttributeError``.
    """
    table = dict(moved)

    def __getattr__(name: str) -> object:
        new_module = table.get(name)
        if new_module is None:
            raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
        warnings.warn(
            f"{old_module}.{name} is deprecated and goes in the next release; "
            f"use {new_module}.{name}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(new_module), name)

    return __getattr__
