"""Tier 1: the vocabulary rule (:mod:`mopd.mcore.lm_head`): the real vocabulary is said once,
models may each be padded to their own size, and a size read off the models must agree."""

from __future__ import annotations

import pytest

from mopd.mcore.lm_head import MEGATRON_VOCAB_MULTIPLE, looks_padded, resolve_vocab_size


def test_a_given_vocabulary_wins_over_every_padded_size() -> None:
    sizes = [("teacher 0", 1024), ("teacher 1", 1008), ("the student", 1008)]
    assert resolve_vocab_size(1000, sizes) == (1000, True)
    assert resolve_vocab_size(1008, sizes) == (1008, True)


def test_a_given_vocabulary_larger_than_a_model_is_refused() -> None:
    with pytest.raises(ValueError) as info:
        resolve_vocab_size(1010, [("teacher 0", 1024), ("the student", 1008)])
    assert str(info.value) == (
        "vocab_size=1010 is larger than the vocabulary of the student (1008): every model must "
        "be built with at least the real vocabulary (teacher 0 1024, the student 1008)"
    )


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "1000"])
def test_a_given_vocabulary_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ValueError, match="vocab_size must be a positive int"):
        resolve_vocab_size(bad, [])  # type: ignore[arg-type]


def test_without_one_the_models_must_agree() -> None:
    assert resolve_vocab_size(None, [("teacher 0", 64), ("the student", 64)]) == (64, False)
    with pytest.raises(ValueError) as info:
        resolve_vocab_size(None, [("teacher 0", 1024), ("the student", 1008)])
    msg = str(info.value)
    assert msg.startswith(
        "the models' vocab_size attributes differ (teacher 0 1024, the student 1008)"
    )
    assert msg.endswith("pass vocab_size=<the tokenizer's vocabulary, at most 1008>")


def test_looks_padded_is_megatrons_multiple_above_every_token_seen() -> None:
    assert MEGATRON_VOCAB_MULTIPLE == 128
    assert looks_padded(1024, 999)
    assert not looks_padded(1024, 1023)  # the last id is used: not padding
    assert not looks_padded(1008, 999)  # not a multiple of 128
    assert not looks_padded(64, 10)
