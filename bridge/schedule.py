"""One rank's schedule of one micro-batch, and its index tensors on the device.

Why this file exists: the planner says, in run form, which rows this rank sends, receives and
copies locally (:class:`~mopd.bridge.plan.RankPlan`); the executor needs to know how each of
those touches its buffers: no pass for one contiguous view, block copies (``copy_runs``) for long
runs, per-row gather/scatter otherwise (:class:`RankSchedule`, built once per plan content and
cached). The runs of a plan feed ``copy_runs`` as they are; only sides that move row by row are
expanded into row indices. :class:`DeviceIndices` puts every index tensor a schedule's kernels
read on the data's device with one asynchronous host-to-device copy.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np
import torch

from mopd.bridge.catalog import fan_out
from mopd.bridge.plan import LOCAL, RECV, SEND, DestSlot, RankPlan, TransferTable
from mopd.common.digest import Digest

__all__ = ["MIN_AVG_RUN", "DeviceIndices", "RankSchedule", "plan_digest", "plan_digests"]

_I64 = torch.int64
#: Average run length from which rows move as block copies (``copy_runs``) rather than per row.
MIN_AVG_RUN = 16
#: A side's modes by code (:meth:`_Side.many`).
_MODES = ("view", "runs", "index")


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))


def _merge_runs(row_S: np.ndarray, step_S: np.ndarray, len_S: np.ndarray) -> np.ndarray:
    """``[K, 3]`` maximal contiguous runs ``(row, position, length)`` of one side's segments.

    ``position`` is where the run starts in the transfer's token order. Only for sides whose
    segments all advance by one row (``step == 1``; length-1 segments count as such).
    """
    pos = len_S.cumsum() - len_S
    joins = np.zeros(row_S.size, dtype=bool)
    if row_S.size > 1:
        joins[1:] = row_S[1:] == row_S[:-1] + len_S[:-1]
    start = (~joins).ravel().nonzero()[0]
    length = np.add.reduceat(len_S, start) if start.size else len_S[:0]
    return (
        np.stack([row_S[start], pos[start], length], axis=1)
        if start.size
        else np.empty((0, 3), dtype=np.int64)
    )


def _expand(row_S: np.ndarray, step_S: np.ndarray, len_S: np.ndarray) -> np.ndarray:
    """``[M]`` rows of every token of one side's segments, in order."""
    seg, i = fan_out(len_S)
    return row_S[seg] + i * step_S[seg]


