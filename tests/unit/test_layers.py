"""Tier 1: the package's layers, read off the source tree's imports.

The design's floors, bottom to top: ``common``; ``capture`` and ``kernels``; ``bridge``; ``mcore``;
``profiling`` (tools). A module may import its own subpackage or a lower floor, never a higher
one nor a sibling on its floor, so the data path (everything below ``profiling``) never needs a
tool. And no module reaches itself through its imports (no import circle). Every ``import``
statement counts, at module level or inside a function, because a lazy import is a dependency
too. The folders come from ``pyproject.toml``'s package map, so a new subpackage must be placed
on a floor here before this test passes. The general collective helpers (a timed all-gather or
all-reduce, point-to-point batches, the shared verdict) live in ``common``: none is defined
elsewhere, and no ``mcore`` or ``capture`` module takes one from ``bridge``.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]

#: The floor of each subpackage of ``mopd`` (higher may import lower, not the reverse).
FLOORS: dict[str, int] = {
    "common": 0,
    "capture": 1,
    "kernels": 1,
    "bridge": 2,
    "mcore": 3,
    "profiling": 4,
    "__main__": 5,  # mopd/__main__.py: ``python -m mopd``
}
DATA_PATH = ("capture", "bridge", "kernels", "mcore", "common")
#: The names of general collective helpers (module-level functions): they live in ``common``.
COLLECTIVE = re.compile(
    r"^(all_gather|all_reduce|all_to_all|reduce_scatter|broadcast|batch_p2p|same_verdict)"
)


def package_dirs(root: Path) -> dict[str, Path]:
    """``{"mopd.bridge": <root>/bridge, ...}`` from ``[tool.setuptools.package-dir]``."""
    config = tomllib.loads((root / "pyproject.toml").read_text())
    mapping = config["tool"]["setuptools"]["package-dir"]
    return {pkg: root / folder for pkg, folder in mapping.items()}


def source_modules(dirs: Mapping[str, Path]) -> dict[str, Path]:
    """Every module's dotted name and file, packages (``__init__.py``) under their own name."""
    modules: dict[str, Path] = {}
    for pkg, folder in dirs.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if "results" in parts:
                continue
            name = ".".join([pkg, *(p for p in parts if p != "__init__")])
            modules[name] = path
    return modules


def _imported_names(tree: ast.AST, package: str) -> Iterable[str]:
    """Dotted names an AST imports: ``from a.b import c`` yields ``a.b`` and ``a.b.c``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            yield module
            yield from (f"{module}.{alias.name}" for alias in node.names)


def import_graph(modules: Mapping[str, Path]) -> dict[str, set[str]]:
    """``{module: {modules of this tree it imports}}`` (a module never counts as importing itself)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name] = {t for t in _imported_names(tree, package) if t in modules and t != name}
    return graph


def collective_misplaced(modules: Mapping[str, Path]) -> list[str]:
    """Every general collective helper defined outside ``common``, and every ``mcore`` or
    ``capture`` module that imports one (or anything named like one) from ``bridge``."""
    bad = []
    for name, path in modules.items():
        layer = name.split(".")[1]
        tree = ast.parse(path.read_text(), filename=str(path))
        if layer != "common":
            bad += [
                f"{name} defines {node.name}"
                for node in tree.body
                if isinstance(node, ast.FunctionDef) and COLLECTIVE.match(node.name)
            ]
        if layer in ("mcore", "capture"):
            bad += [
                f"{name} takes {alias.name} from {node.module}"
                for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("mopd.bridge")
                for alias in node.names
                if COLLECTIVE.match(alias.name)
            ]
    return sorted(bad)


def upward_imports(graph: Mapping[str, set[str]]) -> list[str]:
    """``"a -> b"`` for every import of a higher floor or of a sibling subpackage on one floor."""
    bad = []
    for source, targets in graph.items():
        src = source.split(".")[1]
        for target in sorted(targets):
            dst = target.split(".")[1]
            if src != dst and FLOORS[dst] >= FLOORS[src]:
                bad.append(f"{source} -> {target}")
    return sorted(bad)


def import_circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return sorted(circles)


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    dirs = package_dirs(ROOT)
    dirs["mopd"] = ROOT / "mopd"
    return import_graph(source_modules(dirs))


def test_every_subpackage_has_a_floor() -> None:
    subpackages = {pkg.split(".")[1] for pkg in package_dirs(ROOT)}
    assert subpackages == set(FLOORS) - {"__main__"}


def test_the_data_path_imports_no_tool(graph: dict[str, set[str]]) -> None:
    assert any(m.startswith("mopd.profiling.") for m in graph), "no tool module found"
    climbs = [
        f"{m} -> {t}"
        for m, targets in graph.items()
        if m.split(".")[1] in DATA_PATH
        for t in sorted(targets)
        if t.split(".")[1] == "profiling"
    ]
    assert climbs == []


def test_nothing_imports_upward(graph: dict[str, set[str]]) -> None:
    assert upward_imports(graph) == []


def test_no_import_circle(graph: dict[str, set[str]]) -> None:
    assert len(graph) > 50  # the whole package was read
    assert import_circles(graph) == []


def test_collective_helpers_live_in_common() -> None:
    dirs = package_dirs(ROOT)
    modules = source_modules(dirs)
    assert "mopd.common.dist" in modules
    assert collective_misplaced(modules) == []


def test_the_collective_rule_finds_a_helper_out_of_place(tmp_path: Path) -> None:
    for folder in ("bridge", "mcore"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "bridge" / "groups.py").write_text("def all_gather_flat():\n    pass\n")
    (tmp_path / "mcore" / "rollouts.py").write_text(
        "def f():\n    from mopd.bridge.groups import all_gather_flat, GroupPool\n"
    )
    dirs = {"mopd.bridge": tmp_path / "bridge", "mopd.mcore": tmp_path / "mcore"}
    assert collective_misplaced(source_modules(dirs)) == [
        "mopd.bridge.groups defines all_gather_flat",
        "mopd.mcore.rollouts takes all_gather_flat from mopd.bridge.groups",
    ]


def test_the_checks_find_a_climb_and_a_circle(tmp_path: Path) -> None:
    """The analysis itself, on a tree that has both faults (relative imports, lazy ones too)."""
    for folder in ("kernels", "profiling"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "kernels" / "a.py").write_text("from . import b\n")
    (tmp_path / "kernels" / "b.py").write_text(
        "def f():\n    from mopd.kernels.a import x\n    from ..profiling import tool\n"
    )
    (tmp_path / "profiling" / "tool.py").write_text("import mopd.kernels\n")
    dirs = {"mopd.kernels": tmp_path / "kernels", "mopd.profiling": tmp_path / "profiling"}
    graph = import_graph(source_modules(dirs))
    assert graph["mopd.kernels.b"] == {"mopd.kernels.a", "mopd.profiling", "mopd.profiling.tool"}
    assert upward_imports(graph) == [
        "mopd.kernels.b -> mopd.profiling",
        "mopd.kernels.b -> mopd.profiling.tool",
    ]
    assert import_circles(graph) == [["mopd.kernels.a", "mopd.kernels.b"]]
