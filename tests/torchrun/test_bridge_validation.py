"""Tier 2 (4 ranks, gloo): bad input raises the same ValueError on every rank, and nothing hangs.

Each case breaks one thing on one or some ranks only, through ``exchange`` or ``plan_step``:
every rank must raise a ``ValueError`` with the identical message (checked by gathering the
messages), before any row moves (no rank's executor posted or packed anything), and the same
bridge must then run a good exchange bit-exactly (no rank was left inside a collective, the
bridge is still usable). Cases: a token needed but held by nobody, a token held twice, a teacher
buffer given to ``exchange`` with the wrong hidden size, rows, dtype or device on one rank (or
not contiguous, not a tensor, for a teacher the rank does not hold, missing), sequence lengths
CP cannot split, TP replicas with different layouts or dtypes, ranks built with different
settings, a student TP group missing, micro-batch counts that differ between ranks or between
one rank's own sections, layouts given where none belong (or missing), a teacher dtype unknown
at planning, a layout callable that fails; meshes larger than the world and live groups in the
wrong order.

Misuse of a planned step is known to the misusing rank only: a ``send`` out of order or twice,
and a ``receive`` on a colocated rank before its own ``send``, raise a ``BridgeStateError`` there
that says what to call first; the step then completes with exact rows once the calls are made
in order, so the other ranks never hang.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from mopd.bridge import (
    BridgeConfig,
    BridgeGroups,
    BridgeStateError,
    GroupPool,
    HiddenStateBridge,
    Mesh,
    TeacherSpec,
    TokenLayout,
    create_bridge_groups,
    mesh_from_groups,
    padded_layout,
)
from mopd.profiling.synthetic import key_pattern
from tests.support import bridges

TORCHRUN_NPROC = 4
TORCHRUN_TIMEOUT = 240
TORCHRUN_STRICT_P2P = 1  # NCCL's point-to-point rules (tests/support/strict_p2p.py)

TEACHER = Mesh(tp=2)  # ranks 0, 1
STUDENT = Mesh(tp=2, rank_offset=2)  # ranks 2, 3
COLOCATED = Mesh(tp=2, dp=2)  # ranks 0-3: a student sharing the teacher's ranks
POOL = GroupPool(backend="gloo", timeout_s=120)
H = 8
F32 = torch.float32


def make_bridge(
    hidden_size: int = H,
    teacher: Mesh = TEACHER,
    student: Mesh = STUDENT,
    dtype: torch.dtype | None = None,
    **config: Any,
) -> HiddenStateBridge:
    return bridges.make_bridge(
        POOL, [teacher], student, [hidden_size], dtype=dtype, timeout_s=30, **config
    )


def watch(b: HiddenStateBridge) -> list[str]:
    """Every data-path event of ``b``'s executor on this rank ("packed", "posted", ...)."""
    seen: list[str] = []
    b.executor.debug_hook = lambda point, blocks: seen.append(point)
    return seen


def same_error_everywhere(b: HiddenStateBridge | None, fn: Callable[[], Any], match: str) -> str:
    """``fn`` raises a ValueError matching ``match`` on every rank, the same text everywhere,
    and (given the bridge) before its executor took, packed or posted anything."""
    seen = watch(b) if b is not None else []
    with pytest.raises(ValueError, match=match) as info:
        fn()
    msgs: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(msgs, str(info.value))
    assert all(m == msgs[0] for m in msgs), msgs
    if b is not None:
        moved = b.executor.slots_issued or b.executor.memory_stats()["staging_allocations"]
        assert not seen and not moved, f"data moved before the error: {seen}"
        b.executor.debug_hook = None
    return str(msgs[0])


def args(
    *,
    t_samples=(0, 1),
    s_samples=(0, 1),
    seq=4,
    dtype=F32,
    hidden=H,
    t_layout_fn=None,
    s_layout=None,
    buffer_fn=None,
):
    """``exchange`` keyword arguments for TEACHER -> STUDENT on this rank."""
    rank = dist.get_rank()
    kw: dict[str, Any] = {}
    if TEACHER.is_last_stage(rank):
        lay = t_layout_fn(rank) if t_layout_fn else padded_layout(list(t_samples), seq)
        buf = key_pattern(lay, hidden, dtype)
        kw["hidden"] = {0: buffer_fn(rank, buf) if buffer_fn else buf}
        kw["layouts"] = {0: lay}
    if STUDENT.is_last_stage(rank):
        kw["student_layout"] = (
            s_layout if s_layout is not None else padded_layout(list(s_samples), seq)
        )
    return kw


