"""Tier 2 (launch): the worlds as Ray worker groups (:class:`mopd.mcore.WorkerGroup`) on a local
Ray cluster, CPU only.

What a user who runs the teacher's and the student's worlds as Ray worker groups relies on
(:mod:`tests.support.worlds_job` in each actor, as ``torchrun`` runs it: teacher TP2 PP2 in world
``teacher-0``, student TP2 DP2 + SP in world ``student``, 4 actors each):

- the step is right: every student rank's loss and every ``main_grad`` match float64 (the
  rows themselves are bit-equal to one world's in tests/launch/test_worlds.py: the same bridge
  under torchrun);
- a teacher rank SIGKILLed in its forward is named in both places: on every student rank by its
  world (``global rank 1 of world "teacher-0"`` before ``failed first``, within the link's
  timeout), and on the driver, whose call on the teacher group raises the library's
  ``BridgeCommError`` naming that actor (Ray's actor death kept as its cause);
- the group's own contract, without torch.distributed: bad input is a ``ValueError`` naming the
  values; results come back in rank order, each actor with its ``env://`` variables; actors
  that do not answer in time are a ``BridgeTimeoutError`` naming them; an actor killed is a
  ``BridgeCommError`` naming it; an exception raised by a method keeps its class and names the
  rank.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from ray.exceptions import RayActorError

from mopd.bridge.errors import BridgeCommError, BridgeTimeoutError
from mopd.mcore import WorkerGroup

pytestmark = pytest.mark.launch

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 600  # the longest any group or launch may take here (the job's own timeout is 60 s)
LINK_TIMEOUT_S = 60  # tests.support.worlds_job's timeout_s


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """A local Ray cluster for the module: 8 CPUs (one per actor of the two worlds), quiet; the
    actors import this checkout's ``tests`` (``PYTHONPATH``) wherever pytest runs from."""
    ray.init(
        num_cpus=8,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
    )
    yield
    ray.shutdown()


class WorldsJob:
    """One rank of a world in a Ray actor: :func:`tests.support.worlds_job.main` from the
    ``env://`` variables its worker group set, as under torchrun."""

    def run(self, argv: list[str]) -> int:
        from tests.support import worlds_job

        worlds_job.main(argv)
        return int(os.environ["RANK"])


def _groups(out: Path, fault: str | None) -> tuple[WorkerGroup, WorkerGroup, Any, Any]:
    """The student's and the teacher's worker groups, each running its world's job (started,
    not awaited), connected by one address on the student world's rank 0."""
    student = WorkerGroup(WorldsJob, world="student", size=4, timeout_s=TIMEOUT)
    try:
        teacher = WorkerGroup(WorldsJob, world="teacher-0", size=4, timeout_s=TIMEOUT)
    except BaseException:
        student.shutdown()
        raise
    address = student.link_address()
    common = ["--address", address, "--out", str(out), *(["--fault", fault] if fault else [])]
    serving = teacher.submit("run", ["--world", "teacher-0", *common])
    learning = student.submit(
        "run", ["--world", "student", "--worlds", "student,teacher-0", *common]
    )
    return student, teacher, serving, learning


def _reports(out: Path, world: str) -> list[dict[str, Any]]:
    return [torch.load(out / f"{world}-{r}.pt", weights_only=False) for r in range(4)]


# ---- the worlds as worker groups -----------------------------------------------------------------


def test_worker_groups_match_float64_on_every_student_rank(cluster: None, tmp_path: Path) -> None:
    student, teacher, serving, learning = _groups(tmp_path, None)
    with student, teacher:
        assert learning.get() == [0, 1, 2, 3]  # every actor's answer, in rank order
        assert serving.get() == [0, 1, 2, 3]
    reps = _reports(tmp_path, "student")
    for rank, got in enumerate(reps):
        assert got["problems"] == [], (rank, got["problems"])  # loss and main_grads vs float64
        assert sorted(got["rows"]) == [0, 1], rank  # both micro-batches' rows arrived
        for i, rows in got["rows"].items():
            assert rows and all(r.numel() > 0 for r in rows.values()), (rank, i)
    assert len({float(rep["loss"]) for rep in reps}) == 1  # the step's mean loss, on every rank


def test_a_killed_teacher_actor_is_named_by_both_worlds_and_the_driver(
    cluster: None, tmp_path: Path
) -> None:
    student, teacher, serving, learning = _groups(tmp_path, "kill-teacher")
    with student, teacher:
        t0 = time.monotonic()
        with pytest.raises(BridgeCommError) as err:
            serving.get()  # teacher rank 1 SIGKILLs itself in its forward of step 0
        driver_s = time.monotonic() - t0
        assert learning.get() == [0, 1, 2, 3]  # each student rank reported its error
    text = str(err.value)
    assert text.startswith('global rank 1 of world "teacher-0" failed in run()'), text
    assert "the process died" in text, text
    assert isinstance(err.value.__cause__, RayActorError)  # Ray's own error, kept
    assert any("Ray's error" in n for n in err.value.__notes__), err.value.__notes__
    # ...within the link's timeout, from the start of the groups' jobs (their models included)
    assert driver_s < LINK_TIMEOUT_S + 30, driver_s
    for rank, rep in enumerate(_reports(tmp_path, "student")):
        assert rep["error"] == "BridgeCommError", (rank, rep)
        assert 'global rank 1 of world "teacher-0"' in rep["text"].split("failed first")[0], rep
        assert rep["elapsed_s"] < LINK_TIMEOUT_S + 30, (rank, rep["elapsed_s"])


