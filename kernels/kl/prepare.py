"""Validation of one KL call's arguments and the job the chunk loop runs.

Why this file exists: both entry points of :mod:`mopd.kernels.kl` take the same arguments
(:class:`KLArgs`) and must reject bad ones with a clear ``ValueError`` *before* any collective,
locally, so that a debug-mode failure can still join the TP agreement all-reduce
(:mod:`mopd.kernels.kl.agreement`). :func:`prepare` checks everything and builds the
:class:`KLJob`: the processing order of the active tokens (grouped by teacher, so each teacher's
LM-head matmul runs on contiguous rows), each teacher's rows in it, the mask weights, the
dtypes the logits and gradients are formed in, the backend and the chunk size.

Host syncs: none without a mask or a teacher index; a mask or a teacher index costs a few (the
index range check, the teacher counts, the grouping of tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from mopd.kernels.kl.config import KLConfig, choose_chunk_tokens
from mopd.kernels.kl.matmul import logit_dtype
from mopd.kernels.kl.rowwise import resolve_chunk_backend

__all__ = ["KLArgs", "KLJob", "TeacherSlot", "prepare"]


@dataclass(frozen=True, kw_only=True)
class KLArgs:
    """One call's arguments as the caller gave them, shared by both entry points.

    Not validated on construction: :func:`prepare` checks them, locally and before any
    collective, so that in debug mode a failure can still join the agreement all-reduce.
    Shapes as in :func:`mopd.kernels.kl.vocab_parallel_kl` /
    :func:`mopd.kernels.kl.fused_vocab_parallel_kl`.

    Attributes:
        student_TX: ``[T, V_local]`` student logits shard, or ``[T, H_s]`` student hidden states
            when ``student_weight_VH`` is given.
        student_weight_VH: ``[V_local, H_s]`` student output-weight shard (fused path) or ``None``
            (logits path).
        teacher_hidden: one ``[T, H_k]`` or compact ``[T_k, H_k]`` tensor per teacher (the
            tokens with ``teacher_index == k``, or only those with ``loss_mask_T != 0``).
        teacher_weight: one ``[V_local, H_k]`` LM-head shard per teacher.
        vocab_start, vocab_size, loss_mask_T, teacher_index_T, group, config: as the public
            functions take them (``config`` already defaulted).
    """

    student_TX: torch.Tensor
    student_weight_VH: torch.Tensor | None
    teacher_hidden: torch.Tensor | Sequence[torch.Tensor]
    teacher_weight: torch.Tensor | Sequence[torch.Tensor]
    vocab_start: int
    vocab_size: int
    loss_mask_T: torch.Tensor | None
    teacher_index_T: torch.Tensor | None
    group: dist.ProcessGroup | None
    config: KLConfig


@dataclass(frozen=True)
class TeacherSlot:
    """One teacher's part of the processing order.

    Attributes:
        hidden_XH: ``[T, H_k]``, or ``[T_k, H_k]`` compact hidden states (detached): the tokens
            with ``teacher_index == k``, or only those the mask counts, in token order.
        weight_VH: ``[V_local, H_k]`` LM-head shard (detached).
        rows_M: ``[stop - start]`` hidden rows of this teacher's active tokens in processing
            order, or ``None`` when they are the contiguous rows ``hidden_XH[0 : stop - start]``.
        start, stop: this teacher's positions ``[start, stop)`` in the processing order.
    """

    hidden_XH: torch.Tensor
    weight_VH: torch.Tensor
    rows_M: torch.Tensor | None
    start: int
    stop: int


@dataclass(frozen=True)
class KLJob:
    """Everything the chunk loop needs, validated.

    Attributes:
        config: the call's config.
        group, tp_size: the TP group (``None`` or size 1: no collectives).
        T: tokens; ``v_local``: this rank's vocab rows; ``n_valid``: how many of them are real
            (global id ``< vocab_size``).
        order_N: ``[N]`` active tokens in processing order, or ``None``: all ``T`` in order.
        weight_N: ``[N]`` fp32 mask weights in processing order.
        total_weight: fp32 scalar, the sum of the mask weights.
        teachers: one :class:`TeacherSlot` per teacher, in processing order.
        chunk: tokens per chunk; ``backend``: where the row-wise passes run.
        nonfinite: debug mode: the names of this rank's inputs holding NaN or inf.
        student_logit_dtype: the chunk's student logits: the caller's (logits path) or at least
            fp32 (fused path).
        teacher_logit_dtype: the chunk's teacher logits: at least fp32.
        weight_grad_dtype: fused path: the dtype the weight gradient sums its chunks in (see
            ``KLConfig.weight_grad_accumulation``); ``None`` on the logits path.
    """

    config: KLConfig
    group: dist.ProcessGroup | None
    tp_size: int
    T: int
    v_local: int
    n_valid: int
    order_N: torch.Tensor | None
    weight_N: torch.Tensor
    total_weight: torch.Tensor
    teachers: tuple[TeacherSlot, ...]
    chunk: int
    backend: Literal["cupy", "torch"]
    nonfinite: tuple[str, ...]
    student_logit_dtype: torch.dtype
    teacher_logit_dtype: torch.dtype
    weight_grad_dtype: torch.dtype | None

    @property
    def n_active(self) -> int:
        return self.weight_N.shape[0]


def _shape(t: object) -> object:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else t


def _check_float(name: str, t: torch.Tensor, dim: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {_shape(t)}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor, got dtype {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the student's tensors are on {device}")
    if t.dim() == 2 and t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must have contiguous columns (stride(1) == 1), got {t.stride()}")


def _check_student(args: KLArgs) -> int:
    """Check the student's tensors; returns ``V_local``."""
    x, w = args.student_TX, args.student_weight_VH
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"student input must be a torch.Tensor, got {type(x).__name__}")
    if w is None:
        _check_float("student_logits_TV", x, 2, x.device)
        return x.shape[1]
    _check_float("student_hidden_TH", x, 2, x.device)
    _check_float("student_weight_VH", w, 2, x.device)
    if w.shape[1] != x.shape[1]:
        raise ValueError(
            f"student_weight_VH {_shape(w)} and student_hidden_TH {_shape(x)} disagree on the "
            "hidden size"
        )
    if w.dtype != x.dtype:
        raise ValueError(f"student_weight_VH dtype {w.dtype} != student_hidden_TH dtype {x.dtype}")
    return w.shape[0]


