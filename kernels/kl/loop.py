"""The KL's chunk loop and its autograd function.

Why this file exists: this is the loss's data path. Per chunk of ``C`` tokens it forms the
student and teacher logits blocks ``[C, V_local]`` (at least fp32, see
:mod:`mopd.kernels.kl.matmul`), reduces their softmax statistics over the TP group (one MAX and
one SUM all-reduce), computes the per-token KL and, when a backward can follow, the gradient with
respect to the student logits, which it moves into the input gradients (the fused path through
the student's LM-head matmuls, accumulated in fp32 where ``KLJob`` says so). :class:`KLFunction`
decides when the gradient is computed: in the forward for ``sum``/``mean`` (ctx keeps only the
gradients; backward scales them), in the backward for ``none`` (recomputed from tensors saved
with ``save_for_backward``, so an in-place change in between raises).

Profiler ranges (:mod:`mopd.common.ranges`, off by default): ``mopd/loss_chunk:<i>`` around
each chunk, ``mopd/projection:<k>`` around teacher k's LM-head matmul.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from mopd.common.dist import ReduceOpLike, all_reduce
from mopd.common.ranges import span
from mopd.kernels.kl.matmul import logit_dtype, matmul_into
from mopd.kernels.kl.prepare import KLJob, TeacherSlot
from mopd.kernels.kl.rowwise import rescale_sums, row_grad, row_stats

__all__ = ["KLFunction", "StudentSide", "run_chunks", "scale_", "teacher_logits"]


def _all_reduce(t: torch.Tensor, op: ReduceOpLike, job: KLJob) -> None:
    """In-place all-reduce over the TP group, waiting at most ``KLConfig.timeout_s``."""
    if job.group is None or job.tp_size == 1:
        return
    all_reduce(t, op=op, group=job.group, timeout_s=job.config.timeout_s)


class StudentSide:
    """The student's side of a chunk: its logits rows, and where their gradient goes.

    ``x_TX`` is ``[T, V_local]`` logits (``weight_VH`` ``None``) or ``[T, H_s]`` hidden states
    with the ``[V_local, H_s]`` LM-head shard ``weight_VH``. After the loop (:meth:`finish`),
    ``grad_x`` / ``grad_w`` hold the input gradients in the inputs' dtypes. The logits path
    writes its gradient into ``grad_x`` directly (one rounding per element); the fused path
    accumulates the hidden-state gradient in ``[T, H_s]`` at least fp32 and the weight gradient
    in ``job.weight_grad_dtype``, and rounds them in :meth:`finish`.
    """

    def __init__(self, job: KLJob, x_TX: torch.Tensor, weight_VH: torch.Tensor | None) -> None:
        self.job = job
        self.x_TX = x_TX.detach()
        self.weight_VH = None if weight_VH is None else weight_VH.detach()
        self.grad_x: torch.Tensor | None = None
        self.grad_w: torch.Tensor | None = None
        self._acc_x_TH: torch.Tensor | None = None  # fused: hidden-state gradient, fp32
        self._acc_w_VH: torch.Tensor | None = None  # fused: weight gradient, weight_grad_dtype

    def logits(self, rows: slice | torch.Tensor) -> torch.Tensor:
        """``[C, n_valid]`` student logits of the chunk's tokens, in ``student_logit_dtype``."""
        nv = self.job.n_valid
        if self.weight_VH is None:
            if isinstance(rows, slice):
                return self.x_TX[rows, :nv]
            return self.x_TX.index_select(0, rows)[:, :nv]
        h_CH = self.x_TX[rows] if isinstance(rows, slice) else self.x_TX.index_select(0, rows)
        s_CV = torch.empty(
            (h_CH.shape[0], nv), dtype=self.job.student_logit_dtype, device=h_CH.device
        )
        return matmul_into(h_CH, self.weight_VH[:nv].T, s_CV)

    def start_grads(self) -> None:
        if self.weight_VH is None:
            self.grad_x = torch.zeros_like(self.x_TX)
            return
        assert self.job.weight_grad_dtype is not None
        self._acc_x_TH = torch.zeros(
            self.x_TX.shape, dtype=logit_dtype(self.x_TX.dtype), device=self.x_TX.device
        )
        self._acc_w_VH = torch.zeros(
            self.weight_VH.shape, dtype=self.job.weight_grad_dtype, device=self.weight_VH.device
        )

    def grad_buffer(self, rows: slice | torch.Tensor, s_CV: torch.Tensor) -> torch.Tensor:
        """Where :func:`row_grad` writes the chunk's ``[C, n_valid]`` logits gradient, in the
        student's dtype."""
        if self.weight_VH is not None:
            if s_CV.dtype == self.x_TX.dtype:
                return s_CV  # our own matmul output: overwritten in place (one buffer fewer)
            return torch.empty(s_CV.shape, dtype=self.x_TX.dtype, device=s_CV.device)
        assert self.grad_x is not None
        if isinstance(rows, slice):
            return self.grad_x[rows, : self.job.n_valid]  # written in place, nothing to move
        return torch.empty_like(s_CV)

    def take_grad(self, rows: slice | torch.Tensor, g_CV: torch.Tensor) -> None:
        """Move the chunk's ``[C, n_valid]`` logits gradient into the input gradients."""
        nv = self.job.n_valid
        if self.weight_VH is None:
            assert self.grad_x is not None
            if not isinstance(rows, slice):
                self.grad_x[:, :nv].index_copy_(0, rows, g_CV)
            return
        acc_x, acc_w = self._acc_x_TH, self._acc_w_VH
        assert acc_x is not None and acc_w is not None
        w_VH = self.weight_VH[:nv]
        if isinstance(rows, slice):
            h_CH = self.x_TX[rows]
            matmul_into(g_CV, w_VH, acc_x[rows])  # each token's row is written once
        else:
            h_CH = self.x_TX.index_select(0, rows)
            part_CH = torch.empty((g_CV.shape[0], acc_x.shape[1]), dtype=acc_x.dtype,
                                  device=acc_x.device)  # fmt: skip
            acc_x.index_copy_(0, rows, matmul_into(g_CV, w_VH, part_CH))
        matmul_into(g_CV.T, h_CH, acc_w[:nv], accumulate=True)

    def finish(self) -> None:
        """Fused path: sum the hidden-state gradient over the TP group (fp32, when the config
        says so) and round both gradients to the inputs' dtypes, once."""
        if self.weight_VH is None:
            return
        acc_x, acc_w = self._acc_x_TH, self._acc_w_VH
        assert acc_x is not None and acc_w is not None
        self._acc_x_TH = self._acc_w_VH = None
        if self.job.config.sum_hidden_grad_over_tp:
            _all_reduce(acc_x, dist.ReduceOp.SUM, self.job)
        self.grad_x = acc_x.to(self.x_TX.dtype)
        del acc_x
        self.grad_w = acc_w.to(self.weight_VH.dtype)


