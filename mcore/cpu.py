"""Running megatron-core on CPU ranks (gloo): the patches it needs and a stand-in attention.

Why this file exists: megatron-core assumes CUDA (buffers on ``torch.cuda.current_device()``,
the RNG tracker on the CUDA generator, ``torch.cuda.synchronize`` in its pipeline schedule, SP only
with fused norms) and its local attention supports neither context parallelism nor packed (THD)
sequences, and its ``HybridModel`` ships a Transformer Engine spec only. The demo and the
multi-process tests run real GPTModels and HybridModels on CPU ranks, so everything that makes
that possible lives here, in one module: :func:`apply` (idempotent, process-wide patches),
:func:`cpu_gpt_layer_spec` (megatron's local layer spec with :class:`CPUCoreAttention`),
:func:`cpu_hybrid_stack_spec` (a ``HybridStack`` of those layers: attention ``*`` and MLP ``-``)
and :func:`quiet` (megatron-core's known notices on a machine without Transformer Engine and
Apex, listed in :data:`QUIETED`; nothing of this library's own).
The data path (capture, bridge, kernels) never imports it; it is for CPU runs only.

What :func:`apply` patches:
- ``torch.cuda.current_device`` returns ``"cpu"`` (megatron allocates with it);
- the "CUDA" RNG state of megatron's tracker is the CPU default generator;
- ``WrappedTorchNorm`` is built with sequence parallelism off and its parameters tagged
  ``sequence_parallel`` (torch's LayerNorm asserts when SP is on; the math is per token);
- ``get_pos_emb_on_this_cp_rank`` without pinned memory, the default causal mask on CPU;
- the pipeline schedules: ``torch.cuda.synchronize`` is a no-op and the schedules' token
  counters (``torch.zeros(..., device="cuda")``) live on the CPU; the interleaved (virtual
  pipeline) schedule refuses, before any communication, PP=2 with ``batch_p2p_comm=True``
  (megatron's default): there the previous and next stage are one rank and gloo swaps its
  activations and gradients silently; ``overlap_p2p_comm=True, batch_p2p_comm=False`` is right;
- megatron's pipeline sends and receives (``pipeline_parallel.p2p_communication``): their
  ``wait()`` waits at most the pipeline group's current timeout. gloo fixes a group's
  point-to-point timeout when the group is made (torch has no call that changes it; a
  collective's follows ``GroupPool.bound_by``), so a pipeline group made by a ``GroupPool()``
  before a ``Distiller`` bounded it would otherwise wait the pool's 300 s, not the Distiller's
  ``timeout_s``, for a stage that stalled or raised;
- the DDP gradient buffers (``distributed.param_and_grad_buffer``): their
  ``torch.cuda.current_stream()`` (asked unconditionally before a gradient reduction since
  megatron-core 0.19) is a stream that has nothing to wait for;
- ``HybridStack``'s final norm (megatron-core 0.18+, ``megatron.core.models.hybrid``), built with
  Transformer Engine's ``TENorm`` by name: without Transformer Engine it is ``WrappedTorchNorm``
  (so the SP rule above holds for it too);
- megatron's fusions (``megatron.core.jit.jit_fuser``, which is ``torch.compile``) are plain
  eager functions: compiled they would build C++ with Inductor at a fusion's first call on a CPU
  rank. Applied before megatron-core is imported, its import also makes no ``torch.compile``
  wrappers, so no rank loads TorchDynamo and Inductor at start-up; applied after, the fusions
  megatron defines from then on are plain;
- mixture of experts: ``te_general_gemm`` is defined (as ``None``, Transformer Engine absent) in
  megatron's ``moe_utils``, whose allgather token dispatcher reads it; use
  ``moe_token_dispatcher_type="allgather"``: the alltoall and flex dispatchers make CUDA streams.

:class:`CPUCoreAttention` (causal self-attention only, no dropout, no bias): under CP
(``pg_collection.cp`` of size ``cp > 1``) K and V are all-gathered over the CP group with
autograd; each local query attends to keys at global positions ``<=`` its own in the same
sequence, positions following megatron's load balancing (2 * cp chunks, CP rank ``r`` holds
chunks ``r`` and ``2 cp - 1 - r``); THD packing (``packed_seq_params.qkv_format == "thd"``) takes
the sequences from ``cu_seqlens_q_padded`` (global, pre-CP offsets). Positions are not applied
here: use learned absolute position embeddings with the global ``position_ids`` of local rows.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import math
import sys
from typing import Any

import torch
import torch.distributed as dist

from mopd.common import dist as cdist

__all__ = [
    "QUIETED",
    "CPUCoreAttention",
    "apply",
    "check_interleaved_p2p",
    "cpu_gpt_layer_spec",
    "cpu_hybrid_stack_spec",
    "packed_rows",
    "quiet",
    "zigzag_positions",
]

_APPLIED = False

#: What :func:`quiet` silences, as ``(category, message regex, module regex)`` warning filters:
#: megatron-core's notices where Transformer Engine and Apex are absent (its CPU ranks), each
#: printed once per rank, and torch's deprecation of the two collectives megatron-core calls by
#: their old names. This library calls neither old name, so none of its own warnings match.
QUIETED: tuple[tuple[type[Warning], str, str], ...] = (
    (UserWarning, r"Transformer Engine and Apex are not installed", r"megatron\."),
    (UserWarning, r"Apex is not installed\. Falling back to Torch Norm", r"megatron\."),
    (UserWarning, r"When using [\w ]+ it is recommended to set the environment variable "
     r"CUDA_DEVICE_MAX_CONNECTIONS", r"megatron\."),
    (UserWarning, r"full scope is deprecated\. Use empty cuda_graph_scope", r"megatron\."),
    (FutureWarning, r"`torch\.distributed\.all_gather_into_tensor` is deprecated", r"torch\."),
    (FutureWarning, r"`torch\.distributed\.reduce_scatter_tensor` is deprecated", r"torch\."),
)  # fmt: skip


def quiet() -> None:
    """Silence megatron-core's known notices on CPU ranks (the filters of :data:`QUIETED`).

    Exactly these, each once per rank otherwise: "Transformer Engine and Apex are not
    installed" (several forms, at import) and "Apex is not installed. Falling back to Torch
    Norm" (at import and per model), megatron's CUDA_DEVICE_MAX_CONNECTIONS advice (for
    sequence parallelism and for async gradient all-reduce; CUDA-only) and its "full scope is
    deprecated" note on its own default ``cuda_graph_scope``, and torch's ``FutureWarning`` that
    ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` are deprecated (megatron-core calls
    them; this library calls their new names). Every other warning stays, this library's
    included. Call it before importing megatron-core (its import-time notices) or at any point
    for the rest; idempotent.
    """
    import warnings

    for category, message, module in QUIETED:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def apply() -> None:
    """Apply the CPU patches (idempotent)."""
    global _APPLIED
    if _APPLIED:
        return
    _plain_fusions()
    import megatron.core.tensor_parallel.random as mrandom
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import torch_norm

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]

    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(state)

    torch.cuda.get_rng_state = get_rng_state  # type: ignore[assignment]
    torch.cuda.random.get_rng_state = get_rng_state  # type: ignore[assignment]

    def manual_seed(seed: int) -> None:
        torch.default_generator.manual_seed(int(seed))

    torch.cuda.manual_seed = manual_seed  # type: ignore[assignment]
    torch.cuda.manual_seed_all = manual_seed  # type: ignore[assignment]
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state()
    )
    mrandom._set_cuda_rng_state = set_rng_state

    original_new = torch_norm.WrappedTorchNorm.__new__

    def norm_new(cls, config, hidden_size, eps=1e-5, **kwargs):
        sp = config.sequence_parallel
        cfg = dataclasses.replace(config, sequence_parallel=False) if sp else config
        norm = original_new(cls, cfg, hidden_size, eps, **kwargs)
        if sp:
            for p in norm.parameters():
                p.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = norm_new  # type: ignore[method-assign]

    def pos_emb_on_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1])
        pos_emb = pos_emb.view(
            *pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1 :]
        )
        pos_emb = pos_emb.index_select(seq_dim, idx)
        return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2 :])

    rope_utils.get_pos_emb_on_this_cp_rank = pos_emb_on_cp_rank

    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tutils

    def causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    tutils.get_default_causal_mask = causal_mask
    fused_softmax.get_default_causal_mask = causal_mask
    _patch_schedules()
    _patch_p2p()
    _patch_moe()
    _patch_hybrid()
    _APPLIED = True


def _uncompiled(model: Any = None, **kwargs: Any) -> Any:
    """``torch.compile`` while megatron-core is imported by :func:`_plain_fusions`: the function
    itself (``@torch.compile`` and ``torch.compile(fn)``) or, called bare, a decorator that is."""
    return model if model is not None else (lambda fn: fn)


def _plain_fusions() -> None:
    """megatron-core's ``jit_fuser`` a no-op decorator; megatron-core imported under
    :func:`_uncompiled` first where it is not imported yet (its modules apply ``jit_fuser`` as
    they load)."""
    if "megatron.core" not in sys.modules:
        compile_ = torch.compile
        torch.compile = _uncompiled  # type: ignore[assignment]
        try:
            import megatron.core  # noqa: F401 (imported here, its fusions uncompiled)
        finally:
            torch.compile = compile_  # type: ignore[assignment]
    from megatron.core import jit

    jit.disable_jit_fuser()


def _on_cpu(device: Any) -> Any:
    if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
        return "cpu"
    return device


class _NoStream:
    """The "current CUDA stream" of a CPU rank: its work is done when a call returns."""

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _CpuCuda:
    """``torch.cuda`` as megatron's modules see it on CPU ranks: ``current_stream()`` is a
    :class:`_NoStream`; everything else is ``torch.cuda`` itself."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_stream(device: Any = None) -> _NoStream:
        return _NoStream()


class _CpuTorch:
    """``torch`` for megatron's schedule and gradient-buffer modules: token counters made with
    ``device="cuda"`` live on the CPU and ``torch.cuda.current_stream()`` is a :class:`_NoStream`."""

    cuda = _CpuCuda()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, device=_on_cpu(device), **kwargs)

    @staticmethod
    def tensor(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.tensor(*args, device=_on_cpu(device), **kwargs)


def _patch_schedules() -> None:
    """megatron's pipeline schedules and DDP gradient buffers on CPU: no device syncs, token
    counters on the CPU, no stream to wait on."""
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.pipeline_parallel import schedules

    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    schedules.torch = _CpuTorch()  # type: ignore[attr-defined]
    param_and_grad_buffer.torch = _CpuTorch()  # type: ignore[attr-defined]
    interleaved = schedules.forward_backward_pipelining_with_interleaving

    def checked_interleaved(**kwargs: Any) -> Any:
        check_interleaved_p2p(
            kwargs.get("model"), kwargs.get("p2p_communicator"), kwargs.get("pg_collection")
        )
        return interleaved(**kwargs)

    schedules.forward_backward_pipelining_with_interleaving = checked_interleaved


def _group_timeout(group: Any) -> datetime.timedelta | None:
    """``group``'s current timeout on the CPU (what its collectives wait, and what
    ``GroupPool.bound_by`` sets), or ``None`` where it cannot be read."""
    try:
        timeout = group._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # not a gloo group, or another torch
        return None
    return timeout if isinstance(timeout, datetime.timedelta) else None


class _BoundedWork:
    """A point-to-point work whose ``wait()`` without a timeout waits at most ``timeout``."""

    def __init__(self, work: Any, timeout: datetime.timedelta | None) -> None:
        self._work = work
        self._timeout = timeout

    def wait(self, timeout: datetime.timedelta | None = None) -> Any:
        timeout = timeout if timeout is not None else self._timeout
        return self._work.wait() if timeout is None else self._work.wait(timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _bounded(works: Any, group: Any) -> Any:
    """``works`` (a list or a dict of them) with each ``wait()`` bounded by ``group``'s
    current timeout."""
    timeout = _group_timeout(group if group is not None else dist.group.WORLD)
    if isinstance(works, dict):
        return {k: _BoundedWork(w, timeout) for k, w in works.items()}
    return [_BoundedWork(w, timeout) for w in works]


class _P2PDistributed:
    """``torch.distributed`` for megatron's p2p module: ``batch_isend_irecv`` returns bounded
    works (:class:`_BoundedWork`); everything else is ``torch.distributed`` itself."""

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    @staticmethod
    def batch_isend_irecv(ops: list[Any]) -> Any:
        return _bounded(dist.batch_isend_irecv(ops), ops[0].group if ops else None)


class _P2PTorch:
    """``torch`` for megatron's p2p module (its ``distributed`` is :class:`_P2PDistributed`)."""

    distributed = _P2PDistributed()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _patch_p2p() -> None:
    """megatron's pipeline waits bounded by the pipeline group's current timeout: its batched
    sends and receives (and their shapes') through :class:`_P2PTorch`, its unbatched ones
    (``batch_p2p_comm=False``, over the pipeline group or, at PP=2, the world) by their
    caller's group."""
    from megatron.core.pipeline_parallel import p2p_communication

    p2p_communication.torch = _P2PTorch()  # type: ignore[attr-defined]
    unbatched = p2p_communication._p2p_ops

    def bounded_p2p_ops(**kwargs: Any) -> Any:
        return _bounded(unbatched(**kwargs), kwargs.get("group"))

    p2p_communication._p2p_ops = bounded_p2p_ops


def check_interleaved_p2p(model: Any, p2p_communicator: Any, pg_collection: Any) -> None:
    """Refuse megatron's interleaved schedule on CPU (gloo) ranks where it corrupts silently.

    At PP=2 the previous and the next stage are the same rank, and with ``batch_p2p_comm=True``
    (megatron's default) gloo pairs the batched sends and receives of both directions wrongly:
    activations and gradients are swapped without an error. Raises ``ValueError`` (the same on
    every rank: the config and the pipeline size are) before any communication.
    """
    from megatron.core import parallel_state
    from megatron.core.utils import get_model_config

    chunks = model if isinstance(model, list | tuple) else [model]
    config = get_model_config(chunks[0])
    if p2p_communicator is not None:
        pp = p2p_communicator.pp_group.size()
    elif pg_collection is not None:
        pp = pg_collection.pp.size()
    else:
        pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp == 2 and getattr(config, "batch_p2p_comm", False):
        raise ValueError(
            "megatron's interleaved (virtual pipeline) schedule at pipeline size 2 with "
            "batch_p2p_comm=True swaps activations and gradients silently on CPU (gloo) ranks: "
            "set overlap_p2p_comm=True and batch_p2p_comm=False in the TransformerConfig"
        )


def _patch_moe() -> None:
    """megatron's MoE utilities without Transformer Engine: ``te_general_gemm`` is read by name."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]


def _patch_hybrid() -> None:
    """``HybridStack``'s final norm without Transformer Engine (megatron-core releases that have
    ``megatron.core.models.hybrid``; nothing to do before them)."""
    import importlib.util

    if importlib.util.find_spec("megatron.core.models.hybrid") is None:
        return
    from megatron.core.extensions import transformer_engine
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if not getattr(transformer_engine, "HAVE_TE", False):
        hybrid_block.TENorm = WrappedTorchNorm  # type: ignore[misc]


def zigzag_positions(length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """``[length / cp]`` int64 positions that CP rank ``cp_rank`` holds of a sequence of ``length``.

    Chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` of ``2 * cp_size`` equal chunks
    (``arange(length)`` when ``cp_size == 1``).
    """
    if cp_size == 1:
        return torch.arange(length, dtype=torch.int64)
    if length % (2 * cp_size):
        raise ValueError(f"length {length} is not divisible by 2*cp = {2 * cp_size}")
    chunk = length // (2 * cp_size)
    late = 2 * cp_size - 1 - cp_rank
    return torch.cat(
        [
            torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, dtype=torch.int64),
            torch.arange(late * chunk, (late + 1) * chunk, dtype=torch.int64),
        ]
    )


def packed_rows(
    cu_seqlens_padded: torch.Tensor | list[int], cp_size: int, cp_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(seq_T, pos_T)``: sequence index and global position of each local THD row.

    ``cu_seqlens_padded`` are the ``[N + 1]`` global (pre-CP) padded offsets; CP rank ``cp_rank``
    holds, for each sequence in order, its zigzag positions (``T = cu[-1] / cp`` rows in all).
    """
    cu = torch.as_tensor(cu_seqlens_padded, dtype=torch.int64).cpu().tolist()
    seqs, poss = [], []
    for i in range(len(cu) - 1):
        p = zigzag_positions(cu[i + 1] - cu[i], cp_size, cp_rank)
        poss.append(p)
        seqs.append(torch.full_like(p, i))
    if not poss:
        empty = torch.empty(0, dtype=torch.int64)
        return empty, empty.clone()
    return torch.cat(seqs), torch.cat(poss)


