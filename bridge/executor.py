"""The executor: runs one rank's share of a :class:`TransferPlan` with one batched send/recv.

Why this file exists: the plan says which rows go where; this file moves them, touching each row
at most once on each side. Per rank it derives a :class:`~mopd.bridge.schedule.RankSchedule`
(cached per plan, with its index tensors put on the device in one asynchronous copy): its sends,
receives and local copies in the plan's global order, and how each is packed or unpacked:

- a side whose rows form one contiguous run needs no pass: send from / receive into a view;
- otherwise rows are packed into (unpacked from) a per-peer contiguous view of one staging buffer
  per owner; one kernel launch packs (unpacks) all peers' views of an owner at once:
  :func:`mopd.kernels.copy_runs` when the rows form long runs, else
  :func:`mopd.kernels.gather_rows` / :func:`mopd.kernels.scatter_rows`;
- a local copy (source replica on the destination rank) is one pass: ``copy_runs`` over runs that
  are contiguous on both sides, or one gather / scatter when one side is contiguous;
- destination rows no transfer writes (padding, rows of another owner) are zero-filled.

All sends and receives of all owners go into one ``batch_isend_irecv`` on the bridge group; every
rank issues the ops it shares with a peer in the plan's transfer order, so pairs match. The
returned :class:`ExchangeHandle` completes them on ``.wait()``, unpacks, and (when the student
has TP > 1 and keeps no SP shard) all-gathers each owner's buffer over the student TP group, in
place (:func:`mopd.bridge.groups.all_gather_flat` with this rank's slice as input). Data never leaves the device
of its tensors: CUDA tensors go over NCCL, CPU tensors over gloo. Kernels run with
``check_bounds=False`` (no host sync): plan rows are in range by construction, and buffer row
counts are validated against the layouts before planning. Staging buffers are reused
across calls (a pool per owner and dtype, grown to the largest need, one buffer per exchange in
flight); schedules are kept for the last ``max_schedules`` plans.

Streams (CUDA): one stream per exchange. ``start`` queues the packing and the sends/receives on
the current stream, ``wait`` makes the current stream wait for them and queues the unpacking and
the TP all-gather there; the staging buffers, the zero rows and the checksums are reused on
the assumption that the next exchange runs on the same stream (or one ordered after it), as the
outputs must be read on it. Only the schedule's index tensors are safe on any stream
(:class:`~mopd.bridge.schedule.DeviceIndices`). An exchange started while an earlier one that
writes into the same outputs is in flight completes the earlier one first, as its ``wait()``
would (on the ranks that hold such outputs; the others are not affected).

Reliability (issue 7): one deadline, ``timeout`` from the start of :meth:`ExchangeHandle.wait`,
covers everything that call waits on (earlier flights, the transfers, the TP all-gathers, the
integrity verdict); each wait gets the time left. That host-side deadline applies to gloo (CPU
tensors). CUDA tensors (NCCL) are waited on without a host timeout, so ``wait()`` only makes the
current stream wait and never blocks the host (:func:`mopd.bridge.groups.wait_work`); hangs are
then caught by the process groups' own timeout (``GroupPool(timeout=...)``, NCCL's watchdog). A
transfer that misses its deadline, or fails because a peer died, raises a
:class:`~mopd.bridge.errors.BridgeTimeoutError` / :class:`~mopd.bridge.errors.BridgeCommError`
naming this rank, the peers whose messages did not complete, and the timeout. After such a
failure the executor refuses further exchanges (:class:`~mopd.bridge.errors.BridgeStateError`):
the process group may still hold pending receives into old buffers, and a late message could be
matched to a later exchange. Handles complete in start order (waiting on a later handle completes
the earlier ones first), so every rank issues the student TP all-gathers in the same order. With
``integrity=True`` rows are checked end to end, the student TP all-gather included
(:mod:`mopd.bridge.integrity`); ``wait()`` is then a collective over the bridge group (every
rank's verdict is all-gathered, on the gloo metadata group when there is one, so all raise
alike) and blocks the host (the mismatch counts are read there).

Every rank of the bridge group must call ``wait()`` on every handle, teacher-only ranks too: the
staging buffers of an exchange return to the pool only there. More than ``max_schedules``
exchanges in flight on one rank warn once (buffers held by handles nobody waits on).
"""

