"""Tier 2 (4 ranks, gloo): wrong uses of the bridge fail on every rank alike, before data moves.

The misuse matrix of issue 7 (docs/reliability.md lists every case, with the existing ones in
tests/torchrun/test_bridge_validation.py and the unit tiers). Each case here breaks one thing on
one rank (or every rank) and checks that every rank raises the same ``ValueError`` (messages are
all-gathered and compared), quickly (well inside the timeout: nobody waited on an absent peer),
and before any send or receive was posted (the executor's exchange counter is still 0). A good
exchange at the end proves no rank was left inside a collective.

Meshes: the teacher is ``tp2`` on global ranks 0-1, the student ``tp2`` on 2-3, unless a case
says otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

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
    padded_layout,
)
from mopd.bridge.api import BridgeStateError
from mopd.bridge.synthetic import key_pattern

TORCHRUN_NPROC = 4
TORCHRUN_TIMEOUT = 240

TEACHER = Mesh(tp=2)  # global ranks 0, 1
STUDENT = Mesh(tp=2, rank_offset=2)  # global ranks 2, 3
POOL = GroupPool(backend="gloo")
H = 8
TIMEOUT_S = 20.0  # generous: a case that waits on a peer would show up in the elapsed time
FAST_S = 10.0  # every case must fail faster than this (it waits on nobody)


def make_bridge(teachers=(TEACHER,), student=STUDENT, **config) -> HiddenStateBridge:
    groups = create_bridge_groups(POOL, list(teachers), student)
    return HiddenStateBridge(
        teachers=[TeacherSpec(mesh=m, hidden_size=H) for m in teachers],
        student=student,
        groups=groups,
        config=BridgeConfig(timeout_s=TIMEOUT_S, **config),
    )


def kwargs(
    *,
    seq: int = 4,
    t_samples=(0, 1),
    s_samples=(0, 1),
    dtype=torch.float32,
    teacher: Mesh = TEACHER,
    student: Mesh = STUDENT,
    outputs: bool = True,
) -> dict[str, Any]:
    rank = dist.get_rank()
    kw: dict[str, Any] = {}
    if teacher.is_last_stage(rank):
        lay = padded_layout(list(t_samples), seq)
        kw["hidden"] = {0: key_pattern(lay, H, dtype).view(seq, len(t_samples), H)}
        kw["layouts"] = {0: lay}
    if student.is_last_stage(rank):
        lay = padded_layout(list(s_samples), seq)
        kw["student_layout"] = lay
        if outputs:
            kw["outputs"] = {0: torch.full((lay.num_rows, H), float("nan"), dtype=dtype)}
    return kw


def fails_alike(bridge: HiddenStateBridge, call: Callable[[], Any], match: str) -> str:
    """``call`` raises the same ``ValueError`` on every rank, fast, with nothing posted."""
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=match) as info:
        call()
    elapsed = time.monotonic() - t0
    assert elapsed < FAST_S, f"took {elapsed:.1f} s: a rank waited on a peer"
    assert bridge.executor.exchanges == 0, "data moved before the error"
    msgs: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(msgs, str(info.value))
    assert all(m == msgs[0] for m in msgs), msgs
    return str(msgs[0])


def rank() -> int:
    return dist.get_rank()


# --- wrong buffers ---------------------------------------------------------------------------


def test_non_contiguous_hidden_buffer_on_one_rank():
    b = make_bridge()
    kw = kwargs()
    if rank() == 1:
        h = kw["hidden"][0]  # [S, B, H] -> a transposed [B, S, H] view of other memory
        kw["hidden"] = {0: h.transpose(0, 1).contiguous().transpose(0, 1)}
        assert not kw["hidden"][0].is_contiguous()
    msg = fails_alike(b, lambda: b.exchange(**kw), "must be contiguous")
    assert "global rank 1: teacher 0 hidden buffer" in msg


def test_non_contiguous_output_buffer():
    b = make_bridge()
    kw = kwargs()
    if rank() == 3:
        kw["outputs"] = {0: torch.zeros((H, 8)).t()}  # [8, H] view, column-major
    msg = fails_alike(b, lambda: b.exchange(**kw), "must be contiguous")
    assert "global rank 3: output buffer for teacher 0" in msg


def test_output_buffer_on_the_wrong_device():
    b = make_bridge()
    kw = kwargs()
    if rank() == 2:
        kw["outputs"] = {0: torch.empty((8, H), device="meta")}
    fails_alike(
        b,
        lambda: b.exchange(**kw),
        r"output buffer for teacher 0 on global rank 2 is torch.float32 on other, "
        r"expected torch.float32 on cpu",
    )


def test_hidden_buffer_that_is_not_a_tensor():
    b = make_bridge()
    kw = kwargs()
    if rank() == 0:
        kw["hidden"] = {0: kw["hidden"][0].numpy()}
    fails_alike(b, lambda: b.exchange(**kw), "must be a torch.Tensor, got ndarray")


def test_one_dimensional_hidden_buffer():
    b = make_bridge()
    kw = kwargs()
    if rank() == 1:
        kw["hidden"] = {0: kw["hidden"][0].reshape(-1)}
    fails_alike(b, lambda: b.exchange(**kw), r"hidden dim last \(>= 2-D\), got shape \(64,\)")


def test_hidden_rows_disagree_with_the_layout():
    b = make_bridge()
    kw = kwargs()
    if rank() == 0:
        kw["hidden"] = {0: kw["hidden"][0][:3]}
    fails_alike(b, lambda: b.exchange(**kw), "has 6 rows .* but its layout describes 8")


def test_output_aliasing_the_hidden_buffer_on_a_colocated_rank():
    mesh = Mesh(dp=4)
    b = make_bridge(teachers=(mesh,), student=mesh)
    lay = padded_layout([rank()], 4)
    h = key_pattern(lay, H, torch.float32)
    out = h if rank() == 1 else torch.empty_like(h)
    msg = fails_alike(
        b,
        lambda: b.exchange(hidden={0: h}, layouts={0: lay}, student_layout=lay, outputs={0: out}),
        r"outputs\[0\] shares memory with hidden\[0\] on this rank",
    )
    assert msg.startswith("bridge input rejected on global rank(s) [1]")


def test_unsupported_dtype():
    b = make_bridge()
    kw = kwargs(dtype=torch.complex64, outputs=False)
    fails_alike(b, lambda: b.exchange(**kw), "teacher 0 on global rank 0: unsupported dtype")


def test_teacher_replicas_hold_different_dtypes():
    b = make_bridge()
    kw = kwargs(dtype=torch.bfloat16 if rank() == 1 else torch.float32, outputs=False)
    fails_alike(b, lambda: b.exchange(**kw), r"teacher 0: ranks hold different dtypes")


# --- wrong call pattern ----------------------------------------------------------------------


def test_hidden_passed_on_a_student_only_rank():
    b = make_bridge()
    kw = kwargs()
    if rank() == 2:
        kw["hidden"] = {0: torch.zeros(8, H)}
        kw["layouts"] = {0: padded_layout([0, 1], 4)}
    fails_alike(
        b, lambda: b.exchange(**kw), r"this rank must not pass hidden\[0\] and layouts\[0\]"
    )


def test_teacher_rank_passes_nothing():
    b = make_bridge()
    kw = kwargs()
    if rank() == 0:
        kw = {}
    fails_alike(b, lambda: b.exchange(**kw), r"global rank 0: teacher 0 .* this rank must pass")


def test_teacher_index_out_of_range():
    b = make_bridge()
    kw = kwargs()
    if rank() == 1:
        kw["layouts"] = {**kw["layouts"], 1: kw["layouts"][0]}
    fails_alike(b, lambda: b.exchange(**kw), r"teacher index 1 outside \[0, 1\)")


def test_outputs_on_a_rank_without_a_student_shard():
    b = make_bridge()
    kw = kwargs()
    if rank() == 0:
        kw["outputs"] = {0: torch.zeros(8, H)}
    fails_alike(b, lambda: b.exchange(**kw), "outputs given on a rank without a student shard")


def test_student_rank_without_a_student_layout():
    b = make_bridge()
    kw = kwargs()
    if rank() == 3:
        kw = {}
    fails_alike(b, lambda: b.exchange(**kw), "this rank must pass student_layout")


def test_outputs_missing_for_one_of_two_teachers():
    teachers = (Mesh(), Mesh(rank_offset=1))
    b = make_bridge(teachers=teachers)
    lay = padded_layout([rank()], 4)
    kw: dict[str, Any] = {}
    if rank() < 2:
        kw = {"hidden": {rank(): key_pattern(lay, H, torch.float32)}, "layouts": {rank(): lay}}
    else:
        stu = padded_layout([0, 1], 2)
        kw = {"student_layout": stu, "outputs": {0: torch.zeros(4, H)}}
    fails_alike(b, lambda: b.exchange(**kw), r"one buffer per teacher \[0, 1\], got \[0\]")


# --- layouts that disagree across ranks ------------------------------------------------------


def test_student_tp_ranks_want_different_layouts():
    b = make_bridge()
    kw = kwargs(s_samples=(1, 0) if rank() == 3 else (0, 1))
    fails_alike(b, lambda: b.exchange(**kw), r"student TP ranks \[2, 3\] .* want different")


def test_student_rows_do_not_split_over_its_tp_group():
    b = make_bridge()
    kw = kwargs(seq=4)
    if rank() >= 2:
        kw["student_layout"] = padded_layout([0], 3)
        kw["outputs"] = {0: torch.zeros(3, H)}
    fails_alike(b, lambda: b.exchange(**kw), r"3 rows do not split into tp=2 equal slices")


# --- wrong groups and ranks ------------------------------------------------------------------


def test_groups_made_for_other_meshes():
    groups = create_bridge_groups(POOL, [Mesh(tp=2, rank_offset=1)], Mesh(rank_offset=3))
    with pytest.raises(ValueError, match=r"created for global ranks \[1, 2, 3\] but these meshes"):
        HiddenStateBridge(
            teachers=[TeacherSpec(mesh=TEACHER, hidden_size=H)], student=STUDENT, groups=groups
        )


def test_a_rank_outside_every_mesh_calls_the_bridge():
    teacher, student = Mesh(), Mesh(tp=2, rank_offset=1)  # ranks 0..2; rank 3 is outside
    b = make_bridge(teachers=(teacher,), student=student)
    if rank() == 3:
        with pytest.raises(ValueError, match="global rank 3 is in no mesh of this bridge"):
            b.exchange()
        return
    got = b.exchange(**kwargs(teacher=teacher, student=student)).wait()
    if student.is_last_stage(rank()):
        want = key_pattern(padded_layout([0, 1], 4), H, torch.float32)
        assert torch.equal(got[0].view(torch.int32), want.view(torch.int32))


def test_starting_one_prepared_exchange_twice_before_waiting():
    b = make_bridge()
    prepared = b.prepare(**kwargs())
    first = b.start(prepared)
    if STUDENT.is_last_stage(rank()):  # only ranks with outputs can clobber them
        with pytest.raises(BridgeStateError, match="same output buffer is still in flight"):
            b.start(prepared)
    first.wait()
    b.start(prepared).wait()  # after the wait, the same prepared exchange runs again


def test_a_good_exchange_after_every_misuse():
    b = make_bridge()
    kw = kwargs(s_samples=(1, 0))
    got = b.exchange(**kw).wait()
    if STUDENT.is_last_stage(rank()):
        want = key_pattern(padded_layout([1, 0], 4), H, torch.float32)
        assert torch.equal(got[0].view(torch.int32), want.view(torch.int32))
