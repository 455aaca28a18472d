"""A planned step on one rank: its sends, receives and fence; and the one-call exchange's handle.

Why this file exists: a :class:`BridgeStep` is what a training loop holds between
:meth:`~mopd.bridge.api.HiddenStateBridge.plan_step` and ``finish()``: the schedules of its
micro-batches, the order they go on the wire, the rows each receive returns and the state that
fences one step from the next. It needs only what the bridge that planned it fixed at
construction (:class:`StepBridge`), so it does not import the bridge (which builds steps).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
import torch

from mopd.bridge.catalog import RunCatalog
from mopd.bridge.config import BridgeConfig, TeacherSpec
from mopd.bridge.errors import BridgeNonFiniteError, BridgeStateError
from mopd.bridge.executor import Executor, Slot
from mopd.bridge.faults import Faults
from mopd.bridge.groups import BridgeGroups
from mopd.bridge.inputs import check_buffer
from mopd.bridge.lifecycle import Lifecycle
from mopd.bridge.metadata import Section, StepMatrix, code_dtype
from mopd.bridge.order import StepOrder
from mopd.bridge.plan import plan_rank
from mopd.bridge.record import StepView
from mopd.bridge.schedule import RankSchedule
from mopd.bridge.topology import Topology
from mopd.common import dist as cdist
from mopd.common import ranges

__all__ = [
    "BridgeStep",
    "ExchangeHandle",
    "StepBridge",
]


class StepBridge(Protocol):
    """What a step reads off the bridge that planned it (a
    :class:`~mopd.bridge.api.HiddenStateBridge`), fixed when that bridge was built."""

    @property
    def teachers(self) -> tuple[TeacherSpec, ...]: ...

    @property
    def topology(self) -> Topology: ...

    @property
    def groups(self) -> BridgeGroups: ...

    @property
    def config(self) -> BridgeConfig: ...

    @property
    def rank(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def executor(self) -> Executor: ...

    @property
    def lifecycle(self) -> Lifecycle: ...

    @property
    def faults(self) -> Faults: ...


class BridgeStep:
    """One rank's share of a planned step (see :mod:`mopd.bridge.api`): ``send``, ``receive``,
    ``finish``.

    Built by :meth:`HiddenStateBridge.plan_step`. Use it as a context manager: leaving the
    block normally calls :meth:`finish`; leaving it on an exception abandons the step
    (:meth:`abandon`): this rank's bridge refuses further use, and every rank's next
    ``plan_step`` raises :class:`BridgeStateError` naming that failure.
    """

    def __init__(
        self,
        bridge: StepBridge,
        matrix: StepMatrix,
        catalogs: Sequence[RunCatalog],
        sections: Sequence[Section | None],
        *,
        seq: int = 0,
        view: StepView,
        keys: Sequence[bytes],
        cached: Sequence[tuple[bool, RankSchedule | None]],
        tokens_I: np.ndarray | None = None,
    ) -> None:
        self._bridge = bridge
        self._view = view
        #: global_tokens per micro-batch: given (the bridge's memo), or read once
        self._tokens_I: np.ndarray | None = tokens_I
        #: this step's number on its bridge (the same on every rank); its transfers carry it
        self.seq = seq
        self._catalogs = catalogs  # the ones plan_step checked: their decoded runs are kept
        n_slots = self.num_micro_batches = len(self._catalogs)
        self._sections = list(sections)
        self.finished = False
        topo = bridge.topology
        n = len(bridge.teachers)
        # per owner (hidden, dtype) from the teacher's first leader: the students' buffers
        self._specs: dict[int, tuple[int, torch.dtype]] = {}
        for o, spec in enumerate(bridge.teachers):
            dtype = code_dtype(matrix.teacher_head(o, topo.first_leader(o))[0])
            assert dtype is not None
            self._specs[o] = (spec.hidden_size, dtype)
        self._slots: list[Slot] = []
        ex = bridge.executor
        row_bytes = [h * d.itemsize for h, d in self._specs.values()]
        with ranges.span("plan"):
            # the micro-batches whose plan inputs are new (or whose schedule was evicted),
            # planned together (each catalog's plan_rank plans every pending one with it)
            todo = [i for i in range(n_slots) if not cached[i][0]]
            view.batch.expect(todo)
            plans = [
                plan_rank(
                    self._catalogs[i],
                    bridge.rank,
                    local_copy=bridge.config.local_copy,
                    compact=True,
                )
                for i in todo
            ]
            view.batch.done()
            busy = [(i, p) for i, p in zip(todo, plans, strict=True) if p.busy]
            made = ex.schedules(
                [p for _, p in busy],
                slice_rows=[  # the group's slices' rows (DestGroup.slice_rows)
                    0 if p.dest is None else p.dest.padded_rows // p.dest.group_size
                    for _, p in busy
                ],
                num_owners=n,
                row_bytes=row_bytes,
            )
            fresh: dict[int, RankSchedule | None] = dict.fromkeys(todo)
            fresh.update((i, s) for (i, _), s in zip(busy, made, strict=True))
            for i in range(n_slots):
                hit, sched = cached[i]
                if not hit:
                    sched = fresh[i]
                    ex.remember(keys[i], sched)
                self._slots.append(Slot(index=i, schedule=sched))
        self._owner_dev: dict[int, torch.Tensor] = {}
        self._order = StepOrder(
            self._slots,
            executor=ex,
            rank=bridge.rank,
            output_specs=self._specs,
            device=bridge.device,
            group=bridge.groups.bridge,
            tag=self.tag,
            tp_group=bridge.groups.student_tp,
        )

    # --- figures -------------------------------------------------------------------------------

    def owner(self, micro_batch: int) -> torch.Tensor | None:
        """``[N]`` int64 on the bridge's device: which teacher owns each row of this rank's
        layout for ``micro_batch`` (``-1``: padding); ``None`` on ranks that receive nothing.
        Teacher ``k``'s compact rows from :meth:`receive` are the rows where it equals ``k``,
        in order. Still readable after :meth:`finish` (like the rows it describes)."""
        self._check_index(micro_batch, finished_ok=True)
        sched = self._slots[micro_batch].schedule
        if sched is None or sched.owner_N is None:
            return None
        got = self._owner_dev.get(micro_batch)
        if got is None:
            got = self._owner_dev[micro_batch] = sched.owner_N.to(self._bridge.device)
        return got

    def schedule(self, micro_batch: int) -> RankSchedule | None:
        """This rank's schedule for ``micro_batch`` (``None``: nothing to do there): its sends,
        receives, local copies and figures (:meth:`~mopd.bridge.schedule.RankSchedule.counts`)."""
        if isinstance(micro_batch, bool) or not 0 <= micro_batch < self.num_micro_batches:
            raise ValueError(f"micro-batch {micro_batch!r} outside [0, {self.num_micro_batches})")
        return self._slots[micro_batch].schedule

    def traffic(self) -> list[tuple[int, int, int, int, int]]:
        """What this rank moves in the step: ``(micro_batch, owner, src_rank, dst_rank, bytes)``
        for each of its sends and local copies (``src_rank == dst_rank``), from its plans."""
        out = []
        for slot in self._slots:
            sched = slot.schedule
            if sched is None:
                continue
            rb = sched.row_bytes
            for op in sched.sends:
                out.append(
                    (slot.index, op.owner, self._bridge.rank, op.peer, op.count * rb[op.owner])
                )
            for x in sched.locals:
                r = self._bridge.rank
                out.append((slot.index, x.owner, r, r, x.src.count * rb[x.owner]))
        return out

    def num_tokens(self, micro_batch: int) -> int:
        """Real tokens in the rows this rank receives for ``micro_batch`` (0 if none)."""
        sched = self._slots[micro_batch].schedule
        return 0 if sched is None or sched.owner_N is None else int((sched.owner_N >= 0).sum())

    def global_tokens(self, micro_batch: int | None = None) -> int:
        """Real tokens the student wants in ``micro_batch`` over all its shards (each once), or
        in the whole step with ``None``: the destination leaders' token counts, summed over
        the metadata group with the step's verdict (no communication here)."""
        if self._tokens_I is None:
            self._tokens_I = self._view.tokens_I()
        if micro_batch is None:
            return int(self._tokens_I.sum())
        if isinstance(micro_batch, bool) or not 0 <= micro_batch < self.num_micro_batches:
            raise ValueError(f"micro-batch {micro_batch!r} outside [0, {self.num_micro_batches})")
        return int(self._tokens_I[micro_batch])

    # --- the data phase ------------------------------------------------------------------------

    def _check_index(self, i: int, *, finished_ok: bool = False) -> None:
        if not finished_ok or self._bridge.lifecycle.closed:
            self._bridge.lifecycle.check_usable()
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_micro_batches:
            raise ValueError(f"micro-batch {i!r} outside [0, {self.num_micro_batches})")
        if self.finished and not finished_ok:
            raise BridgeStateError("this step is finished; plan the next one with plan_step")

    @property
    def posted(self) -> int:
        """Micro-batches this rank has posted (in order)."""
        return self._order.posted

    def unposted(self) -> bool:
        """True while this rank has micro-batches of the step left to post that put something
        on the wire (a later step's transfers would pair with them). A micro-batch with no
        send or receive on this rank (nothing to do, or local copies only) counts as posted:
        a rank with no transfers in a step is fully posted from the start."""
        if self.finished:
            return False
        return any(_on_wire(slot) for slot in self._slots[self._order.posted :])

    @property
    def tag(self) -> int:
        """The step's tag on the wire (its number; gloo matches by it, NCCL ignores it)."""
        return 1 + self.seq % (1 << 30)

    def _issue_through(self, i: int, *, why: str) -> None:
        """Post every micro-batch up to ``i`` in order (their rows must have been given)."""
        self._order.post_through(i, why=why)

    def send(self, micro_batch: int, hidden: Mapping[int, torch.Tensor]) -> None:
        """Give micro-batch ``micro_batch``'s teacher rows; they are taken now (point to point).

        On a teacher's last-stage ranks: ``hidden`` maps teacher index -> the captured buffer
        described by this rank's layout for that micro-batch (contiguous, hidden dim last, the
        declared dtype, on the bridge's device). The buffer may be overwritten as soon as this
        returns. A rank holding several teachers may give them in one call or one per call.
        Call it in micro-batch order; the micro-batch is posted once all its teachers are given.
        On ranks that hold no teacher rows there is nothing to send.

        Raises:
            ValueError: a buffer that does not match this rank's plan (on this rank only: the
                students waiting for its rows then time out).
        """
        self._check_index(micro_batch)
        b = self._bridge
        b.lifecycle.check_usable()
        b.faults.at(self.seq, "send", micro_batch)
        if not isinstance(hidden, Mapping):
            raise ValueError(
                f"hidden must be a mapping teacher index -> tensor, got {type(hidden).__name__}"
            )
        extra = [o for o in hidden if not (isinstance(o, int) and 0 <= o < len(b.teachers))]
        if extra:
            raise ValueError(f"teacher indices {extra} outside [0, {len(b.teachers)})")
        flat: dict[int, torch.Tensor] = {}
        for o, t in hidden.items():
            sec = self._sections[o]
            if sec is None:
                raise ValueError(f"this rank holds no rows of teacher {o} (not its last stage)")
            if o in self._order.given[micro_batch]:
                raise BridgeStateError(
                    f"teacher {o}'s rows of micro-batch {micro_batch} were already sent"
                )
            flat[o] = check_buffer(
                o,
                micro_batch,
                t,
                sec.layouts[micro_batch],
                self._specs[o][0],
                sec.dtype,
                b.device,
            )
        need = self._order.needed(micro_batch)
        if micro_batch < self._order.posted and need & set(flat):
            raise BridgeStateError(f"micro-batch {micro_batch} was already posted")
        slot = self._slots[micro_batch]
        take = {o: f for o, f in flat.items() if o in need}
        if take:
            b.executor.take(slot, take, output_specs=self._specs, device=b.device)
        self._order.give(micro_batch, flat)

    def receive(self, micro_batch: int) -> dict[int, torch.Tensor]:
        """Wait for micro-batch ``micro_batch`` and return ``teacher -> [N_k, H_k]`` rows
        (point to point).

        On the student's last-stage ranks: for every teacher ``k``, compact rows: exactly the
        ``N_k`` tokens of this rank's layout for that micro-batch (its own slice with
        ``keep_sp_shard``) that teacher ``k`` owns, in the layout's row order, i.e. the rows
        ``r`` with ``owner(micro_batch)[r] == k``; no zero rows for tokens of other teachers
        or for padding (``N_k`` may be 0). This is the compact form the KL takes
        (:func:`mopd.kernels.kl.vocab_parallel_kl` with ``teacher_index_T = owner`` and the
        counted tokens as its mask); :func:`mopd.bridge.layout_rows` scatters them back into
        the layout's order. With one teacher that is every real token, padding rows dropped.
        Earlier micro-batches not received yet are completed first (in order). Other ranks get
        ``{}``. Every rank of a student TP group calls it for the same micro-batches (the rows
        are all-gathered over that group).
        """
        self._check_index(micro_batch)
        b = self._bridge
        b.lifecycle.check_usable()
        b.faults.at(self.seq, "receive", micro_batch)
        self._order.complete_through(micro_batch, deadline=time.monotonic() + b.config.timeout_s)
        self._order.release_done()
        slot = self._slots[micro_batch]
        sched = slot.schedule
        if sched is None or sched.dest is None:
            return {}
        rows = {o: t[: sched.out_rows(o)] for o, t in slot.outputs.items()}
        if b.config.check_finite and rows:
            self._check_finite(slot, rows)
        return rows

    def _check_finite(self, slot: Slot, rows: Mapping[int, torch.Tensor]) -> None:
        """Raise :class:`BridgeNonFiniteError` if a teacher's ``[N, H]`` rows hold NaN / Inf
        (one reduction per teacher, one host sync); the step then fails everywhere (its next
        ``plan_step`` says so on every rank). The first failure published names the rank that
        sent the rows (a teacher rank), found by this rank."""
        ok = torch.stack([torch.isfinite(t).all() for t in rows.values()]).tolist()
        if all(ok):
            return
        b = self._bridge
        found = []
        sender: int | None = None
        first_found = ""
        for (o, t), fine in zip(rows.items(), ok, strict=True):
            if fine:
                continue
            bad = torch.nonzero(~torch.isfinite(t).all(dim=1)).reshape(-1)
            first = int(bad[0])
            where, src = self._source_of(slot, o, first)
            found.append(
                f"teacher {o}: {bad.numel()} of {t.shape[0]} rows (first: row {first}, {where})"
            )
            if sender is None and src is not None:
                sender, first_found = src, found[-1]
        text = (
            f"global rank {b.rank}: non-finite (NaN/Inf) teacher rows arrived in micro-batch "
            f"{slot.index} of step {self.seq}: " + "; ".join(found)
        )
        cause = None
        if sender is not None and sender != b.rank:
            cause = (
                f"it sent non-finite (NaN/Inf) teacher rows in micro-batch {slot.index} of step "
                f"{self.seq} (found by global rank {b.rank}: {first_found})"
            )
        b.faults.mark_abandoned(
            text,
            cause=cause,
            rank=sender if cause is not None else None,
            where=f"step {self.seq}, its rows of micro-batch {slot.index}" if cause else None,
        )
        raise BridgeNonFiniteError(text)

    def _source_of(self, slot: Slot, owner: int, row: int) -> tuple[str, int | None]:
        """Which rank sent row ``row`` of ``owner``'s rows to this rank, in words (for messages)
        and as a global rank (``None``: a padding row, or not found)."""
        b = self._bridge
        sched = slot.schedule
        assert sched is not None and sched.dest is not None
        n = sched.slice_rows_of(owner)
        j, rel = divmod(row, max(n, 1))
        if j != sched.dest.slot:
            tp = b.groups.student_tp
            who = cdist.group_ranks(tp)[j] if tp is not None else j
            src = self._peer_sender(slot.index, who, owner, rel)
            via = ""
            if src is not None:
                via = f"sent to it by global rank {src}, " if src != who else "its local copy, "
            return f"the slice of global rank {who}, {via}via the student TP all-gather", src
        for op in sched.recvs:
            if op.owner == owner and bool((op.side.rows == rel).any()):
                return f"sent by global rank {op.peer}", op.peer
        for lop in sched.locals:
            if lop.owner == owner and bool((lop.dst.rows == rel).any()):
                return f"a local copy on global rank {b.rank}", b.rank
        return "a padding row", None

    def _peer_sender(self, index: int, who: int, owner: int, rel: int) -> int | None:
        """Who sent row ``rel`` of ``owner``'s slice on global rank ``who`` (a student TP peer of
        this rank) in micro-batch ``index``: read off that rank's plan, computed here (the
        failure path only)."""
        b = self._bridge
        try:
            catalog = self._catalogs[index]
            plan = plan_rank(catalog, who, local_copy=b.config.local_copy, compact=True)
            if plan.dest is None:
                return None
            sched = RankSchedule.build(
                plan,
                slice_rows=catalog.dests[plan.dest.group].slice_rows,
                num_owners=len(b.teachers),
                row_bytes=[h * d.itemsize for h, d in self._specs.values()],
            )
        except Exception:  # a name in a message is not worth a second failure
            return None
        for op in sched.recvs:
            if op.owner == owner and bool((op.side.rows == rel).any()):
                return op.peer
        for lop in sched.locals:
            if lop.owner == owner and bool((lop.dst.rows == rel).any()):
                return who
        return None

    def finish(self) -> None:
        """Complete the step on this rank: every micro-batch issued, received and sent.

        Every rank of the bridge group calls it once per step, after the schedule (a collective
        with integrity on: the verdict). Raises :class:`BridgeStateError` if this rank holds
        teacher rows of a micro-batch it never sent.
        """
        if self.finished:
            return
        b = self._bridge
        b.lifecycle.check_usable()
        b.faults.at(self.seq, "finish")
        deadline = time.monotonic() + b.config.timeout_s
        self._order.finish(deadline=deadline)
        self.finished = True
        if b.config.integrity:
            meta = b.groups.metadata_group
            with ranges.span("integrity"):
                b.executor.verdict(self._slots, group=meta, deadline=deadline)
        b.faults.at(self.seq, "done")

    def __enter__(self) -> BridgeStep:
        return self

    def _drop(self) -> None:
        """Let go of everything the step holds that lives on the bridge's groups (its slots'
        transport handles and buffers): the bridge is being closed. The step is finished."""
        self.finished = True
        self._slots = []
        self._catalogs = []
        self._owner_dev.clear()
        self._order.slots = []
        self._order.group = None
        self._order.tp_group = None

    def abandon(self, cause: BaseException | str) -> None:
        """Give the step up on this rank (its caller raised inside it): no further call on this
        bridge succeeds here, and the next ``plan_step`` tells every rank (each raises
        :class:`BridgeStateError` naming this failure) instead of planning a step whose
        transfers could pair with this one's leftovers. Local, no communication."""
        if self.finished:
            return
        b = self._bridge
        what = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        b.faults.mark_abandoned(
            f"step {self.seq} abandoned on global rank {b.rank} after {self._order.posted} of "
            f"{self.num_micro_batches} micro-batches posted, {self._order.received} received: "
            f"{what}",
            cause=what,
        )
        self.finished = True

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.finish()
        elif isinstance(exc, BaseException):
            self.abandon(exc)


