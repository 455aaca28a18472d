"""A rank's micro-batches, checked before a step moves anything: every field the schedule reads.

Why this file exists: megatron's schedule runs a rank's micro-batches as they are. Tokens of a
width the peer does not expect reach the pipeline's sends (gloo aborts the process when the
sizes differ); float, 1-D or missing tokens, or position ids of another shape, raise inside the
forward on that rank only while the others wait out the timeout; a 0.5 in a row mask is taken
silently. :meth:`~mopd.mcore.Distiller.step` calls :func:`check_micro_batches` inside the
bridge's guarded planning phase, so whatever it finds is the same ``ValueError`` on every rank,
naming the rank, the micro-batch, the field and the shapes, before anything moves; and the
shapes every rank of one model replica must give alike (its TP, CP and pipeline peers) are
returned as an :class:`~mopd.bridge.inputs.Agreement` the bridge compares across ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mopd.bridge.inputs import Agreement
from mopd.bridge.mesh import Mesh
from mopd.capture.unwrap import unwrap_model
from mopd.common.digest import Digest
from mopd.common.log import warn_once
from mopd.mcore.batch import MicroBatch, _ints, sample_id_problem
from mopd.mcore.megatron_lm_head import MEGATRON_VOCAB_MULTIPLE, VOCAB_ATTRIBUTE, looks_padded
from mopd.mcore.teacher import pipeline_shape

__all__ = ["ID_DTYPES", "SHAPE_FIELDS", "check_micro_batches", "check_tokens"]

#: The dtypes input ids (tokens, position ids, labels) may have (what an embedding takes).
ID_DTYPES = (torch.int64, torch.int32)
#: The words of one micro-batch in a model replica's shape agreement.
SHAPE_FIELDS = ("packed", "seq_length", "micro_batch_size", "packing digest", "sample ids digest")


def check_micro_batches(
    mbs: Sequence[Any],
    *,
    what: str,
    mesh: Mesh,
    rank: int,
    model: Any,
    default_forward: bool,
    student: bool,
    vocab_size: int,
    given: bool,
) -> Agreement:
    """Check this rank's micro-batches of one model (local; the ``ValueError`` it raises is
    the bridge's to share); return the shapes its replica peers must give alike.

    Per micro-batch, what the stage this rank holds uses: a :class:`MicroBatch`; ``tokens``
    present on a first stage (with the default forward), a ``[B, S_local]`` (padded: ``B`` the
    sample ids, ``S_local * cp`` the ``seq_len``) or ``[1, T_local]`` (packed: ``T_local * cp``
    the end of ``cu_seqlens_q_padded``) integer tensor on the model's device; ``position_ids``
    of the tokens' shape (present where the model embeds positions), ``labels`` and the
    student's ``loss_mask`` of the shape of the micro-batch's logit rows; ``lengths`` one per
    column within ``seq_len``; an ``attention_mask`` of that batch and length; then, in one
    host sync, token ids and labels within the vocabulary, position ids within the model's
    position table, and a row mask of bools or 0/1 (:func:`check_tokens`).

    Args:
        what: ``"student"`` / ``"teacher o"`` (messages).
        mesh: the model's mesh; ``rank`` is in it.
        model: the (wrapped) model or its chunks on this rank.
        default_forward: the micro-batches feed megatron's GPTModel call (tokens, positions,
            mask): what it needs must be there.
        student: the student's micro-batches (its ``loss_mask`` counts; a teacher's is
            ignored).
        vocab_size, given: the real vocabulary, and whether the caller said it (else it was
            read off the models).
    """
    coord = mesh.coord(rank)
    assert coord is not None, "a rank holding the model is in its mesh"
    cp = mesh.cp
    first = coord.pp_rank == 0
    inner = _first_chunk(model)
    device = _device(inner)
    table = _position_table(inner) if first else None
    for i, mb in enumerate(mbs):
        where = f"{what} micro-batch {i}"
        if not isinstance(mb, MicroBatch):
            raise ValueError(f"{where} is a {type(mb).__name__}, not a MicroBatch")
        _check_fields(
            mb,
            where=where,
            cp=cp,
            needs_tokens=first and default_forward,
            positions=table if default_forward else None,
            device=device,
            student=student,
        )
    check_tokens(
        mbs,
        what=what,
        vocab_size=vocab_size,
        given=given,
        position_table=table,
        row_masks=student,
    )
    ranks = tuple(
        sorted(
            mesh.global_rank(tp_rank=t, cp_rank=c, dp_rank=coord.dp_rank, pp_rank=p)
            for t in range(mesh.tp)
            for c in range(mesh.cp)
            for p in range(mesh.pp)
        )
    )
    words = [w for mb in mbs for w in _shape_words(mb, cp)]
    return Agreement(
        what=f"{what} micro-batch shapes", ranks=ranks, fields=SHAPE_FIELDS, words=tuple(words)
    )


def _first_chunk(model: Any) -> Any:
    m = model[0] if isinstance(model, list | tuple) else model
    return unwrap_model(m) if isinstance(m, torch.nn.Module) else m


def _device(inner: Any) -> torch.device | None:
    if not isinstance(inner, torch.nn.Module):
        return None
    p = next(inner.parameters(), None)
    return None if p is None else p.device


def _position_table(inner: Any) -> int | None:
    """The rows of the model's learned position embedding (``None``: it embeds no positions,
    e.g. RoPE)."""
    emb = getattr(getattr(inner, "embedding", None), "position_embeddings", None)
    n = getattr(emb, "num_embeddings", None)
    return int(n) if isinstance(n, int) else None


def _shape(t: Any) -> Any:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


def _rows_shape(mb: MicroBatch, cp: int) -> tuple[int, int]:
    """The shape of the micro-batch's logit rows on this rank: ``[B, S_local]`` or
    ``[1, T_local]``."""
    if mb.is_packed:
        return 1, int(mb.padded_offsets()[-1]) // cp
    if isinstance(mb.tokens, torch.Tensor) and mb.tokens.dim() == 2:
        cols = int(mb.tokens.shape[0])
    else:
        cols = max(len(_ints(mb.sample_ids)), 1)
    return cols, mb.padded_seq_len(cp) // cp


def _check_fields(
    mb: MicroBatch,
    *,
    where: str,
    cp: int,
    needs_tokens: bool,
    positions: int | None,
    device: torch.device | None,
    student: bool,
) -> None:
    """The structure of one micro-batch (no host sync)."""
    wrong = sample_id_problem(mb.sample_ids)
    if wrong is not None:
        raise ValueError(f"{where}: {wrong}")
    ids = _ints(mb.sample_ids)
    tokens = mb.tokens
    if tokens is None:
        if needs_tokens:
            raise ValueError(
                f"{where}: tokens is None, but this rank holds the model's first stage, which "
                "embeds them: give its [B, S_local] (padded) or [1, T_local] (packed) input ids"
            )
        if not mb.is_packed and mb.seq_len is None:
            raise ValueError(f"{where}: without tokens a padded micro-batch needs seq_len")
    else:
        _check_ids(tokens, "tokens", where)
        if tokens.dim() != 2:
            raise ValueError(
                f"{where}: tokens {tuple(tokens.shape)} must be 2-D: [B, S_local] (padded) or "
                "[1, T_local] (packed)"
            )
        if device is not None and tokens.device.type != device.type:
            raise ValueError(
                f"{where}: tokens are on {tokens.device}, the model on {device}: move them there"
            )
        if mb.is_packed:
            if tokens.shape[0] != 1:
                raise ValueError(
                    f"{where}: packed tokens {tuple(tokens.shape)} must be [1, T_local] (one "
                    "row of packed sequences)"
                )
            padded = int(mb.padded_offsets()[-1])
            local = int(tokens.shape[-1])
            if local * cp != padded:
                raise ValueError(
                    f"{where}: tokens {tuple(tokens.shape)} hold {local} positions on this CP "
                    f"rank, but cu_seqlens_q_padded ends at {padded} (cp={cp}: {padded / cp:g} "
                    "per rank)"
                )
        else:
            cols, width = int(tokens.shape[0]), int(tokens.shape[1])
            if ids and cols != len(ids):
                raise ValueError(
                    f"{where}: tokens {tuple(tokens.shape)} hold {cols} columns but the "
                    f"micro-batch has {len(ids)} sample ids (one per column)"
                )
            if cols < 1:
                raise ValueError(f"{where}: tokens {tuple(tokens.shape)} hold no column")
            if mb.seq_len is not None and width * cp != int(mb.seq_len):
                raise ValueError(
                    f"{where}: tokens {tuple(tokens.shape)} hold {width} positions on this CP "
                    f"rank, but seq_len={mb.seq_len} (cp={cp}: {int(mb.seq_len) / cp:g} per rank)"
                )
    rows = _rows_shape(mb, cp)
    pos = mb.position_ids
    if pos is None:
        if positions is not None and tokens is not None:
            raise ValueError(
                f"{where}: position_ids is None, but the model embeds positions (a learned "
                f"table of {positions}): give them, the shape of tokens {tuple(tokens.shape)}"
            )
    else:
        _check_ids(pos, "position_ids", where)
        want = tuple(tokens.shape) if tokens is not None else rows
        if tuple(pos.shape) != want:
            raise ValueError(
                f"{where}: position_ids {tuple(pos.shape)} must have the shape of tokens {want}"
            )
    if mb.labels is not None:
        _check_ids(mb.labels, "labels", where)
        if tuple(mb.labels.shape) != rows:
            raise ValueError(
                f"{where}: labels {tuple(mb.labels.shape)} must have the shape of the "
                f"micro-batch's logit rows {rows} (row p's label is token p + 1)"
            )
    mask = mb.loss_mask
    if student and mask is not None:
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != rows:
            raise ValueError(
                f"{where}: loss_mask {_shape(mask)} must be a tensor of the shape of the "
                f"micro-batch's logit rows {rows} (row-aligned: bools or 0/1)"
            )
        if mask.is_complex():
            raise ValueError(f"{where}: loss_mask is {mask.dtype}: give bools or 0/1")
    if not mb.is_packed and mb.lengths is not None:
        try:
            lengths = _ints(mb.lengths)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: lengths must be ints, got {mb.lengths!r}") from exc
        seq = mb.padded_seq_len(cp)
        if ids and len(lengths) != len(ids):
            raise ValueError(
                f"{where}: {len(lengths)} lengths for {len(ids)} sample ids (one per column)"
            )
        bad = [n for n in lengths if not 0 <= n <= seq]
        if bad:
            raise ValueError(f"{where}: lengths {bad[:4]} outside [0, seq_len={seq}]")
    am = mb.attention_mask
    if am is not None and not mb.is_packed:
        if not isinstance(am, torch.Tensor) or am.dim() != 4:
            raise ValueError(
                f"{where}: attention_mask {_shape(am)} must be a 4-D tensor "
                "[B or 1, 1, S_local, S_local] (megatron's)"
            )
        b = rows[0]
        if am.shape[0] not in (1, b) or (cp == 1 and tuple(am.shape[-2:]) != (rows[1], rows[1])):
            raise ValueError(
                f"{where}: attention_mask {tuple(am.shape)} does not fit the micro-batch's "
                f"{b} columns of {rows[1]} positions ([B or 1, 1, S, S])"
            )


def _check_ids(t: Any, name: str, where: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in ID_DTYPES:
        raise ValueError(
            f"{where}: {name} are {t.dtype}; ids must be " + " or ".join(str(d) for d in ID_DTYPES)
        )


def check_tokens(
    mbs: Sequence[MicroBatch],
    *,
    what: str,
    vocab_size: int,
    given: bool,
    position_table: int | None = None,
    row_masks: bool = False,
) -> None:
    """The values of a rank's micro-batches, in one host sync (the min and max of every field
    of every micro-batch at once): token ids and labels in ``[0, vocab_size)``, the real
    vocabulary (megatron's vocab-parallel embedding would silently zero ids past its padded
    size under TP, and would embed a padded row for ids between the two); position ids within
    ``position_table`` (the model's learned table, if any); with ``row_masks``, a ``loss_mask``
    of bools or 0/1. A vocabulary read off the models (``given`` false) that looks padded
    (:func:`~mopd.mcore.megatron_lm_head.looks_padded`) warns once. The fields' shapes and dtypes are
    checked first (:func:`check_micro_batches`)."""
    fields: list[torch.Tensor | None] = []
    for mb in mbs:
        m = mb.loss_mask if row_masks else None
        fields += [
            mb.tokens,
            mb.position_ids if position_table is not None else None,
            mb.labels,
            m if m is not None and m.dtype != torch.bool else None,
        ]
    present = [t for t in fields if t is not None and t.numel()]
    if not present:
        return
    dev = present[0].device
    rows = [_ends(t, dev, mask=k % 4 == 3) for k, t in enumerate(fields)]
    ends = torch.stack(rows).tolist()  # the one host sync
    vocab = (
        f"real vocabulary [0, {vocab_size}) (Distiller's vocab_size)"
        if given
        else f"model's vocabulary [0, {vocab_size}) (its {VOCAB_ATTRIBUTE} attribute)"
    )
    largest = -1
    for i, mb in enumerate(mbs):
        tok, pos, lab, bad = ends[4 * i : 4 * i + 4]
        where = f"{what} micro-batch {i}"
        if mb.tokens is not None and mb.tokens.numel():
            lo, hi = tok
            if lo < 0 or hi >= vocab_size:
                raise ValueError(f"{where}: token ids span [{lo}, {hi}], outside the {vocab}")
            largest = max(largest, hi)
        if position_table is not None and mb.position_ids is not None and mb.position_ids.numel():
            lo, hi = pos
            if lo < 0 or hi >= position_table:
                raise ValueError(
                    f"{where}: position_ids span [{lo}, {hi}], outside the model's position "
                    f"table [0, {position_table}) (its max_sequence_length)"
                )
        if mb.labels is not None and mb.labels.numel():
            lo, hi = lab
            if lo < 0 or hi >= vocab_size:
                raise ValueError(f"{where}: labels span [{lo}, {hi}], outside the {vocab}")
        if bad[0]:
            raise ValueError(
                f"{where}: loss_mask holds values other than 0 and 1: it is a row mask (bools "
                "or 0/1); a per-token weight belongs in the loss (see TeacherSignal)"
            )
    if not given and largest >= 0 and looks_padded(vocab_size, largest):
        warn_once(
            f"Distiller: no vocab_size was given, so the models' {VOCAB_ATTRIBUTE} attribute "
            f"({vocab_size}) is taken as the real vocabulary; it is a multiple of "
            f"{MEGATRON_VOCAB_MULTIPLE} (megatron-LM pads to make_vocab_size_divisible_by x tp) "
            "and larger than any token id seen: if the models were built with a padded "
            "vocabulary, its padded columns count in both softmaxes and the KL. Pass "
            "Distiller(vocab_size=<the tokenizer's vocabulary>)"
        )


def _ends(t: torch.Tensor | None, device: torch.device, *, mask: bool) -> torch.Tensor:
    """``[min, max]`` int64 of ``t`` on ``device`` (zeros when absent or empty); a mask's:
    ``[bad, bad]``, whether it holds a value other than 0 and 1."""
    if t is None or not t.numel():
        return torch.zeros(2, dtype=torch.int64, device=device)
    if mask:
        return ((t != 0) & (t != 1)).any().to(torch.int64).reshape(1).expand(2).to(device)
    return torch.stack([t.min(), t.max()]).to(device=device, dtype=torch.int64)


def _digest(values: Sequence[int]) -> int:
    return Digest(repr(list(values)), size=8).word(bits=62)


def _shape_words(mb: MicroBatch, cp: int) -> tuple[int, int, int, int, int]:
    """One micro-batch's words in its replica's agreement (:data:`SHAPE_FIELDS`): what
    megatron's pipeline and TP collectives need equal on every rank of a model replica."""
    seq, cols = pipeline_shape(mb, cp_size=cp)
    if not mb.is_packed:
        cols = _rows_shape(mb, cp)[0]
    packing = 0
    if mb.is_packed:
        psp = mb.packed_seq_params
        assert psp is not None
        packing = _digest([*_ints(psp.cu_seqlens_q), -1, *_ints(mb.padded_offsets())])
    return int(mb.is_packed), int(seq), int(cols), packing, _digest(_ints(mb.sample_ids))
