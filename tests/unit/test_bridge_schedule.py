"""Tier 1: rank schedules, their one-copy index upload, and the executor's data path in one process.

Every rank's plan of a simulated micro-batch (:mod:`tests.support.plan_sim`, then
:func:`mopd.bridge.plan.plan_rank`) is built into a :class:`~mopd.bridge.schedule.RankSchedule`
and run through the executor itself (``Executor.take`` / ``post`` / ``complete`` / ``release``:
its pack, view copy, unpack, local-copy and zero-fill code, its staging pool), with a mailbox
standing in for the transport: sends and receives between two ranks pair in posting order, as on
NCCL and gloo, and a receive reads the sender's buffer only when it is waited on (the laziest
transport allowed). Every buffer the executor allocates starts as NaN bits, and each teacher's
buffer is overwritten as soon as its rows were given, so the student buffers (each rank's slice
assembled as the TP all-gather would) must hold exactly the teacher rows of their keys, zeros
elsewhere (the padding of uneven slices included), and every index the data path reads must have
come from the schedule's single upload (:class:`mopd.bridge.schedule.DeviceIndices`).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mopd.bridge import Mesh, TokenLayout
from mopd.bridge import executor as executor_mod
from mopd.bridge.executor import Executor, Slot
from mopd.bridge.plan import RankPlan, plan_rank
from mopd.bridge.schedule import DeviceIndices, RankSchedule
from mopd.profiling.synthetic import SideFormat, SyntheticStep, key_pattern, synthetic_step
from tests.support.bridges import poison
from tests.support.plan_sim import simulate

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPE = torch.float32
CPU = torch.device("cpu")


def hidden_of(owner: int) -> int:
    return 5 + 3 * owner


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


# --- the mailbox transport --------------------------------------------------------------------


@dataclass
class _Op:
    op: Any
    tensor: torch.Tensor
    peer: int
    group: Any = None
    tag: int = 0


class _Work:
    def __init__(self, on_wait: Any = None) -> None:
        self._on_wait = on_wait
        self.done = on_wait is None

    def wait(self, *args: Any) -> bool:
        if not self.done:
            self._on_wait()
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


class Mailbox:
    """``batch_isend_irecv`` between the ranks of one process: a send leaves a reference to its
    buffer; the matching receive (same pair, posting order) copies from it when waited on."""

    def __init__(self) -> None:
        self.rank = -1  # the rank posting now
        self.box: dict[tuple[int, int], deque[torch.Tensor]] = defaultdict(deque)
        self.posted_bytes: Counter[int] = Counter()

    def batch_isend_irecv(self, ops: list[_Op]) -> list[_Work]:
        works = []
        for op in ops:
            if op.op is dist.isend:
                self.box[(self.rank, op.peer)].append(op.tensor)
                self.posted_bytes[self.rank] += op.tensor.numel() * op.tensor.element_size()
                works.append(_Work())
            else:
                works.append(_Work(self._receiver(op.peer, self.rank, op.tensor)))
        return works

    def _receiver(self, src: int, dst: int, buf: torch.Tensor) -> Any:
        def receive() -> None:
            got = self.box[(src, dst)].popleft()
            assert got.shape == buf.shape and got.dtype == buf.dtype, (got.shape, buf.shape)
            buf.copy_(got)

        return receive

    @contextmanager
    def installed(self) -> Iterator[None]:
        real_empty = torch.empty

        def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
            return poison(real_empty(*args, **kwargs))

        def no_gather(output: Any, input_: Any, **_: Any) -> None:
            pass  # the test assembles each destination group's slices itself

        with (
            mock.patch.object(dist, "P2POp", _Op),
            mock.patch.object(dist, "batch_isend_irecv", self.batch_isend_irecv),
            mock.patch.object(executor_mod, "all_gather_flat", no_gather),
            mock.patch.object(torch, "empty", empty),
        ):
            yield


# --- one micro-batch through every rank's executor ----------------------------------------------


@dataclass(frozen=True, kw_only=True, eq=False)
class Run:
    plans: dict[int, RankPlan]
    schedules: dict[int, RankSchedule]
    slots: dict[int, Slot]
    outputs: dict[int, dict[int, torch.Tensor]]  # destination group -> owner -> [padded, H]
    dest_layouts: dict[int, TokenLayout]  # destination group -> its full layout
    modes: Counter[str]
    posted_bytes: Counter[int]


def rank_layouts(student: Mesh, shards: dict[tuple[int, int], TokenLayout]) -> dict:
    """Per last-stage student rank, its TP rank's contiguous (uneven) part of its shard's rows:
    what each rank passes with ``keep_sp_shard``."""
    out = {}
    for r in student.last_stage_ranks():
        c = student.coord(r)
        assert c is not None
        lay = shards[(c.dp_rank, c.cp_rank)]
        part = torch.from_numpy(np.array_split(np.arange(lay.num_rows), student.tp)[c.tp_rank])
        out[r] = TokenLayout(
            sample_id_R=lay.sample_id_R[part].contiguous(),
            position_R=lay.position_R[part].contiguous(),
        )
    return out


def schedule_modes(s: RankSchedule) -> Counter[str]:
    """How many operations of each kind and mode ``s`` has; each operation's own mode, first
    row and count (what the executor reads) checked against its side's (made from its rows)."""
    modes: Counter[str] = Counter()
    for op in (*s.sends, *s.recvs):
        assert (op.mode, op.first, op.count) == (op.side.mode, op.side.first, op.side.count)
    for op in s.sends:
        modes[f"send:{op.side.mode}"] += 1
    for op in s.recvs:
        modes[f"recv:{op.side.mode}"] += 1
    for side in s.pack_sides.values():
        modes[f"pack:{side.mode}"] += 1
    for side in s.unpack_sides.values():
        modes[f"unpack:{side.mode}"] += 1
    for lop in s.locals:
        modes[f"local:{lop.mode}"] += 1
    return modes


