"""A micro-batch as the bridge needs it, and its token layout read off Megatron's own objects.

Why this file exists: the bridge joins teacher and student rows by global ``(sample_id,
position)`` keys, and each side's rows follow Megatron's conventions: a padded batch's hidden
states are ``[S_local, B, H]`` (CP zigzag over ``S``), its logits ``[B, S_local, V]``; a packed
(THD) batch is ``[T_local, 1, H]`` / ``[1, T_local, V]`` with each sequence padded and cut into
zigzag chunks as ``PackedSeqParams.cu_seqlens_q_padded`` says. :func:`micro_batch_layout`
derives the layout from a :class:`MicroBatch` and the model's CP (and, for a kept SP slice, TP)
group, so nothing is re-derived by hand.

Two on-policy facts live here too. A student's ``loss_mask`` (megatron's own, in the order of
its logits) turns the rows it excludes into padding of the student's layout, so the bridge never
moves them and every count downstream (the loss, ``num_tokens``, the step's global tokens, the
logged mean) sees only counted tokens. A rank with no sample in a micro-batch (routing, fewer
samples than DP ranks) still runs it, on a placeholder: one all-padding column (padded) or one
all-padding sequence (THD), so megatron's pipeline and expert collectives stay in step while
nothing crosses the bridge.
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
    encode_keys,
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
            ``cu_seqlens_q_padded`` the padded global offsets). Trailing zero-length sequences
            (a fixed-capacity packer's repeated last offset) are allowed and hold no sample.
        loss_mask: the student's per-token loss mask, megatron's ``loss_mask`` of this rank:
            ``[B, S_local]`` (padded) or ``[1, T_local]`` (THD), the order of the logits; bool or
            0/1 values. Rows it excludes are not counted by the loss, its token counts or the
            logged mean, and are not sent over the bridge. Only the student's micro-batches
            use it (a teacher sends whatever some student counts).
        extra: anything the caller's forward function needs.

    ``sample_ids`` may be empty: the rank holds no sample of this micro-batch, and ``tokens``
    (if given) is a placeholder whose rows are all padding (:func:`padded_micro_batch` and
    :func:`packed_micro_batch` build one).
    """

    sample_ids: Sequence[int] | torch.Tensor
    tokens: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    lengths: Sequence[int] | torch.Tensor | None = None
    seq_len: int | None = None
    packed_seq_params: Any | None = None
    loss_mask: torch.Tensor | None = None
    extra: Any = None

    def __post_init__(self) -> None:
        ids = _ints(self.sample_ids)
        if ids and min(ids) < 0:
            raise ValueError(f"sample_ids must be non-negative, got {ids[:8]}")
        if self.loss_mask is not None:
            m = self.loss_mask
            if not isinstance(m, torch.Tensor) or m.dim() != 2:
                raise ValueError(
                    "loss_mask must be a 2-D tensor ([B, S_local] or [1, T_local]), got "
                    f"{tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__}"
                )
            if m.dtype != torch.bool and bool(((m != 0) & (m != 1)).any()):
                raise ValueError(
                    "loss_mask must hold bools or 0/1 values (a per-token weight belongs in the "
                    "loss: see TeacherSignal)"
                )
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
    use_loss_mask: bool = True,
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
        use_loss_mask: turn the rows ``mb.loss_mask`` excludes into padding (the student's
            side); ``False`` for the teacher's side, which sends what the student counts.
    """
    if rows not in ("hidden", "logits"):
        raise ValueError(f"rows must be 'hidden' or 'logits', got {rows!r}")
    if sp_size > 1 and rows != "hidden":
        raise ValueError("an SP slice is a slice of hidden states: use rows='hidden'")
    size, rank = _cp(pg_collection)
    cp_size = size if cp_size is None else cp_size
    cp_rank = rank if cp_rank is None else cp_rank
    layout = _layout(mb, rows=rows, cp=(cp_size, cp_rank), sp=(sp_size, sp_rank))
    if mb.loss_mask is None or not use_loss_mask:
        return layout
    logits = layout
    if rows != "logits" or sp_size > 1:
        logits = _layout(mb, rows="logits", cp=(cp_size, cp_rank), sp=(1, 0))
    return _apply_loss_mask(layout, logits, mb.loss_mask)


def _layout(mb: MicroBatch, *, rows: Rows, cp: tuple[int, int], sp: tuple[int, int]) -> TokenLayout:
    """The layout of ``mb``'s rows, loss mask not applied (see :func:`micro_batch_layout`)."""
    cp_size, cp_rank = cp
    ids = _ints(mb.sample_ids)
    if mb.is_packed:
        qkv_format = getattr(mb.packed_seq_params, "qkv_format", "thd")
        if qkv_format != "thd":
            raise ValueError(f"packed_seq_params.qkv_format must be 'thd', got {qkv_format!r}")
        real, padded = _packed_offsets(mb, len(ids))
        lens = [b - a for a, b in itertools.pairwise(real)]
        if not ids:  # a placeholder: its sequences hold no sample, every row is padding
            ids, lens = [0] * len(lens), [0] * len(lens)
        return packed_layout(
            ids,
            lens,
            cu_seqlens_padded=padded,
            cp_size=cp_size,
            cp_rank=cp_rank,
            sp_size=sp[0],
            sp_rank=sp[1],
        )
    seq_len = mb.padded_seq_len(cp_size)
    lengths = None if mb.lengths is None else _ints(mb.lengths)
    if not ids:  # a placeholder: its columns hold no sample, every row is padding
        cols = int(mb.tokens.shape[0]) if mb.tokens is not None else 1
        ids, lengths = [0] * cols, [0] * cols
    return padded_layout(
        ids,
        seq_len,
        order="sbh" if rows == "hidden" else "bsh",
        lengths=lengths,
        cp_size=cp_size,
        cp_rank=cp_rank,
        sp_size=sp[0],
        sp_rank=sp[1],
    )


