"""Undoing sequence parallelism into one tensor, and the buffer a caller may recycle for it.

Why this file exists: under sequence parallelism each TP rank holds ``[S/tp, B, H]`` of the
tensor fed to the LM head. The capture (and the bridge after it) wants the full ``[S, B, H]``.
A ``torch.cat`` of an all-gather allocates twice and copies twice; here one
``all_gather_into_tensor`` writes every rank's shard straight into its slice of the target: a
fresh tensor (the capture's default) or a buffer the caller owns, which lives as long as the
shape does (:class:`ReusableBuffer`: no allocation per step at a steady shape).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mopd.common import ranges
from mopd.common.dist import all_gather_into

__all__ = ["ReusableBuffer", "gather_sequence_parallel"]


class ReusableBuffer:
    """A tensor that is allocated once per (shape, dtype, device) and handed out again after.

    The storage pointer stays the same across calls at a steady shape; a new shape, dtype or
    device drops the old tensor and allocates a new one. Lifetime rule for its owner: what one
    user wrote into it is valid until the next :meth:`get`, whose caller overwrites it.
    """

    def __init__(self) -> None:
        self._tensor: torch.Tensor | None = None
        self.allocations = 0

    def get(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        t = self._tensor
        if t is None or tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device:
            self._tensor = None  # release before allocating the replacement
            t = self._tensor = torch.empty(shape, dtype=dtype, device=device)
            self.allocations += 1
        return t

    def release(self) -> None:
        self._tensor = None


def gather_sequence_parallel(
    local_SBH: torch.Tensor, tp_group: dist.ProcessGroup | None, out_SBH: torch.Tensor
) -> torch.Tensor:
    """All-gather ``[S/tp, B, H]`` shards along dim 0 over ``tp_group`` into ``out_SBH`` ``[S, B, H]``.

    Rank ``i`` of the group lands in rows ``[i * S/tp, (i+1) * S/tp)``, which is Megatron's
    sequence-parallel split. With a group of size 1 (or ``None``) this is a copy. The write
    happens on the current stream (for NCCL, the collective is ordered after the current
    stream's work and the current stream waits for it).

    Raises:
        ValueError: ``out_SBH`` has the wrong shape, dtype or device.
    """
    world = 1 if tp_group is None else dist.get_world_size(tp_group)
    want = (local_SBH.shape[0] * world, *local_SBH.shape[1:])
    if (
        tuple(out_SBH.shape) != want
        or out_SBH.dtype != local_SBH.dtype
        or out_SBH.device != local_SBH.device
    ):
        raise ValueError(
            f"capture buffer is {tuple(out_SBH.shape)} {out_SBH.dtype} on {out_SBH.device}; the gathered "
            f"hidden states need {want} {local_SBH.dtype} on {local_SBH.device}"
        )
    if not out_SBH.is_contiguous():
        raise ValueError(f"capture buffer must be contiguous, got strides {out_SBH.stride()}")
    with ranges.span("gather", world):
        if world == 1:
            out_SBH.copy_(local_SBH)
        else:
            all_gather_into(out_SBH, local_SBH.contiguous(), group=tp_group)
    return out_SBH
