"""The executor: runs one rank's share of a :class:`TransferPlan` with one batched send/recv.

Why this file exists: the plan says which rows go where; this file moves them, touching each row
at most once on each side. Per rank it derives a :class:`RankSchedule` (cached per plan): its
sends, receives and local copies in the plan's global order, and how each is packed or unpacked:

- a side whose rows form one contiguous run needs no pass: send from / receive into a view;
- otherwise rows are packed into (unpacked from) a per-peer contiguous view of one staging buffer
  per owner, with :func:`mopd.kernels.copy_runs` when the rows form long runs, else
  :func:`mopd.kernels.gather_rows` / :func:`mopd.kernels.scatter_rows`;
- a local copy (source replica on the destination rank) is one pass: ``copy_runs`` over runs that
  are contiguous on both sides, or one gather / scatter when one side is contiguous;
- destination rows no transfer writes (padding, rows of another owner) are zero-filled.

All sends and receives of all owners go into one ``batch_isend_irecv`` on the bridge group; every
rank issues the ops it shares with a peer in the plan's transfer order, so pairs match. The
returned :class:`ExchangeHandle` completes them on ``.wait()``, unpacks, and (when the student
has TP > 1 and keeps no SP shard) all-gathers each owner's buffer over the student TP group, in
place (``all_gather_into_tensor`` with this rank's slice as input). Data never leaves the device
of its tensors: CUDA tensors go over NCCL, CPU tensors over gloo. Kernels run with
``check_bounds=False`` (no host sync): plan rows are in range by construction, and buffer row
counts are validated against the layouts before planning. Staging buffers are reused
across calls with the same plan, dtype and device.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from mopd.bridge.groups import all_gather_flat
from mopd.bridge.planner import TransferPlan
from mopd.kernels import copy_runs, gather_rows, scatter_rows

__all__ = ["ExchangeHandle", "Executor", "RankSchedule", "row_runs"]

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


@dataclass(frozen=True, kw_only=True, eq=False)
class _Local:
    owner: int
    mode: str  # "runs", "gather" (dst contiguous), "scatter" (src contiguous)
    src: _Side
    dst: _Side
    joint_src: torch.Tensor
    joint_dst: torch.Tensor
    joint_len: torch.Tensor


@dataclass(frozen=True, kw_only=True, eq=False)
class RankSchedule:
    """One rank's share of a plan, in plan order, with pack/unpack decisions and counts.

    Attributes:
        rank: the global rank.
        sends, recvs, locals: the operations (private structure).
        dest_index: index into ``plan.dests`` of this rank's destination group, or ``-1``.
        slot: this rank's slice in its destination group.
        row_offset: first row of this rank's slice in the group's full buffer.
        fill: ``owner -> [F]`` slice-relative rows that no transfer writes (zero-filled).
        stats: bytes and passes for printing (see :meth:`counts`).
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

    @staticmethod
    def build(plan: TransferPlan, rank: int) -> RankSchedule:
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
                side = _side(src_rows)
                off = -1
                if side.mode != "view":
                    off = send_rows.get(owner, 0)
                    send_rows[owner] = off + src_rows.numel()
                sends.append(
                    _Op(owner=owner, peer=dst, count=src_rows.numel(), stage_off=off, side=side)
                )
            if dst == rank:
                side = _side(dst_rows)
                off = -1
                if side.mode != "view":
                    off = recv_rows.get(owner, 0)
                    recv_rows[owner] = off + dst_rows.numel()
                recvs.append(
                    _Op(owner=owner, peer=src, count=dst_rows.numel(), stage_off=off, side=side)
                )
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
        )

    def counts(self) -> dict[str, int]:
        """Bytes and passes: ``send/recv/local_bytes``, ``pack/unpack_bytes``, ``messages``, ``local_passes``."""
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
            "fill_rows": sum(int(f.numel()) for f in self.fill.values()),
        }


