"""Tier 2 (4 ranks, gloo): no malformed micro-batch reaches megatron's schedule, and none kills a rank.

The job (``tests/support/distill_job.py``) is a :class:`mopd.mcore.Distiller` with teacher
``tp2`` on global ranks 0-1 and student ``tp2 pp2`` (first stage ranks 0-1, last stage 2-3)
around megatron-core's pipeline schedule. Each probe breaks one rank's micro-batches of one
step the way a data pipeline might (widths, lengths and columns that disagree with the
layout or with the rank's pipeline and TP peers, float / bool / 1-D / 3-D / missing / non-tensor
tokens, position ids of the wrong shape, dtype or range, labels and row masks of the wrong
shape, dtype or values with the constructor bypassed, negative or out-of-vocabulary ids, bad
lengths, packing, attention masks, devices, counts), and every one is caught with the same
``ValueError`` on every rank, before anything moves (nothing posted, well inside the timeout,
the bridge still usable), naming the rank, the micro-batch and the field; or, for the inputs
that are valid (int32 ids, a 0/1 float row mask), accepted with the loss bit for bit the
reference's. After every probe the next good step runs with the reference's loss, bit for bit:
no rank was killed, none left waiting.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.support.distill_job import GLOBAL_MB, Job, S, V
from tests.support.megatron_cpu import megatron_world
from tests.support.reliability import everyone, outcome

TORCHRUN_NPROC = 4
TORCHRUN_TIMEOUT = 420
TORCHRUN_STRICT_P2P = 1  # NCCL's point-to-point rules (tests/support/strict_p2p.py)

T_S = 8.0
SEED = 3
B = GLOBAL_MB  # the student's columns per micro-batch (dp 1)

world = pytest.fixture(scope="module")(megatron_world)


@pytest.fixture(scope="module")
def job(world) -> Any:
    j = Job(timeout_s=T_S, student_pp=2)
    j.want = j.run(SEED)  # the reference: the fault-free loss of the probes' step
    yield j
    j.close()


def setattr_(mb: Any, **fields: Any) -> Any:
    """``mb`` with ``fields`` set, the constructor's checks bypassed."""
    for k, v in fields.items():
        object.__setattr__(mb, k, v)
    return mb


def on(rank: int, side: str, i: int, change: Callable[[Any], Any]) -> Callable[..., Any]:
    """A probe: on global ``rank``, ``side``'s (``"student"`` / ``"teacher"``) micro-batch
    ``i`` becomes ``change(mb)``."""

    def probe(job: Job, s: list[Any], t: list[Any] | None) -> tuple[Any, Any]:
        if dist.get_rank() == rank:
            mbs = s if side == "student" else t
            assert mbs is not None
            mbs[i] = change(mbs[i])
        return s, t

    return probe


def narrower(mb: Any) -> Any:
    """Tokens and positions 12 wide, seq_len still 16 (a truncation that forgot the rest)."""
    return setattr_(mb, tokens=mb.tokens[:, :12], position_ids=mb.position_ids[:, :12])


def consistent_narrower(mb: Any) -> Any:
    """A well-formed micro-batch of 12 positions (seq_len read from its tokens): right on its
    own, wrong beside its peers' 16."""
    from mopd.mcore import MicroBatch

    return MicroBatch(
        sample_ids=mb.sample_ids, tokens=mb.tokens[:, :12], position_ids=mb.position_ids[:, :12]
    )


def packed_two_rows(mb: Any) -> Any:
    from mopd.mcore import packed_micro_batch

    p = packed_micro_batch(list(mb.sample_ids[:1]), [mb.tokens[0]])
    return setattr_(p, tokens=p.tokens.expand(2, -1), position_ids=p.position_ids.expand(2, -1))


def one_fewer(job: Job, s: list[Any], t: list[Any] | None) -> tuple[Any, Any]:
    return (s[:-1] if dist.get_rank() == 2 else s), t


def no_teacher_batches(job: Job, s: list[Any], t: list[Any] | None) -> tuple[Any, Any]:
    return s, (None if dist.get_rank() == 1 else t)


