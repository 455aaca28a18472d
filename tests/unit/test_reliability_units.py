"""Tier 1: the reliability pieces on their own, and the step API's local misuse on one rank.

Without a process group: config and constructor misuse raise ``ValueError`` naming the values
(``timeout_s`` is the one spelling: ``BridgeConfig(timeout_s=)``, ``GroupPool(timeout_s=)``);
:func:`row_checksum` equals an integer reference computed from the raw bytes and changes under
every single-bit flip; the mismatch report round-trips (micro-batch included) and formats the
same text; transport errors are classified; the staging pool reuses buffers.

On a one-rank gloo world (an in-process store; teacher and student colocated, so every row
moves by local copy and nothing waits on a peer): steps of several micro-batches are exact with
and without integrity; integrity names the micro-batch and rows of a row changed after its
local copy and leaves the bridge usable; the schedule cache is bounded (least recently used
dropped); a failed executor refuses every call of the step API; and the step API's local
misuse (out of order, twice, out of range, after ``finish()``, a wrong buffer) raises the
documented error at once, a rejected buffer changing nothing.
"""

from __future__ import annotations

import datetime
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from mopd.bridge import (
    BridgeConfig,
    BridgeGroups,
    BridgeStep,
    GroupPool,
    HiddenStateBridge,
    Mesh,
    TeacherSpec,
    padded_layout,
)
from mopd.bridge.config import DEFAULT_TIMEOUT_S
from mopd.bridge.errors import (
    BridgeCommError,
    BridgeIntegrityError,
    BridgeNonFiniteError,
    BridgeStateError,
    BridgeTimeoutError,
)
from mopd.bridge.executor import _StagePool, comm_failure
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
from tests.support.reliability import fresh_bridge

H = 8
M = 3  # micro-batches per step
T_S = 5.0

# --- configuration misuse --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"timeout_s": 0}, r"timeout_s must be a positive finite number, got 0"),
        ({"timeout_s": -3.0}, r"got -3.0"),
        ({"timeout_s": float("inf")}, r"got inf"),
        ({"timeout_s": float("nan")}, r"got nan"),
        ({"timeout_s": "5"}, r"got '5'"),
        ({"timeout_s": True}, r"got True"),
        ({"max_cached_plans": 0}, r"max_cached_plans must be an int >= 1, got 0"),
        ({"max_cached_plans": 2.5}, r"got 2.5"),
        ({"integrity": "yes"}, r"integrity must be a bool, got 'yes'"),
        ({"local_copy": 1}, r"local_copy must be a bool, got 1"),
        ({"keep_sp_shard": None}, r"keep_sp_shard must be a bool, got None"),
    ],
)
def test_bridge_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BridgeConfig(**kwargs)


@pytest.mark.parametrize("bad", [0, -1.5, True, "5", float("inf"), float("nan")])
def test_group_pool_rejects_bad_timeouts(bad):
    """At construction, not as an OverflowError inside the first (collective) group creation."""
    with pytest.raises(
        ValueError, match=r"timeout_s must be a positive finite number of seconds, got"
    ):
        GroupPool(timeout_s=bad)


def test_timeout_is_spelled_timeout_s():
    """The old ``timedelta`` keyword is gone, not silently ignored."""
    with pytest.raises(TypeError):
        GroupPool(timeout=datetime.timedelta(seconds=5))  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        BridgeConfig(timeout=5)  # type: ignore[call-arg]
    assert GroupPool(timeout_s=2.5).timeout_s == 2.5


