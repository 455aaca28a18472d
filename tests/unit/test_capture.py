"""Tier 1: the capture's unwrapping rules and hook lifecycle on duck-typed modules."""

from __future__ import annotations

import pytest
import torch

from mopd.capture import (
    CaptureMisuseError,
    OutputLayerInputCapture,
    ReusableBuffer,
    find_output_layer,
    get_opd_full_capture_context,
    unwrap_model,
)

H, V = 8, 11


class Head(torch.nn.Module):
    """Stands in for ColumnParallelLinear: called as ``head(x, weight=...)``."""

    def __init__(self, mtp_num_layers: int | None = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(V, H))
        self.config = type("Cfg", (), {"mtp_num_layers": mtp_num_layers})()

    def forward(
        self, x: torch.Tensor, weight: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, None]:
        w = self.weight if weight is None else weight
        return x @ w.t(), None


class TinyLM(torch.nn.Module):
    """Stands in for GPTModel: a layer norm, then the head; MTP depths run the head first."""

    def __init__(self, *, post_process: bool = True, mtp: int = 0, tied: bool = False) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(H)
        self.mtp = mtp
        self.tied = tied
        self.embedding = torch.nn.Parameter(torch.randn(V, H))
        if post_process:
            self.output_layer = Head(mtp_num_layers=mtp or None)

    def forward(self, x_SBH: torch.Tensor, fail_before_head: bool = False) -> torch.Tensor:
        h = self.norm(x_SBH)
        if fail_before_head:
            raise RuntimeError("boom")
        weight = self.embedding if self.tied else None
        for d in range(self.mtp):  # MTP depths come first, on other inputs
            self.output_layer(h * (d + 2.0), weight=weight)
        return self.output_layer(h, weight=weight)[0]


