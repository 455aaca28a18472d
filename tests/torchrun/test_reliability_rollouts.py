"""Tier 2 (4 ranks, gloo): the on-policy surface (``Distiller.step(rollouts, ...)``) is as reliable
as the rest.

The job is the reliability job in the README's topology (``tests/support/distill_job.py``:
teachers ``tp2 pp2`` and ``tp2 dp2``, student ``tp2 pp2``, real GPTModels, a Distiller around
megatron-core's own schedule, forward only, so a step's loss depends only on its rows and is
compared bit for bit). The samples sit on global rank 0 (the holder); the others pass ``None``.

- sample ids anywhere in their documented range (every non-negative int64, ``0 <= id <
  2**63``) give exactly the loss of the same samples under ids ``0..7``;
- a malformed input (each of the table's: a bad field, a non-``Rollouts``, the exception a
  rank's ``Rollouts`` raised, ``num_micro_batches`` left out) on one rank (not the holder), on
  the holder, or on every rank -> the same ``ValueError`` on every rank, fast, naming the rank,
  the field's index and value, before any token moves; the bridge stays usable and the next
  step is exact;
- a rank that raises or stalls inside the rollouts exchange (between the headers' all-gather
  and the tokens' all-to-all), raises building its micro-batches from it, or never calls the step (it goes on to the job's next
  collective) -> every other rank's first error is a named bridge error leading with ``global
  rank r failed first (step 0, the rollouts exchange)`` (or where the absent rank is), within
  ``timeout_s`` + 30 s, never a raw transport error; the next step is the library's
  ``BridgeStateError`` (on the absent rank, alone in its exchange: a named timeout).

- on a ``GroupPool()`` without a timeout, a student rank asleep ``4 T`` before its first
  forward -> every other rank named within ``2 T + 4`` s, before the sleeper wakes: every wait
  under the Distiller is bounded by its ``timeout_s``, the pipeline groups made before it
  included.

A rank killed inside the exchange is ``tests/launch/test_reliability_kill.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.support.distill_job import N_ROLLOUTS, Injected, Job, sleep_at
from tests.support.megatron_cpu import megatron_world
from tests.support.reliability import everyone, outcome, own_view

TORCHRUN_NPROC = 4
TORCHRUN_TIMEOUT = 500
# strict point-to-point mode off: it bounds every wait by its group's current timeout itself
# (NCCL's behaviour), which would hide gloo's fixed point-to-point timeout that the GroupPool()
# case checks; the same job's steps run under it in test_reliability_steps.py

T_S = 4.0  # the bridge's and the groups' timeout
SLACK_S = 30.0  # what a peer may take past the timeout to be named (the census included)
HOLDER = 0  # the rank holding the step's samples
NAMED = ("BridgeTimeoutError", "BridgeCommError", "BridgeStateError")
SEED = 3

world = pytest.fixture(scope="module")(megatron_world)


@pytest.fixture(scope="module")
def job(world: Any) -> Any:
    """One job shared by the cases that leave it usable."""
    j = Job(timeout_s=T_S, readme=True)
    yield j
    j.close()


@pytest.fixture(scope="module")
def clean(job: Any) -> float | None:
    """The fault-free loss of the step of seed :data:`SEED` (ids ``0..7``)."""
    return job.run_rollouts(job.rollouts(SEED, ids=list(range(N_ROLLOUTS))))


#: sample ids at the edges of the documented range, and spread over it
EDGE_IDS = {
    "top": [2**63 - N_ROLLOUTS + j for j in range(N_ROLLOUTS)],
    "spread": [j * 2**59 + 1 for j in range(N_ROLLOUTS)],
    "mixed": [2**63 - 1, 0, 2**62, 5, 2**63 - 2, 2**32, 1, 2**61 + 3],
}


def test_sample_ids_anywhere_in_their_range_give_exactly_the_loss_of_small_ids(
    job: Any, clean: float | None
) -> None:
    """The same samples (tokens, teachers, advantages) under ids ``0..7`` and under ids at the
    top of int64, spread over it in steps of ``2**59``, or mixed: the same loss, bit for bit,
    on every rank of the student's last stage (the ids only name the samples)."""
    got = {name: job.run_rollouts(job.rollouts(SEED, ids=ids)) for name, ids in EDGE_IDS.items()}
    seen = everyone({"small": clean, **got})
    for r, s in enumerate(seen):
        if job.smesh.is_last_stage(r):
            assert s["small"] is not None and s["small"] > 0, s
            assert all(s[name] == s["small"] for name in EDGE_IDS), (r, s)
    print("losses (rank 2):", seen[2])


