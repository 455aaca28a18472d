"""The transfer planner: a deterministic join of source rows and destination rows by key.

Why this file exists: deciding who sends which row to whom is pure integer work that must give
the same answer on every rank, be checkable without any process group (the ``mopd plan``
inspector, the unit tests) and be fast for a million tokens, every step (packing changes the
layout each step, so the cache does not always help). It joins *runs* of keys
(:mod:`mopd.bridge.planner_runs`: ``O(runs log runs)`` plus a few linear passes to write the row
arrays), and keeps the per-token join (one sort of every key of both sides) as the reference
(``method="tokens"``), which the property tests compare it with, plan for plan. Measured on 1M
tokens over 256 ranks (``bench_bridge`` prints both; profiling/results/bridge-plan-cpu-*.md), THD
both sides: 12-20 ms by runs against 150-350 ms per token on 2 / 1 CPU threads; an ``[S, B, H]``
student (strided runs, found as constant-step chains without a sort): 25-28 ms against
230-350 ms. Keys that are not run-structured (with
``method="auto"``) and bad input (for the exact error message) go through the per-token path.
Knows nothing about tensors' contents.

Model:

- a :class:`SourceGroup` is a set of global ranks (replicas) holding the same rows: a teacher's
  TP group on its last pipeline stage for one ``(dp, cp)`` shard (CP is not undone by capture, SP
  is), or, for the LM head, the teacher ranks that hold one vocab shard;
- a :class:`DestGroup` is a set of global ranks that share one crossing: the destination buffer's
  rows are split into ``len(ranks)`` equal slices, ``ranks[j]`` receives the rows of slice ``j``
  and the group then all-gathers (a student's TP group for one ``(dp, cp)`` shard);
- every destination row's key is found in exactly one source group (two groups holding one key
  is an error; a missing key is an error unless ``allow_missing``, then the row is zero-filled
  and reported). Each needed row therefore crosses into its destination group once;
- the rows one source group sends to one destination slot are split into ``len(replicas)``
  contiguous, near-equal chunks, one per replica, rotated per block so the remainders spread
  (balance across teacher TP replicas); if a replica lives on the destination rank itself and
  ``local_copy`` is on, that replica serves the whole block as a local copy.

The result, :class:`TransferPlan`, is CSR: a table of transfers ``(owner, src_rank, dst_rank,
start, count)`` sorted by ``(owner, src_rank, dst_rank)``, and two flat row arrays; within a
transfer, rows are in increasing destination-row order. ``owner`` is the teacher index (one
output buffer per teacher).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from mopd.bridge.layout import TokenLayout
from mopd.bridge.mesh import Mesh
from mopd.bridge.planner_runs import extract_runs, is_run_structured, plan_from_runs

__all__ = [
    "DestGroup",
    "DestPlan",
    "PlanMethod",
    "SourceGroup",
    "StudentBatch",
    "TeacherBatch",
    "TransferPlan",
    "key_stride",
    "plan_token_exchange",
    "plan_transfers",
]

_I64 = torch.int64
_log = logging.getLogger(__name__)
_logged_fallback: set[bool] = set()

#: How :func:`plan_transfers` joins keys: ``"runs"``, ``"tokens"`` (the reference) or ``"auto"``.
PlanMethod = Literal["auto", "runs", "tokens"]


@dataclass(frozen=True, kw_only=True, eq=False)
class SourceGroup:
    """Replicas holding identical rows.

    Attributes:
        owner: which output buffer the rows belong to (teacher index).
        ranks: global ranks of the replicas (each holds the full ``key_R`` buffer).
        key_R: ``[R]`` int64 key of each row of the replicas' flat buffer; ``-1`` for padding.
        label: for error messages.
    """

    owner: int
    ranks: tuple[int, ...]
    key_R: torch.Tensor
    label: str = ""


@dataclass(frozen=True, kw_only=True, eq=False)
class DestGroup:
    """Ranks sharing one crossing: the buffer's ``N`` rows split into ``len(ranks)`` slices.

    Attributes:
        ranks: global ranks; ``ranks[j]`` receives rows ``[j * N / n, (j + 1) * N / n)``.
        key_R: ``[N]`` int64 key wanted in each row; ``-1`` for padding (zero-filled).
        label: for error messages.
    """

    ranks: tuple[int, ...]
    key_R: torch.Tensor
    label: str = ""


@dataclass(frozen=True, kw_only=True, eq=False)
class DestPlan:
    """What a destination group gets: ``owner_N[r]`` is the owner filling row ``r`` or ``-1``."""

    ranks: tuple[int, ...]
    num_rows: int
    owner_N: torch.Tensor
    label: str = ""

    @property
    def slice_rows(self) -> int:
        """Rows each rank of the group receives."""
        return self.num_rows // len(self.ranks)


@dataclass(frozen=True, kw_only=True, eq=False)
class TransferPlan:
    """A deterministic set of row transfers (CSR), identical on every rank that builds it.

    Attributes:
        num_owners: number of output buffers (teachers).
        row_bytes: bytes per row for each owner (``hidden_size * itemsize``; 0 if unknown).
        transfers_T5: ``[T, 5]`` int64 ``(owner, src_rank, dst_rank, start, count)``, sorted.
        src_rows_M: ``[M]`` int64 rows of the source replica's flat buffer.
        dst_rows_M: ``[M]`` int64 rows of the destination group's full flat buffer.
        dests: one :class:`DestPlan` per destination group.
        num_missing: destination rows with no source (zero-filled; only with ``allow_missing``).
        signature: a content hash of the inputs (of the keys as runs, which encode them exactly).
        replica_groups: the ranks of each source group (for balance figures).
        local_copy: if False, a transfer whose source and destination rank coincide still goes
            through the process group (a send/recv to self), e.g. to exercise NCCL at world size 1.
    """

    num_owners: int
    row_bytes: tuple[int, ...]
    transfers_T5: torch.Tensor
    src_rows_M: torch.Tensor
    dst_rows_M: torch.Tensor
    dests: tuple[DestPlan, ...]
    num_missing: int
    signature: str
    replica_groups: tuple[tuple[int, ...], ...] = ()
    local_copy: bool = True
    _by_rank: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def num_transfers(self) -> int:
        return int(self.transfers_T5.shape[0])

    def transfer_ids(self, rank: int) -> torch.Tensor:
        """Indices of the transfers where ``rank`` sends or receives (cached)."""
        ids = self._by_rank.get(rank)
        if ids is None:
            t = self.transfers_T5
            ids = torch.nonzero((t[:, 1] == rank) | (t[:, 2] == rank)).reshape(-1)
            self._by_rank[rank] = ids
        return ids

    def rows_of(self, transfer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(src_rows, dst_rows)`` of one transfer (views)."""
        start, count = (int(x) for x in self.transfers_T5[transfer_id, 3:5])
        return self.src_rows_M[start : start + count], self.dst_rows_M[start : start + count]

    def ranks(self) -> list[int]:
        """All global ranks that appear in the plan (as source, destination or group member)."""
        out = set(self.transfers_T5[:, 1].tolist()) | set(self.transfers_T5[:, 2].tolist())
        for d in self.dests:
            out |= set(d.ranks)
        return sorted(out)

    def transfer_matrix(self, world_size: int | None = None) -> torch.Tensor:
        """``[W, W]`` int64 bytes from source global rank (row) to destination (column).

        The diagonal holds local copies. Needs ``row_bytes`` (pass sizes when planning).
        """
        t = self.transfers_T5
        w = world_size if world_size is not None else (int(t[:, 1:3].max()) + 1 if t.numel() else 0)
        m = torch.zeros(w * w, dtype=_I64)
        if t.numel():
            rb = torch.tensor(self.row_bytes, dtype=_I64)[t[:, 0]]
            m.index_add_(0, t[:, 1] * w + t[:, 2], t[:, 4] * rb)
        return m.view(w, w)

    def summary(self) -> dict[str, int | float]:
        """Totals for printing: bytes across ranks, local bytes, messages, send imbalance."""
        t = self.transfers_T5
        rb = (
            torch.tensor(self.row_bytes, dtype=_I64)[t[:, 0]]
            if t.numel()
            else torch.zeros(0, dtype=_I64)
        )
        nbytes = t[:, 4] * rb if t.numel() else torch.zeros(0, dtype=_I64)
        cross = (
            (t[:, 1] != t[:, 2]) | (not self.local_copy)
            if t.numel()
            else torch.zeros(0, dtype=torch.bool)
        )
        send = {}
        for s, b in zip(t[cross, 1].tolist(), nbytes[cross].tolist(), strict=True):
            send[s] = send.get(s, 0) + b
        vols = list(send.values())
        rep = 0.0
        for ranks in self.replica_groups:
            v = [send.get(r, 0) for r in ranks]
            if len(v) > 1 and sum(v):
                rep = max(rep, max(v) / (sum(v) / len(v)) - 1.0)
        return {
            "transfers": self.num_transfers,
            "messages": int(cross.sum()),
            "local_copies": int((~cross).sum()),
            "rows_cross": int(t[cross, 4].sum()) if t.numel() else 0,
            "rows_local": int(t[~cross, 4].sum()) if t.numel() else 0,
            "bytes_cross": int(nbytes[cross].sum()) if t.numel() else 0,
            "bytes_local": int(nbytes[~cross].sum()) if t.numel() else 0,
            "max_send_bytes": max(vols) if vols else 0,
            "send_imbalance": (
                (max(vols) / (sum(vols) / len(vols)) - 1.0) if vols and sum(vols) else 0.0
            ),
            "replica_imbalance": rep,
            "missing_rows": self.num_missing,
        }


