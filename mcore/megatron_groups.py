"""Megatron process groups and meshes for a model that lives on its own mesh inside the job.

Why this file exists: megatron's ``parallel_state`` holds one global configuration, but in MOPD
the teachers and the student each have their own mesh (TP, CP, DP, PP) inside one job.
megatron-core accepts explicit groups per model (``pg_collection=`` on the model, the schedule
and ``finalize_model_grads``); :func:`megatron_process_groups` builds them from a
:class:`~mopd.bridge.mesh.Mesh`, through a :class:`~mopd.bridge.groups.GroupPool`, so every rank
creates every group in the same order; :func:`mesh_from_pg_collection` and
:func:`mesh_from_parallel_state` read a mesh back off megatron's groups. Megatron is imported on
use only.

Mixture-of-experts layers see the ranks of one pipeline stage differently: the ``tp x cp x dp``
ranks of a stage are ``expert_tp x ep x expt_dp`` (megatron's expert rank order, expert TP
fastest; CP folds into the expert data parallelism), so expert parallelism is a factor of data
parallelism as far as the dense parts, the LM head and the bridge are concerned.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from mopd.bridge.mesh import Mesh, mesh_from_groups

if TYPE_CHECKING:
    from mopd.bridge.groups import GroupPool

__all__ = [
    "megatron_process_groups",
    "mesh_from_parallel_state",
    "mesh_from_pg_collection",
    "mesh_group_ranks",
]


def _expert_sizes(mesh: Mesh, ep: int, expert_tp: int | None) -> tuple[int, int, int]:
    """``(expert_tp, ep, expt_dp)`` of ``mesh``'s stages; ``ValueError`` if they do not fit."""
    etp = mesh.tp if expert_tp is None else expert_tp
    for name, value in (("ep", ep), ("expert_tp", etp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"mesh {mesh.name!r}: {name} must be a positive int, got {value!r}")
    stage = mesh.tp * mesh.cp * mesh.dp
    if stage % (etp * ep):
        raise ValueError(
            f"mesh {mesh.name!r}: expert_tp * ep = {etp} * {ep} must divide the ranks of a "
            f"stage, tp * cp * dp = {mesh.tp} * {mesh.cp} * {mesh.dp} = {stage}"
        )
    return etp, ep, stage // (etp * ep)


def mesh_group_ranks(
    mesh: Mesh, *, ep: int = 1, expert_tp: int | None = None
) -> dict[str, list[list[int]]]:
    """Every group of ``mesh`` by megatron's name, as global-rank lists (pure, no process group).

    ``tp``, ``cp``, ``dp`` (without CP), ``dp_cp``, ``tp_cp``, ``tp_dp_cp``, ``pp``, ``mp``
    (tp x pp), ``embd`` (first and last stage, for tied embeddings) and ``pos_embd`` (first
    stage); and the expert groups for ``ep``-way expert parallelism with ``expert_tp``-way expert
    tensor parallelism (default: ``tp``): ``ep``, ``expt_tp``, ``tp_ep`` (expert_tp x ep),
    ``tp_ep_pp`` (expert_tp x ep x pp) and ``expt_dp`` (the rest of the stage). Dense models keep
    ``ep=1`` (its ``ep`` groups have one rank). In a fixed order: the order
    :func:`megatron_process_groups` creates them in.
    """
    etp, ep, edp = _expert_sizes(mesh, ep, expert_tp)
    tp_r, cp_r, dp_r, pp_r = range(mesh.tp), range(mesh.cp), range(mesh.dp), range(mesh.pp)

    def at(t: int, c: int, d: int, p: int) -> int:
        return mesh.global_rank(tp_rank=t, cp_rank=c, dp_rank=d, pp_rank=p)

    stage = mesh.tp * mesh.cp * mesh.dp

    def ex(t: int, e: int, d: int, p: int) -> int:  # megatron's expert order, expert TP fastest
        return mesh.rank_offset + p * stage + t + etp * (e + ep * d)

    et_r, ep_r, ed_r = range(etp), range(ep), range(edp)
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
        "ep": [[ex(t, e, d, p) for e in ep_r] for p in pp_r for d in ed_r for t in et_r],
        "expt_tp": [[ex(t, e, d, p) for t in et_r] for p in pp_r for d in ed_r for e in ep_r],
        "tp_ep": [[ex(t, e, d, p) for e in ep_r for t in et_r] for p in pp_r for d in ed_r],
        "tp_ep_pp": [[ex(t, e, d, p) for p in pp_r for e in ep_r for t in et_r] for d in ed_r],
        "expt_dp": [[ex(t, e, d, p) for d in ed_r] for p in pp_r for e in ep_r for t in et_r],
    }


