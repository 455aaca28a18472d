"""Benchmark: the bridge against the naive all-gather, and the planner at 1M tokens / 256 ranks.

Why this file exists: the bridge's claims are "cross-mesh bytes == the minimum", "balanced over
teacher TP replicas" and "one pass on each side", at a planning cost of milliseconds. This prints,
side by side in one run:

1. planning (pure, no process group): plan time for ~1M tokens over 256 ranks (a 128-rank teacher
   ``tp8 cp2 dp8`` and a 128-rank student ``tp4 cp4 dp8``, THD on both sides, different packing),
   bytes across ranks, messages and replica imbalance;
2. the exchange on this world (torchrun: ``W`` ranks, teacher on the first half, student on the
   second, plus a colocated run on all ranks; plain ``python``: world size 1, colocated, with
   local copies and with NCCL/gloo send-to-self): time per exchange, bytes moved across ranks,
   messages, pack/unpack bytes (each staged row once: one pass per side) and kernel launches
   (one per owner and side on each rank, whatever the number of peers), and the same figures for the naive baseline that all-gathers
   every teacher row to every rank and then gathers its own rows (``vs naive`` = naive time /
   bridge time);
3. the first case that sends (NCCL send/recv to self at world size 1 on a GPU) again with
   ``BridgeConfig(integrity=True)`` (per-row checksums of the source and output rows, one
   checksum message per transfer, a small verdict all-gather in ``wait()``): ``integrity cost``
   = its bridge time / the same exchange's time with integrity off, the two timed alternately
   in the same call.

Run: ``python -m mopd.profiling.bench_bridge [--quick] [--results-dir DIR]`` (one process, NCCL
on a GPU, gloo on CPU), or ``torchrun --nproc-per-node 4 -m mopd.profiling.bench_bridge --quick``
(gloo on CPU). Results go to ``profiling/results/bridge-<machine>-<date>.{csv,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mopd.bridge import (
    BridgeConfig,
    GroupPool,
    HiddenStateBridge,
    Mesh,
    StudentBatch,
    TeacherBatch,
    TeacherSpec,
    create_bridge_groups,
    plan_token_exchange,
)
from mopd.bridge.groups import all_gather_flat
from mopd.bridge.layout import encode_keys
from mopd.kernels import gather_rows
from mopd.profiling.results import format_table, record
from mopd.profiling.synthetic import SideFormat, synthetic_step

__all__ = ["bench_exchange", "bench_plan", "main"]


def bench_plan(*, samples: int, max_len: int, repeats: int = 5, student_kind: str = "thd") -> dict:
    """Plan time and figures for the 256-rank layout (``samples * max_len / 2`` tokens on average).

    Times the run join (``method="runs"``, what the bridge uses) and the per-token reference
    (``method="tokens"``) on the same layouts (medians of ``repeats`` after a warm-up), checks
    they give the same plan, and prints both with their ratio. ``student_kind``: ``"thd"`` or ``"sbh"`` (strided runs that interleave).
    """
    teacher = Mesh(tp=8, cp=2, dp=8, name="teacher")
    student = Mesh(tp=4, cp=4, dp=8, rank_offset=128, name="student")
    step = synthetic_step(
        teachers=[teacher],
        student=student,
        num_samples=samples,
        max_len=max_len,
        teacher_formats=[SideFormat(kind="thd", micro_batch=8)],
        student_format=SideFormat(kind=student_kind, micro_batch=4, pad_multiple=student.tp),
        seed=0,
    )
    tb = [TeacherBatch(mesh=teacher, layouts=step.teacher_layouts[0], hidden_size=4096)]
    sb = StudentBatch(mesh=student, layouts=step.student_layouts)
    med: dict[str, float] = {}
    plans = {}
    for method in ("runs", "tokens"):
        plan_token_exchange(tb, sb, method=method)  # warm-up: first-touch page faults
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            plans[method] = plan_token_exchange(tb, sb, method=method)
            times.append(time.perf_counter() - t)
        med[method] = statistics.median(times)
    plan, ref = plans["runs"], plans["tokens"]
    if not (
        plan.signature == ref.signature
        and torch.equal(plan.transfers_T5, ref.transfers_T5)
        and torch.equal(plan.src_rows_M, ref.src_rows_M)
        and torch.equal(plan.dst_rows_M, ref.dst_rows_M)
    ):
        raise RuntimeError("bench_plan: the run join and the per-token reference disagree")
    s = plan.summary()
    return {
        "case": f"plan only: 256 ranks (tp8cp2dp8 -> tp4cp4dp8), THD -> {student_kind.upper()}",
        "tokens": step.num_tokens,
        "hidden": 4096,
        "plan ms": 1e3 * med["runs"],
        "plan ms (per-token reference)": 1e3 * med["tokens"],
        "reference / runs": med["tokens"] / med["runs"],
        "torch threads": torch.get_num_threads(),
        "bytes across ranks": s["bytes_cross"],
        "minimum bytes": step.num_tokens * 4096 * 2,
        "messages": s["messages"],
        "replica imbalance": s["replica_imbalance"],
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_exchange(
    *,
    name: str,
    teacher: Mesh,
    student: Mesh,
    pool: GroupPool,
    samples: int,
    max_len: int,
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
    iters: int,
    local_copy: bool = True,
    integrity: bool = False,
) -> dict | None:
    """Time the bridge and the naive all-gather on ``teacher -> student`` (collective over the world)."""
    rank = dist.get_rank()
    groups = create_bridge_groups(pool, [teacher], student)
    step = synthetic_step(
        teachers=[teacher],
        student=student,
        num_samples=samples,
        max_len=max_len,
        teacher_formats=[SideFormat(kind="thd", micro_batch=4)],
        student_format=SideFormat(kind="sbh", micro_batch=2, pad_multiple=student.tp),
        seed=1,
    )
    kw: dict = {}
    src_keys = torch.empty(0, dtype=torch.int64)
    src = torch.empty((0, hidden), dtype=dtype, device=device)
    if teacher.is_last_stage(rank):
        c = teacher.coord(rank)
        lay = step.teacher_layouts[0][(c.dp_rank, c.cp_rank)]
        src = torch.randn(lay.num_rows, hidden, device=device).to(dtype)
        kw.update(hidden={0: src}, layouts={0: lay})
        if c.tp_rank == 0:  # the naive baseline gathers each teacher row once
            src_keys = encode_keys(lay.sample_id_R, lay.position_R, 1 << 24)
        else:
            src = src[:0]
    stu = None
    if student.is_last_stage(rank):
        c = student.coord(rank)
        stu = step.student_layouts[(c.dp_rank, c.cp_rank)]
        kw.update(
            student_layout=stu,
            outputs={0: torch.empty((stu.num_rows, hidden), dtype=dtype, device=device)},
        )
    bridge = HiddenStateBridge(
        teachers=[TeacherSpec(mesh=teacher, hidden_size=hidden)],
        student=student,
        groups=groups,
        config=BridgeConfig(timeout_s=120, local_copy=local_copy, integrity=integrity),
    )
    prepared = bridge.prepare(**kw)

    # naive: all-gather every teacher row (padded to the largest rank) everywhere, then gather
    world = dist.get_world_size()
    n_local = torch.tensor([src.shape[0]], device=device)
    n_all = torch.empty(world, dtype=torch.int64, device=device)
    all_gather_flat(n_all, n_local, group=None, timeout=datetime.timedelta(seconds=120))
    width = int(n_all.max())
    keys_pad = torch.full((width,), -1, dtype=torch.int64, device=device)
    keys_pad[: src_keys.numel()] = src_keys.to(device)
    keys_all = torch.empty(world * width, dtype=torch.int64, device=device)
    all_gather_flat(keys_all, keys_pad, group=None, timeout=datetime.timedelta(seconds=120))
    send_pad = torch.zeros((width, hidden), dtype=dtype, device=device)
    recv_all = torch.empty((world * width, hidden), dtype=dtype, device=device)
    pick = None
    naive_out = None
    if stu is not None:
        kd = encode_keys(stu.sample_id_R, stu.position_R, 1 << 24).to(device)
        order = torch.argsort(keys_all)
        pos = torch.searchsorted(keys_all[order], kd).clamp(max=keys_all.numel() - 1)
        pick = order[pos]  # padding rows pick anything: the bridge zero-fills them, naive does not
        naive_out = torch.empty((stu.num_rows, hidden), dtype=dtype, device=device)

    def naive() -> None:
        send_pad[: src.shape[0]].copy_(src)
        all_gather_flat(recv_all, send_pad, group=None, timeout=datetime.timedelta(seconds=120))
        if pick is not None:
            gather_rows(recv_all, pick, out_RH=naive_out, check_bounds=False)

    def bridged() -> None:
        bridge.start(prepared).wait()

    row_bytes = hidden * torch.empty((), dtype=dtype).element_size()
    figures = {}

    def timed(fn) -> float:
        dist.barrier()
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        dist.barrier()
        return time.perf_counter() - t

    for label, fn in (("bridge", bridged), ("naive", naive)):
        fn()
        figures[label] = statistics.median(timed(fn) for _ in range(iters))
    if integrity:
        # the same exchange with integrity off, timed alternately with the integrity-on bridge
        # in this call, so the ratio compares like with like (on a busy machine too)
        plain_bridge = HiddenStateBridge(
            teachers=[TeacherSpec(mesh=teacher, hidden_size=hidden)],
            student=student,
            groups=groups,
            config=BridgeConfig(timeout_s=120, local_copy=local_copy),
        )
        plain_prepared = plain_bridge.prepare(**kw)

        def plain() -> None:
            plain_bridge.start(plain_prepared).wait()

        plain()
        on, off = [], []
        for _ in range(iters):
            on.append(timed(bridged))
            off.append(timed(plain))
        figures["bridge"], figures["plain"] = statistics.median(on), statistics.median(off)
    sched = bridge.executor.schedule(prepared.plan).counts()
    totals = torch.tensor(
        [
            sched["pack_bytes"],
            sched["unpack_bytes"],
            sched["local_bytes"],
            sched["pack_launches"] + sched["unpack_launches"],
        ],
        dtype=torch.int64,
    )
    if device.type == "cuda":
        totals = totals.to(device)
    dist.all_reduce(totals)
    totals = totals.cpu()
    s = prepared.plan.summary()
    needed = sum(x.num_tokens * student.tp for x in step.student_layouts.values()) * row_bytes
    naive_bytes = (world - 1) * int(n_all.sum()) * row_bytes
    extra = (
        {
            "integrity off ms": 1e3 * figures["plain"],
            "integrity cost": figures["bridge"] / figures["plain"],
        }
        if integrity
        else {}
    )
    return {
        "case": name,
        "integrity": "on" if integrity else "off",
        "tokens": step.num_tokens,
        "hidden": hidden,
        "bridge ms": 1e3 * figures["bridge"],
        "naive ms": 1e3 * figures["naive"],
        "vs naive": figures["naive"] / figures["bridge"],
        "bridge GB/s (rows delivered)": needed / figures["bridge"] / 1e9,
        "bytes across ranks": s["bytes_cross"],
        "naive bytes across ranks": naive_bytes,
        "local copy bytes": int(totals[2]),
        "pack bytes": int(totals[0]),
        "unpack bytes": int(totals[1]),
        "pack+unpack launches": int(totals[3]),
        "messages": s["messages"],
        "replica imbalance": s["replica_imbalance"],
        **extra,
    }


def _init() -> torch.device:
    cuda = torch.cuda.is_available()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            kw = {"device_id": device} if cuda else {}
            dist.init_process_group(
                "nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=300), **kw
            )
        return device
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if not dist.is_initialized():
        kw = {"device_id": device} if cuda else {}
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=300),
            **kw,
        )
    return device


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_bridge", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes (CPU / harness check)")
    p.add_argument("--results-dir", type=Path, default=None)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--samples", type=int, default=None, help="samples per exchange")
    p.add_argument("--max-len", type=int, default=None, help="longest sample")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--skip-plan", action="store_true", help="skip the 256-rank planning figure")
    args = p.parse_args(argv)
    device = _init()
    rank, world = dist.get_rank(), dist.get_world_size()
    small = args.quick or device.type == "cpu"
    samples = args.samples or (16 if small else 32)
    max_len = args.max_len or (256 if small else 4096)
    hidden = args.hidden or (128 if small else 4096)
    dtype = torch.bfloat16
    rows = []
    if rank == 0 and not args.skip_plan:
        plan_samples = 64 if args.quick else 512
        for kind in ("thd", "sbh"):
            rows.append(bench_plan(samples=plan_samples, max_len=4096, student_kind=kind))
            print(format_table(rows[-1:]), flush=True)
    pool = GroupPool(backend="nccl" if device.type == "cuda" else "gloo")
    cases: list[tuple[str, Mesh, Mesh, bool]] = []
    if world == 1:
        cases += [
            ("world 1, colocated, local copies", Mesh(), Mesh(), True),
        ]
        if device.type == "cuda":  # gloo cannot send to itself
            cases.append(("world 1, colocated, NCCL send/recv to self", Mesh(), Mesh(), False))
    else:
        half = world // 2
        t_tp = 2 if half % 2 == 0 else 1
        s_tp = 2 if (world - half) % 2 == 0 else 1
        cases += [
            (
                f"disjoint: tp{t_tp}dp{half // t_tp} -> tp{s_tp}dp{(world - half) // s_tp}",
                Mesh(tp=t_tp, dp=half // t_tp),
                Mesh(tp=s_tp, dp=(world - half) // s_tp, rank_offset=half),
                True,
            ),
            (
                f"colocated: tp{t_tp}dp{world // t_tp} -> dp{world}",
                Mesh(tp=t_tp, dp=world // t_tp),
                Mesh(dp=world),
                True,
            ),
        ]
    # the first case once more with integrity on: its cost against the row with it off
    # (on the network path: NCCL send/recv to self at world size 1 on a GPU)
    runs = [(c, False) for c in cases] + [(next((c for c in cases if not c[3]), cases[0]), True)]
    for (name, teacher, student, local), integrity in runs:
        row = bench_exchange(
            name=name,
            teacher=teacher,
            student=student,
            pool=pool,
            samples=samples,
            max_len=max_len,
            hidden=hidden,
            dtype=dtype,
            device=device,
            iters=args.iters,
            local_copy=local,
            integrity=integrity,
        )
        if row is not None:
            row["world"] = world
            rows.append(row)
            if rank == 0:
                print(format_table([row]), flush=True)
    if rank == 0:
        print(format_table(rows))
        record(
            "bridge",
            rows,
            out_dir=args.results_dir,
            notes=(
                "bridge vs naive (all-gather every teacher row to every rank, then gather one's "
                "own rows), same run. 'vs naive' = naive ms / bridge ms. 'bytes across ranks' "
                "excludes local copies; the planning row is pure (no process group). "
                "'integrity cost' = bridge ms with BridgeConfig(integrity=True) / 'integrity "
                "off ms' (the same exchange with it off, timed alternately in the same call)."
                + (
                    f" CPU run: {world} gloo ranks share this machine's cores, so the times are "
                    "a functional check, not link or kernel speed."
                    if device.type == "cpu"
                    else ""
                )
            ),
        )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
