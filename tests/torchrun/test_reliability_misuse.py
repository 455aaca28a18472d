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

import dataclasses
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
    VocabSpec,
    create_bridge_groups,
    padded_layout,
    reshard_lm_head,
)
from mopd.bridge import api as api_mod
from mopd.bridge import executor as executor_mod
from mopd.profiling.synthetic import key_pattern
from tests.support import bridges

TORCHRUN_NPROC = 4
TORCHRUN_TIMEOUT = 240

TEACHER = Mesh(tp=2)  # global ranks 0, 1
STUDENT = Mesh(tp=2, rank_offset=2)  # global ranks 2, 3
POOL = GroupPool(backend="gloo")
H = 8
TIMEOUT_S = 20.0  # generous: a case that waits on a peer would show up in the elapsed time
FAST_S = 10.0  # every case must fail faster than this (it waits on nobody)


def make_bridge(teachers=(TEACHER,), student=STUDENT, **config) -> HiddenStateBridge:
    return bridges.make_bridge(
        POOL, teachers, student, [H] * len(teachers), timeout_s=TIMEOUT_S, **config
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


def fails_alike(
    bridge: HiddenStateBridge, call: Callable[[], Any], match: str, *, exchanges: int = 0
) -> str:
    """``call`` raises the same ``ValueError`` on every rank, fast, with nothing posted
    (the bridge had started ``exchanges`` before)."""
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=match) as info:
        call()
    elapsed = time.monotonic() - t0
    assert elapsed < FAST_S, f"took {elapsed:.1f} s: a rank waited on a peer"
    assert bridge.executor.exchanges == exchanges, "data moved before the error"
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
    """On every rank: the second start completes the first where they share outputs, then runs."""
    b = make_bridge()
    prepared = b.prepare(**kwargs())
    first = b.start(prepared)
    second = b.start(prepared)  # every rank: nothing raises, nobody is left with stray sends
    holds_outputs = STUDENT.is_last_stage(rank())
    # ranks whose outputs the second exchange reuses completed the first one at its start
    assert first.flight.done == holds_outputs
    got = second.wait()
    assert first.wait() is not None and first.flight.done
    if holds_outputs:
        want = key_pattern(padded_layout([0, 1], 4), H, torch.float32)
        assert torch.equal(got[0].view(torch.int32), want.view(torch.int32))
    b.exchange(**kwargs()).wait()  # and the bridge goes on


# --- review fixes: student TP group, non-layout inputs, metadata group, plan cache hits ---------


def test_student_tp_group_missing_on_one_rank():
    b = make_bridge()
    if rank() == 3:
        b = HiddenStateBridge(
            teachers=b.teachers,
            student=b.student,
            groups=dataclasses.replace(b.groups, student_tp=None),
            config=b.config,
        )
    msg = fails_alike(b, lambda: b.exchange(**kwargs()), "groups.student_tp is None")
    assert msg.startswith("bridge input rejected on global rank(s) [3]")
    assert "[2, 3]" in msg


def test_student_tp_group_over_the_wrong_ranks():
    b = make_bridge()
    if rank() == 2:  # the bridge group (ranks 0-3) passed as the student TP group
        b = HiddenStateBridge(
            teachers=b.teachers,
            student=b.student,
            groups=dataclasses.replace(b.groups, student_tp=b.groups.bridge),
            config=b.config,
        )
    fails_alike(
        b,
        lambda: b.exchange(**kwargs()),
        r"global rank 2: groups.student_tp spans global ranks \[0, 1, 2, 3\] but this rank's "
        r"student TP group \(dp=0, cp=0\) is \[2, 3\]",
    )


def test_keep_sp_shard_needs_no_student_tp_group():
    b = make_bridge(keep_sp_shard=True)
    b = HiddenStateBridge(
        teachers=b.teachers,
        student=b.student,
        groups=dataclasses.replace(b.groups, student_tp=None),
        config=b.config,
    )
    got = b.exchange(**kwargs(outputs=False)).wait()
    if STUDENT.is_last_stage(rank()):
        j = STUDENT.coord(rank()).tp_rank
        want = key_pattern(padded_layout([0, 1], 4), H, torch.float32)[4 * j : 4 * (j + 1)]
        assert torch.equal(got[0].view(torch.int32), want.view(torch.int32))


