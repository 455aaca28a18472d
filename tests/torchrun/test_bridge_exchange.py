"""Tier 2 (8 ranks, gloo): the bridge bit-exact against an all-gather reference, over many meshes.

One launch covers 32 teacher/student combinations carved out of the 8 ranks: disjoint and
colocated (fully and partly), pipeline stages on either side, CP zigzag on both sides, THD packing
that differs between the sides, different micro-batching and sample order, two teachers with
different hidden sizes, and the student keeping its SP slice. Rows are filled with bits derived
from their key and output buffers are poisoned first, so a misplaced, missing or doubled row fails.
Also: cross-rank bytes equal the minimum, the plan cache and staging reuse, the LM-head reshard.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mopd.bridge import (
    BridgeConfig,
    GroupPool,
    HiddenStateBridge,
    Mesh,
    TeacherSpec,
    VocabSpec,
    create_bridge_groups,
    reshard_lm_head,
)
from mopd.bridge.layout import TokenLayout, encode_keys
from mopd.profiling.synthetic import SideFormat, key_pattern, synthetic_step

TORCHRUN_NPROC = 8
TORCHRUN_TIMEOUT = 240

M = Mesh
THD, SBH, BSH = "thd", "sbh", "bsh"

# (name, teachers, student)
MESHES: list[tuple[str, list[Mesh], Mesh]] = [
    ("disjoint tp2cp2 -> tp2dp2", [M(tp=2, cp=2)], M(tp=2, dp=2, rank_offset=4)),
    ("disjoint dp4 -> tp4", [M(dp=4)], M(tp=4, rank_offset=4)),
    ("disjoint tp4 -> cp2dp2", [M(tp=4)], M(cp=2, dp=2, rank_offset=4)),
    ("disjoint tp2pp2 -> tp2cp2", [M(tp=2, pp=2)], M(tp=2, cp=2, rank_offset=4)),
    ("disjoint cp2dp2 -> tp2pp2", [M(cp=2, dp=2)], M(tp=2, pp=2, rank_offset=4)),
    ("disjoint tp1 -> tp2cp2dp1", [M()], M(tp=2, cp=2, rank_offset=1)),
    (
        "two teachers tp2 + cp2 -> tp2dp2",
        [M(tp=2), M(cp=2, rank_offset=2)],
        M(tp=2, dp=2, rank_offset=4),
    ),
    (
        "two teachers dp2 + tp2 -> cp2dp2",
        [M(dp=2), M(tp=2, rank_offset=2)],
        M(cp=2, dp=2, rank_offset=4),
    ),
    ("colocated same mesh tp2cp2dp2", [M(tp=2, cp=2, dp=2)], M(tp=2, cp=2, dp=2)),
    ("colocated tp2dp4 -> tp4dp2", [M(tp=2, dp=4)], M(tp=4, dp=2)),
    ("colocated tp4cp2 -> cp4dp2", [M(tp=4, cp=2)], M(cp=4, dp=2)),
    ("colocated tp8 -> tp2cp2dp2", [M(tp=8)], M(tp=2, cp=2, dp=2)),
    ("partly colocated tp2cp2dp2 -> tp2cp2", [M(tp=2, cp=2, dp=2)], M(tp=2, cp=2)),
    (
        "two teachers colocated with the student",
        [M(tp=2, dp=2), M(tp=2, dp=2, rank_offset=4)],
        M(tp=2, cp=2, dp=2),
    ),
    ("colocated pp2 both sides", [M(tp=4, pp=2)], M(tp=2, cp=2, pp=2)),
    ("colocated dp8 -> tp8", [M(dp=8)], M(tp=8)),
]

# (teacher format(s), student format, dtype, keep_sp_shard)
VARIANTS = [
    (
        SideFormat(kind=THD, micro_batch=2),
        SideFormat(kind=SBH, micro_batch=3),
        torch.bfloat16,
        False,
    ),
    (SideFormat(kind=BSH, micro_batch=3), SideFormat(kind=THD, micro_batch=1), torch.float32, True),
]

CASES = [(m, v) for m in range(len(MESHES)) for v in range(len(VARIANTS))]
POOL: GroupPool | None = None
BRIDGES: dict[int, HiddenStateBridge] = {}


def pool() -> GroupPool:
    global POOL
    if POOL is None:
        POOL = GroupPool(backend="gloo")
    return POOL


def hidden_of(o: int) -> int:
    return 8 + 4 * o


def student_format(fmt: SideFormat, student: Mesh) -> SideFormat:
    return SideFormat(kind=fmt.kind, micro_batch=fmt.micro_batch, pad_multiple=student.tp)


def reference(teachers, step, dtype, o):
    """All-gather every teacher rank's (keys, rows) for owner ``o``; return sorted keys and rows."""
    rank = dist.get_rank()
    world = dist.get_world_size()
    m = teachers[o]
    h = hidden_of(o)
    stride = 1 << 20
    if m.is_last_stage(rank):
        c = m.coord(rank)
        lay = step.teacher_layouts[o][(c.dp_rank, c.cp_rank)]
        keys = encode_keys(lay.sample_id_R, lay.position_R, stride)
        rows = key_pattern(lay, h, dtype, salt=o)
    else:
        keys = torch.empty(0, dtype=torch.int64)
        rows = torch.empty((0, h), dtype=dtype)
    n = torch.tensor([keys.numel()])
    ns = torch.empty(world, dtype=torch.int64)
    dist.all_gather_into_tensor(ns, n)
    width = int(ns.max())
    kp = torch.full((width,), -1, dtype=torch.int64)
    kp[: keys.numel()] = keys
    rp = torch.zeros((width, h), dtype=dtype)
    rp[: rows.shape[0]] = rows
    all_k = torch.empty(world * width, dtype=torch.int64)
    all_r = torch.empty((world * width, h), dtype=dtype)
    dist.all_gather_into_tensor(all_k, kp)
    dist.all_gather_into_tensor(all_r, rp)
    keep = all_k >= 0
    all_k, all_r = all_k[keep], all_r[keep]
    order = torch.argsort(all_k)
    return all_k[order], all_r[order], stride


