"""Tier 2 (torchrun, 4 ranks, gloo): MOPD with a student on virtual pipeline stages (PP2 x VPP2),
and the pipeline settings refused early.

What a user relies on: the student as a list of model chunks under megatron's interleaved
schedule, one data iterator per chunk (``[step.data_iterator() for _ in chunks]``), trains on the
response-only KL with the loss and every finalized ``main_grad`` of the plain computation
(:func:`tests.support.mcore_ref.reference_step`, float64): loss within rtol 1e-5, gradients
within 1e-4 of their norm; a micro-batch count megatron's interleaved schedule would refuse
once running (3 at PP=2) is the same ``ValueError`` on every rank from ``distiller.step``,
naming the rule. And ``mopd.mcore.cpu`` refuses, before any communication, the
setting that corrupts megatron's interleaved schedule on gloo at PP=2 (``batch_p2p_comm=True``);
and a pipelined student given packed micro-batches of different lengths without
``variable_seq_lengths`` fails at ``distiller.step`` on every rank with the fix named.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.support.megatron_cpu import megatron_world

TORCHRUN_NPROC = 4
TORCHRUN_TIMEOUT = 600

V, S, LAYERS, VPP = 64, 16, 4, 2


world = pytest.fixture(scope="module")(megatron_world)


def _gpt(hidden: int, *, pg: Any = None, vp_stage: int | None = None, **kw: Any) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from tests.support.megatron_cpu import tiny_config

    cfg = tiny_config(num_layers=LAYERS, hidden_size=hidden, init_method_std=0.05, **kw)
    return GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=V,
        max_sequence_length=S,
        position_embedding_type="learned_absolute",
        pg_collection=pg,
        vp_stage=vp_stage,
        pre_process=_pre(kw, vp_stage),
        post_process=_post(kw, vp_stage),
    )


def _pre(kw: dict, vp_stage: int | None) -> bool:
    pp = kw.get("pipeline_model_parallel_size", 1)
    return pp == 1 or (_PP_RANK[0] == 0 and vp_stage == 0)


def _post(kw: dict, vp_stage: int | None) -> bool:
    pp = kw.get("pipeline_model_parallel_size", 1)
    return pp == 1 or (_PP_RANK[0] == pp - 1 and vp_stage == VPP - 1)


_PP_RANK = [0]


def _chunks(mesh: Any, pg: Any, full: dict, *, batch_p2p: bool, per_token: bool) -> Any:
    """The student's VPP chunks with the full weights; ``(chunks, names, config)``."""
    from tests.support.mcore_ref import load_sharded

    _PP_RANK[0] = mesh.coord(dist.get_rank()).pp_rank
    chunks, names = [], {}
    for v in range(VPP):
        model = _gpt(
            32,
            pg=pg,
            vp_stage=v,
            pipeline_model_parallel_size=mesh.pp,
            virtual_pipeline_model_parallel_size=VPP,
            pipeline_dtype=torch.float32,
            overlap_p2p_comm=not batch_p2p,
            batch_p2p_comm=batch_p2p,
            calculate_per_token_loss=per_token,
        )
        offset = model.decoder.layers[0].layer_number - 1
        got = load_sharded(model, full, tp_rank=0, tp_size=1, layer_offset=offset)
        names[v] = got
        chunks.append(model)
    return chunks, names, chunks[0].config


def _micro_batches(seed: int, mesh: Any, *, masked: bool) -> tuple[list[Any], dict, dict]:
    from tests.support.mcore_ref import masked_padded_micro_batches

    g = torch.Generator().manual_seed(seed)
    ids = list(range(100 * seed, 100 * seed + 8))
    toks, mask = {}, {}
    for s in ids:
        L = int(torch.randint(4, S + 1, (), generator=g))
        toks[s] = torch.randint(0, V, (L,), generator=g)
        mask[s] = torch.arange(L) >= int(torch.randint(1, L - 1, (), generator=g))
    groups = [
        ids[2 * i : 2 * i + 2] for i in range(4)
    ]  # 4 micro-batches of 2 samples (VPP at PP=2 wants a multiple of 2)
    mbs = masked_padded_micro_batches(
        mesh, dist.get_rank(), groups, toks, mask, seq_len=S, masked=masked
    )
    return mbs, toks, mask


