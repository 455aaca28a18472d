"""The executor: moves one rank's share of one micro-batch, and nothing else.

Why this file exists: the planner says which rows go where; this file moves them, touching each
row at most once on each side, with no collective over the bridge group (so it can run inside a
training schedule). Per micro-batch a rank has one :class:`Slot`, which owns its buffers (the
output buffers it delivers into, the staging buffers it holds from the pool):

- :meth:`Executor.take` takes a teacher's rows at that moment: packs this rank's sends into
  staging buffers (one kernel launch per owner for all peers: ``copy_runs`` for long runs, a
  gather otherwise; a contiguous side is copied as one block) and runs the local copies (a
  source replica on this rank). Afterwards the caller may overwrite its buffer: the bridge
  never reads it again.
- :meth:`Executor.post` zero-fills the rows no transfer writes (in the compact form only the
  TP all-gather's padding at the end of each owner's buffer) and hands the slot's
  sends and receives to the transport in one batch (:mod:`mopd.bridge.transport`).
- :meth:`Executor.complete` waits for the slot's receives (a host wait with a deadline on gloo;
  a stream wait on NCCL), unpacks them (one launch per owner), and all-gathers each owner's
  buffer over the student TP group when the destination group has more than one rank.
- :meth:`Executor.release` waits for the slot's sends and returns their staging buffers.

The order in which a step's slots are posted, completed and released is not decided here:
:class:`mopd.bridge.order.StepOrder` owns it (every rank posts its slots in micro-batch order,
one batch per slot holding both its sends and its receives).

Data never leaves the device of its tensors: CUDA tensors go over NCCL, CPU tensors over gloo.
Kernels run with ``check_bounds=False``: plan rows are in range by construction and buffer row
counts are checked against the layouts before anything is taken.

Reliability: a failed or timed-out wait raises :class:`~mopd.bridge.errors.BridgeTimeoutError` /
:class:`~mopd.bridge.errors.BridgeCommError` naming this rank, the pending peers and the timeout;
the executor then refuses further work (:class:`~mopd.bridge.errors.BridgeStateError`): the
process group may still hold operations of the failed slot that a later one could match. What a
failure means (a cause or a symptom of another rank's) and what is recorded of it is judged by
:class:`~mopd.bridge.faults.Faults`, which the executor owns beside its
:class:`~mopd.bridge.lifecycle.Lifecycle`.
Integrity mode (:mod:`mopd.bridge.integrity`) wraps the transport (checksums travel beside the
rows) and plugs its checks into the data path's check points; they run on the device and are
judged together, on every rank alike, by :meth:`Executor.verdict`.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from mopd.bridge.errors import BridgeError
from mopd.bridge.failures import FailureBoard
from mopd.bridge.faults import Faults
from mopd.bridge.integrity import (
    IntegrityTransport,
    NoChecks,
    RowChecks,
    SlotChecks,
    integrity_verdict,
)
from mopd.bridge.lifecycle import Lifecycle
from mopd.bridge.plan import RankPlan
from mopd.bridge.schedule import DeviceIndices, RankSchedule, _Local, _Side, plan_digests
from mopd.bridge.transport import (
    Message,
    P2PTransport,
    Posted,
    Transport,
    comm_failure,
    time_left,
)
from mopd.common import dist as cdist
from mopd.common import ranges
from mopd.common.dist import all_gather_flat
from mopd.kernels.rows import copy_runs, gather_rows, scatter_rows

__all__ = ["DebugHook", "Executor", "Slot", "comm_failure"]

#: ``hook(point, blocks)`` at ``"packed"`` (send buffers, before posting), ``"posted"``,
#: ``"received"`` (receive buffers, before unpacking) and, in integrity mode, ``"gathered"``
#: (slices the student TP all-gather brought), with ``(owner, peer_global_rank, rows_RH)``
#: blocks: tests corrupt bytes in flight or fail a rank mid-exchange through it
#: (``Executor.debug_hook``).
DebugHook = Callable[[str, list[tuple[int, int, torch.Tensor]]], None]


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


class _StagePool:
    """Staging buffers reused across slots: per ``(kind, owner, dtype, device, H)`` a free list.

    A buffer is held by one slot until its sends (receives) complete; a slot gets the smallest
    free buffer that fits, and when none does the largest is replaced by a larger one.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        self.allocations = 0
        self.bytes = 0
        self.buffers = 0

    def acquire(self, key: tuple[Any, ...], rows: int, like: torch.Tensor) -> torch.Tensor:
        """The smallest free buffer of ``key`` with at least ``rows`` rows; if none fits, the
        largest free one is replaced by a new one of ``rows`` rows (so the pool converges to the
        sizes its slots need together, whatever order they come in)."""
        free = self._free.get(key)
        if free:
            fits = [i for i, t in enumerate(free) if t.shape[0] >= rows]
            if fits:
                return free.pop(min(fits, key=lambda i: free[i].shape[0]))
            t = free.pop(max(range(len(free)), key=lambda i: free[i].shape[0]))
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
    """One rank's micro-batch of a step: its schedule, the buffers it owns, its messages.

    Attributes:
        index: the micro-batch.
        schedule: this rank's schedule (``None``: nothing to do on this rank).
        outputs: ``owner -> [padded_rows, H]`` output buffers (destination ranks, from issue):
            compact, one row per token of that owner plus the all-gather's padding.
        staged: ``(pool key, buffer)`` staging buffers this slot holds from the pool.
        send_bufs: ``send index -> rows`` taken for each send, until posted.
        posted: its messages in flight (the transport's handles), once posted.
        checks: integrity state (:class:`~mopd.bridge.integrity.SlotChecks`) or ``None``.
        issued, received, released: progress (posted, receives completed, sends completed).
    """

    index: int
    schedule: RankSchedule | None
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    issued: bool = False
    received: bool = False
    released: bool = False
    posted: Posted | None = None
    staged: list[tuple[tuple[Any, ...], torch.Tensor]] = field(default_factory=list)
    send_bufs: dict[int, torch.Tensor] = field(default_factory=dict)
    recv_stage: dict[int, torch.Tensor] = field(default_factory=dict)
    recv_blocks: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)
    taken: set[int] = field(default_factory=set)
    checks: SlotChecks | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dev: DeviceIndices | None = None

    def hold(
        self, pool: _StagePool, kind: str, owner: int, rows: int, like: torch.Tensor
    ) -> torch.Tensor:
        """A staging buffer of at least ``rows`` rows like ``like``, held by this slot."""
        key = (kind, owner, like.dtype, like.device, like.shape[1])
        t = pool.acquire(key, rows, like)
        self.staged.append((key, t))
        return t

    def give_back(self, pool: _StagePool, *, receives: bool) -> None:
        """Return the receive (``receives``) or send staging buffers to ``pool``."""
        keep = []
        for key, t in self.staged:
            if (key[0] == "recv") == receives:
                pool.release(key, t)
            else:
                keep.append((key, t))
        self.staged = keep
        if receives:
            self.recv_stage = {}

    def drop(self, pool: _StagePool) -> None:
        """Forget every staging buffer (a failed slot's peers may still write into them)."""
        for _key, t in self.staged:
            pool.forget(t)
        self.staged.clear()


