"""Tier 1: the demo's sampler (:mod:`mopd.profiling.demo.sampling`) in one process.

What the demo relies on: a sample's noise depends on its seed, stream and id only (so two meshes
sample the same tokens from the same logits); the Gumbel-max rule draws from
``softmax(logits / T)``; the row of the asked position is the one returned, over the real
vocabulary; every copy of a response must agree, and a disagreement or a missing sample is named;
bad settings are refused with the values named. (The TP/CP/PP collectives run in the demo's
8-rank tests, tests/launch/test_demo.py, against a one-rank run.)
"""

from __future__ import annotations

import pytest
import torch

from mopd.profiling.demo.sampling import (
    SamplingConfig,
    choose_tokens,
    gumbel_noise,
    judge_copies,
    last_position_logits,
)


def test_noise_is_keyed_by_seed_stream_and_sample() -> None:
    a = gumbel_noise(7, seed=1, stream=2, rows=3, vocab_size=11)
    assert a.shape == (3, 11) and a.dtype == torch.float64
    assert torch.equal(a, gumbel_noise(7, seed=1, stream=2, rows=3, vocab_size=11))
    # more rows extend the same draws: row t is the sample's t-th token whatever the length
    assert torch.equal(a[:2], gumbel_noise(7, seed=1, stream=2, rows=2, vocab_size=11))
    for other in (
        gumbel_noise(8, seed=1, stream=2, rows=3, vocab_size=11),
        gumbel_noise(7, seed=2, stream=2, rows=3, vocab_size=11),
        gumbel_noise(7, seed=1, stream=3, rows=3, vocab_size=11),
    ):
        assert not torch.equal(a, other)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_gumbel_max_draws_from_the_tempered_softmax(temperature: float) -> None:
    logits_V = torch.tensor([2.0, 0.5, -1.0, 0.0, 1.0])
    n = 20_000
    noise = torch.cat([gumbel_noise(i, seed=3, stream=0, rows=1, vocab_size=5) for i in range(n)])
    tokens = choose_tokens(logits_V.expand(n, -1), noise, temperature)
    freq = torch.bincount(tokens, minlength=5).double() / n
    want = torch.softmax(logits_V.double() / temperature, dim=0)
    # binomial std <= 0.0036 at n = 20000: 5 sigma
    assert torch.allclose(freq, want, atol=0.018), (freq, want)


def test_choose_tokens_is_the_argmax_of_scaled_logits_plus_noise() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, -5.0, 0.0]])
    noise = torch.tensor([[2.9, 0.0, 0.0], [0.0, 0.0, 2.6]], dtype=torch.float64)
    assert choose_tokens(logits, noise, 1.0).tolist() == [1, 0]
    assert choose_tokens(logits, noise, 2.0).tolist() == [0, 2]  # 3/2 < 2.9; 5/2 < 2.6


def test_last_position_logits_reads_each_sequence_row_over_the_real_vocabulary() -> None:
    logits_BSV = torch.randn(3, 8, 6)
    positions = torch.tensor([7, 0, 4])
    got = last_position_logits(
        logits_BSV,
        positions,
        torch.arange(8),
        cp_group=None,
        tp_group=None,
        vocab_size=5,
        timeout_s=None,
    )
    assert torch.equal(got, logits_BSV[torch.arange(3), positions, :5])


def test_last_position_logits_follows_the_local_positions() -> None:
    """A CP rank's rows are its zigzag positions: the row is found by position, not index."""
    logits_BSV = torch.randn(2, 4, 3)
    local_positions = torch.tensor([2, 3, 12, 13])  # chunks 1 and 6 of 8 (cp=4, rank 1)
    got = last_position_logits(
        logits_BSV,
        torch.tensor([12, 3]),
        local_positions,
        cp_group=None,
        tp_group=None,
        vocab_size=3,
        timeout_s=None,
    )
    assert torch.equal(got, torch.stack([logits_BSV[0, 2], logits_BSV[1, 1]]))


def _table(rows: list[list[list[int]]], width: int = 4) -> torch.Tensor:
    """``[world, N, 1 + width]`` from per-rank lists of ``[length, *tokens]`` or ``[]``."""
    out = torch.full((len(rows), len(rows[0]), 1 + width), -1, dtype=torch.int64)
    for r, per_rank in enumerate(rows):
        for k, entry in enumerate(per_rank):
            if entry:
                out[r, k, : len(entry)] = torch.tensor(entry)
    return out


def test_judge_copies_agrees_on_equal_copies() -> None:
    every = _table([[[2, 5, 6], []], [[2, 5, 6], [1, 9]], [[], [1, 9]]])
    got = judge_copies(every, [10, 11])
    assert {s: t.tolist() for s, t in got.items()} == {10: [5, 6], 11: [9]}


def test_judge_copies_names_a_disagreement_and_a_missing_sample() -> None:
    every = _table([[[2, 5, 6], [], []], [[2, 5, 7], [1, 3], []]])
    with pytest.raises(ValueError) as exc:
        judge_copies(every, [10, 11, 12])
    msg = str(exc.value)
    assert "sample 10: global ranks [1] hold other tokens than global rank 0" in msg
    assert "sample 12: no rank sampled it" in msg and "sample 11" not in msg


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
        ({"temperature": 0.0}, "temperature must be > 0, got 0.0"),
        ({"stop_token": 16}, "stop_token 16 is outside the vocabulary [0, 16)"),
    ],
)
def test_bad_sampling_settings_are_refused(kwargs: dict, message: str) -> None:
    base = {"max_new_tokens": 4, "vocab_size": 16}
    with pytest.raises(ValueError) as exc:
        SamplingConfig(**{**base, **kwargs})
    assert message in str(exc.value)
