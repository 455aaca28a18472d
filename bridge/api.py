"""The live bridge: teacher hidden states -> every student rank's own layout, one call per step.

Why this file exists: it ties the pieces together on a running job. Each call

1. builds this rank's local view (layouts, buffer shapes) and catches local errors instead of
   raising them alone (:mod:`mopd.bridge.metadata` carries them);
2. all-gathers that metadata over the bridge's gloo group (host tensors, so the step's GPU work
   is never synchronised for it; timeouts on every collective);
3. validates the gathered data on every rank identically (local errors anywhere, ranks that
   disagree on the meshes, missing or extra buffers, hidden size / dtype / device mismatches,
   wrong output shapes, TP replicas with different layouts, tokens held twice or by nobody), so
   every rank raises the same ``ValueError`` before any data moves and none is left waiting;
4. plans (cached by the gathered metadata's content: on a hit, steps 3 and the decoding are
   skipped, since the verdict depends only on that metadata and the bridge's settings) and
   starts the exchange (:class:`mopd.bridge.executor.Executor`), returning a handle to
   ``.wait()`` on. Every rank calls ``.wait()`` on every handle (teacher-only ranks too: the
   staging buffers are released there).

Failures of the run (issue 7) are not ``ValueError``: a rank that never calls, raises or dies
leaves the others with a :class:`~mopd.bridge.errors.BridgeTimeoutError` (or
:class:`~mopd.bridge.errors.BridgeCommError`) within ``BridgeConfig.timeout_s`` of the phase they
wait in (the metadata all-gather, or ``wait()``), naming the phase, the peers and the timeout;
after one, the bridge refuses further calls (:class:`~mopd.bridge.errors.BridgeStateError`).
``BridgeConfig(integrity=True)`` checks every delivered row (:mod:`mopd.bridge.integrity`).

Call convention: every rank of the bridge group (every rank of every mesh) calls
:meth:`HiddenStateBridge.exchange` with what it holds: teacher ranks on their mesh's last stage
pass ``hidden={teacher_index: buffer}`` and ``layouts={teacher_index: layout}``; student ranks on
the last stage pass ``student_layout`` (and optionally ``outputs``, one buffer per teacher);
other ranks pass nothing. A layout may be given as a zero-argument callable: it is then built
inside the guarded phase, so an error it raises (e.g. a sequence length not divisible by
``2 * cp``, or any other exception) reaches every rank as the same ``ValueError``; so does a
layout that is not a :class:`~mopd.bridge.layout.TokenLayout`, and, on a student rank with
``tp > 1`` that all-gathers, a missing ``groups.student_tp`` or one over the wrong ranks.

Outputs: one buffer per teacher, the student shard's full ``[N, H_teacher]`` flat rows (or this
rank's ``[N / tp, H]`` SP slice with ``keep_sp_shard``); a row no teacher ``i`` fills (padding, or
a token routed to another teacher) is zero in teacher ``i``'s buffer, and
:attr:`PreparedExchange.owner_N` says which teacher filled each row (``-1``: padding).
"""

from __future__ import annotations

import datetime
import hashlib
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
from mopd.bridge.executor import DebugHook, ExchangeHandle, Executor, buffers_overlap, comm_failure
from mopd.bridge.groups import BridgeGroups, group_moves_cuda
from mopd.bridge.layout import TokenLayout
from mopd.bridge.mesh import Mesh, meshes_overlap
from mopd.bridge.metadata import RankRecord, decode_records, encode_record, gather_record_matrix
from mopd.bridge.planner import StudentBatch, TeacherBatch, TransferPlan, plan_token_exchange

__all__ = [
    "BridgeCommError",
    "BridgeConfig",
    "BridgeError",
    "BridgeIntegrityError",
    "BridgeStateError",
    "BridgeTimeoutError",
    "HiddenStateBridge",
    "LayoutArg",
    "PreparedExchange",
    "TeacherSpec",
]