def test_a_group_pool_without_a_timeout_is_bounded(one_rank_world):
    """Without ``timeout_s`` the groups wait the bridge's default, not torch's 30 minutes, and
    a bridge's own timeout once one is built on the pool (``bound_by``), the groups made before
    included; a pool given ``timeout_s`` keeps it. Nothing is warned."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pool = GroupPool()
        given = GroupPool(timeout_s=30)
    assert pool.timeout_s == DEFAULT_TIMEOUT_S == BridgeConfig().timeout_s
    early = pool.create([0])
    assert _group_wait_s(early) == DEFAULT_TIMEOUT_S
    pool.bound_by(7.0)
    assert pool.timeout_s == 7.0 and _group_wait_s(early) == 7.0
    assert _group_wait_s(pool.create([0], backend="gloo", purpose="later")) == 7.0
    pool.bound_by(20.0)  # never longer than before
    assert pool.timeout_s == 7.0
    given.bound_by(7.0)
    assert given.timeout_s == 30.0 and _group_wait_s(given.create([0])) == 30.0


def _group_wait_s(group: Any) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def test_bridge_config_defaults_keep_integrity_off():
    assert BridgeConfig().integrity is False


def test_teacher_spec_misuse():
    with pytest.raises(ValueError, match="hidden_size must be >= 1, got 0"):
        TeacherSpec(mesh=Mesh(), hidden_size=0)
    with pytest.raises(ValueError, match="hidden_size must be an int, got True"):
        TeacherSpec(mesh=Mesh(), hidden_size=True)
    with pytest.raises(ValueError, match=r"TeacherSpec\.mesh must be a Mesh, got tuple"):
        TeacherSpec(mesh=(2, 1), hidden_size=8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dtype must be a torch\.dtype, got 'bf16'"):
        TeacherSpec(mesh=Mesh(), hidden_size=8, dtype="bf16")  # type: ignore[arg-type]


def test_bridge_constructor_misuse_before_any_group_is_used():
    groups = BridgeGroups(bridge=None, student_tp=None, members=(0, 1))
    with pytest.raises(ValueError, match="at least one teacher"):
        HiddenStateBridge(teachers=[], student=Mesh(), groups=groups)
    with pytest.raises(
        ValueError, match=r"teachers must be TeacherSpec and student a Mesh, got \['Mesh'\]"
    ):
        HiddenStateBridge(teachers=[Mesh()], student=Mesh(), groups=groups)  # type: ignore[list-item]


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
            total += int.from_bytes(bytes(r[i : i + word]), "little", signed=True)
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
            owner=0,
            src_rank=1,
            dst_rank=3,
            rows=16,
            bad=2,
            dst_rows=(5, 9),
            src_rows=(0, 4),
            micro_batch=2,
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
            micro_batch=5,
        ),
    ]
    total, back = decode_mismatches(encode_mismatches(found))
    assert total == 3 and back == found
    assert [m.stage for m in back] == [CROSSING, CROSSING, TP_GATHER]
    assert [m.micro_batch for m in back] == [2, 0, 5]
    text = format_mismatches([(2, 0, []), (3, total, back)])
    assert text == format_mismatches(
        [(2, 0, []), (3, *decode_mismatches(encode_mismatches(found)))]
    )
    assert (
        "teacher 0, micro-batch 2: global rank 1 -> global rank 3: 2 of 16 rows differ "
        "(destination rows [5, 9], source rows [0, 4])"
    ) in text
    assert (
        "teacher 1, micro-batch 0 on global rank 3: 7 of 9 rows that no transfer writes are not "
        "zero (destination rows [1, 2, 3, 4, ...])"
    ) in text
    assert (
        "teacher 1, micro-batch 5: student TP all-gather, global rank 2 -> global rank 3: 1 of 8 "
        "rows differ from the sender's slice (destination rows [6], rows of the sender's slice "
        "[6])"
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
    assert all(isinstance(e, RuntimeError) for e in (t, nccl, late, dead))


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
    # best fit: a slot gets the smallest free buffer that holds it, whatever order they
    # were returned in, so small and large slots alternating allocate nothing more
    pool.release(("k",), b)
    pool.release(("k",), c)
    for rows in (5, 1, 5, 1):
        got = pool.acquire(("k",), rows, like)
        assert got is (b if rows == 5 else c)
        pool.release(("k",), got)
    pool.release(("k",), pool.acquire(("k",), 1, like))
    assert pool.allocations == 3
    # none fits: the largest free one is replaced
    d = pool.acquire(("k",), 7, like)
    assert d.shape == (7, 4) and pool.buffers == 2 and pool.allocations == 4


# --- one rank: the step API end to end, local copies only -------------------------------------


@pytest.fixture(scope="module")
def one_rank_world() -> Iterator[None]:
    """A one-rank gloo world on an in-process store (torn down after the module)."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            pytest.skip("a process group of several ranks is already initialized")
        yield
        return
    dist.init_process_group(
        "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )
    yield
    dist.destroy_process_group()


MESH = Mesh()


def layouts(seed: int) -> tuple[list[Any], list[Any]]:
    """``M`` micro-batches of one step: (teacher THD layouts, student ``[S, B]`` layouts)."""
    t, s = [], []
    for i in range(M):
        step = synthetic_step(
            teachers=[MESH],
            student=MESH,
            num_samples=4,
            max_len=9,
            teacher_formats=[SideFormat(kind="thd")],
            student_format=SideFormat(kind="sbh", micro_batch=3),
            seed=10 * seed + i,
        )
        t.append(step.teacher_layouts[0][(0, 0)])
        s.append(step.student_layouts[(0, 0)])
    return t, s


def rows(lay: Any, i: int) -> torch.Tensor:
    return key_pattern(lay, H, torch.float32, salt=i)


def want(lay: Any, i: int) -> torch.Tensor:
    """The rows ``receive`` returns for one teacher: its tokens of ``lay``, compact."""
    return rows(lay, i)[lay.sample_id_R >= 0]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def bridge(**config: Any) -> HiddenStateBridge:
    return fresh_bridge([MESH], MESH, [H], timeout_s=T_S, **config)


def plan(b: HiddenStateBridge, seed: int) -> tuple[BridgeStep, list[Any], list[Any]]:
    t, s = layouts(seed)
    return b.plan_step(teacher_layouts={0: t}, student_layouts=s), t, s


def run(b: HiddenStateBridge, seed: int) -> bool:
    """One step: every micro-batch sent and received in order, then finish(); all exact?"""
    step, t, s = plan(b, seed)
    ok = []
    for i in range(M):
        step.send(i, {0: rows(t[i], i)})
        ok.append(torch.equal(bits(step.receive(i)[0]), bits(want(s[i], i))))
    step.finish()
    return all(ok)


@pytest.mark.parametrize("integrity", [False, True])
def test_one_rank_steps_are_exact_with_and_without_integrity(one_rank_world, integrity):
    b = bridge(integrity=integrity)
    assert run(b, 0) and run(b, 1)
    stats = b.executor.memory_stats()
    assert stats["staging_buffers"] == 0  # local copies only: nothing staged
    assert b.lifecycle.failure is None


def test_integrity_names_the_micro_batch_of_a_row_changed_after_its_local_copy(one_rank_world):
    step_ref: list[BridgeStep] = []

    def hook(point: str, blocks: list) -> None:
        slot = step_ref[0]._slots[1]
        if point == "received" and slot.received and not hit:
            loc = slot.schedule.locals[0]
            row = int(loc.dst.rows[2])
            slot.outputs[0].view(torch.int32)[row, 5] ^= 1 << 30
            hit.append((loc.src.count, row, int(loc.src.rows[2])))

    hit: list[tuple[int, int, int]] = []
    b = bridge(integrity=True, hook=hook)
    step, t, _ = plan(b, 0)
    step_ref.append(step)
    for i in range(M):
        step.send(i, {0: rows(t[i], i)})
        step.receive(i)
    with pytest.raises(BridgeIntegrityError) as info:
        step.finish()
    count, dst_row, src_row = hit[0]
    assert str(info.value).startswith(
        "bridge integrity check failed: 1 corrupted block(s) received on global rank(s) [0]: "
        f"teacher 0, micro-batch 1: global rank 0 -> global rank 0: 1 of {count} rows differ "
        f"(destination rows [{dst_row}], source rows [{src_row}])"
    ), str(info.value)
    assert b.lifecycle.failure is None  # a caught corruption leaves the bridge usable
    assert run(b, 1)


def test_the_schedule_cache_is_bounded_least_recently_used_first(one_rank_world):
    b = bridge(max_cached_plans=2)
    ex = b.executor
    t, s = layouts(0)  # three micro-batches with three different plans

    def run_mbs(idx: list[int]) -> bool:
        step = b.plan_step(
            teacher_layouts={0: [t[k] for k in idx]}, student_layouts=[s[k] for k in idx]
        )
        ok = []
        for i, k in enumerate(idx):
            step.send(i, {0: rows(t[k], k)})
            ok.append(torch.equal(bits(step.receive(i)[0]), bits(want(s[k], k))))
        step.finish()
        return all(ok)

    built = []
    for idx in ([0, 1, 2], [2, 1, 2], [0], [2], [1]):
        assert run_mbs(idx), idx
        built.append(ex.schedules_built)
        assert len(ex._schedules) <= 2 and ex.memory_stats()["device_caches"] <= 2
    # 0, 1, 2 built (0 dropped); 2, 1 hit; 0 built (1 dropped: used before 2); 2 hit; 1 built
    assert built == [3, 3, 4, 4, 5], built


def test_a_failed_executor_refuses_every_call(one_rank_world):
    b = bridge()
    step, t, s = plan(b, 0)
    b.faults.mark_failed(BridgeTimeoutError("first cause"))
    b.faults.mark_failed(BridgeTimeoutError("second cause"))
    refusal = r"global rank 0: this bridge cannot be used after a failed exchange \(BridgeTimeoutError: first cause\)"
    with pytest.raises(BridgeStateError, match=refusal):
        b.plan_step(teacher_layouts={0: t}, student_layouts=s)
    with pytest.raises(BridgeStateError, match=refusal):
        step.send(0, {0: rows(t[0], 0)})
    with pytest.raises(BridgeStateError, match=refusal):
        step.receive(0)
    with pytest.raises(BridgeStateError, match=refusal):
        step.finish()
    with pytest.raises(BridgeStateError, match=refusal):
        b.exchange(hidden={0: rows(t[0], 0)}, layouts={0: t[0]}, student_layout=s[0])


def test_step_misuse_on_one_rank_raises_at_once(one_rank_world):
    b = bridge()
    step, t, s = plan(b, 0)
    with pytest.raises(ValueError, match=r"micro-batch 3 outside \[0, 3\)"):
        step.receive(3)
    with pytest.raises(ValueError, match=r"micro-batch True outside"):
        step.send(True, {0: rows(t[0], 0)})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"teacher indices \[1\] outside \[0, 1\)"):
        step.send(0, {1: rows(t[0], 0)})
    with pytest.raises(ValueError, match="hidden must be a mapping teacher index -> tensor"):
        step.send(0, [rows(t[0], 0)])  # type: ignore[arg-type]
    n = t[0].num_rows
    with pytest.raises(ValueError, match=rf"has {n - 1} rows of 8, the plan wants {n} rows of 8"):
        step.send(0, {0: rows(t[0], 0)[1:]})
    with pytest.raises(ValueError, match=r"buffer is torch.float64 on cpu, the plan wants"):
        step.send(0, {0: rows(t[0], 0).double()})
    with pytest.raises(ValueError, match="must be contiguous"):
        step.send(0, {0: torch.zeros(H, n).t()})
    with pytest.raises(BridgeStateError, match=r"finish\(\) needs micro-batch 0 posted first"):
        step.finish()
    with pytest.raises(BridgeStateError, match=r"receive\(0\) needs micro-batch 0 posted first"):
        step.receive(0)
    # out of order: micro-batch 1's rows are taken, but it cannot be posted before 0
    with pytest.raises(BridgeStateError, match=r"send\(1\) needs micro-batch 0 posted first"):
        step.send(1, {0: rows(t[1], 1)})
    with pytest.raises(BridgeStateError, match="teacher 0's rows of micro-batch 1 were already"):
        step.send(1, {0: rows(t[1], 1)})
    # none of the rejected calls changed anything: the step runs to the end, exact
    got = []
    for i in range(M):
        if i != 1:
            step.send(i, {0: rows(t[i], i)})
        got.append(torch.equal(bits(step.receive(i)[0]), bits(want(s[i], i))))
    with pytest.raises(BridgeStateError, match="micro-batch 0 were already sent"):
        step.send(0, {0: rows(t[0], 0)})
    step.finish()
    step.finish()  # idempotent
    assert got == [True] * M
    with pytest.raises(BridgeStateError, match="this step is finished; plan the next one"):
        step.receive(0)
    with pytest.raises(BridgeStateError, match="this step is finished"):
        step.send(0, {0: rows(t[0], 0)})
    assert b.lifecycle.failure is None and run(b, 1)