def good_exchange(b: HiddenStateBridge, samples=(1, 0)) -> None:
    """A correct exchange on ``b`` (TEACHER -> STUDENT) delivers exact rows on the students."""
    got = b.exchange(**args(s_samples=samples)).wait()
    if STUDENT.is_last_stage(dist.get_rank()):
        lay = padded_layout(list(samples), 4)
        want = key_pattern(lay, H, F32)[lay.sample_id_R >= 0]  # compact: the real tokens
        assert torch.equal(got[0].view(torch.int32), want.view(torch.int32))
    else:
        assert got == {}


# --- tokens -------------------------------------------------------------------------------------


def test_missing_token():
    b = make_bridge()
    msg = same_error_everywhere(
        b, lambda: b.exchange(**args(s_samples=(0, 5))), r"sample_id=5, position=0\) is needed"
    )
    assert "bridge input rejected (found by global rank 2" in msg and "micro-batch 0" in msg
    good_exchange(b)


def test_token_held_twice():
    teachers = [Mesh(), Mesh(rank_offset=1)]
    b = bridges.make_bridge(POOL, teachers, STUDENT, [H] * len(teachers), timeout_s=30)
    rank = dist.get_rank()
    lay = padded_layout([0, 1], 4)
    kw: dict[str, Any] = {}
    if rank in (0, 1):
        kw = {"hidden": {rank: key_pattern(lay, H, F32)}, "layouts": {rank: lay}}
    else:
        kw = {"student_layout": lay}
    same_error_everywhere(b, lambda: b.exchange(**kw), "is held twice")


# --- teacher buffers ------------------------------------------------------------------------------


def test_hidden_size_mismatch_on_one_rank():
    b = make_bridge()
    kw = args(
        buffer_fn=lambda r, buf: (
            key_pattern(padded_layout([0, 1], 4), H + 2, F32) if r == 1 else buf
        )
    )
    same_error_everywhere(
        b,
        lambda: b.exchange(**kw),
        r"rejected on global rank\(s\) \[1\]: global rank 1: teacher 0 micro-batch 0: buffer of "
        r"\(8, 10\) has 8 rows of 10, the plan wants 8 rows of 8",
    )
    good_exchange(b)


def test_buffer_rows_do_not_match_the_layout():
    b = make_bridge()
    kw = args(buffer_fn=lambda r, buf: buf[:6].clone() if r == 0 else buf)
    same_error_everywhere(
        b, lambda: b.exchange(**kw), r"\[0\]: .*has 6 rows of 8, the plan wants 8 rows of 8"
    )
    good_exchange(b)


def test_buffer_dtype_differs_from_the_declared_one():
    b = make_bridge(dtype=F32)
    kw = args(buffer_fn=lambda r, buf: buf.to(torch.bfloat16) if r == 0 else buf)
    same_error_everywhere(
        b,
        lambda: b.exchange(**kw),
        r"\[0\]: .*buffer is torch\.bfloat16 on cpu, the plan wants torch\.float32 on cpu",
    )
    good_exchange(b)


def test_tp_replicas_with_different_dtypes():
    b = make_bridge()  # dtype read off the buffers
    kw = args(buffer_fn=lambda r, buf: buf.to(torch.bfloat16) if r == 1 else buf)
    same_error_everywhere(
        b, lambda: b.exchange(**kw), r"global rank 1: .*differ from its TP replica global rank 0"
    )
    good_exchange(b)


def test_device_mismatch():
    b = make_bridge()
    kw = args(buffer_fn=lambda r, buf: buf.to("meta") if r == 1 else buf)
    same_error_everywhere(
        b, lambda: b.exchange(**kw), r"\[1\]: .*on meta, the plan wants torch\.float32 on cpu"
    )
    good_exchange(b)


