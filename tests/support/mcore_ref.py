"""Direct (PP=1, TP=1) references for MOPD runs under megatron's schedule, in float64.

Why this file exists: the training-loop tests check that a distributed MOPD step (student and
teacher with TP, SP, CP, DP, PP, micro-batches) gives the loss and the gradients of the plain
computation: the student's full weights on the whole global batch against the teacher's own full
logits. This module loads full weights into sharded models (pipeline stages and TP shards), runs
that plain computation, and maps full gradients back to each rank's shards. The models are
megatron-core GPTModels or HybridModels (the same parameter names under ``decoder.layers.N``),
and :func:`bridged_row_problems` checks the rows a step moved against the teacher's own capture.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

__all__ = [
    "ExtraLoss",
    "Float64Check",
    "Reference",
    "bridged_row_problems",
    "compare_grads",
    "compare_loss",
    "load_sharded",
    "masked_padded_micro_batches",
    "reference_step",
    "shard_of",
    "unwrapped",
]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _full_name(name: str, layer_offset: int) -> str:
    m = _LAYER.match(name)
    if m is None:
        return name
    return f"decoder.layers.{int(m.group(1)) + layer_offset}." + name[m.end() :]


def shard_of(
    full: torch.Tensor,
    param: torch.nn.Parameter,
    tp_rank: int,
    tp_size: int,
    *,
    glu: bool = False,
) -> torch.Tensor:
    """This TP rank's shard of a full tensor (megatron's ``partition_dim`` chunks).

    ``glu``: the tensor is a gated linear unit's ``linear_fc1`` (SwiGLU), whose full rows are
    ``[gate; up]`` and whose shard on each TP rank is ``[gate shard; up shard]``."""
    if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
        dim = param.partition_dim
        if glu:
            halves = full.chunk(2, dim=dim)
            return torch.cat([h.chunk(tp_size, dim=dim)[tp_rank] for h in halves], dim=dim)
        return full.chunk(tp_size, dim=dim)[tp_rank]
    return full


def _is_glu(full_name: str, glu: bool) -> bool:
    """Whether ``full_name`` is a gated MLP's first linear (``glu``: the model is gated)."""
    return glu and full_name.endswith("mlp.linear_fc1.weight")


def load_sharded(
    model: torch.nn.Module,
    full: dict[str, torch.Tensor],
    *,
    tp_rank: int,
    tp_size: int,
    layer_offset: int,
    glu: bool = False,
) -> dict[str, str]:
    """Copy full tensors into a sharded model (this stage's layers, this TP rank's shards;
    ``glu``: its MLPs are gated, see :func:`shard_of`).

    Returns ``parameter name -> full name`` for mapping gradients back.
    """
    names: dict[str, str] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            fname = _full_name(name, layer_offset)
            p.copy_(shard_of(full[fname], p, tp_rank, tp_size, glu=_is_glu(fname, glu)))
            names[name] = fname
    return names


def _kl_rows(student_LV: torch.Tensor, teacher_LV: torch.Tensor) -> torch.Tensor:
    """``[L]`` float64 reverse KL(p_S || p_T) per token."""
    ls = torch.log_softmax(student_LV.double(), dim=-1)
    lt = torch.log_softmax(teacher_LV.double(), dim=-1)
    return (ls.exp() * (ls - lt)).sum(-1)


