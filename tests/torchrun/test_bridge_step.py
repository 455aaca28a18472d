"""Tier 2 (8 ranks, gloo): the step API, several micro-batches per step, bit-exact.

Each case plans one step of several micro-batches with ``plan_step`` (every micro-batch its own
synthetic step: different samples, lengths and layouts, padded ``[S, B]`` / ``[B, S]`` or THD,
CP zigzag), then moves them with ``send`` / ``receive`` / ``finish``. Cases: colocated and
disjoint meshes, one and two teachers (two on the same ranks too), a teacher pipeline whose last
stage sits on the student, student TP with uneven and empty slices, and ``keep_sp_shard`` with
uneven per-rank slices. Every row a student receives must be the teacher's row of its key, bit
for bit (rows carry a hash of key, teacher, micro-batch and step, so a row of another
micro-batch fails too), rows of other teachers and padding zero, ``owner`` the routed teacher;
every output buffer the bridge allocates starts as NaN bits.

What the step promises, each checked where it can fail:

- rows are taken at ``send``: every teacher buffer is overwritten right after it was given (a
  rank holding two teachers gives them one per call, overwriting the first before the second
  is given, so that micro-batch is posted after the overwrite), and no buffer the executor posts
  shares memory with a caller's buffer. Each case declares which paths its schedules take
  (contiguous view, staged runs, staged per-row index, local copy), the schedules are read to
  prove it, and together the cases cover all four;
- every case runs in three orders: the teacher sends all micro-batches first (prefetch), one
  per student micro-batch (inline: send ``i`` then receive ``i`` on the same rank where
  colocated, both teachers of a rank in one call), or all first with the receives reversed;
- ``receive`` out of order completes the earlier micro-batches first, in order, and their rows
  stay returned correctly afterwards;
- a second step of the same shapes (other sample ids, other rows) builds no schedule and warns
  about nothing; ``global_tokens`` counts each wanted token once with ``keep_sp_shard``.

The module runs under NCCL's point-to-point rules (``tests/support/strict_p2p.py``) and
``TORCH_DISTRIBUTED_DEBUG=DETAIL``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
import torch.distributed as dist

from mopd.bridge import BridgeStep, GroupPool, HiddenStateBridge, Mesh, TokenLayout, compact_rows
from mopd.profiling.synthetic import SideFormat, SyntheticStep, key_pattern, synthetic_step
from tests.support.bridges import make_bridge, poison, poison_outputs

TORCHRUN_NPROC = 8
TORCHRUN_TIMEOUT = 300
TORCHRUN_STRICT_P2P = 1  # NCCL's point-to-point rules (tests/support/strict_p2p.py)
TORCHRUN_DEBUG_DETAIL = 1  # TORCH_DISTRIBUTED_DEBUG=DETAIL: collective order and shapes checked

PATHS = ("view", "runs", "index", "local")


@dataclass(frozen=True, kw_only=True)
class Case:
    """One step's meshes and formats; ``sizes``: samples per micro-batch (one step each);
    ``paths``: the data paths its schedules must take; ``empty``: some student slice is empty."""

    teachers: list[Mesh]
    student: Mesh
    t_kinds: list[str]
    s_kind: str
    sizes: list[int]
    max_len: int = 11
    keep_sp: bool = False
    paths: set[str] = field(default_factory=set)
    empty: bool = False
    uneven: bool = True
    dtype: torch.dtype = torch.float32
    seed: int = 0


CASES: dict[str, Case] = {
    # every rank a teacher replica and a student: local copies and sends both ways
    "colocated tp2dp4 -> tp4dp2, sbh -> thd": Case(
        teachers=[Mesh(tp=2, dp=4)],
        student=Mesh(tp=4, dp=2),
        t_kinds=["sbh"],
        s_kind="thd",
        sizes=[5, 3, 6],
        paths={"view", "index", "local"},
        seed=10,
    ),
    # two teachers on other ranks, long packed sequences: staged runs; a tiny last micro-batch
    # leaves student TP slices empty
    "disjoint tp2 + dp2 -> tp4, thd -> thd": Case(
        teachers=[Mesh(tp=2), Mesh(dp=2, rank_offset=2)],
        student=Mesh(tp=4, rank_offset=4),
        t_kinds=["thd", "thd"],
        s_kind="thd",
        sizes=[12, 8, 1],
        max_len=160,
        paths={"view", "runs", "index"},
        empty=True,
        dtype=torch.bfloat16,
        seed=100,
    ),
    # two teachers on the same four ranks, student with CP over all eight (CP pads the packed
    # sequences to multiples of 4: even TP slices)
    "two teachers on ranks 0-3 -> tp2cp2dp2, sbh + thd -> thd": Case(
        teachers=[Mesh(tp=2, dp=2), Mesh(tp=2, dp=2)],
        student=Mesh(tp=2, cp=2, dp=2),
        t_kinds=["sbh", "thd"],
        s_kind="thd",
        sizes=[6, 4, 5],
        paths={"view", "index", "local"},
        uneven=False,
        seed=20,
    ),
    # each student rank keeps its own (uneven) slice, partly colocated with the teacher
    "keep_sp_shard dp4 -> tp4dp2, thd -> sbh": Case(
        teachers=[Mesh(dp=4)],
        student=Mesh(tp=4, dp=2),
        t_kinds=["thd"],
        s_kind="sbh",
        sizes=[7, 3, 5],
        keep_sp=True,
        paths={"view", "index", "local"},
        seed=30,
    ),
    # the teacher's last stage (ranks 4-7) sits on the student
    "teacher pp2 tp4 -> tp2dp4, sbh -> bsh": Case(
        teachers=[Mesh(tp=4, pp=2)],
        student=Mesh(tp=2, dp=4),
        t_kinds=["sbh"],
        s_kind="bsh",
        sizes=[8, 5, 6],
        paths={"view", "index", "local"},
        seed=40,
    ),
}
NAMES = sorted(CASES)
ORDERS = ("prefetch", "inline", "reverse")

_POOL: list[GroupPool] = []
_BRIDGES: dict[str, HiddenStateBridge] = {}


def pool() -> GroupPool:
    if not _POOL:
        _POOL.append(GroupPool(backend="gloo", timeout_s=120))
    return _POOL[0]


def hidden_of(o: int) -> int:
    return 8 + 4 * o


def salt(o: int, i: int, step_no: int) -> int:
    """Row contents differ per teacher, micro-batch and step."""
    return o + 16 * i + 256 * step_no


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def bridge_of(name: str) -> HiddenStateBridge:
    """One bridge per case for the whole module (steps on it reuse its schedules)."""
    if name not in _BRIDGES:
        c = CASES[name]
        b = make_bridge(
            pool(),
            c.teachers,
            c.student,
            [hidden_of(o) for o in range(len(c.teachers))],
            dtype=c.dtype,
            timeout_s=60,
            keep_sp_shard=c.keep_sp,
        )
        _BRIDGES[name] = poison_outputs(b)
    return _BRIDGES[name]


def micro_batches(name: str) -> list[SyntheticStep]:
    c = CASES[name]
    return [
        synthetic_step(
            teachers=c.teachers,
            student=c.student,
            num_samples=n,
            max_len=c.max_len if n > 1 else 2,
            teacher_formats=[SideFormat(kind=k, micro_batch=2) for k in c.t_kinds],
            student_format=SideFormat(kind=c.s_kind, micro_batch=3, pad_multiple=1),
            seed=c.seed + i,
        )
        for i, n in enumerate(c.sizes)
    ]


def shifted(layout: TokenLayout, by: int) -> TokenLayout:
    """The same layout with every sample id moved by ``by`` (same shapes, other keys)."""
    s = layout.sample_id_R
    return TokenLayout(sample_id_R=torch.where(s >= 0, s + by, s), position_R=layout.position_R)


def sp_slice(layout: TokenLayout, tp: int, tp_rank: int) -> TokenLayout:
    """TP rank ``tp_rank``'s contiguous, uneven (``np.array_split``) part of ``layout``."""
    part = torch.from_numpy(np.array_split(np.arange(layout.num_rows), tp)[tp_rank])
    return TokenLayout(
        sample_id_R=layout.sample_id_R[part].contiguous(),
        position_R=layout.position_R[part].contiguous(),
    )


