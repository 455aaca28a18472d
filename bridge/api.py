"""The live bridge: teacher hidden states -> every student rank's own layout, per micro-batch.

Why this file exists: it ties the pieces together on a running job, in the shape a training
loop needs. Megatron's pipeline schedule runs micro-batches in its own order and owns the
point-to-point slots between stages, so nothing collective over the whole bridge group may run
inside ``forward_step_func`` / ``loss_func``. A step therefore has two phases:

1. :meth:`HiddenStateBridge.plan_step`, outside the schedule, on every rank of the bridge group:
   one metadata exchange for all micro-batches of both sides (:mod:`mopd.bridge.metadata`: an
   all-reduce of the records' header summary, then, on an agreed step, each rank's peers'
   records, routed (:mod:`mopd.bridge.peers`); every record, flat or in two levels over node
   groups, when some header differs), checks whose verdict every rank shares (bad input
   raises the same ``ValueError`` on every rank before any data moves), and each rank's own
   plans of its micro-batches (:mod:`mopd.bridge.plan`, work proportional to its own runs and
   its peers').
2. Per micro-batch, point to point only: :meth:`BridgeStep.send` on teacher ranks takes the
   captured rows at the call (the buffer may be reused as soon as it returns) and posts the
   transfers; :meth:`BridgeStep.receive` on student ranks waits for them and returns each
   teacher's rows compact, in the student's own order (one row per token);
   :meth:`BridgeStep.finish` (every rank, after the schedule) waits for the sends and releases
   the buffers.

Ordering (why this cannot deadlock; :class:`~mopd.bridge.order.StepOrder` keeps it): every
rank issues its micro-batches in order, one batch of
point-to-point operations per micro-batch holding all of that rank's sends and receives for it.
A micro-batch with receives only is issued at the latest when it is received, or when a later
one is; one with sends waits for its :meth:`~BridgeStep.send`. So any two ranks meet in the same
micro-batch order, and a rank's receive never waits on a send its own later work would post. The
teacher may send all its micro-batches first (a forward-only pass before the student's schedule)
or one per student micro-batch (colocated meshes, inline), as long as it sends in order.

Failures of the run are not ``ValueError``: a rank that never calls, raises or dies leaves the
others with a :class:`~mopd.bridge.errors.BridgeTimeoutError` (or
:class:`~mopd.bridge.errors.BridgeCommError`) within ``BridgeConfig.timeout_s`` of the phase
they wait in, naming the phase, the peers and the timeout; afterwards the bridge refuses further
calls (:class:`~mopd.bridge.errors.BridgeStateError`). A bad buffer given to ``send`` is only
known to that rank: it raises ``ValueError`` there, and the student ranks waiting for its rows
time out. ``BridgeConfig(integrity=True)`` checks every delivered row; its verdict is part of
:meth:`BridgeStep.finish`, then a collective.

Streams (CUDA): ``send`` queues its copies and posts on the current stream; ``receive`` makes the
current stream wait for the transfers and queues the unpacking and the TP all-gather there.
Read the rows on that stream, or order yours after it.

The step itself is :mod:`mopd.bridge.step`'s, the configs :mod:`mopd.bridge.config`'s, the
checks every rank judges alike off the exchanged records :mod:`mopd.bridge.checks`'s, and the
rules for the caller's layouts and buffers :mod:`mopd.bridge.inputs`'s. This module keeps the
bridge and its planning call, and re-exports the names it used to define.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mopd.bridge.checks import agreed_slots, agreed_state, rank_checks
from mopd.bridge.config import BridgeConfig, TeacherSpec
from mopd.bridge.executor import Executor
from mopd.bridge.failures import FailureBoard
from mopd.bridge.faults import Faults
from mopd.bridge.groups import BridgeGroups
from mopd.bridge.inputs import Agreement, LayoutArg, StepChecks, called, check_buffer, layout_list
from mopd.bridge.layout import TokenLayout
from mopd.bridge.lifecycle import Lifecycle
from mopd.bridge.mesh import Mesh, meshes_overlap
from mopd.bridge.metadata import (
    SIZE,
    STATE_FAILED,
    STATE_OPEN,
    STATE_READY,
    RaggedRecords,
    RecordRoute,
    Section,
    StepMatrix,
    encode_step_record,
    gather_records,
    record_tables,
    reduce_summary,
    reuses_memo,
    summary_heads,
    uniform_count,
)
from mopd.bridge.peers import exchange_records
from mopd.bridge.record import config_signature, rank_roles, rank_sections, read_step
from mopd.bridge.route import GroupWire, Wire
from mopd.bridge.step import BridgeStep, ExchangeHandle
from mopd.bridge.topology import Topology
from mopd.bridge.transport import comm_failure
from mopd.bridge.worlds import WorldLink
from mopd.common import dist as cdist
from mopd.common import ranges

__all__ = [
    "BridgeConfig",
    "BridgeStep",
    "ExchangeHandle",
    "HiddenStateBridge",
    "LayoutArg",
    "TeacherSpec",
]


class HiddenStateBridge:
    """Moves captured teacher hidden states into the student's layout (see the module doc).

    Args:
        teachers: the teachers; index = owner = key of the ``hidden`` / layout mappings.
        student: the student mesh.
        groups: this rank's groups (:func:`mopd.bridge.groups.create_bridge_groups`; a live
            Megatron job may pass its student TP group as ``BridgeGroups.student_tp``).
        config: settings.
        store: the key-value store the job's first failure is published in, under the
            metadata group's name (:mod:`mopd.bridge.failures`; default: torch.distributed's
            default store): every rank's error then leads with it.
        link: the worlds the meshes span (:func:`~mopd.bridge.worlds.connect_worlds`; the
            meshes and ``groups`` in its bridge ranks): the failure board lives in the link's
            store (``store`` unless given) and names ranks by world.
    """

    def __init__(
        self,
        *,
        teachers: Sequence[TeacherSpec],
        student: Mesh,
        groups: BridgeGroups,
        config: BridgeConfig | None = None,
        store: dist.Store | None = None,
        link: WorldLink | None = None,
        _topology: Topology | None = None,
    ) -> None:
        if not teachers:
            raise ValueError("the bridge needs at least one teacher")
        bad = [t for t in teachers if not isinstance(t, TeacherSpec)]
        if bad or not isinstance(student, Mesh):
            raise ValueError(
                "teachers must be TeacherSpec and student a Mesh, got "
                f"{[type(t).__name__ for t in teachers]} and {type(student).__name__}"
            )
        self.teachers = tuple(teachers)
        self.student = student
        self.groups = groups
        self.config = config or BridgeConfig()
        self.rank = groups.rank
        self.topology = _topology or Topology.build(
            [t.mesh for t in self.teachers],
            student,
            per_rank_dests=self.config.keep_sp_shard,
            shard_sources=[t.sp_shards for t in self.teachers],
        )
        if tuple(groups.members) != self.topology.members:
            raise ValueError(
                f"groups were created for global ranks {list(groups.members)} but these meshes "
                f"span {list(self.topology.members)}: pass create_bridge_groups(pool, "
                "teacher_meshes, student) for the same meshes"
            )
        self.device = cdist.group_device(groups.bridge)
        if (
            not self.config.local_copy
            and self.device.type == "cpu"
            and meshes_overlap([*(t.mesh for t in self.teachers), student])
        ):
            raise ValueError(
                "local_copy=False sends colocated rows to the same rank, which the gloo "
                "backend cannot do (gloo has no send-to-self); use NCCL or local_copy=True"
            )
        self._executor = Executor(
            rank=self.rank,
            timeout_s=self.config.timeout_s,
            max_schedules=self.config.max_cached_plans,
            integrity=self.config.integrity,
            board=FailureBoard.of(
                groups.metadata_group,
                rank=self.rank,
                members=self.topology.members,
                timeout_s=self.config.timeout_s,
                store=link.store if link is not None and store is None else store,
                names=link.names if link is not None else None,
                store_host=0 if link is not None and store is None else None,
            ),
        )
        # offline (no groups): nothing is all-gathered after the crossing
        self._tp_group_error = "" if groups.is_offline else self._check_student_tp_group()
        #: an offline bridge's metadata wire (:meth:`offline`); ``None``: the groups' own
        self._offline_wire: Callable[[float], Wire] | None = None
        #: what this rank contributes per section (:func:`~mopd.bridge.record.rank_roles`)
        self._roles = rank_roles(
            self.rank,
            [t.mesh for t in self.teachers],
            student,
            keep_sp_shard=self.config.keep_sp_shard,
            shard_sources=self.topology.shard_sources,  # the topology's sources, one rule
        )
        self.config_sig = config_signature(
            self.teachers,
            student,
            self.config,
            members=self.topology.members,
            routed=groups.meta_routes is not None,
        )
        self._open_steps: list[BridgeStep] = []
        #: what the last planned step derived from the job's tables (:class:`_PlanMemo`)
        self._memo: _PlanMemo | None = None
        #: every step of this bridge still referenced somewhere (:meth:`close` empties them)
        self._live_steps: weakref.WeakSet[BridgeStep] = weakref.WeakSet()
        #: steps planned on this bridge
        self.steps = 0
        #: :meth:`close` was called
        self.closed = False

    @classmethod
    def offline(
        cls,
        *,
        teachers: Sequence[TeacherSpec],
        student: Mesh,
        rank: int,
        config: BridgeConfig | None = None,
        topology: Topology | None = None,
        wire: Callable[[float], Wire] | None = None,
    ) -> HiddenStateBridge:
        """This bridge as global rank ``rank`` of these meshes holds it, without a process
        group: its record, verdicts, plan keys, plans and schedules are the live bridge's, and
        nothing moves (:class:`~mopd.bridge.offline.OfflineBridge` runs a step on it; the
        ``mopd plan`` inspector, ``mopd bench plan`` and the tests use it).

        Args:
            teachers, student, config: as for the live bridge.
            rank: the global rank this bridge is (a member of the meshes).
            topology: the meshes' :class:`~mopd.bridge.topology.Topology` when the caller has
                built it (it is the same for every rank of a job); else built here.
            wire: ``deadline -> `` the metadata rounds' and sums' transport (a
                :class:`~mopd.bridge.peers.Wire`, e.g. a simulation of every member); ``None``:
                a step that needs one raises.
        """
        topo = topology or Topology.build(
            [t.mesh for t in teachers],
            student,
            per_rank_dests=(config or BridgeConfig()).keep_sp_shard,
            shard_sources=[t.sp_shards for t in teachers],
        )
        if rank not in topo.members:
            raise ValueError(f"global rank {rank} is not in the meshes {list(topo.members)}")
        groups = BridgeGroups.offline(members=topo.members, rank=rank)
        bridge = cls(
            teachers=teachers, student=student, groups=groups, config=config, _topology=topo
        )
        bridge._offline_wire = wire
        return bridge

    def close(self) -> None:
        """Free what this bridge holds on its groups: its steps' transport handles and buffers,
        its caches, its references to the groups (local; every rank of the bridge calls it
        before closing the groups' :class:`~mopd.bridge.groups.GroupPool`). Every later call
        on the bridge or its steps raises :class:`~mopd.bridge.errors.BridgeStateError`.
        Idempotent; ``with HiddenStateBridge(...) as bridge:`` closes it on leaving."""
        if self.closed:
            return
        self.closed = True
        for step in list(self._live_steps):
            step._drop()
        self._open_steps = []
        self._memo = None
        # the board's watcher ends with the last bridge on its group (other bridges of this
        # process on the same group share it)
        self.faults.board = None
        self._executor.close()
        self.groups = BridgeGroups(bridge=None, student_tp=None, members=self.groups.members)

    def __enter__(self) -> HiddenStateBridge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def executor(self) -> Executor:
        """This rank's executor (schedule cache, staging buffers, figures)."""
        return self._executor

    @property
    def lifecycle(self) -> Lifecycle:
        """Whether this rank's bridge may be used, and the first failure that ended it."""
        return self._executor.lifecycle

    @property
    def faults(self) -> Faults:
        """What a failure on this rank means, what is recorded of it, and where the rank is."""
        return self._executor.faults

    def _check_student_tp_group(self) -> str:
        """Why ``groups.student_tp`` cannot serve this rank's all-gather, or ``""``."""
        s = self.student
        c = s.coord(self.rank)
        if s.tp == 1 or self.config.keep_sp_shard or c is None or c.pp_rank != s.pp - 1:
            return ""
        want = tuple(s.tp_group_ranks(dp_rank=c.dp_rank, cp_rank=c.cp_rank))
        tp = self.groups.student_tp
        if tp is None:
            return (
                f"the student has tp={s.tp} and all-gathers after the crossing, but "
                f"groups.student_tp is None on this rank; pass a process group over global "
                f"ranks {list(want)} (create_bridge_groups makes it) or keep_sp_shard=True"
            )
        try:
            got = tuple(cdist.group_ranks(tp))
        except Exception as exc:
            return f"groups.student_tp is not a process group this rank belongs to ({exc})"
        if tuple(sorted(got)) != tuple(sorted(want)):
            return (
                f"groups.student_tp spans global ranks {list(got)} but this rank's student TP "
                f"group (dp={c.dp_rank}, cp={c.cp_rank}) is {list(want)}"
            )
        return ""

    # --- the step ------------------------------------------------------------------------------

    def plan_step(
        self,
        *,
        teacher_layouts: Mapping[int, Sequence[LayoutArg] | Callable[[], Sequence[LayoutArg]]]
        | None = None,
        student_layouts: Sequence[LayoutArg] | Callable[[], Sequence[LayoutArg]] | None = None,
        check: Callable[[], Mapping[str, int] | None] | None = None,
        _buffers: Mapping[Any, Any] | None = None,
    ) -> BridgeStep:
        """Exchange a step's metadata, agree on it, and plan this rank's micro-batches.

        Collective over the bridge group, outside the training schedule: every rank of every
        mesh calls it once per step, each with what it holds.

        Args:
            teacher_layouts: on a teacher's last-stage ranks, ``teacher index -> `` one layout
                per micro-batch of the rows that rank will :meth:`BridgeStep.send` (its
                captured buffer's flat ``[R, H]`` rows: ``[S, B, H]`` order for a padded
                batch, THD for packed; SP undone, CP not; each rank's own SP slice with
                :attr:`TeacherSpec.sp_shards`); ``None`` elsewhere.
            student_layouts: on the student's last-stage ranks, one layout per micro-batch of
                the rows it wants (typically the order of its logits, ``[B, S]``; identical on
                the ranks of one student TP group, or each rank's own slice with
                ``keep_sp_shard``); ``None`` elsewhere.

            check: this rank's own input checks, run first in the guarded phase: a
                ``ValueError`` it raises reaches every rank as the same ``ValueError``; it may
                return ``{what: count}`` micro-batch counts this rank commits to (e.g. a
                student's first stage, which passes no layouts), agreed with everyone's, as a
                :class:`~mopd.bridge.inputs.StepChecks` with the
                :class:`~mopd.bridge.inputs.Agreement` s its peers must match (a model
                replica's shapes): compared after the metadata exchange, a difference is the
                same ``ValueError`` everywhere.

        Micro-batch ``i`` on one side is micro-batch ``i`` on the other: teacher micro-batch
        ``i`` (over all teacher shards) must hold every token student micro-batch ``i`` wants.
        Every layout may be a zero-argument callable (built inside the guarded phase).

        Returns:
            This rank's :class:`BridgeStep`.
        Raises:
            ValueError: bad input on any rank (the same text on every rank, before data moves).
            BridgeTimeoutError, BridgeCommError: the metadata exchange or the verdict on the
                input failed. After those, and after any other error past the metadata
                all-gather except the agreed ``ValueError``, the bridge refuses further use.
            BridgeStateError: an earlier exchange failed.
        """
        if self.closed:
            self.lifecycle.check_usable()
        if self.groups.bridge is None:
            raise ValueError(
                f"global rank {self.rank} is in no mesh of this bridge; it must not call it"
            )
        if self.lifecycle.hard:  # the transport may be out of step: refuse locally
            self.lifecycle.check_usable()
        open_steps = [s for s in self._open_steps if not s.finished]
        if open_steps and self.lifecycle.failure is None:
            warnings.warn(
                f"global rank {self.rank}: a step is planned while {len(open_steps)} earlier "
                "step(s) of this bridge are not finished; call step.finish() (every rank) after "
                "the schedule so their buffers are released",
                stacklevel=2,
            )
        self._open_steps = open_steps
        self.faults.at(self.steps, "plan")
        record, sections, agreements = self._local_record(
            teacher_layouts, student_layouts, _buffers, check, open_steps
        )
        with ranges.span("metadata"):
            meta_group = self.groups.metadata_group
            matrix = self.faults.timed(
                lambda: self._gather(record, meta_group, agreements),
                lambda: (
                    "the bridge's metadata all-gather over global ranks "
                    f"{list(self.topology.members)}"
                ),
            )
        return self._agree_and_plan(matrix, sections, agreements)

    def _gather(
        self,
        record: torch.Tensor,
        group: dist.ProcessGroup | None,
        agreements: Sequence[Agreement] = (),
    ) -> StepMatrix:
        """The records this rank reads, with the summary (:mod:`mopd.bridge.metadata`): the
        summary's all-reduce, then no records when every record is the plan memo's step's but
        for its header (the memo's serve), the records of this rank's peers when the summary
        says every rank agreed (:func:`~mopd.bridge.peers.exchange_records`), every record
        otherwise (the fence and the header verdicts read them all). The summary is the same on
        every rank, so is the choice. A memo that cannot serve is dropped first."""
        device = cdist.group_device(group)
        summary = reduce_summary(
            record,
            group=group,
            device=device,
            timeout_s=self.config.timeout_s,
            heads=len(self.teachers),
        )
        repeated = self._memo_matrix(summary)
        if repeated is not None:
            return repeated
        n_slots = uniform_count(summary)
        route: RecordRoute | None = None
        routes = self.groups.meta_routes is not None or len(self.topology.members) == 1
        if routes and n_slots is not None and summary_heads(summary) is not None:
            deadline = time.monotonic() + self.config.timeout_s

            def route(rec: torch.Tensor) -> tuple[RaggedRecords, np.ndarray]:
                assert n_slots is not None
                return exchange_records(
                    rec,
                    self._make_wire(deadline),
                    topology=self.topology,
                    rank=self.rank,
                    n_slots=n_slots,
                    agreements=agreements,
                )

        matrix, members = gather_records(
            record,
            width=int(summary[SIZE]),
            group=group,
            n_members=len(self.topology.members),
            device=device,
            timeout_s=self.config.timeout_s,
            nodes=self.groups.meta_nodes,
            route=route,
        )
        return StepMatrix(matrix, summary, members)

    def forget_plan_memo(self) -> None:
        """Forget what the last step derived from the job's records (this rank's plan memo):
        its next step exchanges the records again, and so does every rank's (the step's
        summary tells them this rank has no memo). Local; the records' digests still let it
        reuse cached schedules."""
        self._memo = None

    def _memo_matrix(self, summary: np.ndarray) -> StepMatrix | None:
        """The plan memo's records as this step's, when the summary says every record
        repeats the memo's step; else ``None``, and the memo is dropped."""
        memo = self._memo
        if memo is not None and reuses_memo(summary, memo.step):
            return StepMatrix(memo.matrix, summary, memo.members)
        self._memo = None
        return None

    def _make_wire(self, deadline: float) -> Wire:
        """This rank's end of the metadata group's point-to-point rounds and sums, every wait
        ending by ``deadline`` (an offline bridge's: the one it was given)."""
        if self.groups.is_offline:
            if self._offline_wire is None:
                raise ValueError("this offline bridge was given no metadata wire")
            return self._offline_wire(deadline)
        return GroupWire(
            self.groups.meta_routes,
            members=self.topology.members,
            member=self.topology.member_index(self.rank),
            deadline=deadline,
            sums=self.groups.metadata_group,
        )

    def _local_record(
        self,
        teacher_layouts: Any,
        student_layouts: Any,
        buffers: Mapping[Any, Any] | None,
        check: Callable[[], Mapping[str, int] | None] | None,
        open_steps: Sequence[BridgeStep],
    ) -> tuple[torch.Tensor, list[Section | None], tuple[Agreement, ...]]:
        """This rank's step record, sections and agreements (local; a ``ValueError`` of the
        input becomes the record's error text, which every rank reads after the exchange)."""
        n = len(self.teachers)
        sections: list[Section | None] = [None] * (n + 1)
        n_slots = -1
        error = ""
        state, unposted = STATE_READY, [s for s in open_steps if s.unposted()]
        if self.lifecycle.failure is not None:
            state, error = STATE_FAILED, self.lifecycle.failure
        elif unposted:
            s0 = unposted[0]
            state = STATE_OPEN
            error = (
                f"global rank {self.rank} posted {s0.posted} of the {s0.num_micro_batches} "
                f"micro-batches of step {s0.seq}"
            )
        agreements: list[Agreement] = []
        memo = self._memo
        with ranges.span("metadata"):
            if state == STATE_READY:
                try:
                    n_slots = self._local_sections(
                        teacher_layouts, student_layouts, buffers, sections, check, agreements
                    )
                except ValueError as exc:
                    error = f"global rank {self.rank}: {exc}"
                    sections = [None] * (n + 1)
                    agreements = []
            record = encode_step_record(
                config_sig=self.config_sig,
                n_slots=n_slots,
                error=error,
                sections=sections,
                state=state,
                step=self.steps,
                agreements=agreements,
                memo_step=-1 if memo is None else memo.step,
                memo_tables=None if memo is None else memo.tables,
            )
        return record, sections, tuple(agreements)

    def _agree_and_plan(
        self,
        matrix: StepMatrix,
        sections: list[Section | None],
        agreements: Sequence[Agreement] = (),
    ) -> BridgeStep:
        """From the exchanged records: the fence, the shared verdict on the input, this rank's
        plans (or cached schedules); the step. Collective only in the verdict."""
        ex = self._executor
        n_slots_ok = matrix.uniform_slots()  # every record ready and agreeing (the summary)
        if n_slots_ok is None:
            members = self.topology.members
            agreed_state(matrix, members=members, rank=self.rank, faults=self.faults)  # the fence
            n_slots = agreed_slots(matrix, members=members)  # the same ValueError everywhere
        else:
            n_slots = n_slots_ok
        agreed = False
        try:
            with ranges.span("verdict"):
                view = read_step(self.topology, matrix, n_slots)
                catalogs = view.catalogs  # built on first use (a cached micro-batch needs none)
                extra = self._key_extra(matrix)
                memo = self._memo
                if (
                    memo is not None
                    and n_slots_ok is not None
                    and memo.n_slots == n_slots
                    and memo.extra == extra
                    and matrix.unchanged_since(memo.step)
                ):  # every rank's tables are the memo step's: so are the keys
                    keys = list(memo.keys)
                else:
                    keys = view.plan_keys(self.rank, extra)
                cached = [ex.lookup(k) for k in keys]
                problems = rank_checks(
                    matrix,
                    catalogs,
                    topology=self.topology,
                    teachers=self.teachers,
                    student=self.student,
                    rank=self.rank,
                    duplicate_samples=self.config.duplicate_samples,
                    skip=[hit for hit, _ in cached],
                    agreements=agreements,
                )
                t0 = time.monotonic()
                try:
                    tokens_I = self._verdict(problems, view.led_tokens_I(self.rank))
                except ValueError:
                    agreed = True  # the same verdict on every rank: nobody is left waiting
                    raise
                except Exception as exc:
                    raise comm_failure(
                        exc,
                        rank=self.rank,
                        what="the bridge's input verdict over global ranks "
                        f"{list(self.topology.members)}",
                        timeout_s=self.config.timeout_s,
                        elapsed_s=time.monotonic() - t0,
                    ) from exc
            step = BridgeStep(
                self,
                matrix,
                catalogs,
                sections,
                seq=self.steps,
                view=view,
                keys=keys,
                cached=cached,
                tokens_I=tokens_I,
            )
            self._memo = _PlanMemo(
                step=self.steps,
                tables=record_tables(matrix.row(self.topology.member_index(self.rank))),
                matrix=matrix.matrix,
                members=matrix.members,
                n_slots=n_slots,
                extra=extra,
                keys=tuple(keys),
            )
        except BaseException as exc:
            if not agreed:  # the others may be in the verdict or in this step: refuse from now
                self.faults.mark_failed(exc)
            raise
        self._open_steps.append(step)
        self._live_steps.add(step)
        self.faults.at(self.steps, "planned")
        self.steps += 1
        return step

    def exchange(
        self,
        *,
        hidden: Mapping[int, torch.Tensor] | None = None,
        layouts: Mapping[int, LayoutArg] | None = None,
        student_layout: LayoutArg | None = None,
    ) -> ExchangeHandle:
        """One micro-batch, planned and started in one call (collective over the bridge group).

        ``hidden`` / ``layouts``: on teacher last-stage ranks, ``teacher index -> `` the
        captured buffer and its layout; ``student_layout``: on student last-stage ranks. The
        buffers are checked with the layouts (a bad one raises the same ``ValueError`` on every
        rank, before data moves); the rows are taken at the call. Every rank then calls
        ``.wait()`` on the handle.
        """
        # anything but a non-empty mapping goes to plan_step as it is (a bad type raises there)
        teacher_layouts: Any = layouts or None
        if isinstance(layouts, Mapping) and layouts:
            teacher_layouts = {o: [x] for o, x in layouts.items()}
        step = self.plan_step(
            teacher_layouts=teacher_layouts,
            student_layouts=[student_layout] if student_layout is not None else None,
            _buffers={} if hidden is None else hidden,  # checked with the layouts, everywhere
        )
        hidden_d = dict(hidden or {})
        if hidden_d:
            step.send(0, hidden_d)
        # posted here on every rank (receive-only ranks too), so exchanges in flight on one
        # group pair in the order they were started, whatever order they are waited in
        step._issue_through(0, why="exchange()")
        return ExchangeHandle(step)

    # --- local phase (errors are gathered, not raised) -----------------------------------------

    def _local_sections(
        self,
        teacher_layouts: Any,
        student_layouts: Any,
        buffers: Mapping[Any, Any] | None,
        sections: list[Section | None],
        check: Callable[[], Mapping[str, int] | None] | None = None,
        agreements: list[Agreement] | None = None,
    ) -> int:
        """This rank's sections; ``buffers``: the rows :meth:`exchange` will send (checked here);
        ``check``: the caller's own checks (see :meth:`plan_step`), whose
        :class:`~mopd.bridge.inputs.StepChecks` agreements go into ``agreements``."""
        n = len(self.teachers)
        checked = called(check, "plan_step's check") if check else None
        counts: dict[str, int] = dict(checked or {})
        if isinstance(checked, StepChecks) and agreements is not None:
            agreements.extend(checked.agreements)
        given = {} if teacher_layouts is None else teacher_layouts
        if not isinstance(given, Mapping):
            raise ValueError(
                "teacher_layouts must be a mapping teacher index -> layouts, got "
                f"{type(given).__name__}"
            )
        if buffers is not None and not isinstance(buffers, Mapping):
            raise ValueError(
                f"hidden must be a mapping teacher index -> tensor, got {type(buffers).__name__}"
            )
        for o in [*given, *(buffers or {})]:
            if not (isinstance(o, int) and 0 <= o < n):
                raise ValueError(f"teacher index {o!r} outside [0, {n})")
        roles = self._roles
        t_lays: dict[int, list[TokenLayout]] = {}
        dtypes: list[torch.dtype | None] = [None] * n
        s_lays: list[TokenLayout] | None = None
        for o, spec in enumerate(self.teachers):
            holds = roles[o] is not None
            if holds != (o in given):
                want = "must pass" if holds else "must not pass"
                raise ValueError(
                    f"teacher {o} ({spec.mesh}): this rank {want} teacher_layouts[{o}]"
                )
            if not holds:
                if buffers is not None and o in buffers:
                    raise ValueError(f"this rank holds no rows of teacher {o} (not its last stage)")
                continue
            lays = layout_list(given[o], f"teacher_layouts[{o}]")
            dtype = spec.dtype
            if buffers is not None:
                if o not in buffers:
                    raise ValueError(f"teacher {o}: a layout but no buffer in hidden[{o}]")
                t = buffers[o]
                if dtype is None and isinstance(t, torch.Tensor):
                    dtype = t.dtype
                check_buffer(o, 0, t, lays[0], spec.hidden_size, dtype, self.device)
            if dtype is None:
                raise ValueError(
                    f"teacher {o}: its dtype is unknown; give TeacherSpec(dtype=...) to plan a "
                    "step before the teacher has run"
                )
            counts[f"teacher {o}'s layouts"] = len(lays)
            t_lays[o], dtypes[o] = lays, dtype
        is_student = roles[n] is not None
        if is_student != (student_layouts is not None):
            want = "must pass" if is_student else "must not pass"
            raise ValueError(f"student ({self.student}): this rank {want} student_layouts")
        if is_student:
            if self._tp_group_error:
                raise ValueError(self._tp_group_error)
            s_lays = layout_list(student_layouts, "student_layouts")
            counts["the student's layouts"] = len(s_lays)
        if len(set(counts.values())) > 1:
            raise ValueError(
                "this rank gives different micro-batch counts: "
                + ", ".join(f"{k} {v}" for k, v in counts.items())
            )
        sections[:] = rank_sections(
            roles,
            teacher_layouts=t_lays,
            student_layouts=s_lays,
            dtypes=dtypes,
            hiddens=[t.hidden_size for t in self.teachers],
            device=self.device,
        )
        return next(iter(counts.values())) if counts else -1

    # --- global phase: same data, same verdict on every rank -----------------------------------

    def _key_extra(self, matrix: StepMatrix) -> bytes:
        """What a rank's schedules depend on beside its plan inputs: the teachers' dtype codes
        (row widths), as every rank reads them (the summary's, or off the first leaders'
        records)."""
        topo = self.topology
        codes = [matrix.teacher_head(o, topo.first_leader(o))[0] for o in range(len(self.teachers))]
        return np.asarray(codes, dtype=np.int64).tobytes()

    def _verdict(self, problems: Sequence[str], led_tokens_I: np.ndarray) -> np.ndarray:
        """The shared verdict on the step's input, and the step's token counts, in one sum
        over the metadata group: ``[1 + n_slots]`` words, whether this rank found a problem and
        the tokens of the destination groups it leads per micro-batch. Returns the step's
        ``[n_slots]`` tokens (every destination group's, each once); raises the same
        ``ValueError`` on every rank when any found a problem
        (:func:`~mopd.common.dist.same_verdict` then names the first)."""
        words = np.concatenate([[1 if problems else 0], led_tokens_I]).astype(np.int64)
        total = self._make_wire(time.monotonic() + self.config.timeout_s).reduce_sum(words)
        if total[0]:
            cdist.same_verdict(
                problems,
                group=self.groups.metadata_group,
                timeout_s=self.config.timeout_s,
                what="bridge input",
            )
        return total[1:]


@dataclass(frozen=True, kw_only=True, eq=False)
class _PlanMemo:
    """What a rank derived from the job's records at step ``step`` (its own record past the
    header then: ``tables``; the records it read then: ``matrix``, of ``members``, ``None``:
    every member), kept for the next step: when every record of the next says it is that
    step's but for its header (:func:`~mopd.bridge.metadata.reuses_memo`), no record is
    exchanged again, and the plan keys are these: no group's table is read.
    """

    step: int
    tables: np.ndarray
    matrix: np.ndarray | RaggedRecords
    members: np.ndarray | None
    n_slots: int
    extra: bytes
    keys: tuple[bytes, ...]
