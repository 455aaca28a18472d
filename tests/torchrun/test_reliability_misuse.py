"""Tier 2 (4 ranks, gloo): wrong uses of the bridge fail on every rank alike, before data moves.

The misuse matrix (docs/reliability.md lists every case, with the ones in
tests/torchrun/test_bridge_validation.py and the unit tiers). Each case breaks one thing on one
rank (or every rank) and checks that every rank raises the same ``ValueError`` (messages are
all-gathered and compared), quickly (well inside the timeout: nobody waited on an absent peer)
and before any data moved (no micro-batch posted, no staging allocated, no step created). A good
step at the end proves no rank was left inside a collective.

Most cases go through :meth:`HiddenStateBridge.exchange` (one micro-batch: buffers and layouts
in one call, so a bad buffer is judged with the layouts, on every rank); the step API's own
cases go through :meth:`HiddenStateBridge.plan_step` (layouts of several micro-batches, their
counts, their pairing across the two sides, a dtype needed before the teacher ran). The cases
that break one argument (or group) on some ranks are one table, ``MISUSES``, run by
``test_misuse_fails_alike_on_every_rank`` (its ids are the cases' names); the cases of another
shape are tests of their own.

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
    create_bridge_groups,
    padded_layout,
)
from mopd.bridge import api as api_mod
from mopd.bridge import executor as executor_mod
from mopd.bridge import integrity as integrity_mod
from mopd.bridge.lm_head import VocabSpec, reshard_lm_head
from mopd.profiling.synthetic import key_pattern
from tests.support.reliability import everyone, fresh_bridge

TORCHRUN_NPROC = 4
TORCHRUN_TIMEOUT = 300
TORCHRUN_STRICT_P2P = 1  # NCCL's point-to-point rules (tests/support/strict_p2p.py)

TEACHER = Mesh(tp=2)  # global ranks 0, 1
STUDENT = Mesh(tp=2, rank_offset=2)  # global ranks 2, 3
POOL = GroupPool(backend="gloo", timeout_s=120)
H = 8
TIMEOUT_S = 8.0  # a case that waits on a peer would show up in the elapsed time
FAST_S = 4.0  # every case must fail faster than this (it waits on nobody)


def make_bridge(
    teachers=(TEACHER,), student=STUDENT, dtype: torch.dtype | None = torch.float32, **config
) -> HiddenStateBridge:
    return fresh_bridge(
        teachers,
        student,
        [H] * len(teachers),
        timeout_s=TIMEOUT_S,
        pool=POOL,
        dtype=dtype,
        **config,
    )


def rank() -> int:
    return dist.get_rank()


def kwargs(
    *,
    seq: int = 4,
    t_samples=(0, 1),
    s_samples=(0, 1),
    dtype=torch.float32,
    teacher: Mesh = TEACHER,
    student: Mesh = STUDENT,
) -> dict[str, Any]:
    """This rank's ``exchange()`` arguments for one padded ``[S, B]`` micro-batch."""
    kw: dict[str, Any] = {}
    if teacher.is_last_stage(rank()):
        lay = padded_layout(list(t_samples), seq)
        kw["hidden"] = {0: key_pattern(lay, H, dtype).view(seq, len(t_samples), H)}
        kw["layouts"] = {0: lay}
    if student.is_last_stage(rank()):
        kw["student_layout"] = padded_layout(list(s_samples), seq)
    return kw


def plan_kwargs(m: int = 2, *, s_shift: int = 0) -> dict[str, Any]:
    """This rank's ``plan_step()`` arguments: ``m`` micro-batches of two samples each."""
    t = [padded_layout([2 * i, 2 * i + 1], 4) for i in range(m)]
    s = [padded_layout([2 * (i + s_shift), 2 * (i + s_shift) + 1], 4) for i in range(m)]
    return {
        "teacher_layouts": {0: t} if TEACHER.is_last_stage(rank()) else None,
        "student_layouts": s if STUDENT.is_last_stage(rank()) else None,
    }


