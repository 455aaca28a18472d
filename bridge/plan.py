"""The transfer planner: each rank plans only its own sends and receives, from runs of keys.

Why this file exists: deciding who sends which row to whom is pure integer work that both ends
of every transfer must derive identically, without a process group (the ``mopd plan`` inspector
and the unit tests call it directly), and at a cost that follows the rank's own work, not the
job's: one rank of a 16k-rank job must not plan the other 16k ranks' transfers.

Model (all tokens are keys ``(sample_id, position)``; rows are rows of a flat ``[R, H]`` buffer):

- a :class:`SourceGroup` is a set of replicas (global ranks) holding identical buffers: a
  teacher's last-stage TP group for one ``(dp, cp)`` shard, or, for the LM head, the teacher
  ranks holding one vocab shard; its rows are described by runs (:data:`RUN_COLUMNS`);
- a :class:`DestGroup` is a set of global ranks sharing one crossing: its ``N`` rows are split
  into near-equal contiguous slices (:meth:`DestGroup.slice_bounds`), ``ranks[j]`` receives
  slice ``j`` and the group then all-gathers (a student TP group for one ``(dp, cp)`` shard), or
  a single rank;
- every destination row's key is held by exactly one source group (else a verdict of
  :func:`check_rank`), so each needed token crosses into its destination group once;
- the tokens one source group ``g`` sends to one destination slot ``s`` (global slot index:
  slots of all destination groups, in order) form a *block*, in increasing destination-row
  order. A block of ``n`` tokens is cut into ``k = len(g.ranks)`` near-equal contiguous chunks,
  chunk ``c`` holding tokens ``[ceil(c n / k), ceil((c + 1) n / k))``, served by replica
  ``g.ranks[(c + g + s) % k]`` (the rotation spreads the remainders over the replicas). If a
  replica of ``g`` is the slot's own rank and ``local_copy`` is on, it serves the whole block as
  a local copy instead.

A rank's share of that, :class:`RankPlan`, is in *run form*: every transfer is a table of
segments ``(src_row, src_step, dst_row, dst_step, length)``, in destination-row order, that both
ends derive the same way. Destination rows are relative to the receiving rank's slice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "RUN_COLUMNS",
    "SEGMENT_COLUMNS",
    "DestGroup",
    "DestSlot",
    "RankPlan",
    "RunCatalog",
    "SourceGroup",
    "Transfer",
    "check_rank",
    "plan_rank",
]

#: Columns of a ``[K, 5]`` int64 run table: rows ``row + i * step`` hold positions
#: ``position + i`` of sample ``sample`` (``i < length``; ``step`` is 1 for runs of length 1).
RUN_COLUMNS = ("sample", "position", "row", "step", "length")
#: Columns of a ``[S, 5]`` int64 segment table: token ``i < length`` of a segment moves from
#: source row ``src_row + i * src_step`` to destination row ``dst_row + i * dst_step``.
SEGMENT_COLUMNS = ("src_row", "src_step", "dst_row", "dst_step", "length")

_I64 = np.int64


@dataclass(frozen=True, kw_only=True)
class SourceGroup:
    """Replicas holding identical rows.

    Attributes:
        owner: which output buffer the rows belong to (teacher index).
        ranks: global ranks of the replicas (each holds the whole buffer).
        num_rows: rows of the replicas' flat buffer.
        label: for messages (``"teacher 0 (dp=1, cp=0)"``).
    """

    owner: int
    ranks: tuple[int, ...]
    num_rows: int
    label: str = ""


@dataclass(frozen=True, kw_only=True)
class DestGroup:
    """Ranks sharing one crossing: ``num_rows`` rows cut into ``len(ranks)`` slices.

    Attributes:
        ranks: global ranks; ``ranks[j]`` receives slice ``j`` (:meth:`slice_bounds`).
        num_rows: rows of the group's full flat buffer.
        label: for messages.
    """

    ranks: tuple[int, ...]
    num_rows: int
    label: str = ""

    @property
    def slice_rows(self) -> int:
        """Rows of every slice but maybe the last: ``ceil(num_rows / len(ranks))``."""
        return -(-self.num_rows // len(self.ranks))

    def slice_bounds(self, j: int) -> tuple[int, int]:
        """``[start, stop)`` rows of slice ``j`` (the last ones may be short or empty)."""
        n = self.slice_rows
        return min(j * n, self.num_rows), min((j + 1) * n, self.num_rows)


@dataclass(frozen=True, kw_only=True, eq=False)
class RunCatalog:
    """What every rank contributed for one exchange, looked up lazily.

    Attributes:
        sources, dests: every group of the exchange, in plan order (the same on every rank).
        source_runs: ``g -> [K, 5]`` int64 runs of source group ``g`` (:data:`RUN_COLUMNS`).
        dest_runs: ``d -> [K, 5]`` int64 runs of destination group ``d``.
        source_range_G2, dest_range_D2: ``[G, 2]`` / ``[D, 2]`` int64 smallest and largest
            sample id of each group's runs (``(1, 0)`` for a group without tokens): where a
            group's tokens can be found without decoding its runs.
    """

    sources: tuple[SourceGroup, ...]
    dests: tuple[DestGroup, ...]
    source_runs: Callable[[int], np.ndarray]
    dest_runs: Callable[[int], np.ndarray]
    source_range_G2: np.ndarray
    dest_range_D2: np.ndarray

    def slot_offsets(self) -> np.ndarray:
        """``[D + 1]`` int64: destination group ``d``'s slots are ``offsets[d] .. offsets[d + 1]``."""
        return np.concatenate([[0], np.cumsum([len(d.ranks) for d in self.dests])]).astype(_I64)


