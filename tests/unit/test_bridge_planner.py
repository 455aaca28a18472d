"""Tier 1: meshes, token layouts and the transfer planner (property-based, one process)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mopd.bridge import (
    DestGroup,
    Mesh,
    SourceGroup,
    StudentBatch,
    TeacherBatch,
    TokenLayout,
    concat_layouts,
    cp_positions,
    layout_from_runs,
    layout_to_runs,
    packed_layout,
    padded_layout,
    plan_lm_head,
    plan_token_exchange,
    plan_transfers,
    planner_runs,
    vocab_layout,
)
from mopd.bridge import planner as planner_mod
from mopd.bridge.lm_head import VocabSpec
from mopd.bridge.schedule import RankSchedule
from mopd.bridge.synthetic import SideFormat, synthetic_step

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --- meshes --------------------------------------------------------------------------------


@given(
    tp=st.integers(1, 4),
    cp=st.integers(1, 3),
    dp=st.integers(1, 3),
    pp=st.integers(1, 3),
    off=st.integers(0, 5),
)
@SETTINGS
def test_mesh_coords_round_trip_in_megatron_order(tp, cp, dp, pp, off):
    m = Mesh(tp=tp, cp=cp, dp=dp, pp=pp, rank_offset=off)
    seen = []
    for p in range(pp):
        for d in range(dp):
            for c in range(cp):
                for t in range(tp):
                    r = m.global_rank(tp_rank=t, cp_rank=c, dp_rank=d, pp_rank=p)
                    seen.append(r)
                    co = m.coord(r)
                    assert (co.tp_rank, co.cp_rank, co.dp_rank, co.pp_rank) == (t, c, d, p)
    assert seen == list(m.ranks)  # tp fastest, then cp, dp, pp
    assert m.coord(off - 1) is None and m.coord(off + m.size) is None
    assert set(m.last_stage_ranks()) == {r for r in m.ranks if m.is_last_stage(r)}


def test_mesh_rejects_bad_sizes():
    with pytest.raises(ValueError, match="tp must be a positive int"):
        Mesh(tp=0)
    with pytest.raises(ValueError, match="cp_rank=2 outside"):
        Mesh(cp=2).global_rank(cp_rank=2)


# --- layouts -------------------------------------------------------------------------------


@given(cp=st.integers(1, 4), k=st.integers(1, 5))
@SETTINGS
def test_cp_zigzag_partitions_the_sequence(cp, k):
    seq = 2 * cp * k
    parts = [cp_positions(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(seq))
    chunk = seq // (2 * cp)
    for r, p in enumerate(parts):
        assert p[:chunk].tolist() == list(range(r * chunk, (r + 1) * chunk))
        j = 2 * cp - 1 - r
        assert p[chunk:].tolist() == list(range(j * chunk, (j + 1) * chunk))


def test_cp_rejects_length_not_divisible_by_2cp():
    with pytest.raises(ValueError, match="not divisible by 2\\*cp = 4"):
        padded_layout([0], 6, cp_size=2, cp_rank=0)
    with pytest.raises(ValueError, match="not divisible by 2\\*cp = 4"):
        packed_layout([0, 1], [4, 6], cu_seqlens_padded=[0, 4, 10], cp_size=2, cp_rank=1)


def test_padded_row_order_sbh_and_bsh():
    sbh = padded_layout([7, 9], 3, order="sbh", lengths=[3, 2])
    # row s * B + b
    assert sbh.sample_id_R.tolist() == [7, 9, 7, 9, 7, -1]
    assert sbh.position_R.tolist() == [0, 0, 1, 1, 2, -1]
    bsh = padded_layout([7, 9], 3, order="bsh", lengths=[3, 2])
    assert bsh.sample_id_R.tolist() == [7, 7, 7, 9, 9, -1]
    assert bsh.position_R.tolist() == [0, 1, 2, 0, 1, -1]
    sp1 = padded_layout([7, 9], 4, order="sbh", sp_size=2, sp_rank=1)
    assert sp1.position_R.tolist() == [2, 2, 3, 3]


@given(
    lens=st.lists(st.integers(1, 17), min_size=1, max_size=6),
    cp=st.integers(1, 3),
    sp=st.integers(1, 2),
)
@SETTINGS
def test_packed_cp_sp_shards_cover_every_token_once(lens, cp, sp):
    ids = [3 * i + 1 for i in range(len(lens))]
    got = Counter()
    for c in range(cp):
        for k in range(sp):
            lay = packed_layout(ids, lens, cp_size=cp, cp_rank=c, sp_size=sp, sp_rank=k)
            for s, p in zip(lay.sample_id_R.tolist(), lay.position_R.tolist(), strict=True):
                if s >= 0:
                    got[(s, p)] += 1
    want = {(s, p) for s, n in zip(ids, lens, strict=True) for p in range(n)}
    assert set(got) == want and set(got.values()) == {1}


@given(
    b=st.integers(1, 4),
    seq=st.integers(1, 12),
    order=st.sampled_from(["sbh", "bsh"]),
    data=st.data(),
)
@SETTINGS
def test_layout_runs_round_trip(b, seq, order, data):
    lens = data.draw(st.lists(st.integers(0, seq), min_size=b, max_size=b))
    ids = data.draw(st.lists(st.integers(0, 50), min_size=b, max_size=b, unique=True))
    lay = concat_layouts(
        [
            padded_layout(ids, seq, order=order, lengths=lens),
            packed_layout(ids, [max(1, n) for n in lens]),
        ]
    )
    runs = layout_to_runs(lay)
    back = layout_from_runs(runs, lay.num_rows)
    assert back.same_as(lay)
    assert runs.shape[0] <= max(1, lay.num_tokens)


def test_layout_validation():
    with pytest.raises(ValueError, match="padding rows"):
        TokenLayout(sample_id_R=torch.tensor([0, -1]), position_R=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="int64 CPU"):
        TokenLayout(sample_id_R=torch.tensor([0], dtype=torch.int32), position_R=torch.tensor([0]))


# --- the planner: a brute-force checker ----------------------------------------------------


def check_plan(plan, teachers, student, layouts_t, layouts_s, *, local_copy=True):
    """Every needed row written exactly once, by a replica holding its key, into its slot."""
    holder = {}  # key -> (owner, (dp, cp))
    for o, lays in enumerate(layouts_t):
        for (d, c), lay in lays.items():
            for s, p in zip(lay.sample_id_R.tolist(), lay.position_R.tolist(), strict=True):
                if s >= 0:
                    assert (s, p) not in holder
                    holder[(s, p)] = (o, (d, c))
    rank_src = {}  # (owner, rank) -> (dp, cp)
    for o, m in enumerate(teachers):
        for d, c in m.shards():
            for r in m.tp_group_ranks(dp_rank=d, cp_rank=c):
                rank_src[(o, r)] = (d, c)
    dst_of = {}
    for d, c in student.shards():
        for j, r in enumerate(student.tp_group_ranks(dp_rank=d, cp_rank=c)):
            dst_of[r] = ((d, c), j)
    written = Counter()
    cross_rows = 0
    min_cross = 0
    for tid in range(plan.num_transfers):
        owner, src, dst = (int(x) for x in plan.transfers_T5[tid, :3])
        src_rows, dst_rows = plan.rows_of(tid)
        shard_t = rank_src[(owner, src)]
        shard_s, j = dst_of[dst]
        lay_t, lay_s = layouts_t[owner][shard_t], layouts_s[shard_s]
        n = lay_s.num_rows // student.tp
        assert dst_rows.tolist() == sorted(dst_rows.tolist())
        for sr, dr in zip(src_rows.tolist(), dst_rows.tolist(), strict=True):
            assert dr // n == j, "row delivered to the wrong TP slice"
            key_t = (int(lay_t.sample_id_R[sr]), int(lay_t.position_R[sr]))
            key_s = (int(lay_s.sample_id_R[dr]), int(lay_s.position_R[dr]))
            assert key_t == key_s and key_s[0] >= 0
            written[(shard_s, dr)] += 1
        if src != dst or not local_copy:
            cross_rows += src_rows.numel()
            if local_copy:
                replicas = teachers[owner].tp_group_ranks(dp_rank=shard_t[0], cp_rank=shard_t[1])
                assert dst not in replicas, "a colocated replica should have served this locally"
    for shard, lay in layouts_s.items():
        n = lay.num_rows // student.tp
        for r, (s, p) in enumerate(
            zip(lay.sample_id_R.tolist(), lay.position_R.tolist(), strict=True)
        ):
            if s < 0:
                assert written[(shard, r)] == 0
                continue
            assert written[(shard, r)] == 1, (
                f"row {r} of {shard} written {written[(shard, r)]} times"
            )
            o, shard_t = holder[(s, p)]
            assert int(plan.dests[student.shards().index(shard)].owner_N[r]) == o
            dst_rank = student.tp_group_ranks(dp_rank=shard[0], cp_rank=shard[1])[r // n]
            replicas = teachers[o].tp_group_ranks(dp_rank=shard_t[0], cp_rank=shard_t[1])
            if not (local_copy and dst_rank in replicas):
                min_cross += 1
    assert cross_rows == min_cross, "cross-rank rows must equal the minimum"
    return cross_rows


@st.composite
def scenarios(draw, max_len=12):
    def mesh(off):
        return Mesh(
            tp=draw(st.integers(1, 3)),
            cp=draw(st.integers(1, 2)),
            dp=draw(st.integers(1, 3)),
            pp=draw(st.integers(1, 2)),
            rank_offset=off,
        )

    t0 = mesh(0)
    n_teachers = draw(st.integers(1, 2))
    colocated = draw(st.booleans())
    teachers = [t0]
    if n_teachers == 2:
        teachers.append(mesh(0 if colocated else t0.size))
    end = max(m.rank_offset + m.size for m in teachers)
    student = mesh(0 if colocated else end)
    fmt = st.builds(
        SideFormat,
        kind=st.sampled_from(["sbh", "bsh", "thd"]),
        micro_batch=st.integers(1, 3),
    )
    t_fmts = [draw(fmt) for _ in teachers]
    s_fmt = draw(fmt)
    s_fmt = SideFormat(kind=s_fmt.kind, micro_batch=s_fmt.micro_batch, pad_multiple=student.tp)
    step = synthetic_step(
        teachers=teachers,
        student=student,
        num_samples=draw(st.integers(1, 8)),
        max_len=draw(st.integers(1, max_len)),
        teacher_formats=t_fmts,
        student_format=s_fmt,
        seed=draw(st.integers(0, 2**16)),
    )
    return teachers, student, step, colocated


def _plan(teachers, student, step, **kw):
    tb = [
        TeacherBatch(mesh=m, layouts=lay, hidden_size=8 + o, itemsize=2)
        for o, (m, lay) in enumerate(zip(teachers, step.teacher_layouts, strict=True))
    ]
    return plan_token_exchange(tb, StudentBatch(mesh=student, layouts=step.student_layouts), **kw)


@given(scenarios(), st.booleans())
@SETTINGS
def test_plan_delivers_every_token_once_with_minimal_crossings(scenario, local_copy):
    teachers, student, step, _ = scenario
    plan = _plan(teachers, student, step, local_copy=local_copy)
    check_plan(
        plan, teachers, student, step.teacher_layouts, step.student_layouts, local_copy=local_copy
    )
    # bytes: the transfer matrix agrees with the rows and each owner's row size
    m = plan.transfer_matrix()
    rb = torch.tensor(plan.row_bytes)[plan.transfers_T5[:, 0]] * plan.transfers_T5[:, 4]
    assert int(m.sum()) == int(rb.sum())


@given(scenarios())
@SETTINGS
def test_plan_is_deterministic_and_survives_the_metadata_round_trip(scenario):
    teachers, student, step, _ = scenario
    a = _plan(teachers, student, step)

    def rt(lays):
        return {k: layout_from_runs(layout_to_runs(v), v.num_rows) for k, v in lays.items()}

    step2 = type(step)(
        teacher_layouts=tuple(rt(x) for x in step.teacher_layouts),
        student_layouts=rt(step.student_layouts),
        sample_ids=step.sample_ids,
        lengths=step.lengths,
        route=step.route,
    )
    b = _plan(teachers, student, step2)
    assert a.signature == b.signature
    assert torch.equal(a.transfers_T5, b.transfers_T5)
    assert torch.equal(a.src_rows_M, b.src_rows_M) and torch.equal(a.dst_rows_M, b.dst_rows_M)


@given(scenarios())
@SETTINGS
def test_replicas_share_each_block_within_one_row(scenario):
    teachers, student, step, _ = scenario
    plan = _plan(teachers, student, step, local_copy=False)
    # per (source group, destination rank) the replicas' row counts differ by at most one
    per = Counter()
    for o, m in enumerate(teachers):
        for d, c in m.shards():
            reps = m.tp_group_ranks(dp_rank=d, cp_rank=c)
            for dst in set(plan.transfers_T5[:, 2].tolist()):
                counts = []
                for r in reps:
                    sel = (
                        (plan.transfers_T5[:, 0] == o)
                        & (plan.transfers_T5[:, 1] == r)
                        & (plan.transfers_T5[:, 2] == dst)
                    )
                    counts.append(int(plan.transfers_T5[sel, 4].sum()))
                if sum(counts):
                    assert max(counts) - min(counts) <= 1, counts
                    per[(o, d, c)] += 1
    assert sum(per.values()) > 0 or plan.num_transfers == 0


def test_balance_across_teacher_tp_replicas_within_10_percent():
    teacher = Mesh(tp=4, cp=2, dp=2)
    student = Mesh(tp=2, cp=1, dp=4, rank_offset=16)
    step = synthetic_step(
        teachers=[teacher],
        student=student,
        num_samples=24,
        max_len=300,
        teacher_formats=[SideFormat(kind="thd", micro_batch=3)],
        student_format=SideFormat(kind="sbh", micro_batch=2, pad_multiple=2),
        seed=3,
    )
    plan = _plan([teacher], student, step)
    s = plan.summary()
    assert s["replica_imbalance"] <= 0.10, s
    assert s["rows_cross"] == step.num_tokens


def test_colocated_identical_layouts_are_all_local_copies():
    mesh = Mesh(tp=2, cp=2, dp=2)
    step = synthetic_step(
        teachers=[mesh],
        student=mesh,
        num_samples=6,
        max_len=9,
        teacher_formats=[SideFormat(kind="sbh", micro_batch=2, pad_multiple=2)],
        student_format=SideFormat(kind="sbh", micro_batch=2, pad_multiple=2),
        seed=0,
    )
    # the student wants exactly the teacher's layout: everything is a local copy
    step = type(step)(
        teacher_layouts=step.teacher_layouts,
        student_layouts=dict(step.teacher_layouts[0]),
        sample_ids=step.sample_ids,
        lengths=step.lengths,
        route=step.route,
    )
    plan = _plan([mesh], mesh, step)
    s = plan.summary()
    assert s["bytes_cross"] == 0 and s["messages"] == 0
    assert s["rows_local"] == step.num_tokens
    for r in mesh.ranks:
        sched = RankSchedule.build(plan, r)
        assert not sched.sends and not sched.recvs
        assert all(x.mode == "runs" for x in sched.locals)  # identical layouts: joint runs
        assert sched.counts()["local_passes"] == len(sched.locals)


def test_contiguous_rows_need_no_pack_pass():
    teacher = Mesh(tp=1, dp=2)
    student = Mesh(tp=1, dp=2, rank_offset=2)
    lay0 = packed_layout([0, 1], [5, 7])
    lay1 = packed_layout([2], [4])
    layouts = {(0, 0): lay0, (1, 0): lay1}
    plan = plan_token_exchange(
        [TeacherBatch(mesh=teacher, layouts=layouts, hidden_size=4)],
        StudentBatch(mesh=student, layouts=layouts),
    )
    for r in (0, 1, 2, 3):
        c = RankSchedule.build(plan, r).counts()
        assert c["pack_bytes"] == 0 and c["unpack_bytes"] == 0
    assert plan.summary()["messages"] == 2


# --- the run join against the per-token reference -----------------------------------------


def assert_same_plan(a, b):
    """Bit-identical plans: transfers, row arrays, owners, missing count and signature."""
    assert a.signature == b.signature
    assert torch.equal(a.transfers_T5, b.transfers_T5)
    assert torch.equal(a.src_rows_M, b.src_rows_M)
    assert torch.equal(a.dst_rows_M, b.dst_rows_M)
    assert a.src_rows_M.dtype == b.src_rows_M.dtype == torch.int64
    assert a.num_missing == b.num_missing and a.row_bytes == b.row_bytes
    assert len(a.dests) == len(b.dests)
    for x, y in zip(a.dests, b.dests, strict=True):
        assert x.ranks == y.ranks and x.num_rows == y.num_rows
        assert torch.equal(x.owner_N, y.owner_N)


@given(scenarios(max_len=48), st.booleans())
@SETTINGS
def test_run_join_gives_the_per_token_plan(scenario, local_copy):
    teachers, student, step, _ = scenario
    ref = _plan(teachers, student, step, local_copy=local_copy, method="tokens")
    for method in ("runs", "auto"):
        assert_same_plan(_plan(teachers, student, step, local_copy=local_copy, method=method), ref)


def _interleaved_sbh_step():
    teacher = Mesh(tp=2, cp=1, dp=1)
    student = Mesh(tp=2, cp=2, dp=2, rank_offset=2)
    return (
        teacher,
        student,
        synthetic_step(
            teachers=[teacher],
            student=student,
            num_samples=12,
            max_len=200,
            teacher_formats=[SideFormat(kind="thd", micro_batch=6)],
            student_format=SideFormat(kind="sbh", micro_batch=3, pad_multiple=2),
            seed=5,
        ),
    )


def test_strided_student_runs_interleave_and_still_match():
    # [S, B, H] student: a sample's rows are B apart, so within one (teacher shard, student rank)
    # block the runs interleave and the run join must merge them into destination-row order
    teacher, student, step = _interleaved_sbh_step()
    ref = _plan([teacher], student, step, method="tokens")
    got = _plan([teacher], student, step, method="runs")
    assert_same_plan(got, ref)
    check_plan(got, [teacher], student, step.teacher_layouts, step.student_layouts)
    # the interleaving is real: some transfer's destination rows are not one contiguous range
    gaps = [int((got.rows_of(t)[1].diff() > 1).sum()) for t in range(got.num_transfers)]
    assert max(gaps) > 0


def test_run_join_plans_long_runs_from_few_runs():
    # 256 ranks, THD both sides: the plan the benchmark times, at a size a unit test affords
    teacher = Mesh(tp=8, cp=2, dp=8)
    student = Mesh(tp=4, cp=4, dp=8, rank_offset=128)
    step = synthetic_step(
        teachers=[teacher],
        student=student,
        num_samples=24,
        max_len=512,
        teacher_formats=[SideFormat(kind="thd", micro_batch=8)],
        student_format=SideFormat(kind="thd", micro_batch=4, pad_multiple=4),
        seed=0,
    )
    ref = _plan([teacher], student, step, method="tokens")
    got = _plan([teacher], student, step, method="runs")
    assert_same_plan(got, ref)
    assert got.summary()["rows_cross"] == step.num_tokens


@st.composite
def arbitrary_groups(draw):
    """Source and destination groups with arbitrary keys: shuffled, sorted (runs), padded,
    duplicated or missing; ranks shared between groups."""
    sources = []
    for i in range(draw(st.integers(1, 4))):
        keys = draw(st.lists(st.integers(-1, 60), max_size=16, unique=draw(st.booleans())))
        if draw(st.booleans()):
            keys = sorted(keys)
        sources.append(
            SourceGroup(
                owner=draw(st.integers(0, 1)),
                ranks=tuple(draw(st.lists(st.integers(0, 7), min_size=1, max_size=3, unique=True))),
                key_R=torch.tensor(keys, dtype=torch.int64),
                label=f"src{i}",
            )
        )
    held = [k for s in sources for k in s.key_R.tolist() if k >= 0]
    dests = []
    for i in range(draw(st.integers(0, 4))):
        ranks = tuple(draw(st.lists(st.integers(0, 7), min_size=1, max_size=3, unique=True)))
        n = len(ranks) * draw(st.integers(0, 6))
        pick = st.sampled_from(held) if held and draw(st.booleans()) else st.integers(-1, 62)
        keys = draw(st.lists(st.one_of(pick, st.just(-1)), min_size=n, max_size=n))
        if draw(st.booleans()):
            keys = sorted(keys)
        dests.append(
            DestGroup(ranks=ranks, key_R=torch.tensor(keys, dtype=torch.int64), label=f"dst{i}")
        )
    return sources, dests


def _outcome(sources, dests, **kw):
    try:
        return plan_transfers(sources, dests, num_owners=2, row_bytes=[4, 6], **kw)
    except ValueError as e:
        return str(e)


@given(arbitrary_groups(), st.booleans(), st.booleans())
@SETTINGS
def test_run_join_matches_reference_on_arbitrary_keys(groups, local_copy, allow_missing):
    sources, dests = groups
    kw = {"local_copy": local_copy, "allow_missing": allow_missing}
    ref = _outcome(sources, dests, method="tokens", **kw)
    for method in ("runs", "auto"):
        got = _outcome(sources, dests, method=method, **kw)
        if isinstance(ref, str):
            assert got == ref  # the same error, word for word
        else:
            assert not isinstance(got, str), got
            assert_same_plan(got, ref)


def test_run_join_matches_reference_with_missing_rows_allowed():
    src = [SourceGroup(owner=0, ranks=(0, 1), key_R=torch.tensor([5, 6, 7, 8, -1, 20, 21]))]
    dst = [DestGroup(ranks=(2, 0), key_R=torch.tensor([4, 5, 6, 7, 8, 9, -1, 21]))]
    ref = plan_transfers(src, dst, allow_missing=True, method="tokens")
    got = plan_transfers(src, dst, allow_missing=True, method="runs")
    assert_same_plan(got, ref)
    assert got.num_missing == 2 and got.dests[0].owner_N.tolist() == [-1, 0, 0, 0, 0, -1, -1, 0]


def test_auto_plans_unstructured_keys_per_token_and_logs_once(monkeypatch, caplog):
    monkeypatch.setattr(planner_mod, "_logged_fallback", set())
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    src = [SourceGroup(owner=0, ranks=(0,), key_R=perm * 3)]  # keys 3 apart: no runs at all
    dst = [DestGroup(ranks=(1,), key_R=perm.flip(0) * 3)]
    with caplog.at_level("INFO", logger=planner_mod.__name__):
        a = plan_transfers(src, dst)
        b = plan_transfers(src, dst)
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "not run-structured" in caplog.records[0].message
    assert_same_plan(a, plan_transfers(src, dst, method="runs"))
    assert_same_plan(b, plan_transfers(src, dst, method="tokens"))


def test_signature_tells_layouts_apart():
    src = [SourceGroup(owner=0, ranks=(0,), key_R=torch.arange(8))]

    def sig(keys):
        return plan_transfers(src, [DestGroup(ranks=(1,), key_R=torch.tensor(keys))]).signature

    assert sig([0, 1, 2, 3]) == sig([0, 1, 2, 3])
    assert (
        len({sig([0, 1, 2, 3]), sig([0, 1, 2, 4]), sig([0, 1, 2, 3, -1]), sig([1, 0, 2, 3])}) == 4
    )


def test_backward_and_strided_runs_match_the_reference():
    # rows holding descending keys (step -1) and strided ones (step 3, 2) on both sides
    src = [
        SourceGroup(owner=0, ranks=(0, 1), key_R=torch.arange(40, 0, -1)),  # keys 40..1
        SourceGroup(owner=1, ranks=(2,), key_R=torch.arange(100, 130).view(10, 3).T.reshape(-1)),
    ]
    want = torch.cat([torch.arange(1, 41).view(20, 2).T.reshape(-1), torch.arange(129, 99, -1)])
    dst = [DestGroup(ranks=(3, 0), key_R=want), DestGroup(ranks=(1,), key_R=want.flip(0))]
    for local_copy in (True, False):
        ref = plan_transfers(src, dst, local_copy=local_copy, method="tokens")
        assert_same_plan(plan_transfers(src, dst, local_copy=local_copy, method="runs"), ref)
        assert ref.summary()["rows_cross"] + ref.summary()["rows_local"] == 2 * want.numel()


@st.composite
def sbh_students(draw):
    """A step whose student is [S, B, H] with CP zigzag and several micro-batches per shard."""
    t_cp = draw(st.integers(1, 2))
    teacher = Mesh(tp=draw(st.integers(1, 2)), cp=t_cp, dp=draw(st.integers(1, 2)))
    student = Mesh(
        tp=draw(st.integers(1, 4)),
        cp=draw(st.integers(2, 3)),
        dp=draw(st.integers(1, 2)),
        rank_offset=draw(st.sampled_from([0, teacher.size])),
    )
    mb = draw(st.integers(2, 4))
    step = synthetic_step(
        teachers=[teacher],
        student=student,
        # at least two micro-batches on every student DP rank (the last one may be smaller)
        num_samples=student.dp * mb * draw(st.integers(2, 3)) + draw(st.integers(0, mb - 1)),
        max_len=draw(st.integers(8, 96)),
        teacher_formats=[SideFormat(kind=draw(st.sampled_from(["thd", "sbh"])), micro_batch=3)],
        student_format=SideFormat(kind="sbh", micro_batch=mb, pad_multiple=student.tp),
        seed=draw(st.integers(0, 2**16)),
    )
    return teacher, student, step


def _runs_by_sorting_only(keys, **kw):
    """extract_runs as before the strided fast path: no probed steps, every short group sorted."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(planner_runs, "_probe_steps", lambda key_R, off_G1: np.zeros(off_G1.size - 1))
        return planner_runs.extract_runs(keys, **kw)


