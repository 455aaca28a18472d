"""Tier 2 (4 ranks, gloo): faults during a step end in clear errors within the timeout, never hangs.

A rank that *exits* is in tests/launch/test_reliability_exit.py (it kills its torchrun launch).
Meshes: the teacher is ``tp2`` on global ranks 0-1, the student ``tp2`` on 2-3; each teacher rank
sends half of every micro-batch to each student rank, so every student waits on both teachers.
Each case runs one step of ``M`` micro-batches on a bridge built on fresh groups (a failed step
leaves its groups unusable by design) with ``timeout_s = T_S`` for the bridge and its transport,
breaks one rank, and compares what every rank saw (error type, message, elapsed):

- the bridge planned on some ranks only -> the callers get ``BridgeTimeoutError`` from the
  metadata all-gather, naming the group's ranks and the timeout; later calls are refused at once
  (``BridgeStateError``);
- a rank raises after the metadata all-gather, while checking the step -> the others time out
  in the input verdict, naming it; every rank refuses further use, the raising one too;
- a teacher rank raises before its first ``send`` -> the students time out in ``receive(0)``,
  naming that rank and micro-batch 0 (and not the teacher that did send);
- a teacher rank raises between ``send(i)`` and ``send(i + 1)`` -> the students got micro-batch
  ``i`` exact and time out in ``receive(i + 1)``, naming micro-batch ``i + 1`` and that rank; the
  teacher that did send times out at ``finish()`` naming its unmatched sends;
- a failed step -> the next ``plan_step`` raises ``BridgeStateError`` at once on the ranks that
  saw the failure, and the others (the rank that raised, the teacher that sent) time out in its
  metadata all-gather instead of hanging;
- a student rank raises inside ``receive`` (rows arrived, before the TP all-gather) -> its TP
  peer times out in the all-gather, which the error names with its ranks; the raising rank's
  bridge refuses further use;
- a rank never calls ``finish()`` -> harmless without integrity (the others finish, the rank is
  warned at its next ``plan_step``, that step is exact); with integrity on ``finish()`` is a
  collective, so the others time out in the verdict, which the error names;
- a rank slower than the timeout -> the others time out, the sleeper fails too once it arrives;
  a rank slower than its peers but within the timeout (before planning or between two sends)
  changes nothing: every row exact, and the bridge keeps working.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from mopd.bridge import BridgeStep, HiddenStateBridge, Mesh, padded_layout
from mopd.bridge import api as api_mod
from mopd.profiling.synthetic import key_pattern
from tests.support.reliability import everyone, fresh_bridge, outcome, own_view

TORCHRUN_NPROC = 4
TORCHRUN_TIMEOUT = 300
TORCHRUN_STRICT_P2P = 1  # NCCL's point-to-point rules (tests/support/strict_p2p.py)

TEACHER = Mesh(tp=2)  # global ranks 0, 1
STUDENT = Mesh(tp=2, rank_offset=2)  # global ranks 2, 3
H = 8
M = 3  # micro-batches per step
T_S = 3.0  # BridgeConfig.timeout_s and the groups' transport timeout
SLACK_S = 6.0  # scheduling slack on 2 loaded cores
LAYOUTS = [padded_layout([2 * i, 2 * i + 1], 4) for i in range(M)]  # 8 rows per micro-batch
TIMEOUTS = ("BridgeTimeoutError", "BridgeCommError")  # a closed pair may beat the timeout


class Injected(RuntimeError):
    """The fault a test injects on one rank."""


def rank() -> int:
    return dist.get_rank()


def is_teacher() -> bool:
    return TEACHER.is_last_stage(rank())


def is_student() -> bool:
    return STUDENT.is_last_stage(rank())


def bridge(hook: Any = None, **config: Any) -> HiddenStateBridge:
    return fresh_bridge([TEACHER], STUDENT, [H], timeout_s=T_S, hook=hook, **config)


def rows(i: int) -> torch.Tensor:
    return key_pattern(LAYOUTS[i], H, torch.float32)


def plan(b: HiddenStateBridge, m: int = M) -> BridgeStep:
    return b.plan_step(
        teacher_layouts={0: LAYOUTS[:m]} if is_teacher() else None,
        student_layouts=LAYOUTS[:m] if is_student() else None,
    )


def exact(got: dict[int, torch.Tensor], i: int) -> bool:
    """``receive``'s rows are the real tokens of the layout, compact, bit for bit."""
    want = rows(i)[LAYOUTS[i].sample_id_R >= 0]
    return torch.equal(got[0].view(torch.int32), want.view(torch.int32))


