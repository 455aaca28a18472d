"""Tier 2 (8 ranks, gloo): the bridge bit-exact against an all-gather reference, over many meshes.

One launch covers 32 teacher/student combinations carved out of the 8 ranks: disjoint and
colocated (fully and partly), pipeline stages on either side, CP zigzag on both sides, THD packing
that differs between the sides, different micro-batching and sample order, two teachers with
different hidden sizes, student TP slices of uneven length (some empty), and the student keeping
its own (uneven) SP slice. Rows are filled with bits derived from their key and every output
buffer the bridge allocates starts as NaN bits, so a misplaced, missing or doubled row fails;
each teacher's rows arrive compact (its tokens only, in layout order, in a buffer of one row
per token plus at most tp - 1 padding rows) and ``owner_N`` must name the teacher each sample
was routed to. Also: the bytes actually posted to other ranks (seen at the executor's "packed" point) equal
the schedules' figure and the minimum (each needed token crosses once per receiving rank,
never where a replica is local); repeating an exchange builds no schedule and allocates no
staging; the LM-head reshard equals slicing the full weight (padding rows never read).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from mopd.bridge import GroupPool, Mesh, TokenLayout, compact_rows, create_bridge_groups
from mopd.bridge.layout import encode_keys
from mopd.bridge.lm_head import VocabSpec, reshard_lm_head
from mopd.profiling.synthetic import SideFormat, SyntheticStep, key_pattern, synthetic_step
from tests.support.bridges import make_bridge, poison_outputs

TORCHRUN_NPROC = 8
TORCHRUN_TIMEOUT = 300
TORCHRUN_STRICT_P2P = 1  # NCCL's point-to-point rules (tests/support/strict_p2p.py)

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

# (teacher format, student format, dtype, keep_sp_shard); pad_multiple=1: uneven TP slices
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
POOL: list[GroupPool] = []
STRIDE = 1 << 20


def pool() -> GroupPool:
    if not POOL:
        POOL.append(GroupPool(backend="gloo", timeout_s=120))
    return POOL[0]


def hidden_of(o: int) -> int:
    return 8 + 4 * o


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def sp_slice(layout: TokenLayout, tp: int, tp_rank: int) -> tuple[TokenLayout, slice]:
    """TP rank ``tp_rank``'s contiguous part of ``layout`` (uneven: ``np.array_split``), as the
    layout it passes with ``keep_sp_shard`` and the rows of the full layout it covers."""
    bounds = np.cumsum([0] + [len(p) for p in np.array_split(np.arange(layout.num_rows), tp)])
    rows = slice(int(bounds[tp_rank]), int(bounds[tp_rank + 1]))
    part = TokenLayout(
        sample_id_R=layout.sample_id_R[rows].contiguous(),
        position_R=layout.position_R[rows].contiguous(),
    )
    return part, rows


def reference(teachers: list[Mesh], step: SyntheticStep, dtype: torch.dtype, o: int):
    """All-gather every teacher rank's (keys, rows) for owner ``o``; return them sorted by key."""
    rank = dist.get_rank()
    world = dist.get_world_size()
    m = teachers[o]
    h = hidden_of(o)
    if m.is_last_stage(rank):
        c = m.coord(rank)
        lay = step.teacher_layouts[o][(c.dp_rank, c.cp_rank)]
        keys = encode_keys(lay.sample_id_R, lay.position_R, STRIDE)
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
    return all_k[order], all_r[order]


