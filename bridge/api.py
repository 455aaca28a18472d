"""The live bridge: teacher hidden states -> every student rank's own layout, per micro-batch.

Why this file exists: it ties the pieces together on a running job, in the shape a training
loop needs. Megatron's pipeline schedule runs micro-batches in its own order and owns the
point-to-point slots between stages, so nothing collective over the whole bridge group may run
inside ``forward_step_func`` / ``loss_func``. A step therefore has two phases:

1. :meth:`HiddenStateBridge.plan_step`, outside the schedule, on every rank of the bridge group:
   one metadata exchange for all micro-batches of both sides (:mod:`mopd.bridge.metadata`: the
   records' headers and sizes, then the records; flat, or in two levels over node groups),
   checks whose verdict every rank shares (bad input raises the same ``ValueError`` on every
   rank before any data moves), and each rank's own plan per micro-batch
   (:mod:`mopd.bridge.plan`, work proportional to its own runs and its peers').
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
"""

from __future__ import annotations

import hashlib
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mopd.bridge.errors import BridgeNonFiniteError, BridgeStateError
from mopd.bridge.executor import Executor, Slot
from mopd.bridge.groups import BridgeGroups
from mopd.bridge.layout import TokenLayout
from mopd.bridge.mesh import Mesh, meshes_overlap
from mopd.bridge.metadata import (
    MAGIC,
    STATE_FAILED,
    STATE_OPEN,
    STATE_READY,
    Section,
    StepMatrix,
    code_dtype,
    encode_step_record,
    gather_step_matrix,
)
from mopd.bridge.order import StepOrder
from mopd.bridge.plan import RunCatalog, check_rank, plan_rank
from mopd.bridge.record import StepView, rank_roles, rank_sections, read_step
from mopd.bridge.schedule import RankSchedule
from mopd.bridge.topology import Topology
from mopd.bridge.transport import comm_failure
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

#: A layout, or a zero-argument callable building one inside the guarded phase (so that an error
#: it raises reaches every rank as the same ``ValueError`` instead of leaving them waiting).
LayoutArg = TokenLayout | Callable[[], TokenLayout]


@dataclass(frozen=True, kw_only=True)
class TeacherSpec:
    """A teacher as the bridge sees it.

    Attributes:
        mesh: its mesh (sources are its last-stage TP groups).
        hidden_size: ``H`` of its captured hidden states.
        dtype: the captured rows' dtype (e.g. ``torch.bfloat16``); needed to plan a step
            before the teacher has run (the students allocate their buffers from it). ``None``
            is allowed with :meth:`HiddenStateBridge.exchange`, which reads it off the buffer.
        sp_shards: the teacher runs with sequence parallelism and each last-stage TP rank
            sends from its own SP shard: its layouts and buffers are that rank's
            ``[S/tp, B, H]`` slice (``micro_batch_layout(..., sp_size=tp, sp_rank=tp_rank)``,
            the capture's :meth:`~mopd.capture.OutputLayerInputCapture.get_local_hidden_states`),
            each rank is its own source and nothing is all-gathered. ``False``: the TP ranks are
            replicas of the full ``[S, B, H]`` buffer (no SP, or SP undone by the capture).
    """

    mesh: Mesh
    hidden_size: int
    dtype: torch.dtype | None = None
    sp_shards: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, Mesh):
            raise ValueError(f"TeacherSpec.mesh must be a Mesh, got {type(self.mesh).__name__}")
        if isinstance(self.hidden_size, bool) or not isinstance(self.hidden_size, int):
            raise ValueError(f"{self.mesh}: hidden_size must be an int, got {self.hidden_size!r}")
        if self.hidden_size < 1:
            raise ValueError(f"{self.mesh}: hidden_size must be >= 1, got {self.hidden_size}")
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"{self.mesh}: dtype must be a torch.dtype, got {self.dtype!r}")
        if not isinstance(self.sp_shards, bool):
            raise ValueError(f"{self.mesh}: sp_shards must be a bool, got {self.sp_shards!r}")


