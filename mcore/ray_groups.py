"""Ray worker groups as torch.distributed worlds: a teacher world and a student world as actors.

Why this file exists: the RL engines that run MOPD at scale (NeMo-RL, verl, slime, OpenRLHF)
start each model's job as a Ray *worker group*: N actors that form one torch.distributed world
of their own from the ``env://`` variables each actor is given (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). A teacher world and a student world of a
bridge across worlds (:func:`mopd.bridge.connect_worlds`) are two such groups, connected by one
address. :class:`WorkerGroup` is the smallest such group, enough to run the library's worlds
from a Ray driver and to test them: actor 0 picks a free port on its node, every actor gets its
rank and actor 0's address before its class is built, :meth:`WorkerGroup.call` runs a method on
every actor and returns the results in rank order. Ray's failures come back as the library's
named errors: an actor that died is a :class:`~mopd.bridge.errors.BridgeCommError` naming its
rank and world, actors that do not answer in time a
:class:`~mopd.bridge.errors.BridgeTimeoutError` naming them; every wait has a timeout.

Adapting it to a framework's own worker groups: verl's and NeMo-RL's ``RayWorkerGroup`` already
set the same ``env://`` variables on each actor, so a worker of theirs runs a world's code as
an actor of this group does: initialize the default group (``init_process_group``), then
``connect_worlds(address, world=...)`` with one address that every world knows (a free port on
the student world's rank 0: :meth:`WorkerGroup.link_address` here), then ``TeacherServer`` on
the teacher's workers and ``Distiller(link=...)`` on the student's. The driver hands over
only that address and collects what the workers return; the rollouts' token ids and the
teachers' hidden states move between the workers over the bridge, never through the driver.

Ray is imported when a group is made, not when this module is: ``pip install
'mopd-bridge[ray]'``.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from mopd.bridge.errors import BridgeCommError, BridgeTimeoutError
from mopd.common.dist import DEFAULT_TIMEOUT_S

__all__ = ["PendingCall", "WorkerGroup"]

#: How long after a call finds an actor dead the group ends its other actors (``grace_s``).
DEFAULT_GRACE_S = 5.0
#: The variables a group sets on each actor (``env`` may not set them).
DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # a world's name, as connect_worlds takes it


class _Worker:
    """One actor of a group (made a Ray actor class by :class:`WorkerGroup`): it sets its
    rank's variables, then builds the group's class and runs its methods."""

    def __init__(self) -> None:
        self.obj: Any = None

    def node(self) -> tuple[str, str]:
        """``(node id, node IP)`` of this actor's node."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        """A port free on this node now."""
        with socket.socket() as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def setup(self, env: dict[str, str], cls: type, args: tuple[Any, ...], kwargs: dict) -> None:
        os.environ.update(env)
        self.obj = cls(*args, **kwargs)

    def run(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return getattr(self.obj, method)(*args, **kwargs)


def _ranks(world: str, ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return f'global rank {ranks[0]} of world "{world}"'
    return f'global ranks {list(ranks)} of world "{world}"'


class PendingCall:
    """A method running on every actor of a :class:`WorkerGroup` (:meth:`WorkerGroup.submit`):
    :meth:`get` waits for its results.

    Attributes:
        method: the method's name.
    """

    def __init__(self, group: WorkerGroup, method: str, refs: list[Any]) -> None:
        self._group = group
        self.method = method
        self._refs = refs

    def get(self, timeout_s: float | None = None) -> list[Any]:
        """Every actor's result, in rank order, once all have answered.

        Raises:
            BridgeCommError: an actor's process died (the first one seen), naming its rank
                and world; Ray's own error is kept as a note and as the cause.
            BridgeTimeoutError: some actors did not answer within ``timeout_s`` (the group's
                timeout by default), naming them.
            Exception: the method raised on an actor: Ray's error (an instance of the raised
                exception's class as well), with a note naming the rank.
        """
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        group = self._group
        timeout = group.timeout_s if timeout_s is None else float(timeout_s)
        what = f"{self.method}()"
        deadline = time.monotonic() + timeout
        waiting = {ref: rank for rank, ref in enumerate(self._refs)}
        results: dict[int, Any] = {}
        while waiting:
            left = deadline - time.monotonic()
            ready: list[Any] = []
            if left > 0:
                ready, _ = ray.wait(list(waiting), num_returns=1, timeout=left)
            if not ready:
                silent = sorted(waiting.values())
                raise BridgeTimeoutError(
                    f"{_ranks(group.world, silent)} did not answer {what} within {timeout:g} s "
                    f"(still running it, or stopped); ranks that answered: {sorted(results)}"
                )
            for ref in ready:
                rank = waiting.pop(ref)
                try:
                    results[rank] = ray.get(ref, timeout=max(deadline - time.monotonic(), 1.0))
                except RayActorError as exc:
                    raise group._died(rank, what, exc) from exc
                except RayTaskError as exc:
                    exc.add_note(f"raised in {what} on {_ranks(group.world, [rank])}")
                    raise
        return [results[r] for r in range(len(self._refs))]


class WorkerGroup:
    """``size`` Ray actors that form one torch.distributed world (``world``): actor ``r`` is
    its rank ``r``, given ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and
    actor 0's ``MASTER_ADDR`` / ``MASTER_PORT`` (a port free on its node) before
    ``actor_cls(*args, **kwargs)`` is built in it.

    The group's own world is its actors' alone: the class initializes it (``env://``, gloo on
    CPU); another world (another group, a torchrun job) joins it only through
    :func:`mopd.bridge.connect_worlds`. Ray must be running (``ray.init``) before a group is
    made.

    Args:
        actor_cls: the class each actor builds (a plain class; not a ``ray.remote`` one).
        world: the world's name, as :func:`~mopd.bridge.connect_worlds` takes it; errors name
            ranks by it (``global rank 1 of world "teacher-0"``).
        size: the number of actors (ranks).
        num_cpus_per_worker: Ray CPUs each actor reserves.
        env: more variables for each actor's process, set when it starts (``OMP_NUM_THREADS``,
            ``PYTHONPATH``, ...); not the ``env://`` ones, which the group sets.
        args, kwargs: ``actor_cls``'s arguments, the same on every actor.
        options: more Ray actor options for every actor (``num_gpus``, a
            ``scheduling_strategy`` with a placement group, ...).
        timeout_s: how long the group waits for its actors: to start, and to answer each
            :meth:`call` (:meth:`PendingCall.get` takes another).
        grace_s: once a call finds an actor dead, the group ends its other actors this many
            seconds later, as torchrun ends a job whose rank died: a world cannot go on without
            a rank, and the other worlds' ranks waiting on it then fail at once (a closed
            connection) instead of at their timeout. The grace lets the survivors name the dead
            rank first (the bridge's census takes up to 2 s). ``None``: leave them running.

    Raises:
        ValueError: bad input (``size``, ``world``, ``env``, ``num_cpus_per_worker``,
            ``timeout_s``), naming the values.
        BridgeCommError, BridgeTimeoutError: an actor died or did not start in time.

    Attributes:
        world, size, timeout_s: as given.
        master_address: ``host:port`` of the group's own rendezvous (actor 0's).
        nodes: each rank's node IP, in rank order.
    """

    def __init__(
        self,
        actor_cls: type,
        *,
        world: str,
        size: int,
        num_cpus_per_worker: float = 1,
        env: Mapping[str, str] | None = None,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        options: Mapping[str, Any] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        grace_s: float | None = DEFAULT_GRACE_S,
    ) -> None:
        if not isinstance(world, str) or not _NAME.match(world):
            raise ValueError(
                f"world must be a name of 1-64 letters, digits, '_', '.' or '-', got {world!r}"
            )
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f'size of world "{world}" must be an int >= 1, got {size!r}')
        if not isinstance(num_cpus_per_worker, (int, float)) or num_cpus_per_worker < 0:
            raise ValueError(f"num_cpus_per_worker must be >= 0, got {num_cpus_per_worker!r}")
        if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if grace_s is not None and (not isinstance(grace_s, (int, float)) or grace_s < 0):
            raise ValueError(f"grace_s must be >= 0 or None, got {grace_s!r}")
        env = dict(env or {})
        reserved = sorted(set(env) & set(DIST_VARS))
        if reserved:
            raise ValueError(f"env may not set {reserved}: the group sets {list(DIST_VARS)}")
        bad = {k: v for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str)}
        if bad:
            raise ValueError(f"env must map names to strings, got {bad!r}")
        if not isinstance(actor_cls, type):
            raise ValueError(f"actor_cls must be a class, got {actor_cls!r}")

        import ray

        self.world = world
        self.size = size
        self.timeout_s = float(timeout_s)
        self.grace_s = grace_s
        self._killed: set[int] = set()
        self._ending: threading.Timer | None = None
        self._actors: list[Any] = []
        opts: dict[str, Any] = {"num_cpus": num_cpus_per_worker, **dict(options or {})}
        opts["max_restarts"] = 0  # a dead rank stays dead: its world cannot take it back
        if env:
            opts["runtime_env"] = {"env_vars": env}
        remote: Any = ray.remote(_Worker)
        self._actors = [remote.options(**opts).remote() for _ in range(size)]
        try:
            where = self._all("node")
            ip = where[0][1]
            port = self._one(0, "free_port")
            self.master_address = f"{ip}:{port}"
            self.nodes = [node_ip for _, node_ip in where]
            locals_ = [[r for r in range(size) if where[r][0] == where[k][0]] for k in range(size)]
            envs = [
                {
                    "RANK": str(r),
                    "WORLD_SIZE": str(size),
                    "LOCAL_RANK": str(locals_[r].index(r)),
                    "LOCAL_WORLD_SIZE": str(len(locals_[r])),
                    "MASTER_ADDR": ip,
                    "MASTER_PORT": str(port),
                }
                for r in range(size)
            ]
            a, kw = tuple(args), dict(kwargs or {})
            PendingCall(
                self,
                f"{getattr(actor_cls, '__name__', 'actor_cls')}.__init__",
                [act.setup.remote(envs[r], actor_cls, a, kw) for r, act in enumerate(self._actors)],
            ).get()
        except BaseException:
            self.shutdown()
            raise

    # --- calls ------------------------------------------------------------------------------------

    def submit(self, method: str, *args: Any, **kwargs: Any) -> PendingCall:
        """Start ``method(*args, **kwargs)`` on every actor; :meth:`PendingCall.get` waits for
        the results (to run methods of two groups at once: a teacher world's ``serve`` beside
        the student world's steps)."""
        refs = [act.run.remote(method, args, kwargs) for act in self._actors]
        return PendingCall(self, method, refs)

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``method(*args, **kwargs)`` on every actor; the results in rank order, within the
        group's ``timeout_s`` (errors as :meth:`PendingCall.get`)."""
        return self.submit(method, *args, **kwargs).get()

    def link_address(self) -> str:
        """``host:port``: a port free now on rank 0's node, for
        :func:`~mopd.bridge.connect_worlds` when this group's world hosts the link (its rank 0
        serves the rendezvous store there)."""
        return f"{self.nodes[0]}:{self._one(0, 'free_port')}"

    # --- actors -----------------------------------------------------------------------------------

    def kill(self, rank: int) -> None:
        """End rank ``rank``'s actor now (``ray.kill``), as a crash would: its world's other
        ranks name it when they next wait for it."""
        import ray

        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.size:
            raise ValueError(
                f'rank must be in 0..{self.size - 1} (world "{self.world}"), got {rank!r}'
            )
        ray.kill(self._actors[rank], no_restart=True)
        self._killed.add(rank)

    def shutdown(self) -> None:
        """End every actor (those still running a method too); the group is unusable after."""
        if self._ending is not None:
            self._ending.cancel()
        self._end()
        self._actors = []

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # --- helpers ----------------------------------------------------------------------------------

    def _all(self, method: str) -> list[Any]:
        return PendingCall(self, method, [getattr(a, method).remote() for a in self._actors]).get()

    def _one(self, rank: int, method: str) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            return ray.get(getattr(self._actors[rank], method).remote(), timeout=self.timeout_s)
        except RayActorError as exc:
            raise self._died(rank, f"{method}()", exc) from exc
        except GetTimeoutError as exc:
            raise BridgeTimeoutError(
                f"{_ranks(self.world, [rank])} did not answer {method}() within "
                f"{self.timeout_s:g} s"
            ) from exc

    def _end(self) -> None:
        import ray

        for act in self._actors:
            with contextlib.suppress(Exception):  # already gone, or Ray itself is shut down
                ray.kill(act, no_restart=True)

    def _died(self, rank: int, what: str, exc: BaseException) -> BridgeCommError:
        how = "killed by WorkerGroup.kill" if rank in self._killed else "its Ray actor is gone"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        then = ""
        if self.grace_s is not None and self._actors:
            if self._ending is None:  # the world cannot go on: end its other actors soon
                self._ending = threading.Timer(self.grace_s, self._end)
                self._ending.daemon = True
                self._ending.start()
            then = f"; the group ends its other actors {self.grace_s:g} s after the first death"
        err = BridgeCommError(
            f"{_ranks(self.world, [rank])} failed in {what}: the process died ({how}){then}; "
            f"Ray: {type(exc).__name__}: {first}"
        )
        err.add_note(f"Ray's error for {_ranks(self.world, [rank])}: {exc}")
        return err
