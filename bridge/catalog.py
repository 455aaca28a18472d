"""What the planner reads: the groups of an exchange and their runs of keys, looked up lazily.

Why this file exists: the planner (:mod:`mopd.bridge.plan`) and the input verdicts
(:mod:`mopd.bridge.coverage`) read the same thing, every rank's contribution to one exchange,
and must read it the same way, without a process group and without decoding a group they have
no business with.

Model (all tokens are keys ``(sample_id, position)``; rows are rows of a flat ``[R, H]`` buffer):

- a :class:`SourceGroup` is a set of replicas (global ranks) holding identical buffers: a
  teacher's last-stage TP group for one ``(dp, cp)`` shard, or, for the LM head, the teacher
  ranks holding one vocab shard; its rows are described by runs (:data:`RUN_COLUMNS`);
- a :class:`DestGroup` is a set of global ranks sharing one crossing: its ``N`` rows are split
  into near-equal contiguous slices (:meth:`DestGroup.slice_bounds`), ``ranks[j]`` receives
  slice ``j`` and the group then all-gathers (a student TP group for one ``(dp, cp)`` shard), or
  a single rank;
- a :class:`RunCatalog` holds one micro-batch's groups, their runs (decoded on first use, once)
  and their ``[G, 2]`` / ``[D, 2]`` sample ranges (where a group's tokens can be found without
  decoding its runs); a :class:`StepBatch` ties a step's catalogs together so that they are
  planned and checked in one pass;
- a step's runs are read in one batch (:func:`read_runs`) and sample ids made distinct per
  micro-batch (:func:`dense_samples`), so that one join serves every micro-batch;
- keys and intervals: :func:`key_space` / :func:`run_keys` order tokens by
  ``(sample, position)`` without overflow, :func:`interval_overlaps` pairs overlapping
  intervals with two binary searches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "RUN_COLUMNS",
    "DestGroup",
    "GroupIndex",
    "RunCatalog",
    "RunFetch",
    "SourceGroup",
    "StepBatch",
    "StepRanges",
    "dense_samples",
    "fan_out",
    "group_runs",
    "groups_meeting",
    "interval_overlaps",
    "key_space",
    "ranges_meet",
    "read_runs",
    "rows_in",
    "run_keys",
    "slice_bounds",
    "tagged_runs",
    "unique_first",
]

_I64 = np.int64
_EMPTY = np.empty(0, dtype=_I64)


#: Columns of a ``[K, 5]`` int64 run table: rows ``row + i * step`` hold positions
#: ``position + i`` of sample ``sample`` (``i < length``; ``step`` is 1 for runs of length 1).
RUN_COLUMNS = ("sample", "position", "row", "step", "length")


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
        return slice_bounds(self.num_rows, len(self.ranks), j)


def slice_bounds(num_rows: int, size: int, j: int) -> tuple[int, int]:
    """``[start, stop)`` rows of slice ``j`` when ``num_rows`` rows are cut into ``size``
    slices of ``ceil(num_rows / size)`` rows (the last ones may be short or empty)."""
    n = -(-num_rows // size)
    return min(j * n, num_rows), min((j + 1) * n, num_rows)


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

    @functools.cached_property
    def _replica_keys(self) -> tuple[np.ndarray, int]:
        """``([X] sorted group * stride + rank of every replica, stride)``, built once."""
        stride = int(self.rep_rank_X.max(initial=-1)) + 1
        group_X = np.arange(self.owner_G.size, dtype=_I64).repeat(np.diff(self.rep_off_G1))
        return np.sort(group_X * stride + self.rep_rank_X), stride

    def is_replica(self, rank_B: np.ndarray, group_B: np.ndarray) -> np.ndarray:
        """``[B]`` whether ``rank_B[b]`` is a replica of source group ``group_B[b]``."""
        keys, stride = self._replica_keys
        if not keys.size:
            return np.zeros(np.shape(rank_B), dtype=bool)
        want = group_B * stride + rank_B
        at = np.minimum(keys.searchsorted(want), keys.size - 1)
        return (keys[at] == want) & (rank_B >= 0) & (rank_B < stride)


@dataclass(eq=False)
class StepBatch:
    """A step's catalogs (one per micro-batch, :attr:`RunCatalog.slot` its index here) that
    :func:`~mopd.bridge.plan.plan_rank` and :func:`~mopd.bridge.coverage.check_rank` handle together: the first call for one of the
    ``pending`` catalogs plans (checks) every pending one for that rank in one pass
    (:func:`~mopd.bridge.plan.plan_ranks`, :func:`~mopd.bridge.coverage.check_ranks`), later calls read its result. The caller marks
    which micro-batches it is about to plan (:meth:`expect`) and lets go of the results when
    done (:meth:`done`).

    Attributes:
        catalogs: the step's catalogs, by micro-batch (built on first access).
        pending: the micro-batches planned / checked together, ascending.
    """

    catalogs: Sequence[RunCatalog]
    pending: tuple[int, ...] = ()
    #: per plan key, each pending micro-batch's :class:`~mopd.bridge.plan.RankPlan`
    _plans: dict[tuple[int, bool, bool], dict[int, Any]] = field(default_factory=dict)
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
            :func:`~mopd.bridge.plan.plan_rank` / :func:`~mopd.bridge.coverage.check_rank` of one of its pending catalogs plan (check)
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
        return self.dest_rows_D[rows_in(self.dest_ids, np.asarray(ds, dtype=_I64))]

    def sources_meeting(self, lo: int, hi: int) -> np.ndarray:
        """Source groups (ascending) whose non-empty sample range meets ``[lo, hi]``."""
        return groups_meeting(self.source_range_G2, lo, hi, self.source_ids)

    def dests_meeting(self, lo: int, hi: int) -> np.ndarray:
        """Destination groups (ascending) whose non-empty sample range meets ``[lo, hi]``."""
        return groups_meeting(self.dest_range_D2, lo, hi, self.dest_ids)

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


def group_runs(catalog: RunCatalog, side: str, i: int) -> np.ndarray:
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


def tagged_runs(
    catalog: RunCatalog, side: str, groups: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The runs of several groups, concatenated: ``([K, 5] runs, [K] group of each run)``."""
    tables = [group_runs(catalog, side, int(g)) for g in groups.tolist()]
    if not tables:
        return np.empty((0, 5), dtype=_I64), _EMPTY
    tag = groups.astype(_I64).repeat([t.shape[0] for t in tables])
    return np.concatenate(tables), tag


