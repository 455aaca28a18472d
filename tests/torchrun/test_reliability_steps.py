"""Tier 2 (4 ranks, gloo): steps of a training job are fenced; a failed step fails everywhere.

The job is the README's: a :class:`mopd.mcore.Distiller` around megatron-core's own schedule
(``get_forward_backward_func()``, PP=1), teacher ``tp2`` on global ranks 0-1 (each of its
micro-batches holds all samples of the student's), student ``tp2 dp2`` on ranks 0-3 (ranks 2-3
only receive: they post in ``receive``, inside the schedule). Cases:

- every rank raises in the student's forward at micro-batch 1; the job catches it and runs the
  next step -> every rank raises the same ``BridgeStateError`` at once, naming the abandoned
  step, and so does every later step; never a row of the failed step (fixed and variable
  lengths);
- two ``distiller.step`` blocks open at once (the inner planned inside the outer) -> the inner
  raises the same ``ValueError`` on every rank before anything of it moves; the outer then
  completes with exactly the loss it has alone, and the next step too;
- a rank slower than megatron's own TP collectives' timeout inside the schedule -> the ranks
  that see megatron's timeout refuse every later step at once with ``BridgeStateError`` naming
  it; the others get a named bridge error; afterwards every call on every rank is refused.

Losses are compared bit for bit with the same step run alone (forward only: the weights never
change, so a step's loss depends only on its rows).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.support.reliability import everyone, outcome

TORCHRUN_NPROC = 4
TORCHRUN_TIMEOUT = 400

V, S, HT, HS = 64, 16, 48, 32
GLOBAL_MB = 4  # samples per global micro-batch
M = 3  # micro-batches per step
T_S = 4.0  # the bridge's and the groups' timeout
SLACK_S = 8.0


class Injected(RuntimeError):
    """The fault a test injects."""


@pytest.fixture(scope="module")
def world() -> Any:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from mopd.mcore import cpu
    from tests.support.dist import ensure_world

    ensure_world()
    cpu.apply()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(7)
    yield
    parallel_state.destroy_model_parallel()


class Job:
    """Models, groups, a Distiller and the step runner, on fresh groups (timeout ``T_S``)."""

    def __init__(self) -> None:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        from mopd.bridge import BridgeConfig, GroupPool, Mesh, megatron_process_groups
        from mopd.mcore import Distiller, MeshModel
        from tests.support.megatron_cpu import tiny_config

        self.rank = dist.get_rank()
        pool = GroupPool(timeout_s=T_S)
        self.tmesh = Mesh(tp=2, name="teacher")
        self.smesh = Mesh(tp=2, dp=2, name="student")
        self.tpg = megatron_process_groups(self.tmesh, pool)
        self.spg = megatron_process_groups(self.smesh, pool)

        def build(mesh: Any, pg: Any, hidden: int, seed: int) -> Any:
            torch.manual_seed(seed)
            cfg = tiny_config(
                hidden_size=hidden,
                tensor_model_parallel_size=mesh.tp,
                variable_seq_lengths=True,
                moe_token_dispatcher_type="alltoall",
                init_method_std=0.05,
            )
            return GPTModel(
                config=cfg,
                transformer_layer_spec=get_gpt_layer_local_spec(),
                vocab_size=V,
                max_sequence_length=S,
                position_embedding_type="learned_absolute",
                pg_collection=pg,
            )

        self.teacher = build(self.tmesh, self.tpg, HT, 11).eval() if self.tpg else None
        self.student = build(self.smesh, self.spg, HS, 12)
        self.distiller = Distiller(
            teachers=[MeshModel(mesh=self.tmesh, model=self.teacher, pg_collection=self.tpg)],
            student=MeshModel(mesh=self.smesh, model=self.student, pg_collection=self.spg),
            pool=pool,
            bridge_config=BridgeConfig(timeout_s=T_S),
        )

    def batches(self, seed: int, *, variable: bool) -> tuple[Any, Any]:
        """This rank's (student, teacher) micro-batches of a step."""
        from mopd.mcore import padded_micro_batch, split_samples

        g = torch.Generator().manual_seed(seed)
        ids = [1000 * seed + i for i in range(M * GLOBAL_MB)]
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

    def schedule(self, step: Any, *, fail_at: int | None = None, sleep: float = 0.0) -> None:
        """Megatron's schedule over the step (forward only); ``fail_at``: raise in the student's
        forward at that micro-batch; ``sleep``: seconds this rank sleeps before its forward."""
        import time

        from megatron.core.pipeline_parallel import get_forward_backward_func

        calls = [0]

        def forward_step(data_iterator: Any, model: Any) -> Any:
            if calls[0] == fail_at:
                raise Injected(f"rank {self.rank}: the student's forward fails at micro-batch 1")
            if sleep and calls[0] == 0:
                time.sleep(sleep)
            calls[0] += 1
            return step.forward_step(data_iterator, model)

        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=step.data_iterator(),
            model=[self.student],
            num_microbatches=step.num_micro_batches,
            seq_length=S,
            micro_batch_size=GLOBAL_MB // 2,
            forward_only=True,
            pg_collection=self.spg,
        )

    def run(self, seed: int, *, variable: bool, **fault: Any) -> float | None:
        """One step: plan, teacher pass, schedule, finish; the step's mean KL (last stage)."""
        s_mbs, t_mbs = self.batches(seed, variable=variable)
        with self.distiller.step(student=s_mbs, teachers=[t_mbs]) as step:
            self.schedule(step, **fault)
        return step.mean_loss()