def test_a_step_left_on_an_error_fails_the_bridge_naming_it(one_rank_world):
    """Leaving a step's ``with`` block normally finishes it; leaving it on an exception abandons
    it: every later call refuses at once, naming the step, what was posted and the exception."""
    b = bridge()
    t, s = layouts(0)
    with b.plan_step(teacher_layouts={0: t}, student_layouts=s) as step:
        for i in range(M):
            step.send(i, {0: rows(t[i], i)})
            step.receive(i)
    assert step.finished and b.lifecycle.failure is None
    with pytest.raises(KeyError), b.plan_step(teacher_layouts={0: t}, student_layouts=s) as other:
        other.send(0, {0: rows(t[0], 0)})
        raise KeyError("the schedule failed")
    cause = (
        f"step 1 abandoned on global rank 0 after 1 of {M} micro-batches posted, 0 received: "
        "KeyError: 'the schedule failed'"
    )
    with pytest.raises(BridgeStateError) as err:
        other.receive(1)
    assert cause in str(err.value)
    with pytest.raises(BridgeStateError) as err:
        b.plan_step(teacher_layouts={0: t}, student_layouts=s)
    assert str(err.value).startswith(
        "global rank 0: this bridge cannot be used after a failed exchange (first failure on "
        f"global rank 0: {cause})"
    ), str(err.value)
    with pytest.raises(BridgeStateError, match="step 1 abandoned on global rank 0"):
        b.exchange(hidden={0: rows(t[0], 0)}, layouts={0: t[0]}, student_layout=s[0])


