"""Capturing the teacher's pre-LM-head hidden states with a forward pre-hook.

Why this file exists: MOPD ships the teacher's hidden states (``H`` floats per token) instead of
its logits (``V`` floats per token). The tensor to ship is exactly what Megatron feeds its
``output_layer``: the post-``final_layernorm`` hidden states ``[S_local, B, H]``, sequence-first.
This module provides NeMo-RL's ``opd_full_capture`` API (same names, same semantics) and what
real Megatron setups add to it: wrapped models and virtual-pipeline chunk lists, sequence
parallelism undone into a reused buffer (or one the caller hands in), MTP, tied embeddings and
clear errors on misuse.

Typical use on the teacher::

    ctx, capture = get_opd_full_capture_context(teacher, enabled=True)
    with torch.no_grad(), ctx:
        teacher(input_ids, position_ids, attention_mask)
    hidden_SBH = capture.get_hidden_states() if capture is not None else None

How the main call is identified under MTP: with ``mtp_num_layers = k`` Megatron runs the output
layer ``k`` times for the MTP depths and then once for the main head, in that order, inside one
forward pass. The hook keeps a (detached, zero-copy) reference to the input of the most recent
call only, so the main head's input, the last one, is what ``get_hidden_states`` returns. More
than ``k + 1`` calls inside one context means the context spanned several forward passes, which
is an error.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from mopd.capture.gather import ReusableBuffer, gather_sequence_parallel
from mopd.capture.unwrap import find_output_layer

__all__ = ["CaptureMisuseError", "OutputLayerInputCapture", "get_opd_full_capture_context"]

# output_layer -> the capture whose hook is registered on it right now. Only for the
# two-captures-on-one-layer check; weak so that a dropped model is not kept alive.
_ACTIVE_ON_LAYER: weakref.WeakKeyDictionary[torch.nn.Module, OutputLayerInputCapture] = (
    weakref.WeakKeyDictionary()
)


# output_layer -> the buffer the SP gather writes into, shared by every capture of that layer (one
# is active at a time), so that a capture made anew each step (get_opd_full_capture_context in a
# training loop) still allocates nothing after the first step at a steady shape.
_BUFFER_OF_LAYER: weakref.WeakKeyDictionary[torch.nn.Module, ReusableBuffer] = (
    weakref.WeakKeyDictionary()
)


class CaptureMisuseError(RuntimeError):
    """A capture used against its lifecycle (re-entered, doubled on one layer, spanning forwards)."""


def _default_tp_group(layer: torch.nn.Module) -> dist.ProcessGroup | None:
    group = getattr(layer, "tp_group", None)
    if group is not None:
        return group
    try:  # the seed's behaviour: megatron's global TP group, when megatron is initialized
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return parallel_state.get_tensor_model_parallel_group()
    except ImportError:
        pass
    return None


class OutputLayerInputCapture:
    """Captures the tensor fed into a Megatron model's ``output_layer`` during one forward pass.

    Args:
        model: a GPTModel (or anything with an ``output_layer``), possibly wrapped in DDP /
            Float16Module / FSDP (``.module`` chains), a VLM with ``language_model.output_layer``,
            or a list of virtual-pipeline chunks (the chunk owning the output layer is used).
        tp_group: the output layer's tensor-parallel group, used to undo sequence parallelism.
            Default: the layer's own ``tp_group``, else megatron's global TP group.
        sequence_parallel: whether the layer's input is sequence-sharded. Default: the layer's
            ``sequence_parallel`` attribute.
        out: an optional ``[S, B, H]`` buffer to write the hidden states into (for example the
            bridge's send buffer). Without it, the capture owns a buffer (under SP) that is
            allocated once per shape and reused.

    Lifetime and stream of what :meth:`get_hidden_states` returns: it is valid until the next
    :meth:`capture_context` on the same output layer (the owned buffer is shared by that layer's
    captures, so a capture made anew every step reuses it; the next step overwrites it). It is
    written on the current CUDA stream of the call to :meth:`get_hidden_states`, which first waits
    for the stream the forward ran on (the SP all-gather is ordered on that stream). Without SP
    and without ``out`` it is the layer's input itself, detached, with no copy. It never holds the
    autograd graph.
    """

    def __init__(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        *,
        tp_group: dist.ProcessGroup | None = None,
        sequence_parallel: bool | None = None,
        out: torch.Tensor | None = None,
    ) -> None:
        self._output_layer = find_output_layer(model)
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
        config = getattr(layer, "config", None)
        self._mtp_num_layers = int(getattr(config, "mtp_num_layers", None) or 0)
        self._out = out
        self._buffer = (
            ReusableBuffer()
            if layer is None
            else _BUFFER_OF_LAYER.setdefault(layer, ReusableBuffer())
        )
        self._pending_sp = self._sequence_parallel
        self._pending_stream: torch.cuda.Stream | None = None
        self._handle: torch.utils.hooks.RemovableHandle | None = None
        self._active = False
        self._pending: torch.Tensor | None = None
        self._result: torch.Tensor | None = None
        self._calls = 0

    # ---- the seed's API -------------------------------------------------------------------

    @property
    def is_available(self) -> bool:
        """Whether this rank owns an output layer (the last pipeline stage)."""
        return self._output_layer is not None

    def _pre_hook(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        """Forward pre-hook: keep a detached reference to the output layer's input."""
        if not args or not isinstance(args[0], torch.Tensor):
            raise ValueError(
                f"output_layer was called without a positional tensor input (got {len(args)} args)"
            )
        self._calls += 1
        self._pending = args[0].detach()
        self._result = None
        # Megatron may switch the layer's SP flag per forward (e.g. dynamic-batching inference):
        # read it at the call unless the caller fixed it; remember the producing stream.
        self._pending_sp = (
            self._sp_override
            if self._sp_override is not None
            else bool(getattr(module, "sequence_parallel", self._sequence_parallel))
        )
        self._pending_stream = (
            torch.cuda.current_stream(args[0].device) if args[0].is_cuda else None
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
    def capture_context(self) -> Iterator[OutputLayerInputCapture]:
        """Register the pre-hook for one forward pass; removed on exit, also when it raises."""
        if self._active:
            raise CaptureMisuseError("this capture's context is already active (entered twice)")
        layer = self._output_layer
        if layer is not None:
            other = _ACTIVE_ON_LAYER.get(layer)
            if other is not None:
                raise CaptureMisuseError(
                    "another OutputLayerInputCapture is already active on this output_layer; "
                    "use one capture per layer"
                )
        self._pending, self._result, self._calls = None, None, 0
        self._active = True
        if layer is not None:
            self._handle = layer.register_forward_pre_hook(
                self._pre_hook_with_kwargs, with_kwargs=True
            )
            _ACTIVE_ON_LAYER[layer] = self
        ok = False
        try:
            yield self
            ok = True
        finally:
            if self._handle is not None:
                self._handle.remove()
                self._handle = None
            if layer is not None and _ACTIVE_ON_LAYER.get(layer) is self:
                del _ACTIVE_ON_LAYER[layer]
            self._active = False
            if not ok:
                self._pending = None  # a failed forward leaves nothing to read

    def get_hidden_states(self) -> torch.Tensor | None:
        """The captured hidden states ``[S, B, H]`` with sequence parallelism undone.

        Returns ``None`` when this rank has no output layer or the forward never reached it.
        Under SP this is a collective over the TP group: call it on every TP rank.

        Raises:
            ValueError: the captured tensor is not rank 3, or ``out`` does not fit.
            CaptureMisuseError: the output layer ran more often than one forward pass explains.
        """
        if self._result is not None:
            return self._result
        local_SBH = self._pending
        if local_SBH is None:
            return None
        if local_SBH.dim() != 3:
            raise ValueError(
                f"captured output_layer input has shape {tuple(local_SBH.shape)}; expected rank 3 "
                "[S, B, H] (sequence-first)"
            )
        expected_calls = 1 + self._mtp_num_layers
        if self._calls > expected_calls:
            raise CaptureMisuseError(
                f"output_layer ran {self._calls} times inside one capture_context; one forward pass "
                f"runs it {expected_calls} time(s) (mtp_num_layers={self._mtp_num_layers}). "
                "Use one capture_context per forward pass."
            )
        world = 1 if self._tp_group is None else dist.get_world_size(self._tp_group)
        if self._pending_sp and self._tp_group is None:
            raise ValueError(
                "the output layer ran sequence-parallel but no tensor-parallel group is known: "
                "pass tp_group= to OutputLayerInputCapture"
            )
        sp = self._pending_sp and world > 1
        producer = self._pending_stream
        if producer is not None:  # the forward may have run on another stream than this call's
            current = torch.cuda.current_stream(local_SBH.device)
            if producer != current:
                current.wait_stream(producer)
                local_SBH.record_stream(current)
        if sp or self._out is not None:
            shape = (local_SBH.shape[0] * (world if sp else 1), *local_SBH.shape[1:])
            out = (
                self._out
                if self._out is not None
                else self._buffer.get(shape, local_SBH.dtype, local_SBH.device)
            )
            result = gather_sequence_parallel(local_SBH, self._tp_group if sp else None, out)
        else:
            result = local_SBH
        self._pending = None
        self._result = result
        return result

    # ---- beyond the seed -------------------------------------------------------------------

    @property
    def output_layer(self) -> torch.nn.Module | None:
        """The output layer the hook goes on (``None`` off the last pipeline stage)."""
        return self._output_layer

    @property
    def sequence_parallel(self) -> bool:
        return self._sequence_parallel

    @property
    def buffer_allocations(self) -> int:
        """How many times the owned buffer was (re)allocated: 1 after the first step at a steady shape."""
        return self._buffer.allocations

    def set_output_buffer(self, out: torch.Tensor | None) -> None:
        """Hand in (or drop, with ``None``) the buffer the next capture writes into."""
        if self._active:
            raise CaptureMisuseError("cannot change the output buffer while a capture is active")
        self._out = out
        if out is not None:
            self._buffer.release()


def get_opd_full_capture_context(
    model: torch.nn.Module | Sequence[torch.nn.Module], enabled: bool, **capture_kwargs: Any
) -> tuple[contextlib.AbstractContextManager[Any], OutputLayerInputCapture | None]:
    """``(context manager, capture)``; ``(nullcontext(), None)`` when disabled or unavailable.

    ``capture_kwargs`` go to :class:`OutputLayerInputCapture` (``tp_group``, ``sequence_parallel``,
    ``out``).
    """
    if not enabled:
        return contextlib.nullcontext(), None
    capture = OutputLayerInputCapture(model, **capture_kwargs)
    if not capture.is_available:
        return contextlib.nullcontext(), None
    return capture.capture_context(), capture
