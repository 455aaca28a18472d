"""Tier 2 (torchrun, 8 ranks, gloo): MOPD inside megatron-core's own schedule.

A student with PP=2 trains through ``get_forward_backward_func()`` (1F1B) against a teacher with
PP=2 run in its own forward-only pass, with :class:`mopd.mcore.Distiller` (the set-up) and its
step (plan, teacher pass, the loss inside the schedule). Two meshes:

- ``sp``: student TP2 + SP, DP2, PP2 on padded micro-batches; teacher TP2 + SP, DP2, PP2;
- ``thd``: student TP2, CP2, PP2 on packed (THD) micro-batches with CP zigzag; teacher TP2 + SP,
  DP2, PP2 on padded micro-batches (the sides batch differently).

For 4 and 12 micro-batches and both of megatron's loss paths (``calculate_per_token_loss`` on
and off), the step's mean KL and every parameter's finalized ``main_grad`` must equal the plain
computation (:mod:`tests.support.mcore_ref`: the student's full weights at PP=1, TP=1 on the
whole global batch against the teacher's own full logits, KL in float64): loss within rtol
1e-5, each parameter's gradient within 1e-4 relative to its norm (fp32 models; TP reductions
and chunking reorder sums).

Also: the bridge used as documented inside ``forward_step_func`` (a PP=1 teacher colocated with
the student's first stage sending each micro-batch inline, the last stage receiving in
``loss_func``) runs to the end and delivers exact rows; steps with the same shapes reuse their
schedules, and 12 micro-batches in flight warn about nothing.
"""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.support.megatron_cpu import megatron_world

TORCHRUN_NPROC = 8
TORCHRUN_TIMEOUT = 900
TORCHRUN_STRICT_P2P = 1  # NCCL's point-to-point rules (tests/support/strict_p2p.py)
_MOPD_PACKAGES = ("capture", "bridge", "kernels", "mcore", "common", "profiling")


def _from_mopd(filename: str) -> bool:
    """Whether a warning's file is a module of the mopd package (by module, not by path text:
    a site-packages path may contain "mopd" anywhere, e.g. in a virtual environment's name)."""
    path = Path(filename).resolve()
    for name in _MOPD_PACKAGES:
        folder = Path(importlib.import_module(f"mopd.{name}").__file__).resolve().parent
        if path.is_relative_to(folder):
            return True
    return False


V, S, LAYERS = 64, 16, 2
GLOBAL_MB = 4  # samples per global micro-batch


world = pytest.fixture(scope="module")(megatron_world)


def _cfg(**kw: Any) -> Any:
    from tests.support.megatron_cpu import tiny_config

    return tiny_config(
        num_layers=LAYERS, variable_seq_lengths=True, moe_token_dispatcher_type="alltoall", **kw
    )


def _full_models(hidden_t: int) -> tuple[Any, Any, dict, dict]:
    """Full (TP1, PP1) teacher and student with fixed weights, the same on every rank."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    def build(hidden: int, seed: int) -> Any:
        torch.manual_seed(seed)
        return GPTModel(
            config=_cfg(hidden_size=hidden, init_method_std=0.05),
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=V,
            max_sequence_length=S,
            position_embedding_type="learned_absolute",
        )

    teacher, student = build(hidden_t, 11), build(32, 12)
    return (
        teacher.eval(),
        student,
        {n: p.detach().clone() for n, p in teacher.named_parameters()},
        {n: p.detach().clone() for n, p in student.named_parameters()},
    )


def _sharded(
    mesh: Any, pg: Any, full: dict, *, hidden: int, sp: bool, thd: bool, per_token: bool = True
) -> tuple[Any, dict, Any]:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from mopd.mcore.cpu import cpu_gpt_layer_spec
    from tests.support.mcore_ref import load_sharded

    c = mesh.coord(dist.get_rank())
    cfg = _cfg(
        hidden_size=hidden,
        tensor_model_parallel_size=mesh.tp,
        pipeline_model_parallel_size=mesh.pp,
        context_parallel_size=mesh.cp,
        sequence_parallel=sp,
        calculate_per_token_loss=per_token,
    )
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=cpu_gpt_layer_spec() if thd else get_gpt_layer_local_spec(),
        vocab_size=V,
        max_sequence_length=S,
        position_embedding_type="learned_absolute",
        pre_process=c.pp_rank == 0,
        post_process=c.pp_rank == mesh.pp - 1,
        pg_collection=pg,
    )
    names = load_sharded(
        model, full, tp_rank=c.tp_rank, tp_size=mesh.tp, layer_offset=c.pp_rank * LAYERS // mesh.pp
    )
    return model, names, cfg


def _global_batch(
    m: int, seed: int, *, id_base: int | None = None
) -> tuple[list[int], dict[int, torch.Tensor]]:
    """``m`` global micro-batches: sparse global ids, random lengths and tokens from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    base = 1000 * seed if id_base is None else id_base
    ids = [base + 3 * i for i in range(m * GLOBAL_MB)]
    lens = torch.randint(3, S + 1, (len(ids),), generator=g).tolist()
    return ids, {i: torch.randint(0, V, (n,), generator=g) for i, n in zip(ids, lens, strict=True)}


