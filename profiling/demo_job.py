"""The ``mopd demo`` worker: one rank of the multi-teacher MOPD training job.

Why this file exists: :mod:`mopd.profiling.demo` parses the flags and starts torchrun; every rank
then runs :func:`worker` from here, as a megatron-core user's training script would: models on
their own meshes, :class:`mopd.mcore.Distiller` once, then per step ``Distiller.step`` around
megatron's ``get_forward_backward_func()``, an optimizer step, step 1 verified bit-exact against
an all-gather reference, and a report per phase. On-policy: each step the student samples its
responses to the step's prompts under its own mesh (:mod:`mopd.profiling.sampling`), and before
each step a fixed held-out set is scored against the teachers, so the report shows whether the
student gets closer to them.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import math
import os
import re
import sys
import time
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mopd.profiling import phases
from mopd.profiling.demo_config import DemoConfig

if TYPE_CHECKING:
    import torch

    from mopd.mcore import Rollouts

__all__ = ["worker"]

#: The timed phases of one step, in table order.
PHASES: tuple[str, ...] = (
    "held-out",
    "sample",
    "exchange+plan",
    "teacher fwd",
    "student fwd+bwd",
    "finish",
    "optimizer",
)

#: The token that ends a response; the domain tag of teacher ``k``'s prompts is ``1 + k``, and
#: the rest of a prompt draws from the ids after the tags.
STOP_TOKEN = 0

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


class _Job:
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
        (:func:`~mopd.profiling.sampling.generate`); every copy is checked equal over the job
        (:func:`~mopd.profiling.sampling.check_copies_agree`). The replica's first rank (TP, CP
        and PP rank 0) returns them as :class:`~mopd.mcore.Rollouts` (sample ids, routed to
        teacher ``id % num_teachers``) and keeps their token ids for the report
        (:attr:`sampled`); every other rank returns ``None``. Replicas in DP order hold the
        samples in id order, so the step's micro-batches are contiguous runs of ids on any mesh.
        """
        from mopd.mcore import Rollouts, split_samples
        from mopd.profiling.sampling import SamplingConfig, check_copies_agree, generate

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
            from mopd.profiling.demo_report import verdict

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

    def _verify(self, dstep: Any) -> bool:
        """Every student rank checks its bridged rows against an all-gather reference (bit-exact).

        Reference: each teacher's hidden states from a second forward-only pass over the same
        micro-batches (those ``Distiller.step`` built from the rollouts and ran,
        :attr:`~mopd.mcore.DistillationStep.teacher_micro_batches`; deterministic: the same
        bits), all-gathered with the key of every row;
        the student's rows are joined to it by key. Checked: the owner of each row
        (``sample_id % num_teachers``, ``-1`` for padding), each owned row equal to the reference
        row, one row per token of its teacher (compact, in layout order).
        """
        import torch
        import torch.distributed as dist

        from mopd.bridge.layout import encode_keys
        from mopd.mcore import micro_batch_layout
        from mopd.mcore.teacher import run_teacher

        cfg, dev = self.cfg, self.device
        s_mbs, t_mbs = dstep.micro_batches, dstep.teacher_micro_batches
        stride = cfg.seq_len
        problems: list[str] = []
        checked = 0
        for k, mesh in enumerate(self.teacher_meshes):
            seen: dict[int, torch.Tensor] = {}
            if t_mbs[k] is not None:
                run_teacher(
                    self.teachers[k],
                    t_mbs[k],
                    pg_collection=self.teacher_pgs[k],
                    on_hidden=lambda i, h, seen=seen: seen.__setitem__(i, h.clone()),
                )
            h = cfg.teacher_hidden[k]
            for i in range(cfg.micro_batches):
                cap = cfg.seq_len * cfg.samples
                rows = torch.zeros(cap, h, dtype=torch.float32, device=dev)
                keys = torch.full((cap,), -1, dtype=torch.int64, device=dev)
                tc = mesh.coord(self.rank)
                if i in seen and tc is not None and tc.tp_rank == 0:
                    flat = seen[i].reshape(-1, h)
                    lay = micro_batch_layout(t_mbs[k][i], rows="hidden")
                    rows[: flat.shape[0]] = flat
                    keys[: flat.shape[0]] = encode_keys(lay.sample_id_R, lay.position_R, stride).to(
                        dev
                    )
                every_rows = [torch.empty_like(rows) for _ in range(self.world)]
                every_keys = [torch.empty_like(keys) for _ in range(self.world)]
                dist.all_gather(every_rows, rows)
                dist.all_gather(every_keys, keys)
                all_keys, all_rows = torch.cat(every_keys).cpu(), torch.cat(every_rows)
                valid = all_keys >= 0
                all_keys, all_rows = all_keys[valid], all_rows[valid.to(dev)]
                order = torch.argsort(all_keys)
                ref_keys, ref_rows = all_keys[order], all_rows[order.to(dev)]
                if not self.student_mesh.is_last_stage(self.rank):
                    continue
                got = dstep.bridge_step.receive(i)[k]
                owner = dstep.bridge_step.owner(i).cpu()
                if (
                    self.args.inject_mismatch
                    and k == 0
                    and i == 0
                    and self.rank == max(self.student_mesh.ranks)
                ):
                    got = got.clone()  # compact rows: row 0 is teacher 0's first token
                    got[0, 0] += 1.0
                lay = micro_batch_layout(s_mbs[i], rows="logits", pg_collection=self.student_pg)
                keys_N = encode_keys(lay.sample_id_R, lay.position_R, stride)
                want_owner = torch.where(
                    keys_N >= 0, lay.sample_id_R % cfg.num_teachers, torch.full_like(keys_N, -1)
                )
                if k == 0 and not torch.equal(owner, want_owner):
                    problems.append(
                        f"micro-batch {i}: {int((owner != want_owner).sum())} rows have the wrong owner"
                    )
                mine = (want_owner == k).nonzero().reshape(-1)
                pos = torch.searchsorted(ref_keys, keys_N[mine]).clamp(
                    max=max(ref_keys.numel() - 1, 0)
                )
                if mine.numel() and not torch.equal(ref_keys[pos], keys_N[mine]):
                    problems.append(
                        f"teacher {k} micro-batch {i}: student keys missing from the reference"
                    )
                    continue
                if got.shape[0] != mine.numel():  # compact: one row per token of teacher k
                    problems.append(
                        f"teacher {k} micro-batch {i}: {got.shape[0]} rows arrived for "
                        f"{mine.numel()} tokens"
                    )
                    continue
                if not torch.equal(got, ref_rows[pos.to(dev)]):
                    diff = (got != ref_rows[pos.to(dev)]).any(dim=1).nonzero().reshape(-1)
                    first = int(mine[diff[0]])
                    problems.append(
                        f"teacher {k} micro-batch {i}: {diff.numel()} of {mine.numel()} rows differ "
                        f"from the reference (first: row {first}, sample "
                        f"{int(lay.sample_id_R[first])}, position {int(lay.position_R[first])})"
                    )
                checked += mine.numel()
        flag = torch.tensor([1 if problems else 0, checked], dtype=torch.int64, device=dev)
        dist.all_reduce(flag)
        for p in problems:
            print(f"verification: global rank {self.rank}: {p}", file=sys.stderr, flush=True)
        self.verified = {"ok": int(flag[0]) == 0, "rows": int(flag[1]), "bad_ranks": int(flag[0])}
        if self.rank == 0:
            if int(flag[0]) == 0:
                print(
                    f"verification: OK (step 1: {int(flag[1])} bridged rows on "
                    f"{len(self.student_mesh.last_stage_ranks())} student ranks, "
                    f"{cfg.micro_batches} micro-batches, bit-exact against the all-gather reference)",
                    file=self.out,
                    flush=True,
                )
            else:
                print(
                    f"verification: MISMATCH on {int(flag[0])} rank(s)", file=self.out, flush=True
                )
        return int(flag[0]) == 0

    # ---- printing ----------------------------------------------------------------------------

    def _print_meshes(self) -> None:
        cfg = self.cfg
        lines = [
            f"world: {self.world} ranks, backend {os.environ.get('MOPD_DEMO_BACKEND', 'gloo')}"
        ]
        for i, m in enumerate(self.teacher_meshes):
            lines.append(
                f"{m} hidden={cfg.teacher_hidden[i]} sp={'on' if self._sp(m.tp) else 'off'} "
                f"frozen; gets samples with id % {cfg.num_teachers} == {i}"
            )
        lines.append(
            f"{self.student_mesh} hidden={cfg.student_hidden} THD-packed, CP zigzag; "
            f"vocab={cfg.vocab} layers={cfg.layers} heads={cfg.heads}"
        )
        lines.append(
            f"step: {cfg.samples} prompts of {cfg.prompt_len} tokens (a domain tag, 1 + teacher, "
            f"then random ids); the student samples each response (temperature "
            f"{cfg.temperature:g}, stop token {STOP_TOKEN}, at most {cfg.max_new_tokens} tokens); "
            f"{cfg.micro_batches} micro-batches, megatron's "
            f"{'per-token' if cfg.per_token_loss else 'default'} loss path, Adam lr {cfg.lr:g}"
        )
        print("\n".join(f"  {x}" for x in lines), file=self.out, flush=True)

    def _report(self) -> None:
        import torch.distributed as dist

        cfg = self.cfg
        times = self.times.to(self.device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        links: list[Any] = [None] * self.world
        dist.all_gather_object(links, self.link_bytes)
        sampled: list[Any] = [None] * self.world
        dist.all_gather_object(sampled, self.sampled)
        if self.rank != 0:
            return
        link_bytes: dict[tuple[int, int, int], int] = {}
        for part in links:
            for key, n in part.items():
                link_bytes[key] = link_bytes.get(key, 0) + n
        # every sampling call's samples, from the replicas' first ranks: prompt + response
        calls: list[dict[int, list[int]]] = [{} for _ in range(1 + cfg.steps)]
        for part in sampled:
            for j, call in enumerate(part):
                calls[j].update({s: p + r for s, (p, r) in call.items()})
        heldout_tokens, rollouts = calls[0], calls[1:]
        ms = times.cpu() * 1e3
        tokens = sum(len(t) for step in rollouts for t in step.values())
        lengths = [[len(step[s]) - cfg.prompt_len for s in sorted(step)] for step in rollouts]
        stopped = sum(
            t[-1] == STOP_TOKEN and len(t) > cfg.prompt_len
            for step in rollouts
            for t in step.values()
        )
        heldout = self.heldout_kl.tolist()
        rollout_kl = self.rollout_kl.tolist()
        trends = {
            "rollout_kl": _trend([float(x) for x in self.losses]),
            "heldout_kl": [_trend(h) for h in heldout],
        }
        cross = sum(n for (o, s, d), n in link_bytes.items() if s != d)
        local = sum(n for (o, s, d), n in link_bytes.items() if s == d)
        masked, saved = self._masked_bytes(link_bytes, rollouts)
        result = {
            "config": cfg.as_dict(),
            "verification": self.verified,
            "rollouts": "student",
            "loss_per_step": [float(x) for x in self.losses],
            "rollout_kl": rollout_kl,
            "heldout_kl": heldout,
            "response_lengths": lengths,
            "stopped_responses": stopped,
            "rollout_digest": [_digest(step) for step in rollouts],
            "heldout_digest": _digest(heldout_tokens),
            "trends": trends,
            "phase_ms_max_over_ranks": {
                name: [float(ms[s, k]) for s in range(cfg.steps)] for k, name in enumerate(PHASES)
            },
            "bytes_sent": cross,
            "bytes_local": local,
            "masked_tokens": masked,
            "bytes_saved_by_mask": saved,
            "logits_bytes_instead": 4 * cfg.vocab * tokens,
            "links": [
                {"teacher": o, "src": s, "dst": d, "bytes": n}
                for (o, s, d), n in sorted(link_bytes.items())
            ],
        }
        ending = self._record(result)
        if self.args.json:
            print(json.dumps(result), flush=True)
            print("\n".join(ending), file=self.out, flush=True)
            return
        n = cfg.num_teachers
        time_head = ["step", *PHASES, "total"]
        time_rows = [
            [str(s + 1), *(f"{float(x):.1f}" for x in ms[s]), f"{float(ms[s].sum()):.1f}"]
            for s in range(cfg.steps)
        ]
        kl_head = ["step", "rollout KL (the loss)"]
        kl_head += [f"rollout t{k}" for k in range(n)] + [f"held-out t{k}" for k in range(n)]
        kl_rows = [
            [str(s + 1), f"{float(self.losses[s]):.6f}"]
            + [f"{rollout_kl[k][s]:.6f}" for k in range(n)]
            + [f"{heldout[k][s]:.6f}" for k in range(n)]
            for s in range(cfg.steps)
        ]
        out = ["  time per phase (ms, max over ranks):"]
        out += _table(time_head, time_rows)
        out.append("")
        out.append(
            "  reverse KL per response token of the student that samples the step (before its "
            "update):\n  rollout = on the step's fresh rollouts (all, then per teacher tk), "
            "held-out = on the fixed held-out set:"
        )
        out += _table(kl_head, kl_rows)
        flat = [n for step in lengths for n in step]
        out.append(
            f"  rollouts: {len(flat)} responses sampled by the student, {min(flat)}.."
            f"{max(flat)} tokens (mean {sum(flat) / len(flat):.1f}), {stopped} ended by the "
            "stop token"
        )
        out.append("")
        if self.args.links:
            out.append(
                f"  bytes per link (teacher rank -> student rank, from the plans, {cfg.steps} "
                "steps):"
            )
            for (owner, src, dst), nbytes in sorted(link_bytes.items()):
                kind = "local copy" if src == dst else "sent"
                out.append(f"    teacher{owner} r{src} -> r{dst}  {_human(nbytes):>10}  {kind}")
        out.append(
            f"  bytes over {len(link_bytes)} teacher-to-student links (--links lists them): "
            f"{_human(cross)} sent, {_human(local)} local copies (teacher logits instead: "
            f"{_human(4 * cfg.vocab * tokens)}, {tokens} tokens x {cfg.vocab} fp32)"
        )
        out.append(
            f"  prompt tokens (loss mask) not sent: {masked} tokens, {_human(saved)} saved "
            f"({100 * saved / max(saved + cross + local, 1):.0f}% of the unmasked traffic)"
        )
        out.append(f"  rollout KL: {trends['rollout_kl']}")
        for k in range(cfg.num_teachers):
            out.append(f"  held-out KL teacher {k}: {trends['heldout_kl'][k]}")
        print("\n".join(out + ending), file=self.out, flush=True)

    def _record(self, result: dict[str, Any]) -> list[str]:
        """Write the results JSON and the loss-curve PNG (rank 0); the run's last lines: where
        they went, then the verdict."""
        from pathlib import Path

        from mopd.profiling.demo_report import verdict, write
        from mopd.profiling.extras import can_draw
        from mopd.profiling.results import default_results_dir, environment

        out_dir = Path(self.args.results_dir) if self.args.results_dir else default_results_dir()
        json_path, png = write(
            result, out_dir=out_dir, env=environment(), draw=can_draw("mopd demo")
        )
        wrote = f"  results: {json_path}" + (f" and its loss curves {png.name}" if png else "")
        line = verdict(
            rows_ok=bool(self.verified.get("ok")),
            bad_ranks=int(self.verified.get("bad_ranks", 0)),
            heldout=result["heldout_kl"],
        )
        return [wrote, line]

    def _masked_bytes(
        self, link_bytes: dict[tuple[int, int, int], int], rollouts: list[dict[int, list[int]]]
    ) -> tuple[int, int]:
        """``(tokens, bytes)`` the loss mask kept off the bridge over the run: each teacher's
        moved bytes per counted token (every counted token moves once, from the plans) times
        the prompt tokens routed to it."""
        cfg = self.cfg
        counted = [0] * cfg.num_teachers
        masked = [0] * cfg.num_teachers
        for step in rollouts:
            for s, t in step.items():
                k = s % cfg.num_teachers
                prompt = min(cfg.prompt_len, len(t))
                masked[k] += prompt
                counted[k] += len(t) - prompt
        moved = [0] * cfg.num_teachers
        for (o, _s, _d), n in link_bytes.items():
            moved[o] += n
        saved = sum(moved[k] * masked[k] // max(counted[k], 1) for k in range(cfg.num_teachers))
        return sum(masked), saved


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Lines of a right-aligned text table under ``head``."""
    widths = [max(len(r[c]) for r in [head, *rows]) for c in range(len(head))]

    def fmt(r: Sequence[str]) -> str:
        return "    " + "  ".join(x.rjust(w) for x, w in zip(r, widths, strict=True))

    return [fmt(head), "    " + "-" * (sum(widths) + 2 * (len(widths) - 1)), *map(fmt, rows)]


def _trend(values: Sequence[float]) -> str:
    """What a per-step series did: first -> last, their ratio, and every step where it rose."""
    if len(values) == 1:  # one value is no trend
        return f"{values[0]:.4f} (one step)"
    first, last = values[0], values[-1]
    rose = [k + 1 for k in range(1, len(values)) if values[k] > values[k - 1]]
    if rose:  # step k (1-based) rose when its value is above step k - 1's
        what = f"rose at step{'s' if len(rose) > 1 else ''} {', '.join(map(str, rose))}"
    elif all(b < a for a, b in itertools.pairwise(values)):
        what = "fell every step"
    else:
        what = "never rose (flat at some step)"
    ratio = f"{last / first:.2f}x" if first > 0 else "n/a"
    return f"{first:.4f} -> {last:.4f} ({ratio}), {what}"


def _digest(tokens: dict[int, list[int]]) -> int:
    """CRC-32 of samples' token ids in sample-id order (rollouts compared across runs)."""
    crc = 0
    for s in sorted(tokens):
        crc = zlib.crc32(f"{s}:{tokens[s]};".encode(), crc)
    return crc


def _human(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    exp = min(int(math.log(n, 1024)), 3)
    return f"{n / 1024**exp:.1f} {['B', 'KiB', 'MiB', 'GiB'][exp]}"
