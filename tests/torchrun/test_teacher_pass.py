"""Tier 2: the teacher pass captures into one recycled buffer, step after step (gloo, 2 ranks).

The bridge path's capture is the zero-allocation one: :func:`mopd.mcore.teacher.run_teacher` hands each
micro-batch's hidden states to its callback from the caller's :class:`~mopd.capture.ReusableBuffer`
(the Distiller keeps one per teacher), so a steady shape allocates once over many steps. Checked
on a TP2 + SP GPTModel built on explicit process groups, against a default capture of each
micro-batch alone (the same bits).
"""

from __future__ import annotations

import torch

from mopd.capture import ReusableBuffer, get_opd_full_capture_context
from tests.support import megatron_cpu as mc

TORCHRUN_NPROC = 2
TORCHRUN_TIMEOUT = 300

S, B, V, H = 16, 2, 64, 32


def test_run_teacher_recycles_the_callers_buffer_across_steps():
    from mopd.bridge import GroupPool, Mesh
    from mopd.mcore import megatron_process_groups, padded_micro_batch
    from mopd.mcore.teacher import run_teacher

    mc.init_parallel(tp=1)
    pg = megatron_process_groups(Mesh(tp=2), GroupPool())
    model = mc.build_gpt(
        mc.tiny_config(tensor_model_parallel_size=2, sequence_parallel=True), pg_collection=pg
    ).eval()
    g = torch.Generator().manual_seed(3)
    mbs = [
        padded_micro_batch([2 * i, 2 * i + 1], torch.randint(0, V, (B, S), generator=g))
        for i in range(3)
    ]
    buf = ReusableBuffer()
    ptrs: set[int] = set()
    seen: dict[tuple[int, int], torch.Tensor] = {}
    for step in range(2):

        def on_hidden(i: int, hidden: torch.Tensor, step: int = step) -> None:
            ptrs.add(hidden.data_ptr())
            seen[step, i] = hidden.clone()

        run_teacher(model, mbs, pg_collection=pg, on_hidden=on_hidden, buffer=buf)
    assert len(seen) == 6 and len(ptrs) == 1 and buf.allocations == 1
    for i, mb in enumerate(mbs):
        ctx, cap = get_opd_full_capture_context(model, enabled=True)
        with torch.no_grad(), ctx:
            model(mb.tokens, mb.position_ids, None)
        ref = cap.get_hidden_states()
        assert ref.shape == (S, B, H)
        assert torch.equal(seen[0, i], ref) and torch.equal(seen[1, i], ref)
