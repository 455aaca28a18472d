"""A MOPD step with its teacher in another world (another torchrun job), or in the same one.

Why this file exists: the tests of a bridge across worlds run the same on-policy GRPO step three
ways and compare them: a student job (TP2 DP2, 4 ranks) and a teacher job (TP2 PP2, 4 ranks)
connected by an address; a second teacher job routed beside the first; and all of it as one
8-rank world. Run under torchrun, one job per world::

    torchrun --nproc-per-node 4 -m tests.support.worlds_job --world student \\
        --worlds student,teacher-0 --address 127.0.0.1:29600 --out DIR
    torchrun --nproc-per-node 4 -m tests.support.worlds_job --world teacher-0 \\
        --address 127.0.0.1:29600 --out DIR
    torchrun --nproc-per-node 8 -m tests.support.worlds_job --world one --out DIR

Each student last-stage rank writes ``DIR/<world>-<rank>.pt``: the rows it received per
micro-batch and teacher, its loss, and the float64 reference's verdict on the loss and every
``main_grad``. ``--fault kill-teacher`` SIGKILLs teacher rank 1 in its forward of step 0
(``kill-teacher-ahead``: of step 1, which with ``--ahead 1`` it scores during step 0;
``kill-student``: student rank 1 in its forward of step 0, while the teacher scores ahead);
``--fault bad-rollouts`` gives rank 0 a teacher index out of range.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

V, S, LAYERS = 64, 16, 2
HIDDEN_T = (48, 40)
HIDDEN_S = 32
BETA = 0.5
N_SAMPLES, M = 8, 2
TIMEOUT_S = 60.0


def _samples(n_teachers: int, step: int = 0) -> dict[str, list[Any]]:
    g = torch.Generator().manual_seed(5 + step)
    out: dict[str, list[Any]] = {"prompts": [], "responses": [], "teachers": [], "adv": []}
    for _ in range(N_SAMPLES):
        p = int(torch.randint(1, 7, (), generator=g))
        r = int(torch.randint(1, S - p + 1, (), generator=g))
        out["prompts"].append(torch.randint(0, V, (p,), generator=g))
        out["responses"].append(torch.randint(0, V, (r,), generator=g))
        out["teachers"].append(int(torch.randint(0, n_teachers, (), generator=g)))
        out["adv"].append(float(torch.randn((), generator=g)))
    return out


def _teacher(k: int, mesh: Any, pool: Any, rank: int) -> Any:
    from mopd.mcore import MeshModel, megatron_process_groups
    from tests.support.mcore_models import full_gpt, sharded_gpt

    pg = megatron_process_groups(mesh, pool)
    model = None
    if mesh.coord(rank) is not None:
        _, full = full_gpt(hidden=HIDDEN_T[k], seed=11 + k, vocab=V, seq=S, layers=LAYERS)
        model, _, _ = sharded_gpt(
            mesh, pg, full, hidden=HIDDEN_T[k], sp=True, thd=False, vocab=V, seq=S, layers=LAYERS
        )
        model.eval()
    return MeshModel(mesh=mesh, model=model, pg_collection=pg)


def _forward_step(mopd: Any, got: dict[int, Any]) -> Any:
    def forward_step(data_iterator: Any, model: Any) -> Any:
        mb = next(data_iterator)

        def loss_func(logits: torch.Tensor) -> Any:
            signal = mopd.teacher_signal(logits, mb)
            i = mopd.micro_batches.index(mb)
            got[i] = {k: v.clone() for k, v in mopd.teacher_rows(i).items()}
            logp = mopd.token_logprobs(logits, mb.labels).reshape(-1)
            pg = -(signal.advantage_T * logp)[signal.mask_T].sum()
            return mopd.loss_output(signal.weighted_kl_sum() + BETA * pg, signal)

        return mopd.forward(model, mb), loss_func

    return forward_step


def _fault_hook(model: Any, rank: int, at_call: int = 0) -> None:
    """Rank 1 SIGKILLs itself in its forward call ``at_call`` (a process that dies
    mid-step; with M micro-batches a step, call M is the first of the step after)."""
    if rank != 1:
        return
    calls = [0]

    def die(*_: Any) -> None:
        calls[0] += 1
        if calls[0] > at_call:
            os.kill(os.getpid(), signal.SIGKILL)

    model.register_forward_pre_hook(die)


def main(argv: list[str] | None = None) -> None:
    """One rank of one world (its default group from ``env://``: torchrun's, or the variables a
    Ray actor of a worker group sets before calling it); ``argv``: the command line's flags."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", required=True)
    ap.add_argument("--worlds", default=None)
    ap.add_argument("--address", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--fault",
        default=None,
        choices=["kill-teacher", "kill-teacher-ahead", "kill-student", "bad-rollouts"],
    )
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--ahead", type=int, default=0, help="the student's steps_ahead")
    args = ap.parse_args(argv)

    from tests.support.megatron_cpu import megatron_world

    setup = megatron_world()
    next(setup)  # the CPU patches and megatron's state, for the life of the job
    from mopd.bridge import GroupPool, Mesh, connect_worlds
    from mopd.mcore import MeshModel, TeacherServer

    rank = dist.get_rank()
    out = Path(args.out)
    pool = GroupPool(timeout_s=TIMEOUT_S)
    worlds = args.worlds.split(",") if args.worlds else None
    n_teachers = len(worlds) - 1 if worlds else 1
    if args.world == "one":
        link = None
        tmeshes = [Mesh(tp=2, pp=2, rank_offset=4, name="teacher0")]
    elif args.world.startswith("teacher"):
        link = connect_worlds(args.address, world=args.world, timeout_s=TIMEOUT_S)
        k = int(args.world.split("-")[1])
        teacher = _teacher(k, Mesh(tp=2, pp=2, name=f"teacher{k}"), pool, rank)
        if args.fault in ("kill-teacher", "kill-teacher-ahead") and teacher.model is not None:
            _fault_hook(teacher.model, rank, M if args.fault == "kill-teacher-ahead" else 0)
        try:
            with TeacherServer(link=link, teachers=[teacher], pool=pool) as server:
                served = server.serve()
            (out / f"{args.world}-{rank}.json").write_text(
                json.dumps({"served": served, "history": server.history})
            )
        except Exception as exc:
            (out / f"{args.world}-{rank}.json").write_text(
                json.dumps({"error": type(exc).__name__, "text": str(exc)})
            )
        link.close()
        pool.close()
        return
    else:
        link = connect_worlds(args.address, world=args.world, worlds=worlds, timeout_s=TIMEOUT_S)
        tmeshes = [Mesh(tp=2, pp=2, name=f"teacher{k}") for k in range(n_teachers)]
    teachers = (
        [_teacher(0, tmeshes[0], pool, rank)]
        if link is None
        else [MeshModel(mesh=m, world=f"teacher-{k}") for k, m in enumerate(tmeshes)]
    )
    report = _student_step(
        link=link,
        teachers=teachers,
        pool=pool,
        rank=rank,
        n_teachers=n_teachers,
        fault=args.fault,
        steps=args.steps,
        ahead=args.ahead,
    )
    if report is not None:
        torch.save(report, out / f"{args.world}-{rank}.pt")
    if link is not None and rank == 0:  # it hosts the link's store: the others may still read
        others = [out / f"{args.world}-{r}.pt" for r in range(1, dist.get_world_size())]
        deadline = time.monotonic() + 2 * TIMEOUT_S
        while not all(f.exists() for f in others) and time.monotonic() < deadline:
            time.sleep(0.05)
    if link is not None:
        link.close()
    pool.close()


