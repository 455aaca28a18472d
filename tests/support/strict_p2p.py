"""NCCL's point-to-point rules, enforced on gloo: the tier-2 suite's strict mode.

Why this file exists: every multi-rank test here runs on gloo, which buffers sends and matches
a receive by (peer, tag), while NCCL's point-to-point (what the bridge and megatron's pipeline
use on GPUs) blocks a send until the peer has posted the matching receive, pairs operations per
peer strictly in issue order (tags ignored), and builds a group's communicator in its first
batched operation, which every member must then join. Code that is correct on gloo can therefore
hang or swap rows on NCCL. With ``MOPD_STRICT_P2P=1`` in a rank's environment, the tier-2
harness (``tests/torchrun/conftest.py``) calls :func:`install`, which wraps
``torch.distributed``'s point-to-point calls so that, over the job's own store:

- the ``k``-th send from rank A to rank B on a group and the ``k``-th receive B posts from A on
  it are compared (shape, dtype, tag): any difference is a :class:`StrictP2PError` (NCCL would
  pair them all the same: wrong rows, or a size mismatch);
- a send's ``wait()`` / ``is_completed()`` complete only once the peer has posted that receive
  (a send left unmatched times out, as it would block on NCCL); a ``wait()`` without a timeout
  waits as long as the operation's group would (its own timeout), not longer;
- ``batch_isend_irecv`` on a group of more than two ranks that has seen no collective on this
  rank before is a :class:`StrictP2PError` (NCCL would create the communicator there).

Nothing here changes what a correct program computes; it only turns NCCL-incorrect patterns
into named errors.
"""

from __future__ import annotations

import datetime
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ENV", "StrictP2PError", "group_timeout_s", "install", "installed"]

#: The environment variable that turns the mode on ("1") in a tier-2 rank.
ENV = "MOPD_STRICT_P2P"
_PREFIX = "mopd-strict-p2p"
#: The wait of a work whose group's timeout cannot be read (torch's default for gloo groups).
_FALLBACK_WAIT_S = 1800.0
_COLLECTIVES = (
    "barrier",
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
)


class StrictP2PError(RuntimeError):
    """A point-to-point pattern that NCCL would hang on or pair wrongly."""


class _State:
    def __init__(self) -> None:
        self.store = dist.PrefixStore(_PREFIX, dist.distributed_c10d._get_default_store())
        self.counters: dict[tuple[str, int, int, str], int] = {}
        self.set_up: set[str] = set()
        self.orig: dict[str, Callable[..., Any]] = {}


_STATE: _State | None = None


def installed() -> bool:
    return _STATE is not None


def _name(group: Any) -> str:
    g = group if group is not None else dist.group.WORLD
    return str(g.group_name)


def _desc(tensor: torch.Tensor, tag: int) -> str:
    return f"{tuple(tensor.shape)} {tensor.dtype} tag {tag}"


def group_timeout_s(group: Any) -> float:
    """Seconds ``group``'s own operations wait (the ``timeout`` it was created with, or set
    later): what a ``wait()`` without a timeout waits on it."""
    g = group if group is not None else dist.group.WORLD
    try:
        backend = g._get_backend(torch.device("cpu"))
        return float(backend.options._timeout.total_seconds())
    except Exception:  # another backend or torch version: torch's default for gloo groups
        return _FALLBACK_WAIT_S


class _StrictWork:
    """A gloo work object that completes by NCCL's rules (see the module doc)."""

    def __init__(
        self, work: Any, *, send: bool, mine: str, other: str, what: str, wait_s: float
    ) -> None:
        self._work = work
        self._send = send
        self._mine = mine
        self._other = other  # the peer's key for the same position in the pair's order
        self._what = what
        self._wait_s = wait_s  # the group's own timeout: a wait() without one waits that long
        self._checked = False

    def _check(self, timeout_s: float) -> None:
        if self._checked:
            return
        st = _STATE
        assert st is not None
        try:
            st.store.wait([self._other], datetime.timedelta(seconds=max(timeout_s, 1e-3)))
        except Exception as exc:
            side = "receive" if self._send else "send"
            raise StrictP2PError(
                f"strict p2p: {self._what} timed out after {timeout_s:.1f} s: the peer never "
                f"posted the matching {side} (on NCCL this blocks): {exc}"
            ) from exc
        theirs = st.store.get(self._other).decode()
        if theirs != self._mine:
            raise StrictP2PError(
                f"strict p2p: {self._what} is {self._mine} but the operation the peer posted in "
                f"the same place of the pair's order is {theirs}: NCCL pairs point-to-point "
                "operations per peer in issue order, tags ignored"
            )
        self._checked = True

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        limit = timeout.total_seconds() if timeout is not None else self._wait_s
        if self._send:
            self._check(limit)
        if timeout is None:
            self._work.wait()
        else:
            self._work.wait(timeout)
        self._check(limit)
        return True

    def is_completed(self) -> bool:
        if self._send and not self._checked:
            st = _STATE
            assert st is not None
            if not st.store.check([self._other]):
                return False
        return bool(self._work.is_completed())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _post(send: bool, tensor: torch.Tensor, peer: int, group: Any, tag: int) -> _StrictWork:
    """Record one operation in the pair's order, then post it on gloo."""
    st = _STATE
    assert st is not None
    me = dist.get_rank()
    src, dst = (me, peer) if send else (peer, me)
    gname = _name(group)
    key = (gname, src, dst, "s" if send else "r")
    k = st.counters.get(key, 0)
    st.counters[key] = k + 1
    base = f"{gname}/{src}>{dst}/{k}"
    mine = _desc(tensor, tag)
    st.store.set(f"{base}/{'s' if send else 'r'}", mine)
    fn = st.orig["isend" if send else "irecv"]
    kw = {"dst": peer} if send else {"src": peer}
    work = fn(tensor, group=group, tag=tag, **kw)
    what = f"{'send' if send else 'receive'} #{k} from global rank {src} to {dst} on group {gname}"
    return _StrictWork(
        work,
        send=send,
        mine=mine,
        other=f"{base}/{'r' if send else 's'}",
        what=what,
        wait_s=group_timeout_s(group),
    )