# name -> (probe, the global rank it breaks, what its message holds)
REJECTED: dict[str, tuple[Callable[..., Any], int, str]] = {
    # the student's first stage: what the embedding and the pipeline's first send read
    "tokens narrower than seq_len": (
        on(0, "student", 1, narrower),
        0,
        "student micro-batch 1: tokens (4, 12) hold 12 positions on this CP rank, but seq_len=16",
    ),
    "tokens wider than seq_len": (
        on(
            1,
            "student",
            0,
            lambda mb: setattr_(mb, tokens=torch.cat([mb.tokens, mb.tokens[:, :1]], 1)),
        ),
        1,
        "student micro-batch 0: tokens (4, 17) hold 17 positions on this CP rank, but seq_len=16",
    ),
    "an extra column": (
        on(0, "student", 2, lambda mb: setattr_(mb, tokens=torch.cat([mb.tokens, mb.tokens[:1]]))),
        0,
        "student micro-batch 2: tokens (5, 16) hold 5 columns but the micro-batch has 4 sample ids",
    ),
    "a column fewer": (
        on(1, "student", 0, lambda mb: setattr_(mb, tokens=mb.tokens[1:])),
        1,
        "student micro-batch 0: tokens (3, 16) hold 3 columns but the micro-batch has 4 sample ids",
    ),
    "float tokens": (
        on(0, "student", 0, lambda mb: setattr_(mb, tokens=mb.tokens.float())),
        0,
        "student micro-batch 0: tokens are torch.float32; ids must be torch.int64 or torch.int32",
    ),
    "bool tokens": (
        on(1, "student", 1, lambda mb: setattr_(mb, tokens=mb.tokens > 3)),
        1,
        "student micro-batch 1: tokens are torch.bool",
    ),
    "1-D tokens": (
        on(0, "student", 0, lambda mb: setattr_(mb, tokens=mb.tokens.reshape(-1))),
        0,
        "student micro-batch 0: tokens (64,) must be 2-D",
    ),
    "3-D tokens": (
        on(1, "student", 2, lambda mb: setattr_(mb, tokens=mb.tokens[..., None])),
        1,
        "student micro-batch 2: tokens (4, 16, 1) must be 2-D",
    ),
    "tokens None on a first stage": (
        on(0, "student", 1, lambda mb: setattr_(mb, tokens=None, labels=None)),
        0,
        "student micro-batch 1: tokens is None, but this rank holds the model's first stage",
    ),
    "tokens a list": (
        on(1, "student", 0, lambda mb: setattr_(mb, tokens=mb.tokens.tolist())),
        1,
        "student micro-batch 0: tokens must be a torch.Tensor, got list",
    ),
    "tokens on another device": (
        on(0, "student", 0, lambda mb: setattr_(mb, tokens=mb.tokens.to("meta"))),
        0,
        "student micro-batch 0: tokens are on meta, the model on cpu",
    ),
    "a negative token id": (
        on(
            0,
            "student",
            2,
            lambda mb: setattr_(mb, tokens=mb.tokens.clone().index_fill_(1, torch.tensor([3]), -1)),
        ),
        0,
        "student micro-batch 2: token ids span [-1, ",
    ),
    "a token id past the vocabulary": (
        on(
            1,
            "student",
            1,
            lambda mb: setattr_(mb, tokens=mb.tokens.clone().index_fill_(1, torch.tensor([5]), V)),
        ),
        1,
        f"student micro-batch 1: token ids span [0, {V}], outside the model's vocabulary",
    ),
    "position_ids of the wrong shape": (
        on(0, "student", 0, lambda mb: setattr_(mb, position_ids=mb.position_ids[:, :8])),
        0,
        "student micro-batch 0: position_ids (4, 8) must have the shape of tokens (4, 16)",
    ),
    "position_ids None": (
        on(1, "student", 2, lambda mb: setattr_(mb, position_ids=None)),
        1,
        "student micro-batch 2: position_ids is None, but the model embeds positions",
    ),
    "float position_ids": (
        on(0, "student", 1, lambda mb: setattr_(mb, position_ids=mb.position_ids.float())),
        0,
        "student micro-batch 1: position_ids are torch.float32",
    ),
    "a position past the table": (
        on(1, "student", 0, lambda mb: setattr_(mb, position_ids=mb.position_ids + 1)),
        1,
        f"student micro-batch 0: position_ids span [1, {S}], outside the model's position table",
    ),
    "a negative position": (
        on(0, "student", 2, lambda mb: setattr_(mb, position_ids=mb.position_ids - 1)),
        0,
        "student micro-batch 2: position_ids span [-1, ",
    ),
    "an attention mask of the wrong shape": (
        on(
            1,
            "student",
            1,
            lambda mb: setattr_(mb, attention_mask=torch.ones(4, 1, 8, 8, dtype=torch.bool)),
        ),
        1,
        "student micro-batch 1: attention_mask (4, 1, 8, 8) does not fit",
    ),
    "packed tokens of two rows": (
        on(0, "student", 0, packed_two_rows),
        0,
        "student micro-batch 0: packed tokens (2, 16) must be [1, T_local]",
    ),
    "not a MicroBatch": (
        on(1, "student", 2, lambda mb: dataclasses.asdict(mb)),
        1,
        "student micro-batch 2 is a dict, not a MicroBatch",
    ),
    # well-formed on the rank, wrong beside its pipeline / TP peers
    "12 positions on one first-stage rank": (
        on(1, "student", 1, consistent_narrower),
        1,
        "student micro-batch shapes differ within global ranks [0, 1, 2, 3]: micro-batch 1: "
        "seq_length 12 on global rank 1, 16 on global rank 0",
    ),
    "3 columns on one last-stage rank": (
        on(
            2,
            "student",
            0,
            lambda mb: dataclasses.replace(
                mb,
                sample_ids=mb.sample_ids[:3],
                tokens=mb.tokens[:3],
                position_ids=mb.position_ids[:3],
                labels=mb.labels[:3],
            ),
        ),
        2,
        "micro-batch 0",
    ),
    "other samples on one TP rank": (
        on(
            1,
            "student",
            2,
            lambda mb: dataclasses.replace(mb, sample_ids=[x + 1 for x in mb.sample_ids]),
        ),
        1,
        "student micro-batch shapes differ within global ranks [0, 1, 2, 3]: micro-batch 2: "
        "sample ids not the same",
    ),
    # the student's last stage: what the loss and the bridge read
    "labels of the wrong shape": (
        on(2, "student", 1, lambda mb: setattr_(mb, labels=mb.labels[:, :8])),
        2,
        "student micro-batch 1: labels (4, 8) must have the shape of the micro-batch's logit rows (4, 16)",
    ),
    "float labels": (
        on(3, "student", 0, lambda mb: setattr_(mb, labels=mb.labels.float())),
        3,
        "student micro-batch 0: labels are torch.float32",
    ),
    "a label past the vocabulary": (
        on(
            2,
            "student",
            2,
            lambda mb: setattr_(mb, labels=mb.labels.clone().index_fill_(1, torch.tensor([0]), V)),
        ),
        2,
        f"student micro-batch 2: labels span [0, {V}], outside the model's vocabulary",
    ),
    "a 0.5 row mask": (
        on(3, "student", 1, lambda mb: setattr_(mb, loss_mask=torch.full((4, S), 0.5))),
        3,
        "student micro-batch 1: loss_mask holds values other than 0 and 1",
    ),
    "a row mask of 2": (
        on(2, "student", 0, lambda mb: setattr_(mb, loss_mask=torch.full((4, S), 2))),
        2,
        "student micro-batch 0: loss_mask holds values other than 0 and 1",
    ),
    "a row mask of the wrong shape (dataclasses.replace)": (
        on(
            3,
            "student",
            2,
            lambda mb: dataclasses.replace(mb, loss_mask=torch.ones(4, 8, dtype=torch.bool)),
        ),
        3,
        "student micro-batch 2: loss_mask (4, 8) must be a tensor of the shape of the micro-batch's logit rows (4, 16)",
    ),
    "a 1-D row mask": (
        on(2, "student", 1, lambda mb: setattr_(mb, loss_mask=torch.ones(4 * S, dtype=torch.bool))),
        2,
        "student micro-batch 1: loss_mask (64,) must be a tensor",
    ),
    "a row mask that is a list": (
        on(3, "student", 0, lambda mb: setattr_(mb, loss_mask=[[1] * S] * 4)),
        3,
        "student micro-batch 0: loss_mask list must be a tensor",
    ),
    "a negative sample id": (
        on(2, "student", 2, lambda mb: setattr_(mb, sample_ids=[-1, *mb.sample_ids[1:]])),
        2,
        "student micro-batch 2: sample_ids[0] is -1, outside [0, 2**63)",
    ),
    "lengths of the wrong count": (
        on(3, "student", 1, lambda mb: dataclasses.replace(mb, lengths=[S] * 3)),
        3,
        "student micro-batch 1: 3 lengths for 4 sample ids",
    ),
    "a length past seq_len": (
        on(2, "student", 0, lambda mb: dataclasses.replace(mb, lengths=[S + 1] * 4)),
        2,
        f"student micro-batch 0: lengths [{S + 1}, {S + 1}, {S + 1}, {S + 1}] outside [0, seq_len={S}]",
    ),
    "a negative length": (
        on(3, "student", 2, lambda mb: dataclasses.replace(mb, lengths=[S, -1, S, S])),
        3,
        f"student micro-batch 2: lengths [-1] outside [0, seq_len={S}]",
    ),
    "a micro-batch fewer on one rank": (
        one_fewer,
        2,
        "ranks give different micro-batch counts: 2 on global ranks [2], 3 on global ranks",
    ),
    # the teacher's ranks
    "teacher tokens narrower than seq_len": (
        on(1, "teacher", 0, narrower),
        1,
        "teacher 0 micro-batch 0: tokens (4, 12) hold 12 positions on this CP rank, but seq_len=16",
    ),
    "teacher tokens None": (
        on(0, "teacher", 2, lambda mb: setattr_(mb, tokens=None, labels=None)),
        0,
        "teacher 0 micro-batch 2: tokens is None, but this rank holds the model's first stage",
    ),
    "float teacher tokens": (
        on(1, "teacher", 1, lambda mb: setattr_(mb, tokens=mb.tokens.double())),
        1,
        "teacher 0 micro-batch 1: tokens are torch.float64",
    ),
    "no teacher micro-batches on a teacher rank": (
        no_teacher_batches,
        1,
        "teacher 0 (teacher Mesh(tp=2, cp=1, dp=1, pp=1, ranks=0..1)): this rank holds a stage of it",
    ),
}


