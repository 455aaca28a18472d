"""Synthetic steps: seeded batch descriptions for both sides, and row contents derived from keys.

Why this file exists: the tests, the benchmarks and the ``mopd plan`` inspector all need realistic, reproducible steps without a model: samples of random lengths,
routed to teachers, sharded over DP differently on each side, cut into micro-batches of different
sizes, padded (``[S, B, H]`` / ``[B, S, H]``) or packed (THD) independently, with CP zigzag on
both sides. :func:`synthetic_step` builds the :class:`~mopd.bridge.layout.TokenLayout` of every
shard from a seed; :func:`key_pattern` fills rows with bits derived from their key, so a row that
lands in the wrong place is caught by exact comparison.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from mopd.bridge.layout import (
    TokenLayout,
    concat_layouts,
    megatron_padded_length,
    packed_layout,
    padded_layout,
)
from mopd.bridge.mesh import Mesh

__all__ = ["SideFormat", "SyntheticStep", "key_pattern", "synthetic_step"]

_I64 = torch.int64


@dataclass(frozen=True, kw_only=True)
class SideFormat:
    """How one side batches its tokens.

    Attributes:
        kind: ``"sbh"`` / ``"bsh"`` padded micro-batches, or ``"thd"`` packed ones.
        micro_batch: samples per micro-batch.
        pad_multiple: extra padding multiple of each (padded) length, on top of ``2 * cp``
            (the student uses its TP size so its buffer splits into equal SP slices).
    """

    kind: Literal["sbh", "bsh", "thd"] = "sbh"
    micro_batch: int = 2
    pad_multiple: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ("sbh", "bsh", "thd"):
            raise ValueError(f"kind must be 'sbh', 'bsh' or 'thd', got {self.kind!r}")
        if self.micro_batch < 1 or self.pad_multiple < 1:
            raise ValueError(
                f"micro_batch {self.micro_batch} and pad_multiple {self.pad_multiple} must be >= 1"
            )


@dataclass(frozen=True, kw_only=True, eq=False)
class SyntheticStep:
    """Layouts of one step: per teacher and for the student, ``(dp_rank, cp_rank) -> layout``."""

    teacher_layouts: tuple[dict[tuple[int, int], TokenLayout], ...]
    student_layouts: dict[tuple[int, int], TokenLayout]
    sample_ids: torch.Tensor
    lengths: torch.Tensor
    route: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


def _side_layouts(
    mesh: Mesh,
    samples: torch.Tensor,
    lengths: dict[int, int],
    fmt: SideFormat,
    gen: torch.Generator,
) -> dict[tuple[int, int], TokenLayout]:
    perm = samples[torch.randperm(samples.numel(), generator=gen)]

    def pad(n: int) -> int:  # megatron's rule: 2 * cp, times the extra multiple (SP's tp)
        return megatron_padded_length(n, cp_size=mesh.cp, sp_size=fmt.pad_multiple)

    out: dict[tuple[int, int], TokenLayout] = {}
    for d in range(mesh.dp):
        mine = perm[d :: mesh.dp].tolist()
        mbs = [mine[i : i + fmt.micro_batch] for i in range(0, len(mine), fmt.micro_batch)]
        for c in range(mesh.cp):
            parts = []
            for mb in mbs:
                lens = [lengths[s] for s in mb]
                if fmt.kind == "thd":
                    padded = [pad(n) for n in lens]
                    cu = [0]
                    for p in padded:
                        cu.append(cu[-1] + p)
                    parts.append(
                        packed_layout(mb, lens, cu_seqlens_padded=cu, cp_size=mesh.cp, cp_rank=c)
                    )
                else:
                    seq = pad(max(lens))
                    parts.append(
                        padded_layout(
                            mb, seq, order=fmt.kind, lengths=lens, cp_size=mesh.cp, cp_rank=c
                        )
                    )
            out[(d, c)] = concat_layouts(parts)
    return out


def synthetic_step(
    *,
    teachers: Sequence[Mesh],
    student: Mesh,
    num_samples: int,
    max_len: int,
    teacher_formats: Sequence[SideFormat] | None = None,
    student_format: SideFormat | None = None,
    seed: int = 0,
) -> SyntheticStep:
    """A seeded step: ``num_samples`` samples of lengths in ``[1, max_len]``, each routed to one teacher.

    Sample ids are sparse (drawn from ``[0, 3 * num_samples)``) so nothing relies on them being
    dense; each side shuffles and shards them over its own DP ranks independently.
    """
    if num_samples < 1 or max_len < 1 or not teachers:
        raise ValueError(
            f"need num_samples >= 1 ({num_samples}), max_len >= 1 ({max_len}) and a teacher"
        )
    teacher_formats = list(teacher_formats or [SideFormat()] * len(teachers))
    if len(teacher_formats) != len(teachers):
        raise ValueError(f"{len(teacher_formats)} teacher formats for {len(teachers)} teachers")
    student_format = student_format or SideFormat(pad_multiple=student.tp)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(3 * num_samples, generator=gen)[:num_samples].sort().values
    lens = torch.randint(1, max_len + 1, (num_samples,), generator=gen, dtype=_I64)
    route = torch.randint(0, len(teachers), (num_samples,), generator=gen, dtype=_I64)
    lengths = dict(zip(ids.tolist(), lens.tolist(), strict=True))
    t_layouts = tuple(
        _side_layouts(m, ids[route == i], lengths, f, gen)
        for i, (m, f) in enumerate(zip(teachers, teacher_formats, strict=True))
    )
    s_layouts = _side_layouts(student, ids, lengths, student_format, gen)
    return SyntheticStep(
        teacher_layouts=t_layouts,
        student_layouts=s_layouts,
        sample_ids=ids,
        lengths=lens,
        route=route,
    )


_INT_OF = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def key_pattern(
    layout: TokenLayout, hidden: int, dtype: torch.dtype, *, salt: int = 0
) -> torch.Tensor:
    """``[R, hidden]`` rows whose bits are a hash of ``(sample_id, position, column, salt)``.

    Padding rows get a hash of ``salt`` alone. Float values are finite (the top bit of the
    exponent is cleared, as real hidden states are; the bridge checks rows for NaN / Inf);
    compare results bitwise (``.view(int)``) all the same.
    """
    itemsize = dtype.itemsize
    x = layout.sample_id_R * 1_000_003 + layout.position_R * 7919 + salt * 104_729 + 17
    h = torch.arange(hidden, dtype=_I64)
    v = x[:, None] * 6364136223846793005 + h[None, :] * 1442695040888963407
    v = v ^ (v >> 29)
    v = v * -7046029254386353131
    v = v ^ (v >> 32)
    bits = 8 * itemsize
    if bits < 64:
        v = v & ((1 << bits) - 1)
        v = torch.where(v >= (1 << (bits - 1)), v - (1 << bits), v)
    if dtype.is_floating_point:  # the exponent's top bit: below all-ones, never NaN / Inf
        v = v & ~(1 << (bits - 2))
    out = v.to(_INT_OF[itemsize]) if itemsize in _INT_OF else v
    return out.view(dtype)