def run_data_path(
    teachers: list[Mesh],
    student: Mesh,
    step: SyntheticStep,
    *,
    local_copy: bool = True,
    per_rank: bool = False,
) -> Run:
    """Plan every rank, then run its schedule through its own :class:`Executor`: every rank
    takes and posts (its teacher buffers overwritten right after), then every rank completes
    and releases; each destination group's buffer is its ranks' slices side by side."""
    n = len(teachers)
    s_rank_layouts = rank_layouts(student, step.student_layouts) if per_rank else None
    sim = simulate(
        teachers,
        student,
        step.teacher_layouts,
        step.student_layouts,
        per_rank_dests=per_rank,
        student_rank_layouts=s_rank_layouts,
    )
    cat = sim.catalog
    members = sim.topology.members
    row_bytes = [hidden_of(o) * DTYPE.itemsize for o in range(n)]
    plans = {r: plan_rank(cat, r, local_copy=local_copy) for r in members}
    schedules = {
        r: RankSchedule.build(
            p,
            slice_rows=cat.dests[p.dest.group].slice_rows if p.dest is not None else 0,
            num_owners=n,
            row_bytes=row_bytes,
        )
        for r, p in plans.items()
    }
    specs = {o: (hidden_of(o), DTYPE) for o in range(n)}
    sources: dict[int, dict[int, torch.Tensor]] = defaultdict(dict)
    for o, m in enumerate(teachers):
        for r in m.last_stage_ranks():
            c = m.coord(r)
            assert c is not None
            lay = step.teacher_layouts[o][(c.dp_rank, c.cp_rank)]
            sources[r][o] = key_pattern(lay, hidden_of(o), DTYPE, salt=o)
    mail = Mailbox()
    executors = {r: Executor(rank=r, timeout_s=5.0) for r in members}
    slots = {r: Slot(index=0, schedule=schedules[r]) for r in members}
    modes: Counter[str] = Counter()
    with mail.installed():
        for r in members:  # take (the rows given), overwrite the caller's buffers, post
            s = schedules[r]
            modes += schedule_modes(s)
            need = {op.owner for op in s.sends} | {x.owner for x in s.locals}
            if need:
                executors[r].take(
                    slots[r], {o: sources[r][o] for o in need}, output_specs=specs, device=CPU
                )
            for t in sources[r].values():
                poison(t)
            mail.rank = r
            executors[r].post(slots[r], output_specs=specs, device=CPU, group=None)
        deadline = time.monotonic() + 5.0
        for r in members:
            executors[r].complete(slots[r], tp_group=object(), deadline=deadline)
        for r in members:
            executors[r].release(slots[r], deadline=deadline)
    assert not any(mail.box.values()), "a send had no matching receive"
    outputs: dict[int, dict[int, torch.Tensor]] = {}
    dest_layouts: dict[int, TokenLayout] = {}
    for r, p in plans.items():
        s = schedules[r]
        if p.dest is None:
            continue
        d = p.dest.group
        if d not in outputs:
            outputs[d] = {
                o: torch.full((p.dest.padded_rows, hidden_of(o)), -7, dtype=torch.int32).view(DTYPE)
                for o in range(n)
            }
        lo = s.slice_rows * p.dest.slot
        for o in range(n):
            outputs[d][o][lo : lo + s.slice_rows] = slots[r].outputs[o][lo : lo + s.slice_rows]
        if s_rank_layouts is not None:
            dest_layouts[d] = s_rank_layouts[r]
        else:
            c = student.coord(r)
            assert c is not None
            dest_layouts[d] = step.student_layouts[(c.dp_rank, c.cp_rank)]
    return Run(
        plans=plans,
        schedules=schedules,
        slots=slots,
        outputs=outputs,
        dest_layouts=dest_layouts,
        modes=modes,
        posted_bytes=mail.posted_bytes,
    )


