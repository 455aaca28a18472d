"""Megatron process-group collections for a model that lives on a sub-mesh of the job.

Why this file exists: megatron's ``parallel_state`` holds one global configuration, but in MOPD
the teachers and the student each have their own mesh inside one job. megatron-core accepts
explicit groups per model (``pg_collection``); this builds them from a :class:`mopd.bridge.Mesh`,
through a :class:`mopd.bridge.GroupPool` so that every rank creates every group in the same order.
Used by the demo and by the end-to-end tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mopd.bridge import GroupPool, Mesh

__all__ = ["model_process_groups"]


def model_process_groups(mesh: Mesh, pool: GroupPool) -> Any | None:
    """A megatron ``ProcessGroupCollection`` for this rank's place in ``mesh`` (``pp == 1``).

    Collective over the default group: every global rank calls it with the same meshes in the
    same order (groups are created through ``pool``, which deduplicates rank sets). Returns
    ``None`` on ranks outside the mesh. Groups: tp, cp, dp, dp_cp, tp_cp, tp_dp_cp, pp (one rank),
    mp (= tp); no embedding groups (untied embeddings, one stage).
    """
    from megatron.core.process_groups_config import ProcessGroupCollection

    if mesh.pp != 1:
        raise ValueError(f"{mesh}: the demo builds one-stage models (pp=1), got pp={mesh.pp}")
    tp_r, cp_r, dp_r = range(mesh.tp), range(mesh.cp), range(mesh.dp)

    def at(t: int, c: int, d: int) -> int:
        return mesh.global_rank(tp_rank=t, cp_rank=c, dp_rank=d)

    kinds: dict[str, list[list[int]]] = {
        "tp": [[at(t, c, d) for t in tp_r] for d in dp_r for c in cp_r],
        "cp": [[at(t, c, d) for c in cp_r] for d in dp_r for t in tp_r],
        "dp": [[at(t, c, d) for d in dp_r] for c in cp_r for t in tp_r],
        "dp_cp": [[at(t, c, d) for d in dp_r for c in cp_r] for t in tp_r],
        "tp_cp": [[at(t, c, d) for c in cp_r for t in tp_r] for d in dp_r],
        "tp_dp_cp": [list(mesh.ranks)],
        "pp": [[r] for r in mesh.ranks],
    }
    mine: dict[str, Any] = {}
    me = _rank()
    for kind, rank_sets in kinds.items():
        for ranks in rank_sets:
            group = pool.create(ranks)
            if me in ranks:
                mine[kind] = group
    if mesh.coord(me) is None:
        return None
    return ProcessGroupCollection(**mine, mp=mine["tp"], embd=None, pos_embd=None)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()
