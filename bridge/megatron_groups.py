"""Megatron process-group collections for a model that lives on its own mesh inside the job.

Why this file exists: megatron's ``parallel_state`` holds one global configuration, but in MOPD
the teachers and the student each have their own mesh (TP, CP, DP, PP) inside one job.
megatron-core accepts explicit groups per model (``pg_collection=`` on the model, the schedule
and ``finalize_model_grads``); :func:`megatron_process_groups` builds them from a
:class:`~mopd.bridge.mesh.Mesh`, through a :class:`~mopd.bridge.groups.GroupPool`, so every rank
creates every group in the same order. Megatron is imported on use only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    from mopd.bridge.groups import GroupPool
    from mopd.bridge.mesh import Mesh

__all__ = ["megatron_process_groups", "mesh_group_ranks"]


def mesh_group_ranks(mesh: Mesh) -> dict[str, list[list[int]]]:
    """Every group of ``mesh`` by megatron's name, as global-rank lists (pure, no process group).

    ``tp``, ``cp``, ``dp`` (without CP), ``dp_cp``, ``tp_cp``, ``tp_dp_cp``, ``pp``, ``mp``
    (tp x pp), ``embd`` (first and last stage, for tied embeddings) and ``pos_embd`` (first
    stage) and ``ep`` (one rank each: dense models), in a fixed order: the order :func:`megatron_process_groups` creates them in.
    """
    tp_r, cp_r, dp_r, pp_r = range(mesh.tp), range(mesh.cp), range(mesh.dp), range(mesh.pp)

    def at(t: int, c: int, d: int, p: int) -> int:
        return mesh.global_rank(tp_rank=t, cp_rank=c, dp_rank=d, pp_rank=p)

    last = mesh.pp - 1
    return {
        "tp": [[at(t, c, d, p) for t in tp_r] for p in pp_r for d in dp_r for c in cp_r],
        "cp": [[at(t, c, d, p) for c in cp_r] for p in pp_r for d in dp_r for t in tp_r],
        "dp": [[at(t, c, d, p) for d in dp_r] for p in pp_r for c in cp_r for t in tp_r],
        "dp_cp": [[at(t, c, d, p) for d in dp_r for c in cp_r] for p in pp_r for t in tp_r],
        "tp_cp": [[at(t, c, d, p) for c in cp_r for t in tp_r] for p in pp_r for d in dp_r],
        "tp_dp_cp": [[at(t, c, d, p) for d in dp_r for c in cp_r for t in tp_r] for p in pp_r],
        "pp": [[at(t, c, d, p) for p in pp_r] for d in dp_r for c in cp_r for t in tp_r],
        "mp": [[at(t, c, d, p) for p in pp_r for t in tp_r] for d in dp_r for c in cp_r],
        "embd": [
            sorted({at(t, c, d, 0), at(t, c, d, last)}) for d in dp_r for c in cp_r for t in tp_r
        ],
        "pos_embd": [[at(t, c, d, 0)] for d in dp_r for c in cp_r for t in tp_r],
        "ep": [[r] for r in mesh.ranks],
    }


def megatron_process_groups(mesh: Mesh, pool: GroupPool) -> Any | None:
    """A megatron ``ProcessGroupCollection`` for this rank's place in ``mesh`` (any TP/CP/DP/PP).

    Collective over the default group: every global rank calls it, with the same meshes in the
    same order (groups are created through ``pool``, which creates a rank set once). Returns
    ``None`` on ranks outside the mesh. Pass the result as ``pg_collection=`` to the model, to
    megatron's schedule (with a ``P2PCommunicator`` over its ``pp`` group) and to
    ``finalize_model_grads``; give its ``tp`` to the bridge as the student TP group.
    """
    from megatron.core.process_groups_config import ProcessGroupCollection

    me = dist.get_rank()
    mine: dict[str, Any] = {}
    for kind, rank_sets in mesh_group_ranks(mesh).items():
        mine[kind] = None  # embd / pos_embd: ranks off the first and last stages hold none
        for ranks in rank_sets:
            group = pool.create(ranks)
            if me in ranks:
                mine[kind] = group
    if mesh.coord(me) is None:
        return None
    # dense models: no expert parallelism (ep of one rank), so megatron's expert and partial
    # data-parallel groups are the plain ones
    for alias, same in (
        ("intra_dp_cp", "dp_cp"),
        ("expt_dp", "dp_cp"),
        ("intra_expt_dp", "dp_cp"),
        ("intra_dist_opt", "dp_cp"),
        ("expt_tp", "tp"),
        ("tp_ep", "tp"),
        ("tp_ep_pp", "mp"),
    ):
        mine[alias] = mine[same]
    mine["inter_dist_opt"] = None  # one distributed-optimizer instance
    return ProcessGroupCollection(**mine)
