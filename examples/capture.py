"""The teacher's hidden states captured at its LM head (``mopd.capture``), as NeMo-RL's
``opd_full_capture`` returns them: a drop-in with the same names and answers, plus a
zero-allocation path on request.

Run it on 2 CPU ranks (gloo), a teacher under TP2 with sequence parallelism:

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/capture.py
"""

from mopd.mcore import cpu

cpu.quiet()  # megatron-core's known CPU notices (cpu.QUIETED), before megatron-core is imported
cpu.apply()  # megatron-core on CPU ranks; before it is imported, so its fusions stay plain

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

from mopd.bridge import GroupPool, Mesh
from mopd.capture import get_opd_full_capture_context
from mopd.mcore import megatron_process_groups

dist.init_process_group("gloo")  # torchrun --nproc-per-node 2 gives the world
parallel_state.initialize_model_parallel()
model_parallel_cuda_manual_seed(0)
pool = GroupPool(timeout_s=300)
mesh = Mesh(tp=2)  # a one-stage teacher: every rank holds the LM head
config = TransformerConfig(
    num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
    tensor_model_parallel_size=2, sequence_parallel=True, hidden_dropout=0.0,
    attention_dropout=0.0,
)
teacher = GPTModel(
    config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=128,
    max_sequence_length=32, pg_collection=megatron_process_groups(mesh, pool),
).eval()
tokens, positions = torch.randint(0, 128, (2, 32)), torch.arange(32).expand(2, 32)

ctx, capture = get_opd_full_capture_context(teacher, enabled=True)
with torch.no_grad(), ctx:
    teacher(tokens, positions, None)
hidden_SBH = capture.get_hidden_states()  # [S, B, H]
assert hidden_SBH.shape == (32, 2, 64)  # sequence parallelism undone, into a tensor of its own

# the zero-allocation path, on request: every capture writes into the caller's tensor
out_SBH = torch.empty(32, 2, 64)
ctx, capture = get_opd_full_capture_context(teacher, enabled=True, out=out_SBH)
with torch.no_grad(), ctx:
    teacher(tokens, positions, None)
assert capture.get_hidden_states() is out_SBH and torch.equal(out_SBH, hidden_SBH)
if dist.get_rank() == 0:
    print(f"capture.py: hidden states {tuple(hidden_SBH.shape)} captured, twice the same")
pool.close()
dist.destroy_process_group()