def _padded_mbs(ids: list[int], toks: dict, m: int, mesh: Any, pg: Any) -> list[Any]:
    """This rank's padded micro-batches: its DP share of each global micro-batch, its CP zigzag."""
    from mopd.mcore import padded_micro_batch, split_samples

    c = mesh.coord(dist.get_rank())
    out = []
    for i in range(m):
        mine = split_samples(ids[i * GLOBAL_MB : (i + 1) * GLOBAL_MB], mesh.dp, c.dp_rank)
        tokens = torch.zeros(len(mine), S, dtype=torch.int64)
        for b, s in enumerate(mine):
            tokens[b, : toks[s].numel()] = toks[s]
        out.append(
            padded_micro_batch(
                mine,
                tokens,
                lengths=[toks[s].numel() for s in mine],
                cp_size=mesh.cp,
                cp_rank=c.cp_rank,
            )
        )
    return out


def _packed_mbs(ids: list[int], toks: dict, m: int, mesh: Any, *, sp: int) -> list[Any]:
    from mopd.mcore import packed_micro_batch, split_samples

    c = mesh.coord(dist.get_rank())
    out = []
    for i in range(m):
        mine = split_samples(ids[i * GLOBAL_MB : (i + 1) * GLOBAL_MB], mesh.dp, c.dp_rank)
        out.append(
            packed_micro_batch(
                mine, [toks[s] for s in mine], cp_size=mesh.cp, cp_rank=c.cp_rank, sp_size=sp
            )
        )
    return out


