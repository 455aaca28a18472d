"""Tier 1: a rank's micro-batch checks and the agreements its peers must match, in one process.

``mopd.mcore.megatron_checks.check_micro_batches`` on its own (no process group, no model): each field
the schedule reads is a ``ValueError`` naming the micro-batch, the field and the shapes, valid
variants pass, and the shapes its replica must agree on are one record per micro-batch.
``mopd.bridge.inputs.Agreement`` names the first differing micro-batch and field;
``StepChecks`` is the mapping of counts it always was; an agreement survives the step record
(``encode_step_record`` -> ``StepMatrix.agreements``), whatever else the record holds.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from mopd.bridge.inputs import Agreement, StepChecks
from mopd.bridge.mesh import Mesh
from mopd.bridge.metadata import SIZE, StepMatrix, encode_step_record
from mopd.bridge.record import stack_records
from mopd.mcore import padded_micro_batch
from mopd.mcore.megatron_checks import SHAPE_FIELDS, check_micro_batches

V, S = 64, 16
MESH = Mesh(tp=2, pp=2)  # global rank 0: tp 0, first stage


def mbs(n: int = 2) -> list[Any]:
    g = torch.Generator().manual_seed(0)
    return [
        padded_micro_batch([4 * i + k for k in range(3)], torch.randint(0, V, (3, S), generator=g))
        for i in range(n)
    ]


def check(batches: list[Any], *, rank: int = 0, student: bool = True) -> Agreement:
    return check_micro_batches(
        batches,
        what="student",
        mesh=MESH,
        rank=rank,
        model=None,
        default_forward=True,
        student=student,
        vocab_size=V,
        given=True,
    )


def set_(mb: Any, **fields: Any) -> Any:
    for k, v in fields.items():
        object.__setattr__(mb, k, v)
    return mb


def test_good_micro_batches_pass_and_commit_their_shapes():
    a = check(mbs())
    assert a.ranks == (0, 1, 2, 3) and a.fields == SHAPE_FIELDS
    assert len(a.words) == 2 * len(SHAPE_FIELDS)
    assert a.words[:3] == (0, S, 3)  # padded, seq_length, micro_batch_size
    b = mbs()
    set_(b[1], tokens=b[1].tokens.int(), position_ids=b[1].position_ids.int())
    set_(b[0], loss_mask=torch.ones(3, S))  # 0/1 floats: a row mask
    assert check(b).words == a.words


@pytest.mark.parametrize(
    ("change", "text"),
    [
        (
            lambda mb: set_(mb, tokens=mb.tokens[:, :12]),
            "tokens (3, 12) hold 12 positions on this CP rank, but seq_len=16",
        ),
        (lambda mb: set_(mb, tokens=mb.tokens.float()), "tokens are torch.float32"),
        (
            lambda mb: set_(mb, tokens=None, labels=None),
            "tokens is None, but this rank holds the model's first stage",
        ),
        (
            lambda mb: set_(mb, position_ids=mb.position_ids[:, :8]),
            "position_ids (3, 8) must have the shape of tokens (3, 16)",
        ),
        (
            lambda mb: set_(mb, labels=mb.labels[:2]),
            "labels (2, 16) must have the shape of the micro-batch's logit rows (3, 16)",
        ),
        (
            lambda mb: set_(mb, loss_mask=torch.full((3, S), 0.5)),
            "loss_mask holds values other than 0 and 1",
        ),
        (lambda mb: set_(mb, tokens=mb.tokens + V), f"token ids span [{V}, "),
        (lambda mb: set_(mb, lengths=[S] * 2), "2 lengths for 3 sample ids"),
    ],
)
def test_a_bad_field_names_the_micro_batch_and_the_shapes(change, text):
    b = mbs()
    b[1] = change(b[1])
    with pytest.raises(ValueError) as err:
        check(b)
    assert str(err.value).startswith("student micro-batch 1: "), str(err.value)
    assert text in str(err.value)


def test_a_teachers_row_mask_is_not_judged():
    b = mbs()
    set_(b[0], loss_mask=torch.full((3, S), 0.5))
    check(b, student=False)  # ignored on a teacher (it sends what the student counts)


def test_an_agreement_names_the_first_difference():
    mine = Agreement(
        what="student micro-batch shapes",
        ranks=(0, 2),
        fields=SHAPE_FIELDS,
        words=(0, 16, 3, 0, 7) * 2,
    )
    assert mine.differs(list(mine.words), me=2) is None
    theirs = [0, 16, 3, 0, 7, 0, 12, 3, 0, 8]
    assert mine.differs(theirs, me=2) == (
        "student micro-batch shapes differ within global ranks [0, 2]: micro-batch 1: "
        "seq_length 16 on global rank 2, 12 on global rank 0, sample ids not the same"
    )
    assert "gives 2 micro-batch(s), global rank 0 1" in (mine.differs(theirs[:5], me=2) or "")
    with pytest.raises(ValueError):
        Agreement(what="x", ranks=(0,), fields=("a", "b"), words=(1, 2, 3))


def test_step_checks_are_the_mapping_of_counts():
    c = StepChecks({"student's micro-batches": 3})
    assert dict(c) == {"student's micro-batches": 3} and len(c) == 1 and c.agreements == ()


def test_agreements_survive_the_step_record():
    a = Agreement(what="w", ranks=(0, 1), fields=("x",), words=(5, -1, 2**40))
    b = Agreement(what="v", ranks=(0, 1), fields=("y", "z"), words=())
    recs = [
        encode_step_record(
            config_sig=1, n_slots=-1, error="", sections=[None, None], agreements=[a, b]
        ),
        encode_step_record(config_sig=1, n_slots=-1, error="some text", sections=[None, None]),
    ]
    matrix, sizes = stack_records(recs)
    assert sizes.tolist() == [r.numel() for r in recs] == matrix[:, SIZE].tolist()
    m = StepMatrix(matrix)  # each record says where it ends: its padding is never read
    got = m.agreements(0)
    assert set(got) == {a.key, b.key} and got[a.key].tolist() == [5, -1, 2**40]
    assert got[b.key].size == 0
    assert m.agreements(1) == {} and m.error(1) == "some text"
    assert isinstance(got[a.key], np.ndarray)
