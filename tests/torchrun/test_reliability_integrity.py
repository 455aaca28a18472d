"""Tier 2 (4 ranks, gloo): integrity mode catches corrupted rows; steps in flight stay exact.

Integrity mode (``BridgeConfig(integrity=True)``): clean steps of several micro-batches over
disjoint, colocated and two-teacher meshes stay bit-exact and raise nothing. Bytes changed on
the way, through the executor's test hook, are caught at ``finish()`` with a
``BridgeIntegrityError`` that is *the same text on every rank* and names the teacher, the
micro-batch, the source and destination global ranks and the rows (checked against where the
token really sits in both layouts): a bit flipped in a packed send buffer (staging) or in a
receive buffer (in flight), a row changed after its local copy, a bit flipped in a slice the
student TP all-gather brought, and a padding row written behind the bridge's back.
Corruptions in several micro-batches of one step are reported together, once, at ``finish()``
(``receive`` does not judge: the verdict is one collective per step). The same flip with
integrity off goes unnoticed (the rows really differ), and the same bridge delivers exact rows
again in the next step.

Steps in flight: two bridges on one group with their steps interleaved micro-batch by
micro-batch and finished in reverse order, and two exchanges of one bridge (or of two bridges)
started before either is waited on and waited in reverse order: exact, integrity off and on. A
rank with no transfers in a step (a student's first stage outside every teacher mesh) counts as
fully posted, so the next step of the same bridge may be planned before the first is finished.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from mopd.bridge import BridgeStep, GroupPool, Mesh, TokenLayout, compact_rows, padded_layout
from mopd.profiling.synthetic import SideFormat, key_pattern, synthetic_step
from tests.support.reliability import everyone, fresh_bridge, outcome, same_everywhere

TORCHRUN_NPROC = 4
TORCHRUN_TIMEOUT = 300
TORCHRUN_STRICT_P2P = 1  # NCCL's point-to-point rules (tests/support/strict_p2p.py)

# nothing here breaks a group: one pool for the module
POOL = GroupPool(backend="gloo", timeout_s=120)
DTYPE = torch.float32
M = 3  # micro-batches per step
TIMEOUT_S = 20.0

# (teachers, student)
MESHES = {
    "disjoint": ([Mesh(tp=2)], Mesh(tp=2, rank_offset=2)),
    "colocated": ([Mesh(tp=2, dp=2)], Mesh(dp=4)),
    "two teachers": ([Mesh(tp=2), Mesh(dp=2, rank_offset=2)], Mesh(tp=2, dp=2)),
}


def hidden_of(o: int) -> int:
    return 8 + 4 * o


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def salt(o: int, i: int) -> int:
    """Teacher ``o``'s rows of micro-batch ``i``: a row delivered into another micro-batch or
    from another teacher differs."""
    return o + 10 * i


def flip(t: torch.Tensor, row: int = 0) -> None:
    b = t.view(torch.uint8)
    b[row, 0] = b[row, 0] ^ 1


class Case:
    """A bridge on one mesh combination and its seeded steps of ``M`` micro-batches each."""

    def __init__(self, name: str, *, integrity: bool = True, hook: Any = None) -> None:
        self.name = name
        self.teachers, self.student = MESHES[name]
        self.rank = dist.get_rank()
        self.bridge = fresh_bridge(
            self.teachers,
            self.student,
            [hidden_of(o) for o in range(len(self.teachers))],
            timeout_s=TIMEOUT_S,
            hook=hook,
            pool=POOL,
            integrity=integrity,
        )
        self.step: BridgeStep | None = None  # the step in progress (hooks look at it)
        self.got: dict[int, dict[int, torch.Tensor]] = {}  # its rows received so far
        self.micro_batch = -1  # the micro-batch being sent or received now

    def mb(self, seed: int, i: int) -> Any:
        """Micro-batch ``i`` of the step seeded ``seed`` (the same on every rank)."""
        return synthetic_step(
            teachers=self.teachers,
            student=self.student,
            num_samples=4,
            max_len=9,
            teacher_formats=[SideFormat(kind="thd", micro_batch=2)] * len(self.teachers),
            student_format=SideFormat(kind="sbh", micro_batch=2, pad_multiple=self.student.tp),
            seed=100 * seed + i,
        )

    def teacher_layout(self, o: int, seed: int, i: int) -> TokenLayout | None:
        m = self.teachers[o]
        if not m.is_last_stage(self.rank):
            return None
        c = m.coord(self.rank)
        return self.mb(seed, i).teacher_layouts[o][(c.dp_rank, c.cp_rank)]

    def student_layout(self, seed: int, i: int) -> TokenLayout | None:
        if not self.student.is_last_stage(self.rank):
            return None
        c = self.student.coord(self.rank)
        return self.mb(seed, i).student_layouts[(c.dp_rank, c.cp_rank)]

    def plan(self, seed: int) -> BridgeStep:
        held = [o for o in range(len(self.teachers)) if self.teacher_layout(o, seed, 0)]
        stu = self.student_layout(seed, 0) is not None
        self.step = self.bridge.plan_step(
            teacher_layouts={o: [self.teacher_layout(o, seed, i) for i in range(M)] for o in held}
            or None,
            student_layouts=[self.student_layout(seed, i) for i in range(M)] if stu else None,
        )
        return self.step

    def hidden(self, seed: int, i: int) -> dict[int, torch.Tensor]:
        out = {}
        for o in range(len(self.teachers)):
            lay = self.teacher_layout(o, seed, i)
            if lay is not None:
                out[o] = key_pattern(lay, hidden_of(o), DTYPE, salt=salt(o, i))
        return out

    def expected(self, seed: int, i: int, o: int) -> torch.Tensor:
        stu = self.student_layout(seed, i)
        assert stu is not None
        mb = self.mb(seed, i)
        route = dict(zip(mb.sample_ids.tolist(), mb.route.tolist(), strict=True))
        owner = torch.tensor([route.get(s, -1) for s in stu.sample_id_R.tolist()])
        want = key_pattern(stu, hidden_of(o), DTYPE, salt=salt(o, i))
        return compact_rows({o: want}, owner)[o]  # teacher o's tokens of the layout, in order

    def exact(self, seed: int, i: int, got: dict[int, torch.Tensor]) -> bool:
        if self.student_layout(seed, i) is None:
            return not got
        return all(
            torch.equal(bits(got[o]), bits(self.expected(seed, i, o)))
            for o in range(len(self.teachers))
        )

    def schedule(
        self,
        seed: int,
        *,
        after_plan: Callable[[BridgeStep], None] | None = None,
        before_finish: Callable[[], None] | None = None,
    ) -> dict[int, dict[int, torch.Tensor]]:
        """Plan step ``seed``, send and receive each micro-batch in order, then ``finish()``.
        Returns this rank's received rows per micro-batch (copies, taken before ``finish``)."""
        step = self.plan(seed)
        if after_plan is not None:
            after_plan(step)
        got = self.got = {}
        for i in range(M):
            self.micro_batch = i
            h = self.hidden(seed, i)
            if h:
                step.send(i, h)
            if self.student_layout(seed, i) is not None:
                got[i] = {o: t.clone() for o, t in step.receive(i).items()}
        if before_finish is not None:
            before_finish()
        step.finish()
        return got

    def all_exact(self, seed: int, got: dict[int, dict[int, torch.Tensor]]) -> bool:
        return all(self.exact(seed, i, got.get(i, {})) for i in range(M))