def expected_rows(layout: TokenLayout, ref, h, dtype):
    keys_sorted, rows_sorted, stride = ref
    keys = encode_keys(layout.sample_id_R, layout.position_R, stride)
    out = torch.zeros((layout.num_rows, h), dtype=dtype)
    pos = torch.searchsorted(keys_sorted, keys).clamp(max=max(keys_sorted.numel() - 1, 0))
    hit = (keys >= 0) & (keys_sorted.numel() > 0)
    if keys_sorted.numel():
        hit &= keys_sorted[pos] == keys
        out[hit] = rows_sorted[pos[hit]]
    return out, hit


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def run_case(case: int, repeat: int = 1) -> dict:
    mi, vi = CASES[case]
    name, teachers, student = MESHES[mi]
    t_fmt, s_fmt, dtype, keep_sp = VARIANTS[vi]
    rank = dist.get_rank()
    groups = create_bridge_groups(pool(), teachers, student)
    step = synthetic_step(
        teachers=teachers,
        student=student,
        num_samples=7,
        max_len=11,
        teacher_formats=[t_fmt] * len(teachers),
        student_format=student_format(s_fmt, student),
        seed=case,
    )
    refs = [reference(teachers, step, dtype, o) for o in range(len(teachers))]
    if groups.bridge is None:
        return {}
    bridge = HiddenStateBridge(
        teachers=[TeacherSpec(mesh=m, hidden_size=hidden_of(o)) for o, m in enumerate(teachers)],
        student=student,
        groups=groups,
        config=BridgeConfig(timeout_s=60, keep_sp_shard=keep_sp),
    )
    hidden, layouts = {}, {}
    for o, m in enumerate(teachers):
        if m.is_last_stage(rank):
            c = m.coord(rank)
            lay = step.teacher_layouts[o][(c.dp_rank, c.cp_rank)]
            hidden[o] = key_pattern(lay, hidden_of(o), dtype, salt=o).view(-1, 1, hidden_of(o))
            layouts[o] = lay
    stu_layout, outputs = None, None
    sc = student.coord(rank)
    is_student = student.is_last_stage(rank)
    if is_student:
        stu_layout = step.student_layouts[(sc.dp_rank, sc.cp_rank)]
        n = stu_layout.num_rows // (student.tp if keep_sp else 1)
        outputs = {
            o: torch.full((n, hidden_of(o)), float("nan"), dtype=dtype)
            for o in range(len(teachers))
        }
    for _ in range(repeat):
        if outputs is not None:
            for t in outputs.values():
                t.fill_(float("nan"))  # poison: unwritten rows fail
        handle = bridge.exchange(
            hidden=hidden, layouts=layouts, student_layout=stu_layout, outputs=outputs
        )
        got = handle.wait()
        if is_student:
            for o in range(len(teachers)):
                want, hit = expected_rows(stu_layout, refs[o], hidden_of(o), dtype)
                if keep_sp:
                    n = want.shape[0] // student.tp
                    want = want[sc.tp_rank * n : (sc.tp_rank + 1) * n]
                    hit = hit[sc.tp_rank * n : (sc.tp_rank + 1) * n]
                assert got[o] is outputs[o]
                assert torch.equal(bits(got[o]), bits(want)), f"{name}: teacher {o} rows differ"
                prepared_owner = bridge._plans  # plan cache holds one entry per layout set
                assert len(prepared_owner) == 1
    return {"bridge": bridge, "step": step, "teachers": teachers, "student": student}


