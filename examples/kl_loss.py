"""The full-vocabulary reverse KL (``mopd.kernels``) on one process: the student's logits against
a teacher's logits rebuilt from its hidden states and LM head, gradients into the student only.

    python examples/kl_loss.py
"""

import torch

from mopd.kernels import KLConfig, vocab_parallel_kl

T, H, V = 16, 32, 1000
student_logits_TV = torch.randn(T, V, requires_grad=True)
teacher_hidden_TH, teacher_weight_VH = torch.randn(T, H), torch.randn(V, H) / H**0.5
loss = vocab_parallel_kl(student_logits_TV, teacher_hidden_TH, teacher_weight_VH,
                         vocab_start=0, vocab_size=V, config=KLConfig(reduction="mean"))
loss.backward()  # gradients into the student only
print(f"kl_loss.py: mean reverse KL {loss.item():.4f} over {T} tokens, vocabulary {V}")
