"""The executor: moves one rank's share of one micro-batch, point to point.

Why this file exists: the planner says which rows go where; this file moves them, touching each
row at most once on each side, with no collective over the bridge group (so it can run inside a
training schedule). Per micro-batch a rank has one :class:`Slot`:

- :meth:`Executor.take` takes a teacher's rows at that moment: packs this rank's sends into
  staging buffers (one kernel launch per owner for all peers: ``copy_runs`` for long runs, a
  gather otherwise; a contiguous side is copied as one block), checksums them in integrity mode
  and runs the local copies (a source replica on this rank). Afterwards the caller may overwrite
  its buffer: the bridge never reads it again.
- :meth:`Executor.post` zero-fills the rows no transfer writes and posts all of the slot's sends
  and receives in one ``batch_isend_irecv``.
- :meth:`Executor.complete` waits for the slot's receives (a host wait with a deadline on gloo; a
  stream wait on NCCL), unpacks them (one launch per owner), and all-gathers each owner's buffer
  over the student TP group when the destination group has more than one rank.
- :meth:`Executor.release` waits for the slot's sends and returns their staging buffers.

Ordering: every rank posts its slots in micro-batch order, one batch per slot holding both its
sends and its receives, so the point-to-point operations of any two ranks meet in the same order
(on NCCL a communicator runs a rank's batches in issue order; see :mod:`mopd.bridge.api`).

Data never leaves the device of its tensors: CUDA tensors go over NCCL, CPU tensors over gloo.
Kernels run with ``check_bounds=False``: plan rows are in range by construction and buffer row
counts are checked against the layouts before anything is taken.

Reliability: a failed or timed-out wait raises :class:`~mopd.bridge.errors.BridgeTimeoutError` /
:class:`~mopd.bridge.errors.BridgeCommError` naming this rank, the pending peers and the timeout;
the executor then refuses further work (:class:`~mopd.bridge.errors.BridgeStateError`): the
process group may still hold operations of the failed slot that a later one could match.
Integrity mode (:mod:`mopd.bridge.integrity`) checksums every delivered row; the checks run on
the device at :meth:`Executor.complete` and are judged together, on every rank alike, by
:meth:`Executor.verdict`.
"""

from __future__ import annotations

import functools
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from mopd.bridge.errors import (
    BridgeCommError,
    BridgeError,
    BridgeIntegrityError,
    BridgeStateError,
    BridgeTimeoutError,
)
from mopd.bridge.groups import all_gather_flat
from mopd.bridge.integrity import (
    CROSSING,
    TP_GATHER,
    BlockMismatch,
    decode_mismatches,
    encode_mismatches,
    format_mismatches,
    row_checksum,
)
from mopd.bridge.plan import RankPlan
from mopd.bridge.schedule import DeviceIndices, RankSchedule, _Local, _Op, _Side, plan_digest
from mopd.common import dist as cdist
from mopd.common import ranges
from mopd.kernels.rows import copy_runs, gather_rows, scatter_rows

__all__ = ["DebugHook", "Executor", "Slot", "comm_failure"]

#: ``hook(point, blocks)`` at ``"packed"`` (send buffers, before posting), ``"posted"``,
#: ``"received"`` (receive buffers, before unpacking) and, in integrity mode, ``"gathered"``
#: (slices the student TP all-gather brought), with ``(owner, peer_global_rank, rows_RH)``
#: blocks: tests corrupt bytes in flight or fail a rank mid-exchange through it
#: (``Executor.debug_hook``).
DebugHook = Callable[[str, list[tuple[int, int, torch.Tensor]]], None]
#: One integrity check: ``[R]`` bool "row differs" and (owner, peer, destination rows relative
#: to the slice, source rows, stage) to report it.
_T = TypeVar("_T")
_Check = tuple[torch.Tensor, tuple[int, int, torch.Tensor, torch.Tensor, int]]


def _left(deadline: float) -> float:
    """Seconds until ``deadline`` (``time.monotonic()`` clock), at least 1 ms."""
    return max(deadline - time.monotonic(), 1e-3)