def test_a_list_where_a_layout_belongs():
    b = make_bridge()
    kw = kwargs()
    if rank() == 0:
        kw["layouts"] = {0: [1, 2]}
    fails_alike(
        b,
        lambda: b.exchange(**kw),
        r"global rank 0: layouts\[0\] must be a TokenLayout or a zero-argument callable "
        r"returning one, got list",
    )


def test_a_tensor_as_the_student_layout():
    b = make_bridge()
    kw = kwargs()
    if rank() == 2:
        kw["student_layout"] = torch.zeros(3)
    fails_alike(b, lambda: b.exchange(**kw), "global rank 2: student_layout must be a TokenLayout")


def test_a_layout_callable_raising_something_other_than_value_error():
    b = make_bridge()
    kw = kwargs()
    if rank() == 1:

        def broken() -> Any:
            raise TypeError("unsupported operand")

        kw["layouts"] = {0: broken}
    fails_alike(
        b,
        lambda: b.exchange(**kw),
        r"global rank 1: layouts\[0\]: the layout callable raised TypeError: unsupported operand",
    )


def test_hidden_that_is_not_a_mapping():
    b = make_bridge()
    kw = kwargs()
    if rank() == 0:
        kw["hidden"] = [kw["hidden"][0]]
    fails_alike(b, lambda: b.exchange(**kw), "global rank 0: hidden must be a mapping")


def test_lm_head_weight_that_is_not_a_tensor():
    groups = create_bridge_groups(POOL, [TEACHER], STUDENT)
    weight = None
    if TEACHER.is_last_stage(rank()):
        weight = torch.zeros(4, H) if rank() == 0 else torch.zeros(4, H).numpy()
    t0 = time.monotonic()
    with pytest.raises(
        ValueError, match=r"weight shard must be a torch\.Tensor, got ndarray"
    ) as info:
        reshard_lm_head(
            weight,
            teacher=TEACHER,
            student=STUDENT,
            vocab=VocabSpec(vocab_size=8, teacher_padded=8, student_padded=8),
            hidden_size=H,
            groups=groups,
            timeout_s=TIMEOUT_S,
        )
    assert time.monotonic() - t0 < FAST_S
    msgs: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(msgs, str(info.value))
    assert all(m == msgs[0] for m in msgs), msgs


def test_metadata_and_verdict_go_over_a_gloo_group_beside_the_data_group(monkeypatch):
    """A pool without a backend gets a separate gloo group for the host-side metadata."""
    pool = GroupPool()  # the default backend (gloo here; NCCL in a GPU job)
    groups = create_bridge_groups(pool, [TEACHER], STUDENT)
    assert groups.meta is not None and groups.meta is not groups.bridge
    assert dist.get_backend(groups.meta) == "gloo"
    assert dist.get_process_group_ranks(groups.meta) == [0, 1, 2, 3]
    # a gloo pool reuses its bridge group: no extra group, no collective
    gloo = create_bridge_groups(POOL, [TEACHER], STUDENT)
    assert gloo.meta is gloo.bridge
    seen: list[tuple[str, Any]] = []
    real_gather = api_mod.gather_record_matrix
    real_flat = executor_mod.all_gather_flat

    def gather(record, *, group, device, **kw):
        seen.append(("metadata", group, device))
        return real_gather(record, group=group, device=device, **kw)

    def flat(output, input_, *, group, timeout):
        seen.append(("all-gather", group, output.device))
        return real_flat(output, input_, group=group, timeout=timeout)

    monkeypatch.setattr(api_mod, "gather_record_matrix", gather)
    monkeypatch.setattr(executor_mod, "all_gather_flat", flat)
    b = HiddenStateBridge(
        teachers=[TeacherSpec(mesh=TEACHER, hidden_size=H)],
        student=STUDENT,
        groups=groups,
        config=BridgeConfig(timeout_s=TIMEOUT_S, integrity=True),
    )
    got = b.exchange(**kwargs()).wait()
    assert seen[0] == ("metadata", groups.meta, torch.device("cpu"))
    verdicts = [g for kind, g, _ in seen if kind == "all-gather" and g is not groups.student_tp]
    assert verdicts == [groups.meta]
    if STUDENT.is_last_stage(rank()):
        want = key_pattern(padded_layout([0, 1], 4), H, torch.float32)
        assert torch.equal(got[0].view(torch.int32), want.view(torch.int32))