@dataclass(frozen=True, kw_only=True)
class BridgeConfig:
    """Settings of a :class:`HiddenStateBridge`.

    Attributes:
        timeout_s: seconds each phase may wait on other ranks (the metadata all-gather, a
            receive, the sends at :meth:`BridgeStep.finish`) before raising
            :class:`~mopd.bridge.errors.BridgeTimeoutError`. Host-side on gloo; on NCCL waits
            do not block the host (the stream waits), so hangs there are caught by the process
            groups' own timeout: create them with ``GroupPool(timeout_s=...)`` no longer than this.
        local_copy: serve a destination from a replica on the same rank by a local copy.
        keep_sp_shard: each student TP rank gets only its own sequence-parallel slice (it
            passes its own slice's layouts; no all-gather).
        max_cached_plans: schedules kept per rank (one per distinct micro-batch plan; steps with
            the same shapes reuse them).
        integrity: check every delivered row against the sender's checksum (one extra read of
            the source and of the output rows, one small message per transfer, and a verdict
            all-gather in :meth:`BridgeStep.finish`).
        duplicate_samples: allow one sample id on several student DP ranks in a micro-batch
            (refused by default: the student would train on it twice).
        check_finite: :meth:`BridgeStep.receive` checks the rows it returns for NaN / Inf and
            raises :class:`~mopd.bridge.errors.BridgeNonFiniteError` naming the teacher, the
            micro-batch and the ranks (one reduction over the rows and one host sync per
            received micro-batch).
    """

    timeout_s: float = 300.0
    local_copy: bool = True
    keep_sp_shard: bool = False
    max_cached_plans: int = 64
    integrity: bool = False
    duplicate_samples: bool = False
    check_finite: bool = True

    def __post_init__(self) -> None:
        if (
            isinstance(self.timeout_s, bool)
            or not isinstance(self.timeout_s, int | float)
            or not 0 < self.timeout_s < float("inf")
        ):
            raise ValueError(f"timeout_s must be a positive finite number, got {self.timeout_s!r}")
        if (
            isinstance(self.max_cached_plans, bool)
            or not isinstance(self.max_cached_plans, int)
            or self.max_cached_plans < 1
        ):
            raise ValueError(f"max_cached_plans must be an int >= 1, got {self.max_cached_plans!r}")
        for name in (
            "local_copy",
            "keep_sp_shard",
            "integrity",
            "duplicate_samples",
            "check_finite",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")


def _called(arg: Any, what: str, *, noun: str = "callable") -> Any:
    """``arg()`` when ``arg`` is a callable (not a layout), else ``arg``; whatever the callable
    raises reaches the caller as a ValueError (the guarded phase gathers those)."""
    if not callable(arg) or isinstance(arg, TokenLayout):
        return arg
    try:
        return arg()
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"{what}: the {noun} raised {type(exc).__name__}: {exc}") from exc


def _resolve_layout(arg: Any, what: str) -> TokenLayout:
    """``arg`` as a TokenLayout (calling it when it is a callable); any failure is a ValueError."""
    arg = _called(arg, what, noun="layout callable")
    if not isinstance(arg, TokenLayout):
        raise ValueError(
            f"{what} must be a TokenLayout or a zero-argument callable returning one, "
            f"got {type(arg).__name__}"
        )
    return arg


def _layout_list(arg: Any, what: str) -> list[TokenLayout]:
    """One layout per micro-batch (a sequence, or a callable returning one)."""
    arg = _called(arg, what)
    if isinstance(arg, TokenLayout) or not isinstance(arg, Sequence) or not arg:
        raise ValueError(
            f"{what} must be a non-empty sequence with one layout per micro-batch, got "
            f"{type(arg).__name__}"
        )
    return [_resolve_layout(x, f"{what}[{i}]") for i, x in enumerate(arg)]