def source_and_destination(case: Case, seed: int, i: int, owner: int, src_row: int) -> Any:
    """Where teacher ``owner``'s row ``src_row`` of this rank (micro-batch ``i``) lands: the
    token's row among ``owner``'s compact rows of every student shard (its tokens, in layout
    order), as ``{global rank: row}``."""
    lay = case.teacher_layout(owner, seed, i)
    assert lay is not None
    key = (int(lay.sample_id_R[src_row]), int(lay.position_R[src_row]))
    mb = case.mb(seed, i)
    route = dict(zip(mb.sample_ids.tolist(), mb.route.tolist(), strict=True))
    out = {}
    for r in case.student.ranks:
        c = case.student.coord(r)
        stu = mb.student_layouts[(c.dp_rank, c.cp_rank)]
        mine = torch.tensor([route.get(x, -1) == owner for x in stu.sample_id_R.tolist()])
        hit = (stu.sample_id_R == key[0]) & (stu.position_R == key[1]) & mine
        if bool(hit.any()):
            out[r] = int(mine[: int(torch.nonzero(hit)[0])].sum())
    return out


def integrity_error(fn: Callable[[], Any]) -> str:
    """``fn`` raises BridgeIntegrityError on this rank; its text, asserted equal everywhere."""
    res = outcome(fn)
    kinds = everyone(res[0])
    assert kinds == ["BridgeIntegrityError"] * len(kinds), (kinds, res[1])
    return same_everywhere(res[1])


