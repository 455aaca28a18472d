"""Benchmark: a bridge step against the naive all-gather, with bytes and kernel launches per rank.

Why this file exists: the bridge's claims are "cross-mesh bytes == the minimum (each token
crosses into its student group once)", "one pack and one unpack launch per teacher on each rank,
whatever the number of peers" and "faster than gathering every teacher row everywhere". This
runs, side by side in one run on this world, for a few mesh pairs:

- the bridge's step API (:meth:`~mopd.bridge.HiddenStateBridge.plan_step`, ``send`` /
  ``receive`` per micro-batch, ``finish``): time per step (``plan_step ms``: its metadata
  all-gather and planning, part of the step), bytes moved across ranks against the minimum,
  local-copy / pack / unpack bytes, and per rank the kernel launches and peers from the
  executor's schedules (``bridge.executor``);
- the naive baseline: all-gather every teacher row (padded to the largest rank) to every rank,
  then gather one's own rows (``vs all-gather`` = its time / the bridge step's);
- every delivered row checked bit for bit against the teacher's (``exact``);
- the first case that sends, again with ``BridgeConfig(integrity=True)`` (per-row checksums, a
  verdict all-gather in ``finish``): ``integrity cost`` = its step time / the same step with
  integrity off, the two timed alternately in the same call.

On CPU ranks (gloo) the times are functional figures (the paths run, the rows are exact, the
bytes and launches are what a GPU run moves), not link or kernel speed: ranks share this
machine's cores. Every table, note and the plot say so. Planning at scale is ``mopd bench plan``.

Run: ``python -m mopd.profiling.bench.bridge [--quick] [--nproc N] [--json] [--results-dir DIR]``
(or ``mopd bench bridge``). Without torchrun it starts ``--nproc`` ranks itself (default 4 gloo
ranks on CPU, 1 NCCL rank on a GPU: send/recv to itself); under
``torchrun --nproc-per-node N -m mopd.profiling.bench.bridge`` it uses torchrun's world.
Records ``bridge-<machine>-<date>.{csv,md,png}`` under the results folder
(:func:`mopd.profiling.results.default_results_dir`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mopd.profiling.extras import can_draw
from mopd.profiling.launch import free_port, run_spawned
from mopd.profiling.mesh_arg import OneLineParser, prog_for

if TYPE_CHECKING:
    import torch

    from mopd.bridge import BridgeStep, GroupPool, Mesh, TokenLayout

__all__ = ["Case", "bench_case", "cases_for", "main", "plot", "receive_memory"]

_TIMEOUT_S = 120.0


@dataclass(frozen=True, kw_only=True)
class Case:
    """One mesh pair of the run."""

    name: str
    teacher: Mesh
    student: Mesh
    local_copy: bool = True
    micro_batches: int = 1


def cases_for(world: int, *, cuda: bool) -> list[Case]:
    """The mesh pairs measured on a world of ``world`` ranks."""
    from mopd.bridge import Mesh

    if world == 1:
        out = [Case(name="world 1, colocated, local copies", teacher=Mesh(), student=Mesh())]
        if cuda:  # gloo cannot send to itself
            out.append(
                Case(
                    name="world 1, colocated, NCCL send/recv to self",
                    teacher=Mesh(),
                    student=Mesh(),
                    local_copy=False,
                )
            )
        return out
    half = world // 2
    t_tp = 2 if half % 2 == 0 else 1
    s_tp = 2 if (world - half) % 2 == 0 else 1
    out = [
        Case(
            name=f"disjoint: tp{t_tp}dp{half // t_tp} -> tp{s_tp}dp{(world - half) // s_tp}",
            teacher=Mesh(tp=t_tp, dp=half // t_tp),
            student=Mesh(tp=s_tp, dp=(world - half) // s_tp, rank_offset=half),
        )
    ]
    if world % 2 == 0:
        out.append(
            Case(
                name=f"colocated: tp2dp{world // 2} -> dp{world}",
                teacher=Mesh(tp=2, dp=world // 2),
                student=Mesh(dp=world),
            )
        )
    if world % 4 == 0:
        out.append(
            Case(
                name=f"colocated, 2 micro-batches: tp2dp{world // 2} -> tp2cp2dp{world // 4}",
                teacher=Mesh(tp=2, dp=world // 2),
                student=Mesh(tp=2, cp=2, dp=world // 4),
                micro_batches=2,
            )
        )
    return out


def _shifted(layout: TokenLayout, by: int) -> TokenLayout:
    """``layout`` with every real sample id moved by ``by`` (micro-batches with distinct ids)."""
    import torch

    from mopd.bridge import TokenLayout

    s = layout.sample_id_R
    return TokenLayout(sample_id_R=torch.where(s >= 0, s + by, s), position_R=layout.position_R)


def _micro_batches(
    case: Case, *, samples: int, max_len: int, seed: int
) -> tuple[list[dict[tuple[int, int], TokenLayout]], list[dict[tuple[int, int], TokenLayout]]]:
    """Per micro-batch, teacher (THD) and student (SBH) layouts of the same samples."""
    from mopd.profiling.synthetic import SideFormat, synthetic_step

    t_out, s_out = [], []
    for i in range(case.micro_batches):
        st = synthetic_step(
            teachers=[case.teacher],
            student=case.student,
            num_samples=samples,
            max_len=max_len,
            teacher_formats=[SideFormat(kind="thd", micro_batch=4)],
            student_format=SideFormat(kind="sbh", micro_batch=2, pad_multiple=case.student.tp),
            seed=seed + i,
        )
        by = i * 3 * samples  # synthetic ids lie in [0, 3 * samples)
        t_out.append({k: _shifted(v, by) for k, v in st.teacher_layouts[0].items()})
        s_out.append({k: _shifted(v, by) for k, v in st.student_layouts.items()})
    return t_out, s_out


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _schedules(step: BridgeStep) -> list[Any]:
    """This rank's schedule of every micro-batch (the executor's, as the step runs them)."""
    scheds = [step.schedule(i) for i in range(step.num_micro_batches)]
    return [s for s in scheds if s is not None]


def bench_case(
    case: Case,
    *,
    pool: GroupPool,
    samples: int,
    max_len: int,
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
    iters: int,
    integrity: bool = False,
) -> dict[str, Any]:
    """Time the bridge step and the naive all-gather on ``case`` (collective over the world)."""
    import torch
    import torch.distributed as dist

    from mopd.bridge import BridgeConfig, HiddenStateBridge, TeacherSpec, create_bridge_groups
    from mopd.bridge.layout import encode_keys
    from mopd.common.dist import all_gather_flat
    from mopd.kernels.rows import gather_rows
    from mopd.profiling.synthetic import key_pattern

    rank, world = dist.get_rank(), dist.get_world_size()
    teacher, student, m = case.teacher, case.student, case.micro_batches
    groups = create_bridge_groups(pool, [teacher], student)
    t_lay, s_lay = _micro_batches(case, samples=samples, max_len=max_len, seed=1)
    tc, sc = teacher.coord(rank), student.coord(rank)
    t_mine = [t_lay[i][(tc.dp_rank, tc.cp_rank)] for i in range(m)] if tc is not None else None
    s_mine = [s_lay[i][(sc.dp_rank, sc.cp_rank)] for i in range(m)] if sc is not None else None
    # rows whose bits derive from their key: replicas agree, a misplaced row is caught
    hidden_M = [key_pattern(x, hidden, dtype).to(device) for x in t_mine or []]

    def make(with_integrity: bool) -> HiddenStateBridge:
        return HiddenStateBridge(
            teachers=[TeacherSpec(mesh=teacher, hidden_size=hidden, dtype=dtype)],
            student=student,
            groups=groups,
            config=BridgeConfig(
                timeout_s=120, local_copy=case.local_copy, integrity=with_integrity
            ),
        )

    bridge = make(integrity)
    plan_s: list[float] = []  # plan_step of the timed bridge steps

    def run_step(
        b: HiddenStateBridge, plan_times: list[float] | None = None
    ) -> tuple[BridgeStep, list[tuple[torch.Tensor, Any]]]:
        """One step; on student ranks ``(rows of teacher 0, owner of each row)`` per micro-batch."""
        t0 = time.perf_counter()
        step = b.plan_step(
            teacher_layouts={0: t_mine} if t_mine is not None else None,
            student_layouts=s_mine,
        )
        if plan_times is not None:
            plan_times.append(time.perf_counter() - t0)
        outs = []
        for i in range(m):
            if t_mine is not None:
                step.send(i, {0: hidden_M[i]})
            if s_mine is not None:
                outs.append((step.receive(i)[0], step.owner(i)))
        step.finish()
        return step, outs

    # naive: per micro-batch, all-gather every teacher row (tp rank 0's copy) everywhere
    naive_mb = []
    for i in range(m):
        if tc is not None and tc.tp_rank == 0:
            src = hidden_M[i]
            keys = encode_keys(t_mine[i].sample_id_R, t_mine[i].position_R, 1 << 24)  # type: ignore[index]
        else:
            src = torch.empty((0, hidden), dtype=dtype, device=device)
            keys = torch.empty(0, dtype=torch.int64)
        n_all = torch.empty(world, dtype=torch.int64, device=device)
        all_gather_flat(
            n_all, torch.tensor([src.shape[0]], device=device), group=None, timeout_s=_TIMEOUT_S
        )
        width = int(n_all.max())
        keys_pad = torch.full((width,), -1, dtype=torch.int64, device=device)
        keys_pad[: keys.numel()] = keys.to(device)
        keys_all = torch.empty(world * width, dtype=torch.int64, device=device)
        all_gather_flat(keys_all, keys_pad, group=None, timeout_s=_TIMEOUT_S)
        pick = out = None
        if s_mine is not None:
            kd = encode_keys(s_mine[i].sample_id_R, s_mine[i].position_R, 1 << 24).to(device)
            order = torch.argsort(keys_all)
            pos = torch.searchsorted(keys_all[order], kd).clamp(max=keys_all.numel() - 1)
            pick = order[pos]  # padding rows pick anything (this baseline fills layout rows;
            # the bridge delivers compact rows, one per token, which the comparison unpacks)
            out = torch.empty((s_mine[i].num_rows, hidden), dtype=dtype, device=device)
        naive_mb.append(
            {
                "src": src,
                "send": torch.zeros((width, hidden), dtype=dtype, device=device),
                "recv": torch.empty((world * width, hidden), dtype=dtype, device=device),
                "pick": pick,
                "out": out,
                "rows": int(n_all.sum()),
            }
        )

    def naive() -> None:
        for x in naive_mb:
            x["send"][: x["src"].shape[0]].copy_(x["src"])
            all_gather_flat(x["recv"], x["send"], group=None, timeout_s=_TIMEOUT_S)
            if x["pick"] is not None:
                gather_rows(x["recv"], x["pick"], out_RH=x["out"], check_bounds=False)

    def timed(fn: Callable[[], object]) -> float:
        dist.barrier()
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        dist.barrier()
        return time.perf_counter() - t

    # the functional check first: every delivered row bit for bit, the baseline's too
    step, outs = run_step(bridge)
    ok = True
    int_view = {2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.int8}[dtype.itemsize]
    wants = [key_pattern(x, hidden, dtype).to(device).view(int_view) for x in s_mine or []]
    for i, (got, owner) in enumerate(outs):
        want = wants[i]
        real = owner >= 0  # compact: one row per real token (one teacher), in layout order
        ok &= bool(torch.equal(got.view(int_view), want[real]))
        ok &= bool(real.sum() == s_mine[i].num_tokens)  # type: ignore[index]
    naive()
    for i, x in enumerate(naive_mb):
        if x["out"] is not None:
            real = s_mine[i].sample_id_R.to(device) >= 0  # type: ignore[index]
            ok &= bool(torch.equal(x["out"].view(int_view)[real], wants[i][real]))

    counts = [s.counts() for s in _schedules(step)]
    per_rank = {
        k: sum(c[k] for c in counts)
        for k in ("send_bytes", "local_bytes", "pack_bytes", "unpack_bytes", "messages")
    }
    launches = max(
        (c["pack_launches"] + c["unpack_launches"] + c["local_passes"] for c in counts), default=0
    )
    peers = max((c["messages"] for c in counts), default=0)
    sums = torch.tensor(
        [per_rank[k] for k in ("send_bytes", "local_bytes", "pack_bytes", "unpack_bytes")]
        + [per_rank["messages"]],
        dtype=torch.int64,
        device=device,
    )
    tops = torch.tensor([launches, peers, 0 if ok else 1], dtype=torch.int64, device=device)
    dist.all_reduce(sums)
    dist.all_reduce(tops, op=dist.ReduceOp.MAX)
    sums, tops = sums.cpu().tolist(), tops.cpu().tolist()

    figures: dict[str, float] = {}
    for label, fn in (("bridge", lambda: run_step(bridge, plan_s)), ("naive", naive)):
        fn()
        figures[label] = statistics.median(timed(fn) for _ in range(iters))
    plan_ms = 1e3 * statistics.median(plan_s)
    extra: dict[str, Any] = {}
    if integrity:
        # the same step with integrity off, timed alternately with the integrity-on bridge in
        # this call, so the ratio compares like with like (on a busy machine too)
        plain = make(False)
        run_step(plain)
        on, off = [], []
        for _ in range(iters):
            on.append(timed(lambda: run_step(bridge)))
            off.append(timed(lambda: run_step(plain)))
        figures["bridge"] = statistics.median(on)
        extra = {
            "integrity off ms": 1e3 * statistics.median(off),
            "integrity cost": statistics.median(on) / statistics.median(off),
        }
    row_bytes = hidden * dtype.itemsize
    tokens = sum(x.num_tokens for lay in s_lay for x in lay.values())
    naive_bytes = sum((world - 1) * x["rows"] * row_bytes for x in naive_mb)
    return {
        "case": case.name,
        "world": world,
        "micro-batches": m,
        "integrity": "on" if integrity else "off",
        "tokens": tokens,
        "hidden": hidden,
        "bridge step ms": 1e3 * figures["bridge"],
        "plan_step ms": plan_ms,
        "all-gather ms": 1e3 * figures["naive"],
        "vs all-gather": figures["naive"] / figures["bridge"],
        "bytes across ranks": sums[0],
        "local copy bytes": sums[1],
        "minimum bytes": tokens * row_bytes,
        "all-gather bytes across ranks": naive_bytes,
        "pack bytes": sums[2],
        "unpack bytes": sums[3],
        "transfers": sums[4] // 2,  # each counted by its sender and its receiver
        "launches/rank/micro-batch (max)": tops[0],
        "messages/rank/micro-batch (max)": tops[1],
        "exact": tops[2] == 0,
        **extra,
    }


def receive_memory(
    *,
    pool: GroupPool,
    samples: int,
    max_len: int,
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
    micro_batches: int = 2,
) -> list[dict[str, Any]]:
    """Peak receive memory per student rank on a two-teacher step (collective over the world).

    Two teachers (each sample routed to one) and a student padded ``[B, S]`` with TP 2 where
    the world allows, colocated on every rank. One step: every micro-batch sent and received,
    all returned rows held until ``finish`` (as a loss that reads them per micro-batch would).
    Per student rank: ``receive bytes`` = the storage of the buffers the bridge delivered
    into (measured off the tensors), against ``K x [N, H]`` (the per-teacher layout-order
    buffers the bridge allocated before compact delivery: ``K`` teachers x ``tp * ceil(N / tp)``
    rows each), ``[N, H]`` (every row of the layout once) and ``tokens x H`` (one row per
    token: the floor). Every delivered row is also checked bit for bit.
    """
    import torch
    import torch.distributed as dist

    from mopd.bridge import (
        BridgeConfig,
        HiddenStateBridge,
        Mesh,
        TeacherSpec,
        compact_rows,
        create_bridge_groups,
    )
    from mopd.profiling.synthetic import SideFormat, key_pattern, synthetic_step

    rank, world = dist.get_rank(), dist.get_world_size()
    tp = 2 if world % 2 == 0 else 1
    teachers = [Mesh(dp=world), Mesh(tp=world)]
    student = Mesh(tp=tp, dp=world // tp)
    groups = create_bridge_groups(pool, teachers, student)
    bridge = HiddenStateBridge(
        teachers=[TeacherSpec(mesh=m, hidden_size=hidden, dtype=dtype) for m in teachers],
        student=student,
        groups=groups,
        config=BridgeConfig(timeout_s=_TIMEOUT_S),
    )
    steps = [
        synthetic_step(
            teachers=teachers,
            student=student,
            num_samples=samples,
            max_len=max_len,
            teacher_formats=[SideFormat(kind="thd", micro_batch=4)] * 2,
            student_format=SideFormat(kind="bsh", micro_batch=2, pad_multiple=tp),
            seed=7 + i,
        )
        for i in range(micro_batches)
    ]
    by = [i * 3 * samples for i in range(micro_batches)]
    t_lays = {}
    for o, m in enumerate(teachers):
        c = m.coord(rank)
        if c is not None:
            t_lays[o] = [
                _shifted(st.teacher_layouts[o][(c.dp_rank, c.cp_rank)], b)
                for st, b in zip(steps, by, strict=True)
            ]
    sc = student.coord(rank)
    assert sc is not None
    s_lays = [
        _shifted(st.student_layouts[(sc.dp_rank, sc.cp_rank)], b)
        for st, b in zip(steps, by, strict=True)
    ]
    step = bridge.plan_step(teacher_layouts=t_lays, student_layouts=s_lays)
    got = []
    for i in range(micro_batches):
        step.send(
            i,
            {
                o: key_pattern(lays[i], hidden, dtype, salt=o).to(device)
                for o, lays in t_lays.items()
            },
        )
        got.append(step.receive(i))
    exact = True
    new_b = old_b = layout_b = token_b = 0
    seen: set[int] = set()
    row_bytes = hidden * dtype.itemsize
    for i, rows in enumerate(got):
        owner = step.owner(i)
        assert owner is not None
        wanted = compact_rows(
            {o: key_pattern(s_lays[i], hidden, dtype, salt=o).to(device) for o in rows}, owner
        )
        for o, t in rows.items():
            want = wanted[o]
            exact &= bool(torch.equal(t.view(torch.uint8), want.view(torch.uint8)))
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                new_b += storage.nbytes()
        n = owner.numel()
        old_b += len(teachers) * tp * -(-n // tp) * row_bytes
        layout_b += n * row_bytes
        token_b += int((owner >= 0).sum()) * row_bytes
    step.finish()
    mine = torch.tensor([new_b, old_b, layout_b, token_b, int(exact)], device=device)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    out = []
    for r, e in enumerate(every):
        new_r, old_r, lay_r, tok_r, ok = (int(x) for x in e.tolist())
        out.append(
            {
                "student rank": r,
                "teachers": len(teachers),
                "student": str(student),
                "micro-batches": micro_batches,
                "K x [N, H] bytes (before)": old_r,
                "receive bytes (compact)": new_r,
                "[N, H] bytes": lay_r,
                "tokens x H bytes": tok_r,
                "compact / [N, H]": round(new_r / max(lay_r, 1), 4),
                "before / compact": round(old_r / max(new_r, 1), 3),
                "exact": bool(ok),
            }
        )
    return out


def plot(rows: Sequence[dict[str, Any]], png: Path, title: str, *, caveat: str | None) -> Path:
    """Per case: the bridge step against the all-gather (time), and the bytes each moves."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    from mopd.profiling.plots import byte_unit, spans_decades

    labels = [
        f"{r['case']}{' + integrity' if r['integrity'] == 'on' else ''}\n"
        f"all-gather / bridge {float(r['vs all-gather']):.2f}x, rows exact: {r['exact']}"
        for r in rows
    ]
    peak = max(float(r["all-gather bytes across ranks"]) for r in rows)
    unit, scale = byte_unit(peak)
    fig = Figure(figsize=(12.0, 0.8 * len(rows) + 2.6), layout="constrained")
    FigureCanvasAgg(fig)
    ax, bx = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2, sharey=None)
    pos = list(range(len(rows)))
    h = 0.38
    bridge = [float(r["bridge step ms"]) for r in rows]
    naive = [float(r["all-gather ms"]) for r in rows]
    ax.barh([p - h / 2 for p in pos], bridge, h, color="#4472c4", label="bridge step")
    ax.barh([p + h / 2 for p in pos], naive, h, color="#7f7f7f", label="all-gather baseline")
    h = 0.27
    cross = [float(r["bytes across ranks"]) / scale for r in rows]
    local = [float(r["local copy bytes"]) / scale for r in rows]
    minimum = [float(r["minimum bytes"]) / scale for r in rows]
    gathered = [float(r["all-gather bytes across ranks"]) / scale for r in rows]
    bx.barh([p - h for p in pos], cross, h, color="#4472c4", label="bridge: across ranks")
    bx.barh([p - h for p in pos], local, h, left=cross, color="tab:orange", label="+ local copies")
    bx.barh(pos, minimum, h, color="tab:green", label="minimum: each token once")
    bx.barh([p + h for p in pos], gathered, h, color="#7f7f7f", label="all-gather: across ranks")
    for axis, values, unit_text in (
        (ax, bridge + naive, "ms per step (median)"),
        (bx, [c + x for c, x in zip(cross, local, strict=True)] + gathered, f"{unit} per step"),
    ):
        if spans_decades(values):
            axis.set_xscale("log")
            axis.xaxis.set_minor_formatter(NullFormatter())
            unit_text += ", log scale"
        axis.set_xlabel(unit_text)
        axis.grid(axis="x", alpha=0.3, which="both")
        axis.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
        axis.invert_yaxis()
    ax.set_yticks(pos, labels, fontsize=8)
    bx.set_yticks(pos, ["" for _ in pos])
    fig.suptitle(title + (f"\n{caveat}" if caveat else ""), fontsize=9)
    fig.savefig(png, dpi=110)
    return png


