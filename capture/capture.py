"""Capturing the teacher's pre-LM-head hidden states with a forward pre-hook.

Why this file exists: MOPD ships the teacher's hidden states (``H`` floats per token) instead of
its logits (``V`` floats per token). The tensor to ship is exactly what Megatron feeds its
``output_layer``: the post-``final_layernorm`` hidden states ``[S_local, B, H]``, sequence-first.
This module is a drop-in for NeMo-RL's ``nemo_rl.models.megatron.opd_full_capture`` (same names;
by default the same answer in every case a NeMo-RL caller meets) plus what real Megatron setups
add to it: virtual-pipeline chunk lists, any ``.module`` wrapper chain, the head called with a
keyword input, the gather over the output layer's own TP group, a zero-allocation path into a
buffer the caller owns (``out=`` or ``buffer=``), and the local shard as it is, with no gather
(:meth:`OutputLayerInputCapture.get_local_hidden_states`: the bridge path, where each TP rank
sends from its own sequence-parallel shard).

Typical use on the teacher::

    ctx, capture = get_opd_full_capture_context(teacher, enabled=True)
    with torch.no_grad(), ctx:
        teacher(input_ids, position_ids, attention_mask)
    hidden_SBH = capture.get_hidden_states() if capture is not None else None

What is kept when the output layer runs more than once inside one context: the input of the last
call, as in NeMo-RL. Under MTP (``mtp_num_layers = k``) Megatron runs the output layer ``k`` times
for the MTP depths and then once for the main head, so the main head's input is what
:meth:`OutputLayerInputCapture.get_hidden_states` returns; two forward passes in one context keep
the second one's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from mopd.capture.gather import ReusableBuffer, gather_sequence_parallel
from mopd.capture.unwrap import find_output_layer, unwrap_model

__all__ = ["CaptureMisuseError", "OutputLayerInputCapture", "get_opd_full_capture_context"]


class CaptureMisuseError(RuntimeError):
    """A capture used against its lifecycle (its context re-entered while active)."""


def _default_tp_group(layer: torch.nn.Module) -> dist.ProcessGroup | None:
    group = getattr(layer, "tp_group", None)
    if group is not None:
        return group
    try:  # NeMo-RL's fallback: megatron's global TP group, when megatron is initialized
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return parallel_state.get_tensor_model_parallel_group()
    except ImportError:
        pass
    return None


def _unwrapped(model: Any) -> Any:
    """NeMo-RL's ``capture.model``: the model without its wrappers (a list stays a list)."""
    if model is None or isinstance(model, torch.nn.Module):
        return None if model is None else unwrap_model(model)
    return [unwrap_model(chunk) if isinstance(chunk, torch.nn.Module) else chunk for chunk in model]