@dataclass(frozen=True, kw_only=True, eq=False)
class Transfer:
    """One message (or local copy) of one owner between two ranks.

    Attributes:
        owner: teacher index.
        src_rank, dst_rank: global ranks (equal for a local copy).
        segments_S5: ``[S, 5]`` int64 (:data:`SEGMENT_COLUMNS`), in destination-row order;
            source rows are rows of the source buffer, destination rows are relative to the
            receiving rank's slice.
    """

    owner: int
    src_rank: int
    dst_rank: int
    segments_S5: np.ndarray

    @property
    def count(self) -> int:
        """Tokens moved."""
        return int(self.segments_S5[:, 4].sum())


@dataclass(frozen=True, kw_only=True)
class DestSlot:
    """Where a receiving rank's slice sits.

    Attributes:
        group: index into :attr:`RunCatalog.dests`.
        slot: this rank's slice index in the group.
        row_offset: first row of the slice in the group's full buffer.
        slice_rows: rows of the slice (may be fewer than the group's ``slice_rows`` at the end).
        num_rows: rows of the group's full buffer.
        padded_rows: ``len(ranks) * DestGroup.slice_rows``: the rows a buffer needs for an
            all-gather of equal slices.
    """

    group: int
    slot: int
    row_offset: int
    slice_rows: int
    num_rows: int
    padded_rows: int


@dataclass(frozen=True, kw_only=True, eq=False)
class RankPlan:
    """One global rank's share of an exchange.

    Attributes:
        rank: the global rank.
        sends: transfers this rank sends, sorted by ``(owner, dst_rank)``.
        recvs: transfers this rank receives, sorted by ``(owner, src_rank)``.
        locals: local copies (source replica on this rank), sorted by owner.
        dest: this rank's slice, or ``None`` when it receives nothing.
        owner_N: ``[N]`` int64 (``dest.num_rows``), which owner fills each row of the whole
            destination group's buffer (``-1``: padding or missing); ``None`` without ``dest``.
    """

    rank: int
    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]
    locals: tuple[Transfer, ...]
    dest: DestSlot | None
    owner_N: np.ndarray | None


# --- keys ------------------------------------------------------------------------------------


