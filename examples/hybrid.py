"""MOPD between megatron-core HybridModels: a hybrid teacher and a hybrid student, each on its
own mesh, one step of the response-only reverse KL inside megatron's pipeline schedule.

Needs megatron-core 0.18 or newer (``megatron.core.models.hybrid``); on an older release it says
so in one line and exits before starting anything. Run it on 4 CPU ranks (gloo):

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 examples/hybrid.py

On CPU ranks the layers are attention (``*``) and MLP (``-``) from
``mopd.mcore.cpu.cpu_hybrid_stack_spec()``; on GPUs megatron's own ``hybrid_stack_spec`` adds
Mamba (``M``) and the other kinds.
"""

from __future__ import annotations

import os
import re
import sys
from importlib.metadata import version
from typing import Any

from mopd.mcore import cpu

cpu.quiet()  # megatron-core's known CPU notices (cpu.QUIETED), before megatron-core is imported

MEGATRON_CORE = version("megatron-core")
if tuple(map(int, re.findall(r"\d+", MEGATRON_CORE)[:2])) < (0, 18):  # before any rank starts work
    if os.environ.get("RANK", "0") == "0":  # one line from the whole job
        print(
            f"hybrid.py: HybridModel needs megatron-core 0.18 or newer; this is {MEGATRON_CORE} "
            "(pip install 'megatron-core>=0.18')",
            file=sys.stderr,
        )
    sys.exit(0)

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel as DDP
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

from mopd.bridge import GroupPool, Mesh
from mopd.mcore import Distiller, MeshModel, Rollouts, megatron_process_groups

VOCAB = 128


def hybrid(mesh: Mesh, pg: Any, hidden: int, pattern: str, spec: Any, **config: Any) -> Any:
    """This rank's stage of a HybridModel: one layer per symbol of ``pattern``; each ``|``
    starts the next pipeline stage."""
    stage = mesh.coord(dist.get_rank()).pp_rank
    cfg = TransformerConfig(
        num_layers=len(pattern.replace("|", "")), hidden_size=hidden, num_attention_heads=4,
        use_cpu_initialization=True, tensor_model_parallel_size=mesh.tp,
        pipeline_model_parallel_size=mesh.pp, sequence_parallel=True,
        pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0, **config,
    )
    return HybridModel(
        config=cfg, hybrid_stack_spec=spec, hybrid_layer_pattern=pattern, vocab_size=VOCAB,
        max_sequence_length=32, position_embedding_type="learned_absolute",
        pre_process=stage == 0, post_process=stage == mesh.pp - 1, pg_collection=pg,
    )


def main() -> None:
    dist.init_process_group("gloo")  # torchrun --nproc-per-node 4 gives the world
    if torch.cuda.is_available():  # megatron's own spec: Transformer Engine, Mamba kernels
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec as spec
    else:  # CPU ranks: attention (*) and MLP (-) layers
        cpu.apply()
        spec = cpu.cpu_hybrid_stack_spec()
    parallel_state.initialize_model_parallel()  # for what still reads megatron's globals
    model_parallel_cuda_manual_seed(0)
    pool = GroupPool(timeout_s=300)
    teacher_mesh, student_mesh = Mesh(tp=2, pp=2), Mesh(tp=2, pp=2)
    teacher_pg = megatron_process_groups(teacher_mesh, pool)
    student_pg = megatron_process_groups(student_mesh, pool)
    teacher = hybrid(teacher_mesh, teacher_pg, 64, "*-|*-", spec).eval()
    student = hybrid(student_mesh, student_pg, 32, "*-*-|*-", spec, calculate_per_token_loss=True)
    student = DDP(
        student.config, DistributedDataParallelConfig(), student, pg_collection=student_pg
    )
    student.config.finalize_model_grads_func = finalize_model_grads
    distiller = Distiller(
        teachers=[MeshModel(mesh=teacher_mesh, model=teacher, pg_collection=teacher_pg)],
        student=MeshModel(mesh=student_mesh, model=student, pg_collection=student_pg),
        pool=pool,
        vocab_size=VOCAB,
    )
    held = None
    if dist.get_rank() == 0:  # the student's one DP replica's first rank holds the rollouts
        g = torch.Generator().manual_seed(0)
        held = Rollouts(
            prompts=[torch.randint(0, VOCAB, (4,), generator=g) for _ in range(8)],
            responses=[torch.randint(0, VOCAB, (12,), generator=g) for _ in range(8)],
        )
    with distiller.step(held, num_micro_batches=4) as mopd:
        get_forward_backward_func(pp_size=student_mesh.pp, vp_size=None)(
            forward_step_func=mopd.forward_step, model=[student], **mopd.schedule_kwargs(),
            p2p_communicator=P2PCommunicator(pp_group=student_pg.pp, config=student.config),
            pg_collection=student_pg,
        )
    if dist.get_rank() == student_mesh.global_rank(pp_rank=student_mesh.pp - 1):
        print(f"hybrid.py: mean KL per response token {mopd.mean_loss():.4f}")
    distiller.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
