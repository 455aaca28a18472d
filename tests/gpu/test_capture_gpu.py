"""Tier 3: the capture on CUDA with NCCL at world size 1, and its no-allocation property."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="tier 3 needs a CUDA device; none here"
    ),
]


def _allocs() -> int:
    return torch.cuda.memory_stats()["allocation.all.allocated"]


def test_sp_gather_on_nccl_writes_the_reused_buffer(nccl_world):
    from mopd.capture import ReusableBuffer, gather_sequence_parallel

    buf = ReusableBuffer()
    ptrs = set()
    for step in range(4):
        local = torch.randn(64, 4, 1024, device="cuda", dtype=torch.bfloat16)
        out = buf.get(tuple(local.shape), local.dtype, local.device)
        out.fill_(float("nan"))
        before = _allocs()
        gather_sequence_parallel(local, nccl_world, out)
        torch.cuda.synchronize()
        if step > 0:
            assert _allocs() == before, "the gather allocated at a steady shape"
        assert torch.equal(out, local)
        ptrs.add(out.data_ptr())
    assert len(ptrs) == 1 and buf.allocations == 1


def test_capture_of_a_cuda_gptmodel_with_a_caller_buffer(nccl_world):
    pytest.importorskip(
        "megatron.core", reason="megatron-core is not installed on this GPU machine"
    )
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mopd.capture import OutputLayerInputCapture

    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    from megatron.core.transformer.module import Float16Module

    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=256,
        num_attention_heads=4,
        bf16=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    inner = (
        GPTModel(
            config=cfg,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=512,
            max_sequence_length=128,
        )
        .cuda()
        .eval()
    )
    model = Float16Module(cfg, inner)  # bf16 params and activations, as in training
    S, B = 128, 4
    out = torch.empty(S, B, 256, device="cuda", dtype=torch.bfloat16)
    cap = OutputLayerInputCapture(model, out=out)
    try:
        for step in range(3):
            ids = torch.randint(0, 512, (B, S), device="cuda")
            pos = torch.arange(S, device="cuda").expand(B, S)
            out.fill_(float("nan"))
            with torch.no_grad(), cap.capture_context():
                logits = model(ids, pos, None)
            before = _allocs()
            h = cap.get_hidden_states()
            if step > 0:
                assert _allocs() == before
            assert h.data_ptr() == out.data_ptr() and not torch.isnan(out).any()
            ref = (h.float() @ inner.output_layer.weight.float().t()).transpose(0, 1)
            torch.testing.assert_close(logits.float(), ref, rtol=2e-2, atol=2e-2)
    finally:
        parallel_state.destroy_model_parallel()


def test_copy_waits_for_the_stream_the_forward_ran_on(nccl_world):
    """A forward on a side stream (delayed by a sleep kernel) and get_hidden_states on the default
    stream: the copy into ``out`` must wait for the producer, or it reads unwritten rows."""
    from mopd.capture import OutputLayerInputCapture

    class Head(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sum(-1)

    holder = torch.nn.Module()
    holder.output_layer = Head()
    out = torch.full((64, 4, 4096), float("nan"), device="cuda")
    cap = OutputLayerInputCapture(holder, out=out)
    side = torch.cuda.Stream()
    x = torch.randn(64, 4, 4096, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side), cap.capture_context():
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the producer writes
        y = x * 3.0
        holder.output_layer(y)
    h = cap.get_hidden_states()  # default stream
    torch.cuda.synchronize()
    assert h.data_ptr() == out.data_ptr()
    assert torch.equal(out, x * 3.0)