LayoutArg = TokenLayout | Callable[[], TokenLayout]


@dataclass(frozen=True, kw_only=True)
class TeacherSpec:
    """A teacher as the bridge sees it: its mesh and hidden size."""

    mesh: Mesh
    hidden_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.hidden_size, int) or self.hidden_size < 1:
            raise ValueError(
                f"{self.mesh}: hidden_size must be a positive int, got {self.hidden_size!r}"
            )


@dataclass(frozen=True, kw_only=True)
class BridgeConfig:
    """Settings of a :class:`HiddenStateBridge`.

    Attributes:
        timeout_s: seconds each phase may wait on other ranks (the metadata all-gather; a
            handle's ``wait()``, one deadline counted from the call) before raising
            :class:`~mopd.bridge.errors.BridgeTimeoutError`. A host-side deadline on gloo; on
            NCCL ``wait()`` does not block the host (the stream waits), so hangs there are
            caught by the process groups' own timeout: create the groups with a
            :class:`~mopd.bridge.groups.GroupPool` whose timeout is not longer, so the
            transport also gives up on abandoned operations.
        local_copy: serve a destination from a replica on the same rank by a local copy.
        keep_sp_shard: each student TP rank keeps only its ``[N / tp, H]`` slice (no all-gather).
        max_cached_plans: plans (and executor schedules) kept, least recently used dropped.
        integrity: check every delivered row against the sender's checksum (one extra read of
            the source and of the output rows, one small message per transfer, and a small
            all-gather in ``wait()``, which then must be called on every rank of the bridge
            group); a mismatch raises :class:`~mopd.bridge.errors.BridgeIntegrityError` with the
            same text on every rank.
    """

    timeout_s: float = 300.0
    local_copy: bool = True
    keep_sp_shard: bool = False
    max_cached_plans: int = 8
    integrity: bool = False

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
        for name in ("local_copy", "keep_sp_shard", "integrity"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")


@dataclass(frozen=True, kw_only=True, eq=False)
class PreparedExchange:
    """A validated, planned exchange for this rank (``start`` it; reusable for the same layouts).

    Attributes:
        plan: the plan (identical on every rank).
        sources: ``teacher -> [R, H]`` flat views of this rank's captured buffers.
        outputs: ``teacher -> `` this rank's output buffers, as passed or allocated.
        owner_N: which teacher fills each row of this rank's output (``-1``: padding); ``None``
            on ranks without a student shard.
    """

    plan: TransferPlan
    sources: dict[int, torch.Tensor]
    outputs: dict[int, torch.Tensor]
    owner_N: torch.Tensor | None


@dataclass(frozen=True, kw_only=True, eq=False)
class _CachedPlan:
    """A validated plan and what ``prepare`` needs without decoding the records again.

    ``out_specs[o]``: teacher ``o``'s ``(hidden_size, dtype)`` (for allocated outputs).
    """

    plan: TransferPlan
    out_specs: tuple[tuple[int, torch.dtype], ...]


def _as_dict(arg: Any, what: str) -> dict[Any, Any]:
    if arg is None:
        return {}
    if not isinstance(arg, Mapping):
        raise ValueError(
            f"{what} must be a mapping teacher index -> value, got {type(arg).__name__}"
        )
    return dict(arg)


def _resolve_layout(arg: Any, what: str) -> TokenLayout:
    """``arg`` as a TokenLayout (calling it when it is a callable); any failure is a ValueError."""
    if callable(arg) and not isinstance(arg, TokenLayout):
        try:
            arg = arg()
        except ValueError:
            raise
        except Exception as exc:
            raise ValueError(
                f"{what}: the layout callable raised {type(exc).__name__}: {exc}"
            ) from exc
    if not isinstance(arg, TokenLayout):
        raise ValueError(
            f"{what} must be a TokenLayout or a zero-argument callable returning one, "
            f"got {type(arg).__name__}"
        )
    return arg


def _flat(t: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() < 2:
        raise ValueError(f"{what} must have a hidden dim last (>= 2-D), got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous (the bridge moves rows of its flat view)")
    return t.view(-1, t.shape[-1])


class HiddenStateBridge:
    """Moves captured teacher hidden states into the student's layout (see the module doc).

    Args:
        teachers: the teachers, index = owner = key of ``hidden`` / ``layouts`` / ``outputs``.
        student: the student mesh.
        groups: this rank's groups (:func:`mopd.bridge.groups.create_bridge_groups`).
        config: settings.
        rank: this process's global rank (default: ``dist.get_rank()``).
        debug_hook: passed to the executor (tests: corrupt or fail an exchange mid-way).
    """

    def __init__(
        self,
        *,
        teachers: Sequence[TeacherSpec],
        student: Mesh,
        groups: BridgeGroups,
        config: BridgeConfig | None = None,
        rank: int | None = None,
        debug_hook: DebugHook | None = None,
    ) -> None:
        if not teachers:
            raise ValueError("the bridge needs at least one teacher")
        bad = [t for t in teachers if not isinstance(t, TeacherSpec)]
        if bad or not isinstance(student, Mesh):
            raise ValueError(
                f"teachers must be TeacherSpec and student a Mesh, got {[type(t).__name__ for t in teachers]} "
                f"and {type(student).__name__}"
            )
        self.teachers = tuple(teachers)
        self.student = student
        self.groups = groups
        self.config = config or BridgeConfig()
        self.rank = dist.get_rank() if rank is None else rank
        want = tuple(sorted(set(student.ranks).union(*(t.mesh.ranks for t in self.teachers))))
        if tuple(groups.members) != want:
            raise ValueError(
                f"groups were created for global ranks {list(groups.members)} but these meshes "
                f"span {list(want)}: pass create_bridge_groups(pool, teacher_meshes, student) "
                "for the same meshes"
            )
        self.timeout = datetime.timedelta(seconds=self.config.timeout_s)
        self.executor = Executor(
            rank=self.rank,
            timeout=self.timeout,
            max_schedules=self.config.max_cached_plans,
            integrity=self.config.integrity,
            debug_hook=debug_hook,
        )
        moves_cuda = groups.bridge is not None and group_moves_cuda(groups.bridge)
        self.device_type = "cuda" if moves_cuda else "cpu"
        meshes = [t.mesh for t in self.teachers] + [student]
        if not self.config.local_copy and not meshes_overlap(meshes):
            warnings.warn(
                "BridgeConfig(local_copy=False) has no effect: no teacher shares a rank with the "
                "student",
                stacklevel=2,
            )
        if self.config.keep_sp_shard and student.tp == 1:
            warnings.warn(
                "BridgeConfig(keep_sp_shard=True) has no effect: the student has tp=1",
                stacklevel=2,
            )
        if not self.config.local_copy and not moves_cuda and meshes_overlap(meshes):
            raise ValueError(
                "local_copy=False sends colocated rows to the same rank, which the gloo "
                "backend cannot do (gloo has no send-to-self); use NCCL or local_copy=True"
            )
        self._tp_group_error = self._check_student_tp_group()
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if self.device_type == "cuda"
            else torch.device("cpu")
        )
        sig = repr(
            [(*t.mesh.as_ints(), t.hidden_size) for t in self.teachers]
            + [
                student.as_ints(),
                self.config.local_copy,
                self.config.keep_sp_shard,
                self.config.integrity,
                groups.members,
            ]
        )
        self.config_sig = int.from_bytes(
            hashlib.blake2b(sig.encode(), digest_size=7).digest(), "little"
        )
        #: digest of the gathered metadata -> its validated plan (LRU, ``max_cached_plans``)
        self._plans: OrderedDict[str, TransferPlan] = OrderedDict()
        #: same keys: per teacher ``(hidden_size, dtype)``, for outputs allocated on a hit
        self._out_specs: dict[str, tuple[tuple[int, torch.dtype], ...]] = {}
        #: how many ``prepare`` calls decoded and validated the gathered metadata (plan misses)
        self.validations = 0

    def _check_student_tp_group(self) -> str:
        """Why ``groups.student_tp`` cannot serve this rank's all-gather, or ``""`` (local).

        Only student last-stage ranks that all-gather (``tp > 1`` without ``keep_sp_shard``)
        need it; the message is raised in the guarded phase so every rank gets it.
        """
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
            got = tuple(sorted(dist.get_process_group_ranks(tp)))
        except Exception as exc:
            return f"groups.student_tp is not a process group this rank belongs to ({exc})"
        if got != tuple(sorted(want)):
            return (
                f"groups.student_tp spans global ranks {list(got)} but this rank's student TP "
                f"group (dp={c.dp_rank}, cp={c.cp_rank}) is {list(want)}"
            )
        return ""

    # --- the call ------------------------------------------------------------------------------

    def exchange(
        self,
        *,
        hidden: Mapping[int, torch.Tensor] | None = None,
        layouts: Mapping[int, LayoutArg] | None = None,
        student_layout: LayoutArg | None = None,
        outputs: Mapping[int, torch.Tensor] | None = None,
    ) -> ExchangeHandle:
        """Validate, plan and start one exchange (collective over the bridge group).

        Same arguments as :meth:`prepare`; returns the started handle (call ``.wait()`` on
        every rank before reading the outputs).

        Streams (CUDA): packing is queued on the current stream at this call, and ``wait()``
        makes the then-current stream wait for the transfer without blocking the host. Call
        ``exchange``, ``wait`` and whatever reads the outputs on one stream (or order the streams
        yourself): the staging buffers are reused by the next exchange in stream order.
        """
        return self.start(
            self.prepare(
                hidden=hidden, layouts=layouts, student_layout=student_layout, outputs=outputs
            )
        )

    def start(self, prepared: PreparedExchange) -> ExchangeHandle:
        """Start a prepared exchange; ``.wait()`` on the handle before reading the outputs.

        Every rank of the bridge group must start the same prepared exchange (same step).
        """
        flat_out = {o: t.view(-1, t.shape[-1]) for o, t in prepared.outputs.items()}
        handle = self.executor.start(
            prepared.plan,
            sources=prepared.sources,
            outputs=flat_out,
            group=self.groups.bridge,
            tp_group=self.groups.student_tp,
            keep_slice=self.config.keep_sp_shard,
            meta_group=self.groups.meta,
        )
        handle.outputs = dict(prepared.outputs)
        return handle

    def prepare(
        self,
        *,
        hidden: Mapping[int, torch.Tensor] | None = None,
        layouts: Mapping[int, LayoutArg] | None = None,
        student_layout: LayoutArg | None = None,
        outputs: Mapping[int, torch.Tensor] | None = None,
    ) -> PreparedExchange:
        """Exchange metadata, validate it identically on every rank, and plan (cached).

        Collective over the bridge group (every member calls it, each with what it holds).

        Args:
            hidden: on teacher last-stage ranks, ``teacher index -> `` the captured buffer,
                contiguous, hidden dim last (``[S, B, H]``, ``[B, S, H]`` or ``[T, H]``; its flat
                ``[R, H]`` rows are what the layout describes), on the bridge's device (the
                current CUDA device for NCCL, CPU for gloo); ``None`` elsewhere.
            layouts: same keys as ``hidden``: a :class:`TokenLayout` of ``R`` rows, or a
                zero-argument callable building one (inside the guarded phase).
            student_layout: on student last-stage ranks, this rank's student layout (or a
                callable), ``N`` rows (identical on the ranks of one student TP group, ``N``
                divisible by the student's tp); ``None`` elsewhere.
            outputs: optional, student ranks only: one buffer per teacher, contiguous, ``[N,
                H_teacher]`` flat (``[N / tp, H_teacher]`` with ``keep_sp_shard``), the
                teacher's dtype, the bridge's device; must not alias ``hidden``. When omitted
                they are allocated.
        Returns:
            A :class:`PreparedExchange` to :meth:`start`.
        Raises:
            ValueError: bad input on any rank (the same text on every rank, before data moves).
            BridgeTimeoutError, BridgeCommError: the metadata all-gather failed.
            BridgeStateError: an earlier exchange failed.
        """
        if self.groups.bridge is None:
            raise ValueError(
                f"global rank {self.rank} is in no mesh of this bridge; it must not call it"
            )
        self.executor.check_usable()
        n = len(self.teachers)
        src_meta: list[tuple[TokenLayout, int, torch.dtype, torch.device] | None] = [None] * n
        out_meta: list[tuple[int, int, torch.dtype, torch.device] | None] = [None] * n
        sources: dict[int, torch.Tensor] = {}
        outs: dict[int, torch.Tensor] = {}
        try:
            hidden_d = _as_dict(hidden, "hidden")
            layouts_d = _as_dict(layouts, "layouts")
            outs = _as_dict(outputs, "outputs")
            stu = self._local_checks(
                hidden_d, layouts_d, student_layout, outs, src_meta, out_meta, sources
            )
            record = encode_record(
                config_sig=self.config_sig,
                error="",
                sources=src_meta,
                student=stu,
                outputs=out_meta,
            )
        except ValueError as exc:
            sources, outs = {}, {}
            record = encode_record(
                config_sig=self.config_sig,
                error=f"global rank {self.rank}: {exc}",
                sources=[None] * n,
                student=None,
                outputs=[None] * n,
            )
        meta_group = self.groups.meta if self.groups.meta is not None else self.groups.bridge
        meta_device = (
            torch.device("cuda", torch.cuda.current_device())
            if group_moves_cuda(meta_group)
            else torch.device("cpu")
        )
        t0 = time.monotonic()
        try:
            matrix, sizes = gather_record_matrix(
                record,
                group=meta_group,
                members=self.groups.members,
                device=meta_device,
                timeout=self.timeout,
            )
        except Exception as exc:
            self.executor.mark_failed(exc)
            raise comm_failure(
                exc,
                rank=self.rank,
                what=f"the bridge's metadata all-gather over global ranks {list(self.groups.members)}",
                timeout_s=self.config.timeout_s,
                elapsed_s=time.monotonic() - t0,
            ) from exc
        # The plan cache key: every rank's whole (run-encoded, small) metadata, errors included.
        # A hit means every rank sent exactly what a validated step sent, and the verdict depends
        # only on that and on this bridge's settings: skip decoding and validation.
        digest = hashlib.blake2b(matrix.numpy().tobytes(), digest_size=16).hexdigest()
        plan = self._plans.get(digest)
        if plan is not None:
            self._plans.move_to_end(digest)
        else:
            self.validations += 1
            cached = self._validate_and_plan(decode_records(matrix, sizes, self.groups.members))
            if len(self._plans) >= self.config.max_cached_plans:
                old, _ = self._plans.popitem(last=False)
                del self._out_specs[old]
            plan = self._plans[digest] = cached.plan
            self._out_specs[digest] = cached.out_specs
        owner_N = None
        me = self.student.coord(self.rank)
        if me is not None and me.pp_rank == self.student.pp - 1:
            dest = next(d for d in plan.dests if self.rank in d.ranks)
            owner_N = dest.owner_N
            if self.config.keep_sp_shard:
                j = dest.ranks.index(self.rank)
                owner_N = owner_N[j * dest.slice_rows : (j + 1) * dest.slice_rows]
            if not outs:
                rows = owner_N.numel()
                for o, (hidden_size, dtype) in enumerate(self._out_specs[digest]):
                    outs[o] = torch.empty((rows, hidden_size), dtype=dtype, device=self.device)
        return PreparedExchange(plan=plan, sources=sources, outputs=outs, owner_N=owner_N)

    # --- local phase (errors are gathered, not raised) -----------------------------------------

    def _local_checks(
        self,
        hidden: dict[int, torch.Tensor],
        layouts: dict[int, LayoutArg],
        student_layout: LayoutArg | None,
        outputs: dict[int, torch.Tensor],
        src_meta: list[Any],
        out_meta: list[Any],
        sources: dict[int, torch.Tensor],
    ) -> TokenLayout | None:
        n = len(self.teachers)
        for o in list(hidden) + list(layouts) + list(outputs):
            if not (isinstance(o, int) and 0 <= o < n):
                raise ValueError(f"teacher index {o!r} outside [0, {n})")
        for o, spec in enumerate(self.teachers):
            holds = spec.mesh.is_last_stage(self.rank)
            if holds != (o in hidden) or holds != (o in layouts):
                want = "must pass" if holds else "must not pass"
                raise ValueError(
                    f"teacher {o} ({spec.mesh}): this rank {want} hidden[{o}] and layouts[{o}]"
                )
            if not holds:
                continue
            layout = _resolve_layout(layouts[o], f"layouts[{o}]")
            flat = _flat(hidden[o], f"teacher {o} hidden buffer")
            if flat.shape[0] != layout.num_rows:
                raise ValueError(
                    f"teacher {o} hidden buffer has {flat.shape[0]} rows (shape {tuple(hidden[o].shape)}) "
                    f"but its layout describes {layout.num_rows}"
                )
            src_meta[o] = (layout, flat.shape[1], flat.dtype, flat.device)
            sources[o] = flat
        self._check_devices_and_aliasing(hidden, {})
        is_student = self.student.is_last_stage(self.rank)
        if is_student != (student_layout is not None):
            want = "must pass" if is_student else "must not pass"
            raise ValueError(f"student ({self.student}): this rank {want} student_layout")
        if not is_student:
            if outputs:
                raise ValueError("outputs given on a rank without a student shard")
            return None
        stu = _resolve_layout(student_layout, "student_layout")
        if self._tp_group_error:
            raise ValueError(self._tp_group_error)
        if outputs and set(outputs) != set(range(n)):
            raise ValueError(
                f"outputs must have one buffer per teacher {list(range(n))}, got {sorted(outputs)}"
            )
        for o, t in outputs.items():
            flat = _flat(t, f"output buffer for teacher {o}")
            out_meta[o] = (flat.shape[0], flat.shape[1], flat.dtype, flat.device)
        self._check_devices_and_aliasing(hidden, outputs)
        return stu

    def _check_devices_and_aliasing(
        self, hidden: Mapping[int, torch.Tensor], outputs: Mapping[int, torch.Tensor]
    ) -> None:
        """Buffers on another device of the bridge's type, and outputs sharing memory (local)."""
        named = [(f"hidden[{o}]", t) for o, t in sorted(hidden.items())] + [
            (f"outputs[{o}]", t) for o, t in sorted(outputs.items())
        ]
        for name, t in named:
            if t.device.type == self.device.type and t.device != self.device:
                raise ValueError(
                    f"{name} is on {t.device} but this rank's bridge moves tensors on {self.device} "
                    "(the current CUDA device when the bridge was built)"
                )
        for i, (name, t) in enumerate(named):
            if not name.startswith("outputs"):
                continue
            for other, u in named[:i]:
                if buffers_overlap(t, u):
                    raise ValueError(
                        f"{name} shares memory with {other} on this rank: the bridge writes every "
                        "row of an output buffer, so it must not alias a source or another output"
                    )

    # --- global phase: same data, same verdict on every rank -----------------------------------

    def _validate_and_plan(self, records: list[RankRecord]) -> _CachedPlan:
        by_rank = {r.rank: r for r in records}
        sigs = sorted({r.config_sig for r in records})
        if len(sigs) > 1:
            groups = {s: [r.rank for r in records if r.config_sig == s] for s in sigs}
            raise ValueError(
                f"ranks were built with different meshes or settings: {list(groups.values())}"
            )
        bad = [r for r in records if r.error]
        if bad:
            raise ValueError(
                f"bridge input rejected on global rank(s) {[r.rank for r in bad]}: "
                + "; ".join(r.error for r in bad)
            )
        dev = self.device_type
        teacher_batches = []
        for o, spec in enumerate(self.teachers):
            m = spec.mesh
            lay: dict[tuple[int, int], TokenLayout] = {}
            dtypes = set()
            for d, c in m.shards():
                ranks = m.tp_group_ranks(dp_rank=d, cp_rank=c)
                first = by_rank[ranks[0]].sources[o]
                for r in ranks:
                    rec = by_rank[r].sources[o]
                    assert rec is not None and first is not None and rec.layout is not None
                    if rec.hidden != spec.hidden_size:
                        raise ValueError(
                            f"teacher {o} on global rank {r}: hidden size {rec.hidden}, expected {spec.hidden_size}"
                        )
                    if rec.device != dev:
                        raise ValueError(
                            f"teacher {o} on global rank {r}: buffer on {rec.device}, the bridge group moves {dev} tensors"
                        )
                    if rec.dtype is None:
                        raise ValueError(f"teacher {o} on global rank {r}: unsupported dtype")
                    dtypes.add(rec.dtype)
                    assert first.layout is not None
                    if not rec.layout.same_as(first.layout):
                        raise ValueError(
                            f"teacher {o} TP replicas {list(ranks)} (dp={d}, cp={c}) hold different token layouts"
                        )
                lay[(d, c)] = first.layout  # type: ignore[union-attr]
            if len(dtypes) != 1:
                raise ValueError(
                    f"teacher {o}: ranks hold different dtypes {sorted(map(str, dtypes))}"
                )
            dtype = dtypes.pop()
            itemsize = dtype.itemsize
            teacher_batches.append(
                (
                    TeacherBatch(
                        mesh=m, layouts=lay, hidden_size=spec.hidden_size, itemsize=itemsize
                    ),
                    dtype,
                )
            )
        s = self.student
        stu: dict[tuple[int, int], TokenLayout] = {}
        for d, c in s.shards():
            ranks = s.tp_group_ranks(dp_rank=d, cp_rank=c)
            first = by_rank[ranks[0]].student
            assert first is not None
            if first.num_rows % s.tp:
                raise ValueError(
                    f"student (dp={d}, cp={c}): {first.num_rows} rows do not split into tp={s.tp} equal slices"
                )
            want_rows = first.num_rows // s.tp if self.config.keep_sp_shard else first.num_rows
            for r in ranks:
                rec = by_rank[r]
                assert rec.student is not None
                if not rec.student.same_as(first):
                    raise ValueError(
                        f"student TP ranks {list(ranks)} (dp={d}, cp={c}) want different token layouts"
                    )
                for o, out in enumerate(rec.outputs):
                    if out is None:
                        continue
                    tb, dtype = teacher_batches[o]
                    if out.rows != want_rows or out.hidden != tb.hidden_size:
                        raise ValueError(
                            f"output buffer for teacher {o} on global rank {r} has {out.rows} rows of {out.hidden}, "
                            f"expected {want_rows} rows of {tb.hidden_size}"
                        )
                    if out.dtype != dtype or out.device != dev:
                        raise ValueError(
                            f"output buffer for teacher {o} on global rank {r} is {out.dtype} on {out.device}, "
                            f"expected {dtype} on {dev} (the teacher's dtype)"
                        )
            stu[(d, c)] = first
        plan = plan_token_exchange(
            [tb for tb, _ in teacher_batches],
            StudentBatch(mesh=s, layouts=stu),
            local_copy=self.config.local_copy,
        )
        return _CachedPlan(
            plan=plan, out_specs=tuple((tb.hidden_size, dtype) for tb, dtype in teacher_batches)
        )
