"""Tier 2 (torchrun, 4 ranks, gloo): the true vocabulary, with models built as megatron-LM builds
them.

megatron-LM builds ``GPTModel(vocab_size=padded_vocab_size)`` (a multiple of
``make_vocab_size_divisible_by * tp``), so teacher and student with different parallelism pad
differently and a model's ``vocab_size`` attribute is its padded size. The real vocabulary is
said once, ``Distiller(vocab_size=V)``; what a user relies on then, with real-model
configurations (RoPE, grouped-query attention, SwiGLU, RMSNorm, no biases, untied embeddings),
a teacher with TP2 + SP, DP2 and a student with TP2 + SP, DP2 (padded) or TP2, CP2 (THD), the
real vocabulary 1000 padded to 1024 / 1024 and to 1024 / 1008:

- the step's mean KL and every finalized ``main_grad`` equal the float64 reference over the
  1000 real columns (:func:`tests.support.mcore_ref.reference_step`; loss within rtol 1e-5,
  gradients within 1e-4 of their norm: fp32 models, TP reductions and chunking reorder sums);
- the student's padded output rows get exactly zero gradient, and the teacher's padded LM-head
  rows never reach the student (its resharded rows past V are zero where the teacher's are not);
- a token id in ``[V, padded)`` is the same ``ValueError`` on every rank, at planning.

Without ``vocab_size``: models padded differently are a ``ValueError`` naming both sizes at
set-up, the same on every rank; models padded alike warn once, at the first step, naming the
attribute read.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.support.megatron_cpu import megatron_world

TORCHRUN_NPROC = 4
TORCHRUN_TIMEOUT = 900

V = 1000  # the real vocabulary
T_PADDED = 1024
S, M, GLOBAL_MB = 16, 2, 4
HIDDEN_T, HIDDEN_S = 64, 32

world = pytest.fixture(scope="module")(megatron_world)


def _cfg(hidden: int, **kw: Any) -> Any:
    """A real-model configuration, as small as a CPU test allows."""
    import torch.nn.functional as F

    from tests.support.megatron_cpu import tiny_config

    return tiny_config(
        num_layers=2,
        hidden_size=hidden,
        num_attention_heads=4,
        num_query_groups=2,  # grouped-query attention
        ffn_hidden_size=2 * hidden,
        normalization="RMSNorm",
        gated_linear_unit=True,  # SwiGLU
        activation_func=F.silu,
        add_bias_linear=False,
        init_method_std=0.05,
        **kw,
    )


def _gpt(cfg: Any, padded: int, *, thd: bool = False, pg: Any = None) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from mopd.mcore.cpu import cpu_gpt_layer_spec

    return GPTModel(
        config=cfg,
        transformer_layer_spec=cpu_gpt_layer_spec() if thd else get_gpt_layer_local_spec(),
        vocab_size=padded,  # as megatron-LM builds it: the padded vocabulary
        max_sequence_length=S,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        pg_collection=pg,
    )


def _full(hidden: int, padded: int, seed: int) -> tuple[Any, dict[str, torch.Tensor]]:
    """A full (TP1) model with fixed weights, the same on every rank."""
    torch.manual_seed(seed)
    model = _gpt(_cfg(hidden), padded)
    return model, {n: p.detach().clone() for n, p in model.named_parameters()}


def _sharded(mesh: Any, pg: Any, full: dict, *, hidden: int, padded: int, sp: bool, thd: bool):
    from tests.support.mcore_ref import load_sharded

    c = mesh.coord(dist.get_rank())
    cfg = _cfg(
        hidden,
        tensor_model_parallel_size=mesh.tp,
        context_parallel_size=mesh.cp,
        sequence_parallel=sp,
        calculate_per_token_loss=True,
    )
    model = _gpt(cfg, padded, thd=thd, pg=pg)
    names = load_sharded(model, full, tp_rank=c.tp_rank, tp_size=mesh.tp, layer_offset=0, glu=True)
    return model, names, cfg


def _batch(seed: int) -> tuple[list[list[int]], dict[int, torch.Tensor]]:
    """``M`` global micro-batches of ``GLOBAL_MB`` samples, token ids in ``[0, V)``."""
    g = torch.Generator().manual_seed(seed)
    ids = [100 * seed + 3 * i for i in range(M * GLOBAL_MB)]
    lens = torch.randint(4, S + 1, (len(ids),), generator=g).tolist()
    toks = {i: torch.randint(0, V, (n,), generator=g) for i, n in zip(ids, lens, strict=True)}
    return [ids[i * GLOBAL_MB : (i + 1) * GLOBAL_MB] for i in range(M)], toks


def _micro_batches(mesh: Any, micro: list[list[int]], toks: dict, *, thd: bool) -> list[Any]:
    from mopd.mcore import packed_micro_batch, split_samples
    from tests.support.mcore_ref import masked_padded_micro_batches

    rank = dist.get_rank()
    if not thd:
        every = {s: torch.ones(t.numel(), dtype=torch.bool) for s, t in toks.items()}
        return masked_padded_micro_batches(mesh, rank, micro, toks, every, seq_len=S, masked=False)
    c = mesh.coord(rank)
    return [
        packed_micro_batch(
            (mine := split_samples(ids, mesh.dp, c.dp_rank)),
            [toks[s] for s in mine],
            cp_size=mesh.cp,
            cp_rank=c.cp_rank,
        )
        for ids in micro
    ]


class Job:
    """The teacher (TP2 + SP, DP2, padded to 1024) once, students built per case."""

    def __init__(self) -> None:
        from mopd.bridge import GroupPool, Mesh
        from mopd.mcore import megatron_process_groups

        self.rank = dist.get_rank()
        self.pool = GroupPool(timeout_s=120)
        self.tmesh = Mesh(tp=2, dp=2, name="teacher")
        self.tpg = megatron_process_groups(self.tmesh, self.pool)
        self.full_t_model, self.full_t = _full(HIDDEN_T, T_PADDED, seed=21)
        self.full_t_model.eval()
        teacher, _, _ = _sharded(
            self.tmesh, self.tpg, self.full_t, hidden=HIDDEN_T, padded=T_PADDED, sp=True, thd=False
        )
        self.teacher = teacher.eval()

    def student(self, mesh_kw: dict, *, padded: int, thd: bool) -> tuple[Any, ...]:
        from megatron.core.distributed import DistributedDataParallel as DDP
        from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads

        from mopd.bridge import Mesh
        from mopd.mcore import megatron_process_groups

        smesh = Mesh(**mesh_kw, name="student")
        spg = megatron_process_groups(smesh, self.pool)
        full_model, full = _full(HIDDEN_S, padded, seed=22)
        model, names, cfg = _sharded(
            smesh, spg, full, hidden=HIDDEN_S, padded=padded, sp=not thd, thd=thd
        )
        model = DDP(cfg, DistributedDataParallelConfig(), model, pg_collection=spg)
        cfg.finalize_model_grads_func = finalize_model_grads
        return smesh, spg, model, names, full_model

    def distiller(self, smesh: Any, spg: Any, model: Any, **kw: Any) -> Any:
        from mopd.bridge import BridgeConfig
        from mopd.mcore import Distiller, MeshModel

        return Distiller(
            teachers=[MeshModel(mesh=self.tmesh, model=self.teacher, pg_collection=self.tpg)],
            student=MeshModel(mesh=smesh, model=model, pg_collection=spg),
            pool=self.pool,
            bridge_config=BridgeConfig(timeout_s=120),
            **kw,
        )


def _run(distiller: Any, model: Any, spg: Any, s_mbs: list, t_mbs: list) -> Any:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model.zero_grad_buffer()
    with distiller.step(student=s_mbs, teachers=[t_mbs]) as step:
        get_forward_backward_func(pp_size=1, vp_size=None)(
            forward_step_func=step.forward_step,
            data_iterator=step.data_iterator(),
            model=[model],
            num_microbatches=M,
            seq_length=S,
            micro_batch_size=2,
            pg_collection=spg,
        )
    return step


STUDENTS = {
    # name: (student mesh, THD)
    "tp2dp2": ({"tp": 2, "dp": 2}, False),
    "tp2cp2_thd": ({"tp": 2, "cp": 2}, True),
}


@pytest.fixture(scope="module")
def job(world: Any) -> Job:
    return Job()


@pytest.mark.parametrize("student_padded", [1024, 1008])
@pytest.mark.parametrize("case", sorted(STUDENTS))
def test_loss_and_grads_over_the_real_columns(job: Job, case: str, student_padded: int) -> None:
    from tests.support.mcore_ref import Float64Check, unwrapped

    mesh_kw, thd = STUDENTS[case]
    smesh, spg, model, names, full_s_model = job.student(mesh_kw, padded=student_padded, thd=thd)
    distiller = job.distiller(smesh, spg, model, vocab_size=V)
    assert distiller.vocab_size == V
    micro, toks = _batch(seed=3)
    t_mbs = _micro_batches(job.tmesh, micro, toks, thd=False)
    s_mbs = _micro_batches(smesh, micro, toks, thd=thd)
    step = _run(distiller, model, spg, s_mbs, t_mbs)
    loss = step.mean_loss()
    ids = [s for ids in micro for s in ids]
    check = Float64Check()  # loss within rtol 1e-5, each gradient within 1e-4
    ref = check.reference(
        full_s_model, [job.full_t_model], [(0, toks[s]) for s in ids], vocab_size=V
    )
    sc = smesh.coord(job.rank)
    check.compare(  # no pipeline: every rank holds the loss
        ref,
        loss=loss,
        holds_loss=True,
        model=model,
        names=names,
        tp_rank=sc.tp_rank,
        tp_size=smesh.tp,
        glu=True,
    )
    print(f"{case} student padded {student_padded}: {check.summary()}")
    # the student's padded output rows (global ids >= V) get no gradient at all; its real rows do
    out = unwrapped(model).output_layer.weight
    rows = out.shape[0]
    vocab_ids = torch.arange(sc.tp_rank * rows, (sc.tp_rank + 1) * rows)
    grad = out.main_grad
    if bool((vocab_ids >= V).any()):
        padded_grad = float(grad[vocab_ids >= V].abs().max())
        if padded_grad != 0.0:
            check.problems.append(f"padded output rows got gradient (max |g| {padded_grad:.3e})")
    assert not check.problems, f"{case} student padded {student_padded}: " + "; ".join(
        check.problems[:10]
    )
    assert float(grad[vocab_ids < V].abs().max()) > 0
    # the teacher's padded LM-head rows never reach the student: its resharded rows past V are
    # zero, although the teacher's own padded rows are not; its real rows are the teacher's
    head = distiller.lm_heads[0]
    full_w = job.full_t["output_layer.weight"]
    assert float(full_w[V:].abs().min()) > 0  # the poison: nonzero padded rows at the source
    start = head.vocab_start
    assert start == sc.tp_rank * rows and head.vocab_size == V
    assert torch.equal(head.valid_V, vocab_ids < V)
    assert head.num_padding == int((vocab_ids >= V).sum())
    assert not bool(head.weight_VH[~head.valid_V].any()), "padded LM-head rows were sent"
    real = int(head.valid_V.sum())
    assert torch.equal(head.weight_VH[:real], full_w[start : start + real])


def test_a_token_past_the_real_vocabulary_is_refused_alike(job: Job) -> None:
    from tests.support.reliability import everyone, outcome

    smesh, spg, model, _, _ = job.student({"tp": 2, "dp": 2}, padded=1008, thd=False)
    distiller = job.distiller(smesh, spg, model, vocab_size=V)
    micro, toks = _batch(seed=4)
    t_mbs = _micro_batches(job.tmesh, micro, toks, thd=False)
    s_mbs = _micro_batches(smesh, micro, toks, thd=False)
    if job.rank == 1:
        s_mbs[0].tokens[0, 2] = V + 3  # < the padded 1008: embedded as a padded row, silently
    before = distiller.bridge.executor.slots_issued
    got = outcome(lambda: distiller.step(student=s_mbs, teachers=[t_mbs]))
    seen = everyone((got[0], got[1]))
    assert all(s == seen[0] for s in seen), seen
    assert seen[0][0] == "ValueError", seen[0]
    assert seen[0][1].startswith(
        "bridge input rejected on global rank(s) [1]: global rank 1: student micro-batch 0: "
        f"token ids span [0, {V + 3}], outside the real vocabulary [0, {V}) (Distiller's "
        "vocab_size)"
    ), seen[0][1]
    assert distiller.bridge.executor.slots_issued == before  # nothing moved
    # the bridge stays usable: the same step with the token fixed runs
    if job.rank == 1:
        s_mbs[0].tokens[0, 2] = 0
    step = _run(distiller, model, spg, s_mbs, t_mbs)
    assert step.mean_loss() is not None


def test_without_vocab_size_padding_differently_is_refused_alike(job: Job) -> None:
    from tests.support.reliability import everyone, outcome

    smesh, spg, model, _, _ = job.student({"tp": 2, "dp": 2}, padded=1008, thd=False)
    got = outcome(lambda: job.distiller(smesh, spg, model))
    seen = everyone((got[0], got[1]))
    assert all(s == seen[0] for s in seen), seen
    assert seen[0] == (
        "ValueError",
        "the models' vocab_size attributes differ (teacher 0 1024, the student 1008): they were "
        "built with vocabularies padded differently (megatron-LM pads to a multiple of "
        "make_vocab_size_divisible_by x tp), so the real vocabulary cannot be read off them; "
        "pass vocab_size=<the tokenizer's vocabulary, at most 1008>",
    ), seen[0]


def test_without_vocab_size_a_padded_looking_vocabulary_warns_once(job: Job) -> None:
    from mopd.common.log import reset_once

    smesh, spg, model, _, _ = job.student({"tp": 2, "dp": 2}, padded=1024, thd=False)
    distiller = job.distiller(smesh, spg, model)
    assert distiller.vocab_size == 1024  # read off the models, which agree
    reset_once()
    caught_per_step = []
    for seed in (5, 6):
        micro, toks = _batch(seed=seed)  # ids < 1000: never the last 24 columns
        t_mbs = _micro_batches(job.tmesh, micro, toks, thd=False)
        s_mbs = _micro_batches(smesh, micro, toks, thd=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _run(distiller, model, spg, s_mbs, t_mbs)
        caught_per_step.append([str(w.message) for w in caught if "vocab_size" in str(w.message)])
    first, second = caught_per_step
    assert len(first) == 1 and not second, caught_per_step
    assert "the models' vocab_size attribute (1024) is taken as the real vocabulary" in first[0]
    assert "Distiller(vocab_size=" in first[0]
