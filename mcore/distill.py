"""MOPD inside megatron's own training loop: the set-up once, and a step around the schedule.

Why this file exists: a Megatron user runs ``get_forward_backward_func()`` with their own
``forward_step_func``; MOPD has to fit into that without glue. :class:`Distiller` is built once
(collectively): the bridge's groups (reusing the student model's TP group), the bridge, and each
teacher's LM head resharded into the student's vocab partition, all read off the models and
their process groups. Each step, :meth:`Distiller.step` (collectively, outside the schedule)
plans the bridge for all micro-batches of both sides and runs the teachers' forward-only pass,
sending each micro-batch's hidden states as it is captured; inside the schedule the student's
``loss_func`` receives its micro-batch's rows point to point and returns what the schedule
expects (:mod:`mopd.mcore.loss`). Leaving the step finishes the bridge's transfers::

    distiller = Distiller(teachers=[MeshModel(model=t, mesh=tm, pg_collection=tpg)],
                          student=MeshModel(model=s, mesh=sm, pg_collection=spg), pool=pool)
    with distiller.step(student=student_mbs, teachers=[teacher_mbs]) as step:
        forward_backward(forward_step_func=step.forward_step, data_iterator=step.data_iterator(),
                         model=[s], num_microbatches=step.num_micro_batches,
                         seq_length=S, micro_batch_size=B)
    kl = step.mean_loss()   # the step's mean KL per token (student last stage), else None

A job with its own loss (an RL term with the KL as a dense reward, an SFT term) writes its
``loss_func`` around :meth:`DistillationStep.teacher_signal` (the per-token KL in the order of
its logits) and :meth:`DistillationStep.loss_output` (what the schedule expects).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mopd.bridge.api import HiddenStateBridge
from mopd.bridge.config import BridgeConfig, TeacherSpec
from mopd.bridge.groups import GroupPool, create_bridge_groups
from mopd.bridge.inputs import StepChecks
from mopd.bridge.lm_head import LMHeadShard
from mopd.bridge.worlds import WorldLink
from mopd.capture import ReusableBuffer
from mopd.common import dist as cdist
from mopd.common.log import warn_once
from mopd.kernels.kl import KLConfig
from mopd.mcore.batch import MicroBatch
from mopd.mcore.distill_step import DistillationStep
from mopd.mcore.megatron_checks import check_micro_batches
from mopd.mcore.megatron_lm_head import (
    lm_head_from_models,
    model_vocab_size,
    resolve_vocab_size,
)
from mopd.mcore.mesh_model import (
    MeshModel,
    check_pg_collection,
    hidden_dtype,
    layouts_of,
    max_positions,
)
from mopd.mcore.rollouts import (
    Rollouts,
    StepSamples,
    exchange_rollouts,
    rollout_micro_batches,
)
from mopd.mcore.teacher import (
    default_forward,
    model_config,
    run_teacher,
)

__all__ = ["Distiller"]

#: The longest a closing Distiller that hosts a link waits for the teacher worlds' servers to
#: see the close (they listen for it every fraction of a second; one that died never answers).
CLOSE_WAIT_S = 30.0


class Distiller:
    """MOPD set-up for one student and its teachers (collective over the default group, once).

    Every global rank of the job calls it, with the same meshes, after the models exist.

    Args:
        teachers: one :class:`MeshModel` per teacher (frozen; ``eval()`` is not enforced).
        student: the student's :class:`MeshModel`.
        pool: the :class:`~mopd.bridge.groups.GroupPool` the models' groups came from (the
            bridge then reuses the student's TP groups). A pool made without ``timeout_s`` is
            bounded by ``bridge_config.timeout_s`` from here on, its groups made so far
            included (:meth:`~mopd.bridge.groups.GroupPool.bound_by`).
        bridge_config: the bridge's settings (``timeout_s`` also bounds the set-up).
        kl_config: the loss's settings (``reduction`` must stay ``"sum"``).
        teacher_weights: one non-negative weight per teacher: a token's KL counts with its
            teacher's weight in the stock loss (:attr:`TeacherSignal.weight_T`); default all 1.
        teacher_sp_shards: a teacher whose ``TransformerConfig`` has ``sequence_parallel`` (at
            ``tp > 1``) sends from where its rows are: each last-stage TP rank sends its own
            SP shard (:attr:`~mopd.bridge.config.TeacherSpec.sp_shards`), and its capture does
            no all-gather. ``False``: the capture undoes SP on every TP rank and the TP ranks
            send as replicas (each a share of the full buffer).
        vocab_size: the real vocabulary (the tokenizer's). Each model may be built with its own
            padded vocabulary ``>= vocab_size`` (megatron-LM builds
            ``GPTModel(vocab_size=padded_vocab_size)``, a multiple of
            ``make_vocab_size_divisible_by * tp``); columns and LM-head rows past it never
            count: not in either softmax, the KL, the log-probs, the token counts or any
            gradient, and the teacher's padded rows are never sent. ``None``: the models'
            ``vocab_size`` attribute, which must then be the same on every model (a warning
            at the first step whose token ids suggest it is padded).
        store: where a failure is published for every rank to name it (the bridge's
            ``store``; default: torch.distributed's default store, or the link's).
        link: the teachers run in other worlds (other jobs): the link between the worlds
            (:func:`~mopd.bridge.worlds.connect_worlds`, this world the student's). A teacher
            of another world is ``MeshModel(mesh=..., world=name)``; its world runs a
            :class:`~mopd.mcore.worlds.TeacherServer`. Every step takes the rollouts form.
        steps_ahead: how many steps may be submitted (:meth:`submit`) beyond the one the
            student takes next: ``0`` (the default) is lockstep; ``1`` lets the teacher worlds
            score step ``k + 1`` while the student trains on step ``k``. A teacher world keeps
            the rows of a step it scored ahead until that step: at most ``steps_ahead`` steps
            of each last-stage teacher rank's captured hidden states (:attr:`held_bytes`). In
            one world the teachers score a step at :meth:`step` (there is no other world to
            run them meanwhile): the setting then only bounds the submitted steps, with a
            warning.

    Attributes:
        vocab_size: the real vocabulary, agreed on every rank.
    """

    def __init__(
        self,
        *,
        teachers: Sequence[MeshModel],
        student: MeshModel,
        pool: GroupPool,
        bridge_config: BridgeConfig | None = None,
        kl_config: KLConfig | None = None,
        teacher_weights: Sequence[float] | None = None,
        teacher_sp_shards: bool = True,
        vocab_size: int | None = None,
        store: dist.Store | None = None,
        link: WorldLink | None = None,
        steps_ahead: int = 0,
    ) -> None:
        if isinstance(steps_ahead, bool) or not isinstance(steps_ahead, int) or steps_ahead < 0:
            raise ValueError(f"steps_ahead must be an int >= 0, got {steps_ahead!r}")
        teachers, student = _in_bridge_ranks(teachers, student, link)
        self.link = link
        self.steps_ahead = steps_ahead
        if steps_ahead and link is None:
            warn_once(
                f"Distiller(steps_ahead={steps_ahead}) in one world: the teachers score a step "
                "at step() (no other world runs them meanwhile); the setting only bounds the "
                "steps submitted ahead"
            )
        #: steps submitted (:meth:`submit`) and not stepped yet, oldest first
        self._submitted: collections.deque[_Submitted] = collections.deque()
        if vocab_size is not None:
            resolve_vocab_size(vocab_size, [])  # its type and sign, before any collective
        if not isinstance(teacher_sp_shards, bool):
            raise ValueError(f"teacher_sp_shards must be a bool, got {teacher_sp_shards!r}")
        if not teachers:
            raise ValueError("Distiller needs at least one teacher")
        if teacher_weights is not None and (
            len(teacher_weights) != len(teachers) or any(not float(w) >= 0 for w in teacher_weights)
        ):
            raise ValueError(
                f"teacher_weights must be {len(teachers)} non-negative numbers (one per teacher), "
                f"got {list(teacher_weights)}"
            )
        self.teacher_weights = (
            None if teacher_weights is None else tuple(map(float, teacher_weights))
        )
        self.teachers = tuple(teachers)
        # one recycled buffer per teacher for its capture's SP gather (a teacher sending from
        # replicas), kept across steps: the teacher pass allocates nothing per step at a steady
        # shape (send takes the rows at once); a teacher sending its SP shards never uses it
        self._capture_buffers = tuple(ReusableBuffer() for _ in self.teachers)
        self.student = student
        self.rank = dist.get_rank() if link is None else link.rank
        self.bridge_config = bridge_config or BridgeConfig()
        self.kl_config = kl_config or KLConfig(reduction="sum")
        meshes = [t.mesh for t in self.teachers]
        self._session = None
        if link is not None and link.world == link.roster.names[0]:
            # the student's world numbers its bridges on the link; a teacher world's
            # TeacherServer numbers its own alike, one per bridge (this Distiller's)
            self._session = link.open_session()
            if link.world_rank == 0:
                link.announce(
                    f"{self._session}/distiller",
                    _describe_setup(
                        self.teachers,
                        student,
                        link,
                        bridge_config=self.bridge_config,
                        vocab_size=vocab_size,
                        teacher_sp_shards=teacher_sp_shards,
                        steps_ahead=steps_ahead,
                    ),
                )
        self._events = 0
        pool.bound_by(self.bridge_config.timeout_s)  # a pool without timeout_s: the bridge's
        groups = create_bridge_groups(pool, meshes, student.mesh, link=link)
        offset = 0 if link is None else link.offset()
        problems = check_pg_collection(student, "the student", self.rank, offset)
        for o, t in enumerate(self.teachers):
            problems += check_pg_collection(t, f"teacher {o}", self.rank, offset)
        cdist.same_verdict(
            problems,
            group=groups.metadata_group,
            timeout_s=self.bridge_config.timeout_s,
            what="Distiller set-up",
        )
        spg = student.pg_collection
        if spg is not None and student.last_stage(self.rank) and student.mesh.tp > 1:
            groups = dataclasses.replace(groups, student_tp=spg.tp)
        self.groups = groups
        # every rank needs each teacher's hidden size and whether it runs sequence-parallel,
        # and every model's vocab_size attribute (the last column: the student's); the ranks
        # holding each model know them
        n = len(self.teachers)
        sizes = torch.zeros(3, n + 1, dtype=torch.int64)
        for o, t in enumerate(self.teachers):
            if t.model is not None:
                cfg = model_config(t.model)
                sizes[0, o] = int(cfg.hidden_size)
                sizes[1, o] = int(bool(getattr(cfg, "sequence_parallel", False)))
                sizes[2, o] = model_vocab_size(t.model)
        if student.model is not None:
            sizes[2, n] = model_vocab_size(student.model)
        meta = groups.metadata_group
        cdist.all_reduce(
            sizes, op=dist.ReduceOp.MAX, group=meta, timeout_s=self.bridge_config.timeout_s
        )
        hidden_sp = sizes[:2, :n]
        self.vocab_size, self._vocab_given = resolve_vocab_size(
            vocab_size,
            [(f"teacher {o}", int(sizes[2, o])) for o in range(n)]
            + [("the student", int(sizes[2, n]))],
        )
        #: per teacher, whether its TP ranks send their own SP shards (see ``teacher_sp_shards``)
        self.teacher_sp_shards = tuple(
            teacher_sp_shards and bool(hidden_sp[1, o]) and t.mesh.tp > 1
            for o, t in enumerate(self.teachers)
        )
        specs = []
        for o, t in enumerate(self.teachers):
            dtype = hidden_dtype(model_config(t.model)) if t.model is not None else None
            specs.append(
                TeacherSpec(
                    mesh=t.mesh,
                    hidden_size=int(hidden_sp[0, o]),
                    dtype=dtype,
                    sp_shards=self.teacher_sp_shards[o],
                )
            )
        self.bridge = HiddenStateBridge(
            teachers=specs,
            student=student.mesh,
            groups=groups,
            config=self.bridge_config,
            store=store,
            link=link,
        )
        self.lm_heads: list[LMHeadShard | None] = [
            lm_head_from_models(
                t.model,
                student.model,
                teacher=t.mesh,
                student=student.mesh,
                groups=groups,
                vocab_size=self.vocab_size,
                timeout_s=self.bridge_config.timeout_s,
                local_copy=self.bridge_config.local_copy,
            )
            for t in self.teachers
        ]
        self.per_token = (
            bool(getattr(model_config(student.model), "calculate_per_token_loss", False))
            if student.model is not None
            else False
        )
        self.closed = False

    def close(self) -> None:
        """Free what the Distiller made and holds: its bridge (:meth:`HiddenStateBridge.close`:
        the steps' transport handles, caches, the groups' references), the resharded LM
        heads, the capture buffers, and its references to the models and their groups (the
        meshes stay). Local: every rank calls it, then closes the
        :class:`~mopd.bridge.groups.GroupPool` (which destroys the groups); models built on
        that pool's groups hold them until they go too. Idempotent; ``with Distiller(...) as
        distiller:`` closes it on leaving. Later calls raise
        :class:`~mopd.bridge.errors.BridgeStateError`."""
        if self.closed:
            return
        self.closed = True
        link = self.link
        if link is not None and link.world == link.roster.names[0] and link.world_rank == 0:
            with contextlib.suppress(Exception):  # the link is gone: its servers see that
                link.announce(f"{self._session}/close", "1")
                if self.bridge.lifecycle.failure is None:  # a dead rank would never answer
                    self._await_servers(link)
        self.bridge.close()
        self.groups = self.bridge.groups
        self.lm_heads = [None] * len(self.teachers)
        self._capture_buffers = tuple(ReusableBuffer() for _ in self.teachers)
        self._submitted.clear()
        self.teachers = tuple(MeshModel(mesh=t.mesh) for t in self.teachers)
        self.student = MeshModel(mesh=self.student.mesh)

    def _await_servers(self, link: WorldLink) -> None:
        """The link's host (this world's rank 0): wait until no teacher rank serves (each
        :class:`~mopd.mcore.TeacherServer` says so once it saw the close, raised, or closed),
        at most ``CLOSE_WAIT_S`` (or the link's ``timeout_s``, if shorter), so that this
        process's store outlives their last read of it; warn naming the ranks still serving."""
        ranks = range(link.roster.sizes[0], link.roster.size)
        keys = [f"{self._session}/serving/{r}" for r in ranks]
        deadline = time.monotonic() + min(CLOSE_WAIT_S, link.timeout_s)
        while True:
            serving = [
                r
                for r, k in zip(ranks, keys, strict=True)
                if link.store.check([k]) and link.store.get(k) == b"1"
            ]
            if not serving or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if serving:
            warn_once(
                f"Distiller.close(): {', '.join(link.describe(r) for r in serving)} still "
                f"served {min(CLOSE_WAIT_S, link.timeout_s):g} s after the close; their "
                "TeacherServer will find the link's store gone"
            )

    def __enter__(self) -> Distiller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, rollouts: Rollouts | None, *, num_micro_batches: int | None) -> None:
        """Hand a later step's rollouts over now (collective over every rank of every world,
        outside the schedule): the rollouts exchange runs (their token ids go to the ranks
        that use them) and every model's micro-batches are built, and a teacher world scores
        the step as soon as it has sent the rows of the step before it, while the student
        trains on that one. :meth:`step` without arguments takes the oldest submitted step::

            distiller.submit(rollouts[0], num_micro_batches=M)
            for k in range(steps):
                if k + 1 < steps:
                    distiller.submit(rollouts[k + 1], num_micro_batches=M)  # scored meanwhile
                with distiller.step() as mopd:  # step k: its rows are waiting
                    forward_backward(...)

        At most ``steps_ahead + 1`` steps are submitted and not stepped (the next one and
        ``steps_ahead`` beyond it). Arguments as :meth:`step`'s first form.

        Raises:
            ValueError: the same on every rank, before anything moves: more submitted steps
                than ``steps_ahead`` allows, or bad rollouts (as :meth:`step`).
            BridgeTimeoutError, BridgeCommError, BridgeStateError: as :meth:`step`.
        """
        try:
            if self.closed:
                self.bridge.lifecycle.check_usable()  # refused: closed
            if len(self._submitted) > self.steps_ahead:
                raise ValueError(
                    f"{len(self._submitted)} submitted steps wait for step() already: "
                    f"steps_ahead={self.steps_ahead} allows {self.steps_ahead + 1} (the next "
                    "step and steps_ahead beyond it); call step() first"
                )
            seq = self.bridge.steps + len(self._submitted)
            self._announce("submit", num_micro_batches)
            samples, student, teachers, deferred = self._from_rollouts(
                rollouts, num_micro_batches, seq=seq
            )
            self._submitted.append(
                _Submitted(samples=samples, student=student, teachers=teachers, deferred=deferred)
            )
        except Exception as exc:
            raise self.named(exc) from None

    @property
    def held_bytes(self) -> int:
        """Bytes of teacher rows this rank holds for steps it scored ahead (a teacher world's
        last-stage ranks; at most ``steps_ahead`` steps of them)."""
        return sum(
            t.numel() * t.element_size()
            for sub in self._submitted
            for rows in (sub.rows or {}).values()
            for t in rows.values()
        )

    def step(
        self,
        rollouts: Rollouts | None = None,
        *,
        num_micro_batches: int | None = None,
        student: Sequence[MicroBatch] | None = None,
        teachers: Sequence[Sequence[MicroBatch] | None] | None = None,
    ) -> DistillationStep:
        """Plan one step and run the teachers' forward-only pass (collective, outside the schedule).

        Three forms; every rank uses the same one:

        - ``step(rollouts, num_micro_batches=M)``: the step's on-policy samples, each rank
          passing the :class:`~mopd.mcore.rollouts.Rollouts` it holds (``None`` or empty where
          it holds none; the exception its sampler or the ``Rollouts`` raised where it could
          not build them, so that every rank refuses the step alike instead of waiting for it). The library agrees them on every rank, moves their token ids to the
          ranks that use them and builds every model's micro-batches (the student's DP split
          of ``M`` micro-batches with the row mask derived from each response and
          ``labels``; each teacher's split of the samples routed to it; packed or padded as
          each :class:`MeshModel` says); :meth:`DistillationStep.schedule_kwargs` gives them
          to megatron's schedule.
        - ``step(student=..., teachers=[...])``: micro-batches built by the caller.
        - ``step()``: the oldest step handed over by :meth:`submit` (its rows may be waiting:
          a teacher world scored it ahead).

        Args:
            rollouts: this rank's rollouts (the first form).
            num_micro_batches: ``M`` (the first form).
            student: on student ranks, this rank's micro-batches in schedule order (the same
                count on every student rank); ``None`` elsewhere.
            teachers: per teacher, on its ranks, its micro-batches: teacher micro-batch ``i``
                (over all teacher shards) holds the samples of student micro-batch ``i``;
                ``None`` where the rank is outside that teacher's mesh.
        Raises:
            ValueError: the same on every rank, before anything moves, for bad input (in the
                first form: a malformed or missing ``Rollouts``, ``num_micro_batches`` bad or
                left out, on any subset of ranks; the first two forms while submitted steps
                wait).
            BridgeTimeoutError, BridgeCommError: a rank failed, stalled or died in the step,
                named (the rollouts exchange included, as the phase "the rollouts exchange").
            BridgeStateError: an earlier step failed; at once where this rank saw it.
        """
        try:
            return self._step(
                rollouts, num_micro_batches=num_micro_batches, student=student, teachers=teachers
            )
        except Exception as exc:
            raise self.named(exc) from None

    def named(self, exc: BaseException) -> BaseException:
        """``exc`` with the ranks it names named by their worlds (a bridge across worlds:
        ``global rank 1 of world "teacher-0"``); itself otherwise."""
        if self.link is not None and exc.args and isinstance(exc.args[0], str):
            exc.args = (self.link.names(exc.args[0]), *exc.args[1:])
        return exc

    def _announce(self, kind: str, num_micro_batches: int | None) -> None:
        """The student's world tells the teacher worlds' servers what it calls next, in order
        (``"step"``: a step from rollouts, ``"submit"``: rollouts handed over ahead,
        ``"next"``: the oldest submitted step), with ``M`` as the student passed it (from its
        rank 0; the other worlds wait for it between calls)."""
        link = self.link
        if link is None or link.world != link.roster.names[0]:
            return
        if link.world_rank == 0:
            link.announce(
                f"{self._session}/event/{self._events}",
                json.dumps({"kind": kind, "num_micro_batches": num_micro_batches}),
            )
        self._events += 1

    def _step(
        self,
        rollouts: Rollouts | None,
        *,
        num_micro_batches: int | None,
        student: Sequence[MicroBatch] | None,
        teachers: Sequence[Sequence[MicroBatch] | None] | None,
    ) -> DistillationStep:
        if self.closed:
            self.bridge.lifecycle.check_usable()  # refused: closed
        samples = None
        scored: dict[int, dict[int, torch.Tensor]] | None = None
        queued = rollouts is None and num_micro_batches is None and student is None
        queued = queued and teachers is None and bool(self._submitted)
        if self._submitted and not queued:
            raise ValueError(
                f"{len(self._submitted)} submitted step(s) wait: step() without arguments "
                "takes them in order (submit() this step's rollouts too)"
            )
        if self.link is not None and (student is not None or teachers is not None):
            raise ValueError(
                "a Distiller across worlds takes the rollouts form: step(rollouts, "
                "num_micro_batches=M) (the teacher worlds build their own micro-batches)"
            )
        deferred: ValueError | None = None
        micro = student is not None or teachers is not None
        if queued:
            self._announce("next", None)
            sub = self._submitted.popleft()
            samples, student, teachers = sub.samples, sub.student, sub.teachers
            deferred, scored = sub.deferred, sub.rows
        elif not micro or num_micro_batches is not None or rollouts is not None:
            both = (
                [
                    f"global rank {self.rank}: Distiller.step takes rollouts and "
                    "num_micro_batches, or student= and teachers= micro-batches, not both"
                ]
                if micro
                else []
            )
            self._announce("step", num_micro_batches)
            samples, student, teachers, deferred = self._from_rollouts(
                rollouts, num_micro_batches, both, seq=self.bridge.steps
            )
        if teachers is None:
            raise ValueError("Distiller.step needs rollouts or student= and teachers=")
        if len(teachers) != len(self.teachers):
            raise ValueError(
                f"{len(teachers)} teacher micro-batch lists for {len(self.teachers)} teachers"
            )
        rank = self.rank
        s = self.student
        teacher_layouts = {}
        for o, (t, mbs) in enumerate(zip(self.teachers, teachers, strict=True)):
            if t.last_stage(rank):
                tc = t.mesh.coord(rank)
                assert tc is not None
                teacher_layouts[o] = layouts_of(
                    mbs,
                    t,
                    rows="hidden",
                    what=f"teacher {o}",
                    mask=False,
                    sp=(t.mesh.tp, tc.tp_rank) if self.teacher_sp_shards[o] else (1, 0),
                )
        student_layouts = None
        keep = self.bridge_config.keep_sp_shard
        if s.last_stage(rank):
            coord = s.mesh.coord(rank)
            assert coord is not None
            student_layouts = layouts_of(
                student,
                s,
                rows="hidden" if keep else "logits",
                what="student",
                sp=(s.mesh.tp, coord.tp_rank) if keep else (1, 0),
            )
        t0 = time.perf_counter()
        bstep = self.bridge.plan_step(
            teacher_layouts=teacher_layouts or None,
            student_layouts=student_layouts,
            check=lambda: self._check_inputs(student, teachers, deferred),
        )
        step = DistillationStep(self, bstep, student, teachers=teachers, samples=samples)
        t1 = time.perf_counter()
        held = [o for o, t in enumerate(self.teachers) if t.holds(rank)]
        try:
            if scored is not None:  # scored ahead: its rows wait here
                for i in sorted(scored):
                    step.bridge_step.send(i, scored.pop(i))
                held = []
            for k, o in enumerate(held):
                t, mbs = self.teachers[o], teachers[o]
                if mbs is None:
                    raise ValueError(
                        f"global rank {rank} is in teacher {o}'s mesh: pass its micro-batches"
                    )
                last = k == len(held) - 1
                run_teacher(
                    t.model,
                    mbs,
                    pg_collection=t.pg_collection,
                    on_hidden=step._teacher_rows(o, clone=not last),
                    forward=step._noted(t.forward or default_forward, "teacher", t.model),
                    buffer=self._capture_buffers[o],
                    sp_shards=self.teacher_sp_shards[o],
                )
            step._flush_teacher_rows()
            t2 = time.perf_counter()
            self._score_ahead(step)
        except BaseException as exc:  # the step is planned everywhere: fail it, as its block would
            step.__exit__(type(exc), exc, exc.__traceback__)
            raise
        step.timings["plan"] = t1 - t0
        step.timings["teacher"] = t2 - t1
        step.timings["ahead"] = time.perf_counter() - t2
        return step

    def _score_ahead(self, step: DistillationStep) -> None:
        """A teacher world, once this step's rows are sent: score the steps submitted beyond
        it (their forward-only pass, the rows kept until their step), while the student's
        world trains on this one. Nothing elsewhere (one world, the student's world)."""
        link, rank = self.link, self.rank
        if link is None or link.world == link.roster.names[0]:
            return
        held = [o for o, t in enumerate(self.teachers) if t.holds(rank)]
        for sub in self._submitted:
            if sub.rows is not None or sub.teachers is None:
                continue
            rows: dict[int, dict[int, torch.Tensor]] = {}
            for o in held:
                t, mbs = self.teachers[o], sub.teachers[o]
                if mbs is None:
                    raise ValueError(
                        f"global rank {rank} is in teacher {o}'s mesh: pass its micro-batches"
                    )
                run_teacher(
                    t.model,
                    mbs,
                    pg_collection=t.pg_collection,
                    on_hidden=functools.partial(_keep_rows, rows, o),
                    forward=step._noted(t.forward or default_forward, "ahead", t.model),
                    buffer=self._capture_buffers[o],
                    sp_shards=self.teacher_sp_shards[o],
                )
            sub.rows = rows

    def _from_rollouts(
        self, rollouts: Any, num_micro_batches: Any, problems: Sequence[str] = (), *, seq: int
    ) -> tuple[
        StepSamples | None,
        list[MicroBatch] | None,
        list[list[MicroBatch] | None],
        ValueError | None,
    ]:
        """The step's samples, this rank's micro-batches of each model it holds, and what is
        wrong with them on this rank only (a ``ValueError`` the planning's guarded phase
        shares: :meth:`_check_inputs`). ``problems``: this rank's own, shared in the
        rollouts' verdict; ``seq``: the step they are for."""
        rank = self.rank
        if rank not in self.groups.members:  # outside every mesh: nothing to build
            if isinstance(rollouts, Rollouts) and len(rollouts):
                raise ValueError(
                    f"global rank {rank} is outside every mesh: it cannot hold rollouts"
                )
            return None, None, [None] * len(self.teachers), None
        faults = self.bridge.faults
        if self.bridge.lifecycle.hard:  # the transport may be out of step: refuse locally
            self.bridge.lifecycle.check_usable()
        faults.at(seq, "rollouts")
        samples = exchange_rollouts(
            rollouts,
            num_micro_batches=num_micro_batches,
            student=self.student.mesh,
            teachers=[t.mesh for t in self.teachers],
            group=self.groups.metadata_group,
            vocab_size=self.vocab_size,
            timeout_s=self.bridge_config.timeout_s,
            faults=faults,
            problems=problems,
        )
        device = cdist.group_device(self.groups.bridge)
        deferred: list[ValueError] = []

        def build(mm: MeshModel, teacher: int | None) -> list[MicroBatch] | None:
            if mm.model is None or not mm.holds(rank):
                return None
            config = model_config(mm.model)
            try:
                return rollout_micro_batches(
                    samples,
                    mesh=mm.mesh,
                    teacher=teacher,
                    packed=mm.packed,
                    sequence_parallel=bool(getattr(config, "sequence_parallel", False)),
                    device=device,
                    max_sequence_length=max_positions(mm.model),
                    rank=rank,
                )
            except ValueError as exc:  # this rank's model only: shared at planning
                deferred.append(exc)
                return None

        try:
            student = build(self.student, None)
            teachers = [build(t, o) for o, t in enumerate(self.teachers)]
        except BaseException as exc:  # the others go on to plan: the job's first failure
            faults.mark_failed(exc)
            raise
        return samples, student, teachers, deferred[0] if deferred else None

    def _check_inputs(
        self,
        student: Sequence[MicroBatch] | None,
        teachers: Sequence[Sequence[MicroBatch] | None],
        deferred: ValueError | None = None,
    ) -> StepChecks:
        """This rank's checks of a step's micro-batches (run inside the bridge's guarded phase,
        so a problem is the same ``ValueError`` on every rank): each model it holds has its
        micro-batches, and every field its schedule reads fits them
        (:func:`~mopd.mcore.megatron_checks.check_micro_batches`); returns the counts (a mapping) and
        the shapes each model replica's ranks must give alike, which the bridge compares.
        ``deferred``: what building this rank's micro-batches from rollouts found, raised
        first."""
        if deferred is not None:
            raise deferred
        counts: dict[str, int] = {}
        agreements = []
        for what, mm, mbs in [
            ("student", self.student, student),
            *(
                (f"teacher {o}", t, m)
                for o, (t, m) in enumerate(zip(self.teachers, teachers, strict=True))
            ),
        ]:
            if not mm.holds(self.rank):
                continue
            if mbs is None or isinstance(mbs, MicroBatch) or len(mbs) == 0:
                raise ValueError(
                    f"{what} ({mm.mesh}): this rank holds a stage of it, so it must pass its "
                    f"micro-batches (one per micro-batch of the step), got {_describe(mbs)}"
                )
            counts[f"{what}'s micro-batches"] = len(mbs)
            agreements.append(
                check_micro_batches(
                    mbs,
                    what=what,
                    mesh=mm.mesh,
                    rank=self.rank,
                    model=mm.model,
                    default_forward=mm.forward is None,
                    student=mm is self.student,
                    vocab_size=self.vocab_size,
                    given=self._vocab_given,
                )
            )
        return StepChecks(counts, tuple(agreements))


def _in_bridge_ranks(
    teachers: Sequence[MeshModel], student: MeshModel, link: WorldLink | None
) -> tuple[list[MeshModel], MeshModel]:
    """The models with their meshes in the bridge's rank space (checked before anything
    moves: a model of another world has no model here; ``world`` needs a link)."""
    if not isinstance(student, MeshModel) or not all(isinstance(t, MeshModel) for t in teachers):
        raise ValueError(
            "Distiller takes MeshModels: got "
            f"{[type(t).__name__ for t in teachers]} and {type(student).__name__}"
        )
    models = [*teachers, student]
    if link is None:
        worlds = sorted({m.world for m in models if m.world is not None})
        if worlds:
            raise ValueError(
                f"MeshModels name worlds {worlds} but no link was given: pass "
                "link=connect_worlds(...)"
            )
        return list(teachers), student
    out = []
    for i, m in enumerate(models):
        what = "the student" if i == len(teachers) else f"teacher {i}"
        world = link.world if m.world is None else m.world
        if world not in link.roster.names:
            raise ValueError(
                f"{what}: world {world!r} is not on the link (worlds: {list(link.roster.names)})"
            )
        if world != link.world and m.model is not None:
            raise ValueError(
                f"{what} runs in world {world!r}: this process (world {link.world!r}) "
                "cannot hold its model; pass MeshModel(mesh=..., world=...) without one"
            )
        out.append(dataclasses.replace(m, mesh=link.to_bridge(m.mesh, world), world=world))
    if out[-1].world != link.roster.names[0]:
        raise ValueError(
            f"the student must run in the link's host world {link.roster.names[0]!r}, "
            f"not {out[-1].world!r}"
        )
    return out[:-1], out[-1]


def _describe_setup(
    teachers: Sequence[MeshModel],
    student: MeshModel,
    link: WorldLink,
    *,
    bridge_config: BridgeConfig,
    vocab_size: int | None,
    teacher_sp_shards: bool,
    steps_ahead: int,
) -> str:
    """What a teacher world's :class:`~mopd.mcore.worlds.TeacherServer` needs to build the
    same Distiller (JSON; meshes in their own worlds' ranks)."""

    def mesh(m: MeshModel) -> dict[str, Any]:
        local = dataclasses.replace(m.mesh, rank_offset=m.mesh.rank_offset - link.offset(m.world))
        return {"world": m.world, "mesh": list(local.as_ints()), "name": local.name}

    return json.dumps(
        {
            "teachers": [mesh(t) for t in teachers],
            "student": mesh(student),
            "bridge_config": dataclasses.asdict(bridge_config),
            "vocab_size": vocab_size,
            "teacher_sp_shards": teacher_sp_shards,
            "steps_ahead": steps_ahead,
        }
    )


def _keep_rows(
    rows: dict[int, dict[int, torch.Tensor]], owner: int, i: int, hidden: torch.Tensor
) -> None:
    """A teacher pass scoring ahead: keep micro-batch ``i``'s rows of teacher ``owner`` (a copy:
    the capture reuses its buffer) until their step."""
    rows.setdefault(i, {})[owner] = hidden.clone()


@dataclass(kw_only=True, eq=False)
class _Submitted:
    """A step handed over by :meth:`Distiller.submit`: what its rollouts built on this rank
    (as :meth:`Distiller._from_rollouts` returns it) and, once a teacher world scored it
    ahead, its rows: micro-batch -> teacher -> this rank's captured hidden states."""

    samples: StepSamples | None
    student: list[MicroBatch] | None
    teachers: list[list[MicroBatch] | None]
    deferred: ValueError | None
    rows: dict[int, dict[int, torch.Tensor]] | None = None


def _describe(mbs: Any) -> str:
    return (
        "None"
        if mbs is None
        else f"{type(mbs).__name__} of {len(mbs)}"
        if hasattr(mbs, "__len__")
        else type(mbs).__name__
    )