@dataclass(kw_only=True)
class Side:
    """This rank's share of one planned step."""

    teacher_layouts: dict[int, list[TokenLayout]]
    student_layouts: list[TokenLayout] | None
    routes: list[dict[int, int]]


def side_of(name: str, id_shift: int) -> Side:
    c = CASES[name]
    rank = dist.get_rank()
    mbs = micro_batches(name)
    t: dict[int, list[TokenLayout]] = {}
    for o, m in enumerate(c.teachers):
        tc = m.coord(rank)
        if tc is not None and m.is_last_stage(rank):
            t[o] = [shifted(s.teacher_layouts[o][(tc.dp_rank, tc.cp_rank)], id_shift) for s in mbs]
    s_lays = None
    sc = c.student.coord(rank)
    if sc is not None and c.student.is_last_stage(rank):
        s_lays = [shifted(s.student_layouts[(sc.dp_rank, sc.cp_rank)], id_shift) for s in mbs]
        if c.keep_sp:
            s_lays = [sp_slice(x, c.student.tp, sc.tp_rank) for x in s_lays]
    routes = [
        {sid + id_shift: o for sid, o in zip(s.sample_ids.tolist(), s.route.tolist(), strict=True)}
        for s in mbs
    ]
    return Side(teacher_layouts=t, student_layouts=s_lays, routes=routes)