def assert_delivered(run: Run, step: SyntheticStep, n_owners: int) -> None:
    """Each destination row holds its owner's teacher row bit for bit; other rows are zero
    (padding of the last, short slice included); ``owner_N`` names the routed teacher."""
    route = dict(zip(step.sample_ids.tolist(), step.route.tolist(), strict=True))
    assert run.outputs or not step.student_layouts
    for d, lay in run.dest_layouts.items():
        owner_N = torch.tensor([route[s] if s >= 0 else -1 for s in lay.sample_id_R.tolist()])
        plan = next(p for p in run.plans.values() if p.dest is not None and p.dest.group == d)
        assert plan.owner_N is not None and torch.equal(torch.from_numpy(plan.owner_N), owner_N)
        for o in range(n_owners):
            got = run.outputs[d][o]
            want = key_pattern(lay, hidden_of(o), DTYPE, salt=o)
            mine = owner_N == o
            n = lay.num_rows
            assert torch.equal(bits(got[:n][mine]), bits(want[mine])), f"dest {d} owner {o}"
            assert bool((bits(got[:n][~mine]) == 0).all()), f"dest {d} owner {o}: not zeroed"
            assert bool((bits(got[n:]) == 0).all()), f"dest {d} owner {o}: padding not zeroed"


def assert_one_upload(run: Run) -> None:
    for r, slot in run.slots.items():
        if slot.dev is not None:
            assert slot.dev.late_uploads == 0, f"rank {r} read an index its schedule did not upload"
            assert slot.dev.uploads <= 1


@st.composite
def scenarios(draw):
    def mesh(off):
        return Mesh(
            tp=draw(st.integers(1, 3)),
            cp=draw(st.integers(1, 2)),
            dp=draw(st.integers(1, 2)),
            pp=draw(st.integers(1, 2)),
            rank_offset=off,
        )

    teachers = [mesh(0)]
    colocated = draw(st.booleans())
    if draw(st.booleans()):
        teachers.append(mesh(0 if colocated else teachers[0].size))
    end = max(m.rank_offset + m.size for m in teachers)
    student = mesh(0 if colocated else end)
    fmt = st.builds(
        SideFormat, kind=st.sampled_from(["sbh", "bsh", "thd"]), micro_batch=st.integers(1, 3)
    )
    s_fmt = draw(fmt)
    step = synthetic_step(
        teachers=teachers,
        student=student,
        num_samples=draw(st.integers(1, 6)),
        max_len=draw(st.sampled_from([4, 24, 80])),
        teacher_formats=[draw(fmt) for _ in teachers],
        student_format=SideFormat(
            kind=s_fmt.kind,
            micro_batch=s_fmt.micro_batch,
            pad_multiple=draw(st.sampled_from([1, student.tp])),  # 1: uneven slices
        ),
        seed=draw(st.integers(0, 2**16)),
    )
    return teachers, student, step


@given(scenarios(), st.booleans(), st.booleans())
@SETTINGS
def test_data_path_delivers_every_row_from_one_index_upload_per_schedule(
    scenario, local_copy, per_rank
):
    teachers, student, step = scenario
    run = run_data_path(teachers, student, step, local_copy=local_copy, per_rank=per_rank)
    assert_delivered(run, step, len(teachers))
    assert_one_upload(run)
    for r, s in run.schedules.items():  # what was posted is what the schedule says it sends
        assert run.posted_bytes[r] == s.counts()["send_bytes"], f"rank {r}"


