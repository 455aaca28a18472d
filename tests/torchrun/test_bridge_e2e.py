"""Tier 2 (4 ranks, gloo): real megatron-core teacher and student GPTModels, capture -> bridge.

Each case builds a teacher and a student GPTModel on their own process groups (explicit
``ProcessGroupCollection``s over :class:`~mopd.bridge.Mesh` grids), runs the teacher forward
under :class:`mopd.capture.OutputLayerInputCapture` (SP undone, CP not), bridges the captured
hidden states into the student's layout with ``exchange`` (the capture buffer overwritten right
after the call, the bridge's outputs poisoned), reshards the teacher's LM head into the
student's vocab partition (``reshard_lm_head`` with the sizes given and ``lm_head_from_models``
reading them off the models must give the same rows), and checks on every student rank that
``bridged_h @ W_shard^T`` (vocab shards gathered over the student TP group) equals the teacher's
own logits for the same ``(sample, position)``, looked up by key in an all-gather of every
teacher row; padding rows come out zero. The student forward runs on the same layout while the
rows are in flight, and the layout's row order is checked against the order the student's
attention uses (megatron's zigzag CP / THD packing). Also: the mesh read back from megatron's
``parallel_state`` and from each model's ``ProcessGroupCollection``.

Cases: teacher TP2+SP x DP2 -> student CP2 x DP2 packed (colocated); teacher CP2 x DP2 padded
(zigzag captured as is) -> student TP2 x DP2 ``[S, B]`` (colocated, SP slices all-gathered);
teacher TP2 -> student CP2 packed on other ranks (disjoint).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from mopd.bridge import (
    BridgeConfig,
    GroupPool,
    HiddenStateBridge,
    Mesh,
    TeacherSpec,
    create_bridge_groups,
    packed_layout,
    padded_layout,
)
from mopd.bridge.layout import encode_keys
from mopd.bridge.lm_head import VocabSpec, reshard_lm_head
from mopd.capture import OutputLayerInputCapture, ReusableBuffer
from mopd.mcore import (
    lm_head_from_models,
    megatron_process_groups,
    mesh_from_parallel_state,
    mesh_from_pg_collection,
)
from mopd.mcore.cpu import cpu_gpt_layer_spec, packed_rows, zigzag_positions
from tests.support import megatron_cpu as mc
from tests.support.bridges import poison_outputs
from tests.support.dist import COLLECTIVE_TIMEOUT

TORCHRUN_NPROC = 4
TORCHRUN_TIMEOUT = 300
TORCHRUN_STRICT_P2P = 1  # NCCL's point-to-point rules (tests/support/strict_p2p.py)

V, S, N = 64, 8, 8  # vocab, padded sequence length, samples per step
H_T, H_S = 32, 16
LENGTHS = [5, 8, 3, 7, 4, 8, 2, 6]

CASES = {
    "tp2sp-dp2 -> cp2-dp2 thd (colocated)": (Mesh(tp=2, dp=2), "sbh", Mesh(cp=2, dp=2), "thd"),
    "cp2-dp2 padded -> tp2-dp2 sbh (colocated)": (Mesh(cp=2, dp=2), "sbh", Mesh(tp=2, dp=2), "sbh"),
    "tp2 -> cp2 thd (disjoint)": (Mesh(tp=2), "sbh", Mesh(cp=2, rank_offset=2), "thd"),
}
POOL: list[GroupPool] = []


def pool() -> GroupPool:
    if not POOL:
        POOL.append(GroupPool(timeout_s=COLLECTIVE_TIMEOUT.total_seconds()))
    return POOL[0]


def tokens_NS() -> torch.Tensor:
    return torch.randint(0, V, (N, S), generator=torch.Generator().manual_seed(5))


def build(mesh: Mesh, pg: Any, hidden: int, *, sp: bool, cpu_attn: bool, seed: int) -> Any:
    torch.manual_seed(seed)
    cfg = mc.tiny_config(
        hidden_size=hidden,
        tensor_model_parallel_size=mesh.tp,
        context_parallel_size=mesh.cp,
        sequence_parallel=sp,
    )
    return mc.build_gpt(
        cfg,
        vocab_size=V,
        max_seq_len=S,
        layer_spec=cpu_gpt_layer_spec() if cpu_attn else None,
        pg_collection=pg,
    ).eval()


def thd_inputs(mesh: Mesh, samples: list[int], cp_rank: int):
    """Student THD layout and its model inputs; asserts the attention's row order matches."""
    from megatron.core.packed_seq_params import PackedSeqParams

    lens = torch.tensor([LENGTHS[i] for i in samples])
    mult = 2 * mesh.cp if mesh.cp > 1 else 1
    cu = torch.zeros(len(samples) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum((lens + mult - 1) // mult * mult, 0)
    layout = packed_layout(samples, lens, cu_seqlens_padded=cu, cp_size=mesh.cp, cp_rank=cp_rank)
    seq_T, pos_T = packed_rows(cu, mesh.cp, cp_rank)
    real = pos_T < lens[seq_T]
    assert torch.equal(torch.where(real, torch.tensor(samples)[seq_T], -1), layout.sample_id_R)
    assert torch.equal(torch.where(real, pos_T, -1), layout.position_R)
    cu_real = torch.zeros_like(cu)
    cu_real[1:] = torch.cumsum(lens, 0)
    psp = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_real.to(torch.int32),
        cu_seqlens_kv=cu_real.to(torch.int32),
        cu_seqlens_q_padded=cu.to(torch.int32),
        cu_seqlens_kv_padded=cu.to(torch.int32),
        max_seqlen_q=int((cu[1:] - cu[:-1]).max()),
        max_seqlen_kv=int((cu[1:] - cu[:-1]).max()),
    )
    tok = tokens_NS()[torch.tensor(samples)[seq_T], pos_T.clamp(max=S - 1)][None]
    return layout, (tok, pos_T.clamp(max=S - 1)[None], None), {"packed_seq_params": psp}


def padded_inputs(mesh: Mesh, samples: list[int], cp_rank: int):
    """``[S_local, B]`` zigzag layout and inputs; asserts the attention's positions match."""
    layout = padded_layout(
        samples, S, lengths=[LENGTHS[i] for i in samples], cp_size=mesh.cp, cp_rank=cp_rank
    )
    pos = zigzag_positions(S, mesh.cp, cp_rank) if mesh.cp > 1 else torch.arange(S)
    b = len(samples)
    real = layout.position_R >= 0
    assert torch.equal(layout.position_R[real], pos[:, None].expand(-1, b).reshape(-1)[real])
    tok = tokens_NS()[torch.tensor(samples)][:, pos]
    return layout, (tok, pos.expand(b, -1), None), {}


def shard(mesh: Mesh, d: int, salt: int) -> list[int]:
    """Samples of DP rank ``d``: each side orders and splits the samples its own way."""
    order = torch.randperm(N, generator=torch.Generator().manual_seed(salt)).tolist()
    return order[d :: mesh.dp]


@pytest.mark.parametrize("case", list(CASES))
def test_megatron_teacher_to_student_logits_match(case):
    t_mesh, _, s_mesh, s_kind = CASES[case]
    rank = dist.get_rank()
    mc.init_parallel(tp=1)  # only the global buffers and the RNG tracker read parallel_state
    t_pg = megatron_process_groups(t_mesh, pool())
    s_pg = megatron_process_groups(s_mesh, pool())
    # the meshes, read back from the live groups the models are built on
    for mesh, pg in ((t_mesh, t_pg), (s_mesh, s_pg)):
        if pg is not None:
            live = mesh_from_pg_collection(pg)
            assert live.as_ints() == mesh.as_ints()
    groups = create_bridge_groups(pool(), [t_mesh], s_mesh)

    # --- teacher: forward under the capture; its own logits are the reference ----------------
    hidden, layouts = {}, {}
    ref_keys = torch.empty(0, dtype=torch.int64)
    ref_logits = torch.empty((0, V))
    teacher, weight = None, None
    if t_pg is not None:
        tc = t_mesh.coord(rank)
        teacher = build(t_mesh, t_pg, H_T, sp=t_mesh.tp > 1, cpu_attn=t_mesh.cp > 1, seed=11)
        samples = shard(t_mesh, tc.dp_rank, salt=1)
        layout, args, kw = padded_inputs(t_mesh, samples, tc.cp_rank)
        cap = OutputLayerInputCapture(teacher, buffer=ReusableBuffer())  # the bridge path's
        with torch.no_grad(), cap.capture_context():
            logits_BSv = teacher(*args, **kw)
        h_SBH = cap.get_hidden_states()
        assert h_SBH.shape == (S // t_mesh.cp, len(samples), H_T)
        hidden[0], layouts[0] = h_SBH.contiguous(), layout
        weight = teacher.output_layer.weight.detach().contiguous()
        full_BSV = mc.gather_vocab_shards(logits_BSv, t_pg.tp)  # collective over teacher TP
        if tc.tp_rank == 0:
            ref_keys = encode_keys(layout.sample_id_R, layout.position_R, S)
            ref_logits = full_BSV.transpose(0, 1).reshape(-1, V)
    student = None
    if s_pg is not None:
        student = build(s_mesh, s_pg, H_S, sp=False, cpu_attn=True, seed=12)

    # --- LM head: given the sizes, and read off the models; the same rows -------------------
    head = reshard_lm_head(
        weight,
        teacher=t_mesh,
        student=s_mesh,
        vocab=VocabSpec(vocab_size=V, teacher_padded=V, student_padded=V),
        hidden_size=H_T,
        groups=groups,
        timeout_s=60,
    )
    from_models = lm_head_from_models(
        teacher, student, teacher=t_mesh, student=s_mesh, groups=groups, timeout_s=60
    )
    assert (head is None) == (from_models is None) == (s_pg is None)
    if head is not None:
        assert torch.equal(head.weight_VH, from_models.weight_VH)
        assert head.vocab_start == from_models.vocab_start and head.vocab_size == V

    # --- bridge: the captured rows into the student's layout ----------------------------------
    s_layout, s_args, s_kw = None, None, None
    if s_pg is not None:
        sc = s_mesh.coord(rank)
        samples = shard(s_mesh, sc.dp_rank, salt=2)
        make = thd_inputs if s_kind == "thd" else padded_inputs
        s_layout, s_args, s_kw = make(s_mesh, samples, sc.cp_rank)
    bridge = HiddenStateBridge(
        teachers=[TeacherSpec(mesh=t_mesh, hidden_size=H_T)],
        student=s_mesh,
        groups=groups,
        config=BridgeConfig(timeout_s=60),
    )
    poison_outputs(bridge)
    handle = bridge.exchange(hidden=hidden, layouts=layouts, student_layout=s_layout)
    for t in hidden.values():
        t.fill_(float("nan"))  # the rows were taken at the call: the capture buffer is free
    if student is not None:  # the student forward overlaps the transfer
        with torch.no_grad():
            s_logits = student(*s_args, **s_kw)
        assert s_logits.shape[-1] == V // s_mesh.tp
    got = handle.wait()

    # --- the all-gather reference, by key -----------------------------------------------------
    world = dist.get_world_size()
    n = torch.tensor([ref_keys.numel()])
    ns = torch.empty(world, dtype=torch.int64)
    dist.all_gather_into_tensor(ns, n)
    width = int(ns.max())
    kp = torch.full((width,), -1, dtype=torch.int64)
    kp[: ref_keys.numel()] = ref_keys
    lp = torch.zeros((width, V))
    lp[: ref_logits.shape[0]] = ref_logits
    all_k = torch.empty(world * width, dtype=torch.int64)
    all_l = torch.empty((world * width, V))
    dist.all_gather_into_tensor(all_k, kp)
    dist.all_gather_into_tensor(all_l, lp)
    if s_pg is None:
        assert head is None and not got
        return
    assert head is not None and head.num_padding == 0
    h_RH = got[0]  # compact: one row per real token of the student's layout, in order
    keys = encode_keys(s_layout.sample_id_R, s_layout.position_R, S)
    real = keys >= 0
    assert int(real.sum()) == s_layout.num_tokens > 0
    assert h_RH.shape[0] == s_layout.num_tokens  # no rows for padding
    assert torch.equal(handle.owner_N >= 0, real)
    mine_RV = mc.gather_vocab_shards(h_RH @ head.weight_VH.t(), s_pg.tp)
    order = torch.argsort(all_k)
    pos = torch.searchsorted(all_k[order], keys[real])
    assert torch.equal(all_k[order][pos], keys[real])
    torch.testing.assert_close(mine_RV, all_l[order][pos], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("tp", "cp", "pp"), [(2, 1, 1), (1, 2, 1), (2, 1, 2), (1, 1, 2)])
def test_mesh_from_megatron_parallel_state(tp, cp, pp):
    mc.init_parallel(tp=tp, cp=cp, pp=pp)
    mesh = mesh_from_parallel_state(name="live")
    world = dist.get_world_size()
    assert mesh.as_ints() == (tp, cp, world // (tp * cp * pp), pp, 0)
    c = mesh.coord(dist.get_rank())
    from megatron.core import parallel_state as ps

    assert c.tp_rank == ps.get_tensor_model_parallel_rank()
    assert c.pp_rank == ps.get_pipeline_model_parallel_rank()
    assert c.cp_rank == ps.get_context_parallel_rank()
    mc.init_parallel(tp=1)
