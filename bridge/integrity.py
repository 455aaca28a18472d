"""Integrity mode: per-row checksums that catch bytes landing wrong, and one verdict on every rank.

Why this file exists: a bug or fault that moves the wrong bytes (a bad plan, a kernel writing the
wrong row, a staging buffer reused too early, a corrupted transfer) does not crash anything: the
student just trains on wrong teacher states. With ``BridgeConfig(integrity=True)`` the executor
checks every delivered row end to end, and this module holds the pieces it uses:

- :func:`row_checksum`: ``[N, H]`` rows -> ``[N]`` int64, the wrapping sum of each row's bytes read
  as 64-bit words (32/16/8-bit words when the row size is not a multiple of 8 bytes). One read pass
  on the device, no host sync, order-independent (integer addition), so sender and receiver agree
  bit for bit. It changes under any single-bit error and whenever a row is replaced by a row with
  different content; it does not see 8-byte words permuted *inside* a row, which no step of the
  bridge can do (every kernel moves whole rows).
- The sender checksums its *source* rows (before packing) and sends the sums with the rows; the
  receiver checksums its *output* rows (after unpacking) and compares, so packing, the transfer,
  the staging buffers and unpacking are all covered, and local copies too. Rows no transfer writes
  must checksum to 0 (zero-filled).
- With student TP > 1 the crossing fills each TP rank's slice, and the TP all-gather assembles
  the full buffer: every rank all-gathers its slice's checksums with it and compares them with
  the gathered rows, so the all-gather is covered too (``stage=TP_GATHER`` blocks).
- :class:`BlockMismatch` names a failed block (owner, source and destination global rank, rows);
  :func:`encode_mismatches` / :func:`decode_mismatches` pack up to :data:`MAX_REPORTED` of them
  into a fixed-size int64 vector that the executor all-gathers over the bridge group, so every rank
  formats the same list with :func:`format_mismatches` and raises the same
  :class:`~mopd.bridge.errors.BridgeIntegrityError` (none is left waiting in a later collective).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "CROSSING",
    "MAX_REPORTED",
    "TP_GATHER",
    "BlockMismatch",
    "decode_mismatches",
    "encode_mismatches",
    "format_mismatches",
    "row_checksum",
]

_I64 = torch.int64
#: Mismatched blocks each rank reports in full (more are counted, not listed).
MAX_REPORTED = 4
#: Rows listed per block.
_ROWS_LISTED = 4
_ENTRY = 7 + 2 * _ROWS_LISTED
#: :attr:`BlockMismatch.stage`: rows delivered by the crossing (sends, receives, local copies).
CROSSING = 0
#: :attr:`BlockMismatch.stage`: rows another student TP rank delivered through the TP all-gather.
TP_GATHER = 1
_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.int8))


def row_checksum(rows_NH: torch.Tensor) -> torch.Tensor:
    """``[N]`` int64: the wrapping sum of each row's bytes as the widest word that divides a row.

    Args:
        rows_NH: ``[N, H]`` rows of any dtype, each row contiguous (``stride(1) == 1``); a
            contiguous ``[N, H]`` buffer or a row slice of one.
    Returns:
        ``[N]`` int64 on the rows' device (computed there, no host sync).
    """
    if rows_NH.dim() != 2 or (rows_NH.shape[1] > 1 and rows_NH.stride(1) != 1):
        raise ValueError(
            f"row_checksum wants [N, H] rows with contiguous rows, got shape "
            f"{tuple(rows_NH.shape)} strides {rows_NH.stride()}"
        )
    if rows_NH.shape[0] == 0:
        return torch.zeros(0, dtype=_I64, device=rows_NH.device)
    row_bytes = rows_NH.shape[1] * rows_NH.element_size()
    word = next(w for size, w in _WORDS if row_bytes % size == 0)
    try:
        words = rows_NH.view(word)
    except RuntimeError:  # a storage offset not aligned to the word: same words, aligned copy
        words = rows_NH.clone().view(word)
    return words.sum(dim=1, dtype=_I64)


@dataclass(frozen=True, kw_only=True)
class BlockMismatch:
    """One block whose delivered rows do not match the sender's checksums.

    Attributes:
        owner: teacher index.
        src_rank: sending global rank (the TP peer for ``TP_GATHER``); ``-1`` for rows no
            transfer writes (must be zero).
        dst_rank: receiving global rank.
        rows: rows in the block.
        bad: rows that differ.
        dst_rows: the first differing rows of the destination group's full buffer.
        src_rows: the matching rows of the source's flat buffer (the peer's slice for
            ``TP_GATHER``; empty for zero-fill rows).
        stage: :data:`CROSSING` or :data:`TP_GATHER`.
        micro_batch: the micro-batch of the step the block belongs to (the rows above count
            in that micro-batch's buffers).
    """

    owner: int
    src_rank: int
    dst_rank: int
    rows: int
    bad: int
    dst_rows: tuple[int, ...]
    src_rows: tuple[int, ...] = ()
    stage: int = CROSSING
    micro_batch: int = 0


def encode_mismatches(found: Sequence[BlockMismatch]) -> torch.Tensor:
    """``[1 + MAX_REPORTED * 15]`` int64: the count, then up to :data:`MAX_REPORTED` entries."""
    out = torch.full((1 + MAX_REPORTED * _ENTRY,), -1, dtype=_I64)
    out[0] = len(found)
    for i, m in enumerate(found[:MAX_REPORTED]):
        d = list(m.dst_rows[:_ROWS_LISTED]) + [-1] * (_ROWS_LISTED - len(m.dst_rows[:_ROWS_LISTED]))
        s = list(m.src_rows[:_ROWS_LISTED]) + [-1] * (_ROWS_LISTED - len(m.src_rows[:_ROWS_LISTED]))
        out[1 + i * _ENTRY : 1 + (i + 1) * _ENTRY] = torch.tensor(
            [m.owner, m.src_rank, m.dst_rank, m.rows, m.bad, m.stage, m.micro_batch, *d, *s],
            dtype=_I64,
        )
    return out


def decode_mismatches(vec: torch.Tensor) -> tuple[int, list[BlockMismatch]]:
    """Invert :func:`encode_mismatches`: ``(total count, listed entries)``."""
    v = vec.tolist()
    total = int(v[0])
    found = []
    for i in range(min(total, MAX_REPORTED)):
        e = v[1 + i * _ENTRY : 1 + (i + 1) * _ENTRY]
        d = tuple(x for x in e[7 : 7 + _ROWS_LISTED] if x >= 0)
        s = tuple(x for x in e[7 + _ROWS_LISTED :] if x >= 0)
        found.append(
            BlockMismatch(
                owner=e[0],
                src_rank=e[1],
                dst_rank=e[2],
                rows=e[3],
                bad=e[4],
                dst_rows=d,
                src_rows=s,
                stage=e[5],
                micro_batch=e[6],
            )
        )
    return total, found


def _rows(rows: tuple[int, ...], bad: int) -> str:
    listed = ", ".join(map(str, rows))
    return f"[{listed}{', ...' if bad > len(rows) else ''}]"


def format_mismatches(per_rank: Sequence[tuple[int, int, list[BlockMismatch]]]) -> str:
    """One message for ``(global_rank, total, listed)`` reports, the same on every rank."""
    parts = []
    total = 0
    ranks = []
    for rank, count, found in per_rank:
        if not count:
            continue
        total += count
        ranks.append(rank)
        for m in found:
            where = f"teacher {m.owner}, micro-batch {m.micro_batch}"
            if m.stage == TP_GATHER:
                parts.append(
                    f"{where}: student TP all-gather, global rank {m.src_rank} -> "
                    f"global rank {m.dst_rank}: {m.bad} of {m.rows} rows differ from the sender's "
                    f"slice (destination rows {_rows(m.dst_rows, m.bad)}, rows of the sender's "
                    f"slice {_rows(m.src_rows, m.bad)})"
                )
            elif m.src_rank < 0:
                parts.append(
                    f"{where} on global rank {m.dst_rank}: {m.bad} of {m.rows} rows that "
                    f"no transfer writes are not zero (destination rows {_rows(m.dst_rows, m.bad)})"
                )
            else:
                parts.append(
                    f"{where}: global rank {m.src_rank} -> global rank {m.dst_rank}: "
                    f"{m.bad} of {m.rows} rows differ (destination rows "
                    f"{_rows(m.dst_rows, m.bad)}, source rows {_rows(m.src_rows, m.bad)})"
                )
        if count > len(found):
            parts.append(f"{count - len(found)} more block(s) on global rank {rank}")
    return (
        f"bridge integrity check failed: {total} corrupted block(s) received on global rank(s) "
        f"{ranks}: " + "; ".join(parts) + ". The rows' bytes changed between the sender's "
        "checksum of its source rows and the receiver's checksum of its output rows (transport, "
        "staging buffers, a layout kernel or the student TP all-gather); destination rows count in "
        "the student shard's full buffer of that micro-batch, source rows in the teacher's flat "
        "buffer of it."
    )
