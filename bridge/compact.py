"""Compact per-teacher rows and the layout order they come from.

Why this file exists: the bridge delivers each teacher's rows compact (one row per token that
teacher owns, in the student layout's row order: the form the KL reads, no zero-filled copies).
A caller who wants them back in the layout's order, one ``[N, H_k]`` buffer per teacher with
zero rows elsewhere (checks, tools, a loss of its own), scatters them with
:func:`layout_rows`; :func:`compact_rows` is the inverse.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["compact_rows", "layout_rows"]


def layout_rows(rows: Mapping[int, torch.Tensor], owner_N: torch.Tensor) -> dict[int, torch.Tensor]:
    """``teacher -> [N, H_k]``: each teacher's compact ``[N_k, H_k]`` rows put back at the
    rows of the layout it owns (``owner_N == k``, in order), zero elsewhere.

    Args:
        rows: ``teacher -> [N_k, H_k]`` compact rows (:meth:`~mopd.bridge.BridgeStep.receive`).
        owner_N: ``[N]`` int64 owner of each layout row, ``-1`` for padding
            (:meth:`~mopd.bridge.BridgeStep.owner`).
    Raises:
        ValueError: a teacher's row count differs from the rows ``owner_N`` gives it.
    """
    out: dict[int, torch.Tensor] = {}
    for k, t in rows.items():
        mine = owner_N.to(t.device) == k
        n = int(mine.sum())
        if t.dim() != 2 or t.shape[0] != n:
            raise ValueError(
                f"teacher {k}: {tuple(t.shape)} compact rows, but owner_N gives it {n} rows"
            )
        full = t.new_zeros((owner_N.numel(), t.shape[1]))
        full[mine] = t
        out[k] = full
    return out


def compact_rows(
    rows_NH: Mapping[int, torch.Tensor], owner_N: torch.Tensor
) -> dict[int, torch.Tensor]:
    """``teacher -> [N_k, H_k]``: the rows of each ``[N, H_k]`` buffer its teacher owns
    (``owner_N == k``), in order: :func:`layout_rows`' inverse."""
    return {k: t[owner_N.to(t.device) == k] for k, t in rows_NH.items()}