FIXED = [
    # separate meshes, long padded sequences: runs and views
    ([Mesh(tp=2, cp=2, dp=1)], Mesh(tp=1, cp=1, dp=2, rank_offset=4), "thd", "sbh", 80),
    # separate meshes, long packed sequences of alternating teacher shards: staged runs
    ([Mesh(dp=2)], Mesh(rank_offset=2), "thd", "thd", 80),
    # short sequences, SBH on both sides with different micro-batches: per-row sides
    ([Mesh(tp=1, dp=2)], Mesh(tp=2, dp=1, rank_offset=2), "sbh", "bsh", 4),
    # colocated, different layouts: local copies of every kind
    ([Mesh(tp=2, cp=2, dp=2)], Mesh(tp=2, cp=2, dp=2), "thd", "sbh", 24),
    ([Mesh(tp=2, dp=2)], Mesh(tp=2, dp=2), "thd", "thd", 80),
    ([Mesh(tp=2, dp=2)], Mesh(tp=2, dp=2), "sbh", "thd", 4),
    ([Mesh(tp=1, dp=2)], Mesh(tp=1, dp=2), "thd", "sbh", 40),
]


def test_fixed_cases_cover_every_pack_unpack_and_local_mode():
    """The data path above is exercised in every mode (views, runs, per-row; local kinds), with
    even and uneven student slices."""
    seen: Counter[str] = Counter()
    uneven = 0
    for seed in range(4):
        for teachers, student, t_kind, s_kind, max_len in FIXED:
            step = synthetic_step(
                teachers=teachers,
                student=student,
                num_samples=6,
                max_len=max_len,
                teacher_formats=[SideFormat(kind=t_kind, micro_batch=2)] * len(teachers),
                student_format=SideFormat(
                    kind=s_kind, micro_batch=3, pad_multiple=student.tp if seed % 2 else 1
                ),
                seed=seed,
            )
            run = run_data_path(teachers, student, step)
            assert_delivered(run, step, len(teachers))
            assert_one_upload(run)
            seen += run.modes
            uneven += sum(
                p.dest.slice_rows < s.slice_rows
                for p, s in zip(run.plans.values(), run.schedules.values(), strict=True)
                if p.dest is not None
            )
    wanted = [f"{side}:{m}" for side in ("send", "recv") for m in ("view", "runs", "index")]
    wanted += [f"{side}:{m}" for side in ("pack", "unpack") for m in ("runs", "index")]
    wanted += ["local:runs", "local:gather", "local:scatter"]
    missing = [m for m in wanted if not seen[m]]
    assert not missing, f"modes never exercised: {missing} (seen {dict(seen)})"
    assert uneven, "no destination slice was short: uneven slices never exercised"


def test_a_broken_data_path_is_caught():
    """The check above can fail: a schedule whose unpack skips a row leaves poison (NaN bits)
    in the output, and the comparison reports it."""
    teachers, student = [Mesh(tp=1, dp=2)], Mesh(tp=2, dp=1, rank_offset=2)
    step = synthetic_step(
        teachers=teachers,
        student=student,
        num_samples=6,
        max_len=4,
        teacher_formats=[SideFormat(kind="sbh", micro_batch=2)],
        student_format=SideFormat(kind="bsh", micro_batch=3, pad_multiple=2),
        seed=0,
    )
    real = executor_mod._unpack

    def lossy(stage_RH, side, out_NH, dev):
        real(stage_RH, side, out_NH, dev)
        first = int(side.run_row[0]) if side.mode == "runs" else int(side.rows[0])
        poison(out_NH[first])  # the first row this unpack writes never lands

    with mock.patch.object(executor_mod, "_unpack", lossy):
        run = run_data_path(teachers, student, step)
    assert sum(v for k, v in run.modes.items() if k.startswith("unpack:")), (
        "no unpack: proves nothing"
    )
    with pytest.raises(AssertionError, match="dest"):
        assert_delivered(run, step, len(teachers))


