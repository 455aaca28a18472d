"""A micro-batch as the bridge needs it, and its token layout read off Megatron's own objects.

Why this file exists: the bridge joins teacher and student rows by global ``(sample_id,
position)`` keys, and each side's rows follow Megatron's conventions: a padded batch's hidden
states are ``[S_local, B, H]`` (CP zigzag over ``S``), its logits ``[B, S_local, V]``; a packed
(THD) batch is ``[T_local, 1, H]`` / ``[1, T_local, V]`` with each sequence padded and cut into
zigzag chunks as ``PackedSeqParams.cu_seqlens_q_padded`` says. :func:`micro_batch_layout`
derives the layout from a :class:`MicroBatch` and the model's CP (and, for a kept SP slice, TP)
group, so nothing is re-derived by hand.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from mopd.bridge.layout import (
    TokenLayout,
    cp_positions,
    megatron_padded_length,
    packed_layout,
    padded_layout,
)

__all__ = [
    "MicroBatch",
    "Rows",
    "micro_batch_layout",
    "packed_micro_batch",
    "padded_micro_batch",
    "split_samples",
]

#: Which rows a layout describes: ``"hidden"`` the ``[S, B]`` / THD order of hidden states (the
#: teacher's capture; a student's SP slice), ``"logits"`` the ``[B, S]`` / THD order of logits.
Rows = Literal["hidden", "logits"]


def _ints(x: Any) -> list[int]:
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.reshape(-1).tolist()]
    return [int(v) for v in x]


@dataclass(frozen=True, kw_only=True, eq=False)
class MicroBatch:
    """One model's micro-batch on one rank.

    Attributes:
        sample_ids: global sample ids: one per batch column (padded), or one per packed
            sequence in packing order (THD). They link teacher and student rows.
        tokens: ``[B, S_local]`` (padded) or ``[1, T_local]`` (THD) input ids, on ranks that
            embed (first stage); ``None`` elsewhere.
        position_ids: same shape as ``tokens`` (global positions of the local rows).
        attention_mask: megatron's attention mask, if the model takes one.
        lengths: padded batches: the real length of each column (default: all ``seq_len``).
        seq_len: padded batches: the padded length ``S`` before CP (default:
            ``tokens.shape[1] * cp``).
        packed_seq_params: THD: megatron's ``PackedSeqParams`` (``cu_seqlens_q`` the real,
            ``cu_seqlens_q_padded`` the padded global offsets).
        extra: anything the caller's forward function needs.
    """

    sample_ids: Sequence[int] | torch.Tensor
    tokens: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    lengths: Sequence[int] | torch.Tensor | None = None
    seq_len: int | None = None
    packed_seq_params: Any | None = None
    extra: Any = None

    def __post_init__(self) -> None:
        ids = _ints(self.sample_ids)
        if not ids or min(ids) < 0:
            raise ValueError(f"sample_ids must be non-empty and non-negative, got {ids[:8]}")
        if self.packed_seq_params is None and self.seq_len is None and self.tokens is None:
            raise ValueError(
                "a padded MicroBatch needs seq_len (the padded length) or tokens to read it from"
            )

    @property
    def is_packed(self) -> bool:
        return self.packed_seq_params is not None

    def padded_offsets(self) -> Sequence[int] | torch.Tensor:
        """THD: the padded global offsets (``cu_seqlens_q_padded``, else the real ones)."""
        psp = self.packed_seq_params
        assert psp is not None, "padded_offsets is for packed micro-batches"
        cu = psp.cu_seqlens_q_padded
        return psp.cu_seqlens_q if cu is None else cu

    def padded_seq_len(self, cp_size: int) -> int:
        """Padded batches: the padded length ``S`` before CP (``seq_len``, else read from
        ``tokens`` ``[B, S / cp]``)."""
        if self.seq_len is not None:
            return int(self.seq_len)
        assert self.tokens is not None  # __post_init__ demands one of them
        return int(self.tokens.shape[1]) * cp_size


def split_samples(samples: Sequence[int], parts: int, index: int) -> list[int]:
    """Part ``index`` of ``parts`` contiguous near-equal parts of ``samples`` (a DP split of one
    global micro-batch, the earlier parts one longer when it does not divide)."""
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"part {index} of {parts} does not exist")
    q, r = divmod(len(samples), parts)
    start = index * q + min(index, r)
    return list(samples[start : start + q + (1 if index < r else 0)])


def _cp(pg_collection: Any) -> tuple[int, int]:
    cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if cp is None:
        return 1, 0
    return cp.size(), cp.rank()


def micro_batch_layout(
    mb: MicroBatch,
    *,
    rows: Rows,
    pg_collection: Any | None = None,
    cp_size: int | None = None,
    cp_rank: int | None = None,
    sp_size: int = 1,
    sp_rank: int = 0,
) -> TokenLayout:
    """The layout of ``mb``'s rows on this rank.

    Args:
        rows: ``"hidden"`` for hidden states (``[S_local, B]`` order, THD rows), as the teacher's
            capture returns them (SP undone) or as a student keeps its SP slice; ``"logits"``
            for the rows of megatron's logits (``[B, S_local]`` order, THD rows).
        pg_collection: the model's megatron ``ProcessGroupCollection`` (its ``cp`` group gives
            the CP size and rank); or pass ``cp_size`` / ``cp_rank``.
        sp_size, sp_rank: keep only this sequence-parallel slice (a student's TP rank with
            ``keep_sp_shard``); hidden rows only.
    """
    if rows not in ("hidden", "logits"):
        raise ValueError(f"rows must be 'hidden' or 'logits', got {rows!r}")
    if sp_size > 1 and rows != "hidden":
        raise ValueError("an SP slice is a slice of hidden states: use rows='hidden'")
    size, rank = _cp(pg_collection)
    cp_size = size if cp_size is None else cp_size
    cp_rank = rank if cp_rank is None else cp_rank
    ids = _ints(mb.sample_ids)
    if mb.is_packed:
        psp = mb.packed_seq_params
        if getattr(psp, "qkv_format", "thd") != "thd":
            raise ValueError(f"packed_seq_params.qkv_format must be 'thd', got {psp.qkv_format!r}")
        real = _ints(psp.cu_seqlens_q)
        padded = _ints(mb.padded_offsets())
        if len(real) != len(ids) + 1:
            raise ValueError(
                f"{len(ids)} sample ids but cu_seqlens_q has {len(real)} offsets "
                f"(one sample id per packed sequence)"
            )
        lens = [b - a for a, b in itertools.pairwise(real)]
        return packed_layout(
            ids,
            lens,
            cu_seqlens_padded=padded,
            cp_size=cp_size,
            cp_rank=cp_rank,
            sp_size=sp_size,
            sp_rank=sp_rank,
        )
    seq_len = mb.padded_seq_len(cp_size)
    lengths = None if mb.lengths is None else _ints(mb.lengths)
    return padded_layout(
        ids,
        seq_len,
        order="sbh" if rows == "hidden" else "bsh",
        lengths=lengths,
        cp_size=cp_size,
        cp_rank=cp_rank,
        sp_size=sp_size,
        sp_rank=sp_rank,
    )


def padded_micro_batch(
    sample_ids: Sequence[int],
    tokens_BS: torch.Tensor,
    *,
    lengths: Sequence[int] | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    device: torch.device | str | None = None,
) -> MicroBatch:
    """A padded micro-batch as this CP rank feeds it to megatron: its zigzag share of the columns.

    Args:
        tokens_BS: ``[B, S]`` the whole padded sequences (``S`` divisible by ``2 * cp``).
        lengths: real length of each column (default: ``S``).
    """
    S = int(tokens_BS.shape[1])
    pos_S = cp_positions(S, cp_size, cp_rank)
    B = int(tokens_BS.shape[0])
    return MicroBatch(
        sample_ids=list(sample_ids),
        tokens=tokens_BS[:, pos_S].to(device) if device is not None else tokens_BS[:, pos_S],
        position_ids=pos_S.expand(B, -1).to(tokens_BS.device if device is None else device),
        lengths=list(lengths) if lengths is not None else None,
        seq_len=S,
    )


def packed_micro_batch(
    sample_ids: Sequence[int],
    tokens: Sequence[torch.Tensor],
    *,
    cp_size: int = 1,
    cp_rank: int = 0,
    sp_size: int = 1,
    pad_token: int = 0,
    device: torch.device | str | None = None,
) -> MicroBatch:
    """A packed (THD) micro-batch as this CP rank feeds it to megatron.

    Each sequence is padded to megatron's multiple (:func:`~mopd.bridge.layout.
    megatron_padded_length`: ``2 * cp``, times ``sp_size`` = TP under sequence parallelism) and
    this rank takes its zigzag chunks of each, in packing order. The ``PackedSeqParams`` carry
    the real (``cu_seqlens_q``) and padded (``cu_seqlens_q_padded``) global offsets, int32.

    Args:
        tokens: one ``[L_i]`` int64 tensor per sequence.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    lens = [int(t.numel()) for t in tokens]
    padded = [megatron_padded_length(n, cp_size=cp_size, sp_size=sp_size) for n in lens]
    cu_real, cu_pad = [0], [0]
    for n, p in zip(lens, padded, strict=True):
        cu_real.append(cu_real[-1] + n)
        cu_pad.append(cu_pad[-1] + p)
    rows_t, pos_t = [], []
    for t, p in zip(tokens, padded, strict=True):
        full = torch.full((p,), pad_token, dtype=torch.int64)
        full[: t.numel()] = t.reshape(-1).cpu()
        pos = cp_positions(p, cp_size, cp_rank)
        rows_t.append(full[pos])
        pos_t.append(pos)
    dev = device if device is not None else "cpu"
    to32 = {"dtype": torch.int32, "device": dev}
    psp = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=torch.tensor(cu_real, **to32),
        cu_seqlens_kv=torch.tensor(cu_real, **to32),
        cu_seqlens_q_padded=torch.tensor(cu_pad, **to32),
        cu_seqlens_kv_padded=torch.tensor(cu_pad, **to32),
        max_seqlen_q=max(padded),
        max_seqlen_kv=max(padded),
    )
    return MicroBatch(
        sample_ids=list(sample_ids),
        tokens=torch.cat(rows_t)[None].to(dev),
        position_ids=torch.cat(pos_t)[None].to(dev),
        packed_seq_params=psp,
    )