def groups_meeting(
    range_X2: np.ndarray, lo: int, hi: int, ids_X: np.ndarray | None = None
) -> np.ndarray:
    """The groups (ascending) whose non-empty sample range meets ``[lo, hi]``: indices of
    ``range_X2``'s rows, or with ``ids_X`` the ids of those rows."""
    if lo > hi:
        return _EMPTY
    at = ranges_meet(range_X2[:, 0], range_X2[:, 1], lo, hi).ravel().nonzero()[0]
    return at if ids_X is None else ids_X[at]


def ranges_meet(
    lo_a: np.ndarray | int, hi_a: np.ndarray | int, lo_b: np.ndarray | int, hi_b: np.ndarray | int
) -> np.ndarray:
    """Whether sample range ``[lo_a, hi_a]`` meets ``[lo_b, hi_b]``, both non-empty (an empty
    range is ``lo > hi``, a group without tokens ``(1, 0)``); elementwise, broadcast."""
    return np.asarray((lo_a <= hi_b) & (hi_a >= lo_b) & (lo_a <= hi_a) & (lo_b <= hi_b))


@dataclass(frozen=True, eq=False)
class StepRanges:
    """Every catalog's group sample ranges on one side, one after another (rows ``R``): how a
    step's micro-batches find the groups that meet a range in one pass, not one per
    micro-batch.

    Attributes:
        range_R2: ``[R, 2]`` smallest and largest sample id (``(1, 0)``: no tokens).
        mb_R: ``[R]`` the catalog (its index in the sequence given) of each row.
        id_R: ``[R]`` the group of each row (ascending within a catalog).
        n: how many catalogs.
    """

    range_R2: np.ndarray
    mb_R: np.ndarray
    id_R: np.ndarray
    n: int

    @staticmethod
    def of(catalogs: Sequence[RunCatalog], side: str) -> StepRanges:
        """The source (``side`` ``"s"``) or destination (``"d"``) ranges of ``catalogs``."""
        rng = [c.source_range_G2 if side == "s" else c.dest_range_D2 for c in catalogs]
        ids = [c.source_ids if side == "s" else c.dest_ids for c in catalogs]
        sizes = [r.shape[0] for r in rng]
        id_R = [
            np.arange(k, dtype=_I64) if x is None else x for x, k in zip(ids, sizes, strict=True)
        ]
        return StepRanges(
            range_R2=np.concatenate(rng) if rng else np.empty((0, 2), dtype=_I64),
            mb_R=np.arange(len(rng), dtype=_I64).repeat(sizes),
            id_R=np.concatenate(id_R).astype(_I64, copy=False) if id_R else _EMPTY,
            n=len(rng),
        )

    def range_of(self, x: int) -> tuple[np.ndarray, np.ndarray]:
        """``([n] lo, [n] hi)``: group ``x``'s range in each catalog (``(1, 0)`` where it is
        not among the catalog's groups)."""
        lo, hi = np.ones(self.n, dtype=_I64), np.zeros(self.n, dtype=_I64)
        at = (self.id_R == x).ravel().nonzero()[0]
        lo[self.mb_R[at]], hi[self.mb_R[at]] = self.range_R2[at, 0], self.range_R2[at, 1]
        return lo, hi

    def meeting(self, lo_I: np.ndarray, hi_I: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``([P] catalog, [P] group)``: in each catalog ``i``, the groups whose non-empty range
        meets ``[lo_I[i], hi_I[i]]`` (none where that is empty), by catalog, then group:
        :meth:`RunCatalog.sources_meeting` (``dests_meeting``) of every catalog at once."""
        mb = self.mb_R
        at = (
            ranges_meet(self.range_R2[:, 0], self.range_R2[:, 1], lo_I[mb], hi_I[mb])
            .ravel()
            .nonzero()[0]
        )
        return self.mb_R[at], self.id_R[at]


def _range_of(range_X2: np.ndarray, ids_X: np.ndarray | None, x: int) -> tuple[int, int]:
    """Group ``x``'s row of ``range_X2`` (with ``ids_X``: the row of id ``x``, which must be
    there)."""
    at = x
    if ids_X is not None:
        at = int(ids_X.searchsorted(x))
        if at >= ids_X.size or int(ids_X[at]) != x:
            raise AssertionError(f"group {x} is not among the catalog's groups")
    lo, hi = range_X2[at]
    return int(lo), int(hi)


def key_space(*tables: np.ndarray) -> tuple[np.ndarray, int]:
    """``(samples, stride)``: key ``index(sample) * stride + position`` orders the tokens of
    ``tables`` by ``(sample, position)`` (dense sample indices: no overflow for sparse ids)."""
    live = [t for t in tables if t.shape[0]]
    if not live:
        return _EMPTY, 1
    u, _ = unique_first(np.concatenate([t[:, 0] for t in live]))
    stride = int(max(int((t[:, 1] + t[:, 4]).max()) for t in live)) + 1
    if u.size * stride >= 2**62:
        raise ValueError(f"{u.size} samples with positions up to {stride} overflow int64 keys")
    return u, stride


def run_keys(runs_K5: np.ndarray, u: np.ndarray, stride: int) -> np.ndarray:
    """``[K]`` first key of each run (see :func:`key_space`)."""
    return u.searchsorted(runs_K5[:, 0]) * stride + runs_K5[:, 1]


def interval_overlaps(
    start_A: np.ndarray, end_A: np.ndarray, start_B: np.ndarray, end_B: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Pairs ``(b, a)`` of intervals ``[start, end)`` that overlap: ``A`` sorted and disjoint
    (``start_A`` and ``end_A`` increasing), ``B`` any; by ``b``, then ``a`` increasing."""
    lo = end_A.searchsorted(start_B, side="right")
    hi = start_A.searchsorted(end_B, side="left")
    b, t = fan_out(np.maximum(hi - lo, 0))
    return b, lo[b] + t


