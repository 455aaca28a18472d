"""Tier 2: capture on real megatron-core GPTModels (local spec, CPU, gloo, 2 ranks).

Every case checks the captured ``[S, B, H]`` against an independent reference: ``captured @
W_full^T`` equals the model's full logits (vocab shards gathered), and, for TP, the hidden states
of a TP=1 model holding the same weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mopd.capture import OutputLayerInputCapture, get_opd_full_capture_context
from tests.support import megatron_cpu as mc

TORCHRUN_NPROC = 2
TORCHRUN_TIMEOUT = 300

S, B, V = 16, 2, 64


def _batch(seed: int = 0, s: int = S) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, s), generator=g)
    return ids, torch.arange(s).expand(B, s)


def _tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def _head_weight(model) -> torch.Tensor:
    w = model.output_layer.weight
    if w is None:  # tied: the embedding is the head
        w = model.embedding.word_embeddings.weight
    return mc.gather_vocab_shards(w.detach().t().contiguous(), _tp_group()).t()


def _check_logits(h_SBH: torch.Tensor, logits_BSV_local: torch.Tensor, w_VH: torch.Tensor) -> None:
    full_BSV = mc.gather_vocab_shards(logits_BSV_local.detach(), _tp_group())
    ref_BSV = (h_SBH.float() @ w_VH.float().t()).transpose(0, 1)
    torch.testing.assert_close(full_BSV.float(), ref_BSV, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
def test_tp2_capture_matches_logits_and_tp1_reference(sp):
    mc.init_parallel(tp=2)
    model = mc.build_gpt(mc.tiny_config(tensor_model_parallel_size=2, sequence_parallel=sp))
    ids, pos = _batch()
    seen: list[torch.Size] = []
    model.output_layer.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape) and None)
    ctx, cap = get_opd_full_capture_context(model, enabled=True)
    assert cap is not None and cap.sequence_parallel == sp
    with ctx:
        logits = model(ids, pos, None)
    assert seen == [torch.Size([S // 2 if sp else S, B, 32])]  # what the hook saw locally
    h = cap.get_hidden_states()
    assert h.shape == (S, B, 32) and not h.requires_grad
    _check_logits(h, logits, _head_weight(model))

    full = mc.full_state(model, _tp_group())
    mc.init_parallel(tp=1)
    ref = mc.build_gpt(mc.tiny_config())
    mc.load_full_state(ref, full, 0, 1)
    ctx1, cap1 = get_opd_full_capture_context(ref, enabled=True)
    with ctx1:
        ref(ids, pos, None)
    torch.testing.assert_close(h, cap1.get_hidden_states(), rtol=1e-5, atol=1e-5)


def test_pp2_last_and_non_last_stage():
    mc.init_parallel(pp=2)
    rank = dist.get_rank()
    cfg = mc.tiny_config(pipeline_model_parallel_size=2)
    model = mc.build_gpt(cfg, pre_process=rank == 0, post_process=rank == 1)
    ids, pos = _batch(1)
    ctx, cap = get_opd_full_capture_context(model, enabled=True)
    if rank == 0:
        assert cap is None and not OutputLayerInputCapture(model).is_available
        hidden = model(ids, pos, None)
        dist.send(hidden.detach().contiguous(), dst=1)
    else:
        assert cap is not None
        recv = torch.empty(S, B, 32)
        dist.recv(recv, src=0)
        model.set_input_tensor(recv)
        with ctx:
            logits = model(ids, pos, None)
        h = cap.get_hidden_states()
        assert h.shape == (S, B, 32)
        ref = (h @ model.output_layer.weight.detach().t()).transpose(0, 1)
        torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)


def test_vpp_chunk_list_captures_on_the_last_chunk():
    mc.init_parallel(pp=2, vpp=2)
    rank = dist.get_rank()
    cfg = mc.tiny_config(
        num_layers=4, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2
    )
    chunks = [
        mc.build_gpt(
            cfg, pre_process=rank == 0 and v == 0, post_process=rank == 1 and v == 1, vp_stage=v
        )
        for v in range(2)
    ]
    ids, pos = _batch(2)
    cap = OutputLayerInputCapture(chunks)
    assert cap.is_available == (rank == 1)
    if rank == 1:
        assert cap.output_layer is chunks[1].output_layer
    # run the interleaved schedule by hand: r0c0 -> r1c0 -> r0c1 -> r1c1
    buf = torch.empty(S, B, 32)
    if rank == 0:
        dist.send(chunks[0](ids, pos, None).detach().contiguous(), dst=1)
        dist.recv(buf, src=1)
        chunks[1].set_input_tensor(buf)
        dist.send(chunks[1](ids, pos, None).detach().contiguous(), dst=1)
        assert cap.get_hidden_states() is None
    else:
        dist.recv(buf, src=0)
        chunks[0].set_input_tensor(buf)
        dist.send(chunks[0](ids, pos, None).detach().contiguous(), dst=0)
        dist.recv(buf, src=0)
        chunks[1].set_input_tensor(buf)
        with cap.capture_context():
            logits = chunks[1](ids, pos, None)
        h = cap.get_hidden_states()
        ref = (h @ chunks[1].output_layer.weight.detach().t()).transpose(0, 1)
        torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)


def test_mtp_captures_the_main_head_not_an_mtp_depth():
    mc.init_parallel(tp=2)
    cfg = mc.tiny_config(
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        mtp_num_layers=1,
        mtp_loss_scaling_factor=0.1,
    )
    model = mc.build_gpt(cfg, mtp=True)
    ids, pos = _batch(3)
    inputs: list[torch.Tensor] = []
    model.output_layer.register_forward_pre_hook(
        lambda m, a: inputs.append(a[0].detach().clone()) and None
    )
    cap = OutputLayerInputCapture(model)
    with cap.capture_context():
        model(ids, pos, None, labels=ids)
    assert len(inputs) == 2  # one MTP depth, then the main head
    h = cap.get_hidden_states()
    tp = _tp_group()

    def gather_seq(x: torch.Tensor) -> torch.Tensor:
        return mc.gather_vocab_shards(x.movedim(0, -1).contiguous(), tp).movedim(-1, 0)

    torch.testing.assert_close(h, gather_seq(inputs[-1]), rtol=0, atol=0)
    assert not torch.allclose(h, gather_seq(inputs[0]))
    # independent reference: the same weights without MTP give the same main hidden states
    full = {k: v for k, v in mc.full_state(model, tp).items() if not k.startswith("mtp.")}
    plain = mc.build_gpt(mc.tiny_config(tensor_model_parallel_size=2, sequence_parallel=True))
    mc.load_full_state(plain, full, dist.get_rank(), 2)
    cap2 = OutputLayerInputCapture(plain)
    with cap2.capture_context():
        plain(ids, pos, None)
    torch.testing.assert_close(h, cap2.get_hidden_states(), rtol=1e-6, atol=1e-6)


def test_tied_embeddings_weight_as_keyword():
    mc.init_parallel(tp=2)
    cfg = mc.tiny_config(tensor_model_parallel_size=2, sequence_parallel=True)
    model = mc.build_gpt(cfg, share_embeddings=True)
    assert model.output_layer.weight is None
    ids, pos = _batch(4)
    cap = OutputLayerInputCapture(model)
    with cap.capture_context():
        logits = model(ids, pos, None)
    _check_logits(cap.get_hidden_states(), logits, _head_weight(model))


def test_megatron_ddp_and_float16module_wrappers():
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    mc.init_parallel(tp=2)
    cfg = mc.tiny_config(tensor_model_parallel_size=2, sequence_parallel=True, bf16=True)
    inner = mc.build_gpt(cfg)
    model = DistributedDataParallel(cfg, DistributedDataParallelConfig(), Float16Module(cfg, inner))
    ids, pos = _batch(5)
    ctx, cap = get_opd_full_capture_context(model, enabled=True)
    assert cap is not None and cap.output_layer is inner.output_layer
    with ctx:
        logits = model(ids, pos, None)
    h = cap.get_hidden_states()
    assert h.dtype == torch.bfloat16 and h.shape == (S, B, 32)
    w = _head_weight(inner)
    full = mc.gather_vocab_shards(logits.detach(), _tp_group())
    ref = (h.float() @ w.float().t()).to(torch.bfloat16).float().transpose(0, 1)
    torch.testing.assert_close(full, ref, rtol=1.6e-2, atol=1e-2)  # bf16 rounding of the product


def test_caller_buffer_is_recycled_across_steps_and_never_holds_the_graph():
    from mopd.capture import ReusableBuffer

    mc.init_parallel(tp=2)
    model = mc.build_gpt(mc.tiny_config(tensor_model_parallel_size=2, sequence_parallel=True))
    buf = ReusableBuffer()  # the caller's, recycled: the zero-allocation path on request
    ptrs = set()
    for step in range(3):
        ids, pos = _batch(10 + step)
        # a capture made anew every step, as get_opd_full_capture_context is used in a loop
        ctx, cap = get_opd_full_capture_context(model, enabled=True, buffer=buf)
        with ctx:
            logits = model(ids, pos, None)  # grad enabled: a training-mode forward
        h = cap.get_hidden_states()
        assert h.grad_fn is None and not h.requires_grad
        _check_logits(h, logits, _head_weight(model))
        ptrs.add(h.data_ptr())
    assert buf.allocations == 1 and len(ptrs) == 1
    ids, pos = _batch(20, s=8)
    with cap.capture_context():
        model(ids, pos, None)
    assert cap.get_hidden_states().shape == (8, B, 32) and buf.allocations == 2


def test_caller_buffer_receives_the_gather():
    mc.init_parallel(tp=2)
    model = mc.build_gpt(mc.tiny_config(tensor_model_parallel_size=2, sequence_parallel=True))
    out = torch.full((S, B, 32), float("nan"))
    cap = OutputLayerInputCapture(model, out=out)
    ids, pos = _batch(6)
    with cap.capture_context():
        logits = model(ids, pos, None)
    h = cap.get_hidden_states()
    assert h.data_ptr() == out.data_ptr() and not torch.isnan(out).any()
    assert cap.allocations == 0
    _check_logits(out, logits, _head_weight(model))
