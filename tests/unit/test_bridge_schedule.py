"""Tier 1: rank schedules, their one-copy index upload, and the executor's data path in one process.

Every rank's schedule of a plan is run through the executor's own pack / unpack / local-copy /
zero-fill functions, with a mailbox standing in for the transport (sends and receives between two
ranks pair in posting order, as on NCCL and gloo). The student buffers, poisoned first, must hold
exactly the teacher rows of their keys, and every index the data path reads must have come from
the schedule's single upload (:class:`mopd.bridge.schedule.DeviceIndices`).
"""

from __future__ import annotations

import datetime
from collections import Counter, defaultdict, deque

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mopd.bridge import Mesh, StudentBatch, TeacherBatch, plan_token_exchange
from mopd.bridge.executor import Executor, _local, _pack, _unpack
from mopd.bridge.schedule import DeviceIndices, RankSchedule
from mopd.profiling.synthetic import SideFormat, key_pattern, synthetic_step

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPE = torch.float32
POISON = -1  # int32 bits of every output row before the exchange (a NaN in float32)


def hidden_of(owner: int) -> int:
    return 5 + 3 * owner


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def run_data_path(teachers, student, step, *, local_copy=True):
    """Plan, then run every rank's schedule through the executor's data-path functions.

    Returns ``(outputs, schedules, indices, modes)``: ``outputs[(shard, owner)]`` is the student
    group's full ``[N, H_owner]`` buffer (each TP rank writes its slice, which is what the TP
    all-gather would assemble), ``indices[rank]`` the rank's :class:`DeviceIndices`, ``modes``
    a count of the side and local-copy modes seen.
    """
    plan = plan_token_exchange(
        [
            TeacherBatch(mesh=m, layouts=lay, hidden_size=hidden_of(o), itemsize=DTYPE.itemsize)
            for o, (m, lay) in enumerate(zip(teachers, step.teacher_layouts, strict=True))
        ],
        StudentBatch(mesh=student, layouts=step.student_layouts),
        local_copy=local_copy,
    )
    ranks = sorted({r for m in (*teachers, student) for r in m.ranks})
    sources: dict[int, dict[int, torch.Tensor]] = defaultdict(dict)
    for o, m in enumerate(teachers):
        for r in m.ranks:
            if m.is_last_stage(r):
                c = m.coord(r)
                lay = step.teacher_layouts[o][(c.dp_rank, c.cp_rank)]
                sources[r][o] = key_pattern(lay, hidden_of(o), DTYPE, salt=o)
    outputs = {
        (shard, o): torch.full((lay.num_rows, hidden_of(o)), POISON, dtype=torch.int32).view(DTYPE)
        for shard, lay in step.student_layouts.items()
        for o in range(len(teachers))
    }
    schedules = {r: RankSchedule.build(plan, r) for r in ranks}
    cpu = torch.device("cpu")
    indices = {r: DeviceIndices(s.data_path_indices(), cpu) for r, s in schedules.items()}
    modes: Counter[str] = Counter()
    mailbox: dict[tuple[int, int], deque] = defaultdict(deque)

    def staging(rows: int, hidden: int) -> torch.Tensor:
        return torch.full((rows, hidden), POISON, dtype=torch.int32).view(DTYPE)

    for r, s in schedules.items():  # every rank packs (one launch per owner), then posts
        send_stage = {o: staging(n, hidden_of(o)) for o, n in s.send_stage_rows.items()}
        for o, side in s.pack_sides.items():
            modes[f"pack:{side.mode}"] += 1
            _pack(sources[r][o], side, send_stage[o], indices[r])
        for op in s.sends:
            modes[f"send:{op.side.mode}"] += 1
            src = sources[r][op.owner]
            if op.side.mode == "view":
                buf = src[op.side.first : op.side.first + op.count]
            else:
                buf = send_stage[op.owner][op.stage_off : op.stage_off + op.count]
            mailbox[(r, op.peer)].append((op.owner, buf.clone()))
    for r, s in schedules.items():  # then every rank receives, unpacks and copies locally
        if s.dest_index < 0:
            continue
        c = student.coord(r)
        shard = (c.dp_rank, c.cp_rank)
        targets = {
            o: outputs[(shard, o)][s.row_offset : s.row_offset + s.slice_rows]
            for o in range(len(teachers))
        }
        executor = Executor(rank=r, timeout=datetime.timedelta(seconds=1))
        for owner, rows in s.fill.items():
            if rows.numel():
                executor._zero_rows(targets[owner], rows, indices[r])
        recv_stage = {o: staging(n, hidden_of(o)) for o, n in s.recv_stage_rows.items()}
        for op in s.recvs:
            modes[f"recv:{op.side.mode}"] += 1
            owner, got = mailbox[(op.peer, r)].popleft()
            assert owner == op.owner and got.shape[0] == op.count
            if op.side.mode == "view":
                targets[op.owner][op.side.first : op.side.first + op.count] = got
            else:
                recv_stage[op.owner][op.stage_off : op.stage_off + op.count] = got
        for o, side in s.unpack_sides.items():  # after every receive: one launch per owner
            modes[f"unpack:{side.mode}"] += 1
            _unpack(recv_stage[o], side, targets[o], indices[r])
        for lop in s.locals:
            modes[f"local:{lop.mode}"] += 1
            _local(sources[r][lop.owner], lop, targets[lop.owner], indices[r])
    assert not any(mailbox.values()), "a send had no matching receive"
    return outputs, schedules, indices, modes


