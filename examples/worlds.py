"""MOPD with the teacher in its own job: a teacher world and a student world, two torchrun jobs
that share no process group, connected by one address.

On two sets of nodes (or one machine), start the two jobs; each is a torchrun of its own:

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 --master-port 29511 examples/worlds.py \\
        --world teacher-0 --address 127.0.0.1:29600 &
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 --master-port 29512 examples/worlds.py \\
        --world student --address 127.0.0.1:29600

Or let this file start both on this machine (CPU, gloo; free ports picked for you):

    python examples/worlds.py

It prints one line per step and the result, from one student rank. With ``--one-step-ahead``
the student submits each step's rollouts one step early and the teacher's world scores step
``k + 1`` while the student trains on step ``k``:

    python examples/worlds.py --one-step-ahead
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
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
from megatron.core.transformer.transformer_config import TransformerConfig

from mopd.bridge import GroupPool, Mesh, connect_worlds
from mopd.mcore import Distiller, MeshModel, Rollouts, TeacherServer, megatron_process_groups

VOCAB, STEPS = 128, 2
TEACHER_MESH = Mesh(tp=2, pp=2)  # in the teacher world's own ranks
STUDENT_MESH = Mesh(tp=2, dp=2)  # in the student world's own ranks


def gpt(mesh: Mesh, pg: Any, hidden: int, seed: int, **config: Any) -> Any:
    """This rank's pipeline stage of a small GPTModel on ``mesh`` (a rank of this world)."""
    torch.manual_seed(seed)  # the same weights on every DP replica (a real job loads a checkpoint)
    stage = mesh.coord(dist.get_rank()).pp_rank
    cfg = TransformerConfig(
        num_layers=2, hidden_size=hidden, num_attention_heads=4, use_cpu_initialization=True,
        tensor_model_parallel_size=mesh.tp, pipeline_model_parallel_size=mesh.pp,
        sequence_parallel=True, hidden_dropout=0.0, attention_dropout=0.0,
        pipeline_dtype=torch.float32, **config,
    )
    return GPTModel(
        config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
        max_sequence_length=32, pre_process=stage == 0, post_process=stage == mesh.pp - 1,
        pg_collection=pg,
    )


def teacher_job(address: str) -> None:
    """The teacher world: connect, build its model, serve every step the student starts."""
    link = connect_worlds(address, world="teacher-0", timeout_s=300)
    pool = GroupPool(timeout_s=300)
    pg = megatron_process_groups(TEACHER_MESH, pool)
    teacher = gpt(TEACHER_MESH, pg, 64, 1).eval()
    with TeacherServer(
        link=link, teachers=[MeshModel(mesh=TEACHER_MESH, model=teacher, pg_collection=pg)],
        pool=pool,
    ) as server:
        server.serve()  # until the student's Distiller closes
    link.close()
    pool.close()


def rollouts(step: int) -> Rollouts:
    """The step's 8 samples: a prompt and the student's response each, all for teacher 0."""
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(2, 16, (8, 2), generator=g).tolist()  # prompt, response
    return Rollouts(
        prompts=[torch.randint(0, VOCAB, (p,), generator=g) for p, _ in lengths],
        responses=[torch.randint(0, VOCAB, (r,), generator=g) for _, r in lengths],
        teachers=[0] * 8,
    )


