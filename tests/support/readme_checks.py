"""What the README's training blocks are checked for, inside their own torchrun launch.

Why this file exists: a README block that runs is not yet a README block that is right. After
the training blocks have run as written, :func:`check_training_blocks` takes the names they
defined (``train_step``, the models, ``adam`` and its fp32 ``master`` weights, the meshes, the
``rollouts`` of a step and the GRPO ``forward_step``) and checks what their reader trusts:

- the same batch at learning rate 0 twice hands the optimizer the same gradients (a hand-off
  that leaves ``p.grad`` aliased to ``main_grad`` adds the first micro-batch twice);
- the GRPO block's loss and every gradient equal a float64 reference built from the models'
  full weights that counts exactly the rows predicting response tokens (row ``p`` of a sample
  with prompt ``P`` and length ``L`` counts for ``P - 1 <= p <= L - 2``; a one-row shift, as a
  token-aligned mask taken for a row mask gives, fails it);
- under ``BF16 = True`` the same, within bf16's tolerance, and against the fp32 run's gradients.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from tests.support.mcore_ref import reference_step, shard_of
from tests.support.megatron_cpu import build_gpt, full_state, tiny_config

__all__ = ["check_training_blocks"]

#: (loss, gradient) relative tolerances: fp32 models (TP reductions and chunking reorder sums),
#: and bf16 weights and activations against float64 on the same weights.
TOLERANCE = {False: (1e-5, 1e-4), True: (3e-2, 6e-2)}
#: bf16 gradients against the fp32 run's (other rounding of the same initial weights).
BF16_VS_FP32 = 1e-1
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _inner(model: Any) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


def _full_name(name: str, offset: int) -> str:
    m = _LAYER.match(name)
    return name if m is None else f"decoder.layers.{int(m.group(1)) + offset}." + name[m.end() :]


def _full_weights(model: Any, mesh: Any, pg: Any, num_layers: int) -> dict[str, torch.Tensor]:
    """Every parameter's full (TP1, PP1) tensor in fp32, on every rank (collective: world)."""
    rank = dist.get_rank()
    c = mesh.coord(rank)
    named: dict[str, torch.Tensor] = {}
    if c is not None:
        inner = _inner(model)
        local = full_state(inner, pg.tp)
        if c.tp_rank == 0 and c.dp_rank == 0 and c.cp_rank == 0:
            offset = c.pp_rank * (num_layers // mesh.pp)
            named = {_full_name(n, offset): t.float().clone() for n, t in local.items()}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, named)
    merged: dict[str, torch.Tensor] = {}
    for part in every:
        merged.update(part)
    return merged


def _full_model(weights: Mapping[str, torch.Tensor], hidden: int) -> torch.nn.Module:
    """A TP1, PP1 fp32 GPTModel as the README's ``gpt()`` builds it, with ``weights``."""
    model = build_gpt(
        tiny_config(num_layers=2, hidden_size=hidden, num_attention_heads=4),
        vocab_size=128,
        max_seq_len=32,
    )
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
    return model


def _step_grads(ns: Mapping[str, Any], step: int, forward_step: Any) -> tuple[Any, list]:
    """``(mean loss, the gradients handed to the optimizer)`` of one step at learning rate 0."""
    adam, master = ns["adam"], ns["master"]
    for group in adam.param_groups:
        group["lr"] = 0.0
    seen: list[list[torch.Tensor]] = []
    hook = adam.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append([m.grad.clone() for m in master])
    )
    try:
        mopd = ns["train_step"](step, forward_step=forward_step)
    finally:
        hook.remove()
    return mopd.mean_loss(), seen[0]