def run_step(
    step: BridgeStep, *, before: Callable[[int], None] | None = None, m: int = M
) -> tuple[str, list[int]]:
    """The schedule of one step on this rank, then ``finish()``; ``before(i)`` runs before
    micro-batch ``i``. Returns where it stopped (``"send 2"``, ``"finish"``, ``"done"``) and the
    micro-batches received exact; a raised error carries them as ``exc.where``."""
    done: list[int] = []
    where = ""
    try:
        for i in range(m):
            if before is not None:
                where = f"before {i}"
                before(i)
            if is_teacher():
                where = f"send {i}"
                step.send(i, {0: rows(i)})
            if is_student():
                where = f"receive {i}"
                if exact(step.receive(i), i):
                    done.append(i)
        where = "finish"
        step.finish()
    except Exception as exc:
        exc.where = where  # type: ignore[attr-defined]
        exc.done = done  # type: ignore[attr-defined]
        raise
    return "done", done


def blames_rank_1(msg: str, at: str) -> bool:
    """``msg`` leads with the census's finding: rank 1 (which raised outside the bridge,
    telling it nothing) is the rank the students' transfers wait for, and where it was then."""
    return msg.startswith(f"global rank 1 failed first ({at}): global rank") and (
        " wait for its transfers, and it is waiting in " in msg
    )


def seen_by_all(
    res: tuple[str, str, float, Any], b: HiddenStateBridge | None = None, **more: Any
) -> list[dict[str, Any]]:
    """Every rank's outcome: kind, message, elapsed, where it stopped, the micro-batches it
    received exact, ``b``'s :func:`refusal` afterwards (when given) and ``more``."""
    exc = res[3]
    ok = res[0] == "ok"
    mine = {
        "kind": res[0],
        "msg": res[1],
        "own": own_view(res),
        "elapsed": res[2],
        "where": "done" if ok else getattr(exc, "where", ""),
        "done": res[3][1] if ok else getattr(exc, "done", None),
        **more,
    }
    if b is not None:
        mine["refusal"] = refusal(b)
    return everyone(mine)


def brief(res: tuple[str, str, float, Any]) -> tuple[str, str, float, Any]:
    """``res`` without the exception object (it need not pickle): the result when it passed."""
    return (*res[:3], res[3] if res[0] == "ok" else None)


def refusal(b: HiddenStateBridge) -> dict[str, Any]:
    """What a new step and an exchange on ``b`` do on this rank now (checked by
    :func:`refused` once every rank has reported: an assertion must not leave peers waiting)."""
    again = outcome(lambda: plan(b))
    ex = outcome(lambda: b.exchange(student_layout=LAYOUTS[0]))
    return {"rank": rank(), "plan": again[:3], "exchange": ex[:3]}


def refused(seen: dict[str, Any]) -> None:
    """The bridge refused both at once, locally, naming the earlier failure."""
    kind, msg, elapsed = seen["plan"]
    assert kind == "BridgeStateError" and elapsed < 1.0, seen
    assert msg.startswith(
        f"global rank {seen['rank']}: this bridge cannot be used after a failed exchange ("
    ), msg
    assert seen["exchange"][0] == "BridgeStateError", seen


