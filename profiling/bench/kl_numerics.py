"""How accurate the full-vocabulary KL is with bf16 inputs: errors against float64, beside peers.

Why this file exists: a loss in bf16 can be as accurate as its inputs allow or much worse,
depending on where it rounds (the teacher logits rounded to bf16 cost 3-13% of the gradient in
the distillation regime). ``mopd bench kl`` measures both speed (GPU) and this numerics half
(any device): inputs in the distillation regime, a float64 reference computed from the *same*
bf16 inputs (its own, so that the library ships no test oracle), the peers, the error table and
its plot.

The regime: teacher hidden states ``h_t ~ N(0, 1)`` (bf16), LM-head rows scaled so the teacher
logits have standard deviation ``logit_std``; the logits path's student logits are the exact
teacher logits plus ``N(0, noise_std^2)``, rounded to bf16; the fused path's student has the
teacher's LM head and hidden states ``h_t + N(0, (noise_std / logit_std)^2)`` (so again logits
``~ noise_std`` from the teacher's), in bf16. Errors are relative: ``|L - L_ref| / |L_ref|`` for
the loss (summed over tokens) and ``||g - g_ref|| / ||g_ref||`` (Frobenius) for each gradient.

Methods: ``ours`` (:func:`mopd.kernels.kl.vocab_parallel_kl` /
:func:`~mopd.kernels.kl.fused_vocab_parallel_kl`, default config), ``torch bf16`` (logits in
bf16 from bf16 matmuls, ``log_softmax`` in fp32, autograd: what a plain implementation does) and,
on a GPU where it imports, Liger-Kernel's ``LigerFusedLinearJSDLoss`` (fused path; beta 1 is the
reverse KL, 0 the forward KL; it has no mixed KL).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "KINDS",
    "NumericsInputs",
    "NumericsSetup",
    "make_inputs",
    "method_names",
    "plot_errors",
    "reference_kl",
    "relative_error",
    "run_numerics",
]

KINDS: tuple[str, ...] = ("reverse", "forward", "mixed")
MIX_WEIGHT = 0.5  # the reverse KL's weight in "mixed"
_BLOCK_ROWS = 16384  # vocab rows per float64 block of the reference matmuls

Row = dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class NumericsSetup:
    """One point of the sweep.

    Attributes:
        tokens: ``T``.
        hidden: ``H`` (teacher and student).
        vocab: ``V``.
        logit_std: standard deviation of the teacher logits.
        noise_std: standard deviation of the student's logits around the teacher's.
        seed: of the generator the inputs come from.
    """

    tokens: int
    hidden: int
    vocab: int
    logit_std: float
    noise_std: float = 0.25
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("tokens", "hidden", "vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("logit_std", "noise_std"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")


@dataclass(frozen=True)
class NumericsInputs:
    """bf16 inputs of one setup (shapes in the names)."""

    teacher_hidden_TH: torch.Tensor
    teacher_weight_VH: torch.Tensor
    student_logits_TV: torch.Tensor  # the logits path's student
    student_hidden_TH: torch.Tensor  # the fused path's student (its LM head is the teacher's)

    @property
    def student_weight_VH(self) -> torch.Tensor:
        return self.teacher_weight_VH


def _logits_f64(hidden_TH: torch.Tensor, weight_VH: torch.Tensor) -> torch.Tensor:
    """``[T, V]`` float64 ``hidden_TH @ weight_VH.T``, the weight converted a block at a time."""
    h64 = hidden_TH.double()
    out_TV = torch.empty(
        (hidden_TH.shape[0], weight_VH.shape[0]), dtype=torch.float64, device=hidden_TH.device
    )
    for v0 in range(0, weight_VH.shape[0], _BLOCK_ROWS):
        blk = weight_VH[v0 : v0 + _BLOCK_ROWS].double()
        torch.mm(h64, blk.T, out=out_TV[:, v0 : v0 + blk.shape[0]])
    return out_TV


def _mm_f64_left(g_TV: torch.Tensor, weight_VH: torch.Tensor) -> torch.Tensor:
    """``[T, H]`` float64 ``g_TV @ weight_VH`` (``g_TV`` float64), the weight in blocks."""
    out_TH = torch.zeros(
        (g_TV.shape[0], weight_VH.shape[1]), dtype=torch.float64, device=g_TV.device
    )
    for v0 in range(0, weight_VH.shape[0], _BLOCK_ROWS):
        blk = weight_VH[v0 : v0 + _BLOCK_ROWS].double()
        out_TH.addmm_(g_TV[:, v0 : v0 + blk.shape[0]], blk)
    return out_TH


def make_inputs(setup: NumericsSetup, device: torch.device) -> NumericsInputs:
    """The bf16 inputs of ``setup`` (see the module docstring for the regime)."""
    g = torch.Generator(device=device).manual_seed(setup.seed)
    T, H, V = setup.tokens, setup.hidden, setup.vocab

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device)

    h_t = randn(T, H).bfloat16()
    w_t = (randn(V, H) * (setup.logit_std / H**0.5)).bfloat16()
    u64_TV = _logits_f64(h_t, w_t)
    s_TV = (u64_TV + setup.noise_std * randn(T, V).double()).bfloat16()
    del u64_TV
    h_s = (h_t.float() + (setup.noise_std / setup.logit_std) * randn(T, H)).bfloat16()
    return NumericsInputs(h_t, w_t, s_TV, h_s)


def reference_kl(
    s_TV: torch.Tensor, u_TV: torch.Tensor, kind: str, mix_weight: float = MIX_WEIGHT
) -> tuple[float, torch.Tensor]:
    """The KL summed over tokens and its gradient with respect to the student logits, in float64.

    Args:
        s_TV: ``[T, V]`` student logits (float64 for a float64 result).
        u_TV: ``[T, V]`` teacher logits.
        kind: ``"reverse"`` (KL(p_S || p_T)), ``"forward"`` or ``"mixed"``.
        mix_weight: the reverse KL's weight in ``"mixed"``.
    Returns:
        ``(loss, grad_TV)``: analytic gradients, reverse ``p_S (r - E_pS[r])`` with
        ``r = log p_S - log p_T``, forward ``p_S - p_T``.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    log_ps = torch.log_softmax(s_TV, dim=1)
    log_pt = torch.log_softmax(u_TV, dim=1)
    ps, pt = log_ps.exp(), log_pt.exp()
    r_TV = log_ps - log_pt
    w_r = {"reverse": 1.0, "forward": 0.0, "mixed": mix_weight}[kind]
    loss = torch.zeros((), dtype=s_TV.dtype, device=s_TV.device)
    grad_TV = torch.zeros_like(s_TV)
    if w_r:
        rev_T = (ps * r_TV).sum(1)
        loss = loss + w_r * rev_T.sum()
        grad_TV += w_r * ps * (r_TV - rev_T[:, None])
    if w_r != 1.0:
        loss = loss + (1.0 - w_r) * (pt * -r_TV).sum()
        grad_TV += (1.0 - w_r) * (ps - pt)
    return float(loss), grad_TV


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` (Frobenius, float64)."""
    want64 = want.double()
    return float((got.double() - want64).norm() / want64.norm().clamp_min(1e-300))


# ---- the methods: each returns (loss, grads) for one input, kind and path -----------------------

Result = tuple[float, tuple[torch.Tensor, ...]]
Method = Callable[[NumericsInputs, str, bool], Result]


def _ours(x: NumericsInputs, kind: str, fused: bool) -> Result:
    from mopd.kernels.kl import KLConfig, fused_vocab_parallel_kl, vocab_parallel_kl

    cfg = KLConfig(kind=kind, mix_weight=MIX_WEIGHT if kind == "mixed" else None)  # type: ignore[arg-type]
    V = x.teacher_weight_VH.shape[0]
    if fused:
        h = x.student_hidden_TH.clone().requires_grad_(True)
        w = x.student_weight_VH.clone().requires_grad_(True)
        loss = fused_vocab_parallel_kl(
            h, w, x.teacher_hidden_TH, x.teacher_weight_VH, vocab_start=0, vocab_size=V,
            config=cfg,
        )  # fmt: skip
        grads = torch.autograd.grad(loss, (h, w))
    else:
        s = x.student_logits_TV.clone().requires_grad_(True)
        loss = vocab_parallel_kl(
            s, x.teacher_hidden_TH, x.teacher_weight_VH, vocab_start=0, vocab_size=V, config=cfg
        )
        grads = torch.autograd.grad(loss, (s,))
    return float(loss.detach()), tuple(grads)


def _torch_kl_sum(s_TV: torch.Tensor, u_TV: torch.Tensor, kind: str) -> torch.Tensor:
    """Plain torch: the KL of ``[T, V]`` fp32 logits, summed over tokens."""
    log_ps = torch.log_softmax(s_TV, dim=-1)
    log_pt = torch.log_softmax(u_TV, dim=-1)
    w_r = {"reverse": 1.0, "forward": 0.0, "mixed": MIX_WEIGHT}[kind]
    loss = torch.zeros((), device=s_TV.device)
    if w_r:
        loss = loss + w_r * (log_ps.exp() * (log_ps - log_pt)).sum()
    if w_r != 1.0:
        loss = loss + (1.0 - w_r) * (log_pt.exp() * (log_pt - log_ps)).sum()
    return loss


def _torch_bf16(x: NumericsInputs, kind: str, fused: bool) -> Result:
    with torch.no_grad():
        u_TV = x.teacher_hidden_TH @ x.teacher_weight_VH.T  # bf16 logits
    if fused:
        h = x.student_hidden_TH.clone().requires_grad_(True)
        w = x.student_weight_VH.clone().requires_grad_(True)
        loss = _torch_kl_sum((h @ w.T).float(), u_TV.float(), kind)
        grads = torch.autograd.grad(loss, (h, w))
    else:
        s = x.student_logits_TV.clone().requires_grad_(True)
        loss = _torch_kl_sum(s.float(), u_TV.float(), kind)
        grads = torch.autograd.grad(loss, (s,))
    return float(loss.detach()), tuple(grads)


def _liger() -> tuple[Method | None, str]:
    """Liger-Kernel's fused linear JSD as a peer (fused path, reverse/forward), or why not."""
    if not torch.cuda.is_available():
        return None, "Liger-Kernel needs CUDA (Triton)"
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss
    except Exception as exc:  # not installed: the usual case
        return None, f"Liger-Kernel not importable ({type(exc).__name__}: {exc})"

    def run(x: NumericsInputs, kind: str, fused: bool) -> Result:
        if not fused or kind == "mixed":
            raise NotImplementedError("Liger's fused linear JSD: fused path, reverse/forward only")
        loss_fn = LigerFusedLinearJSDLoss(
            weight_hard_loss=0.0, weight_soft_loss=1.0, beta=1.0 if kind == "reverse" else 0.0
        )
        h = x.student_hidden_TH.clone().requires_grad_(True)
        w = x.student_weight_VH.clone().requires_grad_(True)
        labels = torch.zeros(h.shape[0], dtype=torch.long, device=h.device)
        loss = loss_fn(h, w, x.teacher_hidden_TH, x.teacher_weight_VH, labels)
        grads = torch.autograd.grad(loss, (h, w))
        # Liger averages over tokens: report it on the summed scale of the reference
        T = h.shape[0]
        return float(loss.detach()) * T, tuple(g * T for g in grads)

    return run, "Liger-Kernel LigerFusedLinearJSDLoss (beta 1: reverse, 0: forward; its loss x T)"


def method_names(device: torch.device) -> tuple[dict[str, Method], list[str]]:
    """``({name: method}, notes)`` of the peers that run on ``device``."""
    methods: dict[str, Method] = {"ours": _ours, "torch bf16": _torch_bf16}
    notes = []
    if device.type == "cuda":
        liger, note = _liger()
        if liger is not None:
            methods["Liger-Kernel"] = liger
        notes.append(note)
    return methods, notes


def run_numerics(
    *,
    tokens: int,
    hidden: int,
    vocabs: Sequence[int],
    logit_stds: Sequence[float],
    kinds: Sequence[str] = KINDS,
    noise_std: float = 0.25,
    device: torch.device,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[Row], list[str]]:
    """The error table: one row per (V, logit std, kind, path, method).

    ``progress`` gets one line per (V, logit std). Returns ``(rows, notes)``; a method that cannot run a case (Liger on the logits path or the
    mixed KL) is left out of it, one that fails records its error in ``loss_rel_err``'s place.
    """
    methods, notes = method_names(device)
    rows: list[Row] = []
    for V in vocabs:
        for std in logit_stds:
            setup = NumericsSetup(
                tokens=tokens, hidden=hidden, vocab=V, logit_std=float(std), noise_std=noise_std
            )
            x = make_inputs(setup, device)
            u64 = _logits_f64(x.teacher_hidden_TH, x.teacher_weight_VH)
            s64 = {
                False: x.student_logits_TV.double(),
                True: _logits_f64(x.student_hidden_TH, x.student_weight_VH),
            }
            for kind in kinds:
                for fused in (False, True):
                    ref_loss, g64_TV = reference_kl(s64[fused], u64, kind)
                    ref_grads: tuple[torch.Tensor, ...] = (g64_TV,)
                    if fused:
                        ref_grads = (
                            _mm_f64_left(g64_TV, x.student_weight_VH),
                            g64_TV.T @ x.student_hidden_TH.double(),
                        )
                    del g64_TV
                    for name, method in methods.items():
                        row: Row = {
                            "method": name, "path": "fused" if fused else "logits", "kind": kind,
                            "V": V, "logit_std": float(std), "T": tokens, "H": hidden,
                        }  # fmt: skip
                        try:
                            loss, grads = method(x, kind, fused)
                        except NotImplementedError:
                            continue
                        errs = [relative_error(g, r) for g, r in zip(grads, ref_grads, strict=True)]
                        row["loss_rel_err"] = abs(loss - ref_loss) / max(abs(ref_loss), 1e-300)
                        row["grad_rel_err"] = max(errs)
                        row["grad_h_rel_err"] = errs[0] if fused else ""
                        row["grad_w_rel_err"] = errs[1] if fused else ""
                        rows.append(row)
            if progress is not None:
                progress(f"V={V} logit std {std:g}: measured")
            del x, u64, s64
    return rows, notes


def _num(value: object) -> float | None:
    """A cell as a float (rows from a CSV hold text); ``None`` when empty or not a number."""
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def plot_errors(rows: Sequence[Row], png_path: Path, title: str) -> Path:
    """Relative loss and gradient errors against logit std, log-scaled: one panel per (metric, V).

    ``rows`` as :func:`run_numerics` returns them or as read back from its CSV.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    vocabs = sorted({int(r["V"]) for r in rows})
    metrics = [("loss_rel_err", "relative loss error"), ("grad_rel_err", "relative gradient error")]
    fig = Figure(figsize=(5.0 * len(vocabs), 9.0), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(metrics), len(vocabs), squeeze=False)
    styles = {"reverse": "-", "forward": "--", "mixed": ":"}
    series = sorted({(r["method"], r["path"]) for r in rows})
    colors = {s: f"C{i}" for i, s in enumerate(series)}
    for j, V in enumerate(vocabs):
        for i, (col, label) in enumerate(metrics):
            ax = axes[i][j]
            for method, path in series:
                for kind, ls in styles.items():
                    pts = sorted(
                        (float(r["logit_std"]), y)
                        for r in rows
                        if int(r["V"]) == V
                        and (r["method"], r["path"], r["kind"]) == (method, path, kind)
                        and (y := _num(r.get(col))) is not None
                    )
                    if not pts:
                        continue
                    xs, ys = zip(*pts, strict=True)
                    ax.plot(
                        xs, [max(y, 1e-12) for y in ys], ls, marker="o", ms=3,
                        color=colors[method, path], label=f"{method} ({path}), {kind}",
                    )  # fmt: skip
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("teacher logit std")
            ax.set_ylabel(label)
            ax.set_title(f"V = {V}")
            ax.grid(which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=4, fontsize=7)
    fig.suptitle(title, fontsize=10)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=110)
    return png_path
