"""What the training examples are checked for, in one torchrun launch of 4 ranks.

Why this file exists: an example that runs is not yet an example that is right.
``tests/launch/test_readme.py`` runs every example as the docs print it; this module, launched
once (``torchrun --nproc-per-node 4 -m tests.support.readme_checks``), imports the training
examples' own functions (``build``, ``rollouts``, ``train_step``, ``grpo_forward_step``) and
checks what their reader trusts:

- ``examples/train.py``: the same batch at learning rate 0 twice hands the optimizer the same
  gradients (a hand-off that leaves ``p.grad`` aliased to ``main_grad`` adds the first
  micro-batch twice); the step's loss and every gradient equal a float64 reference built from
  the models' full weights that counts exactly the rows predicting response tokens (row ``p`` of
  a sample with prompt ``P`` and length ``L`` counts for ``P - 1 <= p <= L - 2``; a one-row
  shift, as a token-aligned mask taken for a row mask gives, fails it);
- the same under ``--bf16`` (``build(bf16=True)``), within bf16's tolerance, and against the
  fp32 job's gradients;
- ``examples/grpo.py`` (teachers on some ranks only, two DP replicas holding rollouts): the
  loss (KL plus ``beta * -A * log p``) and every gradient against the same kind of float64
  reference, empty responses included.

Each check prints one line per rank, which the test counts.
"""

from __future__ import annotations

import datetime
import importlib.util
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from tests.support.mcore_ref import reference_step, shard_of
from tests.support.megatron_cpu import build_gpt, full_state, tiny_config

__all__ = ["check_examples", "load_example"]

