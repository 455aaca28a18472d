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
- the teacher's hidden states of one micro-batch turn NaN -> every student rank raises
  ``BridgeNonFiniteError`` naming it inside the schedule, before the loss reads the rows; the
  next step is refused everywhere;
- bad input (packing, empty stages, out-of-vocabulary ids, a sample on two DP ranks, a
  ``pg_collection`` of another mesh) -> the same ``ValueError`` on every rank before data moves;
  ``mean_loss()`` timing out -> named;
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

from tests.support.distill_job import GLOBAL_MB, Injected, Job, M, V, fail_at, sleep_at
from tests.support.megatron_cpu import megatron_world
from tests.support.reliability import everyone, outcome, own_view

TORCHRUN_NPROC = 4
TORCHRUN_TIMEOUT = 400
TORCHRUN_STRICT_P2P = 1  # NCCL's point-to-point rules (tests/support/strict_p2p.py)

T_S = 4.0  # the bridge's and the groups' timeout
SLACK_S = 8.0

world = pytest.fixture(scope="module")(megatron_world)


def new_job(**kw: Any) -> Job:
    """A job on fresh groups (timeout ``T_S``)."""
    return Job(timeout_s=T_S, **kw)


@pytest.mark.parametrize("variable", [False, True], ids=["fixed", "variable"])
def test_a_step_failed_inside_the_schedule_fails_the_next_step_on_every_rank(world, variable):
    job = new_job()
    first = outcome(lambda: job.run(1, variable=variable, before=fail_at(1)))
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
    alone = new_job()
    want = [alone.run(seed, variable=True) for seed in (5, 6, 7)]
    job = new_job()
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
    times out in megatron's own all-reduce, raised as a named bridge error that leads with rank
    3 (found busy by the census, the teachers waiting for its transfers). Every rank ends the
    step with a named error or refuses the next one at once; afterwards every call is
    refused."""
    job = new_job()
    sleepy = T_S + 2.0
    first = outcome(lambda: job.run(1, variable=False, before=sleep_at(3, 0, sleepy)))
    nxt = outcome(lambda: job.run(2, variable=False))
    later = outcome(lambda: job.run(3, variable=False))
    seen = everyone(
        {"first": first[:3], "own": own_view(first), "next": nxt[:3], "later": later[:3]}
    )
    named = ("BridgeStateError", "BridgeTimeoutError", "BridgeCommError")
    s = seen[2]
    assert s["first"][0] == "BridgeTimeoutError", s  # megatron's (torch's) error, named
    assert s["first"][1].startswith("global rank 3 failed first (step 0, after planning): "), s
    assert "busy in " in s["first"][1], s
    assert s["own"].startswith(
        "global rank 2: a collective inside step 0's block (megatron's own, or the job's) did "
        "not complete within BridgeConfig.timeout_s=4 s"
    ), s
    assert s["next"][0] == "BridgeStateError" and s["next"][2] < 2.0, s
    assert "global rank 3 failed first" in s["next"][1], s
    for r, s in enumerate(seen):
        assert s["next"][0] in named, (r, s)
        assert s["next"][2] <= T_S + SLACK_S, (r, s)
        assert s["later"][0] == "BridgeStateError" and s["later"][2] < 2.0, (r, s)


# --- bad input at planning: the same ValueError on every rank, before data moves ----------------


def fails_alike(job: Job, fn: Any) -> str:
    """``fn`` raises the same ValueError on every rank, fast, with nothing posted; its text."""
    before = job.distiller.bridge.executor.slots_issued
    got = outcome(fn)
    seen = everyone((got[0], got[1], got[2] < T_S, job.distiller.bridge.executor.slots_issued))
    assert all(s[:3] == (seen[0][0], seen[0][1], True) for s in seen), seen
    assert seen[0][0] == "ValueError", seen[0]
    assert job.distiller.bridge.executor.slots_issued == before
    assert job.distiller.bridge.lifecycle.failure is None  # the bridge stays usable
    return seen[0][1]


def test_cu_seqlens_shorter_than_the_tokens(world):
    from megatron.core.packed_seq_params import PackedSeqParams

    from mopd.mcore import MicroBatch

    job = new_job()
    s_mbs, t_mbs = job.batches(1, variable=False)
    if job.smesh.coord(job.rank).dp_rank == 1:  # 2 packed samples of 16 tokens, cu_seqlens 24
        cu = torch.tensor([0, 16, 24], dtype=torch.int32)
        psp = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=cu,
            cu_seqlens_kv_padded=cu,
            max_seqlen_q=16,
            max_seqlen_kv=16,
        )
        mb = s_mbs[0]
        s_mbs[0] = MicroBatch(
            sample_ids=mb.sample_ids,
            tokens=mb.tokens.reshape(1, -1),
            position_ids=mb.position_ids.reshape(1, -1),
            packed_seq_params=psp,
        )
    msg = fails_alike(job, lambda: job.distiller.step(student=s_mbs, teachers=[t_mbs]))
    assert msg.startswith(
        "bridge input rejected on global rank(s) [2, 3]: global rank 2: student micro-batch 0: "
        "tokens (1, 32) hold 32 positions on this CP rank, but cu_seqlens_q_padded ends at 24"
    ), msg
    assert job.run(2, variable=False) is not None or not job.smesh.is_last_stage(job.rank)


def test_no_micro_batches_on_a_student_stage_that_is_not_the_last(world):
    job = new_job(student_pp=2)  # student stages: ranks 0-1, then 2-3
    s_mbs, t_mbs = job.batches(1, variable=False)
    msg = fails_alike(
        job,
        lambda: job.distiller.step(student=[] if job.rank == 0 else s_mbs, teachers=[t_mbs]),
    )
    assert msg == (
        "bridge input rejected on global rank(s) [0]: global rank 0: student (student "
        "Mesh(tp=2, cp=1, dp=1, pp=2, ranks=0..3)): this rank holds a stage of it, so it must "
        "pass its micro-batches (one per micro-batch of the step), got list of 0"
    ), msg
    fewer = fails_alike(
        job,
        lambda: job.distiller.step(student=s_mbs[:2] if job.rank == 1 else s_mbs, teachers=[t_mbs]),
    )
    assert fewer == (
        "bridge input rejected on global rank(s) [1]: global rank 1: this rank gives different "
        "micro-batch counts: student's micro-batches 2, teacher 0's micro-batches 3, teacher "
        "0's layouts 3"
    ), fewer


def test_token_ids_beyond_the_vocabulary_under_tp(world):
    job = new_job()
    s_mbs, t_mbs = job.batches(1, variable=False)
    if job.rank == 1:
        s_mbs[1].tokens[0, 3] = V  # megatron's vocab-parallel embedding would zero it silently
    msg = fails_alike(job, lambda: job.distiller.step(student=s_mbs, teachers=[t_mbs]))
    assert msg.startswith(
        "bridge input rejected on global rank(s) [1]: global rank 1: student micro-batch 1: "
        f"token ids span [0, {V}], outside the model's vocabulary [0, {V})"
    ), msg


@pytest.mark.parametrize("allowed", [False, True], ids=["refused", "allowed"])
def test_one_sample_on_two_student_dp_ranks(world, allowed):
    job = new_job(duplicate_samples=allowed)
    ids = [100 + i for i in range(M * GLOBAL_MB)]
    ids[3] = ids[0]  # micro-batch 0: DP rank 0 gets samples 0-1, DP rank 1 samples 2-3
    s_mbs, t_mbs = job.batches(1, variable=False, ids=ids)
    if t_mbs is not None:  # the teacher holds it once
        from mopd.mcore import padded_micro_batch

        t_mbs[0] = padded_micro_batch(ids[:3], t_mbs[0].tokens[:3])
    if allowed:  # asked for: the step runs
        with job.distiller.step(student=s_mbs, teachers=[t_mbs]) as step:
            job.schedule(step)
        assert step.mean_loss() is not None
        return
    msg = fails_alike(job, lambda: job.distiller.step(student=s_mbs, teachers=[t_mbs]))
    # found by the first rank of the later student group that wants it (DP rank 1's, global 2)
    assert msg.startswith(
        "bridge input rejected (found by global rank 2): micro-batch 0: sample id 100 is wanted "
        "by student DP ranks 0 and 1: it would be trained on twice"
    ), msg


def test_a_student_mesh_that_disagrees_with_its_pg_collection(world):
    got = outcome(lambda: new_job(wrong_pg=True))
    seen = everyone(got[:2])
    assert all(s == seen[0] for s in seen), seen
    kind, msg = seen[0]
    assert kind == "ValueError", seen[0]
    assert msg.startswith(
        "Distiller set-up rejected (found by global rank 0; 3 other rank(s) also found "
        "problems): the student: its pg_collection.tp spans global ranks [0, 1, 2, 3], but its "
        "mesh student Mesh(tp=2, cp=1, dp=2, pp=1, ranks=0..3) puts global rank 0's tp group at [0, 1]"
    ), msg


def test_mean_loss_that_times_out_is_named_and_fails_the_bridge(world):
    """Rank 2 never asks for the mean loss: rank 0 (its DP peer) times out by name; its bridge
    then refuses the next step at once."""
    job = new_job()
    s_mbs, t_mbs = job.batches(1, variable=False)
    with job.distiller.step(student=s_mbs, teachers=[t_mbs]) as step:
        job.schedule(step)
    got = outcome(step.mean_loss) if job.rank != 2 else ("skipped", "", 0.0, None)
    seen = everyone((*got[:3], own_view(got)))
    kind, msg, elapsed, own = seen[0]
    assert kind == "BridgeTimeoutError", seen
    assert msg.startswith(  # the census: rank 2 never came (it waits elsewhere, behind)
        "global rank 2 failed first (step 0, done): it is behind its peers, waiting in "
    ), msg
    assert own.startswith(
        "global rank 0: mean_loss()'s all-reduce over the student's DP x CP group (global ranks "
        "[0, 2]) did not complete within BridgeConfig.timeout_s=4 s"
    ), own
    assert elapsed <= T_S + SLACK_S, seen
    if job.rank == 0:
        nxt = outcome(lambda: job.distiller.step(student=s_mbs, teachers=[t_mbs]))
        assert nxt[0] == "BridgeStateError" and "mean_loss()'s all-reduce" in nxt[1], nxt


def test_non_finite_teacher_rows_are_named_before_the_loss_reads_them(world):
    """The teacher's hidden states of micro-batch 1 turn NaN (both teacher ranks): every student
    rank raises ``BridgeNonFiniteError`` inside megatron's schedule, naming teacher 0,
    micro-batch 1 and itself, before the loss reads the rows; the next step is the same
    ``BridgeStateError`` on every rank, at once."""
    job = new_job()
    calls = [0]
    if job.teacher is not None:

        def poison(module: Any, args: Any, out: torch.Tensor) -> None:
            if calls[0] == 1:
                out.fill_(float("nan"))
            calls[0] += 1

        job.teacher.decoder.final_layernorm.register_forward_hook(poison)
    first = outcome(lambda: job.run(1, variable=True))
    nxt = outcome(lambda: job.run(2, variable=True))
    seen = everyone({"first": first[:3], "next": nxt[:3]})
    for r, s in enumerate(seen):
        kind, msg, _ = s["first"]
        assert kind == "BridgeNonFiniteError", (r, s)
        assert msg.startswith(
            f"global rank {r}: non-finite (NaN/Inf) teacher rows arrived in micro-batch 1 of "
            "step 0: teacher 0: "
        ), msg
        kind, msg, elapsed = s["next"]
        assert kind == "BridgeStateError" and elapsed < 2.0, (r, s)
        assert "(first failure on global rank 0: global rank 0: non-finite (NaN/Inf)" in msg, msg


def test_a_teacher_pass_raising_on_one_rank_fails_the_step_by_name_everywhere(world):
    """Rank 1's teacher forward raises inside ``distiller.step(...)`` (before the schedule): its
    step is abandoned there; its teacher TP peer (rank 0) times out in megatron's own
    all-reduce (torch's error); the students waiting for rank 1's rows time out by name; no
    rank returns. Afterwards every rank's calls are refused or time out by name, then refused
    at once."""
    job = new_job()
    if job.rank == 1:

        def broken(module: Any, args: Any) -> None:
            raise Injected("rank 1: the teacher's forward fails")

        job.teacher.decoder.register_forward_pre_hook(broken)
    first = outcome(lambda: job.run(1, variable=False))
    nxt = outcome(lambda: job.run(2, variable=False))
    later = outcome(lambda: job.run(3, variable=False))
    seen = everyone({"first": first[:3], "next": nxt[:3], "later": later[:3]})
    named = ("BridgeStateError", "BridgeTimeoutError", "BridgeCommError")
    assert seen[1]["first"][0] == "Injected", seen[1]
    for r, s in enumerate(seen):
        assert s["first"][0] != "ok", (r, s)
        assert s["next"][0] in named and s["next"][2] <= 2 * T_S + SLACK_S, (r, s)
        assert s["later"][0] == "BridgeStateError" and s["later"][2] < 2.0, (r, s)
    assert "step 0 abandoned on global rank 1" in seen[1]["later"][1], seen[1]
