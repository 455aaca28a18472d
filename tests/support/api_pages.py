"""The API reference pages (docs/api/), generated from the packages' ``__all__`` and docstrings.

Why this file exists: a reference written by hand drifts from the code. Each public package gets
one page listing its ``__all__`` in order, one line per name: the first paragraph of the name's
docstring (a constant: the ``#:`` comment above its assignment), Sphinx roles turned into code
spans. ``python -m tests.support.api_pages`` rewrites the pages; ``tests/unit/test_api_names.py``
fails when a page differs from what this renders, so a changed docstring or ``__all__`` shows up
as a page to regenerate.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["PACKAGES", "page_path", "render", "summary"]

ROOT = Path(__file__).resolve().parents[2]
#: The public packages, each with its page.
PACKAGES = ("mopd.mcore", "mopd.bridge", "mopd.capture", "mopd.kernels", "mopd.common.ranges")
_ROLE = re.compile(r":\w+:`(~?)([^`]+)`")


def _plain(text: str) -> str:
    """Docstring text as Markdown on one line: roles and double backticks as code spans."""

    def role(m: re.Match[str]) -> str:
        target = m[2].rsplit(".", 1)[-1] if m[1] else m[2]
        return f"``{target}``"

    text = _ROLE.sub(role, " ".join(text.split()))
    return text.replace("``", "`").replace("|", "\\|")


def _constant_comment(module: ModuleType, name: str) -> str:
    """The ``#:`` comment lines right above ``name = ...`` in ``module``'s source."""
    lines = inspect.getsource(module).splitlines()
    for node in ast.parse("\n".join(lines)).body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            above = []
            i = node.lineno - 2
            while i >= 0 and lines[i].lstrip().startswith("#:"):
                above.insert(0, lines[i].lstrip()[2:].strip())
                i -= 1
            return " ".join(above)
    return ""


def summary(package: ModuleType, name: str) -> tuple[str, str]:
    """``(kind, one line)`` of a public name."""
    obj = getattr(package, name)
    if inspect.isclass(obj):
        kind = "exception" if issubclass(obj, BaseException) else "class"
        return kind, _plain((inspect.getdoc(obj) or "").split("\n\n")[0])
    if inspect.isfunction(obj):
        return "function", _plain((inspect.getdoc(obj) or "").split("\n\n")[0])
    home = sys.modules[getattr(obj, "__module__", None) or package.__name__]
    for module in (package, home):
        text = _constant_comment(module, name)
        if text:
            return "constant", _plain(text)
    return "constant", ""


def page_path(package: str) -> Path:
    return ROOT / "docs" / "api" / f"{package}.md"


def render(package: str) -> str:
    """The page of ``package``."""
    module = importlib.import_module(package)
    intro = _plain((module.__doc__ or "").split("\n\n")[0])
    rows = []
    for name in module.__all__:
        kind, line = summary(module, name)
        rows.append(f"| `{name}` | {kind} | {line} |")
    return (
        f"# `{package}`\n\n{intro}\n\n"
        f"Its public names ({len(module.__all__)}, its `__all__`, in order); anything else is "
        "internal and may change. Generated from the docstrings by "
        "`python -m tests.support.api_pages`.\n\n"
        "| name | kind | what it is |\n| --- | --- | --- |\n" + "\n".join(rows) + "\n"
    )


def main() -> None:
    for package in PACKAGES:
        page_path(package).write_text(render(package))
        print(f"wrote {page_path(package).relative_to(ROOT)}")


if __name__ == "__main__":
    main()
