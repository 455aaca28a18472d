"""What ``mopd plan`` is asked: the meshes, the batch, and every rank's token layouts.

Why this file exists: the inspector's request (:class:`PlanRequest`) and the layouts each side's
ranks would hand the bridge for it (:func:`build_layouts`, Megatron's padding rules) are the
input of everything it reports; one place says how a request becomes layouts.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from mopd.bridge.layout import TokenLayout
    from mopd.bridge.mesh import Mesh

__all__ = [
    "PlanRequest",
    "build_layouts",
    "pad_rule",
]


_I64 = np.int64


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """Everything the inspector needs; validated before any planning.

    Attributes:
        teacher, student: the meshes (global ranks included).
        lengths: ``[B]`` real length of each sample (sample id = index).
        padded_seq_len: ``S`` for a padded batch, ``None`` for packed (THD) batches.
        hidden_size: the teacher's ``H`` (what crosses).
        vocab_size: for the logits comparison.
        dtype_bytes: bytes per element on the wire (2 for bf16).
        micro_batches: the step's micro-batches (the same on both sides).
        teacher_sp, student_sp: sequence parallelism on that side (the student then keeps its
            SP slice: every student rank is its own destination, no all-gather).
        teacher_sp_shards: with teacher SP, each teacher TP rank sends from its own SP shard
            (every rank its own source, no all-gather on the teacher's TP links: the
            ``Distiller``'s default); ``False``: the capture all-gathers the sequence and the
            TP ranks send as replicas (``TeacherSpec(sp_shards=False)``).
        link_gbps, nvlink_gbps, pcie_gbps: per-rank, per-direction bandwidths in Gb/s.
    """

    teacher: Mesh
    student: Mesh
    lengths: tuple[int, ...]
    padded_seq_len: int | None
    hidden_size: int
    vocab_size: int
    dtype_bytes: int = 2
    micro_batches: int = 1
    teacher_sp: bool = False
    student_sp: bool = False
    teacher_sp_shards: bool = True
    link_gbps: float = 400.0
    nvlink_gbps: float = 3600.0
    pcie_gbps: float = 400.0

    def __post_init__(self) -> None:
        if not self.lengths:
            raise ValueError("the batch has no samples")
        if any((not isinstance(n, int)) or n < 1 for n in self.lengths):
            raise ValueError(f"sample lengths must be positive ints, got {list(self.lengths)}")
        if self.padded_seq_len is not None and any(n != self.padded_seq_len for n in self.lengths):
            raise ValueError(
                f"a padded batch has every sample at seq_len {self.padded_seq_len}, got "
                f"{list(self.lengths)}"
            )
        for name in ("hidden_size", "vocab_size", "dtype_bytes", "micro_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("link_gbps", "nvlink_gbps", "pcie_gbps"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
        b, m = len(self.lengths), self.micro_batches
        if b % m:
            raise ValueError(f"--micro-batches {m} does not divide the batch of {b} samples")
        per_mb = b // m
        for side, mesh in (("teacher", self.teacher), ("student", self.student)):
            if per_mb % mesh.dp:
                raise ValueError(
                    f"a micro-batch of {per_mb} samples ({b} samples / {m} micro-batches) does "
                    f"not split over the {side}'s dp={mesh.dp} (Megatron gives every DP rank "
                    "the same number of samples)"
                )
        if self.teacher_sp and self.teacher.tp == 1:
            warnings.warn("teacher sequence parallelism ignored: teacher tp=1", stacklevel=2)
        if self.student_sp and self.student.tp == 1:
            warnings.warn("student sequence parallelism ignored: student tp=1", stacklevel=2)

    @property
    def row_bytes(self) -> int:
        return self.hidden_size * self.dtype_bytes

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def sources_from_shards(self) -> bool:
        """Each teacher TP rank is a source of its own SP shard (``TeacherSpec(sp_shards=True)``)."""
        return self.teacher_sp and self.teacher_sp_shards and self.teacher.tp > 1

    @property
    def keeps_sp_slice(self) -> bool:
        """The student keeps its SP slice (``BridgeConfig(keep_sp_shard=True)``)."""
        return self.student_sp and self.student.tp > 1


def pad_rule(mesh: Mesh, *, sp: bool) -> dict[str, int]:
    """One side's keywords for :func:`~mopd.bridge.layout.megatron_padded_length`."""
    return {"cp_size": mesh.cp, "sp_size": mesh.tp if sp else 1}


def _micro_batch_ids(req: PlanRequest, i: int, mesh: Mesh, d: int) -> list[int]:
    """Sample ids DP rank ``d`` of ``mesh`` holds in micro-batch ``i``."""
    per_mb = len(req.lengths) // req.micro_batches
    per_rank = per_mb // mesh.dp
    start = i * per_mb + d * per_rank
    return list(range(start, start + per_rank))


def _layout(
    req: PlanRequest,
    ids: list[int],
    mesh: Mesh,
    cp_rank: int,
    *,
    pad: dict[str, int],
    order: str,
    sp: tuple[int, int] = (1, 0),
) -> TokenLayout:
    from mopd.bridge.layout import megatron_padded_length, packed_layout, padded_layout

    lens = [req.lengths[s] for s in ids]
    if req.padded_seq_len is not None:
        return padded_layout(
            ids,
            megatron_padded_length(req.padded_seq_len, **pad),
            order=order,  # type: ignore[arg-type]
            lengths=lens,
            cp_size=mesh.cp,
            cp_rank=cp_rank,
            sp_size=sp[0],
            sp_rank=sp[1],
        )
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + megatron_padded_length(n, **pad))
    return packed_layout(
        ids,
        lens,
        cu_seqlens_padded=cu,
        cp_size=mesh.cp,
        cp_rank=cp_rank,
        sp_size=sp[0],
        sp_rank=sp[1],
    )