def test_a_plan_cache_hit_skips_decoding_and_validation(monkeypatch):
    decoded: list[int] = []
    real = api_mod.decode_records

    def decode(matrix, sizes, members):
        decoded.append(len(members))
        return real(matrix, sizes, members)

    monkeypatch.setattr(api_mod, "decode_records", decode)
    b = make_bridge()
    want = {s: key_pattern(padded_layout(list(s), 4), H, torch.float32) for s in [(0, 1), (1, 0)]}

    def check(got: dict, s_samples) -> None:
        if STUDENT.is_last_stage(rank()):
            assert torch.equal(got[0].view(torch.int32), want[s_samples].view(torch.int32))

    for _ in range(3):  # same layouts and buffers: one validation, then hits
        check(b.exchange(**kwargs()).wait(), (0, 1))
    assert b.validations == 1 and len(decoded) == 1
    check(b.exchange(**kwargs(s_samples=(1, 0))).wait(), (1, 0))  # new layouts: a miss
    assert b.validations == 2
    for _ in range(2):  # allocated outputs on a hit: the cached hidden size and dtype
        got = b.exchange(**kwargs(outputs=False)).wait()
        check(got, (0, 1))
        if STUDENT.is_last_stage(rank()):
            assert got[0].dtype == torch.float32 and got[0].shape == (8, H)
    assert b.validations == 3 and len(decoded) == 3
    kw = kwargs()  # an error after hits: new metadata, so validated (and rejected) everywhere
    if rank() == 1:
        kw["hidden"] = {0: kw["hidden"][0][:, :, : H - 2].contiguous()}
    fails_alike(
        b,
        lambda: b.exchange(**kw),
        "global rank 1: hidden size 6, expected 8",
        exchanges=b.executor.exchanges,
    )
    check(b.exchange(**kwargs()).wait(), (0, 1))  # and the cached plan still serves
    assert b.validations == 4


def test_a_good_exchange_after_every_misuse():
    b = make_bridge()
    kw = kwargs(s_samples=(1, 0))
    got = b.exchange(**kw).wait()
    if STUDENT.is_last_stage(rank()):
        want = key_pattern(padded_layout([1, 0], 4), H, torch.float32)
        assert torch.equal(got[0].view(torch.int32), want.view(torch.int32))


def test_nccl_bridge_groups_are_set_up_at_creation(monkeypatch):
    """An NCCL bridge group: every member, and only members, pass one barrier on it at creation
    (NCCL builds a communicator in a group's first collective, which needs every member; the
    first use of the group is a batched send/recv that ranks without transfers skip)."""
    from mopd.bridge import groups as groups_mod

    calls: list[tuple[Any, Any]] = []
    monkeypatch.setattr(groups_mod, "group_moves_cuda", lambda group: True)
    monkeypatch.setattr(groups_mod.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(groups_mod.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        groups_mod.dist,
        "barrier",
        lambda group=None, device_ids=None: calls.append((group, device_ids)),
    )
    teacher, student = Mesh(), Mesh(tp=2, rank_offset=1)  # global ranks 0-2; rank 3 outside
    groups = create_bridge_groups(GroupPool(backend="gloo"), [teacher], student)
    monkeypatch.undo()
    if rank() == 3:
        assert calls == [] and groups.bridge is None
    else:
        assert calls == [(groups.bridge, [0])]