from __future__ import annotations

import datetime
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mopd.bridge.errors import (
    BridgeCommError,
    BridgeError,
    BridgeIntegrityError,
    BridgeStateError,
    BridgeTimeoutError,
)
from mopd.bridge.groups import all_gather_flat, group_moves_cuda, wait_work
from mopd.bridge.integrity import (
    CROSSING,
    TP_GATHER,
    BlockMismatch,
    decode_mismatches,
    encode_mismatches,
    format_mismatches,
    row_checksum,
)
from mopd.bridge.planner import TransferPlan
from mopd.bridge.schedule import DeviceIndices, RankSchedule, _Local, _Op, _Side, row_runs
from mopd.kernels import copy_runs, gather_rows, scatter_rows
from mopd.kernels.rows import rows_overlap

__all__ = [
    "DebugHook",
    "ExchangeHandle",
    "Executor",
    "buffers_overlap",
    "comm_failure",
]

#: ``hook(point, blocks)``: called at ``"packed"`` (send buffers, after packing, before posting),
#: ``"posted"`` (after the batch is posted), ``"received"`` (receive buffers, before
#: unpacking) and, in integrity mode, ``"gathered"`` (the slices the student TP all-gather
#: brought from the other TP ranks, before they are checked) with
#: ``(owner, peer_global_rank, rows_RH)`` blocks; tests use it to corrupt bytes in flight or to
#: fail a rank mid-exchange.
DebugHook = Callable[[str, list[tuple[int, int, torch.Tensor]]], None]
#: One integrity check: ``[R]`` bool "row differs", and (owner, source global rank, destination
#: rows relative to this rank's slice, source rows, stage) to report it.
_Check = tuple[torch.Tensor, tuple[int, int, torch.Tensor, torch.Tensor, int]]


def _pack(src_NH: torch.Tensor, side: _Side, stage_RH: torch.Tensor, dev: DeviceIndices) -> None:
    """Rows ``side.rows`` of ``src_NH`` -> contiguous ``stage_RH`` (one pass)."""
    if side.mode == "runs":
        copy_runs(
            src_NH,
            dev(side.run_buf_start),
            dev(side.run_pos),
            dev(side.run_len),
            stage_RH,
            num_rows=stage_RH.shape[0],
            check_bounds=False,
        )
    else:
        gather_rows(src_NH, dev(side.rows), out_RH=stage_RH, check_bounds=False)


def _unpack(stage_RH: torch.Tensor, side: _Side, out_NH: torch.Tensor, dev: DeviceIndices) -> None:
    """Contiguous ``stage_RH`` -> rows ``side.rows`` of ``out_NH`` (one pass)."""
    if side.mode == "runs":
        copy_runs(
            stage_RH,
            dev(side.run_pos),
            dev(side.run_buf_start),
            dev(side.run_len),
            out_NH,
            num_rows=stage_RH.shape[0],
            check_bounds=False,
        )
    else:
        scatter_rows(stage_RH, dev(side.rows), out_NH, check_bounds=False)


def _local(src_NH: torch.Tensor, op: _Local, out_NH: torch.Tensor, dev: DeviceIndices) -> None:
    """A local copy (source replica on this rank): rows of ``src_NH`` -> rows of ``out_NH``, one pass."""
    n = op.src.rows.numel()
    if op.mode == "runs":
        copy_runs(
            src_NH,
            dev(op.joint_src),
            dev(op.joint_dst),
            dev(op.joint_len),
            out_NH,
            num_rows=n,
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


def _left(deadline: float) -> datetime.timedelta:
    """The time left until ``deadline`` (``time.monotonic`` seconds), at least 1 ms."""
    return datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3))


