"""On-policy MOPD with a GRPO term: each teacher on its own ranks, every sample routed to the
teacher of its prompt's domain, the loss the teachers' reverse KL plus a policy-gradient term on
group-normalized advantages.

Run it on 4 CPU ranks (gloo); on GPUs use NCCL and drop the two ``cpu`` calls:

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 examples/grpo.py

Ranks 0-1 hold teacher 0 and ranks 2-3 teacher 1 (models on some ranks only); the student spans
all four (TP2 DP2): DP replica ``d`` is ranks ``2d, 2d + 1``, and its first rank samples the
responses to its share of the prompts. It prints one line per step and the result, from one rank.
"""

from __future__ import annotations

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
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

from mopd.bridge import GroupPool, Mesh
from mopd.mcore import Distiller, MeshModel, Rollouts, megatron_process_groups

VOCAB, STEPS, BETA = 128, 2, 0.1
PROMPTS, GROUP = 4, 4  # per step: 4 prompts, 4 responses each (a GRPO group), 16 samples


def gpt(mesh: Mesh, pg: Any, hidden: int, seed: int, **config: Any) -> Any:
    """A small GPTModel on ``mesh``, built on the ranks of ``mesh`` only (``pg``: its groups)."""
    torch.manual_seed(seed)  # the same weights on every DP replica (a real job loads a checkpoint)
    cfg = TransformerConfig(
        num_layers=2, hidden_size=hidden, num_attention_heads=4, use_cpu_initialization=True,
        tensor_model_parallel_size=mesh.tp, sequence_parallel=True, hidden_dropout=0.0,
        attention_dropout=0.0, **config,
    )
    return GPTModel(
        config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
        max_sequence_length=32, pg_collection=pg,
    )


@dataclass
class Job:
    """What a training step needs."""

    distiller: Distiller
    student: Any  # megatron's DDP around the student
    student_mesh: Mesh
    student_pg: Any
    adam: torch.optim.Optimizer


def build() -> Job:
    """Each model on its own ranks, and the ``Distiller`` (collective: every rank calls it)."""
    pool = GroupPool(timeout_s=300)
    teacher_meshes = [Mesh(tp=2, rank_offset=0), Mesh(tp=2, rank_offset=2)]  # ranks 0-1, 2-3
    student_mesh = Mesh(tp=2, dp=2)  # ranks 0-3
    teachers = []
    for k, (mesh, hidden) in enumerate(zip(teacher_meshes, (64, 48), strict=True)):
        pg = megatron_process_groups(mesh, pool)  # collective; None on ranks off the mesh
        model = gpt(mesh, pg, hidden, seed=1 + k).eval() if pg is not None else None
        teachers.append(MeshModel(mesh=mesh, model=model, pg_collection=pg))  # None, None off it
    student_pg = megatron_process_groups(student_mesh, pool)
    student = gpt(student_mesh, student_pg, 32, seed=3, calculate_per_token_loss=True)
    student = DDP(
        student.config, DistributedDataParallelConfig(), student, pg_collection=student_pg
    )
    student.config.finalize_model_grads_func = finalize_model_grads
    distiller = Distiller(
        teachers=teachers,
        student=MeshModel(mesh=student_mesh, model=student, pg_collection=student_pg),
        pool=pool,
        vocab_size=VOCAB,
    )
    adam = torch.optim.Adam(student.parameters(), lr=1e-3)
    return Job(distiller, student, student_mesh, student_pg, adam)


