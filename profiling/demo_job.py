"""The ``mopd demo`` worker: one rank of the multi-teacher MOPD training job.

Why this file exists: :mod:`mopd.profiling.demo` parses the flags and starts torchrun; every rank
then runs :func:`worker` from here: build the teachers and the student on their own meshes,
reshard the teachers' LM heads once, and run the steps (capture, bridge, student forward, KL,
backward, optimizer), verifying step 1 against an all-gather reference and reporting per phase.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mopd.profiling.demo import PHASE_NAMES, DemoConfig
from mopd.profiling.megatron_groups import model_process_groups

if TYPE_CHECKING:
    import torch

__all__ = ["worker"]


def worker(args: argparse.Namespace, cfg: DemoConfig) -> int:
    import warnings

    import torch
    import torch.distributed as dist

    # megatron-core without TE/apex warns on import and on each deprecated c10d call it makes
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings(
        "ignore", message=r".*is deprecated\. Please use", category=FutureWarning
    )
    backend = os.environ.get("MOPD_DEMO_BACKEND", "gloo")
    sys.path.insert(0, os.environ["MOPD_CHECKOUT"])
    if backend == "gloo":
        from tests.support import megatron_cpu

        megatron_cpu.apply()
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend=backend,
        timeout=datetime.timedelta(seconds=max(60.0, args.timeout / 2)),
        **({"device_id": device} if backend == "nccl" else {}),
    )
    try:
        ok = _Job(cfg, args, device).run()
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


@dataclass(frozen=True, kw_only=True, eq=False)
class _Batch:
    """One step's global batch, identical on every rank.

    Attributes:
        sample_id_N: ``[N]`` int64 global sample ids.
        length_N: ``[N]`` int64 real lengths.
        tokens_NS: ``[N, S]`` int64 token ids (past ``length`` they are padding, never read as real).
    """

    sample_id_N: torch.Tensor
    length_N: torch.Tensor
    tokens_NS: torch.Tensor


def _split(items: list[int], parts: int, index: int) -> list[int]:
    """Contiguous near-equal split (``numpy.array_split`` semantics): part ``index`` of ``parts``."""
    q, r = divmod(len(items), parts)
    start = index * q + min(index, r)
    return items[start : start + q + (1 if index < r else 0)]


class _Job:
    """One rank's share of the demo (built collectively, then :meth:`run`)."""

    def __init__(self, cfg: DemoConfig, args: argparse.Namespace, device: torch.device) -> None:
        import torch.distributed as dist

        self.cfg, self.args, self.device = cfg, args, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timeout = datetime.timedelta(seconds=max(60.0, args.timeout / 2))
        self._captures: dict[int, Any] = {}

    # ---- set-up ------------------------------------------------------------------------------

    def _build(self) -> None:
        import torch
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        from mopd.bridge import (
            BridgeConfig,
            GroupPool,
            HiddenStateBridge,
            Mesh,
            TeacherSpec,
            VocabSpec,
            create_bridge_groups,
            reshard_lm_head,
        )
        from tests.support.cpu_attention import cpu_gpt_layer_spec

        cfg = self.cfg
        # Global parallel_state as plain data parallelism: only what still reads it (the global
        # memory buffer, the RNG tracker) sees it; every model runs on its own pg_collection.
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=1,
            create_gloo_process_groups=False,
            distributed_timeout_minutes=max(1, int(self.timeout.total_seconds() // 60)),
        )
        model_parallel_cuda_manual_seed(cfg.seed)
        self.teacher_meshes = [
            Mesh(tp=t.tp, dp=t.dp, rank_offset=t.at, name=f"teacher{i}")
            for i, t in enumerate(cfg.teachers)
        ]
        s = cfg.student
        self.student_mesh = Mesh(tp=s.tp, cp=s.cp, dp=s.dp, rank_offset=s.at, name="student")
        pool = GroupPool(timeout=self.timeout)
        teacher_pgs = [model_process_groups(m, pool) for m in self.teacher_meshes]
        student_pg = model_process_groups(self.student_mesh, pool)
        groups = create_bridge_groups(pool, self.teacher_meshes, self.student_mesh)
        self.pool = pool

        self.teachers: dict[int, Any] = {}
        for i, (mesh, pg) in enumerate(zip(self.teacher_meshes, teacher_pgs, strict=True)):
            if pg is None:
                continue
            torch.manual_seed(cfg.seed + 101 * (i + 1))
            tcfg = self._transformer_config(
                hidden=cfg.teacher_hidden[i],
                tp=mesh.tp,
                cp=1,
                sp=self._teacher_sp(mesh.tp),
                std=cfg.teacher_init_std,
            )
            model = GPTModel(
                config=tcfg,
                transformer_layer_spec=get_gpt_layer_local_spec(),
                vocab_size=cfg.vocab,
                max_sequence_length=cfg.seq_len,
                position_embedding_type="learned_absolute",
                pg_collection=pg,
            )
            model = model.to(self.device).eval().requires_grad_(False)
            self.teachers[i] = model
        self.student = None
        self.student_pg = student_pg
        if student_pg is not None:
            torch.manual_seed(cfg.seed)
            scfg = self._transformer_config(
                hidden=cfg.student_hidden, tp=s.tp, cp=s.cp, sp=False, std=0.02
            )
            self.student = GPTModel(
                config=scfg,
                transformer_layer_spec=cpu_gpt_layer_spec(),
                vocab_size=cfg.vocab,
                max_sequence_length=cfg.seq_len,
                position_embedding_type="learned_absolute",
                pg_collection=student_pg,
            ).to(self.device)
            self.optimizer = torch.optim.Adam(self.student.parameters(), lr=cfg.lr)

        # the teachers' LM heads, resharded once into the student's vocab partition
        self.lm_heads: list[torch.Tensor] = []
        vocab = VocabSpec(vocab_size=cfg.vocab, teacher_padded=cfg.vocab, student_padded=cfg.vocab)
        for i, mesh in enumerate(self.teacher_meshes):
            weight = (
                self.teachers[i].output_layer.weight.detach().contiguous()
                if i in self.teachers
                else None
            )
            shard = reshard_lm_head(
                weight,
                teacher=mesh,
                student=self.student_mesh,
                vocab=vocab,
                hidden_size=cfg.teacher_hidden[i],
                groups=groups,
                timeout_s=self.timeout.total_seconds(),
            )
            if shard is not None:
                self.lm_heads.append(shard.weight_VH)
                self.vocab_start = shard.vocab_start
        self.bridge = HiddenStateBridge(
            teachers=[
                TeacherSpec(mesh=m, hidden_size=h)
                for m, h in zip(self.teacher_meshes, cfg.teacher_hidden, strict=True)
            ],
            student=self.student_mesh,
            groups=groups,
            config=BridgeConfig(timeout_s=self.timeout.total_seconds()),
        )
        self.student_tp_group = student_pg.tp if student_pg is not None else None
        self.student_dp_cp_group = student_pg.dp_cp if student_pg is not None else None

    def _teacher_sp(self, tp: int) -> bool:
        """Sequence parallelism on a teacher: with TP, where the norm supports it.

        On CPU the test-support patch makes torch's LayerNorm SP-safe; on GPUs megatron's local
        spec needs apex's fused norm for SP (its torch norm asserts), so without apex SP is off.
        """
        if tp == 1:
            return False
        if self.device.type == "cpu":
            return True
        from megatron.core.models.gpt import gpt_layer_specs

        return bool(getattr(gpt_layer_specs, "HAVE_APEX", False))

    def _transformer_config(self, *, hidden: int, tp: int, cp: int, sp: bool, std: float) -> Any:
        import torch
        from megatron.core.transformer.transformer_config import TransformerConfig

        return TransformerConfig(
            num_layers=self.cfg.layers,
            hidden_size=hidden,
            num_attention_heads=self.cfg.heads,
            tensor_model_parallel_size=tp,
            context_parallel_size=cp,
            sequence_parallel=sp,
            use_cpu_initialization=True,
            params_dtype=torch.float32,
            init_method_std=std,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            bias_dropout_fusion=False,
            gradient_accumulation_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            apply_rope_fusion=False,
        )

    # ---- data --------------------------------------------------------------------------------

    def _batch(self, step: int) -> _Batch:
        import torch

        cfg = self.cfg
        g = torch.Generator().manual_seed(cfg.seed * 7919 + step)
        ids = torch.arange(step * cfg.samples, (step + 1) * cfg.samples, dtype=torch.int64)
        lengths = torch.randint(cfg.min_len, cfg.seq_len + 1, (cfg.samples,), generator=g)
        tokens = torch.randint(0, cfg.vocab, (cfg.samples, cfg.seq_len), generator=g)
        return _Batch(sample_id_N=ids, length_N=lengths, tokens_NS=tokens)

    def _teacher_samples(self, i: int, dp_rank: int) -> list[int]:
        """Indices into the batch of the samples teacher ``i``'s DP rank ``dp_rank`` runs."""
        # ids are step * samples + index and samples % num_teachers == 0: id % T == index % T
        mine = list(range(i, self.cfg.samples, self.cfg.num_teachers))
        return _split(mine, self.teacher_meshes[i].dp, dp_rank)

    def _student_samples(self, dp_rank: int) -> list[int]:
        return _split(list(range(self.cfg.samples)), self.student_mesh.dp, dp_rank)

    # ---- one step ----------------------------------------------------------------------------

    def _sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self) -> bool:
        import torch
        import torch.distributed as dist

        from mopd.profiling import ranges

        for phase in ("loss", "optimizer", "grad_sync", "verify"):
            ranges.register_phase(phase)
        cfg = self.cfg
        t0 = time.perf_counter()
        self._build()
        setup_s = time.perf_counter() - t0
        if self.rank == 0:
            self._print_meshes(setup_s)
        self.times = torch.zeros(cfg.steps, len(PHASE_NAMES), dtype=torch.float64)
        self.losses = torch.zeros(cfg.steps, dtype=torch.float64)
        self.link_bytes: dict[tuple[int, int, int], int] = {}
        profiler = None
        if self.args.trace:
            ranges.enable()
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            profiler = torch.profiler.profile(activities=activities)
            profiler.__enter__()
        bar = None
        if self.rank == 0:
            from tqdm import tqdm

            bar = tqdm(
                total=cfg.steps, desc="mopd demo", unit="step", file=sys.stderr, dynamic_ncols=True
            )
        ok = True
        try:
            for step in range(cfg.steps):
                with ranges.span("step", step):
                    ok = self._step(step)
                if not ok:
                    break
                if bar is not None:
                    bar.set_postfix(loss=f"{float(self.losses[step]):.4f}")
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            if profiler is not None:
                profiler.__exit__(None, None, None)
                os.makedirs(self.args.trace, exist_ok=True)
                path = os.path.join(self.args.trace, f"trace_rank{self.rank}.json")
                profiler.export_chrome_trace(path)
        if ok:
            self._report()
        if profiler is not None and self.rank == 0:
            print(f"traces: {self.args.trace}/trace_rank<r>.json ({self.world} ranks)", flush=True)
        from megatron.core import parallel_state

        dist.barrier()
        parallel_state.destroy_model_parallel()
        return ok

    def _step(self, step: int) -> bool:
        import torch
        import torch.distributed as dist
        from megatron.core.packed_seq_params import PackedSeqParams

        from mopd.bridge import packed_layout, padded_layout
        from mopd.kernels.kl import vocab_parallel_kl
        from mopd.profiling import ranges
        from tests.support.cpu_attention import packed_rows

        cfg, dev = self.cfg, self.device
        batch = self._batch(step)
        times = self.times[step]

        # teacher forward under the capture
        t = time.perf_counter()
        hidden: dict[int, torch.Tensor] = {}
        layouts: dict[int, Any] = {}
        for i, model in self.teachers.items():
            coord = self.teacher_meshes[i].coord(self.rank)
            assert coord is not None
            idx = self._teacher_samples(i, coord.dp_rank)
            tokens_BS = batch.tokens_NS[idx].to(dev)
            pos_BS = torch.arange(cfg.seq_len, device=dev).expand(len(idx), -1)
            capture = self._capture(i, model)
            with ranges.span("forward", f"teacher{i}"), torch.no_grad(), capture.capture_context():
                model(tokens_BS, pos_BS, None)
            with ranges.span("capture", i):
                hidden_SBH = capture.get_hidden_states()
            assert hidden_SBH is not None and hidden_SBH.shape[:2] == (cfg.seq_len, len(idx))
            hidden[i] = hidden_SBH.contiguous()
            layouts[i] = padded_layout(
                batch.sample_id_N[idx], cfg.seq_len, order="sbh", lengths=batch.length_N[idx]
            )
        self._sync()
        times[0] = time.perf_counter() - t

        # the student's packed CP layout and inputs
        s_coord = self.student_mesh.coord(self.rank)
        student_layout = None
        if s_coord is not None:
            idx = self._student_samples(s_coord.dp_rank)
            ids, lens = batch.sample_id_N[idx], batch.length_N[idx]
            # pad each sequence so that every CP rank holds whole zigzag chunks and its rows
            # split into student-TP equal slices (the bridge's TP split)
            cp, tp = self.student_mesh.cp, self.student_mesh.tp
            mult = (2 * cp if cp > 1 else 1) * tp
            cu = torch.zeros(len(idx) + 1, dtype=torch.int64)
            cu[1:] = torch.cumsum((lens + mult - 1) // mult * mult, 0)
            student_layout = packed_layout(
                ids,
                lens,
                cu_seqlens_padded=cu,
                cp_size=self.student_mesh.cp,
                cp_rank=s_coord.cp_rank,
            )
            seq_T, pos_T = packed_rows(cu, self.student_mesh.cp, s_coord.cp_rank)
            # our invariant: the attention's row order is the bridge layout's row order
            real_T = pos_T < lens[seq_T]
            assert torch.equal(torch.where(real_T, ids[seq_T], -1), student_layout.sample_id_R)
            assert torch.equal(torch.where(real_T, pos_T, -1), student_layout.position_R)
            tokens_1T = batch.tokens_NS[torch.tensor(idx)[seq_T], pos_T][None].to(dev)
            pos_1T = pos_T[None].to(dev)
            cu_real = torch.zeros_like(cu)
            cu_real[1:] = torch.cumsum(lens, 0)
            psp = PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=cu_real.to(torch.int32).to(dev),
                cu_seqlens_kv=cu_real.to(torch.int32).to(dev),
                cu_seqlens_q_padded=cu.to(torch.int32).to(dev),
                cu_seqlens_kv_padded=cu.to(torch.int32).to(dev),
                max_seqlen_q=int((cu[1:] - cu[:-1]).max()),
                max_seqlen_kv=int((cu[1:] - cu[:-1]).max()),
            )

        # bridge (the transfer overlaps the student forward unless --no-overlap)
        t = time.perf_counter()
        with ranges.span("plan"):
            prepared = self.bridge.prepare(
                hidden=hidden, layouts=layouts, student_layout=student_layout
            )
        handle = self.bridge.start(prepared)
        self._count_links(prepared.plan)
        bridge_s = time.perf_counter() - t
        logits = None
        if not cfg.overlap:
            t = time.perf_counter()
            with ranges.span("wait"):
                handle.wait()
            self._sync()
            bridge_s += time.perf_counter() - t
        if self.student is not None:
            t = time.perf_counter()
            with ranges.span("forward", "student"):
                logits = self.student(tokens_1T, pos_1T, None, packed_seq_params=psp)
            self._sync()
            times[2] = time.perf_counter() - t
        t = time.perf_counter()
        with ranges.span("wait"):
            outputs = handle.wait()
        self._sync()
        times[1] = bridge_s + time.perf_counter() - t

        if step == 0:
            if (
                self.args.inject_mismatch
                and s_coord is not None
                and self.rank == max(self.student_mesh.ranks)
            ):
                owner = prepared.owner_N
                assert owner is not None
                row = int(torch.nonzero(owner == 0)[0])
                outputs[0][row, 0] += 1.0
            with ranges.span("verify"):
                ok = self._verify(batch, hidden, layouts, student_layout, prepared.owner_N, outputs)
            if not ok:
                return False

        loss_value = torch.zeros((), dtype=torch.float64)
        if self.student is not None:
            assert logits is not None and prepared.owner_N is not None
            owner_T = prepared.owner_N.to(dev)
            logits_TV = logits.reshape(-1, logits.shape[-1])
            total_tokens = int(batch.length_N.sum())
            t = time.perf_counter()
            with ranges.span("loss"):
                loss = vocab_parallel_kl(
                    logits_TV,
                    [outputs[i] for i in range(cfg.num_teachers)],
                    self.lm_heads,
                    vocab_start=self.vocab_start,
                    vocab_size=cfg.vocab,
                    teacher_index_T=owner_T.clamp(min=0),
                    loss_mask_T=(owner_T >= 0).to(torch.float32) / total_tokens,
                    group=self.student_tp_group,
                )
            self._sync()
            times[3] = time.perf_counter() - t
            t = time.perf_counter()
            with ranges.span("backward"):
                loss.backward()
            self._sync()
            times[4] = time.perf_counter() - t
            t = time.perf_counter()
            with ranges.span("grad_sync"):
                self._all_reduce_grads()
            self._sync()
            times[5] = time.perf_counter() - t
            t = time.perf_counter()
            with ranges.span("optimizer"):
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            self._sync()
            times[6] = time.perf_counter() - t
            assert s_coord is not None
            if s_coord.tp_rank == 0:  # the loss is replicated over TP; one rank per token shard
                loss_value = loss.detach().to(torch.float64).cpu()
        # the global mean KL per token: every token shard's sum, once
        total = loss_value.reshape(1).to(dev)
        dist.all_reduce(total)
        self.losses[step] = float(total)
        return True

    def _capture(self, i: int, model: Any) -> Any:
        from mopd.capture import OutputLayerInputCapture

        if i not in self._captures:
            self._captures[i] = OutputLayerInputCapture(model)
        return self._captures[i]

    def _all_reduce_grads(self) -> None:
        """Sum the student's gradients over its DP x CP ranks (the loss is already / global tokens)."""
        import torch
        import torch.distributed as dist

        assert self.student is not None
        if self.student_dp_cp_group is None or dist.get_world_size(self.student_dp_cp_group) == 1:
            return
        grads = [p.grad for p in self.student.parameters() if p.grad is not None]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.student_dp_cp_group)
        for g, synced in zip(
            grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True
        ):
            g.copy_(synced)

    def _count_links(self, plan: Any) -> None:
        t = plan.transfers_T5
        for owner, src, dst, _, count in t.tolist():
            key = (owner, src, dst)
            self.link_bytes[key] = self.link_bytes.get(key, 0) + count * plan.row_bytes[owner]

    # ---- verification ------------------------------------------------------------------------

    def _verify(
        self,
        batch: _Batch,
        hidden: dict[int, torch.Tensor],
        layouts: dict[int, Any],
        student_layout: Any,
        owner_N: torch.Tensor | None,
        outputs: dict[int, torch.Tensor],
    ) -> bool:
        """Every student rank checks its bridged rows against an all-gather reference (bit-exact).

        Reference: each teacher's captured ``[S, B, H]`` (from its TP rank 0 of every DP shard),
        all-gathered to every rank with the key of every row; the student's rows are joined to
        it by key. Checked: owner of each row (``sample_id % num_teachers``, ``-1`` for padding),
        each owned row equal to the reference row, rows of other teachers zero.
        """
        import torch
        import torch.distributed as dist

        from mopd.bridge import encode_keys

        cfg, dev = self.cfg, self.device
        stride = cfg.seq_len
        problems: list[str] = []
        max_b = [
            max(len(self._teacher_samples(i, d)) for d in range(m.dp))
            for i, m in enumerate(self.teacher_meshes)
        ]
        refs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, mesh in enumerate(self.teacher_meshes):
            cap = cfg.seq_len * max_b[i]
            h = cfg.teacher_hidden[i]
            rows_RH = torch.zeros(cap, h, dtype=torch.float32, device=dev)
            keys_R = torch.full((cap,), -1, dtype=torch.int64, device=dev)
            coord = mesh.coord(self.rank)
            if i in hidden and coord is not None and coord.tp_rank == 0:
                flat = hidden[i].reshape(-1, h)
                rows_RH[: flat.shape[0]] = flat
                lay = layouts[i]
                keys_R[: flat.shape[0]] = encode_keys(lay.sample_id_R, lay.position_R, stride).to(
                    dev
                )
            all_rows = [torch.empty_like(rows_RH) for _ in range(self.world)]
            all_keys = [torch.empty_like(keys_R) for _ in range(self.world)]
            dist.all_gather(all_rows, rows_RH)
            dist.all_gather(all_keys, keys_R)
            keys = torch.cat(all_keys).cpu()
            rows = torch.cat(all_rows)
            valid = keys >= 0
            keys, rows = keys[valid], rows[valid.to(dev)]
            order = torch.argsort(keys)
            refs.append((keys[order], rows[order.to(dev)]))
        checked = 0
        if student_layout is not None:
            assert owner_N is not None
            keys_N = encode_keys(student_layout.sample_id_R, student_layout.position_R, stride)
            want_owner = torch.where(
                keys_N >= 0,
                student_layout.sample_id_R % cfg.num_teachers,
                torch.full_like(keys_N, -1),
            )
            if not torch.equal(owner_N.cpu(), want_owner):
                bad = int((owner_N.cpu() != want_owner).sum())
                problems.append(f"{bad} rows have the wrong owner teacher")
            for i in range(cfg.num_teachers):
                out = outputs[i]
                mine = (want_owner == i).nonzero().reshape(-1)
                ref_keys, ref_rows = refs[i]
                pos = torch.searchsorted(ref_keys, keys_N[mine]).clamp(
                    max=max(ref_keys.numel() - 1, 0)
                )
                found = ref_keys.numel() > 0 and torch.equal(ref_keys[pos], keys_N[mine])
                if not found:
                    problems.append(
                        f"teacher {i}: some student keys are missing from the reference"
                    )
                    continue
                got = out[mine.to(dev)]
                want = ref_rows[pos.to(dev)]
                if not torch.equal(got, want):
                    diff = (got != want).any(dim=1).nonzero().reshape(-1)
                    first = int(mine[diff[0]])
                    problems.append(
                        f"teacher {i}: {diff.numel()} of {mine.numel()} rows differ from the reference "
                        f"(first: row {first}, sample {int(student_layout.sample_id_R[first])}, "
                        f"position {int(student_layout.position_R[first])})"
                    )
                others = (want_owner != i).nonzero().reshape(-1).to(dev)
                if bool((out[others] != 0).any()):
                    problems.append(
                        f"teacher {i}: rows owned by no teacher or another teacher are not zero"
                    )
                checked += mine.numel()
        flag = torch.tensor([1 if problems else 0, checked], dtype=torch.int64, device=dev)
        dist.all_reduce(flag)
        for p in problems:
            print(f"verification: global rank {self.rank}: {p}", file=sys.stderr, flush=True)
        if self.rank == 0:
            if int(flag[0]) == 0:
                print(
                    f"verification: OK (step 1: {int(flag[1])} bridged rows on "
                    f"{self.student_mesh.size} student ranks bit-exact against the all-gather reference)",
                    flush=True,
                )
            else:
                print(f"verification: MISMATCH on {int(flag[0])} rank(s)", flush=True)
        return int(flag[0]) == 0

    # ---- printing ----------------------------------------------------------------------------

    def _print_meshes(self, setup_s: float) -> None:
        cfg = self.cfg
        lines = [
            f"world: {self.world} ranks, backend {os.environ.get('MOPD_DEMO_BACKEND', 'gloo')}"
        ]
        for i, m in enumerate(self.teacher_meshes):
            lines.append(
                f"{m} hidden={cfg.teacher_hidden[i]} sp={'on' if self._teacher_sp(m.tp) else 'off'} "
                f"frozen; gets samples with id % {cfg.num_teachers} == {i}"
            )
        lines.append(
            f"{self.student_mesh} hidden={cfg.student_hidden} THD-packed, CP zigzag; "
            f"vocab={cfg.vocab} layers={cfg.layers} heads={cfg.heads}"
        )
        lines.append(
            f"batch: {cfg.samples} samples/step, lengths {cfg.min_len}..{cfg.seq_len}; set-up {setup_s:.1f} s"
        )
        print("\n".join(f"  {x}" for x in lines), flush=True)

    def _report(self) -> None:
        import torch.distributed as dist

        cfg = self.cfg
        times = self.times.to(self.device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        if self.rank != 0:
            return
        times = times.cpu() * 1e3
        head = ["phase (ms, max over ranks)"] + [f"step {s + 1}" for s in range(cfg.steps)]
        rows = [
            [name] + [f"{float(times[s, k]):.1f}" for s in range(cfg.steps)]
            for k, name in enumerate(PHASE_NAMES)
        ]
        rows.append(["total"] + [f"{float(times[s].sum()):.1f}" for s in range(cfg.steps)])
        rows.append(["loss (reverse KL / token)"] + [f"{float(x):.6f}" for x in self.losses])
        widths = [max(len(r[c]) for r in [head, *rows]) for c in range(len(head))]

        def fmt(r: Sequence[str]) -> str:
            return (
                "  "
                + r[0].ljust(widths[0])
                + "".join(f"  {x.rjust(w)}" for x, w in zip(r[1:], widths[1:], strict=True))
            )

        out = [fmt(head), "  " + "-" * (sum(widths) + 2 * (len(widths) - 1))]
        out += [fmt(r) for r in rows]
        out.append("")
        out.append(
            f"  bytes per link (teacher rank -> student rank, from the plans, {cfg.steps} steps):"
        )
        cross = local = 0
        for (owner, src, dst), nbytes in sorted(self.link_bytes.items()):
            kind = "local copy" if src == dst else "sent"
            if src == dst:
                local += nbytes
            else:
                cross += nbytes
            out.append(f"    teacher{owner} r{src} -> r{dst}  {_human(nbytes):>10}  {kind}")
        tokens = sum(int(self._batch(k).length_N.sum()) for k in range(cfg.steps))
        logits_bytes = 4 * cfg.vocab * tokens
        out.append(
            f"  total: {_human(cross)} sent, {_human(local)} local copies "
            f"(teacher logits instead: {_human(logits_bytes)}, {tokens} tokens x {cfg.vocab} fp32)"
        )
        first, last = float(self.losses[0]), float(self.losses[-1])
        trend = "decreasing" if last < first else "not decreasing"
        out.append(f"  loss: {first:.6f} -> {last:.6f} ({trend})")
        print("\n".join(out), flush=True)


def _human(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    exp = min(int(math.log(n, 1024)), 3)
    return f"{n / 1024**exp:.1f} {['B', 'KiB', 'MiB', 'GiB'][exp]}"
