"""One bridge across several torch.distributed worlds: a teacher job and a student job.

Why this file exists: where MOPD runs at scale the teacher is its own job (another torchrun, a
Ray worker group, other nodes), with its own default process group and megatron's groups. The
bridge needs one rank space and a few groups over the ranks of every world, made without any
shared default group. :func:`connect_worlds` makes that link: every rank of every world calls it
in its own world with one address (``host:port``) that all of them know, and gets a
:class:`WorldLink`.

- **The rendezvous.** The student's world hosts it: its rank 0 serves a ``TCPStore`` on the
  address (``connect_worlds(address, world="student", worlds=["student", "teacher-0", ...])``);
  every other world connects to it as a client (``connect_worlds(address, world="teacher-0")``).
  Each world's rank 0 checks its world in with its size; the host publishes a roster.
- **The rank space.** Bridge ranks are the worlds' ranks laid end to end in the host's order,
  the student's world first: a student rank's bridge rank is its own global rank, and world
  ``w``'s rank ``r`` is bridge rank ``offset(w) + r``. Each side describes its meshes in its own
  world's ranks; :meth:`WorldLink.to_bridge` moves a mesh into the bridge's space.
- **The groups.** :meth:`WorldLink.create` makes a group over some bridge ranks (gloo on CPU,
  NCCL on CUDA) on a ``PrefixStore`` of the rendezvous store, only on its members (a group of
  its own prefix needs no other rank). torch.distributed's registry does not know these groups:
  the library names their members and ranks through :func:`mopd.common.dist.group_ranks` /
  :func:`~mopd.common.dist.rank_in` and posts point to point through
  :func:`~mopd.common.dist.batch_p2p`.
- **Generations.** Every roster is a generation, with its own groups and keys. A world whose
  processes were restarted connects again; the worlds still running call
  :meth:`WorldLink.reconnect`; the host publishes the next roster once every world has checked
  in, within the timeout. Nothing else needs restarting.
- **Names.** Errors across worlds name ranks as ``global rank 1 of world "teacher-0"``
  (:meth:`WorldLink.names`), in the failure board's text and in every error the
  :class:`~mopd.mcore.Distiller` raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mopd.bridge.config import DEFAULT_TIMEOUT_S
from mopd.bridge.errors import BridgeCommError
from mopd.bridge.mesh import Mesh
from mopd.common import dist as cdist
from mopd.common.digest import Digest

__all__ = ["WorldLink", "WorldRoster", "connect_worlds"]

#: Key prefix of the link in the rendezvous store.
_ROOT = "mopd-worlds/"
#: How often a wait on the store wakes to look again (a rendezvous, the next step).
_POLL_S = 0.05
#: The longest a listener waits on its first key before it looks at the others again.
_LISTEN_S = 0.5
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True, kw_only=True)
class WorldRoster:
    """The worlds of one generation of a link, in bridge order (the host's world first).

    Attributes:
        generation: the roster's number (0 for the first; each reconnection adds one).
        names: each world's name.
        sizes: each world's number of ranks.
        incarnations: each world's connection count (a restarted world has a higher one).
    """

    generation: int
    names: tuple[str, ...]
    sizes: tuple[int, ...]
    incarnations: tuple[int, ...]

    @property
    def offsets(self) -> tuple[int, ...]:
        """Each world's first bridge rank."""
        out, at = [], 0
        for n in self.sizes:
            out.append(at)
            at += n
        return tuple(out)

    @property
    def size(self) -> int:
        """Bridge ranks in all."""
        return sum(self.sizes)

    def world_of(self, bridge_rank: int) -> tuple[str, int]:
        """``(world name, rank in that world)`` of a bridge rank."""
        for name, off, n in zip(self.names, self.offsets, self.sizes, strict=True):
            if off <= bridge_rank < off + n:
                return name, bridge_rank - off
        raise ValueError(f"bridge rank {bridge_rank} is outside the roster {self}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> WorldRoster:
        d = json.loads(text)
        return cls(
            generation=int(d["generation"]),
            names=tuple(d["names"]),
            sizes=tuple(int(n) for n in d["sizes"]),
            incarnations=tuple(int(n) for n in d["incarnations"]),
        )


def _address(address: str) -> tuple[str, int]:
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address must be 'host:port' (a port in 1..65535), got {address!r}")
    return host.strip("[]"), int(port)


def _check_name(what: str, name: Any) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"{what} must be a name of 1-64 letters, digits, '_', '.' or '-', got {name!r}"
        )
    return name


def _wait_key(store: dist.Store, key: str, *, deadline: float, what: str) -> bytes:
    """Wait for ``key`` until ``deadline`` (``time.monotonic()``); ``TimeoutError`` naming
    ``what`` past it."""
    while True:
        left = deadline - time.monotonic()
        try:
            store.wait([key], datetime.timedelta(seconds=max(min(left, 5.0), 0.01)))
            return store.get(key)
        except dist.DistStoreError as exc:
            if "timeout" not in str(exc).lower():
                raise
        if time.monotonic() >= deadline:
            raise TimeoutError(what)


class WorldLink:
    """This process's end of a link between worlds (:func:`connect_worlds`).

    Attributes:
        world: this process's world.
        world_rank: its rank in its own world (its default group's).
        rank: its bridge rank.
        roster: the current generation's worlds.
        store: the current generation's keys (a ``PrefixStore`` of the rendezvous store).
        backend: the backend of the link's data groups (``"nccl"`` or ``"gloo"``; metadata
            groups are always gloo).
        timeout_s: how long the rendezvous and every group of the link wait.
    """

    def __init__(
        self,
        *,
        world: str,
        store: dist.Store,
        hosts: bool,
        order: tuple[str, ...] | None,
        backend: str,
        timeout_s: float,
    ) -> None:
        self.world = world
        self.world_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._root = store
        self._hosts = hosts
        self._order = order
        self.backend = backend
        self.timeout_s = float(timeout_s)
        self.closed = False
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._sessions = 0
        self.roster = self._rendezvous()

    # --- the rendezvous ---------------------------------------------------------------------------

    def _rendezvous(self) -> WorldRoster:
        """Check this world in to the next generation and wait for its roster (collective over
        this world's default group and, through the store, over every world)."""
        root = self._root
        deadline = time.monotonic() + self.timeout_s
        mine = [0, 0]  # (generation, incarnation): decided by this world's rank 0
        if self.world_rank == 0:
            generation = int(root.add(_ROOT + "published", 0))
            incarnation = int(root.add(f"{_ROOT}incarnation/{self.world}", 1))
            root.set(
                f"{_ROOT}{generation}/checkin/{self.world}",
                json.dumps([self.world_size, incarnation]),
            )
            mine = [generation, incarnation]
        got = torch.tensor(mine, dtype=torch.int64, device=_world_device())
        dist.broadcast(got, src=0)
        generation = int(got[0])
        if self._hosts and self.world_rank == 0:
            self._publish(generation, deadline)
        roster = WorldRoster.from_json(
            _wait_key(
                root,
                f"{_ROOT}{generation}/roster",
                deadline=deadline,
                what=f"world {self.world!r}: no roster for generation {generation} within "
                f"timeout_s={self.timeout_s:g} s: the hosting world did not connect (or "
                "reconnect) at this address",
            )
        )
        if self.world not in roster.names:
            raise ValueError(
                f"world {self.world!r} is not one of the host's worlds {list(roster.names)}"
            )
        size = roster.sizes[roster.names.index(self.world)]
        if size != self.world_size:
            raise ValueError(
                f"world {self.world!r} has {self.world_size} ranks but checked in with {size}"
            )
        self.store = dist.PrefixStore(f"{_ROOT}{generation}/", root)
        self.rank = roster.offsets[roster.names.index(self.world)] + self.world_rank
        return roster

    def _publish(self, generation: int, deadline: float) -> None:
        """The host: wait for every world's check-in, then publish the roster."""
        assert self._order is not None
        root = self._root
        sizes, incarnations = [], []
        for name in self._order:
            size, inc = json.loads(
                _wait_key(
                    root,
                    f"{_ROOT}{generation}/checkin/{name}",
                    deadline=deadline,
                    what=f"world {name!r} did not connect within timeout_s={self.timeout_s:g} s "
                    f"(generation {generation}; connected: {self._checked_in(generation)})",
                )
            )
            sizes.append(int(size))
            incarnations.append(int(inc))
        roster = WorldRoster(
            generation=generation,
            names=self._order,
            sizes=tuple(sizes),
            incarnations=tuple(incarnations),
        )
        root.set(f"{_ROOT}{generation}/roster", roster.to_json())
        root.add(_ROOT + "published", 1)

    def _checked_in(self, generation: int) -> list[str]:
        assert self._order is not None
        keys = [f"{_ROOT}{generation}/checkin/{n}" for n in self._order]
        return [n for n, k in zip(self._order, keys, strict=True) if self._root.check([k])]

    def reconnect(self) -> WorldRoster:
        """Start the next generation after a world was restarted: every world still running
        calls it (each of its ranks), the restarted ones call :func:`connect_worlds` again;
        returns the new roster once every world is in (within :attr:`timeout_s`). The previous
        generation's groups are destroyed; build the bridge anew on the link (a new
        :class:`~mopd.mcore.Distiller`)."""
        self._check_open()
        self._drop_groups()
        self._sessions = 0
        self.roster = self._rendezvous()
        return self.roster

    # --- ranks and meshes -------------------------------------------------------------------------

    def offset(self, world: str | None = None) -> int:
        """The first bridge rank of ``world`` (default: this one)."""
        name = self.world if world is None else world
        if name not in self.roster.names:
            raise ValueError(f"no world {name!r} on this link (worlds: {list(self.roster.names)})")
        return self.roster.offsets[self.roster.names.index(name)]

    def to_bridge(self, mesh: Mesh, world: str | None = None) -> Mesh:
        """``mesh``, given in ``world``'s own ranks (default: this world's), in bridge ranks."""
        name = self.world if world is None else world
        size = self.roster.sizes[self.roster.names.index(name)] if name in self.roster.names else 0
        off = self.offset(name)
        if mesh.rank_offset + mesh.size > size:
            raise ValueError(
                f"{mesh} does not fit world {name!r}, which has {size} ranks (ranks 0..{size - 1})"
            )
        return dataclasses.replace(mesh, rank_offset=mesh.rank_offset + off)

    def describe(self, bridge_rank: int) -> str:
        """``'global rank 1 of world "teacher-0"'``."""
        name, r = self.roster.world_of(bridge_rank)
        return f'global rank {r} of world "{name}"'

    def names(self, text: str) -> str:
        """``text`` with each bridge rank it names (``global rank 5``, ``global ranks [4, 5]``)
        named by its world (:meth:`describe`); names already given by world are kept."""

        def one(m: re.Match[str]) -> str:
            r = int(m.group(1))
            try:
                return self.describe(r)
            except ValueError:
                return m.group(0)

        def many(m: re.Match[str]) -> str:
            ranks = [int(x) for x in re.findall(r"\d+", m.group(1))]
            try:
                return "[" + ", ".join(self.describe(r) for r in ranks) + "]"
            except ValueError:
                return m.group(0)

        text = re.sub(r"global ranks (\[[\d, ]*\])", many, text)
        return re.sub(r'global rank (\d+)(?! of world ")', one, text)

    # --- groups -----------------------------------------------------------------------------------

    def _key(
        self, ranks: Sequence[int], backend: str | None, purpose: str
    ) -> tuple[str, str, tuple[int, ...]]:
        """``(key, backend, members)`` of a group: its name in the store, and what it spans."""
        members = tuple(sorted({int(r) for r in ranks}))
        kind = backend or self.backend
        digest = Digest(repr(members), size=8).hexdigest()
        return f"{purpose}/{kind}/{len(members)}/{digest}", kind, members

    def has(self, ranks: Sequence[int], *, backend: str | None = None, purpose: str = "") -> bool:
        """Whether :meth:`create` already made this group here (local)."""
        return self._key(ranks, backend, purpose)[0] in self._groups

    def create(
        self, ranks: Sequence[int], *, backend: str | None = None, purpose: str = ""
    ) -> dist.ProcessGroup | None:
        """The group over ``ranks`` (bridge ranks) for ``purpose``, made on first use by its
        members only (each member calls it; others get ``None`` and need not call): what
        :meth:`~mopd.bridge.groups.GroupPool.create` is in one world. ``backend``: ``"gloo"``
        or ``"nccl"`` (default: :attr:`backend`). Waits at most :attr:`timeout_s` for the
        members."""
        self._check_open()
        key, kind, members = self._key(ranks, backend, purpose)
        if self.rank not in members:
            return None
        if key in self._groups:
            return self._groups[key]
        store = dist.PrefixStore(f"group/{key}/", self.store)
        rank_in_group, size = members.index(self.rank), len(members)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        pg = dist.ProcessGroup(store, rank_in_group, size)
        if kind == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            be: Any = dist.ProcessGroupNCCL(store, rank_in_group, size, options)
            device, kind_enum = torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL
        elif kind == "gloo":
            be = dist.ProcessGroupGloo(store, rank_in_group, size, timeout)
            device, kind_enum = torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO
        else:
            raise ValueError(f"a link's group backend is 'gloo' or 'nccl', got {kind!r}")
        pg._set_default_backend(kind_enum)
        pg._register_backend(device, kind_enum, be)
        pg._set_group_name(f"mopd-worlds-{self.roster.generation}-{key}")  # type: ignore[arg-type]
        cdist.register_linked_group(pg, ranks=members, rank=self.rank, cuda=kind == "nccl")
        self._groups[key] = pg
        return pg

    def _drop_groups(self) -> None:
        groups, self._groups = self._groups, {}
        for pg in groups.values():
            cdist.unregister_linked_group(pg)
            with contextlib.suppress(Exception):  # already gone with a peer
                pg.shutdown()

    # --- steps (the student's world tells the others) -----------------------------------------

    def open_session(self) -> str:
        """The next bridge built on this link in this process (``"s0"``, ``"s1"``, ...): the
        student's world and each teacher world count theirs alike, so the n-th of each pair up
        and their keys never meet an earlier bridge's."""
        n, self._sessions = self._sessions, self._sessions + 1
        return f"s{n}"

    def announce(self, key: str, value: str) -> None:
        """Set ``key`` in this generation's keys (from one rank: the others read it)."""
        self.store.set(f"say/{key}", value)

    def heard(self, key: str) -> str | None:
        """``key``'s value if announced, else ``None`` (no wait)."""
        k = f"say/{key}"
        return self.store.get(k).decode() if self.store.check([k]) else None

    def listen(self, keys: Sequence[str], *, timeout_s: float | None) -> tuple[str, str]:
        """Wait for the first of ``keys`` to be announced; ``(key, value)``. ``timeout_s=None``
        waits as long as the link lives.

        Raises:
            TimeoutError: nothing announced within ``timeout_s``.
            BridgeCommError: the link's store went away (its host's process ended: the host
                world's job stopped), naming the host.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                for key in keys:
                    value = self.heard(key)
                    if value is not None:
                        return key, value
                left = _LISTEN_S if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"world {self.world!r}: none of {list(keys)} was announced within "
                        f"{timeout_s:g} s"
                    )
                # woken as soon as the first key is set; the others are looked at in between
                with contextlib.suppress(dist.DistStoreError):  # its wait timed out
                    self.store.wait(
                        [f"say/{keys[0]}"], datetime.timedelta(seconds=min(left, _LISTEN_S))
                    )
            except dist.DistNetworkError as exc:
                raise BridgeCommError(
                    f'global rank {self.world_rank} of world "{self.world}": the link\'s '
                    f'store, served by global rank 0 of world "{self.roster.names[0]}", '
                    "is gone (that process ended: its job stopped or failed) while this "
                    f"rank waited for the next step. The store said: {exc}"
                ) from exc

    # --- lifecycle --------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("this WorldLink is closed: connect_worlds() again")

    def close(self) -> None:
        """Destroy the link's groups and drop its store connection (local; every rank of every
        world calls it once its bridge is closed). The host's store goes with the host's
        process. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._drop_groups()

    def __enter__(self) -> WorldLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"WorldLink(world={self.world!r}, rank={self.rank}, "
            f"generation={self.roster.generation}, worlds={list(self.roster.names)}, "
            f"sizes={list(self.roster.sizes)})"
        )