def _check_teachers(
    args: KLArgs, v_local: int, device: torch.device
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Check the teachers' tensors; returns ``(hiddens, weights)`` as lists."""
    th, tw = args.teacher_hidden, args.teacher_weight
    hiddens = [th] if isinstance(th, torch.Tensor) else list(th)
    weights = [tw] if isinstance(tw, torch.Tensor) else list(tw)
    if len(hiddens) != len(weights) or not hiddens:
        raise ValueError(
            f"need one teacher hidden tensor per teacher LM-head shard, got {len(hiddens)} "
            f"hidden and {len(weights)} weight tensors"
        )
    for k, (h, w) in enumerate(zip(hiddens, weights, strict=True)):
        _check_float(f"teacher_hidden[{k}]", h, 2, device)
        _check_float(f"teacher_weight[{k}]", w, 2, device)
        if w.shape[0] != v_local:
            raise ValueError(
                f"teacher_weight[{k}] has {w.shape[0]} vocab rows, the student's shard has "
                f"{v_local}: both must hold the same vocab range"
            )
        if h.shape[1] != w.shape[1]:
            raise ValueError(
                f"teacher_hidden[{k}] {_shape(h)} and teacher_weight[{k}] {_shape(w)} disagree "
                "on the teacher's hidden size"
            )
        if h.dtype != w.dtype:
            raise ValueError(
                f"teacher_hidden[{k}] dtype {h.dtype} != teacher_weight[{k}] {w.dtype}"
            )
    return hiddens, weights


def _check_vocab(args: KLArgs, v_local: int) -> tuple[int, int]:
    """Check the group and the vocab range; returns ``(tp_size, n_valid)``."""
    group, vocab_start, vocab_size = args.group, args.vocab_start, args.vocab_size
    if group is None:
        tp_size, rank_in_group = 1, 0
    else:
        if not dist.is_initialized():
            raise ValueError("a process group was given but torch.distributed is not initialized")
        tp_size = dist.get_world_size(group)
        rank_in_group = dist.get_rank(group)
        if rank_in_group < 0:
            raise ValueError("this process is not a member of the given TP group")
    if not isinstance(vocab_size, int) or not isinstance(vocab_start, int):
        raise ValueError(
            f"vocab_start and vocab_size must be ints, got {vocab_start!r} and {vocab_size!r}"
        )
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if vocab_start != rank_in_group * v_local:
        raise ValueError(
            f"vocab_start={vocab_start} but rank {rank_in_group} of a TP group of {tp_size} with "
            f"{v_local} vocab rows per rank starts at {rank_in_group * v_local}"
        )
    if vocab_size > tp_size * v_local:
        raise ValueError(
            f"vocab_size={vocab_size} exceeds the padded vocab {tp_size} x {v_local} = "
            f"{tp_size * v_local} of this TP group (group size or shard size mismatch)"
        )
    return tp_size, max(0, min(v_local, vocab_size - vocab_start))


def _check_mask(mask: object, T: int, device: torch.device) -> torch.Tensor | None:
    """``[T]`` fp32 mask weights, or ``None`` (no mask)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or _shape(mask) != (T,):
        raise ValueError(f"loss_mask_T must be a [T={T}] tensor, got {_shape(mask)!r}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise ValueError(f"loss_mask_T must be bool or floating, got {mask.dtype}")
    if mask.device != device:
        raise ValueError(f"loss_mask_T is on {mask.device}, expected {device}")
    return mask.to(torch.float32)


def _check_index(index: object, T: int, K: int, device: torch.device) -> torch.Tensor | None:
    """``[T]`` int64 teacher index, or ``None`` (one teacher); one host sync for the range."""
    if index is None:
        if K != 1:
            raise ValueError(f"{K} teachers were given but no teacher_index_T")
        return None
    if not isinstance(index, torch.Tensor) or _shape(index) != (T,):
        raise ValueError(f"teacher_index_T must be a [T={T}] tensor")
    if index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"teacher_index_T must be int64 or int32, got {index.dtype}")
    if index.device != device:
        raise ValueError(f"teacher_index_T is on {index.device}, expected {device}")
    index_T = index.to(torch.int64)
    if T:
        lo, hi = int(index_T.min()), int(index_T.max())
        if lo < 0 or hi >= K:
            raise ValueError(f"teacher_index_T values in [{lo}, {hi}], valid is [0, {K})")
    return index_T


def _compact_layouts(
    hiddens: list[torch.Tensor], T: int, index_T: torch.Tensor | None, mask_T: torch.Tensor | None
) -> list[str]:
    """Per teacher, the form of its hidden rows: ``"token"`` (``[T, H_k]``), ``"all"`` (one row
    per token with ``teacher_index == k``) or ``"counted"`` (one row per such token that the
    mask counts, ``mask != 0``). Told apart by the row count; where two counts are equal the two
    forms hold the same rows."""
    K = len(hiddens)
    all_K = [T] if index_T is None else torch.bincount(index_T, minlength=K).tolist()
    counted_K = all_K
    if mask_T is not None:
        counted = mask_T != 0
        counted_K = (
            [int(counted.sum())]
            if index_T is None
            else torch.bincount(index_T[counted], minlength=K).tolist()
        )
    forms = []
    for k, h in enumerate(hiddens):
        if h.shape[0] == T:
            forms.append("token")
        elif h.shape[0] == all_K[k]:
            forms.append("all")
        elif h.shape[0] == counted_K[k]:
            forms.append("counted")
        else:
            raise ValueError(
                f"teacher_hidden[{k}] has {h.shape[0]} rows: expected T={T} (token layout), "
                f"{all_K[k]} (the tokens with teacher_index == {k}) or {counted_K[k]} (those "
                "of them the loss mask counts)"
            )
    return forms


def _nonfinite_inputs(
    args: KLArgs,
    hiddens: list[torch.Tensor],
    weights: list[torch.Tensor],
    mask_T: torch.Tensor | None,
    tp_size: int,
) -> tuple[str, ...]:
    """Debug mode: the inputs holding NaN or inf (raises here when there is no TP group)."""
    named = [("student input", args.student_TX)]
    if args.student_weight_VH is not None:
        named.append(("student_weight_VH", args.student_weight_VH))
    named += [(f"teacher_hidden[{k}]", h) for k, h in enumerate(hiddens)]
    named += [(f"teacher_weight[{k}]", w) for k, w in enumerate(weights)]
    if mask_T is not None:
        named.append(("loss_mask_T", mask_T))
    nonfinite = tuple(name for name, t in named if t.numel() and not bool(torch.isfinite(t).all()))
    if nonfinite and tp_size == 1:
        raise ValueError(f"{', '.join(nonfinite)} contain(s) NaN or inf (KLConfig(debug=True))")
    return nonfinite


def _teacher_slots(
    hiddens: list[torch.Tensor],
    weights: list[torch.Tensor],
    forms: list[str],
    T: int,
    index_T: torch.Tensor | None,
    mask_T: torch.Tensor | None,
    order_N: torch.Tensor,
    seg_counts: list[int],
    identity: bool,
) -> tuple[TeacherSlot, ...]:
    """Each teacher's rows of the processing order (see :class:`TeacherSlot`)."""
    slots = []
    start = 0
    for k, (h, w) in enumerate(zip(hiddens, weights, strict=True)):
        stop = start + seg_counts[k]
        h, w = h.detach(), w.detach()
        if identity:
            # every token active and tokens already grouped by teacher: teacher k's tokens are
            # the run [start, stop) of the token layout, rows [0, stop - start) of a compact one
            first = 0 if forms[k] != "token" else start
            slots.append(TeacherSlot(h[first : first + stop - start], w, None, start, stop))
        elif forms[k] == "counted" or (forms[k] == "all" and mask_T is None):
            # compact rows of the counted tokens, in token order: exactly this teacher's run of
            # the processing order (active tokens grouped by teacher, stable), so its rows are
            # read as they are, no gather
            slots.append(TeacherSlot(h[: stop - start], w, None, start, stop))
        elif forms[k] != "token":
            # row of each token among teacher k's rows (all of its tokens)
            mine_T = torch.ones(T, dtype=torch.bool, device=order_N.device)
            if index_T is not None:
                mine_T = index_T == k
            rank_T = torch.cumsum(mine_T.to(torch.int64), 0) - 1
            slots.append(TeacherSlot(h, w, rank_T[order_N[start:stop]], start, stop))
        else:
            slots.append(TeacherSlot(h, w, order_N[start:stop], start, stop))
        start = stop
    return tuple(slots)


def _processing_order(
    T: int, mask_T: torch.Tensor | None, index_T: torch.Tensor | None, K: int, device: torch.device
) -> tuple[torch.Tensor, list[int], bool]:
    """``(order_N, tokens per teacher, identity)``: the active tokens grouped by teacher (stable);
    ``identity`` when that is every token in token order (no gather needed)."""
    active_N = (
        torch.arange(T, device=device) if mask_T is None else torch.nonzero(mask_T != 0).flatten()
    )
    if index_T is None:
        order_N, seg_counts = active_N, [active_N.numel()]
    else:
        keys_N = index_T[active_N]
        order_N = active_N[torch.sort(keys_N, stable=True).indices]
        seg_counts = torch.bincount(keys_N, minlength=K).tolist()
    identity = order_N.numel() == T and (
        index_T is None or bool((index_T[1:] >= index_T[:-1]).all())
    )
    return order_N, seg_counts, identity


def _weight_grad_dtype(args: KLArgs, v_local: int, n_active: int, chunk: int) -> torch.dtype | None:
    """Fused path: the dtype the weight gradient sums its chunks in (``KLConfig``'s rule)."""
    w = args.student_weight_VH
    if w is None:
        return None
    wide = logit_dtype(w.dtype)
    fits = v_local * w.shape[1] * wide.itemsize <= args.config.memory_budget_bytes
    mode = args.config.weight_grad_accumulation
    n_chunks = -(-n_active // chunk)
    return wide if mode == "fp32" or (mode == "auto" and n_chunks > 1 and fits) else w.dtype


def prepare(args: KLArgs) -> KLJob:
    """Validate everything (locally, no collective) and build the processing order.

    Raises:
        ValueError: any inconsistency of shapes, dtypes, devices, vocab range, group, mask or
            teacher index (and, in debug mode without TP, a non-finite input).
    """
    config = args.config
    if not isinstance(config, KLConfig):
        raise ValueError(f"config must be a KLConfig, got {type(config).__name__}")
    v_local = _check_student(args)
    student_TX = args.student_TX
    device, T = student_TX.device, student_TX.shape[0]
    hiddens, weights = _check_teachers(args, v_local, device)
    tp_size, n_valid = _check_vocab(args, v_local)
    mask_T = _check_mask(args.loss_mask_T, T, device)
    index_T = _check_index(args.teacher_index_T, T, len(hiddens), device)
    forms = _compact_layouts(hiddens, T, index_T, mask_T)
    nonfinite = _nonfinite_inputs(args, hiddens, weights, mask_T, tp_size) if config.debug else ()

    order_N, seg_counts, identity = _processing_order(T, mask_T, index_T, len(hiddens), device)
    N = order_N.numel()
    weight_N = (
        torch.ones(N, dtype=torch.float32, device=device) if mask_T is None else mask_T[order_N]
    )
    total_weight = torch.full((), float(T), device=device) if mask_T is None else mask_T.sum()
    teachers = _teacher_slots(
        hiddens, weights, forms, T, index_T, mask_T, order_N, seg_counts, identity
    )

    # the logits in at least fp32 (never rounded to a bf16 input's dtype), the gradient in the
    # student's dtype: the row-wise passes see (s, u) and (s, u, gradient) of these dtypes
    fused = args.student_weight_VH is not None
    s_dtype = logit_dtype(student_TX.dtype) if fused else student_TX.dtype
    u_dtype = logit_dtype(*(w.dtype for w in weights))
    backend = resolve_chunk_backend(
        config.backend, student_TX, (s_dtype, u_dtype), (s_dtype, u_dtype, student_TX.dtype)
    )
    chunk = choose_chunk_tokens(
        config,
        v_local=v_local,
        element_size=student_TX.element_size(),
        backend=backend,
        fused=fused,
        logit_element_size=max(s_dtype.itemsize, u_dtype.itemsize),
    )
    return KLJob(
        config=config,
        group=args.group,
        tp_size=tp_size,
        T=T,
        v_local=v_local,
        n_valid=n_valid,
        order_N=None if identity else order_N,
        weight_N=weight_N,
        total_weight=total_weight.to(torch.float32),
        teachers=teachers,
        chunk=chunk,
        backend=backend,
        nonfinite=nonfinite,
        student_logit_dtype=s_dtype,
        teacher_logit_dtype=u_dtype,
        weight_grad_dtype=_weight_grad_dtype(args, v_local, N, chunk),
    )