class _Dev:
    """A schedule's index tensors moved to one device, once."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cache: dict[int, torch.Tensor] = {}

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        got = self._cache.get(id(t))
        if got is None:
            got = t.to(self.device)
            self._cache[id(t)] = got
        return got


def _pack(src_NH: torch.Tensor, side: _Side, stage_RH: torch.Tensor, dev: _Dev) -> None:
    """Rows ``side.rows`` of ``src_NH`` -> contiguous ``stage_RH`` (one pass)."""
    if side.mode == "runs":
        copy_runs(
            src_NH,
            dev(side.run_buf_start),
            dev(side.run_pos),
            dev(side.run_len),
            stage_RH,
            check_bounds=False,
        )
    else:
        gather_rows(src_NH, dev(side.rows), out_RH=stage_RH, check_bounds=False)


def _unpack(stage_RH: torch.Tensor, side: _Side, out_NH: torch.Tensor, dev: _Dev) -> None:
    """Contiguous ``stage_RH`` -> rows ``side.rows`` of ``out_NH`` (one pass)."""
    if side.mode == "runs":
        copy_runs(
            stage_RH,
            dev(side.run_pos),
            dev(side.run_buf_start),
            dev(side.run_len),
            out_NH,
            check_bounds=False,
        )
    else:
        scatter_rows(stage_RH, dev(side.rows), out_NH, check_bounds=False)


def _local(src_NH: torch.Tensor, op: _Local, out_NH: torch.Tensor, dev: _Dev) -> None:
    n = op.src.rows.numel()
    if op.mode == "runs" and src_NH.device.type == "cpu" and n < MIN_AVG_RUN * op.joint_len.numel():
        # CPU only: the torch twin of copy_runs loops over runs in Python; many short runs are
        # cheaper as one gather plus one scatter (two passes; CUDA keeps the one-pass kernel)
        scatter_rows(
            gather_rows(src_NH, dev(op.src.rows), check_bounds=False),
            dev(op.dst.rows),
            out_NH,
            check_bounds=False,
        )
    elif op.mode == "runs":
        copy_runs(
            src_NH,
            dev(op.joint_src),
            dev(op.joint_dst),
            dev(op.joint_len),
            out_NH,
            check_bounds=False,
        )
    elif op.mode == "gather":
        gather_rows(
            src_NH,
            dev(op.src.rows),
            out_RH=out_NH[op.dst.first : op.dst.first + n],
            check_bounds=False,
        )
    elif op.mode == "scatter":
        scatter_rows(
            src_NH[op.src.first : op.src.first + n], dev(op.dst.rows), out_NH, check_bounds=False
        )
    else:  # pragma: no cover - every mode is handled above
        raise AssertionError(op.mode)


@dataclass(kw_only=True, eq=False)
class ExchangeHandle:
    """An exchange in flight. :meth:`wait` returns ``owner -> output`` once rows are in place."""

    works: list[Any]
    finish: Any
    release: Any
    timeout: datetime.timedelta
    outputs: dict[int, torch.Tensor]
    done: bool = False
    _result: dict[int, torch.Tensor] = field(default_factory=dict)

    def wait(self) -> dict[int, torch.Tensor]:
        """Complete the transfer (and the student TP all-gather); idempotent."""
        if not self.done:
            try:
                for w in self.works:
                    w.wait(self.timeout)
                self.finish()
            finally:  # a failed wait does not leave the plan marked in flight
                self.release()
            self.done = True
        return self.outputs


class Executor:
    """Runs plans for one global rank; caches schedules and staging buffers per plan.

    Args:
        rank: this process's global rank.
        timeout: for waiting on sends/receives and the TP all-gather.
    """

    def __init__(self, *, rank: int, timeout: datetime.timedelta) -> None:
        self.rank = rank
        self.timeout = timeout
        self._schedules: dict[str, RankSchedule] = {}
        self._stages: dict[tuple[Any, ...], torch.Tensor] = {}
        self._devs: dict[tuple[str, str], _Dev] = {}
        self._zeros: dict[tuple[Any, ...], torch.Tensor] = {}
        self._inflight: set[str] = set()

    def schedule(self, plan: TransferPlan) -> RankSchedule:
        """This rank's schedule for ``plan`` (built once per plan signature)."""
        s = self._schedules.get(plan.signature)
        if s is None:
            if len(self._schedules) > 16:
                self._schedules.clear()
                self._devs.clear()
                self._stages.clear()
            s = RankSchedule.build(plan, self.rank)
            self._schedules[plan.signature] = s
        return s

    def _stage(
        self, plan: TransferPlan, kind: str, owner: int, rows: int, like: torch.Tensor
    ) -> torch.Tensor:
        key = (plan.signature, kind, owner, like.dtype, like.device, like.shape[1])
        t = self._stages.get(key)
        if t is None or t.shape[0] < rows:
            t = torch.empty((rows, like.shape[1]), dtype=like.dtype, device=like.device)
            self._stages[key] = t
        return t

    def start(
        self,
        plan: TransferPlan,
        *,
        sources: Mapping[int, torch.Tensor],
        outputs: Mapping[int, torch.Tensor],
        group: Any | None,
        tp_group: Any | None = None,
        keep_slice: bool = False,
    ) -> ExchangeHandle:
        """Start this rank's share of ``plan``.

        Args:
            sources: ``owner -> [R, H]`` flat source rows this rank holds (as a replica).
            outputs: ``owner -> [N, H]`` the destination group's full flat buffer, or with
                ``keep_slice`` this rank's ``[N / tp, H]`` slice. Rows are overwritten.
            group: the bridge process group (point-to-point).
            tp_group: the destination group's all-gather group (ignored with ``keep_slice``).
        Returns:
            A handle; call ``.wait()`` before reading ``outputs``.
        """
        if plan.signature in self._inflight:
            raise RuntimeError(
                "an exchange with this plan is still in flight on this rank: call .wait() on its "
                "handle before starting the next one (they share staging buffers)"
            )
        sched = self.schedule(plan)
        dev_key = next(iter(outputs.values()), next(iter(sources.values()), None))
        dev = self._dev(dev_key.device if dev_key is not None else torch.device("cpu"))
        off = 0 if keep_slice else sched.row_offset
        targets = {o: t[off : off + sched.slice_rows] for o, t in outputs.items()}
        # zero rows nobody writes (disjoint from every written row, so order does not matter)
        for owner, rows in sched.fill.items():
            if rows.numel():
                self._zero_rows(targets[owner], rows, dev)
        ops: list[dist.P2POp] = []
        pending: list[tuple[torch.Tensor, _Side, torch.Tensor]] = []
        for op in sched.sends:
            src = sources[op.owner]
            if op.side.mode == "view":
                buf = src[op.side.first : op.side.first + op.count]
            else:
                stage = self._stage(plan, "send", op.owner, sched.send_stage_rows[op.owner], src)
                buf = stage[op.stage_off : op.stage_off + op.count]
                _pack(src, op.side, buf, dev)
            ops.append(dist.P2POp(dist.isend, buf, op.peer, group=group))
        for op in sched.recvs:
            out = targets[op.owner]
            if op.side.mode == "view":
                buf = out[op.side.first : op.side.first + op.count]
            else:
                stage = self._stage(plan, "recv", op.owner, sched.recv_stage_rows[op.owner], out)
                buf = stage[op.stage_off : op.stage_off + op.count]
                pending.append((buf, op.side, out))
            ops.append(dist.P2POp(dist.irecv, buf, op.peer, group=group))
        works = dist.batch_isend_irecv(ops) if ops else []
        self._inflight.add(plan.signature)
        for op in sched.locals:
            _local(sources[op.owner], op, targets[op.owner], dev)

        def finish() -> None:
            for buf, side, out in pending:
                _unpack(buf, side, out, dev)
            if tp_group is not None and not keep_slice and sched.dest_index >= 0:
                n_ranks = len(plan.dests[sched.dest_index].ranks)
                if n_ranks > 1:
                    for owner in sorted(outputs):
                        all_gather_flat(
                            outputs[owner], targets[owner], group=tp_group, timeout=self.timeout
                        )

        return ExchangeHandle(
            works=works,
            finish=finish,
            release=lambda: self._inflight.discard(plan.signature),
            timeout=self.timeout,
            outputs=dict(outputs),
        )

    def _dev(self, device: torch.device) -> _Dev:
        key = (str(device), "")
        d = self._devs.get(key)
        if d is None:
            d = _Dev(device)
            self._devs[key] = d
        return d

    def _zero_rows(self, out_NH: torch.Tensor, rows: torch.Tensor, dev: _Dev) -> None:
        start, length = row_runs(rows)
        if start.numel() <= 8:
            for s, n in zip(rows[start].tolist(), length.tolist(), strict=True):
                out_NH[s : s + n].zero_()
            return
        key = (out_NH.dtype, out_NH.device, out_NH.shape[1])
        z = self._zeros.get(key)
        if z is None or z.shape[0] < rows.numel():
            z = torch.zeros(
                (rows.numel(), out_NH.shape[1]), dtype=out_NH.dtype, device=out_NH.device
            )
            self._zeros[key] = z
        scatter_rows(z[: rows.numel()], dev(rows), out_NH, check_bounds=False)