def _world_device() -> torch.device:
    """Where this world's default group moves tensors."""
    if cdist.moves_cuda(None) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def connect_worlds(
    address: str,
    *,
    world: str,
    worlds: Sequence[str] | None = None,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> WorldLink:
    """Connect this world to the others at ``address`` (collective over this world's default
    group; every world's ranks call it).

    Args:
        address: ``"host:port"`` every world can reach; the host world's rank 0 serves the
            rendezvous there (the port must be free on that host, and not another job's).
        world: this world's name (``"student"``, ``"teacher-0"``: what errors name).
        worlds: on the host world only (the student's): every world's name in bridge order,
            its own first; ``None`` on the other worlds.
        backend: the data groups' backend: ``"nccl"`` (CUDA) or ``"gloo"``; default: NCCL when
            this world's default group moves CUDA tensors, else gloo. Every world must use
            the same.
        timeout_s: how long to wait for the other worlds, and every later wait of the link's
            groups.
    Raises:
        ValueError: a malformed address, name or world list (before anything connects).
        TimeoutError: the other worlds did not connect within ``timeout_s``.
    """
    host, port = _address(address)
    _check_name("world", world)
    if worlds is not None:
        names = tuple(_check_name("each of worlds", w) for w in worlds)
        if len(set(names)) != len(names) or len(names) < 2 or names[0] != world:
            raise ValueError(
                f"worlds must list two or more distinct names, this world ({world!r}) first, "
                f"got {list(worlds)}"
            )
    else:
        names = None
    if backend is not None and backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    if isinstance(timeout_s, bool) or not (
        isinstance(timeout_s, int | float) and 0 < timeout_s < float("inf")
    ):
        raise ValueError(f"timeout_s must be a positive finite number, got {timeout_s!r}")
    if not dist.is_initialized():
        raise ValueError(
            "connect_worlds needs this world's default process group: call "
            "torch.distributed.init_process_group first"
        )
    if backend is None:
        backend = "nccl" if _world_device().type == "cuda" else "gloo"
    hosts = names is not None
    store = dist.TCPStore(
        host,
        port,
        is_master=hosts and dist.get_rank() == 0,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return WorldLink(
        world=world,
        store=store,
        hosts=hosts,
        order=names,
        backend=backend,
        timeout_s=timeout_s,
    )
