"""A micro-batch as the bridge needs it, and its token layout read off Megatron's own objects.

Why this file exists: the bridge joins teacher and student rows by global ``(sample_id,
position)`` keys, and each side's rows follow Megatron's conventions: a padded batch's hidden
states are ``[S_local, B, H]`` (CP zigzag over ``S``), its logits ``[B, S_local, V]``; a packed
(THD) batch is ``[T_local, 1, H]`` / ``[1, T_local, V]`` with each sequence padded and cut into
zigzag chunks as ``PackedSeqParams.cu_seqlens_q_padded`` says. :func:`micro_batch_layout`
derives the layout from a :class:`MicroBatch` and the model's CP (and, for a kept SP slice, TP)
group, so nothing is re-derived by hand.

Rows and tokens: logit row ``p`` predicts token ``p + 1``. A *response mask* is token-aligned
(which tokens the student sampled); the *row mask* is row-aligned (megatron's ``loss_mask``):
row ``p`` counts exactly when token ``p + 1`` is a response token, and the last row of a
sequence, which predicts nothing, never counts. The builders here take either, by those names
(``response_mask_BS`` / ``response_masks``, ``row_mask_BS`` / ``row_masks``), derive the row mask
from whole sequences before the CP split (a row's next token may sit on another CP rank), and
give the row-aligned next tokens as ``labels`` (megatron's ``labels``), so no caller shifts
anything by hand.

Two on-policy facts live here too. A student's row mask (:attr:`MicroBatch.loss_mask`) turns the
rows it excludes into padding of the student's layout, so the bridge never moves them and every
count downstream (the loss, ``num_tokens``, the step's global tokens, the logged mean) sees only
counted rows. A rank with no sample in a micro-batch (routing, fewer
samples than DP ranks) still runs it, on a placeholder: one all-padding column (padded) or one
all-padding sequence (THD), so megatron's pipeline and expert collectives stay in step while
nothing crosses the bridge.
"""

from __future__ import annotations

import itertools
import numbers
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from mopd.bridge.layout import (
    TokenLayout,
    cp_positions,
    megatron_padded_length,
    packed_layout,
    padded_layout,
    token_keys,
)

__all__ = [
    "ID_LIMIT",
    "MicroBatch",
    "Rows",
    "micro_batch_layout",
    "packed_micro_batch",
    "padded_micro_batch",
    "row_mask_from_response",
    "sample_id_problem",
    "split_samples",
]

#: Which rows a layout describes: ``"hidden"`` the ``[S, B]`` / THD order of hidden states (the
#: teacher's capture; a student's SP slice), ``"logits"`` the ``[B, S]`` / THD order of logits.
Rows = Literal["hidden", "logits"]


#: Sample ids lie in ``[0, ID_LIMIT)``: every non-negative int64 (the loss never depends on
#: their values, only on which rows share one).
ID_LIMIT = 2**63


def _is_int(v: Any) -> bool:
    """An integer, not a bool: a Python or NumPy integer, or a 0-d integer tensor."""
    if isinstance(v, torch.Tensor):
        return (
            v.dim() == 0
            and not v.dtype.is_floating_point
            and not v.dtype.is_complex
            and v.dtype != torch.bool
        )
    return isinstance(v, numbers.Integral) and not isinstance(v, bool | np.bool_)