def test_bridge_called_on_some_ranks_only_times_out_on_the_callers():
    b = bridge()
    mine: dict[str, Any] = {}
    if rank() != 3:
        res = outcome(lambda: plan(b))
        mine = {"first": res[:3], "own": own_view(res), "refusal": refusal(b)}
    seen = everyone(mine)  # the world (not the broken bridge group) is still in step
    for r in (0, 1, 2):
        kind, msg, elapsed = seen[r]["first"]
        assert kind == "BridgeTimeoutError", seen[r]
        # the census found rank 3 behind the others (it never planned), waiting elsewhere
        assert msg.startswith(
            "global rank 3 failed first (before any step): it is behind its peers, waiting in "
        ), msg
        assert msg.endswith(
            f"As a result, global rank {r} (step 0, planning) stopped: the bridge's metadata "
            "all-gather did not complete within BridgeConfig.timeout_s=3 s"
        ), msg
        own = seen[r]["own"]
        assert own.startswith(
            f"global rank {r}: the bridge's metadata all-gather over global ranks [0, 1, 2, 3] "
            "did not complete within BridgeConfig.timeout_s=3 s"
        ), own
        assert "called on some ranks only" in own
        assert T_S * 0.9 <= elapsed <= T_S + SLACK_S, elapsed
        refused(seen[r]["refusal"])
        assert "(BridgeTimeoutError: global rank" in seen[r]["refusal"]["plan"][1]


def test_rank_raising_while_checking_the_step_leaves_the_others_in_the_verdict(monkeypatch):
    """Rank 3 raises after the metadata all-gather, while checking its share of the step: the
    others time out in the verdict that follows it, naming it; every rank refuses from then on
    (the raising one too: its peers may be inside a collective of that step)."""
    b = bridge()
    if rank() == 3:

        def broken(*args: Any, **kwargs: Any) -> list[str]:
            raise Injected("rank 3 fails while checking the step")

        monkeypatch.setattr(api_mod, "rank_checks", broken)
    seen = seen_by_all(outcome(lambda: plan(b)), b)
    assert seen[3]["kind"] == "Injected", seen[3]
    for r in (0, 1, 2):
        s = seen[r]
        assert s["kind"] == "BridgeTimeoutError", s
        assert s["msg"] == (
            "global rank 3 failed first (step 0, planning): Injected: rank 3 fails while checking "
            f"the step. As a result, global rank {r} (step 0, planning) stopped: the bridge's "
            "input verdict did not complete within BridgeConfig.timeout_s=3 s"
        ), s["msg"]
        assert s["own"].startswith(
            f"global rank {r}: the bridge's input verdict over global ranks [0, 1, 2, 3] did not "
            "complete within BridgeConfig.timeout_s=3 s"
        ), s["own"]
        assert T_S * 0.9 <= s["elapsed"] <= T_S + SLACK_S, s
    for s in seen:
        refused(s["refusal"])
    assert "(Injected: rank 3 fails while checking the step)" in seen[3]["refusal"]["plan"][1]


def test_teacher_raising_before_its_first_send_leaves_the_students_waiting_on_it():
    b = bridge()

    def before(i: int) -> None:
        if rank() == 1 and i == 0:
            raise Injected("rank 1 fails after plan_step, before send(0)")

    res = outcome(lambda: run_step(plan(b, m=1), before=before, m=1))
    seen = seen_by_all(res, b if is_student() else None)
    assert seen[1]["kind"] == "Injected"
    assert seen[0]["kind"] == "ok", seen[0]  # one micro-batch: its receivers were all there
    for r in (2, 3):
        s = seen[r]
        assert s["kind"] == "BridgeTimeoutError" and s["where"] == "receive 0", s
        # rank 1 never told the bridge (it raised outside a step block): the first student to
        # time out named the rank whose rows it waited for
        assert blames_rank_1(s["msg"], "step 0, after planning"), s["msg"]
        assert s["own"].startswith(
            f"global rank {r}: the bridge exchange (incomplete: receive from global rank 1 "
            "(micro-batch 0, teacher 0, 2 rows)) did not complete within "
            "BridgeConfig.timeout_s=3 s"
        ), s["own"]
        assert "from global rank 0" not in s["own"]  # rank 0's rows came
        assert T_S * 0.9 <= s["elapsed"] <= T_S + SLACK_S, s
        refused(s["refusal"])