@pytest.mark.parametrize(
    "case", range(len(CASES)), ids=lambda c: f"{MESHES[CASES[c][0]][0]}/v{CASES[c][1]}"
)
def test_exchange_bit_exact(case):
    run_case(case)


def test_at_least_30_combinations():
    assert len(CASES) >= 30


def test_repeat_reuses_plan_and_staging():
    out = run_case(0, repeat=3)
    if out:
        assert len(out["bridge"].executor._schedules) == 1


def test_owner_mask_and_allocated_outputs():
    """Two teachers: outputs allocated by the bridge; ``owner_N`` says which teacher filled a row."""
    _, teachers, student = MESHES[6]
    rank = dist.get_rank()
    groups = create_bridge_groups(pool(), teachers, student)
    step = synthetic_step(
        teachers=teachers,
        student=student,
        num_samples=9,
        max_len=7,
        student_format=SideFormat(pad_multiple=student.tp),
        seed=99,
    )
    if groups.bridge is None:
        return
    bridge = HiddenStateBridge(
        teachers=[TeacherSpec(mesh=m, hidden_size=hidden_of(o)) for o, m in enumerate(teachers)],
        student=student,
        groups=groups,
        config=BridgeConfig(timeout_s=60),
    )
    hidden, layouts = {}, {}
    for o, m in enumerate(teachers):
        if m.is_last_stage(rank):
            c = m.coord(rank)
            layouts[o] = step.teacher_layouts[o][(c.dp_rank, c.cp_rank)]
            hidden[o] = key_pattern(layouts[o], hidden_of(o), torch.float32, salt=o)
    stu = None
    if student.is_last_stage(rank):
        c = student.coord(rank)
        stu = step.student_layouts[(c.dp_rank, c.cp_rank)]
    prepared = bridge.prepare(hidden=hidden, layouts=layouts, student_layout=stu)
    got = bridge.start(prepared).wait()
    if stu is None:
        assert prepared.owner_N is None and not got
        return
    route = dict(zip(step.sample_ids.tolist(), step.route.tolist(), strict=True))
    want_owner = torch.tensor([route[s] if s >= 0 else -1 for s in stu.sample_id_R.tolist()])
    assert torch.equal(prepared.owner_N, want_owner)
    for o in range(len(teachers)):
        mine = want_owner == o
        exp = key_pattern(stu, hidden_of(o), torch.float32, salt=o)
        assert torch.equal(bits(got[o][mine]), bits(exp[mine]))
        assert bool((got[o][~mine] == 0).all())