class Executor:
    """Runs one global rank's slots; caches schedules by plan content, pools staging buffers.

    Args:
        rank: this process's global rank.
        timeout_s: deadline of each wait (host-side on gloo; NCCL waits rely on the process
            groups' own timeout).
        max_schedules: schedules kept (least recently used dropped first).
        integrity: checksum every delivered row (:mod:`mopd.bridge.integrity`): the transport
            is wrapped and the data path's check points run :class:`~mopd.bridge.integrity.
            RowChecks` (chosen here, once).
        transport: the transport to move data with (default :class:`~mopd.bridge.transport.
            P2PTransport`).
        board: where the job's first failure is published and read
            (:class:`~mopd.bridge.failures.FailureBoard`; ``None``: this rank names only its
            own view).
    """

    def __init__(
        self,
        *,
        rank: int,
        timeout_s: float,
        max_schedules: int = 64,
        integrity: bool = False,
        transport: Transport | None = None,
        board: FailureBoard | None = None,
    ) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.max_schedules = max_schedules
        self.integrity = integrity
        #: whether this rank's bridge may be used, and the first failure that ended it
        self.lifecycle = Lifecycle(rank)
        #: what a failure means and where this rank is (:mod:`mopd.bridge.faults`)
        self.faults = Faults(rank=rank, timeout_s=timeout_s, lifecycle=self.lifecycle, board=board)
        inner = transport or P2PTransport(
            rank=rank, timeout_s=timeout_s, on_wait=self.faults.waiting
        )
        self.transport: Transport = IntegrityTransport(inner) if integrity else inner
        self._checks: NoChecks = RowChecks() if integrity else NoChecks()
        #: see :data:`DebugHook` (tests only)
        self.debug_hook: DebugHook | None = None
        self._schedules: OrderedDict[str, RankSchedule] = OrderedDict()
        #: plan-input key (:meth:`~mopd.bridge.record.StepView.plan_keys`) -> the plan digest
        #: its schedule is kept under, ``None``: nothing to do (LRU-bounded like the schedules)
        self._inputs: OrderedDict[bytes, str | None] = OrderedDict()
        self._devs: dict[tuple[str, str], DeviceIndices] = {}
        self._pool = _StagePool()
        self._zeros: dict[tuple[Any, ...], torch.Tensor] = {}
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
        """This rank's schedule of ``plan`` (built once per plan content and row widths,
        LRU-bounded): :meth:`schedules` of one."""
        return self.schedules(
            [plan], slice_rows=[slice_rows], num_owners=num_owners, row_bytes=row_bytes
        )[0]

    def schedules(
        self,
        plans: Sequence[RankPlan],
        *,
        slice_rows: Sequence[int],
        num_owners: int,
        row_bytes: Sequence[int],
    ) -> list[RankSchedule]:
        """This rank's schedules of ``plans`` (each built once per plan content and row
        widths, LRU-bounded; those not cached built together:
        :meth:`~mopd.bridge.schedule.RankSchedule.build_many`)."""
        widths = ",".join(map(str, row_bytes))
        digests = plan_digests(plans)
        keys = [f"{h}:{n}:{widths}" for h, n in zip(digests, slice_rows, strict=True)]
        out: list[RankSchedule | None] = []
        todo: dict[str, int] = {}
        for k, key in enumerate(keys):
            s = self._schedules.get(key)
            if s is not None:
                self._schedules.move_to_end(key)
            elif key not in todo:
                todo[key] = k
            out.append(s)
        if todo:
            made = RankSchedule.build_many(
                [plans[k] for k in todo.values()],
                slice_rows=[slice_rows[k] for k in todo.values()],
                num_owners=num_owners,
                row_bytes=row_bytes,
                digests=list(todo),
            )
            fresh = dict(zip(todo, made, strict=True))
            for key, s in fresh.items():
                self.schedules_built += 1
                self._schedules[key] = s
            out = [fresh[key] if s is None else s for key, s in zip(keys, out, strict=True)]
            while len(self._schedules) > self.max_schedules:
                old, _ = self._schedules.popitem(last=False)
                for dev_key in [d for d in self._devs if d[0] == old]:
                    del self._devs[dev_key]
        return [s for s in out if s is not None]

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

    def close(self) -> None:
        """Drop every cached schedule, index copy and staging buffer; refuse every later call
        (local). Idempotent."""
        self.lifecycle.close()
        self._schedules.clear()
        self._inputs.clear()
        self._devs.clear()
        self._zeros.clear()
        self._pool = _StagePool()
        self.debug_hook = None

    def _dev(self, sched: RankSchedule, device: torch.device) -> DeviceIndices:
        key = (sched.digest, str(device))
        d = self._devs.get(key)
        if d is None:
            d = DeviceIndices(sched.data_path_indices(integrity=self._checks.indices), device)
            if sched.digest in self._schedules:  # an evicted one's live with its slot only
                self._devs[key] = d
        return d

    def _state(self, slot: Slot) -> SlotChecks | None:
        """The slot's integrity state (made on first use; ``None`` when nothing is checked)."""
        if slot.checks is None and self._checks.indices:
            slot.checks = SlotChecks()
        return slot.checks

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

        Packs their sends into staging (a contiguous block is copied too) and runs their local
        copies; afterwards the caller may overwrite the buffers. :meth:`post` sends once every
        owner the slot reads has been taken.

        Args:
            sources: ``owner -> [R, H]`` flat rows this rank holds as a replica (contiguous).
            output_specs: ``owner -> (hidden, dtype)`` of every owner's output buffer.
            device: the bridge's device.
        """
        self.lifecycle.check_usable()
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
        self.lifecycle.check_usable()
        sched = slot.schedule
        slot.issued = True
        slot.device = device
        if sched is None:
            return
        self.slots_issued += 1
        try:
            with ranges.span("issue", slot.index):
                self._outputs(slot, sched, output_specs, device)
                self._post(slot, sched, device, group, tag)
        except BaseException as exc:
            self._fail_slot(slot, exc)
            raise

    def _fail_slot(self, slot: Slot, exc: BaseException) -> None:
        # peers' messages may still arrive for this rank and its posted receives may still land
        # in the staging buffers: neither is reused
        self.faults.mark_failed(exc)
        slot.drop(self._pool)

    def _targets(self, slot: Slot, sched: RankSchedule) -> dict[int, torch.Tensor]:
        """``owner -> `` this rank's slice of each output buffer."""
        assert sched.dest is not None
        return {
            o: t[sched.slice_start(o) : sched.slice_start(o) + sched.slice_rows_of(o)]
            for o, t in slot.outputs.items()
        }

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
                (sched.padded_rows(owner), hidden), dtype=dtype, device=device
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
        self._checks.taken(self._state(slot), sched, dev, owner, src)
        n = sched.send_stage_rows.get(owner, 0)
        if n:
            with ranges.span("pack"):
                stage = slot.hold(self._pool, "send", owner, n, src)
                _pack(src, sched.pack_sides[owner], stage[:n], dev)
        for i, op in enumerate(sched.sends):
            if op.owner != owner:
                continue
            if op.mode == "view":
                # a contiguous block is copied too: the caller may reuse its buffer at once
                buf = slot.hold(self._pool, "send1", owner, op.count, src)[: op.count]
                buf.copy_(src[op.first : op.first + op.count])
            else:
                buf = stage[op.stage_off : op.stage_off + op.count]
            slot.send_bufs[i] = buf
        if sched.dest is not None:
            targets = self._targets(slot, sched)
            with ranges.span("local_copy"):
                for lop in sched.locals:
                    if lop.owner == owner:
                        _local(src, lop, targets[owner], dev)

    def _post(
        self,
        slot: Slot,
        sched: RankSchedule,
        device: torch.device,
        group: dist.ProcessGroup | None,
        tag: int,
    ) -> None:
        missing = sorted({op.owner for op in sched.sends} - slot.taken)
        if missing:
            raise AssertionError(f"micro-batch {slot.index}: rows of owners {missing} not taken")
        state = self._state(slot)
        sends = [
            Message(
                peer=op.peer,
                rows=slot.send_bufs[i],
                what=f"send to global rank {op.peer} (micro-batch {slot.index}, teacher "
                f"{op.owner}, {op.count} rows)",
                checksums=self._checks.send_checksums(state, i),
            )
            for i, op in enumerate(sched.sends)
        ]
        targets = self._targets(slot, sched) if sched.dest is not None else {}
        slot.recv_stage = {
            o: slot.hold(self._pool, "recv", o, n, slot.outputs[o])
            for o, n in sched.recv_stage_rows.items()
        }
        recvs = []
        for op in sched.recvs:
            if op.mode == "view":
                buf = targets[op.owner][op.first : op.first + op.count]
            else:
                buf = slot.recv_stage[op.owner][op.stage_off : op.stage_off + op.count]
            slot.recv_blocks.append((op.owner, op.peer, buf))
            recvs.append(
                Message(
                    peer=op.peer,
                    rows=buf,
                    what=f"receive from global rank {op.peer} (micro-batch {slot.index}, "
                    f"teacher {op.owner}, {op.count} rows)",
                )
            )
        if self.debug_hook is not None:
            self.debug_hook(
                "packed",
                [(op.owner, op.peer, m.rows) for op, m in zip(sched.sends, sends, strict=True)],
            )
        slot.posted = self.transport.post(
            sends, recvs, index=slot.index, device=device, group=group, tag=tag
        )
        self._checks.posted(state, sched, slot.posted)
        slot.send_bufs.clear()
        if self.debug_hook is not None:
            self.debug_hook("posted", [])

    # --- complete ------------------------------------------------------------------------------

    def _wait(self, posted: Posted, *, sends: bool, deadline: float) -> None:
        """The transport's wait; a failure refuses further work."""
        try:
            self.transport.wait(posted, sends=sends, deadline=deadline)
        except BridgeError as err:
            self.faults.mark_failed(err)
            raise

    def complete(self, slot: Slot, *, tp_group: dist.ProcessGroup | None, deadline: float) -> None:
        """Wait for ``slot``'s receives, unpack, and all-gather over ``tp_group`` (see module doc).

        Any failure here refuses further work: this rank's TP peers may be waiting in the slot's
        all-gather, and receives it posted may still land in its staging buffers.
        """
        self.lifecycle.check_usable()
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
        assert dev is not None and slot.posted is not None
        with ranges.span("recv_wait", slot.index):
            self._wait(slot.posted, sends=False, deadline=deadline)
        slot.posted.recv_works = []  # done (a coalesced work stays in send_works until released)
        if self.debug_hook is not None:
            self.debug_hook("received", slot.recv_blocks)
        targets = self._targets(slot, sched)
        with ranges.span("unpack", slot.index):
            for o, side in sched.unpack_sides.items():  # one launch per owner, all peers
                _unpack(slot.recv_stage[o][: sched.recv_stage_rows[o]], side, targets[o], dev)
        state = self._state(slot)
        self._checks.delivered(state, sched, targets, dev, self.rank)
        group_size = sched.dest.group_size
        if group_size > 1:
            if tp_group is None:
                raise AssertionError("a destination group of several ranks needs its TP group")
            with ranges.span("tp_all_gather", slot.index):
                for owner in sorted(slot.outputs):
                    self.faults.timed(
                        functools.partial(
                            all_gather_flat,
                            slot.outputs[owner],
                            targets[owner],
                            group=tp_group,
                            timeout_s=time_left(deadline),
                        ),
                        lambda: (
                            f"the student TP all-gather after the crossing (micro-batch "
                            f"{slot.index}, over global ranks "
                            f"{cdist.group_ranks(tp_group)})"
                        ),
                    )
            self._checks.gathered(
                state,
                index=slot.index,
                sched=sched,
                outputs=slot.outputs,
                tp_group=tp_group,
                group_size=group_size,
                deadline=deadline,
                timed=self.faults.timed,
                hook=self.debug_hook,
            )
        slot.give_back(self._pool, receives=True)

    def release(self, slot: Slot, *, deadline: float) -> None:
        """Wait for ``slot``'s sends and return their staging buffers (idempotent)."""
        if slot.released:
            return
        slot.released = True
        posted = slot.posted
        if posted is not None and slot.schedule is not None and slot.issued:
            with ranges.span("send_wait", slot.index):
                self._wait(posted, sends=True, deadline=deadline)
        # completed work objects are dropped: one that outlives its process group at exit aborts
        # (a coalesced work also covers the receives: it goes once they are complete too)
        if posted is not None and (posted.send_works is not posted.recv_works or slot.received):
            posted.send_works = []
        slot.give_back(self._pool, receives=False)

    def sends_done(self, slot: Slot) -> bool:
        """True once every send of ``slot`` has completed (a poll, no wait)."""
        return slot.posted is None or self.transport.sends_done(slot.posted)

    # --- integrity -----------------------------------------------------------------------------

    def verdict(
        self, slots: Sequence[Slot], *, group: dist.ProcessGroup | None, deadline: float
    ) -> None:
        """Integrity: judge every slot's checks; the same
        :class:`~mopd.bridge.errors.BridgeIntegrityError` everywhere.

        Collective over ``group`` (the gloo metadata group): every rank calls it once per step.
        """
        integrity_verdict(
            [(s.index, s.schedule, s.checks) for s in slots],
            rank=self.rank,
            group=group,
            deadline=deadline,
            timed=self.faults.timed,
        )

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