def test_teacher_raising_between_two_sends_times_the_students_out_in_the_next_receive():
    """Rank 1 sends micro-batch 0 and raises before sending 1 (inside the schedule)."""
    b = bridge()

    def before(i: int) -> None:
        if rank() == 1 and i == 1:
            raise Injected("rank 1 fails between send(0) and send(1)")

    step = plan(b)
    res = outcome(lambda: run_step(step, before=before))
    later = outcome(lambda: step.receive(2)) if is_student() else None
    seen = seen_by_all(res, b if rank() != 1 else None, later=later[:2] if later else None)
    assert seen[1]["kind"] == "Injected" and seen[1]["where"] == "before 1"
    for r in (2, 3):
        s = seen[r]
        assert s["kind"] == "BridgeTimeoutError" and s["where"] == "receive 1", s
        assert s["done"] == [0], s  # micro-batch 0 arrived exact before the fault
        assert blames_rank_1(s["msg"], "step 0, sending micro-batch 0"), s["msg"]
        assert s["own"].startswith(
            f"global rank {r}: the bridge exchange (incomplete: receive from global rank 1 "
            "(micro-batch 1, teacher 0, 2 rows)) did not complete within "
            "BridgeConfig.timeout_s=3 s"
        ), s["own"]
        assert "micro-batch 0" not in s["own"] and "from global rank 0" not in s["own"]
        assert T_S * 0.9 <= s["elapsed"] <= T_S + SLACK_S, s
        refused(s["refusal"])
        assert s["later"][0] == "BridgeStateError", s  # the failed step refuses too
    # rank 0 sent every micro-batch; 2 was never received: its finish() names those sends
    s = seen[0]
    assert s["kind"] in TIMEOUTS and s["where"] == "finish", s
    assert blames_rank_1(s["msg"], "step 0, sending micro-batch 0"), s["msg"]
    assert s["own"].startswith(
        "global rank 0: the bridge exchange (incomplete: send to global rank"
    )
    assert "(micro-batch 2, teacher 0, 2 rows)" in s["own"], s["own"]
    assert s["elapsed"] <= 2 * T_S + SLACK_S, s
    refused(s["refusal"])


@pytest.mark.filterwarnings("ignore:global rank 1. a step is planned while")
def test_a_failed_step_fails_the_next_plan_step_clearly_on_every_rank():
    """Rank 1 gives send(0) a buffer of the wrong dtype: a ValueError on rank 1 only (it alone
    sees its buffer); the students time out waiting for its rows. Then every rank plans the next
    step: the ranks that saw the failure refuse at once, the others time out in the metadata
    all-gather (the students never come), within the timeout."""
    b = bridge()
    step = plan(b, m=1)
    if rank() == 1:
        first = outcome(lambda: step.send(0, {0: rows(0).double()}))
    else:
        first = outcome(lambda: run_step(step, m=1))
    nxt = outcome(lambda: plan(b))
    seen = seen_by_all(first, b, next=nxt[:3])
    assert seen[1]["kind"] == "ValueError", seen[1]
    assert "the plan wants torch.float32 on cpu" in seen[1]["msg"]
    assert seen[0]["kind"] == "ok", seen[0]
    assert [seen[r]["kind"] for r in (2, 3)] == ["BridgeTimeoutError"] * 2, seen
    for r in (2, 3):
        assert blames_rank_1(seen[r]["msg"], "step 1, planning"), seen[r]  # it went on
        kind, msg, elapsed = seen[r]["next"]
        assert kind == "BridgeStateError" and elapsed < 1.0, seen[r]
        assert "cannot be used after a failed exchange (BridgeTimeoutError: global rank 1 " in msg
    for r in (0, 1):
        kind, msg, elapsed = seen[r]["next"]
        assert kind in TIMEOUTS, seen[r]
        assert blames_rank_1(msg, "step 1, planning"), msg
        assert f"As a result, global rank {r} (step 1, planning) stopped: the bridge's " in msg
        assert elapsed <= T_S + SLACK_S, seen[r]
    for s in seen:  # now every rank refuses
        refused(s["refusal"])