def _on_wire(slot: Slot) -> bool:
    """Whether posting ``slot`` puts anything on the wire (a send or a receive)."""
    sched = slot.schedule
    return sched is not None and bool(sched.sends or sched.recvs)


class ExchangeHandle:
    """A one-micro-batch exchange in flight (:meth:`HiddenStateBridge.exchange`)."""

    def __init__(self, step: BridgeStep) -> None:
        self.step = step
        self._outputs: dict[int, torch.Tensor] | None = None

    @property
    def owner_N(self) -> torch.Tensor | None:
        """``[N]`` which teacher owns each row of the student's layout (``-1``: padding);
        ``None`` elsewhere. Teacher ``k``'s rows from :meth:`wait` are the rows where it is ``k``."""
        return self.step.owner(0)

    @property
    def done(self) -> bool:
        return self.step.finished

    def wait(self) -> dict[int, torch.Tensor]:
        """Complete the exchange; every rank calls it (teacher-only ranks too). Idempotent.

        Returns ``teacher -> [N_k, H_k]`` compact rows on student ranks (as
        :meth:`BridgeStep.receive`: teacher ``k``'s tokens in layout order, see
        :attr:`owner_N`), ``{}`` elsewhere.
        """
        if self._outputs is None:
            self._outputs = self.step.receive(0)
            self.step.finish()
        return self._outputs