def fails_alike(bridge: HiddenStateBridge, call: Callable[[], Any], match: str) -> str:
    """``call`` raises the same ``ValueError`` on every rank, fast, before data moves."""
    ex = bridge.executor
    before = (ex.slots_issued, ex.memory_stats()["staging_allocations"], bridge.steps)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=match) as info:
        call()
    elapsed = time.monotonic() - t0
    assert elapsed < FAST_S, f"took {elapsed:.1f} s: a rank waited on a peer"
    after = (ex.slots_issued, ex.memory_stats()["staging_allocations"], bridge.steps)
    assert after == before, f"data moved (or a step was made) before the error: {before} {after}"
    assert ex.lifecycle.failure is None, "bad input must not break the bridge"
    msgs = everyone(str(info.value))
    assert all(m == msgs[0] for m in msgs), msgs
    return str(msgs[0])


def exact_exchange(b: HiddenStateBridge, kw: dict[str, Any], want_samples=(0, 1)) -> None:
    got = b.exchange(**kw).wait()
    if STUDENT.is_last_stage(rank()):
        want = key_pattern(padded_layout(list(want_samples), 4), H, torch.float32)
        assert torch.equal(got[0].view(torch.int32), want.view(torch.int32))


# --- the misuse table: one bad argument (or group) on some ranks, the same ValueError on all ----


def _transposed(kw: dict[str, Any]) -> dict[str, Any]:
    h = kw["hidden"][0]  # [S, B, H] -> a transposed [B, S, H] view of other memory
    h = h.transpose(0, 1).contiguous().transpose(0, 1)
    assert not h.is_contiguous()
    return {**kw, "hidden": {0: h}}


def _raising(error: Exception) -> Callable[[], Any]:
    """A callable (micro-batches' or a layout's) that raises ``error``."""

    def broken() -> Any:
        raise error

    return broken


@dataclasses.dataclass(frozen=True)
class Misuse:
    """One row of the misuse table (docs/reliability.md numbers them).

    A fresh bridge (``make_bridge(**bridge)``; on the ranks ``on``, rebuilt over
    ``groups(its groups)`` when given) and this rank's arguments ``args()`` (on the ranks ``on``,
    ``breaks(arguments)``; ``on=None``: every rank); then ``call`` (``"exchange"`` or
    ``"plan_step"``) fails alike (:func:`fails_alike`) matching ``match``, and the agreed message
    starts with ``starts``, contains ``contains`` and, when given, is ``equals``.
    """

    call: str
    match: str
    on: tuple[int, ...] | None = None
    breaks: Callable[[dict[str, Any]], dict[str, Any]] = lambda kw: kw
    args: Callable[[], dict[str, Any]] = kwargs
    bridge: dict[str, Any] = dataclasses.field(default_factory=dict)
    groups: Callable[[Any], Any] | None = None
    starts: str = ""
    contains: str = ""
    equals: str | None = None


STUDENT_LAST = (2, 3)  # STUDENT's last-stage ranks
UNTYPED = {"dtype": None}  # a bridge that reads the dtype off the buffers