def _flat(t: Any, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() < 2:
        raise ValueError(f"{what} must have a hidden dim last (>= 2-D), got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous (the bridge moves rows of its flat view)")
    return t.view(-1, t.shape[-1])


def _check_buffer(
    o: int, i: int, t: Any, lay: TokenLayout, hidden: int, dtype: Any, device: torch.device
) -> torch.Tensor:
    """Teacher ``o``'s buffer of micro-batch ``i`` as flat ``[R, H]`` rows; a ValueError when it
    does not match the layout, the hidden size, the dtype or the device."""
    f = _flat(t, f"teacher {o} hidden buffer")
    if f.shape[0] != lay.num_rows or f.shape[1] != hidden:
        raise ValueError(
            f"teacher {o} micro-batch {i}: buffer of {tuple(t.shape)} has "
            f"{f.shape[0]} rows of {f.shape[1]}, the plan wants {lay.num_rows} rows of {hidden}"
        )
    if f.dtype != dtype or f.device != device:
        raise ValueError(
            f"teacher {o} micro-batch {i}: buffer is {f.dtype} on {f.device}, "
            f"the plan wants {dtype} on {device}"
        )
    return f


class HiddenStateBridge:
    """Moves captured teacher hidden states into the student's layout (see the module doc).

    Args:
        teachers: the teachers; index = owner = key of the ``hidden`` / layout mappings.
        student: the student mesh.
        groups: this rank's groups (:func:`mopd.bridge.groups.create_bridge_groups`; a live
            Megatron job may pass its student TP group as ``BridgeGroups.student_tp``).
        config: settings.
    """

    def __init__(
        self,
        *,
        teachers: Sequence[TeacherSpec],
        student: Mesh,
        groups: BridgeGroups,
        config: BridgeConfig | None = None,
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
        self.rank = dist.get_rank()
        self.topology = Topology.build(
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
        )
        self._tp_group_error = self._check_student_tp_group()
        #: what this rank contributes per section (:func:`~mopd.bridge.record.rank_roles`)
        self._roles = rank_roles(
            self.rank,
            [t.mesh for t in self.teachers],
            student,
            keep_sp_shard=self.config.keep_sp_shard,
            shard_sources=self.topology.shard_sources,  # the topology's sources, one rule
        )
        sig = repr(
            [(*t.mesh.as_ints(), t.hidden_size, t.sp_shards) for t in self.teachers]
            + [
                student.as_ints(),
                self.config.local_copy,
                self.config.keep_sp_shard,
                self.config.integrity,
                self.topology.members,
            ]
        )
        self.config_sig = int.from_bytes(
            hashlib.blake2b(sig.encode(), digest_size=7).digest(), "little"
        )
        self._open_steps: list[BridgeStep] = []
        #: steps planned on this bridge
        self.steps = 0

    @property
    def executor(self) -> Executor:
        """This rank's executor (schedule cache, staging buffers, figures)."""
        return self._executor

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
            got = tuple(dist.get_process_group_ranks(tp))
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
                student's first stage, which passes no layouts), agreed with everyone's.

        Micro-batch ``i`` on one side is micro-batch ``i`` on the other: teacher micro-batch
        ``i`` (over all teacher shards) must hold every token student micro-batch ``i`` wants.
        Every layout may be a zero-argument callable (built inside the guarded phase).

        Returns:
            This rank's :class:`BridgeStep`.
        Raises:
            ValueError: bad input on any rank (the same text on every rank, before data moves).
            BridgeTimeoutError, BridgeCommError: the metadata all-gather or the verdict on the
                input failed. After those, and after any other error past the metadata
                all-gather except the agreed ``ValueError``, the bridge refuses further use.
            BridgeStateError: an earlier exchange failed.
        """
        if self.groups.bridge is None:
            raise ValueError(
                f"global rank {self.rank} is in no mesh of this bridge; it must not call it"
            )
        ex = self._executor
        if ex.failure_hard:  # the transport may be out of step: refuse locally
            ex.check_usable()
        open_steps = [s for s in self._open_steps if not s.finished]
        if open_steps and ex.failure is None:
            warnings.warn(
                f"global rank {self.rank}: a step is planned while {len(open_steps)} earlier "
                "step(s) of this bridge are not finished; call step.finish() (every rank) after "
                "the schedule so their buffers are released",
                stacklevel=2,
            )
        self._open_steps = open_steps
        record, sections = self._local_record(
            teacher_layouts, student_layouts, _buffers, check, open_steps
        )
        with ranges.span("metadata"):
            meta_group = self.groups.metadata_group
            m, _sizes, header = self._executor.timed(
                lambda: gather_step_matrix(
                    record,
                    group=meta_group,
                    n_members=len(self.topology.members),
                    device=cdist.group_device(meta_group),
                    timeout_s=self.config.timeout_s,
                    nodes=self.groups.meta_nodes,
                ),
                lambda: (
                    "the bridge's metadata all-gather over global ranks "
                    f"{list(self.topology.members)}"
                ),
            )
        return self._agree_and_plan(StepMatrix(m, header), sections)

    def _local_record(
        self,
        teacher_layouts: Any,
        student_layouts: Any,
        buffers: Mapping[Any, Any] | None,
        check: Callable[[], Mapping[str, int] | None] | None,
        open_steps: Sequence[BridgeStep],
    ) -> tuple[torch.Tensor, list[Section | None]]:
        """This rank's step record and sections (local; a ``ValueError`` of the input becomes
        the record's error text, which every rank reads after the all-gather)."""
        ex = self._executor
        n = len(self.teachers)
        sections: list[Section | None] = [None] * (n + 1)
        n_slots = -1
        error = ""
        state, unposted = STATE_READY, [s for s in open_steps if s.unposted()]
        if ex.failure is not None:
            state, error = STATE_FAILED, ex.failure
        elif unposted:
            s0 = unposted[0]
            state = STATE_OPEN
            error = (
                f"global rank {self.rank} posted {s0.posted} of the {s0.num_micro_batches} "
                f"micro-batches of step {s0.seq}"
            )
        with ranges.span("metadata"):
            if state == STATE_READY:
                try:
                    n_slots = self._local_sections(
                        teacher_layouts, student_layouts, buffers, sections, check
                    )
                except ValueError as exc:
                    error = f"global rank {self.rank}: {exc}"
                    sections = [None] * (n + 1)
            record = encode_step_record(
                config_sig=self.config_sig,
                n_slots=n_slots,
                error=error,
                sections=sections,
                state=state,
                step=self.steps,
            )
        return record, sections

    def _agree_and_plan(self, matrix: StepMatrix, sections: list[Section | None]) -> BridgeStep:
        """From the gathered matrix: the fence, the shared verdict on the input, this rank's
        plans (or cached schedules); the step. Collective only in the verdict."""
        ex = self._executor
        meta_group = self.groups.metadata_group
        n_slots_ok = matrix.uniform_slots()  # every record ready and agreeing (one pass)
        if n_slots_ok is None:
            self._agreed_state(matrix)  # the fence: the same error everywhere
            n_slots = self._agreed_slots(matrix)  # raises the same ValueError everywhere
        else:
            n_slots = n_slots_ok
        agreed = False
        try:
            with ranges.span("verdict"):
                view = read_step(self.topology, matrix, n_slots)
                catalogs = view.catalogs  # built on first use (a cached micro-batch needs none)
                keys = view.plan_keys(self.rank, self._key_extra(matrix))
                cached = [ex.lookup(k) for k in keys]
                problems = self._checks(matrix, catalogs, skip=[hit for hit, _ in cached])
                t0 = time.monotonic()
                try:
                    cdist.same_verdict(
                        problems,
                        group=meta_group,
                        timeout_s=self.config.timeout_s,
                        what="bridge input",
                    )
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
            )
        except BaseException as exc:
            if not agreed:  # the others may be in the verdict or in this step: refuse from now
                self._executor.mark_failed(exc)
            raise
        self._open_steps.append(step)
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
    ) -> int:
        """This rank's sections; ``buffers``: the rows :meth:`exchange` will send (checked here);
        ``check``: the caller's own checks (see :meth:`plan_step`)."""
        n = len(self.teachers)
        counts: dict[str, int] = dict(_called(check, "plan_step's check") or {}) if check else {}
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
            lays = _layout_list(given[o], f"teacher_layouts[{o}]")
            dtype = spec.dtype
            if buffers is not None:
                if o not in buffers:
                    raise ValueError(f"teacher {o}: a layout but no buffer in hidden[{o}]")
                t = buffers[o]
                if dtype is None and isinstance(t, torch.Tensor):
                    dtype = t.dtype
                _check_buffer(o, 0, t, lays[0], spec.hidden_size, dtype, self.device)
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
            s_lays = _layout_list(student_layouts, "student_layouts")
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

    def _agreed_state(self, matrix: StepMatrix) -> None:
        """The fence, from every rank's state in the matrix (the same verdict everywhere).

        A step failed or was abandoned on some rank: :class:`BridgeStateError` naming the first
        failure (the lowest rank's), and this bridge refuses from now on. Ranks at different
        step counts (a rank planned a step the others did not): the same. An earlier step with
        micro-batches some rank has not posted: ``ValueError`` (nothing of this step moves; the
        earlier step may still complete), because a new step's transfers would pair with the
        earlier step's on the wire.
        """
        members = self.topology.members
        state = matrix.state_N()
        steps = matrix.step_N()
        failed = np.flatnonzero(state == STATE_FAILED).tolist()
        first = ""
        if failed:
            first = f"first failure on global rank {members[failed[0]]}: {matrix.error(failed[0])}"
            if len(failed) > 1:
                first += f"; global ranks {[members[j] for j in failed[1:]]} failed too"
        elif (steps != steps[0]).any():
            by: dict[int, list[int]] = {}
            for j, k in enumerate(steps.tolist()):
                by.setdefault(k, []).append(members[j])
            first = "ranks are at different steps of this bridge: " + ", ".join(
                f"step {k} on global ranks {v}" for k, v in sorted(by.items())
            )
        if first:
            self._executor.mark_abandoned(first)
            raise BridgeStateError(
                f"global rank {self.rank}: this bridge cannot be used after a failed exchange "
                f"({first}); its process group may still hold sends/receives of that step, "
                "which a later one could match. Create new groups (a new GroupPool and "
                "create_bridge_groups) and a new HiddenStateBridge on every rank."
            )
        open_ = np.flatnonzero(state == STATE_OPEN).tolist()
        if open_:
            raise ValueError(
                f"step {int(steps[0])} planned while an earlier step of this bridge is not fully "
                "posted: "
                + "; ".join(matrix.error(j) for j in open_)
                + ". Its transfers would pair with that step's on the wire: finish the earlier "
                "step (leave its `with` block) before planning the next on the same bridge"
            )

    def _agreed_slots(self, matrix: StepMatrix) -> int:
        """The step's micro-batch count; raises what every rank can see in the matrix alike."""
        members = self.topology.members
        bad_magic = np.flatnonzero(matrix.magic_N() != MAGIC)
        if bad_magic.size:
            raise ValueError(
                f"global ranks {[members[j] for j in bad_magic.tolist()]} sent bridge metadata of "
                "another format (another version of mopd-bridge?)"
            )
        sigs = matrix.config_sig_N()
        if (sigs != sigs[0]).any():
            groups: dict[int, list[int]] = {}
            for j, s in enumerate(sigs.tolist()):
                groups.setdefault(s, []).append(members[j])
            raise ValueError(
                f"ranks were built with different meshes or settings: {list(groups.values())}"
            )
        bad = np.flatnonzero(matrix.error_bytes_N() > 0).tolist()
        if bad:
            raise ValueError(
                f"bridge input rejected on global rank(s) {[members[j] for j in bad]}: "
                + "; ".join(matrix.error(j) for j in bad)
            )
        slots = matrix.n_slots_N()
        given = slots[slots >= 0]
        known = [] if not given.size else [int(given.min())]
        if given.size and given.max() != given.min():
            known = np.unique(given).tolist()
        if len(known) != 1:
            by: dict[int, list[int]] = {}
            for j, s in enumerate(slots.tolist()):
                if s >= 0:
                    by.setdefault(s, []).append(members[j])
            raise ValueError(
                "ranks give different micro-batch counts: "
                + ", ".join(f"{k} on global ranks {v}" for k, v in sorted(by.items()))
                if by
                else "no rank holds a layout: nothing to exchange"
            )
        return known[0]

    def _key_extra(self, matrix: StepMatrix) -> bytes:
        """What a rank's schedules depend on beside its plan inputs: the teachers' dtype codes
        (row widths), as every rank reads them off the matrix."""
        topo = self.topology
        codes = [matrix.section_head(topo.first_leader(o), o)[0] for o in range(len(self.teachers))]
        return np.asarray(codes, dtype=np.int64).tobytes()

    def _duplicate_samples(self, catalogs: Sequence[RunCatalog], skip: Sequence[bool]) -> list[str]:
        """Sample ids the student wants on two DP ranks in one micro-batch (it would train on
        them twice). Each destination group's first rank checks its group against the earlier
        groups whose sample range meets it (its peers, not the job); ``skip``: micro-batches
        whose inputs this rank has seen pass before."""
        topo = self.topology
        mine = [
            d
            for d in topo.index.dest_groups.get(self.rank, ())
            if topo.dests[d].ranks[0] == self.rank
        ]
        problems: list[str] = []
        for i in range(len(catalogs)):
            if skip[i] or not mine:
                continue
            catalog = catalogs[i]
            rng = catalog.dest_range_D2
            for d in mine:
                lo, hi = (int(x) for x in rng[d])
                a, b = rng[:d, 0], rng[:d, 1]
                if lo > hi:
                    continue
                earlier = np.flatnonzero((a <= hi) & (b >= lo) & (a <= b))
                if not earlier.size:
                    continue
                dp = _dp_of(self.student, topo.dests[d].ranks[0])
                wanted = np.unique(catalog.dest_runs(d)[:, 0])
                first: dict[int, int] = {}  # sample -> DP rank of the first group wanting it
                for e in earlier.tolist():
                    dp_e = _dp_of(self.student, topo.dests[e].ranks[0])
                    runs = catalog.dest_runs(e)
                    for sample in np.intersect1d(wanted, runs[:, 0]).tolist():
                        first.setdefault(sample, dp_e)
                for sample, dp0 in sorted(first.items()):
                    if dp0 != dp and len(problems) < 4:
                        problems.append(
                            f"micro-batch {i}: sample id {sample} is wanted by student DP ranks "
                            f"{dp0} and {dp}: it would be trained on twice; give each sample "
                            "to one DP rank, or BridgeConfig(duplicate_samples=True) if that is "
                            "meant"
                        )
        return problems

    def _checks(
        self,
        matrix: StepMatrix,
        catalogs: Sequence[RunCatalog],
        *,
        skip: Sequence[bool] | None = None,
    ) -> list[str]:
        """The problems this rank is responsible for finding (its share of the global checks);
        ``catalogs``: the step's micro-batches, in order; ``skip``: micro-batches whose plan
        inputs (:meth:`~mopd.bridge.record.StepView.plan_keys`) this rank saw pass before: the
        planner's verdicts on them are those of then (none), so they are not run again."""
        n_slots = len(catalogs)
        skip = [False] * n_slots if skip is None else list(skip)
        n_sec = len(self.teachers) + 1
        me = self.topology.members.index(self.rank)
        topo = self.topology
        problems: list[str] = []
        # replicas against their leader: same rows, same layout, same dtype / hidden / device
        mine_g = topo.index.source_groups.get(self.rank, ())  # this rank's groups, ascending
        for g in mine_g:
            source = topo.sources[g]
            if self.rank == source.ranks[0]:
                continue
            leader, o = int(topo.source_leader[g]), int(topo.source_section[g])
            if matrix.section_head(me, o) != matrix.section_head(leader, o):
                problems.append(
                    f"teacher {o} on global rank {self.rank}: (dtype, hidden, device) codes "
                    f"{matrix.section_head(me, o)[:3]} differ from its TP replica global rank "
                    f"{source.ranks[0]}'s {matrix.section_head(leader, o)[:3]}"
                )
                continue
            i = _first_differing_slot(matrix, me, leader, o, n_slots, n_sec)
            if i is not None:
                problems.append(
                    f"teacher {o} TP replicas {list(source.ranks)} ({source.label}) hold "
                    f"different token layouts in micro-batch {i}"
                )
        for d in topo.index.dest_groups.get(self.rank, ()):
            dest = topo.dests[d]
            if self.rank == dest.ranks[0]:
                continue
            leader = int(topo.dest_leader[d])
            i = _first_differing_slot(matrix, me, leader, topo.student_section, n_slots, n_sec)
            if i is not None:
                problems.append(
                    f"student TP ranks {list(dest.ranks)} ({dest.label}) want different "
                    f"token layouts in micro-batch {i}"
                )
        # every teacher's leaders agree on (dtype, hidden, device): students size buffers by them
        # (sources are teacher-major, so this goes teacher by teacher as before)
        for g in mine_g:
            if topo.sources[g].ranks[0] != self.rank:
                continue
            o = int(topo.source_section[g])
            spec = self.teachers[o]
            first = topo.first_leader(o)
            head = matrix.section_head(me, o)
            if head[1] != spec.hidden_size:
                problems.append(
                    f"teacher {o} on global rank {self.rank}: hidden size {head[1]}, "
                    f"expected {spec.hidden_size}"
                )
            if head[:3] != matrix.section_head(first, o)[:3]:
                problems.append(
                    f"teacher {o}: global ranks {topo.members[first]} and {self.rank} hold "
                    f"different dtypes or devices ({matrix.section_head(first, o)[:3]} vs "
                    f"{head[:3]})"
                )
            if code_dtype(head[0]) is None:
                problems.append(f"teacher {o} on global rank {self.rank}: unsupported dtype")
        if not self.config.duplicate_samples:
            problems += self._duplicate_samples(catalogs, skip)
        # the planner's checks: tokens held twice or by nobody
        with ranges.span("plan", "checks"):
            for i in range(n_slots):
                if not skip[i]:
                    problems += [
                        f"micro-batch {i}: {p}" for p in check_rank(catalogs[i], self.rank)
                    ]
        return problems


