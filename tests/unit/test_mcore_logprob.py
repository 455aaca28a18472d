"""Tier 1: :func:`mopd.mcore.token_logprobs` against a float64 log-softmax, value and gradient
(its TP > 1 path runs in the tier-2 RL loss, tests/torchrun/test_mcore_onpolicy.py)."""

from __future__ import annotations

import torch

from mopd.mcore.logprob import token_logprobs


def test_logprobs_and_gradient_match_float64_with_padded_vocab() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 40, generator=g, requires_grad=True)
    labels = torch.randint(0, 37, (3, 5), generator=g)
    weight = torch.randn(3, 5, generator=g)
    got = token_logprobs(logits, labels, vocab_size=37)
    (got * weight).sum().backward()
    x = logits.detach().double()[..., :37].requires_grad_(True)
    want = torch.log_softmax(x, -1).gather(-1, labels[..., None])[..., 0]
    (want * weight.double()).sum().backward()
    assert got.dtype == torch.float32 and got.shape == (3, 5)
    assert torch.allclose(got.double(), want, rtol=0, atol=1e-5)
    assert torch.allclose(logits.grad[..., :37].double(), x.grad, rtol=0, atol=1e-6)
    assert torch.equal(logits.grad[..., 37:], torch.zeros(3, 5, 3))  # padding gets nothing


def test_cross_entropy_is_the_negative_log_probability_over_the_real_vocabulary() -> None:
    from mopd.mcore import cross_entropy

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 7, 24, generator=g, requires_grad=True)
    labels = torch.randint(0, 20, (2, 7), generator=g)
    ce = cross_entropy(logits, labels, vocab_size=20)
    ce.sum().backward()
    x = logits.detach().double()[..., :20].requires_grad_(True)
    want = torch.nn.functional.cross_entropy(
        x.reshape(-1, 20), labels.reshape(-1), reduction="none"
    )
    want.sum().backward()
    assert torch.allclose(ce.double().reshape(-1), want, rtol=0, atol=1e-5)
    assert torch.allclose(logits.grad[..., :20].double(), x.grad, rtol=0, atol=1e-6)
    assert torch.equal(logits.grad[..., 20:], torch.zeros(2, 7, 4))
