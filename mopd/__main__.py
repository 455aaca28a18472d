"""``python -m mopd``: the ``mopd`` command (:mod:`mopd.profiling.cli`).

Why this file exists: ``mopd`` is a namespace shared by the subpackages (there is no
``mopd/__init__.py``), and this folder holds only this module, installed as ``mopd.__main__``
(the ``mopd`` package in pyproject.toml, still without ``__init__.py``), so that ``python -m
mopd`` works where the console script is not on ``PATH``.
"""

from __future__ import annotations

from mopd.profiling.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