def buffers_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True if the byte ranges of ``a`` and ``b`` (contiguous, same device) intersect.

    Each tensor is one row of its bytes for :func:`mopd.kernels.rows.rows_overlap`; tensors
    without storage (``meta``) or on different devices never overlap.
    """
    return rows_overlap(a.view(1, -1), b.view(1, -1))


def comm_failure(
    exc: BaseException, *, rank: int, what: str, timeout_s: float, elapsed_s: float
) -> BridgeError:
    """A :class:`BridgeTimeoutError` or :class:`BridgeCommError` for a failed wait on ``what``.

    A failure counts as a timeout when the transport says so or when the full timeout elapsed.
    """
    msg = str(exc)
    low = msg.lower()
    said_timeout = any(k in low for k in ("timed out", "timeout", "timing out", "time out"))
    if said_timeout or elapsed_s >= 0.98 * timeout_s:
        return BridgeTimeoutError(
            f"global rank {rank}: {what} did not complete within BridgeConfig.timeout_s="
            f"{timeout_s:g} s (waited {elapsed_s:.1f} s): a rank of the bridge group did not call "
            "the bridge (called on some ranks only), raised or exited before its part, or is "
            f"slower than the timeout. Transport said: {msg}"
        )
    return BridgeCommError(
        f"global rank {rank}: {what} failed after {elapsed_s:.1f} s (timeout_s={timeout_s:g}): "
        f"the transport reported an error, typically because a peer process died or aborted. "
        f"Transport said: {msg}"
    )


class _StagePool:
    """Staging buffers reused across exchanges.

    Per key ``(kind, owner, dtype, device, H)`` a free list; a buffer is held by one exchange in
    flight and returned on its ``wait()``; a buffer too small for a new plan is replaced by a
    larger one. Memory is therefore bounded by (exchanges in flight) x (largest need).
    """

    def __init__(self) -> None:
        self._free: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        self.allocations = 0
        self.bytes = 0
        self.buffers = 0

    def acquire(self, key: tuple[Any, ...], rows: int, like: torch.Tensor) -> torch.Tensor:
        free = self._free.get(key)
        if free:
            t = free.pop()
            if t.shape[0] >= rows:
                return t
            self.bytes -= t.numel() * t.element_size()
            self.buffers -= 1
        t = torch.empty((rows, like.shape[1]), dtype=like.dtype, device=like.device)
        self.allocations += 1
        self.buffers += 1
        self.bytes += t.numel() * t.element_size()
        return t

    def release(self, key: tuple[Any, ...], t: torch.Tensor) -> None:
        self._free.setdefault(key, []).append(t)

    def forget(self, t: torch.Tensor) -> None:
        """Drop a buffer for good (a failed exchange may still write into it)."""
        self.buffers -= 1
        self.bytes -= t.numel() * t.element_size()


@dataclass(kw_only=True, eq=False)
class _Flight:
    """One started exchange: what ``wait()`` needs to complete, check and release it."""

    works: list[Any]
    descs: list[str]
    finish: Callable[[float], None]  # finish(deadline): unpack, verify, all-gather
    device: torch.device  # where the transfers' tensors live (CUDA: NCCL, no host wait)
    staged: list[tuple[tuple[Any, ...], torch.Tensor]]
    outputs: list[torch.Tensor]
    done: bool = False
    error: BaseException | None = None


@dataclass(kw_only=True, eq=False)
class ExchangeHandle:
    """An exchange in flight. :meth:`wait` returns ``owner -> output`` once rows are in place.

    Handles of one executor complete in start order: waiting on a later handle first completes
    the earlier ones (every rank then runs the student TP all-gathers in the same order).
    """

    executor: Executor
    flight: _Flight
    timeout: datetime.timedelta
    outputs: dict[int, torch.Tensor]

    @property
    def done(self) -> bool:
        return self.flight.done

    def wait(self) -> dict[int, torch.Tensor]:
        """Complete the transfer (and the student TP all-gather); idempotent.

        Every rank of the bridge group calls it for every exchange (teacher-only ranks too: the
        staging buffers are released here). On CUDA it does not block the host: it makes the
        current stream wait on the transfers, and the unpacking and the TP all-gather are queued
        on that stream (read the outputs on it, or order your stream after it); with
        ``integrity=True`` it does block: the verdict needs the mismatch counts on the host. On
        CPU (gloo) it returns with the rows in place.

        Raises:
            BridgeTimeoutError: a transfer did not complete within the timeout, counted once from
                this call for everything it waits on (gloo; on NCCL the process group's timeout).
            BridgeCommError: the transport failed (a peer died).
            BridgeIntegrityError: integrity mode found corrupted rows (on every rank alike).
            BridgeStateError: an earlier exchange of this executor failed.
        """
        self.executor._complete_through(self.flight)
        return self.outputs


class Executor:
    """Runs plans for one global rank; caches schedules (LRU) and pools staging buffers.

    Args:
        rank: this process's global rank.
        timeout: deadline for each ``wait()`` (sends/receives, the TP all-gather, the integrity
            verdict; one deadline per call). Host-side for gloo only; NCCL waits rely on the
            process group's timeout (see the module doc).
        max_schedules: schedules kept (least recently used dropped first); also the number of
            exchanges in flight above which :meth:`start` warns (once).
        integrity: check every delivered row (:mod:`mopd.bridge.integrity`); makes ``wait()``
            a collective over the bridge group.
        debug_hook: see :data:`DebugHook` (tests only).
    """

    def __init__(
        self,
        *,
        rank: int,
        timeout: datetime.timedelta,
        max_schedules: int = 8,
        integrity: bool = False,
        debug_hook: DebugHook | None = None,
    ) -> None:
        if max_schedules < 1:
            raise ValueError(f"max_schedules must be >= 1, got {max_schedules}")
        self.rank = rank
        self.timeout = timeout
        self.max_schedules = max_schedules
        self.integrity = integrity
        self.debug_hook = debug_hook
        self._schedules: OrderedDict[str, RankSchedule] = OrderedDict()
        self._devs: dict[tuple[str, str], DeviceIndices] = {}
        self._pool = _StagePool()
        self._zeros: dict[tuple[Any, ...], torch.Tensor] = {}
        self._flights: list[_Flight] = []
        self.failure: str | None = None
        self.exchanges = 0
        self._warned_in_flight = False

    # --- bookkeeping ---------------------------------------------------------------------------

    def schedule(self, plan: TransferPlan) -> RankSchedule:
        """This rank's schedule for ``plan`` (built once per plan signature, LRU-bounded)."""
        s = self._schedules.get(plan.signature)
        if s is None:
            s = RankSchedule.build(plan, self.rank)
            self._schedules[plan.signature] = s
            while len(self._schedules) > self.max_schedules:
                old, _ = self._schedules.popitem(last=False)
                for k in [k for k in self._devs if k[0] == old]:
                    del self._devs[k]
        else:
            self._schedules.move_to_end(plan.signature)
        return s

    def memory_stats(self) -> dict[str, int]:
        """Buffers this executor holds: staging (bytes, buffers, allocations ever), zero rows,
        cached schedules, device index caches, exchanges in flight and started."""
        return {
            "staging_bytes": self._pool.bytes,
            "staging_buffers": self._pool.buffers,
            "staging_allocations": self._pool.allocations,
            "zeros_bytes": sum(z.numel() * z.element_size() for z in self._zeros.values()),
            "schedules": len(self._schedules),
            "device_caches": len(self._devs),
            "in_flight": len(self._flights),
            "exchanges": self.exchanges,
        }

    def check_usable(self) -> None:
        """Raise :class:`BridgeStateError` if an earlier exchange failed (local, no communication)."""
        if self.failure is not None:
            raise BridgeStateError(
                f"global rank {self.rank}: this bridge cannot be used after a failed exchange "
                f"({self.failure}); its process group may still hold sends/receives of that "
                "exchange, which a later one could match. Create new groups (a new GroupPool and "
                "create_bridge_groups) and a new HiddenStateBridge on every rank."
            )

    def mark_failed(self, exc: BaseException) -> None:
        """Refuse further exchanges (see :meth:`check_usable`); keeps the first cause."""
        if self.failure is None:
            self.failure = f"{type(exc).__name__}: {str(exc)[:300]}"

    # --- start ---------------------------------------------------------------------------------

    def start(
        self,
        plan: TransferPlan,
        *,
        sources: Mapping[int, torch.Tensor],
        outputs: Mapping[int, torch.Tensor],
        group: Any | None,
        tp_group: Any | None = None,
        keep_slice: bool = False,
        meta_group: Any | None = None,
    ) -> ExchangeHandle:
        """Start this rank's share of ``plan``.

        Args:
            sources: ``owner -> [R, H]`` flat source rows this rank holds (as a replica),
                contiguous, on the bridge's device.
            outputs: ``owner -> [N, H]`` the destination group's full flat buffer, or with
                ``keep_slice`` this rank's ``[N / tp, H]`` slice, contiguous, same device. Rows
                are overwritten.
            group: the bridge process group (point-to-point; the integrity verdict when
                ``meta_group`` is ``None``).
            tp_group: the destination group's all-gather group (ignored with ``keep_slice``).
            meta_group: a gloo group over the same ranks for the integrity verdict (host-side).
        Returns:
            A handle; call ``.wait()`` before reading ``outputs``.
        """
        self.check_usable()
        if len(self._flights) >= self.max_schedules and not self._warned_in_flight:
            self._warned_in_flight = True
            warnings.warn(
                f"global rank {self.rank}: {len(self._flights) + 1} bridge exchanges are in flight "
                f"(more than max_cached_plans={self.max_schedules}): call .wait() on every handle "
                "on every rank, teacher-only ranks too; staging buffers are released only there",
                stacklevel=3,
            )
        # an exchange still in flight that writes into these outputs completes first (as its
        # wait() would, with the ones before it): raising here instead would leave this rank's
        # peers, which have no such outputs, with posted sends nobody receives
        clash = [
            f
            for f in self._flights
            if any(buffers_overlap(a, b) for a in f.outputs for b in outputs.values())
        ]
        if clash:
            self._complete_through(clash[-1])
        sched = self.schedule(plan)
        dev_key = next(iter(outputs.values()), next(iter(sources.values()), None))
        dev = self._dev(
            plan.signature, sched, dev_key.device if dev_key is not None else torch.device("cpu")
        )
        off = 0 if keep_slice else sched.row_offset
        targets = {o: t[off : off + sched.slice_rows] for o, t in outputs.items()}
        staged: list[tuple[tuple[Any, ...], torch.Tensor]] = []

        def stage(kind: str, owner: int, rows: int, like: torch.Tensor) -> torch.Tensor:
            key = (kind, owner, like.dtype, like.device, like.shape[1])
            t = self._pool.acquire(key, rows, like)
            staged.append((key, t))
            return t

        try:
            # zero rows nobody writes (disjoint from every written row, so order does not matter)
            for owner, rows in sched.fill.items():
                if rows.numel():
                    self._zero_rows(targets[owner], rows, dev)
            src_sums: dict[int, torch.Tensor] = {}
            if self.integrity:  # checksums of the source rows, before any packing
                for owner, (lo, hi) in sched.src_span.items():
                    src_sums[owner] = row_checksum(sources[owner][lo:hi])
            ops: list[dist.P2POp] = []
            descs: list[str] = []
            send_blocks: list[tuple[int, int, torch.Tensor]] = []
            recv_blocks: list[tuple[int, int, torch.Tensor]] = []
            checks: list[tuple[_Op | _Local, torch.Tensor]] = []
            send_stage = {
                o: stage("send", o, n, sources[o]) for o, n in sched.send_stage_rows.items()
            }
            recv_stage = {
                o: stage("recv", o, n, targets[o]) for o, n in sched.recv_stage_rows.items()
            }
            for o, side in sched.pack_sides.items():  # one launch per owner, all peers
                _pack(sources[o], side, send_stage[o][: sched.send_stage_rows[o]], dev)
            for i, op in enumerate(sched.sends):
                src = sources[op.owner]
                if op.side.mode == "view":
                    buf = src[op.side.first : op.side.first + op.count]
                else:
                    buf = send_stage[op.owner][op.stage_off : op.stage_off + op.count]
                send_blocks.append((op.owner, op.peer, buf))
                ops.append(dist.P2POp(dist.isend, buf, op.peer, group=group))
                descs.append(f"send to global rank {op.peer} (teacher {op.owner}, {op.count} rows)")
                if self.integrity:
                    sums = src_sums[op.owner][dev(sched.send_src_rel[i])]
                    ops.append(dist.P2POp(dist.isend, sums, op.peer, group=group))
                    descs.append(f"send to global rank {op.peer} (teacher {op.owner}, checksums)")
            for op in sched.recvs:
                out = targets[op.owner]
                if op.side.mode == "view":
                    buf = out[op.side.first : op.side.first + op.count]
                else:
                    buf = recv_stage[op.owner][op.stage_off : op.stage_off + op.count]
                recv_blocks.append((op.owner, op.peer, buf))
                ops.append(dist.P2POp(dist.irecv, buf, op.peer, group=group))
                descs.append(
                    f"receive from global rank {op.peer} (teacher {op.owner}, {op.count} rows)"
                )
                if self.integrity:
                    sums = torch.empty(op.count, dtype=torch.int64, device=out.device)
                    checks.append((op, sums))
                    ops.append(dist.P2POp(dist.irecv, sums, op.peer, group=group))
                    descs.append(
                        f"receive from global rank {op.peer} (teacher {op.owner}, checksums)"
                    )
            if self.debug_hook is not None:
                self.debug_hook("packed", send_blocks)
            try:
                works = dist.batch_isend_irecv(ops) if ops else []
            except Exception as exc:
                self.mark_failed(exc)
                raise comm_failure(
                    exc,
                    rank=self.rank,
                    what="posting the bridge's sends/receives",
                    timeout_s=self.timeout.total_seconds(),
                    elapsed_s=0.0,
                ) from exc
            self.exchanges += 1
            if self.debug_hook is not None:
                self.debug_hook("posted", [])
            for i, lop in enumerate(sched.locals):
                if self.integrity:
                    checks.append((lop, src_sums[lop.owner][dev(sched.local_src_rel[i])]))
                _local(sources[lop.owner], lop, targets[lop.owner], dev)

        except BaseException as exc:
            # this rank stops mid-exchange: peers' messages may still arrive for it, and its own
            # posted receives may still land in the staging buffers, so neither is ever reused
            self.mark_failed(exc)
            for _key, t in staged:
                self._pool.forget(t)
            raise

        # the student TP ranks that all-gather this rank's slices after the crossing
        gather_ranks: tuple[int, ...] = ()
        if tp_group is not None and not keep_slice and sched.dest_index >= 0:
            gather_ranks = tuple(plan.dests[sched.dest_index].ranks)

        def finish(deadline: float) -> None:
            if self.debug_hook is not None:
                self.debug_hook("received", recv_blocks)
            for o, side in sched.unpack_sides.items():  # one launch per owner, all peers
                _unpack(recv_stage[o][: sched.recv_stage_rows[o]], side, targets[o], dev)
            slice_sums: dict[int, torch.Tensor] = {}
            if self.integrity and sched.dest_index >= 0:  # the slice as the crossing left it
                slice_sums = {o: row_checksum(t) for o, t in targets.items()}
            gather_checks: list[_Check] = []
            if len(gather_ranks) > 1:
                for owner in sorted(outputs):
                    self._timed(
                        lambda owner=owner: all_gather_flat(
                            outputs[owner],
                            targets[owner],
                            group=tp_group,
                            timeout=_left(deadline),
                        ),
                        "the student TP all-gather after the crossing",
                    )
                if self.integrity:
                    gather_checks = self._gather_checks(
                        sched, outputs, slice_sums, gather_ranks, tp_group, deadline
                    )
            if self.integrity:
                self._verify(
                    sched,
                    slice_sums,
                    checks,
                    dev,
                    meta_group if meta_group is not None else group,
                    deadline,
                    extra=gather_checks,
                )

        flight = _Flight(
            works=list(works),
            descs=descs if len(works) == len(descs) else ["; ".join(descs)] * len(works),
            finish=finish,
            device=dev.device,
            staged=staged,
            outputs=list(outputs.values()),
        )
        self._flights.append(flight)
        return ExchangeHandle(
            executor=self, flight=flight, timeout=self.timeout, outputs=dict(outputs)
        )

    # --- wait ----------------------------------------------------------------------------------

    def _timed(self, fn: Callable[[], None], what: str) -> None:
        t0 = time.monotonic()
        try:
            fn()
        except BridgeError:
            raise
        except Exception as exc:
            raise comm_failure(
                exc,
                rank=self.rank,
                what=what,
                timeout_s=self.timeout.total_seconds(),
                elapsed_s=time.monotonic() - t0,
            ) from exc

    def _complete_through(self, flight: _Flight) -> None:
        """Complete every flight started up to and including ``flight``, in start order.

        One deadline (``timeout`` from now) covers all of it; each wait gets the time left.
        """
        if flight.done:
            if flight.error is not None:
                raise flight.error
            return
        deadline = time.monotonic() + self.timeout.total_seconds()
        while self._flights:
            f = self._flights[0]
            try:
                self._complete(f, deadline)
            except BridgeIntegrityError as exc:
                # every rank reached the same verdict and no message is pending: the group and
                # the staging buffers stay usable, the rows of this exchange do not
                f.error, f.done = exc, True
                self._flights.pop(0)
                for key, t in f.staged:
                    self._pool.release(key, t)
                raise
            except BaseException as exc:
                self.mark_failed(exc)
                for g in self._flights:  # later flights share the broken group: fail them too
                    g.error, g.done = exc, True
                    for _key, t in g.staged:  # pending receives may still land there
                        self._pool.forget(t)
                self._flights.clear()
                raise
            f.done = True
            self._flights.pop(0)
            for key, t in f.staged:
                self._pool.release(key, t)
            if f is flight:
                return

    def _complete(self, f: _Flight, deadline: float) -> None:
        """Wait on ``f``'s transfers (host wait until ``deadline`` on gloo, stream wait on
        NCCL), then finish it (unpack, verify, TP all-gather) within what is left."""
        t0 = time.monotonic()
        for i, w in enumerate(f.works):
            try:
                wait_work(w, device=f.device, timeout=_left(deadline))
            except Exception as exc:
                pending = []
                for w2, d in zip(f.works[i:], f.descs[i:], strict=True):
                    try:
                        completed = bool(w2.is_completed()) and w2 is not w
                    except Exception:
                        completed = False
                    if not completed and d not in pending:
                        pending.append(d)
                raise comm_failure(
                    exc,
                    rank=self.rank,
                    what="the bridge exchange (incomplete: " + "; ".join(pending) + ")",
                    timeout_s=self.timeout.total_seconds(),
                    elapsed_s=time.monotonic() - t0,
                ) from exc
        f.finish(deadline)

    def _gather_checks(
        self,
        sched: RankSchedule,
        outputs: Mapping[int, torch.Tensor],
        slice_sums: Mapping[int, torch.Tensor],
        ranks: tuple[int, ...],
        tp_group: Any,
        deadline: float,
    ) -> list[_Check]:
        """Checks of the student TP all-gather: every slice against its sender's checksums.

        Every TP rank all-gathers the ``[slice_rows]`` checksums it took of its slices before
        the data all-gather (one collective for all owners), then compares them with the full
        buffer after it: the peers' slices that arrived, and its own (the in-place all-gather
        must leave it as it was). Returns one :data:`_Check` per (owner, slice) for
        :meth:`_verify`.
        """
        owners = sorted(outputs)
        rows = sched.slice_rows
        mine = torch.cat([slice_sums[o] for o in owners])  # [owners * rows]
        every = torch.empty(len(ranks) * mine.numel(), dtype=torch.int64, device=mine.device)
        self._timed(
            lambda: all_gather_flat(every, mine, group=tp_group, timeout=_left(deadline)),
            "the checksums of the student TP all-gather (integrity)",
        )
        expected = every.view(len(ranks), len(owners), rows)
        peers = [j for j in range(len(ranks)) if j != sched.slot]
        if self.debug_hook is not None:
            self.debug_hook(
                "gathered",
                [
                    (o, ranks[j], outputs[o][j * rows : (j + 1) * rows])
                    for o in owners
                    for j in peers
                ],
            )
        out: list[_Check] = []
        for i, o in enumerate(owners):
            got = row_checksum(outputs[o]).view(len(ranks), rows)
            for j in range(len(ranks)):
                # rows relative to this rank's slice, as the crossing checks count them
                dst_rows = torch.arange(j * rows, (j + 1) * rows) - sched.row_offset
                out.append(
                    (
                        got[j] != expected[j, i],
                        (o, ranks[j], dst_rows, torch.arange(rows), TP_GATHER),
                    )
                )
        return out

    def _verify(
        self,
        sched: RankSchedule,
        actual: Mapping[int, torch.Tensor],
        checks: Sequence[tuple[_Op | _Local, torch.Tensor]],
        dev: DeviceIndices,
        group: Any,
        deadline: float,
        extra: Sequence[_Check] = (),
    ) -> None:
        """Compare delivered rows with the senders' checksums; same verdict on every rank.

        Args:
            actual: ``owner -> [slice_rows]`` checksums of this rank's slices after the crossing.
            checks: the senders' ``[R]`` checksums of each receive and local copy.
            extra: more checks (the TP all-gather's, :meth:`_gather_checks`).
            group: carries the verdict all-gather (the gloo metadata group when there is one:
                CPU tensors, a host wait until ``deadline``; an NCCL group: CUDA tensors).
        """
        bad: list[torch.Tensor] = []
        what: list[tuple[int, int, torch.Tensor, torch.Tensor, int]] = []
        for op, expected in checks:
            if isinstance(op, _Op):
                dst_rows, src_rows, peer = op.side.rows, op.peer_rows, op.peer
            else:
                dst_rows, src_rows, peer = op.dst.rows, op.src.rows, self.rank
            bad.append(actual[op.owner][dev(dst_rows)] != expected)
            what.append((op.owner, peer, dst_rows, src_rows, CROSSING))
        for owner, rows in sched.fill.items():
            if rows.numel():
                bad.append(actual[owner][dev(rows)] != 0)
                what.append((owner, -1, rows, torch.empty(0, dtype=torch.int64), CROSSING))
        for b, w in extra:
            bad.append(b)
            what.append(w)
        found: list[BlockMismatch] = []
        if bad:
            counts = torch.stack([b.sum() for b in bad]).tolist()  # the one host sync
            for b, n, (owner, peer, dst_rows, src_rows, stage) in zip(
                bad, counts, what, strict=True
            ):
                if not n:
                    continue
                idx = torch.nonzero(b.cpu()).reshape(-1)[:4]
                found.append(
                    BlockMismatch(
                        owner=owner,
                        src_rank=peer,
                        dst_rank=self.rank,
                        rows=int(dst_rows.numel()),
                        bad=int(n),
                        dst_rows=tuple((dst_rows[idx] + sched.row_offset).tolist()),
                        src_rows=tuple(src_rows[idx].tolist()) if src_rows.numel() else (),
                        stage=stage,
                    )
                )
        mine = encode_mismatches(found)
        if group is None:
            reports = [(self.rank, *decode_mismatches(mine))]
        else:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if group_moves_cuda(group)
                else torch.device("cpu")
            )
            n = dist.get_world_size(group)
            every = torch.empty(n * mine.numel(), dtype=torch.int64, device=device)
            self._timed(
                lambda: all_gather_flat(
                    every, mine.to(device), group=group, timeout=_left(deadline)
                ),
                "the integrity verdict (all-gather over the bridge group)",
            )
            ranks = dist.get_process_group_ranks(group)
            rows = every.cpu().view(n, -1)
            reports = [(ranks[j], *decode_mismatches(rows[j])) for j in range(n)]
        if any(count for _, count, _ in reports):
            raise BridgeIntegrityError(format_mismatches(reports))

    # --- helpers -------------------------------------------------------------------------------

    def _dev(self, signature: str, sched: RankSchedule, device: torch.device) -> DeviceIndices:
        """``sched``'s index tensors on ``device``: one upload per schedule and device."""
        key = (signature, str(device))
        d = self._devs.get(key)
        if d is None:
            d = DeviceIndices(sched.data_path_indices(integrity=self.integrity), device)
            self._devs[key] = d
        return d

    def _zero_rows(self, out_NH: torch.Tensor, rows: torch.Tensor, dev: DeviceIndices) -> None:
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