CASES = {
    # name: (student mesh kwargs, student SP, THD student)
    "sp": ({"tp": 2, "dp": 2, "pp": 2}, True, False),
    "thd": ({"tp": 2, "cp": 2, "pp": 2}, False, True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_schedule_loss_and_grads_match_direct(world: Any, case: str) -> None:
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from mopd.bridge import BridgeConfig, GroupPool, Mesh
    from mopd.mcore import Distiller, MeshModel, megatron_process_groups
    from tests.support.mcore_ref import Float64Check

    smesh_kw, s_sp, thd = CASES[case]
    rank = dist.get_rank()
    pool = GroupPool(timeout_s=120)
    tmesh = Mesh(tp=2, dp=2, pp=2, name="teacher")
    smesh = Mesh(**smesh_kw, name="student")
    tpg = megatron_process_groups(tmesh, pool)
    spg = megatron_process_groups(smesh, pool)
    full_t_model, full_s_model, full_t, full_s = _full_models(48)
    teacher, _, _ = _sharded(tmesh, tpg, full_t, hidden=48, sp=True, thd=False)
    teacher.eval()
    tc, sc = tmesh.coord(rank), smesh.coord(rank)
    check = Float64Check()  # loss within rtol 1e-5, each gradient within 1e-4
    for per_token in (True, False):
        student, names, scfg = _sharded(
            smesh, spg, full_s, hidden=32, sp=s_sp, thd=thd, per_token=per_token
        )
        student = DDP(scfg, DistributedDataParallelConfig(), student, pg_collection=spg)
        scfg.finalize_model_grads_func = finalize_model_grads
        distiller = Distiller(
            teachers=[MeshModel(mesh=tmesh, model=teacher, pg_collection=tpg)],
            student=MeshModel(mesh=smesh, model=student, pg_collection=spg),
            pool=pool,
            bridge_config=BridgeConfig(timeout_s=120),
        )
        fb = get_forward_backward_func(pp_size=2, vp_size=None)
        for m in (4, 12):
            ids, toks = _global_batch(m, seed=m + (10 if per_token else 0))
            t_mbs = _padded_mbs(ids, toks, m, tmesh, tpg)
            s_mbs = (
                _packed_mbs(ids, toks, m, smesh, sp=smesh.tp if s_sp else 1)
                if thd
                else _padded_mbs(ids, toks, m, smesh, spg)
            )
            student.zero_grad_buffer()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with distiller.step(student=s_mbs, teachers=[t_mbs]) as step:
                    fb(
                        forward_step_func=step.forward_step,
                        data_iterator=step.data_iterator(),
                        model=[student],
                        num_microbatches=m,
                        seq_length=S,
                        micro_batch_size=2,
                        p2p_communicator=P2PCommunicator(pp_group=spg.pp, config=scfg),
                        pg_collection=spg,
                    )
            assert step.bridge_step.finished
            ours = [
                str(w.message)
                for w in caught
                if _from_mopd(w.filename) or "bridge" in str(w.message)
            ]
            assert not ours, ours  # e.g. no "in flight" warning at 12 micro-batches
            loss = step.mean_loss()
            ref = check.reference(
                full_s_model, [full_t_model], [(0, toks[i]) for i in ids], vocab_size=V
            )
            check.compare(
                ref,
                loss=loss,
                holds_loss=smesh.is_last_stage(rank),
                model=student,
                names=names,
                tp_rank=sc.tp_rank,
                tp_size=smesh.tp,
                what=f"{case} per_token={per_token} M={m}",
            )
    del tc
    print(f"{case}: {check.summary()}")
    check.assert_ok()


def test_inline_send_in_forward_step(world: Any) -> None:
    """The raw bridge API inside megatron's schedule, placed as a user would: plan the step
    before the schedule; in ``forward_step_func`` the colocated PP=1 teacher runs the
    micro-batch and ``send``s it; in ``loss_func`` the last stage ``receive``s. Runs to the end;
    the rows are the teacher's own hidden states, bit for bit."""
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from mopd.bridge import (
        BridgeConfig,
        GroupPool,
        HiddenStateBridge,
        Mesh,
        TeacherSpec,
        create_bridge_groups,
    )
    from mopd.capture import OutputLayerInputCapture
    from mopd.mcore import megatron_process_groups, micro_batch_layout

    rank = dist.get_rank()
    pool = GroupPool(timeout_s=120)
    smesh = Mesh(tp=2, dp=2, pp=2, name="student")
    tmesh = Mesh(tp=2, dp=2, name="teacher")  # PP=1 on ranks 0-3: the student's first stage
    spg = megatron_process_groups(smesh, pool)
    tpg = megatron_process_groups(tmesh, pool)
    full_t_model, _, full_t, full_s = _full_models(48)
    del full_t_model
    tc = tmesh.coord(rank)
    teacher = None
    if tc is not None:
        teacher, _, _ = _sharded(tmesh, tpg, full_t, hidden=48, sp=True, thd=False)
        teacher.eval()
    student, _, scfg = _sharded(smesh, spg, full_s, hidden=32, sp=True, thd=False)
    student = DDP(scfg, DistributedDataParallelConfig(), student, pg_collection=spg)
    scfg.finalize_model_grads_func = finalize_model_grads
    groups = create_bridge_groups(pool, [tmesh], smesh)
    bridge = HiddenStateBridge(
        teachers=[TeacherSpec(mesh=tmesh, hidden_size=48, dtype=torch.float32)],
        student=smesh,
        groups=groups,
        config=BridgeConfig(timeout_s=120),
    )
    capture = OutputLayerInputCapture(teacher) if teacher is not None else None
    m = 6
    fb = get_forward_backward_func(pp_size=2, vp_size=None)

    def run_step(step_no: int) -> None:
        ids, toks = _global_batch(m, seed=50, id_base=10_000 * (step_no + 1))
        t_mbs = _padded_mbs(ids, toks, m, tmesh, tpg) if tc is not None else None
        s_mbs = _padded_mbs(ids, toks, m, smesh, spg)
        step = bridge.plan_step(
            teacher_layouts={
                0: [micro_batch_layout(x, rows="hidden", pg_collection=tpg) for x in t_mbs]
            }
            if t_mbs is not None
            else None,
            student_layouts=[micro_batch_layout(x, rows="logits", pg_collection=spg) for x in s_mbs]
            if smesh.is_last_stage(rank)
            else None,
        )
        sent: dict[int, torch.Tensor] = {}
        got: dict[int, dict[int, torch.Tensor]] = {}
        it = iter(range(m))

        def forward_step(data_iterator: Any, model: Any) -> Any:
            i = next(data_iterator)
            if teacher is not None:  # inline: the teacher's micro-batch i, sent right away
                with torch.no_grad(), capture.capture_context():
                    teacher(t_mbs[i].tokens, t_mbs[i].position_ids, None)
                h = capture.get_hidden_states()
                sent[i] = h.clone()
                step.send(i, {0: h})
            mb = s_mbs[i]
            out = model(mb.tokens, mb.position_ids, None)

            def loss_func(output: torch.Tensor) -> Any:
                got[i] = step.receive(i)
                return output.float().sum() * 0.0, {}

            return out, loss_func

        student.zero_grad_buffer()
        fb(
            forward_step_func=forward_step,
            data_iterator=it,
            model=[student],
            num_microbatches=m,
            seq_length=S,
            micro_batch_size=2,
            p2p_communicator=P2PCommunicator(pp_group=spg.pp, config=scfg),
            pg_collection=spg,
        )
        step.finish()
        # exactness: all-gather what the teachers sent (with keys) and check the students' rows
        from mopd.bridge.layout import encode_keys

        problems = []
        world = dist.get_world_size()
        for i in range(m):
            rows = torch.zeros(S * 2, 48)
            keys = torch.full((S * 2,), -1, dtype=torch.int64)
            if tc is not None and tc.tp_rank == 0:
                lay = micro_batch_layout(t_mbs[i], rows="hidden", pg_collection=tpg)
                rows[: lay.num_rows] = sent[i].reshape(-1, 48)
                keys[: lay.num_rows] = encode_keys(lay.sample_id_R, lay.position_R, S)
            all_rows = [torch.empty_like(rows) for _ in range(world)]
            all_keys = [torch.empty_like(keys) for _ in range(world)]
            dist.all_gather(all_rows, rows)
            dist.all_gather(all_keys, keys)
            ref = {
                int(k): r
                for kk, rr in zip(all_keys, all_rows, strict=True)
                for k, r in zip(kk, rr, strict=True)
                if k >= 0
            }
            if smesh.is_last_stage(rank):
                lay = micro_batch_layout(s_mbs[i], rows="logits", pg_collection=spg)
                k = encode_keys(lay.sample_id_R, lay.position_R, S)
                real = k[k >= 0]  # compact: one row per real token, in layout order
                if got[i][0].shape[0] != real.numel():
                    problems.append(f"step {step_no} micro-batch {i}: {got[i][0].shape[0]} rows")
                    continue
                for r, key in enumerate(real.tolist()):
                    if not torch.equal(got[i][0][r], ref[key]):
                        problems.append(f"step {step_no} micro-batch {i} row {r}")
        assert not problems, problems[:5]

    run_step(0)
    built = bridge.executor.schedules_built
    run_step(1)  # the same shapes: every schedule is reused
    assert bridge.executor.schedules_built == built, (
        f"same shapes built {bridge.executor.schedules_built - built} more schedules"
    )