def paths_of(step: BridgeStep) -> set[str]:
    """The data paths this rank's schedules of ``step`` take for teacher rows (either end of a
    transfer, and the staging passes)."""
    found: set[str] = set()
    for slot in step._slots:
        s = slot.schedule
        if s is not None:
            found |= {op.side.mode for op in (*s.sends, *s.recvs)}
            # the staging kernels: one pack / unpack pass per owner over all peers
            found |= {x.mode for x in (*s.pack_sides.values(), *s.unpack_sides.values())}
            found |= {"local"} if s.locals else set()
    return found


def all_paths(step: BridgeStep) -> set[str]:
    mine = torch.tensor([p in paths_of(step) for p in PATHS], dtype=torch.int64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return {p for p, f in zip(PATHS, mine.tolist(), strict=True) if f}


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True if the bytes of ``a`` and ``b`` overlap (views of one storage included)."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


class Driver:
    """Runs one step of a case on this rank in a given order and checks what it receives."""

    def __init__(self, name: str, *, step_no: int = 0, id_shift: int = 0) -> None:
        self.name, self.case = name, CASES[name]
        self.step_no = step_no
        self.bridge = bridge_of(name)
        self.side = side_of(name, id_shift)
        self.given: list[torch.Tensor] = []  # the caller buffers of the micro-batch being sent
        self.aliased: list[str] = []
        self.bridge.executor.debug_hook = self._hook
        self.step = self.bridge.plan_step(
            teacher_layouts=self.side.teacher_layouts or None,
            student_layouts=self.side.student_layouts,
        )
        self.received: dict[int, dict[int, torch.Tensor]] = {}

    def _hook(self, point: str, blocks: list) -> None:
        if point == "packed":
            for owner, peer, buf in blocks:
                if any(overlaps(buf, g) for g in self.given):
                    self.aliased.append(f"teacher {owner} -> rank {peer}")

    def send(self, i: int, *, one_call: bool = False) -> None:
        """Give micro-batch ``i``'s rows of every teacher this rank holds, each buffer
        overwritten right after it was given (one call per teacher unless ``one_call``)."""
        bufs = {
            o: key_pattern(lays[i], hidden_of(o), self.case.dtype, salt=salt(o, i, self.step_no))
            for o, lays in self.side.teacher_layouts.items()
        }
        self.given = list(bufs.values())
        if one_call and bufs:
            self.step.send(i, bufs)
            for b in bufs.values():
                poison(b)
            return
        for o, b in bufs.items():
            self.step.send(i, {o: b})
            poison(b)  # before the next teacher is given: this micro-batch posts after it

    def receive(self, i: int) -> None:
        got = self.step.receive(i)
        if self.side.student_layouts is None:
            assert got == {} and self.step.owner(i) is None
            return
        self.received[i] = got

    def check(self, i: int) -> None:
        """Micro-batch ``i``'s rows on this student rank, bit for bit, and its owner mask."""
        if self.side.student_layouts is None:
            return
        lay = self.side.student_layouts[i]
        route = self.side.routes[i]
        want_owner = torch.tensor([route[s] if s >= 0 else -1 for s in lay.sample_id_R.tolist()])
        owner = self.step.owner(i)
        assert owner is not None and torch.equal(owner, want_owner), f"{self.name} mb {i}: owner"
        assert self.step.num_tokens(i) == lay.num_tokens
        got = self.received[i]
        assert sorted(got) == list(range(len(self.case.teachers)))
        wanted = compact_rows(  # teacher o's tokens of the layout, in order
            {
                o: key_pattern(lay, hidden_of(o), self.case.dtype, salt=salt(o, i, self.step_no))
                for o in got
            },
            want_owner,
        )
        for o, rows in got.items():
            want = wanted[o]
            assert rows.shape == want.shape, f"{self.name} mb {i} teacher {o}: {rows.shape}"
            assert torch.equal(bits(rows), bits(want)), f"{self.name} mb {i} teacher {o} differ"

    def run(self, order: str) -> None:
        n = self.step.num_micro_batches
        assert n == len(self.case.sizes)
        if order == "inline":
            for i in range(n):
                self.send(i, one_call=True)
                self.receive(i)
        elif order == "prefetch":
            for i in range(n):
                self.send(i)
            for i in range(n):
                self.receive(i)
        else:  # reverse: the last micro-batch received first
            for i in range(n):
                self.send(i)
            for i in reversed(range(n)):
                self.receive(i)
        self.step.finish()
        self.bridge.executor.debug_hook = None
        assert not self.aliased, f"{self.name}: posted buffers alias the caller's: {self.aliased}"
        for i in range(n):
            self.check(i)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", NAMES)
def test_step_is_bit_exact_and_takes_rows_at_send(name: str, order: str) -> None:
    d = Driver(name)
    d.run(order)
    found = all_paths(d.step)
    assert CASES[name].paths <= found, (
        f"{name}: paths {sorted(found)}, declared {CASES[name].paths}"
    )


def test_the_cases_cover_every_path_uneven_and_empty_slices() -> None:
    """Pure: the declared paths cover view, runs, index and local copies; every case's layouts
    give uneven student TP slices, and empty ones where declared."""
    assert set().union(*(c.paths for c in CASES.values())) == set(PATHS)
    for name, c in CASES.items():
        tp = c.student.tp
        rows = [lay.num_rows for s in micro_batches(name) for lay in s.student_layouts.values()]
        if c.uneven:
            assert any(n % tp for n in rows), f"{name}: no uneven slice"
        if c.empty:
            assert any(-(-n // tp) * (tp - 1) >= n for n in rows), f"{name}: no empty slice"


def test_receive_out_of_order_completes_earlier_micro_batches_first() -> None:
    """All sent first; the students receive the last micro-batch first: that call completes
    0, 1, 2 in order, and the later calls for 0 and 1 wait for nothing more and return their
    rows."""
    name = "disjoint tp2 + dp2 -> tp4, thd -> thd"
    d = Driver(name, step_no=1)
    ex = d.bridge.executor
    completed: list[int] = []
    real = ex.complete

    def recording(slot, **kw):
        completed.append(slot.index)
        return real(slot, **kw)

    ex.complete = recording  # type: ignore[method-assign]
    try:
        for i in range(3):
            d.send(i)
        if d.side.student_layouts is not None:
            d.receive(2)
            assert completed == [0, 1, 2], completed
            assert all(s.received for s in d.step._slots)
            d.receive(0)
            d.receive(1)
            assert completed == [0, 1, 2], "an earlier micro-batch was completed twice"
        d.step.finish()
    finally:
        ex.complete = real  # type: ignore[method-assign]
    for i in range(3):
        d.check(i)


def test_two_steps_of_the_same_shapes_reuse_schedules() -> None:
    name = "colocated tp2dp4 -> tp4dp2, sbh -> thd"
    Driver(name, step_no=2).run("prefetch")
    built = bridge_of(name).executor.schedules_built
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        d = Driver(name, step_no=3, id_shift=10_000)  # same shapes, other sample ids and rows
        d.run("inline")
    assert bridge_of(name).executor.schedules_built == built, "same shapes built schedules"
    assert built >= 1
    ours = [
        str(w.message) for w in caught if "bridge" in str(w.message) or "step" in str(w.message)
    ]
    assert not ours, ours
    if d.side.student_layouts is not None:  # the second step really moved other rows
        assert d.side.student_layouts[0].sample_id_R.max() >= 10_000


def test_global_tokens_count_every_wanted_token_once() -> None:
    """With ``keep_sp_shard`` every student rank is its own destination: the step's token count
    still counts each wanted token once (per micro-batch and in all), read from the metadata."""
    name = "keep_sp_shard dp4 -> tp4dp2, thd -> sbh"
    d = Driver(name, step_no=4)
    d.run("prefetch")
    mbs = micro_batches(name)
    for i, s in enumerate(mbs):
        assert d.step.global_tokens(i) == sum(x.num_tokens for x in s.student_layouts.values())
    assert d.step.global_tokens() == sum(d.step.global_tokens(i) for i in range(len(mbs)))


def test_this_module_runs_under_nccls_rules_and_debug_detail() -> None:
    """The knobs above reached every rank: the strict point-to-point mode is installed and torch
    checks every collective's order and shapes (so the steps above passed under both)."""
    from tests.support import strict_p2p

    assert strict_p2p.installed()
    assert dist.get_debug_level() == dist.DebugLevel.DETAIL