@pytest.mark.parametrize("variable", [False, True], ids=["fixed", "variable"])
def test_a_step_failed_inside_the_schedule_fails_the_next_step_on_every_rank(world, variable):
    job = Job()
    first = outcome(lambda: job.run(1, variable=variable, fail_at=1))
    nxt = outcome(lambda: job.run(2, variable=variable))
    later = outcome(lambda: job.run(3, variable=variable))
    seen = everyone({"first": first[:3], "next": nxt[:3], "later": later[:3]})
    for r, s in enumerate(seen):
        assert s["first"][0] == "Injected", s
        kind, msg, elapsed = s["next"]
        assert kind == "BridgeStateError" and elapsed < 2.0, (r, s)
        assert msg.startswith(
            f"global rank {r}: this bridge cannot be used after a failed exchange (first "
            "failure on global rank 0: step 0 abandoned on global rank 0 after "
        ), msg
        assert "Injected: rank 0: the student's forward fails at micro-batch 1" in msg, msg
        assert "global ranks [1, 2, 3] failed too" in msg, msg
        assert s["later"][0] == "BridgeStateError" and s["later"][2] < 2.0, s
        assert "step 0 abandoned on global rank 0" in s["later"][1], s
    # the same text everywhere but for the rank that reports it
    tails = {s["next"][1].split(": ", 1)[1] for s in seen}
    assert len(tails) == 1, tails


def test_two_steps_open_at_once_raise_before_data_moves_and_the_outer_one_is_exact(world):
    alone = Job()
    want = [alone.run(seed, variable=True) for seed in (5, 6, 7)]
    job = Job()
    s5, t5 = job.batches(5, variable=True)
    s6, t6 = job.batches(6, variable=True)
    issued = []
    with job.distiller.step(student=s5, teachers=[t5]) as outer:
        issued.append(job.distiller.bridge.executor.slots_issued)
        inner = outcome(lambda: job.distiller.step(student=s6, teachers=[t6]))
        issued.append(job.distiller.bridge.executor.slots_issued)
        job.schedule(outer)
    got = [outer.mean_loss()]
    got += [job.run(seed, variable=True) for seed in (6, 7)]
    seen = everyone({"inner": inner[:2], "issued": issued})
    texts = {s["inner"] for s in seen}
    assert len(texts) == 1, texts
    kind, msg = texts.pop()
    assert kind == "ValueError", msg
    assert msg.startswith(
        "step 1 planned while an earlier step of this bridge is not fully posted: global rank 2 "
        "posted 0 of the 3 micro-batches of step 0; global rank 3 posted 0 of the 3"
    ), msg
    assert all(s["issued"][0] == s["issued"][1] for s in seen), seen  # nothing of it moved
    if job.smesh.is_last_stage(job.rank):
        assert got == want, (got, want)  # bit for bit: the rows of each step, and only them


def test_a_timeout_in_megatrons_own_collectives_fails_every_later_step(world):
    """Rank 3 sleeps past the groups' timeout before its first forward: its TP peer (rank 2)
    times out in megatron's own all-reduce. Every rank ends the step with a named error or
    refuses the next one at once; afterwards every call is refused."""
    job = Job()
    sleepy = T_S + 2.0
    first = outcome(lambda: job.run(1, variable=False, sleep=sleepy if job.rank == 3 else 0.0))
    nxt = outcome(lambda: job.run(2, variable=False))
    later = outcome(lambda: job.run(3, variable=False))
    seen = everyone({"first": first[:3], "next": nxt[:3], "later": later[:3]})
    named = ("BridgeStateError", "BridgeTimeoutError", "BridgeCommError")
    s = seen[2]
    assert s["first"][0] not in ("ok", *named), s  # megatron's (torch's) own error
    assert s["next"][0] == "BridgeStateError" and s["next"][2] < 2.0, s
    assert "step 0 failed in a collective" in s["next"][1], s
    for r, s in enumerate(seen):
        assert s["next"][0] in named, (r, s)
        assert s["next"][2] <= T_S + SLACK_S, (r, s)
        assert s["later"][0] == "BridgeStateError" and s["later"][2] < 2.0, (r, s)
