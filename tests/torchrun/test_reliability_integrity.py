"""Tier 2 (4 ranks, gloo): integrity mode catches corrupted rows; two exchanges in flight are exact.

Integrity mode (``BridgeConfig(integrity=True)``, issue 7): clean exchanges over disjoint,
colocated and two-teacher meshes stay bit-exact and raise nothing; a bit flipped in flight (in a
packed send buffer, in a receive buffer before unpacking, in a source row between the checksum
and a local copy, in a slice the student TP all-gather brought) or a padding row written behind
the bridge's back raises
``BridgeIntegrityError`` on *every* rank with the same text, naming the teacher, the source and
destination global ranks and the rows. The same corruption with integrity off goes unnoticed
(the rows really differ), and the bridge keeps working after a caught corruption.

Two exchanges in flight: two bridges (two teachers) on one group, and one bridge with two
different layouts, each started before either is waited on, waited in reverse order: exact.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from mopd.bridge import (
    GroupPool,
    Mesh,
    TokenLayout,
    padded_layout,
)
from mopd.bridge.api import BridgeIntegrityError
from mopd.profiling.synthetic import SideFormat, key_pattern, synthetic_step
from tests.support.bridges import make_bridge

TORCHRUN_NPROC = 4
TORCHRUN_TIMEOUT = 240

POOL = GroupPool(backend="gloo")
DTYPE = torch.float32

# (name, teachers, student)
MESHES = {
    "disjoint": ([Mesh(tp=2)], Mesh(tp=2, rank_offset=2)),
    "colocated": ([Mesh(tp=2, dp=2)], Mesh(dp=4)),
    "two teachers": ([Mesh(tp=2), Mesh(dp=2, rank_offset=2)], Mesh(tp=2, dp=2)),
}


def hidden_of(o: int) -> int:
    return 8 + 4 * o


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


class Case:
    """One seeded step on one mesh combination, with this rank's arguments and expectations."""

    def __init__(self, name: str, *, integrity: bool = True, seed: int = 0, hook=None) -> None:
        teachers, student = MESHES[name]
        self.teachers, self.student = teachers, student
        self.rank = dist.get_rank()
        self.bridge = make_bridge(
            POOL,
            teachers,
            student,
            [hidden_of(o) for o in range(len(teachers))],
            debug_hook=hook,
            timeout_s=30,
            integrity=integrity,
        )
        self.step = synthetic_step(
            teachers=teachers,
            student=student,
            num_samples=6,
            max_len=9,
            teacher_formats=[SideFormat(kind="thd", micro_batch=2)] * len(teachers),
            student_format=SideFormat(kind="sbh", micro_batch=3, pad_multiple=student.tp),
            seed=seed,
        )
        self.stu: TokenLayout | None = None
        if student.is_last_stage(self.rank):
            c = student.coord(self.rank)
            self.stu = self.step.student_layouts[(c.dp_rank, c.cp_rank)]

    def kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"hidden": {}, "layouts": {}}
        for o, m in enumerate(self.teachers):
            if m.is_last_stage(self.rank):
                c = m.coord(self.rank)
                lay = self.step.teacher_layouts[o][(c.dp_rank, c.cp_rank)]
                kw["hidden"][o] = key_pattern(lay, hidden_of(o), DTYPE, salt=o)
                kw["layouts"][o] = lay
        if self.stu is not None:
            kw["student_layout"] = self.stu
            kw["outputs"] = {
                o: torch.full((self.stu.num_rows, hidden_of(o)), float("nan"), dtype=DTYPE)
                for o in range(len(self.teachers))
            }
        return kw

    def expected(self, o: int) -> torch.Tensor:
        assert self.stu is not None
        route = dict(zip(self.step.sample_ids.tolist(), self.step.route.tolist(), strict=True))
        owner = torch.tensor([route.get(s, -1) for s in self.stu.sample_id_R.tolist()])
        want = key_pattern(self.stu, hidden_of(o), DTYPE, salt=o)
        want[owner != o] = 0
        return want

    def exact(self, got: dict[int, torch.Tensor]) -> bool:
        if self.stu is None:
            return not got
        return all(
            torch.equal(bits(got[o]), bits(self.expected(o))) for o in range(len(self.teachers))
        )


