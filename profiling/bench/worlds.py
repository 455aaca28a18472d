"""Benchmark: a step with its teacher in another world, beside the host path and one world.

Why this file exists: where MOPD runs at scale the teacher is its own job (a Ray worker group, a
torchrun of its own), and today's engines move its output through host memory: NeMo-RL copies
the hidden states to the CPU inside the schedule, miles hands them through Ray's object store.
The bridge across worlds moves them device to device, and ``Distiller(steps_ahead=1)`` lets the
teacher's world score step ``k + 1`` while the student trains on step ``k``. This shows, in one
run, what a step costs each way, in lockstep and one step ahead.

Every rank is a Ray actor, each its own ``torch.distributed`` world (gloo, one thread, a local
Ray cluster), as the engines build their worker groups. One teacher rank and one student rank
(``Mesh(tp=1)`` each), real megatron-core GPTModels (``mopd.mcore.cpu``), the student under DDP
and megatron's ``get_forward_backward_func()``, a step of ``M`` micro-batches from rollouts. The
configurations, one row each:

- ``bridge, lockstep`` / ``bridge, 1 step ahead``: the two worlds connected
  (:func:`~mopd.bridge.worlds.connect_worlds`), a :class:`~mopd.mcore.TeacherServer` in the
  teacher's; the student's ``Distiller.step`` (lockstep) or ``submit`` then ``step()``.
- ``host, lockstep`` / ``host, 1 step ahead``: the peer, the path the engines take. The
  teacher's actor runs the same forward-only pass with the capture, copies each micro-batch's
  hidden states to host memory (``.cpu()``) and returns them through Ray's object store; the
  driver hands the object reference (never the data) to the student's actor, which moves them
  to its device and computes the same full-vocabulary reverse KL against the teacher's LM head
  inside megatron's schedule. Lockstep scores, then trains; one step ahead scores step ``k + 1``
  while step ``k`` trains (two actors at once).
- ``one world``: both models in one 2-rank world, the bridge as inside one job (lockstep; the
  teacher's sends overlap the student's schedule within the step).

Figures per row (medians over ``--steps`` steps after a warm-up step): ``step_ms`` (the
student's step: its calls, schedule and finish; the host path's: from scoring to trained, as
the driver sees it), ``teacher_ms`` (the teacher's own pass: the forward with its sends, or
with its copies to host memory), ``hidden_ms`` (one step ahead: the lockstep step of the same
path less this one; the teacher's time taken off the step) and ``hidden_of_teacher``
(``hidden_ms / teacher_ms``), ``payload_bytes`` (a step's teacher rows), ``link_bytes`` (bytes
on the teacher-to-student link per step), ``host_bytes`` (bytes copied through host memory per
step: the host path's copy to the CPU, the object store's copy and the copy back to the device;
none for the bridge, whose rows go device to device), and ``peer`` / ``over_peer`` (the row it
is compared with and ``step_ms`` over that row's). On CPU ranks every byte is in host memory
anyway and the devices are the CPU: those figures are labelled functional (``figures``); the
step times and their ratios are what they measure. Over the bridge, lockstep already streams
each micro-batch's rows as the teacher's pass goes on (that pass overlaps the student's
schedule within the step), so one step ahead hides only what the student's step does outside
its schedule; the host path's lockstep scores, then trains, and gains the whole pass. The ranks
run on gloo on a GPU machine too
(NCCL cannot put two ranks on one GPU), so every row says so.

Run: ``python -m mopd.profiling.bench.worlds [--json] [--quick] [--results-dir DIR]`` (or
``mopd bench worlds``; needs Ray: ``pip install "mopd-bridge[ray]"``). A table (``--json``: one
JSON object per configuration, and nothing else on stdout) and a summary line; records
``worlds-<machine>-<date>.{csv,md}`` in the results folder (not with ``--no-record``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mopd.profiling.mesh_arg import OneLineParser, prog_for

__all__ = ["build_parser", "main", "rows_of", "summary"]

VOCAB = 256
TEACHER_WORLD, STUDENT_WORLD = "teacher-0", "student"
#: the timeout of every wait (the link, the bridge, each Ray call)
TIMEOUT_S = 600.0


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog=prog_for("mopd.profiling.bench.worlds"), description=__doc__.splitlines()[0]
    )
    p.add_argument("--micro-batches", type=int, default=4, help="M per step (default: 4)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per row (default: 4)")
    p.add_argument("--samples", type=int, default=4, help="samples per micro-batch (default: 4)")
    p.add_argument(
        "--length", type=int, default=64, help="tokens per sample, prompt + response (default: 64)"
    )
    p.add_argument("--hidden", type=int, default=256, help="hidden size of both (default: 256)")
    p.add_argument("--teacher-layers", type=int, default=4, help="(default: 4)")
    p.add_argument("--student-layers", type=int, default=2, help="(default: 2)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, one timed step (a check)")
    p.add_argument("--json", action="store_true", help="one JSON object per configuration")
    p.add_argument("--results-dir", type=Path, default=None)
    p.add_argument("--no-record", action="store_true", help="print only")
    return p


# --- one rank (a Ray actor) -----------------------------------------------------------------------


class _Rank:
    """One rank of one world: the teacher's or the student's model, and each configuration's
    side of a step. Each actor is its own ``torch.distributed`` world (``world_size`` 1), or
    one of the 2 ranks of the one-world job."""

    def __init__(self, role: str, *, rank: int, world_size: int, port: int, argd: dict) -> None:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK="0",
        )
        import torch

        from mopd.mcore import cpu

        cpu.quiet()
        cpu.apply()  # before megatron-core is imported: its fusions plain
        torch.set_num_threads(1)
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        from mopd.bridge import GroupPool, Mesh
        from mopd.mcore import megatron_process_groups

        dist.init_process_group("gloo")
        parallel_state.initialize_model_parallel()
        model_parallel_cuda_manual_seed(0)
        self.args = argparse.Namespace(**argd)
        self.role = role
        self.one_world = world_size == 2
        self.rank = rank
        self.pool = GroupPool(timeout_s=TIMEOUT_S)
        # in the one-world job the teacher is rank 0 and the student rank 1
        self.mesh = Mesh(tp=1, rank_offset=rank if self.one_world else 0)
        self.other = Mesh(tp=1, rank_offset=1 - rank) if self.one_world else Mesh(tp=1)
        self.pg = megatron_process_groups(self.mesh, self.pool)
        if self.one_world:
            megatron_process_groups(self.other, self.pool)  # every rank makes every group
        self.model = _model(role, self.mesh, self.pg, self.args)
        self.link: Any = None
        self.head: Any = None
        self.scored: list[float] = []  # the host path's teacher: each pass's seconds
        self.payload = 0  # and the bytes of its last step's rows

    # the bridge across worlds

    def connect(self, address: str) -> None:
        from mopd.bridge import connect_worlds

        if self.role == "student":
            self.link = connect_worlds(
                address, world=STUDENT_WORLD, worlds=[STUDENT_WORLD, TEACHER_WORLD],
                timeout_s=TIMEOUT_S,
            )  # fmt: skip
        else:
            self.link = connect_worlds(address, world=TEACHER_WORLD, timeout_s=TIMEOUT_S)

    def serve(self) -> list[dict[str, Any]]:
        """The teacher's world: serve one Distiller's steps; its history."""
        from mopd.mcore import MeshModel, TeacherServer

        teacher = MeshModel(mesh=self.mesh, model=self.model, pg_collection=self.pg)
        with TeacherServer(link=self.link, teachers=[teacher], pool=self.pool) as server:
            server.serve()
        return server.history

    def bridge_steps(self, steps: int, ahead: int) -> dict[str, Any]:
        """The student's world (or the one-world job's ranks): ``steps`` timed steps after a
        warm-up one; each step's seconds on this rank and the rows it received."""
        from mopd.mcore import Distiller, MeshModel

        me = MeshModel(mesh=self.mesh, model=self.model, pg_collection=self.pg)
        if self.one_world:
            other = MeshModel(mesh=self.other)
            teacher, student = (me, other) if self.role == "teacher" else (other, me)
        else:
            teacher, student = MeshModel(mesh=self.other, world=TEACHER_WORLD), me
        distiller = Distiller(
            teachers=[teacher], student=student, pool=self.pool, vocab_size=VOCAB,
            link=self.link, steps_ahead=ahead,
        )  # fmt: skip
        total = steps + 1
        mine = self.role == "student"

        def held(k: int) -> Any:
            return _rollouts(self.args, k) if mine else None

        times, teacher_s, rows = [], [], 0
        if ahead:
            distiller.submit(held(0), num_micro_batches=self.args.micro_batches)
        for k in range(total):
            t0 = time.perf_counter()
            if ahead and k + 1 < total:
                distiller.submit(held(k + 1), num_micro_batches=self.args.micro_batches)
            step = (
                distiller.step()
                if ahead
                else distiller.step(held(k), num_micro_batches=self.args.micro_batches)
            )
            with step:
                if mine:
                    self._schedule(step.forward_step, step.schedule_kwargs())
            times.append(time.perf_counter() - t0)
            teacher_s.append(step.timings.get("teacher", 0.0))
            if mine and k == 0:
                rows = sum(int(mb.loss_mask.numel()) for mb in step.micro_batches)
            if mine:
                self.model.zero_grad_buffer()
        distiller.close()
        return {"step_s": times[1:], "teacher_s": teacher_s[1:], "rows": rows}

    # the host path

    def teacher_head(self) -> Any:
        """The teacher's LM head weight ``[V, H]`` (set-up, not timed)."""
        return self.model.output_layer.weight.detach().clone()

    def set_teacher_head(self, weight: Any) -> None:
        self.head = weight

    def host_score(self, k: int) -> list[Any]:
        """The teacher: step ``k``'s forward-only pass with the capture, each micro-batch's
        hidden states ``[S, B, H]`` copied to host memory; returned through the object store."""
        from mopd.mcore.teacher import run_teacher

        t0 = time.perf_counter()
        rows: list[Any] = []
        run_teacher(
            self.model,
            _micro_batches(self.args, k, self.mesh, teacher=0),
            pg_collection=self.pg,
            on_hidden=lambda i, hidden: rows.append(hidden.to("cpu", copy=True)),
        )
        self.scored.append(time.perf_counter() - t0)
        self.payload = sum(int(r.numel()) * r.element_size() for r in rows)
        return rows

    def host_figures(self) -> dict[str, Any]:
        """The host path's teacher figures so far (each pass's seconds, a step's bytes); reset."""
        got = {"teacher_s": self.scored, "payload_bytes": self.payload}
        self.scored = []
        return got

    def host_train(self, k: int, scored: list[Any]) -> float:
        """The student: step ``k``'s schedule, each micro-batch's loss the full-vocabulary
        reverse KL to the rows that came through the object store (moved to this device)."""
        import torch

        t0 = time.perf_counter()
        device = torch.device("cpu")
        rows = [r.to(device) for r in scored]
        head = self.head.to(device)
        mbs = _micro_batches(self.args, k, self.mesh, teacher=None)

        def forward_step(data_iterator: Any, model: Any) -> Any:
            i = next(data_iterator)
            mb = mbs[i]

            def loss_func(logits: torch.Tensor) -> Any:
                teacher = torch.einsum("sbh,vh->bsv", rows[i], head)  # [B, S, V]
                logp_s = torch.log_softmax(logits.float(), -1)
                logp_t = torch.log_softmax(teacher.float(), -1)
                kl = (logp_s.exp() * (logp_s - logp_t)).sum(-1)
                mask = mb.loss_mask.float()
                loss = (kl * mask).sum()
                return loss, mask.sum().to(torch.int), {"kl": torch.stack([loss, mask.sum()])}

            return model(mb.tokens, mb.position_ids, mb.attention_mask), loss_func

        self._schedule(
            forward_step,
            {
                "data_iterator": iter(range(len(mbs))),
                "num_microbatches": len(mbs),
                "seq_length": int(mbs[0].tokens.shape[1]),
                "micro_batch_size": int(mbs[0].tokens.shape[0]),
            },
        )
        self.model.zero_grad_buffer()
        return time.perf_counter() - t0

    def _schedule(self, forward_step: Any, kwargs: dict[str, Any]) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        get_forward_backward_func()(
            forward_step_func=forward_step,
            model=[self.model],
            p2p_communicator=P2PCommunicator(pp_group=self.pg.pp, config=self.model.config),
            pg_collection=self.pg,
            **kwargs,
        )

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
        self.pool.close()


