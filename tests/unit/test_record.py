"""What a rank contributes and reads back (``mopd.bridge.record``), without process groups.

- ``rank_roles``: the first rank of a TP group sends the runs, its replicas their digests, every
  student rank with ``keep_sp_shard``; ranks off a mesh's last stage hold nothing of it.
- The token counts in the record: ``StepView.tokens_I`` equals the count decoded from every
  student group's runs and the layouts' own count.
- Plan keys: the same inputs give the same keys; a changed layout of one DP shard changes the
  keys of exactly the ranks whose groups meet its samples, in the micro-batch it changed.
- The second hop: a compact sender's key covers its owner's other sources of the destinations
  it serves (they place its rows), even where their samples miss its own group's.
- Cache soundness (hypothesis): a rank whose key is unchanged by a changed layout has the same
  compact plan (``plan_digest``) and the same ``check_rank`` verdicts.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mopd.bridge.coverage import check_rank
from mopd.bridge.layout import TokenLayout, padded_layout
from mopd.bridge.mesh import Mesh
from mopd.bridge.metadata import StepMatrix, encode_step_record
from mopd.bridge.plan import plan_rank
from mopd.bridge.record import StepView, rank_roles, rank_sections, read_step, stack_records
from mopd.bridge.schedule import plan_digest
from mopd.bridge.topology import Topology
from tests.support.plan_sim import SimStep, contiguous_step, expand_segments, simulate

TEACHER, STUDENT = Mesh(tp=2, dp=4), Mesh(tp=2, dp=4)  # colocated, every rank both
M = 3  # micro-batches


def _layouts(dp: int, i: int, short: int) -> tuple[TokenLayout, TokenLayout]:
    ids = [100 * i + 2 * dp, 100 * i + 2 * dp + 1]
    lengths = [8, 8 - short]
    return (
        padded_layout(ids, 8, lengths=lengths),
        padded_layout(ids, 8, order="bsh", lengths=lengths),
    )


def _step(changed: tuple[int, int] | None = None) -> tuple[StepView, dict[int, list]]:
    """Every rank's record, stacked and read; ``changed``: ``(dp, micro-batch)`` whose layouts
    are one token shorter."""
    topo = Topology.build([TEACHER], STUDENT)
    records, lays = [], {}
    for r in topo.members:
        c = TEACHER.coord(r)
        assert c is not None
        lays[r] = [_layouts(c.dp_rank, i, 1 if changed == (c.dp_rank, i) else 0) for i in range(M)]
        sections = rank_sections(
            rank_roles(r, [TEACHER], STUDENT),
            teacher_layouts={0: [t for t, _ in lays[r]]},
            student_layouts=[s for _, s in lays[r]],
            dtypes=[torch.float32],
            hiddens=[4],
        )
        records.append(encode_step_record(config_sig=1, n_slots=M, error="", sections=sections))
    matrix, _ = stack_records(records)
    return read_step(topo, StepMatrix(matrix), M), lays


def test_roles_follow_the_tp_leaders_and_the_last_stages() -> None:
    t, s = Mesh(tp=2, pp=2), Mesh(tp=4, rank_offset=4)
    assert rank_roles(0, [t], s) == (None, None)  # teacher's first stage, not a student
    assert rank_roles(2, [t], s) == (True, None)  # teacher's last stage, TP rank 0
    assert rank_roles(3, [t], s) == (False, None)
    assert rank_roles(4, [t], s) == (None, True)
    assert rank_roles(5, [t], s) == (None, False)
    assert rank_roles(5, [t], s, keep_sp_shard=True) == (None, True)


def test_token_counts_in_the_record_equal_the_decoded_runs() -> None:
    view, lays = _step(changed=(2, 1))
    decoded = [
        sum(int(c.dest_runs(d)[:, 4].sum()) for d in range(len(c.dests))) for c in view.catalogs
    ]
    wanted = [sum(lays[2 * dp][i][1].num_tokens for dp in range(4)) for i in range(M)]
    assert view.tokens_I().tolist() == decoded == wanted
    assert wanted[1] == wanted[0] - 1


def test_plan_keys_change_exactly_where_a_peer_changed() -> None:
    base, _ = _step()
    again, _ = _step()
    changed, _ = _step(changed=(3, 1))
    for r in range(8):
        assert base.plan_keys(r) == again.plan_keys(r)
        a, b = base.plan_keys(r), changed.plan_keys(r)
        differ = [i for i in range(M) if a[i] != b[i]]
        assert differ == ([1] if r in (6, 7) else []), (r, differ)
    # the caller's extra (row widths) is part of the key
    assert base.plan_keys(0, b"\x01") != base.plan_keys(0)
    # a rank's key covers its own groups and its peers' (rows, ranges, digests)
    # the two ranks of a TP group share their groups (one key); DP shards and micro-batches not
    assert len({k for r in range(8) for k in base.plan_keys(r)}) == 4 * M


# --- compact delivery: the second hop of the plan keys ---------------------------------------


def _two_hop_step(*, moved: bool) -> SimStep:
    """Teacher A (ranks 0, 1: DP 2) and teacher B (rank 2) send to one student (rank 3) that
    wants samples 0-4 in ``[S, B, H]`` order (the samples' tokens interleave). Rank 0 (A's
    DP 0) holds samples 0, 1; A's DP 1 holds 2, 3 and B holds 4, or (``moved``) A's DP 1
    holds 2 only and B holds 3, 4: a change of groups whose sample ranges miss rank 0's own."""
    a, b = Mesh(dp=2, name="a"), Mesh(rank_offset=2, name="b")
    student = Mesh(rank_offset=3, name="student")
    far_a, far_b = ([2], [3, 4]) if moved else ([2, 3], [4])
    teacher_layouts = [
        {(0, 0): padded_layout([0, 1], 4, order="bsh"), (1, 0): padded_layout(far_a, 4)},
        {(0, 0): padded_layout(far_b, 4)},
    ]
    student_layouts = {(0, 0): padded_layout([0, 1, 2, 3, 4], 4, order="sbh")}
    return simulate([a, b], student, teacher_layouts, student_layouts)


