"""MOPD on Ray: the teacher's world and the student's world as two Ray worker groups, the way
NeMo-RL, verl, slime and OpenRLHF run their models' jobs.

    python examples/ray_worlds.py

The driver starts Ray on this machine (CPU, gloo), makes a teacher worker group (4 actors: one
world, a TP2 PP2 GPTModel) and a student worker group (4 actors: TP2 DP2), and hands both one
address: a free port on the student world's rank 0, where that world hosts the link. Each group
is a torch.distributed world of its own (``mopd.mcore.WorkerGroup`` gives its actors the
``env://`` variables, as torchrun gives a job's ranks); the worlds meet only over the bridge.
The driver ships no data: the student actors' own sampler makes each step's rollouts, and their
token ids and the teacher's hidden states move between the groups over the bridge, never
through the driver. The teacher actors serve until the student's world is done; the student
actors return their losses, and the driver prints one line per step and the result.

Each world's job is examples/worlds.py's, the same functions its torchrun jobs run.
"""

from __future__ import annotations

from mopd.mcore import cpu

cpu.quiet()  # megatron-core's known CPU notices (cpu.QUIETED), before megatron-core is imported

import ray
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from worlds import STEPS, student_job, teacher_job  # examples/worlds.py: each world's job

from mopd.mcore import WorkerGroup


class Rank:
    """One rank of a world, in a Ray actor: its default group from the ``env://`` variables its
    worker group set (gloo on CPU), megatron-core on CPU ranks."""

    def __init__(self) -> None:
        dist.init_process_group("gloo")
        cpu.apply()  # megatron-core on CPU ranks
        parallel_state.initialize_model_parallel()  # for what still reads megatron's globals
        model_parallel_cuda_manual_seed(0)

    def teach(self, address: str) -> None:
        teacher_job(address)  # a TeacherServer: serves every step the student's world starts

    def learn(self, address: str) -> list[float]:
        return student_job(address, steps_ahead=0)  # its sampler's rollouts, STEPS steps


def main() -> None:
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    with (
        WorkerGroup(Rank, world="student", size=4) as student,
        WorkerGroup(Rank, world="teacher-0", size=4) as teacher,
    ):
        address = student.link_address()  # the student world's rank 0 hosts the link there
        serving = teacher.submit("teach", address)
        losses = student.call("learn", address)[0]  # every rank's; the loss is the same on all
        serving.get()  # the teacher's world ends its serve() when the student's Distiller closes
    ray.shutdown()
    for step, loss in enumerate(losses):
        print(f"step {step + 1}/{STEPS}: mean KL per response token {loss:.4f}")
    print(
        'ray_worlds.py: the student worker group learned from world "teacher-0" (a teacher '
        f"worker group) over the bridge, mean KL {losses[0]:.4f} -> {losses[-1]:.4f} "
        f"in {STEPS} steps"
    )


if __name__ == "__main__":
    main()