def _dp_of(student: Mesh, rank: int) -> int:
    c = student.coord(rank)
    assert c is not None
    return c.dp_rank


def _first_differing_slot(
    matrix: StepMatrix, me: int, leader: int, section: int, n_slots: int, n_sections: int
) -> int | None:
    """The first micro-batch where member ``me``'s layout (rows, digest) differs from its
    replica leader's, or ``None`` (one read of both slot tables)."""
    t = matrix.slot_tables(
        np.asarray([me, leader]), section, n_sections=n_sections, n_slots=n_slots
    )
    differ = np.flatnonzero((t[0, :, 0] != t[1, :, 0]) | (t[0, :, 5] != t[1, :, 5]))
    return int(differ[0]) if differ.size else None


class BridgeStep:
    """One rank's share of a planned step (see the module doc): ``send``, ``receive``, ``finish``.

    Built by :meth:`HiddenStateBridge.plan_step`. Use it as a context manager: leaving the
    block normally calls :meth:`finish`; leaving it on an exception abandons the step
    (:meth:`abandon`): this rank's bridge refuses further use, and every rank's next
    ``plan_step`` raises :class:`BridgeStateError` naming that failure.
    """

    def __init__(
        self,
        bridge: HiddenStateBridge,
        matrix: StepMatrix,
        catalogs: Sequence[RunCatalog],
        sections: Sequence[Section | None],
        *,
        seq: int = 0,
        view: StepView,
        keys: Sequence[bytes],
        cached: Sequence[tuple[bool, RankSchedule | None]],
    ) -> None:
        self._bridge = bridge
        self._view = view
        self._tokens_I: np.ndarray | None = None  # global_tokens, read once
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
            first = topo.first_leader(o)
            dtype = code_dtype(matrix.section_head(first, o)[0])
            assert dtype is not None
            self._specs[o] = (spec.hidden_size, dtype)
        self._slots: list[Slot] = []
        ex = bridge.executor
        row_bytes = [h * d.itemsize for h, d in self._specs.values()]
        with ranges.span("plan"):
            for i in range(n_slots):
                hit, sched = cached[i]
                if not hit:  # plan inputs not seen before (or their schedule was evicted)
                    catalog = self._catalogs[i]
                    plan = plan_rank(
                        catalog, bridge.rank, local_copy=bridge.config.local_copy, compact=True
                    )
                    if plan.sends or plan.recvs or plan.locals or plan.dest is not None:
                        nominal = 0
                        if plan.dest is not None:
                            nominal = catalog.dests[plan.dest.group].slice_rows
                        sched = ex.schedule(
                            plan,
                            slice_rows=nominal,
                            num_owners=n,
                            row_bytes=row_bytes,
                        )
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
        in the whole step with ``None``. Read from the gathered metadata (no communication):
        the destination leaders' token counts, summed once per step."""
        if self._tokens_I is None:
            self._tokens_I = self._view.tokens_I()
        if micro_batch is None:
            return int(self._tokens_I.sum())
        if isinstance(micro_batch, bool) or not 0 <= micro_batch < self.num_micro_batches:
            raise ValueError(f"micro-batch {micro_batch!r} outside [0, {self.num_micro_batches})")
        return int(self._tokens_I[micro_batch])

    # --- the data phase ------------------------------------------------------------------------

    def _check_index(self, i: int, *, finished_ok: bool = False) -> None:
        if not finished_ok:
            self._bridge.executor.check_usable()
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_micro_batches:
            raise ValueError(f"micro-batch {i!r} outside [0, {self.num_micro_batches})")
        if self.finished and not finished_ok:
            raise BridgeStateError("this step is finished; plan the next one with plan_step")

    @property
    def posted(self) -> int:
        """Micro-batches this rank has posted (in order)."""
        return self._order.posted

    def unposted(self) -> bool:
        """True while this rank has micro-batches of the step left to post (it is open on the
        wire: a later step's transfers would pair with them)."""
        return not self.finished and self._order.posted < self.num_micro_batches

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
        b.executor.check_usable()
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
            flat[o] = _check_buffer(
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
        b.executor.check_usable()
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
        ``plan_step`` says so on every rank)."""
        ok = torch.stack([torch.isfinite(t).all() for t in rows.values()]).tolist()
        if all(ok):
            return
        b = self._bridge
        found = []
        for (o, t), fine in zip(rows.items(), ok, strict=True):
            if fine:
                continue
            bad = torch.nonzero(~torch.isfinite(t).all(dim=1)).reshape(-1)
            first = int(bad[0])
            found.append(
                f"teacher {o}: {bad.numel()} of {t.shape[0]} rows (first: row {first}, "
                f"{self._source_of(slot, o, first)})"
            )
        text = (
            f"global rank {b.rank}: non-finite (NaN/Inf) teacher rows arrived in micro-batch "
            f"{slot.index} of step {self.seq}: " + "; ".join(found)
        )
        b.executor.mark_abandoned(text)
        raise BridgeNonFiniteError(text)

    def _source_of(self, slot: Slot, owner: int, row: int) -> str:
        """Which rank sent row ``row`` of ``owner``'s rows to this rank (for messages)."""
        b = self._bridge
        sched = slot.schedule
        assert sched is not None and sched.dest is not None
        n = sched.slice_rows_of(owner)
        j, rel = divmod(row, max(n, 1))
        if j != sched.dest.slot:
            tp = b.groups.student_tp
            who = dist.get_process_group_ranks(tp)[j] if tp is not None else j
            return f"the slice of global rank {who}, via the student TP all-gather"
        for op in sched.recvs:
            if op.owner == owner and bool((op.side.rows == rel).any()):
                return f"sent by global rank {op.peer}"
        for lop in sched.locals:
            if lop.owner == owner and bool((lop.dst.rows == rel).any()):
                return f"a local copy on global rank {b.rank}"
        return "a padding row"

    def finish(self) -> None:
        """Complete the step on this rank: every micro-batch issued, received and sent.

        Every rank of the bridge group calls it once per step, after the schedule (a collective
        with integrity on: the verdict). Raises :class:`BridgeStateError` if this rank holds
        teacher rows of a micro-batch it never sent.
        """
        if self.finished:
            return
        b = self._bridge
        b.executor.check_usable()
        deadline = time.monotonic() + b.config.timeout_s
        self._order.finish(deadline=deadline)
        self.finished = True
        if b.config.integrity:
            meta = b.groups.metadata_group
            with ranges.span("integrity"):
                b.executor.verdict(self._slots, group=meta, deadline=deadline)

    def __enter__(self) -> BridgeStep:
        return self

    def abandon(self, cause: BaseException | str) -> None:
        """Give the step up on this rank (its caller raised inside it): no further call on this
        bridge succeeds here, and the next ``plan_step`` tells every rank (each raises
        :class:`BridgeStateError` naming this failure) instead of planning a step whose
        transfers could pair with this one's leftovers. Local, no communication."""
        if self.finished:
            return
        b = self._bridge
        what = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        b.executor.mark_abandoned(
            f"step {self.seq} abandoned on global rank {b.rank} after {self._order.posted} of "
            f"{self.num_micro_batches} micro-batches posted, {self._order.received} received: "
            f"{what}"
        )
        self.finished = True

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.finish()
        elif isinstance(exc, BaseException):
            self.abandon(exc)


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