def teacher_logits(job: KLJob, c0: int, c1: int) -> torch.Tensor:
    """``[c1 - c0, n_valid]`` teacher logits of processing positions ``[c0, c1)``, in
    ``job.teacher_logit_dtype`` (fp32 accumulation and output from bf16 inputs)."""
    nv = job.n_valid
    device = job.weight_N.device
    u_CV = torch.empty((c1 - c0, nv), dtype=job.teacher_logit_dtype, device=device)
    for k, t in enumerate(job.teachers):
        a, b = max(c0, t.start), min(c1, t.stop)
        if a >= b:
            continue
        with span("projection", k):
            if t.rows_M is None:
                h_MH = t.hidden_XH[a - t.start : b - t.start]
            else:
                h_MH = t.hidden_XH.index_select(0, t.rows_M[a - t.start : b - t.start])
            matmul_into(h_MH, t.weight_VH[:nv].T, u_CV[a - c0 : b - c0])
    return u_CV


def run_chunks(
    job: KLJob, student: StudentSide, grad_weight_N: torch.Tensor | None
) -> torch.Tensor:
    """The chunk loop. Returns ``[N]`` fp32 per-token KL in processing order.

    With ``grad_weight_N`` (``[N]`` fp32 ``d loss / d KL_t``), also computes the gradients into
    ``student.grad_x`` / ``student.grad_w``.
    """
    cfg = job.config
    w_r, w_f = cfg.reverse_weight, cfg.forward_weight
    N = job.n_active
    device = job.weight_N.device
    kl_N = torch.empty(N, dtype=torch.float32, device=device)
    if grad_weight_N is not None:
        student.start_grads()
    for i, c0 in enumerate(range(0, N, job.chunk)):
        with span("loss_chunk", i):
            c1 = min(N, c0 + job.chunk)
            rows = slice(c0, c1) if job.order_N is None else job.order_N[c0:c1]
            s_CV = student.logits(rows)
            u_CV = teacher_logits(job, c0, c1)
            stats_6C = row_stats(s_CV, u_CV, need_forward=w_f != 0.0, backend=job.backend)
            max_2C = stats_6C[:2].clone()
            _all_reduce(max_2C, dist.ReduceOp.MAX, job)
            sums_4C = rescale_sums(stats_6C, max_2C[0], max_2C[1])
            _all_reduce(sums_4C, dist.ReduceOp.SUM, job)
            z_s, z_t, a_s, b_t = sums_4C
            # lse_S - lse_T without forming either: each may be ~100 where their difference
            # and the KL are ~0.01 (fp32 rounding of lse_S alone would cost 1e-4 of the KL);
            # the maxima's difference is exact for nearby maxima, the log-sums are O(log V)
            d_lse = (max_2C[0] - max_2C[1]) + (z_s.log() - z_t.log())
            kl_C = torch.zeros_like(z_s)
            if w_r:
                kl_C += w_r * (a_s / z_s - d_lse)
            if w_f:
                kl_C += w_f * (d_lse - b_t / z_t)
            kl_N[c0:c1] = kl_C
            if grad_weight_N is None:
                del s_CV, u_CV  # free this chunk's blocks before the next chunk allocates
                continue
            g_C = grad_weight_N[c0:c1]
            coef_5C = torch.stack(
                [
                    max_2C[0],
                    max_2C[1],
                    g_C * (w_r / z_s),
                    g_C * (w_f - w_r * a_s / z_s) / z_s,
                    g_C * (-w_f / z_t),
                ]
            )
            out_CV = student.grad_buffer(rows, s_CV)
            row_grad(s_CV, u_CV, coef_5C, out_CV, teacher_term=w_f != 0.0, backend=job.backend)
            del s_CV, u_CV
            student.take_grad(rows, out_CV)
            del out_CV  # (it may be the chunk's student logits) free before the next chunk
    if grad_weight_N is not None:
        student.finish()
    return kl_N


