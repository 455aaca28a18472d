"""One rank's schedule of a transfer plan, and its index tensors on the device.

Why this file exists: the planner says which rows go where for every rank; the executor needs, for
its own rank, the sends, receives and local copies in the plan's order and how each touches its
buffers: no pass for a contiguous view, block copies for long runs, per-row gather/scatter
otherwise (:class:`RankSchedule`, built once per plan and cached by the executor). The kernels read
a schedule's row indices on the data's device: :class:`DeviceIndices` puts all of them there with
one asynchronous host-to-device copy per schedule, so a new plan never stalls the host on one
synchronous copy per index tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mopd.bridge.planner import TransferPlan

__all__ = [
    "MIN_AVG_RUN",
    "DeviceIndices",
    "RankSchedule",
    "row_runs",
]

_I64 = torch.int64
#: Average run length from which rows move as block copies (``copy_runs``) rather than per row.
MIN_AVG_RUN = 16


def row_runs(*rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Maximal runs where every given ``[R]`` row array advances by one: ``(start_K, length_K)``.

    ``start_K`` indexes into the arrays (position ``i``), not their values.
    """
    n = rows[0].numel()
    if n == 0:
        return torch.empty(0, dtype=_I64), torch.empty(0, dtype=_I64)
    brk = torch.zeros(n - 1, dtype=torch.bool)
    for r in rows:
        brk |= r[1:] != r[:-1] + 1
    start = torch.cat([torch.zeros(1, dtype=_I64), torch.nonzero(brk).reshape(-1) + 1])
    length = torch.diff(torch.cat([start, torch.tensor([n], dtype=_I64)]))
    return start, length


@dataclass(frozen=True, kw_only=True, eq=False)
class _Side:
    """How one side of a transfer touches its buffer: ``mode`` in ``view``, ``runs``, ``index``."""

    mode: str
    rows: torch.Tensor  # [R] rows of the buffer
    first: int  # rows[0] (for ``view``)
    run_buf_start: torch.Tensor  # [K] buffer rows where runs start
    run_len: torch.Tensor  # [K]
    run_pos: torch.Tensor  # [K] positions in the transfer (staging offset) where runs start


def _op(
    owner: int,
    peer: int,
    rows: torch.Tensor,
    peer_rows: torch.Tensor,
    staged_rows: dict[int, int],
) -> _Op:
    """One send (or receive) of ``rows`` of this rank's buffer to (from) ``peer``.

    Rows that are not one contiguous view get the next slot of ``owner``'s staging buffer;
    ``staged_rows`` counts the rows staged so far per owner (updated in place).
    """
    side = _side(rows)
    off = -1
    if side.mode != "view":
        off = staged_rows.get(owner, 0)
        staged_rows[owner] = off + rows.numel()
    return _Op(
        owner=owner, peer=peer, count=rows.numel(), stage_off=off, side=side, peer_rows=peer_rows
    )


def _side(rows: torch.Tensor) -> _Side:
    start, length = row_runs(rows)
    if start.numel() <= 1:
        mode = "view"
    elif rows.numel() // start.numel() >= MIN_AVG_RUN:
        mode = "runs"
    else:
        mode = "index"
    return _Side(
        mode=mode,
        rows=rows,
        first=int(rows[0]) if rows.numel() else 0,
        run_buf_start=rows[start],
        run_len=length,
        run_pos=start,
    )


@dataclass(frozen=True, kw_only=True, eq=False)
class _Op:
    owner: int
    peer: int
    count: int
    stage_off: int  # offset in this owner's staging buffer (send or recv), -1 when none
    side: _Side
    peer_rows: torch.Tensor  # [R] the other side's rows (for integrity messages)


@dataclass(frozen=True, kw_only=True, eq=False)
class _Local:
    owner: int
    mode: str  # "runs", "gather" (dst contiguous), "scatter" (src contiguous)
    src: _Side
    dst: _Side
    joint_src: torch.Tensor
    joint_dst: torch.Tensor
    joint_len: torch.Tensor


def _staged_sides(ops: Sequence[_Op]) -> dict[int, _Side]:
    """``owner -> side`` over the rows of ``ops`` that are staged (not views), in staging order.

    Staging offsets are handed out in op order per owner (:func:`_op`), so the concatenated
    ``[R]`` rows are the owner's whole staging buffer, row for row. Every staged op has two
    runs or more and joining ops can only merge runs at their ends, so the joint side is never
    one contiguous view.
    """
    rows: dict[int, list[torch.Tensor]] = {}
    for op in ops:
        if op.side.mode != "view":
            rows.setdefault(op.owner, []).append(op.side.rows)
    out: dict[int, _Side] = {}
    for owner, parts in rows.items():
        side = _side(torch.cat(parts))
        assert side.mode != "view", "staged rows joined into one contiguous run"
        out[owner] = side
    return out


