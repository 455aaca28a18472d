"""Tier 3 (CUDA, NCCL at world size 1): integrity mode on the device path, through the step API.

Integrity where it matters: CUDA tensors, NCCL send/recv to self (``local_copy=False``:
staging, ``batch_isend_irecv``, unpack) and CUDA local copies. Checks that ``row_checksum`` on
the device equals the CPU one bit for bit (the wrapping int64 sum must agree between a sender
and a receiver on different devices); that steps of several micro-batches stay exact with
integrity on (``plan_step`` / ``send`` / ``receive`` / ``finish``, and ``exchange``); that a bit
flipped in a packed send buffer or in a receive buffer raises ``BridgeIntegrityError`` at
``finish()`` naming the teacher, the micro-batch and the ranks; and that the bridge delivers
exact rows again in the next step. Skipped without a CUDA device (the reason says so).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mopd.bridge import (
    BridgeConfig,
    GroupPool,
    HiddenStateBridge,
    Mesh,
    TeacherSpec,
    create_bridge_groups,
)
from mopd.bridge.errors import BridgeIntegrityError
from mopd.bridge.integrity import row_checksum
from mopd.profiling.synthetic import SideFormat, key_pattern, synthetic_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="tier 3 needs a CUDA device; none here"
    ),
]

H = 64
M = 3
DTYPE = torch.bfloat16
_POOL: list[GroupPool] = []


def pool() -> GroupPool:
    if not _POOL:
        _POOL.append(GroupPool(backend="nccl", timeout_s=60))
    return _POOL[0]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_device_checksum_equals_the_cpu_checksum(dtype):
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(513, 96, generator=gen).to(dtype)
    dev = row_checksum(rows.cuda()).cpu()
    assert torch.equal(dev, row_checksum(rows))
    odd = torch.randn(40, 3, generator=gen).to(dtype)  # 6- or 12-byte rows: narrower words
    assert torch.equal(row_checksum(odd.cuda()).cpu(), row_checksum(odd))


class Case:
    """A one-rank bridge (teacher and student both global rank 0) and seeded micro-batches."""

    def __init__(self, local_copy: bool, hook: Any = None) -> None:
        self.mesh = Mesh()
        self.bridge = HiddenStateBridge(
            teachers=[TeacherSpec(mesh=self.mesh, hidden_size=H, dtype=DTYPE)],
            student=self.mesh,
            groups=create_bridge_groups(pool(), [self.mesh], self.mesh),
            config=BridgeConfig(timeout_s=60, local_copy=local_copy, integrity=True),
        )
        self.bridge.executor.debug_hook = hook
        self.micro_batch = -1

    def layouts(self, seed: int, i: int) -> tuple[Any, Any]:
        step = synthetic_step(
            teachers=[self.mesh],
            student=self.mesh,
            num_samples=16,
            max_len=200,
            teacher_formats=[SideFormat(kind="thd", micro_batch=4, pad_multiple=8)],
            student_format=SideFormat(kind="sbh", micro_batch=5),
            seed=100 * seed + i,
        )
        return step.teacher_layouts[0][(0, 0)], step.student_layouts[(0, 0)]

    def want(self, seed: int, i: int) -> torch.Tensor:
        stu = self.layouts(seed, i)[1]
        return key_pattern(stu, H, DTYPE, salt=i)[stu.sample_id_R >= 0]  # compact: real tokens

    def run(self, seed: int) -> list[bool]:
        """One step of ``M`` micro-batches; per micro-batch, exact? (``finish()`` may raise)."""
        lays = [self.layouts(seed, i) for i in range(M)]
        step = self.bridge.plan_step(
            teacher_layouts={0: [t for t, _ in lays]}, student_layouts=[s for _, s in lays]
        )
        got = []
        for i, (t, _) in enumerate(lays):
            self.micro_batch = i
            step.send(i, {0: key_pattern(t, H, DTYPE, salt=i).cuda()})
            got.append(step.receive(i)[0].clone())
        try:
            step.finish()
        finally:
            torch.cuda.synchronize()
            self.got = [
                torch.equal(bits(g.cpu()), bits(self.want(seed, i))) for i, g in enumerate(got)
            ]
        return self.got


@pytest.mark.parametrize("local_copy", [True, False], ids=["local-copy", "nccl-self-p2p"])
def test_clean_steps_with_integrity_are_exact(nccl_world, local_copy):
    case = Case(local_copy)
    for seed in range(2):
        assert case.run(seed) == [True] * M
    t, s = case.layouts(0, 0)
    got = case.bridge.exchange(
        hidden={0: key_pattern(t, H, DTYPE, salt=0).cuda()}, layouts={0: t}, student_layout=s
    ).wait()[0]
    torch.cuda.synchronize()
    assert torch.equal(bits(got.cpu()), bits(case.want(0, 0)))
    assert case.bridge.lifecycle.failure is None


@pytest.mark.parametrize("point", ["packed", "received"])
def test_flipped_bit_on_the_nccl_path_is_caught_at_finish(nccl_world, point):
    armed = [True]

    def hook(p: str, blocks: list) -> None:
        if p == point and armed[0] and blocks and case.micro_batch == 1:
            b = blocks[0][2].view(torch.uint8)
            b[0, 1] = b[0, 1] ^ 4
            armed[0] = False

    case = Case(False, hook)
    with pytest.raises(
        BridgeIntegrityError,
        match=r"1 corrupted block\(s\) received on global rank\(s\) \[0\]: teacher 0, "
        r"micro-batch 1: global rank 0 -> global rank 0: 1 of",
    ):
        case.run(0)
    assert case.got == [True, False, True]  # the corrupted rows were delivered, then judged
    assert not armed[0] and case.bridge.lifecycle.failure is None
    assert case.run(1) == [True] * M  # and the bridge works again
