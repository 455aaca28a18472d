"""Finding the module that owns the LM head (``output_layer``) inside a wrapped Megatron model.

Why this file exists: a training loop rarely holds a bare GPTModel. It holds DDP or FSDP
wrappers, a Float16Module, a VLM whose language model is an attribute, or a list of virtual
pipeline chunks. The capture needs the one ``output_layer`` that this rank runs, and it must not
silently give up on any of these shapes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["MAX_WRAPPER_DEPTH", "find_output_layer", "unwrap_model"]

#: Deeper ``.module`` chains than this are treated as a cycle (a bug in the caller's model).
MAX_WRAPPER_DEPTH = 16


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """Follow the ``.module`` chain (DDP, Float16Module, FSDP, torch DDP) to the inner model.

    Unlike ``megatron.core.utils.unwrap_model`` (known wrapper classes only, a list mapped
    element-wise), any wrapper with a ``.module`` is followed, and the walk stops at the first
    module that owns an ``output_layer``; one module in, one out.
    """
    depth = 0
    while not hasattr(model, "output_layer") and isinstance(
        getattr(model, "module", None), torch.nn.Module
    ):
        inner = model.module
        assert isinstance(inner, torch.nn.Module)  # the loop's condition
        model = inner
        depth += 1
        if depth > MAX_WRAPPER_DEPTH:
            raise ValueError(
                f"more than {MAX_WRAPPER_DEPTH} nested .module wrappers: is there a cycle?"
            )
    return model


def _output_layer_of(model: torch.nn.Module) -> torch.nn.Module | None:
    inner = unwrap_model(model)
    layer = getattr(inner, "output_layer", None)
    if layer is None:
        # VLMs (e.g. LLaVA-style) keep the GPT under ``language_model``.
        lm = getattr(inner, "language_model", None)
        if isinstance(lm, torch.nn.Module):
            layer = getattr(unwrap_model(lm), "output_layer", None)
    return layer if isinstance(layer, torch.nn.Module) else None


def find_output_layer(model: torch.nn.Module | Sequence[torch.nn.Module]) -> torch.nn.Module | None:
    """The ``output_layer`` this rank runs, or ``None`` when it holds no LM head.

    Args:
        model: a module (possibly wrapped) or a list of virtual-pipeline chunks. For a list, the
            chunk that owns an output layer is used (only the last chunk of the last stage has
            one); two chunks with output layers is an error.
    """
    if isinstance(model, torch.nn.Module) and not isinstance(model, torch.nn.ModuleList):
        return _output_layer_of(model)
    if isinstance(model, (Sequence, torch.nn.ModuleList)) and not isinstance(model, (str, bytes)):
        found = [
            (i, layer)
            for i, chunk in enumerate(model)
            if (layer := _output_layer_of(chunk)) is not None
        ]
        if len(found) > 1:
            raise ValueError(
                f"model chunks {[i for i, _ in found]} each own an output_layer; expected at most one"
            )
        return found[0][1] if found else None
    raise ValueError(
        f"model must be a torch.nn.Module or a list of them, got {type(model).__name__}"
    )
