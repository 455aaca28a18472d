"""Where each rank of a job is: one small phase file per rank, read by the launcher on a timeout.

Why this file exists: a ``mopd demo`` killed at its time limit must say more than "timed out".
Each rank records the phase it enters (:func:`enter`: the phase and when it began, one JSON file
per rank, replaced atomically) in the folder the launcher names in ``MOPD_PHASE_DIR``; a rank
started without that variable records nothing. When the launcher kills a job, it reads the
folder (:func:`read`) and prints which phase each rank was in, for how long, and what to change
(:func:`timeout_report`). Files, not a store or a socket: they survive the ranks being killed,
need no rendezvous, and cost one small write per phase.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from mopd.common.units import human_seconds, rank_list

__all__ = ["ENV_VAR", "RankPhase", "enter", "read", "timeout_report"]

#: The folder every rank writes its phase file into (set by the launcher).
ENV_VAR = "MOPD_PHASE_DIR"

_started: float | None = None  # when this process recorded its first phase


@dataclass(frozen=True, kw_only=True)
class RankPhase:
    """A rank's last recorded phase.

    Attributes:
        rank: the global rank.
        phase: what it was doing, e.g. ``"step 2 of 3"``.
        since: when it entered the phase (``time.time()``).
        up_since: when it recorded its first phase (its interpreter was running).
    """

    rank: int
    phase: str
    since: float
    up_since: float


def enter(phase: str, *, rank: int | None = None) -> None:
    """Record that this rank now is in ``phase`` (nothing without ``MOPD_PHASE_DIR``).

    ``rank``: default the ``RANK`` torchrun sets. Never raises for a folder that went away (the
    launcher may be tearing the job down): the phase file is a report, not part of the job.
    """
    global _started
    folder = os.environ.get(ENV_VAR)
    if not folder:
        return
    now = time.time()
    if _started is None:
        _started = now
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    path = Path(folder) / f"rank{rank}.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps({"phase": phase, "since": now, "up_since": _started}))
        os.replace(tmp, path)
    except OSError:
        pass


def read(folder: str | Path) -> dict[int, RankPhase]:
    """Every rank's last recorded phase in ``folder`` (unreadable files are left out)."""
    found: dict[int, RankPhase] = {}
    for path in Path(folder).glob("rank*.json"):
        try:
            rank = int(path.stem[len("rank") :])
            data = json.loads(path.read_text())
            found[rank] = RankPhase(
                rank=rank,
                phase=str(data["phase"]),
                since=float(data["since"]),
                up_since=float(data["up_since"]),
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def _seconds(values: Sequence[float]) -> str:
    """``12 s`` / ``0.4 s`` / ``12-15 s``: the least and the most, coarse."""
    lo, hi = (human_seconds(x, coarse=True) for x in (min(values), max(values)))
    return lo if lo == hi else f"{lo.removesuffix(' s')}-{hi}"


def timeout_report(
    phases: Mapping[int, RankPhase],
    *,
    ranks: Sequence[int] | None,
    nproc: int,
    timeout_s: float,
    now: float,
    unreported: str = "no phase recorded (its Python had not started yet)",
) -> list[str]:
    """The lines a launcher prints when it killed a job at ``timeout_s``: one per group of ranks
    in the same phase (``for`` how long they had been in it, ``up`` how long they had run), then
    one for the ranks that recorded nothing (``unreported``).

    Args:
        ranks: the global ranks the launcher started, where it knows them (one node: ``0 ..
            nproc - 1``); ``None`` on one node of several, whose ranks the rendezvous numbers:
            then the recorded ones are listed and the others counted.
        nproc: how many ranks the launcher started.
    """
    lines = [f"the job timed out after {timeout_s:.0f} s and was killed; where its ranks were:"]
    mine = sorted(phases) if ranks is None else [r for r in ranks if r in phases]
    groups: dict[str, list[RankPhase]] = {}
    for rank in mine:
        groups.setdefault(phases[rank].phase, []).append(phases[rank])
    for phase, members in sorted(groups.items(), key=lambda kv: kv[1][0].rank):
        lines.append(
            f"  {rank_list([m.rank for m in members], noun='rank', style='span')}: {phase}, for "
            f"{_seconds([now - m.since for m in members])} "
            f"(up {_seconds([now - m.up_since for m in members])})"
        )
    if ranks is not None:
        silent = [r for r in ranks if r not in phases]
        if silent:
            lines.append(f"  {rank_list(silent, noun='rank', style='span')}: {unreported}")
    elif len(mine) < nproc:
        others = nproc - len(mine)
        lines.append(f"  {others} more rank{'s' if others > 1 else ''} of this node: {unreported}")
    return lines
