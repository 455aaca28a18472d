"""Tier 2: NeMo-RL's ``opd_full_capture`` contract under TP2 + sequence parallelism (gloo, 2 ranks).

The cases of ``tests/unit/test_capture_nemo_contract.py`` where sequence parallelism matters, on
real megatron-core GPTModels (local spec, CPU): each rank's output layer sees ``[S/2, B, H]`` and
``get_hidden_states`` all-gathers it. References are independent of the capture: the full
logits (vocab shards gathered) equal ``captured @ W^T``, and a capture of the same input alone
gives the same bits (CPU forwards are deterministic). Also here: the supersets that need ranks
(the gather over the output layer's own TP group, a cached second call without a collective) and
the zero-allocation path measured by counting allocator calls (not timing).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mopd.capture import OutputLayerInputCapture, ReusableBuffer, get_opd_full_capture_context
from mopd.profiling.bench.allocations import count_allocations
from tests.support import megatron_cpu as mc

TORCHRUN_NPROC = 2
TORCHRUN_TIMEOUT = 300

S, B, V, H = 16, 2, 64, 32
CPU = torch.device("cpu")


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, S), generator=g), torch.arange(S).expand(B, S)


def _model() -> torch.nn.Module:
    mc.init_parallel(tp=2)
    return mc.build_gpt(mc.tiny_config(tensor_model_parallel_size=2, sequence_parallel=True))


def _check_logits(model, h_SBH: torch.Tensor, logits_BSv: torch.Tensor) -> None:
    """``h @ W_full^T`` equals the model's full logits (an independent reference)."""
    tp = model.output_layer.tp_group
    w_VH = mc.gather_vocab_shards(model.output_layer.weight.detach().t().contiguous(), tp).t()
    full_BSV = mc.gather_vocab_shards(logits_BSv.detach(), tp)
    torch.testing.assert_close(full_BSV, (h_SBH @ w_VH.t()).transpose(0, 1), rtol=1e-5, atol=1e-5)


def _alone(model, seed: int) -> torch.Tensor:
    """The capture of one forward of batch ``seed``, in a context of its own."""
    ctx, cap = get_opd_full_capture_context(model, enabled=True)
    with torch.no_grad(), ctx:
        model(*_batch(seed), None)
    return cap.get_hidden_states().clone()


def test_a_kept_result_is_never_overwritten_by_a_later_capture():
    model = _model()
    kept, logits = [], []
    for seed in range(3):  # micro-batches of one shape, a capture made anew each, results kept
        ctx, cap = get_opd_full_capture_context(model, enabled=True)
        with torch.no_grad(), ctx:
            logits.append(model(*_batch(seed), None))
        h = cap.get_hidden_states()
        assert h.shape == (S, B, H)
        kept.append(h)
    assert len({h.data_ptr() for h in kept}) == 3  # one tensor per capture
    for seed, (h, lg) in enumerate(zip(kept, logits, strict=True)):
        _check_logits(model, h, lg)
        assert torch.equal(h, _alone(model, seed))
    # one capture object reused micro-batch after micro-batch: the same
    cap = OutputLayerInputCapture(model)
    first = None
    for seed in (5, 6):
        with torch.no_grad(), cap.capture_context():
            model(*_batch(seed), None)
        first = cap.get_hidden_states() if first is None else first
    assert torch.equal(first, _alone(model, 5))


def test_two_forward_passes_in_one_context_keep_the_last():
    model = _model()
    ctx, cap = get_opd_full_capture_context(model, enabled=True)
    with torch.no_grad(), ctx:
        model(*_batch(1), None)
        logits = model(*_batch(2), None)
    h = cap.get_hidden_states()
    _check_logits(model, h, logits)
    assert torch.equal(h, _alone(model, 2))


def test_two_captures_active_on_one_layer_both_work():
    model = _model()
    a, b = OutputLayerInputCapture(model), OutputLayerInputCapture(model)
    with torch.no_grad(), a.capture_context(), b.capture_context():
        logits = model(*_batch(3), None)
    ha, hb = a.get_hidden_states(), b.get_hidden_states()  # one gather each, same order per rank
    _check_logits(model, ha, logits)
    assert torch.equal(ha, hb) and ha.data_ptr() != hb.data_ptr()
    assert len(model.output_layer._forward_pre_hooks) == 0


def test_an_exception_after_the_head_keeps_the_capture():
    model = _model()
    cap = OutputLayerInputCapture(model)
    with (
        pytest.raises(RuntimeError, match="after the forward"),
        torch.no_grad(),
        cap.capture_context(),
    ):
        logits = model(*_batch(4), None)
        raise RuntimeError("after the forward")
    assert len(model.output_layer._forward_pre_hooks) == 0
    h = cap.get_hidden_states()
    _check_logits(model, h, logits)
    assert torch.equal(h, _alone(model, 4))


def test_pre_hook_without_positional_arguments_is_ignored():
    model = _model()
    cap = OutputLayerInputCapture(model)
    with torch.no_grad(), cap.capture_context():
        model(*_batch(5), None)
        cap._pre_hook(model.output_layer, ())
    assert torch.equal(cap.get_hidden_states(), _alone(model, 5))