@pytest.mark.parametrize("name", list(MESHES))
def test_clean_steps_pass_the_check_and_are_exact(name):
    case = Case(name)
    for seed in range(2):
        got = case.schedule(seed)
        assert case.all_exact(seed, got), f"{name} step {seed}"
    # the checks read only indices the schedule uploaded up front (one copy per schedule)
    devs = case.bridge.executor._devs.values()
    assert all(d.late_uploads == 0 and d.uploads <= 1 for d in devs), (
        name,
        [(d.uploads, d.late_uploads) for d in devs],
    )


def test_bit_flipped_in_a_packed_send_buffer_is_caught_on_every_rank():
    """Rank 0 flips a bit of its first send's staging rows in micro-batch 1."""
    hit: list[tuple[int, int, int, int]] = []

    def hook(point: str, blocks: list) -> None:
        if point == "packed" and dist.get_rank() == 0 and case.micro_batch == 1 and not hit:
            owner, peer, buf = blocks[0]
            assert case.step is not None
            op = case.step._slots[1].schedule.sends[0]
            assert (op.owner, op.peer) == (owner, peer)
            flip(buf)
            hit.append((owner, peer, int(op.side.rows[0]), op.count))

    case = Case("disjoint", hook=hook)
    msg = integrity_error(lambda: case.schedule(0))
    facts = everyone(hit[0] if hit else None)[0]
    owner, peer, src_row, count = facts
    dst_row = everyone(
        source_and_destination(case, 0, 1, owner, src_row) if dist.get_rank() == 0 else None
    )[0][peer]
    assert msg.startswith(
        "bridge integrity check failed: 1 corrupted block(s) received on global rank(s) "
        f"[{peer}]: teacher {owner}, micro-batch 1: global rank 0 -> global rank {peer}: 1 of "
        f"{count} rows differ (destination rows [{dst_row}], source rows [{src_row}])"
    ), msg
    # the group is healthy: the same bridge delivers exact rows in the next step (hook idle)
    assert case.all_exact(1, case.schedule(1))


def test_bit_flipped_in_a_receive_buffer_is_caught():
    """Rank 3 flips a bit of the last block it received in micro-batch 2, before unpacking."""

    def hook(point: str, blocks: list) -> None:
        if point == "received" and dist.get_rank() == 3 and case.micro_batch == 2:
            flip(blocks[-1][2])

    case = Case("disjoint", hook=hook)
    msg = integrity_error(lambda: case.schedule(0))
    assert msg.startswith(
        "bridge integrity check failed: 1 corrupted block(s) received on global rank(s) [3]: "
        "teacher 0, micro-batch 2: global rank 1 -> global rank 3: 1 of "
    ), msg


