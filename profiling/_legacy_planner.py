"""The previous global planner (``plan_token_exchange``), kept only for ``mopd bench plan``.

Why this file exists: the planning benchmark times one rank's local plan
(:func:`mopd.bridge.plan.plan_rank`) beside what every rank used to compute, the whole job's plan,
on the same layouts. That planner left the library; this is its code as it was (the run join of
``bridge/planner_runs.py`` followed by ``bridge/planner.py``, one after the other), unchanged but
for the imports. Nothing else imports it. Its rules differ slightly from today's (replica
rotation ``(c + block) % k`` over all blocks, equal slices): its figures are the cost of the old
way, not a reference for the new plans.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from mopd.bridge.layout import TokenLayout
from mopd.bridge.mesh import Mesh

__all__ = ["StudentBatch", "TeacherBatch", "TransferPlan", "plan_token_exchange"]

_I64 = torch.int64
_log = logging.getLogger(__name__)
_logged_fallback: set[bool] = set()

# --- the run join (was bridge/planner_runs.py) ------------------------------------------------

#: Mean run length below which a group's row-order runs are re-found by sorting its keys (strided
#: ``[S, B, H]`` layouts), and below which, for all groups together, the keys are not considered
#: run-structured (``method="auto"`` then plans per token).
MIN_MEAN_RUN = 4


@dataclass(frozen=True, kw_only=True, eq=False)
class KeyRuns:
    """Runs of the keys of several groups' flat buffers (``K`` runs in all).

    Attributes:
        group_K: ``[K]`` int64 group index of each run.
        key_K: ``[K]`` int64 first key; the run holds keys ``key .. key + length - 1``.
        row_K: ``[K]`` int64 row of the first key, in its group's flat buffer.
        step_K: ``[K]`` int64 row step between consecutive keys (1 for runs of length 1).
        length_K: ``[K]`` int64 number of keys (>= 1).
        slot_K: ``[K]`` int64 global slot (receiving rank) of the run for destinations, else -1.
        num_tokens: rows with a key (``sum(length_K)``).
    """

    group_K: torch.Tensor
    key_K: torch.Tensor
    row_K: torch.Tensor
    step_K: torch.Tensor
    length_K: torch.Tensor
    slot_K: torch.Tensor
    num_tokens: int

    @property
    def num_runs(self) -> int:
        return int(self.key_K.numel())

    def table(self) -> torch.Tensor:
        """``[K, 6]`` int64 ``(group, key, row, step, length, slot)`` (for hashing and printing)."""
        return torch.stack(
            [self.group_K, self.key_K, self.row_K, self.step_K, self.length_K, self.slot_K], dim=1
        )


def _row_order_runs(key_R: np.ndarray, breaks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Step-1 runs of ``[R]`` keys in row order: ``(start_K, length_K)`` rows; no run spans a break.

    ``breaks`` holds rows where a run must start anew (group and slice starts). Padding (any
    negative key) belongs to no run. Linear: a few elementwise passes, no sort.
    """
    n = key_R.size
    if n == 0:
        e = np.empty(0, dtype=np.int64)
        return e, e.copy()
    cont = np.empty(n, dtype=bool)  # cont[r]: row r continues row r - 1
    cont[0] = False
    np.equal(np.diff(key_R), 1, out=cont[1:])
    cont[1:] &= key_R[:-1] >= 0
    cont[breaks] = False
    start = np.flatnonzero(~cont)  # every maximal chain; a padding row is a chain of its own
    length = np.diff(start, append=n)
    keep = key_R[start] >= 0
    return start[keep], length[keep]