def test_student_rank_raising_inside_receive_leaves_its_tp_peer_in_the_all_gather():
    def hook(point: str, blocks: list) -> None:
        if point == "received" and rank() == 2:
            raise Injected("rank 2 fails after its rows arrived")

    b = bridge(hook)
    seen = seen_by_all(outcome(lambda: run_step(plan(b, m=1), m=1)), b if is_student() else None)
    assert [s["kind"] for s in seen[:3]] == ["ok", "ok", "Injected"], seen
    s = seen[3]
    assert s["kind"] in TIMEOUTS and s["where"] == "receive 0", s
    assert s["msg"].startswith(
        "global rank 2 failed first (step 0, receiving micro-batch 0): Injected: rank 2 fails "
        "after its rows arrived. As a result, global rank 3 (step 0, receiving micro-batch 0) "
        "stopped: the student TP all-gather after the crossing "
    ), s["msg"]
    assert s["own"].startswith(
        "global rank 3: the student TP all-gather after the crossing (micro-batch 0, over "
        "global ranks [2, 3])"
    ), s["own"]
    assert s["elapsed"] <= T_S + SLACK_S, s
    for r in (2, 3):  # the raising rank's bridge refuses further use too
        refused(seen[r]["refusal"])


def test_a_rank_that_never_calls_finish_without_integrity():
    """Without integrity ``finish()`` waits on nobody: the others finish; the skipping rank is
    warned when it plans again, and that step is exact everywhere."""
    b = bridge()
    step = plan(b)
    if rank() == 0:
        for i in range(M):
            step.send(i, {0: rows(i)})
        res = outcome(lambda: ("done", []))
    else:
        res = outcome(lambda: run_step(step))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nxt = outcome(lambda: run_step(plan(b)))
    texts = [str(w.message) for w in caught]
    seen = seen_by_all(res, next=brief(nxt), warned=texts)
    assert all(s["kind"] == "ok" for s in seen), seen
    assert [seen[r]["done"] for r in (2, 3)] == [list(range(M))] * 2, seen
    assert all(s["next"][0] == "ok" for s in seen), seen
    assert [seen[r]["next"][3][1] for r in (2, 3)] == [list(range(M))] * 2, seen
    assert len(seen[0]["warned"]) == 1, seen[0]
    assert (
        "global rank 0: a step is planned while 1 earlier step(s) of this bridge are not "
        in (seen[0]["warned"][0])
    )
    assert [s["warned"] for s in seen[1:]] == [[]] * 3, seen


def test_a_rank_that_never_calls_finish_with_integrity():
    """With integrity ``finish()`` is a collective (the verdict): the others time out there."""
    b = bridge(integrity=True)
    step = plan(b)
    if rank() == 3:
        got = [exact(step.receive(i), i) for i in range(M)]
        seen = seen_by_all(("ok", "", 0.0, ("receives only", [i for i in range(M) if got[i]])))
    else:
        seen = seen_by_all(outcome(lambda: run_step(step)), b)
    assert seen[3]["done"] == list(range(M)), seen[3]
    for r in (0, 1, 2):
        s = seen[r]
        assert s["kind"] == "BridgeTimeoutError" and s["where"] == "finish", s
        assert s["msg"].startswith(  # it received everything, then went elsewhere
            "global rank 3 failed first (step 0, receiving micro-batch 2): it is behind its "
            "peers, waiting in "
        ), s["msg"]
        assert s["own"].startswith(
            f"global rank {r}: the integrity verdict (all-gather over global ranks [0, 1, 2, 3]) "
            "did not complete within BridgeConfig.timeout_s=3 s"
        ), s["own"]
        assert T_S * 0.9 <= s["elapsed"] <= T_S + SLACK_S, s
        refused(s["refusal"])
    assert seen[2]["done"] == list(range(M))


def test_rank_slower_than_the_timeout():
    b = bridge()

    def run() -> Any:
        if rank() == 3:
            time.sleep(T_S + 2.0)
        return run_step(plan(b))

    seen = seen_by_all(outcome(run), b)
    sleeper = "global rank 3 failed first (before any step): it is alive but busy outside any "
    for r in (0, 1, 2):
        s = seen[r]
        assert s["kind"] == "BridgeTimeoutError", s
        assert s["msg"].startswith(sleeper + "collective, in run (tests/torchrun/"), s
        assert s["own"].startswith(f"global rank {r}: the bridge's metadata all-gather"), s
        assert s["elapsed"] <= T_S + SLACK_S, s
    s = seen[3]  # the sleeper fails too, once it arrives, within the timeout, named
    assert s["kind"] in TIMEOUTS, s
    assert s["msg"].startswith(sleeper), s
    assert s["own"].startswith("global rank 3: the bridge's metadata all-gather"), s
    assert s["elapsed"] <= (T_S + 2.0) + T_S + SLACK_S, s
    for s in seen:
        refused(s["refusal"])


