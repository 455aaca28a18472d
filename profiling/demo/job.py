"""The ``mopd demo`` worker: one rank of the multi-teacher MOPD training job.

Why this file exists: :mod:`mopd.profiling.demo` parses the flags and starts torchrun; every rank
then runs :func:`worker` from here, as a megatron-core user's training script would: models on
their own meshes, :class:`mopd.mcore.Distiller` once, then per step ``Distiller.step`` around
megatron's ``get_forward_backward_func()``, an optimizer step, step 1 verified bit-exact against
an all-gather reference, and a report per phase. On-policy: each step the student samples its
responses to the step's prompts under its own mesh (:mod:`mopd.profiling.demo.sampling`), and before
each step a fixed held-out set is scored against the teachers, so the report shows whether the
student gets closer to them.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import re
import sys
import time
import zlib
from typing import TYPE_CHECKING, Any

from mopd.profiling import phases
from mopd.profiling.demo.config import DemoConfig

if TYPE_CHECKING:
    import torch

    from mopd.mcore import Rollouts

from mopd.profiling.demo.config import PHASES, STOP_TOKEN
from mopd.profiling.demo.report import ReportMixin
from mopd.profiling.demo.verify import VerifyMixin

__all__ = ["worker"]


#: Sampling streams: the held-out set's continuations and the training rollouts draw
#: independent noise even where their sample ids overlap.
HELDOUT_STREAM, ROLLOUT_STREAM = 1, 2


def worker(args: argparse.Namespace, cfg: DemoConfig) -> int:
    """One rank of the demo (torchrun's env:// gives the world); returns the exit code."""
    import torch
    import torch.distributed as dist

    from mopd.mcore import cpu

    cpu.quiet()  # megatron-core's known notices without Transformer Engine / Apex, once per rank
    backend = os.environ.get("MOPD_DEMO_BACKEND", "gloo")
    if backend == "gloo":
        cpu.apply()
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=max(60.0, args.timeout / 2))
    phases.enter("joining the job's process group (waiting for the other ranks)")
    dist.init_process_group(
        backend=backend, timeout=timeout, **({"device_id": device} if backend == "nccl" else {})
    )
    if dist.get_world_size() != cfg.nproc:
        print(
            f"mopd demo: the job has {dist.get_world_size()} ranks but --nproc says {cfg.nproc}",
            file=sys.stderr,
        )
        dist.destroy_process_group()
        return 2
    try:
        ok = _Job(cfg, args, device, timeout).run()
    finally:
        dist.destroy_process_group()
    phases.enter("done")
    return 0 if ok else 1


def _name_seed(name: str, seed: int) -> int:
    """A parameter's seed from its full (PP=1, TP=1) name: the same whatever the meshes."""
    return (zlib.crc32(name.encode()) + 1_000_003 * seed) % (2**31)


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _init_weights(
    model: Any, *, tp_rank: int, tp: int, layer_offset: int, seed: int, std: float
) -> None:
    """Initialize every parameter from its full name, then take this rank's shard.

    Every full weight is drawn whole from a generator seeded by its name, so a model has the
    same weights on any mesh (TP shards, pipeline stages): the demo's loss does not depend on
    the parallelism, which its tests check.
    """
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            m = _LAYER.match(name)
            full_name = (
                name
                if m is None
                else f"decoder.layers.{int(m.group(1)) + layer_offset}." + name[m.end() :]
            )
            shape = list(p.shape)
            split = getattr(p, "tensor_model_parallel", False) and tp > 1
            if split:
                shape[p.partition_dim] *= tp
            if name.endswith("norm.weight"):
                full = torch.ones(shape)
            elif name.endswith(".bias"):
                full = torch.zeros(shape)
            else:
                g = torch.Generator().manual_seed(_name_seed(full_name, seed))
                full = torch.randn(shape, generator=g) * std
            if split:
                full = full.chunk(tp, dim=p.partition_dim)[tp_rank]
            p.copy_(full.to(p.device, p.dtype))