def _packed_offsets(mb: MicroBatch, n_samples: int) -> tuple[list[int], list[int]]:
    """THD: ``(cu_seqlens_q, cu_seqlens_q_padded)`` as ints, one sequence per sample id.

    A fixed-capacity packer repeats the last offset for unused slots: those trailing
    zero-length sequences are dropped. A micro-batch without samples keeps its (placeholder)
    sequences."""
    assert mb.packed_seq_params is not None  # a packed micro-batch
    real = _ints(mb.packed_seq_params.cu_seqlens_q)
    padded = _ints(mb.padded_offsets())
    if len(real) != len(padded):
        raise ValueError(
            f"cu_seqlens_q has {len(real)} offsets but cu_seqlens_q_padded has {len(padded)}"
        )
    if n_samples == 0:
        return real, padded
    keep = len(real)
    while (
        keep > n_samples + 1
        and real[keep - 1] == real[keep - 2]
        and (padded[keep - 1] == padded[keep - 2])
    ):
        keep -= 1
    if keep != n_samples + 1:
        raise ValueError(
            f"{n_samples} sample ids but cu_seqlens_q has {len(real)} offsets {real[:12]} "
            f"(one sample id per packed sequence; trailing repeated offsets, as fixed-capacity "
            f"packers emit, are dropped when cu_seqlens_q and cu_seqlens_q_padded both repeat)"
        )
    return real[:keep], padded[:keep]


def _apply_loss_mask(
    layout: TokenLayout, logits: TokenLayout, loss_mask: torch.Tensor
) -> TokenLayout:
    """``layout`` with the tokens ``loss_mask`` excludes turned into padding.

    ``loss_mask`` is in the order of ``logits`` (the same micro-batch's ``"logits"`` layout,
    ``[B, S_local]`` or ``[1, T_local]``); ``layout`` may be any order or SP slice of the same
    tokens: excluded tokens are found by key."""
    mask_R = loss_mask.detach().reshape(-1).cpu() != 0
    if mask_R.numel() != logits.num_rows:
        raise ValueError(
            f"loss_mask has shape {tuple(loss_mask.shape)} ({mask_R.numel()} tokens) but the "
            f"micro-batch's logits have {logits.num_rows} rows ([B, S_local] or [1, T_local])"
        )
    real = logits.sample_id_R >= 0
    dropped = real & ~mask_R
    if not bool(dropped.any()):
        return layout
    stride = int(max(int(logits.position_R.max()), int(layout.position_R.max()))) + 1
    gone = encode_keys(logits.sample_id_R[dropped], logits.position_R[dropped], stride)
    keys = encode_keys(layout.sample_id_R, layout.position_R, stride)
    out = (keys >= 0) & torch.isin(keys, gone)
    minus = torch.full((), -1, dtype=torch.int64)
    return TokenLayout(
        sample_id_R=torch.where(out, minus, layout.sample_id_R).contiguous(),
        position_R=torch.where(out, minus, layout.position_R).contiguous(),
    )