def _model(role: str, mesh: Any, pg: Any, args: argparse.Namespace) -> Any:
    """This rank's model: the teacher (eval) or the student under DDP."""
    import torch
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    teacher = role == "teacher"
    torch.manual_seed(1 if teacher else 2)
    cfg = TransformerConfig(
        num_layers=args.teacher_layers if teacher else args.student_layers,
        hidden_size=args.hidden,
        num_attention_heads=4,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        calculate_per_token_loss=True,
    )
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=args.length,
        pg_collection=pg,
    )
    if teacher:
        return model.eval()
    model = DDP(cfg, DistributedDataParallelConfig(), model, pg_collection=pg)
    cfg.finalize_model_grads_func = finalize_model_grads
    return model


def _rollouts(args: argparse.Namespace, k: int) -> Any:
    """Step ``k``'s samples (fixed lengths, random tokens, a quarter of each its prompt)."""
    import torch

    from mopd.mcore import Rollouts

    n = args.samples * args.micro_batches
    g = torch.Generator().manual_seed(k)
    prompt = max(1, args.length // 4)
    return Rollouts(
        prompts=[torch.randint(0, VOCAB, (prompt,), generator=g) for _ in range(n)],
        responses=[torch.randint(0, VOCAB, (args.length - prompt,), generator=g) for _ in range(n)],
        teachers=[0] * n,
    )


def _micro_batches(args: argparse.Namespace, k: int, mesh: Any, *, teacher: int | None) -> Any:
    """The host path's micro-batches of step ``k`` (a world of one rank: every sample here),
    built as the library builds them from rollouts."""
    import torch

    from mopd.mcore.rollouts import StepSamples, rollout_micro_batches

    r = _rollouts(args, k)
    n = len(r)
    tokens = {j: torch.cat([r.prompts[j], r.responses[j]]) for j in range(n)}
    samples = StepSamples(
        sample_id_N=torch.arange(n),
        teacher_N=torch.zeros(n, dtype=torch.int64),
        prompt_len_N=torch.tensor([int(p.numel()) for p in r.prompts]),
        length_N=torch.tensor([int(t.numel()) for t in tokens.values()]),
        advantage_N=None,
        tokens=tokens,
        num_micro_batches=args.micro_batches,
    )
    return rollout_micro_batches(
        samples, mesh=mesh, teacher=teacher, packed=False, sequence_parallel=False,
        device="cpu", rank=mesh.rank_offset,
    )  # fmt: skip


# --- the driver -----------------------------------------------------------------------------------


def _ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (each held until all are picked)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _get(refs: Any) -> Any:
    """``ray.get`` of one reference or a list, bounded by :data:`TIMEOUT_S`; of a list, the
    first that fails raises at once (its peers would only time out waiting for it)."""
    import ray

    if not isinstance(refs, list):
        return ray.get(refs, timeout=TIMEOUT_S)
    deadline = time.monotonic() + TIMEOUT_S
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=deadline - time.monotonic())
        if not done:
            raise TimeoutError(f"bench_worlds: {len(pending)} actor calls still running")
        ray.get(done[0])  # raises its error now
    return ray.get(refs)


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every configuration's raw figures (seconds per timed step), from a local Ray cluster."""
    import ray

    argd = vars(args)
    remote = ray.remote(num_cpus=1)(_Rank)
    out: dict[str, Any] = {}
    # two worlds: the bridge, then the host path, on the same two actors
    ports = _ports(4)  # distinct: none is bound before the actors start
    teacher = remote.remote("teacher", rank=0, world_size=1, port=ports[0], argd=argd)
    student = remote.remote("student", rank=0, world_size=1, port=ports[1], argd=argd)
    address = f"127.0.0.1:{ports[2]}"
    _get([student.connect.remote(address), teacher.connect.remote(address)])
    for ahead in (0, 1):
        got, history = _get(
            [student.bridge_steps.remote(args.steps, ahead), teacher.serve.remote()]
        )
        got["teacher_s"] = [e["timings"]["teacher"] for e in history if "timings" in e][1:]
        out[f"bridge{ahead}"] = got
    _get(student.set_teacher_head.remote(teacher.teacher_head.remote()))
    total = args.steps + 1
    for ahead in (0, 1):
        times = []
        scored = teacher.host_score.remote(0)
        last = time.perf_counter()
        for k in range(total):  # a step: from the last one trained to this one trained
            nxt = teacher.host_score.remote(k + 1) if ahead and k + 1 < total else None
            _get(student.host_train.remote(k, scored))  # the reference, resolved by Ray there
            now = time.perf_counter()
            times.append(now - last)
            last = now
            if k + 1 < total:
                scored = nxt if nxt is not None else teacher.host_score.remote(k + 1)
        figures = _get(teacher.host_figures.remote())
        out[f"host{ahead}"] = {"step_s": times[1:], "teacher_s": figures["teacher_s"][1:]}
        out["host_payload_bytes"] = figures["payload_bytes"]
    _get([teacher.close.remote(), student.close.remote()])
    for a in (teacher, student):
        ray.kill(a)
    # one world: both models on the 2 ranks of one job
    port = ports[3]
    pair = [
        remote.remote(role, rank=r, world_size=2, port=port, argd=argd)
        for r, role in enumerate(("teacher", "student"))
    ]
    ranks = _get([a.bridge_steps.remote(args.steps, 0) for a in pair])
    out["one"] = {"step_s": ranks[1]["step_s"], "teacher_s": ranks[0]["teacher_s"]}
    _get([a.close.remote() for a in pair])
    for a in pair:
        ray.kill(a)
    return out


