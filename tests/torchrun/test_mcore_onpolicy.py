"""Tier 2 (torchrun, 8 ranks, gloo): on-policy distillation as jobs train it, under megatron's
own schedule (1F1B, student PP=2).

What a user relies on, each checked against the plain computation in float64
(:func:`tests.support.mcore_ref.reference_step`: the student's full weights at PP=1, TP=1 on the
whole global batch against each teacher's own full logits): the step's logged mean loss within
rtol 1e-5 and every finalized ``main_grad`` within 1e-4 of its norm (fp32 models; TP reductions
and chunking reorder sums), on both of megatron's loss paths.

- ``mask_sp`` / ``mask_thd``: response-only KL (a prompt of varying length per sample is not
  counted) with a padded student (TP2 + SP, DP2, PP2) and a packed one (TP2, CP2, PP2 THD).
- ``routed``: two teachers of different hidden sizes, each sample routed to one, per-teacher
  weights; some teacher DP ranks and one student DP rank hold no sample in some micro-batches
  (``routed_thd``: the student packed, TP2 + SP, DP2, PP2).
- ``rl``: the job's own loss: a policy-gradient term whose per-token reward is the teachers'
  reverse KL (no gradient through the KL), built on ``step.teacher_signal`` and
  ``mopd.mcore.token_logprobs`` (student TP2 + SP, DP2, PP2).
- ``sft``: the weighted reverse KL, an SFT cross-entropy and the forward KL on the same tokens
  (two routed teachers, student DP4, PP2).

Also: masked tokens never cross the bridge (the bytes the step moves equal the counted tokens
times the row size).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.support.megatron_cpu import megatron_world

TORCHRUN_NPROC = 8
TORCHRUN_TIMEOUT = 900

V, S, LAYERS = 64, 16, 2
BETA, LAMBDA, GAMMA = 0.7, 0.3, 0.2
HIDDEN_T = (48, 40)


world = pytest.fixture(scope="module")(megatron_world)


#: every model of this module: the vocabulary, the positions, the layers; a pipelined model's
#: micro-batches may differ in shape
_SIZES: dict[str, Any] = dict(
    vocab=V, seq=S, layers=LAYERS, variable_seq_lengths=True, moe_token_dispatcher_type="alltoall"
)


def _full(hidden: int, seed: int) -> tuple[Any, dict]:
    from tests.support.mcore_models import full_gpt

    return full_gpt(hidden=hidden, seed=seed, **_SIZES)


def _sharded(mesh: Any, pg: Any, full: dict, *, hidden: int, sp: bool, thd: bool, **kw: Any):
    from tests.support.mcore_models import sharded_gpt

    return sharded_gpt(mesh, pg, full, hidden=hidden, sp=sp, thd=thd, **_SIZES, **kw)


class Batch:
    """A step's global batch: per micro-batch its sample ids; per sample its tokens, the
    response mask (a prompt of random length is not counted), its teacher, labels and
    advantages (for the job's own loss terms)."""

    def __init__(self, sizes: list[int], seed: int, n_teachers: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.micro: list[list[int]] = []
        self.tokens: dict[int, torch.Tensor] = {}
        self.mask: dict[int, torch.Tensor] = {}
        self.teacher: dict[int, int] = {}
        self.labels: dict[int, torch.Tensor] = {}
        self.adv: dict[int, torch.Tensor] = {}
        next_id = 100 * seed
        for n in sizes:
            ids = [next_id + 3 * j for j in range(n)]
            next_id += 3 * n + 1
            self.micro.append(ids)
            for s in ids:
                L = int(torch.randint(4, S + 1, (), generator=g))
                prompt = int(torch.randint(1, L - 1, (), generator=g))
                self.tokens[s] = torch.randint(0, V, (L,), generator=g)
                self.mask[s] = torch.arange(L) >= prompt
                self.teacher[s] = int(torch.randint(0, n_teachers, (), generator=g))
                self.labels[s] = torch.cat([self.tokens[s][1:], torch.zeros(1, dtype=torch.int64)])
                self.adv[s] = torch.randn(L, generator=g, dtype=torch.float64)

    def ids(self) -> list[int]:
        return [s for ids in self.micro for s in ids]

    def routed(self, i: int, teacher: int) -> list[int]:
        return [s for s in self.micro[i] if self.teacher[s] == teacher]


def _padded(batch: Batch, ids: list[int], mesh: Any, *, masked: bool, extra: bool) -> Any:
    from mopd.mcore import padded_micro_batch, split_samples

    c = mesh.coord(dist.get_rank())
    mine = split_samples(ids, mesh.dp, c.dp_rank)
    tokens = torch.zeros(len(mine), S, dtype=torch.int64)
    mask = torch.zeros(len(mine), S, dtype=torch.bool)
    labels = torch.zeros(max(len(mine), 1), S, dtype=torch.int64)
    adv = torch.zeros(max(len(mine), 1), S, dtype=torch.float64)
    for b, s in enumerate(mine):
        L = batch.tokens[s].numel()
        tokens[b, :L] = batch.tokens[s]
        mask[b, :L] = batch.mask[s]
        labels[b, :L] = batch.labels[s]
        adv[b, :L] = batch.adv[s]
    mb = padded_micro_batch(
        mine,
        tokens,
        lengths=[batch.tokens[s].numel() for s in mine],
        row_mask_BS=mask if masked and mine else None,
        cp_size=mesh.cp,
        cp_rank=c.cp_rank,
    )
    if extra:  # the job's per-token inputs, in the order of the logits (CP 1 here)
        mb = dataclasses.replace(mb, extra={"labels": labels, "adv": adv})
    return mb


def _packed(batch: Batch, ids: list[int], mesh: Any, *, sp: int) -> Any:
    from mopd.mcore import packed_micro_batch, split_samples

    c = mesh.coord(dist.get_rank())
    mine = split_samples(ids, mesh.dp, c.dp_rank)
    return packed_micro_batch(
        mine,
        [batch.tokens[s] for s in mine],
        row_masks=[batch.mask[s] for s in mine],
        cp_size=mesh.cp,
        cp_rank=c.cp_rank,
        sp_size=sp,
    )


def _token_logprob(output: torch.Tensor, labels_BS: torch.Tensor, tp_group: Any) -> torch.Tensor:
    """``[T]`` log p_S(label) from the student's ``[B, S, V / tp]`` logits."""
    from mopd.mcore import token_logprobs

    return token_logprobs(output, labels_BS, tp_group=tp_group).reshape(-1)


def _rl_forward_step(step: Any, tp_group: Any) -> Any:
    """A user's ``forward_step_func``: policy gradient with the teachers' reverse KL as a dense
    per-token reward: ``-(A_t - beta * KL_t) * log p(y_t)``, the KL without gradient."""

    def forward_step(data_iterator: Any, model: Any) -> Any:
        mb = next(data_iterator)
        out = model(mb.tokens, mb.position_ids, None)

        def loss_func(output: torch.Tensor) -> Any:
            signal = step.teacher_signal(output, mb)
            reward_T = -signal.kl_T["reverse"].detach().double()
            adv_T = mb.extra["adv"].reshape(-1) + BETA * reward_T
            per_T = -adv_T * _token_logprob(output, mb.extra["labels"], tp_group)
            return step.loss_output((per_T * signal.mask_T).sum().float(), signal)

        return out, loss_func

    return forward_step


def _sft_forward_step(step: Any, tp_group: Any) -> Any:
    """A user's ``forward_step_func``: the weighted reverse KL, an SFT cross-entropy and the
    (unweighted) forward KL."""

    def forward_step(data_iterator: Any, model: Any) -> Any:
        mb = next(data_iterator)
        out = model(mb.tokens, mb.position_ids, None)

        def loss_func(output: torch.Tensor) -> Any:
            signal = step.teacher_signal(output, mb, kinds=("reverse", "forward"))
            ce_T = -_token_logprob(output, mb.extra["labels"], tp_group)
            loss = (
                signal.weighted_kl_sum("reverse")
                + LAMBDA * (ce_T * signal.mask_T).sum().float()
                + GAMMA * signal.kl_T["forward"].sum()
            )
            return step.loss_output(loss, signal)

        return out, loss_func

    return forward_step


CASES: dict[str, dict[str, Any]] = {
    "mask_sp": {"student": {"tp": 2, "dp": 2, "pp": 2}, "sp": True, "thd": False},
    "mask_thd": {"student": {"tp": 2, "cp": 2, "pp": 2}, "sp": False, "thd": True},
    "routed": {
        "student": {"tp": 2, "dp": 2, "pp": 2},
        "sp": True,
        "thd": False,
        "teachers": 2,
        "weights": (1.0, 0.4),
        "sizes": [4, 1, 3, 2],  # micro-batch 1: one sample, student DP rank 1 holds nothing
    },
    "routed_thd": {  # the same with a packed student: packed_micro_batch([], []) placeholders
        "student": {"tp": 2, "dp": 2, "pp": 2},
        "sp": True,
        "thd": True,
        "teachers": 2,
        "weights": (0.3, 1.0),
        "sizes": [1, 4, 2, 1],
    },
    "rl": {"student": {"tp": 2, "dp": 2, "pp": 2}, "sp": True, "thd": False, "loss": "rl"},
    "sft": {
        "student": {"dp": 4, "pp": 2},
        "sp": False,
        "thd": False,
        "loss": "sft",
        "teachers": 2,
        "weights": (0.5, 2.0),
    },
}


def _extra_reference(kind: str, batch: Batch) -> Any:
    ids = batch.ids()

    def extra(j: int, s_logits: torch.Tensor, t_logits: torch.Tensor, kl: torch.Tensor) -> Any:
        s = ids[j]
        ls = torch.log_softmax(s_logits, dim=-1)
        logp = ls.gather(-1, batch.labels[s][:, None])[:, 0]
        if kind == "rl":  # the stock KL term is weighted 0 below: only the PG term counts
            return -(batch.adv[s] - BETA * kl.detach()) * logp
        lt = torch.log_softmax(t_logits, dim=-1)
        forward_kl = (lt.exp() * (lt - ls)).sum(-1)
        return -LAMBDA * logp + GAMMA * forward_kl

    return extra


@pytest.mark.parametrize("case", sorted(CASES))
def test_onpolicy_loss_and_grads_match_direct(world: Any, case: str) -> None:
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from mopd.bridge import BridgeConfig, GroupPool, Mesh
    from mopd.mcore import Distiller, MeshModel, megatron_process_groups
    from tests.support.mcore_ref import Float64Check

    spec = CASES[case]
    n_teachers = spec.get("teachers", 1)
    loss_kind = spec.get("loss", "kl")
    rank = dist.get_rank()
    pool = GroupPool(timeout_s=120)
    tmeshes = [Mesh(tp=2, dp=2, pp=2, name="teacher0")]
    if n_teachers == 2:  # ranks 4-7: teacher 0's second stage and all of teacher 1
        tmeshes.append(Mesh(dp=4, rank_offset=4, name="teacher1"))
    smesh = Mesh(**spec["student"], name="student")
    tpgs = [megatron_process_groups(m, pool) for m in tmeshes]
    spg = megatron_process_groups(smesh, pool)
    fulls = [_full(HIDDEN_T[k], 11 + k) for k in range(n_teachers)]
    full_s_model, full_s = _full(32, 12)
    teachers = []
    for k, (m, pg) in enumerate(zip(tmeshes, tpgs, strict=True)):
        model = None
        if m.coord(rank) is not None:
            model, _, _ = _sharded(m, pg, fulls[k][1], hidden=HIDDEN_T[k], sp=m.tp > 1, thd=False)
            model.eval()
        teachers.append(MeshModel(mesh=m, model=model, pg_collection=pg))
    sc = smesh.coord(rank)
    check = Float64Check()  # loss within rtol 1e-5, each gradient within 1e-4
    moved_ok = True
    for per_token in (True, False):
        student, names, scfg = _sharded(
            smesh,
            spg,
            full_s,
            hidden=32,
            sp=spec["sp"],
            thd=spec["thd"],
            calculate_per_token_loss=per_token,
        )
        student = DDP(scfg, DistributedDataParallelConfig(), student, pg_collection=spg)
        scfg.finalize_model_grads_func = finalize_model_grads
        weights = spec.get("weights")
        if loss_kind == "rl":
            weights = None
        distiller = Distiller(
            teachers=teachers,
            student=MeshModel(mesh=smesh, model=student, pg_collection=spg),
            pool=pool,
            bridge_config=BridgeConfig(timeout_s=120),
            teacher_weights=weights,
        )
        batch = Batch(spec.get("sizes", [4, 4, 4, 4]), seed=3 + per_token, n_teachers=n_teachers)
        m = len(batch.micro)
        t_mbs = [
            [_padded(batch, batch.routed(i, k), tm, masked=False, extra=False) for i in range(m)]
            if tm.coord(rank) is not None
            else None
            for k, tm in enumerate(tmeshes)
        ]
        if spec["thd"]:
            s_mbs = [
                _packed(batch, batch.micro[i], smesh, sp=smesh.tp if spec["sp"] else 1)
                for i in range(m)
            ]
        else:
            s_mbs = [
                _padded(batch, batch.micro[i], smesh, masked=True, extra=loss_kind != "kl")
                for i in range(m)
            ]
        student.zero_grad_buffer()
        fb = get_forward_backward_func(pp_size=2, vp_size=None)
        with distiller.step(student=s_mbs, teachers=t_mbs) as step:
            forward_step = {
                "kl": step.forward_step,
                "rl": _rl_forward_step(step, spg.tp),
                "sft": _sft_forward_step(step, spg.tp),
            }[loss_kind]
            fb(
                forward_step_func=forward_step,
                data_iterator=step.data_iterator(),
                model=[student],
                num_microbatches=m,
                seq_length=S,
                micro_batch_size=2,
                p2p_communicator=P2PCommunicator(pp_group=spg.pp, config=scfg),
                pg_collection=spg,
            )
        loss = step.mean_loss()
        what = f"{case} per_token={per_token}"
        # masked tokens never cross: each counted token moves once (fp32 rows), no other
        counted = sum(int(batch.mask[s].sum()) for s in batch.ids())
        assert step.global_tokens == counted, (step.global_tokens, counted)
        moved = torch.tensor([sum(b for *_, b in step.bridge_step.traffic())], dtype=torch.int64)
        dist.all_reduce(moved)
        owner = [batch.teacher[s] if n_teachers > 1 else 0 for s in batch.ids()]
        want = sum(
            int(batch.mask[s].sum()) * 4 * HIDDEN_T[k]
            for s, k in zip(batch.ids(), owner, strict=True)
        )
        moved_ok &= int(moved) == want
        if rank == 0:
            print(f"{what}: bridge moved {int(moved)} bytes, counted tokens {counted}")
        ref = check.reference(
            full_s_model,
            [f[0] for f in fulls],
            [(k, batch.tokens[s]) for s, k in zip(batch.ids(), owner, strict=True)],
            vocab_size=V,
            masks=[batch.mask[s] for s in batch.ids()],
            teacher_weights=(0.0,) * n_teachers if loss_kind == "rl" else weights,
            extra=None if loss_kind == "kl" else _extra_reference(loss_kind, batch),
        )
        check.compare(
            ref,
            loss=loss,
            holds_loss=smesh.is_last_stage(rank),
            model=student,
            names=names,
            tp_rank=sc.tp_rank,
            tp_size=smesh.tp,
            what=what,
        )
    print(f"{case}: {check.summary()}")
    assert moved_ok, "the bridge moved rows the loss mask excludes"
    check.assert_ok()
