"""MOPD training: two frozen teachers and a student, each a megatron-core GPTModel on its own
mesh, the student learning the full-vocabulary reverse KL to the teacher each sample is routed
to, inside megatron-core's own pipeline schedule.

Run it on 4 CPU ranks (gloo); on GPUs use NCCL and drop the two ``cpu`` calls:

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 examples/train.py          # fp32
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 examples/train.py --bf16   # mixed precision

It prints one line per step and the result, from one rank.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from mopd.mcore import cpu

cpu.quiet()  # megatron-core's known CPU notices (cpu.QUIETED), before megatron-core is imported
cpu.apply()  # megatron-core on CPU ranks; before it is imported, so its fusions stay plain

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel as DDP
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

from mopd.bridge import GroupPool, Mesh
from mopd.mcore import Distiller, MeshModel, Rollouts, megatron_process_groups

VOCAB, STEPS = 128, 2


def gpt(mesh: Mesh, pg: Any, hidden: int, seed: int, *, bf16: bool, **config: Any) -> Any:
    """This rank's pipeline stage of a small GPTModel on ``mesh`` (bf16: as megatron-LM trains,
    bf16 weights and activations under its ``Float16Module``)."""
    torch.manual_seed(seed)  # the same weights on every DP replica (a real job loads a checkpoint)
    stage = mesh.coord(dist.get_rank()).pp_rank
    dtype = torch.bfloat16 if bf16 else torch.float32
    cfg = TransformerConfig(
        num_layers=2, hidden_size=hidden, num_attention_heads=4, use_cpu_initialization=True,
        tensor_model_parallel_size=mesh.tp, pipeline_model_parallel_size=mesh.pp,
        sequence_parallel=True, hidden_dropout=0.0, attention_dropout=0.0,
        bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype, **config,
    )
    model = GPTModel(
        config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
        max_sequence_length=32, pre_process=stage == 0, post_process=stage == mesh.pp - 1,
        pg_collection=pg,
    )
    return Float16Module(cfg, model) if bf16 else model


@dataclass
class Job:
    """What a training step needs: the distiller, the student and its optimizer."""

    distiller: Distiller
    student: Any  # megatron's DDP around the student's stage
    student_mesh: Mesh
    student_pg: Any
    params: list[torch.nn.Parameter]  # the student's, in its dtype
    master: list[torch.Tensor]  # their fp32 master copies, which the optimizer updates
    adam: torch.optim.Optimizer


def build(*, bf16: bool) -> Job:
    """The models on their meshes and the ``Distiller`` (collective: every rank calls it)."""
    pool = GroupPool(timeout_s=300)  # <= BridgeConfig.timeout_s: a failed rank blocks no one longer
    meshes = [Mesh(tp=2, pp=2), Mesh(tp=2, dp=2)]  # teachers 0 and 1, on ranks 0-3 each
    student_mesh = Mesh(tp=2, pp=2)  # the student too (colocated; disjoint meshes work alike)
    teacher_pgs = [megatron_process_groups(m, pool) for m in meshes]
    student_pg = megatron_process_groups(student_mesh, pool)
    teachers = [
        gpt(mesh, pg, hidden, seed, bf16=bf16).eval()
        for mesh, pg, hidden, seed in zip(meshes, teacher_pgs, (64, 48), (1, 2), strict=True)
    ]
    student = gpt(student_mesh, student_pg, 32, 3, bf16=bf16, calculate_per_token_loss=True)
    student = DDP(
        student.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), student,
        pg_collection=student_pg,
    )
    student.config.finalize_model_grads_func = finalize_model_grads
    distiller = Distiller(
        teachers=[MeshModel(mesh=m, model=t, pg_collection=pg)
                  for m, t, pg in zip(meshes, teachers, teacher_pgs, strict=True)],
        student=MeshModel(mesh=student_mesh, model=student, pg_collection=student_pg),
        pool=pool,
        vocab_size=VOCAB,  # the tokenizer's vocabulary: each model may be padded past it
    )
    params = list(student.parameters())
    master = [p.detach().float().clone().requires_grad_() for p in params]
    adam = torch.optim.Adam(master, lr=1e-3)
    return Job(distiller, student, student_mesh, student_pg, params, master, adam)


def rollouts(step: int) -> Rollouts:
    """The step's 8 samples: a prompt and the student's response each (random tokens here: your
    sampler's), and the teacher each is routed to."""
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(2, 16, (8, 2), generator=g).tolist()  # prompt, response
    return Rollouts(
        prompts=[torch.randint(0, VOCAB, (p,), generator=g) for p, _ in lengths],
        responses=[torch.randint(0, VOCAB, (r,), generator=g) for _, r in lengths],
        teachers=torch.randint(0, 2, (8,), generator=g),
    )


def train_step(job: Job, step: int) -> Any:
    """One step: ``distiller.step`` around megatron's schedule, then the optimizer. Rank 0 (the
    student's one DP replica's first rank) holds the rollouts; the others pass ``None``."""
    held = rollouts(step) if dist.get_rank() == 0 else None
    with job.distiller.step(held, num_micro_batches=4) as mopd:
        get_forward_backward_func(pp_size=job.student_mesh.pp, vp_size=None)(
            forward_step_func=mopd.forward_step,  # the student's forward and the KL as its loss
            model=[job.student], **mopd.schedule_kwargs(),  # data_iterator, num_microbatches...
            p2p_communicator=P2PCommunicator(pp_group=job.student_pg.pp, config=job.student.config),
            pg_collection=job.student_pg,
        )
    for p, m in zip(job.params, job.master, strict=True):
        m.grad = p.main_grad.float()  # megatron's DDP accumulates gradients in main_grad
    job.adam.step()
    with torch.no_grad():
        for p, m in zip(job.params, job.master, strict=True):
            p.copy_(m)  # the update, in the model's dtype
            m.grad = None
    job.student.zero_grad_buffer()
    return mopd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bf16", action="store_true", help="bf16 as megatron-LM trains")
    args = parser.parse_args()
    dist.init_process_group("gloo")  # torchrun --nproc-per-node 4 gives the world
    parallel_state.initialize_model_parallel()  # for what still reads megatron's globals
    model_parallel_cuda_manual_seed(0)
    job = build(bf16=args.bf16)
    # mean_loss() is the same on every rank of the student's last stage: print from its first
    reporter = job.student_mesh.global_rank(pp_rank=job.student_mesh.pp - 1)
    losses = []
    for step in range(STEPS):
        losses.append(train_step(job, step).mean_loss())
        if dist.get_rank() == reporter:
            print(f"step {step + 1}/{STEPS}: mean KL per response token {losses[-1]:.4f}")
    if dist.get_rank() == reporter:
        precision = "bf16" if args.bf16 else "fp32"
        print(
            f"train.py: {precision}, mean KL {losses[0]:.4f} -> {losses[-1]:.4f} in {STEPS} steps"
        )
    job.distiller.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
