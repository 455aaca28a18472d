"""One step's on-policy samples in, every rank's micro-batches out.

Why this file exists: in on-policy distillation the samples of a step are made where the
student generated them (its DP ranks, or one rank), while every rank of every model needs its
own micro-batches of them: the student's DP split of each micro-batch, in its packing, CP and SP;
each teacher's split of the samples routed to it, in its own. :class:`Rollouts` is what a rank
holds (a prompt and the student's response per sample, the teacher it is routed to, an optional
advantage); :func:`exchange_rollouts` agrees the step's samples on every rank and moves each
sample's token ids to the ranks that use them (one all-gather of small headers, one
all-to-all of the tokens, over the bridge's metadata group; bad input is the same ``ValueError``
on every rank before any token moves); :func:`rollout_micro_batches` builds one model's
micro-batches on this rank from the result. The student's row mask is derived from the response
(:func:`~mopd.mcore.batch.row_mask_from_response`), so no caller shifts a mask.

Assignment (the same on every rank): the step's samples in order (global rank, then each rank's
list), cut into ``M`` contiguous near-equal micro-batches; a model's DP rank ``d`` holds part
``d`` of each (:func:`~mopd.mcore.batch.split_samples`) of the samples it serves (a teacher: the
samples routed to it). Padded micro-batches of one model share one sequence length (the step's
longest sample, padded to the model's multiple) and one column count (the largest share, empty
columns all padding), so a pipelined model runs them without ``variable_seq_lengths``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mopd.bridge.groups import all_gather_flat
from mopd.bridge.layout import megatron_padded_length
from mopd.bridge.mesh import Mesh
from mopd.common import dist as cdist
from mopd.mcore.batch import MicroBatch, packed_micro_batch, padded_micro_batch, split_samples

__all__ = [
    "Rollouts",
    "StepSamples",
    "exchange_rollouts",
    "rollout_micro_batches",
    "step_assignment",
]

#: Header columns per sample: sample id (-1: numbered by the library), teacher, prompt length,
#: response length, the advantage's float64 bits.
_HEADER = 5


def _as_list(x: Any) -> list[Any]:
    if isinstance(x, torch.Tensor):
        return x.reshape(-1).tolist()
    return list(x)


@dataclass(frozen=True, kw_only=True, eq=False)
class Rollouts:
    """The on-policy samples of one step that this rank holds (possibly none).

    Attributes:
        prompts: one ``[P_j]`` integer tensor of token ids per sample (``P_j >= 1``).
        responses: one ``[R_j]`` integer tensor per sample: the tokens the student sampled after
            its prompt. Token-aligned: logit row ``p`` of the sequence ``prompt + response``
            counts exactly when token ``p + 1`` is a response token (the rows
            ``P_j - 1 .. P_j + R_j - 2``).
        teachers: the teacher each sample is routed to (its index in ``Distiller(teachers=)``),
            one per sample; ``None``: teacher 0.
        advantages: one float per sample (e.g. a group-normalized reward), handed to the loss
            per token as :attr:`~mopd.mcore.loss.TeacherSignal.advantage_T`; ``None``: none.
        sample_ids: one distinct non-negative id per sample over the whole step; ``None`` (on
            every rank): the library numbers the step's samples ``0 .. N-1`` in order (global
            rank, then this list).
    """

    prompts: Sequence[torch.Tensor]
    responses: Sequence[torch.Tensor]
    teachers: Sequence[int] | torch.Tensor | None = None
    advantages: Sequence[float] | torch.Tensor | None = None
    sample_ids: Sequence[int] | torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = len(self.prompts)
        for name in ("responses", "teachers", "advantages", "sample_ids"):
            value = getattr(self, name)
            if value is not None and len(_as_list(value)) != n:
                raise ValueError(
                    f"Rollouts: {n} prompts but {len(_as_list(value))} {name} (one per sample)"
                )

    def __len__(self) -> int:
        return len(self.prompts)

    def problems(self, *, vocab_size: int, num_teachers: int) -> list[str]:
        """What is wrong with these rollouts (``[]``: nothing), checked locally; one host sync
        for the token range of all of them."""
        out: list[str] = []
        ranged: list[tuple[str, int, torch.Tensor]] = []
        for what, seqs in (("prompt", self.prompts), ("response", self.responses)):
            for j, t in enumerate(seqs):
                if not isinstance(t, torch.Tensor) or t.dim() != 1:
                    shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    out.append(f"{what} {j} must be a 1-D tensor of token ids, got {shape}")
                elif t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
                    out.append(f"{what} {j} must hold integer token ids, got {t.dtype}")
                elif what == "prompt" and t.numel() == 0:
                    out.append(f"prompt {j} is empty (a sample needs at least one prompt token)")
                elif t.numel():
                    ranged.append((what, j, t))
        if ranged and not out:
            ends = torch.stack(
                [torch.stack([t.min(), t.max()]).to(torch.int64) for _, _, t in ranged]
            ).cpu()
            for (what, j, _), (lo, hi) in zip(ranged, ends.tolist(), strict=True):
                if lo < 0 or hi >= vocab_size:
                    out.append(
                        f"{what} {j}: token ids span [{lo}, {hi}], outside the vocabulary "
                        f"[0, {vocab_size})"
                    )
                    break
        if self.teachers is not None:
            bad = [k for k in _as_list(self.teachers) if not 0 <= int(k) < num_teachers]
            if bad:
                out.append(f"teachers {bad[:4]} outside [0, {num_teachers})")
        if self.advantages is not None:
            values = [float(a) for a in _as_list(self.advantages)]
            if not all(math.isfinite(a) for a in values):
                out.append(f"advantages must be finite, got {values[:4]}")
        if self.sample_ids is not None:
            ids = [int(s) for s in _as_list(self.sample_ids)]
            if any(s < 0 for s in ids) or len(set(ids)) != len(ids):
                out.append(f"sample_ids must be distinct and non-negative, got {ids[:8]}")
        return out

    def _headers(self) -> torch.Tensor:
        """``[n, 5]`` int64 (see ``_HEADER``)."""
        n = len(self)
        h = torch.full((n, _HEADER), -1, dtype=torch.int64)
        if not n:
            return h
        if self.sample_ids is not None:
            h[:, 0] = torch.as_tensor([int(s) for s in _as_list(self.sample_ids)])
        h[:, 1] = (
            0
            if self.teachers is None
            else torch.as_tensor([int(k) for k in _as_list(self.teachers)])
        )
        h[:, 2] = torch.as_tensor([int(t.numel()) for t in self.prompts])
        h[:, 3] = torch.as_tensor([int(t.numel()) for t in self.responses])
        if self.advantages is not None:
            adv = torch.as_tensor(
                [float(a) for a in _as_list(self.advantages)], dtype=torch.float64
            )
            h[:, 4] = adv.view(torch.int64)
        return h


@dataclass(frozen=True, kw_only=True, eq=False)
class StepSamples:
    """One step's samples as every rank agrees them, and the token ids this rank was sent.

    Attributes:
        sample_id_N: ``[N]`` int64 global sample ids, in step order.
        teacher_N: ``[N]`` int64 the teacher of each sample.
        prompt_len_N, length_N: ``[N]`` int64 prompt and whole-sequence lengths.
        advantage_N: ``[N]`` float64, or ``None`` when no rank gave advantages.
        tokens: ``sample index -> [L_j]`` int64 token ids of the samples this rank uses.
        num_micro_batches: ``M``.
    """

    sample_id_N: torch.Tensor
    teacher_N: torch.Tensor
    prompt_len_N: torch.Tensor
    length_N: torch.Tensor
    advantage_N: torch.Tensor | None
    tokens: dict[int, torch.Tensor]
    num_micro_batches: int

    @property
    def num_samples(self) -> int:
        return int(self.sample_id_N.numel())

    def response_mask(self, j: int) -> torch.Tensor:
        """``[L_j]`` bool, token-aligned: the response tokens of sample ``j``."""
        return torch.arange(int(self.length_N[j])) >= int(self.prompt_len_N[j])

    def micro_batch(self, i: int) -> list[int]:
        """Sample indices (into the ``_N`` tensors) of global micro-batch ``i``."""
        return split_samples(range(self.num_samples), self.num_micro_batches, i)


def step_assignment(
    teacher_N: torch.Tensor,
    num_micro_batches: int,
    *,
    mesh: Mesh,
    teacher: int | None,
) -> list[list[list[int]]]:
    """``[micro-batch][dp_rank] -> sample indices`` of one model (pure, the same on every rank).

    Args:
        teacher_N: ``[N]`` the teacher of each sample, in step order.
        mesh: the model's mesh (its ``dp`` splits each micro-batch).
        teacher: the teacher's index (it serves the samples routed to it), ``None`` for the
            student (it trains on every sample).
    """
    n = int(teacher_N.numel())
    owners = teacher_N.tolist()
    out = []
    for i in range(num_micro_batches):
        mb = split_samples(range(n), num_micro_batches, i)
        served = mb if teacher is None else [j for j in mb if owners[j] == teacher]
        out.append([split_samples(served, mesh.dp, d) for d in range(mesh.dp)])
    return out


def _users(
    teacher_N: torch.Tensor, m: int, meshes: Sequence[tuple[Mesh, int | None]]
) -> dict[int, set[int]]:
    """``sample index -> global ranks`` that use its tokens: every rank of each model's DP
    shard that holds it (its embedding, its labels)."""
    users: dict[int, set[int]] = {}
    for mesh, teacher in meshes:
        plan = step_assignment(teacher_N, m, mesh=mesh, teacher=teacher)
        ranks_of_dp: list[list[int]] = [[] for _ in range(mesh.dp)]
        for r in mesh.ranks:
            c = mesh.coord(r)
            assert c is not None
            ranks_of_dp[c.dp_rank].append(r)
        for per_dp in plan:
            for d, samples in enumerate(per_dp):
                for j in samples:
                    users.setdefault(j, set()).update(ranks_of_dp[d])
    return users


def exchange_rollouts(
    rollouts: Rollouts | None,
    *,
    num_micro_batches: int,
    student: Mesh,
    teachers: Sequence[Mesh],
    group: dist.ProcessGroup | None,
    vocab_size: int,
    timeout_s: float,
) -> StepSamples:
    """Agree one step's samples on every rank and send each sample's tokens where they are used.

    Collective over ``group`` (the bridge's metadata group, every rank of every mesh; gloo):
    one all-reduce (the verdict), two all-gathers (counts, then headers: five int64 per sample)
    and one all-to-all of the token ids (each rank receives only the samples its models use).

    Args:
        rollouts: what this rank holds (``None``: nothing).
        num_micro_batches: ``M``, the step's micro-batch count (every model's).
        student, teachers: the meshes (``teachers[k]`` serves the samples routed to ``k``).
        group: the process group over every rank of every mesh.
        vocab_size: the real vocabulary (token ids must lie in ``[0, vocab_size)``).
        timeout_s: the deadline of each collective.
    Raises:
        ValueError: the same on every rank of ``group``, before any token moves: malformed
            rollouts on any rank, sample ids given on some ranks only or given twice, advantages
            on some ranks only, fewer samples than ``M``.
    """
    rank = cdist.rank_in(group)
    rollouts = rollouts if rollouts is not None else Rollouts(prompts=[], responses=[])
    problems: list[str] = []
    if isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, int):
        problems.append(f"num_micro_batches must be an int, got {num_micro_batches!r}")
    elif num_micro_batches < 1:
        problems.append(f"num_micro_batches must be >= 1, got {num_micro_batches}")
    problems += [
        f"global rank {rank}: Rollouts: {p}"
        for p in rollouts.problems(vocab_size=vocab_size, num_teachers=len(teachers))
    ]
    cdist.same_verdict(problems, group=group, timeout_s=timeout_s, what="rollouts")
    members = cdist.group_ranks(group) if group is not None else [rank]
    world = len(members)
    mine = rollouts._headers()
    counts = torch.zeros(world, dtype=torch.int64)
    if world > 1:
        all_gather_flat(counts, torch.tensor([len(rollouts)]), group=group, timeout_s=timeout_s)
    else:
        counts[0] = len(rollouts)
    width = max(int(counts.max()), 1)
    block = torch.full((width, _HEADER), -1, dtype=torch.int64)
    block[: len(rollouts)] = mine
    every = torch.empty(world * width, _HEADER, dtype=torch.int64)
    if world > 1:
        all_gather_flat(every, block, group=group, timeout_s=timeout_s)
    else:
        every.copy_(block)
    rows = [every[r * width : r * width + int(counts[r])] for r in range(world)]
    h = torch.cat(rows) if rows else torch.empty(0, _HEADER, dtype=torch.int64)
    # from here on every rank holds the same headers: the same verdict, without collectives
    n = int(h.shape[0])
    owner_N = torch.cat([torch.full((int(counts[r]),), r, dtype=torch.int64) for r in range(world)])
    given_ids = [bool(int(counts[r])) and bool((rows[r][:, 0] >= 0).all()) for r in range(world)]
    with_samples = [r for r in range(world) if int(counts[r])]
    verdict: list[str] = []
    if with_samples and len({given_ids[r] for r in with_samples}) > 1:
        verdict.append(
            "sample_ids are given on global ranks "
            f"{[members[r] for r in with_samples if given_ids[r]]} but not on "
            f"{[members[r] for r in with_samples if not given_ids[r]]}: give them everywhere "
            "or nowhere"
        )
    adv_bits = h[:, 4]
    has_adv = [bool(int(counts[r])) and bool((rows[r][:, 4] != -1).any()) for r in range(world)]
    if with_samples and len({has_adv[r] for r in with_samples}) > 1:
        verdict.append(
            f"advantages are given on global ranks {[members[r] for r in with_samples if has_adv[r]]}"
            f" but not on {[members[r] for r in with_samples if not has_adv[r]]}: give them "
            "everywhere or nowhere"
        )
    ids = h[:, 0] if with_samples and given_ids[with_samples[0]] else torch.arange(n)
    if n and int(torch.unique(ids).numel()) != n:
        uniq, count = torch.unique(ids, return_counts=True)
        twice = uniq[count > 1][:4].tolist()
        verdict.append(f"sample ids {twice} are given more than once in the step")
    if isinstance(num_micro_batches, int) and n < num_micro_batches:
        verdict.append(
            f"the step has {n} samples for {num_micro_batches} micro-batches: every "
            "micro-batch needs at least one sample"
        )
    if verdict:
        raise ValueError("rollouts rejected: " + "; ".join(verdict))
    advantage_N = adv_bits.view(torch.float64).clone() if any(has_adv) else None
    teacher_N = h[:, 1].clone()
    length_N = h[:, 2] + h[:, 3]
    meshes: list[tuple[Mesh, int | None]] = [(student, None)]
    meshes += [(t, k) for k, t in enumerate(teachers)]
    users = _users(teacher_N, num_micro_batches, meshes)
    tokens = _send_tokens(
        rollouts,
        owner_N=owner_N,
        length_N=length_N,
        users=users,
        members=members,
        group=group,
        timeout_s=timeout_s,
    )
    return StepSamples(
        sample_id_N=ids.clone(),
        teacher_N=teacher_N,
        prompt_len_N=h[:, 2].clone(),
        length_N=length_N,
        advantage_N=advantage_N,
        tokens=tokens,
        num_micro_batches=num_micro_batches,
    )


def _send_tokens(
    rollouts: Rollouts,
    *,
    owner_N: torch.Tensor,
    length_N: torch.Tensor,
    users: dict[int, set[int]],
    members: Sequence[int],
    group: dist.ProcessGroup | None,
    timeout_s: float,
) -> dict[int, torch.Tensor]:
    """The all-to-all of token ids: each sample from the rank holding it to the ranks using
    it, int32, in sample order per pair. Returns this rank's ``sample index -> [L_j]`` int64."""
    rank = cdist.rank_in(group)
    index = {r: i for i, r in enumerate(members)}  # global rank -> rank in the group
    me = index.get(rank, -1)
    owners = owner_N.tolist()
    lengths = length_N.tolist()
    first = owners.index(me) if me in owners else 0
    mine = [
        torch.cat([p.reshape(-1), q.reshape(-1)])
        for p, q in zip(rollouts.prompts, rollouts.responses, strict=True)
    ]
    # this rank's samples on the host in one copy, as int32
    local = torch.cat(mine).to(torch.int32).cpu() if mine else torch.empty(0, dtype=torch.int32)
    pieces = list(torch.split(local, [int(t.numel()) for t in mine])) if mine else []
    send: list[list[torch.Tensor]] = [[] for _ in members]
    recv_counts = [0] * len(members)
    wanted: list[int] = []
    for j in range(len(owners)):
        who = users.get(j, set())
        if owners[j] == me:
            for r in sorted(who):
                send[index[r]].append(pieces[j - first])
        if rank in who:
            recv_counts[owners[j]] += int(lengths[j])
            wanted.append(j)
    send_counts = [sum(int(t.numel()) for t in parts) for parts in send]
    flat_send = (
        torch.cat([t for parts in send for t in parts])
        if any(send_counts)
        else torch.empty(0, dtype=torch.int32)
    )
    flat_recv = torch.empty(sum(recv_counts), dtype=torch.int32)
    if len(members) > 1:
        work = dist.all_to_all_single(
            flat_recv,
            flat_send,
            output_split_sizes=recv_counts,
            input_split_sizes=send_counts,
            group=group,
            async_op=True,
        )
        cdist.wait(work, device=flat_recv.device, timeout_s=timeout_s)
    else:
        flat_recv.copy_(flat_send)
    # received: per source rank, its samples in sample order
    starts = [0] * len(members)
    acc = 0
    for r, c in enumerate(recv_counts):
        starts[r] = acc
        acc += c
    out: dict[int, torch.Tensor] = {}
    for j in wanted:
        r = owners[j]
        n = int(lengths[j])
        out[j] = flat_recv[starts[r] : starts[r] + n].to(torch.int64)
        starts[r] += n
    return out