def same_everywhere(msg: str) -> str:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, msg)
    assert all(m == out[0] for m in out), out
    return out[0]


def flip(t: torch.Tensor, row: int = 0) -> None:
    b = t.view(torch.uint8)
    b[row, 0] = b[row, 0] ^ 1


@pytest.mark.parametrize("name", list(MESHES))
def test_clean_exchanges_pass_the_check_and_are_exact(name):
    for seed in range(3):
        case = Case(name, seed=seed)
        got = case.bridge.exchange(**case.kwargs()).wait()
        assert case.exact(got), f"{name} seed {seed}"
        # the checks read only indices the schedule uploaded up front (one copy per schedule)
        devs = case.bridge.executor._devs.values()
        assert all(d.late_uploads == 0 and d.uploads <= 1 for d in devs), name


def test_bit_flipped_in_a_packed_send_buffer_is_caught_on_every_rank():
    hit: list[tuple[int, int, int, int, int]] = []
    case_ref: list[Case] = []

    def hook(point: str, blocks: list) -> None:
        if point == "packed" and dist.get_rank() == 0 and blocks:
            owner, peer, buf = blocks[0]
            flip(buf)
            b = case_ref[0].bridge
            op = b.executor.schedule(next(iter(b._plans.values()))).sends[0]
            hit.append((owner, peer, int(op.peer_rows[0]), int(op.side.rows[0]), op.count))

    case = Case("disjoint", hook=hook)
    case_ref.append(case)
    with pytest.raises(BridgeIntegrityError) as info:
        case.bridge.exchange(**case.kwargs()).wait()
    msg = same_everywhere(str(info.value))
    facts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(facts, hit[0] if hit else None)
    owner, peer, dst_row, src_row, count = facts[0]
    assert msg.startswith(
        "bridge integrity check failed: 1 corrupted block(s) received on global rank(s) "
        f"[{peer}]: teacher {owner}: global rank 0 -> global rank {peer}: 1 of {count} rows "
        f"differ (destination rows [{dst_row}], source rows [{src_row}])"
    ), msg
    # the group is healthy: the same bridge (hook now idle) delivers exact rows again
    case.bridge.executor.debug_hook = None
    assert case.exact(case.bridge.exchange(**case.kwargs()).wait())


def test_bit_flipped_in_the_student_tp_all_gather_is_caught():
    """Rank 3 (student TP rank 1) corrupts a row of rank 2's slice after the TP all-gather."""

    def hook(point: str, blocks: list) -> None:
        if point == "gathered" and dist.get_rank() == 3:
            owner, peer, rows = blocks[0]
            assert (owner, peer) == (0, 2)
            flip(rows, row=1)

    case = Case("disjoint", hook=hook)
    with pytest.raises(BridgeIntegrityError) as info:
        case.bridge.exchange(**case.kwargs()).wait()
    msg = same_everywhere(str(info.value))
    n = case.step.student_layouts[(0, 0)].num_rows // 2  # rows per student TP slice
    assert msg.startswith(
        "bridge integrity check failed: 1 corrupted block(s) received on global rank(s) [3]: "
        f"teacher 0: student TP all-gather, global rank 2 -> global rank 3: 1 of {n} rows "
        "differ from the sender's slice (destination rows [1], rows of the sender's slice [1])"
    ), msg
    case.bridge.executor.debug_hook = None
    assert case.exact(case.bridge.exchange(**case.kwargs()).wait())


def test_same_flip_without_integrity_goes_unnoticed():
    def hook(point: str, blocks: list) -> None:
        if point == "packed" and dist.get_rank() == 0 and blocks:
            flip(blocks[0][2])

    case = Case("disjoint", integrity=False, hook=hook)
    got = case.bridge.exchange(**case.kwargs()).wait()
    ok: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ok, case.exact(got))
    assert ok[:2] == [True, True]  # teachers receive nothing
    assert not all(ok[2:]), "the flipped bit must reach a student rank"


