"""The input verdicts: every token a destination needs is held by exactly one source group.

Why this file exists: the planner assumes each needed token is held once; bad input (a token
held twice, inside a group or across groups, or needed and held by nobody) must be found before
anything moves, by the ranks that lead the groups concerned, with messages that depend on the
input only, so that every rank reaches the same verdict. The checks are interval arithmetic on
the runs the planner reads (:mod:`mopd.bridge.catalog`): overlaps of a group's sorted runs (held
twice inside the group), overlaps with earlier groups whose range meets it (held twice across
groups), gaps between a destination run and the union of the sources (needed but held by
nobody). A step's micro-batches are checked in one pass (:func:`check_ranks`), each one's
verdicts those it gets alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mopd.bridge.catalog import (
    RunCatalog,
    StepRanges,
    dense_samples,
    group_runs,
    interval_overlaps,
    key_space,
    read_runs,
    run_keys,
    tagged_runs,
)

__all__ = ["check_rank", "check_ranks"]

_I64 = np.int64
_EMPTY = np.empty(0, dtype=_I64)


def _where(label: str, ranks: tuple[int, ...], row: int) -> str:
    return f"{label} (ranks {list(ranks)}, row {row})"


def _union(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals ``[start, end)`` as sorted, disjoint intervals."""
    o = start.argsort(kind="stable")
    start, end = start[o], end[o]
    reach = np.maximum.accumulate(end)
    head = np.ones(start.size, dtype=bool)
    head[1:] = start[1:] > reach[:-1]
    at = head.ravel().nonzero()[0]
    return start[at], np.maximum.reduceat(end, at) if at.size else _EMPTY


def _depth2(start: np.ndarray, end: np.ndarray) -> int:
    """How many keys at least two of the intervals ``[start, end)`` cover."""
    pos = np.concatenate([start, end])
    delta = np.concatenate([np.ones(start.size, _I64), -np.ones(end.size, _I64)])
    o = np.lexsort((delta, pos))  # at one key, ends before starts
    pos, depth = pos[o], delta[o].cumsum()
    return int((np.diff(pos) * (depth[:-1] >= 2)).sum())


def _rows_at(runs_K5: np.ndarray, key_K: np.ndarray, k: int) -> np.ndarray:
    """Rows holding key ``k`` in runs with first keys ``key_K``, ascending."""
    cover = (key_K <= k) & (k < key_K + runs_K5[:, 4])
    return np.sort(runs_K5[cover, 2] + (k - key_K[cover]) * runs_K5[cover, 3])


def _check_source(catalog: RunCatalog, g: int) -> str | None:
    """Source group ``g``'s verdict: a key it holds twice, or that an earlier group holds."""
    source = catalog.sources[g]
    runs = group_runs(catalog, "s", g)
    if not runs.shape[0]:
        return None
    lo, hi = catalog.source_range(g)
    cands = catalog.sources_meeting(lo, hi)
    cands = cands[cands < g]
    other, other_grp = tagged_runs(catalog, "s", cands)
    u, stride = key_space(runs, other)
    ks = run_keys(runs, u, stride)
    o = ks.argsort(kind="stable")
    runs, ks = runs[o], ks[o]
    ke = ks + runs[:, 4]
    if ks.size > 1:
        dup = ks[1:] < np.maximum.accumulate(ke)[:-1]
        if dup.any():
            k = int(ks[1:][dup].min())
            rows = _rows_at(runs, ks, k)
            return (
                f"token (sample_id={int(u[k // stride])}, position={k % stride}) is held twice "
                f"by {source.label or g} (ranks {list(source.ranks)}, rows {int(rows[0])} and "
                f"{int(rows[1])}); {_depth2(ks, ke)} keys are held more than once there"
            )
    if not other.shape[0]:
        return None
    kd = run_keys(other, u, stride)
    kde = kd + other[:, 4]
    b, a = interval_overlaps(ks, ke, kd, kde)
    if not b.size:
        return None
    h_P = other_grp[b]
    h = int(h_P.min())
    sel = h_P == h
    first = np.maximum(kd[b[sel]], ks[a[sel]])
    end = np.minimum(kde[b[sel]], ke[a[sel]])
    k = int(first.min())
    us, ue = _union(first, end)
    mine = other_grp == h
    row_h = int(_rows_at(other[mine], kd[mine], k)[0])
    row_g = int(_rows_at(runs, ks, k)[0])
    held = catalog.sources[h]
    return (
        f"token (sample_id={int(u[k // stride])}, position={k % stride}) is held twice: by "
        f"{_where(held.label or str(h), held.ranks, row_h)} and by "
        f"{_where(source.label or str(g), source.ranks, row_g)}; "
        f"{int((ue - us).sum())} keys are held by both"
    )