def test_a_buffer_that_is_not_contiguous_or_not_a_tensor():
    b = make_bridge()
    kw = args(buffer_fn=lambda r, buf: buf.t().contiguous().t() if r == 0 else [1.0])
    same_error_everywhere(
        b, lambda: b.exchange(**kw), r"\[0, 1\]: .*must be contiguous.*must be a torch\.Tensor"
    )


def test_a_buffer_for_a_teacher_the_rank_does_not_hold():
    b = make_bridge()
    rank = dist.get_rank()
    kw = args()
    if rank == 3:  # a student rank passes teacher rows
        kw["hidden"] = {0: torch.zeros(8, H)}
    same_error_everywhere(b, lambda: b.exchange(**kw), r"\[3\]: .*holds no rows of teacher 0")
    kw = args()
    if rank == 0:  # a teacher rank passes its layout but no rows
        del kw["hidden"]
    same_error_everywhere(
        b, lambda: b.exchange(**kw), r"\[0\]: .*a layout but no buffer in hidden\[0\]"
    )
    good_exchange(b)


# --- layouts ------------------------------------------------------------------------------------


def test_sequence_length_not_divisible_by_2cp_on_the_student_only():
    student = Mesh(cp=2, rank_offset=2)
    b = make_bridge(student=student)
    rank = dist.get_rank()
    kw: dict[str, Any] = {}
    if TEACHER.is_last_stage(rank):
        lay = padded_layout([0], 6)
        kw = {"hidden": {0: key_pattern(lay, H, F32)}, "layouts": {0: lay}}
    if student.is_last_stage(rank):
        c = student.coord(rank).cp_rank
        kw = {"student_layout": lambda: padded_layout([0], 6, cp_size=2, cp_rank=c)}
    same_error_everywhere(
        b,
        lambda: b.exchange(**kw),
        r"rejected on global rank\(s\) \[2, 3\].*not divisible by 2\*cp = 4",
    )


def test_a_layout_callable_that_fails():
    b = make_bridge()
    kw = args()
    if dist.get_rank() == 2:
        kw["student_layout"] = lambda: {}["boom"]
    same_error_everywhere(
        b, lambda: b.exchange(**kw), r"\[2\]: .*the layout callable raised KeyError"
    )
    good_exchange(b)


def test_tp_replicas_with_different_layouts():
    b = make_bridge()
    kw = args(t_layout_fn=lambda r: padded_layout([0, 1] if r == 0 else [1, 0], 4))
    same_error_everywhere(
        b, lambda: b.exchange(**kw), "TP replicas \\[0, 1\\].*hold different token layouts"
    )


def test_student_tp_ranks_want_different_layouts():
    b = make_bridge()
    kw = args()
    if dist.get_rank() == 3:
        kw["student_layout"] = padded_layout([1, 0], 4)
    same_error_everywhere(
        b, lambda: b.exchange(**kw), "student TP ranks \\[2, 3\\].*want different token layouts"
    )
    good_exchange(b)


def test_layouts_where_none_belong_or_missing():
    b = make_bridge(dtype=F32)
    rank = dist.get_rank()
    lay = padded_layout([0, 1], 4)
    t = {0: [lay]} if rank < 2 else None
    s = [lay] if rank >= 2 else None
    same_error_everywhere(
        b,
        lambda: b.plan_step(teacher_layouts={0: [lay]}, student_layouts=s),
        r"\[2, 3\]: global rank 2: teacher 0 .*this rank must not pass teacher_layouts\[0\]",
    )
    same_error_everywhere(
        b,
        lambda: b.plan_step(teacher_layouts=t if rank != 1 else None, student_layouts=s),
        r"\[1\]: global rank 1: teacher 0 .*this rank must pass teacher_layouts\[0\]",
    )
    same_error_everywhere(
        b,
        lambda: b.plan_step(teacher_layouts=t, student_layouts=s if rank != 3 else None),
        r"\[3\]: .*student .*this rank must pass student_layouts",
    )
    same_error_everywhere(
        b,
        lambda: b.plan_step(teacher_layouts={5: [lay]} if rank == 0 else t, student_layouts=s),
        r"\[0\]: global rank 0: teacher index 5 outside \[0, 1\)",
    )
    same_error_everywhere(
        b,
        lambda: b.plan_step(teacher_layouts=t, student_layouts=[] if rank >= 2 else None),
        r"\[2, 3\]: .*student_layouts must be a non-empty sequence",
    )
    good_exchange(b)


