"""Tier 3: megatron-core HybridModels with Mamba layers as MOPD teacher and student (one GPU).

Mamba layers (``M`` in a ``hybrid_layer_pattern``) run CUDA kernels (mamba-ssm, causal-conv1d)
and megatron's shipped ``hybrid_stack_spec`` is Transformer Engine only, so these models exist
only on a GPU; the attention + MLP patterns are tier 2 (``tests/torchrun/test_mcore_hybrid.py``).
A pattern of Mamba, attention and MLP layers (``M*-M-``), bf16, NCCL at world size 1 (teacher and
student colocated on one rank), checked for what the library promises on it:

- the capture: ``captured @ W^T`` is the teacher's logits (bf16 tolerance);
- the teacher pass (megatron's forward-only schedule, LM head skipped) hands the same hidden
  states as a direct forward under the capture, bit for bit;
- ``lm_head_from_models`` reads the teacher's head (the rows are its ``output_layer`` weight);
- one :class:`mopd.mcore.Distiller` step on a Mamba student: the mean KL over the response
  tokens within 1e-2 of a float64 computation from the same outputs (the student's logits and
  the captured teacher states times the teacher's head).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="tier 3 needs a CUDA device; none here"
    ),
]

V, S, B, H = 512, 128, 2, 256
PATTERN = "M*-M-"  # Mamba, attention, MLP, Mamba, MLP
PROMPT = 32  # the first tokens of each sample are not counted


def _missing() -> str | None:
    """Why a Mamba HybridModel cannot be built on this machine, or ``None``."""
    import importlib.util

    if importlib.util.find_spec("megatron") is None:
        return "megatron-core is not installed on this GPU machine"
    if importlib.util.find_spec("megatron.core.models.hybrid") is None:
        return "this megatron-core has no megatron.core.models.hybrid (HybridModel: 0.18+)"
    from megatron.core.extensions import transformer_engine

    if not getattr(transformer_engine, "HAVE_TE", False):
        return "megatron's hybrid_stack_spec needs Transformer Engine, not installed here"
    for name in ("mamba_ssm", "causal_conv1d"):
        if importlib.util.find_spec(name) is None:
            return f"Mamba layers need {name}, not installed here"
    return None


@pytest.fixture
def megatron_gpu(nccl_world: Any) -> Any:
    """megatron's parallel state at world size 1 on the GPU (torn down afterwards)."""
    reason = _missing()
    if reason is not None:
        pytest.skip(reason)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    yield
    parallel_state.destroy_model_parallel()


def _model(pg: Any, seed: int, *, per_token: bool = True) -> Any:
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=len(PATTERN),
        hidden_size=H,
        num_attention_heads=4,
        mamba_head_dim=32,  # 16 heads: megatron wants (2 d_inner + 2 groups d_state + heads) % 16 == 0
        mamba_num_groups=8,
        mamba_state_dim=64,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        calculate_per_token_loss=per_token,
    )
    return HybridModel(
        config=cfg,
        hybrid_stack_spec=hybrid_stack_spec,
        vocab_size=V,
        max_sequence_length=S,
        hybrid_layer_pattern=PATTERN,
        position_embedding_type="none",
        pg_collection=pg,
    ).cuda()


def test_mamba_teacher_capture_teacher_pass_head_and_a_distillation_step(megatron_gpu) -> None:
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mopd.bridge import BridgeConfig, GroupPool, Mesh, create_bridge_groups
    from mopd.capture import get_opd_full_capture_context
    from mopd.mcore import (
        Distiller,
        MeshModel,
        lm_head_from_models,
        megatron_process_groups,
        padded_micro_batch,
    )
    from mopd.mcore.teacher import run_teacher

    pool = GroupPool(backend="nccl", timeout_s=60)
    tmesh, smesh = Mesh(name="teacher"), Mesh(name="student")
    tpg, spg = megatron_process_groups(tmesh, pool), megatron_process_groups(smesh, pool)
    teacher = _model(tpg, seed=1).eval()
    g = torch.Generator().manual_seed(0)
    tokens_BS = torch.randint(0, V, (B, S), generator=g).cuda()
    pos_BS = torch.arange(S, device="cuda").expand(B, S)

    # the capture: what feeds the head is the teacher's last hidden states
    ctx, cap = get_opd_full_capture_context(teacher, enabled=True)
    with torch.no_grad(), ctx:
        logits_BSV = teacher(tokens_BS, pos_BS, None)
    h_SBH = cap.get_hidden_states().clone()
    w_VH = teacher.output_layer.weight.detach()
    assert h_SBH.shape == (S, B, H)
    torch.testing.assert_close(
        logits_BSV.float(), (h_SBH.float() @ w_VH.float().t()).transpose(0, 1), rtol=2e-2, atol=2e-2
    )

    # the teacher pass: the same states through megatron's forward-only schedule
    seen: dict[int, torch.Tensor] = {}
    mbs = [padded_micro_batch([0, 1], tokens_BS)]
    run_teacher(teacher, mbs, pg_collection=tpg, on_hidden=lambda i, h: seen.update({i: h.clone()}))
    assert list(seen) == [0] and torch.equal(seen[0], h_SBH)

    # the LM head read off the models
    inner = _model(spg, seed=2)
    groups = create_bridge_groups(pool, [tmesh], smesh)
    head = lm_head_from_models(
        teacher, inner, teacher=tmesh, student=smesh, groups=groups, timeout_s=60
    )
    assert head is not None and torch.equal(head.weight_VH, w_VH)

    # one distillation step on a Mamba student, response tokens only
    student = DDP(inner.config, DistributedDataParallelConfig(), inner, pg_collection=spg)
    inner.config.finalize_model_grads_func = finalize_model_grads
    distiller = Distiller(
        teachers=[MeshModel(mesh=tmesh, model=teacher, pg_collection=tpg)],
        student=MeshModel(mesh=smesh, model=student, pg_collection=spg),
        pool=pool,
        bridge_config=BridgeConfig(timeout_s=60),
    )
    mask_BS = (torch.arange(S) >= PROMPT).expand(B, S).cuda()
    s_mbs = [padded_micro_batch([0, 1], tokens_BS, loss_mask_BS=mask_BS)]
    with distiller.step(student=s_mbs, teachers=[mbs]) as step:
        get_forward_backward_func()(
            forward_step_func=step.forward_step,
            data_iterator=step.data_iterator(),
            model=[student],
            num_microbatches=1,
            seq_length=S,
            micro_batch_size=B,
        )
    loss = step.mean_loss()
    assert loss is not None
    with torch.no_grad():
        s_BSV = inner(tokens_BS, pos_BS, None).double()
    t_BSV = (h_SBH.double() @ w_VH.double().t()).transpose(0, 1)
    ls, lt = torch.log_softmax(s_BSV, -1), torch.log_softmax(t_BSV, -1)
    kl_BS = (ls.exp() * (ls - lt)).sum(-1)
    ref = float(kl_BS[mask_BS].mean())
    assert loss == pytest.approx(ref, rel=1e-2), (loss, ref)