def _student_step(
    *,
    link: Any,
    teachers: list[Any],
    pool: Any,
    rank: int,
    n_teachers: int,
    fault: str | None,
    steps: int,
    ahead: int,
) -> dict[str, Any] | None:
    """The student's steps (``ahead``: submitted that many steps ahead); step 0's report, with
    every step's in ``"steps"`` (each with ``"span"``: its schedule's wall-clock start, end)."""
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from mopd.bridge import BridgeConfig, Mesh
    from mopd.mcore import Distiller, MeshModel, Rollouts, megatron_process_groups
    from tests.support.mcore_models import full_gpt, sharded_gpt

    smesh = Mesh(tp=2, dp=2, name="student")
    spg = megatron_process_groups(smesh, pool)
    full_s_model, full_s = full_gpt(hidden=HIDDEN_S, seed=12, vocab=V, seq=S, layers=LAYERS)
    model = names = cfg = None
    if smesh.coord(rank) is not None:
        model, names, cfg = sharded_gpt(
            smesh, spg, full_s, hidden=HIDDEN_S, sp=True, thd=False, vocab=V, seq=S,
            layers=LAYERS, calculate_per_token_loss=True,
        )  # fmt: skip
        model = DDP(cfg, DistributedDataParallelConfig(), model, pg_collection=spg)
        cfg.finalize_model_grads_func = finalize_model_grads
        if fault == "kill-student" and link is not None:
            _fault_hook(model, rank)
    distiller = Distiller(
        teachers=teachers,
        student=MeshModel(mesh=smesh, model=model, pg_collection=spg),
        pool=pool,
        bridge_config=BridgeConfig(timeout_s=TIMEOUT_S),
        vocab_size=V,
        link=link,
        steps_ahead=ahead,
    )
    c = smesh.coord(rank)
    lead = c is not None and c.tp_rank == 0 and c.pp_rank == 0
    mine = [j for j in range(N_SAMPLES) if j % smesh.dp == (c.dp_rank if c else -1)] if lead else []

    def rollouts(k: int) -> Any:
        smp = _samples(n_teachers, k)
        teachers_of = list(smp["teachers"])
        if fault == "bad-rollouts" and rank == 0:
            teachers_of = [n_teachers + 3] * N_SAMPLES
        return Rollouts(
            prompts=[smp["prompts"][j] for j in mine],
            responses=[smp["responses"][j] for j in mine],
            teachers=[teachers_of[j] for j in mine],
            advantages=[smp["adv"][j] for j in mine],
        )

    def step_k(k: int) -> Any:
        if ahead:
            if k == 0:
                distiller.submit(rollouts(0), num_micro_batches=M)
            if k + 1 < steps:
                distiller.submit(rollouts(k + 1), num_micro_batches=M)  # scored meanwhile
            return distiller.step()
        return distiller.step(rollouts(k), num_micro_batches=M)

    reports: list[dict[str, Any]] = []
    for k in range(steps):
        report: dict[str, Any] = {}
        t0 = time.monotonic()
        try:
            got: dict[int, Any] = {}
            if model is None:  # a teacher rank of the one-world job: its pass runs in step()
                with step_k(k):
                    pass
                continue
            model.zero_grad_buffer()
            with step_k(k) as step:
                start = time.time()
                get_forward_backward_func(pp_size=smesh.pp, vp_size=None)(
                    forward_step_func=_forward_step(step, got),
                    model=[model],
                    p2p_communicator=P2PCommunicator(pp_group=spg.pp, config=cfg),
                    pg_collection=spg,
                    **step.schedule_kwargs(),
                )
                report["span"] = (start, time.time())
            report["loss"] = step.mean_loss()
            report["rows"] = got
        except Exception as exc:
            report["error"] = type(exc).__name__
            report["text"] = str(exc)
            report["elapsed_s"] = time.monotonic() - t0
            reports.append(report)
            break
        smp = _samples(n_teachers, k)
        report.update(
            _reference(smp, full_s_model, model, names, report["loss"], n_teachers, smesh, rank)
        )
        reports.append(report)
    distiller.close()
    if not reports:
        return None
    return dict(reports[0], steps=reports)