@dataclass(frozen=True, kw_only=True, eq=False)
class RankSchedule:
    """One rank's share of a plan, in plan order, with pack/unpack decisions and counts.

    Attributes:
        rank: the global rank.
        sends, recvs, locals: the operations (private structure).
        dest_index: index into ``plan.dests`` of this rank's destination group, or ``-1``.
        slot: this rank's slice in its destination group.
        row_offset: first row of this rank's slice in the group's full buffer.
        slice_rows: rows of that slice (the destination group's rows / its TP size; 0 for a
            rank that receives nothing).
        fill: ``owner -> [F]`` slice-relative rows that no transfer writes (zero-filled).
        send_stage_rows, recv_stage_rows: ``owner -> rows`` of its send / receive staging buffer
            (the sends / receives that are not views, each at its ``stage_off``).
        pack_sides, unpack_sides: ``owner -> side`` over all of its staged sends' / receives'
            rows in staging order: the whole staging buffer of an owner is packed (unpacked) by
            one kernel launch, not one per peer.
        row_bytes: bytes per row of each owner (teacher).
        src_span: ``owner -> (lo, hi)`` the source rows this rank reads (sends and local
            copies); integrity mode checksums that span.
        send_src_rel, local_src_rel: per send / local copy, its ``[R]`` source rows minus the
            owner's ``lo`` (indices into the span's checksums).
    """

    rank: int
    sends: tuple[_Op, ...]
    recvs: tuple[_Op, ...]
    locals: tuple[_Local, ...]
    dest_index: int
    slot: int
    row_offset: int
    slice_rows: int
    send_stage_rows: dict[int, int]
    recv_stage_rows: dict[int, int]
    fill: dict[int, torch.Tensor]
    row_bytes: tuple[int, ...]
    src_span: dict[int, tuple[int, int]] = field(default_factory=dict)
    pack_sides: dict[int, _Side] = field(default_factory=dict)
    unpack_sides: dict[int, _Side] = field(default_factory=dict)
    send_src_rel: tuple[torch.Tensor, ...] = ()
    local_src_rel: tuple[torch.Tensor, ...] = ()

    @staticmethod
    def build(plan: TransferPlan, rank: int) -> RankSchedule:
        """Global rank ``rank``'s schedule of ``plan`` (pure, host tensors only).

        Walks the plan's transfers for this rank in plan order: a transfer to itself with
        ``plan.local_copy`` is a local copy, the others a send and/or a receive; each side is
        a view, runs or per-row indices (:func:`_side`); destination rows are relative to this
        rank's slice.
        """
        dest_index, slot = -1, 0
        for i, d in enumerate(plan.dests):
            if rank in d.ranks:
                dest_index, slot = i, d.ranks.index(rank)
                break
        slice_rows = plan.dests[dest_index].slice_rows if dest_index >= 0 else 0
        row_offset = slot * slice_rows
        sends: list[_Op] = []
        recvs: list[_Op] = []
        locals_: list[_Local] = []
        send_rows: dict[int, int] = {}
        recv_rows: dict[int, int] = {}
        written: dict[int, list[torch.Tensor]] = {}
        for tid in plan.transfer_ids(rank).tolist():
            owner, src, dst = (int(x) for x in plan.transfers_T5[tid, :3])
            src_rows, dst_rows = plan.rows_of(tid)
            if dst == rank:
                dst_rows = dst_rows - row_offset
                written.setdefault(owner, []).append(dst_rows)
            if src == rank and dst == rank and plan.local_copy:
                s, d = _side(src_rows), _side(dst_rows)
                js, jl = row_runs(src_rows, dst_rows)
                # one pass always: block copies over joint runs, or one gather / scatter when
                # one side is contiguous and the runs are short
                if js.numel() <= 1 or src_rows.numel() // js.numel() >= MIN_AVG_RUN:
                    mode = "runs"
                elif d.mode == "view":
                    mode = "gather"
                elif s.mode == "view":
                    mode = "scatter"
                else:
                    mode = "runs"
                locals_.append(
                    _Local(
                        owner=owner,
                        mode=mode,
                        src=s,
                        dst=d,
                        joint_src=src_rows[js],
                        joint_dst=dst_rows[js],
                        joint_len=jl,
                    )
                )
                continue
            if src == rank:
                sends.append(_op(owner, dst, src_rows, dst_rows, send_rows))
            if dst == rank:
                recvs.append(_op(owner, src, dst_rows, src_rows, recv_rows))
        span: dict[int, tuple[int, int]] = {}
        for rows in [(o.owner, o.side.rows) for o in sends] + [
            (x.owner, x.src.rows) for x in locals_
        ]:
            owner, r = rows
            if r.numel():
                lo, hi = int(r.min()), int(r.max()) + 1
                old = span.get(owner, (lo, hi))
                span[owner] = (min(lo, old[0]), max(hi, old[1]))
        fill: dict[int, torch.Tensor] = {}
        if dest_index >= 0:
            for owner in range(plan.num_owners):
                mask = torch.ones(slice_rows, dtype=torch.bool)
                for w in written.get(owner, []):
                    mask[w] = False
                fill[owner] = torch.nonzero(mask).reshape(-1)
        return RankSchedule(
            rank=rank,
            sends=tuple(sends),
            recvs=tuple(recvs),
            locals=tuple(locals_),
            dest_index=dest_index,
            slot=slot,
            row_offset=row_offset,
            slice_rows=slice_rows,
            send_stage_rows=send_rows,
            recv_stage_rows=recv_rows,
            fill=fill,
            row_bytes=plan.row_bytes,
            src_span=span,
            pack_sides=_staged_sides(sends),
            unpack_sides=_staged_sides(recvs),
            send_src_rel=tuple(o.side.rows - span.get(o.owner, (0, 0))[0] for o in sends),
            local_src_rel=tuple(x.src.rows - span.get(x.owner, (0, 0))[0] for x in locals_),
        )

    def counts(self) -> dict[str, int]:
        """This rank's figures: ``messages``; ``send/recv/local_bytes``; ``pack/unpack_bytes``
        (staged rows: each moved once, so pack bytes <= send bytes is one pass); ``local_passes``;
        ``pack_launches`` / ``unpack_launches`` (kernel launches, one per owner and side);
        ``fill_rows`` (rows zero-filled)."""
        rb = self.row_bytes
        local_passes = len(self.locals)
        return {
            "messages": len(self.sends) + len(self.recvs),
            "send_bytes": sum(o.count * rb[o.owner] for o in self.sends),
            "recv_bytes": sum(o.count * rb[o.owner] for o in self.recvs),
            "pack_bytes": sum(o.count * rb[o.owner] for o in self.sends if o.side.mode != "view"),
            "unpack_bytes": sum(o.count * rb[o.owner] for o in self.recvs if o.side.mode != "view"),
            "local_bytes": sum(int(x.src.rows.numel()) * rb[x.owner] for x in self.locals),
            "local_passes": local_passes,
            "pack_launches": len(self.pack_sides),
            "unpack_launches": len(self.unpack_sides),
            "fill_rows": sum(int(f.numel()) for f in self.fill.values()),
        }

    def data_path_indices(self, *, integrity: bool = False) -> list[torch.Tensor]:
        """The ``[K]`` / ``[R]`` int64 host tensors the data path reads, in plan order.

        Packing and unpacking (per owner: run starts, positions and lengths for ``runs`` sides,
        rows for ``index`` sides), local copies (joint runs, or the non-contiguous side's rows)
        and the zero-filled rows; with ``integrity``, also what the checks read (source rows
        relative to the checksummed span, destination rows of every receive and local copy).
        """
        out: list[torch.Tensor] = []
        for side in (*self.pack_sides.values(), *self.unpack_sides.values()):
            if side.mode == "runs":
                out += [side.run_buf_start, side.run_pos, side.run_len]
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
        return out  # a tensor may appear twice: DeviceIndices uploads it once


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

    Args:
        tensors: ``[*]`` int64 host tensors (e.g. :meth:`RankSchedule.data_path_indices`).
        device: where the kernels read them.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], device: torch.device) -> None:
        self.device = device
        #: host-to-device copies made (one per schedule, plus ``late_uploads``).
        self.uploads = 0
        #: lookups of tensors that were not given at construction.
        self.late_uploads = 0
        # id(host tensor) -> (its device view, index of the upload holding it)
        self._views: dict[int, tuple[torch.Tensor, int]] = {}
        self._hosts: list[torch.Tensor] = []  # keeps ids unique while cached
        # per upload: (device buffer, event after the copy, stream handles it is ready on)
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
        tensors = [t for t in tensors if not (id(t) in seen or seen.add(id(t)))]
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
