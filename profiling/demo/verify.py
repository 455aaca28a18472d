"""The demo's checks of a step: every rank's received rows against the teacher's own.

Why this file exists: the demo proves the bridge exact on the run a newcomer watches, so after a
step each student rank compares the rows it received with the teacher's rows recomputed for its
tokens, and every rank learns the verdict. :class:`VerifyMixin` is that part of the demo's job.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


__all__ = ["VerifyMixin"]


class VerifyMixin:
    """The verify part of the demo's job (:class:`mopd.profiling.demo.job._Job` holds the
    models, the meshes and the step it checks)."""

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