def rows_of(raw: dict[str, Any], args: argparse.Namespace) -> list[dict]:
    """The table's rows from :func:`_measure`'s figures (medians, bytes, peers)."""
    hidden_bytes = 4 * args.hidden  # one fp32 row
    tokens = args.samples * args.micro_batches * args.length
    bridge_payload = raw["bridge0"]["rows"] * hidden_bytes or tokens * hidden_bytes
    host_payload = int(raw["host_payload_bytes"])
    ms = {k: 1e3 * statistics.median(v["step_s"]) for k, v in raw.items() if isinstance(v, dict)}
    teacher = {
        k: 1e3 * statistics.median(v["teacher_s"])
        for k, v in raw.items()
        if isinstance(v, dict) and v.get("teacher_s")
    }
    label = "functional (CPU ranks)"  # the ranks run on gloo, on a GPU machine too
    names = {
        "bridge0": "bridge, lockstep",
        "bridge1": "bridge, 1 step ahead",
        "host0": "host, lockstep",
        "host1": "host, 1 step ahead",
        "one": "one world",
    }
    peers = {
        "bridge0": "host0",
        "bridge1": "host1",
        "host0": "bridge0",
        "host1": "bridge1",
        "one": "bridge0",
    }
    rows = []
    for key, name in names.items():
        path = "host" if key.startswith("host") else "bridge"
        ahead = 1 if key.endswith("1") else 0
        lock = ms[f"{path}0"] if key != "one" else ms[key]
        hidden = max(lock - ms[key], 0.0) if ahead else 0.0
        t_ms = teacher.get("one" if key == "one" else f"{path}0", 0.0)  # the lockstep pass
        payload = host_payload if path == "host" else bridge_payload
        rows.append(
            {
                "config": name,
                "steps_ahead": ahead,
                "step_ms": round(ms[key], 2),
                "teacher_ms": round(t_ms, 2),
                "hidden_ms": round(hidden, 2),
                "hidden_of_teacher": round(hidden / t_ms, 3) if t_ms else 0.0,
                "payload_bytes": payload,
                "link_bytes": payload,
                "host_bytes": 3 * payload if path == "host" else 0,
                "peer": names[peers[key]],
                "over_peer": round(ms[key] / ms[peers[key]], 3),
                "figures": label,
            }
        )
    return rows