MISUSES = {
    # wrong buffers
    "non_contiguous_hidden_buffer_on_one_rank": Misuse(
        "exchange",
        "must be contiguous",
        on=(1,),
        breaks=_transposed,
        starts="bridge input rejected on global rank(s) [1]: global rank 1: teacher 0 hidden "
        "buffer",
    ),
    "hidden_buffer_that_is_not_a_tensor": Misuse(
        "exchange",
        "must be a torch.Tensor, got ndarray",
        on=(0,),
        breaks=lambda kw: {**kw, "hidden": {0: kw["hidden"][0].numpy()}},
    ),
    "one_dimensional_hidden_buffer": Misuse(
        "exchange",
        r"hidden dim last \(>= 2-D\), got shape \(64,\)",
        on=(1,),
        breaks=lambda kw: {**kw, "hidden": {0: kw["hidden"][0].reshape(-1)}},
    ),
    "hidden_rows_disagree_with_the_layout": Misuse(
        "exchange",
        r"has 6 rows of 8, the plan wants 8 rows of 8",
        on=(0,),
        breaks=lambda kw: {**kw, "hidden": {0: kw["hidden"][0][:3]}},
    ),
    "hidden_size_differs_on_one_rank": Misuse(
        "exchange",
        r"global rank 1: .* rows of 6, the plan wants",
        on=(1,),
        breaks=lambda kw: {**kw, "hidden": {0: kw["hidden"][0][:, :, : H - 2].contiguous()}},
    ),
    "hidden_dtype_differs_from_the_teacher_spec": Misuse(
        "exchange",
        r"global rank 0: teacher 0 micro-batch 0: buffer is torch.bfloat16 on cpu, the plan "
        r"wants torch.float32 on cpu",
        on=(0,),
        breaks=lambda kw: kwargs(dtype=torch.bfloat16),
    ),
    "hidden_buffer_on_the_wrong_device": Misuse(
        "exchange",
        r"the plan wants torch.float32 on cpu",
        on=(1,),
        breaks=lambda kw: {**kw, "hidden": {0: torch.empty((4, 2, H), device="meta")}},
    ),
    "unsupported_dtype": Misuse(
        "exchange",
        r"teacher 0 on global rank 0: unsupported dtype",
        args=lambda: kwargs(dtype=torch.complex64),
        bridge=UNTYPED,
        equals="bridge input rejected (found by global rank 0): teacher 0 on global rank 0: "
        "unsupported dtype",
    ),
    "teacher_replicas_hold_different_dtypes": Misuse(
        "exchange",
        r"teacher 0 on global rank 1: \(dtype, hidden, device\) codes \(1, 8, 0\) differ from "
        r"its TP replica global rank 0's \(0, 8, 0\)",
        on=(1,),
        breaks=lambda kw: kwargs(dtype=torch.bfloat16),
        bridge=UNTYPED,
    ),
    "hidden_that_is_not_a_mapping": Misuse(
        "exchange",
        "global rank 0: hidden must be a mapping",
        on=(0,),
        breaks=lambda kw: {**kw, "hidden": [kw["hidden"][0]]},
    ),
    "layouts_without_their_hidden_buffer": Misuse(
        "exchange",
        r"global rank 1: teacher 0: a layout but no buffer in hidden\[0\]",
        on=(1,),
        breaks=lambda kw: {**kw, "hidden": {}},
    ),
    # wrong call pattern
    "hidden_passed_on_a_student_only_rank": Misuse(
        "exchange",
        r"this rank must not pass teacher_layouts\[0\]",
        on=(2,),
        breaks=lambda kw: {
            **kw,
            "hidden": {0: torch.zeros(8, H)},
            "layouts": {0: padded_layout([0, 1], 4)},
        },
    ),
    "teacher_rank_passes_nothing": Misuse(
        "exchange",
        r"global rank 0: teacher 0 .* this rank must pass",
        on=(0,),
        breaks=lambda kw: {},
    ),
    "teacher_index_out_of_range": Misuse(
        "exchange",
        r"teacher index 1 outside \[0, 1\)",
        on=(1,),
        breaks=lambda kw: {**kw, "layouts": {**kw["layouts"], 1: kw["layouts"][0]}},
    ),
    "student_rank_without_a_student_layout": Misuse(
        "exchange",
        "this rank must pass student_layouts",
        on=(3,),
        breaks=lambda kw: {},
    ),
    "student_layout_on_a_teacher_only_rank": Misuse(
        "exchange",
        "global rank 0: student .* must not pass student",
        on=(0,),
        breaks=lambda kw: {**kw, "student_layout": padded_layout([0, 1], 4)},
    ),
    # the step API: several micro-batches
    "ranks_give_different_micro_batch_counts": Misuse(
        "plan_step",
        r"ranks give different micro-batch counts: 2 on global ranks \[0, 1, 2\], 3 on global "
        r"ranks \[3\]",
        on=(3,),
        args=plan_kwargs,
        breaks=lambda kw: plan_kwargs(3),
    ),
    # micro-batch i pairs with micro-batch i: the student wants in micro-batch 0 the tokens the
    # teacher gives in micro-batch 1 (and the other way round)
    "a_token_the_teacher_holds_in_another_micro_batch": Misuse(
        "plan_step",
        r"micro-batch 0: .*no teacher holds it",
        on=STUDENT_LAST,
        args=plan_kwargs,
        breaks=lambda kw: {**kw, "student_layouts": kw["student_layouts"][::-1]},
        starts="bridge input rejected (found by global rank",
    ),
    "plan_step_before_the_teacher_ran_needs_its_dtype": Misuse(
        "plan_step",
        r"teacher 0: its dtype is unknown; give TeacherSpec\(dtype=...\)",
        args=plan_kwargs,
        bridge=UNTYPED,
    ),
    "teacher_layouts_that_are_not_a_mapping": Misuse(
        "plan_step",
        "global rank 1: teacher_layouts must be a mapping",
        on=(1,),
        args=plan_kwargs,
        breaks=lambda kw: {**kw, "teacher_layouts": kw["teacher_layouts"][0]},
    ),
    "a_single_layout_where_one_per_micro_batch_belongs": Misuse(
        "plan_step",
        r"global rank 2: student_layouts must be a non-empty sequence with one layout per "
        r"micro-batch, got TokenLayout",
        on=(2,),
        args=plan_kwargs,
        breaks=lambda kw: {**kw, "student_layouts": kw["student_layouts"][0]},
    ),
    "a_callable_giving_the_micro_batches_raising": Misuse(
        "plan_step",
        r"global rank 3: student_layouts: the callable raised RuntimeError: data loader died",
        on=(3,),
        args=plan_kwargs,
        breaks=lambda kw: {**kw, "student_layouts": _raising(RuntimeError("data loader died"))},
    ),
    # layouts that disagree across ranks
    "student_tp_ranks_want_different_layouts": Misuse(
        "exchange",
        r"student TP ranks \[2, 3\] .* want different",
        on=(3,),
        breaks=lambda kw: kwargs(s_samples=(1, 0)),
    ),
    "teacher_tp_replicas_hold_different_layouts_in_one_micro_batch": Misuse(
        "plan_step",
        r"teacher 0 TP replicas \[0, 1\] .* hold different token layouts in micro-batch 1",
        on=(1,),
        args=plan_kwargs,
        breaks=lambda kw: {
            **kw,
            "teacher_layouts": {0: [kw["teacher_layouts"][0][0], padded_layout([3, 2], 4)]},
        },
    ),
    # not layouts
    "a_list_where_a_layout_belongs": Misuse(
        "exchange",
        r"global rank 0: teacher_layouts\[0\]\[0\] must be a TokenLayout or a zero-argument "
        r"callable returning one, got list",
        on=(0,),
        breaks=lambda kw: {**kw, "layouts": {0: [1, 2]}},
    ),
    "a_tensor_as_the_student_layout": Misuse(
        "exchange",
        r"global rank 2: student_layouts\[0\] must be a",
        on=(2,),
        breaks=lambda kw: {**kw, "student_layout": torch.zeros(3)},
    ),
    "a_layout_callable_raising_something_other_than_value_error": Misuse(
        "exchange",
        r"global rank 1: teacher_layouts\[0\]\[0\]: the layout callable raised TypeError: "
        r"unsupported operand",
        on=(1,),
        breaks=lambda kw: {**kw, "layouts": {0: _raising(TypeError("unsupported operand"))}},
    ),
    # wrong groups
    "student_tp_group_missing_on_one_rank": Misuse(
        "exchange",
        "groups.student_tp is None",
        on=(3,),
        groups=lambda g: dataclasses.replace(g, student_tp=None),
        starts="bridge input rejected on global rank(s) [3]",
        contains="[2, 3]",
    ),
    # the bridge group (ranks 0-3) passed as the student TP group
    "student_tp_group_over_the_wrong_ranks": Misuse(
        "exchange",
        r"global rank 2: groups.student_tp spans global ranks \[0, 1, 2, 3\] but this rank's "
        r"student TP group \(dp=0, cp=0\) is \[2, 3\]",
        on=(2,),
        groups=lambda g: dataclasses.replace(g, student_tp=g.bridge),
    ),
}