def rollouts(step: int, replica: int) -> Rollouts:
    """DP replica ``replica``'s samples of the step: its prompts, ``GROUP`` responses to each
    (random tokens here: your sampler's; one of them empty, a response stopped at once), each
    routed to its prompt's teacher, with GRPO's group-normalized advantages of a toy reward."""
    g = torch.Generator().manual_seed(1000 * step + replica)
    prompts, responses, teachers, advantages = [], [], [], []
    share = PROMPTS // 2  # prompts per replica (the student's 2 DP replicas)
    for p in range(share * replica, share * (replica + 1)):
        length = int(torch.randint(2, 8, (1,), generator=g))
        prompt = torch.randint(0, VOCAB, (length,), generator=g)
        group = [torch.randint(0, VOCAB, (int(n),), generator=g)
                 for n in torch.randint(0, 16, (GROUP,), generator=g)]
        rewards = torch.tensor([(r < VOCAB // 2).float().mean().nan_to_num(0.0) for r in group])
        prompts += [prompt] * GROUP
        responses += group
        teachers += [p % 2] * GROUP  # the teacher of the prompt's domain
        advantages += ((rewards - rewards.mean()) / (rewards.std() + 1e-6)).tolist()
    responses[0] = responses[0][:0]  # an empty response: it counts no row
    return Rollouts(prompts=prompts, responses=responses, teachers=teachers, advantages=advantages)


def grpo_forward_step(mopd: Any, beta: float = BETA) -> Any:
    """megatron's ``forward_step_func``: the student's forward, and a ``loss_func`` of the
    teachers' KL plus ``beta`` times the policy gradient ``-A * log p(token)`` per counted row."""

    def forward_step(data_iterator: Any, model: Any) -> Any:
        mb = next(data_iterator)

        def loss_func(logits: torch.Tensor) -> Any:
            signal = mopd.teacher_signal(logits, mb)  # per row, in the order of the logits
            logp = mopd.token_logprobs(logits, mb.labels).flatten()  # row p: log p(token p + 1)
            policy_gradient = -(signal.advantage_T * logp)[signal.mask_T].sum()
            return mopd.loss_output(signal.weighted_kl_sum() + beta * policy_gradient, signal)

        return mopd.forward(model, mb), loss_func

    return forward_step


def train_step(job: Job, step: int) -> Any:
    """One step: each DP replica's first rank hands its samples to ``distiller.step`` (the other
    ranks pass ``None``), megatron's schedule runs the student, then the optimizer."""
    mesh = job.student_mesh
    firsts = [mesh.global_rank(dp_rank=d) for d in range(mesh.dp)]  # [0, 2]: tp varies fastest
    rank = dist.get_rank()
    held = rollouts(step, firsts.index(rank)) if rank in firsts else None
    with job.distiller.step(held, num_micro_batches=2) as mopd:
        get_forward_backward_func()(
            forward_step_func=grpo_forward_step(mopd), model=[job.student], **mopd.schedule_kwargs(),
            pg_collection=job.student_pg,
        )
    for p in job.student.parameters():
        p.grad = p.main_grad  # megatron's DDP accumulates gradients in main_grad
    job.adam.step()
    for p in job.student.parameters():
        p.grad = None
    job.student.zero_grad_buffer()
    return mopd


def main() -> None:
    dist.init_process_group("gloo")  # torchrun --nproc-per-node 4 gives the world
    parallel_state.initialize_model_parallel()  # for what still reads megatron's globals
    model_parallel_cuda_manual_seed(0)
    job = build()
    reporter = job.student_mesh.global_rank()  # mean_loss() is set on every last-stage rank
    losses = []
    for step in range(STEPS):
        mopd = train_step(job, step)
        losses.append(mopd.mean_loss())
        samples = mopd.samples  # every sample of the step, as every rank agreed them
        empty = int((samples.length_N == samples.prompt_len_N).sum())
        routed = torch.bincount(samples.teacher_N, minlength=2).tolist()
        if dist.get_rank() == reporter:
            print(
                f"step {step + 1}/{STEPS}: loss {losses[-1]:.4f} per response token; "
                f"{samples.num_samples} samples ({empty} empty), teachers {routed}"
            )
    if dist.get_rank() == reporter:
        print(f"grpo.py: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {STEPS} steps")
    job.distiller.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