def test_vpp_student_matches_direct_and_gloo_trap_is_refused(world: Any) -> None:
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from mopd.bridge import BridgeConfig, GroupPool, Mesh
    from mopd.mcore import Distiller, MeshModel, megatron_process_groups
    from tests.support.mcore_ref import Float64Check

    rank = dist.get_rank()
    pool = GroupPool(timeout_s=120)
    tmesh, smesh = Mesh(dp=4, name="teacher"), Mesh(dp=2, pp=2, name="student")
    tpg = megatron_process_groups(tmesh, pool)
    spg = megatron_process_groups(smesh, pool)
    _PP_RANK[0] = 0
    torch.manual_seed(11)
    full_t = _gpt(48, vp_stage=None).eval()
    torch.manual_seed(12)
    full_s = _gpt(32, vp_stage=None)
    full_s_weights = {n: p.detach().clone() for n, p in full_s.named_parameters()}
    teacher = _gpt(48, pg=tpg, vp_stage=None).eval()
    teacher.load_state_dict(full_t.state_dict())
    fb = get_forward_backward_func(pp_size=2, vp_size=VPP)

    # megatron's default batch_p2p_comm=True: refused on every rank, before any communication
    chunks, _, cfg = _chunks(smesh, spg, full_s_weights, batch_p2p=True, per_token=True)
    with pytest.raises(ValueError, match="overlap_p2p_comm=True and batch_p2p_comm=False"):
        fb(
            forward_step_func=lambda it, m: None,
            data_iterator=[iter([]) for _ in chunks],
            model=chunks,
            num_microbatches=4,
            seq_length=S,
            micro_batch_size=1,
            p2p_communicator=P2PCommunicator(pp_group=spg.pp, config=cfg),
            pg_collection=spg,
        )

    check = Float64Check()  # loss within rtol 1e-5, each gradient within 1e-4
    for per_token in (True, False):
        chunks, names, cfg = _chunks(
            smesh, spg, full_s_weights, batch_p2p=False, per_token=per_token
        )
        ddp = [DDP(cfg, DistributedDataParallelConfig(), c, pg_collection=spg) for c in chunks]
        cfg.finalize_model_grads_func = finalize_model_grads
        distiller = Distiller(
            teachers=[MeshModel(mesh=tmesh, model=teacher, pg_collection=tpg)],
            student=MeshModel(mesh=smesh, model=ddp, pg_collection=spg),
            pool=pool,
            bridge_config=BridgeConfig(timeout_s=120),
        )
        s_mbs, toks, mask = _micro_batches(1 + per_token, smesh, masked=True)
        t_mbs, _, _ = _micro_batches(1 + per_token, tmesh, masked=False)
        for m in ddp:
            m.zero_grad_buffer()
        with distiller.step(student=s_mbs, teachers=[t_mbs]) as step:
            fb(
                forward_step_func=step.forward_step,
                data_iterator=[step.data_iterator() for _ in ddp],
                model=ddp,
                num_microbatches=len(s_mbs),
                seq_length=S,
                micro_batch_size=1,
                p2p_communicator=P2PCommunicator(pp_group=spg.pp, config=cfg),
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
        what = f"per_token={per_token}"
        if smesh.is_last_stage(rank):
            check.loss(ref, loss, what=what)
        for v, c in enumerate(chunks):
            check.grads(ref, c, names[v], what=f"{what} chunk {v}")
    # 3 micro-batches at PP=2, which megatron's interleaved schedule refuses once running (it
    # wants a multiple of its group size, the pipeline size): the same ValueError on every rank
    # from distiller.step, naming the rule, before the teachers' pass and the schedule
    from mopd.mcore import Rollouts

    ones = torch.ones(4, dtype=torch.int64)
    held = Rollouts(prompts=[ones[:2]] * 6, responses=[ones] * 6) if rank == 0 else None
    with pytest.raises(
        ValueError,
        match=r"student: 3 micro-batches for 2 virtual-pipeline chunks at pipeline size 2.*"
        r"use a multiple of 2 micro-batches \(e\.g\. 2, 4, 6\)",
    ):
        distiller.step(held, num_micro_batches=3)
    if smesh.is_last_stage(rank):
        print(f"vpp: {check.summary()}")
    check.assert_ok()


def test_packed_student_at_pp2_without_variable_lengths_fails_early_everywhere(world: Any) -> None:
    """THD micro-batches of different lengths for a PP=2 student whose config has
    ``variable_seq_lengths=False``: every rank gets the same named ``ValueError`` from
    ``distiller.step`` (the bridge's agreed verdict), before the teacher or the schedule run."""
    from megatron.core.models.gpt import GPTModel

    from mopd.bridge import BridgeConfig, GroupPool, Mesh
    from mopd.mcore import (
        Distiller,
        MeshModel,
        megatron_process_groups,
        packed_micro_batch,
        split_samples,
    )
    from mopd.mcore.cpu import cpu_gpt_layer_spec
    from tests.support.megatron_cpu import tiny_config

    rank = dist.get_rank()
    pool = GroupPool(timeout_s=120)
    tmesh, smesh = Mesh(dp=4, name="teacher"), Mesh(dp=2, pp=2, name="student")
    tpg = megatron_process_groups(tmesh, pool)
    spg = megatron_process_groups(smesh, pool)
    teacher = _gpt(48, pg=tpg).eval()
    c = smesh.coord(rank)
    student = GPTModel(
        config=tiny_config(pipeline_model_parallel_size=2),
        transformer_layer_spec=cpu_gpt_layer_spec(),
        vocab_size=V,
        max_sequence_length=S,
        position_embedding_type="learned_absolute",
        pre_process=c.pp_rank == 0,
        post_process=c.pp_rank == 1,
        pg_collection=spg,
    )
    distiller = Distiller(
        teachers=[MeshModel(mesh=tmesh, model=teacher, pg_collection=tpg)],
        student=MeshModel(mesh=smesh, model=student, pg_collection=spg),
        pool=pool,
        bridge_config=BridgeConfig(timeout_s=60),
    )
    lens = [[5, 9], [12, 3]]  # per micro-batch, per student DP rank
    ids = [[10, 11], [12, 13]]
    s_mbs = [
        packed_micro_batch([ids[i][c.dp_rank]], [torch.ones(lens[i][c.dp_rank], dtype=torch.int64)])
        for i in range(2)
    ]
    tc = tmesh.coord(rank)
    t_mbs = [
        packed_micro_batch(
            (mine := split_samples(ids[i], 4, tc.dp_rank)),
            [torch.ones(lens[i][ids[i].index(s)], dtype=torch.int64) for s in mine],
        )
        if split_samples(ids[i], 4, tc.dp_rank)
        else packed_micro_batch([], [])
        for i in range(2)
    ]
    with pytest.raises(ValueError, match=r"student: packed \(THD\) micro-batches of different"):
        distiller.step(student=s_mbs, teachers=[t_mbs])