def _side_layouts(
    req: PlanRequest, i: int, mesh: Mesh, pad: dict[str, int], order: str, *, per_rank: bool
) -> dict[Any, TokenLayout]:
    """One side's layouts of micro-batch ``i``: ``(dp, cp) ->`` the shard's rows in ``order``,
    or with ``per_rank`` ``global rank ->`` each TP rank's own SP slice (``[S/tp, B]`` order)."""
    out: dict[Any, TokenLayout] = {}
    for d, c in mesh.shards():
        ids = _micro_batch_ids(req, i, mesh, d)
        if per_rank:
            for j, r in enumerate(mesh.tp_group_ranks(dp_rank=d, cp_rank=c)):
                out[r] = _layout(req, ids, mesh, c, pad=pad, order="sbh", sp=(mesh.tp, j))
        else:
            out[(d, c)] = _layout(req, ids, mesh, c, pad=pad, order=order)
    return out


def build_layouts(
    req: PlanRequest,
) -> tuple[list[dict[Any, TokenLayout]], list[dict[Any, TokenLayout]]]:
    """Per micro-batch, the teacher's captured layouts (``(dp, cp) ->``, or ``global rank ->``
    when each TP rank sends its SP shard) and the student's wanted ones (``(dp, cp) ->``, or
    ``global rank ->`` when it keeps its SP slice)."""
    t, s = req.teacher, req.student
    t_pad = pad_rule(t, sp=req.teacher_sp)
    s_pad = pad_rule(s, sp=req.student_sp)
    teacher: list[dict[Any, TokenLayout]] = []
    student: list[dict[Any, TokenLayout]] = []
    for i in range(req.micro_batches):
        teacher.append(_side_layouts(req, i, t, t_pad, "sbh", per_rank=req.sources_from_shards))
        student.append(_side_layouts(req, i, s, s_pad, "bsh", per_rank=req.keeps_sp_slice))
    return teacher, student