def _check_dest(catalog: RunCatalog, d: int) -> str | None:
    """Destination group ``d``'s verdict: a token it needs that no source holds."""
    group = catalog.dests[d]
    dst = group_runs(catalog, "d", d)
    if not dst.shape[0]:
        return None
    lo, hi = catalog.dest_range(d)
    src, _ = tagged_runs(catalog, "s", catalog.sources_meeting(lo, hi))
    u, stride = key_space(src, dst)
    kd = run_keys(dst, u, stride)
    kde = kd + dst[:, 4]
    if src.shape[0]:
        ks = run_keys(src, u, stride)
        ms, me = _union(ks, ks + src[:, 4])
        b, a = interval_overlaps(ms, me, kd, kde)
        first, end = np.maximum(kd[b], ms[a]), np.minimum(kde[b], me[a])
    else:
        b = first = end = _EMPTY
    missing = int(dst[:, 4].sum() - (end - first).sum())
    if missing == 0:
        return None
    # gaps of each destination run: before each piece, and after its last one
    new = np.ones(b.size, dtype=bool)
    new[1:] = b[1:] != b[:-1]
    prev = np.where(new, kd[b], np.concatenate([[0], end[:-1]]))
    last_end = kd.copy()  # where each run's last piece ends (its start: no piece)
    last = (np.diff(b, append=-1) != 0).ravel().nonzero()[0]
    last_end[b[last]] = end[last]
    gap_run = np.concatenate([b, np.arange(kd.size, dtype=_I64)])
    gap_lo = np.concatenate([prev, last_end])
    gap_hi = np.concatenate([first, kde])
    real = gap_hi > gap_lo
    gap_run, gap_lo, gap_hi = gap_run[real], gap_lo[real], gap_hi[real]
    row0, step = dst[gap_run, 2], dst[gap_run, 3]
    row_lo = row0 + (gap_lo - kd[gap_run]) * step
    row_hi = row0 + (gap_hi - 1 - kd[gap_run]) * step
    at = np.where(row_lo <= row_hi, gap_lo, gap_hi - 1)
    row = np.minimum(row_lo, row_hi)
    i = int(np.argmin(row))
    run = int(gap_run[i])
    position = int(dst[run, 1] + at[i] - kd[run])
    return (
        f"token (sample_id={int(dst[run, 0])}, position={position}) is needed by "
        f"{_where(group.label or str(d), group.ranks, int(row[i]))} but no teacher holds it; "
        f"{missing} needed tokens are missing in all"
    )


def check_rank(catalog: RunCatalog, rank: int) -> list[str]:
    """The verdicts ``rank`` is responsible for (``[]``: none found).

    Each source group is checked by its first rank (a token it holds twice, or that a source
    group before it also holds); each destination group by its first rank (a token it needs that
    no source holds). Together the ranks check every group once. Messages name the token
    ``(sample_id, position)``, the groups with their ranks and rows, and how many tokens are
    affected; they depend on the catalog only, not on the rank that finds them. A catalog of a
    :class:`StepBatch` whose micro-batch is pending is checked with every pending one
    (:func:`check_ranks`: the same verdicts).
    """
    b = catalog.batch
    if b is not None and catalog.slot in b.pending:  # every pending micro-batch in one pass
        got = b._checks.get(rank)
        if got is None:
            found_I = check_ranks([b.catalogs[i] for i in b.pending], rank)
            got = b._checks[rank] = dict(zip(b.pending, found_I, strict=True))
        return list(got[catalog.slot])
    ix = catalog.index()
    found: list[str] = []
    for g in ix.source_groups.get(rank, ()):
        if catalog.sources[g].ranks[0] == rank:
            msg = _check_source(catalog, g)
            if msg is not None:
                found.append(msg)
    for d in ix.dest_groups.get(rank, ()):
        if catalog.dests[d].ranks[0] == rank:
            msg = _check_dest(catalog, d)
            if msg is not None:
                found.append(msg)
    return found


