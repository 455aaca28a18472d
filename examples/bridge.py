"""The bridge alone (``mopd.bridge``, no megatron): a teacher's hidden states moved to a student
with other parallelism, for any training loop. Every rank of every mesh makes the same calls;
groups are created once, in a fixed order.

Run it on 4 CPU ranks (gloo; on GPUs: ``GroupPool(backend="nccl", timeout_s=300)``):

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 examples/bridge.py
"""

import torch
import torch.distributed as dist

from mopd.bridge import (
    GroupPool,
    HiddenStateBridge,
    Mesh,
    TeacherSpec,
    create_bridge_groups,
    packed_layout,
    padded_layout,
)

dist.init_process_group("gloo")  # torchrun --nproc-per-node 4 gives the world
rank, H, S = dist.get_rank(), 8, 16
teacher, student = Mesh(tp=2, dp=2), Mesh(tp=2, cp=2)  # the same 4 ranks (colocated)
groups = create_bridge_groups(GroupPool(timeout_s=300), [teacher], student)
bridge = HiddenStateBridge(
    teachers=[TeacherSpec(mesh=teacher, hidden_size=H, dtype=torch.float32)],
    student=student, groups=groups,
)
dp, cp = teacher.coord(rank).dp_rank, student.coord(rank).cp_rank
micro_batches = [[0, 1, 2, 3], [4, 5, 6, 7]]  # global sample ids
step = bridge.plan_step(  # once per step, outside the schedule; layouts built inside (callables)
    teacher_layouts={0: [lambda ids=ids: padded_layout(ids[2 * dp : 2 * dp + 2], S)
                         for ids in micro_batches]},  # [S, B, H] rows of this DP rank's samples
    student_layouts=[lambda ids=ids: packed_layout(ids, [S] * 4, cp_size=2, cp_rank=cp)
                     for ids in micro_batches],  # the student's THD rows, CP zigzag
)
for i in range(step.num_micro_batches):  # e.g. in forward_step_func / loss_func
    step.send(i, {0: torch.randn(S, 2, H)})  # teacher: the rows are taken now
    rows_NH = step.receive(i)[0]  # student: teacher 0's tokens, compact, in the student's order
    assert rows_NH.shape == (2 * S, H) and step.owner(i).shape == (2 * S,)
step.finish()  # every rank, after the schedule
if rank == 0:
    print(f"bridge.py: {step.num_micro_batches} micro-batches of {2 * S} rows each moved")
bridge.close()
dist.destroy_process_group()  # every rank, at the end of the job
