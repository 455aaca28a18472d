"""Step metadata: what each rank holds and wants for a whole step, as one int64 record, all-gathered.

Why this file exists: every rank must plan its own transfers and reach the same verdict on bad
input, from one small collective per step (outside the training schedule). Each rank therefore
encodes its view of the step (per micro-batch the runs of its buffers' layouts, dtypes, hidden
sizes, devices, and any local error) into one record; :func:`gather_step_matrix` all-gathers the
records over the bridge's metadata group, and :class:`StepMatrix` reads the result *lazily*: a
rank looks up only the records of its peers, at fixed offsets, so decoding costs follow its own
work, not the job's. Only the first rank of each group of replicas (a TP group) sends its runs;
the others send a digest that must match the leader's.

Record (one int64 vector; ``n_sections = n_owners + 1``, the last one the student's)::

    [MAGIC, config_sig, n_slots, err_bytes, err_offset, state, step, memo_step, unchanged,
     size, section_offset x n_sections, section tables (every section, at fixed places),
     runs..., error text (UTF-8, 8 per int64), agreements..., n_agreement_words]

    section table: [dtype_code, hidden, device_code, n_slots,
                    per slot: n_rows, n_runs, runs_offset, sample_min, sample_max, digest,
                              n_tokens]
    runs: the runs of the slots that carry them (5 int64 each)

With ``n_slots >= 0`` every section's table sits at :func:`table_offset` (the same column in
every record of an agreed step, whether the rank holds the section or not), so one rank reads a
field of every group's slot table with one strided slice (:meth:`StepMatrix.slot_tables`), not
a gather through the offsets. ``n_tokens`` is the slot's real (counted) tokens.

``state`` is the rank's bridge state (:data:`STATE_READY`, :data:`STATE_OPEN`: an earlier step
of this bridge still has micro-batches this rank has not posted, :data:`STATE_FAILED`: a step
failed on this rank; the error text then says how) and ``step`` the number of steps it planned
before this one (the fence: every rank must be at the same step). ``memo_step`` is the step
whose plan keys the rank keeps (-1: none) and ``unchanged`` 1 when its record past the header
(:func:`record_tables`) is word for word the one it sent then: when every record says both
alike, the job's records are the memo step's but for their headers, so no rank gathers them
again (:func:`reuses_memo`): each reads the memo step's matrix, and reuses what it derived
from it (its plan keys, the step's token counts) without reading any group's table
(:meth:`StepMatrix.unchanged_since`).
``n_slots == -1``: the rank holds nothing (it takes the others' count). ``section_offset == 0``:
the rank has no such section. ``n_runs == -1``: a replica that sends only its digest.
The record ends with the caller's agreements (:class:`~mopd.bridge.inputs.Agreement`: per
agreement ``[key, n_words, words...]``) and their word count, read from the record's end
(``size`` is the record's length).

The exchange is two steps: an all-reduce of every header word's largest and smallest value
(:func:`header_summary`: the widest record, and whether every rank's header says the same
fence; with ``heads``, also each teacher's ``(dtype, hidden, device)`` codes), then the records
(:func:`gather_records`). When the summary says every rank is ready, at one step, error-free,
with one config and one micro-batch count, no rank reads any other's header
(:meth:`StepMatrix.uniform_slots`), and each rank receives only the records it reads (its
peers', routed by :mod:`mopd.bridge.peers`: a :class:`StepMatrix` over some members);
otherwise every rank gathers every record, padded to the widest, reads the headers and names
what differs, the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from mopd.bridge.catalog import fan_out
from mopd.bridge.inputs import Agreement
from mopd.bridge.layout import TokenLayout, layout_to_runs
from mopd.common import dist as cdist
from mopd.common.digest import Digest
from mopd.common.dist import NodeGroups, all_gather_flat, all_gather_nodes

__all__ = [
    "DTYPES",
    "HEADER",
    "SLOT_COLUMNS",
    "SLOT_FIELDS",
    "STATE_FAILED",
    "STATE_OPEN",
    "STATE_READY",
    "RaggedRecords",
    "RecordRoute",
    "Section",
    "StepMatrix",
    "code_dtype",
    "device_code",
    "dtype_code",
    "encode_step_record",
    "gather_records",
    "gather_step_matrix",
    "header_summary",
    "layout_digest",
    "record_heads",
    "record_tables",
    "reduce_summary",
    "reduced_summary",
    "reuses_memo",
    "summary_heads",
    "table_offset",
    "uniform_count",
]

_I64 = np.int64
#: Identifies the record format (a rank running another version of the library fails loudly).
MAGIC = 0x6D6F_7064_0007
#: Fixed header words before the section offsets.
HEADER = 10
#: Header words: the micro-batch count, the step of the rank's plan memo, whether its tables
#: are that step's, and the record's length.
N_SLOTS, MEMO_STEP, UNCHANGED, SIZE = 2, 7, 8, 9
#: The rank's bridge state in its record: ready, an earlier step not fully posted, failed.
STATE_READY, STATE_OPEN, STATE_FAILED = 0, 1, 2
#: The words of one slot in a section's slot table, in order.
SLOT_COLUMNS = ("n_rows", "n_runs", "runs_offset", "sample_min", "sample_max", "digest", "n_tokens")
#: Words per slot in a section's slot table.
SLOT_FIELDS = len(SLOT_COLUMNS)
_SECTION_HEAD = 4
_N_ROWS, _N_RUNS, _RUNS_OFF, _SMIN, _SMAX, _DIGEST, _N_TOKENS = range(SLOT_FIELDS)


def table_offset(section: int, *, n_sections: int, n_slots: int) -> int:
    """Word offset of ``section``'s slot table (past its 4-word head) in a record of an agreed
    step with ``n_slots`` micro-batches (the same in every record that has tables)."""
    return HEADER + n_sections + section * (_SECTION_HEAD + SLOT_FIELDS * n_slots) + _SECTION_HEAD


#: dtype <-> code table (index = code).
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
)
_DEVICES = ("cpu", "cuda")


def dtype_code(dtype: torch.dtype | None) -> int:
    return DTYPES.index(dtype) if dtype in DTYPES else -1


def device_code(device: torch.device | str) -> int:
    kind = device.type if isinstance(device, torch.device) else str(device)
    return _DEVICES.index(kind) if kind in _DEVICES else len(_DEVICES)


def code_dtype(code: int) -> torch.dtype | None:
    return DTYPES[code] if 0 <= code < len(DTYPES) else None


def layout_digest(num_rows: int, runs_K5: np.ndarray) -> int:
    """A 62-bit content hash of a layout's rows and runs (equal layouts, equal digests)."""
    h = Digest(np.asarray([num_rows], dtype=_I64), np.asarray(runs_K5, dtype=_I64), size=8)
    return h.word(bits=62)


