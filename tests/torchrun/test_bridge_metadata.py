"""Tier 2 (8 ranks, gloo): the step metadata in two levels, and the schedule cache keyed on it.

- The two-level all-gather (a gather to each node's leader, a log-depth all-gather among the
  leaders, a broadcast inside the node) returns the flat all-gather's bytes exactly, for records
  of different widths on every rank, with nodes of 2 and 4 ranks and of 3 (a short last node).
- A bridge whose metadata goes in two levels moves every row bit-exact, and a ``ValueError`` on
  one rank's input is the same ``ValueError`` on every rank, before data moves.
- A step whose micro-batches have the same plan inputs on a rank as an earlier step runs no
  planner there (``plan_rank`` and ``check_rank`` are counted); a changed layout of one DP
  shard makes exactly the ranks that plan with it (its own and its peers) plan again.
- A step whose every record is the previous step's but for its header gathers no records (the
  summary's all-reduce says so alike on every rank: the memo's matrix serves), flat or in two
  levels; one changed DP shard, or one rank without the memo, makes every rank gather them again;
  every row of every step is bit-exact.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist

from mopd.bridge import checks as bridge_checks
from mopd.bridge import metadata as bridge_metadata
from mopd.bridge import step as bridge_step
from mopd.bridge.api import HiddenStateBridge
from mopd.bridge.config import BridgeConfig, TeacherSpec
from mopd.bridge.groups import GroupPool, create_bridge_groups
from mopd.bridge.layout import TokenLayout, padded_layout
from mopd.bridge.mesh import Mesh
from mopd.bridge.metadata import HEADER, SIZE, gather_step_matrix, reduced_summary
from mopd.common.dist import all_gather_flat, all_gather_nodes
from mopd.profiling.synthetic import key_pattern
from tests.support.bridges import poison_outputs

TORCHRUN_NPROC = 8
TORCHRUN_TIMEOUT = 300

_TIMEOUT_S = 60.0
_H = 4


def _pool() -> GroupPool:
    return GroupPool(timeout_s=_TIMEOUT_S)


@pytest.mark.parametrize("node_size", [2, 3, 4])
def test_two_level_all_gather_is_the_flat_one_bit_for_bit(node_size: int) -> None:
    pool = _pool()
    meshes = [Mesh(tp=2, dp=4)], Mesh(tp=4, dp=2)
    groups = create_bridge_groups(
        pool, *meshes, metadata_nodes_from=1, metadata_node_size=node_size
    )
    assert groups.meta_nodes is not None and groups.meta_nodes.node_size == node_size
    me, n = dist.get_rank(), dist.get_world_size()
    rng = np.random.default_rng(1000 + me)
    # records of different widths, random 64-bit words (negative ones too)
    record = torch.from_numpy(rng.integers(-(2**62), 2**62, size=3 + 5 * me, dtype=np.int64))
    common = {"n_members": n, "device": torch.device("cpu"), "timeout_s": _TIMEOUT_S}
    flat, flat_summary = gather_step_matrix(record, group=groups.meta, **common)
    two, two_summary = gather_step_matrix(
        record, group=groups.meta, nodes=groups.meta_nodes, **common
    )
    sizes = [3 + 5 * j for j in range(n)]
    assert flat.dtype == two.dtype and np.array_equal(flat, two)
    assert flat.shape == (n, max(sizes))
    # the all-reduced summary: every header word's largest and smallest, the widest record
    assert np.array_equal(flat_summary, two_summary) and flat_summary[SIZE] == max(sizes)
    header_NH = flat[:, :HEADER].copy()
    header_NH[:, SIZE] = sizes  # what each rank's header says of its record's length
    assert np.array_equal(flat_summary, reduced_summary(header_NH))
    # the primitive itself, on a width the nodes do not divide evenly
    part = torch.full((7,), me, dtype=torch.int64) * 1000 + torch.arange(7)
    out_flat = torch.full((7 * n,), -1, dtype=torch.int64)
    out_two = torch.full((7 * n,), -2, dtype=torch.int64)
    all_gather_flat(out_flat, part, group=groups.meta, timeout_s=_TIMEOUT_S)
    all_gather_nodes(out_two, part, nodes=groups.meta_nodes, timeout_s=_TIMEOUT_S)
    assert torch.equal(out_flat, out_two)


# --- a bridge on the two-level exchange ---------------------------------------------------------

TEACHER, STUDENT = Mesh(tp=2, dp=4), Mesh(tp=2, dp=4)  # colocated, every rank both


def _bridge(nodes: int | None) -> HiddenStateBridge:
    kw = {} if nodes is None else {"metadata_nodes_from": 1, "metadata_node_size": nodes}
    groups = create_bridge_groups(_pool(), [TEACHER], STUDENT, **kw)
    return poison_outputs(
        HiddenStateBridge(
            teachers=[TeacherSpec(mesh=TEACHER, hidden_size=_H, dtype=torch.float32)],
            student=STUDENT,
            groups=groups,
            config=BridgeConfig(timeout_s=_TIMEOUT_S),
        )
    )


def _layouts(dp: int, i: int, short: int = 0) -> tuple[TokenLayout, TokenLayout]:
    """Micro-batch ``i`` of DP shard ``dp``: two samples of ``8`` positions, teacher ``[S, B]``,
    student ``[B, S]``; ``short``: the teacher's and student's second sample that much shorter."""
    ids = [100 * i + 2 * dp, 100 * i + 2 * dp + 1]
    lengths = [8, 8 - short]
    return (
        padded_layout(ids, 8, lengths=lengths),
        padded_layout(ids, 8, order="bsh", lengths=lengths),
    )


def _run_step(bridge: HiddenStateBridge, short_dp: int | None = None) -> None:
    """Plan, send, receive and check one step of two micro-batches, bit for bit."""
    c = TEACHER.coord(dist.get_rank())
    assert c is not None
    lays = [_layouts(c.dp_rank, i, 3 if c.dp_rank == short_dp else 0) for i in range(2)]
    step = bridge.plan_step(
        teacher_layouts={0: [t for t, _ in lays]}, student_layouts=[s for _, s in lays]
    )
    with step:
        for i, (t, _) in enumerate(lays):
            step.send(i, {0: key_pattern(t, _H, torch.float32)})
        for i, (_, s) in enumerate(lays):
            rows = step.receive(i)[0]  # compact: one row per real token, in layout order
            want = key_pattern(s, _H, torch.float32)[s.sample_id_R >= 0]
            assert torch.equal(rows.view(torch.int32), want.view(torch.int32))
        assert step.global_tokens() == sum(
            sum(_layouts(d, i, 3 if d == short_dp else 0)[1].num_tokens for d in range(4))
            for i in range(2)
        )


@pytest.mark.parametrize("node_size", [2, 4])
def test_a_bridge_on_two_levels_moves_rows_and_agrees_on_errors(node_size: int) -> None:
    bridge = _bridge(node_size)
    assert bridge.groups.meta_nodes is not None
    _run_step(bridge)
    # rank 5 gives one layout too few: the same ValueError everywhere, before data moves
    c = TEACHER.coord(dist.get_rank())
    assert c is not None
    lays = [_layouts(c.dp_rank, i) for i in range(2)]
    student = [s for _, s in lays][: 1 if dist.get_rank() == 5 else 2]
    with pytest.raises(ValueError, match="global rank 5: this rank gives different") as err:
        bridge.plan_step(teacher_layouts={0: [t for t, _ in lays]}, student_layouts=student)
    texts = [None] * dist.get_world_size()
    dist.all_gather_object(texts, str(err.value))
    assert len(set(texts)) == 1, texts
    _run_step(bridge)  # the agreed error left the bridge usable


def test_a_repeated_step_runs_no_planner_and_a_changed_peer_plans_again() -> None:
    bridge = _bridge(None)
    calls = {"plan": 0, "check": 0}
    real_plan, real_check = bridge_step.plan_rank, bridge_checks.check_rank

    def plan(*a, **k):  # type: ignore[no-untyped-def]
        calls["plan"] += 1
        return real_plan(*a, **k)

    def check(*a, **k):  # type: ignore[no-untyped-def]
        calls["check"] += 1
        return real_check(*a, **k)

    with (
        mock.patch.object(bridge_step, "plan_rank", plan),
        mock.patch.object(bridge_checks, "check_rank", check),
    ):
        _run_step(bridge)
        first = dict(calls)
        assert first == {"plan": 2, "check": 2}, first  # two micro-batches, planned and checked
        built = bridge.executor.schedules_built
        _run_step(bridge)  # the same step again: cache hits everywhere
        assert calls == first, calls
        assert bridge.executor.schedules_built == built
        # DP shard 3 (ranks 6, 7) changes its layouts: only the ranks planning with it plan
        _run_step(bridge, short_dp=3)
        planned = calls["plan"] - first["plan"]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, planned)
        assert everyone == [0, 0, 0, 0, 0, 0, 2, 2], everyone
        # back to the first layouts: their keys are still cached
        _run_step(bridge)
        assert calls["plan"] - first["plan"] == planned


@pytest.mark.parametrize("nodes", [None, 4], ids=["flat", "two levels"])
def test_a_repeated_step_gathers_no_records(nodes: int | None) -> None:
    bridge = _bridge(nodes)
    gathers = [0]
    real = bridge_metadata.gather_records

    def counted(*a, **k):  # type: ignore[no-untyped-def]
        gathers[0] += 1
        return real(*a, **k)

    def run(**kw: int) -> int:
        before = gathers[0]
        _run_step(bridge, **kw)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, gathers[0] - before)
        assert len(set(everyone)) == 1, everyone  # every rank decided alike
        return everyone[0]

    with mock.patch("mopd.bridge.api.gather_records", counted):
        assert run() == 1  # the first step: no memo
        assert run() == 0  # the same records: the memo's matrix serves
        assert run() == 0
        assert run(short_dp=3) == 1  # DP shard 3's layouts changed: gathered again
        assert run(short_dp=3) == 0
        assert run() == 1  # back: it differs from the memo (the step before), so gathered
        assert run() == 0
        if dist.get_rank() == 5:
            bridge.forget_plan_memo()  # one rank lost its memo
        assert run() == 1
        assert run() == 0
