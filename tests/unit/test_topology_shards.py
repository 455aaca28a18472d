"""Tier 1: a teacher's sources as its TP ranks' sequence-parallel shards (``Topology``).

With ``shard_sources`` each last-stage teacher TP rank is a source group of its own (it holds
its SP slice, rows no other rank holds) and leads it (its record carries runs); without, the
TP group is one group of replicas led by TP rank 0. The planner needs nothing else: a rank
whose record claims the whole buffer under ``shard_sources`` holds keys its TP peers hold too,
and ``check_rank`` names them, as it does for any key held twice.
"""

from __future__ import annotations

import pytest

from mopd.bridge import Mesh, TokenLayout, padded_layout
from mopd.bridge.catalog import RunCatalog
from mopd.bridge.coverage import check_rank
from mopd.bridge.plan import plan_rank
from mopd.bridge.record import rank_roles
from mopd.bridge.topology import Topology
from tests.support.plan_sim import simulate

T = Mesh(tp=2, dp=2, pp=2, name="teacher")  # last stage: global ranks 4-7
S = Mesh(tp=2, dp=2, rank_offset=4, name="student")  # ranks 4-7: colocated with it


def test_sources_are_single_ranks_and_each_leads_its_own() -> None:
    shards = Topology.build([T], S, shard_sources=[True])
    replicas = Topology.build([T], S)
    assert [g.ranks for g in shards.sources] == [(4,), (5,), (6,), (7,)]
    assert [g.label for g in shards.sources][:2] == [
        "teacher 0 (dp=0, cp=0, tp=0)",
        "teacher 0 (dp=0, cp=0, tp=1)",
    ]
    assert [g.ranks for g in replicas.sources] == [(4, 5), (6, 7)]
    assert shards.shard_sources == (True,) and replicas.shard_sources == (False,)
    # who sends teacher 0's runs (the rest send digests): every shard, or each TP group's first
    assert [rank_roles(r, [T], S, shard_sources=[True])[0] for r in range(4, 8)] == [True] * 4
    assert [rank_roles(r, [T], S)[0] for r in range(4, 8)] == [True, False, True, False]
    assert rank_roles(0, [T], S, shard_sources=[True])[0] is None  # first stage: no rows
    assert shards.source_leader.tolist() == [shards.members.index(r) for r in range(4, 8)]
    # per teacher: the second teacher keeps replicas
    two = Topology.build([T, Mesh(tp=2, name="t1")], S, shard_sources=[True, False])
    assert [g.ranks for g in two.sources] == [(4,), (5,), (6,), (7,), (0, 1)]
    with pytest.raises(ValueError, match="shard_sources has 1 entries for 2 teachers"):
        Topology.build([T, Mesh(tp=2, name="t1")], S, shard_sources=[True])


def _catalog(teacher_rows: dict[int, TokenLayout]) -> tuple[Topology, RunCatalog]:
    """One padded micro-batch (samples 0-3, S=8): teacher DP rank d holds samples 2d, 2d+1; each
    last-stage teacher rank's layout from ``teacher_rows[rank]``; the student wants the same
    split. Records by the bridge's own rule (teacher 0 as SP-shard sources)."""
    student = {(d, 0): padded_layout([2 * d, 2 * d + 1], 8, order="bsh") for d in range(S.dp)}
    sim = simulate([T], S, [teacher_rows], student, shard_sources=[True])
    return sim.topology, sim.catalog


def test_disjoint_shards_pass_the_checks_and_a_full_buffer_is_a_key_held_twice() -> None:
    def rows(r: int, *, sp: bool) -> TokenLayout:
        c = T.coord(r)
        assert c is not None
        ids = [2 * c.dp_rank, 2 * c.dp_rank + 1]
        return padded_layout(
            ids, 8, order="sbh", sp_size=2 if sp else 1, sp_rank=c.tp_rank if sp else 0
        )

    topo, catalog = _catalog({r: rows(r, sp=True) for r in range(4, 8)})
    assert [v for r in topo.members for v in check_rank(catalog, r)] == []
    sent = sum(x.count for r in topo.members for x in plan_rank(catalog, r).sends)
    local = sum(x.count for r in topo.members for x in plan_rank(catalog, r).locals)
    assert sent + local == 4 * 8  # every student token once (each group gets its 2 samples)
    # the replica answer (SP undone) under shard sources: both TP ranks claim every key
    topo, catalog = _catalog({r: rows(r, sp=False) for r in range(4, 8)})
    verdicts = [v for r in topo.members for v in check_rank(catalog, r)]
    assert verdicts and all("is held twice" in v for v in verdicts), verdicts
    assert any("tp=0)" in v and "tp=1)" in v for v in verdicts), verdicts
