"""The teacher's forward-only pass over a step's micro-batches, any pipeline depth.

Why this file exists: the frozen teacher runs before the student's schedule (its own pipeline
cannot nest inside the student's ``forward_step``), through megatron's own forward-only schedule
so that a teacher with PP > 1 works as it does in training. Each micro-batch's pre-LM-head hidden
states are captured on the last stage (:mod:`mopd.capture`) and handed to a callback right away
(the bridge's :meth:`~mopd.bridge.step.BridgeStep.send`, which takes the rows at the call). Under
sequence parallelism the bridge path hands each TP rank's own shard as it is (``sp_shards``: no
all-gather, each rank a source of its own rows); otherwise the capture undoes SP into one
recycled buffer (no allocation per micro-batch). The teacher's own full-vocabulary logits are not
needed: by default its ``output_layer`` is skipped during the pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from mopd.capture import OutputLayerInputCapture, ReusableBuffer
from mopd.common import ranges
from mopd.mcore.batch import MicroBatch

__all__ = [
    "check_interleaved_micro_batches",
    "check_pipeline_shapes",
    "default_forward",
    "pipeline_shape",
    "run_teacher",
]

#: ``forward(model, micro_batch) -> output`` (megatron's output tensor of the stage).
Forward = Callable[[Any, MicroBatch], torch.Tensor]


def default_forward(model: Any, mb: MicroBatch) -> torch.Tensor:
    """``model(tokens, position_ids, attention_mask, packed_seq_params=...)``: a GPTModel or
    HybridModel call (the two share this signature)."""
    return model(
        mb.tokens, mb.position_ids, mb.attention_mask, packed_seq_params=mb.packed_seq_params
    )


@contextlib.contextmanager
def _skip_output_layer(layer: torch.nn.Module | None) -> Iterator[None]:
    """Make ``layer`` (a model's ``output_layer``, ``None`` off the last stage: nothing to do)
    return an empty ``[..., 0]`` output (its pre-hooks, the capture's among them, still run): the
    teacher's logits are never computed."""
    if layer is None:
        yield
        return

    def empty(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        return hidden.new_empty((*hidden.shape[:-1], 0)), None

    layer.forward = empty
    try:
        yield
    finally:
        del layer.forward


def pipeline_shape(mb: MicroBatch, *, cp_size: int) -> tuple[int, int]:
    """``(seq_length, micro_batch_size)`` as megatron's schedules want them for ``mb``: the
    global (pre-CP, pre-SP) sequence length, and the batch columns (1 for THD)."""
    if mb.is_packed:
        return int(mb.padded_offsets()[-1]), 1
    cols = int(mb.tokens.shape[0]) if mb.tokens is not None else len(mb.sample_ids)
    return mb.padded_seq_len(cp_size), cols


def check_pipeline_shapes(
    micro_batches: Sequence[MicroBatch], *, config: Any, pp: int, cp_size: int, what: str
) -> None:
    """``ValueError`` if a pipelined model (``pp > 1``) gets micro-batches of different shapes
    (packed ones of different lengths, padded ones of different sizes) while its
    ``TransformerConfig`` has ``variable_seq_lengths=False``: megatron's pipeline then sends
    every activation with the first shape and fails deep inside the model."""
    if pp <= 1 or getattr(config, "variable_seq_lengths", False):
        return
    shapes = sorted({pipeline_shape(mb, cp_size=cp_size) for mb in micro_batches})
    if len(shapes) > 1:
        kind = "packed (THD)" if any(mb.is_packed for mb in micro_batches) else "padded"
        raise ValueError(
            f"{what}: {kind} micro-batches of different (seq_length, micro_batch_size) "
            f"{shapes[:4]} at pipeline size {pp}, but the TransformerConfig has "
            "variable_seq_lengths=False: set variable_seq_lengths=True (megatron then exchanges "
            "activation shapes between stages), or give every micro-batch one shape"
        )


def check_interleaved_micro_batches(
    num_micro_batches: int, *, model: Any, pp: int, what: str
) -> None:
    """``ValueError`` if megatron's interleaved (virtual pipeline) schedule would refuse
    ``num_micro_batches`` for ``model``, a list of more than one chunk at pipeline size ``pp > 1``.

    The schedule runs the micro-batches in groups of ``N = microbatch_group_size_per_vp_stage``
    (the config's; megatron defaults it to ``pp``) and refuses, once the step has started, unless
    ``pp <= N <= M`` and the last group is whole or at least ``pp`` long (``M % N == 0`` or
    ``M % N >= pp``). Nothing to check for one chunk or ``pp == 1`` (no interleaving).
    """
    chunks = len(model) if isinstance(model, list | tuple) else 1
    if chunks < 2 or pp < 2:
        return
    config = model_config(model)
    n = getattr(config, "microbatch_group_size_per_vp_stage", None) or pp
    m = num_micro_batches
    rest = m % n
    if pp <= n <= m and not 0 < rest < pp:
        return
    rule = (
        f"{what}: {m} micro-batches for {chunks} virtual-pipeline chunks at pipeline size {pp}, "
        f"which megatron's interleaved schedule refuses: it runs them in groups of N = "
        f"microbatch_group_size_per_vp_stage = {n} and needs pp <= N <= M and M % N either 0 or "
        f">= pp (here M = {m}, M % N = {rest}); "
    )
    if n < pp:  # no count helps
        raise ValueError(
            rule + f"set microbatch_group_size_per_vp_stage to at least {pp} (megatron's "
            "default is the pipeline size)"
        )
    allowed = sorted({k * n for k in range(1, 4)} | {n + r for r in range(pp, n)})[:3]
    raise ValueError(
        rule + f"use a multiple of {n} micro-batches (e.g. {', '.join(map(str, allowed))})"
    )


def model_config(model: Any) -> Any:
    """The ``TransformerConfig`` of a (wrapped) model or of its first virtual-pipeline chunk."""
    from megatron.core.utils import get_model_config

    return get_model_config(model[0] if isinstance(model, list | tuple) else model)


def run_teacher(
    model: Any,
    micro_batches: Sequence[MicroBatch],
    *,
    pg_collection: Any,
    on_hidden: Callable[[int, torch.Tensor], None],
    forward: Forward | None = None,
    skip_lm_head: bool = True,
    buffer: ReusableBuffer | None = None,
    sp_shards: bool = False,
) -> None:
    """Run the teacher over ``micro_batches`` with megatron's forward-only schedule.

    Collective over the teacher's model-parallel groups (every rank of the teacher mesh calls
    it, with its own micro-batches, the same count on every rank). On the last stage,
    ``on_hidden(i, hidden)`` receives micro-batch ``i``'s captured ``[S_local, B, H]`` (padded)
    or ``[T_local, 1, H]`` (THD) hidden states, SP undone, contiguous, valid until the next
    micro-batch (under SP they live in ``buffer``, which the next micro-batch overwrites). With
    ``sp_shards`` it receives this TP rank's sequence-parallel shard instead, ``[S_local/tp, B,
    H]`` or ``[T_local/tp, 1, H]``, as the output layer got it (no all-gather, ``buffer`` unused).

    Args:
        model: the (wrapped) teacher model, or its list of virtual-pipeline chunks.
        pg_collection: the teacher's megatron ``ProcessGroupCollection``.
        forward: ``forward(model, micro_batch)`` (default: :func:`default_forward`).
        skip_lm_head: skip the teacher's ``output_layer`` (its logits are not used).
        buffer: the recycled buffer the SP gather writes into; pass the same one every step
            (default: one for this call, so one allocation per call at a steady shape).
        sp_shards: hand each TP rank's own SP shard (the teacher must run with sequence
            parallelism when ``tp > 1``).
    Raises:
        ValueError: micro-batches of different shapes without ``config.variable_seq_lengths``
            (megatron's pipeline then needs it to exchange activation shapes); ``sp_shards``
            while the output layer ran without sequence parallelism at ``tp > 1``.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    if not micro_batches:
        return
    forward = forward or default_forward
    chunks = list(model) if isinstance(model, list | tuple) else [model]
    config = model_config(model)
    pp = pg_collection.pp.size()
    tp = pg_collection.tp.size()
    check_pipeline_shapes(
        micro_batches, config=config, pp=pp, cp_size=pg_collection.cp.size(), what="teacher"
    )
    capture = OutputLayerInputCapture(
        chunks if len(chunks) > 1 else chunks[0],
        buffer=buffer if buffer is not None else ReusableBuffer(),
    )
    state = {"next": 0}

    def forward_step(data_iterator: Iterator[MicroBatch], model_chunk: Any) -> Any:
        mb = next(data_iterator)
        ctx = capture.capture_context() if capture.is_available else contextlib.nullcontext()
        with ctx, ranges.span("forward", "teacher"):
            out = forward(model_chunk, mb)

        def loss_func(output: torch.Tensor, non_loss_data: bool = False) -> Any:
            i = state["next"]
            state["next"] += 1
            if sp_shards:
                hidden = capture.get_local_hidden_states()
                if hidden is not None and not capture.sequence_sharded and tp > 1:
                    raise ValueError(
                        f"the teacher's output layer ran without sequence parallelism at tp={tp}, "
                        "but its rows were planned as SP shards (sp_shards=True): every TP rank "
                        "holds the whole sequence; run it with sequence_parallel=True or plan "
                        "it as replicas"
                    )
            else:
                hidden = capture.get_hidden_states()
            if hidden is not None:
                with ranges.span("capture", i):
                    on_hidden(i, hidden.contiguous())
            return torch.zeros((), device=output.device), {}

        return out, loss_func

    seq, batch = pipeline_shape(micro_batches[0], cp_size=pg_collection.cp.size())
    fb = get_forward_backward_func(pp_size=pp, vp_size=None if len(chunks) == 1 else len(chunks))
    kwargs: dict[str, Any] = {"pg_collection": pg_collection}
    if pp > 1:
        kwargs["p2p_communicator"] = P2PCommunicator(pp_group=pg_collection.pp, config=config)
    skip = _skip_output_layer(capture.output_layer) if skip_lm_head else contextlib.nullcontext()
    with ranges.span("teacher"), torch.no_grad(), skip:
        fb(
            forward_step_func=forward_step,
            data_iterator=(
                iter(micro_batches) if len(chunks) == 1 else [iter(micro_batches) for _ in chunks]
            ),
            model=chunks,
            num_microbatches=len(micro_batches),
            seq_length=seq,
            micro_batch_size=batch,
            forward_only=True,
            **kwargs,
        )
    if capture.is_available and state["next"] != len(micro_batches):
        raise AssertionError(
            f"the teacher's last stage saw {state['next']} of {len(micro_batches)} micro-batches"
        )