#: ``extra(sample_index, student_logits_LV, teacher_logits_LV, kl_L) -> [L]`` more per-token loss
#: (float64; the student's logits and the reverse KL carry gradient).
ExtraLoss = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def reference_step(
    student: torch.nn.Module,
    teachers: Sequence[torch.nn.Module],
    samples: Sequence[tuple[int, torch.Tensor]],
    *,
    vocab_size: int,
    masks: Sequence[torch.Tensor] | None = None,
    teacher_weights: Sequence[float] | None = None,
    extra: ExtraLoss | None = None,
) -> tuple[float, dict[str, torch.Tensor]]:
    """The plain MOPD step: mean loss per counted token over ``samples`` and its gradients.

    The loss of a counted token ``t`` of a sample routed to teacher ``k`` is
    ``teacher_weights[k] * KL_t + extra(...)_t`` (``KL_t`` the reverse KL to teacher ``k``); the
    step's loss is their sum over all counted tokens divided by their number.

    Args:
        student, teachers: PP=1, TP=1 GPTModels with the full weights (learned absolute
            positions); ``teachers[k]`` serves the samples routed to it.
        samples: ``(teacher index, [L] tokens)`` per sample of the global batch.
        masks: ``[L]`` bool per sample: the counted tokens (default: all).
        teacher_weights: one weight per teacher (default: all 1).
        extra: more per-token loss (see :data:`ExtraLoss`).
    Returns:
        ``(loss, {parameter name: full gradient})``.
    """
    student.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    for j, (k, tokens) in enumerate(samples):
        L = int(tokens.numel())
        mask = torch.ones(L, dtype=torch.bool) if masks is None else masks[j].bool()
        pos = torch.arange(L)[None]
        with torch.no_grad():
            t_logits = teachers[k](tokens[None], pos, None)[0, :, :vocab_size]
        s_logits = student(tokens[None], pos, None)[0, :, :vocab_size]
        kl = _kl_rows(s_logits, t_logits)
        w = 1.0 if teacher_weights is None else float(teacher_weights[k])
        per_token = w * kl
        if extra is not None:
            per_token = per_token + extra(j, s_logits.double(), t_logits.double(), kl)
        total = total + per_token[mask].sum()
        count += int(mask.sum())
    loss = total / max(count, 1)
    loss.backward()
    grads = {
        n: p.grad.detach().clone() for n, p in student.named_parameters() if p.grad is not None
    }
    return float(loss), grads


def compare_loss(loss: float, ref: float, *, rtol: float, worst: list[float]) -> list[str]:
    """A step's loss against the reference's: problems found (``[]``: none). ``worst`` is
    appended with the relative error (for reporting, as :func:`compare_grads` does)."""
    worst.append(abs(loss - ref) / abs(ref))
    if abs(loss - ref) > rtol * abs(ref):
        return [f"loss {loss:.8f} vs direct {ref:.8f}"]
    return []


def compare_grads(
    model: torch.nn.Module,
    names: dict[str, str],
    ref: dict[str, torch.Tensor],
    *,
    tp_rank: int,
    tp_size: int,
    rtol: float,
    worst: list[float] | None = None,
    glu: bool = False,
) -> list[str]:
    """Each parameter's ``main_grad`` against the reference's shard: problems found (``[]``: none).

    The error is the norm of the difference over the norm of the reference (parameters whose
    reference gradient is zero compare absolutely against ``rtol``). ``worst``: appended with
    the largest relative error seen (for reporting); ``glu``: the model's MLPs are gated.
    """
    problems = []
    largest = 0.0
    for name, p in model.named_parameters():
        got = getattr(p, "main_grad", None)
        got = p.grad if got is None else got
        fname = names[name]
        want = shard_of(ref[fname], p, tp_rank, tp_size, glu=_is_glu(fname, glu)).to(got.dtype)
        err = float((got - want).norm())
        scale = float(want.norm())
        if scale > 0:
            largest = max(largest, err / scale)
        if err > rtol * max(scale, 1e-12) and err > rtol * 1e-3:
            problems.append(f"{names[name]}: |main_grad - ref| = {err:.3e}, |ref| = {scale:.3e}")
    if worst is not None:
        worst.append(largest)
    return problems


class Reference(NamedTuple):
    """What :func:`reference_step` returns: the float64 loss and ``{full name: full gradient}``."""

    loss: float
    grads: dict[str, torch.Tensor]