def expected_rows(layout: TokenLayout, ref, h: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of ``layout`` looked up by key in ``ref``; zero where the owner holds no such key."""
    keys_sorted, rows_sorted = ref
    keys = encode_keys(layout.sample_id_R, layout.position_R, STRIDE)
    out = torch.zeros((layout.num_rows, h), dtype=dtype)
    if keys_sorted.numel():
        pos = torch.searchsorted(keys_sorted, keys).clamp(max=keys_sorted.numel() - 1)
        hit = (keys >= 0) & (keys_sorted[pos] == keys)
        out[hit] = rows_sorted[pos[hit]]
    return out


def build_step(case: int, teachers: list[Mesh], student: Mesh, num_samples: int = 7):
    t_fmt, s_fmt, _, _ = VARIANTS[CASES[case][1]]
    return synthetic_step(
        teachers=teachers,
        student=student,
        num_samples=num_samples,
        max_len=11,
        teacher_formats=[t_fmt] * len(teachers),
        student_format=s_fmt,
        seed=case,
    )


def run_case(case: int, repeat: int = 1, hook=None) -> dict:
    """Exchange case ``case`` (``repeat`` times, the same layouts and buffers), checking every
    student row against the reference each time; ``hook``: the executor's debug hook. Returns
    what later checks need (``stats``: schedules built and staging allocations after each)."""
    mi, vi = CASES[case]
    name, teachers, student = MESHES[mi]
    _, _, dtype, keep_sp = VARIANTS[vi]
    rank = dist.get_rank()
    step = build_step(case, teachers, student)
    refs = [reference(teachers, step, dtype, o) for o in range(len(teachers))]
    bridge = make_bridge(
        pool(),
        teachers,
        student,
        [hidden_of(o) for o in range(len(teachers))],
        timeout_s=60,
        keep_sp_shard=keep_sp,
    )
    if bridge.groups.bridge is None:
        return {}
    poison_outputs(bridge)
    bridge.executor.debug_hook = hook
    hidden, layouts = {}, {}
    for o, m in enumerate(teachers):
        if m.is_last_stage(rank):
            c = m.coord(rank)
            lay = step.teacher_layouts[o][(c.dp_rank, c.cp_rank)]
            hidden[o] = key_pattern(lay, hidden_of(o), dtype, salt=o).view(-1, 1, hidden_of(o))
            layouts[o] = lay
    stu_layout, rows = None, slice(None)
    sc = student.coord(rank)
    if student.is_last_stage(rank):
        stu_layout = step.student_layouts[(sc.dp_rank, sc.cp_rank)]
        if keep_sp:
            stu_layout, rows = sp_slice(stu_layout, student.tp, sc.tp_rank)
    route = dict(zip(step.sample_ids.tolist(), step.route.tolist(), strict=True))
    out: dict = {"bridge": bridge, "step": step, "stats": []}
    for _ in range(repeat):
        handle = bridge.exchange(hidden=hidden, layouts=layouts, student_layout=stu_layout)
        got = handle.wait()
        out["handle"] = handle
        stats = bridge.executor.memory_stats()
        out["stats"].append((bridge.executor.schedules_built, stats["staging_allocations"]))
        if stu_layout is None:
            assert got == {} and handle.owner_N is None
            continue
        full = step.student_layouts[(sc.dp_rank, sc.cp_rank)]
        want_owner = torch.tensor(
            [route[s] if s >= 0 else -1 for s in full.sample_id_R[rows].tolist()]
        )
        # read after wait(): the mask describes the rows wait() returned, still valid
        assert torch.equal(handle.owner_N, want_owner), f"{name}: owner_N"
        assert torch.equal(handle.step.owner(0), want_owner)
        wanted = compact_rows(  # teacher o's tokens of the layout, in order
            {
                o: expected_rows(full, refs[o], hidden_of(o), dtype)[rows]
                for o in range(len(teachers))
            },
            want_owner,
        )
        for o, want in wanted.items():
            assert got[o].shape == want.shape, f"{name}: teacher {o} shape"
            assert torch.equal(bits(got[o]), bits(want)), f"{name}: teacher {o} rows differ"
            # one row per token: the step's receive memory is the layout's tokens, not K x N
            assert got[o].untyped_storage().nbytes() <= (
                (want.shape[0] + max(student.tp - 1, 0)) * got[o].shape[1] * got[o].element_size()
            ), f"{name}: teacher {o} buffer holds more than its rows (+ tp - 1 padding)"
    return out


@pytest.mark.parametrize(
    "case", range(len(CASES)), ids=lambda c: f"{MESHES[CASES[c][0]][0]}/v{CASES[c][1]}"
)
def test_exchange_bit_exact(case):
    run_case(case)


def test_at_least_30_combinations_with_uneven_slices():
    assert len(CASES) >= 30
    uneven = 0
    for case, (mi, vi) in enumerate(CASES):
        _, teachers, student = MESHES[mi]
        if not VARIANTS[vi][3] and student.tp > 1:
            lays = build_step(case, teachers, student).student_layouts.values()
            uneven += sum(lay.num_rows % student.tp != 0 for lay in lays)
    assert uneven, "no student shard splits unevenly over its TP ranks"


def test_repeat_reuses_schedules_and_staging():
    """Four exchanges of the same layouts on one bridge: the first builds this rank's schedule,
    the others reuse it; staging is reused from the second on (the pool hands out its free
    buffers last-in first-out, so the second may swap one too small for a peer for a larger
    one); each still delivers exact rows into fresh outputs."""
    out = run_case(0, repeat=4)
    if out:
        stats = out["stats"]
        assert stats[0][0] <= 1, f"one exchange built {stats[0][0]} schedules"
        assert {b for b, _ in stats} == {stats[0][0]}, f"repeats built schedules: {stats}"
        assert stats[3] == stats[2] == stats[1], f"repeats allocated staging: {stats}"
        assert stats[1][1] <= stats[0][1] + 1, stats
        assert out["bridge"].executor.memory_stats()["schedules"] == stats[0][0]


def test_cross_rank_bytes_equal_the_minimum():
    """Bytes every rank's sends actually posted to other ranks == the schedules' figure == the
    minimum, per case."""
    for case in (0, 12, 13, 26):
        mi, vi = CASES[case]
        name, teachers, student = MESHES[mi]
        keep_sp = VARIANTS[vi][3]
        posted = torch.zeros(1, dtype=torch.int64)
        planned = torch.zeros(1, dtype=torch.int64)
        rank = dist.get_rank()

        def count(point, blocks, posted=posted, rank=rank):
            if point == "packed":
                for _owner, peer, buf in blocks:
                    assert peer != rank, "a send to self with local_copy on"
                    posted[0] += buf.numel() * buf.element_size()

        out = run_case(case, hook=count)
        if out:
            sched = out["handle"].step._slots[0].schedule
            if sched is not None:
                planned[0] = sched.counts()["send_bytes"]
        dist.all_reduce(posted)
        dist.all_reduce(planned)
        step = build_step(case, teachers, student)
        itemsize = VARIANTS[vi][2].itemsize
        minimum = 0
        for (d, c), lay in step.student_layouts.items():
            dst = student.tp_group_ranks(dp_rank=d, cp_rank=c)
            if keep_sp:
                owner_of_row = np.concatenate(
                    [
                        [t] * len(p)
                        for t, p in enumerate(np.array_split(np.arange(lay.num_rows), student.tp))
                    ]
                ).astype(int)
            else:
                per = -(-lay.num_rows // student.tp)
                owner_of_row = np.arange(lay.num_rows) // per
            for o, m in enumerate(teachers):
                for (td, tc), tl in step.teacher_layouts[o].items():
                    held = set(zip(tl.sample_id_R.tolist(), tl.position_R.tolist(), strict=True))
                    reps = m.tp_group_ranks(dp_rank=td, cp_rank=tc)
                    for r, key in enumerate(
                        zip(lay.sample_id_R.tolist(), lay.position_R.tolist(), strict=True)
                    ):
                        if key[0] >= 0 and key in held and dst[owner_of_row[r]] not in reps:
                            minimum += hidden_of(o) * itemsize
        assert minimum > 0, f"{name}: nothing crosses, the case proves nothing"
        assert int(planned) == minimum, (name, int(planned), minimum)
        assert int(posted) == minimum, (name, int(posted), minimum)


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
    assert got.vocab_start == s * per and got.vocab_size == v
