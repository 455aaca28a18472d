"""Tier 2 (torchrun, 4 ranks, gloo): megatron-core's HybridModel as teacher and as student.

megatron-core 0.19 deprecates GPTModel for ``megatron.core.models.hybrid.HybridModel`` (a
``hybrid_layer_pattern`` of ``*`` attention, ``-`` MLP, ``M`` Mamba, ... layers). Here the
patterns are attention + MLP (``*-*-``, ``*-|*-`` over two pipeline stages), built on CPU ranks
with :func:`mopd.mcore.cpu.cpu_hybrid_stack_spec`; Mamba layers need CUDA kernels
(``tests/gpu/test_hybrid_mamba_gpu.py``). Each MOPD step runs under megatron's own schedule with
:class:`mopd.mcore.Distiller` and is checked three ways:

- the rows the bridge delivered equal the teacher's own capture bit for bit, one row per
  counted token (:func:`tests.support.mcore_ref.bridged_row_problems`);
- the step's mean KL within rtol 1e-5 and every finalized ``main_grad`` within 1e-4 of its norm
  of the plain computation in float64 (:func:`tests.support.mcore_ref.reference_step`: the
  student's full weights at PP=1, TP=1 on the whole batch against the teacher's full logits);
- ``hybrid``: a HybridModel teacher (TP2 + SP, PP2, its rows sent from its SP shards) and a
  HybridModel student (TP2, CP2, THD-packed, CP zigzag; response-only KL), the per-token loss
  path; ``gpt_teacher``: a GPTModel teacher (TP2 + SP, DP2) and a HybridModel student (TP2 +
  SP, PP2 under 1F1B), megatron's default loss path.

Also: the capture on a HybridModel under TP2 + SP equals its logits; ``lm_head_from_models``
reads a HybridModel's head (tied embeddings included) as ``reshard_lm_head`` with the sizes
given; a pattern with a layer kind the CPU spec has no version of (Mamba) is refused by name
rather than built as megatron's default identity layer.
Skipped, with the reason, where megatron-core has no ``megatron.core.models.hybrid`` (before
0.18; ``make test-newest`` runs this module on 0.19.x).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.support.megatron_cpu import hybrid_missing, megatron_world

TORCHRUN_NPROC = 4
TORCHRUN_TIMEOUT = 900

_MISSING = hybrid_missing()
if _MISSING is not None:
    pytest.skip(_MISSING, allow_module_level=True)

V, S = 64, 16
PATTERN = "*-*-"  # two attention and two MLP layers: a GPT block's worth, twice
GLOBAL_MB = 4  # samples per global micro-batch
M = 4  # micro-batches per step
H_T, H_S = 48, 32

world = pytest.fixture(scope="module")(megatron_world)


def _cfg(**kw: Any) -> Any:
    from tests.support.megatron_cpu import tiny_config

    return tiny_config(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall", **kw)


def _staged(pattern: str, pp: int) -> str:
    """``pattern`` cut into ``pp`` pipeline segments with ``|`` (equal layer counts)."""
    n = len(pattern) // pp
    return "|".join(pattern[i * n : (i + 1) * n] for i in range(pp))


def _build(kind: str, cfg: Any, *, pp: int, stage: int, pg: Any = None) -> Any:
    from tests.support.megatron_cpu import build_gpt, build_hybrid

    pre, post = stage == 0, stage == pp - 1
    if kind == "hybrid":
        return build_hybrid(
            cfg,
            pattern=_staged(PATTERN, pp),
            vocab_size=V,
            max_seq_len=S,
            pre_process=pre,
            post_process=post,
            pg_collection=pg,
        )
    from mopd.mcore.cpu import cpu_gpt_layer_spec

    return build_gpt(
        cfg,
        vocab_size=V,
        max_seq_len=S,
        pre_process=pre,
        post_process=post,
        layer_spec=cpu_gpt_layer_spec(),
        pg_collection=pg,
    )


def _layers(kind: str) -> int:
    return len(PATTERN) if kind == "hybrid" else len(PATTERN) // 2


def _full(kind: str, hidden: int, seed: int) -> tuple[Any, dict[str, torch.Tensor]]:
    """A full (TP1, PP1) model with fixed weights, the same on every rank."""
    torch.manual_seed(seed)
    model = _build(
        kind,
        _cfg(num_layers=_layers(kind), hidden_size=hidden, init_method_std=0.05),
        pp=1,
        stage=0,
    )
    return model, {n: p.detach().clone() for n, p in model.named_parameters()}


def _sharded(
    kind: str, mesh: Any, pg: Any, full: dict, *, hidden: int, sp: bool, per_token: bool = True
) -> tuple[Any, dict[str, str], Any]:
    from tests.support.mcore_ref import load_sharded

    c = mesh.coord(dist.get_rank())
    layers = _layers(kind)
    cfg = _cfg(
        num_layers=layers,
        hidden_size=hidden,
        tensor_model_parallel_size=mesh.tp,
        pipeline_model_parallel_size=mesh.pp,
        context_parallel_size=mesh.cp,
        sequence_parallel=sp,
        calculate_per_token_loss=per_token,
    )
    model = _build(kind, cfg, pp=mesh.pp, stage=c.pp_rank, pg=pg)
    names = load_sharded(
        model, full, tp_rank=c.tp_rank, tp_size=mesh.tp, layer_offset=c.pp_rank * layers // mesh.pp
    )
    return model, names, cfg


def _batch(seed: int) -> tuple[list[list[int]], dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """``M`` global micro-batches: sample ids, tokens of random lengths, response masks (a
    prompt of random length is not counted)."""
    g = torch.Generator().manual_seed(seed)
    micro = [[1000 * seed + 3 * (GLOBAL_MB * i + j) for j in range(GLOBAL_MB)] for i in range(M)]
    toks, mask = {}, {}
    for s in (s for ids in micro for s in ids):
        L = int(torch.randint(4, S + 1, (), generator=g))
        toks[s] = torch.randint(0, V, (L,), generator=g)
        mask[s] = torch.arange(L) >= int(torch.randint(1, L - 1, (), generator=g))
    return micro, toks, mask


def _packed(micro: list[list[int]], toks: dict, mask: dict, mesh: Any) -> list[Any]:
    from mopd.mcore import packed_micro_batch, split_samples

    c = mesh.coord(dist.get_rank())
    out = []
    for ids in micro:
        mine = split_samples(ids, mesh.dp, c.dp_rank)
        out.append(
            packed_micro_batch(
                mine,
                [toks[s] for s in mine],
                loss_masks=[mask[s] for s in mine],
                cp_size=mesh.cp,
                cp_rank=c.cp_rank,
            )
        )
    return out


CASES = {
    # name: (teacher kind, teacher mesh, student mesh, student SP, THD student, per-token loss)
    "hybrid": ("hybrid", {"tp": 2, "pp": 2}, {"tp": 2, "cp": 2}, False, True, True),
    "gpt_teacher": ("gpt", {"tp": 2, "dp": 2}, {"tp": 2, "pp": 2}, True, False, False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_step_rows_loss_and_grads_match_direct(world: Any, case: str) -> None:
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from mopd.bridge import BridgeConfig, GroupPool, Mesh
    from mopd.mcore import Distiller, MeshModel, megatron_process_groups
    from tests.support.mcore_ref import (
        Float64Check,
        bridged_row_problems,
        masked_padded_micro_batches,
    )

    t_kind, t_kw, s_kw, s_sp, thd, per_token = CASES[case]
    rank = dist.get_rank()
    pool = GroupPool(timeout_s=120)
    tmesh, smesh = Mesh(**t_kw, name="teacher"), Mesh(**s_kw, name="student")
    tpg = megatron_process_groups(tmesh, pool)
    spg = megatron_process_groups(smesh, pool)
    full_teacher, full_t = _full(t_kind, H_T, seed=11)
    full_student, full_s = _full("hybrid", H_S, seed=12)
    teacher, _, _ = _sharded(t_kind, tmesh, tpg, full_t, hidden=H_T, sp=True)
    teacher.eval()
    student, names, scfg = _sharded(
        "hybrid", smesh, spg, full_s, hidden=H_S, sp=s_sp, per_token=per_token
    )
    assert isinstance(student, HybridModel) and isinstance(full_student, HybridModel)
    assert isinstance(teacher, HybridModel) == (t_kind == "hybrid")
    student = DDP(scfg, DistributedDataParallelConfig(), student, pg_collection=spg)
    scfg.finalize_model_grads_func = finalize_model_grads
    distiller = Distiller(
        teachers=[MeshModel(mesh=tmesh, model=teacher, pg_collection=tpg)],
        student=MeshModel(mesh=smesh, model=student, pg_collection=spg),
        pool=pool,
        bridge_config=BridgeConfig(timeout_s=120),
    )
    micro, toks, mask = _batch(seed=3)
    t_mbs = masked_padded_micro_batches(tmesh, rank, micro, toks, mask, seq_len=S, masked=False)
    if thd:
        s_mbs = _packed(micro, toks, mask, smesh)
    else:
        s_mbs = masked_padded_micro_batches(smesh, rank, micro, toks, mask, seq_len=S, masked=True)
    fb = get_forward_backward_func(pp_size=smesh.pp, vp_size=None)
    kwargs: dict[str, Any] = {"pg_collection": spg}
    if smesh.pp > 1:
        kwargs["p2p_communicator"] = P2PCommunicator(pp_group=spg.pp, config=scfg)
    student.zero_grad_buffer()
    with distiller.step(student=s_mbs, teachers=[t_mbs]) as step:
        fb(
            forward_step_func=step.forward_step,
            data_iterator=step.data_iterator(),
            model=[student],
            num_microbatches=M,
            seq_length=S,
            micro_batch_size=GLOBAL_MB // smesh.dp,
            **kwargs,
        )
        problems, checked = bridged_row_problems(
            step,
            teacher=(tmesh, teacher, tpg, t_mbs),
            hidden_size=H_T,
            student=(smesh, spg, s_mbs),
            stride=S,
        )
    assert step.bridge_step.finished
    ids = [s for ids in micro for s in ids]
    check = Float64Check()  # loss within rtol 1e-5, each gradient within 1e-4
    check.problems += problems  # the bridged rows'
    ref = check.reference(
        full_student,
        [full_teacher],
        [(0, toks[s]) for s in ids],
        vocab_size=V,
        masks=[mask[s] for s in ids],
    )
    if smesh.is_last_stage(rank):
        assert checked > 0, "no bridged row was checked on a student last-stage rank"
    sc = smesh.coord(rank)
    check.compare(
        ref,
        loss=step.mean_loss(),
        holds_loss=smesh.is_last_stage(rank),
        model=student,
        names=names,
        tp_rank=sc.tp_rank,
        tp_size=smesh.tp,
    )
    print(f"{case}: {checked} bridged rows bit-exact; {check.summary()}")
    check.assert_ok()


def test_capture_on_a_hybrid_model_under_tp2_sp_equals_its_logits(world: Any) -> None:
    """What the hook sees is the rank's SP shard ``[S/2, B, H]``; the capture gathers it, and
    ``captured @ W^T`` is the model's logits (vocab shards gathered)."""
    from mopd.bridge import GroupPool, Mesh
    from mopd.capture import get_opd_full_capture_context
    from mopd.mcore import megatron_process_groups
    from tests.support.megatron_cpu import build_hybrid, gather_vocab_shards

    mesh = Mesh(tp=2, dp=2)
    pg = megatron_process_groups(mesh, GroupPool(timeout_s=120))
    cfg = _cfg(num_layers=4, tensor_model_parallel_size=2, sequence_parallel=True)
    model = build_hybrid(cfg, pattern=PATTERN, vocab_size=V, max_seq_len=S, pg_collection=pg)
    seen: list[torch.Size] = []
    model.output_layer.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape) and None)
    g = torch.Generator().manual_seed(dist.get_rank() // 2)
    tokens = torch.randint(0, V, (2, S), generator=g)
    ctx, cap = get_opd_full_capture_context(model, enabled=True)
    assert cap is not None and cap.sequence_parallel
    with torch.no_grad(), ctx:
        logits_BSv = model(tokens, torch.arange(S).expand(2, S), None)
    assert seen == [torch.Size([S // 2, 2, 32])]
    h_SBH = cap.get_hidden_states()
    assert h_SBH.shape == (S, 2, 32)
    w_VH = gather_vocab_shards(model.output_layer.weight.detach().t().contiguous(), pg.tp).t()
    full_BSV = gather_vocab_shards(logits_BSv, pg.tp)
    torch.testing.assert_close(full_BSV, (h_SBH @ w_VH.t()).transpose(0, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [False, True], ids=["own-head", "tied-embeddings"])
def test_lm_head_from_hybrid_models(world: Any, tied: bool) -> None:
    """A HybridModel teacher (TP2 on ranks 0-1) into a HybridModel student's vocab partition
    (TP4): the rows read off the models equal ``reshard_lm_head`` with the sizes given, and
    each is the teacher's full head's row (the word embeddings when tied)."""
    from mopd.bridge import GroupPool, Mesh, VocabSpec, create_bridge_groups, reshard_lm_head
    from mopd.mcore import lm_head_from_models, megatron_process_groups
    from tests.support.megatron_cpu import build_hybrid, gather_vocab_shards

    rank = dist.get_rank()
    pool = GroupPool(timeout_s=120)
    tmesh, smesh = Mesh(tp=2, name="teacher"), Mesh(tp=4, name="student")
    tpg = megatron_process_groups(tmesh, pool)
    spg = megatron_process_groups(smesh, pool)
    groups = create_bridge_groups(pool, [tmesh], smesh)
    teacher = weight = full_VH = None
    if tpg is not None:
        cfg = _cfg(num_layers=4, hidden_size=H_T, tensor_model_parallel_size=2)
        teacher = build_hybrid(
            cfg,
            pattern=PATTERN,
            vocab_size=V,
            max_seq_len=S,
            share_embeddings=tied,
            pg_collection=tpg,
        )
        head_VH = teacher.output_layer.weight
        assert (head_VH is None) == tied
        if tied:  # megatron's tied head: the word embeddings
            head_VH = teacher.embedding.word_embeddings.weight
        weight = head_VH.detach().contiguous()
        full_VH = gather_vocab_shards(weight.t().contiguous(), tpg.tp).t().contiguous()
    cfg = _cfg(num_layers=4, hidden_size=H_S, tensor_model_parallel_size=4)
    student = build_hybrid(cfg, pattern=PATTERN, vocab_size=V, max_seq_len=S, pg_collection=spg)
    head = reshard_lm_head(
        weight,
        teacher=tmesh,
        student=smesh,
        vocab=VocabSpec(vocab_size=V, teacher_padded=V, student_padded=V),
        hidden_size=H_T,
        groups=groups,
        timeout_s=60,
    )
    from_models = lm_head_from_models(
        teacher, student, teacher=tmesh, student=smesh, groups=groups, timeout_s=60
    )
    assert head is not None and from_models is not None
    assert torch.equal(head.weight_VH, from_models.weight_VH)
    assert (from_models.vocab_start, from_models.vocab_size) == (rank * V // 4, V)
    # the teacher's full head, from its ranks to all: each student rank's slice of it
    full = torch.zeros(V, H_T) if full_VH is None else full_VH
    dist.broadcast(full, src=0)
    assert torch.equal(from_models.weight_VH, full[rank * V // 4 : (rank + 1) * V // 4])


def test_cpu_spec_refuses_layers_it_has_no_cpu_version_of(world: Any) -> None:
    from tests.support.megatron_cpu import build_hybrid

    with pytest.raises(ValueError, match=r"no CPU version of Mamba \('M'\) layers"):
        build_hybrid(_cfg(num_layers=3), pattern="*M-", vocab_size=V, max_seq_len=S)