def _student_keys(step, student):
    lays = [step.student_layouts[x] for x in student.shards()]
    stride = planner_mod.key_stride([*lays, *step.teacher_layouts[0].values()])
    keys = planner_mod._keys_of(lays, stride)
    slice_rows = [k.numel() // student.tp for k in keys]
    return keys, {
        "slice_rows": slice_rows,
        "slot_offsets": [student.tp * i for i in range(len(keys))],
    }


@given(sbh_students(), st.booleans())
@SETTINGS
def test_sbh_students_with_micro_batches_and_cp_match_the_reference(case, local_copy):
    teacher, student, step = case
    ref = _plan([teacher], student, step, local_copy=local_copy, method="tokens")
    got = _plan([teacher], student, step, local_copy=local_copy, method="runs")
    assert_same_plan(got, ref)
    # the strided runs are the ones sorting finds (same table, so the same signature)
    keys, kw = _student_keys(step, student)
    fast = planner_runs.extract_runs(keys, **kw)
    assert torch.equal(fast.table(), _runs_by_sorting_only(keys, **kw).table())


def test_sbh_runs_are_found_without_sorting_the_keys(monkeypatch):
    teacher = Mesh(tp=2, cp=2, dp=2)
    student = Mesh(tp=2, cp=2, dp=2, rank_offset=8)
    step = synthetic_step(
        teachers=[teacher],
        student=student,
        num_samples=32,
        max_len=300,
        teacher_formats=[SideFormat(kind="thd", micro_batch=4)],
        student_format=SideFormat(kind="sbh", micro_batch=4, pad_multiple=2),
        seed=3,
    )
    keys, kw = _student_keys(step, student)
    want = _runs_by_sorting_only(keys, **kw)
    assert int((want.step_K == 4).sum()) > want.num_runs // 2  # strided runs, B = 4 apart

    def no_sort(*args):
        raise AssertionError("an [S, B, H] group with one micro-batch size was sorted")

    monkeypatch.setattr(planner_runs, "_sorted_runs", no_sort)
    assert torch.equal(planner_runs.extract_runs(keys, **kw).table(), want.table())
    ref = _plan([teacher], student, step, method="tokens")
    assert_same_plan(_plan([teacher], student, step, method="runs"), ref)


@pytest.mark.parametrize(
    ("rows", "sorts"),
    [
        # chains that sorting cuts differently: keys 0..5 at step 4, then 6..8 at step 3 right
        # after (touching in key order); sorting makes [0..5], [6], [7, 8]
        ([(0, 0, 4, 6), (6, 30, 3, 3)], True),
        # a key held twice (two chains overlap in key order)
        ([(0, 0, 4, 6), (3, 1, 4, 6)], True),
        # two micro-batch sizes in one buffer: steps 4 and 3
        ([(0, 0, 4, 8), (100, 1, 4, 8), (200, 40, 3, 5), (300, 41, 3, 5)], True),
        # chains crossing a slice boundary (slice_rows = 32): cut there, no sort needed
        ([(0, 2, 4, 12), (50, 3, 4, 12)], False),
    ],
)
def test_strided_fast_path_matches_sorting_on_edge_cases(rows, sorts):
    # rows: (first key, first row, row step, length) chains written into a padded buffer
    key_R = torch.full((64,), -1, dtype=torch.int64)
    for k, r, d, n in rows:
        key_R[r : r + d * n : d] = torch.arange(k, k + n)
    kw = {"slice_rows": [32], "slot_offsets": [0]}
    calls = []
    with pytest.MonkeyPatch.context() as m:
        sorted_runs = planner_runs._sorted_runs
        m.setattr(planner_runs, "_sorted_runs", lambda *a: calls.append(1) or sorted_runs(*a))
        fast = planner_runs.extract_runs([key_R], **kw)
    assert bool(calls) == sorts
    assert torch.equal(fast.table(), _runs_by_sorting_only([key_R], **kw).table())
    src = [SourceGroup(owner=0, ranks=(0,), key_R=torch.arange(400))]
    dst = [DestGroup(ranks=(1, 2), key_R=key_R)]
    assert_same_plan(
        plan_transfers(src, dst, method="runs"), plan_transfers(src, dst, method="tokens")
    )


def test_adjacent_key_views_are_read_without_a_copy():
    buf = torch.arange(20)
    views = [buf[0:5], buf[5:5], buf[5:12], buf[12:20]]
    got = planner_runs._concat(views)
    assert np.shares_memory(got, buf.numpy()) and got.tolist() == list(range(20))
    gap = planner_runs._concat([buf[0:5], buf[6:12]])  # not adjacent: copied, still right
    assert not np.shares_memory(gap, buf.numpy())
    assert gap.tolist() == [*range(5), *range(6, 12)]
    apart = planner_runs._concat([torch.arange(3), torch.arange(3, 6)])  # two buffers
    assert apart.tolist() == list(range(6))


def test_plan_method_is_validated():
    with pytest.raises(ValueError, match="method must be 'auto', 'runs' or 'tokens', got 'fast'"):
        plan_transfers([], [], method="fast")


# --- errors --------------------------------------------------------------------------------


def test_token_held_by_two_teachers_is_rejected():
    t0, t1 = Mesh(), Mesh(rank_offset=1)
    student = Mesh(rank_offset=2)
    lay = padded_layout([4], 3)
    with pytest.raises(ValueError, match=r"token \(sample_id=4, position=0\) is held twice"):
        plan_token_exchange(
            [
                TeacherBatch(mesh=t0, layouts={(0, 0): lay}, hidden_size=4),
                TeacherBatch(mesh=t1, layouts={(0, 0): lay}, hidden_size=4),
            ],
            StudentBatch(mesh=student, layouts={(0, 0): lay}),
        )


def test_token_no_teacher_holds_is_rejected():
    with pytest.raises(ValueError, match=r"\(sample_id=5, position=2\) is needed by student"):
        plan_token_exchange(
            [TeacherBatch(mesh=Mesh(), layouts={(0, 0): padded_layout([5], 2)}, hidden_size=4)],
            StudentBatch(mesh=Mesh(rank_offset=1), layouts={(0, 0): padded_layout([5], 3)}),
        )


def test_student_rows_must_split_over_its_tp_group():
    with pytest.raises(ValueError, match="3 rows do not split into 2 equal slices"):
        plan_token_exchange(
            [TeacherBatch(mesh=Mesh(), layouts={(0, 0): padded_layout([5], 3)}, hidden_size=4)],
            StudentBatch(mesh=Mesh(tp=2, rank_offset=1), layouts={(0, 0): padded_layout([5], 3)}),
        )


def test_layouts_must_cover_the_mesh_shards():
    with pytest.raises(ValueError, match="must cover exactly the \\(dp, cp\\) shards"):
        TeacherBatch(mesh=Mesh(dp=2), layouts={(0, 0): padded_layout([5], 3)}, hidden_size=4)


# --- LM head -------------------------------------------------------------------------------


@given(
    v=st.integers(1, 40),
    tp_t=st.integers(1, 4),
    tp_s=st.integers(1, 4),
    dp_t=st.integers(1, 2),
    extra=st.integers(0, 9),
)
@SETTINGS
def test_lm_head_plan_moves_each_vocab_row_into_the_student_partition(v, tp_t, tp_s, dp_t, extra):
    vt = -(-(v + extra) // tp_t) * tp_t
    vs = -(-v // (2 * tp_s)) * (2 * tp_s)
    teacher = Mesh(tp=tp_t, dp=dp_t)
    student = Mesh(tp=tp_s, dp=2, rank_offset=teacher.size)
    plan = plan_lm_head(
        teacher=teacher,
        student=student,
        vocab=VocabSpec(vocab_size=v, teacher_padded=vt, student_padded=vs),
        hidden_size=4,
    )
    got = Counter()
    for tid in range(plan.num_transfers):
        _, src, dst = (int(x) for x in plan.transfers_T5[tid, :3])
        tc, sc = teacher.coord(src), student.coord(dst)
        s_rows, d_rows = plan.rows_of(tid)
        t_vocab = vocab_layout(v, vt, tp_t, tc.tp_rank).position_R[s_rows]
        s_vocab = vocab_layout(v, vs, tp_s, sc.tp_rank).position_R[d_rows]
        assert torch.equal(t_vocab, s_vocab) and bool((s_vocab >= 0).all())
        for x in s_vocab.tolist():
            got[(dst, x)] += 1
    for r in student.last_stage_ranks():
        t = student.coord(r).tp_rank
        per = vs // tp_s
        want = {x for x in range(t * per, (t + 1) * per) if x < v}
        assert {x for (d, x) in got if d == r} == want
    assert set(got.values()) <= {1}