def test_cross_rank_bytes_equal_the_minimum():
    """Bytes actually posted by every rank's sends == the plan's == the minimum, per case."""
    for case in (0, 12, 13, 26):
        mi, vi = CASES[case]
        name, teachers, student = MESHES[mi]
        out = run_case(case)
        sent = torch.zeros(1, dtype=torch.int64)
        if out:
            bridge = out["bridge"]
            (plan,) = bridge._plans.values()
            sent[0] = bridge.executor.schedule(plan).counts()["send_bytes"]
        dist.all_reduce(sent)
        if not out:
            continue
        step = out["step"]
        itemsize = VARIANTS[vi][2].itemsize
        minimum = 0
        for (d, c), lay in step.student_layouts.items():
            n = lay.num_rows // student.tp
            dst = student.tp_group_ranks(dp_rank=d, cp_rank=c)
            for o, m in enumerate(teachers):
                for (td, tc), tl in step.teacher_layouts[o].items():
                    held = set(zip(tl.sample_id_R.tolist(), tl.position_R.tolist(), strict=True))
                    reps = m.tp_group_ranks(dp_rank=td, cp_rank=tc)
                    for r, key in enumerate(
                        zip(lay.sample_id_R.tolist(), lay.position_R.tolist(), strict=True)
                    ):
                        if key[0] >= 0 and key in held and dst[r // n] not in reps:
                            minimum += hidden_of(o) * itemsize
        assert plan.summary()["bytes_cross"] == minimum, name
        assert int(sent) == minimum, name


# --- LM head --------------------------------------------------------------------------------

LM_CASES = [
    (M(tp=2, dp=2), M(tp=4, rank_offset=4), 37, 40, 40),
    (M(tp=4, pp=2), M(tp=2, cp=2, pp=2), 50, 52, 56),
    (M(tp=8), M(tp=3, dp=2, rank_offset=1), 29, 32, 30),
]


@pytest.mark.parametrize("case", range(len(LM_CASES)))
def test_lm_head_reshard_matches_slicing_the_full_weight(case):
    teacher, student, v, vt, vs = LM_CASES[case]
    rank = dist.get_rank()
    h = 6
    groups = create_bridge_groups(pool(), [teacher], student)
    gen = torch.Generator().manual_seed(case)
    full = torch.randn(vt, h, generator=gen)
    full[v:] = float("nan")  # teacher padding rows must never be read
    shard = None
    if teacher.is_last_stage(rank):
        per = vt // teacher.tp
        t = teacher.coord(rank).tp_rank
        shard = full[t * per : (t + 1) * per].clone()
    if groups.bridge is None:
        return
    got = reshard_lm_head(
        shard,
        teacher=teacher,
        student=student,
        vocab=VocabSpec(vocab_size=v, teacher_padded=vt, student_padded=vs),
        hidden_size=h,
        groups=groups,
        timeout_s=60,
    )
    if not student.is_last_stage(rank):
        assert got is None
        return
    per = vs // student.tp
    s = student.coord(rank).tp_rank
    want = torch.zeros(per, h)
    lo, hi = s * per, min((s + 1) * per, v)
    if hi > lo:
        want[: hi - lo] = full[lo:hi]
    assert torch.equal(got.weight_VH, want)
    assert got.valid_V.tolist() == [lo + i < v for i in range(per)]
    assert got.num_padding == per - max(0, hi - lo)
