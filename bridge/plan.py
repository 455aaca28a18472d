"""The transfer planner: each rank plans only its own sends and receives, from runs of keys.

Why this file exists: deciding who sends which row to whom is pure integer work that both ends
of every transfer must derive identically, without a process group (the ``mopd plan`` inspector
and the unit tests call it directly), and at a cost that follows the rank's own work, not the
job's: one rank of a 16k-rank job must not plan the other 16k ranks' transfers.

Model (all tokens are keys ``(sample_id, position)``; rows are rows of a flat ``[R, H]`` buffer):

- a :class:`SourceGroup` is a set of replicas (global ranks) holding identical buffers: a
  teacher's last-stage TP group for one ``(dp, cp)`` shard, or, for the LM head, the teacher
  ranks holding one vocab shard; its rows are described by runs (:data:`RUN_COLUMNS`);
- a :class:`DestGroup` is a set of global ranks sharing one crossing: its ``N`` rows are split
  into near-equal contiguous slices (:meth:`DestGroup.slice_bounds`), ``ranks[j]`` receives
  slice ``j`` and the group then all-gathers (a student TP group for one ``(dp, cp)`` shard), or
  a single rank;
- every destination row's key is held by exactly one source group (else a verdict of
  :func:`check_rank`), so each needed token crosses into its destination group once;
- the tokens one source group ``g`` sends to one destination slot ``s`` (global slot index:
  slots of all destination groups, in order) form a *block*, in increasing destination-row
  order. A block of ``n`` tokens is cut into ``k = len(g.ranks)`` near-equal contiguous chunks,
  chunk ``c`` holding tokens ``[ceil(c n / k), ceil((c + 1) n / k))``, served by replica
  ``g.ranks[(c + g + s) % k]`` (the rotation spreads the remainders over the replicas). If a
  replica of ``g`` is the slot's own rank and ``local_copy`` is on, it serves the whole block as
  a local copy instead.

A rank's share of that, :class:`RankPlan`, is in *run form*: every transfer is a table of
segments ``(src_row, src_step, dst_row, dst_step, length)``, in destination-row order, that both
ends derive the same way. Destination rows are relative to the receiving rank's slice.

How a rank plans (never a token at a time, never a group it has no business with):

- peers come from the ``[G, 2]`` / ``[D, 2]`` sample ranges (one vectorized comparison): a
  receiving rank reads its destination group's runs and those of the source groups whose range
  meets it; a sending rank reads its source group's runs and those of the destination groups
  whose range meets it;
- the join is by key interval: source runs sorted by first key (they are disjoint), each
  destination run finds the source runs it overlaps with two binary searches, and every overlap
  becomes a *piece* (a segment of rows ``src_row + i * src_step -> dst_row + i * dst_step``);
- pieces are cut where a slice ends and where a chunk ends (integer arithmetic on the piece),
  sorted by destination row inside their block, and consecutive pieces that continue each other
  are merged. Only pieces whose destination rows interleave (a strided ``[S, B, H]``
  destination) are expanded into tokens, and only inside the slot that needs them;
- verdicts (:func:`check_rank`) are interval arithmetic on the same runs: overlaps of a group's
  sorted runs (held twice inside the group), overlaps with earlier groups whose range meets it
  (held twice across groups), gaps between a destination run and the union of the sources
  (needed but held by nobody);
- a step's micro-batches go together (:func:`plan_ranks`, :func:`check_ranks`): their runs are
  read in one batch (:func:`read_runs`), sample ids made distinct per micro-batch
  (:func:`dense_samples`) so that one join, one cut and one chunking serve them all, and each
  micro-batch's plan and verdicts are those it gets alone; the number of array operations per
  step does not grow with the micro-batches or the peers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "RUN_COLUMNS",
    "SEGMENT_COLUMNS",
    "DestGroup",
    "DestSlot",
    "GroupIndex",
    "RankPlan",
    "RunCatalog",
    "RunFetch",
    "SourceGroup",
    "StepBatch",
    "Transfer",
    "check_rank",
    "check_ranks",
    "dense_samples",
    "plan_rank",
    "plan_ranks",
    "read_runs",
]

#: Columns of a ``[K, 5]`` int64 run table: rows ``row + i * step`` hold positions
#: ``position + i`` of sample ``sample`` (``i < length``; ``step`` is 1 for runs of length 1).
RUN_COLUMNS = ("sample", "position", "row", "step", "length")
#: Columns of a ``[S, 5]`` int64 segment table: token ``i < length`` of a segment moves from
#: source row ``src_row + i * src_step`` to destination row ``dst_row + i * dst_step``.
SEGMENT_COLUMNS = ("src_row", "src_step", "dst_row", "dst_step", "length")

_I64 = np.int64
_EMPTY = np.empty(0, dtype=_I64)


@dataclass(frozen=True, kw_only=True)
class SourceGroup:
    """Replicas holding identical rows.

    Attributes:
        owner: which output buffer the rows belong to (teacher index).
        ranks: global ranks of the replicas (each holds the whole buffer).
        num_rows: rows of the replicas' flat buffer.
        label: for messages (``"teacher 0 (dp=1, cp=0)"``).
    """

    owner: int
    ranks: tuple[int, ...]
    num_rows: int
    label: str = ""


@dataclass(frozen=True, kw_only=True)
class DestGroup:
    """Ranks sharing one crossing: ``num_rows`` rows cut into ``len(ranks)`` slices.

    Attributes:
        ranks: global ranks; ``ranks[j]`` receives slice ``j`` (:meth:`slice_bounds`).
        num_rows: rows of the group's full flat buffer.
        label: for messages.
    """

    ranks: tuple[int, ...]
    num_rows: int
    label: str = ""

    @property
    def slice_rows(self) -> int:
        """Rows of every slice but maybe the last: ``ceil(num_rows / len(ranks))``."""
        return -(-self.num_rows // len(self.ranks))

    def slice_bounds(self, j: int) -> tuple[int, int]:
        """``[start, stop)`` rows of slice ``j`` (the last ones may be short or empty)."""
        n = self.slice_rows
        return min(j * n, self.num_rows), min((j + 1) * n, self.num_rows)


@dataclass(frozen=True, kw_only=True, eq=False)
class GroupIndex:
    """The groups' ranks as flat arrays, and the lookups a rank starts from.

    Depends on the groups' ranks only (not on rows or runs), so a :class:`~mopd.bridge.topology.
    Topology` builds it once and every micro-batch's catalog shares it.

    Attributes:
        owner_G: ``[G]`` owner of each source group.
        rep_off_G1: ``[G + 1]`` offsets of each source group's replicas in ``rep_rank_X``.
        rep_rank_X: replica ranks of all source groups, concatenated.
        slot_off_D1: ``[D + 1]`` offsets of each destination group's slots (global slot index).
        slot_rank_S: ``[S]`` receiving rank of each global slot.
        source_groups: ``rank ->`` the source groups it is a replica of, ascending.
        dest_groups: ``rank ->`` the destination groups it is a slot of, ascending (it receives
            into the first one).
    """

    owner_G: np.ndarray
    rep_off_G1: np.ndarray
    rep_rank_X: np.ndarray
    slot_off_D1: np.ndarray
    slot_rank_S: np.ndarray
    source_groups: Mapping[int, tuple[int, ...]]
    dest_groups: Mapping[int, tuple[int, ...]]

    @staticmethod
    def build(sources: Sequence[SourceGroup], dests: Sequence[DestGroup]) -> GroupIndex:
        """The index of ``sources`` and ``dests`` (``O(ranks)``, once per topology)."""
        reps = [s.ranks for s in sources]
        slots = [d.ranks for d in dests]
        by_rank: dict[int, list[int]] = {}
        for g, ranks in enumerate(reps):
            for r in dict.fromkeys(ranks):
                by_rank.setdefault(r, []).append(g)
        by_slot: dict[int, list[int]] = {}
        for d, ranks in enumerate(slots):
            for r in dict.fromkeys(ranks):
                by_slot.setdefault(r, []).append(d)
        return GroupIndex(
            owner_G=np.asarray([s.owner for s in sources], dtype=_I64),
            rep_off_G1=np.cumsum([0] + [len(r) for r in reps], dtype=_I64),
            rep_rank_X=np.asarray([r for ranks in reps for r in ranks], dtype=_I64),
            slot_off_D1=np.cumsum([0] + [len(r) for r in slots], dtype=_I64),
            slot_rank_S=np.asarray([r for ranks in slots for r in ranks], dtype=_I64),
            source_groups={r: tuple(gs) for r, gs in by_rank.items()},
            dest_groups={r: tuple(ds) for r, ds in by_slot.items()},
        )


@dataclass(eq=False)
class StepBatch:
    """A step's catalogs (one per micro-batch, :attr:`RunCatalog.slot` its index here) that
    :func:`plan_rank` and :func:`check_rank` handle together: the first call for one of the
    ``pending`` catalogs plans (checks) every pending one for that rank in one pass
    (:func:`plan_ranks`, :func:`check_ranks`), later calls read its result. The caller marks
    which micro-batches it is about to plan (:meth:`expect`) and lets go of the results when
    done (:meth:`done`).

    Attributes:
        catalogs: the step's catalogs, by micro-batch (built on first access).
        pending: the micro-batches planned / checked together, ascending.
    """

    catalogs: Sequence[RunCatalog]
    pending: tuple[int, ...] = ()
    _plans: dict[tuple[int, bool, bool], dict[int, RankPlan]] = field(default_factory=dict)
    _checks: dict[int, dict[int, list[str]]] = field(default_factory=dict)

    def expect(self, slots: Sequence[int]) -> None:
        """The micro-batches about to be planned or checked, one call each."""
        self.done()
        self.pending = tuple(sorted(slots))

    def done(self) -> None:
        """Forget the pending micro-batches and their results."""
        self.pending = ()
        self._plans.clear()
        self._checks.clear()


#: :attr:`RunCatalog.fetch`: ``(side, slots, groups) -> ([K, 5] runs, [len(groups)] counts)``.
RunFetch = Callable[[str, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True, kw_only=True, eq=False)
class RunCatalog:
    """What every rank contributed for one exchange, looked up lazily.

    Attributes:
        sources, dests: every group of the exchange, in plan order (the same on every rank);
            any sequence (a :class:`~mopd.bridge.topology.Topology` hands lazy ones that build
            a group only when it is looked at).
        source_runs: ``g -> [K, 5]`` int64 runs of source group ``g`` (:data:`RUN_COLUMNS`).
        dest_runs: ``d -> [K, 5]`` int64 runs of destination group ``d``.
        source_range_G2, dest_range_D2: ``[G, 2]`` / ``[D, 2]`` int64 smallest and largest
            sample id of each group's runs (``(1, 0)`` for a group without tokens): where a
            group's tokens can be found without decoding its runs; with ``source_ids`` /
            ``dest_ids``, of those groups only (row ``r`` is group ``ids[r]``).
        group_index: the groups' :class:`GroupIndex`, when the caller has it (else built from
            ``sources`` and ``dests`` on first use, ``O(groups)``).
        source_ids, dest_ids: ``[G']`` / ``[D']`` ascending: the only groups whose runs can be
            read (a rank's routed records: :mod:`mopd.bridge.peers`); ``None``: every group.
            The planner looks for a group's peers among these: it must hold every group that
            shares a sample with the groups the caller plans or checks.
        fetch: ``(side, slots, groups) -> ([K, 5] runs, [len(groups)] runs of each)``:
            several groups' runs (``side`` ``"s"`` or ``"d"``), each in its micro-batch
            (``slots``: in the numbering of the catalogs sharing this ``fetch``), in one read,
            as ``source_runs`` / ``dest_runs`` give them one by one, concatenated; ``None``:
            read one by one.
        slot: this catalog's micro-batch in ``fetch``'s numbering.
        dest_rows_D: ``[D]`` (``[D']`` with ``dest_ids``) each destination group's rows, when
            the caller has them (else read off :attr:`dests`).
        batch: the step's catalogs this one is planned and checked with (:class:`StepBatch`):
            :func:`plan_rank` / :func:`check_rank` of one of its pending catalogs plan (check)
            them all at once; ``None``: this catalog alone.

    The planner reads each group's runs at most once per catalog (kept in a private memo).
    """

    sources: Sequence[SourceGroup]
    dests: Sequence[DestGroup]
    source_runs: Callable[[int], np.ndarray]
    dest_runs: Callable[[int], np.ndarray]
    source_range_G2: np.ndarray
    dest_range_D2: np.ndarray
    group_index: GroupIndex | None = None
    source_ids: np.ndarray | None = None
    dest_ids: np.ndarray | None = None
    fetch: RunFetch | None = None
    slot: int = 0
    dest_rows_D: np.ndarray | None = None
    batch: StepBatch | None = None
    _memo: dict[Any, Any] = field(default_factory=dict, init=False, repr=False)

    def source_range(self, g: int) -> tuple[int, int]:
        """Source group ``g``'s ``(smallest, largest)`` sample id."""
        return _range_of(self.source_range_G2, self.source_ids, g)

    def dest_range(self, d: int) -> tuple[int, int]:
        """Destination group ``d``'s ``(smallest, largest)`` sample id."""
        return _range_of(self.dest_range_D2, self.dest_ids, d)

    def dest_rows(self, ds: np.ndarray) -> np.ndarray:
        """``[len(ds)]`` the rows of destination groups ``ds`` in this micro-batch."""
        if self.dest_rows_D is None:
            return np.asarray([self.dests[int(d)].num_rows for d in ds], dtype=_I64)
        return self.dest_rows_D[_rows_in(self.dest_ids, np.asarray(ds, dtype=_I64))]

    def sources_meeting(self, lo: int, hi: int) -> np.ndarray:
        """Source groups (ascending) whose non-empty sample range meets ``[lo, hi]``."""
        return _overlapping(self.source_range_G2, lo, hi, self.source_ids)

    def dests_meeting(self, lo: int, hi: int) -> np.ndarray:
        """Destination groups (ascending) whose non-empty sample range meets ``[lo, hi]``."""
        return _overlapping(self.dest_range_D2, lo, hi, self.dest_ids)

    def index(self) -> GroupIndex:
        """:attr:`group_index`, or the one built from the groups (once)."""
        if self.group_index is not None:
            return self.group_index
        ix = self._memo.get("index")
        if ix is None:
            ix = self._memo["index"] = GroupIndex.build(self.sources, self.dests)
        return ix

    def slot_offsets(self) -> np.ndarray:
        """``[D + 1]`` int64: destination group ``d``'s slots are ``offsets[d] .. offsets[d + 1]``."""
        return self.index().slot_off_D1.copy()

    def recording_reads(self) -> tuple[RunCatalog, set[int], set[int]]:
        """A fresh catalog over the same contributions that notes which groups' runs are read.

        Returns:
            ``(catalog, source_ids, dest_ids)``: planning or checking with ``catalog`` adds
            each source / destination group whose runs it decodes to the two sets (how the
            plan benchmark and tests see that a rank reads only its peers).
        """
        source_ids: set[int] = set()
        dest_ids: set[int] = set()

        def source_runs(g: int) -> np.ndarray:
            source_ids.add(g)
            return self.source_runs(g)

        def dest_runs(d: int) -> np.ndarray:
            dest_ids.add(d)
            return self.dest_runs(d)

        catalog = RunCatalog(
            sources=self.sources,
            dests=self.dests,
            source_runs=source_runs,
            dest_runs=dest_runs,
            source_range_G2=self.source_range_G2,
            dest_range_D2=self.dest_range_D2,
            group_index=self.group_index,
            source_ids=self.source_ids,
            dest_ids=self.dest_ids,
        )
        return catalog, source_ids, dest_ids


@dataclass(frozen=True, kw_only=True, eq=False)
class Transfer:
    """One message (or local copy) of one owner between two ranks.

    Attributes:
        owner: teacher index.
        src_rank, dst_rank: global ranks (equal for a local copy).
        segments_S5: ``[S, 5]`` int64 (:data:`SEGMENT_COLUMNS`), in destination-row order;
            source rows are rows of the source buffer, destination rows are relative to the
            receiving rank's slice.
    """

    owner: int
    src_rank: int
    dst_rank: int
    segments_S5: np.ndarray

    @property
    def count(self) -> int:
        """Tokens moved."""
        return int(self.segments_S5[:, 4].sum())


@dataclass(frozen=True, kw_only=True)
class DestSlot:
    """Where a receiving rank's slice sits.

    Two forms. The *layout* form (``owner_rows == ()``, :func:`plan_rank` with
    ``compact=False``): every owner's buffer has the group's ``num_rows`` rows in the order of
    its layout, cut into near-equal slices. The *compact* form (``compact=True``): owner ``k``'s
    buffer holds only the ``owner_rows[k]`` rows it owns, in the layout's row order, cut into
    slices of ``ceil(owner_rows[k] / group_size)`` rows (:meth:`slice_nominal`), so that a TP
    all-gather of equal slices lands them in place.

    Attributes:
        group: index into :attr:`RunCatalog.dests`.
        slot: this rank's slice index in the group.
        row_offset: layout form: first row of the slice in the group's full buffer.
        slice_rows: layout form: rows of the slice (may be fewer than the group's
            ``slice_rows`` at the end).
        num_rows: rows of the group's layout.
        padded_rows: layout form: ``len(ranks) * DestGroup.slice_rows``, the rows a buffer
            needs for an all-gather of equal slices.
        group_size: ranks of the destination group.
        owner_rows: compact form: rows owner ``k`` delivers to the group (its tokens there);
            ``()`` in the layout form.
    """

    group: int
    slot: int
    row_offset: int
    slice_rows: int
    num_rows: int
    padded_rows: int
    group_size: int = 1
    owner_rows: tuple[int, ...] = ()

    @property
    def compact(self) -> bool:
        return bool(self.owner_rows)

    def out_rows(self, owner: int) -> int:
        """Rows of ``owner``'s delivered buffer (``owner_rows[owner]``, or ``num_rows``)."""
        if not self.owner_rows:
            return self.num_rows
        return self.owner_rows[owner] if owner < len(self.owner_rows) else 0

    def slice_nominal(self, owner: int) -> int:
        """Rows of every slice of ``owner``'s buffer (the all-gather's equal slices)."""
        return -(-self.out_rows(owner) // max(1, self.group_size))

    def padded(self, owner: int) -> int:
        """Rows ``owner``'s buffer needs for the all-gather: ``group_size * slice_nominal``
        (at most ``group_size - 1`` more than :meth:`out_rows`)."""
        return self.group_size * self.slice_nominal(owner)

    def slice_start(self, owner: int) -> int:
        """First row of this rank's slice in ``owner``'s buffer."""
        return self.slot * self.slice_nominal(owner)

    def slice_real(self, owner: int) -> int:
        """Rows of this rank's slice of ``owner``'s buffer that hold tokens (the rest: padding)."""
        n = self.out_rows(owner)
        return max(0, min(self.slice_start(owner) + self.slice_nominal(owner), n)) - min(
            self.slice_start(owner), n
        )


@dataclass(frozen=True, kw_only=True, eq=False)
class RankPlan:
    """One global rank's share of an exchange.

    Attributes:
        rank: the global rank.
        sends: transfers this rank sends, sorted by ``(owner, dst_rank)``.
        recvs: transfers this rank receives, sorted by ``(owner, src_rank)``.
        locals: local copies (source replica on this rank), sorted by owner.
        dest: this rank's slice, or ``None`` when it receives nothing.
        owner_N: ``[N]`` int64 (``dest.num_rows``), which owner fills each row of the whole
            destination group's buffer (``-1``: padding or missing); ``None`` without ``dest``.
    """

    rank: int
    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]
    locals: tuple[Transfer, ...]
    dest: DestSlot | None
    owner_N: np.ndarray | None


# --- runs and keys ---------------------------------------------------------------------------


def _runs(catalog: RunCatalog, side: str, i: int) -> np.ndarray:
    """Group ``i``'s ``[K, 5]`` runs (``side`` ``"s"`` or ``"d"``), read once per catalog.

    A copy with empty runs dropped and the step of runs of length 1 set to 1.
    """
    key = (side, i)
    got = catalog._memo.get(key)
    if got is None:
        raw = catalog.source_runs(i) if side == "s" else catalog.dest_runs(i)
        got = np.array(raw, dtype=_I64).reshape(-1, 5)
        if got.shape[0]:
            got = got[got[:, 4] > 0]
            got[got[:, 4] == 1, 3] = 1
        catalog._memo[key] = got
    return got


def _tagged(catalog: RunCatalog, side: str, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The runs of several groups, concatenated: ``([K, 5] runs, [K] group of each run)``."""
    tables = [_runs(catalog, side, int(g)) for g in groups.tolist()]
    if not tables:
        return np.empty((0, 5), dtype=_I64), _EMPTY
    tag = np.repeat(groups.astype(_I64), [t.shape[0] for t in tables])
    return np.concatenate(tables), tag


def _overlapping(
    range_X2: np.ndarray, lo: int, hi: int, ids_X: np.ndarray | None = None
) -> np.ndarray:
    """The groups (ascending) whose non-empty sample range meets ``[lo, hi]``: indices of
    ``range_X2``'s rows, or with ``ids_X`` the ids of those rows."""
    if lo > hi:
        return _EMPTY
    a, b = range_X2[:, 0], range_X2[:, 1]
    at = np.flatnonzero((a <= hi) & (b >= lo) & (a <= b))
    return at if ids_X is None else ids_X[at]


def _range_of(range_X2: np.ndarray, ids_X: np.ndarray | None, x: int) -> tuple[int, int]:
    """Group ``x``'s row of ``range_X2`` (with ``ids_X``: the row of id ``x``, which must be
    there)."""
    at = x
    if ids_X is not None:
        at = int(np.searchsorted(ids_X, x))
        if at >= ids_X.size or int(ids_X[at]) != x:
            raise AssertionError(f"group {x} is not among the catalog's groups")
    lo, hi = range_X2[at]
    return int(lo), int(hi)


def _key_space(*tables: np.ndarray) -> tuple[np.ndarray, int]:
    """``(samples, stride)``: key ``index(sample) * stride + position`` orders the tokens of
    ``tables`` by ``(sample, position)`` (dense sample indices: no overflow for sparse ids)."""
    live = [t for t in tables if t.shape[0]]
    if not live:
        return _EMPTY, 1
    u = np.unique(np.concatenate([t[:, 0] for t in live]))
    stride = int(max(int((t[:, 1] + t[:, 4]).max()) for t in live)) + 1
    if u.size * stride >= 2**62:
        raise ValueError(f"{u.size} samples with positions up to {stride} overflow int64 keys")
    return u, stride


def _keys(runs_K5: np.ndarray, u: np.ndarray, stride: int) -> np.ndarray:
    """``[K]`` first key of each run (see :func:`_key_space`)."""
    return np.searchsorted(u, runs_K5[:, 0]) * stride + runs_K5[:, 1]


def _overlaps(
    start_A: np.ndarray, end_A: np.ndarray, start_B: np.ndarray, end_B: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Pairs ``(b, a)`` of intervals ``[start, end)`` that overlap: ``A`` sorted and disjoint
    (``start_A`` and ``end_A`` increasing), ``B`` any; by ``b``, then ``a`` increasing."""
    lo = np.searchsorted(end_A, start_B, side="right")
    hi = np.searchsorted(start_A, end_B, side="left")
    b, t = _fan_out(np.maximum(hi - lo, 0))
    return b, lo[b] + t


def _fan_out(n_K: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(k, t)``: each index ``k`` repeated ``n_K[k]`` times, and beside it ``t = 0 ..
    n_K[k] - 1`` (a segmented arange)."""
    k = np.repeat(np.arange(n_K.size, dtype=_I64), n_K)
    t = np.arange(k.size, dtype=_I64) - np.repeat(np.cumsum(n_K) - n_K, n_K)
    return k, t


def _ceil_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return -(-a // b)


# --- pieces ----------------------------------------------------------------------------------


_PIECE_FIELDS = (
    "mb",
    "grp",
    "dst",
    "slot",
    "src_row",
    "src_step",
    "dst_row",
    "dst_step",
    "length",
)


@dataclass(kw_only=True, eq=False)
class _Pieces:
    """Segments of one join, one per array element (``P`` pieces).

    ``mb``: micro-batch; ``grp``: source group; ``dst``: destination (a group, or an instance
    of one in a micro-batch: :func:`plan_ranks`); ``slot``: global slot (after
    :func:`_cut_slices`); then the segment columns. ``dst_step >= 1`` throughout.
    """

    mb: np.ndarray
    grp: np.ndarray
    dst: np.ndarray
    slot: np.ndarray
    src_row: np.ndarray
    src_step: np.ndarray
    dst_row: np.ndarray
    dst_step: np.ndarray
    length: np.ndarray

    @property
    def size(self) -> int:
        return int(self.length.size)

    def take(self, idx: np.ndarray) -> _Pieces:
        return _Pieces(
            mb=self.mb[idx],
            grp=self.grp[idx],
            dst=self.dst[idx],
            slot=self.slot[idx],
            src_row=self.src_row[idx],
            src_step=self.src_step[idx],
            dst_row=self.dst_row[idx],
            dst_step=self.dst_step[idx],
            length=self.length[idx],
        )

    def sub(self, idx: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> _Pieces:
        """Tokens ``lo .. hi - 1`` of pieces ``idx`` (``0 <= lo < hi <= length``), each a piece
        (steps of one-token pieces set to 1)."""
        out = self.take(idx)
        out.src_row = out.src_row + lo * out.src_step
        out.dst_row = out.dst_row + lo * out.dst_step
        out.length = hi - lo
        one = out.length == 1
        out.src_step[one] = 1
        out.dst_step[one] = 1
        return out

    @staticmethod
    def concat(parts: Sequence[_Pieces]) -> _Pieces:
        return _Pieces(
            **{name: np.concatenate([getattr(p, name) for p in parts]) for name in _PIECE_FIELDS}
        )

    def segments_S5(self) -> np.ndarray:
        return np.stack([self.src_row, self.src_step, self.dst_row, self.dst_step, self.length], 1)


def _no_pieces() -> _Pieces:
    e = _EMPTY
    return _Pieces(
        mb=e, grp=e, dst=e, slot=e, src_row=e, src_step=e, dst_row=e, dst_step=e, length=e
    )


def _join(
    src_K5: np.ndarray, src_grp_K: np.ndarray, dst_K5: np.ndarray, dst_id_K: np.ndarray
) -> _Pieces:
    """Every overlap of a source run with a destination run, as a piece.

    Source runs must be disjoint in key (input :func:`check_rank` passes); destination runs may
    be anything. Pieces come with ``dst_step >= 1`` (a run whose rows go backwards is flipped)
    and steps of 1 where they hold one token; ``slot`` is not set yet (``-1``).
    """
    if not src_K5.shape[0] or not dst_K5.shape[0]:
        return _no_pieces()
    u, stride = _key_space(src_K5, dst_K5)
    ks = _keys(src_K5, u, stride)
    o = np.argsort(ks, kind="stable")
    src_K5, src_grp_K, ks = src_K5[o], src_grp_K[o], ks[o]
    ke = ks + src_K5[:, 4]
    kd = _keys(dst_K5, u, stride)
    b, a = _overlaps(ks, ke, kd, kd + dst_K5[:, 4])
    first = np.maximum(kd[b], ks[a])
    length = np.minimum(kd[b] + dst_K5[b, 4], ke[a]) - first
    src_step, dst_step = src_K5[a, 3], dst_K5[b, 3]
    src_row = src_K5[a, 2] + (first - ks[a]) * src_step
    dst_row = dst_K5[b, 2] + (first - kd[b]) * dst_step
    back = dst_step < 0
    if back.any():  # rows going backwards: the same tokens, last one first
        tail = length[back] - 1
        src_row[back] += tail * src_step[back]
        dst_row[back] += tail * dst_step[back]
        src_step[back] *= -1
        dst_step[back] *= -1
    one = length == 1
    src_step[one] = 1
    dst_step[one] = 1
    return _Pieces(
        mb=np.zeros(b.size, dtype=_I64),
        grp=src_grp_K[a],
        dst=dst_id_K[b],
        slot=np.full(b.size, -1, dtype=_I64),
        src_row=src_row,
        src_step=src_step,
        dst_row=dst_row,
        dst_step=dst_step,
        length=length,
    )


def _cut_slices(p: _Pieces, slice_rows_P: np.ndarray, slot0_P: np.ndarray) -> _Pieces:
    """Pieces cut where their destination group's slices end; ``slot`` set (global slot)."""
    n = np.maximum(slice_rows_P, 1)
    q0 = p.dst_row // n
    q1 = (p.dst_row + (p.length - 1) * p.dst_step) // n
    m = q1 - q0 + 1
    if p.size == 0 or bool((m == 1).all()):
        p.slot = slot0_P + q0
        return p
    i, t = _fan_out(m)
    q = q0[i] + t
    r0, st, ni = p.dst_row[i], p.dst_step[i], n[i]
    lo = np.maximum(_ceil_div(q * ni - r0, st), 0)
    hi = np.minimum(_ceil_div((q + 1) * ni - r0, st), p.length[i])
    keep = hi > lo
    i, q, lo, hi = i[keep], q[keep], lo[keep], hi[keep]
    out = p.sub(i, lo, hi)
    out.slot = slot0_P[i] + q
    return out


def _sort_blocks(p: _Pieces) -> tuple[_Pieces, np.ndarray, np.ndarray]:
    """Pieces sorted by block ``(mb, grp, slot)``, then destination row: ``(pieces, block_P,
    starts_B)`` with ``block_P`` the dense block index of each piece."""
    o = np.lexsort((p.dst_row, p.slot, p.grp, p.mb))
    p = p.take(o)
    new = np.ones(p.size, dtype=bool)
    new[1:] = (p.grp[1:] != p.grp[:-1]) | (p.slot[1:] != p.slot[:-1]) | (p.mb[1:] != p.mb[:-1])
    return p, np.cumsum(new) - 1, np.flatnonzero(new)


def _token_segments(
    p: _Pieces, i_M: np.ndarray, src_M: np.ndarray, dst_M: np.ndarray, brk_M: np.ndarray
) -> _Pieces:
    """Token pairs in order, ``src_M -> dst_M`` (token ``m`` of piece ``i_M[m]`` of ``p``),
    cut back into segments: one piece per segment, with the fields of its first token's piece.

    A token starts a segment where ``brk_M`` says so; otherwise it continues the previous one
    when the previous token was made to start one by ``brk_M``, or when its step (from the
    previous token) equals the previous token's step. Every segment has one step; vectorized,
    so a little less greedy than it could be.
    """
    m = src_M.size
    cont = np.zeros(m, dtype=bool)
    if m > 1:
        ds, dd = np.diff(src_M), np.diff(dst_M)
        same = np.zeros(m - 1, dtype=bool)
        same[1:] = (ds[1:] == ds[:-1]) & (dd[1:] == dd[:-1])
        cont[1:] = ~brk_M[1:] & (brk_M[:-1] | same)
    head = np.flatnonzero(~cont)
    n_seg = np.diff(head, append=m)
    nxt = np.minimum(head + 1, m - 1)
    multi = n_seg > 1
    out = p.take(i_M[head])
    out.src_row, out.dst_row, out.length = src_M[head], dst_M[head], n_seg
    out.src_step = np.where(multi, src_M[nxt] - src_M[head], 1)
    out.dst_step = np.where(multi, dst_M[nxt] - dst_M[head], 1)
    return out


def _untangle(
    p: _Pieces, block_P: np.ndarray, starts_B: np.ndarray
) -> tuple[_Pieces, np.ndarray, np.ndarray]:
    """Pieces whose destination rows interleave inside a block (strided destinations) replaced
    by segments of their tokens in destination-row order; the rest untouched. Takes and returns
    :func:`_sort_blocks`' triple."""
    last = p.dst_row + (p.length - 1) * p.dst_step
    big = int(last.max()) + 1
    reach = np.maximum.accumulate(block_P * big + last)
    lone = np.ones(p.size, dtype=bool)
    lone[1:] = block_P[1:] * big + p.dst_row[1:] > reach[:-1]
    if lone.all():
        return p, block_P, starts_B
    cluster = np.cumsum(lone) - 1
    multi = np.bincount(cluster)[cluster] > 1
    q = p.take(multi)
    qc = cluster[multi]
    i, t = _fan_out(q.length)
    src_M, dst_M = q.src_row[i] + t * q.src_step[i], q.dst_row[i] + t * q.dst_step[i]
    o = np.lexsort((dst_M, qc[i]))
    i, src_M, dst_M = i[o], src_M[o], dst_M[o]
    brk = np.ones(i.size, dtype=bool)
    brk[1:] = qc[i[1:]] != qc[i[:-1]]
    new = _token_segments(q, i, src_M, dst_M, brk)
    return _sort_blocks(_Pieces.concat([p.take(~multi), new]))


def _member(rank_B: np.ndarray, grp_B: np.ndarray, ix: GroupIndex) -> np.ndarray:
    """``[B]`` whether ``rank_B[b]`` is a replica of source group ``grp_B[b]``."""
    lo, hi = ix.rep_off_G1[grp_B], ix.rep_off_G1[grp_B + 1]
    out = np.zeros(grp_B.size, dtype=bool)
    for r in range(int((hi - lo).max(initial=0))):
        has = lo + r < hi
        out |= has & (ix.rep_rank_X[np.where(has, lo + r, 0)] == rank_B)
    return out


def _merge(p: _Pieces, tid_P: np.ndarray) -> tuple[_Pieces, np.ndarray]:
    """Consecutive pieces of one transfer that continue each other (same steps), merged."""
    if p.size < 2:
        return p, tid_P
    cont = np.zeros(p.size, dtype=bool)
    cont[1:] = (
        (tid_P[1:] == tid_P[:-1])
        & (p.src_step[1:] == p.src_step[:-1])
        & (p.dst_step[1:] == p.dst_step[:-1])
        & (p.src_row[1:] == p.src_row[:-1] + p.length[:-1] * p.src_step[:-1])
        & (p.dst_row[1:] == p.dst_row[:-1] + p.length[:-1] * p.dst_step[:-1])
    )
    if not cont.any():
        return p, tid_P
    head = np.flatnonzero(~cont)
    out = p.take(head)
    out.length = np.add.reduceat(p.length, head)
    return out, tid_P[head]


@dataclass(frozen=True, kw_only=True, eq=False)
class _Chunked:
    """One transfer per row of the ``[T]`` arrays, segments of transfer ``t`` at
    ``segments_S5[off_T1[t] : off_T1[t + 1]]``."""

    mb_T: np.ndarray
    grp_T: np.ndarray
    slot_T: np.ndarray
    src_rank_T: np.ndarray
    local_T: np.ndarray
    off_T1: np.ndarray
    segments_S5: np.ndarray


def _chunk(
    p: _Pieces, ix: GroupIndex, *, local_copy: bool, send_rank: int | None = None
) -> _Chunked:
    """Blocks of the pieces cut into replica chunks (or kept whole as local copies).

    ``send_rank``: keep only what that rank sends (no local blocks, only its chunks).
    Destination rows stay as they are (the caller makes them slice-relative first).
    """
    if not p.size:
        e = _EMPTY
        return _Chunked(
            mb_T=e,
            grp_T=e,
            slot_T=e,
            src_rank_T=e,
            local_T=e.astype(bool),
            off_T1=np.zeros(1, _I64),
            segments_S5=np.empty((0, 5), dtype=_I64),
        )
    p, block, starts = _sort_blocks(p)
    if bool((p.dst_step > 1).any()):
        p, block, starts = _untangle(p, block, starts)
    blk_g, blk_slot = p.grp[starts], p.slot[starts]
    blk_rank = ix.slot_rank_S[blk_slot]
    blk_k = ix.rep_off_G1[blk_g + 1] - ix.rep_off_G1[blk_g]
    blk_local = _member(blk_rank, blk_g, ix) if local_copy else np.zeros(starts.size, bool)
    cum = np.cumsum(p.length) - p.length
    off = cum - cum[starts][block]
    n = np.add.reduceat(p.length, starts)[block]
    k = np.where(blk_local, 1, blk_k)[block]
    c0 = off * k // n
    c1 = (off + p.length - 1) * k // n
    m = c1 - c0 + 1
    if bool((m > 1).any()):
        i, t = _fan_out(m)
        c = c0[i] + t
        ki, ni, oi = k[i], n[i], off[i]
        lo = np.maximum(_ceil_div(c * ni, ki), oi) - oi
        hi = np.minimum(_ceil_div((c + 1) * ni, ki), oi + p.length[i]) - oi
        keep = hi > lo
        i, c, lo, hi = i[keep], c[keep], lo[keep], hi[keep]
        p, block = p.sub(i, lo, hi), block[i]
    else:
        c = c0
    g, s, kb = p.grp, p.slot, blk_k[block]
    local = blk_local[block]
    rep = ix.rep_rank_X[ix.rep_off_G1[g] + (c + g + s) % kb]
    src_rank = np.where(local, blk_rank[block], rep)
    if send_rank is not None:
        keep = ~local & (src_rank == send_rank)
        p, block, c, src_rank, local = (
            p.take(keep),
            block[keep],
            c[keep],
            src_rank[keep],
            local[keep],
        )
    tid = np.ones(p.size, dtype=bool)
    tid[1:] = (block[1:] != block[:-1]) | (c[1:] != c[:-1])
    tid = np.cumsum(tid) - 1
    firsts = np.flatnonzero(np.diff(tid, prepend=-1))
    mb_T, grp_T, slot_T = p.mb[firsts], p.grp[firsts], p.slot[firsts]
    src_T, local_T = src_rank[firsts], local[firsts]
    p, tid = _merge(p, tid)
    off_T1 = np.searchsorted(tid, np.arange(firsts.size + 1, dtype=_I64))
    return _Chunked(
        mb_T=mb_T,
        grp_T=grp_T,
        slot_T=slot_T,
        src_rank_T=src_T,
        local_T=local_T,
        off_T1=off_T1,
        segments_S5=p.segments_S5(),
    )


def _fill_owners(owner_N: np.ndarray, p: _Pieces, owner_G: np.ndarray) -> None:
    """``owner_N[row] = owner`` for every destination row of the pieces."""
    if not p.size:
        return
    own = owner_G[p.grp]
    if bool((p.dst_step == 1).all()):  # row intervals: mark the edges, then a prefix sum
        n = owner_N.size
        edge = np.zeros(n + 1, dtype=_I64)
        np.add.at(edge, p.dst_row, own + 1)
        np.add.at(edge, p.dst_row + p.length, -(own + 1))
        owner_N[:] = np.cumsum(edge[:n]) - 1
        return
    i, t = _fan_out(p.length)
    owner_N[p.dst_row[i] + t * p.dst_step[i]] = own[i]


def _compact(p: _Pieces, own_P: np.ndarray, num_owners: int) -> tuple[_Pieces, np.ndarray]:
    """Pieces with destination rows moved to compact space: ``(pieces, [num_owners] rows)``.

    ``p`` must hold *every* piece of one destination group for each owner in ``own_P`` (the
    owner of each piece). A row owned by ``k`` moves to its rank among the rows ``k`` owns
    there, in row order (the order the loss reads teacher ``k``'s rows). Run form when every
    piece advances by one row (the pieces of one owner never overlap: a sort by row and a
    prefix sum of lengths); otherwise the tokens of the destination group are ranked and cut
    back into segments, piece by piece (both ends of a transfer cut them alike).
    """
    rows_K = np.bincount(own_P, weights=p.length, minlength=num_owners).astype(_I64)
    if not p.size:
        return p, rows_K
    if bool((p.dst_step == 1).all()):
        o = np.lexsort((p.dst_row, own_P))
        q, own = p.take(o), own_P[o]
        cum = np.cumsum(q.length) - q.length
        q.dst_row = cum - cum[np.searchsorted(own, own, side="left")]
        return q, rows_K
    i, t = _fan_out(p.length)
    row_M, own_M = p.dst_row[i] + t * p.dst_step[i], own_P[i]
    o = np.lexsort((row_M, own_M))
    pos_M = np.empty(i.size, dtype=_I64)
    pos_M[o] = np.arange(i.size, dtype=_I64) - np.searchsorted(own_M[o], own_M[o], side="left")
    src_M = p.src_row[i] + t * p.src_step[i]
    brk = np.ones(i.size, dtype=bool)
    brk[1:] = i[1:] != i[:-1]
    return _token_segments(p, i, src_M, pos_M, brk), rows_K


# --- the plan --------------------------------------------------------------------------------


def _transfers(
    ch: _Chunked, owner_G: np.ndarray, slot_rank_S: np.ndarray | None, rank: int
) -> list[tuple[int, bool, Transfer]]:
    """``(micro-batch, local, transfer)`` of every chunk: received by ``rank`` (``slot_rank_S
    is None``), or sent by it to ``slot_rank_S[slot]``."""
    out = []
    owner = owner_G[ch.grp_T].tolist()
    dst = [rank] * len(owner) if slot_rank_S is None else slot_rank_S[ch.slot_T].tolist()
    src = ch.src_rank_T.tolist() if slot_rank_S is None else [rank] * len(owner)
    local, off, mb = ch.local_T.tolist(), ch.off_T1.tolist(), ch.mb_T.tolist()
    for t in range(len(owner)):
        tr = Transfer(
            owner=owner[t],
            src_rank=src[t],
            dst_rank=dst[t],
            segments_S5=ch.segments_S5[off[t] : off[t + 1]],
        )
        out.append((mb[t], bool(local[t]), tr))
    return out


def read_runs(
    catalogs: Sequence[RunCatalog],
    side: str,
    mb_X: np.ndarray,
    groups_X: np.ndarray,
    *,
    raw: bool = False,
    tag_X: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The runs of ``(catalog mb_X[x], group groups_X[x])`` pairs, concatenated as
    :func:`_runs` reads each (``raw``: as the catalogs give them): ``([K, 5] runs, [K]
    catalog of each, [K] group of each)`` (with ``tag_X``, each run's pair's tag in place of
    its group); in one read when the catalogs share one :attr:`RunCatalog.fetch`, else group
    by group."""
    mb_X, groups_X = mb_X.astype(_I64), groups_X.astype(_I64)
    tags = groups_X if tag_X is None else tag_X.astype(_I64)
    fetch = catalogs[0].fetch if catalogs else None
    if fetch is not None and all(c.fetch is fetch for c in catalogs) and groups_X.size:
        slots = np.asarray([c.slot for c in catalogs], dtype=_I64)[mb_X]
        got, n_X = fetch(side, slots, groups_X)
        runs = got if raw else np.array(got, dtype=_I64).reshape(-1, 5)
        mb, tag = np.repeat(mb_X, n_X), np.repeat(tags, n_X)
    else:
        tables = []
        for i, g in zip(mb_X.tolist(), groups_X.tolist(), strict=True):
            c = catalogs[i]
            if raw:
                read = c.source_runs if side == "s" else c.dest_runs
                tables.append(np.asarray(read(g), dtype=_I64).reshape(-1, 5))
            else:
                tables.append(_runs(c, side, g))
        if not tables:
            return np.empty((0, 5), dtype=_I64), _EMPTY, _EMPTY
        n = [t.shape[0] for t in tables]
        return np.concatenate(tables), np.repeat(mb_X, n), np.repeat(tags, n)
    if raw:
        return runs, mb, tag
    keep = runs[:, 4] > 0
    if not bool(keep.all()):
        runs, mb, tag = runs[keep], mb[keep], tag[keep]
    runs[runs[:, 4] == 1, 3] = 1
    return runs, mb, tag


def dense_samples(mb_K: np.ndarray, sample_K: np.ndarray) -> np.ndarray:
    """``[K]`` a dense id of each ``(micro-batch, sample id)`` pair, in that pair's order: keys
    of different micro-batches never meet."""
    o = np.lexsort((sample_K, mb_K))
    m, x = mb_K[o], sample_K[o]
    new = np.ones(o.size, dtype=bool)
    new[1:] = (m[1:] != m[:-1]) | (x[1:] != x[:-1])
    out = np.empty(o.size, dtype=_I64)
    out[o] = np.cumsum(new) - 1
    return out


def _rows_in(ids_X: np.ndarray | None, groups: np.ndarray) -> np.ndarray:
    """Rows of ``groups`` in a catalog's range arrays (with ``ids_X``: where those ids are)."""
    return groups if ids_X is None else np.searchsorted(ids_X, groups)


def _meeting(lo_A: np.ndarray, hi_A: np.ndarray, range_X2: np.ndarray) -> np.ndarray:
    """``[A, X]`` whether range ``a`` (``[lo_A[a], hi_A[a]]``, non-empty) meets each non-empty
    row of ``range_X2``."""
    a, b = range_X2[:, 0], range_X2[:, 1]
    return (a <= hi_A[:, None]) & (b >= lo_A[:, None]) & (a <= b) & (lo_A <= hi_A)[:, None]


def plan_ranks(
    catalogs: Sequence[RunCatalog],
    rank: int,
    *,
    local_copy: bool = True,
    compact: bool = False,
) -> list[RankPlan]:
    """:func:`plan_rank` of every catalog (a step's micro-batches, over one set of groups),
    in one pass: the joins, slices and chunks of every micro-batch together, so that the
    work is a fixed number of array operations over the rank's own runs and its peers'.

    Each catalog's plan is the one :func:`plan_rank` gives it alone (that function is this one
    with one catalog); the runs read are the same.
    """
    n_mb = len(catalogs)
    if not n_mb:
        return []
    ix = catalogs[0].index()
    n_src = int(ix.owner_G.size)
    num_owners = int(ix.owner_G.max()) + 1 if n_src else 0
    mine = ix.dest_groups.get(rank)
    d0 = mine[0] if mine else None
    my_src = np.asarray(ix.source_groups.get(rank, ()), dtype=_I64)
    # 1. the destination instances (micro-batch, group) and each one's candidate sources
    inst_mb: list[int] = []
    inst_d: list[int] = []
    pair_e: list[int] = []
    pair_g: list[np.ndarray] = []
    recv_e = np.full(n_mb, -1, dtype=_I64)
    for i, cat in enumerate(catalogs):
        s_rng, d_rng = cat.source_range_G2, cat.dest_range_D2
        s_ids = np.arange(s_rng.shape[0], dtype=_I64) if cat.source_ids is None else cat.source_ids
        d_ids = np.arange(d_rng.shape[0], dtype=_I64) if cat.dest_ids is None else cat.dest_ids
        here: dict[int, int] = {}
        if d0 is not None:  # the rank's own destination: every source that meets it
            lo, hi = cat.dest_range(d0)
            here[d0] = recv_e[i] = len(inst_mb)
            inst_mb.append(i)
            inst_d.append(d0)
            cands = _overlapping(s_rng, lo, hi, cat.source_ids)
            pair_e.append(int(recv_e[i]))
            pair_g.append(cands)
        if not my_src.size:
            continue
        g_rng = s_rng[_rows_in(cat.source_ids, my_src)]
        meet_gd = _meeting(g_rng[:, 0], g_rng[:, 1], d_rng)  # [S, D']
        ds = np.flatnonzero(meet_gd.any(axis=0))
        if not ds.size:
            continue
        if compact:  # per destination, every source of an owner that serves it there
            owners_d = np.zeros((ds.size, max(num_owners, 1)), dtype=bool)
            gi, di = np.nonzero(meet_gd[:, ds].T)
            owners_d[gi, ix.owner_G[my_src[di]]] = True
            rng = d_rng[ds]
            ok = _meeting(rng[:, 0], rng[:, 1], s_rng) & owners_d[:, ix.owner_G[s_ids]]
        else:  # this rank's own sources alone
            ok = np.zeros((ds.size, s_ids.size), dtype=bool)
            gs = _rows_in(cat.source_ids, my_src)
            ok[:, gs] = meet_gd[:, ds].T
        for k, d in enumerate(d_ids[ds].tolist()):
            e = here.get(d)
            if e is None:
                e = here[d] = len(inst_mb)
                inst_mb.append(i)
                inst_d.append(d)
            pair_e.append(e)
            pair_g.append(s_ids[ok[k]])
    n_e = len(inst_mb)
    e_mb, e_d = np.asarray(inst_mb, dtype=_I64), np.asarray(inst_d, dtype=_I64)
    # 2. the runs: each destination instance's, each candidate source's (once per micro-batch)
    pe = np.repeat(np.asarray(pair_e, dtype=_I64), [g.size for g in pair_g])
    pg = np.concatenate(pair_g) if pair_g else _EMPTY
    n_s = max(n_src, 1)
    key = np.unique(e_mb[pe] * n_s + pg)  # (micro-batch, source) pairs, each once
    src, _, src_tag = read_runs(catalogs, "s", key // n_s, key % n_s, tag_X=key)
    dst, _, dst_e = read_runs(catalogs, "d", e_mb, e_d, tag_X=np.arange(n_e, dtype=_I64))
    # 3. one join of every micro-batch: sample ids made distinct per micro-batch
    if src.shape[0] and dst.shape[0]:
        ids = dense_samples(
            np.concatenate([src_tag // n_s, e_mb[dst_e]]),
            np.concatenate([src[:, 0], dst[:, 0]]),
        )
        src, dst = src.copy(), dst.copy()
        src[:, 0], dst[:, 0] = ids[: src.shape[0]], ids[src.shape[0] :]
        p = _join(src, src_tag, dst, dst_e)
        p.mb, p.grp = p.grp // n_s, p.grp % n_s
    else:
        p = _no_pieces()
    # 4. each destination instance's rows, owners and slices
    group_size = ix.slot_off_D1[e_d + 1] - ix.slot_off_D1[e_d]
    num_rows = np.zeros(n_e, dtype=_I64)
    for i, cat in enumerate(catalogs):
        at = np.flatnonzero(e_mb == i)
        num_rows[at] = cat.dest_rows(e_d[at])
    owner_of: list[np.ndarray | None] = [None] * n_mb
    if d0 is not None:
        base = np.concatenate([[0], np.cumsum(num_rows[recv_e])])
        owner_all = np.full(int(base[-1]), -1, dtype=_I64)
        mine_p = p.take(np.flatnonzero(np.isin(p.dst, recv_e)))
        if mine_p.size:
            mine_p.dst_row = mine_p.dst_row + base[mine_p.mb]
            _fill_owners(owner_all, mine_p, ix.owner_G)
        owner_of = [owner_all[base[i] : base[i + 1]] for i in range(n_mb)]
    k = max(num_owners, 1)
    own = ix.owner_G[p.grp]
    if compact:
        p, rows_C = _compact(p, p.dst * k + own, n_e * k)
        rows_EK = rows_C.reshape(n_e, k)
        own = ix.owner_G[p.grp]
        nominal_EK = -(-rows_EK // group_size[:, None])
    else:
        rows_EK = np.bincount(p.dst * k + own, weights=p.length, minlength=n_e * k)
        rows_EK = rows_EK.astype(_I64).reshape(n_e, k)
        nominal_EK = np.repeat((-(-num_rows // group_size))[:, None], k, axis=1)
    slot0_E = ix.slot_off_D1[e_d] if n_e else _EMPTY
    p = _cut_slices(p, nominal_EK[p.dst, own], slot0_E[p.dst])
    own = ix.owner_G[p.grp]
    p.dst_row = p.dst_row - (p.slot - slot0_E[p.dst]) * nominal_EK[p.dst, own]
    # 5. this rank's receives and local copies, then its sends
    recvs: list[list[Transfer]] = [[] for _ in range(n_mb)]
    locals_: list[list[Transfer]] = [[] for _ in range(n_mb)]
    sends: list[list[Transfer]] = [[] for _ in range(n_mb)]
    dest: list[DestSlot | None] = [None] * n_mb
    if d0 is not None:
        group = catalogs[0].dests[d0]
        j = group.ranks.index(rank)
        s_glob = int(ix.slot_off_D1[d0]) + j
        q = p.take(np.flatnonzero(np.isin(p.dst, recv_e) & (p.slot == s_glob)))
        for mb, local, t in _transfers(
            _chunk(q, ix, local_copy=local_copy), ix.owner_G, None, rank
        ):
            (locals_ if local else recvs)[mb].append(t)
        for i, cat in enumerate(catalogs):
            g_i = cat.dests[d0]
            start, stop = g_i.slice_bounds(j)
            dest[i] = DestSlot(
                group=d0,
                slot=j,
                row_offset=start,
                slice_rows=stop - start,
                num_rows=g_i.num_rows,
                padded_rows=g_i.slice_rows * len(g_i.ranks),
                group_size=len(g_i.ranks),
                owner_rows=tuple(rows_EK[recv_e[i], :num_owners].tolist()) if compact else (),
            )
    if my_src.size:
        q = p.take(np.flatnonzero(np.isin(p.grp, my_src)))
        ch = _chunk(q, ix, local_copy=local_copy, send_rank=rank)
        for mb, _, t in _transfers(ch, ix.owner_G, ix.slot_rank_S, rank):
            sends[mb].append(t)
    out = []
    for i in range(n_mb):
        sends[i].sort(key=lambda t: (t.owner, t.dst_rank))
        recvs[i].sort(key=lambda t: (t.owner, t.src_rank))
        locals_[i].sort(key=lambda t: t.owner)
        out.append(
            RankPlan(
                rank=rank,
                sends=tuple(sends[i]),
                recvs=tuple(recvs[i]),
                locals=tuple(locals_[i]),
                dest=dest[i],
                owner_N=owner_of[i],
            )
        )
    return out


def plan_rank(
    catalog: RunCatalog, rank: int, *, local_copy: bool = True, compact: bool = False
) -> RankPlan:
    """Global rank ``rank``'s sends, receives and local copies (pure, deterministic).

    Assumes input that :func:`check_rank` passes on every rank (each needed token held once).
    Reads the runs of the rank's own groups and of the groups whose sample range meets theirs.

    ``compact``: destination rows in compact space (see :class:`DestSlot`): each owner's
    rows arrive in a buffer of their own, one row per token it owns, in the layout's row order.
    A sender then also reads, for each destination group it serves, the runs of its owner's
    other source groups that meet that group (to place its pieces among theirs).
    A step's micro-batches are planned together by :func:`plan_ranks`: a catalog of a
    :class:`StepBatch` whose micro-batch is pending is planned with every pending one.
    """
    b = catalog.batch
    if b is None or catalog.slot not in b.pending:
        return plan_ranks([catalog], rank, local_copy=local_copy, compact=compact)[0]
    key = (rank, local_copy, compact)
    got = b._plans.get(key)
    if got is None:
        cats = [b.catalogs[i] for i in b.pending]
        plans = plan_ranks(cats, rank, local_copy=local_copy, compact=compact)
        got = b._plans[key] = dict(zip(b.pending, plans, strict=True))
    return got[catalog.slot]


# --- verdicts --------------------------------------------------------------------------------


def _where(label: str, ranks: tuple[int, ...], row: int) -> str:
    return f"{label} (ranks {list(ranks)}, row {row})"


def _union(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals ``[start, end)`` as sorted, disjoint intervals."""
    o = np.argsort(start, kind="stable")
    start, end = start[o], end[o]
    reach = np.maximum.accumulate(end)
    head = np.ones(start.size, dtype=bool)
    head[1:] = start[1:] > reach[:-1]
    at = np.flatnonzero(head)
    return start[at], np.maximum.reduceat(end, at) if at.size else _EMPTY


def _depth2(start: np.ndarray, end: np.ndarray) -> int:
    """How many keys at least two of the intervals ``[start, end)`` cover."""
    pos = np.concatenate([start, end])
    delta = np.concatenate([np.ones(start.size, _I64), -np.ones(end.size, _I64)])
    o = np.lexsort((delta, pos))  # at one key, ends before starts
    pos, depth = pos[o], np.cumsum(delta[o])
    return int((np.diff(pos) * (depth[:-1] >= 2)).sum())


def _rows_at(runs_K5: np.ndarray, key_K: np.ndarray, k: int) -> np.ndarray:
    """Rows holding key ``k`` in runs with first keys ``key_K``, ascending."""
    cover = (key_K <= k) & (k < key_K + runs_K5[:, 4])
    return np.sort(runs_K5[cover, 2] + (k - key_K[cover]) * runs_K5[cover, 3])


def _check_source(catalog: RunCatalog, g: int) -> str | None:
    """Source group ``g``'s verdict: a key it holds twice, or that an earlier group holds."""
    source = catalog.sources[g]
    runs = _runs(catalog, "s", g)
    if not runs.shape[0]:
        return None
    lo, hi = catalog.source_range(g)
    cands = catalog.sources_meeting(lo, hi)
    cands = cands[cands < g]
    other, other_grp = _tagged(catalog, "s", cands)
    u, stride = _key_space(runs, other)
    ks = _keys(runs, u, stride)
    o = np.argsort(ks, kind="stable")
    runs, ks = runs[o], ks[o]
    ke = ks + runs[:, 4]
    if ks.size > 1:
        dup = ks[1:] < np.maximum.accumulate(ke)[:-1]
        if dup.any():
            k = int(ks[1:][dup].min())
            rows = _rows_at(runs, ks, k)
            return (
                f"token (sample_id={int(u[k // stride])}, position={k % stride}) is held twice "
                f"by {source.label or g} (ranks {list(source.ranks)}, rows {int(rows[0])} and "
                f"{int(rows[1])}); {_depth2(ks, ke)} keys are held more than once there"
            )
    if not other.shape[0]:
        return None
    kd = _keys(other, u, stride)
    kde = kd + other[:, 4]
    b, a = _overlaps(ks, ke, kd, kde)
    if not b.size:
        return None
    h_P = other_grp[b]
    h = int(h_P.min())
    sel = h_P == h
    first = np.maximum(kd[b[sel]], ks[a[sel]])
    end = np.minimum(kde[b[sel]], ke[a[sel]])
    k = int(first.min())
    us, ue = _union(first, end)
    mine = other_grp == h
    row_h = int(_rows_at(other[mine], kd[mine], k)[0])
    row_g = int(_rows_at(runs, ks, k)[0])
    held = catalog.sources[h]
    return (
        f"token (sample_id={int(u[k // stride])}, position={k % stride}) is held twice: by "
        f"{_where(held.label or str(h), held.ranks, row_h)} and by "
        f"{_where(source.label or str(g), source.ranks, row_g)}; "
        f"{int((ue - us).sum())} keys are held by both"
    )


def _check_dest(catalog: RunCatalog, d: int) -> str | None:
    """Destination group ``d``'s verdict: a token it needs that no source holds."""
    group = catalog.dests[d]
    dst = _runs(catalog, "d", d)
    if not dst.shape[0]:
        return None
    lo, hi = catalog.dest_range(d)
    src, _ = _tagged(catalog, "s", catalog.sources_meeting(lo, hi))
    u, stride = _key_space(src, dst)
    kd = _keys(dst, u, stride)
    kde = kd + dst[:, 4]
    if src.shape[0]:
        ks = _keys(src, u, stride)
        ms, me = _union(ks, ks + src[:, 4])
        b, a = _overlaps(ms, me, kd, kde)
        first, end = np.maximum(kd[b], ms[a]), np.minimum(kde[b], me[a])
    else:
        b = first = end = _EMPTY
    missing = int(dst[:, 4].sum() - (end - first).sum())
    if missing == 0:
        return None
    # gaps of each destination run: before each piece, and after its last one
    new = np.ones(b.size, dtype=bool)
    new[1:] = b[1:] != b[:-1]
    prev = np.where(new, kd[b], np.concatenate([[0], end[:-1]]))
    last_end = kd.copy()  # where each run's last piece ends (its start: no piece)
    last = np.flatnonzero(np.diff(b, append=-1) != 0)
    last_end[b[last]] = end[last]
    gap_run = np.concatenate([b, np.arange(kd.size, dtype=_I64)])
    gap_lo = np.concatenate([prev, last_end])
    gap_hi = np.concatenate([first, kde])
    real = gap_hi > gap_lo
    gap_run, gap_lo, gap_hi = gap_run[real], gap_lo[real], gap_hi[real]
    row0, step = dst[gap_run, 2], dst[gap_run, 3]
    row_lo = row0 + (gap_lo - kd[gap_run]) * step
    row_hi = row0 + (gap_hi - 1 - kd[gap_run]) * step
    at = np.where(row_lo <= row_hi, gap_lo, gap_hi - 1)
    row = np.minimum(row_lo, row_hi)
    i = int(np.argmin(row))
    run = int(gap_run[i])
    position = int(dst[run, 1] + at[i] - kd[run])
    return (
        f"token (sample_id={int(dst[run, 0])}, position={position}) is needed by "
        f"{_where(group.label or str(d), group.ranks, int(row[i]))} but no teacher holds it; "
        f"{missing} needed tokens are missing in all"
    )


def check_rank(catalog: RunCatalog, rank: int) -> list[str]:
    """The verdicts ``rank`` is responsible for (``[]``: none found).

    Each source group is checked by its first rank (a token it holds twice, or that a source
    group before it also holds); each destination group by its first rank (a token it needs that
    no source holds). Together the ranks check every group once. Messages name the token
    ``(sample_id, position)``, the groups with their ranks and rows, and how many tokens are
    affected; they depend on the catalog only, not on the rank that finds them. A catalog of a
    :class:`StepBatch` whose micro-batch is pending is checked with every pending one
    (:func:`check_ranks`: the same verdicts).
    """
    b = catalog.batch
    if b is not None and catalog.slot in b.pending:  # every pending micro-batch in one pass
        got = b._checks.get(rank)
        if got is None:
            found_I = check_ranks([b.catalogs[i] for i in b.pending], rank)
            got = b._checks[rank] = dict(zip(b.pending, found_I, strict=True))
        return list(got[catalog.slot])
    ix = catalog.index()
    found: list[str] = []
    for g in ix.source_groups.get(rank, ()):
        if catalog.sources[g].ranks[0] == rank:
            msg = _check_source(catalog, g)
            if msg is not None:
                found.append(msg)
    for d in ix.dest_groups.get(rank, ()):
        if catalog.dests[d].ranks[0] == rank:
            msg = _check_dest(catalog, d)
            if msg is not None:
                found.append(msg)
    return found


def _source_flags(catalogs: Sequence[RunCatalog], g: int) -> np.ndarray:
    """``[n]`` whether :func:`_check_source` finds a problem with source group ``g`` in each
    catalog: one pass over every catalog's runs of ``g`` and of the earlier groups that meet
    it (keys made distinct per catalog)."""
    mb_parts, grp_parts = [], []
    for i, cat in enumerate(catalogs):
        lo, hi = cat.source_range(g)
        if lo > hi:
            continue
        cands = cat.sources_meeting(lo, hi)
        groups = np.append(cands[cands < g], g)
        mb_parts.append(np.full(groups.size, i, dtype=_I64))
        grp_parts.append(groups)
    flags = np.zeros(len(catalogs), dtype=bool)
    if not mb_parts:
        return flags
    runs, mb, tag = read_runs(catalogs, "s", np.concatenate(mb_parts), np.concatenate(grp_parts))
    if not runs.shape[0]:
        return flags
    ids = dense_samples(mb, runs[:, 0])
    stride = int((runs[:, 1] + runs[:, 4]).max()) + 1
    key = ids * stride + runs[:, 1]
    mine = tag == g
    ks, ke, kmb = key[mine], key[mine] + runs[mine, 4], mb[mine]
    o = np.argsort(ks, kind="stable")
    ks, ke, kmb = ks[o], ke[o], kmb[o]
    if ks.size > 1:  # a key held twice inside the group
        dup = ks[1:] < np.maximum.accumulate(ke)[:-1]
        flags[kmb[1:][dup]] = True
    other = ~mine
    if other.any() and ks.size:  # a key an earlier group holds too
        us, ue = _union(ks, ke)
        kd = key[other]
        b, _ = _overlaps(us, ue, kd, kd + runs[other, 4])
        flags[mb[other][b]] = True
    return flags


def _dest_flags(catalogs: Sequence[RunCatalog], d: int) -> np.ndarray:
    """``[n]`` whether :func:`_check_dest` finds a needed token no source holds in destination
    group ``d``, per catalog: one pass over every catalog's runs of ``d`` and of the sources
    that meet it."""
    n = len(catalogs)
    every = np.arange(n, dtype=_I64)
    dst, dmb, _ = read_runs(catalogs, "d", every, np.full(n, d, dtype=_I64))
    if not dst.shape[0]:
        return np.zeros(n, dtype=bool)
    mb_parts, grp_parts = [], []
    for i, cat in enumerate(catalogs):
        lo, hi = cat.dest_range(d)
        cands = cat.sources_meeting(lo, hi)
        mb_parts.append(np.full(cands.size, i, dtype=_I64))
        grp_parts.append(cands)
    src, smb, _ = read_runs(catalogs, "s", np.concatenate(mb_parts), np.concatenate(grp_parts))
    ids = dense_samples(np.concatenate([smb, dmb]), np.concatenate([src[:, 0], dst[:, 0]]))
    both = np.concatenate([src, dst])
    stride = int((both[:, 1] + both[:, 4]).max()) + 1
    key = ids * stride + both[:, 1]
    ks, kd = key[: src.shape[0]], key[src.shape[0] :]
    need = np.bincount(dmb, weights=dst[:, 4], minlength=n).astype(_I64)
    if not ks.size:
        return need > 0
    us, ue = _union(ks, ks + src[:, 4])
    b, a = _overlaps(us, ue, kd, kd + dst[:, 4])
    got = np.minimum(kd[b] + dst[b, 4], ue[a]) - np.maximum(kd[b], us[a])
    return need > np.bincount(dmb[b], weights=got, minlength=n).astype(_I64)


def check_ranks(catalogs: Sequence[RunCatalog], rank: int) -> list[list[str]]:
    """:func:`check_rank` of every catalog (a step's micro-batches, over one set of groups):
    one pass per group this rank checks finds the catalogs with a problem, and each of those
    is judged alone, so the messages are :func:`check_rank`'s, in its order."""
    if not catalogs:
        return []
    ix = catalogs[0].index()
    led_s = [g for g in ix.source_groups.get(rank, ()) if ix.rep_rank_X[ix.rep_off_G1[g]] == rank]
    led_d = [d for d in ix.dest_groups.get(rank, ()) if ix.slot_rank_S[ix.slot_off_D1[d]] == rank]
    flag_s = [_source_flags(catalogs, g) for g in led_s]
    flag_d = [_dest_flags(catalogs, d) for d in led_d]
    out: list[list[str]] = []
    for i, cat in enumerate(catalogs):
        found: list[str] = []
        for g, flags in zip(led_s, flag_s, strict=True):
            if flags[i]:
                msg = _check_source(cat, g)
                assert msg is not None, (i, g)
                found.append(msg)
        for d, flags in zip(led_d, flag_d, strict=True):
            if flags[i]:
                msg = _check_dest(cat, d)
                assert msg is not None, (i, d)
                found.append(msg)
        out.append(found)
    return out