def _pack(src_NH: torch.Tensor, side: _Side, stage_RH: torch.Tensor, dev: DeviceIndices) -> None:
    """Rows ``side`` of ``src_NH`` -> contiguous ``stage_RH`` (one pass)."""
    if side.mode == "view":
        stage_RH.copy_(src_NH[side.first : side.first + side.count])
    elif side.mode == "runs":
        copy_runs(
            src_NH,
            dev(side.run_row),
            dev(side.run_pos),
            dev(side.run_len),
            stage_RH,
            num_rows=stage_RH.shape[0],
            check_bounds=False,
        )
    else:
        gather_rows(src_NH, dev(side.rows), out_RH=stage_RH, check_bounds=False)


def _unpack(stage_RH: torch.Tensor, side: _Side, out_NH: torch.Tensor, dev: DeviceIndices) -> None:
    """Contiguous ``stage_RH`` -> rows ``side`` of ``out_NH`` (one pass)."""
    if side.mode == "runs":
        copy_runs(
            stage_RH,
            dev(side.run_pos),
            dev(side.run_row),
            dev(side.run_len),
            out_NH,
            num_rows=stage_RH.shape[0],
            check_bounds=False,
        )
    else:
        scatter_rows(stage_RH, dev(side.rows), out_NH, check_bounds=False)


