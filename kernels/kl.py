"""The student-side full-vocabulary KL, vocab-parallel over the student's TP group and chunked.

Why this file exists: MOPD trains the student on the exact per-token KL to a frozen teacher over
the whole vocabulary. The student holds a vocab shard ``[V_local]`` of its logits (what Megatron's
``output_layer`` returns) and the same vocab shard of each teacher's LM head; the teacher's logits
shard is rebuilt from the bridged hidden states. This module computes the loss and its gradient
without ever materializing a ``[T, V]`` fp32 tensor:

- tokens are processed in chunks of ``C`` rows (``C`` from a memory budget), so extra memory is
  ``O(C x V_local)`` (plus the gradients themselves);
- per chunk, softmax statistics need exactly two all-reduces over the TP group: one MAX (both
  row maxima) and one SUM (both partition sums and the two cross terms, rescaled to the maxima);
- the gradient is computed in the forward pass (Liger-Kernel style), so backward only scales it
  (in fp32, one rounding); autograd keeps only the gradients, not the inputs. With
  ``reduction="none"`` the upstream gradient is per token and backward recomputes instead, from
  tensors saved with ``save_for_backward`` (an in-place change to them in between raises);
- the row-wise passes are a CuPy kernel on CUDA (a torch twin elsewhere), see
  :mod:`mopd.kernels.kl_rowwise`.

The math, per token, with ``s``/``u`` the student/teacher logits, ``d = s - u``,
``Z_S = sum exp(s - m_S)``, ``A = sum exp(s - m_S) d``, ``B = sum exp(u - m_T) d``:

- reverse ``KL(p_S || p_T) = A / Z_S - lse_S + lse_T``, gradient ``p_S (d - A / Z_S)``;
- forward ``KL(p_T || p_S) = -B / Z_T + lse_S - lse_T``, gradient ``p_S - p_T``;
- mixed ``w * reverse + (1 - w) * forward``.

Padded vocab rows (global ids ``>= vocab_size``) are excluded on both sides. Masked tokens
(weight 0) are skipped entirely. With several teachers, tokens are processed grouped by teacher so
each teacher's LM-head matmul runs on contiguous rows.

Precision: the teacher logits are formed in the student's compute dtype (bf16 matmuls with fp32
accumulation on GPU); all softmax statistics, the loss and the per-token coefficients are fp32;
the gradient is stored in the student's dtype (the fused path accumulates the weight gradient over
chunks in the weight's dtype). Host syncs: none on the plain path (no mask, one teacher); a mask
or a teacher index costs a few (the index range check and the grouping of tokens).

Cross-rank contract: every rank of the TP group passes the same ``T``, mask and teacher index
(they shard the vocabulary, not the tokens). Validation is local and raises before any collective.
An error specific to one rank (its ``vocab_start``, its shard size) then raises on that rank only,
and with ``debug`` off the other ranks hang in the first all-reduce until the collective timeout
(gloo) or the NCCL watchdog. ``KLConfig(debug=True)`` adds finiteness checks and one agreement
all-reduce that catches ranks passing different tokens and carries any rank's validation failure
(its message and rank), so every rank raises the same ValueError. The chunk size is derived from the
config, ``V_local``, the dtype and the backend, so it agrees across ranks that agree on those.
"""

from __future__ import annotations

import dataclasses
import datetime
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from mopd.kernels.kl_rowwise import Backend, rescale_sums, resolve_backend, row_grad, row_stats

__all__ = [
    "KLConfig",
    "KLKind",
    "KLReduction",
    "choose_chunk_tokens",
    "fused_vocab_parallel_kl",
    "vocab_parallel_kl",
]

KLKind = Literal["reverse", "forward", "mixed"]
KLReduction = Literal["sum", "mean", "none"]

_MAX_CHUNK_TOKENS = 32768  # CUDA grid y-dimension limit is 65535 rows per launch
_DEFAULT_BUDGET = 512 * 2**20