class _Side:
    """How one side of a transfer touches its buffer.

    ``mode``: ``"view"`` (rows ``first .. first + count``), ``"runs"`` (``copy_runs`` over
    ``run_row`` / ``run_pos`` / ``run_len``) or ``"index"`` (per-row ``rows``). The index
    tensors are made on first use (each once: the device cache keys on them). A side keeps
    the arrays of its batch (:meth:`many`) and its bounds in them: a step's transfers are many
    and most of them are views that never read their runs.
    """

    __slots__ = ("_made", "_ra", "_rb", "_runs", "_sa", "_sb", "_segs", "count", "first", "mode")

    def __init__(
        self,
        mode: str,
        count: int,
        first: int,
        runs: tuple[np.ndarray, np.ndarray, np.ndarray],
        run_bounds: tuple[int, int],
        segs: tuple[np.ndarray, np.ndarray, np.ndarray],
        seg_bounds: tuple[int, int],
    ) -> None:
        self.mode, self.count, self.first = mode, count, first
        #: ``(row, pos, len)`` of the batch's runs (``[K]`` each: buffer rows where runs start,
        #: positions in the transfer, the staging offset, where they start, lengths), and this
        #: side's ``[ra, rb)`` of them
        self._runs, (self._ra, self._rb) = runs, run_bounds
        #: ``(row, step, len)`` of the batch's segments (``[S]`` each), this side's ``[sa, sb)``
        self._segs, (self._sa, self._sb) = segs, seg_bounds
        self._made: dict[str, torch.Tensor] = {}

    def _run(self, k: int) -> np.ndarray:
        return self._runs[k][self._ra : self._rb]

    @property
    def _row_S(self) -> np.ndarray:
        return self._segs[0][self._sa : self._sb]

    @property
    def _step_S(self) -> np.ndarray:
        return self._segs[1][self._sa : self._sb]

    @property
    def _len_S(self) -> np.ndarray:
        return self._segs[2][self._sa : self._sb]

    def _tensor(self, name: str, make: Any) -> torch.Tensor:
        got = self._made.get(name)
        if got is None:
            got = self._made[name] = _t(make())
        return got

    @property
    def run_row(self) -> torch.Tensor:
        return self._tensor("run_row", lambda: self._run(0))

    @property
    def run_pos(self) -> torch.Tensor:
        return self._tensor("run_pos", lambda: self._run(1))

    @property
    def run_len(self) -> torch.Tensor:
        return self._tensor("run_len", lambda: self._run(2))

    @property
    def rows(self) -> torch.Tensor:
        """``[count]`` int64 buffer row of every token (expanded on first use)."""
        return self._tensor("rows", lambda: _expand(self._row_S, self._step_S, self._len_S))

    @staticmethod
    def of(row_S: np.ndarray, step_S: np.ndarray, len_S: np.ndarray) -> _Side:
        """One side from its segments' rows, steps and lengths (:meth:`many` of one)."""
        return _Side.many(row_S, step_S, len_S, np.asarray([0, row_S.size], dtype=np.int64))[0]

    @staticmethod
    def many(
        row_S: np.ndarray, step_S: np.ndarray, len_S: np.ndarray, off_T1: np.ndarray
    ) -> _Sides:
        """The sides of several transfers at once: transfer ``t``'s segments are
        ``[off_T1[t], off_T1[t + 1])`` of the ``[S]`` arrays. Per transfer: its token count,
        whether every segment advances by one row, and its maximal contiguous runs
        (:func:`_merge_runs`, never across transfers), in a fixed number of array operations
        for all of them; then the mode (one view, block copies, or per-row indices). Each side
        is made on first use (:class:`_Sides`): most transfers read one of their two."""
        row_S, step_S, len_S = (np.asarray(a, dtype=np.int64) for a in (row_S, step_S, len_S))
        n_T = off_T1.size - 1
        n_S = off_T1[1:] - off_T1[:-1]
        if not n_T:
            return _Sides.made([])
        if int(n_S.min()) == 0:  # a transfer without segments: one at a time
            return _Sides.made(
                [
                    _Side.many(row_S[a:b], step_S[a:b], len_S[a:b], np.asarray([0, b - a]))[0]
                    if b > a
                    else _Side._empty()
                    for a, b in zip(off_T1[:-1].tolist(), off_T1[1:].tolist(), strict=True)
                ]
            )
        tid = np.arange(n_T, dtype=np.int64).repeat(n_S)
        starts = off_T1[:-1]
        count_T = np.add.reduceat(len_S, starts)
        unit_T = np.logical_and.reduceat((step_S == 1) | (len_S == 1), starts)
        cum = len_S.cumsum() - len_S
        pos_S = cum - cum[starts][tid]
        joins = np.zeros(row_S.size, dtype=bool)
        if row_S.size > 1:
            joins[1:] = (row_S[1:] == row_S[:-1] + len_S[:-1]) & (tid[1:] == tid[:-1])
        rs = (~joins).ravel().nonzero()[0]
        run_row, run_pos, run_len = row_S[rs], pos_S[rs], np.add.reduceat(len_S, rs)
        run_off = np.concatenate([[0], np.bincount(tid[rs], minlength=n_T).cumsum()])
        # each transfer's mode in one pass: one view, block copies, or per-row indices
        k_T = np.where(unit_T, run_off[1:] - run_off[:-1], 0)
        mode_T = np.where(
            unit_T & (k_T <= 1), 0, np.where(unit_T & (count_T >= MIN_AVG_RUN * k_T), 1, 2)
        )
        return _Sides(
            mode_T.tolist(),
            unit_T.tolist(),
            count_T.tolist(),
            row_S[starts].tolist(),
            np.where(unit_T, run_off[:-1], 0).tolist(),
            np.where(unit_T, run_off[1:], 0).tolist(),
            off_T1.tolist(),
            (run_row, run_pos, run_len),
            (row_S, step_S, len_S),
        )

    @staticmethod
    def _empty() -> _Side:
        e = np.empty(0, dtype=np.int64)
        return _Side("view", 0, 0, (e, e, e), (0, 0), (e, e, e), (0, 0))


