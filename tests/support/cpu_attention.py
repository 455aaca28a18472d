"""A stand-in core attention for megatron-core on CPU: context parallelism (zigzag) and THD packing.

Why this file exists: megatron-core's local ``DotProductAttention`` supports neither context
parallelism nor packed (THD) sequences; those need Transformer Engine, which does not run on CPU.
The CPU demo and tier-2 tests need a student with CP and packing, so this module provides a plain
torch core attention with megatron's ``core_attention`` signature, and a GPT layer spec that uses it.

What it computes (causal self-attention only, no dropout, no bias):

- under CP (``pg_collection.cp`` of size ``cp > 1``), K and V are all-gathered over the CP group
  with autograd (backward: all-reduce of the gradient, each rank keeps its slice), so gradients
  flow back to the CP rank that produced them;
- each local query row attends to the keys at global positions ``<=`` its own, in the same
  sequence. Positions follow megatron's load balancing: a sequence of (padded) length ``P`` is
  cut into ``2 * cp`` chunks and CP rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``;
- THD packing (``packed_seq_params.qkv_format == "thd"``): ``cu_seqlens_q_padded`` (global,
  pre-CP offsets) gives the sequences; the mask is block-diagonal by sequence, and each sequence
  is cut into zigzag chunks on its own; padding rows are ordinary rows of their sequence (they
  come after its real tokens, so no real token sees them);
- ``[S, B]`` padded batches: the whole ``S`` (``S_local * cp``) is cut in zigzag chunks.

Positions are not applied here: use learned absolute position embeddings and pass the global
``position_ids`` of the local rows (this avoids RoPE's CP code).
The library never imports this module (only the demo does, from the checkout).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "CPUCoreAttention",
    "cpu_gpt_layer_spec",
    "packed_rows",
    "zigzag_positions",
]


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
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
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
            seq_q, pos_q = packed_rows(cu, cp_size, cp_rank)
            keys = [packed_rows(cu, cp_size, r) for r in range(cp_size)]
            seq_k = torch.cat([s for s, _ in keys])
            pos_k = torch.cat([p for _, p in keys])
        else:
            if attention_mask is not None and cp_size > 1:
                raise ValueError(
                    "CPUCoreAttention under CP builds its own causal mask; pass attention_mask=None"
                )
            s_full = query.shape[0] * cp_size
            pos_q = zigzag_positions(s_full, cp_size, cp_rank)
            pos_k = torch.cat([zigzag_positions(s_full, cp_size, r) for r in range(cp_size)])
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