def _per_token(job: KLJob, kl_N: torch.Tensor) -> torch.Tensor:
    """``[T]`` fp32 ``mask * KL`` in token order (0 for masked tokens)."""
    out_T = torch.zeros(job.T, dtype=torch.float32, device=kl_N.device)
    val_N = kl_N * job.weight_N
    if job.order_N is None:
        out_T.copy_(val_N)
    else:
        out_T.index_copy_(0, job.order_N, val_N)
    return out_T


def _reduce(job: KLJob, kl_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The loss and, for scalar reductions, ``[N]`` ``d loss / d KL`` per active token."""
    red = job.config.reduction
    if red == "none":
        return _per_token(job, kl_N), None
    total = (kl_N * job.weight_N).sum()
    if red == "sum":
        return total, job.weight_N
    denom = job.total_weight.clamp_min(torch.finfo(torch.float32).tiny)
    scale = torch.where(job.total_weight > 0, 1.0 / denom, torch.zeros_like(denom))
    return total * scale, job.weight_N * scale


def scale_(grad_RX: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``grad_RX *= scale`` in place with one rounding, for a gradient of any dtype.

    Args:
        grad_RX: ``[R, X]`` (or any shape) gradient, scaled in place.
        scale: 0-dim upstream gradient (fp32 from the loss).
    Returns:
        ``grad_RX``.

    ``bf16.mul_(fp32 0-dim)`` is not enough: a 0-dim operand does not take part in type
    promotion, so on CUDA it is cast to bf16 before the multiply (``1/3`` becomes ``0.33398``, a
    0.2% bias). As a one-element tensor it does: the product is formed in fp32 and rounded to the
    gradient's dtype once, in one pass, without a temporary.
    """
    return grad_RX.mul_(scale.to(torch.float32).reshape(1))


class KLFunction(torch.autograd.Function):
    """Autograd for both entry points: ``x_TX`` is the logits or the hidden states.

    Precomputed path (``sum``/``mean`` with a backward to come): the forward computes the
    gradients; ctx keeps only them (not the inputs, not the job) and backward scales them.
    Recompute path (``none``): every tensor the backward reads (student input and weight, each
    teacher's hidden states and LM-head shard) goes through ``ctx.save_for_backward``, so an
    in-place change between forward and backward raises autograd's version-counter error instead
    of silently giving a wrong gradient.
    """

    @staticmethod
    def forward(
        ctx,
        job: KLJob,
        want_grad: bool,
        x_TX: torch.Tensor,
        weight_VH: torch.Tensor | None,
    ):
        student = StudentSide(job, x_TX, weight_VH)
        if job.config.reduction == "none" or not want_grad:
            kl_N = run_chunks(job, student, None)
            loss, _ = _reduce(job, kl_N)
            ctx.precomputed = False
            if want_grad:
                teachers = job.teachers
                ctx.save_for_backward(
                    x_TX,
                    weight_VH,
                    *(t.hidden_XH for t in teachers),
                    *(t.weight_VH for t in teachers),
                )
                # the job without its tensors: backward rebuilds them from the saved ones
                ctx.slots = tuple((t.rows_M, t.start, t.stop) for t in teachers)
                ctx.job = dataclasses.replace(job, teachers=())
        else:
            # the gradient needs d loss / d KL_t, which depends on the reduction only: compute
            # it now from the chunk's statistics, and have backward scale it
            with torch.no_grad():
                _, g_N = _reduce(job, torch.zeros(job.n_active, device=job.weight_N.device))
            kl_N = run_chunks(job, student, g_N)
            loss, _ = _reduce(job, kl_N)
            ctx.precomputed = True
            ctx.grads = (student.grad_x, student.grad_w)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        if ctx.precomputed:
            grad_x, grad_w = ctx.grads
            ctx.grads = None
            scale = grad_out.to(torch.float32)
            grad_x = scale_(grad_x, scale)
            grad_w = None if grad_w is None else scale_(grad_w, scale)
        else:
            # unpacking checks the version counters: RuntimeError if any was modified in place
            x_TX, weight_VH, *rest = ctx.saved_tensors
            K = len(ctx.slots)
            teachers = tuple(
                TeacherSlot(h, w, rows_M, start, stop)
                for h, w, (rows_M, start, stop) in zip(rest[:K], rest[K:], ctx.slots, strict=True)
            )
            job = dataclasses.replace(ctx.job, teachers=teachers)
            student = StudentSide(job, x_TX, weight_VH)
            g_T = grad_out.to(torch.float32)
            g_N = g_T if job.order_N is None else g_T[job.order_N]
            with torch.no_grad():
                run_chunks(job, student, g_N * job.weight_N)
            grad_x, grad_w = student.grad_x, student.grad_w
        return (
            None,
            None,
            grad_x if ctx.needs_input_grad[2] else None,
            grad_w if ctx.needs_input_grad[3] else None,
        )