def _grpo_reference(ns: Mapping[str, Any], step: int, beta: float) -> tuple[float, dict]:
    """The float64 reference of the GRPO block's step: the weighted KL plus
    ``-beta * A * log p(token p + 1)`` over the rows ``P - 1 .. L - 2`` of each sample."""
    meshes, teacher_pgs = ns["meshes"], ns["teacher_pgs"]
    student_w = _full_weights(ns["student"], ns["student_mesh"], ns["student_pg"], 2)
    teacher_ws = [
        _full_weights(t, m, pg, 2)
        for t, m, pg in zip(ns["teachers"], meshes[:2], teacher_pgs, strict=True)
    ]
    hidden = [int(_inner(ns["student"]).config.hidden_size)]
    student = _full_model(student_w, hidden[0])
    teachers = [
        _full_model(w, int(w["embedding.word_embeddings.weight"].shape[1])).eval()
        for w in teacher_ws
    ]
    r = ns["rollouts"](step)
    seqs = [torch.cat([p, q]) for p, q in zip(r.prompts, r.responses, strict=True)]
    rows = []
    for p, t in zip(r.prompts, seqs, strict=True):
        pos = torch.arange(t.numel())
        rows.append((pos >= p.numel() - 1) & (pos <= t.numel() - 2))
    adv = [float(a) for a in r.advantages]

    def policy_gradient(j: int, s_logits: torch.Tensor, t_logits: torch.Tensor, kl: torch.Tensor):
        labels = torch.cat([seqs[j][1:], torch.zeros(1, dtype=torch.int64)])
        logp = torch.log_softmax(s_logits, -1).gather(-1, labels[:, None])[:, 0]
        return -beta * adv[j] * logp

    return reference_step(
        student,
        teachers,
        [(int(k), t) for k, t in zip(r.teachers, seqs, strict=True)],
        vocab_size=128,
        masks=rows,
        extra=policy_gradient,
    )


def check_training_blocks(ns: Mapping[str, Any], *, beta: float = 0.1) -> None:
    """Run the checks of the module doc on every rank; raises ``AssertionError`` on a miss.

    ``MOPD_README_GRADS`` (a folder): the fp32 run writes each rank's GRPO gradients there, and
    the bf16 run compares its own with them."""
    bf16 = bool(ns["BF16"])
    rank = dist.get_rank()
    for p in ns["params"]:
        p.grad = None  # as a fresh student has them
    _, first = _step_grads(ns, 0, None)
    _, again = _step_grads(ns, 0, None)
    worst = max(
        float((a - b).norm() / b.norm().clamp(min=1e-30)) for a, b in zip(first, again, strict=True)
    )
    assert worst < 1e-6, f"the same batch at lr=0 gave gradients {worst:.3g} apart"
    print("README training loop: same gradients over two steps", flush=True)

    loss, grads = _step_grads(ns, 3, ns["grpo_forward_step"])
    ref_loss, ref_grads = _grpo_reference(ns, 3, beta)
    loss_tol, grad_tol = TOLERANCE[bf16]
    inner = _inner(ns["student"])
    smesh = ns["student_mesh"]
    c = smesh.coord(rank)
    problems = []
    if loss is not None:
        err = abs(loss - ref_loss) / abs(ref_loss)
        if err > loss_tol:
            problems.append(f"loss {loss:.6f} vs the float64 reference {ref_loss:.6f}")
    largest = 0.0
    offset = c.pp_rank * (2 // smesh.pp)
    for (name, p), got in zip(inner.named_parameters(), grads, strict=True):
        want = shard_of(ref_grads[_full_name(name, offset)], p, c.tp_rank, smesh.tp).float()
        err = float((got.float() - want).norm() / want.norm().clamp(min=1e-30))
        largest = max(largest, err)
        if err > grad_tol:
            problems.append(f"{name}: gradient {err:.2e} off the float64 reference")
    folder = os.environ.get("MOPD_README_GRADS")
    if folder:
        path = os.path.join(folder, f"grpo_grads_rank{rank}.pt")
        if not bf16:
            torch.save([g.float() for g in grads], path)
        elif os.path.exists(path):
            fp32 = torch.load(path)
            vs = max(
                float((a.float() - b).norm() / b.norm().clamp(min=1e-30))
                for a, b in zip(grads, fp32, strict=True)
            )
            print(f"README GRPO block in bf16: gradients {vs:.2e} from the fp32 run", flush=True)
            if vs > BF16_VS_FP32:
                problems.append(f"bf16 gradients {vs:.2e} from the fp32 run's")
    assert not problems, "; ".join(problems[:8])
    print(
        f"README GRPO block ({'bf16' if bf16 else 'fp32'}): loss and gradients match the float64 "
        f"reference (largest gradient error {largest:.2e})",
        flush=True,
    )
