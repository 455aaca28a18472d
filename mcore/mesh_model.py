"""A model on its own mesh, and what the Distiller reads off it.

Why this file exists: the Distiller and its in-schedule step both need, for each side, the
model with its mesh and process groups, and the same few readings of them (the hidden states'
dtype, the groups, whether the groups match the mesh, the micro-batches' layouts, the longest
position a model embeds); one place says how each is read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mopd.bridge.mesh import Mesh
from mopd.common.log import warn_once
from mopd.mcore.batch import MicroBatch, micro_batch_layout
from mopd.mcore.megatron_groups import mesh_group_ranks
from mopd.mcore.teacher import (
    Forward,
    check_interleaved_micro_batches,
    check_pipeline_shapes,
    model_config,
)

__all__ = [
    "MeshModel",
    "check_pg_collection",
    "hidden_dtype",
    "layouts_of",
    "max_positions",
    "model_groups",
]


@dataclass(frozen=True, kw_only=True, eq=False)
class MeshModel:
    """A model on its own mesh, as this rank holds it.

    Attributes:
        mesh: the model's mesh (the same on every rank).
        model: the (wrapped) megatron model, or its list of virtual-pipeline chunks; ``None`` on
            ranks outside the mesh.
        pg_collection: its megatron ``ProcessGroupCollection``
            (:func:`mopd.mcore.megatron_groups.megatron_process_groups`); ``None`` outside.
        forward: ``forward(model, micro_batch) -> output`` (default: a GPTModel call with the
            micro-batch's tokens, positions, mask and packed-sequence parameters).
        packed: how the model takes the micro-batches :meth:`Distiller.step` builds from
            rollouts: THD-packed sequences (``True``), or a padded ``[B, S]`` batch.
        world: the world the model runs in when the bridge spans several
            (:func:`~mopd.bridge.worlds.connect_worlds`), its ``mesh`` in that world's ranks;
            ``None``: this process's world. A teacher in another world is
            ``MeshModel(mesh=..., world="teacher-0")``, without a model.
    """

    mesh: Mesh
    model: Any | None = None
    pg_collection: Any | None = None
    forward: Forward | None = None
    packed: bool = False
    world: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, Mesh):
            raise ValueError(f"MeshModel.mesh must be a Mesh, got {type(self.mesh).__name__}")
        if not isinstance(self.packed, bool):
            raise ValueError(f"MeshModel.packed must be a bool, got {self.packed!r}")
        if (self.model is None) != (self.pg_collection is None):
            raise ValueError("MeshModel: give both model and pg_collection, or neither")
        if self.world is not None and not isinstance(self.world, str):
            raise ValueError(f"MeshModel.world must be a world's name, got {self.world!r}")

    def holds(self, rank: int) -> bool:
        return self.mesh.coord(rank) is not None

    def last_stage(self, rank: int) -> bool:
        return self.mesh.is_last_stage(rank)


def hidden_dtype(config: Any) -> torch.dtype:
    """The dtype of a model's pre-LM-head hidden states (what the capture sends)."""
    if getattr(config, "bf16", False):
        return torch.bfloat16
    if getattr(config, "fp16", False):
        return torch.float16
    return config.params_dtype


def model_groups(side: MeshModel) -> Any:
    """``side.pg_collection`` on a rank that holds the model (``MeshModel`` checks that a model
    comes with its groups)."""
    assert side.pg_collection is not None, "a rank holding the model holds its groups"
    return side.pg_collection


def check_pg_collection(mm: MeshModel, what: str, rank: int, offset: int = 0) -> list[str]:
    """Where ``mm``'s ``pg_collection`` disagrees with its mesh on this rank's groups
    (``offset``: this world's first rank in the meshes' rank space, when they span worlds)."""
    if mm.pg_collection is None or mm.mesh.coord(rank) is None:
        return []
    problems = []
    for kind, rank_sets in mesh_group_ranks(mm.mesh).items():
        if kind not in ("tp", "cp", "dp", "pp"):
            continue
        want = next(r for r in rank_sets if rank in r)
        group = getattr(mm.pg_collection, kind, None)
        if group is None:
            continue
        got = [r + offset for r in dist.get_process_group_ranks(group)]
        if sorted(got) != sorted(want):
            problems.append(
                f"{what}: its pg_collection.{kind} spans global ranks {sorted(got)}, but its "
                f"mesh {mm.mesh} puts global rank {rank}'s {kind} group at {sorted(want)}: "
                "build the pg_collection from the same mesh (megatron_process_groups)"
            )
    return problems


def layouts_of(
    mbs: Sequence[MicroBatch] | None,
    side: MeshModel,
    *,
    rows: str,
    what: str,
    sp: tuple[int, int] = (1, 0),
    mask: bool = True,
) -> Callable[[], list[Any]]:
    """The layouts of a rank's micro-batches, built inside the bridge's guarded phase (the
    student's with its loss masks applied, ``mask=True``); a pipelined model's micro-batch
    shapes, and a virtual-pipeline model's micro-batch count, are checked there too (an agreed
    error before anything runs)."""
    pg = side.pg_collection

    def build() -> list[Any]:
        if not mbs:
            raise ValueError(f"{what}: this rank must pass its micro-batches")
        check_pipeline_shapes(
            mbs, config=model_config(side.model), pp=side.mesh.pp, cp_size=side.mesh.cp, what=what
        )
        check_interleaved_micro_batches(len(mbs), model=side.model, pp=side.mesh.pp, what=what)
        if not mask and any(mb.loss_mask is not None for mb in mbs):
            warn_once(
                "a teacher's micro-batches carry a loss_mask: it is ignored (the student's "
                "loss_mask decides which tokens count and are sent)"
            )
        return [
            micro_batch_layout(
                mb,
                rows=rows,  # type: ignore[arg-type]
                pg_collection=pg,
                sp_size=sp[0],
                sp_rank=sp[1],
                use_loss_mask=mask,
            )
            for mb in mbs
        ]

    return build


def max_positions(model: Any) -> int | None:
    """A model's ``max_sequence_length`` where it bounds positions (learned absolute position
    embeddings), else ``None``."""
    from mopd.capture.unwrap import unwrap_model

    inner = unwrap_model(model[0] if isinstance(model, list | tuple) else model)
    if getattr(inner, "position_embedding_type", None) != "learned_absolute":
        return None
    limit = getattr(inner, "max_sequence_length", None)
    return int(limit) if isinstance(limit, int) else None