def _local(src_NH: torch.Tensor, op: _Local, out_NH: torch.Tensor, dev: DeviceIndices) -> None:
    """A local copy: rows of ``src_NH`` -> rows of ``out_NH``, one pass."""
    n = op.src.count
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
    else:
        scatter_rows(
            src_NH[op.src.first : op.src.first + n], dev(op.dst.rows), out_NH, check_bounds=False
        )


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
    """Staging buffers reused across slots: per ``(kind, owner, dtype, device, H)`` a free list.

    A buffer is held by one slot until its sends (receives) complete; one too small for a new
    slot is replaced by a larger one.
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
        """Drop a buffer for good (a failed slot may still write into it)."""
        self.buffers -= 1
        self.bytes -= t.numel() * t.element_size()


@dataclass(kw_only=True, eq=False)
class Slot:
    """One rank's micro-batch of a step: its schedule, buffers and transfers in flight.

    Attributes:
        index: the micro-batch.
        schedule: this rank's schedule (``None``: nothing to do on this rank).
        outputs: ``owner -> [padded_rows, H]`` output buffers (destination ranks, from issue).
        issued, received, released: progress (posted, receives completed, sends completed).
    """

    index: int
    schedule: RankSchedule | None
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    issued: bool = False
    received: bool = False
    released: bool = False
    send_works: list[Any] = field(default_factory=list)
    recv_works: list[Any] = field(default_factory=list)
    send_descs: list[str] = field(default_factory=list)
    recv_descs: list[str] = field(default_factory=list)
    staged: list[tuple[tuple[Any, ...], torch.Tensor]] = field(default_factory=list)
    recv_stage: dict[int, torch.Tensor] = field(default_factory=dict)
    recv_blocks: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)
    checks: list[tuple[_Op | _Local, torch.Tensor]] = field(default_factory=list)
    taken: set[int] = field(default_factory=set)
    send_bufs: dict[int, torch.Tensor] = field(default_factory=dict)
    send_sums: dict[int, torch.Tensor] = field(default_factory=dict)
    findings: list[_Check] = field(default_factory=list)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dev: DeviceIndices | None = None


class Executor:
    """Runs one global rank's slots; caches schedules by plan content, pools staging buffers.

    Args:
        rank: this process's global rank.
        timeout_s: deadline of each wait (host-side on gloo; NCCL waits rely on the process
            groups' own timeout).
        max_schedules: schedules kept (least recently used dropped first).
        integrity: checksum every delivered row (:mod:`mopd.bridge.integrity`).
    """

    def __init__(
        self, *, rank: int, timeout_s: float, max_schedules: int = 64, integrity: bool = False
    ) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.max_schedules = max_schedules
        self.integrity = integrity
        #: see :data:`DebugHook` (tests only)
        self.debug_hook: DebugHook | None = None
        self._schedules: OrderedDict[str, RankSchedule] = OrderedDict()
        #: plan-input key (:meth:`~mopd.bridge.record.StepView.plan_keys`) -> the plan digest
        #: its schedule is kept under, ``None``: nothing to do (LRU-bounded like the schedules)
        self._inputs: OrderedDict[bytes, str | None] = OrderedDict()
        self._devs: dict[tuple[str, str], DeviceIndices] = {}
        self._pool = _StagePool()
        self._zeros: dict[tuple[Any, ...], torch.Tensor] = {}
        #: the first failure (text), and whether it left the transport in an unknown state
        #: (``True``: refuse locally, no communication; ``False``: a step abandoned by the
        #: caller, announced to every rank at the next ``plan_step``)
        self.failure: str | None = None
        self.failure_hard = False
        #: schedules built (cache misses) and slots issued, for figures and tests
        self.schedules_built = 0
        self.slots_issued = 0

    # --- bookkeeping ---------------------------------------------------------------------------

    def lookup(self, inputs: bytes) -> tuple[bool, RankSchedule | None]:
        """``(hit, schedule)`` for a micro-batch whose plan inputs hash to ``inputs``: a hit
        needs no planning (``schedule`` ``None``: this rank has nothing to do in it)."""
        if inputs not in self._inputs:
            return False, None
        digest = self._inputs[inputs]
        self._inputs.move_to_end(inputs)
        if digest is None:
            return True, None
        s = self._schedules.get(digest)
        if s is None:  # its schedule was evicted: plan again
            del self._inputs[inputs]
            return False, None
        self._schedules.move_to_end(digest)
        return True, s

    def remember(self, inputs: bytes, schedule: RankSchedule | None) -> None:
        """Key ``schedule`` (from :meth:`schedule`, or ``None``: nothing to do) by its plan
        inputs for :meth:`lookup` (only for micro-batches whose verdict passed)."""
        self._inputs[inputs] = None if schedule is None else schedule.digest
        self._inputs.move_to_end(inputs)
        while len(self._inputs) > 4 * self.max_schedules:
            self._inputs.popitem(last=False)

    def schedule(
        self, plan: RankPlan, *, slice_rows: int, num_owners: int, row_bytes: Sequence[int]
    ) -> RankSchedule:
        """This rank's schedule of ``plan`` (built once per plan content, LRU-bounded)."""
        key = plan_digest(plan)
        s = self._schedules.get(key)
        if s is not None:
            self._schedules.move_to_end(key)
            return s
        s = RankSchedule.build(
            plan,
            slice_rows=slice_rows,
            num_owners=num_owners,
            row_bytes=row_bytes,
            digest=key,
        )
        self.schedules_built += 1
        self._schedules[key] = s
        while len(self._schedules) > self.max_schedules:
            old, _ = self._schedules.popitem(last=False)
            for k in [k for k in self._devs if k[0] == old]:
                del self._devs[k]
        return s

    def memory_stats(self) -> dict[str, int]:
        """Buffers this executor holds: staging (bytes, buffers, allocations ever), zero rows,
        cached schedules and device index caches."""
        return {
            "staging_bytes": self._pool.bytes,
            "staging_buffers": self._pool.buffers,
            "staging_allocations": self._pool.allocations,
            "zeros_bytes": sum(z.numel() * z.element_size() for z in self._zeros.values()),
            "schedules": len(self._schedules),
            "device_caches": len(self._devs),
        }

    def check_usable(self) -> None:
        """Raise :class:`BridgeStateError` if an earlier slot failed (local, no communication)."""
        if self.failure is not None:
            raise BridgeStateError(
                f"global rank {self.rank}: this bridge cannot be used after a failed exchange "
                f"({self.failure}); its process group may still hold sends/receives of that "
                "exchange, which a later one could match. Create new groups (a new GroupPool and "
                "create_bridge_groups) and a new HiddenStateBridge on every rank."
            )

    def mark_failed(self, exc: BaseException) -> None:
        """Refuse further work, locally (see :meth:`check_usable`); keeps the first cause."""
        if self.failure is None:
            self.failure = f"{type(exc).__name__}: {str(exc)[:300]}"
        self.failure_hard = True

    def mark_abandoned(self, text: str) -> None:
        """Refuse further work after a step its caller abandoned (see :attr:`failure_hard`);
        keeps the first cause."""
        if self.failure is None:
            self.failure = text[:400]

    def _dev(self, sched: RankSchedule, device: torch.device) -> DeviceIndices:
        key = (sched.digest, str(device))
        d = self._devs.get(key)
        if d is None:
            d = DeviceIndices(sched.data_path_indices(integrity=self.integrity), device)
            if sched.digest in self._schedules:  # an evicted one's live with its slot only
                self._devs[key] = d
        return d

    # --- issue ---------------------------------------------------------------------------------

    def take(
        self,
        slot: Slot,
        sources: Mapping[int, torch.Tensor],
        *,
        output_specs: Mapping[int, tuple[int, torch.dtype]],
        device: torch.device,
    ) -> None:
        """Take the rows of ``sources`` (some or all owners) for ``slot`` now.

        Packs their sends into staging (a contiguous block is copied too), checksums them in
        integrity mode, and runs their local copies; afterwards the caller may overwrite the
        buffers. :meth:`post` sends once every owner the slot reads has been taken.

        Args:
            sources: ``owner -> [R, H]`` flat rows this rank holds as a replica (contiguous).
            output_specs: ``owner -> (hidden, dtype)`` of every owner's output buffer.
            device: the bridge's device.
        """
        self.check_usable()
        sched = slot.schedule
        slot.device = device
        if sched is None:
            return
        try:
            with ranges.span("issue", slot.index):
                self._outputs(slot, sched, output_specs, device)
                dev = slot.dev
                assert dev is not None
                for owner, src in sources.items():
                    self._take_owner(slot, sched, dev, owner, src)
        except BaseException as exc:
            self._fail_slot(slot, exc)
            raise

    def post(
        self,
        slot: Slot,
        *,
        output_specs: Mapping[int, tuple[int, torch.dtype]],
        device: torch.device,
        group: dist.ProcessGroup | None,
        tag: int = 0,
    ) -> None:
        """Post ``slot``'s sends (rows taken by :meth:`take`) and receives in one batch.

        ``tag``: the step's fence on the wire (transports that match by tag, gloo, never pair an
        operation with another step's; NCCL ignores tags and pairs in issue order, which
        ``plan_step``'s agreement keeps step-major on every rank)."""
        self.check_usable()
        sched = slot.schedule
        slot.issued = True
        slot.device = device
        if sched is None:
            return
        self.slots_issued += 1
        try:
            with ranges.span("issue", slot.index):
                self._outputs(slot, sched, output_specs, device)
                self._post(slot, sched, output_specs, device, group, tag)
        except BaseException as exc:
            self._fail_slot(slot, exc)
            raise

    def _fail_slot(self, slot: Slot, exc: BaseException) -> None:
        # peers' messages may still arrive for this rank and its posted receives may still land
        # in the staging buffers: neither is reused
        self.mark_failed(exc)
        for _key, t in slot.staged:
            self._pool.forget(t)
        slot.staged.clear()

    def _stage(
        self, slot: Slot, kind: str, owner: int, rows: int, like: torch.Tensor
    ) -> torch.Tensor:
        key = (kind, owner, like.dtype, like.device, like.shape[1])
        t = self._pool.acquire(key, rows, like)
        slot.staged.append((key, t))
        return t

    def _targets(self, slot: Slot, sched: RankSchedule) -> dict[int, torch.Tensor]:
        """``owner -> `` this rank's slice of each output buffer."""
        assert sched.dest is not None
        off = sched.slice_rows * sched.dest.slot
        return {o: t[off : off + sched.slice_rows] for o, t in slot.outputs.items()}

    def _outputs(
        self,
        slot: Slot,
        sched: RankSchedule,
        output_specs: Mapping[int, tuple[int, torch.dtype]],
        device: torch.device,
    ) -> None:
        """Allocate the slot's output buffers and zero the rows nothing writes (once)."""
        if slot.dev is None:
            slot.dev = self._dev(sched, device)
        if sched.dest is None or slot.outputs:
            return
        for owner, (hidden, dtype) in output_specs.items():
            slot.outputs[owner] = torch.empty(
                (sched.dest.padded_rows, hidden), dtype=dtype, device=device
            )
        targets = self._targets(slot, sched)
        for owner, fill in sched.fill.items():
            if fill.numel():
                self._zero_rows(targets[owner], fill, slot.dev)

    def _take_owner(
        self, slot: Slot, sched: RankSchedule, dev: DeviceIndices, owner: int, src: torch.Tensor
    ) -> None:
        if owner in slot.taken:
            raise AssertionError(f"owner {owner} of micro-batch {slot.index} taken twice")
        slot.taken.add(owner)
        sums = None
        if self.integrity and owner in sched.src_span:  # checksums of the source rows
            lo, hi = sched.src_span[owner]
            sums = row_checksum(src[lo:hi])
        n = sched.send_stage_rows.get(owner, 0)
        if n:
            with ranges.span("pack"):
                stage = self._stage(slot, "send", owner, n, src)
                _pack(src, sched.pack_sides[owner], stage[:n], dev)
        for i, op in enumerate(sched.sends):
            if op.owner != owner:
                continue
            if op.side.mode == "view":
                # a contiguous block is copied too: the caller may reuse its buffer at once
                buf = self._stage(slot, "send1", owner, op.count, src)[: op.count]
                buf.copy_(src[op.side.first : op.side.first + op.count])
            else:
                buf = stage[op.stage_off : op.stage_off + op.count]
            slot.send_bufs[i] = buf
            if sums is not None:
                slot.send_sums[i] = sums[dev(sched.send_src_rel[i])]
        if sched.dest is not None:
            targets = self._targets(slot, sched)
            with ranges.span("local_copy"):
                for i, lop in enumerate(sched.locals):
                    if lop.owner != owner:
                        continue
                    if sums is not None:
                        slot.checks.append((lop, sums[dev(sched.local_src_rel[i])]))
                    _local(src, lop, targets[owner], dev)

    def _post(
        self,
        slot: Slot,
        sched: RankSchedule,
        output_specs: Mapping[int, tuple[int, torch.dtype]],
        device: torch.device,
        group: dist.ProcessGroup | None,
        tag: int,
    ) -> None:
        missing = sorted({op.owner for op in sched.sends} - slot.taken)
        if missing:
            raise AssertionError(f"micro-batch {slot.index}: rows of owners {missing} not taken")
        ops: list[dist.P2POp] = []
        kinds: list[bool] = []  # True: a receive
        send_blocks: list[tuple[int, int, torch.Tensor]] = []
        for i, op in enumerate(sched.sends):
            buf = slot.send_bufs[i]
            send_blocks.append((op.owner, op.peer, buf))
            ops.append(dist.P2POp(dist.isend, buf, op.peer, group=group, tag=tag))
            kinds.append(False)
            slot.send_descs.append(
                f"send to global rank {op.peer} (micro-batch {slot.index}, teacher {op.owner}, "
                f"{op.count} rows)"
            )
            if self.integrity:
                ops.append(dist.P2POp(dist.isend, slot.send_sums[i], op.peer, group=group, tag=tag))
                kinds.append(False)
                slot.send_descs.append(f"send to global rank {op.peer} (checksums)")
        targets = self._targets(slot, sched) if sched.dest is not None else {}
        like = {
            o: torch.empty((0, h), dtype=d, device=device) for o, (h, d) in output_specs.items()
        }
        slot.recv_stage = {
            o: self._stage(slot, "recv", o, n, like[o]) for o, n in sched.recv_stage_rows.items()
        }
        for op in sched.recvs:
            if op.side.mode == "view":
                buf = targets[op.owner][op.side.first : op.side.first + op.count]
            else:
                buf = slot.recv_stage[op.owner][op.stage_off : op.stage_off + op.count]
            slot.recv_blocks.append((op.owner, op.peer, buf))
            ops.append(dist.P2POp(dist.irecv, buf, op.peer, group=group, tag=tag))
            kinds.append(True)
            slot.recv_descs.append(
                f"receive from global rank {op.peer} (micro-batch {slot.index}, teacher "
                f"{op.owner}, {op.count} rows)"
            )
            if self.integrity:
                sums = torch.empty(op.count, dtype=torch.int64, device=device)
                slot.checks.append((op, sums))
                ops.append(dist.P2POp(dist.irecv, sums, op.peer, group=group, tag=tag))
                kinds.append(True)
                slot.recv_descs.append(f"receive from global rank {op.peer} (checksums)")
        if self.debug_hook is not None:
            self.debug_hook("packed", send_blocks)
        try:
            with ranges.span("send_recv", slot.index):
                works = dist.batch_isend_irecv(ops) if ops else []
        except Exception as exc:
            raise comm_failure(
                exc,
                rank=self.rank,
                what="posting the bridge's sends/receives",
                timeout_s=self.timeout_s,
                elapsed_s=0.0,
            ) from exc
        if len(works) == len(ops):
            slot.send_works = [w for w, k in zip(works, kinds, strict=True) if not k]
            slot.recv_works = [w for w, k in zip(works, kinds, strict=True) if k]
        else:  # one coalesced work for the whole batch (NCCL): it covers both directions
            slot.send_works = list(works)
            slot.recv_works = list(works)
            slot.send_descs = slot.recv_descs = ["; ".join(slot.send_descs + slot.recv_descs)]
        slot.send_bufs.clear()
        slot.send_sums.clear()
        if self.debug_hook is not None:
            self.debug_hook("posted", [])

    # --- complete ------------------------------------------------------------------------------

    def _wait_all(
        self, works: Sequence[Any], descs: Sequence[str], device: torch.device, deadline: float
    ) -> None:
        t0 = time.monotonic()
        for i, w in enumerate(works):
            try:
                cdist.wait(w, device=device, timeout_s=_left(deadline))
            except Exception as exc:
                pending = []
                tail = list(descs)[i:] if len(descs) == len(works) else [""] * (len(works) - i)
                for w2, d in zip(works[i:], tail, strict=True):
                    try:
                        completed = bool(w2.is_completed()) and w2 is not w
                    except Exception:
                        completed = False
                    if not completed and d and d not in pending:
                        pending.append(d)
                err = comm_failure(
                    exc,
                    rank=self.rank,
                    what="the bridge exchange (incomplete: " + "; ".join(pending) + ")",
                    timeout_s=self.timeout_s,
                    elapsed_s=time.monotonic() - t0,
                )
                self.mark_failed(err)
                raise err from exc

    def timed(self, fn: Callable[[], _T], what: str | Callable[[], str]) -> _T:
        """``fn()``'s value; a failure becomes a named timeout / comm error (``what``: the phase,
        or a function writing it, called only then) and refuses further work."""
        t0 = time.monotonic()
        try:
            return fn()
        except BridgeError:
            raise
        except Exception as exc:
            err = comm_failure(
                exc,
                rank=self.rank,
                what=what() if callable(what) else what,
                timeout_s=self.timeout_s,
                elapsed_s=time.monotonic() - t0,
            )
            self.mark_failed(err)
            raise err from exc

    def complete(self, slot: Slot, *, tp_group: dist.ProcessGroup | None, deadline: float) -> None:
        """Wait for ``slot``'s receives, unpack, and all-gather over ``tp_group`` (see module doc).

        Any failure here refuses further work: this rank's TP peers may be waiting in the slot's
        all-gather, and receives it posted may still land in its staging buffers.
        """
        self.check_usable()
        try:
            self._complete(slot, tp_group=tp_group, deadline=deadline)
        except BaseException as exc:
            self._fail_slot(slot, exc)
            raise

    def _complete(self, slot: Slot, *, tp_group: dist.ProcessGroup | None, deadline: float) -> None:
        slot.received = True
        sched = slot.schedule
        if sched is None or sched.dest is None:
            return
        dev = slot.dev
        assert dev is not None
        with ranges.span("recv_wait", slot.index):
            self._wait_all(slot.recv_works, slot.recv_descs, slot.device, deadline)
        slot.recv_works = []  # done: drop them (a coalesced work stays in send_works until released)
        if self.debug_hook is not None:
            self.debug_hook("received", slot.recv_blocks)
        targets = self._targets(slot, sched)
        with ranges.span("unpack", slot.index):
            for o, side in sched.unpack_sides.items():  # one launch per owner, all peers
                _unpack(slot.recv_stage[o][: sched.recv_stage_rows[o]], side, targets[o], dev)
        slice_sums: dict[int, torch.Tensor] = {}
        if self.integrity:
            slice_sums = {o: row_checksum(t) for o, t in targets.items()}
            self._check_crossing(slot, sched, slice_sums, dev)
        group_size = sched.dest.padded_rows // max(1, sched.slice_rows)
        if group_size > 1:
            if tp_group is None:
                raise AssertionError("a destination group of several ranks needs its TP group")
            with ranges.span("tp_all_gather", slot.index):
                for owner in sorted(slot.outputs):
                    self.timed(
                        functools.partial(
                            all_gather_flat,
                            slot.outputs[owner],
                            targets[owner],
                            group=tp_group,
                            timeout_s=_left(deadline),
                        ),
                        lambda: (
                            f"the student TP all-gather after the crossing (micro-batch "
                            f"{slot.index}, over global ranks "
                            f"{dist.get_process_group_ranks(tp_group)})"
                        ),
                    )
            if self.integrity:
                self._check_gather(slot, sched, slice_sums, tp_group, group_size, deadline)
        for key, t in [(k, t) for k, t in slot.staged if k[0] == "recv"]:
            self._pool.release(key, t)
        slot.staged = [(k, t) for k, t in slot.staged if k[0] != "recv"]
        slot.recv_stage = {}

    def release(self, slot: Slot, *, deadline: float) -> None:
        """Wait for ``slot``'s sends and return their staging buffers (idempotent)."""
        if slot.released:
            return
        slot.released = True
        if slot.schedule is not None and slot.issued:
            with ranges.span("send_wait", slot.index):
                self._wait_all(slot.send_works, slot.send_descs, slot.device, deadline)
        # completed work objects are dropped: one that outlives its process group at exit aborts
        # (a coalesced work also covers the receives: it goes once they are complete too)
        if slot.send_works is not slot.recv_works or slot.received:
            slot.send_works = []
        for key, t in slot.staged:
            if key[0] != "recv":
                self._pool.release(key, t)
        slot.staged = [(k, t) for k, t in slot.staged if k[0] == "recv"]

    def sends_done(self, slot: Slot) -> bool:
        """True once every send of ``slot`` has completed (a poll, no wait)."""
        try:
            return all(bool(w.is_completed()) for w in slot.send_works)
        except Exception:
            return False

    # --- integrity -----------------------------------------------------------------------------

    def _check_crossing(
        self,
        slot: Slot,
        sched: RankSchedule,
        actual: Mapping[int, torch.Tensor],
        dev: DeviceIndices,
    ) -> None:
        for op, expected in slot.checks:
            if isinstance(op, _Op):
                dst_rows, src_rows, peer = op.side.rows, op.peer_side.rows, op.peer
            else:
                dst_rows, src_rows, peer = op.dst.rows, op.src.rows, self.rank
            slot.findings.append(
                (
                    actual[op.owner][dev(dst_rows)] != expected,
                    (op.owner, peer, dst_rows, src_rows, CROSSING),
                )
            )
        for owner, inside in sched.fill_checked.items():
            if inside.numel():
                slot.findings.append(
                    (
                        actual[owner][dev(inside)] != 0,
                        (owner, -1, inside, torch.empty(0, dtype=torch.int64), CROSSING),
                    )
                )
        slot.checks = []

    def _check_gather(
        self,
        slot: Slot,
        sched: RankSchedule,
        slice_sums: Mapping[int, torch.Tensor],
        tp_group: dist.ProcessGroup | None,
        group_size: int,
        deadline: float,
    ) -> None:
        """Every slice of the TP all-gather against its sender's checksums (all owners at once)."""
        assert sched.dest is not None
        owners = sorted(slot.outputs)
        rows = sched.slice_rows
        mine = torch.cat([slice_sums[o] for o in owners])
        every = torch.empty(group_size * mine.numel(), dtype=torch.int64, device=mine.device)
        ranks = dist.get_process_group_ranks(tp_group)
        self.timed(
            lambda: all_gather_flat(
                every,
                mine,
                group=tp_group,
                timeout_s=_left(deadline),
            ),
            f"the checksums of the student TP all-gather (integrity, micro-batch {slot.index}, "
            f"over global ranks {ranks})",
        )
        expected = every.view(group_size, len(owners), rows)
        peers = [j for j in range(group_size) if j != sched.dest.slot]
        if self.debug_hook is not None:
            self.debug_hook(
                "gathered",
                [
                    (o, ranks[j], slot.outputs[o][j * rows : (j + 1) * rows])
                    for o in owners
                    for j in peers
                ],
            )
        for i, o in enumerate(owners):
            got = row_checksum(slot.outputs[o]).view(group_size, rows)
            for j in range(group_size):
                dst_rows = (
                    torch.arange(j * rows, (j + 1) * rows) - sched.slice_rows * sched.dest.slot
                )
                slot.findings.append(
                    (
                        got[j] != expected[j, i],
                        (o, ranks[j], dst_rows, torch.arange(rows), TP_GATHER),
                    )
                )

    def verdict(
        self, slots: Sequence[Slot], *, group: dist.ProcessGroup | None, deadline: float
    ) -> None:
        """Integrity: judge every slot's checks; the same :class:`BridgeIntegrityError` everywhere.

        Collective over ``group`` (the gloo metadata group): every rank calls it once per step.
        """
        found: list[BlockMismatch] = []
        flags = [(s, f) for s in slots for f in s.findings]
        if flags:
            counts = torch.stack([b.sum() for _, (b, _) in flags]).tolist()  # the one host sync
            for (slot, (b, info)), n in zip(flags, counts, strict=True):
                if not n:
                    continue
                owner, peer, dst_rows, src_rows, stage = info
                idx = torch.nonzero(b.cpu()).reshape(-1)[:4]
                off = 0
                if slot.schedule is not None and slot.schedule.dest is not None:
                    off = slot.schedule.slice_rows * slot.schedule.dest.slot
                found.append(
                    BlockMismatch(
                        owner=owner,
                        src_rank=peer,
                        dst_rank=self.rank,
                        rows=int(dst_rows.numel()),
                        bad=int(n),
                        dst_rows=tuple((dst_rows[idx] + off).tolist()),
                        src_rows=tuple(src_rows[idx].tolist()) if src_rows.numel() else (),
                        stage=stage,
                        micro_batch=slot.index,
                    )
                )
        for s in slots:
            s.findings = []
        mine = encode_mismatches(found)
        device = cdist.group_device(group)
        n = dist.get_world_size(group)
        every = torch.empty(n * mine.numel(), dtype=torch.int64, device=device)
        ranks = dist.get_process_group_ranks(group)
        self.timed(
            lambda: all_gather_flat(
                every,
                mine.to(device),
                group=group,
                timeout_s=_left(deadline),
            ),
            f"the integrity verdict (all-gather over global ranks {ranks})",
        )
        rows = every.cpu().view(n, -1)
        reports = [(ranks[j], *decode_mismatches(rows[j])) for j in range(n)]
        if any(count for _, count, _ in reports):
            raise BridgeIntegrityError(format_mismatches(reports))

    # --- helpers -------------------------------------------------------------------------------

    def _zero_rows(self, out_NH: torch.Tensor, rows: torch.Tensor, dev: DeviceIndices) -> None:
        """Zero ``rows`` of ``out_NH`` (a few block fills, or one scatter of a cached zero block)."""
        if rows.numel() <= 8 or int(rows[-1] - rows[0]) + 1 == rows.numel():
            if int(rows[-1] - rows[0]) + 1 == rows.numel():
                out_NH[int(rows[0]) : int(rows[-1]) + 1].zero_()
                return
            for r in rows.tolist():
                out_NH[r].zero_()
            return
        key = (out_NH.dtype, out_NH.device, out_NH.shape[1])
        z = self._zeros.get(key)
        if z is None or z.shape[0] < rows.numel():
            z = torch.zeros(
                (rows.numel(), out_NH.shape[1]), dtype=out_NH.dtype, device=out_NH.device
            )
            self._zeros[key] = z
        scatter_rows(z[: rows.numel()], dev(rows), out_NH, check_bounds=False)