class _Sides(Sequence[_Side]):
    """The sides of a batch of transfers (:meth:`_Side.many`), side ``t`` made on first use.

    Per transfer ``t``: its mode code, whether every segment advances by one row (or holds one
    token), token count, first row, ``[run_lo_T[t], run_hi_T[t])``
    of the batch's runs (``(0, 0)``: not a unit-step side) and ``[seg_T1[t], seg_T1[t + 1])``
    of its segments.
    """

    __slots__ = (
        "_count",
        "_first",
        "_made",
        "_mode",
        "_run_hi",
        "_run_lo",
        "_runs",
        "_seg_T1",
        "_segs",
        "_unit",
    )

    def __init__(
        self,
        mode_T: list[int],
        unit_T: list[bool],
        count_T: list[int],
        first_T: list[int],
        run_lo_T: list[int],
        run_hi_T: list[int],
        seg_T1: list[int],
        runs: tuple[np.ndarray, np.ndarray, np.ndarray],
        segs: tuple[np.ndarray, np.ndarray, np.ndarray],
    ) -> None:
        self._mode, self._unit, self._count, self._first = mode_T, unit_T, count_T, first_T
        self._run_lo, self._run_hi, self._seg_T1 = run_lo_T, run_hi_T, seg_T1
        self._runs, self._segs = runs, segs
        self._made: list[_Side | None] = [None] * len(mode_T)

    @staticmethod
    def made(sides: list[_Side]) -> _Sides:
        """A batch of sides made already."""
        e = np.empty(0, dtype=np.int64)
        out = _Sides(
            [_MODES.index(x.mode) for x in sides],
            [bool(((x._step_S == 1) | (x._len_S == 1)).all()) for x in sides],
            [x.count for x in sides],
            [x.first for x in sides],
            [0] * len(sides),
            [0] * len(sides),
            [0] * (len(sides) + 1),
            (e, e, e),
            (e, e, e),
        )
        out._made = list(sides)
        return out

    def __len__(self) -> int:
        return len(self._made)

    @overload
    def __getitem__(self, t: int) -> _Side: ...

    @overload
    def __getitem__(self, t: slice) -> list[_Side]: ...

    def __getitem__(self, t: int | slice) -> _Side | list[_Side]:
        if isinstance(t, slice):
            return [self[i] for i in range(*t.indices(len(self)))]
        got = self._made[t]
        if got is None:
            got = self._made[t] = _Side(
                _MODES[self._mode[t]],
                self._count[t],
                self._first[t],
                self._runs,
                (self._run_lo[t], self._run_hi[t]),
                self._segs,
                (self._seg_T1[t], self._seg_T1[t + 1]),
            )
        return got


class _Op:
    """One send or receive: this rank's side of it, its peer and its staging offset.

    ``mode``, ``first``, ``count``: how this rank's side touches its buffer (:class:`_Side`'s:
    a view is rows ``first .. first + count``, what the executor reads of most operations);
    ``stage_off``: offset in this owner's staging buffer (send or recv), -1 for a view.
    :attr:`side` (this rank's rows) and :attr:`peer_side` (the other end's, for integrity
    messages) are made on first use from their batches.
    """

    __slots__ = ("_at", "_mine", "_peers", "count", "first", "mode", "owner", "peer", "stage_off")

    def __init__(
        self,
        *,
        owner: int,
        peer: int,
        stage_off: int,
        mine: _Sides,
        peers: _Sides,
        at: int,
    ) -> None:
        self.owner, self.peer, self.stage_off = owner, peer, stage_off
        self.mode = _MODES[mine._mode[at]]
        self.count, self.first = mine._count[at], mine._first[at]
        self._mine, self._peers, self._at = mine, peers, at

    @property
    def side(self) -> _Side:
        return self._mine[self._at]

    @property
    def peer_side(self) -> _Side:
        return self._peers[self._at]