def test_bit_flipped_in_the_student_tp_all_gather_is_caught():
    """Rank 3 (student TP rank 1) flips row 1 of rank 2's slice after the TP all-gather."""

    def hook(point: str, blocks: list) -> None:
        if point == "gathered" and dist.get_rank() == 3 and case.micro_batch == 0:
            owner, peer, rows = blocks[0]
            assert (owner, peer) == (0, 2)
            flip(rows, row=1)
            case.bridge.executor.debug_hook = None  # once

    case = Case("disjoint", hook=hook)
    msg = integrity_error(lambda: case.schedule(0))
    stu = case.mb(0, 0).student_layouts[(0, 0)]
    n = (stu.num_tokens + 1) // 2  # rows per student TP slice (compact: tokens; one teacher)
    assert msg.startswith(
        "bridge integrity check failed: 1 corrupted block(s) received on global rank(s) [3]: "
        f"teacher 0, micro-batch 0: student TP all-gather, global rank 2 -> global rank 3: 1 of "
        f"{n} rows differ from the sender's slice (destination rows [1], rows of the sender's "
        "slice [1])"
    ), msg
    assert case.all_exact(1, case.schedule(1))


def test_same_flip_without_integrity_goes_unnoticed():
    def hook(point: str, blocks: list) -> None:
        if point == "packed" and dist.get_rank() == 0 and blocks:
            flip(blocks[0][2])

    case = Case("disjoint", integrity=False, hook=hook)
    got = case.schedule(0)
    ok = everyone(case.all_exact(0, got))
    assert ok[:2] == [True, True]  # teachers receive nothing
    assert not all(ok[2:]), "the flipped bit must reach a student rank"


def test_row_changed_after_its_local_copy_is_caught():
    """Colocated: a rank changes a row its local copy wrote, before the check reads it."""
    victim: list[int] = []

    def find_victim(step: BridgeStep) -> None:
        sched = step._slots[0].schedule
        victim.append(everyone(bool(sched is not None and sched.locals)).index(True))

    def hook(point: str, blocks: list) -> None:
        if point == "received" and dist.get_rank() == victim[0] and case.micro_batch == 0:
            assert case.step is not None
            sched = case.step._slots[0].schedule
            loc = sched.locals[0]
            off = sched.slice_start(loc.owner)
            flip(case.step._slots[0].outputs[loc.owner], off + int(loc.dst.rows[0]))

    case = Case("colocated", hook=hook)
    msg = integrity_error(lambda: case.schedule(0, after_plan=find_victim))
    v = victim[0]
    assert msg.startswith(
        f"bridge integrity check failed: 1 corrupted block(s) received on global rank(s) [{v}]: "
        f"teacher 0, micro-batch 0: global rank {v} -> global rank {v}: 1 of"
    ), msg


def test_compact_rows_are_all_written_by_transfers_and_checked():
    """Compact delivery: every row ``receive`` returns is written by a transfer or a local copy
    (and checked against its sender's checksum); no zero-filled rows are left to check, and the
    only padding is the TP all-gather's (fewer than the group's ranks per teacher)."""
    case = Case("disjoint")
    got = case.schedule(0)
    assert case.all_exact(0, got)
    step = case.step
    assert step is not None
    for slot in step._slots:
        sched = slot.schedule
        if sched is None or sched.dest is None:
            continue
        assert all(rows.numel() == 0 for rows in sched.fill_checked.values())
        for o in slot.outputs:
            assert 0 <= sched.padded_rows(o) - sched.out_rows(o) < sched.dest.group_size
            assert sum(op.count for op in sched.recvs if op.owner == o) + sum(
                x.src.count for x in sched.locals if x.owner == o
            ) == sched.real_rows(o)


