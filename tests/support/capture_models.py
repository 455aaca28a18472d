"""Duck-typed stand-ins for Megatron models, for the capture's single-process tests.

Why this file exists: the capture only sees a model's ``output_layer`` and the way it is wrapped.
Tier 1 needs small modules with those shapes (a GPT-like model, wrappers, a VLM, MTP, tied
weights, a head called with a keyword input), shared by the capture's test modules.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["VLM", "H", "Head", "KeywordHead", "TinyLM", "V", "Wrapper", "hooks_on", "x_SBH"]

H, V = 8, 11


class Head(torch.nn.Module):
    """Stands in for ColumnParallelLinear: called as ``head(x, weight=...)``."""

    def __init__(self, mtp_num_layers: int | None = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(V, H))
        self.config = type("Cfg", (), {"mtp_num_layers": mtp_num_layers})()

    def forward(
        self, x: torch.Tensor, weight: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, None]:
        w = self.weight if weight is None else weight
        return x @ w.t(), None


class KeywordHead(Head):
    """A head whose input is named ``input_`` (ColumnParallelLinear's name), for keyword calls."""

    def forward(  # type: ignore[override]
        self, input_: torch.Tensor, weight: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, None]:
        return super().forward(input_, weight)


class TinyLM(torch.nn.Module):
    """Stands in for GPTModel: a layer norm, then the head; MTP depths run the head first.

    ``forward(x_SBH)`` returns the logits ``[S, B, V]``; the head's input is ``norm(x_SBH)``.
    """

    def __init__(
        self, *, post_process: bool = True, mtp: int = 0, tied: bool = False, keyword: bool = False
    ) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(H)
        self.mtp = mtp
        self.tied = tied
        self.keyword = keyword
        self.embedding = torch.nn.Parameter(torch.randn(V, H))
        if post_process:
            self.output_layer = (KeywordHead if keyword else Head)(mtp_num_layers=mtp or None)

    def forward(
        self, x_SBH: torch.Tensor, fail_before_head: bool = False, fail_after_head: bool = False
    ) -> torch.Tensor:
        h = self.norm(x_SBH)
        if fail_before_head:
            raise RuntimeError("boom before the head")
        weight = self.embedding if self.tied else None
        for d in range(self.mtp):  # MTP depths come first, on other inputs
            self.output_layer(h * (d + 2.0), weight=weight)
        if self.keyword:
            logits = self.output_layer(input_=h, weight=weight)[0]
        else:
            logits = self.output_layer(h, weight=weight)[0]
        if fail_after_head:
            raise RuntimeError("boom after the head")
        return logits


class Wrapper(torch.nn.Module):
    """DDP / Float16Module / FSDP shape: the real model under ``.module``."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *a: Any, **k: Any) -> Any:
        return self.module(*a, **k)


class VLM(torch.nn.Module):
    """A vision-language model's shape: the GPT under ``language_model``."""

    def __init__(self) -> None:
        super().__init__()
        self.language_model = TinyLM()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.language_model(x)


def x_SBH(s: int = 5, b: int = 3, *, seed: int | None = None) -> torch.Tensor:
    """A ``[s, b, H]`` input that requires grad (a training-mode forward)."""
    g = None if seed is None else torch.Generator().manual_seed(seed)
    return torch.randn(s, b, H, generator=g).requires_grad_(True)


def hooks_on(layer: torch.nn.Module) -> int:
    """How many forward pre-hooks ``layer`` holds."""
    return len(layer._forward_pre_hooks)