def rollout_micro_batches(
    samples: StepSamples,
    *,
    mesh: Mesh,
    teacher: int | None,
    packed: bool,
    sequence_parallel: bool,
    device: torch.device | str,
    max_sequence_length: int | None = None,
    rank: int | None = None,
) -> list[MicroBatch]:
    """This rank's micro-batches of one model, from the step's samples (see the module doc).

    Args:
        samples: from :func:`exchange_rollouts` (this rank holds the tokens it uses).
        mesh: the model's mesh (this rank must be in it).
        teacher: the teacher's index, ``None`` for the student (its micro-batches carry the
            row mask derived from each response, and ``labels``).
        packed: THD-packed micro-batches (:func:`~mopd.mcore.batch.packed_micro_batch`), else
            padded (:func:`~mopd.mcore.batch.padded_micro_batch`).
        sequence_parallel: the model runs SP (packed sequences and the padded length then
            divide by its TP size).
        max_sequence_length: the model's (learned positions): a longer step is a ``ValueError``.
        rank: this rank in the meshes' rank space (default: its global rank; a bridge across
            worlds: its bridge rank).
    Returns:
        ``M`` micro-batches; a DP rank with no sample in one gets a placeholder (all padding).
    """
    coord = mesh.coord(dist.get_rank() if rank is None else rank)
    if coord is None:
        raise ValueError(f"this rank is outside {mesh}")
    m = samples.num_micro_batches
    plan = step_assignment(samples.teacher_N, m, mesh=mesh, teacher=teacher)
    sp = mesh.tp if sequence_parallel and mesh.tp > 1 else 1
    student = teacher is None
    ids = samples.sample_id_N.tolist()
    longest = int(samples.length_N.max()) if samples.num_samples else 1
    # padded: one length for every micro-batch; packed: each sequence padded on its own
    seq_len = megatron_padded_length(longest, cp_size=mesh.cp, sp_size=sp)
    if max_sequence_length is not None and seq_len > max_sequence_length:
        raise ValueError(
            f"{'the student' if student else f'teacher {teacher}'}: the step's sequences need "
            f"{seq_len} positions (the longest sample is {longest} tokens, padded for cp="
            f"{mesh.cp}, sp={sp}) but the model has max_sequence_length={max_sequence_length}"
        )
    cols = max((len(part) for per_dp in plan for part in per_dp), default=1) or 1
    out = []
    for per_dp in plan:
        mine = per_dp[coord.dp_rank]
        seqs = [samples.tokens[j] for j in mine]
        masks = [samples.response_mask(j) for j in mine] if student else None
        if packed:
            out.append(
                packed_micro_batch(
                    [ids[j] for j in mine],
                    seqs,
                    response_masks=masks,
                    cp_size=mesh.cp,
                    cp_rank=coord.cp_rank,
                    sp_size=sp,
                    device=device,
                )
            )
            continue
        tokens_BS = torch.zeros(cols, seq_len, dtype=torch.int64)
        lengths = [0] * cols
        resp_BS = torch.zeros(cols, seq_len, dtype=torch.bool)
        for b, t in enumerate(seqs):
            tokens_BS[b, : t.numel()] = t
            lengths[b] = int(t.numel())
            if masks is not None:
                resp_BS[b, : t.numel()] = masks[b]
        if not mine:
            out.append(
                padded_micro_batch(
                    [], tokens_BS, cp_size=mesh.cp, cp_rank=coord.cp_rank, device=device
                )
            )
            continue
        # empty columns (a share smaller than the largest) are padding: their id is a real
        # sample's, but they hold no row of it
        col_ids = [ids[j] for j in mine] + [ids[mine[-1]]] * (cols - len(mine))
        out.append(
            padded_micro_batch(
                col_ids,
                tokens_BS,
                lengths=lengths,
                response_mask_BS=resp_BS if student else None,
                cp_size=mesh.cp,
                cp_rank=coord.cp_rank,
                device=device,
            )
        )
    return out