def test_corruptions_in_several_micro_batches_are_reported_together_at_finish():
    """Micro-batch 0 is corrupted in rank 0's staging, micro-batch 2 in rank 3's receive buffer:
    every ``receive`` returns (the wrong rows included), and ``finish()`` raises once, on every
    rank, listing both blocks with their micro-batches."""

    def hook(point: str, blocks: list) -> None:
        r, i = dist.get_rank(), case.micro_batch
        if (point, r, i) in (("packed", 0, 0), ("received", 3, 2)):
            flip(blocks[0][2] if point == "packed" else blocks[-1][2])

    case = Case("disjoint", hook=hook)
    msg = integrity_error(
        lambda: case.schedule(0, before_finish=lambda: everyone("received every batch"))
    )
    got = case.got
    assert msg.startswith("bridge integrity check failed: 2 corrupted block(s) received on "), msg
    assert msg.count("teacher 0, micro-batch 0: global rank 0 -> global rank") == 1, msg
    assert msg.count("teacher 0, micro-batch 2: global rank 1 -> global rank 3: 1 of") == 1, msg
    wrong = everyone([i for i in range(M) if not case.exact(0, i, got.get(i, {}))])
    assert sorted({i for w in wrong for i in w}) == [0, 2], wrong  # receive gave the bad rows
    case.bridge.executor.debug_hook = None
    assert case.all_exact(1, case.schedule(1))  # and the bridge works again


# --- steps in flight -------------------------------------------------------------------------


def two_bridges(integrity: bool) -> tuple[list[Any], Mesh, list[Mesh]]:
    student = Mesh(tp=2, rank_offset=2)
    teachers = [Mesh(tp=2), Mesh(dp=2)]  # both on ranks 0-1, different hidden sizes
    bridges = [
        fresh_bridge(
            [m], student, [hidden_of(o)], timeout_s=TIMEOUT_S, pool=POOL, integrity=integrity
        )
        for o, m in enumerate(teachers)
    ]
    return bridges, student, teachers


STU_LAYOUTS = [padded_layout([0, 1], 4), padded_layout([1, 0], 6)]


def teacher_side(o: int, rank: int) -> TokenLayout:
    """Teacher 0 (tp2) holds both samples on both ranks; teacher 1 (dp2) one sample per rank."""
    return padded_layout([0, 1], 4) if o == 0 else padded_layout([rank], 6)


@pytest.mark.parametrize("integrity", [False, True])
def test_two_bridges_on_one_group_interleaved_micro_batch_by_micro_batch(integrity):
    """Two steps planned before either runs, sent and received in the same interleaved order
    on every rank, finished in reverse order: exact (each bridge's rows in its own layout)."""
    rank = dist.get_rank()
    bridges, student, teachers = two_bridges(integrity)
    steps = []
    for o, (b, m) in enumerate(zip(bridges, teachers, strict=True)):
        lay = teacher_side(o, rank)
        steps.append(
            b.plan_step(
                teacher_layouts={0: [lay, lay]} if m.is_last_stage(rank) else None,
                student_layouts=[STU_LAYOUTS[o]] * 2 if student.is_last_stage(rank) else None,
            )
        )
    got: dict[tuple[int, int], torch.Tensor] = {}
    for i in range(2):
        for o, step in enumerate(steps):
            if teachers[o].is_last_stage(rank):
                lay = teacher_side(o, rank)
                step.send(i, {0: key_pattern(lay, hidden_of(o), DTYPE, salt=salt(o, i))})
            if student.is_last_stage(rank):
                got[(o, i)] = step.receive(i)[0]
    for step in reversed(steps):
        step.finish()
    if student.is_last_stage(rank):
        for (o, i), rows in got.items():
            lay = STU_LAYOUTS[o]
            want = key_pattern(lay, hidden_of(o), DTYPE, salt=salt(o, i))[lay.sample_id_R >= 0]
            assert torch.equal(bits(rows), bits(want)), f"teacher {o} micro-batch {i}"


@pytest.mark.parametrize("integrity", [False, True])
def test_two_bridges_exchanges_started_before_either_is_waited(integrity):
    """``exchange()`` starts its micro-batch on every rank at the call, so two exchanges on one
    group pair in start order whatever order they are waited in (here the reverse)."""
    rank = dist.get_rank()
    bridges, student, teachers = two_bridges(integrity)
    handles = []
    for o, (b, m) in enumerate(zip(bridges, teachers, strict=True)):
        kw: dict[str, Any] = {}
        if m.is_last_stage(rank):
            lay = teacher_side(o, rank)
            kw = {"hidden": {0: key_pattern(lay, hidden_of(o), DTYPE, salt=o)}, "layouts": {0: lay}}
        else:
            kw = {"student_layout": STU_LAYOUTS[o]}
        handles.append(b.exchange(**kw))
    res = outcome(lambda: [h.wait() for h in reversed(handles)][::-1])
    seen = everyone(res[:2])
    assert all(s[0] == "ok" for s in seen), seen
    if student.is_last_stage(rank):
        for o in range(2):
            lay = STU_LAYOUTS[o]
            want = key_pattern(lay, hidden_of(o), DTYPE, salt=o)[lay.sample_id_R >= 0]
            assert torch.equal(bits(res[3][o][0]), bits(want)), f"teacher {o}"