def _sorted_runs(
    key_R: np.ndarray, slice_rows: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Runs of one group's ``[R]`` keys in key order, any constant row step: ``(key, row, step, length)``.

    For strided layouts (``[S, B, H]``: a sample's rows are ``B`` apart). ``slice_rows > 0``
    keeps each run inside one slice ``row // slice_rows``. ``O(R log R)`` (one stable sort).
    """
    row = np.flatnonzero(key_R >= 0)
    if row.size == 0:
        e = np.empty(0, dtype=np.int64)
        return e, e.copy(), e.copy(), e.copy()
    order = np.argsort(key_R[row], kind="stable")
    row = row[order]
    k = key_R[row]
    n = row.size
    d = np.diff(row)
    cont = np.diff(k) == 1
    if slice_rows > 0:
        cont &= np.diff(row // slice_rows) == 0
    # break before element i + 1 if (i, i + 1) is not continuous or changes the step of (i - 1, i)
    step_change = np.zeros(n - 1, dtype=bool)
    if n > 2:
        step_change[1:] = cont[:-1] & (d[1:] != d[:-1])
    start = np.concatenate([[0], np.flatnonzero(~cont | step_change) + 1]).astype(np.int64)
    length = np.diff(start, append=n)
    step = np.ones_like(start)
    multi = length > 1
    step[multi] = d[start[multi]]
    return k[start], row[start], step, length


#: Rows searched after a probe row for the row holding the next key (the largest row step the
#: strided fast path of :func:`extract_runs` can find; wider steps are found by sorting).
_PROBE_WINDOW = 256
#: Probe rows per group for :func:`_probe_steps`.
_PROBES = 4


def _probe_steps(key_R: np.ndarray, off_G1: np.ndarray) -> np.ndarray:
    """``[G]`` the most common row step between a key and the next key in each group, or 0.

    ``key_R``: ``[R]`` all groups' keys, group ``g`` at rows ``off_G1[g] : off_G1[g + 1]``. A few
    probe rows per group (the first real row after evenly spaced points) look for the row holding
    their key + 1 within :data:`_PROBE_WINDOW` rows after them (the next row first: the common
    case, one gather). A hint only: the caller checks whatever it builds on it (a wrong hint costs
    time, never correctness). Vectorized over ``[G * _PROBES, window]`` blocks, no pass over
    the rows.
    """
    n_groups = off_G1.size - 1
    last = key_R.size - 1
    lo_G, hi_G = off_G1[:-1], off_G1[1:]
    # [G, P] evenly spaced probe points, flattened to [Q]; rows past a group's end count as padding
    at_Q = (lo_G[:, None] + (hi_G - lo_G)[:, None] * np.arange(_PROBES) // _PROBES).reshape(-1)
    end_Q = np.repeat(hi_G, _PROBES)

    def window(start_Q: np.ndarray, end_Q: np.ndarray, width: int) -> np.ndarray:
        """``[Q, width]`` keys of rows ``start .. start + width - 1`` (``-1`` at ``end`` and past)."""
        rows_QW = start_Q[:, None] + np.arange(width)
        return np.where(rows_QW < end_Q[:, None], key_R[np.minimum(rows_QW, last)], -1)

    real_QW = window(at_Q, end_Q, _PROBE_WINDOW // 8) >= 0
    has_Q = real_QW.any(axis=1)
    probe_Q = at_Q + real_QW.argmax(axis=1)  # the first real row of the probe's window
    want_Q = key_R[np.minimum(probe_Q, last)] + 1
    step_Q = np.where(has_Q & (window(probe_Q + 1, end_Q, 1)[:, 0] == want_Q), 1, 0)
    wide = np.flatnonzero(has_Q & (step_Q == 0))  # no key + 1 on the next row: look further
    if wide.size:
        hit_QW = window(probe_Q[wide] + 1, end_Q[wide], _PROBE_WINDOW) == want_Q[wide, None]
        step_Q[wide] = np.where(hit_QW.any(axis=1), hit_QW.argmax(axis=1) + 1, 0)
    step_GP = step_Q.reshape(n_groups, _PROBES)
    out = np.zeros(n_groups, dtype=np.int64)
    for g in np.flatnonzero(step_GP.max(axis=1, initial=0) > 0).tolist():
        v = step_GP[g][step_GP[g] > 0]
        out[g] = int(np.bincount(v).argmax())  # the most common step; ties: the smallest
    return out


def _strided_runs(
    key_R: np.ndarray, step: int, slice_rows: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """:func:`_sorted_runs` of one group, found without sorting the keys when they run ``step`` rows apart.

    Chains of rows ``r, r + step, ...`` holding consecutive keys (inside one slice) are found by
    a few linear passes; only the chains (``K``, a few per sample) are sorted by first key. The
    result is exactly :func:`_sorted_runs`' (same runs, same order) when the keys are distinct and
    no two chains continue each other in key order (``key + length`` of one is the next one's
    first key in the same slice, with another step); otherwise, or when the group's row-order runs
    would not be short (see :func:`extract_runs`), returns ``None`` and the caller sorts.
    Why this is exact: sorted by key, the chains are then the maximal stretches of consecutive
    keys with one row step, which is how :func:`_sorted_runs` cuts.
    """
    n, d = key_R.size, step
    if not 1 < d < n or (slice_rows > 0 and (n % slice_rows or d > slice_rows)):
        return None
    valid = key_R >= 0
    # cont[r]: row r holds the key after row r - d's (same slice); implies valid[r] (key >= 1)
    cont = np.zeros(n, dtype=bool)
    np.equal(key_R[d:], key_R[:-d] + 1, out=cont[d:])
    cont[d:] &= valid[:-d]
    if slice_rows > 0:
        cont.reshape(-1, slice_rows)[:, :d] = False  # rows in a slice's first d start anew
    # heads: real rows no chain continues; tails: real rows the row d further does not continue.
    # cont is a subset of valid (and cont[r + d] of valid[r]), so xor is "and not".
    head = np.flatnonzero(valid ^ cont)
    tail_mask = valid.copy()
    tail_mask[:-d] ^= cont[d:]
    tail = np.flatnonzero(tail_mask)
    if head.size != tail.size or head.size == 0:
        return None
    # within one residue class (row % d) chains are disjoint intervals: the i-th head there
    # pairs with the i-th tail there; a stable sort by residue keeps row order inside a class
    head = head[np.argsort(head % d, kind="stable")]
    tail = tail[np.argsort(tail % d, kind="stable")]
    length = (tail - head) // d + 1
    key = key_R[head]
    o = np.argsort(key, kind="stable")
    key, row, length = key[o], head[o], length[o]
    num_tokens = int(length.sum())
    if (num_tokens - key.size) * MIN_MEAN_RUN <= num_tokens:
        return None  # maybe not short in row order: the caller decides the usual way
    end = key + length  # one past the last key
    if key.size > 1:
        step_a = np.where(length > 1, d, 1)
        last_row = row + (length - 1) * step_a
        touch = key[1:] == end[:-1]  # the next chain starts at this one's key + length
        if slice_rows > 0:
            touch &= row[1:] // slice_rows == last_row[:-1] // slice_rows
        if bool((key[1:] < end[:-1]).any()) or bool(touch.any()):
            return None  # a key held twice, or chains that sorting would cut differently
    return key, row, np.where(length > 1, d, 1), length


def _as_np(t: torch.Tensor) -> np.ndarray:
    return t.detach().reshape(-1).contiguous().numpy()


def _concat(keys: Sequence[torch.Tensor]) -> np.ndarray:
    """All keys one after another; no copy when they are adjacent views of one int64 buffer."""
    if not keys:
        return np.empty(0, dtype=np.int64)
    if len(keys) == 1:
        return _as_np(keys[0])
    first = keys[0]
    storage = first.untyped_storage()
    total = sum(k.numel() for k in keys)
    adjacent = first.numel() > 0 and first.dtype == torch.int64
    at = first.storage_offset()
    for k in keys:
        adjacent = (
            adjacent
            and k.dtype == torch.int64
            and k.is_contiguous()
            and k.untyped_storage().data_ptr() == storage.data_ptr()
            and (k.numel() == 0 or k.storage_offset() == at)
        )
        at += k.numel()
    if adjacent and at * 8 <= storage.nbytes():
        flat = torch.empty(0, dtype=torch.int64).set_(
            storage, first.storage_offset(), (total,), (1,)
        )
        return flat.numpy()
    return np.concatenate([_as_np(k) for k in keys])


def extract_runs(
    keys: Sequence[torch.Tensor],
    *,
    slice_rows: Sequence[int] | None = None,
    slot_offsets: Sequence[int] | None = None,
) -> KeyRuns:
    """Runs of every group's keys (deterministic: a function of the keys and slice sizes only).

    Args:
        keys: per group, ``[R_g]`` int64 keys of its flat buffer (negative = padding).
        slice_rows: for destinations, per group the rows of one receiving rank's slice; runs break
            at slice boundaries and carry their global slot ``slot_offsets[g] + row // slice_rows[g]``.
        slot_offsets: per group, the global index of its first slot (with ``slice_rows``).

    Row-order step-1 runs (linear); a group whose mean run is shorter than :data:`MIN_MEAN_RUN`
    is re-cut by key order, which finds strided runs: by :func:`_strided_runs` (linear, no sort
    of the keys) when its keys run a probed constant step apart, else by sorting its keys. Both
    give the same runs in the same order (a group :func:`_strided_runs` serves skips the
    row-order pass: its chains prove that group short).
    """
    n_groups = len(keys)
    sizes = [int(k.numel()) for k in keys]
    off = [0]
    for s in sizes:
        off.append(off[-1] + s)
    dest = slice_rows is not None
    slices = list(slice_rows) if slice_rows is not None else [0] * n_groups
    slots0 = list(slot_offsets) if slot_offsets is not None else [0] * n_groups
    brk = []
    for g in range(n_groups):
        if sizes[g]:
            brk.append(off[g])
            if slices[g] > 0:
                brk.extend(range(off[g] + slices[g], off[g + 1], slices[g]))
    key_all = _concat(keys)
    off_a = np.asarray(off, dtype=np.int64)
    brk_a = np.asarray(brk, dtype=np.int64)
    # strided groups ([S, B, H]) first, without a row-order pass: a probed row step > 1 whose
    # chains are exactly the key-order runs and prove the group short (see _strided_runs)
    strided: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
    if key_all.size:
        step_g = _probe_steps(key_all, off_a)
        for g in np.flatnonzero(step_g > 1).tolist():
            runs = _strided_runs(key_all[off[g] : off[g + 1]], int(step_g[g]), slices[g])
            if runs is not None:
                strided[g] = runs
    # row-order runs of the other groups: one linear pass over each stretch of them
    if strided:
        starts, lengths = [], []
        g = 0
        while g < n_groups:
            h = g
            while h < n_groups and h not in strided:
                h += 1
            if h > g:
                a, b = off[g], off[h]
                st, ln = _row_order_runs(key_all[a:b], brk_a[(brk_a >= a) & (brk_a < b)] - a)
                starts.append(st + a)
                lengths.append(ln)
            g = h + 1
        e = [np.empty(0, dtype=np.int64)]
        start, length = np.concatenate(starts + e), np.concatenate(lengths + e)
    else:
        start, length = _row_order_runs(key_all, brk_a)
    # runs come in row order, so each group's runs are one slice of them
    bounds = np.searchsorted(start, off_a)
    runs_g = np.diff(bounds)
    cum = np.concatenate([[0], np.cumsum(length)])
    tok_g = cum[bounds[1:]] - cum[bounds[:-1]]
    # groups with short row-order runs are re-cut by key order (strided runs)
    short_g = runs_g * MIN_MEAN_RUN > tok_g
    short_g[list(strided)] = True
    if short_g.any():
        keep = np.repeat(~short_g, runs_g)
        start, length = start[keep], length[keep]
        runs_g = np.where(short_g, 0, runs_g)
    group = np.repeat(np.arange(n_groups, dtype=np.int64), runs_g)
    key = key_all[start]
    row = start - off_a[group]
    step = np.ones_like(start)
    if short_g.any():
        cols: list[list[np.ndarray]] = [[group], [key], [row], [step], [length]]
        for g in np.flatnonzero(short_g).tolist():
            if g in strided:
                k, r, st, ln = strided[g]
            else:
                k, r, st, ln = _sorted_runs(key_all[off[g] : off[g + 1]], slices[g])
            for c, v in zip(cols, (np.full_like(k, g), k, r, st, ln), strict=True):
                c.append(v)
        group, key, row, step, length = (np.concatenate(c) for c in cols)
    if dest and group.size:
        slice_a = np.maximum(np.asarray(slices, dtype=np.int64), 1)
        slot = np.asarray(slots0, dtype=np.int64)[group] + row // slice_a[group]
    else:
        slot = np.full_like(group, -1)
    t = torch.from_numpy
    return KeyRuns(
        group_K=t(group),
        key_K=t(key),
        row_K=t(row),
        step_K=t(step),
        length_K=t(length),
        slot_K=t(slot),
        num_tokens=int(length.sum()),
    )


def is_run_structured(*runs: KeyRuns) -> bool:
    """True if the runs average at least :data:`MIN_MEAN_RUN` keys (the run join pays off)."""
    n_runs = sum(r.num_runs for r in runs)
    n_tok = sum(r.num_tokens for r in runs)
    return n_runs * MIN_MEAN_RUN <= n_tok


@dataclass(frozen=True, kw_only=True, eq=False)
class RunPlan:
    """The plan's arrays, exactly as the per-token reference builds them.

    Attributes:
        transfers_T5: ``[T, 5]`` int64 ``(owner, src_rank, dst_rank, start, count)``, sorted.
        src_rows_M: ``[M]`` int64 source rows, by (source group, slot, destination row).
        dst_rows_M: ``[M]`` int64 destination rows, same order.
        owner_N: ``[sum N_g]`` int64 owner filling each destination row (groups concatenated), or -1.
        num_missing: destination rows with a key that no source holds.
    """

    transfers_T5: torch.Tensor
    src_rows_M: torch.Tensor
    dst_rows_M: torch.Tensor
    owner_N: torch.Tensor
    num_missing: int


def _expand(
    start_S: np.ndarray,
    step_S: np.ndarray,
    offset_S: np.ndarray,
    length_S: np.ndarray,
    iota_M: np.ndarray,
) -> np.ndarray:
    """``[M]`` rows ``start + i * step`` of each segment, segments one after another."""
    if bool((step_S == 1).all()):
        out = np.repeat(start_S - offset_S, length_S)
        out += iota_M
        return out
    out = np.repeat(step_S, length_S)
    out *= iota_M
    out += np.repeat(start_S - offset_S * step_S, length_S)
    return out


def plan_from_runs(
    src: KeyRuns,
    dst: KeyRuns,
    *,
    owner_G: torch.Tensor,
    rep_rank: torch.Tensor,
    rep_off_G: torch.Tensor,
    slot_rank: torch.Tensor,
    dst_sizes: Sequence[int],
    local_copy: bool,
    allow_missing: bool,
) -> RunPlan | None:
    """Join source runs with destination runs and build the plan's arrays.

    Args:
        src: source runs (``group`` = source group index).
        dst: destination runs (``group`` = destination index, ``slot`` = global slot).
        owner_G: ``[G]`` owner of each source group.
        rep_rank: replica global ranks of all source groups, concatenated.
        rep_off_G: ``[G + 1]`` offsets of each group's replicas in ``rep_rank``.
        slot_rank: ``[n_slots]`` receiving global rank of each slot.
        dst_sizes: rows of each destination buffer.

    Returns:
        The arrays, or ``None`` when the input is bad (a key held twice, or a needed key held by
        nobody without ``allow_missing``): the caller then runs the per-token path, which raises
        the error with its exact message.
    """
    n_slots = max(int(slot_rank.numel()), 1)
    n_rows_max = max(dst_sizes, default=0) + 1
    total_rows = sum(dst_sizes)
    rep_count = rep_off_G[1:] - rep_off_G[:-1]

    # --- the join: source runs sorted by first key must be disjoint -----------------------
    ks, o = torch.sort(src.key_K)
    s_len, s_grp, s_row, s_step = src.length_K[o], src.group_K[o], src.row_K[o], src.step_K[o]
    ke = ks + s_len
    if bool((ks[1:] < ke[:-1]).any()):
        return None  # a key held twice
    kd, d_len = dst.key_K, dst.length_K
    lo = torch.searchsorted(ke, kd, right=True)  # first source run ending past kd
    hi = torch.searchsorted(ks, kd + d_len)  # first source run starting at or past kd + len
    n_pc = (hi - lo).clamp(min=0)
    n_pieces = int(n_pc.sum())
    p = torch.repeat_interleave(torch.arange(kd.numel(), dtype=_I64), n_pc, output_size=n_pieces)
    s = lo[p] + torch.arange(n_pieces, dtype=_I64) - (torch.cumsum(n_pc, 0) - n_pc)[p]
    a = torch.maximum(kd[p], ks[s])
    length = torch.minimum(kd[p] + d_len[p], ke[s]) - a
    num_missing = dst.num_tokens - int(length.sum())
    if num_missing and not allow_missing:
        return None

    # --- segments, ordered by (source group, slot, destination row) = the token order --------
    seg_grp = s_grp[s]
    seg_slot = dst.slot_K[p]
    seg_srow = s_row[s] + (a - ks[s]) * s_step[s]
    seg_sstep = s_step[s]
    seg_drow = dst.row_K[p] + (a - kd[p]) * dst.step_K[p]
    seg_dstep = dst.step_K[p]
    seg_dgrp = dst.group_K[p]
    pair = seg_grp * n_slots + seg_slot
    o = torch.argsort(pair * n_rows_max + seg_drow)
    seg_grp, seg_slot, pair = seg_grp[o], seg_slot[o], pair[o]
    seg_srow, seg_sstep, seg_drow, seg_dstep = seg_srow[o], seg_sstep[o], seg_drow[o], seg_dstep[o]
    seg_dgrp, length = seg_dgrp[o], length[o]
    n_seg = int(length.numel())
    m = int(length.sum()) if n_seg else 0

    # --- blocks: (source group, slot) ------------------------------------------------------
    new_block = torch.ones(n_seg, dtype=torch.bool)
    if n_seg > 1:
        new_block[1:] = pair[1:] != pair[:-1]
    seg_block = torch.cumsum(new_block, 0) - 1
    first_seg = torch.nonzero(new_block).reshape(-1)
    n_blocks = int(first_seg.numel())
    b_count = torch.zeros(n_blocks, dtype=_I64).index_add_(0, seg_block, length)
    b_start = torch.cumsum(b_count, 0) - b_count
    b_grp, b_slot = seg_grp[first_seg], seg_slot[first_seg]

    # --- the per-token rows: a few linear passes (numpy: one thread, little overhead) -------
    n_ = _as_np
    seg_len = n_(length)
    seg_off = np.cumsum(seg_len) - seg_len
    iota = np.arange(m, dtype=np.int64)
    src_rows = _expand(n_(seg_srow), n_(seg_sstep), seg_off, seg_len, iota)
    dst_rows = _expand(n_(seg_drow), n_(seg_dstep), seg_off, seg_len, iota)

    # --- owner of every destination row ----------------------------------------------------
    dst_off = torch.tensor([0, *dst_sizes], dtype=_I64).cumsum(0)
    seg_owner = owner_G[seg_grp]
    if bool((seg_dstep == 1).all()):  # disjoint row ranges: mark the edges, then a prefix sum
        g_start = dst_off[seg_dgrp] + seg_drow
        delta = torch.zeros(total_rows + 1, dtype=_I64)
        delta.index_add_(0, g_start, seg_owner + 1)
        delta.index_add_(0, g_start + length, -(seg_owner + 1))
        owner_np = np.cumsum(delta.numpy()[:-1])
        owner_np -= 1
        owner_all = torch.from_numpy(owner_np)
    else:  # strided rows: write each token's owner at its global row (dst_rows: segment order)
        owner_all = torch.full((total_rows,), -1, dtype=_I64)
        g_rows = np.repeat(n_(dst_off[seg_dgrp]), seg_len)
        g_rows += dst_rows
        owners = torch.unique(seg_owner) if n_seg else seg_owner
        if owners.numel() == 1:  # one teacher: no per-token owner array
            owner_all.numpy()[g_rows] = int(owners[0])
        else:
            owner_all.numpy()[g_rows] = np.repeat(n_(seg_owner), seg_len)
        del g_rows

    # --- destination-row order inside each block -------------------------------------------
    # Within a block the tokens must be in increasing destination-row order. Each segment's
    # are (unless it runs backwards), and segments come sorted by block then first row, but
    # strided segments ([S, B, H] students: a sample's rows are B apart) can interleave with
    # the next ones of their block. Only the tokens of such clusters of overlapping segments
    # are re-sorted, in place: in the benchmark's [S, B, H] case ~20% of the tokens, and the
    # sort merges their already sorted segments.
    seg_drow_n, seg_dstep_n, seg_block_n = n_(seg_drow), n_(seg_dstep), n_(seg_block)
    seg_last = seg_drow_n + (seg_len - 1) * seg_dstep_n  # [S] last destination row
    forward = bool((seg_last >= seg_drow_n).all())
    if forward and n_seg > 1:
        # a segment starts a new cluster when its first row lies past every earlier row of its
        # block; block * n_rows_max + row orders (block, row) pairs, so one running maximum
        # over the whole table never reaches back into an earlier block
        reach = np.maximum.accumulate(seg_block_n * n_rows_max + seg_last)
        lone = np.ones(n_seg, dtype=bool)
        lone[1:] = seg_block_n[1:] * n_rows_max + seg_drow_n[1:] > reach[:-1]
        if not lone.all():
            cluster = np.cumsum(lone) - 1  # [S] cluster of each segment
            in_multi = np.bincount(cluster)[cluster] > 1
            m_len, m_off = seg_len[in_multi], seg_off[in_multi]
            # pos: [M'] the clustered tokens' places, increasing (clusters are contiguous)
            pos = np.repeat(m_off - (np.cumsum(m_len) - m_len), m_len)
            pos += np.arange(pos.size, dtype=np.int64)
            key = np.repeat(seg_block_n[in_multi], m_len)
            key *= n_rows_max
            key += dst_rows[pos]
            perm = pos[np.argsort(key, kind="stable")]  # timsort: merges sorted segments
            src_rows[pos] = src_rows[perm]
            dst_rows[pos] = dst_rows[perm]
    elif not forward:  # a segment runs backwards: sort every block's tokens
        blk = np.repeat(seg_block_n, seg_len)
        blk *= n_rows_max
        blk += dst_rows
        perm = np.argsort(blk, kind="stable")
        src_rows, dst_rows = src_rows[perm], dst_rows[perm]

    # --- replicas per block: k near-equal chunks rotated by block, or one local copy --------
    k_b = rep_count[b_grp]
    b_rank = slot_rank[b_slot] if n_blocks else torch.empty(0, dtype=_I64)
    local_rep = torch.full((n_blocks,), -1, dtype=_I64)
    if local_copy and n_blocks:
        for r_i in range(int(rep_count.max())):
            has = (r_i < k_b) & (local_rep < 0)
            at = torch.where(has, rep_off_G[b_grp] + r_i, torch.zeros_like(b_grp))
            local_rep[has & (rep_rank[at] == b_rank)] = r_i
    is_local = local_rep >= 0
    n_chunks = torch.where(is_local, torch.ones_like(k_b), k_b)
    n_ch = int(n_chunks.sum()) if n_blocks else 0
    c_block = torch.repeat_interleave(
        torch.arange(n_blocks, dtype=_I64), n_chunks, output_size=n_ch
    )
    c = torch.arange(n_ch, dtype=_I64) - (torch.cumsum(n_chunks, 0) - n_chunks)[c_block]
    k_c, cnt_c = k_b[c_block], b_count[c_block]
    loc_c = is_local[c_block]
    # chunk c holds block tokens i with i * k // count == c: [ceil(c count / k), ceil((c+1) count / k))
    c_lo = torch.where(loc_c, torch.zeros_like(c), (c * cnt_c + k_c - 1) // k_c)
    c_hi = torch.where(loc_c, cnt_c, ((c + 1) * cnt_c + k_c - 1) // k_c)
    rep = torch.where(loc_c, local_rep[c_block], (c + c_block % k_c) % k_c)
    nz = torch.nonzero(c_hi > c_lo).reshape(-1)
    c_block, rep, c_lo, c_hi = c_block[nz], rep[nz], c_lo[nz], c_hi[nz]
    t_grp = b_grp[c_block]
    t_src = rep_rank[rep_off_G[t_grp] + rep]
    t_dst = slot_rank[b_slot[c_block]] if n_blocks else torch.empty(0, dtype=_I64)
    t_owner = owner_G[t_grp]
    t_start = b_start[c_block] + c_lo
    t_count = c_hi - c_lo
    w = (
        int(
            max(
                int(rep_rank.max()) if rep_rank.numel() else 0,
                int(slot_rank.max()) if slot_rank.numel() else 0,
            )
        )
        + 1
    )
    t_order = torch.argsort((t_owner * w + t_src) * w + t_dst, stable=True)
    transfers = torch.stack([t_owner, t_src, t_dst, t_start, t_count], dim=1)[t_order]
    return RunPlan(
        transfers_T5=transfers.contiguous(),
        src_rows_M=torch.from_numpy(np.ascontiguousarray(src_rows)),
        dst_rows_M=torch.from_numpy(np.ascontiguousarray(dst_rows)),
        owner_N=owner_all,
        num_missing=num_missing,
    )


# --- the planner (was bridge/planner.py) ------------------------------------------------------

#: How :func:`plan_transfers` joins keys: ``"runs"``, ``"tokens"`` (the reference) or ``"auto"``.
PlanMethod = Literal["auto", "runs", "tokens"]


@dataclass(frozen=True, kw_only=True, eq=False)
class SourceGroup:
    """Replicas holding identical rows.

    Attributes:
        owner: which output buffer the rows belong to (teacher index).
        ranks: global ranks of the replicas (each holds the full ``key_R`` buffer).
        key_R: ``[R]`` int64 key of each row of the replicas' flat buffer; ``-1`` for padding.
        label: for error messages.
    """

    owner: int
    ranks: tuple[int, ...]
    key_R: torch.Tensor
    label: str = ""


@dataclass(frozen=True, kw_only=True, eq=False)
class DestGroup:
    """Ranks sharing one crossing: the buffer's ``N`` rows split into ``len(ranks)`` slices.

    Attributes:
        ranks: global ranks; ``ranks[j]`` receives rows ``[j * N / n, (j + 1) * N / n)``.
        key_R: ``[N]`` int64 key wanted in each row; ``-1`` for padding (zero-filled).
        label: for error messages.
    """

    ranks: tuple[int, ...]
    key_R: torch.Tensor
    label: str = ""


@dataclass(frozen=True, kw_only=True, eq=False)
class DestPlan:
    """What a destination group gets: ``owner_N[r]`` is the owner filling row ``r`` or ``-1``."""

    ranks: tuple[int, ...]
    num_rows: int
    owner_N: torch.Tensor
    label: str = ""

    @property
    def slice_rows(self) -> int:
        """Rows each rank of the group receives."""
        return self.num_rows // len(self.ranks)


@dataclass(frozen=True, kw_only=True, eq=False)
class TransferPlan:
    """A deterministic set of row transfers (CSR), identical on every rank that builds it.

    Attributes:
        num_owners: number of output buffers (teachers).
        row_bytes: bytes per row for each owner (``hidden_size * itemsize``; 0 if unknown).
        transfers_T5: ``[T, 5]`` int64 ``(owner, src_rank, dst_rank, start, count)``, sorted.
        src_rows_M: ``[M]`` int64 rows of the source replica's flat buffer.
        dst_rows_M: ``[M]`` int64 rows of the destination group's full flat buffer.
        dests: one :class:`DestPlan` per destination group.
        num_missing: destination rows with no source (zero-filled; only with ``allow_missing``).
        signature: a content hash of the inputs (of the keys as runs, which encode them exactly).
        replica_groups: the ranks of each source group (for balance figures).
        local_copy: if False, a transfer whose source and destination rank coincide still goes
            through the process group (a send/recv to self), e.g. to exercise NCCL at world size 1.
    """

    num_owners: int
    row_bytes: tuple[int, ...]
    transfers_T5: torch.Tensor
    src_rows_M: torch.Tensor
    dst_rows_M: torch.Tensor
    dests: tuple[DestPlan, ...]
    num_missing: int
    signature: str
    replica_groups: tuple[tuple[int, ...], ...] = ()
    local_copy: bool = True
    _by_rank: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def num_transfers(self) -> int:
        return int(self.transfers_T5.shape[0])

    def transfer_ids(self, rank: int) -> torch.Tensor:
        """Indices of the transfers where ``rank`` sends or receives (cached)."""
        ids = self._by_rank.get(rank)
        if ids is None:
            t = self.transfers_T5
            ids = torch.nonzero((t[:, 1] == rank) | (t[:, 2] == rank)).reshape(-1)
            self._by_rank[rank] = ids
        return ids

    def rows_of(self, transfer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(src_rows, dst_rows)`` of one transfer (views)."""
        start, count = (int(x) for x in self.transfers_T5[transfer_id, 3:5])
        return self.src_rows_M[start : start + count], self.dst_rows_M[start : start + count]

    def ranks(self) -> list[int]:
        """All global ranks that appear in the plan (as source, destination or group member)."""
        out = set(self.transfers_T5[:, 1].tolist()) | set(self.transfers_T5[:, 2].tolist())
        for d in self.dests:
            out |= set(d.ranks)
        return sorted(out)

    def transfer_matrix(self, world_size: int | None = None) -> torch.Tensor:
        """``[W, W]`` int64 bytes from source global rank (row) to destination (column).

        The diagonal holds local copies. Needs ``row_bytes`` (pass sizes when planning).
        """
        t = self.transfers_T5
        w = world_size if world_size is not None else (int(t[:, 1:3].max()) + 1 if t.numel() else 0)
        m = torch.zeros(w * w, dtype=_I64)
        if t.numel():
            rb = torch.tensor(self.row_bytes, dtype=_I64)[t[:, 0]]
            m.index_add_(0, t[:, 1] * w + t[:, 2], t[:, 4] * rb)
        return m.view(w, w)

    def summary(self) -> dict[str, int | float]:
        """Totals for printing: bytes across ranks, local bytes, messages, send imbalance."""
        t = self.transfers_T5
        rb = (
            torch.tensor(self.row_bytes, dtype=_I64)[t[:, 0]]
            if t.numel()
            else torch.zeros(0, dtype=_I64)
        )
        nbytes = t[:, 4] * rb if t.numel() else torch.zeros(0, dtype=_I64)
        cross = (
            (t[:, 1] != t[:, 2]) | (not self.local_copy)
            if t.numel()
            else torch.zeros(0, dtype=torch.bool)
        )
        send = {}
        for s, b in zip(t[cross, 1].tolist(), nbytes[cross].tolist(), strict=True):
            send[s] = send.get(s, 0) + b
        vols = list(send.values())
        rep = 0.0
        for ranks in self.replica_groups:
            v = [send.get(r, 0) for r in ranks]
            if len(v) > 1 and sum(v):
                rep = max(rep, max(v) / (sum(v) / len(v)) - 1.0)
        return {
            "transfers": self.num_transfers,
            "messages": int(cross.sum()),
            "local_copies": int((~cross).sum()),
            "rows_cross": int(t[cross, 4].sum()) if t.numel() else 0,
            "rows_local": int(t[~cross, 4].sum()) if t.numel() else 0,
            "bytes_cross": int(nbytes[cross].sum()) if t.numel() else 0,
            "bytes_local": int(nbytes[~cross].sum()) if t.numel() else 0,
            "max_send_bytes": max(vols) if vols else 0,
            "send_imbalance": (
                (max(vols) / (sum(vols) / len(vols)) - 1.0) if vols and sum(vols) else 0.0
            ),
            "replica_imbalance": rep,
            "missing_rows": self.num_missing,
        }


def _signature(parts: Sequence[object]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        if isinstance(p, torch.Tensor):
            h.update(p.contiguous().numpy().tobytes())
        else:
            h.update(repr(p).encode())
        h.update(b"|")
    return h.hexdigest()


def _check_groups(
    sources: Sequence[SourceGroup], dests: Sequence[DestGroup], num_owners: int
) -> None:
    for s in sources:
        if not s.ranks or not 0 <= s.owner < num_owners:
            raise ValueError(
                f"source group {s.label!r}: needs ranks and an owner in [0, {num_owners})"
            )
    for d in dests:
        if not d.ranks:
            raise ValueError(f"destination group {d.label!r} has no ranks")
        if d.key_R.numel() % len(d.ranks):
            raise ValueError(
                f"destination {d.label!r}: {d.key_R.numel()} rows do not split into "
                f"{len(d.ranks)} equal slices (one per rank of its TP group)"
            )


def plan_transfers(
    sources: Sequence[SourceGroup],
    dests: Sequence[DestGroup],
    *,
    num_owners: int | None = None,
    row_bytes: Sequence[int] | None = None,
    local_copy: bool = True,
    allow_missing: bool = False,
    describe_key: Callable[[int], str] = str,
    method: PlanMethod = "auto",
) -> TransferPlan:
    """Join source and destination keys into a :class:`TransferPlan` (pure, deterministic).

    Args:
        method: ``"runs"`` joins runs of keys (:mod:`mopd.bridge.planner_runs`; milliseconds for
            1M tokens), ``"tokens"`` joins every key (the per-token reference), ``"auto"`` takes
            runs unless the keys average fewer than ``MIN_MEAN_RUN`` per run (not run-structured,
            e.g. arbitrary per-row keys), then tokens (logged once). All give identical plans,
            signature included; errors always come from the per-token path (same messages).

    Raises:
        ValueError: a key held by two source rows (two owners, or twice in one group), a
            destination key held by no source (unless ``allow_missing``), or a destination buffer
            whose rows do not split evenly over its ranks.
    """
    if method not in ("auto", "runs", "tokens"):
        raise ValueError(f"method must be 'auto', 'runs' or 'tokens', got {method!r}")
    num_owners = (
        num_owners if num_owners is not None else (max((s.owner for s in sources), default=-1) + 1)
    )
    row_bytes = tuple(row_bytes) if row_bytes is not None else (0,) * num_owners
    if len(row_bytes) != num_owners:
        raise ValueError(f"row_bytes has {len(row_bytes)} entries for {num_owners} owners")
    _check_groups(sources, dests, num_owners)

    # runs of both sides: the join's input and, being an exact encoding of the keys, the
    # signature's (hashing runs instead of every key keeps the signature at microseconds)
    sizes = [int(d.key_R.numel()) for d in dests]
    slot_counts = [len(d.ranks) for d in dests]
    slot_off = [0]
    for n in slot_counts:
        slot_off.append(slot_off[-1] + n)
    src_runs = extract_runs([s.key_R.reshape(-1) for s in sources])
    dst_runs = extract_runs(
        [d.key_R.reshape(-1) for d in dests],
        slice_rows=[n // k for n, k in zip(sizes, slot_counts, strict=True)],
        slot_offsets=slot_off[:-1],
    )
    sig = _signature(
        [num_owners, row_bytes, local_copy, allow_missing]
        + [(s.owner, s.ranks, int(s.key_R.numel())) for s in sources]
        + [(d.ranks, n) for d, n in zip(dests, sizes, strict=True)]
        + [src_runs.table(), dst_runs.table()]
    )
    common = {
        "num_owners": num_owners,
        "row_bytes": row_bytes,
        "local_copy": local_copy,
        "signature": sig,
    }
    use_runs = method == "runs" or (
        method == "auto" and bool(sources) and is_run_structured(src_runs, dst_runs)
    )
    if method == "auto" and not use_runs and src_runs.num_tokens and not _logged_fallback:
        _logged_fallback.add(True)
        _log.info(
            "planner: keys are not run-structured (%d runs for %d keys); planning per token",
            src_runs.num_runs + dst_runs.num_runs,
            src_runs.num_tokens + dst_runs.num_tokens,
        )
    if use_runs and sources:
        rep_count = [len(s.ranks) for s in sources]
        rp = plan_from_runs(
            src_runs,
            dst_runs,
            owner_G=torch.tensor([s.owner for s in sources], dtype=_I64),
            rep_rank=torch.tensor([r for s in sources for r in s.ranks], dtype=_I64),
            rep_off_G=torch.tensor([0, *rep_count], dtype=_I64).cumsum(0),
            slot_rank=torch.tensor([r for d in dests for r in d.ranks], dtype=_I64),
            dst_sizes=sizes,
            local_copy=local_copy,
            allow_missing=allow_missing,
        )
        if rp is not None:
            return _assemble(
                sources,
                dests,
                sizes,
                transfers_T5=rp.transfers_T5,
                src_rows_M=rp.src_rows_M,
                dst_rows_M=rp.dst_rows_M,
                owner_all=rp.owner_N,
                num_missing=rp.num_missing,
                **common,
            )
        # bad input: the per-token path below raises the error with its exact message
    return _plan_per_token(
        sources, dests, allow_missing=allow_missing, describe_key=describe_key, **common
    )


def _assemble(
    sources: Sequence[SourceGroup],
    dests: Sequence[DestGroup],
    sizes: Sequence[int],
    *,
    num_owners: int,
    row_bytes: tuple[int, ...],
    local_copy: bool,
    signature: str,
    transfers_T5: torch.Tensor,
    src_rows_M: torch.Tensor,
    dst_rows_M: torch.Tensor,
    owner_all: torch.Tensor,
    num_missing: int,
) -> TransferPlan:
    """The :class:`TransferPlan` of both paths' arrays (``owner_all``: destinations concatenated)."""
    dest_plans = []
    at = 0
    for d, n in zip(dests, sizes, strict=True):
        dest_plans.append(
            DestPlan(ranks=d.ranks, num_rows=n, owner_N=owner_all[at : at + n], label=d.label)
        )
        at += n
    return TransferPlan(
        num_owners=num_owners,
        row_bytes=row_bytes,
        transfers_T5=transfers_T5.contiguous(),
        src_rows_M=src_rows_M.contiguous(),
        dst_rows_M=dst_rows_M.contiguous(),
        dests=tuple(dest_plans),
        num_missing=num_missing,
        signature=signature,
        replica_groups=tuple(s.ranks for s in sources),
        local_copy=local_copy,
    )


def _plan_per_token(
    sources: Sequence[SourceGroup],
    dests: Sequence[DestGroup],
    *,
    num_owners: int,
    row_bytes: tuple[int, ...],
    local_copy: bool,
    allow_missing: bool,
    describe_key: Callable[[int], str],
    signature: str,
) -> TransferPlan:
    """The per-token reference: one sort of every source and destination key joins them.

    ``O(tokens log tokens)``; kept as the reference the run join is checked against (and as the
    path for keys that are not run-structured, and for error messages). Expects validated input.
    """
    # --- sources: [key, group, row] of every held row -----------------------------------------
    empty = torch.empty((0, 3), dtype=_I64)
    src_KGR = (
        torch.cat(
            [
                torch.stack(
                    [
                        s.key_R,
                        torch.full_like(s.key_R, i),
                        torch.arange(s.key_R.numel(), dtype=_I64),
                    ],
                    dim=1,
                )
                for i, s in enumerate(sources)
            ]
        )
        if sources
        else empty
    )
    src_KGR = src_KGR[src_KGR[:, 0] >= 0]
    n_src = src_KGR.shape[0]

    # --- destinations: [key, group, row, slot]; slot = (group, slice) -> receiving rank --------
    slot_rank = torch.tensor([r for d in dests for r in d.ranks], dtype=_I64)
    slot_off = torch.tensor([0] + [len(d.ranks) for d in dests], dtype=_I64).cumsum(0)
    n_slots = int(slot_rank.numel())
    sizes = [d.key_R.numel() for d in dests]
    parts = []
    for i, d in enumerate(dests):
        row = torch.arange(d.key_R.numel(), dtype=_I64)
        slot_i = int(slot_off[i]) + row // max(1, d.key_R.numel() // len(d.ranks))
        parts.append(torch.stack([d.key_R, torch.full_like(row, i), row, slot_i], dim=1))
    dst_KGRS = torch.cat(parts) if parts else torch.empty((0, 4), dtype=_I64)
    dst_KGRS = dst_KGRS[dst_KGRS[:, 0] >= 0]

    # --- the join: one sort of source and destination keys together -------------------------
    # (key * 2 + tag, tag 0 = source): a destination's source is the last source at or before it
    # in sorted order, if it has the same key. Sequential, cache-friendly; no binary searches.
    merged = torch.cat([src_KGR[:, 0] * 2, dst_KGRS[:, 0] * 2 + 1])
    m_sorted, order = torch.sort(merged, stable=True)
    is_src = order < n_src
    src_pos = torch.nonzero(is_src).reshape(-1)
    k_sorted = m_sorted[src_pos] // 2
    dup = torch.nonzero(k_sorted[1:] == k_sorted[:-1]).reshape(-1)
    if dup.numel():
        i = int(dup[0])
        a, b = (int(src_KGR[order[src_pos[x]], 1]) for x in (i, i + 1))
        raise ValueError(
            f"token {describe_key(int(k_sorted[i]))} is held twice: by {sources[a].label or a} "
            f"(ranks {list(sources[a].ranks)}) and by {sources[b].label or b} "
            f"(ranks {list(sources[b].ranks)}); {dup.numel()} duplicated keys in all"
        )
    idx = torch.arange(order.numel(), dtype=_I64)
    last_src = torch.cummax(torch.where(is_src, idx, torch.full_like(idx, -1)), 0).values
    dst_sel = torch.nonzero(~is_src).reshape(-1)
    j = last_src[dst_sel]
    dst = dst_KGRS[order[dst_sel] - n_src]
    found = j >= 0
    found[found.clone()] = m_sorted[j[found]] // 2 == dst[found, 0]
    num_missing = int((~found).sum())
    if num_missing and not allow_missing:
        i = int(torch.nonzero(~found)[0])
        g, r = int(dst[i, 1]), int(dst[i, 2])
        raise ValueError(
            f"token {describe_key(int(dst[i, 0]))} is needed by {dests[g].label or g} "
            f"(ranks {list(dests[g].ranks)}, row {r}) but no teacher holds it; "
            f"{num_missing} needed tokens are missing in all"
        )
    keep = torch.nonzero(found).reshape(-1)
    src_GR = src_KGR[order[j[keep]], 1:]
    dst = dst[keep]
    # one row per moved token: [group, src_row, dst_group, dst_row, slot]
    rows = torch.cat([src_GR, dst[:, 1:]], dim=1)

    # owner of every destination row
    owners_src = torch.tensor([s.owner for s in sources], dtype=_I64)
    dst_off = torch.tensor([0, *sizes], dtype=_I64).cumsum(0)
    owner_all = torch.full((int(dst_off[-1]),), -1, dtype=_I64)
    owner_all[dst_off[rows[:, 2]] + rows[:, 3]] = owners_src[rows[:, 0]]

    # --- blocks: (source group, destination slot), rows by destination row; replica choice -----
    n_rows_max = max(sizes, default=0) + 1
    pair = rows[:, 0] * max(n_slots, 1) + rows[:, 4]
    _, o = torch.sort(pair * n_rows_max + rows[:, 3])  # unique keys: deterministic
    rows, pair = rows[o], pair[o]
    grp, src_row, dst_row, slot = rows[:, 0], rows[:, 1], rows[:, 3], rows[:, 4]
    _, counts = torch.unique_consecutive(pair, return_counts=True)
    n_blocks = counts.numel()
    block = torch.repeat_interleave(torch.arange(n_blocks, dtype=_I64), counts)
    block_start = torch.cumsum(counts, 0) - counts
    i_in = torch.arange(pair.numel(), dtype=_I64) - block_start[block]
    rep_count = torch.tensor([len(s.ranks) for s in sources], dtype=_I64)
    rep_off = torch.cat([torch.zeros(1, dtype=_I64), rep_count.cumsum(0)])
    rep_rank = torch.tensor([r for s in sources for r in s.ranks], dtype=_I64)
    b_grp = grp[block_start]
    k_b = rep_count[b_grp]
    # k near-equal contiguous chunks per block, one per replica, rotated per block
    rep = (i_in * k_b[block] // counts[block] + block % k_b[block]) % k_b[block]
    if local_copy and n_blocks:
        # a replica on the destination rank serves the whole block locally
        b_rank = slot_rank[slot[block_start]]
        local_rep = torch.full((n_blocks,), -1, dtype=_I64)
        for r_i in range(int(rep_count.max())):
            has = (r_i < k_b) & (local_rep < 0)
            at = torch.where(has, rep_off[b_grp] + r_i, torch.zeros_like(b_grp))
            local_rep[has & (rep_rank[at] == b_rank)] = r_i
        lr = local_rep[block]
        rep = torch.where(lr >= 0, lr, rep)

    # --- transfers: the (block, replica) runs, ordered by (owner, src_rank, dst_rank) ----------
    # each run's rows stay where they are (already in destination-row order); with tokens a rank
    # is a replica of one source group per owner, so each (owner, src, dst) is one run; if a
    # caller's groups share a rank, equal triples keep their run order (stable sort) on every rank
    _, t_counts = torch.unique_consecutive(
        block * (int(rep_count.max()) + 1) + rep, return_counts=True
    )
    t_starts = torch.cumsum(t_counts, 0) - t_counts
    t_grp = grp[t_starts]
    t_src = rep_rank[rep_off[t_grp] + rep[t_starts]]
    t_dst = slot_rank[slot[t_starts]]
    t_owner = owners_src[t_grp]
    w = (
        int(
            max(
                int(rep_rank.max()) if rep_rank.numel() else 0,
                int(slot_rank.max()) if n_slots else 0,
            )
        )
        + 1
    )
    t_order = torch.argsort((t_owner * w + t_src) * w + t_dst, stable=True)
    transfers = torch.stack([t_owner, t_src, t_dst, t_starts, t_counts], dim=1)[t_order]
    return _assemble(
        sources,
        dests,
        sizes,
        num_owners=num_owners,
        row_bytes=row_bytes,
        local_copy=local_copy,
        signature=signature,
        transfers_T5=transfers,
        src_rows_M=src_row,
        dst_rows_M=dst_row,
        owner_all=owner_all,
        num_missing=num_missing,
    )


# --- tokens: teachers' and student's batches -> groups ---------------------------------------


@dataclass(frozen=True, kw_only=True, eq=False)
class TeacherBatch:
    """One teacher's side of a step, as the planner needs it.

    Attributes:
        mesh: the teacher's mesh; sources are its last-stage TP groups.
        layouts: ``(dp_rank, cp_rank) -> TokenLayout`` of the captured buffer every TP rank of
            that shard holds (SP undone, CP not undone).
        hidden_size: ``H`` of this teacher.
        itemsize: bytes per element (2 for bf16).
    """

    mesh: Mesh
    layouts: Mapping[tuple[int, int], TokenLayout]
    hidden_size: int
    itemsize: int = 2

    def __post_init__(self) -> None:
        _check_shards(self.mesh, self.layouts)
        if self.hidden_size < 1 or self.itemsize < 1:
            raise ValueError(
                f"{self.mesh}: hidden_size {self.hidden_size} and itemsize {self.itemsize} must be positive"
            )


@dataclass(frozen=True, kw_only=True, eq=False)
class StudentBatch:
    """The student's side: ``(dp_rank, cp_rank) -> TokenLayout`` of the buffer it wants filled."""

    mesh: Mesh
    layouts: Mapping[tuple[int, int], TokenLayout]

    def __post_init__(self) -> None:
        _check_shards(self.mesh, self.layouts)


def _check_shards(mesh: Mesh, layouts: Mapping[tuple[int, int], TokenLayout]) -> None:
    want = set(mesh.shards())
    got = set(layouts)
    if want != got:
        raise ValueError(
            f"{mesh}: layouts must cover exactly the (dp, cp) shards {sorted(want)}, got {sorted(got)}"
        )


def key_stride(layouts: Sequence[TokenLayout]) -> int:
    """``1 + max position`` over all layouts: the ``L`` of ``key = sample_id * L + position``."""
    m = 0
    for x in layouts:
        if x.position_R.numel():
            m = max(m, int(x.position_R.max()))
    return m + 1


def _keys_of(layouts: Sequence[TokenLayout], stride: int) -> list[torch.Tensor]:
    """Per layout, ``[R]`` int64 keys as :func:`encode_keys` (``-1`` = padding), as adjacent views
    of one buffer (so the run join reads them without a copy). Three passes, no temporaries."""
    buf = torch.empty(sum(x.num_rows for x in layouts), dtype=_I64)
    out = []
    at = 0
    for x in layouts:
        v = buf[at : at + x.num_rows]
        torch.mul(x.sample_id_R, stride, out=v)
        v.add_(x.position_R)
        v.clamp_(min=-1)  # padding: -stride - 1 -> -1
        out.append(v)
        at += x.num_rows
    return out


def plan_token_exchange(
    teachers: Sequence[TeacherBatch],
    student: StudentBatch,
    *,
    local_copy: bool = True,
    method: PlanMethod = "auto",
) -> TransferPlan:
    """Plan moving every token the student's layouts want from the teacher that holds it.

    Pure: needs meshes and layouts only (no process group). Owner ``i`` is ``teachers[i]``.
    ``method`` as in :func:`plan_transfers` (``"tokens"``: the per-token reference).
    """
    all_layouts = [x for t in teachers for x in t.layouts.values()] + list(student.layouts.values())
    stride = key_stride(all_layouts)
    max_sample = max(
        (int(x.sample_id_R.max()) for x in all_layouts if x.sample_id_R.numel()), default=0
    )
    if max_sample >= (2**62) // stride:
        raise ValueError(
            f"sample ids up to {max_sample} with positions up to {stride} overflow int64 keys"
        )
    src_shards = [(i, d, c) for i, t in enumerate(teachers) for d, c in t.mesh.shards()]
    src_keys = _keys_of([teachers[i].layouts[(d, c)] for i, d, c in src_shards], stride)
    sources = [
        SourceGroup(
            owner=i,
            ranks=teachers[i].mesh.tp_group_ranks(dp_rank=d, cp_rank=c),
            key_R=k,
            label=f"teacher {i} (dp={d}, cp={c})",
        )
        for (i, d, c), k in zip(src_shards, src_keys, strict=True)
    ]
    dst_shards = student.mesh.shards()
    dst_keys = _keys_of([student.layouts[x] for x in dst_shards], stride)
    dests = [
        DestGroup(
            ranks=student.mesh.tp_group_ranks(dp_rank=d, cp_rank=c),
            key_R=k,
            label=f"student (dp={d}, cp={c})",
        )
        for (d, c), k in zip(dst_shards, dst_keys, strict=True)
    ]

    def describe(key: int) -> str:
        return f"(sample_id={key // stride}, position={key % stride})"

    return plan_transfers(
        sources,
        dests,
        num_owners=len(teachers),
        row_bytes=[t.hidden_size * t.itemsize for t in teachers],
        local_copy=local_copy,
        describe_key=describe,
        method=method,
    )
