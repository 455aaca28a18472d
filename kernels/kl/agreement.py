"""The KL's debug agreement: the TP ranks of one call check that they were given the same job.

Why this file exists: the TP ranks of one KL call must agree on tokens, mask and teacher index
(they shard the vocabulary, not the tokens), and an argument that is wrong on one rank only
raises there only, leaving the others waiting in the first all-reduce. In debug mode one extra
MAX all-reduce (:func:`check_agreement`) carries every rank's signature and whether any rank's
validation failed, and :func:`mopd.common.dist.same_verdict` makes every rank raise the same
``ValueError`` instead of hanging. The collectives themselves are the library's one timed
all-reduce and verdict, in :mod:`mopd.common.dist`; what is here is what the KL agrees on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from mopd.common.dist import all_reduce, group_device, same_verdict

if TYPE_CHECKING:
    from mopd.kernels.kl.prepare import KLJob

__all__ = [
    "SIGNATURE_LEN",
    "check_agreement",
    "collective_device",
    "group_position",
    "job_signature",
]

#: Entries of :func:`job_signature`.
SIGNATURE_LEN = 7


def group_position(group: dist.ProcessGroup | None) -> tuple[int, int] | None:
    """``(tp_size, rank_in_group)`` when this rank can take part in a collective on ``group``."""
    if group is None or not dist.is_initialized():
        return None
    rank_in_group = dist.get_rank(group)
    if rank_in_group < 0:
        return None
    return dist.get_world_size(group), rank_in_group


def collective_device(x_TX: object, group: dist.ProcessGroup) -> torch.device:
    """Where the debug agreement vector lives: the student's device, else the group's kind."""
    if isinstance(x_TX, torch.Tensor):
        return x_TX.device
    return group_device(group)


def job_signature(
    job: KLJob, loss_mask_T: torch.Tensor | None, index_T: torch.Tensor | None
) -> list[int]:
    """What the TP ranks must agree on: ``T``, active tokens, teachers, ``V_local``, chunk, and
    position-weighted sums of the mask and the teacher index (one host sync each)."""
    dev = job.weight_N.device
    pos_T = torch.arange(1, job.T + 1, device=dev, dtype=torch.int64)
    mask_sig = 0 if loss_mask_T is None else int(((loss_mask_T != 0).to(torch.int64) * pos_T).sum())
    index_sig = 0 if index_T is None else int((index_T.to(torch.int64) * pos_T).sum())
    return [job.T, job.n_active, len(job.teachers), job.v_local, job.chunk, mask_sig, index_sig]


def check_agreement(
    group: dist.ProcessGroup,
    position: tuple[int, int],
    device: torch.device,
    timeout_s: float | None,
    *,
    signature: list[int] | None = None,
    nonfinite: tuple[str, ...] = (),
    failure: ValueError | None = None,
) -> None:
    """Debug mode: the TP ranks agree on the call; raises the same ValueError on every rank.

    ``position`` is ``(tp_size, rank_in_group)`` (see :func:`group_position`); ``device`` is
    where the vector is reduced (the group's device kind).

    One MAX all-reduce of ``[sig (7), -sig (7), non-finite count, failed flag]`` tells every rank
    whether some rank's validation failed (``failure``; ``signature`` is then ``None``), whether
    an input holds NaN or inf, and whether the signatures differ (max != min). Nothing wrong: that
    is all. Otherwise each rank states what it found and :func:`mopd.common.dist.same_verdict` raises the same text
    everywhere: a failed rank's own message first, else the non-finite input, else the
    disagreement.
    """
    _, rank_in_group = position
    n = SIGNATURE_LEN
    vec = torch.zeros(2 * n + 2, dtype=torch.int64)
    if signature is not None:
        assert len(signature) == n
        vec[:n] = torch.tensor(signature, dtype=torch.int64)
        vec[n : 2 * n] = -vec[:n]
    vec[2 * n] = len(nonfinite)
    vec[2 * n + 1] = 1 if failure is not None else 0
    vec = vec.to(device)
    all_reduce(vec, op=dist.ReduceOp.MAX, group=group, timeout_s=timeout_s)
    vec = vec.cpu()
    hi, lo = vec[:n], -vec[n : 2 * n]
    if not int(vec[2 * n + 1]) and not int(vec[2 * n]) and bool((hi == lo).all()):
        return  # nothing wrong anywhere: every rank reads that from the same reduced vector
    problems: list[str] = []
    if failure is not None:
        problems.append(f"rank {rank_in_group} of the TP group: {failure}")
    elif not int(vec[2 * n + 1]):
        if nonfinite:
            problems.append(f"NaN or inf in {', '.join(nonfinite)} on rank {rank_in_group}")
        elif not int(vec[2 * n]) and not bool((hi == lo).all()):
            problems.append(
                "TP ranks disagree on (T, active tokens, teachers, V_local, chunk, mask, "
                f"teacher index): max {hi.tolist()} vs min {lo.tolist()}"
            )
    try:
        same_verdict(
            problems, group=group, timeout_s=timeout_s, what="KL arguments (KLConfig(debug=True))"
        )
    except ValueError as exc:
        if failure is not None:
            raise exc from failure
        raise
