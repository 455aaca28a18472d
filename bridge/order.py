"""The order of one step's micro-batches on one rank: posted, received and released in order.

Why this file exists: the bridge cannot deadlock only because every rank posts its micro-batches
in order, one batch of point-to-point operations per micro-batch holding all of that rank's
sends and receives for it. A micro-batch with receives only is posted at the latest when it is
received, or when a later one is; one with sends waits until the rows of every teacher it reads
were given. So any two ranks meet in the same micro-batch order, and a rank's receive never
waits on a send its own later work would post. :class:`StepOrder` is the one object that keeps
those cursors for a step; the executor only moves the data of the slot it is handed.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from mopd.bridge.errors import BridgeStateError
from mopd.bridge.executor import Executor, Slot

__all__ = ["StepOrder"]


class StepOrder:
    """One step's slots on this rank and how far each has gone.

    Args:
        slots: the step's slots, one per micro-batch, in order.
        executor: the rank's executor (``post``, ``complete``, ``release``, ``sends_done``).
        rank: this rank (messages).
        output_specs: ``owner -> (hidden, dtype)`` of the output buffers.
        device: the bridge's device.
        group: the bridge group the slots post on.
        tag: the step's tag on the wire.
        tp_group: the student TP group the slots all-gather over (``None``: none).

    Attributes:
        posted: micro-batches posted (``0 .. posted - 1``).
        received: micro-batches whose receives completed (``0 .. received - 1``).
        given: per micro-batch, the teachers whose rows this rank gave.
    """

    def __init__(
        self,
        slots: Sequence[Slot],
        *,
        executor: Executor,
        rank: int,
        output_specs: Mapping[int, tuple[int, torch.dtype]],
        device: torch.device,
        group: dist.ProcessGroup | None,
        tag: int,
        tp_group: dist.ProcessGroup | None,
    ) -> None:
        self.slots = list(slots)
        self.executor = executor
        self.rank = rank
        self.output_specs = output_specs
        self.device = device
        self.group = group
        self.tag = tag
        self.tp_group = tp_group
        self.posted = 0
        self.received = 0
        self.given: list[set[int]] = [set() for _ in self.slots]

    def needed(self, i: int) -> set[int]:
        """Owners whose rows this rank must give for micro-batch ``i`` (sends, local copies)."""
        sched = self.slots[i].schedule
        if sched is None:
            return set()
        return {op.owner for op in sched.sends} | {x.owner for x in sched.locals}

    def give(self, i: int, owners: Iterable[int]) -> None:
        """Note that this rank gave teachers ``owners``' rows of micro-batch ``i``; posts it
        (and any earlier micro-batch still waiting) once every teacher it reads was given."""
        self.given[i] |= set(owners)
        if not self.needed(i) - self.given[i] and i >= self.posted:
            self.post_through(i, why=f"send({i})")
        self.release_done()

    def post_through(self, i: int, *, why: str) -> None:
        """Post every micro-batch up to ``i`` in order (their rows must have been given)."""
        while self.posted <= i:
            slot = self.slots[self.posted]
            missing = self.needed(slot.index) - self.given[slot.index]
            if missing:
                raise BridgeStateError(
                    f"global rank {self.rank}: {why} needs micro-batch {slot.index} posted "
                    f"first, and this rank holds rows of teacher(s) {sorted(missing)} for it: "
                    f"call send({slot.index}, ...) before (micro-batches go in order)"
                )
            self.executor.post(
                slot,
                output_specs=self.output_specs,
                device=self.device,
                group=self.group,
                tag=self.tag,
            )
            self.posted += 1

    def complete_through(self, i: int, *, deadline: float) -> None:
        """Complete every micro-batch up to ``i`` in order (posting them first if needed), all
        against the one ``deadline``."""
        self.post_through(i, why=f"receive({i})")
        while self.received <= i:
            self.executor.complete(
                self.slots[self.received], tp_group=self.tp_group, deadline=deadline
            )
            self.received += 1

    def release_done(self) -> None:
        """Return the staging buffers of posted micro-batches whose sends have completed."""
        ex = self.executor
        for slot in self.slots[: self.posted]:
            if not slot.released and ex.sends_done(slot):
                ex.release(slot, deadline=time.monotonic() + 1.0)

    def finish(self, *, deadline: float) -> None:
        """Post, complete and release every micro-batch, against the one ``deadline``."""
        n = len(self.slots)
        self.post_through(n - 1, why="finish()")
        while self.received < n:
            self.executor.complete(
                self.slots[self.received], tp_group=self.tp_group, deadline=deadline
            )
            self.received += 1
        for slot in self.slots:
            self.executor.release(slot, deadline=deadline)
