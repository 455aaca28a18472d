"""What the harness fixture modules share: a 2-rank gloo world made at import, only in the ranks,
and a record of what ran where.

Why this file exists: the fixture modules must be importable in the parent (which collects them)
and must prove which tests each rank really ran; ``record`` appends ``"<rank> <what>"`` lines to
the file named by ``HARNESS_RECORD`` when it is set.
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

__all__ = ["in_ranks", "record", "world"]


def in_ranks() -> bool:
    return "RANK" in os.environ


def world() -> None:
    if in_ranks() and not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))


def record(what: str) -> None:
    path = os.environ.get("HARNESS_RECORD")
    if path and in_ranks():
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(f"{os.environ['RANK']} {what}\n")
