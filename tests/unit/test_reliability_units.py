"""Tier 1: the reliability pieces on their own (no process group).

Config and constructor misuse raise ``ValueError`` naming the values; :func:`row_checksum` equals
an integer reference computed from the raw bytes and changes under every single-bit flip; the
mismatch report round-trips and formats the same text; transport errors are classified; the
executor's caches are bounded, its staging pool reuses buffers, a failed executor refuses work,
and integrity mode on a one-rank colocated plan (local copies only, no communication) is exact
when clean and names the block when a source row changes between checksum and copy.
"""

from __future__ import annotations

import datetime

import pytest
import torch

from mopd.bridge import (
    BridgeConfig,
    BridgeGroups,
    HiddenStateBridge,
    Mesh,
    StudentBatch,
    TeacherBatch,
    TeacherSpec,
    padded_layout,
    plan_token_exchange,
)
from mopd.bridge.api import (
    BridgeCommError,
    BridgeIntegrityError,
    BridgeStateError,
    BridgeTimeoutError,
)
from mopd.bridge.executor import Executor, _StagePool, buffers_overlap, comm_failure
from mopd.bridge.integrity import (
    CROSSING,
    MAX_REPORTED,
    TP_GATHER,
    BlockMismatch,
    decode_mismatches,
    encode_mismatches,
    format_mismatches,
    row_checksum,
)
from mopd.profiling.synthetic import SideFormat, key_pattern, synthetic_step

TIMEOUT = datetime.timedelta(seconds=5)


# --- configuration misuse --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"timeout_s": 0}, r"timeout_s must be a positive finite number, got 0"),
        ({"timeout_s": -3.0}, r"got -3.0"),
        ({"timeout_s": float("inf")}, r"got inf"),
        ({"timeout_s": "5"}, r"got '5'"),
        ({"timeout_s": True}, r"got True"),
        ({"max_cached_plans": 0}, r"max_cached_plans must be an int >= 1, got 0"),
        ({"max_cached_plans": 2.5}, r"got 2.5"),
        ({"integrity": "yes"}, r"integrity must be a bool, got 'yes'"),
        ({"local_copy": 1}, r"local_copy must be a bool, got 1"),
    ],
)
def test_bridge_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BridgeConfig(**kwargs)


def test_bridge_config_defaults_keep_integrity_off():
    assert BridgeConfig().integrity is False


def test_teacher_spec_and_bridge_constructor_misuse():
    with pytest.raises(ValueError, match="hidden_size must be a positive int, got 0"):
        TeacherSpec(mesh=Mesh(), hidden_size=0)
    groups = BridgeGroups(bridge=None, student_tp=None, members=(0, 1))
    with pytest.raises(ValueError, match="at least one teacher"):
        HiddenStateBridge(teachers=[], student=Mesh(), groups=groups, rank=0)
    with pytest.raises(
        ValueError, match=r"teachers must be TeacherSpec and student a Mesh, got \['Mesh'\]"
    ):
        HiddenStateBridge(teachers=[Mesh()], student=Mesh(), groups=groups, rank=0)  # type: ignore[list-item]
    with pytest.raises(
        ValueError, match=r"created for global ranks \[0, 1\] but these meshes span \[0, 1, 2\]"
    ):
        HiddenStateBridge(
            teachers=[TeacherSpec(mesh=Mesh(), hidden_size=4)],
            student=Mesh(tp=2, rank_offset=1),
            groups=groups,
            rank=0,
        )


# --- checksums -------------------------------------------------------------------------------


def _reference(rows: torch.Tensor) -> list[int]:
    """Sum of each row's bytes as little-endian words of the size row_checksum picks, mod 2**64."""
    raw = rows.contiguous().view(torch.uint8).reshape(rows.shape[0], -1)
    row_bytes = raw.shape[1]
    word = next(w for w in (8, 4, 2, 1) if row_bytes % w == 0)
    out = []
    for r in raw.tolist():
        total = 0
        for i in range(0, row_bytes, word):
            v = int.from_bytes(bytes(r[i : i + word]), "little", signed=True)
            total += v
        total %= 2**64
        out.append(total - 2**64 if total >= 2**63 else total)
    return out


@pytest.mark.parametrize(
    ("dtype", "h"),
    [
        (torch.bfloat16, 8),
        (torch.float32, 3),
        (torch.float16, 6),
        (torch.uint8, 3),
        (torch.int16, 1),
    ],
)
def test_row_checksum_matches_an_integer_reference(dtype, h):
    gen = torch.Generator().manual_seed(h)
    rows = torch.randint(-(2**62), 2**62, (5, 8), generator=gen).view(torch.uint8)
    rows = rows.reshape(-1)[: 5 * h * torch.empty((), dtype=dtype).element_size()]
    rows = rows.view(dtype).reshape(5, h)
    assert row_checksum(rows).tolist() == _reference(rows)