class _GatherCP(torch.autograd.Function):
    """All-gather along dim 0 over a group; backward sums the gradient over the group and keeps
    this rank's slice (``torch.distributed.nn.functional.all_gather``'s gloo backward passes
    group ranks where global ranks are expected, so it fails on subgroups)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        ctx.rows = x.shape[0]
        world = dist.get_world_size(group)
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        cdist.all_gather_into(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        r = dist.get_rank(ctx.group)
        return grad[r * ctx.rows : (r + 1) * ctx.rows], None


def _gather_cp(x: torch.Tensor, cp_group: Any) -> torch.Tensor:
    """All-gather ``x`` (``[rows, ...]``) along dim 0 over ``cp_group`` (rank order), with autograd."""
    return _GatherCP.apply(x, cp_group)


class CPUCoreAttention(torch.nn.Module):
    """Causal core attention with CP (K/V all-gather) and THD packing; megatron's signature.

    Inputs (megatron's, per TP rank: ``np`` query heads, ``ng`` KV groups, ``hn`` head dim):
    ``[S_local, B, np, hn]`` query and ``[S_local, B, ng, hn]`` key/value for padded batches, or
    ``[T_local, np, hn]`` / ``[T_local, ng, hn]`` under THD packing. Output ``[S_local, B, np * hn]``
    or ``[T_local, np * hn]``.
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__()
        from megatron.core.transformer.enums import AttnMaskType

        if attention_type != "self":
            raise ValueError(
                f"CPUCoreAttention supports self-attention only, got {attention_type!r}"
            )
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"CPUCoreAttention is causal only, got {attn_mask_type}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(
                f"CPUCoreAttention has no dropout; set attention_dropout=0, got {dropout}"
            )
        self.config = config
        self.layer_number = layer_number
        self.cp_group = None if pg_collection is None else getattr(pg_collection, "cp", None)
        head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
        scale = softmax_scale if softmax_scale is not None else config.softmax_scale
        self.softmax_scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)

    def _cp(self) -> tuple[int, int]:
        if self.cp_group is None:
            return 1, 0
        return dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """Attention output (see the class doc for shapes)."""
        if attention_bias is not None:
            raise ValueError("CPUCoreAttention takes no attention_bias")
        cp_size, cp_rank = self._cp()
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if thd:
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            cu = torch.as_tensor(cu).cpu()
            if int(cu[-1]) != query.shape[0] * cp_size:
                raise ValueError(
                    f"THD: cu_seqlens_q_padded ends at {int(cu[-1])} but the local rows "
                    f"({query.shape[0]}) times cp ({cp_size}) are {query.shape[0] * cp_size}"
                )
            keys = [packed_rows(cu, cp_size, r) for r in range(cp_size)]
            seq_q, pos_q = keys[cp_rank]
            seq_k = torch.cat([s for s, _ in keys])
            pos_k = torch.cat([p for _, p in keys])
        else:
            if attention_mask is not None and cp_size > 1:
                raise ValueError(
                    "CPUCoreAttention under CP builds its own causal mask; pass attention_mask=None"
                )
            s_full = query.shape[0] * cp_size
            parts = [zigzag_positions(s_full, cp_size, r) for r in range(cp_size)]
            pos_q = parts[cp_rank]
            pos_k = torch.cat(parts)
            seq_q = torch.zeros_like(pos_q)
            seq_k = torch.zeros_like(pos_k)
        if cp_size > 1:
            key = _gather_cp(key, self.cp_group)
            value = _gather_cp(value, self.cp_group)
        heads, groups = query.shape[-2], key.shape[-2]
        if heads != groups:
            key = key.repeat_interleave(heads // groups, dim=-2)
            value = value.repeat_interleave(heads // groups, dim=-2)
        allowed_QK = (seq_q[:, None] == seq_k[None, :]) & (pos_k[None, :] <= pos_q[:, None])
        allowed_QK = allowed_QK.to(query.device)
        if thd:
            scores = torch.einsum("qhd,khd->hqk", query, key) * self.softmax_scale
            scores = scores.masked_fill(~allowed_QK, float("-inf"))
            out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), value)
            return out.reshape(out.shape[0], -1)
        scores = torch.einsum("sbhd,kbhd->bhsk", query, key) * self.softmax_scale
        if attention_mask is not None:  # megatron's convention: True = masked out, [B|1, 1, S, S]
            scores = scores.masked_fill(attention_mask.bool(), float("-inf"))
        scores = scores.masked_fill(~allowed_QK, float("-inf"))
        out = torch.einsum("bhsk,kbhd->sbhd", torch.softmax(scores, dim=-1), value)
        return out.reshape(out.shape[0], out.shape[1], -1)


