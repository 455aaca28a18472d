"""What ``mopd demo`` leaves behind: its one-line verdict, its results file and its loss curves.

Why this file exists: a run should end in one line that says whether it worked, and leave its
figures where a reader can open them. :func:`verdict` is that line (the rows bridged exactly,
and whether every teacher's held-out KL fell); :func:`write` records the run's results as JSON
with the machine and versions, and beside it :func:`plot_kl`'s picture of the rollout and
held-out KL per teacher per step. Rank 0 of the demo (:mod:`mopd.profiling.demo.job`) calls them
once the run is over.
"""

from __future__ import annotations

import itertools
import json
import os
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass


from collections.abc import Mapping
from pathlib import Path

from mopd.common.units import human_bytes
from mopd.profiling.demo.config import PHASES, STOP_TOKEN

__all__ = ["ReportMixin", "plot_kl", "verdict", "write"]


def verdict(*, rows_ok: bool, bad_ranks: int, heldout: Sequence[Sequence[float]]) -> str:
    """The demo's last line.

    Args:
        rows_ok: step 1's bridged rows equal the all-gather reference on every student rank.
        bad_ranks: how many ranks found a mismatch (when not ``rows_ok``).
        heldout: per teacher, the held-out KL per step.
    """
    if not rows_ok:
        return (
            f"mopd demo: FAILED - bridged rows differ from the all-gather reference on "
            f"{bad_ranks} rank{'s' if bad_ranks != 1 else ''}"
        )
    if min(len(h) for h in heldout) < 2:
        return "mopd demo: OK - rows exact; one step, so no held-out trend to judge"
    ratios = [h[-1] / h[0] if h[0] > 0 else float("nan") for h in heldout]
    shown = " / ".join(f"{r:.2f}x" for r in ratios)
    learned = all(r < 1 for r in ratios)
    what = "student learned" if learned else "student did not learn"
    return f"mopd demo: OK - rows exact, {what}: held-out KL {shown}"


def plot_kl(
    *, rollout: Sequence[Sequence[float]], heldout: Sequence[Sequence[float]], png: Path
) -> Path:
    """One picture: per teacher, the rollout KL (solid) and the held-out KL (dashed) per step.

    ``rollout`` and ``heldout``: per teacher, one value per step (reverse KL per response token
    of the student that samples the step, before its update).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7.0, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    for k, (r, h) in enumerate(zip(rollout, heldout, strict=True)):
        steps = range(1, len(r) + 1)
        color = colors[k % len(colors)]
        ax.plot(steps, r, "-o", color=color, markersize=3, label=f"teacher {k}: rollouts")
        ax.plot(steps, h, "--s", color=color, markersize=3, label=f"teacher {k}: held-out set")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("reverse KL per response token")
    ax.set_title("mopd demo: the student's KL to each teacher")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    return png


def write(
    result: Mapping[str, Any], *, out_dir: Path, env: Mapping[str, str], draw: bool
) -> tuple[Path, Path | None]:
    """Write ``demo-<machine>-<date>.json`` (``result`` and ``env``) into ``out_dir`` and, with
    ``draw``, the :func:`plot_kl` picture beside it as ``.png``; returns both paths."""
    machine = env.get("gpu", "cpu")
    machine = "cpu" if machine.startswith("none") else machine.replace(" ", "_").lower()
    stem = f"demo-{machine}-{env['date'][:10]}"
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps({**result, "environment": dict(env)}, indent=1) + "\n")
    png = None
    if draw:
        png = plot_kl(
            rollout=result["rollout_kl"],
            heldout=result["heldout_kl"],
            png=json_path.with_suffix(".png"),
        )
    return json_path, png


class ReportMixin:
    """The report part of the demo's job: the meshes it prints, its closing report, the results
    it records (:class:`mopd.profiling.demo.job._Job` holds what they read)."""

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
                out.append(
                    f"    teacher{owner} r{src} -> r{dst}  {human_bytes(nbytes, decimals=1):>10}  {kind}"
                )
        out.append(
            f"  bytes over {len(link_bytes)} teacher-to-student links (--links lists them): "
            f"{human_bytes(cross, decimals=1)} sent, {human_bytes(local, decimals=1)} local copies (teacher logits instead: "
            f"{human_bytes(4 * cfg.vocab * tokens, decimals=1)}, {tokens} tokens x {cfg.vocab} fp32)"
        )
        out.append(
            f"  prompt tokens (loss mask) not sent: {masked} tokens, {human_bytes(saved, decimals=1)} saved "
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

        from mopd.profiling.demo.report import verdict, write
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