def test_every_single_bit_flip_changes_the_checksum():
    rows = key_pattern(padded_layout([3], 2), 4, torch.bfloat16)  # 2 rows of 8 bytes
    base = row_checksum(rows)
    raw = rows.view(torch.uint8)
    for byte in range(raw.shape[1]):
        for bit in range(8):
            bad = raw.clone()
            bad[1, byte] ^= 1 << bit
            got = row_checksum(bad.view(torch.bfloat16))
            assert got[0] == base[0] and got[1] != base[1], (byte, bit)


def test_misaligned_rows_give_the_same_checksum_as_an_aligned_copy():
    flat = torch.arange(41, dtype=torch.float32)
    rows = flat[1:33].view(4, 8)  # storage offset 4 bytes: not 8-byte aligned for int64 words
    assert torch.equal(row_checksum(rows), row_checksum(rows.clone()))
    with pytest.raises(ValueError, match="contiguous rows"):
        row_checksum(torch.zeros(4, 8).t())


def test_mismatch_report_round_trips_and_formats_identically():
    found = [
        BlockMismatch(
            owner=0, src_rank=1, dst_rank=3, rows=16, bad=2, dst_rows=(5, 9), src_rows=(0, 4)
        ),
        BlockMismatch(owner=1, src_rank=-1, dst_rank=3, rows=9, bad=7, dst_rows=(1, 2, 3, 4)),
        BlockMismatch(
            owner=1,
            src_rank=2,
            dst_rank=3,
            rows=8,
            bad=1,
            dst_rows=(6,),
            src_rows=(6,),
            stage=TP_GATHER,
        ),
    ]
    total, back = decode_mismatches(encode_mismatches(found))
    assert total == 3 and back == found
    assert [m.stage for m in back] == [CROSSING, CROSSING, TP_GATHER]
    text = format_mismatches([(2, 0, []), (3, total, back)])
    assert text == format_mismatches(
        [(2, 0, []), (3, *decode_mismatches(encode_mismatches(found)))]
    )
    assert (
        "1 -> global rank 3: 2 of 16 rows differ (destination rows [5, 9], source rows [0, 4])"
        in text
    )
    assert (
        "teacher 1 on global rank 3: 7 of 9 rows that no transfer writes are not zero "
        "(destination rows [1, 2, 3, 4, ...])"
    ) in text
    assert (
        "teacher 1: student TP all-gather, global rank 2 -> global rank 3: 1 of 8 rows differ "
        "from the sender's slice (destination rows [6], rows of the sender's slice [6])"
    ) in text
    assert text.startswith(
        "bridge integrity check failed: 3 corrupted block(s) received on global rank(s) [3]"
    )
    many = [
        BlockMismatch(owner=0, src_rank=r, dst_rank=9, rows=1, bad=1, dst_rows=(0,))
        for r in range(6)
    ]
    total, back = decode_mismatches(encode_mismatches(many))
    assert total == 6 and len(back) == MAX_REPORTED
    assert f"{6 - MAX_REPORTED} more block(s) on global rank 9" in format_mismatches(
        [(9, total, back)]
    )


# --- transport errors ------------------------------------------------------------------------


def test_transport_errors_are_classified_and_name_the_rank_and_timeout():
    t = comm_failure(
        RuntimeError("Operation timed out!"), rank=3, what="X", timeout_s=5, elapsed_s=5.0
    )
    assert isinstance(t, BridgeTimeoutError) and isinstance(t, TimeoutError)
    assert str(t).startswith("global rank 3: X did not complete within BridgeConfig.timeout_s=5 s")
    nccl = comm_failure(
        RuntimeError("Work ran for 5001 milliseconds before timing out."),
        rank=0,
        what="W",
        timeout_s=9,
        elapsed_s=5.0,
    )
    assert isinstance(nccl, BridgeTimeoutError)
    late = comm_failure(RuntimeError("whatever"), rank=0, what="Y", timeout_s=2, elapsed_s=2.0)
    assert isinstance(late, BridgeTimeoutError)
    dead = comm_failure(
        RuntimeError("Connection closed by peer [127.0.0.1]:1"),
        rank=1,
        what="Z",
        timeout_s=5,
        elapsed_s=0.1,
    )
    assert isinstance(dead, BridgeCommError) and not isinstance(dead, TimeoutError)
    assert "typically because a peer process died" in str(dead)