def cpu_gpt_layer_spec() -> Any:
    """megatron's local GPT layer spec with :class:`CPUCoreAttention` as the core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = copy.deepcopy(get_gpt_layer_local_spec())
    spec.submodules.self_attention.submodules.core_attention = CPUCoreAttention
    return spec


def cpu_hybrid_stack_spec() -> Any:
    """A ``HybridStack`` spec for ``HybridModel(hybrid_stack_spec=...)`` on CPU ranks.

    Layers of a ``hybrid_layer_pattern`` made of ``*`` (attention) and ``-`` (MLP), both from
    :func:`cpu_gpt_layer_spec`: an attention layer is that layer with its MLP removed, an MLP
    layer (megatron's ``MLPLayer``) its pre-MLP norm, MLP and residual add. The other kinds
    (``M`` Mamba, ``G`` gated delta net, ``D`` / ``+`` latent attention, ``E`` MoE) have no CPU
    version here: building one raises ``ValueError`` naming it (megatron's default for a kind
    left out is an identity layer, a silently different model). megatron-core 0.18+
    (``megatron.core.models.hybrid``); call :func:`apply` first (the stack's final norm).

    Raises:
        ImportError: this megatron-core has no ``megatron.core.models.hybrid``.
    """
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    layer = cpu_gpt_layer_spec()
    parts = layer.submodules
    keys = parts.sharded_state_dict_keys_map  # checkpoint names of the norms, per layer kind
    attention = ModuleSpec(
        module=layer.module,
        submodules=dataclasses.replace(
            parts,
            pre_mlp_layernorm=IdentityOp,
            mlp=IdentityOp,
            mlp_bda=IdentityFuncOp,
            sharded_state_dict_keys_map={
                k: v for k, v in keys.items() if k.startswith("input_layernorm")
            },
        ),
    )
    mlp = ModuleSpec(
        module=MLPLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=parts.pre_mlp_layernorm,
            mlp=parts.mlp,
            mlp_bda=parts.mlp_bda,
            sharded_state_dict_keys_map={
                k: v for k, v in keys.items() if k.startswith("pre_mlp_layernorm")
            },
        ),
    )
    kinds = {f.name for f in dataclasses.fields(HybridStackSubmodules)}
    refused = {
        field: ModuleSpec(module=_NoCPULayer, params={"kind": kind})
        for field, kind in _NO_CPU_LAYERS.items()
        if field in kinds  # the kinds this megatron-core release knows
    }
    return ModuleSpec(
        module=HybridStack,
        submodules=HybridStackSubmodules(attention_layer=attention, mlp_layer=mlp, **refused),
    )


#: ``HybridStackSubmodules`` field -> the layer kind it builds, for the kinds with no CPU spec.
_NO_CPU_LAYERS = {
    "mamba_layer": "Mamba ('M')",
    "gdn_layer": "gated delta net ('G')",
    "dsa_layer": "DeepSeek sparse attention ('D')",
    "mla_layer": "multi-latent attention ('+')",
    "moe_layer": "mixture-of-experts ('E')",
}


class _NoCPULayer(torch.nn.Module):
    """Stands in :func:`cpu_hybrid_stack_spec` for a layer kind it has no CPU version of."""

    def __init__(self, *args: Any, kind: str, **kwargs: Any) -> None:
        raise ValueError(
            f"cpu_hybrid_stack_spec has no CPU version of {kind} layers (they need CUDA kernels "
            "or Transformer Engine): use '*' (attention) and '-' (MLP) in the "
            "hybrid_layer_pattern on CPU ranks, megatron's hybrid_stack_spec on GPUs"
        )