def as_int32(job: Job, s: list[Any], t: list[Any] | None) -> tuple[Any, Any]:
    for mbs in (s, t or []):
        for mb in mbs:
            setattr_(mb, tokens=mb.tokens.int(), position_ids=mb.position_ids.int())
    return s, t


def float_row_mask(job: Job, s: list[Any], t: list[Any] | None) -> tuple[Any, Any]:
    for mb in s:  # all rows count, as without a mask
        setattr_(mb, loss_mask=torch.ones(mb.tokens.shape, dtype=torch.float32))
    return s, t


ACCEPTED: dict[str, Callable[..., Any]] = {
    "int32 tokens and positions": as_int32,
    "a float row mask of 0/1": float_row_mask,
}


def test_the_probes_are_many():
    assert len(REJECTED) + len(ACCEPTED) >= 39


@pytest.mark.parametrize("name", sorted(REJECTED))
def test_a_malformed_input_is_the_same_value_error_on_every_rank(job, name):
    probe, culprit, text = REJECTED[name]
    s, t = probe(job, *job.batches(SEED))
    ex = job.distiller.bridge.executor
    before = ex.slots_issued
    got = outcome(lambda: job.distiller.step(student=s, teachers=[t]))
    seen = everyone(
        (got[0], got[1], got[2], ex.slots_issued == before, ex.lifecycle.failure is None)
    )
    kind, msg, _, _, _ = seen[0]
    assert kind == "ValueError", seen
    assert all(x[:2] == (kind, msg) for x in seen), seen  # the same text everywhere
    assert all(x[2] < T_S and x[3] and x[4] for x in seen), seen  # fast, nothing moved, usable
    assert text in msg, msg
    assert f"global rank {culprit}" in msg or f"global ranks [{culprit}]" in msg, msg
    assert job.run(SEED) == job.want  # the next good step, bit for bit


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_a_valid_variant_is_accepted_and_exact(job, name):
    s, t = ACCEPTED[name](job, *job.batches(SEED))
    got = outcome(lambda: job.run(SEED, batches=(s, t)))
    seen = everyone(got[:2])
    assert all(x[0] == "ok" for x in seen), seen
    assert got[3] == job.want  # bit for bit (None off the student's last stage)