def test_a_far_source_of_a_served_destination_changes_the_key_and_the_compact_plan() -> None:
    base, moved = _two_hop_step(moved=False), _two_hop_step(moved=True)
    for sim in (base, moved):
        assert all(check_rank(sim.catalog, r) == [] for r in sim.topology.members)
        cat = sim.catalog
        own = cat.source_range_G2[0].tolist()  # rank 0's only group: teacher A's DP 0
        assert own == [0, 1] and cat.index().source_groups[0] == (0,)
        # A's DP 1 and B miss rank 0's group; the destination rank 0 serves meets them all
        for g in (1, 2):
            lo, hi = cat.source_range_G2[g].tolist()
            assert lo <= hi and (hi < own[0] or lo > own[1]), (g, lo, hi)
        assert cat.dest_range_D2[0].tolist() == [0, 4]
    assert base.view.plan_keys(0) != moved.view.plan_keys(0)
    plan = {k: plan_rank(s.catalog, 0, compact=True) for k, s in (("base", base), ("moved", moved))}
    assert plan_digest(plan["base"]) != plan_digest(plan["moved"])
    # rank 0's sample-0/1 tokens land among teacher A's compact rows: with sample 3 gone to B,
    # position 1 of sample 0 is A's 4th row, not its 5th
    (send_base,), (send_moved,) = plan["base"].sends, plan["moved"].sends
    _, dst_base = expand_segments(send_base.segments_S5)
    _, dst_moved = expand_segments(send_moved.segments_S5)
    assert dst_base.tolist() == [0, 1, 4, 5, 8, 9, 12, 13]
    assert dst_moved.tolist() == [0, 1, 3, 4, 6, 7, 9, 10]


# --- cache soundness: equal keys, equal plans and verdicts -----------------------------------


@st.composite
def _mesh(draw: st.DrawFn, offset: int) -> Mesh:
    return Mesh(
        tp=draw(st.integers(1, 2)),
        cp=draw(st.integers(1, 2)),
        dp=draw(st.integers(1, 3)),
        pp=draw(st.integers(1, 2)),
        rank_offset=offset,
    )


def _perturbed(layout: TokenLayout, how: str, rng: np.random.Generator) -> TokenLayout:
    """``layout`` with its rows shuffled, a padding row put in, or one token made padding."""
    sample, position = layout.sample_id_R.numpy().copy(), layout.position_R.numpy().copy()
    if how == "shuffle":
        order = rng.permutation(sample.size)
        sample, position = sample[order], position[order]
    elif how == "pad":
        at = int(rng.integers(0, sample.size + 1))
        sample, position = np.insert(sample, at, -1), np.insert(position, at, -1)
    else:  # "drop": a token no longer held (a source) or no longer wanted (a destination)
        real = np.flatnonzero(sample >= 0)
        if real.size:
            at = int(rng.choice(real))
            sample[at], position[at] = -1, -1
    return TokenLayout(
        sample_id_R=torch.from_numpy(sample).contiguous(),
        position_R=torch.from_numpy(position).contiguous(),
    )


def _handed(src: TokenLayout, dst: TokenLayout, rng: np.random.Generator) -> dict[str, TokenLayout]:
    """``{"from": src, "to": dst}`` after one sample's rows of ``src`` became padding there and
    were appended to ``dst`` (the tokens change holder; unchanged if ``src`` holds none)."""
    sample, position = src.sample_id_R.numpy().copy(), src.position_R.numpy().copy()
    real = np.unique(sample[sample >= 0])
    if real.size == 0 or src is dst:
        return {"from": src, "to": dst}
    mine = sample == rng.choice(real)
    to_s = np.concatenate([dst.sample_id_R.numpy(), sample[mine]])
    to_p = np.concatenate([dst.position_R.numpy(), position[mine]])
    sample[mine], position[mine] = -1, -1
    return {
        "from": TokenLayout(
            sample_id_R=torch.from_numpy(sample), position_R=torch.from_numpy(position)
        ),
        "to": TokenLayout(sample_id_R=torch.from_numpy(to_s), position_R=torch.from_numpy(to_p)),
    }