def _global(group: Any, peer: int | None, group_peer: int | None) -> int:
    if peer is not None:
        return peer
    assert group_peer is not None
    return dist.get_global_rank(group, group_peer) if group is not None else group_peer


def _isend(
    tensor: torch.Tensor,
    dst: int | None = None,
    group: Any = None,
    tag: int = 0,
    group_dst: int | None = None,
) -> Any:
    return _post(True, tensor, _global(group, dst, group_dst), group, tag)


def _irecv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: Any = None,
    tag: int = 0,
    group_src: int | None = None,
) -> Any:
    return _post(False, tensor, _global(group, src, group_src), group, tag)


def _send(
    tensor: torch.Tensor,
    dst: int | None = None,
    group: Any = None,
    tag: int = 0,
    group_dst: int | None = None,
) -> None:
    _isend(tensor, dst, group, tag, group_dst).wait()


def _recv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: Any = None,
    tag: int = 0,
    group_src: int | None = None,
) -> int:
    peer = _global(group, src, group_src)
    _post(False, tensor, peer, group, tag).wait()
    return peer


def _batch(ops: list[Any]) -> list[Any]:
    st = _STATE
    assert st is not None
    if not ops:
        return []
    group = ops[0].group
    size = dist.get_world_size(group)
    if size > 2 and _name(group) not in st.set_up:
        raise StrictP2PError(
            f"strict p2p: batch_isend_irecv on group {_name(group)} "
            f"({dist.get_process_group_ranks(group) if group is not None else 'world'}) before "
            "any collective on it: NCCL creates the group's communicator in this call, and every "
            "member must join it; set the group up (a barrier) before the schedule"
        )
    works = []
    for op in ops:
        send = op.op in (_isend, st.orig["isend"])
        peer = _global(op.group, op.peer, getattr(op, "group_peer", None))
        works.append(_post(send, op.tensor, peer, op.group, op.tag))
    return works


def _collective(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    sig = inspect.signature(fn)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        st = _STATE
        assert st is not None
        group = sig.bind_partial(*args, **kwargs).arguments.get("group")
        out = fn(*args, **kwargs)
        st.set_up.add(_name(group))
        return out

    wrapped.__name__ = name
    wrapped.__doc__ = fn.__doc__
    return wrapped


def install() -> None:
    """Wrap ``torch.distributed``'s point-to-point calls and note collectives (once per
    process, after the default group exists)."""
    global _STATE
    if _STATE is not None:
        return
    st = _STATE = _State()
    c10d = dist.distributed_c10d
    swap: dict[int, Callable[..., Any]] = {}
    for name, fn in (
        ("isend", _isend),
        ("irecv", _irecv),
        ("send", _send),
        ("recv", _recv),
        ("batch_isend_irecv", _batch),
    ):
        st.orig[name] = getattr(c10d, name)
        swap[id(st.orig[name])] = fn
    for name in _COLLECTIVES:
        fn = getattr(c10d, name, None)
        if fn is not None:
            swap[id(fn)] = _collective(name, fn)
    # rebind every module's reference (``from torch.distributed import x`` included); c10d's own
    # too: P2POp checks its op against c10d's isend / irecv
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)
        if not isinstance(names, dict):
            continue
        for attr, value in list(names.items()):
            new = swap.get(id(value)) if callable(value) else None
            if new is not None:
                setattr(module, attr, new)
    os.environ[ENV] = "1"