def _source_flags(catalogs: Sequence[RunCatalog], g: int) -> np.ndarray:
    """``[n]`` whether :func:`_check_source` finds a problem with source group ``g`` in each
    catalog: one pass over every catalog's runs of ``g`` and of the earlier groups that meet
    it (keys made distinct per catalog)."""
    ranges = StepRanges.of(catalogs, "s")
    mb_P, grp_P = ranges.meeting(*ranges.range_of(g))
    keep = grp_P <= g  # the group itself and the earlier ones
    mb_P, grp_P = mb_P[keep], grp_P[keep]
    flags = np.zeros(len(catalogs), dtype=bool)
    if not mb_P.size:
        return flags
    runs, mb, tag = read_runs(catalogs, "s", mb_P, grp_P)
    if not runs.shape[0]:
        return flags
    ids = dense_samples(mb, runs[:, 0])
    stride = int((runs[:, 1] + runs[:, 4]).max()) + 1
    key = ids * stride + runs[:, 1]
    mine = tag == g
    ks, ke, kmb = key[mine], key[mine] + runs[mine, 4], mb[mine]
    o = ks.argsort(kind="stable")
    ks, ke, kmb = ks[o], ke[o], kmb[o]
    if ks.size > 1:  # a key held twice inside the group
        dup = ks[1:] < np.maximum.accumulate(ke)[:-1]
        flags[kmb[1:][dup]] = True
    other = ~mine
    if other.any() and ks.size:  # a key an earlier group holds too
        us, ue = _union(ks, ke)
        kd = key[other]
        b, _ = interval_overlaps(us, ue, kd, kd + runs[other, 4])
        flags[mb[other][b]] = True
    return flags


def _dest_flags(catalogs: Sequence[RunCatalog], d: int) -> np.ndarray:
    """``[n]`` whether :func:`_check_dest` finds a needed token no source holds in destination
    group ``d``, per catalog: one pass over every catalog's runs of ``d`` and of the sources
    that meet it."""
    n = len(catalogs)
    every = np.arange(n, dtype=_I64)
    dst, dmb, _ = read_runs(catalogs, "d", every, np.full(n, d, dtype=_I64))
    if not dst.shape[0]:
        return np.zeros(n, dtype=bool)
    mb_P, grp_P = StepRanges.of(catalogs, "s").meeting(*StepRanges.of(catalogs, "d").range_of(d))
    src, smb, _ = read_runs(catalogs, "s", mb_P, grp_P)
    ids = dense_samples(np.concatenate([smb, dmb]), np.concatenate([src[:, 0], dst[:, 0]]))
    both = np.concatenate([src, dst])
    stride = int((both[:, 1] + both[:, 4]).max()) + 1
    key = ids * stride + both[:, 1]
    ks, kd = key[: src.shape[0]], key[src.shape[0] :]
    need = np.bincount(dmb, weights=dst[:, 4], minlength=n).astype(_I64)
    if not ks.size:
        return need > 0
    us, ue = _union(ks, ks + src[:, 4])
    b, a = interval_overlaps(us, ue, kd, kd + dst[:, 4])
    got = np.minimum(kd[b] + dst[b, 4], ue[a]) - np.maximum(kd[b], us[a])
    return need > np.bincount(dmb[b], weights=got, minlength=n).astype(_I64)


def check_ranks(catalogs: Sequence[RunCatalog], rank: int) -> list[list[str]]:
    """:func:`check_rank` of every catalog (a step's micro-batches, over one set of groups):
    one pass per group this rank checks finds the catalogs with a problem, and each of those
    is judged alone, so the messages are :func:`check_rank`'s, in its order."""
    if not catalogs:
        return []
    ix = catalogs[0].index()
    led_s = [g for g in ix.source_groups.get(rank, ()) if ix.rep_rank_X[ix.rep_off_G1[g]] == rank]
    led_d = [d for d in ix.dest_groups.get(rank, ()) if ix.slot_rank_S[ix.slot_off_D1[d]] == rank]
    flag_s = [_source_flags(catalogs, g) for g in led_s]
    flag_d = [_dest_flags(catalogs, d) for d in led_d]
    out: list[list[str]] = []
    for i, cat in enumerate(catalogs):
        found: list[str] = []
        for g, flags in zip(led_s, flag_s, strict=True):
            if flags[i]:
                msg = _check_source(cat, g)
                assert msg is not None, (i, g)
                found.append(msg)
        for d, flags in zip(led_d, flag_d, strict=True):
            if flags[i]:
                msg = _check_dest(cat, d)
                assert msg is not None, (i, d)
                found.append(msg)
        out.append(found)
    return out