def test_a_step_whose_unposted_micro_batches_move_nothing_on_the_wire_does_not_block(
    one_rank_world,
):
    """One rank, teacher and student colocated: every row is a local copy, nothing goes on the
    wire, so an earlier step with micro-batches not yet sent pairs with nothing and the next
    step may be planned (a step with transfers left is refused: tier 2,
    ``test_reliability_steps.py::test_two_steps_open_at_once_...``). Both run exact."""
    b = bridge()
    t, s = layouts(0)
    outer = b.plan_step(teacher_layouts={0: t}, student_layouts=s)
    outer.send(0, {0: rows(t[0], 0)})
    assert not outer.unposted()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the earlier step is not finished: warned
        inner, t2, s2 = plan(b, 1)
    got = []
    for i in range(M):
        if i:
            outer.send(i, {0: rows(t[i], i)})
        got.append(torch.equal(bits(outer.receive(i)[0]), bits(want(s[i], i))))
    for i in range(M):
        inner.send(i, {0: rows(t2[i], i)})
        got.append(torch.equal(bits(inner.receive(i)[0]), bits(want(s2[i], i))))
    inner.finish()
    outer.finish()
    assert got == [True] * 2 * M and b.lifecycle.failure is None and run(b, 2)


def test_non_finite_teacher_rows_are_named_where_they_arrive(one_rank_world):
    """A NaN and an Inf in teacher rows of micro-batch 1: ``receive(1)`` raises naming the
    teacher, the micro-batch, how many rows, the first student row and where it came from;
    micro-batch 0 was returned; the next step is refused, naming it. With the check off the
    rows are returned as they are."""
    for check in (True, False):
        b = bridge(check_finite=check)
        step, t, s = plan(b, 3)
        step.send(0, {0: rows(t[0], 0)})
        assert torch.equal(bits(step.receive(0)[0]), bits(want(s[0], 0)))
        bad = rows(t[1], 1)
        real = torch.nonzero(t[1].sample_id_R >= 0).reshape(-1)
        bad[real[2], 1] = float("nan")
        bad[real[0], 0] = float("inf")
        key = (int(t[1].sample_id_R[real[0]]), int(t[1].position_R[real[0]]))
        real_s = [r for r in range(s[1].num_rows) if int(s[1].sample_id_R[r]) >= 0]
        first = next(  # among the compact rows: the real rows of the student's layout
            j
            for j, r in enumerate(real_s)
            if (int(s[1].sample_id_R[r]), int(s[1].position_R[r])) == key
        )
        step.send(1, {0: bad})
        if not check:
            got = step.receive(1)[0]
            assert int((~torch.isfinite(got)).any(dim=1).sum()) == 2
            continue
        with pytest.raises(BridgeNonFiniteError) as err:
            step.receive(1)
        text = (
            "global rank 0: non-finite (NaN/Inf) teacher rows arrived in micro-batch 1 of step 0: "
            f"teacher 0: 2 of {len(real_s)} rows (first: row {first}, a local copy on global "
            "rank 0)"
        )
        assert str(err.value) == text
        with pytest.raises(BridgeStateError) as err:
            plan(b, 4)
        assert f"first failure on global rank 0: {text}" in str(err.value)