@dataclass(frozen=True, kw_only=True, eq=False)
class _Local:
    """A local copy: ``mode`` ``"runs"`` (joint runs), ``"gather"`` (destination contiguous) or
    ``"scatter"`` (source contiguous)."""

    owner: int
    mode: str
    src: _Side
    dst: _Side
    joint_src: torch.Tensor
    joint_dst: torch.Tensor
    joint_len: torch.Tensor


def _sides(table: TransferTable) -> tuple[_Sides, _Sides]:
    """``(sources, destinations)``: both sides of every transfer of ``table``, in one batch
    each."""
    s, off = table.segments_S5, table.off_T1
    return (
        _Side.many(s[:, 0], s[:, 1], s[:, 4], off),
        _Side.many(s[:, 2], s[:, 3], s[:, 4], off),
    )


def _local(owner: int, s: np.ndarray, src: _Side, dst: _Side, *, unit: bool) -> _Local:
    """A local copy of ``owner`` with ``[S, 5]`` segments ``s`` and sides ``src``, ``dst``;
    ``unit``: whether every segment advances by one row on both sides (or holds one token)."""
    if unit and (s.shape[0] <= 1 or src.count >= MIN_AVG_RUN * s.shape[0]):
        mode, js, jd, jl = "runs", s[:, 0], s[:, 2], s[:, 4]
    elif dst.mode == "view":
        mode, js, jd, jl = "gather", s[:0, 0], s[:0, 2], s[:0, 4]
    elif src.mode == "view":
        mode, js, jd, jl = "scatter", s[:0, 0], s[:0, 2], s[:0, 4]
    else:  # both sides scattered: one block copy per token
        src_rows, dst_rows = src.rows.numpy(), dst.rows.numpy()
        mode, js, jd, jl = "runs", src_rows, dst_rows, np.ones_like(src_rows)
    return _Local(
        owner=owner,
        mode=mode,
        src=src,
        dst=dst,
        joint_src=_t(js),
        joint_dst=_t(jd),
        joint_len=_t(jl),
    )


def _stage_many(table: TransferTable, groups: Sequence[tuple[bool, Sequence[int]]]) -> _Sides:
    """Per group of staged transfers (one owner's sends or receives of one plan, in staging
    order), one side over this rank's rows of them: one kernel launch packs (unpacks) an
    owner's whole staging buffer. Every group in one batch (:meth:`_Side.many`).

    ``groups``: ``(sends, transfers)``: whether the group's transfers are sends (this rank's
    side is their source) or receives (their destination), and their indices in ``table``.
    """
    if not groups:
        return _Sides.made([])
    x_X = np.asarray([x for _, g in groups for x in g], dtype=np.int64)
    src_X = np.asarray([send for send, g in groups for _ in g], dtype=bool)
    off = table.off_T1
    seg_X = off[x_X + 1] - off[x_X]
    i, t = fan_out(seg_X)
    at_S = off[x_X][i] + t  # the groups' segments, in order
    col_S = np.where(src_X, 0, 2)[i]  # this rank's side: source or destination columns
    seg = table.segments_S5
    row, step, length = seg[at_S, col_S], seg[at_S, col_S + 1], seg[at_S, 4]
    last_G = np.cumsum([len(g) for _, g in groups])  # each group's end in x_X
    seg_G1 = np.concatenate([[0], seg_X.cumsum()[last_G - 1]]).astype(np.int64)
    out = _Side.many(row, step, length, seg_G1)
    for side in out:
        if side.mode == "view":  # staged ops joined into one contiguous run: still a copy
            side.mode = "runs"
    return out


