"""The two row-wise passes of the vocab-parallel KL, with backend selection.

Why this file exists: after the chunk's matmuls, the loss needs per-row softmax statistics of the
student and teacher logits (pass 1) and, once those are reduced over the TP group, the gradient
with respect to the student logits (pass 2). Each pass is one function here with two
implementations of the same signature: a CuPy kernel (``kl_kernels.cu`` via
:mod:`mopd.kernels.kl.cupy_kernels`; reads the logits once, keeps the rest in registers) and a torch twin
(CPU path and reference). Backend rule, as for the rest of :mod:`mopd.kernels`
(:mod:`mopd.kernels.backend`): ``"auto"`` uses CuPy for CUDA tensors when it is importable and
supports the dtypes, the torch twin otherwise (a fallback on CUDA is logged once); an explicit
``"cupy"`` that cannot be met raises.

Layouts: ``s_CV`` (student logits) and ``u_CV`` (teacher logits) are ``[C, V]`` with contiguous
columns (rows may have any stride, e.g. a ``[:, :V]`` view of a padded shard). Their dtypes may
differ (the loss passes bf16 student logits with fp32 teacher logits, or fp32 logits of both with
a bf16 gradient buffer); the math is fp32 either way.
"""

from __future__ import annotations

import logging

import torch

from mopd.common.log import log_once
from mopd.kernels.backend import Backend, Resolved, run_cupy_or_twin
from mopd.kernels.backend import resolve_backend as _resolve_base
from mopd.kernels.kl.cupy_kernels import (
    dtype_reason,
    row_grad_cupy,
    row_stats_partials_cupy,
    unsupported_reason,
)

__all__ = [
    "STATS_ROWS",
    "Backend",
    "combine_partials",
    "rescale_sums",
    "resolve_backend",
    "resolve_chunk_backend",
    "row_grad",
    "row_grad_torch",
    "row_stats",
    "row_stats_torch",
]


_log = logging.getLogger(__name__)

#: Row order of the statistics returned by :func:`row_stats`.
STATS_ROWS = ("max_s", "max_t", "sum_exp_s", "sum_exp_t", "sum_exp_s_diff", "sum_exp_t_diff")


def _cupy_unless(backend: Backend, reason: str | None) -> Resolved:
    """``"cupy"`` when nothing stands against it; else the twin (``"auto"``) or a ValueError."""
    if reason is None:
        return "cupy"
    if backend == "cupy":
        raise ValueError(f"mopd.kernels.kl: backend='cupy' was requested but cannot run: {reason}")
    msg = (
        f"mopd.kernels.kl: the CuPy kernels cannot take these tensors ({reason}); "
        "using the torch twin (logged once)"
    )
    log_once(_log, reason, "%s", msg)
    return "torch"


def resolve_backend(backend: Backend, *tensors: torch.Tensor) -> Resolved:
    """Which implementation runs for ``tensors`` (``(s, u)`` or ``(s, u, out)``) under ``backend``.

    :func:`mopd.kernels.backend.resolve_backend`'s rule, plus the KL kernels' own limits (the
    storage dtypes of :data:`mopd.kernels.kl.cupy_kernels.STATS_KERNELS` / ``GRAD_KERNELS``, contiguous
    columns): beyond them ``"auto"`` takes the twin (logged once) and ``"cupy"`` raises.

    Raises:
        ValueError: unknown ``backend``, or ``"cupy"`` asked for tensors it cannot take.
        RuntimeError: ``"cupy"`` asked for but CuPy is unusable.
    """
    resolved = _resolve_base(backend, "mopd.kernels.kl", *tensors)
    if resolved == "torch":
        return "torch"
    return _cupy_unless(backend, unsupported_reason(*tensors))


def resolve_chunk_backend(
    backend: Backend, probe: torch.Tensor, *dtypes: tuple[torch.dtype, ...]
) -> Resolved:
    """:func:`resolve_backend` for chunks not formed yet: ``probe`` is on their device and
    ``dtypes`` are the storage dtypes the passes will see, ``(s, u)`` and ``(s, u, out)``.

    Raises:
        ValueError, RuntimeError: as :func:`resolve_backend`.
    """
    resolved = _resolve_base(backend, "mopd.kernels.kl", probe)
    if resolved == "torch":
        return "torch"
    reason = next((r for r in (dtype_reason(*d) for d in dtypes) if r is not None), None)
    return _cupy_unless(backend, reason)


def _check_pair(s_CV: torch.Tensor, u_CV: torch.Tensor) -> None:
    if s_CV.dim() != 2 or s_CV.shape != u_CV.shape:
        raise ValueError(
            f"s_CV and u_CV must be 2-D of one shape, got {tuple(s_CV.shape)} and {tuple(u_CV.shape)}"
        )


def rescale_sums(
    stats_6X: torch.Tensor, max_s_X: torch.Tensor, max_t_X: torch.Tensor
) -> torch.Tensor:
    """Rows 2..5 of ``stats_6X`` re-expressed relative to new maxima (``>=`` the local ones).

    ``stats_6X`` is :func:`row_stats`'s layout over any trailing shape ``X``; ``max_s_X`` and
    ``max_t_X`` broadcast against ``X``. A local max of ``-inf`` (no columns) contributes 0.
    Returns ``[4, *X]`` fp32: the student sums (rows 2, 4) scaled by ``exp(max_s_local - max_s)``,
    the teacher sums (rows 3, 5) by ``exp(max_t_local - max_t)``.
    """
    neg_inf = float("-inf")
    f_s = torch.where(
        stats_6X[0] == neg_inf, torch.zeros_like(stats_6X[0]), (stats_6X[0] - max_s_X).exp()
    )
    f_t = torch.where(
        stats_6X[1] == neg_inf, torch.zeros_like(stats_6X[1]), (stats_6X[1] - max_t_X).exp()
    )
    return torch.stack([stats_6X[2] * f_s, stats_6X[3] * f_t, stats_6X[4] * f_s, stats_6X[5] * f_t])


