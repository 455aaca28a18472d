"""Tier 2 (torchrun, 4 ranks, gloo): MOPD with mixture-of-experts teacher and student, EP2.

What a user relies on: with expert groups from ``megatron_process_groups(mesh, pool, ep=2)`` and
``mopd.mcore.cpu`` (megatron's allgather dispatcher on CPU ranks), an MoE teacher (4 experts,
top-2, EP2 x expert-DP2) distils into an MoE student (EP2) under megatron's own schedule with a
response mask, and the step's mean loss and every finalized ``main_grad`` (experts, router and
dense parts) equal the plain computation (:func:`tests.support.mcore_ref.reference_step`: both
models with all experts on one rank, float64 KL): loss within rtol 1e-5, gradients within 1e-4
of their norm, on both of megatron's loss paths. A loss mask on the teacher's micro-batches is
ignored with one warning.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.support.megatron_cpu import megatron_world

TORCHRUN_NPROC = 4
TORCHRUN_TIMEOUT = 600

V, S, LAYERS, EXPERTS, EP = 64, 16, 2, 4, 2
_EXPERT = re.compile(r"(\.local_experts\.)(\d+)(\.)")


world = pytest.fixture(scope="module")(megatron_world)


def _moe(hidden: int, *, ep: int, pg: Any = None, **kw: Any) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from tests.support.megatron_cpu import tiny_config

    cfg = tiny_config(
        num_layers=LAYERS,
        hidden_size=hidden,
        init_method_std=0.05,
        num_moe_experts=EXPERTS,
        moe_router_topk=2,
        moe_ffn_hidden_size=2 * hidden,
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        add_bias_linear=False,
        expert_model_parallel_size=ep,
        **kw,
    )
    return GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=EXPERTS),
        vocab_size=V,
        max_sequence_length=S,
        position_embedding_type="learned_absolute",
        pg_collection=pg,
    )


def _load_ep(model: Any, full: dict[str, torch.Tensor], ep_rank: int) -> dict[str, str]:
    """Copy full weights into an EP-sharded model (local expert ``j`` is global expert
    ``ep_rank * EXPERTS / EP + j``); returns ``parameter name -> full name``."""
    per = EXPERTS // EP
    names = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            fname = _EXPERT.sub(lambda m: f"{m[1]}{ep_rank * per + int(m[2])}{m[3]}", name)
            p.copy_(full[fname])
            names[name] = fname
    return names


def _micro_batches(step: int, mesh: Any, *, masked: bool) -> tuple[list[Any], dict, dict]:
    from tests.support.mcore_ref import masked_padded_micro_batches

    g = torch.Generator().manual_seed(step)
    ids = list(range(16 * step, 16 * step + 8))
    toks = {
        s: torch.randint(0, V, (int(torch.randint(4, S + 1, (), generator=g)),), generator=g)
        for s in ids
    }
    mask = {
        s: torch.arange(t.numel()) >= int(torch.randint(1, t.numel() - 1, (), generator=g))
        for s, t in toks.items()
    }
    groups = [
        ids[4 * i : 4 * i + 4] for i in range(2)
    ]  # 2 micro-batches of 4 samples, one per DP rank
    mbs = masked_padded_micro_batches(
        mesh, dist.get_rank(), groups, toks, mask, seq_len=S, masked=masked
    )
    return mbs, toks, mask


def test_moe_teacher_and_student_ep2_match_direct(world: Any) -> None:
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mopd.bridge import BridgeConfig, GroupPool, Mesh
    from mopd.mcore import Distiller, MeshModel, megatron_process_groups
    from tests.support.mcore_ref import Float64Check

    rank = dist.get_rank()
    pool = GroupPool(timeout_s=120)
    tmesh, smesh = Mesh(dp=4, name="teacher"), Mesh(dp=4, name="student")
    tpg = megatron_process_groups(tmesh, pool, ep=EP)
    spg = megatron_process_groups(smesh, pool, ep=EP)
    assert spg.ep.size() == EP and spg.expt_dp.size() == 4 // EP
    torch.manual_seed(11)
    full_t = _moe(48, ep=1).eval()
    torch.manual_seed(12)
    full_s = _moe(32, ep=1)
    teacher = _moe(48, ep=EP, pg=tpg).eval()
    _load_ep(teacher, dict(full_t.named_parameters()), tpg.ep.rank())
    check = Float64Check()  # loss within rtol 1e-5, each gradient within 1e-4
    for per_token in (True, False):
        student = _moe(32, ep=EP, pg=spg, calculate_per_token_loss=per_token)
        names = _load_ep(student, dict(full_s.named_parameters()), spg.ep.rank())
        student = DDP(student.config, DistributedDataParallelConfig(), student, pg_collection=spg)
        student.config.finalize_model_grads_func = finalize_model_grads
        distiller = Distiller(
            teachers=[MeshModel(mesh=tmesh, model=teacher, pg_collection=tpg)],
            student=MeshModel(mesh=smesh, model=student, pg_collection=spg),
            pool=pool,
            bridge_config=BridgeConfig(timeout_s=120),
        )
        s_mbs, toks, mask = _micro_batches(1 + per_token, smesh, masked=True)
        # the teacher's copy of the mask is ignored (once, with a warning): the student's counts
        t_mbs, _, _ = _micro_batches(1 + per_token, tmesh, masked=True)
        student.zero_grad_buffer()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = distiller.step(student=s_mbs, teachers=[t_mbs])
        ignored = [
            w for w in caught if "teacher's micro-batches carry a loss_mask" in str(w.message)
        ]
        assert len(ignored) == (1 if per_token else 0)  # once per process
        with step:
            get_forward_backward_func()(
                forward_step_func=step.forward_step,
                data_iterator=step.data_iterator(),
                model=[student],
                num_microbatches=len(s_mbs),
                seq_length=S,
                micro_batch_size=1,
                pg_collection=spg,
            )
        loss = step.mean_loss()
        ids = sorted(toks)
        ref = check.reference(
            full_s,
            [full_t],
            [(0, toks[s]) for s in ids],
            vocab_size=V,
            masks=[mask[s] for s in ids],
        )
        # no pipeline (dp=4): every rank holds the loss
        check.compare(
            ref,
            loss=loss,
            holds_loss=True,
            model=student,
            names=names,
            what=f"per_token={per_token}",
        )
    if rank == 0:
        print(f"moe: {check.summary()}")
    check.assert_ok()
