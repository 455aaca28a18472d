"""Tier 1: NeMo-RL's ``opd_full_capture`` contract, case by case, on duck-typed modules.

Each test states one behaviour of NeMo-RL's ``nemo_rl.models.megatron.opd_full_capture`` (its
``OutputLayerInputCapture`` and ``get_opd_full_capture_context``) that a caller relies on, and
checks that ``mopd.capture`` gives the same answer by default. The one deliberate difference is
misuse NeMo-RL handles badly: re-entering one capture's context while it is active (NeMo-RL
leaves a hook behind and fails on exit) raises ``CaptureMisuseError`` here and leaves nothing
behind. The same contract under TP2 + sequence parallelism on real megatron-core GPTModels is
``tests/torchrun/test_capture_nemo_contract.py``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from mopd.capture import (
    CaptureMisuseError,
    OutputLayerInputCapture,
    get_opd_full_capture_context,
)
from tests.support.capture_models import VLM, H, TinyLM, Wrapper, hooks_on, x_SBH


def _head_input(model: TinyLM, x: torch.Tensor) -> torch.Tensor:
    """What GPTModel feeds its output_layer: the post-final-layernorm hidden states."""
    return model.norm(x).detach()


def test_disabled_gives_a_null_context_and_no_capture():
    model = TinyLM()
    ctx, cap = get_opd_full_capture_context(model, enabled=False)
    assert cap is None and isinstance(ctx, contextlib.nullcontext)
    with ctx:
        assert hooks_on(model.output_layer) == 0
        model(x_SBH())


@pytest.mark.parametrize(
    "model",
    [TinyLM(post_process=False), Wrapper(TinyLM(post_process=False)), None],
    ids=["non-last-stage", "wrapped-non-last-stage", "no-model"],
)
def test_no_output_layer_is_unavailable(model):
    """A rank without an output layer (non-final pipeline stage): nothing to capture."""
    cap = OutputLayerInputCapture(model)
    assert not cap.is_available
    with cap.capture_context():
        pass
    assert cap.get_hidden_states() is None
    ctx, none = get_opd_full_capture_context(model, enabled=True)
    assert none is None and isinstance(ctx, contextlib.nullcontext)


def test_model_attribute_is_the_unwrapped_model():
    """``capture.model``: the model with its wrappers removed."""
    inner = TinyLM()
    assert OutputLayerInputCapture(inner).model is inner
    assert OutputLayerInputCapture(Wrapper(Wrapper(inner))).model is inner
    vlm = VLM()
    cap = OutputLayerInputCapture(Wrapper(vlm))
    assert cap.model is vlm and cap.output_layer is vlm.language_model.output_layer
    assert OutputLayerInputCapture(None).model is None


def test_hook_lives_only_inside_the_context_which_yields_none():
    model = TinyLM()
    ctx, cap = get_opd_full_capture_context(model, enabled=True)
    assert cap is not None and cap.is_available and hooks_on(model.output_layer) == 0
    with ctx as entered:
        assert entered is None and hooks_on(model.output_layer) == 1
        model(x_SBH())
    assert hooks_on(model.output_layer) == 0


def test_result_is_the_detached_head_input_and_rank_three_is_checked():
    model = TinyLM()
    x = x_SBH()
    cap = OutputLayerInputCapture(model)
    with cap.capture_context():
        model(x)
    h = cap.get_hidden_states()
    assert h.shape == (5, 3, H) and not h.requires_grad and h.grad_fn is None
    torch.testing.assert_close(h, _head_input(model, x), rtol=0, atol=0)

    holder = torch.nn.Module()
    holder.output_layer = model.output_layer
    flat = OutputLayerInputCapture(holder)
    with flat.capture_context():
        holder.output_layer(torch.randn(4, H))
    with pytest.raises(ValueError, match=r"shape \(4, 8\); expected rank 3"):
        flat.get_hidden_states()


def test_a_kept_result_is_never_overwritten_by_a_later_capture():
    model = TinyLM()
    cap = OutputLayerInputCapture(model)
    kept, refs = [], []
    for seed in range(3):  # one capture per micro-batch, each result kept by the caller
        x = x_SBH(seed=seed)
        with cap.capture_context():
            model(x)
        kept.append(cap.get_hidden_states())
        refs.append(_head_input(model, x).clone())
    for h, ref in zip(kept, refs, strict=True):
        torch.testing.assert_close(h, ref, rtol=0, atol=0)
    # and one made anew per step, as get_opd_full_capture_context is used in a loop
    kept2 = []
    for seed in range(2):
        ctx, c = get_opd_full_capture_context(model, enabled=True)
        with ctx:
            model(x_SBH(seed=seed))
        kept2.append(c.get_hidden_states())
    torch.testing.assert_close(kept2[0], refs[0], rtol=0, atol=0)
    torch.testing.assert_close(kept2[1], refs[1], rtol=0, atol=0)


def test_two_forward_passes_in_one_context_keep_the_last():
    model = TinyLM()
    x1, x2 = x_SBH(seed=1), x_SBH(seed=2)
    cap = OutputLayerInputCapture(model)
    with cap.capture_context():
        model(x1)
        model(x2)
    torch.testing.assert_close(cap.get_hidden_states(), _head_input(model, x2), rtol=0, atol=0)


def test_two_captures_active_on_one_layer_both_work():
    model = TinyLM()
    x = x_SBH()
    a, b = OutputLayerInputCapture(model), OutputLayerInputCapture(model)
    with a.capture_context(), b.capture_context():
        assert hooks_on(model.output_layer) == 2
        model(x)
    assert hooks_on(model.output_layer) == 0
    torch.testing.assert_close(a.get_hidden_states(), _head_input(model, x), rtol=0, atol=0)
    torch.testing.assert_close(b.get_hidden_states(), _head_input(model, x), rtol=0, atol=0)
    # overlapping, not nested: a opens, b opens, a closes, a forward, b closes
    x2 = x_SBH(seed=7)
    ca, cb = a.capture_context(), b.capture_context()
    ca.__enter__()
    cb.__enter__()
    ca.__exit__(None, None, None)
    model(x2)
    cb.__exit__(None, None, None)
    assert a.get_hidden_states() is None  # entering cleared it and a's hook was gone
    torch.testing.assert_close(b.get_hidden_states(), _head_input(model, x2), rtol=0, atol=0)
    assert hooks_on(model.output_layer) == 0


def test_an_exception_after_the_head_keeps_the_capture():
    model = TinyLM()
    x = x_SBH()
    cap = OutputLayerInputCapture(model)
    with pytest.raises(RuntimeError, match="after the head"), cap.capture_context():
        model(x, fail_after_head=True)
    assert hooks_on(model.output_layer) == 0
    torch.testing.assert_close(cap.get_hidden_states(), _head_input(model, x), rtol=0, atol=0)
    with pytest.raises(KeyError), cap.capture_context():  # raised by the caller, not the model
        model(x)
        raise KeyError("after the forward")
    torch.testing.assert_close(cap.get_hidden_states(), _head_input(model, x), rtol=0, atol=0)


def test_an_exception_before_the_head_leaves_nothing():
    model = TinyLM()
    cap = OutputLayerInputCapture(model)
    with cap.capture_context():
        model(x_SBH())
    with pytest.raises(RuntimeError, match="before the head"), cap.capture_context():
        model(x_SBH(), fail_before_head=True)
    assert hooks_on(model.output_layer) == 0
    assert cap.get_hidden_states() is None  # entering cleared the earlier capture


def test_pre_hook_without_positional_arguments_is_ignored():
    model = TinyLM()
    cap = OutputLayerInputCapture(model)
    cap._pre_hook(model.output_layer, ())
    assert cap.get_hidden_states() is None
    x = x_SBH()
    with cap.capture_context():
        model(x)
        cap._pre_hook(model.output_layer, ())  # does not drop what the forward captured
    torch.testing.assert_close(cap.get_hidden_states(), _head_input(model, x), rtol=0, atol=0)


def test_pre_hook_called_directly_captures():
    """The hook is a plain method: called by hand (outside a context) it captures its argument."""
    model = TinyLM()
    cap = OutputLayerInputCapture(model)
    h = torch.randn(4, 2, H)
    cap._pre_hook(model.output_layer, (h,))
    torch.testing.assert_close(cap.get_hidden_states(), h, rtol=0, atol=0)


def test_one_capture_reused_context_after_context():
    model = TinyLM()
    cap = OutputLayerInputCapture(model)
    for seed in range(3):
        x = x_SBH(seed=seed)
        with cap.capture_context():
            model(x)
        torch.testing.assert_close(cap.get_hidden_states(), _head_input(model, x), rtol=0, atol=0)
    assert hooks_on(model.output_layer) == 0


def test_nested_reentry_of_one_context_is_an_error_that_leaves_no_hook():
    """Misuse NeMo-RL handles badly (a hook left behind, a failure on the outer exit)."""
    model = TinyLM()
    x = x_SBH()
    cap = OutputLayerInputCapture(model)
    with cap.capture_context():
        with pytest.raises(CaptureMisuseError, match="already active"), cap.capture_context():
            pass
        assert hooks_on(model.output_layer) == 1  # the outer context is intact
        model(x)
    assert hooks_on(model.output_layer) == 0
    torch.testing.assert_close(cap.get_hidden_states(), _head_input(model, x), rtol=0, atol=0)
    # an unavailable capture has no hook to leave behind: re-entering it is harmless, as there
    idle = OutputLayerInputCapture(TinyLM(post_process=False))
    with idle.capture_context(), idle.capture_context():
        pass