class _Job(VerifyMixin, ReportMixin):
    """One rank's share of the demo (built collectively, then :meth:`run`)."""

    def __init__(
        self, cfg: DemoConfig, args: argparse.Namespace, device: torch.device, timeout: Any
    ) -> None:
        import torch.distributed as dist

        self.cfg, self.args, self.device, self.timeout = cfg, args, device, timeout
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    @property
    def out(self) -> Any:
        """Where the report goes: stdout (stderr under ``--json``), looked up at each print so
        that a progress bar's routing (:meth:`Progress.routed`) applies."""
        return sys.stderr if self.args.json else sys.stdout

    def say(self, text: str) -> None:
        if self.rank == 0:
            print(f"  {text}", file=self.out, flush=True)

    # ---- set-up ------------------------------------------------------------------------------

    def _config(self, *, hidden: int, mesh: Any, sp: bool, per_token: bool) -> Any:
        import torch
        from megatron.core.transformer.transformer_config import TransformerConfig

        return TransformerConfig(
            num_layers=self.cfg.layers,
            hidden_size=hidden,
            num_attention_heads=self.cfg.heads,
            tensor_model_parallel_size=mesh.tp,
            context_parallel_size=mesh.cp,
            pipeline_model_parallel_size=mesh.pp,
            sequence_parallel=sp,
            use_cpu_initialization=True,
            params_dtype=torch.float32,
            pipeline_dtype=torch.float32,
            hidden_dropout=0.0,  # deterministic: the loss must not depend on the meshes
            attention_dropout=0.0,
            calculate_per_token_loss=per_token,
            variable_seq_lengths=True,
            moe_token_dispatcher_type="alltoall",
        )

    def _sp(self, tp: int) -> bool:
        """Sequence parallelism on a teacher: with TP, where the norm supports it (on GPUs
        megatron's local spec needs apex's fused norm for SP)."""
        if tp == 1:
            return False
        if self.device.type == "cpu":
            return True
        from megatron.core.models.gpt import gpt_layer_specs

        return bool(getattr(gpt_layer_specs, "HAVE_APEX", False))

    def _build(self) -> None:
        import torch
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel as DDP
        from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        from mopd.bridge import BridgeConfig, GroupPool
        from mopd.mcore import Distiller, MeshModel, megatron_process_groups
        from mopd.mcore.cpu import cpu_gpt_layer_spec

        cfg = self.cfg
        # megatron's global parallel_state as plain data parallelism: only what still reads it
        # (the global memory buffer, the RNG tracker) sees it; every model has its own groups
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=1,
            create_gloo_process_groups=False,
            distributed_timeout_minutes=max(1, int(self.timeout.total_seconds() // 60)),
        )
        model_parallel_cuda_manual_seed(cfg.seed)
        self.teacher_meshes = [t.mesh(name=f"teacher{i}") for i, t in enumerate(cfg.teachers)]
        self.student_mesh = cfg.student.mesh(name="student")
        pool = GroupPool(timeout_s=self.timeout.total_seconds())
        self.teacher_pgs = [megatron_process_groups(m, pool) for m in self.teacher_meshes]
        self.student_pg = megatron_process_groups(self.student_mesh, pool)

        def gpt(
            mesh: Any,
            pg: Any,
            hidden: int,
            *,
            spec: Any,
            sp: bool,
            per_token: bool,
            seed: int,
            std: float,
        ) -> Any:
            c = mesh.coord(self.rank)
            model = GPTModel(
                config=self._config(hidden=hidden, mesh=mesh, sp=sp, per_token=per_token),
                transformer_layer_spec=spec,
                vocab_size=cfg.vocab,
                max_sequence_length=cfg.seq_len,
                position_embedding_type="learned_absolute",
                pre_process=c.pp_rank == 0,
                post_process=c.pp_rank == mesh.pp - 1,
                pg_collection=pg,
            ).to(self.device)
            _init_weights(
                model,
                tp_rank=c.tp_rank,
                tp=mesh.tp,
                layer_offset=c.pp_rank * (cfg.layers // mesh.pp),
                seed=seed,
                std=std,
            )
            return model

        self.teachers: list[Any] = []
        for i, (mesh, pg) in enumerate(zip(self.teacher_meshes, self.teacher_pgs, strict=True)):
            model = None
            if pg is not None:
                model = gpt(
                    mesh,
                    pg,
                    cfg.teacher_hidden[i],
                    spec=get_gpt_layer_local_spec(),
                    sp=self._sp(mesh.tp),
                    per_token=True,
                    seed=cfg.seed + 101 * (i + 1),
                    std=cfg.teacher_init_std,
                )
                model.eval().requires_grad_(False)
            self.teachers.append(model)
        self.student = None
        if self.student_pg is not None:
            scfg_model = gpt(
                self.student_mesh,
                self.student_pg,
                cfg.student_hidden,
                spec=cpu_gpt_layer_spec(),
                sp=False,
                per_token=cfg.per_token_loss,
                seed=cfg.seed,
                std=0.02,
            )
            self.scfg = scfg_model.config
            self.student = DDP(
                self.scfg,
                DistributedDataParallelConfig(),
                scfg_model,
                pg_collection=self.student_pg,
            )
            self.scfg.finalize_model_grads_func = finalize_model_grads
            self.params = [p for p in self.student.parameters() if p.requires_grad]
            self.optimizer = torch.optim.Adam(self.params, lr=cfg.lr)
        self.distiller = Distiller(
            teachers=[
                MeshModel(mesh=m, model=t, pg_collection=pg)
                for m, t, pg in zip(
                    self.teacher_meshes, self.teachers, self.teacher_pgs, strict=True
                )
            ],
            student=MeshModel(  # THD-packed micro-batches, built by Distiller.step
                mesh=self.student_mesh,
                model=self.student,
                pg_collection=self.student_pg,
                packed=True,
            ),
            pool=pool,
            bridge_config=BridgeConfig(timeout_s=self.timeout.total_seconds()),
            vocab_size=cfg.vocab,
        )

    # ---- data --------------------------------------------------------------------------------

    def _prompts(self, ids: list[int], salt: str) -> dict[int, torch.Tensor]:
        """Each sample's ``[prompt_len]`` prompt: its domain tag (token ``1 + teacher``, so the
        student can tell which teacher a prompt is distilled towards, as a domain's prompts go
        to that domain's teacher), then ids drawn after the tags from a generator seeded by
        ``(seed, salt)``."""
        import torch

        cfg = self.cfg
        g = torch.Generator().manual_seed(zlib.crc32(f"prompts/{cfg.seed}/{salt}".encode()))
        body = torch.randint(
            1 + cfg.num_teachers, cfg.vocab, (len(ids), cfg.prompt_len - 1), generator=g
        )
        return {
            s: torch.cat([torch.tensor([1 + s % cfg.num_teachers]), body[k]])
            for k, s in enumerate(ids)
        }

    def _rollouts(
        self, ids: list[int], prompts: dict[int, torch.Tensor], stream: int
    ) -> Rollouts | None:
        """The student's rollouts of ``ids``, as this rank hands them to ``Distiller.step``.

        Each student DP replica ``d`` samples part ``d`` of ``ids`` (contiguous,
        :func:`~mopd.mcore.split_samples`) under the student's TP/CP/PP
        (:func:`~mopd.profiling.demo.sampling.generate`); every copy is checked equal over the job
        (:func:`~mopd.profiling.demo.sampling.check_copies_agree`). The replica's first rank (TP, CP
        and PP rank 0) returns them as :class:`~mopd.mcore.Rollouts` (sample ids, routed to
        teacher ``id % num_teachers``) and keeps their token ids for the report
        (:attr:`sampled`); every other rank returns ``None``. Replicas in DP order hold the
        samples in id order, so the step's micro-batches are contiguous runs of ids on any mesh.
        """
        from mopd.mcore import Rollouts, split_samples
        from mopd.profiling.demo.sampling import SamplingConfig, check_copies_agree, generate

        cfg = self.cfg
        timeout_s = self.timeout.total_seconds()
        sampling = SamplingConfig(
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            stop_token=STOP_TOKEN,
            vocab_size=cfg.vocab,
            seed=cfg.seed,
            stream=stream,
        )
        c = self.student_mesh.coord(self.rank)
        local: dict[int, torch.Tensor] = {}
        if self.student is not None and c is not None:
            mine = split_samples(ids, self.student_mesh.dp, c.dp_rank)
            responses = generate(
                self.student,
                [prompts[s] for s in mine],
                mine,
                pg_collection=self.student_pg,
                config=sampling,
                max_len=cfg.seq_len,
                device=self.device,
                timeout_s=timeout_s,
            )
            local = dict(zip(mine, responses, strict=True))
        check_copies_agree(
            local, ids, max_new_tokens=cfg.max_new_tokens, device=self.device, timeout_s=timeout_s
        )
        if c is None or (c.tp_rank, c.cp_rank, c.pp_rank) != (0, 0, 0):
            return None
        self.sampled.append({s: (prompts[s].tolist(), r.tolist()) for s, r in local.items()})
        return Rollouts(
            prompts=[prompts[s] for s in local],
            responses=list(local.values()),
            teachers=[s % cfg.num_teachers for s in local],
            sample_ids=list(local),
        )

    # ---- the loss and the held-out KL --------------------------------------------------------

    def _forward_step(self, dstep: Any, sums_2K: torch.Tensor) -> Any:
        """megatron's ``forward_step_func`` for ``dstep``: the student's forward, and a
        ``loss_func`` on :meth:`~mopd.mcore.DistillationStep.teacher_signal` (the stock loss:
        the reverse KL to each token's teacher, summed over counted tokens) that also adds each
        teacher's KL sum and token count (by ``owner_T``) into ``sums_2K`` ``[2, teachers]``
        (TP rank 0 of the last stage only: the TP ranks share their tokens)."""
        c = self.student_mesh.coord(self.rank)
        counts = c is not None and c.tp_rank == 0

        def forward_step(data_iterator: Any, model: Any) -> tuple[Any, Any]:
            mb = next(data_iterator)

            def loss_func(logits: torch.Tensor, non_loss_data: bool = False) -> tuple[Any, ...]:
                signal = dstep.teacher_signal(logits, mb)
                if counts:
                    kl_T = next(iter(signal.kl_T.values())).detach().double().cpu()
                    owner_T = signal.owner_T.cpu()
                    for k in range(self.cfg.num_teachers):
                        sums_2K[0, k] += kl_T[owner_T == k].sum()
                        sums_2K[1, k] += int((owner_T == k).sum())
                return dstep.loss_output(signal.weighted_kl_sum(), signal)

            return dstep.forward(model, mb), loss_func

        return forward_step

    def _per_teacher(self, sums_2K: torch.Tensor) -> list[float]:
        """Each teacher's mean KL per token over the whole job (an all-reduce of the ranks'
        ``[2, teachers]`` sums: every rank takes part)."""
        import torch.distributed as dist

        total = sums_2K.to(self.device)
        dist.all_reduce(total)
        total = total.cpu()
        return [float(total[0, k] / total[1, k].clamp(min=1)) for k in range(total.shape[1])]

    def _schedule(self, dstep: Any, sums_2K: torch.Tensor, *, forward_only: bool) -> None:
        """The student's part of ``dstep`` through megatron's schedule (1F1B with PP; forward
        only for the held-out KL); nothing off the student."""
        import torch
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        if self.student is None:
            return
        fb = get_forward_backward_func(pp_size=self.student_mesh.pp, vp_size=None)
        kwargs: dict[str, Any] = {"pg_collection": self.student_pg}
        if self.student_mesh.pp > 1:
            kwargs["p2p_communicator"] = P2PCommunicator(
                pp_group=self.student_pg.pp, config=self.scfg
            )
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            fb(
                forward_step_func=self._forward_step(dstep, sums_2K),
                model=[self.student],
                forward_only=forward_only,
                **dstep.schedule_kwargs(),  # data_iterator, num_microbatches, seq_length, ...
                **kwargs,
            )

    def _heldout_kl(self) -> list[float]:
        """Each teacher's reverse KL per token on the fixed held-out set (its routed samples'
        response tokens), through the library: a forward-only ``Distiller.step`` pass whose
        ``loss_func`` reads :meth:`~mopd.mcore.DistillationStep.teacher_signal`."""
        import torch

        sums = torch.zeros(2, self.cfg.num_teachers, dtype=torch.float64)
        with self.distiller.step(self.heldout, num_micro_batches=self.cfg.micro_batches) as dstep:
            self._schedule(dstep, sums, forward_only=True)
        return self._per_teacher(sums)

    # ---- the run -----------------------------------------------------------------------------

    def _sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self) -> bool:
        import torch
        import torch.distributed as dist

        from mopd.common import ranges

        cfg = self.cfg
        t_start = float(os.environ.get("MOPD_DEMO_T0", time.time()))
        t0 = time.perf_counter()
        self.say(
            f"ranks up after {time.time() - t_start:.1f} s (python, torch, megatron-core imports)"
        )
        phases.enter("building the models, process groups, bridge and LM-head reshard")
        self._build()
        self.say(
            f"models, groups, bridge and LM-head reshard built in {time.perf_counter() - t0:.1f} s"
        )
        if self.rank == 0:
            self._print_meshes()
        t0 = time.perf_counter()
        #: per sampling call on a replica's first rank: sample id -> (prompt, response) token
        #: ids (the held-out set first, then one per step; empty elsewhere), for the report
        self.sampled: list[dict[int, tuple[list[int], list[int]]]] = []
        heldout_ids = list(range(cfg.heldout_samples))
        self.heldout = self._rollouts(
            heldout_ids, self._prompts(heldout_ids, "held-out"), HELDOUT_STREAM
        )
        self.say(
            f"held-out set: {cfg.heldout_samples} fixed prompts, continuations sampled by the "
            f"untrained student in {time.perf_counter() - t0:.1f} s"
        )
        self.times = torch.zeros(cfg.steps, len(PHASES), dtype=torch.float64)
        self.losses = torch.zeros(cfg.steps, dtype=torch.float64)
        self.heldout_kl = torch.zeros(cfg.num_teachers, cfg.steps, dtype=torch.float64)
        self.rollout_kl = torch.zeros(cfg.num_teachers, cfg.steps, dtype=torch.float64)
        self.link_bytes: dict[tuple[int, int, int], int] = {}
        self.verified: dict[str, Any] = {}
        profiler = None
        if self.args.trace:
            ranges.enable()
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            profiler = torch.profiler.profile(activities=activities)
            profiler.__enter__()
        from mopd.profiling.results import Progress

        # a bar where it can draw: rank 0's terminal (not a log, not --json), lines routed past it
        bar = Progress(
            total=cfg.steps,
            desc="mopd demo",
            unit="step",
            leave=True,
            quiet=self.rank != 0 or self.args.json,
            tool="mopd demo",
        )
        ok = True
        try:
            with bar.routed():
                for step in range(cfg.steps):
                    phases.enter(f"step {step + 1} of {cfg.steps}")
                    t_step = time.perf_counter()
                    with ranges.span("step", step):
                        ok = self._step(step)
                    if not ok:
                        break
                    bar.step(f"loss={float(self.losses[step]):.4f}")
                    if not bar.shown:  # a log: a line per step, so it is never silent for long
                        held = " / ".join(f"{float(x):.4f}" for x in self.heldout_kl[:, step])
                        self.say(
                            f"step {step + 1}/{cfg.steps}: rollout KL "
                            f"{float(self.losses[step]):.4f}, held-out KL {held} "
                            f"({time.perf_counter() - t_step:.1f} s)"
                        )
        finally:
            bar.close()
            if profiler is not None:
                profiler.__exit__(None, None, None)
                os.makedirs(self.args.trace, exist_ok=True)
                profiler.export_chrome_trace(
                    os.path.join(self.args.trace, f"trace_rank{self.rank}.json")
                )
        if ok:
            phases.enter("reporting (gathering every rank's figures)")
            self._report()
        elif self.rank == 0 and self.verified:
            from mopd.profiling.demo.report import verdict

            line = verdict(rows_ok=False, bad_ranks=self.verified["bad_ranks"], heldout=[])
            print(line, file=self.out, flush=True)
        if profiler is not None and self.rank == 0:
            print(
                f"traces: {self.args.trace}/trace_rank<r>.json ({self.world} ranks)",
                file=self.out,
                flush=True,
            )
        from megatron.core import parallel_state

        phases.enter("finishing (waiting for every rank, then ending the process groups)")
        dist.barrier()
        parallel_state.destroy_model_parallel()
        return ok

    def _step(self, step: int) -> bool:
        import torch
        import torch.distributed as dist

        cfg = self.cfg
        times = self.times[step]
        t = time.perf_counter()
        # the student that samples this step, before its update
        self.heldout_kl[:, step] = torch.tensor(self._heldout_kl(), dtype=torch.float64)
        times[0] = time.perf_counter() - t
        t = time.perf_counter()
        ids = list(range(step * cfg.samples, (step + 1) * cfg.samples))
        rollouts = self._rollouts(ids, self._prompts(ids, f"step {step}"), ROLLOUT_STREAM)
        times[1] = time.perf_counter() - t
        if self.student is not None:
            self.student.zero_grad_buffer()
        ok = True
        sums = torch.zeros(2, cfg.num_teachers, dtype=torch.float64)
        t = time.perf_counter()
        # every rank passes what it holds: a replica's first rank its samples, the others None
        with self.distiller.step(rollouts, num_micro_batches=cfg.micro_batches) as dstep:
            times[3] = dstep.timings["teacher"]
            times[2] = time.perf_counter() - t - times[3]  # the rollouts' exchange, the plan
            t = time.perf_counter()
            self._schedule(dstep, sums, forward_only=False)
            self._sync()
            times[4] = time.perf_counter() - t
            if step == 0:
                ok = self._verify(dstep)
            t = time.perf_counter()
        times[5] = time.perf_counter() - t
        for mb, owner, src, dst, nbytes in dstep.bridge_step.traffic():
            del mb
            key = (owner, src, dst)
            self.link_bytes[key] = self.link_bytes.get(key, 0) + nbytes
        t = time.perf_counter()
        if self.student is not None:
            for p in self.params:
                p.grad = p.main_grad
            self.optimizer.step()
            for p in self.params:
                p.grad = None
        self._sync()
        times[6] = time.perf_counter() - t
        self.rollout_kl[:, step] = torch.tensor(self._per_teacher(sums), dtype=torch.float64)
        loss = dstep.mean_loss()
        value = torch.tensor(
            [-math.inf if loss is None else loss], dtype=torch.float64, device=self.device
        )
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        self.losses[step] = float(value)
        return ok

    # ---- verification ------------------------------------------------------------------------

    # ---- printing ----------------------------------------------------------------------------
