"""Tier 3 (CUDA, NCCL at world size 1): the bridge's step API with CUDA tensors, bit-exact.

A one-GPU machine can run NCCL only at world size 1, so the teacher and the student share rank 0
(colocated): once with local copies (the plan's one-pass copy path through the CuPy kernels or
their twins), once with ``local_copy=False`` so every row goes through a NCCL send/recv to self
(the network path: staging, ``batch_isend_irecv``, unpack). Layouts differ between the sides
(THD with CP-style padding against ``[S, B, H]`` / ``[B, S, H]``, different micro-batches), and
two teachers with different hidden sizes feed one student. Output buffers the bridge allocates
start as NaN bits; each teacher's rows arrive compact (its tokens, in layout order). Cases:

- ``exchange`` twice (the second reuses the schedule): exact rows, and the schedule's figures
  say which path moved them (all local copies, or all through NCCL);
- a step of three micro-batches planned before the teacher runs (``TeacherSpec.dtype``), each
  teacher buffer overwritten on the stream right after its ``send`` (one teacher per call), the
  micro-batches received in reverse: exact rows (the sends' copies are ordered before the
  overwrite);
- the LM-head reshard on CUDA;
- ``send`` / ``receive`` / ``finish`` on NCCL make the stream wait and never spin the host.
"""

from __future__ import annotations

import time

import pytest
import torch

from mopd.bridge import GroupPool, Mesh, compact_rows, create_bridge_groups
from mopd.bridge.lm_head import VocabSpec, reshard_lm_head
from mopd.profiling.synthetic import SideFormat, key_pattern, synthetic_step
from tests.support.bridges import make_bridge, poison, poison_outputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="tier 3 needs a CUDA device (NCCL at world size 1); none here",
    ),
]

H = (64, 96)
_POOL: list[GroupPool] = []
DEVICE = torch.device("cuda", 0)


def pool() -> GroupPool:
    if not _POOL:
        _POOL.append(GroupPool(backend="nccl", timeout_s=120))
    return _POOL[0]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def two_teacher_step(seed: int, num_samples: int = 24, max_len: int = 300):
    return synthetic_step(
        teachers=[Mesh(), Mesh()],
        student=Mesh(),
        num_samples=num_samples,
        max_len=max_len,
        teacher_formats=[
            SideFormat(kind="thd", micro_batch=4, pad_multiple=8),
            SideFormat(kind="bsh", micro_batch=3),
        ],
        student_format=SideFormat(kind="sbh", micro_batch=5),
        seed=seed,
    )