@dataclass(frozen=True, kw_only=True)
class KLConfig:
    """How the loss is computed.

    Attributes:
        kind: ``"reverse"`` (KL(p_S || p_T), the default), ``"forward"`` or ``"mixed"``.
        mix_weight: weight of the reverse KL in ``"mixed"`` (the forward KL gets ``1 - w``);
            default 0.5 there; setting it with another ``kind`` warns (it is ignored).
        reduction: ``"sum"`` (of ``mask * KL``), ``"mean"`` (that sum over the mask's total
            weight; 0 when it is 0) or ``"none"`` (``[T]`` fp32 ``mask * KL``).
        memory_budget_bytes: working memory for one chunk's ``[C, V_local]`` blocks; sets ``C``.
            It also bounds the fp32 buffer backward uses to scale a bf16/fp16 gradient.
        chunk_tokens: explicit chunk size; overrides the budget.
        backend: row-wise passes on ``"auto"`` / ``"cupy"`` / ``"torch"`` (see kl_rowwise).
        debug: check inputs for NaN/inf and check, with one extra all-reduce, that the TP ranks
            agree on tokens, mask and teacher index.
        collective_timeout_s: CPU (gloo) groups: wait at most this long on each all-reduce
            (``None``: the group's timeout). CUDA (NCCL) tensors always use the group's own
            timeout (its watchdog): a timed wait there would block the CPU on every chunk.
        sum_hidden_grad_over_tp: fused path: all-reduce the student hidden-state gradient over
            the TP group (the hidden states are TP-replicated, as Megatron's
            copy-to-tensor-parallel-region does); ``False`` leaves this rank's partial sum.
            The logits path has no hidden states: ``False`` there is ignored, with a warning
            (once per process).
    """

    kind: KLKind = "reverse"
    mix_weight: float | None = None
    reduction: KLReduction = "sum"
    memory_budget_bytes: int = _DEFAULT_BUDGET
    chunk_tokens: int | None = None
    backend: Backend = "auto"
    debug: bool = False
    collective_timeout_s: float | None = 600.0
    sum_hidden_grad_over_tp: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("reverse", "forward", "mixed"):
            raise ValueError(f"kind must be 'reverse', 'forward' or 'mixed', got {self.kind!r}")
        if self.reduction not in ("sum", "mean", "none"):
            raise ValueError(f"reduction must be 'sum', 'mean' or 'none', got {self.reduction!r}")
        if self.backend not in ("auto", "cupy", "torch"):
            raise ValueError(f"backend must be 'auto', 'cupy' or 'torch', got {self.backend!r}")
        if self.mix_weight is not None:
            if not 0.0 <= self.mix_weight <= 1.0:
                raise ValueError(f"mix_weight must be in [0, 1], got {self.mix_weight}")
            if self.kind != "mixed":
                warnings.warn(
                    f"KLConfig.mix_weight={self.mix_weight} is ignored with kind={self.kind!r}",
                    stacklevel=3,
                )
        if self.memory_budget_bytes <= 0:
            raise ValueError(f"memory_budget_bytes must be > 0, got {self.memory_budget_bytes}")
        if self.chunk_tokens is not None and not 1 <= self.chunk_tokens <= _MAX_CHUNK_TOKENS:
            raise ValueError(
                f"chunk_tokens must be in [1, {_MAX_CHUNK_TOKENS}], got {self.chunk_tokens}"
            )
        if self.chunk_tokens is not None and self.memory_budget_bytes != _DEFAULT_BUDGET:
            warnings.warn(
                f"KLConfig.memory_budget_bytes={self.memory_budget_bytes} is ignored: "
                f"chunk_tokens={self.chunk_tokens} sets the chunk size",
                stacklevel=3,
            )
        if self.collective_timeout_s is not None and self.collective_timeout_s <= 0:
            raise ValueError(f"collective_timeout_s must be > 0, got {self.collective_timeout_s}")

    @property
    def reverse_weight(self) -> float:
        """Weight of KL(p_S || p_T) in the loss."""
        if self.kind == "mixed":
            return 0.5 if self.mix_weight is None else self.mix_weight
        return 1.0 if self.kind == "reverse" else 0.0

    @property
    def forward_weight(self) -> float:
        """Weight of KL(p_T || p_S) in the loss."""
        return 1.0 - self.reverse_weight


def choose_chunk_tokens(
    config: KLConfig,
    *,
    v_local: int,
    element_size: int,
    backend: Literal["cupy", "torch"],
    fused: bool = True,
) -> int:
    """Tokens per chunk so one chunk's ``[C, V_local]`` blocks fit ``config.memory_budget_bytes``.

    Per element of a chunk, in the compute dtype: the student and teacher logits (the fused
    path writes the gradient over its own student logits) plus, for the logits path, a gradient
    buffer; the torch twin adds ~5 fp32 temporaries. ``C`` is rounded down to a multiple of 64
    when it is at least 128.
    """
    if config.chunk_tokens is not None:
        return config.chunk_tokens
    per_elem = (2 if fused else 3) * element_size + (0 if backend == "cupy" else 20)
    chunk = config.memory_budget_bytes // max(1, v_local * per_elem)
    chunk = max(1, min(int(chunk), _MAX_CHUNK_TOKENS))
    return chunk - chunk % 64 if chunk >= 128 else chunk


# ---- validation ------------------------------------------------------------------------------


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


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


@dataclass(frozen=True)
class _Teacher:
    hidden_XH: torch.Tensor  # [T or T_k, H_k]
    weight_VH: torch.Tensor  # [V_local, H_k]
    rows_M: (
        torch.Tensor | None
    )  # hidden rows of this teacher's active tokens, in order; None: slice
    start: int  # this teacher's first position in processing order
    stop: int


@dataclass(frozen=True)
class _Job:
    """Everything the chunk loop needs, validated."""

    config: KLConfig
    group: dist.ProcessGroup | None
    tp_size: int
    T: int
    v_local: int
    n_valid: int  # local vocab columns that are real (< vocab_size)
    order_N: torch.Tensor | None  # active tokens in processing order; None: all T in order
    weight_N: torch.Tensor  # [N] fp32 mask weights in processing order
    total_weight: torch.Tensor  # fp32 scalar, sum of the mask weights
    teachers: tuple[_Teacher, ...]
    chunk: int
    backend: Literal["cupy", "torch"]
    nonfinite: tuple[str, ...]  # debug mode: inputs of this rank holding NaN or inf

    @property
    def n_active(self) -> int:
        return self.weight_N.shape[0]


