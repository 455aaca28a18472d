"""The teacher world's side of a bridge across worlds: the same Distiller, driven by the student's.

Why this file exists: when the teachers run as their own job (another torchrun, a Ray worker
group), the student's world keeps today's API (``Distiller(..., link=link)`` and
``distiller.step(rollouts, num_micro_batches=M)``) and the teacher world needs a loop that
follows it. :class:`TeacherServer` reads what the student's world built (its meshes, the
bridge's settings) off the link, builds the same :class:`~mopd.mcore.Distiller` with this
world's teacher models in place of their remote specs, and serves each step the student's
world starts: the rollouts' token ids arrive over the bridge's groups, the server builds its
own micro-batches (its DP split, packing, CP/SP), runs the forward-only pass under megatron's
schedule with the capture, and sends the rows straight into the student's layouts. Every step
takes the same metadata exchange, verdict and fences as in one job. When the student's world
submits steps ahead (``Distiller(steps_ahead=1)``, :meth:`~mopd.mcore.Distiller.submit`), the
server scores the next step once it has sent this one's rows, while the student trains::

    link = connect_worlds("10.0.0.1:29600", world="teacher-0")
    with TeacherServer(link=link, teachers=[MeshModel(model=t, mesh=mesh, pg_collection=pgs)],
                       pool=pool) as server:
        server.serve()          # until the student's Distiller closes
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Sequence
from typing import Any

from mopd.bridge.config import BridgeConfig
from mopd.bridge.groups import GroupPool
from mopd.bridge.mesh import Mesh
from mopd.bridge.worlds import WorldLink
from mopd.mcore.distill import Distiller
from mopd.mcore.mesh_model import MeshModel

__all__ = ["TeacherServer"]


def _mesh(d: dict[str, Any]) -> Mesh:
    tp, cp, dp, pp, offset = (int(v) for v in d["mesh"])
    return Mesh(tp=tp, cp=cp, dp=dp, pp=pp, rank_offset=offset, name=str(d.get("name", "")))


class TeacherServer:
    """A teacher world's end of the bridge (collective over every world, like the Distiller).

    Args:
        link: this world's link (:func:`~mopd.bridge.worlds.connect_worlds`, without
            ``worlds=``).
        teachers: this world's teachers, in the order the student's world lists them, each a
            :class:`~mopd.mcore.MeshModel` whose mesh is in this world's ranks (as the
            student's world declared it) with the model and its groups on the ranks that hold
            it.
        pool: this world's :class:`~mopd.bridge.groups.GroupPool` (its teachers' groups').
        timeout_s: how long to wait for the student's world to build its Distiller
            (default: the link's timeout).

    Attributes:
        distiller: the teacher world's :class:`~mopd.mcore.Distiller`.
        steps: steps served so far.
        history: one entry per call the student's world made, in order: ``kind`` (``"step"``,
            ``"submit"``, ``"next"``), ``start`` and ``end`` (``time.time()``), and for a step
            its ``timings`` (seconds: ``plan``, ``teacher`` (its rows: forward and sends, or
            the sends of rows scored ahead), ``ahead`` (scoring the next submitted step)), the
            ``ahead_span`` (``time.time()`` at the start and end of that scoring) and
            ``held_bytes`` (the rows kept after it, for the steps scored ahead).
    """

    def __init__(
        self,
        *,
        link: WorldLink,
        teachers: Sequence[MeshModel],
        pool: GroupPool,
        timeout_s: float | None = None,
    ) -> None:
        if not isinstance(link, WorldLink):
            raise ValueError(f"TeacherServer needs a WorldLink, got {type(link).__name__}")
        if link.world == link.roster.names[0]:
            raise ValueError(
                f"world {link.world!r} hosts the link: it is the student's world, which builds "
                "a Distiller(link=...) rather than a TeacherServer"
            )
        self.link = link
        self._session = link.open_session()
        _, text = link.listen(
            [f"{self._session}/distiller"],
            timeout_s=link.timeout_s if timeout_s is None else timeout_s,
        )
        setup = json.loads(text)
        mine = [i for i, t in enumerate(setup["teachers"]) if t["world"] == link.world]
        if len(teachers) != len(mine):
            raise ValueError(
                f"the student's world puts {len(mine)} teacher(s) in world {link.world!r} "
                f"(teachers {mine}), but {len(teachers)} were given here"
            )
        given = iter(teachers)
        models = []
        for i, t in enumerate(setup["teachers"]):
            mesh = _mesh(t)
            if i not in mine:
                models.append(MeshModel(mesh=mesh, world=t["world"]))
                continue
            m = next(given)
            if m.mesh.as_ints() != mesh.as_ints():
                raise ValueError(
                    f"teacher {i}: the student's world declared its mesh as {mesh}, but this "
                    f"world gives {m.mesh}"
                )
            models.append(m)
        self.distiller = Distiller(
            teachers=models,
            student=MeshModel(mesh=_mesh(setup["student"]), world=setup["student"]["world"]),
            pool=pool,
            bridge_config=BridgeConfig(**setup["bridge_config"]),
            vocab_size=setup["vocab_size"],
            teacher_sp_shards=bool(setup["teacher_sp_shards"]),
            link=link,
            steps_ahead=int(setup["steps_ahead"]),
        )
        self.steps = 0
        self._events = 0
        self.history: list[dict[str, Any]] = []
        self.closed = False

    def step(self, *, timeout_s: float | None = None) -> bool:
        """Serve the student's next step: wait for it (at most ``timeout_s``; ``None``: as long
        as the link lives), then take part in it (the rollouts exchange, the plan, this world's
        teachers' forward-only pass and sends, the step's finish), and in the rollouts
        exchanges of the steps the student submits before it. Returns ``False`` once the
        student's Distiller closed instead."""
        self._present(True)
        try:
            served = self._serve_next(timeout_s)
        except BaseException:
            self._present(False)
            raise
        if not served:
            self._present(False)
        return served

    def _serve_next(self, timeout_s: float | None) -> bool:
        """:meth:`step`'s work: ``False`` when the student's Distiller closed."""
        while True:
            key, value = self.link.listen(
                [f"{self._session}/event/{self._events}", f"{self._session}/close"],
                timeout_s=timeout_s,
            )
            if key.endswith("/close"):
                return False
            self._events += 1
            said = json.loads(value)
            kind, m = said["kind"], said["num_micro_batches"]  # as the student passed them
            entry: dict[str, Any] = {"kind": kind, "start": time.time()}
            self.history.append(entry)
            if kind == "submit":
                self.distiller.submit(None, num_micro_batches=m)
                entry["end"] = time.time()
                continue
            d = self.distiller
            with d.step() if kind == "next" else d.step(None, num_micro_batches=m) as step:
                returned = time.time()  # the teachers' pass ran inside; leaving finishes sends
            ahead = step.timings.get("ahead", 0.0)
            entry.update(
                end=time.time(),
                timings=dict(step.timings),
                ahead_span=(returned - ahead, returned),
                held_bytes=d.held_bytes,
            )
            self.steps += 1
            return True

    def _present(self, serving: bool) -> None:
        """Tell the student's world whether this rank serves (will read the link's store for
        the next call): its rank 0 keeps its process, which serves the store, until no teacher
        rank does (:meth:`Distiller.close`)."""
        with contextlib.suppress(Exception):  # the store is gone already: nothing waits
            self.link.store.set(
                f"{self._session}/serving/{self.link.rank}", "1" if serving else "0"
            )

    def serve(self, *, steps: int | None = None, idle_timeout_s: float | None = None) -> int:
        """Serve steps until the student's Distiller closes (or ``steps`` of them); returns the
        number served. ``idle_timeout_s``: the longest wait for a step (``None``: no limit)."""
        served = 0
        while steps is None or served < steps:
            if not self.step(timeout_s=idle_timeout_s):
                break
            served += 1
        return served

    def close(self) -> None:
        """Close the server's Distiller (local; then close the pool and the link)."""
        if not self.closed:
            self.closed = True
            self._present(False)
            self.distiller.close()

    def __enter__(self) -> TeacherServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