def _reference(
    smp: dict[str, list[Any]],
    full_s: Any,
    model: Any,
    names: dict[str, str],
    loss: Any,
    n: int,
    smesh: Any,
    rank: int,
) -> dict[str, Any]:
    """The float64 reference's loss and each ``main_grad``'s largest relative error."""
    from tests.support.mcore_models import full_gpt
    from tests.support.mcore_ref import Float64Check

    seqs = [torch.cat([p, r]) for p, r in zip(smp["prompts"], smp["responses"], strict=True)]
    rows = []
    for p, t in zip(smp["prompts"], seqs, strict=True):
        L, P = t.numel(), p.numel()
        rows.append((torch.arange(L) >= P - 1) & (torch.arange(L) <= L - 2))

    def extra(j: int, s_logits: torch.Tensor, t_logits: torch.Tensor, kl: torch.Tensor) -> Any:
        t = seqs[j]
        labels = torch.cat([t[1:], torch.zeros(1, dtype=torch.int64)])
        logp = torch.log_softmax(s_logits, -1).gather(-1, labels[:, None])[:, 0]
        return -BETA * smp["adv"][j] * logp

    full_ts = [
        full_gpt(hidden=HIDDEN_T[k], seed=11 + k, vocab=V, seq=S, layers=LAYERS)[0]
        for k in range(n)
    ]
    check = Float64Check()  # loss within rtol 1e-5, each gradient within 1e-4
    ref = check.reference(
        full_s,
        full_ts,
        list(zip(smp["teachers"], seqs, strict=True)),
        vocab_size=V,
        masks=rows,
        extra=extra,
    )
    c = smesh.coord(rank)
    check.compare(
        ref, loss=loss, holds_loss=loss is not None, model=model, names=names,
        tp_rank=c.tp_rank, tp_size=smesh.tp,
    )  # fmt: skip
    return {
        "ref_loss": ref.loss,
        "problems": check.problems,
        "loss_err": check.worst_loss[0] if check.worst_loss else None,
        "grad_err": max(check.worst_grad),
    }


if __name__ == "__main__":
    main()