@pytest.mark.parametrize("name", list(MISUSES))
def test_misuse_fails_alike_on_every_rank(name: str) -> None:
    case = MISUSES[name]
    mine = case.on is None or rank() in case.on
    b = make_bridge(**case.bridge)
    if mine and case.groups is not None:
        b = HiddenStateBridge(
            teachers=b.teachers, student=b.student, groups=case.groups(b.groups), config=b.config
        )
    kw = case.args()
    if mine:
        kw = case.breaks(kw)
    call = {"exchange": b.exchange, "plan_step": b.plan_step}[case.call]
    msg = fails_alike(b, lambda: call(**kw), case.match)
    assert msg.startswith(case.starts), msg
    assert case.contains in msg, msg
    if case.equals is not None:
        assert msg == case.equals, msg


# --- the step API: micro-batch counts of one rank's two sections ------------------------------


def test_one_rank_gives_different_micro_batch_counts_for_its_two_sections():
    """Colocated on ranks 0-1 (2-3 are outside these meshes): rank 0 gives its teacher two
    micro-batches and its student one."""
    mesh = Mesh(dp=2)
    b = make_bridge(teachers=(mesh,), student=mesh)
    if rank() >= 2:
        with pytest.raises(ValueError, match=r"global rank . is in no mesh of this bridge"):
            b.plan_step()
        everyone("outside")
        return
    lay = [padded_layout([rank()], 4)] * 2
    t0 = time.monotonic()
    with pytest.raises(ValueError) as info:
        b.plan_step(teacher_layouts={0: lay}, student_layouts=lay[:1] if rank() == 0 else lay)
    elapsed = time.monotonic() - t0
    msgs = everyone(str(info.value))
    assert msgs[0] == msgs[1] and elapsed < FAST_S, (msgs, elapsed)
    assert msgs[0] == (
        "bridge input rejected on global rank(s) [0]: global rank 0: this rank gives different "
        "micro-batch counts: teacher 0's layouts 2, the student's layouts 1"
    ), msgs[0]