def student_job(address: str, steps_ahead: int) -> list[float]:
    """The student world: connect (it hosts the rendezvous), declare the teacher by its world,
    and train as in one job (``steps_ahead``: submit each step's rollouts that many steps
    early, so that the teacher's world scores them while the student trains); its losses."""
    link = connect_worlds(address, world="student", worlds=["student", "teacher-0"], timeout_s=300)
    pool = GroupPool(timeout_s=300)
    pg = megatron_process_groups(STUDENT_MESH, pool)
    student = gpt(STUDENT_MESH, pg, 32, 3, calculate_per_token_loss=True)
    student = DDP(student.config, DistributedDataParallelConfig(), student, pg_collection=pg)
    student.config.finalize_model_grads_func = finalize_model_grads
    distiller = Distiller(
        teachers=[MeshModel(mesh=TEACHER_MESH, world="teacher-0")],  # no model here: its world's
        student=MeshModel(mesh=STUDENT_MESH, model=student, pg_collection=pg),
        pool=pool,
        vocab_size=VOCAB,
        link=link,
        steps_ahead=steps_ahead,
    )
    adam = torch.optim.Adam(student.parameters(), lr=1e-3)
    losses = []

    def held(step: int) -> Rollouts | None:
        return rollouts(step) if dist.get_rank() == 0 else None  # where the sampler put them

    if steps_ahead:
        distiller.submit(held(0), num_micro_batches=2)
    for step in range(STEPS):
        if steps_ahead and step + 1 < STEPS:  # the teacher's world scores it meanwhile
            distiller.submit(held(step + 1), num_micro_batches=2)
        # the oldest submitted step (its rows are waiting), or this step from its rollouts
        mopd = distiller.step() if steps_ahead else distiller.step(held(step), num_micro_batches=2)
        with mopd:
            get_forward_backward_func(pp_size=STUDENT_MESH.pp, vp_size=None)(
                forward_step_func=mopd.forward_step, model=[student], **mopd.schedule_kwargs(),
                p2p_communicator=P2PCommunicator(pp_group=pg.pp, config=student.config),
                pg_collection=pg,
            )
        for p in student.parameters():
            p.grad = p.main_grad
        adam.step()
        student.zero_grad_buffer()
        losses.append(mopd.mean_loss())
        if dist.get_rank() == 0:
            print(f"step {step + 1}/{STEPS}: mean KL per response token {losses[-1]:.4f}")
    if dist.get_rank() == 0:
        ahead = f", the teacher {steps_ahead} step ahead" if steps_ahead else ""
        print(
            f'worlds.py: the student learned from world "teacher-0" over the bridge{ahead}, '
            f"mean KL {losses[0]:.4f} -> {losses[-1]:.4f} in {STEPS} steps"
        )
    distiller.close()
    link.close()
    pool.close()
    return losses


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_both(steps_ahead: int) -> int:
    """Start the two jobs on this machine, as the module doc prints them; show the student's
    output (the teacher's log only if a job fails)."""
    address = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4"]
    logs = Path(tempfile.mkdtemp(prefix="mopd-worlds-"))
    jobs = {}
    for world in ("teacher-0", "student"):
        cmd = [*torchrun, "--master-port", str(_free_port()), __file__, "--world", world,
               "--address", address, *(["--one-step-ahead"] if steps_ahead else [])]  # fmt: skip
        log = open(logs / f"{world}.log", "w")  # noqa: SIM115 (the child writes it)
        out = subprocess.PIPE if world == "student" else log
        jobs[world] = subprocess.Popen(cmd, env=env, stdout=out, stderr=log, text=True)
    codes: dict[str, int | None] = {w: None for w in jobs}
    while any(c is None for c in codes.values()):  # the first job to fail ends the other
        codes = {w: j.poll() for w, j in jobs.items()}
        if any(codes.values()):
            for j in jobs.values():
                j.kill()
            codes = {w: j.wait() for w, j in jobs.items()}
        time.sleep(0.2)
    printed = jobs["student"].stdout.read() if jobs["student"].stdout else ""
    if any(codes.values()):
        for world, code in codes.items():
            print(f"worlds.py: {world} job exited {code}; its log:", file=sys.stderr)
            print((logs / f"{world}.log").read_text()[-4000:], file=sys.stderr)
        return 1
    print(printed, end="")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", choices=["student", "teacher-0"], help="this job's world")
    parser.add_argument("--address", help="host:port of the rendezvous, the same in both jobs")
    parser.add_argument(
        "--one-step-ahead", action="store_true",
        help="the student's steps_ahead=1 (its world tells the teacher's); default lockstep",
    )  # fmt: skip
    args = parser.parse_args()
    if args.world is None:
        sys.exit(launch_both(int(args.one_step_ahead)))
    if args.address is None:
        parser.error("--world needs --address host:port (the same in both jobs)")
    dist.init_process_group("gloo")  # torchrun gives this world; the other job has its own
    parallel_state.initialize_model_parallel()  # for what still reads megatron's globals
    model_parallel_cuda_manual_seed(0)
    if args.world == "student":
        student_job(args.address, int(args.one_step_ahead))
    else:
        teacher_job(args.address)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