@dataclass(frozen=True, kw_only=True, eq=False)
class Section:
    """One buffer role of a rank for the step: a teacher's capture, or the student's rows.

    Attributes:
        layouts: per micro-batch, the buffer's layout.
        send_runs: True for the first rank of a group of replicas (it sends the runs), False for
            the others (they send digests).
        dtype, hidden: the rows' dtype and width (``None`` / 0 for the student's section).
        device: where the rows live.
    """

    layouts: Sequence[TokenLayout]
    send_runs: bool
    dtype: torch.dtype | None = None
    hidden: int = 0
    device: torch.device | str = "cpu"


def _layout_runs(layout: TokenLayout) -> np.ndarray:
    return layout_to_runs(layout).numpy()


def encode_step_record(
    *,
    config_sig: int,
    n_slots: int,
    error: str,
    sections: Sequence[Section | None],
    state: int = STATE_READY,
    step: int = 0,
    agreements: Sequence[Agreement] = (),
    memo_step: int = -1,
    memo_tables: np.ndarray | None = None,
) -> torch.Tensor:
    """This rank's record (see the module doc): ``[L]`` int64 CPU tensor.

    ``sections``: one per owner (teacher) and, last, the student's; ``None`` where the rank has
    no such role; each present one holds ``n_slots`` layouts. ``error``: the local error text
    (sections are then usually all ``None``), or with a ``state`` other than ready, what that
    state is about. ``memo_step`` / ``memo_tables``: the step whose plan keys the rank keeps
    and its :func:`record_tables` then (``unchanged`` is 1 when this record's are equal: the
    record is that step's but for its header).
    """
    n_sec = len(sections)
    live = [sec for sec in sections if sec is not None]
    if live and any(len(sec.layouts) != n_slots for sec in live):
        raise AssertionError(
            f"sections hold {[len(sec.layouts) for sec in live]} layouts, the record {n_slots}"
        )
    per = _SECTION_HEAD + SLOT_FIELDS * max(n_slots, 0)
    n_tab = n_sec * per if live else 0
    head = np.zeros(HEADER + n_sec + n_tab, dtype=_I64)
    head[0], head[1], head[2] = MAGIC, config_sig, n_slots
    head[5], head[6], head[MEMO_STEP] = state, step, memo_step
    parts: list[np.ndarray] = [head]
    runs_at = head.size
    for s, sec in enumerate(sections):
        if sec is None:
            continue
        at = HEADER + n_sec + s * per
        head[HEADER + s] = at
        head[at : at + _SECTION_HEAD] = (
            dtype_code(sec.dtype),
            sec.hidden,
            device_code(sec.device),
            len(sec.layouts),
        )
        slots = head[at + _SECTION_HEAD : at + per].reshape(-1, SLOT_FIELDS)
        runs_I = [_layout_runs(layout) for layout in sec.layouts]
        rows_I = [layout.num_rows for layout in sec.layouts]
        slots[:, _N_ROWS] = rows_I
        slots[:, _DIGEST] = [layout_digest(n, r) for n, r in zip(rows_I, runs_I, strict=True)]
        # every slot's sample range and tokens in one pass over the section's runs
        n_I = np.fromiter((r.shape[0] for r in runs_I), dtype=_I64, count=len(runs_I))
        slots[:, _SMIN], slots[:, _SMAX], slots[:, _N_TOKENS] = 1, 0, 0
        if int(n_I.sum()):
            every = np.concatenate(runs_I)
            held = n_I.ravel().nonzero()[0]  # the slots with runs
            start = (n_I.cumsum() - n_I)[held]
            slots[held, _SMIN] = np.minimum.reduceat(every[:, 0], start)
            slots[held, _SMAX] = np.maximum.reduceat(every[:, 0], start)
            slots[held, _N_TOKENS] = np.add.reduceat(every[:, 4], start)
        if sec.send_runs:
            slots[:, _N_RUNS] = n_I
            slots[:, _RUNS_OFF] = runs_at + 5 * (n_I.cumsum() - n_I)
            parts += [r.reshape(-1) for r in runs_I]
            runs_at += 5 * int(n_I.sum())
        else:
            slots[:, _N_RUNS] = -1
    text = error.encode()[:4000]
    if text:
        head[3], head[4] = len(text), runs_at
        pad = -len(text) % 8
        parts.append(np.frombuffer(text + b"\0" * pad, dtype="<i8").astype(_I64))
    block = [w for a in agreements for w in (a.key, len(a.words), *a.words)]
    parts.append(np.asarray([*block, len(block)], dtype=_I64))
    record = np.concatenate(parts)
    record[SIZE] = record.size
    if memo_tables is not None and np.array_equal(record[HEADER:], memo_tables):
        record[UNCHANGED] = 1
    return torch.from_numpy(record)


