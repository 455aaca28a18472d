"""Tier 2 (4 ranks, gloo): a TP2 + SP teacher sends from its SP shards, bit-exact, no gather.

Under sequence parallelism each teacher TP rank holds ``[S/tp, B, H]`` of the rows its output
layer gets. Sending from there (each TP rank its own source, ``TeacherSpec(sp_shards=True)``)
must deliver to the student exactly the rows the gathered path delivers (the capture's
all-gather of the full ``[S, B, H]`` on every TP rank, the TP ranks sending as replicas), while
the teacher's capture gathers nothing. Checked two ways on real megatron GPTModels (teacher TP2
+ SP x DP2 on ranks 0-3, student TP2 x DP2 on the same ranks, padded micro-batches):

- :class:`mopd.mcore.Distiller` (its default for an SP teacher against
  ``teacher_sp_shards=False``), two steps of three micro-batches: every row each student rank
  receives, and its owner, equal; the capture's SP gather
  (``mopd.capture.capture.gather_sequence_parallel``) is called zero times and its buffer never
  allocated on the shards path (once per micro-batch and rank on the gathered one);
- the bridge API as documented (``OutputLayerInputCapture.get_local_hidden_states`` with layouts
  of each rank's SP slice, ``exchange``) against ``get_hidden_states`` with the full layouts.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.support import megatron_cpu as mc

TORCHRUN_NPROC = 4
TORCHRUN_TIMEOUT = 600

V, S, M = 64, 16, 3  # vocab, padded sequence length, micro-batches per step
H_T, H_S = 32, 16
PER_MB = 4  # samples per global micro-batch

world = pytest.fixture(scope="module")(mc.megatron_world)


@pytest.fixture()
def gathers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the capture's SP all-gathers on this rank."""
    import mopd.capture.capture as capture_module

    calls: list[int] = []
    real = capture_module.gather_sequence_parallel

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(capture_module, "gather_sequence_parallel", counted)
    return calls


def _setup() -> tuple[Any, ...]:
    from mopd.bridge import GroupPool, Mesh
    from mopd.mcore import megatron_process_groups

    pool = GroupPool(timeout_s=120)
    tmesh, smesh = Mesh(tp=2, dp=2, name="teacher"), Mesh(tp=2, dp=2, name="student")
    tpg = megatron_process_groups(tmesh, pool)
    spg = megatron_process_groups(smesh, pool)
    torch.manual_seed(11)
    teacher = mc.build_gpt(
        mc.tiny_config(hidden_size=H_T, tensor_model_parallel_size=2, sequence_parallel=True),
        vocab_size=V,
        max_seq_len=S,
        pg_collection=tpg,
    ).eval()
    torch.manual_seed(12)
    student = mc.build_gpt(
        mc.tiny_config(hidden_size=H_S, tensor_model_parallel_size=2),
        vocab_size=V,
        max_seq_len=S,
        pg_collection=spg,
    )
    return pool, tmesh, smesh, tpg, spg, teacher, student


def _micro_batches(mesh: Any, step: int) -> list[Any]:
    """This rank's DP share of each of the step's ``M`` micro-batches (random lengths, tokens)."""
    from mopd.mcore import padded_micro_batch, split_samples

    g = torch.Generator().manual_seed(100 + step)
    c = mesh.coord(dist.get_rank())
    out = []
    for i in range(M):
        ids = [1000 * step + PER_MB * i + k for k in range(PER_MB)]
        lens = torch.randint(3, S + 1, (PER_MB,), generator=g).tolist()
        toks = torch.randint(0, V, (PER_MB, S), generator=g)
        mine = split_samples(list(range(PER_MB)), mesh.dp, c.dp_rank)
        out.append(
            padded_micro_batch([ids[k] for k in mine], toks[mine], lengths=[lens[k] for k in mine])
        )
    return out


