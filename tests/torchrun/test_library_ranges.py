"""Tier 2 (torchrun, 2 ranks, gloo): the library opens its own profiler ranges on its data path.

A user profiles their own job, not the demo: under ``torch.profiler`` with ranges on, plain
library calls (the capture's SP gather, an LM-head reshard, a bridge step with sends, a local
copy and the student TP all-gather, integrity mode, a vocab-parallel KL) must show a ``mopd/``
range for every phase they run; with ranges off, none at all.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from mopd.common import ranges

TORCHRUN_NPROC = 2
TORCHRUN_TIMEOUT = 300


@pytest.fixture(autouse=True)
def _ranges_switch() -> Iterator[None]:
    from tests.support.dist import ensure_world

    ensure_world()
    before = ranges.enable(True)
    yield
    ranges.enable(before)


def _library_calls() -> None:
    """One of each data-path call, as a user's job would make them."""
    from mopd.bridge import (
        BridgeConfig,
        GroupPool,
        HiddenStateBridge,
        Mesh,
        TeacherSpec,
        create_bridge_groups,
        padded_layout,
    )
    from mopd.bridge.lm_head import VocabSpec, reshard_lm_head
    from mopd.capture.gather import gather_sequence_parallel
    from mopd.kernels.kl import vocab_parallel_kl

    rank = dist.get_rank()
    pool = GroupPool(timeout_s=120)
    teacher, student = Mesh(tp=1, dp=2), Mesh(tp=2)
    groups = create_bridge_groups(pool, [teacher], student)
    H, S, B, V = 8, 4, 2, 16
    # the capture's sequence-parallel gather over the student's TP group
    local = torch.randn(S // 2, B, H)
    gather_sequence_parallel(local, groups.student_tp, torch.empty(S, B, H))
    # the LM-head reshard
    shard = reshard_lm_head(
        torch.randn(V, H),
        teacher=teacher,
        student=student,
        vocab=VocabSpec(vocab_size=V, teacher_padded=V, student_padded=V),
        hidden_size=H,
        groups=groups,
    )
    assert shard is not None
    # a bridge step: teacher [S, B, H] batches (strided rows: packing), student [B, S] rows
    bridge = HiddenStateBridge(
        teachers=[TeacherSpec(mesh=teacher, hidden_size=H, dtype=torch.float32)],
        student=student,
        groups=groups,
        config=BridgeConfig(timeout_s=60, integrity=True),
    )
    mine = [2 * rank, 2 * rank + 1]
    step = bridge.plan_step(
        teacher_layouts={0: [padded_layout(mine, S, order="sbh")]},
        student_layouts=[padded_layout([0, 2, 1, 3], S, order="bsh")],  # sends and local copies
    )
    step.send(0, {0: torch.randn(S, B, H)})
    rows = step.receive(0)[0]
    step.finish()
    # the loss on the bridged rows, vocab-parallel over the student's TP group
    logits = torch.randn(rows.shape[0], V // 2, requires_grad=True)
    loss = vocab_parallel_kl(
        logits,
        rows,
        shard.weight_VH,
        vocab_start=shard.vocab_start,
        vocab_size=V,
        group=groups.student_tp,
    )
    loss.backward()


EXPECTED = {
    "gather",
    "reshard",
    "metadata",
    "verdict",
    "plan",
    "issue",
    "pack",
    "local_copy",
    "send_recv",
    "recv_wait",
    "unpack",
    "tp_all_gather",
    "send_wait",
    "integrity",
    "projection",
    "loss_chunk",
}


def test_plain_library_calls_show_every_phase() -> None:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _library_calls()
    names = {e.name for e in prof.events() if e.name.startswith(ranges.PREFIX)}
    phases = {n[len(ranges.PREFIX) :].split(":")[0] for n in names}
    missing = EXPECTED - phases
    assert not missing, f"no mopd range for {sorted(missing)}; saw {sorted(phases)}"


def test_ranges_off_emit_nothing() -> None:
    ranges.enable(False)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _library_calls()
    assert not [e.name for e in prof.events() if e.name.startswith(ranges.PREFIX)]