#: ``n_slots`` of a rank that holds nothing, in the summary's smallest half
_NO_SLOTS = 2**62


def header_summary(header_H: np.ndarray | torch.Tensor) -> torch.Tensor:
    """``[2 * HEADER]`` int64: one record's header as the summary's all-reduce (MAX) takes it
    (:func:`reduced_summary` of that one header)."""
    return torch.from_numpy(reduced_summary(np.asarray(header_H, dtype=_I64)[None, :HEADER]))


def reduced_summary(header_NH: np.ndarray) -> np.ndarray:
    """``[2 * HEADER]``: every word's largest value over the ``[n, HEADER]`` headers, then
    every word's smallest, negated (``[max, -min]``, so that an all-reduce (MAX) of each
    member's :func:`header_summary` returns the same). A rank that holds nothing
    (``n_slots == -1``) counts as the largest count in the smallest half, so the counts agree
    when every rank that gives one gives it."""
    h = np.asarray(header_NH, dtype=_I64)
    low = h.copy()
    low[low[:, N_SLOTS] < 0, N_SLOTS] = _NO_SLOTS
    return np.concatenate([h.max(axis=0), (-low).max(axis=0)])


def uniform_count(summary_2H: np.ndarray) -> int | None:
    """The step's micro-batch count when the reduced summary (:func:`header_summary`) says
    every record is of this format, one config, error-free, ready, at one step, every count
    given the same; else ``None`` (some rank differs: read the headers)."""
    hi, lo = summary_2H[:HEADER], -summary_2H[HEADER : 2 * HEADER]
    same = hi == lo
    same[[MEMO_STEP, UNCHANGED, SIZE]] = True  # the memo is judged apart; sizes differ
    if not same.all() or hi[0] != MAGIC or hi[3] != 0 or hi[5] != STATE_READY or hi[N_SLOTS] < 0:
        return None
    return int(hi[N_SLOTS])