@pytest.mark.filterwarnings("ignore:global rank .. a step is planned while 1 earlier step")
def test_one_bridge_with_two_exchanges_in_flight():
    """Two exchanges of one bridge with different layouts, waited in reverse order: exact."""
    a = Case("disjoint")
    rank = dist.get_rank()

    def kwargs(seed: int) -> dict[str, Any]:
        lay, stu = a.teacher_layout(0, seed, 0), a.student_layout(seed, 0)
        if lay is not None:
            return {"hidden": {0: key_pattern(lay, 8, DTYPE, salt=0)}, "layouts": {0: lay}}
        return {"student_layout": stu}

    ha = a.bridge.exchange(**kwargs(3))
    hb = a.bridge.exchange(**kwargs(4))
    res = outcome(lambda: (hb.wait(), ha.wait()))
    seen = everyone(res[:2])
    assert all(s[0] == "ok" for s in seen), seen
    assert ha.done and hb.done
    if a.student.is_last_stage(rank):
        got_b, got_a = res[3]
        assert a.exact(3, 0, got_a) and a.exact(4, 0, got_b)


@pytest.mark.filterwarnings("ignore:global rank .. a step is planned while 1 earlier step")
def test_a_rank_without_transfers_counts_as_fully_posted():
    """Teacher on rank 0, student ``pp2`` on ranks 2 (first stage: no transfers) and 3 (last
    stage, receives from rank 0); rank 1 is outside the bridge. Step 0 is sent and received
    everywhere but not finished; step 1 may be planned at once (every micro-batch of step 0 is
    posted where anything moves), and both finish exact, in reverse order."""
    rank = dist.get_rank()
    teacher, student = Mesh(), Mesh(pp=2, rank_offset=2)
    b = fresh_bridge([teacher], student, [8], timeout_s=TIMEOUT_S, pool=POOL)
    if rank == 1:  # outside the bridge: it only joins the report
        everyone(None)
        return
    lays = [padded_layout([10 * k + i for i in range(2)], 4) for k in range(2)]

    def plan(k: int) -> BridgeStep:
        return b.plan_step(
            teacher_layouts={0: [lays[k]] * M} if rank == 0 else None,
            student_layouts=[lays[k]] * M if rank == 3 else None,
            check=(lambda: {"the student's micro-batches": M}) if rank == 2 else None,
        )

    def run(step: BridgeStep, k: int) -> list[torch.Tensor]:
        got = []
        for i in range(M):
            if rank == 0:
                step.send(i, {0: key_pattern(lays[k], 8, DTYPE, salt=salt(k, i))})
            if rank == 3:
                got.append(step.receive(i)[0])
        return got

    first = plan(0)
    got0 = run(first, 0)
    second = outcome(lambda: plan(1))  # step 0 is posted wherever anything moves
    got1 = run(second[3], 1) if second[0] == "ok" else []
    if second[0] == "ok":
        second[3].finish()
    first.finish()
    seen = everyone(second[:2])
    assert all(s is None or s[0] == "ok" for s in seen), seen
    for k, got in ((0, got0), (1, got1)):
        for i, rows in enumerate(got):
            want = key_pattern(lays[k], 8, DTYPE, salt=salt(k, i))[lays[k].sample_id_R >= 0]
            assert torch.equal(bits(rows), bits(want)), (k, i)
    assert rank != 3 or len(got1) == M