# --- malformed input on one rank, the holder, every rank: the same ValueError everywhere -------


def _with(good: Any, **change: Any) -> Any:
    """``good``'s fields with ``change`` (a new ``Rollouts``; its constructor never raises)."""
    from mopd.mcore import Rollouts

    fields = {k: getattr(good, k) for k in ("prompts", "responses", "teachers", "advantages")}
    fields["sample_ids"] = list(range(N_ROLLOUTS))
    fields.update(change)
    return Rollouts(**fields)


def _meta_prompt(good: Any) -> Any:
    return _with(good, prompts=[good.prompts[0].to("meta"), *good.prompts[1:]])


def _failed_build(good: Any) -> Any:
    try:  # what a sampler that fails hands the step: its exception
        raise RuntimeError("the sampler ran out of memory")
    except RuntimeError as exc:
        return exc


#: case -> (what a rank passes instead of its rollouts, given the good ones; what the shared
#: error says, after "global rank r")
MALFORMED: dict[str, tuple[Callable[[Any], Any], str]] = {
    "id 2**63": (
        lambda g: _with(g, sample_ids=[*range(N_ROLLOUTS - 1), 2**63]),
        ": Rollouts: sample_ids[7] is 9223372036854775808, outside [0, 2**63)",
    ),
    "float ids": (
        lambda g: _with(g, sample_ids=[j + 0.5 for j in range(N_ROLLOUTS)]),
        ": Rollouts: sample_ids[0] is 0.5 (float): give an integer per sample",
    ),
    "float teachers": (
        lambda g: _with(g, teachers=[0.9, 1.7] * (N_ROLLOUTS // 2)),
        ": Rollouts: teachers[0] is 0.9 (float): give an integer per sample",
    ),
    "bool teachers": (
        lambda g: _with(g, teachers=[True, False] * (N_ROLLOUTS // 2)),
        ": Rollouts: teachers[0] is True (bool): give an integer per sample",
    ),
    "a None teacher": (
        lambda g: _with(g, teachers=[0, 1, None, *g.teachers[3:]]),
        ": Rollouts: teachers[2] is None (NoneType)",
    ),
    "a string advantage": (
        lambda g: _with(g, advantages=[0.0, 0.0, "0.5", *[0.0] * (N_ROLLOUTS - 3)]),
        ": Rollouts: advantages[2] is '0.5' (str): give a real number per sample",
    ),
    "-inf at index 7": (
        lambda g: _with(g, advantages=[0.0] * (N_ROLLOUTS - 1) + [float("-inf")]),
        ": Rollouts: advantages[7] is -inf: advantages must be finite",
    ),
    "a meta prompt": (_meta_prompt, ": Rollouts: prompt 0 is on the meta device"),
    "a tuple": (
        lambda g: (g.prompts, g.responses),
        " passed a tuple, not a Rollouts (or None, or the exception that building them raised)",
    ),
    "a dict": (lambda g: {"prompts": g.prompts}, " passed a dict, not a Rollouts"),
    "the constructor's exception": (
        _failed_build,
        " could not build its rollouts: RuntimeError: the sampler ran out of memory",
    ),
    "num_micro_batches left out": (
        lambda g: "omit M",
        ": num_micro_batches is missing: Distiller.step(rollouts, num_micro_batches=M) on "
        "every rank",
    ),
}
#: who passes the malformed input: one rank that holds nothing, the holder, every rank
PLACES = {"one": (3,), "holder": (HOLDER,), "all": (0, 1, 2, 3)}


@pytest.mark.parametrize("place", PLACES, ids=list(PLACES))
@pytest.mark.parametrize("case", MALFORMED, ids=list(MALFORMED))
def test_malformed_rollouts_are_the_same_value_error_on_every_rank(
    job: Any, clean: float | None, case: str, place: str
) -> None:
    make, says = MALFORMED[case]
    good = job.rollouts(SEED, holder=None)  # every rank builds them; the holder passes them
    bad = job.rank in PLACES[place]
    held = make(good) if bad else good if job.rank == HOLDER else None
    kwargs = {} if held == "omit M" else {"num_micro_batches": 3}
    if held == "omit M":
        held = good if job.rank == HOLDER else None
    ex = job.distiller.bridge.executor
    before = ex.slots_issued
    got = outcome(lambda: job.distiller.step(held, **kwargs))
    seen = everyone((got[0], got[1], got[2] < T_S, ex.slots_issued == before, ex.lifecycle.failure))
    assert all(s == seen[0] for s in seen), seen  # the same error, type and text, everywhere
    kind, msg, fast, nothing_moved, failure = seen[0]
    assert kind == "ValueError" and fast and nothing_moved and failure is None, seen[0]
    first = PLACES[place][0]
    assert msg.startswith(f"rollouts rejected (found by global rank {first}"), msg
    assert f"global rank {first}{says}" in msg, msg
    assert "[-1]" not in msg, msg  # never the library's placeholder id


def test_after_the_refusals_the_next_step_is_exact(job: Any, clean: float | None) -> None:
    """A rank appending to its prompts list after building its ``Rollouts`` changes nothing
    (the rollouts copied it); and the step is the fault-free one, bit for bit."""
    from mopd.mcore import Rollouts

    good = job.rollouts(SEED, ids=list(range(N_ROLLOUTS)))
    if good is not None:
        prompts = list(good.prompts)
        held = Rollouts(
            prompts=prompts,
            responses=good.responses,
            teachers=good.teachers,
            advantages=good.advantages,
            sample_ids=good.sample_ids,
        )
        prompts.append(torch.ones(2, dtype=torch.int64))
    else:
        held = None
    loss = job.run_rollouts(held)
    seen = everyone((loss, clean))
    assert all(s[0] == s[1] for s in seen), seen


def test_sample_ids_on_some_ranks_only_name_the_ranks_not_a_placeholder(job: Any) -> None:
    from mopd.mcore import Rollouts

    good = job.rollouts(SEED, holder=None)
    held = None
    if job.rank == HOLDER:
        held = _with(good)  # ids 0..7
    elif job.rank == 2:  # one sample of its own, without an id
        held = Rollouts(prompts=good.prompts[:1], responses=good.responses[:1])
        held = _with(held, teachers=[0], advantages=[0.0], sample_ids=None)
    got = outcome(lambda: job.distiller.step(held, num_micro_batches=3))
    seen = everyone(got[:2])
    assert all(s == seen[0] for s in seen), seen
    assert seen[0] == (
        "ValueError",
        "rollouts rejected: sample_ids are given on global ranks [0] but not on [2]: give them "
        "everywhere or nowhere",
    ), seen[0]


# --- faults in the rollouts exchange: named on every rank, then the library's state error ------


def _in_exchange(monkeypatch: Any, rank: int, fault: Callable[[], None], *, after: bool) -> None:
    """Global rank ``rank`` runs ``fault`` inside the rollouts exchange, after the headers'
    all-gather, before the tokens' all-to-all; or (``after``) once the exchange is done, as it
    builds its micro-batches from it (before the step's planning)."""
    import torch.distributed as dist

    from mopd.mcore import distill, rollouts

    if dist.get_rank() != rank:
        return
    module, name = (distill, "rollout_micro_batches") if after else (rollouts, "_send_tokens")
    inner = getattr(module, name)

    def faulty(*args: Any, **kwargs: Any) -> Any:
        fault()
        return inner(*args, **kwargs)

    monkeypatch.setattr(module, name, faulty)


def _raise() -> None:
    raise Injected("rank 1 fails inside the rollouts exchange")


def _stall() -> None:
    time.sleep(T_S + 4.0)


@pytest.mark.parametrize("fault", ["raises", "stalls", "raises after", "never calls"])
def test_a_fault_in_the_rollouts_exchange_is_named_on_every_rank(
    world: Any, monkeypatch: Any, fault: str
) -> None:
    fresh = Job(timeout_s=T_S)  # a fault breaks its groups: a job of its own
    culprit = 3 if fault == "never calls" else 1
    if fault != "never calls":
        how = _stall if fault == "stalls" else _raise
        _in_exchange(monkeypatch, culprit, how, after=fault == "raises after")
    held = fresh.rollouts(SEED)
    if fault == "never calls" and fresh.rank == culprit:
        first = ("skipped", "", 0.0, None)  # it goes on to the next collective of the job
    else:
        first = outcome(lambda: fresh.run_rollouts(held))
    monkeypatch.undo()
    seen_first = everyone({"first": first[:3], "own": own_view(first)})
    nxt = outcome(lambda: fresh.run_rollouts(held))
    seen = [{**a, "next": b} for a, b in zip(seen_first, everyone(nxt[:3]), strict=True)]
    where = "before any step" if fault == "never calls" else "step 0, the rollouts exchange"
    lead = f"global rank {culprit} failed first ({where}): "
    for r, s in enumerate(seen):
        kind, msg, elapsed = s["first"]
        if r == culprit:
            want = {"stalls": None, "never calls": "skipped"}.get(fault, "Injected")
            assert want is None or kind == want, (r, s)
        else:
            assert kind in NAMED and msg.startswith(lead), (r, s)
            assert elapsed <= T_S + SLACK_S, (r, s)
        if r != culprit or fault != "never calls":
            assert s["next"][0] == "BridgeStateError" and s["next"][2] < 2.0, (r, s)
        else:  # it never saw the failure: its exchange, alone, times out by name
            assert s["next"][0] in NAMED and s["next"][1].startswith(lead), (r, s)
    if fault.startswith("raises"):
        assert seen[2]["first"][1].startswith(lead + "Injected: rank 1 fails inside"), seen[2]
    if fault == "stalls":
        assert "busy outside any collective" in seen[0]["first"][1], seen[0]
    print(fault, [(s["first"][0], round(s["first"][2], 1)) for s in seen])
    fresh.close()


# --- every wait bounded: a GroupPool() in the README's topology ---------------------------------


def test_a_group_pool_without_a_timeout_bounds_every_wait_in_the_readme_topology(world: Any):
    """Student rank 3 sleeps ``4 T`` before its first forward, on a pool made without a
    timeout: every other rank's first error is a named bridge error leading with rank 3 (alive,
    busy outside any collective) within ``2 T + 4`` s, well before rank 3 wakes, so no wait
    outlasts the Distiller's timeout: megatron's TP all-reduce, the bridge's waits, and
    megatron's pipeline sends and receives on the pipeline groups made before the Distiller
    (gloo keeps a group's point-to-point timeout from its creation, ``GroupPool()``'s 300 s:
    the CPU patches bound those waits by the group's current timeout)."""
    t = 3.0  # the Distiller's timeout (the pool has none)
    job = Job(timeout_s=t, pool_timeout=False, readme=True)
    assert job.pool.timeout_s == t  # GroupPool() bounded by the Distiller's timeout
    t0 = time.monotonic()
    first = outcome(lambda: job.run_rollouts(job.rollouts(1), before=sleep_at(3, 0, 4 * t)))
    mine = {"first": first[:3], "own": own_view(first), "rank": job.rank}
    mine["elapsed"] = time.monotonic() - t0
    seen = everyone(mine)
    print("first errors:", [(s["first"][0], round(s["elapsed"], 1)) for s in seen])
    for s in seen:
        kind, msg, _ = s["first"]
        assert kind in NAMED, s
        assert msg.startswith("global rank 3 failed first (step 0, "), s
        assert "busy outside any collective, in before (" in msg, s
        if s["rank"] != 3:
            assert s["elapsed"] <= 2 * t + 4.0, s  # rank 3 sleeps 4 T: nobody waited for it
    job.close()