def test_a_teacher_dtype_unknown_at_planning():
    b = make_bridge()  # TeacherSpec(dtype=None): only exchange (which sees the buffer) can plan
    rank = dist.get_rank()
    lay = padded_layout([0, 1], 4)
    same_error_everywhere(
        b,
        lambda: b.plan_step(
            teacher_layouts={0: [lay]} if rank < 2 else None,
            student_layouts=[lay] if rank >= 2 else None,
        ),
        r"\[0, 1\]: global rank 0: teacher 0: its dtype is unknown; give TeacherSpec\(dtype=",
    )
    good_exchange(b)


# --- micro-batch counts ---------------------------------------------------------------------------


def test_micro_batch_counts_that_differ_between_ranks():
    b = make_bridge(dtype=F32)
    rank = dist.get_rank()
    lay = padded_layout([0, 1], 4)
    same_error_everywhere(
        b,
        lambda: b.plan_step(
            teacher_layouts={0: [lay, lay]} if rank < 2 else None,
            student_layouts=[lay, lay, lay] if rank >= 2 else None,
        ),
        r"ranks give different micro-batch counts: 2 on global ranks \[0, 1\], 3 on global "
        r"ranks \[2, 3\]",
    )
    good_exchange(b)


def test_micro_batch_counts_that_differ_between_one_ranks_own_layouts():
    b = make_bridge(student=COLOCATED, dtype=F32)
    rank = dist.get_rank()
    lay = padded_layout([0, 1], 4)
    c = COLOCATED.coord(rank)
    mine = padded_layout([0] if c.dp_rank == 0 else [1], 4)
    same_error_everywhere(
        b,
        lambda: b.plan_step(
            teacher_layouts={0: [lay, lay]} if rank < 2 else None,
            student_layouts=[mine] * 3,
        ),
        r"\[0, 1\]: global rank 0: this rank gives different micro-batch counts: teacher 0's "
        r"layouts 2, the student's layouts 3",
    )


# --- settings -----------------------------------------------------------------------------------


def test_ranks_built_with_different_settings():
    b = make_bridge(hidden_size=H if dist.get_rank() != 3 else H + 1)
    same_error_everywhere(b, lambda: b.exchange(**args()), "different meshes or settings")


def test_a_student_tp_group_missing():
    groups = create_bridge_groups(POOL, [TEACHER], STUDENT)
    broken = BridgeGroups(
        bridge=groups.bridge,
        student_tp=groups.student_tp if dist.get_rank() != 2 else None,
        members=groups.members,
        meta=groups.meta,
    )
    b = HiddenStateBridge(
        teachers=[TeacherSpec(mesh=TEACHER, hidden_size=H)],
        student=STUDENT,
        groups=broken,
        config=BridgeConfig(timeout_s=30),
    )
    same_error_everywhere(
        b, lambda: b.exchange(**args()), r"\[2\]: global rank 2: .*groups\.student_tp is None"
    )