def fan_out(n_K: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(k, t)``: each index ``k`` repeated ``n_K[k]`` times, and beside it ``t = 0 ..
    n_K[k] - 1`` (a segmented arange)."""
    k = np.arange(n_K.size, dtype=_I64).repeat(n_K)
    t = np.arange(k.size, dtype=_I64) - (n_K.cumsum() - n_K).repeat(n_K)
    return k, t


def unique_first(x_K: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(values, first)``: the distinct values of the 1-D ``x_K`` ascending, and the index of
    each one's first occurrence (``np.unique(x_K, return_index=True)`` without its fixed cost,
    which dominates on the small arrays of a step)."""
    o = x_K.argsort(kind="stable")
    s = x_K[o]
    new = np.ones(s.size, dtype=bool)
    new[1:] = s[1:] != s[:-1]
    return s[new], o[new]


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
    :func:`group_runs` reads each (``raw``: as the catalogs give them): ``([K, 5] runs, [K]
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
        mb, tag = mb_X.repeat(n_X), tags.repeat(n_X)
    else:
        tables = []
        for i, g in zip(mb_X.tolist(), groups_X.tolist(), strict=True):
            c = catalogs[i]
            if raw:
                read = c.source_runs if side == "s" else c.dest_runs
                tables.append(np.asarray(read(g), dtype=_I64).reshape(-1, 5))
            else:
                tables.append(group_runs(c, side, g))
        if not tables:
            return np.empty((0, 5), dtype=_I64), _EMPTY, _EMPTY
        n = [t.shape[0] for t in tables]
        return np.concatenate(tables), mb_X.repeat(n), tags.repeat(n)
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
    out[o] = new.cumsum() - 1
    return out


def rows_in(ids_X: np.ndarray | None, groups: np.ndarray) -> np.ndarray:
    """Rows of ``groups`` in a catalog's range arrays (with ``ids_X``: where those ids are)."""
    return groups if ids_X is None else ids_X.searchsorted(groups)