def summary(rows: Sequence[dict[str, Any]]) -> str:
    """One line: the bridge beside the host path, in lockstep and one step ahead."""
    by = {r["config"]: r for r in rows}
    b0, b1 = by["bridge, lockstep"], by["bridge, 1 step ahead"]
    h0, h1 = by["host, lockstep"], by["host, 1 step ahead"]
    return (
        f"summary: the bridge's step is {b0['over_peer']:.2f}x the host path's in lockstep, "
        f"{b1['over_peer']:.2f}x one step ahead; one step ahead hides "
        f"{b1['hidden_of_teacher']:.0%} of the teacher's time over the bridge "
        f"({h1['hidden_of_teacher']:.0%} over the host path); the host path copies "
        f"{h0['host_bytes']:,} B a step through host memory, the bridge none "
        f"({b0['figures']})"
    )


def _report(args: argparse.Namespace, rows: list[dict], load: float) -> None:
    from mopd.profiling.results import format_table, record

    if args.json:
        for row in rows:
            print(json.dumps(row), flush=True)
    else:
        print(format_table(rows), flush=True)
    print(summary(rows), file=sys.stderr if args.json else sys.stdout, flush=True)
    if args.no_record:
        return
    notes = (
        f"One teacher rank and one student rank, each a Ray actor and its own torch.distributed "
        f"world (gloo, one thread); {args.micro_batches} micro-batches of {args.samples} samples "
        f"x {args.length} tokens, hidden {args.hidden}, teacher {args.teacher_layers} layers, "
        f"student {args.student_layers} under DDP and megatron's schedule; medians of "
        f"{args.steps} steps per row after a warm-up step. Load average {load:.2f} at the start."
        "\n\nThe host path is the peer: the teacher's hidden states copied to host memory, "
        "returned through Ray's object store (the driver hands the reference, not the data), "
        "moved to the student's device, the full-vocabulary reverse KL computed there. "
        "`host_bytes` counts the copy to the CPU, the object store's and the copy back; on CPU "
        "ranks every byte is host memory, so those columns are functional. `hidden_ms`: the "
        "lockstep step of the same path less the one-step-ahead step. Over the bridge, "
        "lockstep already streams each micro-batch's rows while the teacher's pass goes on, so "
        "that pass overlaps the student's schedule within the step (compare the host path's "
        "lockstep, which scores and then trains); one step ahead then hides only what the "
        "student's step does outside its schedule, which here is little more than its calls "
        "(no sampling, no optimizer step). "
        f"{summary(rows)}"
    )
    csv_path, md_path = record("worlds", rows, out_dir=args.results_dir, notes=notes)
    print(f"bench_worlds: recorded {csv_path}, {md_path}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in (
        "micro_batches", "steps", "samples", "length", "hidden", "teacher_layers",
        "student_layers",
    ):  # fmt: skip
        value = getattr(args, name)
        if value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.length < 2:
        parser.error(f"--length must be >= 2 (a prompt and a response token), got {args.length}")
    if args.quick:
        args.steps, args.samples, args.length, args.hidden = 1, 2, 16, 64
        args.micro_batches, args.teacher_layers = min(args.micro_batches, 2), 2
    try:
        import ray
    except ImportError:
        parser.error('needs Ray for its actors and the host path: pip install "mopd-bridge[ray]"')
    load = os.getloadavg()[0]
    env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    ray.init(
        num_cpus=4, include_dashboard=False, log_to_driver=False,
        runtime_env={"env_vars": env}, logging_level="ERROR",
    )  # fmt: skip
    try:
        raw = _measure(args)
    finally:
        ray.shutdown()
    _report(args, rows_of(raw, args), load)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
