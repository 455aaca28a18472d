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
- :class:`IntegrityTransport` wraps the executor's transport (:mod:`mopd.bridge.transport`): a
  checksum message beside every send and receive; :class:`RowChecks` is what the executor's
  data path calls at each point (sources taken, rows delivered, slices gathered, the verdict),
  :class:`NoChecks` the same calls doing nothing, so the data path has no integrity branch.
- :class:`BlockMismatch` names a failed block (owner, source and destination global rank, rows);
  :func:`encode_mismatches` / :func:`decode_mismatches` pack up to :data:`MAX_REPORTED` of them
  into a fixed-size int64 vector that the executor all-gathers over the bridge group, so every rank
  formats the same list with :func:`format_mismatches` and raises the same
  :class:`~mopd.bridge.errors.BridgeIntegrityError` (none is left waiting in a later collective).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from mopd.bridge.errors import BridgeIntegrityError
from mopd.bridge.schedule import DeviceIndices, RankSchedule, _Local, _Op
from mopd.bridge.transport import Message, Posted, Transport, time_left
from mopd.common import dist as cdist
from mopd.common.dist import all_gather_flat

__all__ = [
    "CROSSING",
    "MAX_REPORTED",
    "TP_GATHER",
    "BlockMismatch",
    "IntegrityTransport",
    "NoChecks",
    "RowChecks",
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
        "that teacher's compact rows of the student shard's micro-batch (its tokens, in layout "
        "order), source rows in the teacher's flat buffer of it."
    )


# --- the wrapper around the transport, and the checks on the data path -----------------------


class IntegrityTransport:
    """A :class:`~mopd.bridge.transport.Transport` that sends each message's checksums beside
    it (``Message.checksums``) and receives the peer's beside each receive
    (``Posted.recv_checksums``, in order): one small message more per transfer."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.rank = inner.rank
        self.timeout_s = inner.timeout_s

    def post(
        self,
        sends: Sequence[Message],
        recvs: Sequence[Message],
        *,
        index: int,
        device: torch.device,
        group: dist.ProcessGroup | None,
        tag: int,
    ) -> Posted:
        out_s: list[Message] = []
        for m in sends:
            assert m.checksums is not None, f"{m.what}: no checksums in integrity mode"
            out_s += [
                m,
                Message(
                    peer=m.peer, rows=m.checksums, what=f"send to global rank {m.peer} (checksums)"
                ),
            ]
        out_r: list[Message] = []
        sums = []
        for m in recvs:
            t = torch.empty(m.rows.shape[0], dtype=_I64, device=device)
            sums.append(t)
            out_r += [
                m,
                Message(peer=m.peer, rows=t, what=f"receive from global rank {m.peer} (checksums)"),
            ]
        posted = self.inner.post(out_s, out_r, index=index, device=device, group=group, tag=tag)
        posted.recv_checksums = sums
        return posted

    def wait(self, posted: Posted, *, sends: bool, deadline: float) -> None:
        self.inner.wait(posted, sends=sends, deadline=deadline)

    def sends_done(self, posted: Posted) -> bool:
        return self.inner.sends_done(posted)


#: One finding: ``[R]`` bool "row differs" and (owner, peer, destination rows relative to the
#: slice, source rows, stage) to report it.
_Finding = tuple[torch.Tensor, tuple[int, int, torch.Tensor, torch.Tensor, int]]
#: ``timed(fn, what)``: the executor's wrapper naming a failed collective (see ``Executor.timed``).
Timed = Callable[[Callable[[], Any], str], Any]
#: ``hook(point, blocks)``: the executor's debug hook (tests), or ``None``.
Hook = Callable[[str, list[tuple[int, int, torch.Tensor]]], None] | None


@dataclass(kw_only=True, eq=False)
class SlotChecks:
    """One slot's integrity state: the checksums its sends carry, the expected checksums of
    what it receives and copies locally, and its findings until the verdict."""

    send_sums: dict[int, torch.Tensor] = field(default_factory=dict)
    expected: list[tuple[_Op | _Local, torch.Tensor]] = field(default_factory=list)
    slice_sums: dict[int, torch.Tensor] = field(default_factory=dict)
    findings: list[_Finding] = field(default_factory=list)


class NoChecks:
    """The data path's check points when nothing is checked (every call does nothing)."""

    indices = False

    def taken(
        self, state: Any, sched: RankSchedule, dev: DeviceIndices, owner: int, src_RH: torch.Tensor
    ) -> None:
        """Teacher ``owner``'s rows ``src_RH`` taken for a slot."""

    def send_checksums(self, state: Any, i: int) -> torch.Tensor | None:
        """The checksums send ``i`` carries."""
        return None

    def posted(self, state: Any, sched: RankSchedule, posted: Posted) -> None:
        """The slot's messages posted."""

    def delivered(
        self,
        state: Any,
        sched: RankSchedule,
        targets: Mapping[int, torch.Tensor],
        dev: DeviceIndices,
        rank: int,
    ) -> None:
        """This rank's slices unpacked (before the TP all-gather)."""

    def gathered(self, state: Any, **kw: Any) -> None:
        """The TP all-gather done."""