@dataclass(frozen=True, kw_only=True)
class _Args:
    """One call's arguments as the caller gave them, shared by both entry points.

    Not validated on construction: :func:`_prepare` checks them, locally and before any
    collective, so that in debug mode a failure can still join the agreement all-reduce
    (:func:`_call`). Shapes as in :func:`vocab_parallel_kl` / :func:`fused_vocab_parallel_kl`.

    Attributes:
        student_TX: ``[T, V_local]`` student logits shard, or ``[T, H_s]`` student hidden states
            when ``student_weight_VH`` is given.
        student_weight_VH: ``[V_local, H_s]`` student output-weight shard (fused path) or ``None``
            (logits path).
        teacher_hidden: one ``[T, H_k]`` or ``[T_k, H_k]`` tensor per teacher.
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


def _prepare(args: _Args) -> _Job:
    """Validate everything (locally, no collective) and build the processing order."""
    config, group = args.config, args.group
    student_TX, student_weight_VH = args.student_TX, args.student_weight_VH
    teacher_hidden, teacher_weight = args.teacher_hidden, args.teacher_weight
    vocab_start, vocab_size = args.vocab_start, args.vocab_size
    loss_mask_T, teacher_index_T = args.loss_mask_T, args.teacher_index_T
    if not isinstance(config, KLConfig):
        raise ValueError(f"config must be a KLConfig, got {type(config).__name__}")
    if not isinstance(student_TX, torch.Tensor):
        raise ValueError(f"student input must be a torch.Tensor, got {type(student_TX).__name__}")
    device = student_TX.device
    fused = student_weight_VH is not None
    _check_float("student_hidden_TH" if fused else "student_logits_TV", student_TX, 2, device)
    T = student_TX.shape[0]
    if fused:
        _check_float("student_weight_VH", student_weight_VH, 2, device)
        if student_weight_VH.shape[1] != student_TX.shape[1]:
            raise ValueError(
                f"student_weight_VH {_shape(student_weight_VH)} and student_hidden_TH "
                f"{_shape(student_TX)} disagree on the hidden size"
            )
        if student_weight_VH.dtype != student_TX.dtype:
            raise ValueError(
                f"student_weight_VH dtype {student_weight_VH.dtype} != student_hidden_TH dtype "
                f"{student_TX.dtype}"
            )
        v_local = student_weight_VH.shape[0]
    else:
        v_local = student_TX.shape[1]

    hiddens = [teacher_hidden] if isinstance(teacher_hidden, torch.Tensor) else list(teacher_hidden)
    weights = [teacher_weight] if isinstance(teacher_weight, torch.Tensor) else list(teacher_weight)
    if len(hiddens) != len(weights) or not hiddens:
        raise ValueError(
            f"need one teacher hidden tensor per teacher LM-head shard, got {len(hiddens)} "
            f"hidden and {len(weights)} weight tensors"
        )
    K = len(hiddens)
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

    # group and vocab range
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
    n_valid = max(0, min(v_local, vocab_size - vocab_start))

    # mask
    if loss_mask_T is None:
        mask_T = None
    else:
        if not isinstance(loss_mask_T, torch.Tensor) or _shape(loss_mask_T) != (T,):
            raise ValueError(
                f"loss_mask_T must be a [T={T}] tensor, got "
                f"{_shape(loss_mask_T) if isinstance(loss_mask_T, torch.Tensor) else loss_mask_T!r}"
            )
        if loss_mask_T.dtype != torch.bool and not loss_mask_T.is_floating_point():
            raise ValueError(f"loss_mask_T must be bool or floating, got {loss_mask_T.dtype}")
        if loss_mask_T.device != device:
            raise ValueError(f"loss_mask_T is on {loss_mask_T.device}, expected {device}")
        mask_T = loss_mask_T.to(torch.float32)

    # teacher index
    if teacher_index_T is None:
        if K != 1:
            raise ValueError(f"{K} teachers were given but no teacher_index_T")
        index_T = None
    else:
        if not isinstance(teacher_index_T, torch.Tensor) or _shape(teacher_index_T) != (T,):
            raise ValueError(f"teacher_index_T must be a [T={T}] tensor")
        if teacher_index_T.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"teacher_index_T must be int64 or int32, got {teacher_index_T.dtype}")
        if teacher_index_T.device != device:
            raise ValueError(f"teacher_index_T is on {teacher_index_T.device}, expected {device}")
        index_T = teacher_index_T.to(torch.int64)
        if T:
            lo, hi = int(index_T.min()), int(index_T.max())
            if lo < 0 or hi >= K:
                raise ValueError(f"teacher_index_T values in [{lo}, {hi}], valid is [0, {K})")

    # teacher hidden rows: [T, H_k] (token order) or [T_k, H_k] (that teacher's tokens only)
    counts_K = [T] if index_T is None else torch.bincount(index_T, minlength=K).tolist()
    compact_K = []
    for k, h in enumerate(hiddens):
        if h.shape[0] == T:
            compact_K.append(False)
        elif h.shape[0] == counts_K[k]:
            compact_K.append(True)
        else:
            raise ValueError(
                f"teacher_hidden[{k}] has {h.shape[0]} rows: expected T={T} (token layout) or "
                f"{counts_K[k]} (the tokens with teacher_index == {k})"
            )

    if config.debug:
        named = [("student input", student_TX)]
        if fused:
            named.append(("student_weight_VH", student_weight_VH))
        named += [(f"teacher_hidden[{k}]", h) for k, h in enumerate(hiddens)]
        named += [(f"teacher_weight[{k}]", w) for k, w in enumerate(weights)]
        if mask_T is not None:
            named.append(("loss_mask_T", mask_T))
        nonfinite = tuple(
            name for name, t in named if t.numel() and not bool(torch.isfinite(t).all())
        )
        if nonfinite and (group is None or tp_size == 1):
            raise ValueError(f"{', '.join(nonfinite)} contain(s) NaN or inf (KLConfig(debug=True))")
    else:
        nonfinite = ()

    # processing order: active tokens, grouped by teacher (stable)
    ar_T = torch.arange(T, device=device)
    active_N = ar_T if mask_T is None else torch.nonzero(mask_T != 0).flatten()
    if index_T is None:
        order_N = active_N
        seg_counts = [active_N.numel()]
    else:
        keys_N = index_T[active_N]
        perm_N = torch.sort(keys_N, stable=True).indices
        order_N = active_N[perm_N]
        seg_counts = torch.bincount(keys_N, minlength=K).tolist()
    N = order_N.numel()
    identity = N == T and (index_T is None or bool((index_T[1:] >= index_T[:-1]).all()))
    weight_N = (
        torch.ones(N, dtype=torch.float32, device=device) if mask_T is None else mask_T[order_N]
    )
    total_weight = torch.full((), float(T), device=device) if mask_T is None else mask_T.sum()

    teachers = []
    start = 0
    for k, (h, w) in enumerate(zip(hiddens, weights, strict=True)):
        stop = start + seg_counts[k]
        h, w = h.detach(), w.detach()
        if identity:
            # every token active and tokens already grouped by teacher: teacher k's tokens are
            # the run [start, stop) of the token layout, rows [0, stop - start) of a compact one
            first = 0 if compact_K[k] and index_T is not None else start
            teachers.append(_Teacher(h[first : first + stop - start], w, None, start, stop))
        elif compact_K[k] and index_T is not None:
            rank_T = torch.cumsum((index_T == k).to(torch.int64), 0) - 1
            teachers.append(_Teacher(h, w, rank_T[order_N[start:stop]], start, stop))
        else:
            teachers.append(_Teacher(h, w, order_N[start:stop], start, stop))
        start = stop

    elem = student_TX.element_size()
    probe = [student_TX] if not fused else [student_weight_VH]
    backend = resolve_backend(config.backend, *probe)
    chunk = choose_chunk_tokens(
        config, v_local=v_local, element_size=elem, backend=backend, fused=fused
    )
    return _Job(
        config=config,
        group=group,
        tp_size=tp_size,
        T=T,
        v_local=v_local,
        n_valid=n_valid,
        order_N=None if identity else order_N,
        weight_N=weight_N,
        total_weight=total_weight.to(torch.float32),
        teachers=tuple(teachers),
        chunk=chunk,
        backend=backend,
        nonfinite=nonfinite,
    )


# ---- the chunk loop ------------------------------------------------------------------------------


def _all_reduce_in(
    t: torch.Tensor,
    op: dist.ReduceOp,
    group: dist.ProcessGroup | None,
    timeout_s: float | None,
) -> None:
    """In-place all-reduce of ``t`` over ``group``, waiting at most ``timeout_s`` (CPU tensors)."""
    if t.is_cuda or timeout_s is None:
        dist.all_reduce(t, op=op, group=group)
        return
    work = dist.all_reduce(t, op=op, group=group, async_op=True)
    work.wait(timeout=datetime.timedelta(seconds=timeout_s))


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, job: _Job) -> None:
    """In-place all-reduce over the TP group, waiting at most ``collective_timeout_s``."""
    if job.group is None or job.tp_size == 1:
        return
    _all_reduce_in(t, op, job.group, job.config.collective_timeout_s)


#: Bytes of a failing rank's error message carried by the debug agreement all-reduce.
_MESSAGE_BYTES = 400


def _job_signature(
    job: _Job, loss_mask_T: torch.Tensor | None, index_T: torch.Tensor | None
) -> list[int]:
    """What the TP ranks must agree on: ``T``, active tokens, teachers, ``V_local``, chunk, and
    position-weighted sums of the mask and the teacher index (one host sync each)."""
    dev = job.weight_N.device
    pos_T = torch.arange(1, job.T + 1, device=dev, dtype=torch.int64)
    mask_sig = 0 if loss_mask_T is None else int(((loss_mask_T != 0).to(torch.int64) * pos_T).sum())
    index_sig = 0 if index_T is None else int((index_T.to(torch.int64) * pos_T).sum())
    return [job.T, job.n_active, len(job.teachers), job.v_local, job.chunk, mask_sig, index_sig]


_SIGNATURE_LEN = 7


def _check_agreement(
    group: dist.ProcessGroup,
    position: tuple[int, int],
    device: torch.device,
    timeout_s: float | None,
    *,
    signature: list[int] | None = None,
    nonfinite: tuple[str, ...] = (),
    failure: ValueError | None = None,
) -> None:
    """Debug mode: one MAX all-reduce over the TP group; raises the same ValueError on every rank.

    ``position`` is ``(tp_size, rank_in_group)`` (see :func:`_group_position`); ``device`` is
    where the vector is reduced (the group's device kind).

    The int64 vector reduced is ``[sig (7), -sig (7), non-finite flag, failed flag,
    message bytes (tp_size x _MESSAGE_BYTES)]``: a rank whose validation failed (``failure``,
    ``signature`` then ``None``) sets its flag and writes its message into its own slot, so every
    rank learns which ranks failed and why, and raises the same text. Otherwise: a non-finite
    input anywhere, then any disagreement of the signature (max != min), raise.
    """
    tp_size, rank_in_group = position
    n = _SIGNATURE_LEN
    vec = torch.zeros(2 * n + 2 + tp_size * _MESSAGE_BYTES, dtype=torch.int64)
    if signature is not None:
        assert len(signature) == n
        vec[:n] = torch.tensor(signature, dtype=torch.int64)
        vec[n : 2 * n] = -vec[:n]
    vec[2 * n] = len(nonfinite)
    if failure is not None:
        vec[2 * n + 1] = 1
        msg = (str(failure) or "ValueError").encode("utf-8", errors="replace")[:_MESSAGE_BYTES]
        first = 2 * n + 2 + rank_in_group * _MESSAGE_BYTES
        vec[first : first + len(msg)] = torch.frombuffer(bytearray(msg), dtype=torch.uint8)
    vec = vec.to(device)
    _all_reduce_in(vec, dist.ReduceOp.MAX, group, timeout_s)
    vec = vec.cpu()
    if int(vec[2 * n + 1]):
        slots = vec[2 * n + 2 :].reshape(tp_size, _MESSAGE_BYTES)
        failed, parts = [], []
        for r in range(tp_size):
            raw = bytes(slots[r].to(torch.uint8).tolist()).rstrip(b"\0")
            if raw:
                failed.append(r)
                parts.append(f"rank {r}: {raw.decode('utf-8', errors='replace')}")
        error = ValueError(
            f"invalid KL arguments on rank(s) {failed} of the TP group (KLConfig(debug=True)); "
            + "; ".join(parts)
        )
        if failure is not None:
            raise error from failure
        raise error
    if int(vec[2 * n]):
        where = ", ".join(nonfinite) if nonfinite else "another rank's inputs"
        raise ValueError(f"NaN or inf in {where} (KLConfig(debug=True))")
    hi, lo = vec[:n], -vec[n : 2 * n]
    if not bool((hi == lo).all()):
        raise ValueError(
            "TP ranks disagree on (T, active tokens, teachers, V_local, chunk, mask, teacher "
            f"index): max {hi.tolist()} vs min {lo.tolist()} (KLConfig(debug=True))"
        )


class _Student:
    """The student's side of a chunk: its logits rows, and where their gradient goes."""

    def __init__(self, job: _Job, x_TX: torch.Tensor, weight_VH: torch.Tensor | None) -> None:
        self.job = job
        self.x_TX = x_TX.detach()
        self.weight_VH = None if weight_VH is None else weight_VH.detach()
        self.grad_x: torch.Tensor | None = None
        self.grad_w: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.x_TX.dtype

    def logits(self, rows: slice | torch.Tensor) -> torch.Tensor:
        """``[C, n_valid]`` student logits of the chunk's tokens (compute dtype)."""
        nv = self.job.n_valid
        if self.weight_VH is None:
            if isinstance(rows, slice):
                return self.x_TX[rows, :nv]
            return self.x_TX.index_select(0, rows)[:, :nv]
        h_CH = self.x_TX[rows] if isinstance(rows, slice) else self.x_TX.index_select(0, rows)
        return h_CH @ self.weight_VH[:nv].T

    def start_grads(self) -> None:
        self.grad_x = torch.zeros_like(self.x_TX)
        if self.weight_VH is not None:
            self.grad_w = torch.zeros_like(self.weight_VH)

    def grad_buffer(self, rows: slice | torch.Tensor, s_CV: torch.Tensor) -> torch.Tensor:
        """Where :func:`row_grad` writes the chunk's logits gradient ``[C, n_valid]``."""
        assert self.grad_x is not None
        if self.weight_VH is not None:
            return s_CV  # our own matmul output: overwritten in place (one buffer fewer)
        if isinstance(rows, slice):
            return self.grad_x[rows, : self.job.n_valid]  # written in place, nothing to move
        return torch.empty_like(s_CV)

    def take_grad(self, rows: slice | torch.Tensor, g_CV: torch.Tensor) -> None:
        """Move the chunk's logits gradient into the input gradients."""
        assert self.grad_x is not None
        nv = self.job.n_valid
        if self.weight_VH is None:
            if not isinstance(rows, slice):
                self.grad_x[:, :nv].index_copy_(0, rows, g_CV)
            return
        assert self.grad_w is not None
        w_VH = self.weight_VH[:nv]
        if isinstance(rows, slice):
            h_CH = self.x_TX[rows]
            torch.matmul(g_CV, w_VH, out=self.grad_x[rows])
        else:
            h_CH = self.x_TX.index_select(0, rows)
            self.grad_x.index_copy_(0, rows, g_CV @ w_VH)
        self.grad_w[:nv].addmm_(g_CV.T, h_CH)


def _teacher_logits(job: _Job, c0: int, c1: int, dtype: torch.dtype) -> torch.Tensor:
    """``[c1 - c0, n_valid]`` teacher logits of processing positions ``[c0, c1)`` in ``dtype``."""
    nv = job.n_valid
    device = job.weight_N.device
    u_CV = torch.empty((c1 - c0, nv), dtype=dtype, device=device)
    for t in job.teachers:
        a, b = max(c0, t.start), min(c1, t.stop)
        if a >= b:
            continue
        if t.rows_M is None:
            h_MH = t.hidden_XH[a - t.start : b - t.start]
        else:
            h_MH = t.hidden_XH.index_select(0, t.rows_M[a - t.start : b - t.start])
        w_VH = t.weight_VH[:nv]
        if h_MH.dtype == dtype:
            torch.matmul(h_MH, w_VH.T, out=u_CV[a - c0 : b - c0])
        else:
            u_CV[a - c0 : b - c0] = h_MH @ w_VH.T
    return u_CV


def _run(job: _Job, student: _Student, grad_weight_N: torch.Tensor | None) -> torch.Tensor:
    """The chunk loop. Returns ``[N]`` fp32 per-token KL in processing order.

    With ``grad_weight_N`` (``[N]`` fp32 ``d loss / d KL_t``), also accumulates the gradients
    into ``student.grad_x`` / ``student.grad_w``.
    """
    cfg = job.config
    w_r, w_f = cfg.reverse_weight, cfg.forward_weight
    N = job.n_active
    device = job.weight_N.device
    kl_N = torch.empty(N, dtype=torch.float32, device=device)
    if grad_weight_N is not None:
        student.start_grads()
    for c0 in range(0, N, job.chunk):
        c1 = min(N, c0 + job.chunk)
        rows = slice(c0, c1) if job.order_N is None else job.order_N[c0:c1]
        s_CV = student.logits(rows)
        u_CV = _teacher_logits(job, c0, c1, s_CV.dtype)
        stats_6C = row_stats(s_CV, u_CV, need_forward=w_f != 0.0, backend=job.backend)
        max_2C = stats_6C[:2].clone()
        _all_reduce(max_2C, dist.ReduceOp.MAX, job)
        sums_4C = rescale_sums(stats_6C, max_2C[0], max_2C[1])
        _all_reduce(sums_4C, dist.ReduceOp.SUM, job)
        z_s, z_t, a_s, b_t = sums_4C
        lse_s = max_2C[0] + z_s.log()
        lse_t = max_2C[1] + z_t.log()
        kl_C = torch.zeros_like(z_s)
        if w_r:
            kl_C += w_r * (a_s / z_s - lse_s + lse_t)
        if w_f:
            kl_C += w_f * (lse_s - lse_t - b_t / z_t)
        kl_N[c0:c1] = kl_C
        if grad_weight_N is None:
            del s_CV, u_CV  # free this chunk's blocks before the next chunk allocates its own
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
    if (
        grad_weight_N is not None
        and student.weight_VH is not None
        and cfg.sum_hidden_grad_over_tp
        and student.grad_x is not None
    ):
        _all_reduce(student.grad_x, dist.ReduceOp.SUM, job)
    return kl_N


def _per_token(job: _Job, kl_N: torch.Tensor) -> torch.Tensor:
    """``[T]`` fp32 ``mask * KL`` in token order (0 for masked tokens)."""
    out_T = torch.zeros(job.T, dtype=torch.float32, device=kl_N.device)
    val_N = kl_N * job.weight_N
    if job.order_N is None:
        out_T.copy_(val_N)
    else:
        out_T.index_copy_(0, job.order_N, val_N)
    return out_T


def _reduce(job: _Job, kl_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The loss and, for scalar reductions, ``d loss / d KL`` per active token."""
    red = job.config.reduction
    if red == "none":
        return _per_token(job, kl_N), None
    total = (kl_N * job.weight_N).sum()
    if red == "sum":
        return total, job.weight_N
    denom = job.total_weight.clamp_min(torch.finfo(torch.float32).tiny)
    scale = torch.where(job.total_weight > 0, 1.0 / denom, torch.zeros_like(denom))
    return total * scale, job.weight_N * scale


def _scale_(grad_RX: torch.Tensor, scale: torch.Tensor, budget_bytes: int) -> torch.Tensor:
    """``grad_RX *= scale`` in place with one rounding, for a gradient of any dtype.

    Args:
        grad_RX: ``[R, X]`` (or any shape; dim 0 is chunked) gradient, scaled in place.
        scale: 0-dim upstream gradient (fp32 from the loss).
        budget_bytes: fp32 working memory for the reduced-precision path.
    Returns:
        ``grad_RX``.

    ``bf16.mul_(fp32 0-dim)`` is not enough: on CUDA the 0-dim operand is cast to bf16 before
    the multiply (``1/3`` becomes ``0.33398``, a 0.2% bias). Reduced-precision gradients are
    therefore scaled in fp32, ``budget_bytes`` of rows at a time, and rounded once.
    """
    if grad_RX.dtype in (torch.float32, torch.float64) or grad_RX.dim() == 0:
        return grad_RX.mul_(scale)
    per_row = max(1, grad_RX[:1].numel() * 4)
    step = max(1, budget_bytes // per_row)
    for r0 in range(0, grad_RX.shape[0], step):
        rows = grad_RX[r0 : r0 + step]
        rows.copy_(rows.float().mul_(scale))
    return grad_RX


class _KLFunction(torch.autograd.Function):
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
        job: _Job,
        want_grad: bool,
        x_TX: torch.Tensor,
        weight_VH: torch.Tensor | None,
    ):
        student = _Student(job, x_TX, weight_VH)
        ctx.budget = job.config.memory_budget_bytes
        if job.config.reduction == "none" or not want_grad:
            kl_N = _run(job, student, None)
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
            kl_N = _run(job, student, g_N)
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
            grad_x = _scale_(grad_x, scale, ctx.budget)
            grad_w = None if grad_w is None else _scale_(grad_w, scale, ctx.budget)
        else:
            # unpacking checks the version counters: RuntimeError if any was modified in place
            x_TX, weight_VH, *rest = ctx.saved_tensors
            K = len(ctx.slots)
            teachers = tuple(
                _Teacher(h, w, rows_M, start, stop)
                for h, w, (rows_M, start, stop) in zip(rest[:K], rest[K:], ctx.slots, strict=True)
            )
            job = dataclasses.replace(ctx.job, teachers=teachers)
            student = _Student(job, x_TX, weight_VH)
            g_T = grad_out.to(torch.float32)
            g_N = g_T if job.order_N is None else g_T[job.order_N]
            with torch.no_grad():
                _run(job, student, g_N * job.weight_N)
            grad_x, grad_w = student.grad_x, student.grad_w
        return (
            None,
            None,
            grad_x if ctx.needs_input_grad[2] else None,
            grad_w if ctx.needs_input_grad[3] else None,
        )


def _group_position(group: dist.ProcessGroup | None) -> tuple[int, int] | None:
    """``(tp_size, rank_in_group)`` when this rank can take part in a collective on ``group``."""
    if group is None or not dist.is_initialized():
        return None
    rank_in_group = dist.get_rank(group)
    if rank_in_group < 0:
        return None
    return dist.get_world_size(group), rank_in_group


def _collective_device(x_TX: object, group: dist.ProcessGroup) -> torch.device:
    """Where the debug agreement vector lives: the student's device, else the group's kind."""
    if isinstance(x_TX, torch.Tensor):
        return x_TX.device
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _call(args: _Args) -> torch.Tensor:
    """Both entry points: validate, check agreement in debug mode, run the autograd function."""
    config, group = args.config, args.group
    debug = isinstance(config, KLConfig) and config.debug
    position = _group_position(group) if debug else None
    try:
        job = _prepare(args)
    except ValueError as exc:
        if position is None or position[0] == 1:
            raise
        # debug: the other ranks are about to enter the agreement all-reduce; join it with the
        # failure so that every rank raises the same error instead of waiting for this one
        assert group is not None
        device = _collective_device(args.student_TX, group)
        _check_agreement(group, position, device, config.collective_timeout_s, failure=exc)
        raise AssertionError("the agreement check returned after a failure") from exc
    if debug and position is not None and position[0] > 1:
        assert group is not None
        _check_agreement(
            group,
            position,
            job.weight_N.device,
            config.collective_timeout_s,
            signature=_job_signature(job, args.loss_mask_T, args.teacher_index_T),
            nonfinite=job.nonfinite,
        )
    # precompute gradients in the forward only when a backward can follow
    x_TX, weight_VH = args.student_TX, args.student_weight_VH
    want_grad = torch.is_grad_enabled() and (
        x_TX.requires_grad or (weight_VH is not None and weight_VH.requires_grad)
    )
    return _KLFunction.apply(job, want_grad, x_TX, weight_VH)


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    """``warnings.warn`` the first time ``message`` comes up in this process."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)  # the caller of the public function


def vocab_parallel_kl(
    student_logits_TV: torch.Tensor,
    teacher_hidden: torch.Tensor | Sequence[torch.Tensor],
    teacher_weight: torch.Tensor | Sequence[torch.Tensor],
    *,
    vocab_start: int,
    vocab_size: int,
    loss_mask_T: torch.Tensor | None = None,
    teacher_index_T: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    config: KLConfig | None = None,
) -> torch.Tensor:
    """Full-vocabulary KL from the student's logits shard; differentiable into those logits.

    Args:
        student_logits_TV: ``[T, V_local]`` this rank's vocab shard of the student logits
            (Megatron's ``output_layer`` output flattened to tokens), columns contiguous.
        teacher_hidden: the bridged teacher hidden states, one tensor per teacher: ``[T, H_k]``
            (row t is token t) or ``[T_k, H_k]`` (only the tokens with ``teacher_index == k``,
            in token order). No gradient flows to them.
        teacher_weight: one ``[V_local, H_k]`` LM-head shard per teacher, the same vocab range
            as the student's shard. No gradient flows to them.
        vocab_start: first global vocab id of this rank's shard (``rank_in_group * V_local``).
        vocab_size: the real vocabulary; ids ``>= vocab_size`` are padding, excluded on both sides.
        loss_mask_T: ``[T]`` bool or float weights (``None``: all tokens, weight 1).
        teacher_index_T: ``[T]`` int64/int32 teacher of each token (required with > 1 teacher).
        group: the student's TP group (``None``: no TP, this rank holds the whole vocabulary).
        config: :class:`KLConfig` (``None``: the defaults, reverse KL summed over tokens).
    Returns:
        fp32 scalar (``sum``/``mean``) or ``[T]`` fp32 ``mask * KL`` (``none``), identical on
        every rank of the group.
    Raises:
        ValueError: inconsistent shapes, dtypes, devices, vocab range or group size, before
            any collective. Such an error can be specific to one rank (its ``vocab_start``, its
            shard size); with ``config.debug`` off only that rank raises and the others block in
            the first chunk's all-reduce until ``collective_timeout_s`` (gloo) or the NCCL
            watchdog ends them. With ``config.debug`` on, the failure joins the agreement
            all-reduce and every rank of the group raises the same ValueError.

    ``config.sum_hidden_grad_over_tp`` has no meaning here (there are no hidden states): setting
    it to ``False`` warns once per process.
    """
    config = config or KLConfig()
    if isinstance(config, KLConfig) and not config.sum_hidden_grad_over_tp:
        _warn_once(
            "KLConfig.sum_hidden_grad_over_tp=False is ignored by vocab_parallel_kl (it applies "
            "to fused_vocab_parallel_kl's hidden-state gradient only)"
        )
    return _call(
        _Args(
            student_TX=student_logits_TV,
            student_weight_VH=None,
            teacher_hidden=teacher_hidden,
            teacher_weight=teacher_weight,
            vocab_start=vocab_start,
            vocab_size=vocab_size,
            loss_mask_T=loss_mask_T,
            teacher_index_T=teacher_index_T,
            group=group,
            config=config,
        )
    )


def fused_vocab_parallel_kl(
    student_hidden_TH: torch.Tensor,
    student_weight_VH: torch.Tensor,
    teacher_hidden: torch.Tensor | Sequence[torch.Tensor],
    teacher_weight: torch.Tensor | Sequence[torch.Tensor],
    *,
    vocab_start: int,
    vocab_size: int,
    loss_mask_T: torch.Tensor | None = None,
    teacher_index_T: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    config: KLConfig | None = None,
) -> torch.Tensor:
    """The same loss from the student's hidden states and output-weight shard (fused LM head).

    The student logits are never materialized beyond one ``[C, V_local]`` chunk.

    Args:
        student_hidden_TH: ``[T, H_s]`` student hidden states (TP-replicated, before the LM head).
        student_weight_VH: ``[V_local, H_s]`` this rank's shard of the student's output weight,
            same dtype as ``student_hidden_TH``.
        Other arguments: as :func:`vocab_parallel_kl`.
    Returns:
        As :func:`vocab_parallel_kl`. Gradients flow to ``student_hidden_TH`` (summed over the
        TP group unless ``config.sum_hidden_grad_over_tp`` is off) and ``student_weight_VH``
        (accumulated over chunks in the weight's dtype).
    """
    if not isinstance(student_weight_VH, torch.Tensor):
        raise ValueError(
            f"student_weight_VH must be a torch.Tensor, got {type(student_weight_VH).__name__}"
        )
    return _call(
        _Args(
            student_TX=student_hidden_TH,
            student_weight_VH=student_weight_VH,
            teacher_hidden=teacher_hidden,
            teacher_weight=teacher_weight,
            vocab_start=vocab_start,
            vocab_size=vocab_size,
            loss_mask_T=loss_mask_T,
            teacher_index_T=teacher_index_T,
            group=group,
            config=config or KLConfig(),
        )
    )