def record_tables(record: torch.Tensor | np.ndarray) -> np.ndarray:
    """A copy of ``record`` past its header, up to its ``size`` (a row of a gathered matrix
    drops its padding): the section offsets, tables, runs, error text and agreements, all
    that a rank reads of another's record besides the header."""
    r = record.numpy() if isinstance(record, torch.Tensor) else np.asarray(record)
    return r[HEADER : int(r[SIZE])].copy()


def reuses_memo(summary_2H: np.ndarray, memo_step: int) -> bool:
    """Whether the reduced summary says every record is the one its rank sent at step
    ``memo_step`` but for its header (every rank agreed, each with that memo and unchanged):
    then that step's gathered matrix serves this one, and nothing is gathered. The summary is
    the same on every rank, so is the answer (a rank without a memo says ``memo_step -1``)."""
    if memo_step < 0 or uniform_count(summary_2H) is None:
        return False
    hi, lo = summary_2H[:HEADER], -summary_2H[HEADER : 2 * HEADER]
    return bool(hi[MEMO_STEP] == lo[MEMO_STEP] == memo_step and hi[UNCHANGED] == lo[UNCHANGED] == 1)


#: Words of a section's head in the summary: ``(dtype_code, hidden, device_code)``.
_HEAD = 3
_NONE = np.iinfo(_I64).min


def record_heads(record: np.ndarray | torch.Tensor, n: int) -> np.ndarray:
    """``[n, 3]`` the ``(dtype_code, hidden, device_code)`` of ``record``'s first ``n``
    sections, as the summary's all-reduce takes them: ``[value, -value]`` pairs per word
    (``[6 n]`` flat, values first), the lowest int64 in both for a section the record does not
    hold (or a record of another format), which no reduction picks."""
    r = record.numpy() if isinstance(record, torch.Tensor) else np.asarray(record)
    hi = np.full((n, _HEAD), _NONE, dtype=_I64)
    lo = hi.copy()
    if r.size > HEADER + n and r[0] == MAGIC:
        for s in range(n):
            at = int(r[HEADER + s])
            if at > 0 and at + _HEAD <= r.size:
                hi[s] = r[at : at + _HEAD]
                lo[s] = -hi[s]
    return np.concatenate([hi.reshape(-1), lo.reshape(-1)])


