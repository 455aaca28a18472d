"""Tier 2 (4 ranks, gloo): bad input raises the same ValueError on every rank, and nothing hangs.

Each case breaks one thing on one or some ranks only; every rank must raise a ``ValueError``
with the identical message (checked by gathering the messages), before any row moves. A good
exchange after all of them proves no rank was left inside a collective.
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
    create_bridge_groups,
    mesh_from_groups,
    padded_layout,
)
from mopd.profiling.synthetic import key_pattern
from tests.support import bridges

TORCHRUN_NPROC = 4
TORCHRUN_TIMEOUT = 180

TEACHER = Mesh(tp=2)  # ranks 0, 1
STUDENT = Mesh(tp=2, rank_offset=2)  # ranks 2, 3
POOL = GroupPool(backend="gloo")
H = 8


def make_bridge(hidden_size: int = H, teacher: Mesh = TEACHER, student: Mesh = STUDENT):
    return bridges.make_bridge(POOL, [teacher], student, [hidden_size], timeout_s=30)


def same_error_everywhere(fn, match: str) -> str:
    with pytest.raises(ValueError, match=match) as info:
        fn()
    msgs: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(msgs, str(info.value))
    assert all(m == msgs[0] for m in msgs), msgs
    return msgs[0]


def args(
    *,
    t_samples=(0, 1),
    s_samples=(0, 1),
    seq=4,
    dtype=torch.float32,
    hidden=H,
    out_rows=None,
    out_dtype=None,
    t_layout_fn=None,
    s_layout=None,
    device="cpu",
):
    rank = dist.get_rank()
    kw = {}
    if TEACHER.is_last_stage(rank):
        lay = t_layout_fn(rank) if t_layout_fn else padded_layout(list(t_samples), seq)
        kw["hidden"] = {0: key_pattern(lay, hidden, dtype).to(device)}
        kw["layouts"] = {0: lay}
    if STUDENT.is_last_stage(rank):
        lay = s_layout if s_layout is not None else padded_layout(list(s_samples), seq)
        kw["student_layout"] = lay
        n = out_rows if out_rows is not None else (lay.num_rows if not callable(lay) else 8)
        kw["outputs"] = {0: torch.zeros((n, H), dtype=out_dtype or dtype)}
    return kw


def test_missing_token():
    b = make_bridge()
    same_error_everywhere(
        lambda: b.exchange(**args(s_samples=(0, 5))), r"sample_id=5, position=0\) is needed"
    )


def test_token_held_twice():
    teachers = [Mesh(), Mesh(rank_offset=1)]
    b = bridges.make_bridge(POOL, teachers, STUDENT, [H] * len(teachers), timeout_s=30)
    rank = dist.get_rank()
    lay = padded_layout([0, 1], 4)
    kw = {}
    if rank in (0, 1):
        kw = {"hidden": {rank: key_pattern(lay, H, torch.float32)}, "layouts": {rank: lay}}
    else:
        kw = {"student_layout": lay}
    same_error_everywhere(lambda: b.exchange(**kw), "is held twice")


def test_hidden_size_mismatch_on_one_rank():
    b = make_bridge()
    rank = dist.get_rank()
    kw = args()
    if rank == 1:
        lay = kw["layouts"][0]
        kw["hidden"] = {0: key_pattern(lay, H + 2, torch.float32)}
    same_error_everywhere(lambda: b.exchange(**kw), "global rank 1: hidden size 10, expected 8")


def test_dtype_mismatch_between_output_and_teacher():
    b = make_bridge()
    same_error_everywhere(
        lambda: b.exchange(**args(out_dtype=torch.bfloat16)), "expected torch.float32 on cpu"
    )


def test_device_mismatch():
    b = make_bridge()
    same_error_everywhere(
        lambda: b.exchange(**args(device="meta")), "buffer on other, the bridge group moves cpu"
    )


def test_output_buffer_of_the_wrong_shape():
    b = make_bridge()
    same_error_everywhere(lambda: b.exchange(**args(out_rows=6)), "has 6 rows of 8, expected 8")


def test_sequence_length_not_divisible_by_2cp_on_the_student_only():
    student = Mesh(cp=2, rank_offset=2)
    b = make_bridge(student=student)
    rank = dist.get_rank()
    kw = {}
    if TEACHER.is_last_stage(rank):
        lay = padded_layout([0], 6)
        kw = {"hidden": {0: key_pattern(lay, H, torch.float32)}, "layouts": {0: lay}}
    if student.is_last_stage(rank):
        c = student.coord(rank).cp_rank
        kw = {"student_layout": lambda: padded_layout([0], 6, cp_size=2, cp_rank=c)}
    same_error_everywhere(lambda: b.exchange(**kw), r"not divisible by 2\*cp = 4")


def test_tp_replicas_with_different_layouts():
    b = make_bridge()
    kw = args(t_layout_fn=lambda r: padded_layout([0, 1] if r == 0 else [1, 0], 4))
    same_error_everywhere(lambda: b.exchange(**kw), "hold different token layouts")


def test_ranks_built_with_different_settings():
    b = make_bridge(hidden_size=H if dist.get_rank() != 3 else H + 1)
    same_error_everywhere(lambda: b.exchange(**args()), "different meshes or settings")


def test_mesh_larger_than_the_world():
    same_error_everywhere(
        lambda: create_bridge_groups(POOL, [TEACHER], Mesh(tp=4, rank_offset=2)),
        "global ranks up to 5 but the world has 4 ranks",
    )


def test_mesh_from_live_groups_checks_the_order():
    rank = dist.get_rank()
    # tp groups {0, 2} and {1, 3}: not tp-fastest, not a mesh with offset 0
    POOL.create([0, 2])
    POOL.create([1, 3])
    tp_group = POOL.get([0, 2] if rank % 2 == 0 else [1, 3])
    m = None
    with pytest.raises(ValueError, match="live tp group has ranks") as info:
        m = mesh_from_groups(global_rank=rank, tp_group=tp_group, dp_group=None)
    assert m is None and "tp-cp-dp-pp order" in str(info.value)
    # tp-fastest groups pass and give the right mesh
    POOL.create([0, 1])
    POOL.create([2, 3])
    POOL.create([0, 2])
    tp = POOL.get([0, 1] if rank < 2 else [2, 3])
    dp = POOL.get([0, 2] if rank % 2 == 0 else [1, 3])
    m = mesh_from_groups(global_rank=rank, tp_group=tp, dp_group=dp)
    assert (m.tp, m.cp, m.dp, m.pp, m.rank_offset) == (2, 1, 2, 1, 0)


def test_good_exchange_after_the_errors():
    b = make_bridge()
    h = b.exchange(**args(s_samples=(1, 0)))
    got = h.wait()
    if STUDENT.is_last_stage(dist.get_rank()):
        want = key_pattern(padded_layout([1, 0], 4), H, torch.float32)
        assert torch.equal(got[0], want)


def test_settings_that_cannot_be_met_or_do_nothing():
    colocated = Mesh(tp=2, dp=2)
    groups = create_bridge_groups(POOL, [colocated], colocated)
    spec = [TeacherSpec(mesh=colocated, hidden_size=H)]
    with pytest.raises(ValueError, match="gloo has no send-to-self"):
        HiddenStateBridge(
            teachers=spec, student=colocated, groups=groups, config=BridgeConfig(local_copy=False)
        )
    groups = create_bridge_groups(POOL, [TEACHER], Mesh(dp=2, rank_offset=2))
    with pytest.warns(UserWarning, match="local_copy=False\\) has no effect"):
        HiddenStateBridge(
            teachers=[TeacherSpec(mesh=TEACHER, hidden_size=H)],
            student=Mesh(dp=2, rank_offset=2),
            groups=groups,
            config=BridgeConfig(local_copy=False),
        )
    with pytest.warns(UserWarning, match="keep_sp_shard=True\\) has no effect"):
        HiddenStateBridge(
            teachers=[TeacherSpec(mesh=TEACHER, hidden_size=H)],
            student=Mesh(dp=2, rank_offset=2),
            groups=groups,
            config=BridgeConfig(keep_sp_shard=True),
        )
