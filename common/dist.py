"""torch.distributed helpers shared by the bridge, the LM-head reshard and the loss.

Why this file exists: two questions come up wherever the library talks to a process group, and
each has one answer here:

- which device does a group move tensors on (:func:`group_device`): read from the group's
  backend *config* (``"cpu:gloo,cuda:nccl"``), not ``dist.get_backend``, which can say
  ``"undefined"`` for a group made without a backend;
- how do all ranks raise the same ``ValueError`` when only some of them found a problem
  (:func:`same_verdict`): one small all-reduce when nothing is wrong; otherwise every rank learns
  who found what and raises the same text, so none is left waiting in a later collective.

Timeouts are ``timeout_s`` (seconds) everywhere in the library; :func:`wait` applies one to a
work object the way each transport allows, and :func:`all_reduce` is the library's one timed
all-reduce.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "MESSAGE_BYTES",
    "ReduceOpLike",
    "all_gather_into",
    "all_reduce",
    "group_device",
    "moves_cuda",
    "same_verdict",
    "wait",
]

#: What ``dist.all_reduce`` takes as ``op``: a ``ReduceOp`` or one of its members
#: (``dist.ReduceOp.SUM`` is a ``ReduceOp.RedOpType``).
ReduceOpLike = dist.ReduceOp | dist.ReduceOp.RedOpType

#: ``all_gather_into_tensor`` under the name torch >= 2.13 prefers (it deprecates the old one):
#: ``all_gather_into(output, input, group=..., async_op=...)``.
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: Bytes of a problem's text carried to every rank by :func:`same_verdict`.
MESSAGE_BYTES = 4000


def moves_cuda(group: dist.ProcessGroup | None) -> bool:
    """True if ``group`` moves CUDA tensors (it has an NCCL backend), False for gloo only."""
    return "nccl" in str(dist.get_backend_config(group)).lower()


def group_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where tensors for ``group``'s collectives live: the current CUDA device for NCCL, else CPU."""
    if group is not None and moves_cuda(group) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def wait(work: Any, *, device: torch.device, timeout_s: float | None) -> None:
    """Wait on one work object whose tensors live on ``device``.

    CUDA tensors (NCCL): ``work.wait()`` without a timeout, which only makes the current stream
    wait (a timed wait would spin the host until the operation completes); hang detection is the
    process group's own timeout. Other tensors (gloo): a host wait of at most ``timeout_s``.
    """
    if work is None:
        return
    if device.type == "cuda" or timeout_s is None:
        work.wait()
    else:
        work.wait(datetime.timedelta(seconds=timeout_s))


def all_reduce(
    t: torch.Tensor,
    *,
    op: ReduceOpLike = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None,
    timeout_s: float | None,
) -> None:
    """In-place all-reduce of ``t`` over ``group``, waited for as :func:`wait` does: a host wait
    of at most ``timeout_s`` for CPU tensors, a stream wait for CUDA ones."""
    wait(
        dist.all_reduce(t, op=op, group=group, async_op=True),
        device=t.device,
        timeout_s=timeout_s,
    )


def same_verdict(
    problems: Sequence[str], *, group: dist.ProcessGroup | None, timeout_s: float | None, what: str
) -> None:
    """Raise the same ``ValueError`` on every rank of ``group`` if any rank found a problem.

    Collective over ``group``: every member calls it, each with the problems it found (often
    none). Nothing wrong anywhere: one all-reduce of one integer. Otherwise every rank raises
    ``ValueError("<what> rejected: <the first problem of the lowest group rank that found
    one> [(n ranks found problems; ...)]")``, the same text everywhere.
    """
    device = group_device(group)
    flag = torch.tensor([1 if problems else 0], dtype=torch.int64, device=device)
    if group is None or dist.get_world_size(group) == 1:
        if problems:
            raise ValueError(f"{what} rejected: {problems[0]}")
        return
    all_reduce(flag, op=dist.ReduceOp.MAX, group=group, timeout_s=timeout_s)
    if not int(flag):
        return
    n = dist.get_world_size(group)
    mine = torch.tensor([1 if problems else 0], dtype=torch.int64, device=device)
    every = torch.empty(n, dtype=torch.int64, device=device)
    wait(
        all_gather_into(every, mine, group=group, async_op=True),
        device=device,
        timeout_s=timeout_s,
    )
    who = torch.nonzero(every.cpu()).reshape(-1).tolist()
    first = who[0]
    text = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
    if dist.get_rank(group) == first:
        raw = "; ".join(problems).encode()[:MESSAGE_BYTES]
        text[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    text = text.to(device)
    ranks = dist.get_process_group_ranks(group)
    wait(
        dist.broadcast(text, src=ranks[first], group=group, async_op=True),
        device=device,
        timeout_s=timeout_s,
    )
    message = bytes(text.cpu().tolist()).rstrip(b"\0").decode(errors="replace")
    found_by = f"found by global rank {ranks[first]}"
    others = len(who) - 1
    tail = f"; {others} other rank(s) also found problems" if others else ""
    raise ValueError(f"{what} rejected ({found_by}{tail}): {message}")