class Float64Check:
    """The tier-2 loop tests' check of distributed steps against the float64 reference.

    One per test: :meth:`reference` runs the plain computation (:func:`reference_step`),
    :meth:`loss` and :meth:`grads` (or both at once, :meth:`compare`) compare a step with it
    within the stated tolerances (loss: relative ``loss_rtol``; each parameter's ``main_grad``:
    ``grad_rtol`` relative to its norm, see :func:`compare_grads`), collecting the problems and
    the worst errors over every step the test runs. :meth:`summary` says the worst errors (the
    line the tests print), :meth:`assert_ok` fails the test on any problem, or if no gradient
    was compared at all.
    """

    def __init__(self, *, loss_rtol: float = 1e-5, grad_rtol: float = 1e-4) -> None:
        self.loss_rtol = loss_rtol
        self.grad_rtol = grad_rtol
        self.problems: list[str] = []
        self.worst_loss: list[float] = []
        self.worst_grad: list[float] = []

    @staticmethod
    def reference(
        student: torch.nn.Module,
        teachers: Sequence[torch.nn.Module],
        samples: Sequence[tuple[int, torch.Tensor]],
        **kwargs: Any,
    ) -> Reference:
        """The plain step's loss and full gradients (:func:`reference_step`'s arguments)."""
        return Reference(*reference_step(student, teachers, samples, **kwargs))

    def _add(self, what: str, problems: list[str]) -> None:
        self.problems += [f"{what}: {p}" if what else p for p in problems]

    def loss(self, ref: tuple[float, Any], loss: float | None, *, what: str = "") -> None:
        """A step's loss (the student's last stage holds it: never ``None`` here) against the
        reference's, within ``loss_rtol``."""
        assert loss is not None, f"{what or 'the step'}: no loss on a rank that holds it"
        self._add(what, compare_loss(loss, ref[0], rtol=self.loss_rtol, worst=self.worst_loss))

    def grads(
        self,
        ref: tuple[float, dict[str, torch.Tensor]],
        model: torch.nn.Module,
        names: dict[str, str],
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        glu: bool = False,
        what: str = "",
    ) -> None:
        """Each parameter's ``main_grad`` of ``model`` (unwrapped from DDP here) against its shard
        of the reference gradient, within ``grad_rtol`` (:func:`compare_grads`)."""
        problems = compare_grads(
            unwrapped(model),
            names,
            ref[1],
            tp_rank=tp_rank,
            tp_size=tp_size,
            rtol=self.grad_rtol,
            worst=self.worst_grad,
            glu=glu,
        )
        self._add(what, problems)

    def compare(
        self,
        ref: tuple[float, dict[str, torch.Tensor]],
        *,
        loss: float | None,
        holds_loss: bool,
        model: torch.nn.Module,
        names: dict[str, str],
        tp_rank: int = 0,
        tp_size: int = 1,
        glu: bool = False,
        what: str = "",
    ) -> None:
        """:meth:`loss` where this rank ``holds_loss`` (the student's last stage), then
        :meth:`grads`."""
        if holds_loss:
            self.loss(ref, loss, what=what)
        self.grads(ref, model, names, tp_rank=tp_rank, tp_size=tp_size, glu=glu, what=what)

    def summary(self) -> str:
        """The worst errors seen: ``largest relative loss error 1.2e-07, gradient 3.4e-06``."""
        return (
            f"largest relative loss error {max(self.worst_loss, default=0.0):.2e}, "
            f"gradient {max(self.worst_grad, default=0.0):.2e}"
        )

    def assert_ok(self, *, limit: int = 20) -> None:
        """Fail on any problem found (the first ``limit`` named), or if no gradient was compared."""
        assert self.worst_grad, "no gradient was compared with the float64 reference"
        assert not self.problems, "\n".join(self.problems[:limit])


def unwrapped(model: Any) -> torch.nn.Module:
    """The model inside megatron's DDP wrapper."""
    return model.module if hasattr(model, "module") else model


def masked_padded_micro_batches(
    mesh: Any,
    rank: int,
    micro_batch_ids: Sequence[Sequence[int]],
    toks: dict[int, torch.Tensor],
    mask: dict[int, torch.Tensor],
    *,
    seq_len: int,
    masked: bool,
) -> list[Any]:
    """Global rank ``rank``'s padded micro-batches of ``mesh``: for each list of global sample ids,
    this DP rank's share, ``tokens_BS`` ``[B, seq_len]`` zero-padded from ``toks[s]`` ``[L_s]``,
    with the real lengths and (if ``masked``) the loss mask ``mask[s]`` ``[L_s]`` as ``[B, seq_len]``.
    """
    from mopd.mcore import padded_micro_batch, split_samples

    coord = mesh.coord(rank)
    mbs = []
    for ids in micro_batch_ids:
        mine = split_samples(list(ids), mesh.dp, coord.dp_rank)
        tokens_BS = torch.zeros(len(mine), seq_len, dtype=torch.int64)
        mask_BS = torch.zeros(len(mine), seq_len, dtype=torch.bool)
        for b, s in enumerate(mine):
            tokens_BS[b, : toks[s].numel()] = toks[s]
            mask_BS[b, : toks[s].numel()] = mask[s]
        mbs.append(
            padded_micro_batch(
                mine,
                tokens_BS,
                lengths=[toks[s].numel() for s in mine],
                row_mask_BS=mask_BS if masked else None,
            )
        )
    return mbs


