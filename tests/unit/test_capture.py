"""Tier 1: what the capture does beyond NeMo-RL's module, on duck-typed modules.

NeMo-RL's own contract, case by case, is ``test_capture_nemo_contract.py``; this module covers the
supersets (unwrapping rules, virtual-pipeline chunk lists, MTP, keyword inputs, the caller-owned
buffers) and the capture's own errors.
"""

from __future__ import annotations

import pytest
import torch

from mopd.capture import (
    OutputLayerInputCapture,
    ReusableBuffer,
    find_output_layer,
    get_opd_full_capture_context,
)
from mopd.capture.unwrap import unwrap_model
from tests.support.capture_models import VLM, H, Head, TinyLM, Wrapper, hooks_on, x_SBH


def test_captures_detached_input_of_output_layer():
    model = TinyLM()
    x = x_SBH()
    cap = OutputLayerInputCapture(model)
    assert cap.is_available
    with cap.capture_context():
        model(x)
    h = cap.get_hidden_states()
    assert h is not None and h.shape == x.shape
    assert not h.requires_grad and h.grad_fn is None
    torch.testing.assert_close(h, model.norm(x).detach(), rtol=0, atol=0)
    # superset: the same object on a second call, no recompute (no second collective under SP)
    assert cap.get_hidden_states() is h


@pytest.mark.parametrize(
    "make",
    [
        lambda: Wrapper(TinyLM()),
        lambda: Wrapper(Wrapper(Wrapper(TinyLM()))),
        lambda: VLM(),
        lambda: Wrapper(VLM()),
    ],
    ids=["ddp", "ddp-fp16-fsdp", "vlm", "wrapped-vlm"],
)
def test_unwrapping_finds_the_head(make):
    model = make()
    cap = OutputLayerInputCapture(model)
    assert cap.is_available
    x = x_SBH()
    with cap.capture_context():
        model(x)
    assert cap.get_hidden_states() is not None


def test_vpp_chunk_list_uses_the_chunk_with_the_head():
    chunks = [TinyLM(post_process=False), TinyLM(post_process=False), Wrapper(TinyLM())]
    cap = OutputLayerInputCapture(chunks)
    assert cap.is_available
    assert cap.output_layer is chunks[2].module.output_layer
    assert cap.model == [chunks[0], chunks[1], chunks[2].module]  # NeMo-RL's .model of a list
    with cap.capture_context():
        chunks[2](x_SBH())
    assert cap.get_hidden_states() is not None
    mlist = torch.nn.ModuleList(chunks)
    assert find_output_layer(mlist) is chunks[2].module.output_layer


def test_chunk_list_without_head_is_unavailable_and_two_heads_is_an_error():
    assert not OutputLayerInputCapture([TinyLM(post_process=False)] * 2).is_available
    with pytest.raises(ValueError, match="chunks \\[0, 1\\]"):
        OutputLayerInputCapture([TinyLM(), TinyLM()])
    with pytest.raises(ValueError, match=r"torch\.nn\.Module or a list"):
        OutputLayerInputCapture(42)  # type: ignore[arg-type]


def test_wrapper_cycle_is_reported():
    a = Wrapper(torch.nn.Identity())
    b = Wrapper(a)
    a.module = b  # a cycle through .module
    with pytest.raises(ValueError, match=r"nested \.module"):
        unwrap_model(b)


def test_forward_without_context_captures_nothing():
    model = TinyLM()
    cap = OutputLayerInputCapture(model)
    model(x_SBH())
    assert cap.get_hidden_states() is None and hooks_on(model.output_layer) == 0


@pytest.mark.parametrize("mtp", [1, 3])
def test_mtp_captures_the_main_call(mtp):
    model = TinyLM(mtp=mtp)
    x = x_SBH()
    cap = OutputLayerInputCapture(model)
    with cap.capture_context():
        model(x)
    h = cap.get_hidden_states()
    torch.testing.assert_close(h, model.norm(x).detach(), rtol=0, atol=0)


def test_tied_weight_as_keyword_still_captures():
    model = TinyLM(tied=True)
    x = x_SBH()
    cap = OutputLayerInputCapture(model)
    with cap.capture_context():
        logits = model(x)
    h = cap.get_hidden_states()
    torch.testing.assert_close(h @ model.embedding.detach().t(), logits.detach(), rtol=0, atol=0)


def test_head_called_with_a_keyword_input_is_captured():
    """Superset: NeMo-RL's positional-only hook sees no argument here and captures nothing."""
    model = TinyLM(keyword=True)
    x = x_SBH()
    cap = OutputLayerInputCapture(model)
    with cap.capture_context():
        model(x)
    torch.testing.assert_close(cap.get_hidden_states(), model.norm(x).detach(), rtol=0, atol=0)


