"""A float64 reference for the vocab-parallel KL that materializes everything (a test oracle).

Why this file exists: the chunked, vocab-parallel loss in :mod:`mopd.kernels.kl` is checked
(tier 1, 2 and 3 tests) against one obviously-correct formula over the full, unsharded
vocabulary. Nothing here is fast or memory-frugal, on purpose, and nothing in the library
imports it (the numerics benchmark has its own float64 reference in
:mod:`mopd.profiling.bench.kl_numerics`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "case_kl_kwargs",
    "case_reference",
    "distillation_case",
    "reference_kl",
    "relative_error",
]


def reference_kl(
    student_logits_TV: torch.Tensor,
    teacher_hidden: Sequence[torch.Tensor],
    teacher_weight: Sequence[torch.Tensor],
    *,
    vocab_size: int,
    kind: str = "reverse",
    mix_weight: float = 0.5,
    loss_mask_T: torch.Tensor | None = None,
    teacher_index_T: torch.Tensor | None = None,
    reduction: str = "sum",
) -> torch.Tensor:
    """The KL in float64 over the full vocabulary, differentiable through ``student_logits_TV``.

    Args:
        student_logits_TV: ``[T, V_pad]`` full (unsharded) student logits, any float dtype; the
            result is differentiable with respect to it (the math runs in float64).
        teacher_hidden: one tensor per teacher, ``[T, H_k]`` (row t is token t) or ``[T_k, H_k]``
            (the rows of the tokens with ``teacher_index == k``, in token order; or of only the
            counted ones among them, ``loss_mask_T != 0``).
        teacher_weight: one ``[V_pad, H_k]`` full LM-head weight per teacher.
        vocab_size: the real vocabulary; columns ``>= vocab_size`` are padding and ignored.
        kind: ``"reverse"`` (KL(p_S || p_T)), ``"forward"`` (KL(p_T || p_S)) or ``"mixed"``
            (``mix_weight * reverse + (1 - mix_weight) * forward``).
        loss_mask_T: ``[T]`` bool or float weights (``None``: all ones).
        teacher_index_T: ``[T]`` int64 teacher of each token (``None``: teacher 0 for all).
        reduction: ``"sum"``, ``"mean"`` (over the mask's total weight) or ``"none"``.
    Returns:
        float64 scalar, or ``[T]`` float64 per-token ``mask * KL`` for ``"none"``.
    """
    T = student_logits_TV.shape[0]
    dev = student_logits_TV.device
    s_TV = student_logits_TV.double()[:, :vocab_size]
    index_T = (
        torch.zeros(T, dtype=torch.int64, device=dev)
        if teacher_index_T is None
        else teacher_index_T
    )
    u_TV = torch.zeros_like(s_TV)  # a token no teacher row reaches (not counted): zero logits
    counted_T = (
        torch.ones(T, dtype=torch.bool, device=dev) if loss_mask_T is None else loss_mask_T != 0
    )
    for k, (h_XH, w_VH) in enumerate(zip(teacher_hidden, teacher_weight, strict=True)):
        rows_N = torch.nonzero(index_T == k).flatten()
        if h_XH.shape[0] == T:
            h_NH = h_XH.double()[rows_N]
        elif h_XH.shape[0] != rows_N.numel():  # compact over the counted tokens only
            rows_N = torch.nonzero((index_T == k) & counted_T).flatten()
            h_NH = h_XH.double()
        else:
            h_NH = h_XH.double()
        u_TV[rows_N] = h_NH @ w_VH.double()[:vocab_size].T
    log_ps_TV = torch.log_softmax(s_TV, dim=1)
    log_pt_TV = torch.log_softmax(u_TV, dim=1)
    reverse_T = (log_ps_TV.exp() * (log_ps_TV - log_pt_TV)).sum(1)
    forward_T = (log_pt_TV.exp() * (log_pt_TV - log_ps_TV)).sum(1)
    if kind == "reverse":
        kl_T = reverse_T
    elif kind == "forward":
        kl_T = forward_T
    elif kind == "mixed":
        kl_T = mix_weight * reverse_T + (1.0 - mix_weight) * forward_T
    else:
        raise ValueError(f"kind must be 'reverse', 'forward' or 'mixed', got {kind!r}")
    mask_T = (
        torch.ones(T, dtype=torch.float64, device=dev)
        if loss_mask_T is None
        else loss_mask_T.double()
    )
    per_token_T = mask_T * kl_T
    if reduction == "none":
        return per_token_T
    if reduction == "sum":
        return per_token_T.sum()
    if reduction == "mean":
        total = mask_T.sum()
        return per_token_T.sum() / total.clamp_min(torch.finfo(torch.float64).tiny)
    raise ValueError(f"reduction must be 'sum', 'mean' or 'none', got {reduction!r}")


def distillation_case(
    *, std: float, n_teachers: int, T: int, H: int, V: int, noise: float = 0.25, seed: int = 0
) -> dict[str, Any]:
    """bf16 inputs in the distillation regime, the same on every rank that asks.

    Teachers' hidden states ``~N(0, 1)`` and LM heads scaled for teacher logits of standard
    deviation ``std``; the logits path's student logits (``"logits"``, ``[T, V]``) are teacher
    0's exact logits plus ``N(0, noise^2)``; the fused student (``"h_s"``, ``"w_s"``) has teacher
    0's hidden states plus noise and an LM head within 1% of teacher 0's. With two teachers:
    a ``[T]`` teacher index, teacher 1's hidden rows in the compact layout, and a mask.

    Returns:
        ``hidden``, ``weight`` (lists), ``index_T``, ``mask_T`` (``None`` with one teacher),
        ``logits``, ``h_s``, ``w_s``, ``vocab_size``.
    """
    g = torch.Generator().manual_seed(seed + int(std * 10) + n_teachers)
    hs = (H, H + 32)[:n_teachers]
    index_T = torch.randint(0, n_teachers, (T,), generator=g) if n_teachers > 1 else None
    hidden = [torch.randn(T, h, generator=g).bfloat16() for h in hs]
    weight = [(torch.randn(V, h, generator=g) * (std / h**0.5)).bfloat16() for h in hs]
    u64 = torch.empty(T, V, dtype=torch.float64)
    for k, (h, w) in enumerate(zip(hidden, weight, strict=True)):
        rows = torch.arange(T) if index_T is None else torch.nonzero(index_T == k)[:, 0]
        u64[rows] = h[rows].double() @ w.double().T
    logits = (u64 + noise * torch.randn(T, V, generator=g, dtype=torch.float64)).bfloat16()
    h_s = (hidden[0].float() + (noise / std) * torch.randn(T, H, generator=g)).bfloat16()
    w_s = (weight[0].float() * (1 + 0.01 * torch.randn(V, H, generator=g))).bfloat16()
    mask_T = None if n_teachers == 1 else torch.rand(T, generator=g) > 0.2
    if index_T is not None:
        hidden[1] = hidden[1][index_T == 1]  # compact rows: only teacher 1's tokens
    return dict(
        hidden=hidden, weight=weight, index_T=index_T, mask_T=mask_T, logits=logits, h_s=h_s,
        w_s=w_s, vocab_size=V,
    )  # fmt: skip


MIX_WEIGHT = 0.3  # the mixed KL's weight in every case below


def case_kl_kwargs(case: dict[str, Any], kind: str, **config: Any) -> dict[str, Any]:
    """The keyword arguments of ``vocab_parallel_kl`` / ``fused_vocab_parallel_kl`` for a
    :func:`distillation_case` on one rank holding the whole vocabulary (``config`` goes to
    :class:`~mopd.kernels.kl.KLConfig`)."""
    from mopd.kernels.kl import KLConfig

    mix_weight = MIX_WEIGHT if kind == "mixed" else None
    return dict(
        vocab_start=0, vocab_size=case["vocab_size"], loss_mask_T=case["mask_T"],
        teacher_index_T=case["index_T"], config=KLConfig(kind=kind, mix_weight=mix_weight, **config),
    )  # fmt: skip


def case_reference(case: dict[str, Any], kind: str, student_TV: torch.Tensor) -> torch.Tensor:
    """:func:`reference_kl` of a :func:`distillation_case` against student logits ``[T, V]``."""
    return reference_kl(
        student_TV, case["hidden"], case["weight"], vocab_size=case["vocab_size"], kind=kind,
        mix_weight=MIX_WEIGHT, loss_mask_T=case["mask_T"], teacher_index_T=case["index_T"],
    )  # fmt: skip


def kl_vs_float64(
    case: dict[str, Any], kind: str, *, fused: bool, group: Any = None, **config: Any
) -> tuple[float, float, list[torch.Tensor], list[torch.Tensor]]:
    """The library's KL on a :func:`distillation_case` beside the float64 reference, with grads.

    ``fused=False`` runs ``vocab_parallel_kl`` on the case's student logits ``[T, V]``;
    ``fused=True`` runs ``fused_vocab_parallel_kl`` on its student hidden ``[T, H]`` and LM head
    ``[V, H]``. ``group`` and ``config`` (:class:`~mopd.kernels.kl.KLConfig` fields) go to the
    call under test.

    Returns:
        ``(loss, reference_loss, grads, reference_grads)``: the gradients of the student logits
        (one tensor), or of the student hidden and LM head (two), in the case's dtype and in
        float64.
    """
    from mopd.kernels.kl import fused_vocab_parallel_kl, vocab_parallel_kl

    kwargs = case_kl_kwargs(case, kind, **config)
    if group is not None:
        kwargs["group"] = group
    inputs = (case["h_s"], case["w_s"]) if fused else (case["logits"],)
    leaves = [x.clone().requires_grad_(True) for x in inputs]
    leaves64 = [x.double().requires_grad_(True) for x in inputs]
    if fused:
        out = fused_vocab_parallel_kl(*leaves, case["hidden"], case["weight"], **kwargs)
        ref = case_reference(case, kind, leaves64[0] @ leaves64[1].T)
    else:
        out = vocab_parallel_kl(*leaves, case["hidden"], case["weight"], **kwargs)
        ref = case_reference(case, kind, leaves64[0])
    grads = list(torch.autograd.grad(out, leaves))
    grads64 = list(torch.autograd.grad(ref, leaves64))
    return float(out.detach()), float(ref.detach()), grads, grads64


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` (Frobenius, float64)."""
    want = want.double()
    return float((got.double() - want).norm() / want.norm())