def _spans(
    table: TransferTable, plan_T: np.ndarray, n_plans: int
) -> list[dict[int, tuple[int, int]]]:
    """Per plan, ``owner -> (lo, hi)``: the source rows its sends and local copies read, from
    ``table`` (every plan's transfers, :meth:`~mopd.bridge.plan.TransferTable.join`; transfer
    ``t`` is plan ``plan_T[t]``'s) in one pass."""
    out: list[dict[int, tuple[int, int]]] = [{} for _ in range(n_plans)]
    head, seg = table.head_T5, table.segments_S5
    if not head.shape[0]:
        return out
    n_own = int(head[:, 1].max()) + 1
    key_T = np.where(head[:, 0] != RECV, plan_T * n_own + head[:, 1], -1)
    key_S = key_T.repeat(head[:, 4])
    reads = (key_S >= 0).ravel().nonzero()[0]
    if not reads.size:
        return out
    o = reads[key_S[reads].argsort(kind="stable")]
    row, step, length = seg[o, 0], seg[o, 1], seg[o, 4]
    key = key_S[o]
    new = np.ones(key.size, dtype=bool)  # where each key's reads start
    new[1:] = key[1:] != key[:-1]
    at = new.nonzero()[0]
    lo = np.minimum.reduceat(row + np.minimum(step, 0) * (length - 1), at).tolist()
    hi = np.maximum.reduceat(row + np.maximum(step, 0) * (length - 1) + 1, at).tolist()
    for k, a, b in zip(key[at].tolist(), lo, hi, strict=True):
        out[k // n_own][k % n_own] = (a, b)
    return out


def _fill(plan: RankPlan, slice_rows: int, num_owners: int) -> dict[int, torch.Tensor]:
    """``owner -> `` the slice-relative rows no transfer of that owner writes (zeroed)."""
    fill: dict[int, torch.Tensor] = {}
    d = plan.dest
    if d is None:
        return fill
    assert plan.owner_N is not None
    if d.compact:  # every real row is written: only the all-gather's padding is left
        for owner in range(num_owners):
            fill[owner] = torch.arange(d.slice_real(owner), d.slice_nominal(owner), dtype=_I64)
        return fill
    mine = np.full(slice_rows, -1, dtype=np.int64)
    mine[: d.slice_rows] = plan.owner_N[d.row_offset : d.row_offset + d.slice_rows]
    for owner in range(num_owners):
        fill[owner] = _t((mine != owner).ravel().nonzero()[0])
    return fill


def plan_digest(plan: RankPlan) -> str:
    """A content hash of a rank's plan (peers, owners and segments): schedules cache on it."""
    return plan_digests([plan])[0]


def plan_digests(plans: Sequence[RankPlan]) -> list[str]:
    """:func:`plan_digest` of each plan: its rank and slice, then its transfer table (the
    head's :data:`~mopd.bridge.plan.TRANSFER_COLUMNS`, then the segments), then its row
    owners (as runs: where each starts, and its owner)."""
    out = []
    for p in plans:
        d = p.dest
        h = Digest(
            repr((p.rank, None if d is None else tuple(d.__dict__.values()))),
            p.table.head_T5,
            p.table.segments_S5,
            size=16,
        )
        if p.owner_N is not None:  # as its runs of one owner: starts, owners (and the size)
            own = np.asarray(p.owner_N, dtype=np.int64)
            start = np.ones(own.size, dtype=bool)
            start[1:] = own[1:] != own[:-1]
            at = start.nonzero()[0]
            h.update(np.concatenate([[own.size], at, own[at]]))
        out.append(h.hexdigest())
    return out


@dataclass(frozen=True, kw_only=True, eq=False)
class RankSchedule:
    """One rank's share of one micro-batch's plan, with pack/unpack decisions and counts.

    Attributes:
        rank: the global rank.
        digest: the key it is cached under: :func:`plan_digest` of the plan it was built from
            (the executor appends the slice rows and row widths).
        sends, recvs, locals: the operations, in plan order.
        dest: this rank's slice, or ``None``.
        owner_N: ``[N]`` int64 owner of each row of the destination group's buffer (``-1``:
            none), or ``None``.
        fill: ``owner -> [F]`` slice-relative rows no transfer of that owner writes (zeroed):
            in the compact form only the padding rows of a buffer sized for an all-gather of
            equal slices (at most ``group_size - 1`` per owner, all at the buffer's end); in the
            layout form also the rows another owner fills.
        slice_rows: layout form: rows of this rank's slice in every output buffer (equal for
            every rank of the destination group, so the TP all-gather moves equal slices);
            compact form: per owner, :meth:`slice_rows_of`.
        send_stage_rows, recv_stage_rows: ``owner -> rows`` of its send / receive staging buffer.
        pack_sides, unpack_sides: ``owner -> side`` over all of its staged sends' / receives'
            rows, in staging order (one launch per owner and direction).
        src_span: ``owner -> (lo, hi)`` source rows this rank reads (integrity checksums them).
        send_src_rel, local_src_rel: per send / local copy, its ``[R]`` source rows minus the
            owner's ``lo``.
    """

    rank: int
    digest: str
    sends: tuple[_Op, ...]
    recvs: tuple[_Op, ...]
    locals: tuple[_Local, ...]
    dest: DestSlot | None
    owner_N: torch.Tensor | None
    fill: dict[int, torch.Tensor]
    slice_rows: int
    send_stage_rows: dict[int, int]
    recv_stage_rows: dict[int, int]
    pack_sides: dict[int, _Side]
    unpack_sides: dict[int, _Side]
    src_span: dict[int, tuple[int, int]]
    row_bytes: tuple[int, ...]

    @functools.cached_property
    def send_src_rel(self) -> tuple[torch.Tensor, ...]:
        return tuple(o.side.rows - self.src_span[o.owner][0] for o in self.sends)

    @functools.cached_property
    def local_src_rel(self) -> tuple[torch.Tensor, ...]:
        return tuple(x.src.rows - self.src_span[x.owner][0] for x in self.locals)

    def slice_rows_of(self, owner: int) -> int:
        """Rows of this rank's slice of ``owner``'s output buffer (the all-gather's equal
        slices; compact form: per owner)."""
        d = self.dest
        if d is None:
            return self.slice_rows
        return d.slice_nominal(owner) if d.compact else self.slice_rows

    def slice_start(self, owner: int) -> int:
        """First row of this rank's slice in ``owner``'s output buffer."""
        return 0 if self.dest is None else self.dest.slot * self.slice_rows_of(owner)

    def real_rows(self, owner: int) -> int:
        """Rows of this rank's slice of ``owner``'s buffer that hold tokens or layout rows
        (the rest pads the all-gather)."""
        d = self.dest
        if d is None:
            return 0
        return d.slice_real(owner) if d.compact else d.slice_rows

    def out_rows(self, owner: int) -> int:
        """Rows of ``owner``'s delivered buffer (compact: its tokens; else the layout's)."""
        return 0 if self.dest is None else self.dest.out_rows(owner)

    def padded_rows(self, owner: int) -> int:
        """Rows of ``owner``'s output buffer (room for an all-gather of equal slices)."""
        d = self.dest
        if d is None:
            return 0
        return d.padded(owner) if d.compact else d.padded_rows

    @functools.cached_property
    def fill_checked(self) -> dict[int, torch.Tensor]:
        """``owner -> `` the :attr:`fill` rows inside this rank's real slice (integrity checks
        that they are zero); the same tensor as in :attr:`fill` when all of them are."""
        out = {}
        for owner, rows in self.fill.items():
            n = self.real_rows(owner)
            inside = rows < n
            out[owner] = rows if bool(inside.all()) else rows[inside]
        return out

    @staticmethod
    def build(
        plan: RankPlan,
        *,
        slice_rows: int,
        num_owners: int,
        row_bytes: Sequence[int],
        digest: str | None = None,
    ) -> RankSchedule:
        """The schedule of ``plan`` (pure, host tensors only): :meth:`build_many` of one.

        ``slice_rows``: rows of this rank's slice in the output buffer (the destination group's
        equal slice, :attr:`~mopd.bridge.catalog.DestGroup.slice_rows`; 0 without a destination).
        ``digest``: :func:`plan_digest` of ``plan`` when the caller has it already.
        """
        return RankSchedule.build_many(
            [plan],
            slice_rows=[slice_rows],
            num_owners=num_owners,
            row_bytes=row_bytes,
            digests=None if digest is None else [digest],
        )[0]

    @staticmethod
    def build_many(
        plans: Sequence[RankPlan],
        *,
        slice_rows: Sequence[int],
        num_owners: int,
        row_bytes: Sequence[int],
        digests: Sequence[str] | None = None,
    ) -> list[RankSchedule]:
        """The schedules of several plans (a step's micro-batches, each its own), the sides of
        all their transfers found in one batch (:meth:`_Side.many`), their staging in another.

        ``slice_rows``: per plan, as :meth:`build`'s; ``digests``: per plan, its
        :func:`plan_digest` when the caller has it.
        """
        digests = plan_digests(plans) if digests is None else digests
        every = TransferTable.join([p.table for p in plans])  # every plan's transfers
        src_x, dst_x = _sides(every)  # both sides of each, one batch per side
        at = 0
        built = []
        staged: list[tuple[int, str, int, list[int]]] = []
        for k, plan in enumerate(plans):
            tab = plan.table
            send_rows: dict[int, int] = {}
            recv_rows: dict[int, int] = {}
            sends: list[_Op] = []
            recvs: list[_Op] = []
            locals_: list[_Local] = []
            parts: dict[tuple[str, int], list[int]] = {}  # sends' owners first (plan order)
            off = tab.off_T1.tolist()
            for t, (kind, owner, src_rank, dst_rank, _) in enumerate(tab.head_T5.tolist()):
                x, at = at, at + 1
                if kind == LOCAL:
                    seg = tab.segments_S5[off[t] : off[t + 1]]
                    unit = src_x._unit[x] and dst_x._unit[x]
                    locals_.append(_local(owner, seg, src_x[x], dst_x[x], unit=unit))
                    continue
                send = kind == SEND
                mine, peers = (src_x, dst_x) if send else (dst_x, src_x)
                op = _Op(
                    owner=owner,
                    peer=dst_rank if send else src_rank,
                    stage_off=-1,
                    mine=mine,
                    peers=peers,
                    at=x,
                )
                if op.mode != "view":
                    rows = send_rows if send else recv_rows
                    op.stage_off = rows.get(owner, 0)
                    rows[owner] = op.stage_off + op.count
                    parts.setdefault(("s" if send else "r", owner), []).append(x)
                (sends if send else recvs).append(op)
            staged += [(k, kind, o, sides) for (kind, o), sides in parts.items()]
            built.append((sends, recvs, locals_, send_rows, recv_rows))
        # every plan's staged ops, per (plan, direction, owner): one launch each
        packed = _stage_many(every, [(kind == "s", xs) for _, kind, _, xs in staged])
        pack: list[dict[int, _Side]] = [{} for _ in plans]
        unpack: list[dict[int, _Side]] = [{} for _ in plans]
        for (k, kind, owner, _), side in zip(staged, packed, strict=True):
            (pack if kind == "s" else unpack)[k][owner] = side
        plan_T = np.arange(len(plans)).repeat([p.table.size for p in plans])
        spans = _spans(every, plan_T, len(plans))
        out_s = []
        for k, plan in enumerate(plans):
            sends, recvs, locals_, send_rows, recv_rows = built[k]
            out_s.append(
                RankSchedule(
                    rank=plan.rank,
                    digest=digests[k],
                    sends=tuple(sends),
                    recvs=tuple(recvs),
                    locals=tuple(locals_),
                    dest=plan.dest,
                    owner_N=None if plan.owner_N is None else _t(plan.owner_N),
                    fill=_fill(plan, slice_rows[k], num_owners),
                    slice_rows=slice_rows[k],
                    send_stage_rows=send_rows,
                    recv_stage_rows=recv_rows,
                    pack_sides=pack[k],
                    unpack_sides=unpack[k],
                    src_span=spans[k],
                    row_bytes=tuple(row_bytes),
                )
            )
        return out_s

    def counts(self) -> dict[str, int]:
        """This rank's figures: ``messages``; ``send/recv/local_bytes``; ``pack/unpack_bytes``
        (staged rows, each moved once); ``local_passes``; ``pack_launches`` /
        ``unpack_launches``; ``fill_rows``."""
        rb = self.row_bytes
        return {
            "messages": len(self.sends) + len(self.recvs),
            "send_bytes": sum(o.count * rb[o.owner] for o in self.sends),
            "recv_bytes": sum(o.count * rb[o.owner] for o in self.recvs),
            "pack_bytes": sum(o.count * rb[o.owner] for o in self.sends if o.mode != "view"),
            "unpack_bytes": sum(o.count * rb[o.owner] for o in self.recvs if o.mode != "view"),
            "local_bytes": sum(x.src.count * rb[x.owner] for x in self.locals),
            "local_passes": len(self.locals),
            "pack_launches": len(self.pack_sides),
            "unpack_launches": len(self.unpack_sides),
            "fill_rows": sum(int(f.numel()) for f in self.fill.values()),
        }

    def data_path_indices(self, *, integrity: bool = False) -> list[torch.Tensor]:
        """The int64 host tensors the data path reads (uploaded together by :class:`DeviceIndices`)."""
        out: list[torch.Tensor] = []
        for side in (*self.pack_sides.values(), *self.unpack_sides.values()):
            if side.mode == "runs":
                out += [side.run_row, side.run_pos, side.run_len]
            else:
                out.append(side.rows)
        for lop in self.locals:
            if lop.mode == "runs":
                out += [lop.joint_src, lop.joint_dst, lop.joint_len]
            elif lop.mode == "gather":
                out.append(lop.src.rows)
            else:
                out.append(lop.dst.rows)
        out += [rows for rows in self.fill.values() if rows.numel()]
        if integrity:
            out += [*self.send_src_rel, *self.local_src_rel]
            out += [op.side.rows for op in self.recvs] + [x.dst.rows for x in self.locals]
            out += [rows for rows in self.fill_checked.values() if rows.numel()]
        return out


class DeviceIndices:
    """A schedule's index tensors on one device, uploaded together: one copy per schedule.

    The host tensors given at construction are concatenated into one int64 buffer (pinned when
    ``device`` is CUDA) and copied with ``non_blocking=True`` on the current stream: the host does
    not wait, and the caching host allocator keeps the pinned block until the copy has run.
    Calling it, ``dev(t)``, returns ``t``'s device view (same shape); a tensor given twice is
    uploaded once. A tensor not given up front is uploaded the same way on its first lookup
    (``late_uploads``).

    Streams: an upload is ordered on the stream current when it was made. A lookup from another
    stream makes that stream wait for the upload (an event, once per stream) and records the
    stream on the device buffer, so the caching allocator does not hand the memory out again
    while that stream may still read it.

    Lookups are by identity (``id(t)``): keep the host tensors alive as long as this object (the
    executor keeps both with the schedule).
    """

    def __init__(self, tensors: Sequence[torch.Tensor], device: torch.device) -> None:
        self.device = device
        self.uploads = 0
        self.late_uploads = 0
        self._views: dict[int, tuple[torch.Tensor, int]] = {}
        self._hosts: list[torch.Tensor] = []
        self._uploads: list[tuple[torch.Tensor, Any, set[int]]] = []
        self._upload(list(tensors))

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on :attr:`device` (a view of an upload), ready on the current stream."""
        got = self._views.get(id(t))
        if got is None:
            self.late_uploads += 1
            self._upload([t])
            got = self._views[id(t)]
        view, upload = got
        if self.device.type == "cuda":
            self._ready_on_current_stream(upload)
        return view

    def _upload(self, tensors: list[torch.Tensor]) -> None:
        seen: set[int] = set(self._views)
        fresh = []
        for t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                fresh.append(t)
        tensors = fresh
        if not tensors:
            return
        for t in tensors:
            if t.dtype != torch.int64 or t.device.type != "cpu":
                raise AssertionError(
                    f"schedule indices are int64 host tensors, got {t.dtype} on {t.device}"
                )
        cuda = self.device.type == "cuda"
        total = sum(t.numel() for t in tensors)
        host = torch.empty(total, dtype=torch.int64, pin_memory=cuda)
        torch.cat([t.reshape(-1) for t in tensors], out=host)
        flat = host.to(self.device, non_blocking=cuda)
        event, ready = None, set()
        if cuda:
            stream = torch.cuda.current_stream(self.device)
            event = torch.cuda.Event()
            event.record(stream)
            ready.add(stream.cuda_stream)
        self.uploads += 1
        self._uploads.append((flat, event, ready))
        off = 0
        for t in tensors:
            n = t.numel()
            self._views[id(t)] = (flat[off : off + n].view(t.shape), len(self._uploads) - 1)
            self._hosts.append(t)
            off += n

    def _ready_on_current_stream(self, upload: int) -> None:
        flat, event, ready = self._uploads[upload]
        stream = torch.cuda.current_stream(self.device)
        if stream.cuda_stream in ready:
            return
        stream.wait_event(event)
        flat.record_stream(stream)
        ready.add(stream.cuda_stream)
