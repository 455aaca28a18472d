"""Tier 3 (CUDA, NCCL at world size 1): the bridge with CUDA tensors, bit-exact.

A one-GPU machine can run NCCL only at world size 1, so the teacher and the student share rank 0
(colocated): once with local copies (the plan's one-pass copy path through the CuPy kernels or
their twins), once with ``local_copy=False`` so every row goes through a NCCL send/recv to self
(the network path: staging, ``batch_isend_irecv``, unpack). Layouts differ between the sides
(THD with CP-style padding against ``[S, B, H]`` / ``[B, S, H]``, different micro-batches), and
two teachers with different hidden sizes feed one student. Plus the LM-head reshard on CUDA.
"""

from __future__ import annotations

import time

import pytest
import torch

from mopd.bridge import (
    BridgeConfig,
    GroupPool,
    HiddenStateBridge,
    Mesh,
    TeacherSpec,
    VocabSpec,
    create_bridge_groups,
    reshard_lm_head,
)
from mopd.profiling.synthetic import SideFormat, key_pattern, synthetic_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="tier 3 needs a CUDA device; none here"
    ),
]

H = (64, 96)
_POOL: list[GroupPool] = []


def pool() -> GroupPool:
    if not _POOL:
        _POOL.append(GroupPool(backend="nccl"))
    return _POOL[0]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("local_copy", [True, False], ids=["local-copy", "nccl-self-p2p"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_colocated_one_rank_exchange_is_bit_exact(nccl_world, local_copy, dtype):
    mesh = Mesh()
    teachers = [mesh, mesh]
    dev = torch.device("cuda", 0)
    step = synthetic_step(
        teachers=teachers,
        student=mesh,
        num_samples=24,
        max_len=300,
        teacher_formats=[
            SideFormat(kind="thd", micro_batch=4, pad_multiple=8),
            SideFormat(kind="bsh", micro_batch=3),
        ],
        student_format=SideFormat(kind="sbh", micro_batch=5),
        seed=11,
    )
    groups = create_bridge_groups(pool(), teachers, mesh)
    bridge = HiddenStateBridge(
        teachers=[TeacherSpec(mesh=mesh, hidden_size=h) for h in H],
        student=mesh,
        groups=groups,
        config=BridgeConfig(timeout_s=60, local_copy=local_copy),
    )
    layouts = {o: step.teacher_layouts[o][(0, 0)] for o in range(2)}
    hidden = {o: key_pattern(layouts[o], H[o], dtype, salt=o).to(dev) for o in range(2)}
    stu = step.student_layouts[(0, 0)]
    outputs = {
        o: torch.full((stu.num_rows, H[o]), float("nan"), dtype=dtype, device=dev) for o in range(2)
    }
    for _ in range(2):  # the second call reuses the cached plan and staging buffers
        for t in outputs.values():
            t.fill_(float("nan"))
        got = bridge.exchange(
            hidden=hidden, layouts=layouts, student_layout=stu, outputs=outputs
        ).wait()
        torch.cuda.synchronize()
        route = dict(zip(step.sample_ids.tolist(), step.route.tolist(), strict=True))
        owner = torch.tensor([route[s] if s >= 0 else -1 for s in stu.sample_id_R.tolist()])
        for o in range(2):
            assert got[o].device == dev
            want = key_pattern(stu, H[o], dtype, salt=o)
            want[owner != o] = 0
            assert torch.equal(bits(got[o].cpu()), bits(want))
    (plan,) = bridge._plans.values()
    s = plan.summary()
    if local_copy:
        assert s["messages"] == 0 and s["rows_local"] == step.num_tokens
    else:
        assert s["local_copies"] == 0 and s["rows_cross"] == step.num_tokens


def test_lm_head_reshard_on_cuda(nccl_world):
    mesh = Mesh()
    dev = torch.device("cuda", 0)
    v, vt, vs, h = 1000, 1024, 1008, 32
    full = torch.randn(vt, h, device=dev, dtype=torch.bfloat16)
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
    assert got is not None and got.weight_VH.device == dev
    want = torch.zeros(vs, h, dtype=torch.bfloat16, device=dev)
    want[:v] = full[:v]
    assert torch.equal(bits(got.weight_VH), bits(want))
    assert got.num_padding == vs - v


def test_wait_does_not_block_the_host_on_nccl(nccl_world):
    """``wait()`` on NCCL makes the stream wait; it must not spin the host until the rows land.

    A GPU sleep of about a second is queued before the exchange (every row through a NCCL
    send/recv to self). The host must get back from ``start`` + ``wait`` long before the GPU is
    done; the rows are then exact after a synchronize (stream order holds them back).
    """
    mesh = Mesh()
    dev = torch.device("cuda", 0)
    dtype = torch.bfloat16
    step = synthetic_step(
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
    groups = create_bridge_groups(pool(), [mesh], mesh)
    bridge = HiddenStateBridge(
        teachers=[TeacherSpec(mesh=mesh, hidden_size=H[0])],
        student=mesh,
        groups=groups,
        config=BridgeConfig(timeout_s=60, local_copy=False),
    )
    lay = step.teacher_layouts[0][(0, 0)]
    stu = step.student_layouts[(0, 0)]
    out = torch.empty((stu.num_rows, H[0]), dtype=dtype, device=dev)
    prepared = bridge.prepare(
        hidden={0: key_pattern(lay, H[0], dtype).to(dev)},
        layouts={0: lay},
        student_layout=stu,
        outputs={0: out},
    )
    bridge.start(prepared).wait()  # warm: index tensors and staging buffers on the device
    out.fill_(float("nan"))
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about 1 s of GPU clock cycles, queued before the exchange
    t0 = time.monotonic()
    got = bridge.start(prepared).wait()
    host_s = time.monotonic() - t0
    torch.cuda.synchronize()
    total_s = time.monotonic() - t0
    assert total_s > 0.3, f"the GPU sleep did not hold the stream ({total_s:.3f} s)"
    assert host_s < 0.3 * total_s, f"wait() blocked the host: {host_s:.3f} s of {total_s:.3f} s"
    want = key_pattern(stu, H[0], dtype)
    want[stu.sample_id_R < 0] = 0
    assert torch.equal(bits(got[0].cpu()), bits(want))