def combine_partials(part_6CP: torch.Tensor) -> torch.Tensor:
    """Merge statistics of ``P`` column blocks ``[6, C, P]`` into one row's ``[6, C]``."""
    out_6C = torch.empty(part_6CP.shape[:2], dtype=torch.float32, device=part_6CP.device)
    out_6C[0] = part_6CP[0].amax(-1)
    out_6C[1] = part_6CP[1].amax(-1)
    sums_4CP = rescale_sums(part_6CP, out_6C[0, :, None], out_6C[1, :, None])
    out_6C[2], out_6C[3], out_6C[4], out_6C[5] = sums_4CP.sum(-1)
    return out_6C


def row_stats_torch(s_CV: torch.Tensor, u_CV: torch.Tensor, *, need_forward: bool) -> torch.Tensor:
    """Per-row softmax statistics of ``s_CV`` and ``u_CV`` relative to their local row maxima.

    Args:
        s_CV, u_CV: ``[C, V]`` student and teacher logits (any float dtype; math in fp32).
        need_forward: compute row 5 (otherwise it is 0).
    Returns:
        ``[6, C]`` fp32: ``max_s``, ``max_t`` (``-inf`` when ``V == 0``), ``sum exp(s - max_s)``,
        ``sum exp(u - max_t)``, ``sum exp(s - max_s) * (s - u)``, ``sum exp(u - max_t) * (s - u)``.
    """
    _check_pair(s_CV, u_CV)
    C, V = s_CV.shape
    out_6C = torch.zeros((6, C), dtype=torch.float32, device=s_CV.device)
    if V == 0:
        out_6C[:2] = float("-inf")
        return out_6C
    s32 = s_CV.float()
    u32 = u_CV.float()
    out_6C[0] = s32.amax(1)
    out_6C[1] = u32.amax(1)
    diff_CV = s32 - u32
    e_CV = torch.sub(s32, out_6C[0, :, None]).exp_()
    out_6C[2] = e_CV.sum(1)
    out_6C[4] = (e_CV * diff_CV).sum(1)
    torch.sub(u32, out_6C[1, :, None], out=e_CV).exp_()
    out_6C[3] = e_CV.sum(1)
    if need_forward:
        out_6C[5] = (e_CV * diff_CV).sum(1)
    return out_6C


def row_grad_torch(
    s_CV: torch.Tensor,
    u_CV: torch.Tensor,
    coef_5C: torch.Tensor,
    out_CV: torch.Tensor,
    *,
    teacher_term: bool,
) -> torch.Tensor:
    """``out = exp(s - mS) * (alpha * (s - u) + beta) + gamma * exp(u - mT)`` row-wise.

    Args:
        s_CV, u_CV: ``[C, V]`` student and teacher logits.
        coef_5C: ``[5, C]`` fp32 rows ``(mS, mT, alpha, beta, gamma)``.
        out_CV: ``[C, V]`` destination (any float dtype), written fully; it may be ``s_CV``
            itself (in place), never a partial overlap or ``u_CV``.
        teacher_term: include the ``gamma`` term (``False``: it is skipped, as if ``gamma == 0``).
    Returns:
        ``out_CV``.
    """
    _check_pair(s_CV, u_CV)
    if out_CV.shape != s_CV.shape:
        raise ValueError(f"out_CV shape {tuple(out_CV.shape)} != {tuple(s_CV.shape)}")
    if s_CV.shape[1] == 0:
        return out_CV
    m_s, m_t, alpha, beta, gamma = (c[:, None] for c in coef_5C.float())
    s32 = s_CV.float()
    u32 = u_CV.float()
    g_CV = torch.sub(s32, u32).mul_(alpha).add_(beta).mul_(torch.sub(s32, m_s).exp_())
    if teacher_term:
        g_CV.add_(torch.sub(u32, m_t).exp_().mul_(gamma))
    out_CV.copy_(g_CV)
    return out_CV


def row_stats(
    s_CV: torch.Tensor, u_CV: torch.Tensor, *, need_forward: bool, backend: Backend = "auto"
) -> torch.Tensor:
    """:func:`row_stats_torch`'s contract, on the backend :func:`resolve_backend` picks."""
    _check_pair(s_CV, u_CV)
    twin = lambda: row_stats_torch(s_CV, u_CV, need_forward=need_forward)  # noqa: E731
    if resolve_backend(backend, s_CV, u_CV) == "cupy":
        return run_cupy_or_twin(
            backend,
            "mopd.kernels.kl row_stats",
            lambda: combine_partials(
                row_stats_partials_cupy(s_CV, u_CV, need_forward=need_forward)
            ),
            twin,
        )
    return twin()


def row_grad(
    s_CV: torch.Tensor,
    u_CV: torch.Tensor,
    coef_5C: torch.Tensor,
    out_CV: torch.Tensor,
    *,
    teacher_term: bool,
    backend: Backend = "auto",
) -> torch.Tensor:
    """:func:`row_grad_torch`'s contract, on the backend :func:`resolve_backend` picks."""
    _check_pair(s_CV, u_CV)
    args = (s_CV, u_CV, coef_5C, out_CV)
    twin = lambda: row_grad_torch(*args, teacher_term=teacher_term)  # noqa: E731
    if resolve_backend(backend, s_CV, u_CV, out_CV) == "cupy":
        return run_cupy_or_twin(
            backend,
            "mopd.kernels.kl row_grad",
            lambda: row_grad_cupy(*args, teacher_term=teacher_term),
            twin,
        )
    return twin()