def _sp_shards(mesh: Mesh, shards: dict[tuple[int, int], TokenLayout]) -> dict:
    """Per last-stage rank, its TP rank's contiguous part of its shard's rows (its SP shard)."""
    out = {}
    for r in mesh.last_stage_ranks():
        c = mesh.coord(r)
        assert c is not None
        lay = shards[(c.dp_rank, c.cp_rank)]
        rows = torch.from_numpy(np.array_split(np.arange(lay.num_rows), mesh.tp)[c.tp_rank])
        out[r] = TokenLayout(
            sample_id_R=lay.sample_id_R[rows].contiguous(),
            position_R=lay.position_R[rows].contiguous(),
        )
    return out


@given(data=st.data())
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_equal_plan_keys_mean_equal_compact_plans_and_verdicts(data: st.DataObject) -> None:
    """A schedule cached on a rank's key is the plan (and the verdicts) the planner would give:
    over contiguous steps (teachers as TP replicas or SP shards) and one group's layout changed
    (rows shuffled, padding added, a token dropped), every rank whose key stayed the same has
    the same compact ``plan_digest`` (where both steps are valid) and the same ``check_rank``;
    the changed group's own ranks see a new key."""
    colocated = data.draw(st.sampled_from([False, False, True]))  # apart: fewer groups per rank
    teachers: list[Mesh] = []
    at = 0
    for _ in range(data.draw(st.sampled_from([1, 2, 2]))):
        teachers.append(data.draw(_mesh(data.draw(st.integers(0, 2)) if colocated else at)))
        at += teachers[-1].size
    student = data.draw(_mesh(data.draw(st.integers(0, 2)) if colocated else at))
    kinds = [data.draw(st.sampled_from(["sbh", "bsh", "thd"])) for _ in range(len(teachers) + 1)]
    tl, sl = contiguous_step(
        teachers,
        student,
        num_samples=data.draw(st.integers(1, 12)),
        max_len=data.draw(st.integers(1, 6)),
        kinds=kinds,
        seed=data.draw(st.integers(0, 2**31 - 1)),
    )
    shards = [data.draw(st.booleans()) for _ in teachers]
    t_lays: list[dict] = [
        _sp_shards(m, lay) if sh else lay for m, lay, sh in zip(teachers, tl, shards, strict=True)
    ]
    base = simulate(teachers, student, t_lays, sl, shard_sources=shards)
    # one group's layout changed (a teacher's shard or SP shard, or a student shard), or one
    # sample's tokens handed from a teacher's group to another (two groups, the step valid)
    sides = [*t_lays, sl]
    # (handing over weighs most: it moves tokens among a destination's sources, the second hop)
    how = data.draw(st.sampled_from(["shuffle", "pad", "drop", "hand", "hand", "hand"]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    side = data.draw(st.integers(0, len(teachers) - (how == "hand")))
    key = data.draw(st.sampled_from(sorted(sides[side], key=str)))
    changes = {}
    if how == "hand":
        to_side = data.draw(st.integers(0, len(teachers) - 1))
        to_key = data.draw(st.sampled_from(sorted(sides[to_side], key=str)))
        changes.update(_handed(sides[side][key], sides[to_side][to_key], rng))
        changes = {(side, key): changes["from"], (to_side, to_key): changes["to"]}
    else:
        changes[(side, key)] = _perturbed(sides[side][key], how, rng)
    new_sides = [dict(x) for x in sides]
    for (o, k), lay in changes.items():
        new_sides[o][k] = lay
    pert = simulate(teachers, student, new_sides[:-1], new_sides[-1], shard_sources=shards)
    members = base.topology.members
    valid = [all(check_rank(s.catalog, r) == [] for r in members) for s in (base, pert)]
    same = 0
    for r in members:
        if base.view.plan_keys(r) != pert.view.plan_keys(r):
            continue
        ix = base.topology.index
        same += bool(ix.source_groups.get(r) or ix.dest_groups.get(r))
        assert check_rank(base.catalog, r) == check_rank(pert.catalog, r), r
        if all(valid):
            a = plan_digest(plan_rank(base.catalog, r, compact=True))
            assert a == plan_digest(plan_rank(pert.catalog, r, compact=True)), r
    # the converse where it is certain: a changed group's ranks see the change
    for (o, k), lay in changes.items():
        old = sides[o][k]
        if torch.equal(old.sample_id_R, lay.sample_id_R) and torch.equal(
            old.position_R, lay.position_R
        ):
            continue
        if isinstance(k, int):
            ranks: tuple[int, ...] = (k,)
        else:
            mesh = student if o == len(teachers) else teachers[o]
            ranks = tuple(mesh.tp_group_ranks(dp_rank=k[0], cp_rank=k[1]))
        for r in ranks:
            assert base.view.plan_keys(r) != pert.view.plan_keys(r), (r, o, k)
    event(f"ranks with groups and equal keys: {'none' if same == 0 else 'some'}")
    event(f"{how}, {'valid' if all(valid) else 'invalid'}")
