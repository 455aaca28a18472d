"""Tier 3 (CUDA, NCCL at world size 1): integrity mode on the device path.

Issue 7's integrity mode, where it matters: CUDA tensors, NCCL send/recv to self
(``local_copy=False``: staging, ``batch_isend_irecv``, unpack) and CUDA local copies. Checks that
``row_checksum`` on the device equals the CPU one bit for bit (the wrapping int64 sum must agree
between a sender and a receiver on different devices), that clean exchanges stay exact with
integrity on, and that a bit flipped in a packed send buffer or in a receive buffer raises
``BridgeIntegrityError`` naming the block, after which the bridge still works.
"""

from __future__ import annotations

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
from mopd.bridge.api import BridgeIntegrityError
from mopd.bridge.integrity import row_checksum
from mopd.profiling.synthetic import SideFormat, key_pattern, synthetic_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="tier 3 needs a CUDA device; none here"
    ),
]

H = 64
_POOL: list[GroupPool] = []


def pool() -> GroupPool:
    if not _POOL:
        _POOL.append(GroupPool(backend="nccl"))
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


def _setup(local_copy: bool, hook=None):
    mesh = Mesh()
    dev = torch.device("cuda", 0)
    step = synthetic_step(
        teachers=[mesh],
        student=mesh,
        num_samples=16,
        max_len=200,
        teacher_formats=[SideFormat(kind="thd", micro_batch=4, pad_multiple=8)],
        student_format=SideFormat(kind="sbh", micro_batch=5),
        seed=21,
    )
    bridge = HiddenStateBridge(
        teachers=[TeacherSpec(mesh=mesh, hidden_size=H)],
        student=mesh,
        groups=create_bridge_groups(pool(), [mesh], mesh),
        config=BridgeConfig(timeout_s=60, local_copy=local_copy, integrity=True),
        debug_hook=hook,
    )
    lay = step.teacher_layouts[0][(0, 0)]
    stu = step.student_layouts[(0, 0)]
    kw = {
        "hidden": {0: key_pattern(lay, H, torch.bfloat16).to(dev)},
        "layouts": {0: lay},
        "student_layout": stu,
        "outputs": {
            0: torch.full((stu.num_rows, H), float("nan"), dtype=torch.bfloat16, device=dev)
        },
    }
    want = key_pattern(stu, H, torch.bfloat16)
    want[stu.sample_id_R < 0] = 0
    return bridge, kw, want


@pytest.mark.parametrize("local_copy", [True, False], ids=["local-copy", "nccl-self-p2p"])
def test_clean_exchange_with_integrity_is_exact(nccl_world, local_copy):
    bridge, kw, want = _setup(local_copy)
    for _ in range(2):
        got = bridge.exchange(**kw).wait()[0]
        torch.cuda.synchronize()
        assert torch.equal(bits(got.cpu()), bits(want))


@pytest.mark.parametrize("point", ["packed", "received"])
def test_flipped_bit_on_the_nccl_path_is_caught(nccl_world, point):
    armed = [True]

    def hook(p: str, blocks: list) -> None:
        if p == point and armed[0] and blocks:
            b = blocks[0][2].view(torch.uint8)
            b[0, 1] = b[0, 1] ^ 4

    bridge, kw, want = _setup(False, hook)
    with pytest.raises(
        BridgeIntegrityError, match=r"teacher 0: global rank 0 -> global rank 0: 1 of"
    ):
        bridge.exchange(**kw).wait()
    armed[0] = False
    kw["hidden"] = {0: key_pattern(kw["layouts"][0], H, torch.bfloat16).cuda()}  # undo a flip
    got = bridge.exchange(**kw).wait()[0]
    assert torch.equal(bits(got.cpu()), bits(want))
