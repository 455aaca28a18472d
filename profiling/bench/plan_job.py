"""The job ``mopd bench plan`` simulates: meshes, samples, every rank's layouts and records, the
routed exchange as every member plays it, and a rank's offline bridge.

Why this file exists: the benchmark times one rank's host work on a step of a 256- to
65,536-rank colocated job without processes, so the job itself is simulated here, by the
bridge's own rules: every member's record (:func:`mopd.bridge.offline.step_records`), every
member's part of the routed metadata exchange (:mod:`mopd.bridge.peers`; what one member
receives in each round, :func:`simulate_exchange`), and the bridge a rank steps
(:func:`offline_bridge`). Teacher tp8 cp2 and student tp4 cp4 on the same ranks, THD on both
sides with Megatron's SP padding, samples of random lengths assigned to DP ranks in contiguous
ranges (the teacher cuts by sample count, the student balances tokens, so the cuts differ).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mopd.bridge.config import TeacherSpec
from mopd.bridge.layout import TokenLayout, packed_layouts
from mopd.bridge.mesh import Mesh
from mopd.bridge.metadata import (
    StepMatrix,
)
from mopd.bridge.offline import OfflineBridge, step_records
from mopd.bridge.peers import (
    PeerView,
    directory_replies,
    forward_bundles,
    forward_pairs,
    read_replies,
    registrations,
)
from mopd.bridge.record import read_step, stack_records
from mopd.bridge.route import RADIX, bruck_partners
from mopd.bridge.topology import Topology

__all__ = [
    "BLOCK",
    "Batch",
    "ExchangeJob",
    "ExchangeSim",
    "SimWire",
    "Step",
    "build_step",
    "exchange_job",
    "job_meshes",
    "offline_bridge",
    "rank_batches",
    "rank_layouts",
    "representative_ranks",
    "simulate_exchange",
]

T_TP, T_CP, S_TP, S_CP = 8, 2, 4, 4


BLOCK = T_TP * T_CP  # ranks per DP index (the same for both meshes)


HIDDEN = 8192


def job_meshes(ranks: int) -> tuple[Mesh, Mesh]:
    if ranks % BLOCK:
        raise ValueError(f"ranks must be a multiple of {BLOCK}, got {ranks}")
    dp = ranks // BLOCK
    return (
        Mesh(tp=T_TP, cp=T_CP, dp=dp, name="teacher"),
        Mesh(tp=S_TP, cp=S_CP, dp=dp, name="student"),
    )


@dataclass(frozen=True, kw_only=True, eq=False)
class Samples:
    """One micro-batch's samples and how each side assigns them to its DP ranks (contiguous
    ids)."""

    lengths_S: np.ndarray
    teacher_parts: list[np.ndarray]
    student_parts: list[np.ndarray]


def _samples(ranks: int, tokens_per_rank: int, max_len: int, seed: int) -> Samples:
    rng = np.random.default_rng(seed)
    total = tokens_per_rank * ranks
    lengths = rng.integers(1, max_len + 1, size=int(2.4 * total / (max_len + 1)) + 64)
    n = int(np.searchsorted(np.cumsum(lengths), total)) + 1
    if n > lengths.size:
        raise AssertionError("drew too few samples")
    lengths = lengths[:n]
    dp = ranks // BLOCK
    ids = np.arange(n, dtype=np.int64)
    teacher = np.array_split(ids, dp)  # the same number of samples per DP rank
    cuts = np.searchsorted(np.cumsum(lengths), np.arange(1, dp) * (lengths.sum() / dp))
    student = np.split(ids, cuts)  # about the same number of tokens per DP rank
    return Samples(lengths_S=lengths, teacher_parts=teacher, student_parts=student)


@dataclass(frozen=True, kw_only=True, eq=False)
class Batch:
    """One rank's packed micro-batches as its data loader hands them over (Megatron builds
    ``cu_seqlens_padded`` for attention whether or not a bridge runs): per micro-batch its
    ``[N_i]`` sample ids, their real lengths and ``[N_i + 1]`` padded offsets, int64 tensors."""

    sample_ids: list[torch.Tensor]
    seq_lens: list[torch.Tensor]
    cu_seqlens_padded: list[torch.Tensor]

    @staticmethod
    def of(parts: Sequence[np.ndarray], lengths: Sequence[np.ndarray], mult: int) -> Batch:
        """``parts[i]``: micro-batch ``i``'s sample ids on this rank; ``lengths[i]``: that
        micro-batch's length per sample id; each sequence padded to a multiple of ``mult``."""
        lens = [lengths_S[ids] for ids, lengths_S in zip(parts, lengths, strict=True)]
        cus = [np.concatenate([[0], np.cumsum((x + mult - 1) // mult * mult)]) for x in lens]
        return Batch(
            sample_ids=[torch.from_numpy(ids) for ids in parts],
            seq_lens=[torch.from_numpy(x) for x in lens],
            cu_seqlens_padded=[torch.from_numpy(cu) for cu in cus],
        )

    def layouts(self, cp: int, cp_rank: int, sp: int = 1, sp_rank: int = 0) -> list[TokenLayout]:
        """The rank's layouts of the micro-batches, in one call (what the rank builds each
        step for the bridge)."""
        return packed_layouts(
            self.sample_ids,
            self.seq_lens,
            cu_seqlens_padded=self.cu_seqlens_padded,
            cp_size=cp,
            cp_rank=cp_rank,
            sp_size=sp,
            sp_rank=sp_rank,
        )


def _layouts(
    parts: Sequence[np.ndarray],
    lengths: Sequence[np.ndarray],
    cp: int,
    cp_rank: int,
    mult: int,
    sp: int = 1,
    sp_rank: int = 0,
) -> list[TokenLayout]:
    """:meth:`Batch.layouts` of :meth:`Batch.of` (the step's records are built from these)."""
    return Batch.of(parts, lengths, mult).layouts(cp, cp_rank, sp, sp_rank)


def _mult(tp: int, cp: int) -> int:
    """Megatron's THD padding under CP with SP: each sequence to a multiple of ``2 * cp * tp``."""
    return 2 * cp * tp


@dataclass(frozen=True, kw_only=True, eq=False)
class Step:
    """One simulated step: meshes, topology, the gathered matrix and what it cost to build.

    ``micro``: per micro-batch the samples (what a rank builds its layouts from);
    ``sp_shards``: the teacher sends from its sequence-parallel shards (every teacher rank its
    own source, ``TeacherSpec(sp_shards=True)``) instead of from TP replicas."""

    ranks: int
    sp_shards: bool
    tokens: int
    samples: int
    teacher: Mesh
    student: Mesh
    topology: Topology
    matrix_NW: np.ndarray
    sizes_N: np.ndarray
    micro: tuple[Samples, ...]
    setup_s: float
    topology_ms: float


def rank_batches(step: Step, rank: int) -> tuple[Batch, Batch]:
    """``rank``'s teacher and student micro-batches as its data loader gives them (not the
    bridge's work: the caller times :func:`rank_layouts` of them)."""
    tc, sc = step.teacher.coord(rank), step.student.coord(rank)
    assert tc is not None and sc is not None
    lengths = [m.lengths_S for m in step.micro]
    t = Batch.of([m.teacher_parts[tc.dp_rank] for m in step.micro], lengths, _mult(T_TP, T_CP))
    s = Batch.of([m.student_parts[sc.dp_rank] for m in step.micro], lengths, _mult(S_TP, S_CP))
    return t, s


def rank_layouts(
    step: Step, rank: int, batches: tuple[Batch, Batch] | None = None
) -> tuple[list[TokenLayout], list[TokenLayout]]:
    """``rank``'s teacher and student layouts, one per micro-batch, built as a rank builds
    them each step from its micro-batches (``batches``: :func:`rank_batches`, made here when
    not given)."""
    tc, sc = step.teacher.coord(rank), step.student.coord(rank)
    assert tc is not None and sc is not None
    t_batch, s_batch = rank_batches(step, rank) if batches is None else batches
    sp = (T_TP, tc.tp_rank) if step.sp_shards else (1, 0)
    return t_batch.layouts(T_CP, tc.cp_rank, *sp), s_batch.layouts(S_CP, sc.cp_rank)


def job_teachers(teacher: Mesh, sp_shards: bool) -> tuple[TeacherSpec, ...]:
    """The simulated job's one teacher (bf16, its sources as ``sp_shards`` says)."""
    return (
        TeacherSpec(mesh=teacher, hidden_size=HIDDEN, dtype=torch.bfloat16, sp_shards=sp_shards),
    )


def build_step(
    ranks: int,
    *,
    tokens_per_rank: int,
    max_len: int,
    seed: int = 0,
    micro_batches: int = 1,
    sp_shards: bool = False,
) -> Step:
    """Every rank's record (by the bridge's rule: :func:`~mopd.bridge.offline.step_records`)
    and the stacked matrix; ``tokens_per_rank`` over the whole step, split evenly into the
    micro-batches (each its own draw of samples); ``sp_shards``: the teacher's sources are its
    SP shards (each teacher rank sends its own slice of the CP-local sequence).

    Layouts are built one DP index (16 ranks) at a time, as the ranks ask; TP replicas share
    one encoding.
    """
    t0 = time.perf_counter()
    teacher, student = job_meshes(ranks)
    per_mb = max(tokens_per_rank // micro_batches, 1)
    micro = tuple(_samples(ranks, per_mb, max_len, seed + i) for i in range(micro_batches))
    t_mult, s_mult = _mult(T_TP, T_CP), _mult(S_TP, S_CP)
    t1 = time.perf_counter()
    topo = Topology.build([teacher], student, shard_sources=[sp_shards])
    _ = topo.index
    topology_ms = 1e3 * (time.perf_counter() - t1)
    sp = T_TP if sp_shards else 1

    # a DP index's layouts, built when its first rank asks (ranks come in order; kept a while)
    @functools.lru_cache(maxsize=4 * BLOCK)
    def teacher_shard(d: int, c: int, k: int) -> list[TokenLayout]:
        parts = [m.teacher_parts[d] for m in micro]
        return _layouts(parts, [m.lengths_S for m in micro], T_CP, c, t_mult, sp, k)

    @functools.lru_cache(maxsize=4 * BLOCK)
    def student_shard(d: int, c: int) -> list[TokenLayout]:
        parts = [m.student_parts[d] for m in micro]
        return _layouts(parts, [m.lengths_S for m in micro], S_CP, c, s_mult)

    def teacher_layouts(key: Any) -> list[TokenLayout]:
        if not sp_shards:
            return teacher_shard(*key, 0)
        tc = teacher.coord(key)  # each rank its own SP shard
        assert tc is not None
        return teacher_shard(tc.dp_rank, tc.cp_rank, tc.tp_rank)

    _, records = step_records(
        job_teachers(teacher, sp_shards),
        student,
        n_slots=micro_batches,
        teacher_layouts=[teacher_layouts],
        student_layouts=lambda key: student_shard(*key),
        topology=topo,
    )
    matrix, sizes = stack_records(records)
    del records
    return Step(
        ranks=ranks,
        sp_shards=sp_shards,
        tokens=int(sum(m.lengths_S.sum() for m in micro)),
        samples=int(sum(m.lengths_S.size for m in micro)),
        teacher=teacher,
        student=student,
        topology=topo,
        matrix_NW=matrix,
        sizes_N=sizes,
        micro=micro,
        setup_s=time.perf_counter() - t0,
        topology_ms=topology_ms,
    )


def representative_ranks(ranks: int) -> list[int]:
    """Rank 0 (teacher and student group leader: checks both), one in the middle (no leader),
    and the last teacher leader (a student leader too)."""
    return sorted({0, ranks // 2 + 5, ranks - BLOCK // 2})


class SimWire:
    """:class:`~mopd.bridge.route.Wire` of one member of a simulated job: each round answers
    with what :func:`simulate_exchange` found the other members send it, checking that the
    member expects exactly those messages; :meth:`reduce_sum` answers with the job's sum.

    Args:
        member, size: the member and the job's member count.
        rounds: per :meth:`~mopd.bridge.route.Wire.swap`, in order, ``member -> words`` it
            receives.
        total: what :meth:`reduce_sum` returns (the verdict's flag and the step's tokens).
        book: the rounds' bookkeeping (:class:`RoundBook`, made once per simulated member).
    """

    def __init__(
        self,
        member: int,
        size: int,
        rounds: Sequence[dict[int, np.ndarray]],
        total: np.ndarray,
        book: RoundBook,
    ) -> None:
        self.member = member
        self.size = size
        self._rounds = rounds
        self._book = book
        self._total = total
        self._at = 0
        self._received = 0

    @property
    def received_words(self) -> int:
        return self._received

    def swap(
        self, sends: Mapping[int, np.ndarray], recv_from: Sequence[int]
    ) -> dict[int, np.ndarray]:
        at = self._next(recv_from, sized=False)
        return dict(self._rounds[at])

    def swap_sized(
        self, sends: Mapping[int, np.ndarray], recv_from: Sequence[int], sizes_P: Sequence[int]
    ) -> np.ndarray:
        at = self._next(recv_from, sized=True)
        words = self._book.words[at]
        if list(recv_from) != sorted(recv_from) or sum(sizes_P) != words:
            raise AssertionError(
                f"member {self.member}, round {self._at}: a sized round from "
                f"{list(recv_from)[:8]} of {sum(sizes_P)} words, the job sends {words}"
            )
        return self._book.flats[at]

    def _next(self, recv_from: Sequence[int], *, sized: bool) -> int:
        """The round ``recv_from`` receives in: checked, counted."""
        at = self._at
        got = self._rounds[at]
        self._at += 1
        if len(recv_from) != len(got) or self._book.froms[at] != frozenset(recv_from):
            raise AssertionError(
                f"member {self.member}, round {self._at}: expects {sorted(recv_from)[:8]}, "
                f"the job sends from {sorted(got)[:8]}"
            )
        # every message's words, and its size word where sizes travel first
        self._received += self._book.words[at] + (0 if sized else self._book.others[at])
        return at

    def reduce_sum(self, words: np.ndarray) -> np.ndarray:
        if words.size != self._total.size:
            raise AssertionError(f"a sum of {words.size} words, the job's has {self._total.size}")
        return self._total.copy()


@dataclass(frozen=True, kw_only=True, eq=False)
class ExchangeSim:
    """One member's routed exchange of a simulated step (:func:`simulate_exchange`).

    Attributes:
        member: the member.
        rounds: per swap of :func:`~mopd.bridge.peers.exchange_records`, what it receives.
        held: the members whose records it ends up with (its own included), ascending.
        tokens_I: ``[n_slots]`` the step's tokens (what the verdict's sum returns).
    """

    member: int
    rounds: tuple[dict[int, np.ndarray], ...]
    held: np.ndarray
    tokens_I: np.ndarray

    def wire(self, size: int) -> SimWire:
        total = np.concatenate([[0], self.tokens_I]).astype(np.int64)
        return SimWire(self.member, size, self.rounds, total, self.book)

    @functools.cached_property
    def book(self) -> RoundBook:
        """The rounds' bookkeeping, made once (never in a timed step)."""
        return RoundBook.of(self.member, self.rounds)


@dataclass(frozen=True, kw_only=True, eq=False)
class RoundBook:
    """Per round of a simulated member's exchange: the members it receives from, the words
    it receives, its messages from others, and its messages one after another by ascending
    member (what :meth:`~mopd.bridge.route.Wire.swap_sized` receives into one buffer)."""

    froms: tuple[frozenset[int], ...]
    words: tuple[int, ...]
    others: tuple[int, ...]
    flats: tuple[np.ndarray, ...]

    @staticmethod
    def of(member: int, rounds: Sequence[dict[int, np.ndarray]]) -> RoundBook:
        return RoundBook(
            froms=tuple(frozenset(got) for got in rounds),
            words=tuple(sum(a.size for a in got.values()) for got in rounds),
            others=tuple(len(got) - (member in got) for got in rounds),
            flats=tuple(
                np.concatenate([np.empty(0, np.int64), *(got[p].reshape(-1) for p in sorted(got))])
                for got in rounds
            ),
        )


@dataclass(frozen=True, kw_only=True, eq=False)
class ExchangeJob:
    """Every member's registrations, sorted by home, and what the members learn of them."""

    step: Step
    entries: np.ndarray  # [E, 6] ENTRY_COLUMNS, by home
    home_at: np.ndarray  # [n + 1] each home's rows
    views: dict[int, PeerView]

    def record(self, j: int) -> np.ndarray:
        return self.step.matrix_NW[j, : self.step.sizes_N[j]]

    def replies(self, j: int) -> dict[int, np.ndarray]:
        """``home -> rows`` member ``j`` receives back (one per home it registered at)."""
        homes = self._homes(j)
        out = {}
        for h in homes:
            at = self.entries[self.home_at[h] : self.home_at[h + 1]]
            out[h] = directory_replies(at)[j]
        return out

    def _homes(self, j: int) -> list[int]:
        return sorted(set(self._own(j)[:, 0].tolist()))

    def _own(self, j: int) -> np.ndarray:
        topo, m = self.step.topology, len(self.step.micro)
        return registrations(self.record(j), topology=topo, rank=topo.members[j], n_slots=m)

    def view(self, j: int) -> PeerView:
        got = self.views.get(j)
        if got is None:
            reps = self.replies(j)
            rows = (
                np.concatenate([r.reshape(-1, 5) for r in reps.values()])
                if reps
                else np.empty((0, 5), dtype=np.int64)
            )
            got = self.views[j] = read_replies(
                rows, member=j, n_sources=len(self.step.topology.sources)
            )
        return got

    def introduced(self, j: int) -> dict[int, int]:
        """Member ``j``'s introduced (second-hop) peers, ``member -> words``."""
        out = {}
        for x in self.view(j).intro_from:
            intro = self.view(x).intro
            for p, w in zip(intro[:, 1].tolist(), intro[:, 2].tolist(), strict=True):
                if p != j:
                    out[p] = w
        return out

    def peers(self, j: int) -> dict[int, int]:
        """Member ``j``'s peers: first hop and introduced, ``member -> words``."""
        return {**self.view(j).peers, **self.introduced(j)}

    def forwarded(self, lead: int, j: int) -> np.ndarray:
        """What leader ``lead`` forwards member ``j`` (by the bridge's rule)."""
        topo = self.step.topology
        to_source, to_dest, _ = forward_pairs(topo, topo.members[lead])
        view = self.view(lead)
        return forward_bundles(
            self.held(lead),
            member=lead,
            to_source=[m for m in to_source if m == j],
            to_dest=[m for m in to_dest if m == j],
            source_side=view.source_side | set(self.introduced(lead)),
            dest_side=view.dest_side,
        )[j]

    def held(self, j: int) -> dict[int, np.ndarray]:
        """Member ``j``'s records after the records' round (its own and its peers')."""
        out = {j: self.record(j)}
        out.update((p, self.record(p)) for p in self.peers(j))
        return out


def exchange_job(step: Step) -> ExchangeJob:
    """Every member's registrations (by the bridge's rule), sorted by home (not timed)."""
    topo, m = step.topology, len(step.micro)
    n = len(topo.members)
    parts = [
        registrations(step.matrix_NW[j, : step.sizes_N[j]], topology=topo, rank=r, n_slots=m)
        for j, r in enumerate(topo.members)
    ]
    entries = np.concatenate(parts)
    entries = entries[np.argsort(entries[:, 0], kind="stable")]
    home_at = np.searchsorted(entries[:, 0], np.arange(n + 1))
    return ExchangeJob(step=step, entries=entries, home_at=home_at, views={})


def simulate_exchange(job: ExchangeJob, member: int, *, radix: int = RADIX) -> ExchangeSim:
    """What ``member`` receives in each round of the routed exchange when every member of
    ``job`` plays its part by the bridge's rule (:mod:`mopd.bridge.peers`; not timed):
    the registrations routed through it, its replies, its introductions, its peers' records
    and its leaders' forwarded records."""
    step = job.step
    topo = step.topology
    n = len(topo.members)
    rounds: list[dict[int, np.ndarray]] = []
    # 1. the Bruck rounds: rows that arrive at `member` in each
    e = job.entries
    origin, home = e[:, 4], e[:, 0]
    offset = (home - origin) % n
    step_j = 1
    while step_j < n:
        digit = offset // step_j % radix
        sender = (origin + offset % step_j) % n
        holder = (origin + offset % (step_j * radix)) % n
        here = np.flatnonzero((holder == member) & (digit != 0))
        _, frm = bruck_partners(n, member, step_j, radix)
        got = {p: np.empty(0, dtype=np.int64) for p in frm}
        for p in frm:
            got[p] = e[here[sender[here] == p]].reshape(-1)
        rounds.append(got)
        step_j *= radix
    # 2. replies; 3. introductions; 4. records; 5. forwarded records
    rounds.append(job.replies(member))
    view = job.view(member)
    rounds.append({x: job.view(x).intro.reshape(-1) for x in view.intro_from})
    held = job.held(member)
    rounds.append({p: held[p] for p in sorted(job.peers(member))})
    to_source, to_dest, from_ = forward_pairs(topo, topo.members[member])
    if to_source or to_dest or from_:
        got = {lead: job.forwarded(lead, member) for lead in from_}
        rounds.append(got)
        for msg in got.values():
            for p in msg[1 : 1 + int(msg[0])].tolist():
                held.setdefault(p, job.record(p))
    view = read_step(topo, StepMatrix(step.matrix_NW), len(step.micro))
    return ExchangeSim(
        member=member,
        rounds=tuple(rounds),
        held=np.asarray(sorted(held), dtype=np.int64),
        tokens_I=view.tokens_I(),
    )


def offline_bridge(step: Step, rank: int, sim: ExchangeSim | None = None) -> OfflineBridge:
    """``step``'s bridge as global rank ``rank`` holds it, without process groups
    (:class:`~mopd.bridge.offline.OfflineBridge`: the live bridge's per-step code, minus the
    collectives); its wire is ``sim``'s (:func:`simulate_exchange`), or one that answers the
    verdict's sum with the job's."""
    n = len(step.topology.members)
    if sim is None:
        full = read_step(step.topology, StepMatrix(step.matrix_NW), len(step.micro))
        sim = ExchangeSim(
            member=step.topology.member_index(rank),
            rounds=(),
            held=np.arange(n),
            tokens_I=full.tokens_I(),
        )
    return OfflineBridge(
        teachers=job_teachers(step.teacher, step.sp_shards),
        student=step.student,
        rank=rank,
        topology=step.topology,
        wire=lambda deadline, sim=sim: sim.wire(n),
    )
