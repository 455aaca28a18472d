"""Command-line values every ``mopd`` command shares: meshes, lists of integers, one-line errors.

Why this file exists: ``mopd plan``, ``mopd demo`` and the benchmarks take meshes and sizes on
the command line, and a user who learns the syntax once should meet it everywhere, with the
API's own names: ``tp=8,pp=2,cp=1,dp=1,rank_offset=16`` is ``Mesh(tp=8, pp=2, cp=1, dp=1,
rank_offset=16)``. A typo must come back as one line naming the bad token, before anything heavy
is imported; so this module imports nothing beyond the standard library (the
:class:`~mopd.bridge.mesh.Mesh` is built on request).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from mopd.bridge.mesh import Mesh

__all__ = [
    "MESH_EXAMPLE",
    "MESH_KEYS",
    "PROG_ENV",
    "DefaultsHelpFormatter",
    "MeshSpec",
    "OneLineParser",
    "mesh_type",
    "parse_int_list",
    "parse_mesh",
    "prog_for",
]

#: The keys of a mesh, in the order :meth:`MeshSpec.__str__` writes them.
MESH_KEYS = ("tp", "pp", "cp", "dp", "rank_offset")
#: What an error message suggests.
MESH_EXAMPLE = "tp=8,pp=2,cp=1,dp=1,rank_offset=16"
#: Set by ``mopd bench NAME`` for the benchmark it starts: the command as the user typed it.
PROG_ENV = "MOPD_PROG"
#: Keys other tools used to take, and what to write instead.
_RENAMED = {"offset": "rank_offset", "at": "rank_offset"}


@dataclass(frozen=True, kw_only=True)
class MeshSpec:
    """A mesh as written on the command line: sizes, and the first global rank if one was given.

    Attributes:
        tp, pp, cp, dp: parallel sizes (missing ones are 1).
        rank_offset: the mesh's first global rank, or ``None`` where the text gave none (the
            tool then places the mesh itself).
    """

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    rank_offset: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "dp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        off = self.rank_offset
        if off is not None and (isinstance(off, bool) or not isinstance(off, int) or off < 0):
            raise ValueError(f"rank_offset must be a non-negative int, got {off!r}")

    @property
    def size(self) -> int:
        """Global ranks the mesh spans."""
        return self.tp * self.pp * self.cp * self.dp

    def mesh(self, *, name: str = "", rank_offset: int | None = None) -> Mesh:
        """The :class:`~mopd.bridge.mesh.Mesh`: at this spec's ``rank_offset``, else at
        ``rank_offset``, else at 0."""
        from mopd.bridge.mesh import Mesh

        off = self.rank_offset if self.rank_offset is not None else (rank_offset or 0)
        return Mesh(tp=self.tp, cp=self.cp, dp=self.dp, pp=self.pp, rank_offset=off, name=name)

    def __str__(self) -> str:
        """The canonical text, which :func:`parse_mesh` reads back to an equal spec."""
        text = f"tp={self.tp},pp={self.pp},cp={self.cp},dp={self.dp}"
        return text if self.rank_offset is None else f"{text},rank_offset={self.rank_offset}"


def parse_mesh(text: str) -> MeshSpec:
    """``"tp=8,pp=2,cp=1,dp=1,rank_offset=16"`` -> :class:`MeshSpec` (keys in any order,
    case-insensitive, missing sizes 1, no ``rank_offset``: ``None``).

    Raises:
        ValueError: one line naming the bad token: an item without ``=``, an unknown or repeated
            key, a value that is not an integer, a size below 1 or a negative ``rank_offset``.
    """
    if not isinstance(text, str):
        raise ValueError(f"a mesh is text like {MESH_EXAMPLE}, got {type(text).__name__}")
    values: dict[str, int] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        key, eq, raw = item.partition("=")
        key, raw = key.strip().lower(), raw.strip()
        if not eq:
            raise ValueError(
                f"mesh {text!r}: {item!r} is not KEY=VALUE (write e.g. {MESH_EXAMPLE})"
            )
        if key in _RENAMED:
            raise ValueError(
                f"mesh {text!r}: {key}= is now {_RENAMED[key]}= (write e.g. {MESH_EXAMPLE})"
            )
        if key not in MESH_KEYS:
            raise ValueError(f"mesh {text!r}: unknown key {key!r} (keys: {', '.join(MESH_KEYS)})")
        if key in values:
            raise ValueError(f"mesh {text!r}: {key}= given twice")
        try:
            value = int(raw, 10)
        except ValueError:
            raise ValueError(f"mesh {text!r}: {key}={raw!r} is not an integer") from None
        if key == "rank_offset" and value < 0:
            raise ValueError(f"mesh {text!r}: rank_offset={value} must be >= 0")
        if key != "rank_offset" and value < 1:
            raise ValueError(f"mesh {text!r}: {key}={value} must be >= 1")
        values[key] = value
    if not values:
        raise ValueError(f"empty mesh {text!r}; write e.g. {MESH_EXAMPLE}")
    return MeshSpec(**values)


def parse_int_list(text: str, *, what: str = "value", minimum: int | None = 1) -> tuple[int, ...]:
    """``"64,96"`` -> ``(64, 96)``; one line naming the bad token otherwise.

    Args:
        what: the values' name in messages (``"hidden size"``).
        minimum: smallest value allowed (``None``: any integer).
    """
    items = [x.strip() for x in text.split(",")]
    if not any(items):
        raise ValueError(f"empty list of {what}s {text!r}; write e.g. 64,96")
    out: list[int] = []
    for item in items:
        if not item:
            continue
        try:
            value = int(item, 10)
        except ValueError:
            raise ValueError(f"{what} {item!r} in {text!r} is not an integer") from None
        if minimum is not None and value < minimum:
            raise ValueError(f"{what} {value} in {text!r} must be >= {minimum}")
        out.append(value)
    return tuple(out)


def mesh_type(text: str) -> MeshSpec:
    """:func:`parse_mesh` as an argparse ``type=`` (its message becomes the error line)."""
    try:
        return parse_mesh(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def prog_for(module: str) -> str:
    """The name a tool's usage and errors show: the ``mopd`` command that started it (e.g.
    ``mopd bench ranges``, from :data:`PROG_ENV`), else ``python -m MODULE`` (as typed)."""
    return os.environ.get(PROG_ENV) or f"python -m {module}"


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` that shows each option's default, where it has one to show: not for flags
    (``False``), options without a default (``None``) or help that already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False:
            return action.help or ""
        return super()._get_help_string(action) or ""


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (``PROG: error: ...``), status 2,
    and whose ``--help`` shows the defaults (:class:`DefaultsHelpFormatter`).

    Subparsers made with ``add_subparsers`` are of the same class, so theirs are one line too.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