def test_caller_out_is_written_every_capture_and_overwritten_by_the_next():
    """``out=``: zero allocation, and the lifetime rule: valid until the next capture into it."""
    model = TinyLM()
    out = torch.full((5, 3, H), float("nan"))
    cap = OutputLayerInputCapture(model, out=out)
    kept = []
    for seed in range(3):
        x = x_SBH(seed=seed)
        with cap.capture_context():
            model(x)
        h = cap.get_hidden_states()
        assert h is out
        torch.testing.assert_close(out, model.norm(x).detach(), rtol=0, atol=0)
        kept.append(h)
    assert all(k is out for k in kept) and cap.allocations == 0
    bad = OutputLayerInputCapture(model, out=torch.empty(4, 3, H))
    with bad.capture_context():
        model(x_SBH())
    with pytest.raises(ValueError, match=r"capture buffer is \(4, 3, 8\).*need \(5, 3, 8\)"):
        bad.get_hidden_states()


def test_buffer_without_sequence_parallelism_copies_nothing():
    """``buffer=`` only receives an SP gather; without SP the layer's input is returned as is."""
    model = TinyLM()
    buf = ReusableBuffer()
    cap = OutputLayerInputCapture(model, buffer=buf)
    seen = []
    model.output_layer.register_forward_pre_hook(lambda m, a: seen.append(a[0]) and None)
    with cap.capture_context():
        model(x_SBH())
    h = cap.get_hidden_states()
    assert h.data_ptr() == seen[0].data_ptr() and buf.allocations == 0 and cap.allocations == 0


def test_out_and_buffer_together_are_refused_and_set_output_buffer():
    model = TinyLM()
    with pytest.raises(ValueError, match="out= or buffer="):
        OutputLayerInputCapture(model, out=torch.empty(5, 3, H), buffer=ReusableBuffer())
    cap = OutputLayerInputCapture(model)
    out = torch.empty(5, 3, H)
    cap.set_output_buffer(out)
    x = x_SBH()
    with cap.capture_context():
        model(x)
    assert cap.get_hidden_states() is out
    torch.testing.assert_close(out, model.norm(x).detach(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="buffer="):
        OutputLayerInputCapture(model, buffer=ReusableBuffer()).set_output_buffer(out)


def test_reusable_buffer_allocates_once_per_shape():
    buf = ReusableBuffer()
    a = buf.get((4, 2, 3), torch.float32, torch.device("cpu"))
    b = buf.get((4, 2, 3), torch.float32, torch.device("cpu"))
    assert a.data_ptr() == b.data_ptr() and buf.allocations == 1
    c = buf.get((5, 2, 3), torch.float32, torch.device("cpu"))
    assert c.shape == (5, 2, 3) and buf.allocations == 2
    buf.get((5, 2, 3), torch.bfloat16, torch.device("cpu"))
    assert buf.allocations == 3


def test_sequence_parallel_without_a_group_is_refused():
    model = TinyLM()
    with pytest.raises(ValueError, match="no tensor-parallel group is known"):
        OutputLayerInputCapture(model, sequence_parallel=True)


def test_non_tensor_first_argument_is_a_clear_error():
    """NeMo-RL keeps any first argument and fails on ``.ndim``; here it is a ValueError."""
    holder = torch.nn.Module()
    holder.output_layer = Head()
    cap = OutputLayerInputCapture(holder)
    cap._pre_hook(holder.output_layer, ([1, 2],))
    with pytest.raises(ValueError, match="first positional argument is a list"):
        cap.get_hidden_states()


def test_get_opd_full_capture_context_passes_capture_options():
    model = TinyLM()
    out = torch.empty(5, 3, H)
    ctx, cap = get_opd_full_capture_context(model, True, out=out)
    with ctx:
        model(x_SBH())
    assert cap.get_hidden_states() is out


def test_local_hidden_states_are_the_layers_input_as_is():
    """``get_local_hidden_states``: the input as this rank holds it (no copy, ``out`` untouched,
    not a shard without SP); ``get_hidden_states`` afterwards keeps its own contract; the
    checks are the same."""
    model = TinyLM()
    out = torch.full((5, 3, H), float("nan"))
    cap = OutputLayerInputCapture(model, out=out)
    seen = []
    model.output_layer.register_forward_pre_hook(lambda m, a: seen.append(a[0]) and None)
    x = x_SBH(seed=4)
    with cap.capture_context():
        model(x)
    local = cap.get_local_hidden_states()
    assert local is not None and local.data_ptr() == seen[0].data_ptr()
    assert not local.requires_grad and not cap.sequence_sharded
    assert torch.isnan(out).all() and cap.allocations == 0  # nothing written into out
    assert cap.get_local_hidden_states() is local
    assert cap.get_hidden_states() is out  # the full-[S, B, H] contract, into out as before
    torch.testing.assert_close(out, local, rtol=0, atol=0)
    with cap.capture_context():
        pass
    assert cap.get_local_hidden_states() is None  # a new context clears it
    holder = torch.nn.Module()
    holder.output_layer = Head()
    bad = OutputLayerInputCapture(holder)
    bad._pre_hook(holder.output_layer, (torch.zeros(4, H),))
    with pytest.raises(ValueError, match="expected rank 3"):
        bad.get_local_hidden_states()
