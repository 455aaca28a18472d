"""One MOPD step on one rank, inside megatron's schedule: the student's loss, the teachers' signal.

Why this file exists: :meth:`mopd.mcore.distill.Distiller.step` plans a step collectively, and
what the schedule then calls on each rank (its ``forward_step``, ``loss_func``, the teachers'
per-token signal, the step's mean loss, and leaving the step) is a separate object with its own
lifetime: :class:`DistillationStep`. It reads of its Distiller only what :class:`StepOwner`
names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from mopd.bridge.api import HiddenStateBridge
from mopd.bridge.config import BridgeConfig
from mopd.bridge.errors import BridgeError
from mopd.bridge.layout import TokenLayout
from mopd.bridge.lm_head import LMHeadShard
from mopd.bridge.step import BridgeStep
from mopd.bridge.transport import comm_failure, is_transport_failure
from mopd.common import dist as cdist
from mopd.common.log import warn_once
from mopd.kernels.kl import KLConfig, KLKind
from mopd.mcore.batch import MicroBatch, micro_batch_layout
from mopd.mcore.logprob import token_logprobs
from mopd.mcore.loss import (
    LOG_KEY,
    TeacherSignal,
    kl_loss_func,
    megatron_loss_output,
    teacher_signal,
)
from mopd.mcore.mesh_model import MeshModel, model_groups
from mopd.mcore.rollouts import (
    StepSamples,
)
from mopd.mcore.teacher import (
    Forward,
    default_forward,
    pipeline_shape,
)

__all__ = ["DistillationStep", "StepOwner"]


class StepOwner(Protocol):
    """What a :class:`DistillationStep` reads of the Distiller that planned it."""

    @property
    def rank(self) -> int: ...
    @property
    def student(self) -> MeshModel: ...
    @property
    def bridge(self) -> HiddenStateBridge: ...
    @property
    def bridge_config(self) -> BridgeConfig: ...
    @property
    def per_token(self) -> bool: ...
    @property
    def lm_heads(self) -> Sequence[LMHeadShard | None]: ...
    @property
    def kl_config(self) -> KLConfig: ...
    @property
    def teacher_weights(self) -> tuple[float, ...] | None: ...
    @property
    def vocab_size(self) -> int | None: ...

    def named(self, exc: BaseException) -> BaseException: ...


class DistillationStep:
    """One MOPD step on this rank (:meth:`Distiller.step`); a context manager that finishes it."""

    def __init__(
        self,
        distiller: StepOwner,
        bridge_step: BridgeStep,
        student: Sequence[MicroBatch] | None,
        *,
        teachers: Sequence[Sequence[MicroBatch] | None] | None = None,
        samples: StepSamples | None = None,
    ) -> None:
        self.distiller = distiller
        self.bridge_step = bridge_step
        #: this rank's student micro-batches, in schedule order (``[]`` off the student)
        self.micro_batches = list(student) if student is not None else []
        #: per teacher, this rank's micro-batches of it (what its forward-only pass ran),
        #: ``None`` where the rank is outside that teacher's mesh
        self.teacher_micro_batches: list[list[MicroBatch] | None] = [
            list(t) if t is not None else None for t in (teachers or [])
        ]
        self.num_micro_batches = bridge_step.num_micro_batches
        #: the step's samples as every rank agreed them (the rollouts form), else ``None``
        self.samples = samples
        self._loss_calls = 0
        self._logged: dict[int, torch.Tensor] = {}
        self._pending: dict[int, dict[int, torch.Tensor]] = {}
        s = distiller.student
        dp = s.mesh.dp
        tokens = bridge_step.global_tokens()
        self.default_scale = self.num_micro_batches * dp / max(tokens, 1)
        self.global_tokens = tokens
        #: seconds on this rank: ``plan`` (the bridge's metadata, checks and plans) and
        #: ``teacher`` (the teachers' forward-only pass, sends included)
        self.timings: dict[str, float] = {}
        if tokens == 0 and s.holds(distiller.rank):
            counts = [bridge_step.global_tokens(i) for i in range(self.num_micro_batches)]
            warn_once(
                f"MOPD step {bridge_step.seq}: no row of the student's micro-batches counts on "
                f"any rank (counted rows per micro-batch over the whole student: {counts}): "
                "every row mask is empty, so mean_loss() is 0 and the step's gradients are zero; "
                "are the responses empty, or the masks shifted past them?"
            )
        self._forwards = 0

    # --- where this rank is (what a census of a failure reports) ----------------------------

    def _note(self, phase: str, micro_batch: int | None = None) -> None:
        self.distiller.bridge.faults.at(self.bridge_step.seq, phase, micro_batch)

    def _noted(self, forward: Forward, phase: str, model: Any) -> Forward:
        """``forward`` noting each micro-batch it runs (per model chunk, in order)."""
        chunks = len(model) if isinstance(model, list | tuple) else 1
        calls = [0]

        def noted(chunk: Any, mb: MicroBatch) -> Any:
            self._note(phase, calls[0] // chunks)
            calls[0] += 1
            return forward(chunk, mb)

        return noted

    # --- teacher rows ---------------------------------------------------------------------------

    def _teacher_rows(self, owner: int, *, clone: bool) -> Callable[[int, torch.Tensor], None]:
        """The teacher pass's callback: send now, or hold a copy until the rank's last teacher."""

        def on_hidden(i: int, hidden: torch.Tensor) -> None:
            rows = self._pending.setdefault(i, {})
            rows[owner] = hidden.clone() if clone else hidden
            if not clone:
                self.bridge_step.send(i, self._pending.pop(i))

        return on_hidden

    def _flush_teacher_rows(self) -> None:
        for i in sorted(self._pending):
            self.bridge_step.send(i, self._pending.pop(i))

    # --- inside the schedule --------------------------------------------------------------------

    def _index(self, micro_batch: int | MicroBatch | None) -> int:
        """A student micro-batch's index: given, found by identity, or the next in order."""
        if micro_batch is None:
            i = self._loss_calls
            self._loss_calls += 1
            return i
        if isinstance(micro_batch, MicroBatch):
            for i, mb in enumerate(self.micro_batches):
                if mb is micro_batch:
                    return i
            raise ValueError("this MicroBatch is not one of the step's student micro-batches")
        return int(micro_batch)

    def teacher_signal(
        self,
        logits: torch.Tensor,
        micro_batch: int | MicroBatch | None = None,
        *,
        kinds: Sequence[KLKind] | None = None,
    ) -> TeacherSignal:
        """The teachers' signal for a student micro-batch, in the order of ``logits``
        (:class:`~mopd.mcore.loss.TeacherSignal`: per-token KL to each token's teacher with
        gradient into ``logits``, mask, owner, per-teacher weight, token counts).

        Call it inside ``loss_func`` on the student's last stage, once per micro-batch.

        Args:
            logits: the model's output, ``[B, S_local, V_local]`` or ``[1, T_local, V_local]``.
            micro_batch: the :class:`MicroBatch` the data iterator gave (or its index);
                ``None``: the next one in schedule order (megatron calls the last stage's loss
                functions in micro-batch order).
            kinds: the KLs to compute (default: ``kl_config.kind``).
        """
        d = self.distiller
        s = d.student
        i = self._index(micro_batch)
        heads = d.lm_heads
        if any(h is None for h in heads) or not s.last_stage(d.rank):
            raise ValueError("teacher_signal called on a rank off the student's last stage")
        return teacher_signal(
            self.bridge_step,
            i,
            logits,
            lm_heads=heads,  # type: ignore[arg-type]
            tp_group=model_groups(s).tp if s.mesh.tp > 1 else None,
            teacher_weights=d.teacher_weights,
            kinds=tuple(kinds) if kinds is not None else (d.kl_config.kind,),
            config=d.kl_config,
            global_tokens=self.global_tokens,
            layout=self._logit_rows(i),
            advantages=self._advantages(),
        )

    def _logit_rows(self, i: int) -> TokenLayout | None:
        """Micro-batch ``i``'s logit rows as ``(sample id, position)`` keys, loss mask not
        applied (``None`` if the step has no such micro-batch here)."""
        if i >= len(self.micro_batches):
            return None
        s = self.distiller.student
        return micro_batch_layout(
            self.micro_batches[i], rows="logits", pg_collection=s.pg_collection, use_loss_mask=False
        )

    def _advantages(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(sorted sample ids [N], their advantages [N])`` of the rollouts, or ``None``."""
        smp = self.samples
        if smp is None or smp.advantage_N is None:
            return None
        order = torch.argsort(smp.sample_id_N)
        return smp.sample_id_N[order], smp.advantage_N[order]

    def teacher_rows(self, micro_batch: int) -> dict[int, torch.Tensor]:
        """The teachers' rows of a student micro-batch as the loss receives them:
        ``teacher -> [N_k, H_k]``, the tokens teacher ``k`` owns in the student's layout, in row
        order, compact (:meth:`~mopd.bridge.step.BridgeStep.receive`: the first call waits for
        them, later ones return the same tensors). On the student's last stage."""
        return self.bridge_step.receive(micro_batch)

    def forward(self, model: Any, micro_batch: MicroBatch) -> Any:
        """The student's forward on ``micro_batch`` (its :attr:`MeshModel.forward`, else
        megatron's GPTModel call with tokens, positions, mask and packed-sequence parameters)."""
        return (self.distiller.student.forward or default_forward)(model, micro_batch)

    def schedule_kwargs(self) -> dict[str, Any]:
        """The arguments of megatron's ``forward_backward_func`` that describe this step's
        student micro-batches: ``data_iterator`` (one per virtual-pipeline chunk when the
        student is a list of chunks), ``num_microbatches``, ``seq_length`` and
        ``micro_batch_size`` (megatron's, pre-CP; 1 for THD)."""
        s = self.distiller.student
        kwargs: dict[str, Any] = {"num_microbatches": self.num_micro_batches}
        chunks = s.model if isinstance(s.model, list | tuple) else None
        kwargs["data_iterator"] = (
            [self.data_iterator() for _ in chunks] if chunks else self.data_iterator()
        )
        if self.micro_batches:
            seq, cols = pipeline_shape(self.micro_batches[0], cp_size=s.mesh.cp)
            kwargs.update(seq_length=seq, micro_batch_size=cols)
        return kwargs

    def token_logprobs(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``log p_S(labels)`` per logit row from the student's vocab-parallel ``logits``, over
        the real vocabulary (:attr:`Distiller.vocab_size`) and the student's own TP group
        (:func:`~mopd.mcore.logprob.token_logprobs`); differentiable into ``logits``.

        Args:
            logits: ``[B, S_local, V_local]`` or ``[1, T_local, V_local]``, as the model returns.
            labels: ``logits.shape[:-1]`` global token ids (row ``p``'s is the token it
                predicts, ``p + 1``), the same on every TP rank.
        Returns:
            ``labels.shape`` fp32.
        """
        d = self.distiller
        s = d.student
        if not s.last_stage(d.rank):
            raise ValueError("token_logprobs called on a rank off the student's last stage")
        return token_logprobs(
            logits,
            labels,
            tp_group=model_groups(s).tp if s.mesh.tp > 1 else None,
            vocab_size=d.vocab_size,
            timeout_s=d.bridge_config.timeout_s,
        )

    def cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The per-row cross-entropy ``-log p_S(labels)`` (an SFT term beside the KL): over the
        student's own TP group and the real vocabulary, as :meth:`token_logprobs`; shapes and
        gradient as there. (megatron's ``vocab_parallel_cross_entropy`` reads its global TP
        group, which is not the student's when the models live on their own meshes.)"""
        return -self.token_logprobs(logits, labels)

    def loss_output(
        self,
        loss_sum: torch.Tensor,
        signal: TeacherSignal,
        *,
        logs: dict[str, Any] | None = None,
    ) -> tuple[Any, ...]:
        """What ``loss_func`` returns for ``loss_sum``, a loss summed over ``signal``'s counted
        tokens (the same on every TP rank): megatron's ``(loss_sum, num_tokens, logs)`` with
        ``calculate_per_token_loss``, else the sum scaled by ``M * dp / global_tokens``; either
        way the gradient is that of the step's mean loss per counted token. The logged
        ``[loss_sum, num_tokens]`` feeds :meth:`mean_loss`."""
        out = megatron_loss_output(
            loss_sum,
            signal.num_tokens,
            per_token=self.distiller.per_token,
            default_scale=self.default_scale,
            logs=logs,
        )
        self._logged[signal.micro_batch] = out[-1][LOG_KEY]
        return out

    def loss_func(
        self, micro_batch: int | MicroBatch | None = None
    ) -> Callable[[torch.Tensor], tuple[Any, ...]]:
        """The stock ``loss_func`` for a student micro-batch (default: the next one, in schedule
        order): the teacher-weighted KL summed over counted tokens (:meth:`teacher_signal`,
        :meth:`loss_output`)."""
        d = self.distiller
        s = d.student

        def resolve(output: torch.Tensor, non_loss_data: bool = False) -> tuple[Any, ...]:
            i = self._index(micro_batch)
            heads = d.lm_heads
            if any(h is None for h in heads):
                raise ValueError("loss_func called on a rank off the student's last stage")
            fn = kl_loss_func(
                self.bridge_step,
                i,
                lm_heads=heads,  # type: ignore[arg-type]
                tp_group=model_groups(s).tp if s.mesh.tp > 1 else None,
                per_token=d.per_token,
                default_scale=self.default_scale,
                config=d.kl_config,
                teacher_weights=d.teacher_weights,
                global_tokens=self.global_tokens,
                record=self._logged.__setitem__,
            )
            return fn(output)

        return resolve

    def data_iterator(self) -> Iterator[MicroBatch]:
        """This rank's student micro-batches, in order (megatron's ``data_iterator``)."""
        return iter(self.micro_batches)

    def forward_step(self, data_iterator: Iterator[MicroBatch], model: Any) -> tuple[Any, Any]:
        """A ready ``forward_step_func``: the student's forward on the next micro-batch and the
        MOPD ``loss_func``."""
        mb = next(data_iterator)
        self._note("forward", self._forwards)
        self._forwards += 1
        return self.forward(model, mb), self.loss_func()

    # --- after the schedule ---------------------------------------------------------------------

    def finish(self) -> None:
        """Complete the bridge's transfers (every rank; :meth:`BridgeStep.finish`)."""
        self.bridge_step.finish()

    def mean_loss(self) -> float | None:
        """The step's mean loss per counted token over the whole student (the stock loss: the
        weighted KL; a custom ``loss_func``: what it gave :meth:`loss_output`): one all-reduce
        over the student's DP x CP group on its last stage (call it there after the schedule);
        ``None`` on other ranks."""
        s = self.distiller.student
        if not s.last_stage(self.distiller.rank):
            return None
        self._note("mean_loss")
        group = model_groups(s).dp_cp
        device = cdist.group_device(group)
        total = torch.zeros(2, dtype=torch.float64, device=device)
        for v in self._logged.values():
            total += v.to(device)
        if group is not None and group.size() > 1:
            self.distiller.bridge.lifecycle.check_usable()
            ranks = dist.get_process_group_ranks(group)
            self.distiller.bridge.faults.timed(
                lambda: cdist.all_reduce(
                    total, group=group, timeout_s=self.distiller.bridge_config.timeout_s
                ),
                f"mean_loss()'s all-reduce over the student's DP x CP group (global ranks {ranks})",
            )
        return float(total[0] / total[1].clamp(min=1))

    def __enter__(self) -> DistillationStep:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        """Leaving normally finishes the step. Leaving on an exception fails it: a transport
        error (a timeout or a lost peer, in the bridge or in megatron's own collectives) makes
        this rank's bridge refuse every later call at once, and one from megatron's (or the
        job's) collectives is raised as a :class:`~mopd.bridge.errors.BridgeTimeoutError` /
        :class:`~mopd.bridge.errors.BridgeCommError` leading with the job's first failure
        (another rank's, when one published it: :mod:`mopd.bridge.failures`); any other
        exception abandons the step (published as the job's first failure unless one is
        there), which every rank's next :meth:`Distiller.step` reports as the same
        :class:`~mopd.bridge.errors.BridgeStateError`."""
        if exc_type is None:
            try:
                self.finish()
            except Exception as err:
                raise self.distiller.named(err) from None
            return
        if isinstance(exc, BaseException):
            self.distiller.named(exc)  # re-raised as it is, its ranks named by world
        named = None
        if (
            isinstance(exc, Exception)
            and not isinstance(exc, BridgeError)  # the bridge's own: named where it was raised
            and is_transport_failure(exc)
        ):
            d = self.distiller
            named = comm_failure(
                exc,
                rank=d.rank,
                what=f"a collective inside step {self.bridge_step.seq}'s block (megatron's own, "
                "or the job's)",
                timeout_s=d.bridge_config.timeout_s,
                elapsed_s=0.0,
            )
            d.bridge.faults.mark_failed(named)
        self.bridge_step.__exit__(exc_type, exc, tb)
        if named is not None:
            raise self.distiller.named(named) from exc if isinstance(exc, Exception) else None