def summary_heads(summary: np.ndarray) -> list[tuple[int, int, int]] | None:
    """Each of the first ``n`` sections' ``(dtype_code, hidden, device_code)`` when the summary
    (of :func:`reduce_summary` with ``heads=n``) says every rank holding it gives the same and
    some rank holds it; else ``None`` (some rank differs, or no heads: read the records)."""
    extra = np.asarray(summary[2 * HEADER :], dtype=_I64)
    n = extra.size // (2 * _HEAD)
    if not n:
        return None
    hi, neg_lo = extra[: _HEAD * n].reshape(n, _HEAD), extra[_HEAD * n :].reshape(n, _HEAD)
    if bool((hi == _NONE).any()) or not np.array_equal(hi, -neg_lo):
        return None
    return [(int(a), int(b), int(c)) for a, b, c in hi.tolist()]


def gather_step_matrix(
    record: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    n_members: int,
    device: torch.device,
    timeout_s: float | None,
    nodes: NodeGroups | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """All-gather every member's record: ``([n, width] int64, summary [2 * HEADER])``, the
    same everywhere: :func:`reduce_summary`, then :func:`gather_records` (the bridge skips the
    second when its plan memo serves, :func:`reuses_memo`, and routes it when the summary
    says the step is agreed)."""
    summary_2H = reduce_summary(record, group=group, device=device, timeout_s=timeout_s)
    matrix, _ = gather_records(
        record,
        width=int(summary_2H[SIZE]),
        group=group,
        n_members=n_members,
        device=device,
        timeout_s=timeout_s,
        nodes=nodes,
    )
    assert isinstance(matrix, np.ndarray)  # not routed: every record, padded
    return matrix, summary_2H


def reduce_summary(
    record: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    device: torch.device,
    timeout_s: float | None,
    heads: int = 0,
) -> np.ndarray:
    """``[2 * HEADER + 6 * heads]``: the all-reduce (MAX) over ``group`` of every member's
    :func:`header_summary` (and, with ``heads``, its :func:`record_heads` of the first
    ``heads`` sections: :func:`summary_heads` reads them), the same everywhere: the widest
    record's size, and whether every header agrees, in a constant number of words per rank
    whatever the job's size. Tensors travel on ``device`` (CPU for a gloo group)."""
    head = torch.zeros(HEADER, dtype=torch.int64)
    head[: min(HEADER, record.numel())] = record[:HEADER]
    head[SIZE] = record.numel()  # a record of another format may not say it
    summary = header_summary(head)
    if heads:
        summary = torch.cat([summary, torch.from_numpy(record_heads(record, heads))])
    summary = summary.to(device)
    if group is not None and dist.get_world_size(group) > 1:
        cdist.all_reduce(summary, op=dist.ReduceOp.MAX, group=group, timeout_s=timeout_s)
    return summary.cpu().numpy()


@dataclass(frozen=True, eq=False)
class RaggedRecords:
    """Several records in one flat array, unpadded (what a routed exchange receives: stacking
    them into a padded ``[k, width]`` matrix would copy them row by row, and so would putting
    them one after another in member order).

    Attributes:
        words_W: ``[W]`` int64 holding the records (and possibly words between them).
        start_K, end_K: ``[k]`` int64, record ``r`` is ``words_W[start_K[r] : end_K[r]]``.
    """

    words_W: np.ndarray
    start_K: np.ndarray
    end_K: np.ndarray

    @staticmethod
    def of(records: Sequence[np.ndarray]) -> RaggedRecords:
        """``records`` (each a 1-D int64 record) one after another, in order."""
        sizes = np.fromiter((r.size for r in records), dtype=_I64, count=len(records))
        off = np.zeros(len(records) + 1, dtype=_I64)
        np.cumsum(sizes, out=off[1:])
        words = np.concatenate(records).astype(_I64, copy=False) if records else off[:0]
        return RaggedRecords(words, off[:-1], off[1:])

    def copy(self) -> RaggedRecords:
        return RaggedRecords(self.words_W.copy(), self.start_K.copy(), self.end_K.copy())


#: What :func:`gather_records` calls to route a record to the members that read it instead of
#: gathering every record: ``record -> (records, [k] their member indices)``.
RecordRoute = Callable[[torch.Tensor], tuple[RaggedRecords, np.ndarray]]


def gather_records(
    record: torch.Tensor,
    *,
    width: int,
    group: dist.ProcessGroup | None,
    n_members: int,
    device: torch.device,
    timeout_s: float | None,
    nodes: NodeGroups | None = None,
    route: RecordRoute | None = None,
) -> tuple[np.ndarray | RaggedRecords, np.ndarray | None]:
    """The records this rank reads: ``([k, width] int64, members)``, or routed
    (:class:`RaggedRecords`, the members whose records they are).

    Without ``route``: every member's (``k = n``, ``members`` ``None``: row ``j`` is member
    ``j``'s record in group-rank order, zero-padded to ``width``, the widest: the summary's
    ``size``), the same everywhere; one all-gather flat over ``group`` or, with ``nodes``, in
    two levels (:func:`~mopd.common.dist.all_gather_nodes`; CPU, the same bytes). With
    ``route`` (:func:`mopd.bridge.peers.exchange_records`, for an agreed step): what it
    returns, the records of the members (ascending) this rank reads.
    """
    if route is not None:
        return route(record)
    padded = torch.zeros(width, dtype=torch.int64, device=device)
    padded[: record.numel()] = record.to(device)
    every = torch.empty(n_members * width, dtype=torch.int64, device=device)
    if nodes is not None:
        all_gather_nodes(every, padded, nodes=nodes, timeout_s=timeout_s)
    else:
        all_gather_flat(every, padded, group=group, timeout_s=timeout_s)
    return every.cpu().numpy().reshape(n_members, width), None


class StepMatrix:
    """Lazy reader of a step's records (``[k, width]`` int64 zero-padded, or
    :class:`RaggedRecords`): every member's (gathered) or some members' (routed: ``members``).

    Methods take member indices (positions in the bridge group, not global ranks) and section
    indices (``0 .. n_owners - 1`` teachers, ``n_owners`` the student). Nothing is decoded up
    front; vectorized lookups (:meth:`slot_fields`) read one column of many records at once.
    A routed matrix holds the records of ``members`` only: reading another member's is an
    ``AssertionError`` (:meth:`has` says which are there); the fence and the header verdicts
    read every header, so they run on a gathered matrix only.
    """

    def __init__(
        self,
        matrix: np.ndarray | RaggedRecords,
        summary_2H: np.ndarray | None = None,
        members: np.ndarray | None = None,
    ) -> None:
        #: the records: ``[k, width]`` zero-padded (gathered), or unpadded (routed)
        self.matrix = matrix
        if isinstance(matrix, RaggedRecords):
            self._flat, self._start, self._end = matrix.words_W, matrix.start_K, matrix.end_K
        else:
            k, width = matrix.shape
            self._flat = np.ascontiguousarray(matrix).reshape(-1)
            self._start = np.arange(k, dtype=_I64) * width
            self._end = self._start + width
        #: records held
        self.n_rows = int(self._start.size)
        #: ``[2 * HEADER (+ heads)]`` the exchange's reduced :func:`header_summary`
        #: (``None``: offline, the headers are read off the matrix)
        self.summary_2H = summary_2H
        #: ``[k]`` ascending member index of each row (``None``: row ``j`` is member ``j``)
        self.members = None if members is None else np.asarray(members, dtype=_I64)
        self._header: np.ndarray | None = None
        #: every header agrees (:meth:`uniform_slots` found it)
        self._uniform = False

    @property
    def routed(self) -> bool:
        """Whether this matrix holds some members' records only."""
        return self.members is not None

    def has(self, j: int) -> bool:
        """Whether member ``j``'s record is here."""
        if self.members is None:
            return 0 <= j < self.n_rows
        at = int(self.members.searchsorted(j))
        return at < self.members.size and int(self.members[at]) == j

    def rows(self, members: np.ndarray) -> np.ndarray:
        """``[len(members)]`` the row of each member's record (they must be here)."""
        if self.members is None:
            return members
        at = self.members.searchsorted(members)
        ok = at < self.members.size
        ok[ok] = self.members[at[ok]] == members[ok]
        if not bool(ok.all()):
            raise AssertionError(
                f"records of members {np.asarray(members)[~ok][:8].tolist()} were not routed here"
            )
        return at

    def row(self, j: int) -> np.ndarray:
        """Member ``j``'s record (its row: padding past its ``size`` included, if any)."""
        r = int(self.rows(np.asarray([j], dtype=_I64))[0])
        return self._flat[int(self._start[r]) : int(self._end[r])]

    def header_NH(self) -> np.ndarray:
        """``[n_members, HEADER]`` every record's fixed header, copied once in one pass over the
        matrix's rows (a column of a wide matrix touches a page per row): what the fence and
        the verdicts read when the summary says some rank differs."""
        if self.members is not None:
            raise AssertionError("a routed matrix holds some records only: no header verdicts")
        if self._header is None:
            if isinstance(self.matrix, RaggedRecords):
                self._header = self._flat[self._start[:, None] + np.arange(HEADER, dtype=_I64)]
            else:
                self._header = np.ascontiguousarray(self.matrix[:, :HEADER])
        return self._header

    def uniform_slots(self) -> int | None:
        """The step's micro-batch count when every record is of this format, built with one
        config, error-free, ready, at one step, and every count given agrees; else ``None``
        (the caller then looks for what differs). From the exchange's summary when there is
        one (no header read), else one pass over the headers when they are all the first's, a
        few otherwise."""
        if self.summary_2H is not None:
            count = uniform_count(self.summary_2H)
            self._uniform = count is not None
            return count
        h = self.header_NH()
        if not h.shape[0]:
            return None
        first = h[0]
        if first[0] != MAGIC or first[3] != 0 or first[5] != STATE_READY:
            return None
        if (h[:, :2] != first[:2]).any() or (h[:, 3:MEMO_STEP] != first[3:MEMO_STEP]).any():
            return None
        slots = h[:, 2]
        given = slots[slots >= 0]
        if not given.size or given.min() != given.max():
            return None
        return int(given[0])

    def unchanged_since(self, memo_step: int) -> bool:
        """Whether every record says its tables are word for word those it sent at step
        ``memo_step`` (see the module doc): then a plan key derived from that step's tables
        holds for this one. One pass over two header columns (none when every header agrees,
        :meth:`uniform_slots` having seen that in the summary)."""
        if memo_step < 0 or not self.n_rows:
            return False
        if self._uniform and self.summary_2H is not None:
            return reuses_memo(self.summary_2H, memo_step)
        h = self.header_NH()
        return bool((h[:, MEMO_STEP] == memo_step).all() and (h[:, UNCHANGED] == 1).all())

    def teacher_head(self, section: int, first: int) -> tuple[int, int, int]:
        """``(dtype_code, hidden, device_code)`` of teacher ``section`` as its first source
        group's leader (member ``first``) gives it: from the summary when it says every holder
        gives the same (a routed matrix need not hold that record), else off the record."""
        if self.summary_2H is not None:
            heads = summary_heads(self.summary_2H)
            if heads is not None and section < len(heads):
                return heads[section]
        a, b, c, _ = self.section_head(first, section)
        return a, b, c

    def magic_N(self) -> np.ndarray:
        return self.header_NH()[:, 0]

    def config_sig_N(self) -> np.ndarray:
        return self.header_NH()[:, 1]

    def n_slots_N(self) -> np.ndarray:
        return self.header_NH()[:, 2]

    def error_bytes_N(self) -> np.ndarray:
        return self.header_NH()[:, 3]

    def state_N(self) -> np.ndarray:
        return self.header_NH()[:, 5]

    def step_N(self) -> np.ndarray:
        return self.header_NH()[:, 6]

    def agreements(self, j: int) -> dict[int, np.ndarray]:
        """Member ``j``'s agreements, ``key -> words`` (read from the end its ``size`` says)."""
        rec = self.row(j)
        end = int(rec[SIZE]) - 1
        if end < 0:
            return {}
        n = int(rec[end])
        block = rec[end - n : end]
        out: dict[int, np.ndarray] = {}
        at = 0
        while at < n:
            key, count = int(block[at]), int(block[at + 1])
            out[key] = block[at + 2 : at + 2 + count]
            at += 2 + count
        return out

    def error(self, j: int) -> str:
        """Member ``j``'s local error text (``""``: none)."""
        rec = self.row(j)
        n, at = int(rec[3]), int(rec[4])
        if n <= 0:
            return ""
        words = rec[at : at + (n + 7) // 8].astype("<i8")
        return words.tobytes()[:n].decode(errors="replace")

    def section_head(self, j: int, section: int) -> tuple[int, int, int, int]:
        """``(dtype_code, hidden, device_code, n_slots)`` of member ``j``'s section."""
        rec = self.row(j)
        at = int(rec[HEADER + section])
        return tuple(int(x) for x in rec[at : at + _SECTION_HEAD])  # type: ignore[return-value]

    def slot_fields(
        self,
        members: np.ndarray,
        section: int,
        slot: int,
        fields: Sequence[int] = tuple(range(SLOT_FIELDS)),
    ) -> np.ndarray:
        """``[len(members), len(fields)]`` slot-table rows ``(n_rows, n_runs, runs_offset,
        sample_min, sample_max, digest, n_tokens)`` of ``section`` / ``slot`` in each given member's
        record (the members must hold the section); ``fields``: which of those columns."""
        flat = self._flat
        start = self._start[self.rows(np.asarray(members, dtype=_I64))]
        at = start + flat[start + HEADER + section] + _SECTION_HEAD + SLOT_FIELDS * slot
        # one gather from the flat records: a third of a 2-D fancy index over scattered rows
        return flat[at[:, None] + np.asarray(fields, dtype=_I64)]

    def slot_tables(
        self, members: np.ndarray, section: int, *, n_sections: int, n_slots: int
    ) -> np.ndarray:
        """``[len(members), n_slots, SLOT_FIELDS]`` every slot's table row of ``section`` in
        each given member's record, for an agreed step (the members hold the section): one
        strided slice at :func:`table_offset`, the same column in every record."""
        at = table_offset(section, n_sections=n_sections, n_slots=n_slots)
        rows = self.rows(np.asarray(members, dtype=_I64))
        if isinstance(self.matrix, RaggedRecords):
            cols = at + np.arange(SLOT_FIELDS * n_slots, dtype=_I64)
            block = self._flat[self._start[rows][:, None] + cols]
        else:
            block = self.matrix[rows, at : at + SLOT_FIELDS * n_slots]
        return block.reshape(len(rows), n_slots, SLOT_FIELDS)

    def runs_many(
        self, members: np.ndarray, sections: np.ndarray, slots: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """``([K, 5], [len(members)])``: the runs each given member sent for its section (of
        ``sections``) in its slot (of ``slots``), concatenated in order, and how many each
        sent; one gather from the flat records (:meth:`runs` of each, in one read)."""
        flat = self._flat
        row_at = self._start[self.rows(np.asarray(members, dtype=_I64))]
        at = (
            row_at
            + flat[row_at + HEADER + np.asarray(sections, dtype=_I64)]
            + _SECTION_HEAD
            + SLOT_FIELDS * np.asarray(slots, dtype=_I64)
        )
        n_X = flat[at + _N_RUNS]
        if n_X.size and int(n_X.min()) < 0:
            raise AssertionError(f"members {members[n_X < 0][:4].tolist()} sent no runs")
        start = row_at + flat[at + _RUNS_OFF]
        x, t = fan_out(5 * n_X)
        return flat[start[x] + t].reshape(-1, 5), n_X

    def runs(self, j: int, section: int, slot: int) -> np.ndarray:
        """``[K, 5]`` runs member ``j`` sent for ``section`` / ``slot`` (a view, no copy)."""
        f = self.slot_fields(np.asarray([j]), section, slot)[0]
        n, at = int(f[_N_RUNS]), int(f[_RUNS_OFF])
        if n < 0:
            raise AssertionError(f"member {j} sent no runs for section {section} slot {slot}")
        return self.row(j)[at : at + 5 * n].reshape(n, 5)