def _shown(v: Any, limit: int = 40) -> str:
    """``repr(v)`` for a message, cut to ``limit`` characters."""
    text = repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def sample_id_problem(sample_ids: Any) -> str | None:
    """What is wrong with ``sample_ids`` (``None``: nothing), naming the first bad entry: an
    integer tensor or a sequence of integers (no floats, bools or strings: ``2.5`` is not
    taken as ``2``), each in ``[0, 2**63)``. Local, never raises."""
    if isinstance(sample_ids, torch.Tensor):
        if sample_ids.device.type == "meta":
            return "sample_ids is a tensor on the meta device (it holds no values)"
        if (
            sample_ids.dtype.is_floating_point
            or sample_ids.dtype.is_complex
            or (sample_ids.dtype == torch.bool)
        ):
            return f"sample_ids is a {sample_ids.dtype} tensor: give integers"
        values: list[Any] = sample_ids.reshape(-1).tolist()
    elif isinstance(sample_ids, Sequence) and not isinstance(sample_ids, str | bytes):
        values = list(sample_ids)
    else:
        return f"sample_ids is a {type(sample_ids).__name__}: give a list or tensor of integers"
    for j, v in enumerate(values):
        if not _is_int(v):
            return f"sample_ids[{j}] is {_shown(v)} ({type(v).__name__}): give integers"
        if not 0 <= int(v) < ID_LIMIT:
            return (
                f"sample_ids[{j}] is {_shown(int(v))}, outside [0, 2**63) (a sample id is a "
                "non-negative int64)"
            )
    return None


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
        loss_mask: the student's row mask, megatron's ``loss_mask`` of this rank, row-aligned
            (row ``p`` counts when the token it predicts, ``p + 1``, does): ``[B, S_local]``
            (padded) or ``[1, T_local]`` (THD), the order of the logits; bool or 0/1 values.
            Rows it excludes are not counted by the loss, its token counts or the logged mean,
            and are not sent over the bridge. Only the student's micro-batches use it (a
            teacher sends whatever some student counts). :func:`padded_micro_batch` and
            :func:`packed_micro_batch` derive it from a token-aligned response mask.
        labels: megatron's ``labels``, row-aligned: row ``p``'s is token ``p + 1`` of the same
            sequence (``0`` where there is none: a sequence's last row, padding); the shape of
            ``tokens``, on this rank's rows.
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
    labels: torch.Tensor | None = None
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
        if self.labels is not None and (
            self.tokens is None or tuple(self.labels.shape) != tuple(self.tokens.shape)
        ):
            raise ValueError(
                f"labels {tuple(self.labels.shape)} must have the shape of tokens "
                f"{None if self.tokens is None else tuple(self.tokens.shape)}"
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
    gone, keys = token_keys(
        [logits.sample_id_R[dropped], layout.sample_id_R],
        [logits.position_R[dropped], layout.position_R],
    )
    out = (keys >= 0) & torch.isin(keys, gone)
    minus = torch.full((), -1, dtype=torch.int64)
    return TokenLayout(
        sample_id_R=torch.where(out, minus, layout.sample_id_R).contiguous(),
        position_R=torch.where(out, minus, layout.position_R).contiguous(),
    )


def row_mask_from_response(response_L: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """The row-aligned mask of a token-aligned response mask: ``[L]`` bool, row ``p`` true
    exactly when token ``p + 1`` is a response token and lies within the sequence's first
    ``length`` tokens (default ``L``); the last real row never counts.

    Args:
        response_L: ``[L]`` bool (or 0/1): which tokens are the response (token-aligned).
        length: the sequence's real length (the rest is padding).
    """
    resp = response_L.reshape(-1) != 0
    n = int(resp.numel()) if length is None else int(length)
    row = torch.zeros(resp.numel(), dtype=torch.bool)
    if n > 1:
        row[: n - 1] = resp[1:n].cpu()
    return row


def _next_tokens(tokens_L: torch.Tensor, length: int) -> torch.Tensor:
    """``[L]`` row-aligned labels: row ``p``'s is token ``p + 1`` for ``p + 1 < length``, else 0."""
    flat = tokens_L.reshape(-1)
    out = torch.zeros_like(flat)
    if length > 1:
        out[: length - 1] = flat[1:length]
    return out


def _which_mask(
    response: Any, row: Any, legacy: Any, *, legacy_name: str, row_name: str
) -> tuple[Any, bool]:
    """``(mask, token_aligned)`` of the one mask argument given (``(None, False)`` if none);
    ``legacy`` (the old name) is the row-aligned one, with a ``DeprecationWarning``."""
    if legacy is not None:
        warnings.warn(
            f"{legacy_name} is deprecated: it is row-aligned (megatron's loss_mask), so pass it "
            f"as {row_name}, or pass the response tokens (token-aligned) and let the row mask "
            "be derived",
            DeprecationWarning,
            stacklevel=3,
        )
        if row is not None:
            raise ValueError(f"give {row_name} or {legacy_name}, not both")
        row = legacy
    if response is not None and row is not None:
        raise ValueError(
            "give the response mask (token-aligned) or the row mask (row-aligned), not both"
        )
    if response is not None:
        return response, True
    return row, False


def padded_micro_batch(
    sample_ids: Sequence[int],
    tokens_BS: torch.Tensor,
    *,
    lengths: Sequence[int] | None = None,
    response_mask_BS: torch.Tensor | None = None,
    row_mask_BS: torch.Tensor | None = None,
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
        response_mask_BS: ``[B, S]`` token-aligned: the response tokens (those the student
            sampled) over the whole sequences; the row mask is derived from it (row ``p``
            counts when token ``p + 1`` is a response token).
        row_mask_BS: ``[B, S]`` row-aligned, megatron's ``loss_mask`` over the whole sequences
            (row ``p`` counts for the token ``p + 1`` it predicts). At most one of the two.
        loss_mask_BS: the old name of ``row_mask_BS`` (deprecated).
    Returns:
        The :class:`MicroBatch` of this CP rank: ``tokens``, ``position_ids``, ``labels``
        (row-aligned next tokens) and ``loss_mask`` (the row mask), each ``[B, S / cp]``.
    """
    mask_BS, token_aligned = _which_mask(
        response_mask_BS,
        row_mask_BS,
        loss_mask_BS,
        legacy_name="loss_mask_BS",
        row_name="row_mask_BS",
    )
    S = int(tokens_BS.shape[1])
    pos_S = cp_positions(S, cp_size, cp_rank)
    dev = tokens_BS.device if device is None else device
    ids = list(sample_ids)
    if not ids:
        tokens_BS = torch.zeros(max(int(tokens_BS.shape[0]), 1), S, dtype=tokens_BS.dtype)
        lengths, mask_BS = None, None
    B = int(tokens_BS.shape[0])
    if len(ids) not in (0, B):
        raise ValueError(f"{len(ids)} sample ids for {B} columns of tokens_BS")
    lens = [S] * B if lengths is None or not ids else [int(n) for n in lengths]
    if len(lens) != B:
        raise ValueError(f"{len(lens)} lengths for {B} columns of tokens_BS")
    mask = None
    if mask_BS is not None:
        if tuple(mask_BS.shape) != (B, S):
            name = "response_mask_BS" if token_aligned else "row_mask_BS"
            raise ValueError(f"{name} has shape {tuple(mask_BS.shape)}, tokens_BS {(B, S)}")
        if token_aligned:
            mask_BS = torch.stack([row_mask_from_response(mask_BS[b], lens[b]) for b in range(B)])
        mask = mask_BS[:, pos_S.to(mask_BS.device)].to(dev)
    labels_BS = torch.zeros_like(tokens_BS)
    if ids:
        cpu = tokens_BS.cpu()
        labels_BS = torch.stack([_next_tokens(cpu[b], lens[b]) for b in range(B)])
    return MicroBatch(
        sample_ids=ids,
        tokens=tokens_BS[:, pos_S.to(tokens_BS.device)].to(dev),
        position_ids=pos_S.expand(B, -1).to(dev),
        lengths=list(lengths) if lengths is not None and ids else None,
        seq_len=S,
        loss_mask=mask,
        labels=labels_BS[:, pos_S].to(dev),
    )


def packed_micro_batch(
    sample_ids: Sequence[int],
    tokens: Sequence[torch.Tensor],
    *,
    response_masks: Sequence[torch.Tensor] | None = None,
    row_masks: Sequence[torch.Tensor] | None = None,
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
        response_masks: one ``[L_i]`` bool (or 0/1) tensor per sequence, token-aligned: the
            response tokens; the row mask is derived (row ``p`` counts when token ``p + 1``
            is a response token).
        row_masks: one ``[L_i]`` per sequence, row-aligned (megatron's ``loss_mask``). At most
            one of the two.
        loss_masks: the old name of ``row_masks`` (deprecated).
    Returns:
        The :class:`MicroBatch` of this CP rank: ``[1, T_local]`` ``tokens``,
        ``position_ids``, ``labels`` (row-aligned next tokens, within each sequence) and
        ``loss_mask`` (the row mask, padding excluded).
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    masks, token_aligned = _which_mask(
        response_masks, row_masks, loss_masks, legacy_name="loss_masks", row_name="row_masks"
    )
    if len(tokens) != len(sample_ids):
        raise ValueError(f"{len(sample_ids)} sample ids but {len(tokens)} token sequences")
    if masks is not None and [int(m.numel()) for m in masks] != [int(t.numel()) for t in tokens]:
        name = "response_masks" if token_aligned else "row_masks"
        raise ValueError(
            f"{name} lengths {[int(m.numel()) for m in masks]} differ from the "
            f"sequences' {[int(t.numel()) for t in tokens]}"
        )
    lens = [int(t.numel()) for t in tokens]
    padded = [megatron_padded_length(n, cp_size=cp_size, sp_size=sp_size) for n in lens]
    if not lens:  # a placeholder sequence: real length 0
        lens, padded = [0], [megatron_padded_length(1, cp_size=cp_size, sp_size=sp_size)]
        tokens, masks = [torch.zeros(0, dtype=torch.int64)], None
    cu_real, cu_pad = [0], [0]
    for n, p in zip(lens, padded, strict=True):
        cu_real.append(cu_real[-1] + n)
        cu_pad.append(cu_pad[-1] + p)
    rows_t, pos_t, mask_t, label_t = [], [], [], []
    for k, (t, p) in enumerate(zip(tokens, padded, strict=True)):
        n = int(t.numel())
        full = torch.full((p,), pad_token, dtype=torch.int64)
        full[:n] = t.reshape(-1).cpu()
        labels = torch.zeros(p, dtype=torch.int64)
        labels[:n] = _next_tokens(full[:n], n)
        pos = cp_positions(p, cp_size, cp_rank)
        rows_t.append(full[pos])
        label_t.append(labels[pos])
        pos_t.append(pos)
        if masks is not None:
            m = torch.zeros(p, dtype=torch.bool)
            given = masks[k].reshape(-1).cpu() != 0
            m[:n] = row_mask_from_response(given, n) if token_aligned else given
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
        labels=torch.cat(label_t)[None].to(dev),
    )