def expected(step, o: int, dtype: torch.dtype, salt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The student's compact rows of teacher ``o`` (its tokens, in layout order) and the
    ``[N]`` owner of each row."""
    stu = step.student_layouts[(0, 0)]
    route = dict(zip(step.sample_ids.tolist(), step.route.tolist(), strict=True))
    owner = torch.tensor([route[s] if s >= 0 else -1 for s in stu.sample_id_R.tolist()])
    want = key_pattern(stu, H[o], dtype, salt=salt)
    return compact_rows({o: want}, owner)[o], owner


@pytest.mark.parametrize("local_copy", [True, False], ids=["local-copy", "nccl-self-p2p"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_colocated_one_rank_exchange_is_bit_exact(nccl_world, local_copy, dtype):
    mesh = Mesh()
    step = two_teacher_step(11)
    bridge = poison_outputs(
        make_bridge(pool(), [mesh, mesh], mesh, list(H), timeout_s=60, local_copy=local_copy)
    )
    layouts = {o: step.teacher_layouts[o][(0, 0)] for o in range(2)}
    hidden = {o: key_pattern(layouts[o], H[o], dtype, salt=o).to(DEVICE) for o in range(2)}
    stu = step.student_layouts[(0, 0)]
    built = []
    for _ in range(2):  # the second call reuses the cached schedule and staging buffers
        handle = bridge.exchange(hidden=hidden, layouts=layouts, student_layout=stu)
        got = handle.wait()
        torch.cuda.synchronize()
        built.append(bridge.executor.schedules_built)
        for o in range(2):
            want, owner = expected(step, o, dtype, salt=o)
            assert got[o].device == DEVICE and got[o].shape == want.shape
            assert torch.equal(bits(got[o].cpu()), bits(want))
            assert torch.equal(handle.owner_N.cpu(), owner)
    assert built == [1, 1]
    counts = handle.step._slots[0].schedule.counts()
    moved = sum(int((owner == o).sum()) * H[o] * dtype.itemsize for o in range(2))
    assert moved > 0
    if local_copy:
        assert counts["messages"] == 0 and counts["local_bytes"] == moved
    else:
        assert counts["local_passes"] == 0
        assert counts["send_bytes"] == counts["recv_bytes"] == moved


@pytest.mark.parametrize("local_copy", [True, False], ids=["local-copy", "nccl-self-p2p"])
def test_step_takes_rows_at_send_and_receives_out_of_order(nccl_world, local_copy):
    mesh = Mesh()
    dtype = torch.bfloat16
    mbs = [two_teacher_step(20 + i, num_samples=8 + 4 * i, max_len=120) for i in range(3)]
    bridge = poison_outputs(
        make_bridge(
            pool(), [mesh, mesh], mesh, list(H), dtype=dtype, timeout_s=60, local_copy=local_copy
        )
    )
    step = bridge.plan_step(  # before the teacher has run: the dtype comes from TeacherSpec
        teacher_layouts={o: [s.teacher_layouts[o][(0, 0)] for s in mbs] for o in range(2)},
        student_layouts=[s.student_layouts[(0, 0)] for s in mbs],
    )
    for i, s in enumerate(mbs):
        for o in range(2):  # one teacher per call: micro-batch i posts after both overwrites
            buf = key_pattern(s.teacher_layouts[o][(0, 0)], H[o], dtype, salt=o + 8 * i)
            buf = buf.to(DEVICE)
            step.send(i, {o: buf})
            poison(buf)  # queued on the stream right after the send's copies
    got = {i: step.receive(i) for i in reversed(range(3))}
    step.finish()
    torch.cuda.synchronize()
    for i, s in enumerate(mbs):
        for o in range(2):
            want, owner = expected(s, o, dtype, salt=o + 8 * i)
            assert torch.equal(bits(got[i][o].cpu()), bits(want)), f"micro-batch {i} teacher {o}"
            assert torch.equal(step.owner(i).cpu(), owner)
        sched = step._slots[i].schedule
        assert bool(sched.locals) == local_copy and bool(sched.sends) != local_copy


def test_lm_head_reshard_on_cuda(nccl_world):
    mesh = Mesh()
    v, vt, vs, h = 1000, 1024, 1008, 32
    full = torch.randn(vt, h, device=DEVICE, dtype=torch.bfloat16)
    full[v:] = float("nan")
    groups = create_bridge_groups(pool(), [mesh], mesh)
    got = reshard_lm_head(
        full.clone(),
        teacher=mesh,
        student=mesh,
        vocab=VocabSpec(vocab_size=v, teacher_padded=vt, student_padded=vs),
        hidden_size=h,
        groups=groups,
        timeout_s=60,
    )
    assert got is not None and got.weight_VH.device == DEVICE
    want = torch.zeros(vs, h, dtype=torch.bfloat16, device=DEVICE)
    want[:v] = full[:v]
    assert torch.equal(bits(got.weight_VH), bits(want))
    assert got.num_padding == vs - v


def test_send_receive_finish_do_not_block_the_host_on_nccl(nccl_world):
    """On NCCL the data phase makes the stream wait; it must not spin the host until the rows
    land.

    A GPU sleep of about a second is queued before the data phase (every row through a NCCL
    send/recv to self). The host must get back from ``send`` + ``receive`` + ``finish`` long
    before the GPU is done; the rows are then exact after a synchronize (stream order holds them
    back). The step is planned before the sleep (planning is host work by design), and a first
    step of the same shapes warms the schedule, its device indices and the staging buffers.
    """
    mesh = Mesh()
    dtype = torch.bfloat16
    s = synthetic_step(
        teachers=[mesh],
        student=mesh,
        num_samples=16,
        max_len=200,
        # [B, S, H] against [S, B, H]: runs of one row, so packing and unpacking are gathers and
        # scatters (no copy_runs, whose torch twin reads a run total on the host without CuPy)
        teacher_formats=[SideFormat(kind="bsh", micro_batch=4)],
        student_format=SideFormat(kind="sbh", micro_batch=4),
        seed=5,
    )
    bridge = make_bridge(pool(), [mesh], mesh, [H[0]], dtype=dtype, timeout_s=60, local_copy=False)
    lay, stu = s.teacher_layouts[0][(0, 0)], s.student_layouts[(0, 0)]
    src = key_pattern(lay, H[0], dtype).to(DEVICE)

    def plan():
        return bridge.plan_step(teacher_layouts={0: [lay]}, student_layouts=[stu])

    warm = plan()
    warm.send(0, {0: src})
    warm.receive(0)
    warm.finish()
    step = plan()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about 1 s of GPU clock cycles, queued before the data
    t0 = time.monotonic()
    step.send(0, {0: src})
    got = step.receive(0)
    step.finish()
    host_s = time.monotonic() - t0
    torch.cuda.synchronize()
    total_s = time.monotonic() - t0
    assert bridge.executor.schedules_built == 1
    assert total_s > 0.3, f"the GPU sleep did not hold the stream ({total_s:.3f} s)"
    assert host_s < 0.3 * total_s, (
        f"the data phase blocked the host: {host_s:.3f} s of {total_s:.3f} s"
    )
    want = key_pattern(stu, H[0], dtype)[stu.sample_id_R >= 0]  # compact: the real tokens
    assert torch.equal(bits(got[0].cpu()), bits(want))