# ---- the group's own contract ----------------------------------------------------------------


class Probe:
    """A plain actor class: what a group gave it, and methods that sleep or raise by rank."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def env(self) -> dict[str, str | None]:
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PROBE")
        return {"tag": self.tag, **{k: os.environ.get(k) for k in names}}

    def nap(self, seconds: float, ranks: list[int]) -> int:
        rank = int(os.environ["RANK"])
        if rank in ranks:
            time.sleep(seconds)
        return rank

    def fail(self, rank: int) -> int:
        if int(os.environ["RANK"]) == rank:
            raise KeyError(f"no such thing on rank {rank}")
        return int(os.environ["RANK"])


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"world": "w", "size": 0}, ("size", "got 0")),
        ({"world": "w", "size": -2}, ("size", "got -2")),
        ({"world": "w", "size": 2.0}, ("size", "got 2.0")),
        ({"world": "teacher 0", "size": 2}, ("world", "got 'teacher 0'")),
        ({"world": "", "size": 2}, ("world", "got ''")),
        ({"world": "a/b", "size": 2}, ("world", "got 'a/b'")),
        ({"world": "w", "size": 2, "env": {"MASTER_PORT": "1"}}, ("env", "['MASTER_PORT']")),
        ({"world": "w", "size": 2, "env": {"X": 1}}, ("env", "got {'X': 1}")),
        ({"world": "w", "size": 2, "num_cpus_per_worker": -1}, ("num_cpus_per_worker", "got -1")),
        ({"world": "w", "size": 2, "timeout_s": 0}, ("timeout_s", "got 0")),
    ],
)
def test_bad_input_is_a_value_error_naming_the_values(
    kwargs: dict[str, Any], named: tuple[str, ...]
) -> None:
    with pytest.raises(ValueError) as err:
        WorkerGroup(Probe, **kwargs)  # refused before any actor starts (no Ray needed)
    for part in named:
        assert part in str(err.value), (part, str(err.value))


def test_results_in_rank_order_each_actor_with_its_variables(cluster: None) -> None:
    with WorkerGroup(Probe, world="probe", size=3, env={"PROBE": "yes"}, args=("t",)) as group:
        got = group.call("env")
        host, port = group.master_address.rsplit(":", 1)
        assert got == [
            {"tag": "t", "RANK": str(r), "WORLD_SIZE": "3", "LOCAL_RANK": str(r),
             "MASTER_ADDR": host, "MASTER_PORT": port, "PROBE": "yes"}
            for r in range(3)
        ]  # fmt: skip
        assert group.link_address().startswith(f"{host}:")
        with pytest.raises(KeyError) as err:  # a method's own error keeps its class
            group.call("fail", 2)
        assert 'global rank 2 of world "probe"' in "".join(err.value.__notes__)


def test_silent_actors_are_a_timeout_error_naming_them(cluster: None) -> None:
    with WorkerGroup(Probe, world="sleepy", size=3, args=("t",), timeout_s=60) as group:
        group.timeout_s = 2  # started: its calls wait this long from now on
        t0 = time.monotonic()
        with pytest.raises(BridgeTimeoutError) as err:
            group.call("nap", 60, [0, 2])  # the group's timeout
        assert time.monotonic() - t0 < 2 + 10
        assert 'global ranks [0, 2] of world "sleepy" did not answer nap()' in str(err.value)
        assert "ranks that answered: [1]" in str(err.value)
        t0 = time.monotonic()
        with pytest.raises(BridgeTimeoutError) as err:  # a timeout of its own: 0 and 2 still nap
            group.submit("nap", 0, []).get(timeout_s=0.5)
        assert time.monotonic() - t0 < 0.5 + 10
        assert 'global ranks [0, 2] of world "sleepy" did not answer nap() within 0.5 s' in str(
            err.value
        )


def test_a_killed_actor_is_a_comm_error_naming_it(cluster: None) -> None:
    with WorkerGroup(Probe, world="w", size=3, args=("t",), timeout_s=60) as group:
        pending = group.submit("nap", 60, [1])
        group.kill(1)
        t0 = time.monotonic()
        with pytest.raises(BridgeCommError) as err:
            pending.get()
        assert time.monotonic() - t0 < 30
        assert str(err.value).startswith('global rank 1 of world "w" failed in nap(): the process')
        assert "killed by WorkerGroup.kill" in str(err.value)
        assert isinstance(err.value.__cause__, RayActorError)
        with pytest.raises(BridgeCommError, match='global rank 1 of world "w"'):
            group.call("env")  # it stays dead: its world cannot take it back
        with pytest.raises(ValueError, match="got 3"):
            group.kill(3)