def assert_delivered(outputs, teachers, step):
    """Each student row holds its owner's teacher row bit for bit; other rows are zero."""
    route = dict(zip(step.sample_ids.tolist(), step.route.tolist(), strict=True))
    for shard, lay in step.student_layouts.items():
        owner_N = torch.tensor([route[s] if s >= 0 else -1 for s in lay.sample_id_R.tolist()])
        for o in range(len(teachers)):
            got = outputs[(shard, o)]
            want = key_pattern(lay, hidden_of(o), DTYPE, salt=o)
            mine = owner_N == o
            assert torch.equal(bits(got[mine]), bits(want[mine])), f"shard {shard} owner {o}"
            assert bool((bits(got[~mine]) == 0).all()), f"shard {shard} owner {o}: not zeroed"


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
            kind=s_fmt.kind, micro_batch=s_fmt.micro_batch, pad_multiple=student.tp
        ),
        seed=draw(st.integers(0, 2**16)),
    )
    return teachers, student, step


@given(scenarios(), st.booleans())
@SETTINGS
def test_data_path_delivers_every_row_from_one_index_upload_per_schedule(scenario, local_copy):
    teachers, student, step = scenario
    outputs, _, indices, _ = run_data_path(teachers, student, step, local_copy=local_copy)
    assert_delivered(outputs, teachers, step)
    for r, dev in indices.items():
        assert dev.late_uploads == 0, f"rank {r} read an index its schedule did not upload"
        assert dev.uploads <= 1


def test_fixed_cases_cover_every_pack_unpack_and_local_mode():
    """The data path above is exercised in every mode (views, runs, per-row; local kinds)."""
    seen: Counter[str] = Counter()
    cases = [
        # separate meshes, long padded sequences: runs and views
        ([Mesh(tp=2, cp=2, dp=1)], Mesh(tp=1, cp=1, dp=2, rank_offset=4), "thd", "sbh", 80),
        # short sequences, SBH on both sides with different micro-batches: per-row sides
        ([Mesh(tp=1, dp=2)], Mesh(tp=2, dp=1, rank_offset=2), "sbh", "bsh", 4),
        # colocated, different layouts: local copies of every kind
        ([Mesh(tp=2, cp=2, dp=2)], Mesh(tp=2, cp=2, dp=2), "thd", "sbh", 24),
        ([Mesh(tp=2, dp=2)], Mesh(tp=2, dp=2), "thd", "thd", 80),
        ([Mesh(tp=2, dp=2)], Mesh(tp=2, dp=2), "sbh", "thd", 4),
        ([Mesh(tp=1, dp=2)], Mesh(tp=1, dp=2), "thd", "sbh", 40),
    ]
    for seed in range(4):
        for teachers, student, t_kind, s_kind, max_len in cases:
            step = synthetic_step(
                teachers=teachers,
                student=student,
                num_samples=6,
                max_len=max_len,
                teacher_formats=[SideFormat(kind=t_kind, micro_batch=2)] * len(teachers),
                student_format=SideFormat(kind=s_kind, micro_batch=3, pad_multiple=student.tp),
                seed=seed,
            )
            outputs, _, indices, modes = run_data_path(teachers, student, step)
            assert_delivered(outputs, teachers, step)
            assert all(d.late_uploads == 0 for d in indices.values())
            seen += modes
    wanted = [f"{side}:{m}" for side in ("send", "recv") for m in ("view", "runs", "index")]
    wanted += [f"{side}:{m}" for side in ("pack", "unpack") for m in ("runs", "index")]
    wanted += ["local:runs", "local:gather", "local:scatter"]
    missing = [m for m in wanted if not seen[m]]
    assert not missing, f"modes never exercised: {missing} (seen {dict(seen)})"


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
    _, schedules, _, _ = run_data_path(teachers, student, step)
    staged_any = False
    for s in schedules.values():
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
    _, schedules, _, _ = run_data_path(teachers, student, step)
    for s in schedules.values():
        uploaded = {id(t) for t in s.data_path_indices(integrity=True)}
        read = [*s.send_src_rel, *s.local_src_rel]
        read += [op.side.rows for op in s.recvs] + [x.dst.rows for x in s.locals]
        assert all(id(t) in uploaded for t in read)
        for op, rel in zip(s.sends, s.send_src_rel, strict=True):
            assert torch.equal(rel + s.src_span[op.owner][0], op.side.rows)
        plain = {id(t) for t in s.data_path_indices()}  # without integrity: no check arrays
        assert not {id(t) for t in (*s.send_src_rel, *s.local_src_rel)} & plain