# --- layouts that need not agree -------------------------------------------------------------


def test_student_rows_need_not_split_evenly_over_its_tp_group():
    """3 rows over tp=2: slices of 2 and 1 rows (the buffer is padded for the all-gather)."""
    b = make_bridge()
    kw = kwargs()
    if STUDENT.is_last_stage(rank()):
        kw["student_layout"] = padded_layout([0], 3)
    got = b.exchange(**kw).wait()
    if STUDENT.is_last_stage(rank()):
        want = key_pattern(padded_layout([0], 3), H, torch.float32)
        assert got[0].shape == (3, H)
        assert torch.equal(got[0].view(torch.int32), want.view(torch.int32))


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
        everyone(None)
        return
    got = b.exchange(**kwargs(teacher=teacher, student=student)).wait()
    everyone(None)
    if student.is_last_stage(rank()):
        want = key_pattern(padded_layout([0, 1], 4), H, torch.float32)
        assert torch.equal(got[0].view(torch.int32), want.view(torch.int32))


def test_keep_sp_shard_needs_no_student_tp_group():
    b = make_bridge(keep_sp_shard=True)
    b = HiddenStateBridge(
        teachers=b.teachers,
        student=b.student,
        groups=dataclasses.replace(b.groups, student_tp=None),
        config=b.config,
    )
    kw = kwargs()
    if STUDENT.is_last_stage(rank()):  # each rank its own slice's layout
        j = STUDENT.coord(rank()).tp_rank
        kw["student_layout"] = padded_layout([0, 1], 4, sp_size=2, sp_rank=j)
    got = b.exchange(**kw).wait()
    if STUDENT.is_last_stage(rank()):
        want = key_pattern(padded_layout([0, 1], 4), H, torch.float32)[4 * j : 4 * (j + 1)]
        assert torch.equal(got[0].view(torch.int32), want.view(torch.int32))


def test_lm_head_weight_that_is_not_a_tensor():
    groups = create_bridge_groups(POOL, [TEACHER], STUDENT)
    weight = None
    if TEACHER.is_last_stage(rank()):
        weight = torch.zeros(4, H) if rank() == 0 else torch.zeros(4, H).numpy()
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"the teacher's weight shard is a ndarray") as info:
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
    msgs = everyone(str(info.value))
    assert all(m == msgs[0] for m in msgs), msgs