def _expand_runs(runs_K5: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(sample_M, position_M, row_M)`` of every token of ``runs_K5``, run by run."""
    length = runs_K5[:, 4]
    m = int(length.sum())
    run = np.repeat(np.arange(runs_K5.shape[0], dtype=_I64), length)
    i = np.arange(m, dtype=_I64) - np.repeat(np.cumsum(length) - length, length)
    return runs_K5[run, 0], runs_K5[run, 1] + i, runs_K5[run, 2] + i * runs_K5[run, 3]


def _overlapping(range_X2: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Indices of groups whose sample range meets ``[lo, hi]``."""
    return np.flatnonzero((range_X2[:, 0] <= hi) & (range_X2[:, 1] >= lo))


def _segments(src_M: np.ndarray, dst_M: np.ndarray) -> np.ndarray:
    """``[S, 5]`` segments of token rows ``src_M -> dst_M`` (both ``[M]``, in order).

    Greedy, left to right: a segment extends while both rows advance by the segment's steps.
    """
    m = src_M.size
    if m == 0:
        return np.empty((0, 5), dtype=_I64)
    out = []
    i = 0
    while i < m:
        j = i + 1
        if j < m:
            ds, dd = src_M[j] - src_M[i], dst_M[j] - dst_M[i]
            while j < m and src_M[j] - src_M[j - 1] == ds and dst_M[j] - dst_M[j - 1] == dd:
                j += 1
        else:
            ds = dd = 1
        n = j - i
        out.append((src_M[i], ds if n > 1 else 1, dst_M[i], dd if n > 1 else 1, n))
        i = j
    return np.asarray(out, dtype=_I64).reshape(-1, 5)


@dataclass(frozen=True, kw_only=True, eq=False)
class _Join:
    """A destination group's rows joined with the sources that hold them (token order = row order).

    ``row_M``: destination rows with a key; ``group_M``: source group holding it (-1: none);
    ``src_row_M``: its row there.
    """

    row_M: np.ndarray
    group_M: np.ndarray
    src_row_M: np.ndarray


def _join_dest(catalog: RunCatalog, d: int, only: Sequence[int] | None = None) -> _Join:
    """Join destination group ``d``'s tokens with the source groups that may hold them.

    ``only``: restrict to these source groups (a sender joins with its own group only).
    """
    s_d, p_d, r_d = _expand_runs(catalog.dest_runs(d))
    order = np.argsort(r_d, kind="stable")
    s_d, p_d, r_d = s_d[order], p_d[order], r_d[order]
    group = np.full(r_d.size, -1, dtype=_I64)
    src_row = np.full(r_d.size, -1, dtype=_I64)
    if r_d.size == 0:
        return _Join(row_M=r_d, group_M=group, src_row_M=src_row)
    lo, hi = int(s_d.min()), int(s_d.max())
    cands = _overlapping(catalog.source_range_G2, lo, hi) if only is None else np.asarray(only)
    stride = int(p_d.max()) + 1
    for g in cands.tolist():
        s_g, p_g, r_g = _expand_runs(catalog.source_runs(g))
        inside = p_g < stride
        s_g, p_g, r_g = s_g[inside], p_g[inside], r_g[inside]
        if s_g.size == 0:
            continue
        key_g = s_g * stride + p_g
        o = np.argsort(key_g, kind="stable")
        key_g, r_g = key_g[o], r_g[o]
        key_d = s_d * stride + p_d
        at = np.searchsorted(key_g, key_d).clip(max=max(key_g.size - 1, 0))
        hit = (key_g[at] == key_d) & (group < 0)
        group[hit] = g
        src_row[hit] = r_g[at[hit]]
    return _Join(row_M=r_d, group_M=group, src_row_M=src_row)


def _blocks(
    catalog: RunCatalog, d: int, join: _Join, j: int, *, local_copy: bool
) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
    """Transfers into slot ``j`` of destination ``d``: ``(g, src_rank, src_rows, dst_rows)``.

    ``dst_rows`` relative to the slice, per block chunk, in destination-row order; a local copy
    has ``src_rank`` equal to the slot's rank.
    """
    dest = catalog.dests[d]
    start, stop = dest.slice_bounds(j)
    slot_rank = dest.ranks[j]
    slot = int(catalog.slot_offsets()[d]) + j
    inside = (join.row_M >= start) & (join.row_M < stop) & (join.group_M >= 0)
    out = []
    for g in np.unique(join.group_M[inside]).tolist():
        sel = inside & (join.group_M == g)
        dst_rows, src_rows = join.row_M[sel] - start, join.src_row_M[sel]
        ranks = catalog.sources[g].ranks
        if local_copy and slot_rank in ranks:
            out.append((g, slot_rank, src_rows, dst_rows))
            continue
        k, n = len(ranks), dst_rows.size
        for c in range(k):
            a, b = -(-c * n // k), -(-(c + 1) * n // k)
            if b > a:
                out.append((g, ranks[(c + g + slot) % k], src_rows[a:b], dst_rows[a:b]))
    return out


def plan_rank(catalog: RunCatalog, rank: int, *, local_copy: bool = True) -> RankPlan:
    """Global rank ``rank``'s sends, receives and local copies (pure, deterministic).

    Assumes input that :func:`check_rank` passes on every rank (each needed token held once).
    """
    sends: list[Transfer] = []
    recvs: list[Transfer] = []
    locals_: list[Transfer] = []
    dest: DestSlot | None = None
    owner_N: np.ndarray | None = None
    for d, group in enumerate(catalog.dests):
        if rank not in group.ranks:
            continue
        j = group.ranks.index(rank)
        start, stop = group.slice_bounds(j)
        dest = DestSlot(
            group=d,
            slot=j,
            row_offset=start,
            slice_rows=stop - start,
            num_rows=group.num_rows,
            padded_rows=group.slice_rows * len(group.ranks),
        )
        join = _join_dest(catalog, d)
        owner_N = np.full(group.num_rows, -1, dtype=_I64)
        owners = np.asarray([s.owner for s in catalog.sources], dtype=_I64)
        held = join.group_M >= 0
        owner_N[join.row_M[held]] = owners[join.group_M[held]]
        for g, src_rank, src_rows, dst_rows in _blocks(catalog, d, join, j, local_copy=local_copy):
            t = Transfer(
                owner=catalog.sources[g].owner,
                src_rank=src_rank,
                dst_rank=rank,
                segments_S5=_segments(src_rows, dst_rows),
            )
            (locals_ if src_rank == rank and local_copy else recvs).append(t)
        break
    for g, source in enumerate(catalog.sources):
        if rank not in source.ranks:
            continue
        lo, hi = (int(x) for x in catalog.source_range_G2[g])
        for d in _overlapping(catalog.dest_range_D2, lo, hi).tolist():
            join = _join_dest(catalog, d, only=[g])
            for j, slot_rank in enumerate(catalog.dests[d].ranks):
                if slot_rank == rank and local_copy and rank in source.ranks:
                    continue  # served by the receiving side's local copy
                for _, src_rank, src_rows, dst_rows in _blocks(
                    catalog, d, join, j, local_copy=local_copy
                ):
                    if src_rank == rank:
                        sends.append(
                            Transfer(
                                owner=source.owner,
                                src_rank=rank,
                                dst_rank=slot_rank,
                                segments_S5=_segments(src_rows, dst_rows),
                            )
                        )
    sends.sort(key=lambda t: (t.owner, t.dst_rank))
    recvs.sort(key=lambda t: (t.owner, t.src_rank))
    locals_.sort(key=lambda t: t.owner)
    return RankPlan(
        rank=rank,
        sends=tuple(sends),
        recvs=tuple(recvs),
        locals=tuple(locals_),
        dest=dest,
        owner_N=owner_N,
    )


def check_rank(catalog: RunCatalog, rank: int) -> list[str]:
    """The verdicts ``rank`` is responsible for (``[]``: none found).

    Each source group is checked by its first rank (a token it holds twice, or that a source
    group before it also holds); each destination group by its first rank (a token it needs that
    no source holds). Together the ranks check every group once.
    """
    found: list[str] = []
    for g, source in enumerate(catalog.sources):
        if source.ranks[0] != rank:
            continue
        s_g, p_g, _ = _expand_runs(catalog.source_runs(g))
        if s_g.size == 0:
            continue
        stride = int(p_g.max()) + 1
        key = np.sort(s_g * stride + p_g)
        dup = np.flatnonzero(key[1:] == key[:-1])
        if dup.size:
            k = int(key[dup[0]])
            found.append(
                f"token (sample_id={k // stride}, position={k % stride}) is held twice by "
                f"{source.label or g} (ranks {list(source.ranks)})"
            )
            continue
        lo, hi = int(s_g.min()), int(s_g.max())
        for h in _overlapping(catalog.source_range_G2, lo, hi).tolist():
            if h >= g:
                break
            s_h, p_h, _ = _expand_runs(catalog.source_runs(h))
            inside = p_h < stride
            both = np.intersect1d(key, s_h[inside] * stride + p_h[inside])
            if both.size:
                k, other = int(both[0]), catalog.sources[h]
                found.append(
                    f"token (sample_id={k // stride}, position={k % stride}) is held twice: "
                    f"by {other.label or h} (ranks {list(other.ranks)}) and by "
                    f"{source.label or g} (ranks {list(source.ranks)}); {both.size} duplicated "
                    "keys in all"
                )
                break
    for d, group in enumerate(catalog.dests):
        if group.ranks[0] != rank:
            continue
        join = _join_dest(catalog, d)
        missing = np.flatnonzero(join.group_M < 0)
        if missing.size:
            s_d, p_d, r_d = _expand_runs(catalog.dest_runs(d))
            order = np.argsort(r_d, kind="stable")
            i = order[missing[0]]
            found.append(
                f"token (sample_id={int(s_d[i])}, position={int(p_d[i])}) is needed by "
                f"{group.label or d} (ranks {list(group.ranks)}, row {int(r_d[i])}) but no "
                f"teacher holds it; {missing.size} needed tokens are missing in all"
            )
    return found