def _signature(parts: Sequence[object]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        if isinstance(p, torch.Tensor):
            h.update(p.contiguous().numpy().tobytes())
        else:
            h.update(repr(p).encode())
        h.update(b"|")
    return h.hexdigest()


def _check_groups(
    sources: Sequence[SourceGroup], dests: Sequence[DestGroup], num_owners: int
) -> None:
    for s in sources:
        if not s.ranks or not 0 <= s.owner < num_owners:
            raise ValueError(
                f"source group {s.label!r}: needs ranks and an owner in [0, {num_owners})"
            )
    for d in dests:
        if not d.ranks:
            raise ValueError(f"destination group {d.label!r} has no ranks")
        if d.key_R.numel() % len(d.ranks):
            raise ValueError(
                f"destination {d.label!r}: {d.key_R.numel()} rows do not split into "
                f"{len(d.ranks)} equal slices (one per rank of its TP group)"
            )


def plan_transfers(
    sources: Sequence[SourceGroup],
    dests: Sequence[DestGroup],
    *,
    num_owners: int | None = None,
    row_bytes: Sequence[int] | None = None,
    local_copy: bool = True,
    allow_missing: bool = False,
    describe_key: Callable[[int], str] = str,
    method: PlanMethod = "auto",
) -> TransferPlan:
    """Join source and destination keys into a :class:`TransferPlan` (pure, deterministic).

    Args:
        method: ``"runs"`` joins runs of keys (:mod:`mopd.bridge.planner_runs`; milliseconds for
            1M tokens), ``"tokens"`` joins every key (the per-token reference), ``"auto"`` takes
            runs unless the keys average fewer than ``MIN_MEAN_RUN`` per run (not run-structured,
            e.g. arbitrary per-row keys), then tokens (logged once). All give identical plans,
            signature included; errors always come from the per-token path (same messages).

    Raises:
        ValueError: a key held by two source rows (two owners, or twice in one group), a
            destination key held by no source (unless ``allow_missing``), or a destination buffer
            whose rows do not split evenly over its ranks.
    """
    if method not in ("auto", "runs", "tokens"):
        raise ValueError(f"method must be 'auto', 'runs' or 'tokens', got {method!r}")
    num_owners = (
        num_owners if num_owners is not None else (max((s.owner for s in sources), default=-1) + 1)
    )
    row_bytes = tuple(row_bytes) if row_bytes is not None else (0,) * num_owners
    if len(row_bytes) != num_owners:
        raise ValueError(f"row_bytes has {len(row_bytes)} entries for {num_owners} owners")
    _check_groups(sources, dests, num_owners)

    # runs of both sides: the join's input and, being an exact encoding of the keys, the
    # signature's (hashing runs instead of every key keeps the signature at microseconds)
    sizes = [int(d.key_R.numel()) for d in dests]
    slot_counts = [len(d.ranks) for d in dests]
    slot_off = [0]
    for n in slot_counts:
        slot_off.append(slot_off[-1] + n)
    src_runs = extract_runs([s.key_R.reshape(-1) for s in sources])
    dst_runs = extract_runs(
        [d.key_R.reshape(-1) for d in dests],
        slice_rows=[n // k for n, k in zip(sizes, slot_counts, strict=True)],
        slot_offsets=slot_off[:-1],
    )
    sig = _signature(
        [num_owners, row_bytes, local_copy, allow_missing]
        + [(s.owner, s.ranks, int(s.key_R.numel())) for s in sources]
        + [(d.ranks, n) for d, n in zip(dests, sizes, strict=True)]
        + [src_runs.table(), dst_runs.table()]
    )
    common = {
        "num_owners": num_owners,
        "row_bytes": row_bytes,
        "local_copy": local_copy,
        "signature": sig,
    }
    use_runs = method == "runs" or (
        method == "auto" and bool(sources) and is_run_structured(src_runs, dst_runs)
    )
    if method == "auto" and not use_runs and src_runs.num_tokens and not _logged_fallback:
        _logged_fallback.add(True)
        _log.info(
            "planner: keys are not run-structured (%d runs for %d keys); planning per token",
            src_runs.num_runs + dst_runs.num_runs,
            src_runs.num_tokens + dst_runs.num_tokens,
        )
    if use_runs and sources:
        rep_count = [len(s.ranks) for s in sources]
        rp = plan_from_runs(
            src_runs,
            dst_runs,
            owner_G=torch.tensor([s.owner for s in sources], dtype=_I64),
            rep_rank=torch.tensor([r for s in sources for r in s.ranks], dtype=_I64),
            rep_off_G=torch.tensor([0, *rep_count], dtype=_I64).cumsum(0),
            slot_rank=torch.tensor([r for d in dests for r in d.ranks], dtype=_I64),
            dst_sizes=sizes,
            local_copy=local_copy,
            allow_missing=allow_missing,
        )
        if rp is not None:
            return _assemble(
                sources,
                dests,
                sizes,
                transfers_T5=rp.transfers_T5,
                src_rows_M=rp.src_rows_M,
                dst_rows_M=rp.dst_rows_M,
                owner_all=rp.owner_N,
                num_missing=rp.num_missing,
                **common,
            )
        # bad input: the per-token path below raises the error with its exact message
    return _plan_per_token(
        sources, dests, allow_missing=allow_missing, describe_key=describe_key, **common
    )


def _assemble(
    sources: Sequence[SourceGroup],
    dests: Sequence[DestGroup],
    sizes: Sequence[int],
    *,
    num_owners: int,
    row_bytes: tuple[int, ...],
    local_copy: bool,
    signature: str,
    transfers_T5: torch.Tensor,
    src_rows_M: torch.Tensor,
    dst_rows_M: torch.Tensor,
    owner_all: torch.Tensor,
    num_missing: int,
) -> TransferPlan:
    """The :class:`TransferPlan` of both paths' arrays (``owner_all``: destinations concatenated)."""
    dest_plans = []
    at = 0
    for d, n in zip(dests, sizes, strict=True):
        dest_plans.append(
            DestPlan(ranks=d.ranks, num_rows=n, owner_N=owner_all[at : at + n], label=d.label)
        )
        at += n
    return TransferPlan(
        num_owners=num_owners,
        row_bytes=row_bytes,
        transfers_T5=transfers_T5.contiguous(),
        src_rows_M=src_rows_M.contiguous(),
        dst_rows_M=dst_rows_M.contiguous(),
        dests=tuple(dest_plans),
        num_missing=num_missing,
        signature=signature,
        replica_groups=tuple(s.ranks for s in sources),
        local_copy=local_copy,
    )


def _plan_per_token(
    sources: Sequence[SourceGroup],
    dests: Sequence[DestGroup],
    *,
    num_owners: int,
    row_bytes: tuple[int, ...],
    local_copy: bool,
    allow_missing: bool,
    describe_key: Callable[[int], str],
    signature: str,
) -> TransferPlan:
    """The per-token reference: one sort of every source and destination key joins them.

    ``O(tokens log tokens)``; kept as the reference the run join is checked against (and as the
    path for keys that are not run-structured, and for error messages). Expects validated input.
    """
    # --- sources: [key, group, row] of every held row -----------------------------------------
    empty = torch.empty((0, 3), dtype=_I64)
    src_KGR = (
        torch.cat(
            [
                torch.stack(
                    [
                        s.key_R,
                        torch.full_like(s.key_R, i),
                        torch.arange(s.key_R.numel(), dtype=_I64),
                    ],
                    dim=1,
                )
                for i, s in enumerate(sources)
            ]
        )
        if sources
        else empty
    )
    src_KGR = src_KGR[src_KGR[:, 0] >= 0]
    n_src = src_KGR.shape[0]

    # --- destinations: [key, group, row, slot]; slot = (group, slice) -> receiving rank --------
    slot_rank = torch.tensor([r for d in dests for r in d.ranks], dtype=_I64)
    slot_off = torch.tensor([0] + [len(d.ranks) for d in dests], dtype=_I64).cumsum(0)
    n_slots = int(slot_rank.numel())
    sizes = [d.key_R.numel() for d in dests]
    parts = []
    for i, d in enumerate(dests):
        row = torch.arange(d.key_R.numel(), dtype=_I64)
        slot_i = int(slot_off[i]) + row // max(1, d.key_R.numel() // len(d.ranks))
        parts.append(torch.stack([d.key_R, torch.full_like(row, i), row, slot_i], dim=1))
    dst_KGRS = torch.cat(parts) if parts else torch.empty((0, 4), dtype=_I64)
    dst_KGRS = dst_KGRS[dst_KGRS[:, 0] >= 0]

    # --- the join: one sort of source and destination keys together -------------------------
    # (key * 2 + tag, tag 0 = source): a destination's source is the last source at or before it
    # in sorted order, if it has the same key. Sequential, cache-friendly; no binary searches.
    merged = torch.cat([src_KGR[:, 0] * 2, dst_KGRS[:, 0] * 2 + 1])
    m_sorted, order = torch.sort(merged, stable=True)
    is_src = order < n_src
    src_pos = torch.nonzero(is_src).reshape(-1)
    k_sorted = m_sorted[src_pos] // 2
    dup = torch.nonzero(k_sorted[1:] == k_sorted[:-1]).reshape(-1)
    if dup.numel():
        i = int(dup[0])
        a, b = (int(src_KGR[order[src_pos[x]], 1]) for x in (i, i + 1))
        raise ValueError(
            f"token {describe_key(int(k_sorted[i]))} is held twice: by {sources[a].label or a} "
            f"(ranks {list(sources[a].ranks)}) and by {sources[b].label or b} "
            f"(ranks {list(sources[b].ranks)}); {dup.numel()} duplicated keys in all"
        )
    idx = torch.arange(order.numel(), dtype=_I64)
    last_src = torch.cummax(torch.where(is_src, idx, torch.full_like(idx, -1)), 0).values
    dst_sel = torch.nonzero(~is_src).reshape(-1)
    j = last_src[dst_sel]
    dst = dst_KGRS[order[dst_sel] - n_src]
    found = j >= 0
    found[found.clone()] = m_sorted[j[found]] // 2 == dst[found, 0]
    num_missing = int((~found).sum())
    if num_missing and not allow_missing:
        i = int(torch.nonzero(~found)[0])
        g, r = int(dst[i, 1]), int(dst[i, 2])
        raise ValueError(
            f"token {describe_key(int(dst[i, 0]))} is needed by {dests[g].label or g} "
            f"(ranks {list(dests[g].ranks)}, row {r}) but no teacher holds it; "
            f"{num_missing} needed tokens are missing in all"
        )
    keep = torch.nonzero(found).reshape(-1)
    src_GR = src_KGR[order[j[keep]], 1:]
    dst = dst[keep]
    # one row per moved token: [group, src_row, dst_group, dst_row, slot]
    rows = torch.cat([src_GR, dst[:, 1:]], dim=1)

    # owner of every destination row
    owners_src = torch.tensor([s.owner for s in sources], dtype=_I64)
    dst_off = torch.tensor([0, *sizes], dtype=_I64).cumsum(0)
    owner_all = torch.full((int(dst_off[-1]),), -1, dtype=_I64)
    owner_all[dst_off[rows[:, 2]] + rows[:, 3]] = owners_src[rows[:, 0]]

    # --- blocks: (source group, destination slot), rows by destination row; replica choice -----
    n_rows_max = max(sizes, default=0) + 1
    pair = rows[:, 0] * max(n_slots, 1) + rows[:, 4]
    _, o = torch.sort(pair * n_rows_max + rows[:, 3])  # unique keys: deterministic
    rows, pair = rows[o], pair[o]
    grp, src_row, dst_row, slot = rows[:, 0], rows[:, 1], rows[:, 3], rows[:, 4]
    _, counts = torch.unique_consecutive(pair, return_counts=True)
    n_blocks = counts.numel()
    block = torch.repeat_interleave(torch.arange(n_blocks, dtype=_I64), counts)
    block_start = torch.cumsum(counts, 0) - counts
    i_in = torch.arange(pair.numel(), dtype=_I64) - block_start[block]
    rep_count = torch.tensor([len(s.ranks) for s in sources], dtype=_I64)
    rep_off = torch.cat([torch.zeros(1, dtype=_I64), rep_count.cumsum(0)])
    rep_rank = torch.tensor([r for s in sources for r in s.ranks], dtype=_I64)
    b_grp = grp[block_start]
    k_b = rep_count[b_grp]
    # k near-equal contiguous chunks per block, one per replica, rotated per block
    rep = (i_in * k_b[block] // counts[block] + block % k_b[block]) % k_b[block]
    if local_copy and n_blocks:
        # a replica on the destination rank serves the whole block locally
        b_rank = slot_rank[slot[block_start]]
        local_rep = torch.full((n_blocks,), -1, dtype=_I64)
        for r_i in range(int(rep_count.max())):
            has = (r_i < k_b) & (local_rep < 0)
            at = torch.where(has, rep_off[b_grp] + r_i, torch.zeros_like(b_grp))
            local_rep[has & (rep_rank[at] == b_rank)] = r_i
        lr = local_rep[block]
        rep = torch.where(lr >= 0, lr, rep)

    # --- transfers: the (block, replica) runs, ordered by (owner, src_rank, dst_rank) ----------
    # each run's rows stay where they are (already in destination-row order); with tokens a rank
    # is a replica of one source group per owner, so each (owner, src, dst) is one run; if a
    # caller's groups share a rank, equal triples keep their run order (stable sort) on every rank
    _, t_counts = torch.unique_consecutive(
        block * (int(rep_count.max()) + 1) + rep, return_counts=True
    )
    t_starts = torch.cumsum(t_counts, 0) - t_counts
    t_grp = grp[t_starts]
    t_src = rep_rank[rep_off[t_grp] + rep[t_starts]]
    t_dst = slot_rank[slot[t_starts]]
    t_owner = owners_src[t_grp]
    w = (
        int(
            max(
                int(rep_rank.max()) if rep_rank.numel() else 0,
                int(slot_rank.max()) if n_slots else 0,
            )
        )
        + 1
    )
    t_order = torch.argsort((t_owner * w + t_src) * w + t_dst, stable=True)
    transfers = torch.stack([t_owner, t_src, t_dst, t_starts, t_counts], dim=1)[t_order]
    return _assemble(
        sources,
        dests,
        sizes,
        num_owners=num_owners,
        row_bytes=row_bytes,
        local_copy=local_copy,
        signature=signature,
        transfers_T5=transfers,
        src_rows_M=src_row,
        dst_rows_M=dst_row,
        owner_all=owner_all,
        num_missing=num_missing,
    )


# --- tokens: teachers' and student's batches -> groups ---------------------------------------


@dataclass(frozen=True, kw_only=True, eq=False)
class TeacherBatch:
    """One teacher's side of a step, as the planner needs it.

    Attributes:
        mesh: the teacher's mesh; sources are its last-stage TP groups.
        layouts: ``(dp_rank, cp_rank) -> TokenLayout`` of the captured buffer every TP rank of
            that shard holds (SP undone, CP not undone).
        hidden_size: ``H`` of this teacher.
        itemsize: bytes per element (2 for bf16).
    """

    mesh: Mesh
    layouts: Mapping[tuple[int, int], TokenLayout]
    hidden_size: int
    itemsize: int = 2

    def __post_init__(self) -> None:
        _check_shards(self.mesh, self.layouts)
        if self.hidden_size < 1 or self.itemsize < 1:
            raise ValueError(
                f"{self.mesh}: hidden_size {self.hidden_size} and itemsize {self.itemsize} must be positive"
            )


@dataclass(frozen=True, kw_only=True, eq=False)
class StudentBatch:
    """The student's side: ``(dp_rank, cp_rank) -> TokenLayout`` of the buffer it wants filled."""

    mesh: Mesh
    layouts: Mapping[tuple[int, int], TokenLayout]

    def __post_init__(self) -> None:
        _check_shards(self.mesh, self.layouts)


def _check_shards(mesh: Mesh, layouts: Mapping[tuple[int, int], TokenLayout]) -> None:
    want = set(mesh.shards())
    got = set(layouts)
    if want != got:
        raise ValueError(
            f"{mesh}: layouts must cover exactly the (dp, cp) shards {sorted(want)}, got {sorted(got)}"
        )


def key_stride(layouts: Sequence[TokenLayout]) -> int:
    """``1 + max position`` over all layouts: the ``L`` of ``key = sample_id * L + position``."""
    m = 0
    for x in layouts:
        if x.position_R.numel():
            m = max(m, int(x.position_R.max()))
    return m + 1


def _keys_of(layouts: Sequence[TokenLayout], stride: int) -> list[torch.Tensor]:
    """Per layout, ``[R]`` int64 keys as :func:`encode_keys` (``-1`` = padding), as adjacent views
    of one buffer (so the run join reads them without a copy). Three passes, no temporaries."""
    buf = torch.empty(sum(x.num_rows for x in layouts), dtype=_I64)
    out = []
    at = 0
    for x in layouts:
        v = buf[at : at + x.num_rows]
        torch.mul(x.sample_id_R, stride, out=v)
        v.add_(x.position_R)
        v.clamp_(min=-1)  # padding: -stride - 1 -> -1
        out.append(v)
        at += x.num_rows
    return out


def plan_token_exchange(
    teachers: Sequence[TeacherBatch],
    student: StudentBatch,
    *,
    local_copy: bool = True,
    method: PlanMethod = "auto",
) -> TransferPlan:
    """Plan moving every token the student's layouts want from the teacher that holds it.

    Pure: needs meshes and layouts only (no process group). Owner ``i`` is ``teachers[i]``.
    ``method`` as in :func:`plan_transfers` (``"tokens"``: the per-token reference).
    """
    all_layouts = [x for t in teachers for x in t.layouts.values()] + list(student.layouts.values())
    stride = key_stride(all_layouts)
    max_sample = max(
        (int(x.sample_id_R.max()) for x in all_layouts if x.sample_id_R.numel()), default=0
    )
    if max_sample >= (2**62) // stride:
        raise ValueError(
            f"sample ids up to {max_sample} with positions up to {stride} overflow int64 keys"
        )
    src_shards = [(i, d, c) for i, t in enumerate(teachers) for d, c in t.mesh.shards()]
    src_keys = _keys_of([teachers[i].layouts[(d, c)] for i, d, c in src_shards], stride)
    sources = [
        SourceGroup(
            owner=i,
            ranks=teachers[i].mesh.tp_group_ranks(dp_rank=d, cp_rank=c),
            key_R=k,
            label=f"teacher {i} (dp={d}, cp={c})",
        )
        for (i, d, c), k in zip(src_shards, src_keys, strict=True)
    ]
    dst_shards = student.mesh.shards()
    dst_keys = _keys_of([student.layouts[x] for x in dst_shards], stride)
    dests = [
        DestGroup(
            ranks=student.mesh.tp_group_ranks(dp_rank=d, cp_rank=c),
            key_R=k,
            label=f"student (dp={d}, cp={c})",
        )
        for (d, c), k in zip(dst_shards, dst_keys, strict=True)
    ]

    def describe(key: int) -> str:
        return f"(sample_id={key // stride}, position={key % stride})"

    return plan_transfers(
        sources,
        dests,
        num_owners=len(teachers),
        row_bytes=[t.hidden_size * t.itemsize for t in teachers],
        local_copy=local_copy,
        describe_key=describe,
        method=method,
    )