def test_model_attribute_is_what_megatron_unwrap_model_gives():
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.utils import unwrap_model

    inner = _model()
    cfg = inner.config
    model = DistributedDataParallel(cfg, DistributedDataParallelConfig(), inner)
    cap = OutputLayerInputCapture(model)
    assert cap.model is unwrap_model(model) is inner
    with torch.no_grad(), cap.capture_context():
        logits = model(*_batch(6), None)
    _check_logits(inner, cap.get_hidden_states(), logits)


# ---- supersets ---------------------------------------------------------------------------


def test_gather_uses_the_output_layers_own_tp_group():
    """A model built on an explicit pg_collection while megatron's global TP group is size 1."""
    from mopd.bridge import GroupPool, Mesh
    from mopd.mcore import megatron_process_groups

    mc.init_parallel(tp=1)
    pg = megatron_process_groups(Mesh(tp=2), GroupPool())
    model = mc.build_gpt(
        mc.tiny_config(tensor_model_parallel_size=2, sequence_parallel=True), pg_collection=pg
    )
    assert model.output_layer.tp_group is pg.tp
    ctx, cap = get_opd_full_capture_context(model, enabled=True)
    with torch.no_grad(), ctx:
        logits = model(*_batch(7), None)
    h = cap.get_hidden_states()
    assert h.shape == (S, B, H)
    _check_logits(model, h, logits)


def test_second_get_is_cached_without_a_collective():
    model = _model()
    cap = OutputLayerInputCapture(model)
    with torch.no_grad(), cap.capture_context():
        model(*_batch(8), None)
    h = cap.get_hidden_states()
    if dist.get_rank() == 0:  # one rank only: a collective here would hang (and time out)
        assert cap.get_hidden_states() is h
    dist.barrier()


def test_keyword_input_is_captured():
    model = _model()
    cap = OutputLayerInputCapture(model)
    local = torch.randn(S // 2, B, H, generator=torch.Generator().manual_seed(dist.get_rank()))
    with torch.no_grad(), cap.capture_context():
        model.output_layer(input_=local)
    h = cap.get_hidden_states()
    parts = [torch.empty_like(local) for _ in range(2)]
    dist.all_gather(parts, local)
    assert torch.equal(h, torch.cat(parts))


# ---- the zero-allocation path, measured ---------------------------------------------------


def _get_allocations(model, cap: OutputLayerInputCapture, seed: int) -> tuple[int, int, int]:
    """``(own allocations, own bytes, the collective's allocations)`` of one ``get_hidden_states``.

    The collective's are gloo's: its CPU all-gather stages the gathered tensor through
    temporaries (NCCL does not; ``tests/gpu/test_capture_gpu.py``).
    """
    with torch.no_grad(), cap.capture_context():
        model(*_batch(seed), None)
    a = count_allocations(cap.get_hidden_states, device=CPU)
    return a.own_count, a.own_nbytes, a.collective_count


def test_allocations_per_step_default_out_and_buffer():
    model = _model()
    nbytes = S * B * H * 4
    default = OutputLayerInputCapture(model)
    got = [_get_allocations(model, default, s) for s in range(3)]
    assert [g[:2] for g in got] == [(1, nbytes)] * 3  # NeMo-RL's answer: a tensor per capture
    assert all(g[2] > 0 for g in got)  # gloo's staging (sanity: the split sees collectives)
    out = torch.full((S, B, H), float("nan"))
    with_out = OutputLayerInputCapture(model, out=out)
    assert [_get_allocations(model, with_out, s)[:2] for s in range(3)] == [(0, 0)] * 3
    assert torch.equal(out, _alone(model, 2)) and with_out.allocations == 0
    buf = ReusableBuffer()
    recycled = OutputLayerInputCapture(model, buffer=buf)
    got = [_get_allocations(model, recycled, s)[:2] for s in range(3)]
    assert got == [(1, nbytes), (0, 0), (0, 0)] and buf.allocations == recycled.allocations == 1
    assert torch.equal(recycled.get_hidden_states(), _alone(model, 2))


def test_a_step_with_out_allocates_what_the_forward_alone_allocates():
    """Per step (forward + capture + gather) against the same forward uncaptured, outside
    collectives; inside them the capture adds exactly one gloo all-gather's staging."""
    model = _model()
    ids, pos = _batch(9)
    out = torch.empty(S, B, H)
    cap = OutputLayerInputCapture(model, out=out)

    def plain() -> None:
        with torch.no_grad():
            model(ids, pos, None)

    def captured() -> None:
        with torch.no_grad(), cap.capture_context():
            model(ids, pos, None)
        cap.get_hidden_states()

    plain(), captured()  # warm-up
    base = count_allocations(plain, device=CPU)
    step = count_allocations(captured, device=CPU)
    shard = torch.empty(S // 2, B, H)
    gather = count_allocations(lambda: dist.all_gather_into_tensor(out, shard), device=CPU)
    assert base.own_count > 0 and gather.own_count == 0
    assert (step.own_count, step.own_nbytes) == (base.own_count, base.own_nbytes)
    assert step.collective_count == base.collective_count + gather.collective_count
