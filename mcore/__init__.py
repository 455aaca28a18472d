"""mopd.mcore: MOPD inside megatron-core's own training loop, and everything megatron-facing.

:class:`Distiller` (set-up, once) and :meth:`Distiller.step` (per step, around
``get_forward_backward_func()``), micro-batches described by :class:`MicroBatch` with their
layouts read off megatron's objects (:func:`micro_batch_layout`), the teachers' per-token signal
as a building block for the job's own loss (:func:`teacher_signal`) and the loss in the shape
megatron's schedule expects (:func:`megatron_loss_output`), the student's vocab-parallel
log-probability of given tokens for the job's other terms (:func:`token_logprobs`, and the
cross-entropy :func:`cross_entropy`), a model's
process groups on its own mesh (:func:`megatron_process_groups`), meshes read off megatron's
groups (:func:`mesh_from_pg_collection`, :func:`mesh_from_parallel_state`) and the teachers' LM
heads read off the models (:func:`lm_head_from_models`); one step's on-policy samples
(:class:`Rollouts`), from which :meth:`Distiller.step` builds every rank's micro-batches; a
teacher world's end of a bridge across worlds (:class:`TeacherServer`). The internals (the teachers'
forward-only pass, the stock loss function) live in their modules (:mod:`.teacher`,
:mod:`.loss`). :mod:`mopd.mcore.cpu` makes megatron-core run on CPU ranks (gloo) for the demo and
the tests; it is not imported here. Ray worker groups as worlds (:class:`WorkerGroup`) import
Ray when a group is made: importing this package never needs Ray.
"""

from __future__ import annotations

from mopd.mcore.batch import (
    MicroBatch,
    micro_batch_layout,
    packed_micro_batch,
    padded_micro_batch,
    split_samples,
)
from mopd.mcore.distill import Distiller
from mopd.mcore.distill_step import DistillationStep
from mopd.mcore.logprob import cross_entropy, token_logprobs
from mopd.mcore.loss import TeacherSignal, megatron_loss_output, teacher_signal
from mopd.mcore.megatron_groups import (
    megatron_process_groups,
    mesh_from_parallel_state,
    mesh_from_pg_collection,
)
from mopd.mcore.megatron_lm_head import lm_head_from_models
from mopd.mcore.mesh_model import MeshModel
from mopd.mcore.ray_groups import PendingCall, WorkerGroup  # Ray only when a group is made
from mopd.mcore.rollouts import Rollouts
from mopd.mcore.worlds import TeacherServer

__all__ = [
    "DistillationStep",
    "Distiller",
    "MeshModel",
    "MicroBatch",
    "PendingCall",
    "Rollouts",
    "TeacherServer",
    "TeacherSignal",
    "WorkerGroup",
    "cross_entropy",
    "lm_head_from_models",
    "megatron_loss_output",
    "megatron_process_groups",
    "mesh_from_parallel_state",
    "mesh_from_pg_collection",
    "micro_batch_layout",
    "packed_micro_batch",
    "padded_micro_batch",
    "split_samples",
    "teacher_signal",
    "token_logprobs",
]
