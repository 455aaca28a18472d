"""Tier 1: the expert groups of :func:`mopd.mcore.megatron_groups.mesh_group_ranks` are
megatron's own (its ``RankGenerator`` for expert layers, offset to the mesh's first rank), and a
dense mesh (``ep=1``) gets the same rank sets as before."""

from __future__ import annotations

import pytest

from mopd.bridge.mesh import Mesh
from mopd.mcore.megatron_groups import mesh_group_ranks

CASES = [  # (tp, cp, dp, pp, ep, expert_tp, offset)
    (1, 1, 4, 1, 2, None, 0),
    (2, 1, 2, 2, 2, None, 0),
    (2, 1, 4, 1, 2, 1, 8),
    (2, 2, 2, 2, 4, 1, 3),
    (1, 2, 2, 1, 2, 1, 0),
]


@pytest.mark.parametrize("case", CASES)
def test_expert_groups_are_megatrons(case: tuple) -> None:
    ps = pytest.importorskip("megatron.core.parallel_state")
    tp, cp, dp, pp, ep, etp, offset = case
    mesh = Mesh(tp=tp, cp=cp, dp=dp, pp=pp, rank_offset=offset)
    got = mesh_group_ranks(mesh, ep=ep, expert_tp=etp)
    etp = tp if etp is None else etp
    gen = ps.RankGenerator(
        tp=etp, ep=ep, dp=tp * cp * dp // (etp * ep), pp=pp, cp=1, order="tp-cp-ep-dp-pp"
    )
    for ours, theirs in (
        ("ep", "ep"),
        ("expt_tp", "tp"),
        ("tp_ep", "tp-ep"),
        ("tp_ep_pp", "tp-ep-pp"),
        ("expt_dp", "dp"),
    ):
        want = [[offset + r for r in ranks] for ranks in gen.get_ranks(theirs)]
        assert sorted(got[ours]) == sorted(want), ours
        assert all(g == sorted(g) for g in got[ours])  # group rank order = megatron's


def test_dense_mesh_expert_groups_are_the_plain_ones() -> None:
    mesh = Mesh(tp=2, cp=2, dp=2, pp=2)
    g = mesh_group_ranks(mesh)
    as_set = lambda kind: {tuple(sorted(r)) for r in g[kind]}  # noqa: E731
    assert as_set("ep") == {(r,) for r in mesh.ranks}
    assert as_set("expt_tp") == as_set("tp") == as_set("tp_ep")
    assert as_set("expt_dp") == as_set("dp_cp")
    assert as_set("tp_ep_pp") == as_set("mp")


def test_experts_that_do_not_fit_are_named() -> None:
    with pytest.raises(ValueError, match=r"expert_tp \* ep = 2 \* 3 must divide.*= 8"):
        mesh_group_ranks(Mesh(tp=2, dp=4, name="s"), ep=3)
    with pytest.raises(ValueError, match="ep must be a positive int"):
        mesh_group_ranks(Mesh(dp=2), ep=0)
