"""Which records of a step a rank reads, and how they reach it: routed, never gathered.

Why this file exists: a rank plans and checks a step from its own groups' runs and those of the
groups that share a sample with them (and, to place its rows in compact order, the sources that
share a sample with the destinations it serves). Gathering every record to find those costs
every rank the whole job's metadata; here each rank receives the records it reads, found
through the data in a fixed number of rounds, whatever the job's size.

The exchange (:func:`exchange_records`, collective over the bridge's metadata group, for a step
whose summary says every rank agreed):

1. *Registrations.* Each group leader (the rank whose record carries a group's runs) registers,
   per micro-batch, every sample id its groups hold or want: one row
   :data:`ENTRY_COLUMNS` per ``(micro-batch, sample, group)``, sent to the sample's *home*
   member (:func:`home_of`, a hash of the key: no rank needs to know who holds what) in
   ``ceil(log_8(n))`` rounds (:func:`~mopd.bridge.route.route_rows`). A caller's
   :class:`~mopd.bridge.inputs.Agreement` registers the same way under its key, its first rank
   saying so.
2. *Replies.* Each home sends every member that registered a key there all of that key's
   registrations (:func:`directory_replies`). A rank now knows, per micro-batch and sample, the
   groups that hold or want it: its *first-hop* peers (an agreement's first rank and the ranks
   that give it are peers of each other).
3. *Introductions.* A destination's leader sends each source leader that holds one of its
   samples the list of every source that holds one (:func:`read_replies`): the *second-hop*
   peers a source needs to place its rows among theirs. Both ends know every message of this
   round and of the next from what they received.
4. *Records.* Every rank sends its record to each of its peers and receives theirs (sizes
   known from the registrations).
5. *Forwarding.* A group leader sends the other ranks of its groups (TP replicas, the student's
   TP ranks) its own record and the records of the peers that group plans with; they plan
   from the same records as their leader.

Every relation is symmetric and known to both ends, so each round is one
:meth:`~mopd.bridge.route.Wire.swap`. A rank receives its peers' records (about as many as it
has peers) and a few rows per sample it holds: its metadata follows its own work, not the job.
Planning from them gives the plans and verdicts of every record: the planner reads a group's
runs only where it shares a sample with the rank's own, and every such group is here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mopd.bridge.catalog import fan_out, unique_first
from mopd.bridge.inputs import Agreement
from mopd.bridge.metadata import HEADER, SIZE, SLOT_FIELDS, RaggedRecords
from mopd.bridge.route import RADIX, Wire, route_rows, split_words
from mopd.bridge.topology import Topology

__all__ = [
    "ENTRY_COLUMNS",
    "REPLY_COLUMNS",
    "PeerView",
    "bundle_records",
    "directory_replies",
    "exchange_records",
    "forward_bundles",
    "forward_pairs",
    "home_of",
    "read_replies",
    "registrations",
]

_I64 = np.int64
#: Columns of a registration: its home member, the key (``key_a``: the micro-batch, or ``-1``
#: for an agreement; ``key_b``: the sample id, or the agreement's key), the group (source ``g``:
#: ``g``; destination ``d``: ``n_sources + d``; an agreement: 1 from its first rank, else 0),
#: the registering member and its record's words.
ENTRY_COLUMNS = ("home", "key_a", "key_b", "code", "member", "size")
#: Columns of a reply row: a registration without its home.
REPLY_COLUMNS = ENTRY_COLUMNS[1:]
_RUNS_AT = 2  # runs_offset in a slot table row
_N_RUNS = 1
_AGREEMENT = -1


def home_of(key_a: np.ndarray, key_b: np.ndarray, n: int) -> np.ndarray:
    """``[K]`` the member (``0 .. n - 1``) that collects the registrations of each key: a
    64-bit mix of both words (splitmix64's finalizer), modulo ``n``; the same on every rank."""
    with np.errstate(over="ignore"):
        x = np.asarray(key_a, dtype=_I64).view(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        x ^= np.asarray(key_b, dtype=_I64).view(np.uint64)
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return (x % np.uint64(max(n, 1))).astype(_I64)


def _section_samples(record: np.ndarray, section: int, n_slots: int) -> np.ndarray:
    """``[K, 2]`` distinct ``(micro-batch, sample id)`` of the runs ``record`` carries for
    ``section`` (its slots' runs lie back to back, micro-batch by micro-batch)."""
    at = int(record[HEADER + section]) + 4  # past the section's head
    table = record[at : at + SLOT_FIELDS * n_slots].reshape(n_slots, SLOT_FIELDS)
    n_runs = table[:, _N_RUNS]
    if not n_slots or int(n_runs.min()) < 0:
        raise AssertionError(f"section {section} of this record carries no runs")
    total = int(n_runs.sum())
    if not total:
        return np.empty((0, 2), dtype=_I64)
    start = int(table[0, _RUNS_AT])
    sample = record[start : start + 5 * total : 5]
    slot = np.arange(n_slots, dtype=_I64).repeat(n_runs)
    o = np.lexsort((sample, slot))
    slot, sample = slot[o], sample[o]
    new = np.ones(total, dtype=bool)
    new[1:] = (slot[1:] != slot[:-1]) | (sample[1:] != sample[:-1])
    return np.stack([slot[new], sample[new]], axis=1)


def registrations(
    record: np.ndarray,
    *,
    topology: Topology,
    rank: int,
    n_slots: int,
    agreements: Sequence[Agreement] = (),
) -> np.ndarray:
    """``[E, 6]`` int64 rows :data:`ENTRY_COLUMNS`: what ``rank`` (global) registers for the
    step whose record is ``record``: per group it leads, each ``(micro-batch, sample id)`` its
    runs hold (sources) or want (destinations), and each agreement it gives (whose first rank
    is a member of the bridge)."""
    me = topology.member_index(rank)
    n = len(topology.members)
    size = int(record[SIZE])
    g_src, g_dst = topology.led_by(np.asarray([me], dtype=_I64))
    n_src = len(topology.sources)
    parts: list[np.ndarray] = []
    for g in g_src.tolist():
        ks = _section_samples(record, int(topology.source_section[g]), n_slots)
        parts.append(_rows(ks[:, 0], ks[:, 1], g, me, size))
    for d in g_dst.tolist():
        ks = _section_samples(record, topology.student_section, n_slots)
        parts.append(_rows(ks[:, 0], ks[:, 1], n_src + d, me, size))
    for a in agreements:
        try:
            topology.member_index(a.ranks[0])
        except ValueError:  # its first rank is no member of the bridge: nothing to compare
            continue
        first = 1 if a.ranks[0] == rank else 0
        parts.append(_rows(np.asarray([_AGREEMENT]), np.asarray([a.key]), first, me, size))
    if not parts:
        return np.empty((0, len(ENTRY_COLUMNS)), dtype=_I64)
    rows = np.concatenate(parts)
    rows[:, 0] = home_of(rows[:, 1], rows[:, 2], n)
    return rows


def _rows(key_a: np.ndarray, key_b: np.ndarray, code: int, member: int, size: int) -> np.ndarray:
    out = np.empty((key_a.size, len(ENTRY_COLUMNS)), dtype=_I64)
    out[:, 1], out[:, 2] = key_a, key_b
    out[:, 3], out[:, 4], out[:, 5] = code, member, size
    return out


def directory_replies(at_home_E6: np.ndarray) -> dict[int, np.ndarray]:
    """What a home sends back: ``member -> [Q, 5]`` rows :data:`REPLY_COLUMNS`, every
    registration of every key that member registered here (its own included), by key.

    ``at_home_E6``: the registrations routed to this member (:data:`ENTRY_COLUMNS`).
    """
    e = np.asarray(at_home_E6, dtype=_I64).reshape(-1, len(ENTRY_COLUMNS))
    if not e.shape[0]:
        return {}
    o = np.lexsort((e[:, 3], e[:, 4], e[:, 2], e[:, 1]))
    e = e[o]
    m = e.shape[0]
    new_key = np.ones(m, dtype=bool)
    new_key[1:] = (e[1:, 1] != e[:-1, 1]) | (e[1:, 2] != e[:-1, 2])
    key = new_key.cumsum() - 1
    starts = new_key.ravel().nonzero()[0]
    ends = np.append(starts[1:], m)
    # one reply per (key, registering member): the key's rows
    new_pair = new_key.copy()
    new_pair[1:] |= e[1:, 4] != e[:-1, 4]
    pair = new_pair.ravel().nonzero()[0]
    to, k = e[pair, 4], key[pair]
    length = ends[k] - starts[k]
    j, t = fan_out(length)
    dest = to[j]
    rows = e[starts[k][j] + t, 1:]
    o = dest.argsort(kind="stable")
    dest, rows = dest[o], rows[o]
    at = [0, *((dest[1:] != dest[:-1]).ravel().nonzero()[0] + 1).tolist(), dest.size]
    first = dest[at[:-1]].tolist()
    return {m: rows[a:b] for m, a, b in zip(first, at[:-1], at[1:], strict=True)}


@dataclass(frozen=True, kw_only=True, eq=False)
class PeerView:
    """What a rank learns from its replies (:func:`read_replies`).

    Attributes:
        peers: ``member -> record words`` of its first-hop peers.
        intro: ``[S, 3]`` ``(code, member, size)`` of every source sharing a sample with the
            destination it leads (empty if it leads none): its introductions.
        intro_to: the members it introduces them to (those sources' leaders, itself
            included when it leads one), ascending.
        intro_from: the members that introduce sources to it (the leaders of the destinations
            sharing a sample with the sources it leads, itself included), ascending.
        source_side: the peers its source groups' other ranks plan with: the leaders of the
            destinations sharing their samples (the introduced sources join them).
        dest_side: the peers its destination group's other ranks plan with: the leaders of
            the sources sharing its samples.
    """

    peers: dict[int, int]
    intro: np.ndarray
    intro_to: tuple[int, ...]
    intro_from: tuple[int, ...]
    source_side: frozenset[int] = frozenset()
    dest_side: frozenset[int] = frozenset()


def read_replies(replies_Q5: np.ndarray, *, member: int, n_sources: int) -> PeerView:
    """A rank's first-hop peers and its introductions, from every reply it received
    (``[Q, 5]`` rows :data:`REPLY_COLUMNS`, its own registrations among them)."""
    r = np.asarray(replies_Q5, dtype=_I64).reshape(-1, len(REPLY_COLUMNS))
    peers: dict[int, int] = {}
    if not r.shape[0]:
        return PeerView(peers=peers, intro=np.empty((0, 3), _I64), intro_to=(), intro_from=())
    o = np.lexsort((r[:, 3], r[:, 2], r[:, 1], r[:, 0]))
    r = r[o]
    q = r.shape[0]
    new_key = np.ones(q, dtype=bool)
    new_key[1:] = (r[1:, 0] != r[:-1, 0]) | (r[1:, 1] != r[:-1, 1])
    key = new_key.cumsum() - 1
    n_keys = int(key[-1]) + 1
    mine = r[:, 3] == member
    agreement = r[:, 0] == _AGREEMENT
    src, dst = ~agreement & (r[:, 2] < n_sources), ~agreement & (r[:, 2] >= n_sources)

    def keys_with(sel: np.ndarray) -> np.ndarray:
        has = np.zeros(n_keys, dtype=bool)
        has[key[sel]] = True
        return has[key]

    # samples: every other registrant; agreements: the first rank and the ranks giving it
    first_mine = keys_with(mine & agreement & (r[:, 2] == 1))
    take = (~agreement | first_mine | (agreement & (r[:, 2] == 1))) & ~mine
    m_T, w_T = r[take, 3][::-1], r[take, 4][::-1]  # a member's last row says its words
    m_U, first = unique_first(m_T)
    peers.update(zip(m_U.tolist(), w_T[first].tolist(), strict=True))
    # introductions: the sources of the keys where this rank registered its destination
    on_my_dest = keys_with(mine & dst)
    s = r[on_my_dest & src][:, 2:5]
    if s.shape[0]:  # distinct rows, in row order
        s = s[np.lexsort((s[:, 2], s[:, 1], s[:, 0]))]
        s = s[np.concatenate([[True], (s[1:] != s[:-1]).any(axis=1)])]
    intro_to = tuple(sorted(set(s[:, 1].tolist())))
    on_my_source = keys_with(mine & src)
    intro_from = tuple(sorted(set(r[on_my_source & dst, 3].tolist())))
    return PeerView(
        peers=peers,
        intro=s,
        intro_to=intro_to,
        intro_from=intro_from,
        source_side=frozenset(intro_from) - {member},
        dest_side=frozenset(intro_to) - {member},
    )


def forward_pairs(topology: Topology, rank: int) -> tuple[list[int], list[int], list[int]]:
    """``(to_source, to_dest, from_)`` member indices, ascending: the other ranks of the source
    groups ``rank`` leads and of the destination group it leads (it forwards them the records
    they plan with), and the leaders of the groups it is in but does not lead (they forward it
    theirs)."""
    ix = topology.index
    to: tuple[set[int], set[int]] = (set(), set())
    from_: set[int] = set()
    groups = [(0, topology.sources[g].ranks) for g in ix.source_groups.get(rank, ())]
    groups += [(1, topology.dests[d].ranks) for d in ix.dest_groups.get(rank, ())]
    for side, ranks in groups:
        if ranks[0] == rank:
            to[side].update(r for r in ranks[1:] if r != rank)
        else:
            from_.add(ranks[0])
    return (
        sorted(topology.member_index(r) for r in to[0]),
        sorted(topology.member_index(r) for r in to[1]),
        sorted(topology.member_index(r) for r in from_),
    )


def forward_bundles(
    held: dict[int, np.ndarray],
    *,
    member: int,
    to_source: Sequence[int],
    to_dest: Sequence[int],
    source_side: frozenset[int],
    dest_side: frozenset[int],
) -> dict[int, np.ndarray]:
    """``target -> message`` (:func:`bundle_records`): what a leader forwards each other rank
    of its groups: its own record and those of the peers the target's groups plan with
    (``source_side`` for a rank of its source groups, ``dest_side`` of its destination group;
    both for a rank of both)."""
    out: dict[int, np.ndarray] = {}
    made: dict[tuple[bool, bool], np.ndarray] = {}
    src, dst = set(to_source), set(to_dest)
    for m in sorted(src | dst):
        role = (m in src, m in dst)
        if role not in made:
            keep = (
                {member} | (source_side if role[0] else set()) | (dest_side if role[1] else set())
            )
            made[role] = bundle_records({p: held[p] for p in keep if p in held})
        out[m] = made[role]
    return out


def bundle_records(records: dict[int, np.ndarray]) -> np.ndarray:
    """``[k, members..., sizes..., words...]``: several members' records in one message
    (what a leader forwards: :func:`exchange_records`)."""
    ms = sorted(records)
    sizes = [records[m].size for m in ms]
    return np.concatenate(
        [np.asarray([len(ms), *ms, *sizes], dtype=_I64), *(records[m] for m in ms)]
    )


def exchange_records(
    record: torch.Tensor | np.ndarray,
    wire: Wire,
    *,
    topology: Topology,
    rank: int,
    n_slots: int,
    agreements: Sequence[Agreement] = (),
    radix: int = RADIX,
) -> tuple[RaggedRecords, np.ndarray]:
    """The records ``rank`` reads of an agreed step: ``(records, [k] members)``, its own among
    them, by ascending member index (:class:`~mopd.bridge.metadata.RaggedRecords`).

    Collective over the wire's members (every member of the bridge calls it, each with its
    own record): the rounds of the module doc. ``n_slots``: the step's agreed micro-batch
    count; ``agreements``: this rank's (registered so that each meets its first rank's).
    """
    rec = record.numpy() if isinstance(record, torch.Tensor) else np.asarray(record, dtype=_I64)
    rec = rec[: int(rec[SIZE])]
    me = wire.member
    n_src = len(topology.sources)
    entries = registrations(
        rec, topology=topology, rank=rank, n_slots=n_slots, agreements=agreements
    )
    # 1-2: registrations to their homes, every key's registrations back to its registrants
    at_home = route_rows(entries, wire, radix=radix)
    homes = sorted(set(entries[:, 0].tolist()))
    got = wire.swap({m: rows.reshape(-1) for m, rows in directory_replies(at_home).items()}, homes)
    replies = (
        np.concatenate([got[h].reshape(-1, len(REPLY_COLUMNS)) for h in homes])
        if homes
        else np.empty((0, 5), _I64)
    )
    view = read_replies(replies, member=me, n_sources=n_src)
    # 3: introductions (second-hop peers)
    got = wire.swap({m: view.intro.reshape(-1) for m in view.intro_to}, view.intro_from)
    peers = dict(view.peers)
    introduced: set[int] = set()
    if view.intro_from:
        intro = np.concatenate([got[m].reshape(-1, 3) for m in view.intro_from])[::-1]
        intro = intro[intro[:, 1] != me]
        p, last = unique_first(intro[:, 1])  # a peer's last introduction
        peers.update(zip(p.tolist(), intro[last, 2].tolist(), strict=True))
        introduced = set(p.tolist())
    # 4: records with every peer (sizes known: one buffer, ascending peers)
    order = sorted(peers)
    sizes_P = [peers[p] for p in order]
    got_W = wire.swap_sized({p: rec for p in order}, order, sizes_P)
    # 5: the leaders' records to the other ranks of their groups
    to_source, to_dest, from_ = forward_pairs(topology, rank)
    bundles = []
    if to_source or to_dest or from_:
        held = {me: rec}
        if to_source or to_dest:
            held.update(split_words(got_W, order, sizes_P))
        sends = forward_bundles(
            held,
            member=me,
            to_source=to_source,
            to_dest=to_dest,
            source_side=view.source_side | introduced,
            dest_side=view.dest_side,
        )
        got = wire.swap(sends, from_)
        bundles += [got[m] for m in from_ if got[m].size]
    return _stack_records(me, rec, order, got_W, sizes_P, bundles)


def _stack_records(
    me: int,
    rec: np.ndarray,
    peers: Sequence[int],
    peers_W: np.ndarray,
    sizes_P: Sequence[int],
    bundles: Sequence[np.ndarray],
) -> tuple[RaggedRecords, np.ndarray]:
    """``(records, [k] members)``, ascending: member ``me``'s record ``rec``, the records of
    ``peers`` (``peers_W``: theirs one after another, ``sizes_P`` words each) and those of
    the :func:`bundle_records` messages ``bundles``, one per member (the first copy of a
    record given twice: ``me``'s, the peers', then by message order). The pieces are put
    side by side once; the records stay where they are in them."""
    parts = [rec, peers_W, *bundles]
    base = np.cumsum([0, *(x.size for x in parts[:-1])], dtype=_I64)
    members = [np.asarray([me], dtype=_I64), np.asarray(peers, dtype=_I64)]
    sizes = [np.asarray([rec.size], dtype=_I64), np.asarray(sizes_P, dtype=_I64)]
    starts = [base[:1], base[1] + sizes[1].cumsum() - sizes[1]]
    for msg, at in zip(bundles, base[2:].tolist(), strict=True):
        k = int(msg[0])
        n_K = msg[1 + k : 1 + 2 * k]
        members.append(msg[1 : 1 + k])
        sizes.append(n_K)
        starts.append(at + 1 + 2 * k + n_K.cumsum() - n_K)
    member_K, size_K, start_K = (np.concatenate(x) for x in (members, sizes, starts))
    uniq, first = unique_first(member_K)  # ascending, first copies
    words = np.concatenate(parts).astype(_I64, copy=False)
    return RaggedRecords(words, start_K[first], start_K[first] + size_K[first]), uniq