def _init() -> torch.device:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # several ranks share the cores
    if not dist.is_initialized():
        kw = {"device_id": device} if cuda else {}
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(
                "nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=300), **kw
            )
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            dist.init_process_group(
                "nccl" if cuda else "gloo",
                rank=0,
                world_size=1,
                timeout=datetime.timedelta(seconds=300),
                **kw,
            )
    return device


def _run(args: argparse.Namespace) -> int:
    """One rank of the run (rank 0 prints and records)."""
    import torch
    import torch.distributed as dist

    from mopd.bridge import GroupPool
    from mopd.profiling.results import CPU_CAVEAT, Progress, format_table, record

    device = _init()
    rank, world = dist.get_rank(), dist.get_world_size()
    small = args.quick or device.type == "cpu"
    samples = args.samples or (16 if small else 32)
    max_len = args.max_len or (256 if small else 4096)
    hidden = args.hidden or (128 if small else 4096)
    pool = GroupPool(backend="nccl" if device.type == "cuda" else "gloo", timeout_s=120)
    cases = cases_for(world, cuda=device.type == "cuda")
    # the first case that sends once more with integrity on (world 1 on a GPU: NCCL to self)
    first = next((c for c in cases if not c.local_copy), cases[0]) if world == 1 else cases[0]
    runs = [(c, False) for c in cases] + [(first, True)]
    cpu = device.type == "cpu"
    label = (
        f"functional (CPU: {world} gloo rank(s) on {os.cpu_count()} cores)"
        if cpu
        else f"measured ({world} x {torch.cuda.get_device_name(device)})"
    )
    rows = []
    with Progress(total=len(runs), desc="bench bridge", quiet=args.json or rank != 0) as bar:
        for case, integrity in runs:
            bar.start(case.name + (" + integrity" if integrity else ""))
            row = bench_case(
                case,
                pool=pool,
                samples=samples,
                max_len=max_len,
                hidden=hidden,
                dtype=torch.bfloat16,
                device=device,
                iters=args.iters,
                integrity=integrity,
            )
            row["figures"] = label
            rows.append(row)
            bar.step()
            if args.json and rank == 0:
                print(json.dumps(row), flush=True)
    mem_rows = receive_memory(
        pool=pool,
        samples=samples,
        max_len=max_len,
        hidden=hidden,
        dtype=torch.bfloat16,
        device=device,
    )
    if args.json and rank == 0:
        for row in mem_rows:
            print(json.dumps({"receive_memory": row}), flush=True)
    if rank == 0:
        if not args.json:
            if cpu:
                print(f"{CPU_CAVEAT}: {world} gloo ranks share this machine's cores.")
            print(format_table(rows))
            print("Receive memory per student rank, two-teacher step:")
            print(format_table(mem_rows))
        if not args.no_record:
            notes = (
                "Bridge step (plan_step + send/receive per micro-batch + finish) against the "
                "naive all-gather (every teacher row to every rank, then one's own rows), same "
                "run. 'vs all-gather' = all-gather ms / bridge step ms; 'plan_step ms' is part "
                "of the step. 'bytes across ranks' excludes local copies; with them it equals "
                "'minimum bytes' (each token into its student group once). 'launches/rank/"
                "micro-batch' = pack + unpack + local-copy passes of the busiest rank in one "
                "micro-batch (executor schedules), 'messages/...' its sends and receives. 'exact': every delivered row bit for bit. "
                "'integrity cost' = step ms with BridgeConfig(integrity=True) / 'integrity off "
                "ms' (timed alternately in the same call)."
                + (f" {CPU_CAVEAT}: {world} gloo ranks share the cores." if cpu else "")
            )
            csv_path, md_path = record("bridge", rows, out_dir=args.results_dir, notes=notes)
            recorded = [csv_path, md_path]
            recorded += record(
                "bridge-receive-memory",
                mem_rows,
                out_dir=args.results_dir,
                notes=(
                    "Peak receive memory per student rank on a two-teacher step (all returned "
                    "rows held until finish). 'receive bytes (compact)': the storage of the "
                    "buffers the bridge delivered into, measured off the returned tensors "
                    "(each teacher's tokens, one row each, plus at most tp - 1 padding rows "
                    "for the TP all-gather). 'K x [N, H] bytes (before)': the per-teacher "
                    "layout-order buffers (tp * ceil(N / tp) rows each) the bridge allocated "
                    "before compact delivery, for the same layouts. '[N, H] bytes': every "
                    "layout row once; 'tokens x H bytes': one row per token (the floor). "
                    "'exact': every delivered row bit for bit."
                ),
            )
            if can_draw("mopd bench bridge"):
                recorded.append(
                    plot(
                        rows,
                        csv_path.with_suffix(".png"),
                        f"{csv_path.stem}: bridge step vs all-gather, {world} rank(s)",
                        caveat=f"{CPU_CAVEAT}: {world} gloo ranks share the cores" if cpu else None,
                    )
                )
            print(f"recorded {', '.join(map(str, recorded))}", file=sys.stderr)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if all(r["exact"] for r in rows + mem_rows) else 1


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog=prog_for("mopd.profiling.bench.bridge"), description=__doc__.splitlines()[0]
    )
    p.add_argument("--quick", action="store_true", help="small sizes (CPU / harness check)")
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="ranks to start when not under torchrun (default: 4 on CPU, 1 on a GPU)",
    )
    p.add_argument("--iters", type=int, default=10, help="timed steps per case (median)")
    p.add_argument("--samples", type=int, default=None, help="samples per micro-batch")
    p.add_argument("--max-len", type=int, default=None, help="longest sample")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--json", action="store_true", help="one JSON object per case, no table")
    p.add_argument("--results-dir", type=Path, default=None)
    p.add_argument("--no-record", action="store_true", help="print only")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("nproc", "iters", "samples", "max_len", "hidden"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _run(args)  # under torchrun
    nproc = args.nproc
    if nproc is None:  # the default depends on the machine: only then is torch needed here
        import torch

        nproc = 1 if torch.cuda.is_available() else 4
    if nproc == 1:
        return _run(args)
    return run_spawned(_run, vars(args), nproc=nproc, tool="bench_bridge")


if __name__ == "__main__":
    raise SystemExit(main())
