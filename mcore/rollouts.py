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

import dataclasses
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from mopd.bridge.errors import BridgeError
from mopd.bridge.layout import megatron_padded_length
from mopd.bridge.mesh import Mesh
from mopd.common import dist as cdist
from mopd.common.dist import all_gather_flat
from mopd.mcore.batch import (
    MicroBatch,
    _is_int,
    _shown,
    packed_micro_batch,
    padded_micro_batch,
    sample_id_problem,
    split_samples,
)

if TYPE_CHECKING:
    from mopd.bridge.faults import Faults

__all__ = [
    "Rollouts",
    "StepSamples",
    "exchange_rollouts",
    "rollout_micro_batches",
    "rollouts_problems",
    "step_assignment",
]

_T = TypeVar("_T")

#: Header columns per sample: sample id (-1: numbered by the library), teacher, prompt length,
#: response length, the advantage's float64 bits.
_HEADER = 5
#: Values a message shows of a field at most.
_SHOWN = 8


def _entries(x: Any) -> list[Any]:
    """The entries of a per-sample field, as given: a tensor's elements (``.tolist()``; it is
    on a real device, checked first), else the sequence's items."""
    if isinstance(x, torch.Tensor):
        return x.reshape(-1).tolist()
    return list(x)


def _copy(x: Any) -> Any:
    """A per-sample field as the :class:`Rollouts` keeps it: a tensor cloned, a sequence as a
    tuple (so the caller's later changes to its own list or tensor do not reach the step);
    anything else as it is (refused by :meth:`Rollouts.problems`)."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, list | tuple):
        return tuple(x)
    return x


def _kind(v: Any) -> str:
    """How a message names a value's type: ``float``, ``bool``, ``torch.float32`` (an element of
    a tensor, or a 0-d tensor), ``str``."""
    if isinstance(v, torch.Tensor):
        return str(v.dtype)
    return type(v).__name__


def _is_real(v: Any) -> bool:
    """A real number, not a bool: an int or a float (Python, NumPy), or a 0-d real tensor."""
    if isinstance(v, torch.Tensor):
        return v.dim() == 0 and not v.dtype.is_complex and v.dtype != torch.bool
    return isinstance(v, numbers.Real) and not isinstance(v, bool | np.bool_)


def _field_problems(
    name: str, value: Any, n: int, *, element: str, ok: Callable[[Any], bool]
) -> tuple[list[str], list[Any] | None]:
    """``(problems, entries)`` of a per-sample field (``None``: not given): one entry per sample,
    each passing ``ok`` (``element`` names what they must be); ``entries`` is ``None`` when the
    field cannot be read. Never raises."""
    if value is None:
        return [], None
    if isinstance(value, torch.Tensor):
        if value.device.type == "meta":
            return [f"{name} is a tensor on the meta device (it holds no values)"], None
        if (
            value.dtype == torch.bool
            or value.dtype.is_complex
            or (element == "an integer" and value.dtype.is_floating_point)
        ):
            return [f"{name} is a {value.dtype} tensor: give {element} per sample"], None
    elif not isinstance(value, Sequence) or isinstance(value, str | bytes):
        return [
            f"{name} is a {type(value).__name__}: give {element} per sample (a list or a tensor)"
        ], None
    try:
        entries = _entries(value)
    except Exception as exc:  # an object that claims to be a sequence but is not
        return [f"{name} cannot be read ({type(exc).__name__}: {exc})"], None
    if len(entries) != n:
        return [f"{n} prompts but {len(entries)} {name} (one per sample)"], None
    for j, v in enumerate(entries):
        if not ok(v):
            return [f"{name}[{j}] is {_shown(v)} ({_kind(v)}): give {element} per sample"], None
    return [], entries


@dataclass(frozen=True, kw_only=True, eq=False)
class Rollouts:
    """The on-policy samples of one step that this rank holds (possibly none).

    Building one never raises: what is wrong with it (:meth:`problems`) is refused by
    :meth:`~mopd.mcore.Distiller.step` as the same ``ValueError`` on every rank, before any
    token moves. The lists are copied and tensors of the per-sample fields cloned at
    construction (changing the caller's list or tensor afterwards does not change the
    rollouts); the token tensors are read at the step.

    Attributes:
        prompts: one ``[P_j]`` integer tensor of token ids per sample (``P_j >= 1``).
        responses: one ``[R_j]`` integer tensor per sample: the tokens the student sampled after
            its prompt. Token-aligned: logit row ``p`` of the sequence ``prompt + response``
            counts exactly when token ``p + 1`` is a response token (the rows
            ``P_j - 1 .. P_j + R_j - 2``). Every token tensor of one ``Rollouts`` on one device.
        teachers: the teacher each sample is routed to (its index in ``Distiller(teachers=)``):
            integers (not bools or floats), one per sample; ``None``: teacher 0.
        advantages: one finite real number per sample (e.g. a group-normalized reward; not a
            bool), handed to the loss per token as
            :attr:`~mopd.mcore.loss.TeacherSignal.advantage_T`; ``None``: none.
        sample_ids: one distinct integer id per sample over the whole step, any of
            ``0 <= id < 2**63`` (every non-negative int64; the loss does not depend on their
            values); ``None`` (on every rank): the library numbers the step's samples
            ``0 .. N-1`` in order (global rank, then this list).
    """

    prompts: Sequence[torch.Tensor]
    responses: Sequence[torch.Tensor]
    teachers: Sequence[int] | torch.Tensor | None = None
    advantages: Sequence[float] | torch.Tensor | None = None
    sample_ids: Sequence[int] | torch.Tensor | None = None

    def __post_init__(self) -> None:
        for name in ("prompts", "responses", "teachers", "advantages", "sample_ids"):
            object.__setattr__(self, name, _copy(getattr(self, name)))

    def __len__(self) -> int:
        p = self.prompts
        return len(p) if isinstance(p, Sequence) and not isinstance(p, str | bytes) else 0

    def problems(self, *, vocab_size: int, num_teachers: int) -> list[str]:
        """What is wrong with these rollouts (``[]``: nothing), checked locally; never raises.
        Each problem names the field, the sample's index and the value. One host sync for the
        token range of all of them."""
        seqs: dict[str, Any] = {"prompts": self.prompts, "responses": self.responses}
        for what, value in seqs.items():
            if not isinstance(value, Sequence) or isinstance(value, str | bytes):
                return [
                    f"{what} is a {type(value).__name__}: give one 1-D tensor of token ids per "
                    "sample (a list)"
                ]
        n = len(self.prompts)
        if len(self.responses) != n:
            return [f"{n} prompts but {len(self.responses)} responses (one per sample)"]
        out: list[str] = []
        ranged: list[tuple[str, int, torch.Tensor]] = []
        devices: dict[str, str] = {}
        for what, group in seqs.items():
            one = what[:-1]
            for j, t in enumerate(group):
                if not isinstance(t, torch.Tensor) or t.dim() != 1:
                    shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    out.append(f"{one} {j} must be a 1-D tensor of token ids, got {shape}")
                elif t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
                    out.append(f"{one} {j} must hold integer token ids, got {t.dtype}")
                elif t.device.type == "meta":
                    out.append(f"{one} {j} is on the meta device (it holds no token ids)")
                elif what == "prompts" and t.numel() == 0:
                    out.append(f"prompt {j} is empty (a sample needs at least one prompt token)")
                else:
                    devices.setdefault(str(t.device), f"{one} {j}")
                    if t.numel():
                        ranged.append((one, j, t))
        if len(devices) > 1:
            out.append(
                "token tensors on several devices ("
                + ", ".join(f"{w} on {d}" for d, w in devices.items())
                + "): put every prompt and response of a rank on one device"
            )
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
        bad, teachers = _field_problems(
            "teachers", self.teachers, n, element="an integer", ok=_is_int
        )
        out += bad
        for j, k in enumerate(teachers or ()):
            if not 0 <= int(k) < num_teachers:
                out.append(
                    f"teachers[{j}] is {int(k)}, outside [0, {num_teachers}) (the index of "
                    "a teacher in Distiller(teachers=))"
                )
                break
        bad, advantages = _field_problems(
            "advantages", self.advantages, n, element="a real number", ok=_is_real
        )
        out += bad
        for j, a in enumerate(advantages or ()):
            try:
                finite = math.isfinite(float(a))
            except OverflowError:  # an int past float64
                finite = False
            if not finite:
                out.append(f"advantages[{j}] is {_shown(a)}: advantages must be finite")
                break
        bad, ids = _field_problems(
            "sample_ids", self.sample_ids, n, element="an integer", ok=_is_int
        )
        out += bad
        wrong = sample_id_problem(self.sample_ids) if ids is not None else None
        if wrong is not None:
            out.append(wrong)
        elif ids is not None:
            values = [int(s) for s in ids]
            seen: dict[int, int] = {}
            for j, s in enumerate(values):
                if s in seen:
                    out.append(
                        f"sample_ids[{seen[s]}] and sample_ids[{j}] are both {s} (one id per "
                        "sample)"
                    )
                    break
                seen[s] = j
        return out

    def _headers(self) -> torch.Tensor:
        """``[n, 5]`` int64 (see ``_HEADER``); for rollouts without :meth:`problems`."""
        n = len(self)
        h = torch.full((n, _HEADER), -1, dtype=torch.int64)
        if not n:
            return h
        if self.sample_ids is not None:
            h[:, 0] = torch.as_tensor([int(s) for s in _entries(self.sample_ids)])
        h[:, 1] = (
            0
            if self.teachers is None
            else torch.as_tensor([int(k) for k in _entries(self.teachers)])
        )
        h[:, 2] = torch.as_tensor([int(t.numel()) for t in self.prompts])
        h[:, 3] = torch.as_tensor([int(t.numel()) for t in self.responses])
        if self.advantages is not None:
            adv = torch.as_tensor(
                [float(a) for a in _entries(self.advantages)], dtype=torch.float64
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


def rollouts_problems(
    rollouts: Any,
    num_micro_batches: Any,
    *,
    rank: int,
    vocab_size: int,
    num_teachers: int,
) -> list[str]:
    """What this rank gives the step that is wrong (``[]``: nothing); local, never raises.

    ``rollouts``: a :class:`Rollouts`, ``None`` (this rank holds nothing), or the exception a
    rank got building its rollouts (passed on, so every rank refuses the step alike);
    ``num_micro_batches``: ``M``, a positive int (``None``: not given)."""
    out: list[str] = []
    if num_micro_batches is None:
        out.append(
            f"global rank {rank}: num_micro_batches is missing: "
            "Distiller.step(rollouts, num_micro_batches=M) on every rank"
        )
    elif isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, int):
        out.append(
            f"global rank {rank}: num_micro_batches must be an int, got "
            f"{num_micro_batches!r} ({type(num_micro_batches).__name__})"
        )
    elif num_micro_batches < 1:
        out.append(f"global rank {rank}: num_micro_batches must be >= 1, got {num_micro_batches}")
    if isinstance(rollouts, BaseException):
        out.append(
            f"global rank {rank} could not build its rollouts: "
            f"{type(rollouts).__name__}: {rollouts}"
        )
    elif rollouts is not None and not isinstance(rollouts, Rollouts):
        out.append(
            f"global rank {rank} passed a {type(rollouts).__name__}, not a Rollouts (or None, "
            "or the exception that building them raised)"
        )
    elif rollouts is not None:
        try:
            found = rollouts.problems(vocab_size=vocab_size, num_teachers=num_teachers)
        except Exception as exc:  # a check that should not raise: still a verdict, not a hang
            found = [f"checking them raised {type(exc).__name__}: {exc}"]
        out += [f"global rank {rank}: Rollouts: {p}" for p in found]
    return out


def exchange_rollouts(
    rollouts: Rollouts | BaseException | None,
    *,
    num_micro_batches: int | None,
    student: Mesh,
    teachers: Sequence[Mesh],
    group: dist.ProcessGroup | None,
    vocab_size: int,
    timeout_s: float,
    faults: Faults | None = None,
    problems: Sequence[str] = (),
) -> StepSamples:
    """Agree one step's samples on every rank and send each sample's tokens where they are used.

    Collective over ``group`` (the bridge's metadata group, every rank of every mesh; gloo):
    one all-reduce (the verdict), two all-gathers (counts, then headers: five int64 per sample)
    and one all-to-all of the token ids (each rank receives only the samples its models use).

    Args:
        rollouts: what this rank holds (``None``: nothing; an exception: building them failed,
            see :func:`rollouts_problems`).
        num_micro_batches: ``M``, the step's micro-batch count (every model's).
        student, teachers: the meshes (``teachers[k]`` serves the samples routed to ``k``).
        group: the process group over every rank of every mesh.
        vocab_size: the real vocabulary (token ids must lie in ``[0, vocab_size)``).
        timeout_s: the deadline of each collective.
        faults: the bridge's failure verdicts: each collective runs under them (a
            failed or late peer is a named :class:`~mopd.bridge.errors.BridgeTimeoutError` /
            :class:`~mopd.bridge.errors.BridgeCommError` in the phase "the rollouts exchange",
            and the bridge refuses from then on), and an error of this rank past the verdict
            is published as the job's first failure. ``None``: raw errors.
        problems: more of this rank's problems, found by the caller (shared in the verdict).
    Raises:
        ValueError: the same on every rank of ``group``, before any token moves: malformed
            rollouts (or not a :class:`Rollouts`, or the exception building them raised) or a
            bad ``num_micro_batches`` on any rank, sample ids given on some ranks only or given
            twice, advantages on some ranks only, fewer samples than ``M``.
    """
    rank = cdist.rank_in(group)
    members = cdist.group_ranks(group) if group is not None else [rank]
    mine = rollouts_problems(
        rollouts, num_micro_batches, rank=rank, vocab_size=vocab_size, num_teachers=len(teachers)
    )
    problems = [*problems, *mine]

    def timed(fn: Callable[[], _T], detail: str) -> _T:
        if faults is None:
            return fn()
        return faults.timed(fn, f"the rollouts exchange ({detail}) over global ranks {members}")

    def verdict() -> ValueError | None:
        try:
            cdist.same_verdict(problems, group=group, timeout_s=timeout_s, what="rollouts")
        except ValueError as exc:
            return exc
        return None

    refused = timed(verdict, "its verdict")
    if refused is not None:
        raise refused  # the same on every rank
    assert isinstance(rollouts, Rollouts | None) and isinstance(num_micro_batches, int)
    held = rollouts if rollouts is not None else Rollouts(prompts=[], responses=[])
    tokens: dict[int, torch.Tensor] = {}
    try:
        samples, owner_N, problems = _agree_headers(
            held, num_micro_batches, group=group, members=members, timeout_s=timeout_s, timed=timed
        )
        if not problems:
            meshes: list[tuple[Mesh, int | None]] = [(student, None)]
            meshes += [(t, k) for k, t in enumerate(teachers)]
            tokens = _send_tokens(
                held,
                owner_N=owner_N,
                length_N=samples.length_N,
                users=_users(samples.teacher_N, num_micro_batches, meshes),
                members=members,
                group=group,
                timeout_s=timeout_s,
                timed=timed,
            )
    except BridgeError:
        raise  # named by ``timed`` (the bridge refuses from now on)
    except BaseException as exc:  # this rank's own failure past the verdict: the job's first
        if faults is not None:
            faults.mark_failed(exc)
        raise
    if problems:  # from the headers every rank holds: the same on every rank
        raise ValueError("rollouts rejected: " + "; ".join(problems))
    return dataclasses.replace(samples, tokens=tokens)


def _agree_headers(
    rollouts: Rollouts,
    num_micro_batches: int,
    *,
    group: dist.ProcessGroup | None,
    members: Sequence[int],
    timeout_s: float,
    timed: Callable[[Callable[[], Any], str], Any],
) -> tuple[StepSamples, torch.Tensor, list[str]]:
    """Every rank's headers (two all-gathers) and what they agree: ``(the step's samples
    without tokens, [N] the group rank holding each sample, the verdict's problems)``, the
    same on every rank."""
    world = len(members)
    mine = rollouts._headers()
    counts = torch.zeros(world, dtype=torch.int64)
    if world > 1:
        timed(
            lambda: all_gather_flat(
                counts, torch.tensor([len(rollouts)]), group=group, timeout_s=timeout_s
            ),
            "the counts' all-gather",
        )
    else:
        counts[0] = len(rollouts)
    width = max(int(counts.max()), 1)
    block = torch.full((width, _HEADER), -1, dtype=torch.int64)
    block[: len(rollouts)] = mine
    every = torch.empty(world * width, _HEADER, dtype=torch.int64)
    if world > 1:
        timed(
            lambda: all_gather_flat(every, block, group=group, timeout_s=timeout_s),
            "the headers' all-gather",
        )
    else:
        every.copy_(block)
    rows = [every[r * width : r * width + int(counts[r])] for r in range(world)]
    h = torch.cat(rows) if rows else torch.empty(0, _HEADER, dtype=torch.int64)
    n = int(h.shape[0])
    owner_N = torch.cat([torch.full((int(counts[r]),), r, dtype=torch.int64) for r in range(world)])
    given_ids = [bool(int(counts[r])) and bool((rows[r][:, 0] >= 0).all()) for r in range(world)]
    with_samples = [r for r in range(world) if int(counts[r])]
    verdict: list[str] = []
    mixed_ids = len({given_ids[r] for r in with_samples}) > 1
    if mixed_ids:
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
    given = bool(with_samples) and given_ids[with_samples[0]] and not mixed_ids
    ids = h[:, 0] if given else torch.arange(n)
    if given and int(torch.unique(ids).numel()) != n:  # library-numbered ids are distinct
        uniq, count = torch.unique(ids, return_counts=True)
        twice = uniq[count > 1][:4]
        by = sorted({members[int(r)] for r in owner_N[torch.isin(ids, twice)].tolist()})
        verdict.append(
            f"sample ids {twice.tolist()} are given more than once in the step (by global "
            f"ranks {by})"
        )
    if n < num_micro_batches:
        verdict.append(
            f"the step has {n} samples for {num_micro_batches} micro-batches: every "
            "micro-batch needs at least one sample"
        )
    samples = StepSamples(
        sample_id_N=ids.clone(),
        teacher_N=h[:, 1].clone(),
        prompt_len_N=h[:, 2].clone(),
        length_N=h[:, 2] + h[:, 3],
        advantage_N=adv_bits.view(torch.float64).clone() if any(has_adv) else None,
        tokens={},
        num_micro_batches=num_micro_batches,
    )
    return samples, owner_N, verdict


def _send_tokens(
    rollouts: Rollouts,
    *,
    owner_N: torch.Tensor,
    length_N: torch.Tensor,
    users: dict[int, set[int]],
    members: Sequence[int],
    group: dist.ProcessGroup | None,
    timeout_s: float,
    timed: Callable[[Callable[[], Any], str], Any],
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

        def all_to_all() -> None:
            work = dist.all_to_all_single(
                flat_recv,
                flat_send,
                output_split_sizes=recv_counts,
                input_split_sizes=send_counts,
                group=group,
                async_op=True,
            )
            cdist.wait(work, device=flat_recv.device, timeout_s=timeout_s)

        timed(all_to_all, "the tokens' all-to-all")
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