def test_metadata_and_verdict_go_over_a_gloo_group_beside_the_data_group(monkeypatch):
    """A pool without a backend gets a separate gloo group for the host-side metadata."""
    pool = GroupPool(timeout_s=120)  # the default backend (gloo here; NCCL in a GPU job)
    groups = create_bridge_groups(pool, [TEACHER], STUDENT)
    assert groups.meta is not None and groups.meta is not groups.bridge
    assert dist.get_backend(groups.meta) == "gloo"
    assert dist.get_process_group_ranks(groups.meta) == [0, 1, 2, 3]
    # a gloo pool too: the metadata never shares a group with the point-to-point
    gloo = create_bridge_groups(POOL, [TEACHER], STUDENT)
    assert gloo.meta is not gloo.bridge and dist.get_backend(gloo.meta) == "gloo"
    seen: list[tuple[str, Any, Any]] = []
    real_summary, real_gather = api_mod.reduce_summary, api_mod.gather_records
    real_flat = executor_mod.all_gather_flat

    def summary(record, *, group, device, **kw):
        seen.append(("metadata", group, device))
        return real_summary(record, group=group, device=device, **kw)

    def gather(record, *, group, device, **kw):
        seen.append(("records", group, device))
        return real_gather(record, group=group, device=device, **kw)

    def flat(output, input_, *, group, timeout_s):
        seen.append(("all-gather", group, output.device))
        return real_flat(output, input_, group=group, timeout_s=timeout_s)

    monkeypatch.setattr(api_mod, "reduce_summary", summary)
    monkeypatch.setattr(api_mod, "gather_records", gather)
    monkeypatch.setattr(executor_mod, "all_gather_flat", flat)  # the TP all-gather
    monkeypatch.setattr(integrity_mod, "all_gather_flat", flat)  # checksums and the verdict
    b = HiddenStateBridge(
        teachers=[TeacherSpec(mesh=TEACHER, hidden_size=H)],
        student=STUDENT,
        groups=groups,
        config=BridgeConfig(timeout_s=TIMEOUT_S, integrity=True),
    )
    got = b.exchange(**kwargs()).wait()
    assert seen[:2] == [
        ("metadata", groups.meta, torch.device("cpu")),
        ("records", groups.meta, torch.device("cpu")),
    ]
    verdicts = [g for kind, g, _ in seen if kind == "all-gather" and g is not groups.student_tp]
    assert verdicts == [groups.meta]
    if STUDENT.is_last_stage(rank()):
        want = key_pattern(padded_layout([0, 1], 4), H, torch.float32)
        assert torch.equal(got[0].view(torch.int32), want.view(torch.int32))


def test_nccl_bridge_groups_are_set_up_at_creation(monkeypatch):
    """An NCCL bridge group: every member, and only members, pass one barrier on it at creation
    (NCCL builds a communicator in a group's first collective, which needs every member; the
    first use of the group is a batched send/recv that ranks without transfers skip)."""
    from mopd.bridge import groups as groups_mod

    calls: list[tuple[Any, Any]] = []
    monkeypatch.setattr(groups_mod.cdist, "moves_cuda", lambda group: True)
    monkeypatch.setattr(groups_mod.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(groups_mod.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        groups_mod.dist,
        "barrier",
        lambda group=None, device_ids=None: calls.append((group, device_ids)),
    )
    teacher, student = Mesh(), Mesh(tp=2, rank_offset=1)  # global ranks 0-2; rank 3 outside
    groups = create_bridge_groups(GroupPool(backend="gloo", timeout_s=120), [teacher], student)
    monkeypatch.undo()
    if rank() == 3:
        assert calls == [] and groups.bridge is None
    else:
        assert calls == [(groups.bridge, [0])]


def test_a_good_step_after_every_misuse():
    b = make_bridge()
    exact_exchange(b, kwargs(s_samples=(1, 0)), want_samples=(1, 0))
    step = b.plan_step(**plan_kwargs(2))
    got = {}
    for i in range(2):
        if TEACHER.is_last_stage(rank()):
            step.send(i, {0: key_pattern(padded_layout([2 * i, 2 * i + 1], 4), H, torch.float32)})
        if STUDENT.is_last_stage(rank()):
            got[i] = step.receive(i)[0]
    step.finish()
    for i, rows in got.items():
        want = key_pattern(padded_layout([2 * i, 2 * i + 1], 4), H, torch.float32)
        assert torch.equal(rows.view(torch.int32), want.view(torch.int32))