def bridged_row_problems(
    step: Any,
    *,
    teacher: tuple[Any, Any, Any, Sequence[Any] | None],
    hidden_size: int,
    student: tuple[Any, Any, Sequence[Any] | None],
    stride: int,
) -> tuple[list[str], int]:
    """The rows a single-teacher step delivered against the teacher's own capture, bit for bit.

    Collective over the world (call it inside ``distiller.step(...)``, after the schedule).
    Reference: a second forward-only pass of the teacher over the same micro-batches
    (:func:`mopd.mcore.teacher.run_teacher`; deterministic on CPU ranks: the same bits as the
    step's pass), each captured ``[S, B, H]`` / ``[T, 1, H]`` row all-gathered with its key
    ``(sample, position)``. On each student last-stage rank, ``step.bridge_step.receive(i)[0]``
    must hold one row per counted token of its logits layout, in layout order, each equal to the
    reference row of that token, and ``owner(i)`` must be 0 exactly there.

    Args:
        teacher: ``(mesh, model, pg_collection, micro_batches)``, ``None`` entries off the mesh.
        student: ``(mesh, pg_collection, micro_batches)``, ``None`` entries off the mesh.
        stride: the key stride (at least the longest sequence).
    Returns:
        ``(problems, rows checked on this rank)``.
    """
    import torch.distributed as dist

    from mopd.bridge.layout import encode_keys
    from mopd.mcore import micro_batch_layout
    from mopd.mcore.teacher import run_teacher

    t_mesh, t_model, t_pg, t_mbs = teacher
    s_mesh, s_pg, s_mbs = student
    rank, world = dist.get_rank(), dist.get_world_size()
    seen: dict[int, torch.Tensor] = {}
    if t_mbs is not None:
        run_teacher(
            t_model,
            t_mbs,
            pg_collection=t_pg,
            on_hidden=lambda i, h: seen.__setitem__(i, h.clone()),
        )
    count = torch.tensor([len(s_mbs) if s_mbs is not None else len(t_mbs or [])])
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    problems: list[str] = []
    checked = 0
    tc = t_mesh.coord(rank)
    for i in range(int(count)):
        rows_NH = torch.zeros((0, hidden_size))
        keys_N = torch.zeros(0, dtype=torch.int64)
        if i in seen and tc is not None and tc.tp_rank == 0:  # one TP replica contributes
            lay = micro_batch_layout(t_mbs[i], rows="hidden", pg_collection=t_pg)
            rows_NH = seen[i].reshape(-1, hidden_size)
            keys_N = encode_keys(lay.sample_id_R, lay.position_R, stride)
        width = torch.tensor([keys_N.numel()])
        dist.all_reduce(width, op=dist.ReduceOp.MAX)
        n = int(width)
        pad_rows = torch.zeros((n, hidden_size), dtype=rows_NH.dtype)
        pad_keys = torch.full((n,), -1, dtype=torch.int64)
        pad_rows[: rows_NH.shape[0]] = rows_NH
        pad_keys[: keys_N.numel()] = keys_N
        all_rows = torch.empty((world * n, hidden_size), dtype=rows_NH.dtype)
        all_keys = torch.empty(world * n, dtype=torch.int64)
        dist.all_gather_into_tensor(all_rows, pad_rows)
        dist.all_gather_into_tensor(all_keys, pad_keys)
        if s_mbs is None or not s_mesh.is_last_stage(rank):
            continue
        valid = all_keys >= 0
        ref_keys, ref_rows = all_keys[valid], all_rows[valid]
        order = torch.argsort(ref_keys)
        ref_keys, ref_rows = ref_keys[order], ref_rows[order]
        lay = micro_batch_layout(s_mbs[i], rows="logits", pg_collection=s_pg)
        want_N = encode_keys(lay.sample_id_R, lay.position_R, stride)
        counted = want_N[want_N >= 0]
        got_NH = step.bridge_step.receive(i)[0]
        owner_N = step.bridge_step.owner(i).cpu()
        if not torch.equal(owner_N, torch.where(want_N >= 0, 0, -1)):
            problems.append(f"rank {rank} micro-batch {i}: owners differ from the layout's tokens")
        if got_NH.shape[0] != counted.numel():
            problems.append(
                f"rank {rank} micro-batch {i}: {got_NH.shape[0]} rows for {counted.numel()} tokens"
            )
            continue
        at = torch.searchsorted(ref_keys, counted).clamp(max=max(ref_keys.numel() - 1, 0))
        if counted.numel() and not torch.equal(ref_keys[at], counted):
            problems.append(f"rank {rank} micro-batch {i}: tokens missing from the reference")
            continue
        if not torch.equal(got_NH, ref_rows[at]):
            bad = int((got_NH != ref_rows[at]).any(dim=1).sum())
            problems.append(f"rank {rank} micro-batch {i}: {bad} of {counted.numel()} rows differ")
        checked += counted.numel()
    return problems, checked
