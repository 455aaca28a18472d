"""The per-token oracle of the transfer planner: every rank's plan and every verdict, globally.

Why this file exists: :func:`mopd.bridge.plan.plan_rank` joins runs of keys, one rank at a time,
and :func:`mopd.bridge.coverage.check_rank` finds bad input by interval arithmetic. Both are checked
against this module, which does the same job the obvious way: it expands every run of every
group into tokens, joins all tokens of the exchange at once by key, and applies the rules of
:mod:`mopd.bridge.plan` (blocks in destination-row order, ``k`` near-equal chunks rotated by
``(c + g + s) % k``, local copies, near-equal slices, each group checked by its first rank) to
every rank. It is global and ``O(tokens log tokens)``: for tests only.

Segments here are one per token (``(src, 1, dst, 1, 1)``); compare plans with
:func:`normalise`, which expands any segment table into its token pairs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from mopd.bridge.catalog import RunCatalog
from mopd.bridge.plan import DestSlot, RankPlan, Transfer

__all__ = [
    "NormalPlan",
    "Tokens",
    "compose",
    "expand_runs",
    "normalise",
    "oracle_plans",
    "oracle_verdicts",
    "token_pairs",
]

_I64 = np.int64


@dataclass(frozen=True, kw_only=True, eq=False)
class Tokens:
    """Every token of some runs: ``[M]`` sample, position, row and group (run order)."""

    sample_M: np.ndarray
    position_M: np.ndarray
    row_M: np.ndarray
    group_M: np.ndarray


def expand_runs(runs_K5: np.ndarray, group: int = 0) -> Tokens:
    """The tokens of one run table (``step`` ignored for runs of length 1)."""
    runs_K5 = np.asarray(runs_K5, dtype=_I64).reshape(-1, 5)
    length = np.maximum(runs_K5[:, 4], 0)
    m = int(length.sum())
    run = np.repeat(np.arange(runs_K5.shape[0], dtype=_I64), length)
    i = np.arange(m, dtype=_I64) - np.repeat(np.cumsum(length) - length, length)
    return Tokens(
        sample_M=runs_K5[run, 0],
        position_M=runs_K5[run, 1] + i,
        row_M=runs_K5[run, 2] + i * runs_K5[run, 3],
        group_M=np.full(m, group, dtype=_I64),
    )


def _cat(parts: list[Tokens]) -> Tokens:
    if not parts:
        e = np.empty(0, dtype=_I64)
        return Tokens(sample_M=e, position_M=e, row_M=e, group_M=e)
    return Tokens(
        sample_M=np.concatenate([p.sample_M for p in parts]),
        position_M=np.concatenate([p.position_M for p in parts]),
        row_M=np.concatenate([p.row_M for p in parts]),
        group_M=np.concatenate([p.group_M for p in parts]),
    )


def _keys(*sides: Tokens) -> list[np.ndarray]:
    """Dense int64 keys of ``(sample, position)``, comparable across ``sides``."""
    samples = np.concatenate([s.sample_M for s in sides])
    positions = np.concatenate([s.position_M for s in sides])
    u = np.unique(samples)
    stride = int(positions.max()) + 1 if positions.size else 1
    return [np.searchsorted(u, s.sample_M) * stride + s.position_M for s in sides]


def token_pairs(segments_S5: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(src_rows, dst_rows)`` of every token of a segment table, in order."""
    seg = np.asarray(segments_S5, dtype=_I64).reshape(-1, 5)
    length = seg[:, 4]
    s = np.repeat(np.arange(seg.shape[0]), length)
    i = np.arange(int(length.sum()), dtype=_I64) - np.repeat(np.cumsum(length) - length, length)
    return seg[s, 0] + i * seg[s, 1], seg[s, 2] + i * seg[s, 3]


def _transfer(owner: int, src: int, dst: int, src_M: np.ndarray, dst_M: np.ndarray) -> Transfer:
    seg = np.stack(
        [src_M, np.ones_like(src_M), dst_M, np.ones_like(dst_M), np.ones_like(dst_M)], axis=1
    )
    return Transfer(owner=owner, src_rank=src, dst_rank=dst, segments_S5=seg.astype(_I64))