def megatron_process_groups(
    mesh: Mesh, pool: GroupPool, *, ep: int = 1, expert_tp: int | None = None
) -> Any | None:
    """A megatron ``ProcessGroupCollection`` for this rank's place in ``mesh`` (any TP/CP/DP/PP),
    with the expert groups of mixture-of-experts layers for ``ep``-way expert parallelism and
    ``expert_tp``-way expert tensor parallelism (default: ``tp``; see :func:`mesh_group_ranks`).

    Collective over the default group: every global rank calls it, with the same meshes in the
    same order (groups are created through ``pool``, which creates a rank set once). Returns
    ``None`` on ranks outside the mesh. Pass the result as ``pg_collection=`` to the model, to
    megatron's schedule (with a ``P2PCommunicator`` over its ``pp`` group) and to
    ``finalize_model_grads``; give its ``tp`` to the bridge as the student TP group. ``ep`` and
    ``expert_tp`` must be the model config's ``expert_model_parallel_size`` and
    ``expert_tensor_parallel_size``.

    Raises:
        ValueError: ``expert_tp * ep`` does not divide ``tp * cp * dp`` (before any group).
    """
    from megatron.core.process_groups_config import ProcessGroupCollection

    me = dist.get_rank()
    mine: dict[str, Any] = {}
    for kind, rank_sets in mesh_group_ranks(mesh, ep=ep, expert_tp=expert_tp).items():
        mine[kind] = None  # embd / pos_embd: ranks off the first and last stages hold none
        for ranks in rank_sets:
            group = pool.create(ranks)
            if me in ranks:
                mine[kind] = group
    if mesh.coord(me) is None:
        return None
    # one distributed-optimizer instance: the partial data-parallel groups are the whole ones
    for alias, same in (
        ("intra_dp_cp", "dp_cp"),
        ("intra_expt_dp", "expt_dp"),
        ("intra_dist_opt", "dp_cp"),
    ):
        mine[alias] = mine[same]
    mine["inter_dist_opt"] = None  # one distributed-optimizer instance
    return ProcessGroupCollection(**mine)


def mesh_from_parallel_state(*, name: str = "", parallel_state: Any | None = None) -> Mesh:
    """The mesh of the live ``megatron.core.parallel_state`` setup, checked against its groups."""
    if parallel_state is None:
        from megatron.core import parallel_state as ps

        parallel_state = ps
    return mesh_from_groups(
        global_rank=dist.get_rank(),
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        cp_group=parallel_state.get_context_parallel_group(),
        dp_group=parallel_state.get_data_parallel_group(with_context_parallel=False),
        pp_group=parallel_state.get_pipeline_model_parallel_group(),
        name=name,
    )


def mesh_from_pg_collection(
    pg_collection: Any, *, global_rank: int | None = None, name: str = ""
) -> Mesh:
    """The mesh of a model built on a megatron ``ProcessGroupCollection`` (its ``tp``, ``cp``,
    ``dp`` (without CP) and ``pp`` groups; a missing one counts as size 1), checked against them."""
    return mesh_from_groups(
        global_rank=dist.get_rank() if global_rank is None else global_rank,
        tp_group=getattr(pg_collection, "tp", None),
        cp_group=getattr(pg_collection, "cp", None),
        dp_group=getattr(pg_collection, "dp", None),
        pp_group=getattr(pg_collection, "pp", None),
        name=name,
    )