def test_mesh_larger_than_the_world():
    same_error_everywhere(
        None,
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


def test_settings_that_cannot_be_met():
    groups = create_bridge_groups(POOL, [COLOCATED], COLOCATED)
    with pytest.raises(ValueError, match="gloo has no send-to-self"):
        HiddenStateBridge(
            teachers=[TeacherSpec(mesh=COLOCATED, hidden_size=H)],
            student=COLOCATED,
            groups=groups,
            config=BridgeConfig(local_copy=False),
        )
    with pytest.raises(ValueError, match="groups were created for global ranks \\[0, 1, 2, 3\\]"):
        HiddenStateBridge(
            teachers=[TeacherSpec(mesh=TEACHER, hidden_size=H)],
            student=Mesh(rank_offset=2),
            groups=groups,
        )
    for bad in ({"timeout_s": 0}, {"max_cached_plans": 0}, {"local_copy": 1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            BridgeConfig(**bad)
    b = make_bridge(local_copy=False)  # disjoint meshes: nothing to send to self, fine
    good_exchange(b)


def test_good_exchange_after_the_errors():
    good_exchange(make_bridge())


# --- misuse of a planned step: the misusing rank is told, nothing is lost -----------------------


def _step_layouts(n: int, mesh: Mesh = STUDENT) -> tuple[list[TokenLayout], list[TokenLayout]]:
    """``n`` micro-batches: the teacher holds samples ``(2i, 2i + 1)``; the student (``mesh``)
    wants them in the other order, split over its DP ranks."""
    teacher = [padded_layout([2 * i, 2 * i + 1], 4) for i in range(n)]
    rank = dist.get_rank()
    c = mesh.coord(rank)
    d, dp = (c.dp_rank, mesh.dp) if c is not None else (0, 1)
    student = [padded_layout([2 * i + 1, 2 * i][d::dp], 4) for i in range(n)]
    return teacher, student


def _check_rows(got: dict[int, torch.Tensor], layout: TokenLayout, what: str) -> None:
    want = key_pattern(layout, H, F32)[layout.sample_id_R >= 0]  # compact: the real tokens
    assert torch.equal(got[0].view(torch.int32), want.view(torch.int32)), what


def test_send_out_of_order_is_refused_and_then_completes():
    b = make_bridge(dtype=F32)
    rank = dist.get_rank()
    t_lays, s_lays = _step_layouts(2)
    teacher, student = rank < 2, rank >= 2
    step = b.plan_step(
        teacher_layouts={0: t_lays} if teacher else None,
        student_layouts=s_lays if student else None,
    )
    if teacher:
        with pytest.raises(BridgeStateError, match=r"call send\(0, \.\.\.\) before"):
            step.send(1, {0: key_pattern(t_lays[1], H, F32)})
        assert b.executor.slots_issued == 0  # nothing posted out of order
        step.send(0, {0: key_pattern(t_lays[0], H, F32)})
    if student:
        for i in range(2):
            _check_rows(step.receive(i), s_lays[i], f"micro-batch {i}")
    step.finish()


def test_send_twice_is_refused_and_changes_nothing():
    b = make_bridge(dtype=F32)
    rank = dist.get_rank()
    t_lays, s_lays = _step_layouts(1)
    with b.plan_step(
        teacher_layouts={0: t_lays} if rank < 2 else None,
        student_layouts=s_lays if rank >= 2 else None,
    ) as step:
        if rank < 2:
            step.send(0, {0: key_pattern(t_lays[0], H, F32)})
            with pytest.raises(
                BridgeStateError, match="teacher 0's rows of micro-batch 0 were already sent"
            ):
                step.send(0, {0: key_pattern(t_lays[0], H, F32, salt=9)})
        else:
            with pytest.raises(ValueError, match="this rank holds no rows of teacher 0"):
                step.send(0, {0: torch.zeros(8, H)})
            _check_rows(step.receive(0), s_lays[0], "the first send's rows")
    assert step.finished
    with pytest.raises(BridgeStateError, match="this step is finished"):
        step.receive(0)
    with pytest.raises(ValueError, match=r"micro-batch 3 outside \[0, 1\)"):
        b.plan_step(
            teacher_layouts={0: t_lays} if rank < 2 else None,
            student_layouts=s_lays if rank >= 2 else None,
        ).receive(3)


def test_receive_before_the_needed_send_on_a_colocated_rank():
    b = make_bridge(student=COLOCATED, dtype=F32)
    rank = dist.get_rank()
    t_lays, s_lays = _step_layouts(2, COLOCATED)
    teacher = rank < 2
    step = b.plan_step(teacher_layouts={0: t_lays} if teacher else None, student_layouts=s_lays)
    if teacher:  # ranks 0, 1 hold teacher rows every student rank needs
        with pytest.raises(
            BridgeStateError,
            match=r"receive\(0\) needs micro-batch 0 posted first, and this rank holds rows of "
            r"teacher\(s\) \[0\] for it: call send\(0, \.\.\.\) before",
        ):
            step.receive(0)
    for i in range(2):  # inline: send micro-batch i, then receive it
        if teacher:
            step.send(i, {0: key_pattern(t_lays[i], H, F32)})
        _check_rows(step.receive(i), s_lays[i], f"micro-batch {i}")
    step.finish()