@pytest.mark.parametrize("where", ["before planning", "between two sends"])
@pytest.mark.parametrize("delay_s", [0.5, T_S / 2])
def test_rank_slower_than_its_peers_but_within_the_timeout(where, delay_s):
    b = bridge()

    def before(i: int) -> None:
        if rank() == 1 and where == "between two sends" and i == 1:
            time.sleep(delay_s)

    def run() -> Any:
        if rank() == 1 and where == "before planning":
            time.sleep(delay_s)
        return run_step(plan(b), before=before)

    first = outcome(run)
    again = outcome(lambda: run_step(plan(b)))  # and the same bridge keeps working
    seen = seen_by_all(first, again=brief(again))
    assert all(s["kind"] == "ok" for s in seen), seen
    assert [seen[r]["done"] for r in (2, 3)] == [list(range(M))] * 2, seen
    assert all(s["again"][0] == "ok" for s in seen), seen
    assert [seen[r]["again"][3][1] for r in (2, 3)] == [list(range(M))] * 2, seen


def test_non_finite_teacher_rows_are_named_on_the_ranks_they_reach():
    """Teacher rank 1 sends NaN rows in micro-batch 1: each student rank raises in
    ``receive(1)`` naming teacher 0, micro-batch 1 and where its first bad row came from (rank
    1's crossing, or its TP peer's slice), after micro-batch 0 arrived exact. The teachers'
    sends of micro-batch 2 are never received: they time out at ``finish()``; then every call
    on every rank is refused (the students' next ``plan_step`` times out first, the teachers no
    longer joining), the students' refusals naming the non-finite rows."""
    b = bridge()
    progress: list[int] = []

    def poisoned(i: int) -> torch.Tensor:
        r = rows(i)
        if rank() == 1 and i == 1:
            r[:, 0] = float("nan")
        return r

    def schedule() -> None:
        step = plan(b)
        for i in range(M):
            if is_teacher():
                step.send(i, {0: poisoned(i)})
            if is_student() and exact(step.receive(i), i):
                progress.append(i)
        step.finish()

    first = outcome(schedule)
    nxt = outcome(lambda: plan(b))
    later = outcome(lambda: plan(b))
    seen = everyone(
        {
            "first": first[:3],
            "own": own_view(first),
            "next": nxt[:3],
            "later": later[:3],
            "got": progress,
        }
    )
    for r in (2, 3):
        kind, msg, _ = seen[r]["first"]
        assert kind == "BridgeNonFiniteError" and seen[r]["got"] == [0], seen[r]
        assert msg.startswith(
            f"global rank {r}: non-finite (NaN/Inf) teacher rows arrived in micro-batch 1 of "
            "step 0: teacher 0: 4 of 8 rows (first: row "
        ), msg
        # its own crossing from rank 1, or its TP peer's slice, which rank 1 sent to it
        assert msg.endswith(
            (
                "sent by global rank 1)",
                "sent to it by global rank 1, via the student TP all-gather)",
            )
        ), msg
        assert seen[r]["next"][0] in TIMEOUTS, seen[r]
        assert seen[r]["next"][2] <= T_S + SLACK_S, seen[r]
        assert seen[r]["later"][0] == "BridgeStateError", seen[r]
        assert f"(global rank {r}: non-finite (NaN/Inf) teacher rows" in seen[r]["later"][1]
    for r in (0, 1):
        assert seen[r]["first"][0] in TIMEOUTS, seen[r]
        assert seen[r]["first"][1].startswith(
            "global rank 1 failed first (step 0, its rows of micro-batch 1): it sent non-finite "
            "(NaN/Inf) teacher rows in micro-batch 1 of step 0 (found by global rank "
        ), seen[r]
        assert "(micro-batch 2, teacher 0" in seen[r]["own"], seen[r]
        assert seen[r]["next"][0] == "BridgeStateError" and seen[r]["next"][2] < 1.0, seen[r]