class OutputLayerInputCapture:
    """Captures the tensor fed into a Megatron model's ``output_layer`` during one forward pass.

    Args:
        model: a GPTModel (or anything with an ``output_layer``), possibly wrapped in DDP /
            Float16Module / FSDP (``.module`` chains), a VLM with ``language_model.output_layer``,
            or a list of virtual-pipeline chunks (the chunk owning the output layer is used).
            ``None`` is a rank without a model: the capture is unavailable.
        tp_group: the output layer's tensor-parallel group, used to undo sequence parallelism.
            Default: the layer's own ``tp_group``, else megatron's global TP group.
        sequence_parallel: whether the layer's input is sequence-sharded. Default: the layer's
            ``sequence_parallel`` attribute, read when the layer runs.
        out: an ``[S, B, H]`` tensor the hidden states are written into, every capture, SP or
            not (the zero-allocation path; for example the bridge's send buffer).
        buffer: a :class:`~mopd.capture.ReusableBuffer` the caller owns and recycles: under SP
            the gather writes into it (allocated once per shape); without SP nothing is copied.

    Lifetime of what :meth:`get_hidden_states` returns. By default (neither ``out`` nor
    ``buffer``) it is NeMo-RL's answer: under SP a tensor allocated for this capture, which no
    later capture touches; without SP the layer's input itself, detached, no copy. With ``out``
    it is ``out``, and with ``buffer`` (under SP) the buffer's storage: valid until the next
    :meth:`get_hidden_states` of any capture writing into the same ``out`` or ``buffer``, which
    overwrites it. It is written on the current CUDA stream of the call, which first waits for
    the stream the forward ran on. It never holds the autograd graph.
    """

    def __init__(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module] | None,
        *,
        tp_group: dist.ProcessGroup | None = None,
        sequence_parallel: bool | None = None,
        out: torch.Tensor | None = None,
        buffer: ReusableBuffer | None = None,
    ) -> None:
        if out is not None and buffer is not None:
            raise ValueError("pass out= or buffer= (where the hidden states go), not both")
        self._output_layer = None if model is None else find_output_layer(model)
        #: NeMo-RL's attribute: the model with its wrappers removed (a list of chunks for a list).
        self.model = _unwrapped(model)
        layer = self._output_layer
        self._tp_group = (
            tp_group if tp_group is not None or layer is None else _default_tp_group(layer)
        )
        layer_sp = bool(getattr(layer, "sequence_parallel", False)) if layer is not None else False
        self._sp_override = None if sequence_parallel is None else bool(sequence_parallel)
        self._sequence_parallel = layer_sp if sequence_parallel is None else bool(sequence_parallel)
        if self._sequence_parallel and layer is not None and self._tp_group is None:
            raise ValueError(
                "sequence_parallel=True but no tensor-parallel group is known for the output layer "
                "(it has no tp_group and megatron's parallel_state is not initialized): pass tp_group="
            )
        self._out = out
        self._buffer = buffer
        self._allocations = 0
        self._handle: torch.utils.hooks.RemovableHandle | None = None
        self._pending: Any = None
        self._pending_sp = self._sequence_parallel
        self._pending_stream: torch.cuda.Stream | None = None
        self._result: torch.Tensor | None = None
        self._local: torch.Tensor | None = None
        self._local_sharded = False

    # ---- NeMo-RL's API ---------------------------------------------------------------------

    @property
    def is_available(self) -> bool:
        """Whether this rank owns an output layer (the last pipeline stage)."""
        return self._output_layer is not None

    def _pre_hook(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        """Forward pre-hook: keep the output layer's first positional argument (the hidden states
        ``[S_local, B, H]``), detached; a call without positional arguments is ignored."""
        if not args:
            return
        x = args[0]
        is_tensor = isinstance(x, torch.Tensor)
        self._pending = x.detach() if is_tensor else x
        self._result = self._local = None
        # Megatron may switch the layer's SP flag per forward (e.g. dynamic-batching inference):
        # read it at the call unless the caller fixed it; remember the producing stream.
        self._pending_sp = (
            self._sp_override
            if self._sp_override is not None
            else bool(getattr(module, "sequence_parallel", self._sequence_parallel))
        )
        self._pending_stream = (
            torch.cuda.current_stream(x.device) if is_tensor and x.is_cuda else None
        )

    def _pre_hook_with_kwargs(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        # Megatron passes the tied embedding weight as ``weight=`` (a keyword); the hidden states
        # are positional, but accept ``input_=`` too so a keyword call is not missed.
        if not args and isinstance(kwargs.get("input_"), torch.Tensor):
            args = (kwargs["input_"],)
        self._pre_hook(module, args)

    @contextlib.contextmanager
    def capture_context(self) -> Iterator[None]:
        """Register the pre-hook for one forward pass; removed on exit, also when it raises.

        Entering clears what an earlier context captured. A forward that raised after the
        output layer ran keeps its capture. Several captures may be active on one layer.

        Raises:
            CaptureMisuseError: this capture's context is entered again while it is active.
        """
        layer = self._output_layer
        if layer is not None and self._handle is not None:
            raise CaptureMisuseError(
                "this capture's context is already active: one capture_context at a time per "
                "capture (make a second OutputLayerInputCapture to capture twice at once)"
            )
        self._pending, self._result, self._local = None, None, None
        if layer is None:
            yield
            return
        self._handle = layer.register_forward_pre_hook(self._pre_hook_with_kwargs, with_kwargs=True)
        try:
            yield
        finally:
            self._handle.remove()
            self._handle = None

    def get_hidden_states(self) -> torch.Tensor | None:
        """The captured hidden states ``[S, B, H]`` with sequence parallelism undone, detached.

        Returns ``None`` when this rank has no output layer or the forward never reached it.
        Under SP the first call is a collective over the TP group (call it on every TP rank);
        a second call returns the same tensor without communicating.

        Raises:
            ValueError: the captured input is not a rank-3 tensor, or ``out`` does not fit.
        """
        if self._result is not None:
            return self._result
        local_SBH = self._take_local()
        if local_SBH is None:
            return None
        sp = self._local_sharded
        if sp or self._out is not None:
            world = dist.get_world_size(self._tp_group) if sp else 1
            shape = (local_SBH.shape[0] * world, *local_SBH.shape[1:])
            target_SBH = self._target(shape, local_SBH.dtype, local_SBH.device)
            result = gather_sequence_parallel(local_SBH, self._tp_group if sp else None, target_SBH)
        else:
            result = local_SBH
        self._result = result
        return result

    def _take_local(self) -> torch.Tensor | None:
        """The captured input, checked, with the current stream after the forward's (once per
        capture); records whether it is a sequence-parallel shard."""
        if self._local is not None:
            return self._local
        local_SBH = self._pending
        if local_SBH is None:
            return None
        if not isinstance(local_SBH, torch.Tensor):
            raise ValueError(
                f"output_layer's first positional argument is a {type(local_SBH).__name__}; "
                "expected the hidden states tensor [S, B, H]"
            )
        if local_SBH.dim() != 3:
            raise ValueError(
                f"captured output_layer input has shape {tuple(local_SBH.shape)}; expected rank 3 "
                "[S, B, H] (sequence-first)"
            )
        world = 1 if self._tp_group is None else dist.get_world_size(self._tp_group)
        if self._pending_sp and self._tp_group is None:
            raise ValueError(
                "the output layer ran sequence-parallel but no tensor-parallel group is known: "
                "pass tp_group= to OutputLayerInputCapture"
            )
        producer = self._pending_stream
        if producer is not None:  # the forward may have run on another stream than this call's
            current = torch.cuda.current_stream(local_SBH.device)
            if producer != current:
                current.wait_stream(producer)
                local_SBH.record_stream(current)
        self._pending = None
        self._local = local_SBH
        self._local_sharded = self._pending_sp and world > 1
        return local_SBH

    # ---- beyond NeMo-RL --------------------------------------------------------------------

    def get_local_hidden_states(self) -> torch.Tensor | None:
        """The captured hidden states as this rank holds them, detached, no copy and no
        communication: under sequence parallelism this rank's shard ``[S/tp, B, H]`` (rows
        ``[tp_rank * S/tp, (tp_rank + 1) * S/tp)`` of the full tensor, Megatron's split),
        otherwise the full ``[S, B, H]``. :attr:`sequence_sharded` says which.

        The bridge's sources-from-shards path uses it (each TP rank sends its own rows); it
        does not write into ``out`` or ``buffer``. Valid until the next forward overwrites the
        layer's input. ``None`` as for :meth:`get_hidden_states`.

        Raises:
            ValueError: as :meth:`get_hidden_states`.
        """
        return self._take_local()

    @property
    def sequence_sharded(self) -> bool:
        """Whether the last captured hidden states are a sequence-parallel shard (the layer ran
        with SP over a TP group of more than one rank); read after a ``get_*`` call."""
        return self._local_sharded

    def _target(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Where the hidden states go: ``out``, the caller's buffer, or a fresh tensor."""
        if self._out is not None:
            return self._out
        if self._buffer is not None:
            before = self._buffer.allocations
            target = self._buffer.get(shape, dtype, device)
            self._allocations += self._buffer.allocations - before
            return target
        self._allocations += 1
        return torch.empty(shape, dtype=dtype, device=device)

    @property
    def output_layer(self) -> torch.nn.Module | None:
        """The output layer the hook goes on (``None`` off the last pipeline stage)."""
        return self._output_layer

    @property
    def sequence_parallel(self) -> bool:
        return self._sequence_parallel

    @property
    def allocations(self) -> int:
        """How many result tensors this capture allocated: one per SP capture by default, none
        with ``out``, the buffer's (re)allocations with ``buffer``."""
        return self._allocations

    def set_output_buffer(self, out: torch.Tensor | None) -> None:
        """Hand in (or drop, with ``None``) the ``out`` tensor the next capture writes into."""
        if self._handle is not None:
            raise CaptureMisuseError("cannot change the output buffer while a capture is active")
        if out is not None and self._buffer is not None:
            raise ValueError("this capture writes into its buffer=; out= cannot be set as well")
        self._out = out


def get_opd_full_capture_context(
    model: torch.nn.Module | Sequence[torch.nn.Module] | None, enabled: bool, **capture_kwargs: Any
) -> tuple[contextlib.AbstractContextManager[Any], OutputLayerInputCapture | None]:
    """``(context manager, capture)``; ``(nullcontext(), None)`` when disabled or unavailable.

    ``capture_kwargs`` go to :class:`OutputLayerInputCapture` (``tp_group``, ``sequence_parallel``,
    ``out``, ``buffer``).
    """
    if not enabled:
        return contextlib.nullcontext(), None
    capture = OutputLayerInputCapture(model, **capture_kwargs)
    if not capture.is_available:
        return contextlib.nullcontext(), None
    return capture.capture_context(), capture