def test_one_pack_and_one_unpack_per_owner_cover_its_staging_buffer():
    """The per-owner sides list the staged ops' rows in staging order, nothing else."""
    teachers, student = [Mesh(tp=1, dp=2), Mesh(tp=2)], Mesh(tp=2, dp=2, rank_offset=2)
    step = synthetic_step(
        teachers=teachers,
        student=student,
        num_samples=8,
        max_len=6,
        teacher_formats=[SideFormat(kind="sbh", micro_batch=2)] * 2,
        student_format=SideFormat(kind="bsh", micro_batch=3, pad_multiple=2),
        seed=3,
    )
    run = run_data_path(teachers, student, step)
    assert_delivered(run, step, len(teachers))
    staged_any = False
    for s in run.schedules.values():
        for ops, sides, stage_rows in (
            (s.sends, s.pack_sides, s.send_stage_rows),
            (s.recvs, s.unpack_sides, s.recv_stage_rows),
        ):
            for owner, side in sides.items():
                staged = [op for op in ops if op.owner == owner and op.side.mode != "view"]
                assert [op.stage_off for op in staged] == sorted(op.stage_off for op in staged)
                want = torch.cat([op.side.rows for op in staged])
                assert torch.equal(side.rows, want) and want.numel() == stage_rows[owner]
                staged_any |= len(staged) > 1
            assert set(sides) == {op.owner for op in ops if op.side.mode != "view"}
        c = s.counts()
        assert c["pack_launches"] <= len(teachers) and c["unpack_launches"] <= len(teachers)
    assert staged_any, "no owner had two staged peers: the case proves nothing"


def test_device_indices_views_and_late_uploads_on_cpu():
    a = torch.arange(5, dtype=torch.int64)
    b = torch.tensor([[7, 8], [9, 10]], dtype=torch.int64)
    dev = DeviceIndices([a, b, a], torch.device("cpu"))
    assert dev.uploads == 1 and dev.late_uploads == 0
    flat = dev(a).untyped_storage()
    assert dev(b).untyped_storage().data_ptr() == flat.data_ptr()  # one buffer
    assert flat.nbytes() == 9 * 8  # a once, b once
    assert torch.equal(dev(a), a) and torch.equal(dev(b), b) and dev(b).shape == (2, 2)
    assert dev(a).data_ptr() != a.data_ptr()  # a view of the one upload, not the host tensor
    c = torch.tensor([3], dtype=torch.int64)
    assert torch.equal(dev(c), c) and dev(c) is dev(c)
    assert dev.uploads == 2 and dev.late_uploads == 1
    empty = DeviceIndices([], torch.device("cpu"))
    assert empty.uploads == 0


def test_device_indices_refuse_non_int64_or_device_tensors():
    with pytest.raises(AssertionError, match=r"int64 host tensors, got torch\.int32 on cpu"):
        DeviceIndices([torch.arange(3, dtype=torch.int32)], torch.device("cpu"))
    with pytest.raises(AssertionError, match=r"int64 host tensors, got torch\.int64 on meta"):
        DeviceIndices([torch.empty(3, dtype=torch.int64, device="meta")], torch.device("cpu"))


def test_integrity_indices_cover_what_the_checks_read():
    """With integrity, the upload also holds every row array the checks index with."""
    teachers, student = [Mesh(tp=2, dp=2)], Mesh(tp=2, dp=2)
    step = synthetic_step(
        teachers=teachers,
        student=student,
        num_samples=6,
        max_len=24,
        teacher_formats=[SideFormat(kind="thd", micro_batch=2)],
        student_format=SideFormat(kind="sbh", micro_batch=3, pad_multiple=2),
        seed=1,
    )
    run = run_data_path(teachers, student, step)
    checked = 0
    for s in run.schedules.values():
        uploaded = {id(t) for t in s.data_path_indices(integrity=True)}
        read = [*s.send_src_rel, *s.local_src_rel]
        read += [op.side.rows for op in s.recvs] + [x.dst.rows for x in s.locals]
        assert all(id(t) in uploaded for t in read)
        checked += len(read)
        for op, rel in zip(s.sends, s.send_src_rel, strict=True):
            assert torch.equal(rel + s.src_span[op.owner][0], op.side.rows)
        plain = {id(t) for t in s.data_path_indices()}  # without integrity: no check arrays
        assert not {id(t) for t in (*s.send_src_rel, *s.local_src_rel)} & plain
    assert checked, "no schedule reads any check array: the case proves nothing"