def test_distiller_sends_sp_shards_bit_exact_without_a_gather(
    world: Any, gathers: list[int]
) -> None:
    from mopd.bridge import BridgeConfig
    from mopd.mcore import Distiller, MeshModel

    pool, tmesh, smesh, tpg, spg, teacher, student = _setup()
    got: dict[bool, dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]] = {}
    calls: dict[bool, int] = {}
    allocations: dict[bool, int] = {}
    for shards in (True, False):
        distiller = Distiller(
            teachers=[MeshModel(mesh=tmesh, model=teacher, pg_collection=tpg)],
            student=MeshModel(mesh=smesh, model=student, pg_collection=spg),
            pool=pool,
            bridge_config=BridgeConfig(timeout_s=120),
            teacher_sp_shards=shards,
        )
        assert distiller.teacher_sp_shards == (shards,)
        sources = [g.ranks for g in distiller.bridge.topology.sources]
        assert sources == ([(0,), (1,), (2,), (3,)] if shards else [(0, 1), (2, 3)])
        before = len(gathers)
        got[shards] = {}
        for step_no in range(2):
            t_mbs, s_mbs = _micro_batches(tmesh, step_no), _micro_batches(smesh, step_no)
            with distiller.step(student=s_mbs, teachers=[t_mbs]) as step:
                for i in range(M):
                    rows = step.bridge_step.receive(i)[0].clone()
                    owner = step.bridge_step.owner(i)
                    assert owner is not None
                    got[shards][step_no, i] = (rows, owner.clone())
        calls[shards] = len(gathers) - before
        allocations[shards] = distiller._capture_buffers[0].allocations
    assert calls == {True: 0, False: 2 * M}, calls  # the gathered path: one per micro-batch
    assert allocations == {True: 0, False: 1}, allocations
    sent = 0
    for key, (rows, owner) in got[True].items():
        ref_rows, ref_owner = got[False][key]
        assert torch.equal(owner, ref_owner), key
        assert torch.equal(rows, ref_rows), key  # bit-exact: the same rows, moved otherwise
        sent += int((owner == 0).sum())
        # compact delivery: one real row per token teacher 0 owns here, none of them zeros
        assert rows.shape[0] == int((owner == 0).sum()), key
        assert bool((rows != 0).any(dim=1).all()), key
    assert sent > 0


def test_bridge_api_with_local_shards_equals_the_gathered_capture(
    world: Any, gathers: list[int]
) -> None:
    from mopd.bridge import BridgeConfig, HiddenStateBridge, TeacherSpec, create_bridge_groups
    from mopd.capture import OutputLayerInputCapture
    from mopd.mcore import micro_batch_layout

    pool, tmesh, smesh, tpg, spg, teacher, _ = _setup()
    rank = dist.get_rank()
    tc = tmesh.coord(rank)
    results: dict[bool, list[torch.Tensor]] = {}
    for shards in (True, False):
        bridge = HiddenStateBridge(
            teachers=[
                TeacherSpec(mesh=tmesh, hidden_size=H_T, dtype=torch.float32, sp_shards=shards)
            ],
            student=smesh,
            groups=create_bridge_groups(pool, [tmesh], smesh),
            config=BridgeConfig(timeout_s=120),
        )
        capture = OutputLayerInputCapture(teacher)
        before = len(gathers)
        results[shards] = []
        for mb, smb in zip(_micro_batches(tmesh, 5), _micro_batches(smesh, 5), strict=True):
            with torch.no_grad(), capture.capture_context():
                teacher(mb.tokens, mb.position_ids, None)
            if shards:
                hidden = capture.get_local_hidden_states()
                assert capture.sequence_sharded and hidden.shape[0] == S // 2
                layout = micro_batch_layout(
                    mb, rows="hidden", pg_collection=tpg, sp_size=2, sp_rank=tc.tp_rank
                )
            else:
                hidden = capture.get_hidden_states()
                assert hidden.shape[0] == S
                layout = micro_batch_layout(mb, rows="hidden", pg_collection=tpg)
            out = bridge.exchange(
                hidden={0: hidden},
                layouts={0: layout},
                student_layout=micro_batch_layout(smb, rows="logits", pg_collection=spg),
            ).wait()
            results[shards].append(out[0].clone())
        assert len(gathers) - before == (0 if shards else M)
    for a, b in zip(results[True], results[False], strict=True):
        assert torch.equal(a, b)
    assert any(bool(x.abs().sum() > 0) for x in results[True])
