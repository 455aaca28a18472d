"""The demo's configuration: what every rank of ``mopd demo`` needs, validated in one place.

Why this file exists: the launcher (:mod:`mopd.profiling.demo`) checks the flags before it starts
any rank, and each rank (:mod:`mopd.profiling.demo.job`) runs from the same validated values;
both import this module, neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass

from mopd.profiling.mesh_arg import MeshSpec

__all__ = ["PHASES", "STOP_TOKEN", "DemoConfig", "flag"]

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

#: Configuration fields whose flag is not ``--`` plus the name with dashes.
_FLAGS = {"per_token_loss": "--loss-path"}


def flag(field: str) -> str:
    """The ``mopd demo`` flag that sets a :class:`DemoConfig` field (``seq_len`` -> ``--seq-len``)."""
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


def _short(m: MeshSpec) -> str:
    """A mesh as a user writes it: the sizes that are not 1, and a non-zero ``rank_offset``."""
    parts = [f"{k}={getattr(m, k)}" for k in ("tp", "cp", "dp", "pp") if getattr(m, k) != 1]
    if m.rank_offset:
        parts.append(f"rank_offset={m.rank_offset}")
    return ",".join(parts) or "tp=1"


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Everything a worker needs, validated identically on every rank (and in the launcher).

    Attributes:
        nproc: ranks in the job.
        teachers / teacher_hidden: one mesh and hidden size per teacher (same vocabulary).
        student / student_hidden: the student's mesh and hidden size.
        heads, layers, vocab, seq_len: model and batch shape (``seq_len`` = the longest sample,
            prompt plus response).
        samples: prompts per step over the whole job (global ids ``step * samples + i``); the
            student samples a response to each, and sample ``i`` goes to teacher
            ``i % num_teachers``.
        heldout_samples: the fixed held-out set (prompts with continuations the untrained
            student sampled), scored against its teachers before every step.
        micro_batches: micro-batches per step (each a contiguous share of the samples).
        per_token_loss: megatron's ``calculate_per_token_loss`` (else its default loss path).
        steps, lr, seed: the training run.
        teacher_init_std: the teachers' init std (large -> peaked teacher distributions).
        prompt_len: the first tokens of each sample are its prompt (a domain tag naming its
            teacher, then random ids): the response mask leaves them out (the KL counts the
            response), so the teachers never send them.
        temperature: the student samples from ``softmax(logits / temperature)``.
    """

    nproc: int
    teachers: tuple[MeshSpec, ...]
    teacher_hidden: tuple[int, ...]
    student: MeshSpec
    student_hidden: int
    heads: int = 4
    layers: int = 2
    vocab: int = 256
    seq_len: int = 32
    samples: int = 16
    heldout_samples: int = 16
    micro_batches: int = 2
    per_token_loss: bool = True
    steps: int = 16
    lr: float = 6e-3
    seed: int = 1234
    teacher_init_std: float = 0.15
    prompt_len: int = 8
    temperature: float = 1.0

    def __post_init__(self) -> None:
        # each message leads with the flag and value that fail, then the rule and the fix
        for name in (
            "nproc",
            "heads",
            "layers",
            "vocab",
            "seq_len",
            "samples",
            "heldout_samples",
            "micro_batches",
            "steps",
            "student_hidden",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag(name)} {getattr(self, name)}: must be >= 1")
        for name in ("lr", "teacher_init_std", "temperature"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{flag(name)} {getattr(self, name):g}: must be > 0")
        if not self.teachers:
            raise ValueError("--teacher: at least one teacher is needed")
        if len(self.teacher_hidden) != len(self.teachers):
            raise ValueError(
                f"--teacher-hidden {','.join(map(str, self.teacher_hidden))}: "
                f"{len(self.teacher_hidden)} hidden sizes for {len(self.teachers)} teacher meshes "
                "(--teacher); give one per teacher"
            )
        models = [
            (f"--teacher {_short(m)}", m, h, "--teacher-hidden")
            for m, h in zip(self.teachers, self.teacher_hidden, strict=True)
        ]
        models.append(
            (
                f"--student {_short(self.student)}",
                self.student,
                self.student_hidden,
                "--student-hidden",
            )
        )
        if any(m.rank_offset is None for _, m, _, _ in models):
            raise ValueError("every mesh needs its rank_offset (the parser defaults it to 0)")
        covered: set[int] = set()
        for label, m, h, hidden_flag in models:
            end = m.rank_offset + m.size
            if end > self.nproc:
                raise ValueError(
                    f"{label}: needs global ranks {m.rank_offset}..{end - 1}, the job has "
                    f"{self.nproc} (--nproc {self.nproc}); give --nproc {end} or a smaller mesh "
                    "(--preset 4 or 8 sets meshes that fit)"
                )
            covered |= set(range(m.rank_offset, end))
            if self.heads % m.tp:
                fits = [t for t in range(1, self.heads + 1) if self.heads % t == 0]
                raise ValueError(
                    f"{label}: {self.heads} attention heads do not divide by tp={m.tp}; use a tp "
                    f"that divides --heads {self.heads} ({', '.join(map(str, fits))}), or --heads "
                    f"a multiple of {m.tp} (hidden sizes a multiple of it)"
                )
            if h < 1 or h % self.heads:
                raise ValueError(
                    f"{hidden_flag} {h}: the hidden size of {label} must be a positive multiple "
                    f"of --heads {self.heads}"
                )
            if self.vocab % m.tp:
                raise ValueError(
                    f"--vocab {self.vocab}: does not divide by tp={m.tp} of {label}; use a "
                    f"multiple of {m.tp}"
                )
            if self.layers % m.pp:
                raise ValueError(
                    f"--layers {self.layers}: {self.layers} layers do not divide by pp={m.pp} of "
                    f"{label}; use a multiple of {m.pp}"
                )
        if covered != set(range(self.nproc)):
            raise ValueError(
                f"--nproc {self.nproc}: ranks {sorted(set(range(self.nproc)) - covered)} hold no "
                f"model (teachers {', '.join(_short(t) for t in self.teachers)}, student "
                f"{_short(self.student)}); give --nproc {max(covered) + 1} or meshes over every rank"
            )
        # Distiller.step splits any count (a DP rank or teacher with no sample in a micro-batch
        # runs a placeholder); each micro-batch needs a sample, and each teacher one per set
        least = max(self.micro_batches, self.num_teachers)
        for what, count in (("samples", self.samples), ("heldout_samples", self.heldout_samples)):
            if count < least:
                raise ValueError(
                    f"{flag(what)} {count}: must be at least {least}, one per micro-batch "
                    f"(--micro-batches {self.micro_batches}) and one per teacher "
                    f"({self.num_teachers}, sample i goes to teacher i % teachers)"
                )
        for t in self.teachers:
            if t.cp != 1:
                raise ValueError(f"--teacher {_short(t)}: the demo's teachers take cp=1")
            if self.seq_len % t.tp:
                raise ValueError(
                    f"--seq-len {self.seq_len}: must divide by tp={t.tp} of --teacher "
                    f"{_short(t)} (sequence parallelism)"
                )
        if self.student.cp > 1 and self.seq_len % (2 * self.student.cp):
            raise ValueError(
                f"--seq-len {self.seq_len}: must divide by 2 * cp = {2 * self.student.cp} of "
                f"--student {_short(self.student)} (its sequences are padded to that multiple, "
                "within its positions)"
            )
        if not 1 <= self.prompt_len < self.seq_len:
            raise ValueError(
                f"--prompt-len {self.prompt_len}: must be in [1, {self.seq_len}) (a domain tag "
                f"first, and room for a response within --seq-len {self.seq_len})"
            )
        if self.vocab < self.num_teachers + 2:
            raise ValueError(
                f"--vocab {self.vocab}: needs room for the stop token, {self.num_teachers} domain "
                "tags and prompt tokens"
            )

    @property
    def num_teachers(self) -> int:
        return len(self.teachers)

    @property
    def max_new_tokens(self) -> int:
        """The longest response the student may sample (``seq_len - prompt_len``)."""
        return self.seq_len - self.prompt_len

    def as_dict(self) -> dict[str, object]:
        """The configuration as plain data (for ``--json``)."""
        return {
            "nproc": self.nproc,
            "teachers": [str(t) for t in self.teachers],
            "teacher_hidden": list(self.teacher_hidden),
            "student": str(self.student),
            "student_hidden": self.student_hidden,
            "samples": self.samples,
            "heldout_samples": self.heldout_samples,
            "micro_batches": self.micro_batches,
            "seq_len": self.seq_len,
            "vocab": self.vocab,
            "steps": self.steps,
            "lr": self.lr,
            "seed": self.seed,
            "teacher_init_std": self.teacher_init_std,
            "per_token_loss": self.per_token_loss,
            "prompt_len": self.prompt_len,
            "temperature": self.temperature,
            "max_new_tokens": self.max_new_tokens,
        }