ROOT = Path(__file__).resolve().parents[2]
#: (loss, gradient) relative tolerances: fp32 models (TP reductions and chunking reorder sums),
#: and bf16 weights and activations against float64 on the same weights.
TOLERANCE = {False: (1e-5, 1e-4), True: (3e-2, 6e-2)}
#: bf16 gradients against the fp32 job's (other rounding of the same initial weights).
BF16_VS_FP32 = 1e-1
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def load_example(name: str) -> ModuleType:
    """``examples/<name>.py`` as a module (its ``main()`` not run)."""
    spec = importlib.util.spec_from_file_location(
        f"example_{name}", ROOT / "examples" / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _inner(model: Any) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


def _full_name(name: str, offset: int) -> str:
    m = _LAYER.match(name)
    return name if m is None else f"decoder.layers.{int(m.group(1)) + offset}." + name[m.end() :]


def _full_weights(model: Any, mesh: Any, pg: Any, num_layers: int) -> dict[str, torch.Tensor]:
    """Every parameter's full (TP1, PP1) tensor in fp32, on every rank (collective: world);
    ``model`` is ``None`` on ranks off ``mesh``."""
    c = mesh.coord(dist.get_rank())
    named: dict[str, torch.Tensor] = {}
    if c is not None:
        local = full_state(_inner(model), pg.tp)
        if c.tp_rank == 0 and c.dp_rank == 0 and c.cp_rank == 0:
            offset = c.pp_rank * (num_layers // mesh.pp)
            named = {_full_name(n, offset): t.float().clone() for n, t in local.items()}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, named)
    merged: dict[str, torch.Tensor] = {}
    for part in every:
        merged.update(part)
    return merged


def _full_model(weights: dict[str, torch.Tensor], vocab: int) -> torch.nn.Module:
    """A TP1, PP1 fp32 GPTModel as the examples' ``gpt()`` builds it, with ``weights``."""
    hidden = int(weights["embedding.word_embeddings.weight"].shape[1])
    model = build_gpt(
        tiny_config(num_layers=2, hidden_size=hidden, num_attention_heads=4),
        vocab_size=vocab,
        max_seq_len=32,
    )
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
    return model


def _step_grads(
    job: Any, train_step: Callable[..., Any], step: int, **kwargs: Any
) -> tuple[float | None, list[torch.Tensor]]:
    """``(mean loss, the gradients handed to the optimizer)`` of one step at learning rate 0."""
    for group in job.adam.param_groups:
        group["lr"] = 0.0
    seen: list[list[torch.Tensor]] = []
    hook = job.adam.register_step_pre_hook(
        lambda opt, args, kw: seen.append(
            [p.grad.clone() for g in opt.param_groups for p in g["params"]]
        )
    )
    try:
        mopd = train_step(job, step, **kwargs)
    finally:
        hook.remove()
    return mopd.mean_loss(), seen[0]


def _reference(
    job: Any, rollouts: Sequence[Any], vocab: int, extra: Any = None
) -> tuple[float, dict[str, torch.Tensor]]:
    """The float64 reference of a step over ``rollouts`` (every holder's, in global order):
    the KL to each sample's teacher (plus ``extra``) over the rows ``P - 1 .. L - 2``."""
    d = job.distiller
    student_w = _full_weights(d.student.model, d.student.mesh, d.student.pg_collection, 2)
    teacher_ws = [_full_weights(t.model, t.mesh, t.pg_collection, 2) for t in d.teachers]
    student = _full_model(student_w, vocab)
    teachers = [_full_model(w, vocab).eval() for w in teacher_ws]
    seqs, rows, routed = [], [], []
    for r in rollouts:
        for j, (p, q) in enumerate(zip(r.prompts, r.responses, strict=True)):
            t = torch.cat([p, q])
            pos = torch.arange(t.numel())
            seqs.append(t)
            rows.append((pos >= p.numel() - 1) & (pos <= t.numel() - 2))
            routed.append(0 if r.teachers is None else int(r.teachers[j]))
    return reference_step(
        student,
        teachers,
        list(zip(routed, seqs, strict=True)),
        vocab_size=vocab,
        masks=rows,
        extra=None if extra is None else extra(seqs),
    )


def _compare(
    job: Any, loss: float | None, grads: list[torch.Tensor], ref: tuple[float, dict], bf16: bool
) -> tuple[list[str], float]:
    """Problems of a step's loss and gradients against the reference; the largest error."""
    ref_loss, ref_grads = ref
    loss_tol, grad_tol = TOLERANCE[bf16]
    problems = []
    if loss is not None and abs(loss - ref_loss) > loss_tol * abs(ref_loss):
        problems.append(f"loss {loss:.6f} vs the float64 reference {ref_loss:.6f}")
    mesh = job.distiller.student.mesh
    c = mesh.coord(dist.get_rank())
    offset = c.pp_rank * (2 // mesh.pp)
    largest = 0.0
    inner = _inner(job.student)
    for (name, p), got in zip(inner.named_parameters(), grads, strict=True):
        want = shard_of(ref_grads[_full_name(name, offset)], p, c.tp_rank, mesh.tp).float()
        err = float((got.float() - want).norm() / want.norm().clamp(min=1e-30))
        largest = max(largest, err)
        if err > grad_tol:
            problems.append(f"{name}: gradient {err:.2e} off the float64 reference")
    return problems, largest


def _check_train(train: ModuleType, *, bf16: bool, fp32_grads: list | None) -> list:
    """examples/train.py: lr=0 twice, then the step against float64 (and the fp32 job)."""
    what = f"examples/train.py ({'bf16' if bf16 else 'fp32'})"
    job = train.build(bf16=bf16)
    _, first = _step_grads(job, train.train_step, 0)
    _, again = _step_grads(job, train.train_step, 0)
    worst = max(
        float((a - b).norm() / b.norm().clamp(min=1e-30)) for a, b in zip(first, again, strict=True)
    )
    assert worst < 1e-6, f"{what}: the same batch at lr=0 gave gradients {worst:.3g} apart"
    print(f"{what}: same gradients over two steps", flush=True)
    loss, grads = _step_grads(job, train.train_step, 3)
    held = train.rollouts(3)
    problems, largest = _compare(job, loss, grads, _reference(job, [held], train.VOCAB), bf16)
    if fp32_grads is not None:
        vs = max(
            float((a.float() - b).norm() / b.norm().clamp(min=1e-30))
            for a, b in zip(grads, fp32_grads, strict=True)
        )
        print(f"{what}: gradients {vs:.2e} from the fp32 job's", flush=True)
        if vs > BF16_VS_FP32:
            problems.append(f"bf16 gradients {vs:.2e} from the fp32 job's")
    assert not problems, f"{what}: " + "; ".join(problems[:8])
    print(
        f"{what}: loss and gradients match the float64 reference (largest gradient error "
        f"{largest:.2e})",
        flush=True,
    )
    job.distiller.close()
    return [g.float() for g in grads]


def _check_grpo(grpo: ModuleType) -> None:
    """examples/grpo.py's step against float64: KL plus ``beta * -A * log p(token p + 1)``."""
    job = grpo.build()
    step = 3
    loss, grads = _step_grads(job, grpo.train_step, step)
    held = [grpo.rollouts(step, d) for d in range(job.student_mesh.dp)]  # global order
    adv = [float(a) for r in held for a in r.advantages]

    def policy_gradient(seqs: list[torch.Tensor]) -> Any:
        def extra(j: int, s_logits: torch.Tensor, t_logits: torch.Tensor, kl: torch.Tensor) -> Any:
            labels = torch.cat([seqs[j][1:], torch.zeros(1, dtype=torch.int64)])
            logp = torch.log_softmax(s_logits, -1).gather(-1, labels[:, None])[:, 0]
            return -grpo.BETA * adv[j] * logp

        return extra

    ref = _reference(job, held, grpo.VOCAB, extra=policy_gradient)
    problems, largest = _compare(job, loss, grads, ref, False)
    assert not problems, "examples/grpo.py: " + "; ".join(problems[:8])
    print(
        f"examples/grpo.py: loss and gradients match the float64 reference (largest gradient "
        f"error {largest:.2e})",
        flush=True,
    )
    job.distiller.close()


def check_examples() -> None:
    """Every check of the module doc, on every rank; raises ``AssertionError`` on a miss."""
    train, grpo = load_example("train"), load_example("grpo")
    fp32 = _check_train(train, bf16=False, fp32_grads=None)
    _check_train(train, bf16=True, fp32_grads=fp32)
    _check_grpo(grpo)


def main() -> None:
    from mopd.mcore import cpu

    cpu.apply()  # before megatron-core is imported: its fusions plain
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    try:
        parallel_state.initialize_model_parallel()
        model_parallel_cuda_manual_seed(0)
        check_examples()
        parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