def oracle_plans(
    catalog: RunCatalog,
    *,
    local_copy: bool = True,
    ranks: Iterable[int] = (),
    compact: bool = False,
) -> dict[int, RankPlan]:
    """Every rank's :class:`RankPlan`, from one per-token join of the whole exchange.

    ``compact``: destination rows in compact space (each owner's tokens of a destination
    group ranked by layout row, sliced in ``ceil(count / ranks)`` rows), as
    :func:`~mopd.bridge.plan.plan_rank` with ``compact=True``.

    Ranks: every rank of every group, and ``ranks`` (e.g. the bridge's members). Assumes input :func:`oracle_verdicts` passes (where a
    token is held twice, the lowest source group index serves it).
    """
    sources, dests = list(catalog.sources), list(catalog.dests)
    src = _cat([expand_runs(catalog.source_runs(g), g) for g in range(len(sources))])
    dst = _cat([expand_runs(catalog.dest_runs(d), d) for d in range(len(dests))])
    k_src, k_dst = _keys(src, dst)
    # the first holder (lowest group) of each key: sort by (key, group)
    o = np.lexsort((src.group_M, k_src))
    ks, g_s, r_s = k_src[o], src.group_M[o], src.row_M[o]
    at = np.searchsorted(ks, k_dst)
    ok = at < ks.size
    ok[ok] = ks[at[ok]] == k_dst[ok]
    # the destination tokens that someone holds: group, rows, destination group
    t_g, t_src = g_s[at[ok]], r_s[at[ok]]
    t_d, t_row = dst.group_M[ok], dst.row_M[ok]
    n_slots = np.asarray([len(x.ranks) for x in dests], dtype=_I64)
    slot_off = np.concatenate([[0], np.cumsum(n_slots)]).astype(_I64)
    owner_G = np.asarray([s.owner for s in sources], dtype=_I64)
    n_owners = int(owner_G.max()) + 1 if owner_G.size else 0
    t_own = owner_G[t_g]
    counts_DK = np.zeros((len(dests), max(n_owners, 1)), dtype=_I64)
    np.add.at(counts_DK, (t_d, t_own), 1)
    if compact:  # rank of each token among its owner's tokens of its group, by row
        t_pos = np.empty(t_row.size, dtype=_I64)
        for d in range(len(dests)):
            for k in range(n_owners):
                sel = np.flatnonzero((t_d == d) & (t_own == k))
                t_pos[sel[np.argsort(t_row[sel])]] = np.arange(sel.size)
        nominal = np.maximum(-(-counts_DK[t_d, t_own] // n_slots[t_d]), 1)
    else:
        t_pos = t_row
        nominal = np.asarray([max(x.slice_rows, 1) for x in dests], dtype=_I64)[t_d]
    t_j = t_pos // nominal if t_d.size else t_d
    t_rel = t_pos - t_j * nominal
    t_slot = slot_off[t_d] + t_j

    every = {r for s in sources for r in s.ranks} | {r for x in dests for r in x.ranks}
    ranks = sorted(every | set(ranks))
    sends: dict[int, list[Transfer]] = {r: [] for r in ranks}
    recvs: dict[int, list[Transfer]] = {r: [] for r in ranks}
    locals_: dict[int, list[Transfer]] = {r: [] for r in ranks}
    # blocks (g, slot): tokens in destination-row order
    order = np.lexsort((t_rel, t_slot, t_g))
    t_g, t_src, t_d, t_row, t_j, t_slot, t_rel = (
        a[order] for a in (t_g, t_src, t_d, t_row, t_j, t_slot, t_rel)
    )
    blk = np.flatnonzero(np.diff(np.concatenate([[-1], t_g * (slot_off[-1] + 1) + t_slot])))
    ends = np.concatenate([blk[1:], [t_g.size]])
    for a, b in zip(blk.tolist(), ends.tolist(), strict=True):
        g, s, d, j = int(t_g[a]), int(t_slot[a]), int(t_d[a]), int(t_j[a])
        slot_rank = dests[d].ranks[j]
        reps = sources[g].ranks
        src_M, dst_M = t_src[a:b], t_rel[a:b]
        owner = int(owner_G[g])
        if local_copy and slot_rank in reps:
            locals_[slot_rank].append(_transfer(owner, slot_rank, slot_rank, src_M, dst_M))
            continue
        k, n = len(reps), b - a
        for c in range(k):
            lo, hi = -(-c * n // k), -(-(c + 1) * n // k)
            if hi <= lo:
                continue
            rep = reps[(c + g + s) % k]
            t = _transfer(owner, rep, slot_rank, src_M[lo:hi], dst_M[lo:hi])
            sends[rep].append(t)
            recvs[slot_rank].append(t)

    out: dict[int, RankPlan] = {}
    for r in ranks:
        dest: DestSlot | None = None
        owner_N: np.ndarray | None = None
        for d, x in enumerate(dests):
            if r in x.ranks:
                j = x.ranks.index(r)
                start, stop = x.slice_bounds(j)
                dest = DestSlot(
                    group=d,
                    slot=j,
                    row_offset=start,
                    slice_rows=stop - start,
                    num_rows=x.num_rows,
                    padded_rows=x.slice_rows * len(x.ranks),
                    group_size=len(x.ranks),
                    owner_rows=tuple(int(c) for c in counts_DK[d, :n_owners]) if compact else (),
                )
                owner_N = np.full(x.num_rows, -1, dtype=_I64)
                sel = t_d == d
                owner_N[t_row[sel]] = owner_G[t_g[sel]]
                break
        out[r] = RankPlan.of(
            rank=r,
            sends=tuple(sorted(sends[r], key=lambda t: (t.owner, t.dst_rank))),
            recvs=tuple(sorted(recvs[r], key=lambda t: (t.owner, t.src_rank))),
            locals=tuple(sorted(locals_[r], key=lambda t: t.owner)),
            dest=dest,
            owner_N=owner_N,
        )
    return out


def _where(label: str, ranks: tuple[int, ...], row: int | None = None) -> str:
    at = f", row {row}" if row is not None else ""
    return f"{label} (ranks {list(ranks)}{at})"


def oracle_verdicts(catalog: RunCatalog) -> dict[int, list[str]]:
    """``rank -> verdicts`` (only ranks with one), with :func:`mopd.bridge.coverage.check_rank`'s rules.

    Source group ``g`` (by its first rank): the smallest key it holds twice (its two smallest
    rows, and how many distinct keys it holds more than once); else the first group ``h < g``
    sharing a key with it (the smallest shared key, its smallest row in ``h`` and its row in
    ``g``, and how many distinct keys they share). Destination group ``d`` (by its first rank):
    the needed token no source holds at the smallest row, and how many needed rows are missing.
    """
    sources, dests = list(catalog.sources), list(catalog.dests)
    src = [expand_runs(catalog.source_runs(g), g) for g in range(len(sources))]
    dst = [expand_runs(catalog.dest_runs(d), d) for d in range(len(dests))]
    keys = _keys(*src, *dst)
    k_src, k_dst = keys[: len(src)], keys[len(src) :]
    out: dict[int, list[str]] = {}

    def name(t: Tokens, i: int) -> str:
        return f"(sample_id={int(t.sample_M[i])}, position={int(t.position_M[i])})"

    for g, s in enumerate(sources):
        key, tok = k_src[g], src[g]
        if key.size == 0:
            continue
        u, cnt = np.unique(key, return_counts=True)
        if (cnt > 1).any():
            k = u[np.flatnonzero(cnt > 1)[0]]
            at = np.flatnonzero(key == k)
            rows = np.sort(tok.row_M[at])
            msg = (
                f"token {name(tok, int(at[0]))} is held twice by {s.label or g} "
                f"(ranks {list(s.ranks)}, rows {int(rows[0])} and {int(rows[1])}); "
                f"{int((cnt > 1).sum())} keys are held more than once there"
            )
            out.setdefault(s.ranks[0], []).append(msg)
            continue
        for h in range(g):
            both = np.intersect1d(u, k_src[h])
            if both.size:
                k = int(both[0])
                i_g = int(np.flatnonzero(key == k)[0])
                row_h = int(src[h].row_M[k_src[h] == k].min())
                other = sources[h]
                msg = (
                    f"token {name(tok, i_g)} is held twice: by "
                    f"{_where(other.label or str(h), other.ranks, row_h)} and by "
                    f"{_where(s.label or str(g), s.ranks, int(tok.row_M[i_g]))}; "
                    f"{both.size} keys are held by both"
                )
                out.setdefault(s.ranks[0], []).append(msg)
                break
    held = np.unique(np.concatenate(k_src)) if k_src else np.empty(0, dtype=_I64)
    for d, x in enumerate(dests):
        key, tok = k_dst[d], dst[d]
        missing = ~np.isin(key, held)
        if missing.any():
            i = int(np.flatnonzero(missing)[np.argmin(tok.row_M[missing])])
            msg = (
                f"token {name(tok, i)} is needed by "
                f"{_where(x.label or str(d), x.ranks, int(tok.row_M[i]))} but no teacher holds "
                f"it; {int(missing.sum())} needed tokens are missing in all"
            )
            out.setdefault(x.ranks[0], []).append(msg)
    return out


@dataclass(frozen=True, kw_only=True)
class NormalPlan:
    """A :class:`RankPlan` with every transfer as its token pairs and ``dest`` as its fields
    (comparable with ``==``)."""

    sends: tuple[tuple[int, int, int, tuple[int, ...], tuple[int, ...]], ...]
    recvs: tuple[tuple[int, int, int, tuple[int, ...], tuple[int, ...]], ...]
    locals: tuple[tuple[int, int, int, tuple[int, ...], tuple[int, ...]], ...]
    dest: tuple[int, int, int, int, int, int] | None
    owner_N: tuple[int, ...] | None


def normalise(plan: RankPlan) -> NormalPlan:
    """``plan`` with segments expanded into token pairs (any two segmentations of one order agree)."""

    def norm(
        ts: tuple[Transfer, ...],
    ) -> tuple[tuple[int, int, int, tuple[int, ...], tuple[int, ...]], ...]:
        out = []
        for t in ts:
            s, d = token_pairs(t.segments_S5)
            out.append((t.owner, t.src_rank, t.dst_rank, tuple(s.tolist()), tuple(d.tolist())))
        return tuple(out)

    return NormalPlan(
        sends=norm(plan.sends),
        recvs=norm(plan.recvs),
        locals=norm(plan.locals),
        dest=None if plan.dest is None else dataclasses.astuple(plan.dest),
        owner_N=None if plan.owner_N is None else tuple(plan.owner_N.tolist()),
    )


def compose(plans: Mapping[int, RankPlan]) -> dict[int, NormalPlan]:
    """Every rank's normalised plan (what the oracle's global plan is compared with)."""
    return {r: normalise(p) for r, p in plans.items()}
