"""mopd.mcore: MOPD inside megatron-core's own training loop.

:class:`Distiller` (set-up, once) and :meth:`Distiller.step` (per step, around
``get_forward_backward_func()``), micro-batches described by :class:`MicroBatch` with their
layouts read off megatron's objects (:func:`micro_batch_layout`), the teachers' forward-only
pass (:func:`run_teacher`), the teachers' per-token signal as a building block for the job's own
loss (:func:`teacher_signal`) and the loss in the shape megatron's schedule expects
(:func:`kl_loss_func`, :func:`megatron_loss_output`), and the student's vocab-parallel
log-probability of given tokens for the job's other terms (:func:`token_logprobs`). :mod:`mopd.mcore.cpu` makes megatron-core run on CPU ranks (gloo) for the
demo and the tests; it is not imported here.
"""

from __future__ import annotations

from mopd.mcore.batch import (
    MicroBatch,
    micro_batch_layout,
    packed_micro_batch,
    padded_micro_batch,
    split_samples,
)
from mopd.mcore.distill import DistillationStep, Distiller, MeshModel
from mopd.mcore.logprob import token_logprobs
from mopd.mcore.loss import TeacherSignal, kl_loss_func, megatron_loss_output, teacher_signal
from mopd.mcore.teacher import run_teacher

__all__ = [
    "DistillationStep",
    "Distiller",
    "MeshModel",
    "MicroBatch",
    "TeacherSignal",
    "kl_loss_func",
    "megatron_loss_output",
    "micro_batch_layout",
    "packed_micro_batch",
    "padded_micro_batch",
    "run_teacher",
    "split_samples",
    "teacher_signal",
    "token_logprobs",
]