def padded_micro_batch(
    sample_ids: Sequence[int],
    tokens_BS: torch.Tensor,
    *,
    lengths: Sequence[int] | None = None,
    loss_mask_BS: torch.Tensor | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    device: torch.device | str | None = None,
) -> MicroBatch:
    """A padded micro-batch as this CP rank feeds it to megatron: its zigzag share of the columns.

    Args:
        sample_ids: ``[B]`` global sample ids; empty when this rank holds no sample of the
            micro-batch: ``tokens_BS`` is then ``[0, S]`` (one placeholder column) or ``[B, S]``
            (``B`` placeholder columns, to keep the shape of the other micro-batches where the
            pipeline needs it), all padding.
        tokens_BS: ``[B, S]`` the whole padded sequences (``S`` divisible by ``2 * cp``).
        lengths: real length of each column (default: ``S``).
        loss_mask_BS: ``[B, S]`` the student's loss mask over the whole sequences (e.g. the
            response tokens); this rank keeps its zigzag share, ``[B, S / cp]``.
    """
    S = int(tokens_BS.shape[1])
    pos_S = cp_positions(S, cp_size, cp_rank)
    dev = tokens_BS.device if device is None else device
    ids = list(sample_ids)
    if not ids:
        tokens_BS = torch.zeros(max(int(tokens_BS.shape[0]), 1), S, dtype=tokens_BS.dtype)
        lengths, loss_mask_BS = None, None
    B = int(tokens_BS.shape[0])
    if len(ids) not in (0, B):
        raise ValueError(f"{len(ids)} sample ids for {B} columns of tokens_BS")
    mask = None
    if loss_mask_BS is not None:
        if tuple(loss_mask_BS.shape) != (B, S):
            raise ValueError(
                f"loss_mask_BS has shape {tuple(loss_mask_BS.shape)}, tokens_BS {(B, S)}"
            )
        mask = loss_mask_BS[:, pos_S.to(loss_mask_BS.device)].to(dev)
    return MicroBatch(
        sample_ids=ids,
        tokens=tokens_BS[:, pos_S.to(tokens_BS.device)].to(dev),
        position_ids=pos_S.expand(B, -1).to(dev),
        lengths=list(lengths) if lengths is not None else None,
        seq_len=S,
        loss_mask=mask,
    )


def packed_micro_batch(
    sample_ids: Sequence[int],
    tokens: Sequence[torch.Tensor],
    *,
    loss_masks: Sequence[torch.Tensor] | None = None,
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
    With no sample (``packed_micro_batch([], [])``) the micro-batch is one placeholder
    sequence of that multiple, all padding (real length 0).

    Args:
        tokens: one ``[L_i]`` int64 tensor per sequence.
        loss_masks: one ``[L_i]`` bool (or 0/1) tensor per sequence: the student's loss mask
            (e.g. its response tokens); packed into ``[1, T_local]``, padding excluded.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    if len(tokens) != len(sample_ids):
        raise ValueError(f"{len(sample_ids)} sample ids but {len(tokens)} token sequences")
    if loss_masks is not None and [int(m.numel()) for m in loss_masks] != [
        int(t.numel()) for t in tokens
    ]:
        raise ValueError(
            f"loss_masks lengths {[int(m.numel()) for m in loss_masks]} differ from the "
            f"sequences' {[int(t.numel()) for t in tokens]}"
        )
    lens = [int(t.numel()) for t in tokens]
    padded = [megatron_padded_length(n, cp_size=cp_size, sp_size=sp_size) for n in lens]
    if not lens:  # a placeholder sequence: real length 0
        lens, padded = [0], [megatron_padded_length(1, cp_size=cp_size, sp_size=sp_size)]
        tokens, loss_masks = [torch.zeros(0, dtype=torch.int64)], None
    cu_real, cu_pad = [0], [0]
    for n, p in zip(lens, padded, strict=True):
        cu_real.append(cu_real[-1] + n)
        cu_pad.append(cu_pad[-1] + p)
    rows_t, pos_t, mask_t = [], [], []
    for k, (t, p) in enumerate(zip(tokens, padded, strict=True)):
        full = torch.full((p,), pad_token, dtype=torch.int64)
        full[: t.numel()] = t.reshape(-1).cpu()
        pos = cp_positions(p, cp_size, cp_rank)
        rows_t.append(full[pos])
        pos_t.append(pos)
        if loss_masks is not None:
            m = torch.zeros(p, dtype=torch.bool)
            m[: t.numel()] = loss_masks[k].reshape(-1).cpu() != 0
            mask_t.append(m[pos])
    dev = device if device is not None else "cpu"

    def to32(offsets: list[int]) -> torch.Tensor:
        return torch.tensor(offsets, dtype=torch.int32, device=dev)

    psp = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=to32(cu_real),
        cu_seqlens_kv=to32(cu_real),
        cu_seqlens_q_padded=to32(cu_pad),
        cu_seqlens_kv_padded=to32(cu_pad),
        max_seqlen_q=max(padded),
        max_seqlen_kv=max(padded),
    )
    return MicroBatch(
        sample_ids=list(sample_ids),
        tokens=torch.cat(rows_t)[None].to(dev),
        position_ids=torch.cat(pos_t)[None].to(dev),
        packed_seq_params=psp,
        loss_mask=torch.cat(mask_t)[None].to(dev) if mask_t else None,
    )