def test_bit_flipped_in_a_receive_buffer_is_caught():
    def hook(point: str, blocks: list) -> None:
        if point == "received" and dist.get_rank() == 3:
            flip(blocks[-1][2])

    case = Case("disjoint", hook=hook)
    with pytest.raises(BridgeIntegrityError, match=r"-> global rank 3: 1 of \d+ rows differ"):
        case.bridge.exchange(**case.kwargs()).wait()
    same_everywhere("x")  # in step


def first_rank_with(flag: bool) -> int:
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, flag)
    return flags.index(True)


def test_source_row_changed_before_a_local_copy_is_caught():
    case = Case("colocated")
    kw = case.kwargs()
    prepared = case.bridge.prepare(**kw)
    local = case.bridge.executor.schedule(prepared.plan).locals
    victim = first_rank_with(bool(local))

    def hook(point: str, blocks: list) -> None:
        if point == "posted" and dist.get_rank() == victim:
            flip(prepared.sources[local[0].owner], int(local[0].src.rows[0]))

    case.bridge.executor.debug_hook = hook
    with pytest.raises(BridgeIntegrityError) as info:
        case.bridge.start(prepared).wait()
    msg = same_everywhere(str(info.value))
    assert f"teacher 0: global rank {victim} -> global rank {victim}: 1 of" in msg


def test_padding_row_written_behind_the_bridge_is_caught():
    case = Case("disjoint", seed=1)
    kw = case.kwargs()
    pad = torch.empty(0, dtype=torch.int64)
    if case.stu is not None:
        n = case.stu.num_rows // 2
        lo = case.student.coord(case.rank).tp_rank * n
        pad = torch.nonzero(case.stu.sample_id_R[lo : lo + n] < 0).reshape(-1) + lo
    victim = first_rank_with(bool(pad.numel()))

    def hook(point: str, blocks: list) -> None:
        if point == "received" and dist.get_rank() == victim:
            kw["outputs"][0][int(pad[0])] = 1.0

    case.bridge.executor.debug_hook = hook
    with pytest.raises(BridgeIntegrityError) as info:
        case.bridge.exchange(**kw).wait()
    msg = same_everywhere(str(info.value))
    assert f"teacher 0 on global rank {victim}: 1 of" in msg
    assert "rows that no transfer writes are not zero" in msg


# --- two exchanges in flight -----------------------------------------------------------------


@pytest.mark.parametrize("integrity", [False, True])
def test_two_bridges_on_one_group_started_before_either_is_waited(integrity):
    rank = dist.get_rank()
    student = Mesh(tp=2, rank_offset=2)
    teachers = [Mesh(tp=2), Mesh(dp=2)]  # both on ranks 0-1, different hidden sizes
    bridges = [
        make_bridge(POOL, [m], student, [hidden_of(o)], timeout_s=30, integrity=integrity)
        for o, m in enumerate(teachers)
    ]
    stu_layouts = [padded_layout([0, 1], 4), padded_layout([1, 0], 4)]
    handles = []
    for o, (b, m) in enumerate(zip(bridges, teachers, strict=True)):
        kw: dict[str, Any] = {}
        if m.is_last_stage(rank):
            lay = padded_layout([0, 1], 4) if o == 0 else padded_layout([rank], 4)
            kw = {"hidden": {0: key_pattern(lay, hidden_of(o), DTYPE, salt=o)}, "layouts": {0: lay}}
        else:
            kw = {"student_layout": stu_layouts[o]}
        handles.append(b.exchange(**kw))
    got = [h.wait() for h in reversed(handles)][::-1]
    if student.is_last_stage(rank):
        for o in range(2):
            want = key_pattern(stu_layouts[o], hidden_of(o), DTYPE, salt=o)
            assert torch.equal(bits(got[o][0]), bits(want)), f"teacher {o}"


def test_one_bridge_with_two_layouts_in_flight():
    a, b = Case("colocated", seed=3), Case("colocated", seed=4)
    b.bridge = a.bridge  # one bridge, two steps' layouts
    ha = a.bridge.exchange(**a.kwargs())
    hb = a.bridge.exchange(**b.kwargs())
    assert a.bridge.executor.memory_stats()["in_flight"] == 2
    got_b = hb.wait()  # completes a first, in start order
    assert ha.done
    assert a.exact(ha.wait()) and b.exact(got_b)
    assert len(a.bridge._plans) == 2
