"""The transfer planner: each rank plans only its own sends and receives, from runs of keys.

Why this file exists: deciding who sends which row to whom is pure integer work that both ends
of every transfer must derive identically, without a process group (the ``mopd plan`` inspector
and the unit tests call it directly), and at a cost that follows the rank's own work, not the
job's: one rank of a 16k-rank job must not plan the other 16k ranks' transfers.

What it reads is :mod:`mopd.bridge.catalog`'s (groups, runs of keys); every destination row's key
is held by exactly one source group (else a verdict of :func:`mopd.bridge.coverage.check_rank`),
so each needed token crosses into its destination group once. The tokens one source group ``g``
sends to one destination slot ``s`` (global slot index: slots of all destination groups, in
order) form a *block*, in increasing destination-row order. A block of ``n`` tokens is cut into
``k = len(g.ranks)`` near-equal contiguous chunks, chunk ``c`` holding tokens
``[ceil(c n / k), ceil((c + 1) n / k))``, served by replica ``g.ranks[(c + g + s) % k]`` (the
rotation spreads the remainders over the replicas). If a replica of ``g`` is the slot's own rank
and ``local_copy`` is on, it serves the whole block as a local copy instead.

A rank's share of that, :class:`RankPlan`, is in *run form*: every transfer is a table of
segments ``(src_row, src_step, dst_row, dst_step, length)``, in destination-row order, that both
ends derive the same way. Destination rows are relative to the receiving rank's slice.

How a rank plans (never a token at a time, never a group it has no business with):

- peers come from the ``[G, 2]`` / ``[D, 2]`` sample ranges (one vectorized comparison): a
  receiving rank reads its destination group's runs and those of the source groups whose range
  meets it; a sending rank reads its source group's runs and those of the destination groups
  whose range meets it;
- the join is by key interval: source runs sorted by first key (they are disjoint), each
  destination run finds the source runs it overlaps with two binary searches, and every overlap
  becomes a *piece* (a segment of rows ``src_row + i * src_step -> dst_row + i * dst_step``);
- pieces are cut where a slice ends and where a chunk ends (integer arithmetic on the piece),
  sorted by destination row inside their block, and consecutive pieces that continue each other
  are merged. Only pieces whose destination rows interleave (a strided ``[S, B, H]``
  destination) are expanded into tokens, and only inside the slot that needs them;
- a step's micro-batches go together (:func:`plan_ranks`): one join, one cut and one chunking
  serve them all, and each micro-batch's plan is the one it gets alone; the number of array
  operations per step does not grow with the micro-batches or the peers.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mopd.bridge.catalog import (
    GroupIndex,
    RunCatalog,
    StepRanges,
    dense_samples,
    fan_out,
    interval_overlaps,
    key_space,
    ranges_meet,
    read_runs,
    run_keys,
    slice_bounds,
    unique_first,
)

__all__ = [
    "LOCAL",
    "RECV",
    "SEGMENT_COLUMNS",
    "SEND",
    "TRANSFER_COLUMNS",
    "DestSlot",
    "RankPlan",
    "Transfer",
    "TransferTable",
    "plan_rank",
    "plan_ranks",
]

_I64 = np.int64
_EMPTY = np.empty(0, dtype=_I64)


#: Columns of a ``[S, 5]`` int64 segment table: token ``i < length`` of a segment moves from
#: source row ``src_row + i * src_step`` to destination row ``dst_row + i * dst_step``.
SEGMENT_COLUMNS = ("src_row", "src_step", "dst_row", "dst_step", "length")


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

    Two forms. The *layout* form (``owner_rows == ()``, :func:`plan_rank` with
    ``compact=False``): every owner's buffer has the group's ``num_rows`` rows in the order of
    its layout, cut into near-equal slices. The *compact* form (``compact=True``): owner ``k``'s
    buffer holds only the ``owner_rows[k]`` rows it owns, in the layout's row order, cut into
    slices of ``ceil(owner_rows[k] / group_size)`` rows (:meth:`slice_nominal`), so that a TP
    all-gather of equal slices lands them in place.

    Attributes:
        group: index into :attr:`RunCatalog.dests`.
        slot: this rank's slice index in the group.
        row_offset: layout form: first row of the slice in the group's full buffer.
        slice_rows: layout form: rows of the slice (may be fewer than the group's
            ``slice_rows`` at the end).
        num_rows: rows of the group's layout.
        padded_rows: layout form: ``len(ranks) * DestGroup.slice_rows``, the rows a buffer
            needs for an all-gather of equal slices.
        group_size: ranks of the destination group.
        owner_rows: compact form: rows owner ``k`` delivers to the group (its tokens there);
            ``()`` in the layout form.
    """

    group: int
    slot: int
    row_offset: int
    slice_rows: int
    num_rows: int
    padded_rows: int
    group_size: int = 1
    owner_rows: tuple[int, ...] = ()

    @property
    def compact(self) -> bool:
        return bool(self.owner_rows)

    def out_rows(self, owner: int) -> int:
        """Rows of ``owner``'s delivered buffer (``owner_rows[owner]``, or ``num_rows``)."""
        if not self.owner_rows:
            return self.num_rows
        return self.owner_rows[owner] if owner < len(self.owner_rows) else 0

    def slice_nominal(self, owner: int) -> int:
        """Rows of every slice of ``owner``'s buffer (the all-gather's equal slices)."""
        return -(-self.out_rows(owner) // max(1, self.group_size))

    def padded(self, owner: int) -> int:
        """Rows ``owner``'s buffer needs for the all-gather: ``group_size * slice_nominal``
        (at most ``group_size - 1`` more than :meth:`out_rows`)."""
        return self.group_size * self.slice_nominal(owner)

    def slice_start(self, owner: int) -> int:
        """First row of this rank's slice in ``owner``'s buffer."""
        return self.slot * self.slice_nominal(owner)

    def slice_real(self, owner: int) -> int:
        """Rows of this rank's slice of ``owner``'s buffer that hold tokens (the rest: padding)."""
        n = self.out_rows(owner)
        return max(0, min(self.slice_start(owner) + self.slice_nominal(owner), n)) - min(
            self.slice_start(owner), n
        )


#: Columns of a ``[T, 5]`` int64 transfer table (:class:`TransferTable`): the transfer's
#: kind (:data:`SEND`, :data:`RECV`, :data:`LOCAL`), owner, source and destination global
#: ranks, and how many segments it has.
TRANSFER_COLUMNS = ("kind", "owner", "src_rank", "dst_rank", "segments")
#: Transfer kinds, in plan order.
SEND, RECV, LOCAL = 0, 1, 2


@dataclass(frozen=True, eq=False)
class TransferTable:
    """A plan's transfers as columns: its sends by ``(owner, dst_rank)``, then its receives
    by ``(owner, src_rank)``, then its local copies by owner.

    Attributes:
        head_T5: ``[T, 5]`` int64 (:data:`TRANSFER_COLUMNS`).
        segments_S5: ``[S, 5]`` int64 (:data:`SEGMENT_COLUMNS`): transfer ``t``'s segments are
            rows ``off_T1[t] : off_T1[t + 1]``.
        off_T1: ``[T + 1]`` int64.
    """

    head_T5: np.ndarray
    segments_S5: np.ndarray
    off_T1: np.ndarray

    @property
    def size(self) -> int:
        """Transfers."""
        return int(self.head_T5.shape[0])

    def transfers(self, kind: int) -> tuple[Transfer, ...]:
        """The transfers of ``kind``, as :class:`Transfer` views of the segments."""
        k = self.head_T5[:, 0]
        a, b = k.searchsorted([kind, kind + 1]).tolist()
        h = self.head_T5[a:b].tolist()
        off = self.off_T1[a : b + 1].tolist()
        seg = self.segments_S5
        return tuple(
            Transfer(owner=o, src_rank=sr, dst_rank=dr, segments_S5=seg[off[i] : off[i + 1]])
            for i, (_, o, sr, dr, _) in enumerate(h)
        )

    @staticmethod
    def join(tables: Sequence[TransferTable]) -> TransferTable:
        """One table of ``tables``' transfers, one table after another."""
        head = np.concatenate([np.empty((0, 5), _I64), *(t.head_T5 for t in tables)])
        seg = np.concatenate([np.empty((0, 5), _I64), *(t.segments_S5 for t in tables)])
        return TransferTable(head, seg, np.concatenate([[0], head[:, 4].cumsum()]).astype(_I64))

    @staticmethod
    def of(
        sends: Sequence[Transfer], recvs: Sequence[Transfer], locals_: Sequence[Transfer]
    ) -> TransferTable:
        """The table of transfers given as objects (each list already in plan order)."""
        every = [(c, t) for c, ts in enumerate((sends, recvs, locals_)) for t in ts]
        head = np.asarray(
            [(c, t.owner, t.src_rank, t.dst_rank, t.segments_S5.shape[0]) for c, t in every],
            dtype=_I64,
        ).reshape(-1, 5)
        seg = [np.asarray(t.segments_S5, dtype=_I64).reshape(-1, 5) for _, t in every]
        return TransferTable(
            head,
            np.concatenate(seg) if seg else np.empty((0, 5), dtype=_I64),
            np.concatenate([[0], head[:, 4].cumsum()]).astype(_I64),
        )


@dataclass(frozen=True, kw_only=True, eq=False)
class RankPlan:
    """One global rank's share of an exchange.

    Attributes:
        rank: the global rank.
        table: its transfers (:class:`TransferTable`); :attr:`sends`, :attr:`recvs` and
            :attr:`locals` are views of it.
        dest: this rank's slice, or ``None`` when it receives nothing.
        owner_N: ``[N]`` int64 (``dest.num_rows``), which owner fills each row of the whole
            destination group's buffer (``-1``: padding or missing); ``None`` without ``dest``.
    """

    rank: int
    table: TransferTable
    dest: DestSlot | None
    owner_N: np.ndarray | None

    @staticmethod
    def of(
        *,
        rank: int,
        sends: Sequence[Transfer],
        recvs: Sequence[Transfer],
        locals: Sequence[Transfer],
        dest: DestSlot | None,
        owner_N: np.ndarray | None,
    ) -> RankPlan:
        """A plan from its transfers as objects, each list in plan order."""
        return RankPlan(
            rank=rank, table=TransferTable.of(sends, recvs, locals), dest=dest, owner_N=owner_N
        )

    @functools.cached_property
    def sends(self) -> tuple[Transfer, ...]:
        """Transfers this rank sends, sorted by ``(owner, dst_rank)``."""
        return self.table.transfers(SEND)

    @functools.cached_property
    def recvs(self) -> tuple[Transfer, ...]:
        """Transfers this rank receives, sorted by ``(owner, src_rank)``."""
        return self.table.transfers(RECV)

    @functools.cached_property
    def locals(self) -> tuple[Transfer, ...]:
        """Local copies (source replica on this rank), sorted by owner."""
        return self.table.transfers(LOCAL)

    @property
    def busy(self) -> bool:
        """Whether this rank moves or receives anything."""
        return self.table.size > 0 or self.dest is not None


def _ceil_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return -(-a // b)


_PIECE_FIELDS = (
    "mb",
    "grp",
    "dst",
    "slot",
    "src_row",
    "src_step",
    "dst_row",
    "dst_step",
    "length",
)


@dataclass(kw_only=True, eq=False)
class _Pieces:
    """Segments of one join, one per array element (``P`` pieces).

    ``mb``: micro-batch; ``grp``: source group; ``dst``: destination (a group, or an instance
    of one in a micro-batch: :func:`plan_ranks`); ``slot``: global slot (after
    :func:`_cut_slices`); then the segment columns. ``dst_step >= 1`` throughout.
    """

    mb: np.ndarray
    grp: np.ndarray
    dst: np.ndarray
    slot: np.ndarray
    src_row: np.ndarray
    src_step: np.ndarray
    dst_row: np.ndarray
    dst_step: np.ndarray
    length: np.ndarray

    @property
    def size(self) -> int:
        return int(self.length.size)

    def take(self, idx: np.ndarray) -> _Pieces:
        return _Pieces(
            mb=self.mb[idx],
            grp=self.grp[idx],
            dst=self.dst[idx],
            slot=self.slot[idx],
            src_row=self.src_row[idx],
            src_step=self.src_step[idx],
            dst_row=self.dst_row[idx],
            dst_step=self.dst_step[idx],
            length=self.length[idx],
        )

    def sub(self, idx: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> _Pieces:
        """Tokens ``lo .. hi - 1`` of pieces ``idx`` (``0 <= lo < hi <= length``), each a piece
        (steps of one-token pieces set to 1)."""
        out = self.take(idx)
        out.src_row = out.src_row + lo * out.src_step
        out.dst_row = out.dst_row + lo * out.dst_step
        out.length = hi - lo
        one = out.length == 1
        out.src_step[one] = 1
        out.dst_step[one] = 1
        return out

    @staticmethod
    def concat(parts: Sequence[_Pieces]) -> _Pieces:
        return _Pieces(
            **{name: np.concatenate([getattr(p, name) for p in parts]) for name in _PIECE_FIELDS}
        )

    def segments_S5(self) -> np.ndarray:
        return np.stack([self.src_row, self.src_step, self.dst_row, self.dst_step, self.length], 1)


def _no_pieces() -> _Pieces:
    e = _EMPTY
    return _Pieces(
        mb=e, grp=e, dst=e, slot=e, src_row=e, src_step=e, dst_row=e, dst_step=e, length=e
    )


def _join(
    src_K5: np.ndarray, src_grp_K: np.ndarray, dst_K5: np.ndarray, dst_id_K: np.ndarray
) -> _Pieces:
    """Every overlap of a source run with a destination run, as a piece.

    Source runs must be disjoint in key (input :func:`~mopd.bridge.coverage.check_rank` passes); destination runs may
    be anything. Pieces come with ``dst_step >= 1`` (a run whose rows go backwards is flipped)
    and steps of 1 where they hold one token; ``slot`` is not set yet (``-1``).
    """
    if not src_K5.shape[0] or not dst_K5.shape[0]:
        return _no_pieces()
    u, stride = key_space(src_K5, dst_K5)
    ks = run_keys(src_K5, u, stride)
    o = ks.argsort(kind="stable")
    src_K5, src_grp_K, ks = src_K5[o], src_grp_K[o], ks[o]
    ke = ks + src_K5[:, 4]
    kd = run_keys(dst_K5, u, stride)
    b, a = interval_overlaps(ks, ke, kd, kd + dst_K5[:, 4])
    first = np.maximum(kd[b], ks[a])
    length = np.minimum(kd[b] + dst_K5[b, 4], ke[a]) - first
    src_step, dst_step = src_K5[a, 3], dst_K5[b, 3]
    src_row = src_K5[a, 2] + (first - ks[a]) * src_step
    dst_row = dst_K5[b, 2] + (first - kd[b]) * dst_step
    back = dst_step < 0
    if back.any():  # rows going backwards: the same tokens, last one first
        tail = length[back] - 1
        src_row[back] += tail * src_step[back]
        dst_row[back] += tail * dst_step[back]
        src_step[back] *= -1
        dst_step[back] *= -1
    one = length == 1
    src_step[one] = 1
    dst_step[one] = 1
    return _Pieces(
        mb=np.zeros(b.size, dtype=_I64),
        grp=src_grp_K[a],
        dst=dst_id_K[b],
        slot=np.full(b.size, -1, dtype=_I64),
        src_row=src_row,
        src_step=src_step,
        dst_row=dst_row,
        dst_step=dst_step,
        length=length,
    )


def _cut_slices(p: _Pieces, slice_rows_P: np.ndarray, slot0_P: np.ndarray) -> _Pieces:
    """Pieces cut where their destination group's slices end; ``slot`` set (global slot)."""
    n = np.maximum(slice_rows_P, 1)
    q0 = p.dst_row // n
    q1 = (p.dst_row + (p.length - 1) * p.dst_step) // n
    m = q1 - q0 + 1
    if p.size == 0 or bool((m == 1).all()):
        p.slot = slot0_P + q0
        return p
    i, t = fan_out(m)
    q = q0[i] + t
    r0, st, ni = p.dst_row[i], p.dst_step[i], n[i]
    lo = np.maximum(_ceil_div(q * ni - r0, st), 0)
    hi = np.minimum(_ceil_div((q + 1) * ni - r0, st), p.length[i])
    keep = hi > lo
    i, q, lo, hi = i[keep], q[keep], lo[keep], hi[keep]
    out = p.sub(i, lo, hi)
    out.slot = slot0_P[i] + q
    return out


def _sort_blocks(p: _Pieces) -> tuple[_Pieces, np.ndarray, np.ndarray]:
    """Pieces sorted by block ``(mb, grp, slot)``, then destination row: ``(pieces, block_P,
    starts_B)`` with ``block_P`` the dense block index of each piece."""
    o = np.lexsort((p.dst_row, p.slot, p.grp, p.mb))
    p = p.take(o)
    new = np.ones(p.size, dtype=bool)
    new[1:] = (p.grp[1:] != p.grp[:-1]) | (p.slot[1:] != p.slot[:-1]) | (p.mb[1:] != p.mb[:-1])
    return p, new.cumsum() - 1, new.ravel().nonzero()[0]


def _token_segments(
    p: _Pieces, i_M: np.ndarray, src_M: np.ndarray, dst_M: np.ndarray, brk_M: np.ndarray
) -> _Pieces:
    """Token pairs in order, ``src_M -> dst_M`` (token ``m`` of piece ``i_M[m]`` of ``p``),
    cut back into segments: one piece per segment, with the fields of its first token's piece.

    A token starts a segment where ``brk_M`` says so; otherwise it continues the previous one
    when the previous token was made to start one by ``brk_M``, or when its step (from the
    previous token) equals the previous token's step. Every segment has one step; vectorized,
    so a little less greedy than it could be.
    """
    m = src_M.size
    cont = np.zeros(m, dtype=bool)
    if m > 1:
        ds, dd = src_M[1:] - src_M[:-1], dst_M[1:] - dst_M[:-1]
        same = np.zeros(m - 1, dtype=bool)
        same[1:] = (ds[1:] == ds[:-1]) & (dd[1:] == dd[:-1])
        cont[1:] = ~brk_M[1:] & (brk_M[:-1] | same)
    head = (~cont).ravel().nonzero()[0]
    n_seg = np.diff(head, append=m)
    nxt = np.minimum(head + 1, m - 1)
    multi = n_seg > 1
    out = p.take(i_M[head])
    out.src_row, out.dst_row, out.length = src_M[head], dst_M[head], n_seg
    out.src_step = np.where(multi, src_M[nxt] - src_M[head], 1)
    out.dst_step = np.where(multi, dst_M[nxt] - dst_M[head], 1)
    return out


def _untangle(
    p: _Pieces, block_P: np.ndarray, starts_B: np.ndarray
) -> tuple[_Pieces, np.ndarray, np.ndarray]:
    """Pieces whose destination rows interleave inside a block (strided destinations) replaced
    by segments of their tokens in destination-row order; the rest untouched. Takes and returns
    :func:`_sort_blocks`' triple."""
    last = p.dst_row + (p.length - 1) * p.dst_step
    big = int(last.max()) + 1
    reach = np.maximum.accumulate(block_P * big + last)
    lone = np.ones(p.size, dtype=bool)
    lone[1:] = block_P[1:] * big + p.dst_row[1:] > reach[:-1]
    if lone.all():
        return p, block_P, starts_B
    cluster = lone.cumsum() - 1
    multi = np.bincount(cluster)[cluster] > 1
    q = p.take(multi)
    qc = cluster[multi]
    i, t = fan_out(q.length)
    src_M, dst_M = q.src_row[i] + t * q.src_step[i], q.dst_row[i] + t * q.dst_step[i]
    o = np.lexsort((dst_M, qc[i]))
    i, src_M, dst_M = i[o], src_M[o], dst_M[o]
    brk = np.ones(i.size, dtype=bool)
    brk[1:] = qc[i[1:]] != qc[i[:-1]]
    new = _token_segments(q, i, src_M, dst_M, brk)
    return _sort_blocks(_Pieces.concat([p.take(~multi), new]))


def _merge(p: _Pieces, tid_P: np.ndarray) -> tuple[_Pieces, np.ndarray]:
    """Consecutive pieces of one transfer that continue each other (same steps), merged."""
    if p.size < 2:
        return p, tid_P
    cont = np.zeros(p.size, dtype=bool)
    cont[1:] = (
        (tid_P[1:] == tid_P[:-1])
        & (p.src_step[1:] == p.src_step[:-1])
        & (p.dst_step[1:] == p.dst_step[:-1])
        & (p.src_row[1:] == p.src_row[:-1] + p.length[:-1] * p.src_step[:-1])
        & (p.dst_row[1:] == p.dst_row[:-1] + p.length[:-1] * p.dst_step[:-1])
    )
    if not cont.any():
        return p, tid_P
    head = (~cont).ravel().nonzero()[0]
    out = p.take(head)
    out.length = np.add.reduceat(p.length, head)
    return out, tid_P[head]


@dataclass(frozen=True, kw_only=True, eq=False)
class _Chunked:
    """One transfer per row of the ``[T]`` arrays, segments of transfer ``t`` at
    ``segments_S5[off_T1[t] : off_T1[t + 1]]``."""

    mb_T: np.ndarray
    grp_T: np.ndarray
    slot_T: np.ndarray
    src_rank_T: np.ndarray
    local_T: np.ndarray
    off_T1: np.ndarray
    segments_S5: np.ndarray


def _chunk(
    p: _Pieces, ix: GroupIndex, *, local_copy: bool, send_rank: int | None = None
) -> _Chunked:
    """Blocks of the pieces cut into replica chunks (or kept whole as local copies).

    ``send_rank``: keep only what that rank sends (no local blocks, only its chunks).
    Destination rows stay as they are (the caller makes them slice-relative first).
    """
    if not p.size:
        e = _EMPTY
        return _Chunked(
            mb_T=e,
            grp_T=e,
            slot_T=e,
            src_rank_T=e,
            local_T=e.astype(bool),
            off_T1=np.zeros(1, _I64),
            segments_S5=np.empty((0, 5), dtype=_I64),
        )
    p, block, starts = _sort_blocks(p)
    if bool((p.dst_step > 1).any()):
        p, block, starts = _untangle(p, block, starts)
    blk_g, blk_slot = p.grp[starts], p.slot[starts]
    blk_rank = ix.slot_rank_S[blk_slot]
    blk_k = ix.rep_off_G1[blk_g + 1] - ix.rep_off_G1[blk_g]
    blk_local = ix.is_replica(blk_rank, blk_g) if local_copy else np.zeros(starts.size, bool)
    cum = p.length.cumsum() - p.length
    off = cum - cum[starts][block]
    n = np.add.reduceat(p.length, starts)[block]
    k = np.where(blk_local, 1, blk_k)[block]
    c0 = off * k // n
    c1 = (off + p.length - 1) * k // n
    m = c1 - c0 + 1
    if bool((m > 1).any()):
        i, t = fan_out(m)
        c = c0[i] + t
        ki, ni, oi = k[i], n[i], off[i]
        lo = np.maximum(_ceil_div(c * ni, ki), oi) - oi
        hi = np.minimum(_ceil_div((c + 1) * ni, ki), oi + p.length[i]) - oi
        keep = hi > lo
        i, c, lo, hi = i[keep], c[keep], lo[keep], hi[keep]
        p, block = p.sub(i, lo, hi), block[i]
    else:
        c = c0
    g, s, kb = p.grp, p.slot, blk_k[block]
    local = blk_local[block]
    rep = ix.rep_rank_X[ix.rep_off_G1[g] + (c + g + s) % kb]
    src_rank = np.where(local, blk_rank[block], rep)
    if send_rank is not None:
        keep = ~local & (src_rank == send_rank)
        p, block, c, src_rank, local = (
            p.take(keep),
            block[keep],
            c[keep],
            src_rank[keep],
            local[keep],
        )
    first = np.ones(p.size, dtype=bool)  # a piece that starts a transfer (block, chunk)
    first[1:] = (block[1:] != block[:-1]) | (c[1:] != c[:-1])
    tid = first.cumsum() - 1
    firsts = first.ravel().nonzero()[0]
    mb_T, grp_T, slot_T = p.mb[firsts], p.grp[firsts], p.slot[firsts]
    src_T, local_T = src_rank[firsts], local[firsts]
    p, tid = _merge(p, tid)
    off_T1 = tid.searchsorted(np.arange(firsts.size + 1, dtype=_I64))
    return _Chunked(
        mb_T=mb_T,
        grp_T=grp_T,
        slot_T=slot_T,
        src_rank_T=src_T,
        local_T=local_T,
        off_T1=off_T1,
        segments_S5=p.segments_S5(),
    )


def _fill_owners(owner_N: np.ndarray, p: _Pieces, owner_G: np.ndarray) -> None:
    """``owner_N[row] = owner`` for every destination row of the pieces."""
    if not p.size:
        return
    own = owner_G[p.grp]
    if bool((p.dst_step == 1).all()):  # row intervals: mark the edges, then a prefix sum
        n = owner_N.size
        edge = np.zeros(n + 1, dtype=_I64)
        np.add.at(edge, p.dst_row, own + 1)
        np.add.at(edge, p.dst_row + p.length, -(own + 1))
        owner_N[:] = edge[:n].cumsum() - 1
        return
    i, t = fan_out(p.length)
    owner_N[p.dst_row[i] + t * p.dst_step[i]] = own[i]


def _compact(p: _Pieces, own_P: np.ndarray, num_owners: int) -> tuple[_Pieces, np.ndarray]:
    """Pieces with destination rows moved to compact space: ``(pieces, [num_owners] rows)``.

    ``p`` must hold *every* piece of one destination group for each owner in ``own_P`` (the
    owner of each piece). A row owned by ``k`` moves to its rank among the rows ``k`` owns
    there, in row order (the order the loss reads teacher ``k``'s rows). Run form when every
    piece advances by one row (the pieces of one owner never overlap: a sort by row and a
    prefix sum of lengths); otherwise the tokens of the destination group are ranked and cut
    back into segments, piece by piece (both ends of a transfer cut them alike).
    """
    rows_K = np.bincount(own_P, weights=p.length, minlength=num_owners).astype(_I64)
    if not p.size:
        return p, rows_K
    if bool((p.dst_step == 1).all()):
        o = np.lexsort((p.dst_row, own_P))
        q, own = p.take(o), own_P[o]
        cum = q.length.cumsum() - q.length
        q.dst_row = cum - cum[own.searchsorted(own, side="left")]
        return q, rows_K
    i, t = fan_out(p.length)
    row_M, own_M = p.dst_row[i] + t * p.dst_step[i], own_P[i]
    o = np.lexsort((row_M, own_M))
    pos_M = np.empty(i.size, dtype=_I64)
    pos_M[o] = np.arange(i.size, dtype=_I64) - own_M[o].searchsorted(own_M[o], side="left")
    src_M = p.src_row[i] + t * p.src_step[i]
    brk = np.ones(i.size, dtype=bool)
    brk[1:] = i[1:] != i[:-1]
    return _token_segments(p, i, src_M, pos_M, brk), rows_K


def _step_tables(
    chunks: Sequence[tuple[_Chunked, np.ndarray, np.ndarray, np.ndarray]],
    owner_G: np.ndarray,
    n_mb: int,
) -> list[TransferTable]:
    """Each micro-batch's :class:`TransferTable`, from chunk tables ``(chunks, [T] kind,
    [T] src_rank, [T] dst_rank)``: every transfer of the step ordered at once (micro-batch,
    kind, owner, peer; ties keep the chunks' order) and its segments gathered once."""
    if not chunks:
        empty = TransferTable(np.empty((0, 5), _I64), np.empty((0, 5), _I64), np.zeros(1, _I64))
        return [empty] * n_mb
    base = np.cumsum([0, *(ch.segments_S5.shape[0] for ch, _, _, _ in chunks[:-1])])
    mb = np.concatenate([ch.mb_T for ch, _, _, _ in chunks])
    kind = np.concatenate([k for _, k, _, _ in chunks])
    src = np.concatenate([x for _, _, x, _ in chunks])
    dst = np.concatenate([x for _, _, _, x in chunks])
    owner = owner_G[np.concatenate([ch.grp_T for ch, _, _, _ in chunks])]
    first = np.concatenate(
        [ch.off_T1[:-1] + b for (ch, _, _, _), b in zip(chunks, base, strict=True)]
    )
    nseg = np.concatenate([ch.off_T1[1:] - ch.off_T1[:-1] for ch, _, _, _ in chunks])
    peer = np.where(kind == SEND, dst, np.where(kind == RECV, src, 0))
    o = np.lexsort((peer, owner, kind, mb))
    head_T5 = np.stack([kind[o], owner[o], src[o], dst[o], nseg[o]], axis=1)
    i, t = fan_out(nseg[o])
    seg_all = np.concatenate([ch.segments_S5 for ch, _, _, _ in chunks])
    seg_S5 = seg_all[first[o][i] + t]
    at_T = mb[o].searchsorted(np.arange(n_mb + 1)).tolist()
    off_T1 = np.concatenate([[0], nseg[o].cumsum()]).astype(_I64)
    out = []
    for k in range(n_mb):
        a, b = at_T[k], at_T[k + 1]
        s0, s1 = int(off_T1[a]), int(off_T1[b])
        out.append(TransferTable(head_T5[a:b], seg_S5[s0:s1], off_T1[a : b + 1] - s0))
    return out


def plan_ranks(
    catalogs: Sequence[RunCatalog],
    rank: int,
    *,
    local_copy: bool = True,
    compact: bool = False,
) -> list[RankPlan]:
    """:func:`plan_rank` of every catalog (a step's micro-batches, over one set of groups),
    in one pass: the joins, slices and chunks of every micro-batch together, so that the
    work is a fixed number of array operations over the rank's own runs and its peers'.

    Each catalog's plan is the one :func:`plan_rank` gives it alone (that function is this one
    with one catalog); the runs read are the same.
    """
    n_mb = len(catalogs)
    if not n_mb:
        return []
    ix = catalogs[0].index()
    n_src = int(ix.owner_G.size)
    num_owners = int(ix.owner_G.max()) + 1 if n_src else 0
    mine = ix.dest_groups.get(rank)
    d0 = mine[0] if mine else None
    my_src = np.asarray(ix.source_groups.get(rank, ()), dtype=_I64)
    # 1. the destination instances (micro-batch, group) and each one's candidate sources,
    #    every micro-batch at once: per micro-batch the rank's own destination first, then
    #    the others its sources meet, ascending
    s_rng, d_rng = StepRanges.of(catalogs, "s"), StepRanges.of(catalogs, "d")
    pair_mb: list[np.ndarray] = []
    pair_g: list[np.ndarray] = []
    inst_mb, inst_d, inst_own = [_EMPTY], [_EMPTY], [_EMPTY]
    if d0 is not None:  # the rank's own destination: every source that meets it
        every = np.arange(n_mb, dtype=_I64)
        inst_mb.append(every)
        inst_d.append(np.full(n_mb, d0, dtype=_I64))
        inst_own.append(np.zeros(n_mb, dtype=_I64))
        got_mb, got_g = s_rng.meeting(*d_rng.range_of(d0))
        pair_mb.append(got_mb)
        pair_g.append(got_g)
    if my_src.size:
        # [M, R_d]: each of this rank's sources (per micro-batch) against every destination of
        # its micro-batch
        mine_G = np.zeros(max(n_src, 1), dtype=bool)  # this rank's source groups
        mine_G[my_src] = True
        m_r = mine_G[s_rng.id_R].ravel().nonzero()[0]
        m_lo, m_hi = s_rng.range_R2[m_r, 0], s_rng.range_R2[m_r, 1]
        d_lo, d_hi = d_rng.range_R2[:, 0], d_rng.range_R2[:, 1]
        meet_MQ = (s_rng.mb_R[m_r, None] == d_rng.mb_R) & ranges_meet(
            m_lo[:, None], m_hi[:, None], d_lo, d_hi
        )
        qs = meet_MQ.any(axis=0).ravel().nonzero()[0]  # the destinations met, by micro-batch
        q_mb, q_d = d_rng.mb_R[qs], d_rng.id_R[qs]
        mi, qi = np.nonzero(meet_MQ[:, qs])
        if compact:  # per destination, every source of an owner that serves it there
            owners_QO = np.zeros((qs.size, max(num_owners, 1)), dtype=bool)
            owners_QO[qi, ix.owner_G[s_rng.id_R[m_r[mi]]]] = True
            s_off = s_rng.mb_R.searchsorted(np.arange(n_mb + 1))
            qj, qt = fan_out(s_off[q_mb + 1] - s_off[q_mb])  # each destination x its sources
            r = s_off[q_mb][qj] + qt
            s_lo, s_hi = s_rng.range_R2[r, 0], s_rng.range_R2[r, 1]
            ok = ranges_meet(s_lo, s_hi, d_lo[qs][qj], d_hi[qs][qj])
            ok &= owners_QO[qj, ix.owner_G[s_rng.id_R[r]]]
            pair_mb.append(q_mb[qj[ok]])
            pair_g.append(s_rng.id_R[r[ok]])
        else:  # this rank's own sources alone
            pair_mb.append(q_mb[qi])
            pair_g.append(s_rng.id_R[m_r[mi]])
        other = q_d != d0
        inst_mb.append(q_mb[other])
        inst_d.append(q_d[other])
        inst_own.append(np.ones(int(other.sum()), dtype=_I64))
    e_mb, e_d, e_own = (np.concatenate(x) for x in (inst_mb, inst_d, inst_own))
    order = np.lexsort((e_d, e_own, e_mb))
    e_mb, e_d, e_own = e_mb[order], e_d[order], e_own[order]
    n_e = int(e_mb.size)
    recv_e = np.full(n_mb, -1, dtype=_I64)
    at_own = (e_own == 0).ravel().nonzero()[0]
    recv_e[e_mb[at_own]] = at_own
    # 2. the runs: each destination instance's, each candidate source's (once per micro-batch)
    n_s = max(n_src, 1)
    pm = np.concatenate(pair_mb) if pair_mb else _EMPTY
    pg = np.concatenate(pair_g) if pair_g else _EMPTY
    key, _ = unique_first(pm * n_s + pg)  # (micro-batch, source) pairs, each once
    src, _, src_tag = read_runs(catalogs, "s", key // n_s, key % n_s, tag_X=key)
    dst, _, dst_e = read_runs(catalogs, "d", e_mb, e_d, tag_X=np.arange(n_e, dtype=_I64))
    # 3. one join of every micro-batch: sample ids made distinct per micro-batch
    if src.shape[0] and dst.shape[0]:
        ids = dense_samples(
            np.concatenate([src_tag // n_s, e_mb[dst_e]]),
            np.concatenate([src[:, 0], dst[:, 0]]),
        )
        src, dst = src.copy(), dst.copy()
        src[:, 0], dst[:, 0] = ids[: src.shape[0]], ids[src.shape[0] :]
        p = _join(src, src_tag, dst, dst_e)
        p.mb, p.grp = p.grp // n_s, p.grp % n_s
    else:
        p = _no_pieces()
    # 4. each destination instance's rows, owners and slices
    group_size = ix.slot_off_D1[e_d + 1] - ix.slot_off_D1[e_d]
    num_rows = np.zeros(n_e, dtype=_I64)
    e_at = e_mb.searchsorted(np.arange(n_mb + 1)).tolist()  # instances by micro-batch
    for i, cat in enumerate(catalogs):
        num_rows[e_at[i] : e_at[i + 1]] = cat.dest_rows(e_d[e_at[i] : e_at[i + 1]])
    owner_of: list[np.ndarray | None] = [None] * n_mb
    if d0 is not None:
        base = np.concatenate([[0], num_rows[recv_e].cumsum()])
        owner_all = np.full(int(base[-1]), -1, dtype=_I64)
        recv_E = np.zeros(n_e, dtype=bool)  # the instances of this rank's own destination
        recv_E[recv_e] = True
        mine_p = p.take(recv_E[p.dst].ravel().nonzero()[0])
        if mine_p.size:
            mine_p.dst_row = mine_p.dst_row + base[mine_p.mb]
            _fill_owners(owner_all, mine_p, ix.owner_G)
        owner_of = [owner_all[base[i] : base[i + 1]] for i in range(n_mb)]
    k = max(num_owners, 1)
    own = ix.owner_G[p.grp]
    if compact:
        p, rows_C = _compact(p, p.dst * k + own, n_e * k)
        rows_EK = rows_C.reshape(n_e, k)
        own = ix.owner_G[p.grp]
        nominal_EK = -(-rows_EK // group_size[:, None])
    else:
        rows_EK = np.bincount(p.dst * k + own, weights=p.length, minlength=n_e * k)
        rows_EK = rows_EK.astype(_I64).reshape(n_e, k)
        nominal_EK = (-(-num_rows // group_size))[:, None].repeat(k, axis=1)
    slot0_E = ix.slot_off_D1[e_d] if n_e else _EMPTY
    p = _cut_slices(p, nominal_EK[p.dst, own], slot0_E[p.dst])
    own = ix.owner_G[p.grp]
    p.dst_row = p.dst_row - (p.slot - slot0_E[p.dst]) * nominal_EK[p.dst, own]
    # 5. this rank's receives and local copies, then its sends: the step's transfer tables
    chunks = []
    dest: list[DestSlot | None] = [None] * n_mb
    if d0 is not None:
        group = catalogs[0].dests[d0]
        j = group.ranks.index(rank)
        s_glob = int(ix.slot_off_D1[d0]) + j
        q = p.take((recv_E[p.dst] & (p.slot == s_glob)).ravel().nonzero()[0])
        ch = _chunk(q, ix, local_copy=local_copy)
        n_t = ch.mb_T.size
        kind = np.where(ch.local_T, LOCAL, RECV)
        chunks.append((ch, kind, ch.src_rank_T, np.full(n_t, rank, dtype=_I64)))
        rows_I = num_rows[recv_e].tolist()
        owner_rows_IK = rows_EK[recv_e, :num_owners].tolist()
        size = len(group.ranks)
        for i in range(n_mb):
            n = rows_I[i]  # this micro-batch's rows
            start, stop = slice_bounds(n, size, j)
            dest[i] = DestSlot(
                group=d0,
                slot=j,
                row_offset=start,
                slice_rows=stop - start,
                num_rows=n,
                padded_rows=-(-n // size) * size,
                group_size=size,
                owner_rows=tuple(owner_rows_IK[i]) if compact else (),
            )
    if my_src.size:
        q = p.take(mine_G[p.grp].ravel().nonzero()[0])
        ch = _chunk(q, ix, local_copy=local_copy, send_rank=rank)
        n_t = ch.mb_T.size
        sent = np.full(n_t, SEND, dtype=_I64)
        chunks.append((ch, sent, np.full(n_t, rank, dtype=_I64), ix.slot_rank_S[ch.slot_T]))
    tables = _step_tables(chunks, ix.owner_G, n_mb)
    return [
        RankPlan(rank=rank, table=tables[i], dest=dest[i], owner_N=owner_of[i]) for i in range(n_mb)
    ]


def plan_rank(
    catalog: RunCatalog, rank: int, *, local_copy: bool = True, compact: bool = False
) -> RankPlan:
    """Global rank ``rank``'s sends, receives and local copies (pure, deterministic).

    Assumes input that :func:`~mopd.bridge.coverage.check_rank` passes on every rank (each needed token held once).
    Reads the runs of the rank's own groups and of the groups whose sample range meets theirs.

    ``compact``: destination rows in compact space (see :class:`DestSlot`): each owner's
    rows arrive in a buffer of their own, one row per token it owns, in the layout's row order.
    A sender then also reads, for each destination group it serves, the runs of its owner's
    other source groups that meet that group (to place its pieces among theirs).
    A step's micro-batches are planned together by :func:`plan_ranks`: a catalog of a
    :class:`StepBatch` whose micro-batch is pending is planned with every pending one.
    """
    b = catalog.batch
    if b is None or catalog.slot not in b.pending:
        return plan_ranks([catalog], rank, local_copy=local_copy, compact=compact)[0]
    key = (rank, local_copy, compact)
    got = b._plans.get(key)
    if got is None:
        cats = [b.catalogs[i] for i in b.pending]
        plans = plan_ranks(cats, rank, local_copy=local_copy, compact=compact)
        got = b._plans[key] = dict(zip(b.pending, plans, strict=True))
    return got[catalog.slot]
