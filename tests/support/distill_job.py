"""A small MOPD training job for the reliability tests: real GPTModels, a Distiller, megatron's
schedule.

Why this file exists: the failure-naming, recovery, input-probe and kill tests all need the
operator's view of the library: a teacher and a student on their own meshes inside one job,
``Distiller.step`` around megatron-core's own schedule (forward only: the weights never change,
so a step's loss depends only on its rows and can be compared bit for bit with a fault-free
run). Teacher ``tp2`` on global ranks 0-1; student ``tp2 dp2`` (or ``tp2 pp2``) on ranks 0-3;
or the README's topology (``readme=True``: teachers ``tp2 pp2`` and ``tp2 dp2``, student
``tp2 pp2``, all on ranks 0-3). Steps take the caller's micro-batches (:meth:`Job.run`) or
on-policy :class:`~mopd.mcore.Rollouts` (:meth:`Job.rollouts`, :meth:`Job.run_rollouts`). Each
job builds its own :class:`GroupPool`, so a fault breaks nothing another job uses, and
:meth:`Job.close` frees what it built.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "GLOBAL_MB",
    "HS",
    "HT",
    "N_ROLLOUTS",
    "Injected",
    "Job",
    "M",
    "S",
    "V",
    "fail_at",
    "sleep_at",
]

V, S, HT, HS = 64, 16, 48, 32
GLOBAL_MB = 4  # samples per global micro-batch
M = 3  # micro-batches per step
N_ROLLOUTS = 8  # samples of a rollouts step (M of them per step: M micro-batches)


class Injected(RuntimeError):
    """The fault a test injects."""


class Job:
    """Models, groups, a Distiller and a step runner, on a pool of their own.

    Args:
        timeout_s: ``BridgeConfig.timeout_s``; the pool's too unless ``pool_timeout=False``
            (then ``GroupPool()`` without one: the Distiller bounds it).
        student_pp: the student's pipeline size (``tp2 dp2`` at 1, ``tp2 pp2`` at 2).
        wrong_pg: give the Distiller another mesh's (``tp4``) process groups as the student's
            (a misconfigured job).
        readme: the README's topology (two teachers, ``tp2 pp2`` and ``tp2 dp2``; student
            ``tp2 pp2``; ``student_pp`` is ignored).
        config: more ``BridgeConfig`` settings.
    """

    def __init__(
        self,
        *,
        timeout_s: float,
        student_pp: int = 1,
        pool_timeout: bool = True,
        wrong_pg: bool = False,
        readme: bool = False,
        **config: Any,
    ) -> None:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        from mopd.bridge import BridgeConfig, GroupPool, Mesh
        from mopd.mcore import Distiller, MeshModel, megatron_process_groups
        from tests.support.megatron_cpu import tiny_config

        self.rank = dist.get_rank()
        self.timeout_s = timeout_s
        self.pool = GroupPool(timeout_s=timeout_s) if pool_timeout else GroupPool()
        if readme:
            self.tmeshes = [Mesh(tp=2, pp=2, name="teacher 0"), Mesh(tp=2, dp=2, name="teacher 1")]
            self.smesh = Mesh(tp=2, pp=2, name="student")
        else:
            self.tmeshes = [Mesh(tp=2, name="teacher")]
            self.smesh = Mesh(tp=2, dp=2 // student_pp, pp=student_pp, name="student")
        self.tmesh = self.tmeshes[0]
        self.tpgs = [megatron_process_groups(m, self.pool) for m in self.tmeshes]
        self.tpg = self.tpgs[0]
        self.spg = megatron_process_groups(self.smesh, self.pool)
        other = megatron_process_groups(Mesh(tp=4, name="other"), self.pool) if wrong_pg else None

        def build(mesh: Any, pg: Any, hidden: int, seed: int) -> Any:
            torch.manual_seed(seed)
            c = mesh.coord(self.rank)
            cfg = tiny_config(
                hidden_size=hidden,
                tensor_model_parallel_size=mesh.tp,
                pipeline_model_parallel_size=mesh.pp,
                variable_seq_lengths=True,
                moe_token_dispatcher_type="alltoall",  # megatron's check for variable lengths
                init_method_std=0.05,
            )
            return GPTModel(
                config=cfg,
                transformer_layer_spec=get_gpt_layer_local_spec(),
                vocab_size=V,
                max_sequence_length=S,
                position_embedding_type="learned_absolute",
                pre_process=c.pp_rank == 0,
                post_process=c.pp_rank == mesh.pp - 1,
                pg_collection=pg,
            )

        self.teachers = [
            build(m, pg, HT - 8 * o, 11 + 2 * o).eval() if pg else None
            for o, (m, pg) in enumerate(zip(self.tmeshes, self.tpgs, strict=True))
        ]
        self.teacher = self.teachers[0]
        self.student = build(self.smesh, self.spg, HS, 12)
        self.distiller = Distiller(
            teachers=[
                MeshModel(mesh=m, model=t, pg_collection=pg)
                for m, t, pg in zip(self.tmeshes, self.teachers, self.tpgs, strict=True)
            ],
            student=MeshModel(mesh=self.smesh, model=self.student, pg_collection=other or self.spg),
            pool=self.pool,
            bridge_config=BridgeConfig(timeout_s=timeout_s, **config),
        )

    def close(self) -> None:
        """Close the Distiller and the pool, and drop the models (they hold the groups)."""
        self.distiller.close()
        self.pool.close()
        self.teacher = self.student = self.tpg = self.spg = None
        self.teachers, self.tpgs = [], []

    def batches(
        self, seed: int, *, variable: bool = False, ids: list[int] | None = None
    ) -> tuple[Any, Any]:
        """This rank's (student, teacher) micro-batches of a step (``ids``: the samples' ids)."""
        from mopd.mcore import padded_micro_batch, split_samples

        g = torch.Generator().manual_seed(seed)
        ids = ids or [1000 * seed + i for i in range(M * GLOBAL_MB)]
        lens = torch.randint(3, S + 1, (len(ids),), generator=g).tolist() if variable else None
        toks = torch.randint(0, V, (len(ids), S), generator=g)

        def mbs(mesh: Any) -> list[Any] | None:
            c = mesh.coord(self.rank)
            if c is None:
                return None
            out = []
            for i in range(M):
                cols = split_samples(
                    list(range(i * GLOBAL_MB, (i + 1) * GLOBAL_MB)), mesh.dp, c.dp_rank
                )
                out.append(
                    padded_micro_batch(
                        [ids[k] for k in cols],
                        toks[cols],
                        lengths=[lens[k] for k in cols] if lens else None,
                    )
                )
            return out

        return mbs(self.smesh), mbs(self.tmesh)

    def schedule(
        self,
        step: Any,
        *,
        before: Callable[[int], None] | None = None,
    ) -> None:
        """Megatron's schedule over the step (forward only); ``before(i)`` runs before the
        student's forward of micro-batch ``i`` (a fault)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        calls = [0]

        def forward_step(data_iterator: Any, model: Any) -> Any:
            if before is not None:
                before(calls[0])
            calls[0] += 1
            return step.forward_step(data_iterator, model)

        kwargs: dict[str, Any] = {"pg_collection": self.spg}
        if step.samples is not None:  # the rollouts form: the step says its shapes
            kwargs.update(step.schedule_kwargs())
        else:
            kwargs.update(
                data_iterator=step.data_iterator(),
                num_microbatches=step.num_micro_batches,
                seq_length=S,
                micro_batch_size=GLOBAL_MB // self.smesh.dp,
            )
        if self.smesh.pp > 1:
            kwargs["p2p_communicator"] = P2PCommunicator(
                pp_group=self.spg.pp, config=self.student.config
            )
        get_forward_backward_func(pp_size=self.smesh.pp, vp_size=None)(
            forward_step_func=forward_step,
            model=[self.student],
            forward_only=True,
            **kwargs,
        )

    def run(
        self,
        seed: int,
        *,
        batches: tuple[Any, Any] | None = None,
        before: Callable[[int], None] | None = None,
        variable: bool = False,
    ) -> float | None:
        """One step: plan, teacher pass, schedule, finish; the step's mean KL (last stage)."""
        s_mbs, t_mbs = batches or self.batches(seed, variable=variable)
        with self.distiller.step(student=s_mbs, teachers=[t_mbs]) as step:
            self.schedule(step, before=before)
        return step.mean_loss()

    def rollouts(
        self,
        seed: int,
        *,
        ids: list[int] | None = None,
        holder: int | None = 0,
        advantages: bool = True,
    ) -> Any:
        """The step's :class:`~mopd.mcore.Rollouts` as global rank ``holder`` holds them
        (``None`` elsewhere; ``holder=None``: every rank its own copy): :data:`N_ROLLOUTS`
        samples (prompt and response lengths from ``seed``, within ``S``), routed to the
        teachers in turn, with advantages; ``ids``: their sample ids (default: none, the
        library numbers them)."""
        from mopd.mcore import Rollouts

        if holder is not None and self.rank != holder:
            return None
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(1, S // 2 + 1, (N_ROLLOUTS, 2), generator=g).tolist()
        return Rollouts(
            prompts=[torch.randint(0, V, (p,), generator=g) for p, _ in lengths],
            responses=[torch.randint(0, V, (r,), generator=g) for _, r in lengths],
            teachers=[j % len(self.tmeshes) for j in range(N_ROLLOUTS)],
            advantages=torch.randn(N_ROLLOUTS, generator=g) if advantages else None,
            sample_ids=ids,
        )

    def run_rollouts(
        self,
        held: Any,
        *,
        num_micro_batches: int = M,
        before: Callable[[int], None] | None = None,
    ) -> float | None:
        """One step from this rank's rollouts (``held``): exchange, plan, teacher pass, schedule,
        finish; the step's mean KL (last stage)."""
        with self.distiller.step(held, num_micro_batches=num_micro_batches) as step:
            self.schedule(step, before=before)
        return step.mean_loss()


def fail_at(where: int) -> Callable[[int], None]:
    """A ``before`` for :meth:`Job.schedule`: every rank's student forward of micro-batch
    ``where`` raises :class:`Injected`."""

    def before(i: int) -> None:
        if i == where:
            raise Injected(
                f"rank {dist.get_rank()}: the student's forward fails at micro-batch {where}"
            )

    return before


def sleep_at(rank: int, where: int, seconds: float) -> Callable[[int], None]:
    """A ``before`` for :meth:`Job.schedule`: global rank ``rank`` sleeps before its student
    forward of micro-batch ``where``."""

    def before(i: int) -> None:
        if dist.get_rank() == rank and i == where:
            time.sleep(seconds)

    return before
