"""Tier 1: what :meth:`mopd.mcore.Rollouts.problems` finds, and that nothing about a ``Rollouts``
raises on one rank.

What a user relies on: building a ``Rollouts`` never raises (a rank whose rollouts are wrong
still reaches the step's shared verdict, so no peer is left waiting); every field is
type-checked, with no silent coercion (a float or bool teacher index, a float sample id, a
string advantage are refused, not truncated or taken); each problem names the field, the
sample's index and the value (the ``-inf`` at index 7, not the first four values); lists and
tensors are copied at construction, so the caller changing its own list afterwards changes
nothing; the step-level checks (:func:`mopd.mcore.rollouts.rollouts_problems`) turn a
non-``Rollouts``, the exception building one raised, and a missing or bad
``num_micro_batches`` into problems too.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from mopd.mcore import Rollouts
from mopd.mcore.batch import sample_id_problem
from mopd.mcore.rollouts import rollouts_problems

V, N, TEACHERS = 50, 8, 2


def good(**change: Any) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    fields: dict[str, Any] = {
        "prompts": [torch.randint(0, V, (3,), generator=g) for _ in range(N)],
        "responses": [torch.randint(0, V, (4,), generator=g) for _ in range(N)],
        "teachers": [j % TEACHERS for j in range(N)],
        "advantages": [0.0] * N,
        "sample_ids": list(range(N)),
    }
    fields.update(change)
    return fields


def problems(**change: Any) -> list[str]:
    return Rollouts(**good(**change)).problems(vocab_size=V, num_teachers=TEACHERS)


META = torch.empty(N, device="meta")

#: a malformed field -> the start of the problem found
BAD: dict[str, tuple[dict[str, Any], str]] = {
    "float teacher indices": (
        {"teachers": [0.9, 1.7, 0, 1, 0, 1, 0, 1]},
        "teachers[0] is 0.9 (float): give an integer per sample",
    ),
    "bool teacher indices": (
        {"teachers": [True, False] * 4},
        "teachers[0] is True (bool): give an integer per sample",
    ),
    "a float teachers tensor": (
        {"teachers": torch.zeros(N)},
        "teachers is a torch.float32 tensor: give an integer per sample",
    ),
    "a None teacher entry": (
        {"teachers": [0, 1, None, 1, 0, 1, 0, 1]},
        "teachers[2] is None (NoneType): give an integer per sample",
    ),
    "a teacher out of range": (
        {"teachers": [0, 1, 0, 2, 0, 1, 0, 1]},
        "teachers[3] is 2, outside [0, 2)",
    ),
    "float sample ids": (
        {"sample_ids": [j + 0.5 for j in range(N)]},
        "sample_ids[0] is 0.5 (float): give an integer per sample",
    ),
    "a float sample ids tensor": (
        {"sample_ids": torch.arange(N, dtype=torch.float64)},
        "sample_ids is a torch.float64 tensor: give an integer per sample",
    ),
    "a sample id of 2**63": (
        {"sample_ids": [*range(N - 1), 2**63]},
        "sample_ids[7] is 9223372036854775808, outside [0, 2**63)",
    ),
    "a negative sample id": (
        {"sample_ids": [*range(N - 1), -1]},
        "sample_ids[7] is -1, outside [0, 2**63)",
    ),
    "one sample id twice": (
        {"sample_ids": [0, 1, 2, 3, 4, 5, 6, 3]},
        "sample_ids[3] and sample_ids[7] are both 3",
    ),
    "a string advantage": (
        {"advantages": [0.0, 0.0, 0.0, "0.5", 0.0, 0.0, 0.0, 0.0]},
        "advantages[3] is '0.5' (str): give a real number per sample",
    ),
    "a bool advantage": (
        {"advantages": [0.0, True, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]},
        "advantages[1] is True (bool): give a real number per sample",
    ),
    "-inf at index 7": (
        {"advantages": [0.0] * 7 + [float("-inf")]},
        "advantages[7] is -inf: advantages must be finite",
    ),
    "an int advantage past float64": (
        {"advantages": [0] * 7 + [10**400]},
        "advantages[7] is 1000000",
    ),
    "a meta advantages tensor": (
        {"advantages": META},
        "advantages is a tensor on the meta device (it holds no values)",
    ),
    "advantages as a string": (
        {"advantages": "0" * N},
        "advantages is a str: give a real number per sample",
    ),
    "a None prompt": (
        {
            "prompts": [torch.ones(3, dtype=torch.int64), None]
            + [torch.ones(3, dtype=torch.int64)] * 6
        },
        "prompt 1 must be a 1-D tensor of token ids, got NoneType",
    ),
    "a meta prompt": (
        {"prompts": [torch.ones(3, dtype=torch.int64, device="meta")] * N},
        "prompt 0 is on the meta device (it holds no token ids)",
    ),
    "float tokens": (
        {"responses": [torch.ones(4)] * N},
        "response 0 must hold integer token ids, got torch.float32",
    ),
    "a token past the vocabulary": (
        {"responses": [torch.tensor([1, V])] * N},
        f"response 0: token ids span [1, {V}], outside the vocabulary [0, {V})",
    ),
    "fewer responses": (
        {"responses": [torch.ones(4, dtype=torch.int64)] * (N - 1)},
        "8 prompts but 7 responses (one per sample)",
    ),
    "fewer teachers": ({"teachers": [0] * (N - 1)}, "8 prompts but 7 teachers (one per sample)"),
    "prompts not a list": ({"prompts": 5}, "prompts is a int: give one 1-D tensor"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_a_malformed_field_is_named_by_index_and_value_and_nothing_raises(case: str) -> None:
    change, expect = BAD[case]
    found = problems(**change)  # building and checking never raise
    assert found, case
    assert found[0].startswith(expect), (case, found)
    assert "-1" not in found[0] or case == "a negative sample id", found  # no placeholder id


@pytest.mark.parametrize(
    "change",
    [
        {"prompts": [torch.ones(3, dtype=torch.int32)] * N},
        {"responses": [torch.ones(4, dtype=torch.uint8)] * N},
        {"responses": [torch.arange(8)[::2]] * N},  # non-contiguous
        {"teachers": torch.tensor([0, 1] * 4, dtype=torch.int32)},
        {"teachers": [np.int64(j % 2) for j in range(N)]},
        {"advantages": torch.randn(N, dtype=torch.float64)},
        {"advantages": [1] * N},
        {"sample_ids": torch.tensor([2**63 - 1 - j for j in range(N)])},
        {"sample_ids": [np.int32(j) for j in range(N)]},
        {"teachers": None, "advantages": None, "sample_ids": None},
    ],
    ids=[
        "int32",
        "uint8",
        "strided",
        "int32-teachers",
        "numpy",
        "f64-adv",
        "int-adv",
        "top-ids",
        "numpy-ids",
        "none",
    ],
)
def test_valid_variants_are_taken(change: dict[str, Any]) -> None:
    assert problems(**change) == []


def test_changing_the_callers_lists_and_tensors_afterwards_changes_nothing() -> None:
    fields = good(teachers=torch.tensor([0, 1] * 4))
    r = Rollouts(**fields)
    fields["prompts"].append(torch.ones(2, dtype=torch.int64))  # one more prompt, no response
    fields["sample_ids"][0] = 5  # a duplicate in the caller's list
    fields["teachers"][0] = 7  # out of range in the caller's tensor
    assert len(r) == N
    assert r.problems(vocab_size=V, num_teachers=TEACHERS) == []
    assert r._headers()[:, 1].tolist() == [0, 1] * 4


def test_what_a_rank_gives_the_step_is_checked_whole() -> None:
    def found(rollouts: Any, m: Any = 3) -> list[str]:
        return rollouts_problems(rollouts, m, rank=2, vocab_size=V, num_teachers=TEACHERS)

    assert found(Rollouts(**good())) == [] and found(None) == []
    assert found(tuple(good().values())) == [
        "global rank 2 passed a tuple, not a Rollouts (or None, or the exception that "
        "building them raised)"
    ]
    assert found(dict(good()))[0].startswith("global rank 2 passed a dict, not a Rollouts")
    try:
        raise RuntimeError("the sampler ran out of memory")
    except RuntimeError as exc:
        assert found(exc) == [
            "global rank 2 could not build its rollouts: RuntimeError: the sampler ran out of "
            "memory"
        ]
    assert found(None, None) == [
        "global rank 2: num_micro_batches is missing: "
        "Distiller.step(rollouts, num_micro_batches=M) on every rank"
    ]
    assert found(None, True)[0].endswith("must be an int, got True (bool)")
    assert found(None, 0) == ["global rank 2: num_micro_batches must be >= 1, got 0"]
    bad = found(Rollouts(**good(advantages=[0.0] * 7 + [float("nan")])))
    assert bad == ["global rank 2: Rollouts: advantages[7] is nan: advantages must be finite"]


def test_micro_batch_sample_ids_are_integers_in_range() -> None:
    assert sample_id_problem([0, 2**63 - 1]) is None
    assert sample_id_problem(torch.tensor([3, 4], dtype=torch.int32)) is None
    assert sample_id_problem([1, 2.5]) == "sample_ids[1] is 2.5 (float): give integers"
    assert (
        sample_id_problem(torch.tensor([1.0]))
        == "sample_ids is a torch.float32 tensor: give integers"
    )
    assert sample_id_problem([2**63]).startswith("sample_ids[0] is 9223372036854775808, outside")
    assert sample_id_problem("12").startswith("sample_ids is a str")