class RowChecks(NoChecks):
    """Integrity mode's check points (see the module doc); state per slot in
    :class:`SlotChecks`."""

    indices = True

    def taken(
        self, state: Any, sched: RankSchedule, dev: DeviceIndices, owner: int, src_RH: torch.Tensor
    ) -> None:
        if owner not in sched.src_span:
            return
        lo, hi = sched.src_span[owner]
        sums = row_checksum(src_RH[lo:hi])  # the source rows, before packing
        for i, op in enumerate(sched.sends):
            if op.owner == owner:
                state.send_sums[i] = sums[dev(sched.send_src_rel[i])]
        if sched.dest is not None:
            for i, lop in enumerate(sched.locals):
                if lop.owner == owner:
                    state.expected.append((lop, sums[dev(sched.local_src_rel[i])]))

    def send_checksums(self, state: Any, i: int) -> torch.Tensor | None:
        return state.send_sums.pop(i)

    def posted(self, state: Any, sched: RankSchedule, posted: Posted) -> None:
        state.expected += list(zip(sched.recvs, posted.recv_checksums, strict=True))

    def delivered(
        self,
        state: Any,
        sched: RankSchedule,
        targets: Mapping[int, torch.Tensor],
        dev: DeviceIndices,
        rank: int,
    ) -> None:
        """Every delivered row against the sender's checksum; rows no transfer writes zero."""
        actual = {o: row_checksum(t) for o, t in targets.items()}
        state.slice_sums = actual
        for op, expected in state.expected:
            if isinstance(op, _Op):
                dst_rows, src_rows, peer = op.side.rows, op.peer_side.rows, op.peer
            else:
                dst_rows, src_rows, peer = op.dst.rows, op.src.rows, rank
            state.findings.append(
                (
                    actual[op.owner][dev(dst_rows)] != expected,
                    (op.owner, peer, dst_rows, src_rows, CROSSING),
                )
            )
        for owner, inside in sched.fill_checked.items():
            if inside.numel():
                state.findings.append(
                    (
                        actual[owner][dev(inside)] != 0,
                        (owner, -1, inside, torch.empty(0, dtype=_I64), CROSSING),
                    )
                )
        state.expected = []

    def gathered(  # type: ignore[override]
        self,
        state: Any,
        *,
        index: int,
        sched: RankSchedule,
        outputs: Mapping[int, torch.Tensor],
        tp_group: dist.ProcessGroup | None,
        group_size: int,
        deadline: float,
        timed: Timed,
        hook: Hook,
    ) -> None:
        """Every slice of the TP all-gather against its sender's checksums (all owners at once)."""
        assert sched.dest is not None
        owners = sorted(outputs)
        rows = [sched.slice_rows_of(o) for o in owners]
        mine = torch.cat([state.slice_sums[o] for o in owners])
        every = torch.empty(group_size * mine.numel(), dtype=_I64, device=mine.device)
        ranks = cdist.group_ranks(tp_group)
        timed(
            lambda: all_gather_flat(every, mine, group=tp_group, timeout_s=time_left(deadline)),
            f"the checksums of the student TP all-gather (integrity, micro-batch {index}, "
            f"over global ranks {ranks})",
        )
        expected = every.view(group_size, mine.numel()).split(rows, dim=1)
        peers = [j for j in range(group_size) if j != sched.dest.slot]
        if hook is not None:
            hook(
                "gathered",
                [
                    (o, ranks[j], outputs[o][j * n : (j + 1) * n])
                    for o, n in zip(owners, rows, strict=True)
                    for j in peers
                ],
            )
        for i, (o, n) in enumerate(zip(owners, rows, strict=True)):
            got = row_checksum(outputs[o]).view(group_size, n)
            for j in range(group_size):
                dst_rows = torch.arange(j * n, (j + 1) * n) - sched.slice_start(o)
                state.findings.append(
                    (
                        got[j] != expected[i][j],
                        (o, ranks[j], dst_rows, torch.arange(n), TP_GATHER),
                    )
                )


def integrity_verdict(
    slots: Sequence[tuple[int, RankSchedule | None, SlotChecks | None]],
    *,
    rank: int,
    group: dist.ProcessGroup | None,
    deadline: float,
    timed: Timed,
) -> None:
    """Judge every slot's findings; the same :class:`BridgeIntegrityError` on every rank.

    ``slots``: ``(micro-batch, schedule, state)`` of each slot. Collective over ``group`` (the
    gloo metadata group): every rank calls it once per step.
    """
    found: list[BlockMismatch] = []
    flags = [(i, sched, f) for i, sched, st in slots if st is not None for f in st.findings]
    if flags:
        counts = torch.stack([b.sum() for _, _, (b, _) in flags]).tolist()  # the one host sync
        for (index, sched, (b, info)), n in zip(flags, counts, strict=True):
            if not n:
                continue
            owner, peer, dst_rows, src_rows, stage = info
            idx = torch.nonzero(b.cpu()).reshape(-1)[:4]
            off = sched.slice_start(owner) if sched is not None and sched.dest is not None else 0
            found.append(
                BlockMismatch(
                    owner=owner,
                    src_rank=peer,
                    dst_rank=rank,
                    rows=int(dst_rows.numel()),
                    bad=int(n),
                    dst_rows=tuple((dst_rows[idx] + off).tolist()),
                    src_rows=tuple(src_rows[idx].tolist()) if src_rows.numel() else (),
                    stage=stage,
                    micro_batch=index,
                )
            )
    for _, _, st in slots:
        if st is not None:
            st.findings = []
    mine = encode_mismatches(found)
    device = cdist.group_device(group)
    n = dist.get_world_size(group)
    every = torch.empty(n * mine.numel(), dtype=_I64, device=device)
    ranks = cdist.group_ranks(group)
    timed(
        lambda: all_gather_flat(every, mine.to(device), group=group, timeout_s=time_left(deadline)),
        f"the integrity verdict (all-gather over global ranks {ranks})",
    )
    rows = every.cpu().view(n, -1)
    reports = [(ranks[j], *decode_mismatches(rows[j])) for j in range(n)]
    if any(count for _, count, _ in reports):
        raise BridgeIntegrityError(format_mismatches(reports))