def test_buffers_overlap():
    a = torch.zeros(10, 4)
    assert buffers_overlap(a[2:5], a[4:8]) and not buffers_overlap(a[:4], a[4:])
    assert not buffers_overlap(a, torch.zeros(10, 4))
    assert not buffers_overlap(torch.empty(4, device="meta"), torch.empty(4, device="meta"))
    assert not buffers_overlap(a[:0], a)


# --- executor --------------------------------------------------------------------------------


def _plan(seed: int, hidden: int = 8):
    mesh = Mesh()
    step = synthetic_step(
        teachers=[mesh],
        student=mesh,
        num_samples=4,
        max_len=9,
        teacher_formats=[SideFormat(kind="thd")],
        student_format=SideFormat(kind="bsh", micro_batch=3),
        seed=seed,
    )
    t_lay, s_lay = step.teacher_layouts[0][(0, 0)], step.student_layouts[(0, 0)]
    plan = plan_token_exchange(
        [TeacherBatch(mesh=mesh, layouts={(0, 0): t_lay}, hidden_size=hidden, itemsize=4)],
        StudentBatch(mesh=mesh, layouts={(0, 0): s_lay}),
    )
    return plan, t_lay, s_lay


def test_executor_bounds_its_schedules_and_refuses_work_after_a_failure():
    with pytest.raises(ValueError, match="max_schedules must be >= 1, got 0"):
        Executor(rank=0, timeout=TIMEOUT, max_schedules=0)
    ex = Executor(rank=0, timeout=TIMEOUT, max_schedules=2)
    plans = [_plan(s)[0] for s in range(4)]
    for p in plans + plans[:1]:
        ex.schedule(p)
    assert len(ex._schedules) == 2 and list(ex._schedules) == [
        plans[3].signature,
        plans[0].signature,
    ]
    ex.mark_failed(BridgeTimeoutError("first cause"))
    ex.mark_failed(BridgeTimeoutError("second cause"))
    with pytest.raises(
        BridgeStateError, match=r"after a failed exchange \(BridgeTimeoutError: first cause\)"
    ):
        ex.start(plans[0], sources={}, outputs={}, group=None)


def test_stage_pool_reuses_and_grows():
    pool = _StagePool()
    like = torch.zeros(1, 4)
    a = pool.acquire(("k",), 3, like)
    pool.release(("k",), a)
    assert pool.acquire(("k",), 2, like) is a
    pool.release(("k",), a)
    b = pool.acquire(("k",), 5, like)
    assert b is not a and b.shape == (5, 4)
    c = pool.acquire(("k",), 1, like)  # b is busy: a second buffer
    assert c is not b and pool.buffers == 2 and pool.allocations == 3
    assert pool.bytes == (5 + 1) * 4 * 4


@pytest.mark.parametrize("integrity", [False, True])
def test_one_rank_local_copies_are_exact_with_and_without_integrity(integrity):
    plan, t_lay, s_lay = _plan(5)
    src = key_pattern(t_lay, 8, torch.float32)
    out = torch.full((s_lay.num_rows, 8), float("nan"))
    ex = Executor(rank=0, timeout=TIMEOUT, integrity=integrity)
    ex.start(plan, sources={0: src}, outputs={0: out}, group=None).wait()
    want = key_pattern(s_lay, 8, torch.float32)
    want[s_lay.sample_id_R < 0] = 0
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
    assert ex.memory_stats()["in_flight"] == 0 and ex.memory_stats()["exchanges"] == 1


def test_integrity_names_a_source_row_changed_before_its_local_copy():
    plan, t_lay, s_lay = _plan(6)
    src = key_pattern(t_lay, 8, torch.float32)
    out = torch.empty((s_lay.num_rows, 8))

    def hook(point: str, blocks: list) -> None:
        if point == "posted":
            row = int(ex.schedule(plan).locals[0].src.rows[2])
            src.view(torch.int32)[row, 5] ^= 1 << 30

    ex = Executor(rank=0, timeout=TIMEOUT, integrity=True, debug_hook=hook)
    loc = ex.schedule(plan).locals[0]
    with pytest.raises(BridgeIntegrityError) as info:
        ex.start(plan, sources={0: src}, outputs={0: out}, group=None).wait()
    msg = str(info.value)
    assert msg.startswith(
        "bridge integrity check failed: 1 corrupted block(s) received on global rank(s) [0]"
    )
    assert (
        f"teacher 0: global rank 0 -> global rank 0: 1 of {loc.src.rows.numel()} rows differ "
        f"(destination rows [{int(loc.dst.rows[2])}], source rows [{int(loc.src.rows[2])}])"
    ) in msg
    assert ex.failure is None  # a caught corruption leaves the executor usable