class Wrapper(torch.nn.Module):
    """DDP / Float16Module / FSDP shape: the real model under ``.module``."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *a, **k):
        return self.module(*a, **k)


class VLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.language_model = TinyLM()

    def forward(self, x):
        return self.language_model(x)


def _x(s: int = 5, b: int = 3) -> torch.Tensor:
    return torch.randn(s, b, H, requires_grad=True)


def _hooks(model: torch.nn.Module) -> int:
    layer = find_output_layer(model)
    assert layer is not None
    return len(layer._forward_pre_hooks)


def test_captures_detached_input_of_output_layer():
    model = TinyLM()
    x = _x()
    cap = OutputLayerInputCapture(model)
    assert cap.is_available
    with cap.capture_context():
        model(x)
    h = cap.get_hidden_states()
    assert h is not None and h.shape == x.shape
    assert not h.requires_grad and h.grad_fn is None
    torch.testing.assert_close(h, model.norm(x).detach(), rtol=0, atol=0)
    # the same object on a second call, no recompute
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
    x = _x()
    with cap.capture_context():
        model(x)
    assert cap.get_hidden_states() is not None


def test_vpp_chunk_list_uses_the_chunk_with_the_head():
    chunks = [TinyLM(post_process=False), TinyLM(post_process=False), Wrapper(TinyLM())]
    cap = OutputLayerInputCapture(chunks)
    assert cap.is_available
    assert cap.output_layer is chunks[2].module.output_layer
    with cap.capture_context():
        chunks[2](_x())
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


def test_non_last_stage_is_unavailable_and_context_is_noop():
    model = TinyLM(post_process=False)
    cap = OutputLayerInputCapture(model)
    assert not cap.is_available
    with cap.capture_context():
        pass
    assert cap.get_hidden_states() is None
    ctx, none = get_opd_full_capture_context(model, enabled=True)
    assert none is None
    with ctx:
        pass


def test_disabled_returns_none_and_registers_nothing():
    model = TinyLM()
    ctx, cap = get_opd_full_capture_context(model, enabled=False)
    assert cap is None
    with ctx:
        assert _hooks(model) == 0
        model(_x())


def test_hook_registered_only_inside_context_and_removed_on_error():
    model = TinyLM()
    ctx, cap = get_opd_full_capture_context(model, enabled=True)
    assert cap is not None and _hooks(model) == 0
    with ctx:
        assert _hooks(model) == 1
        model(_x())
    assert _hooks(model) == 0
    with pytest.raises(RuntimeError, match="boom"), cap.capture_context():
        model(_x(), fail_before_head=True)
    assert _hooks(model) == 0
    assert cap.get_hidden_states() is None  # the forward never reached the head


def test_error_after_reaching_head_leaves_nothing_stale():
    model = TinyLM()
    cap = OutputLayerInputCapture(model)
    with pytest.raises(KeyError), cap.capture_context():
        model(_x())
        raise KeyError("after the head")
    assert cap.get_hidden_states() is None
    assert _hooks(model) == 0


def test_forward_without_context_captures_nothing():
    model = TinyLM()
    cap = OutputLayerInputCapture(model)
    model(_x())
    assert cap.get_hidden_states() is None


def test_entering_twice_and_two_captures_on_one_layer_raise():
    model = TinyLM()
    cap = OutputLayerInputCapture(model)
    with cap.capture_context():
        with pytest.raises(CaptureMisuseError, match="entered twice"), cap.capture_context():
            pass
        other = OutputLayerInputCapture(model)
        with (
            pytest.raises(CaptureMisuseError, match="already active on this output_layer"),
            other.capture_context(),
        ):
            pass
    assert _hooks(model) == 0
    # once the first is closed, another capture may take the layer
    other = OutputLayerInputCapture(model)
    with other.capture_context():
        model(_x())
    assert other.get_hidden_states() is not None


def test_context_spanning_two_forwards_is_an_error():
    model = TinyLM()
    cap = OutputLayerInputCapture(model)
    with cap.capture_context():
        model(_x())
        model(_x())
    with pytest.raises(CaptureMisuseError, match="ran 2 times"):
        cap.get_hidden_states()


@pytest.mark.parametrize("mtp", [1, 3])
def test_mtp_captures_the_main_call(mtp):
    model = TinyLM(mtp=mtp)
    x = _x()
    cap = OutputLayerInputCapture(model)
    with cap.capture_context():
        model(x)
    h = cap.get_hidden_states()
    torch.testing.assert_close(h, model.norm(x).detach(), rtol=0, atol=0)


def test_tied_weight_as_keyword_still_captures():
    model = TinyLM(tied=True)
    x = _x()
    cap = OutputLayerInputCapture(model)
    with cap.capture_context():
        logits = model(x)
    h = cap.get_hidden_states()
    torch.testing.assert_close(h @ model.embedding.detach().t(), logits.detach(), rtol=0, atol=0)


def test_rank_other_than_three_raises():
    head = Head()
    holder = torch.nn.Module()
    holder.output_layer = head
    cap = OutputLayerInputCapture(holder)
    with cap.capture_context():
        head(torch.randn(4, H))
    with pytest.raises(ValueError, match=r"shape \(4, 8\); expected rank 3"):
        cap.get_hidden_states()


def test_caller_buffer_is_written_and_reused():
    model = TinyLM()
    out = torch.full((5, 3, H), float("nan"))
    cap = OutputLayerInputCapture(model, out=out)
    ptr = out.data_ptr()
    for _ in range(3):
        x = _x()
        with cap.capture_context():
            model(x)
        h = cap.get_hidden_states()
        assert h.data_ptr() == ptr
        torch.testing.assert_close(out, model.norm(x).detach(), rtol=0, atol=0)
    bad = OutputLayerInputCapture(model, out=torch.empty(4, 3, H))
    with bad.capture_context():
        model(_x())
    with pytest.raises(ValueError, match=r"capture buffer is \(4, 3, 8\).*need \(5, 3, 8\)"):
        bad.get_hidden_states()


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
