"""Tier 1: the tier-2 loop tests' float64 check (:class:`tests.support.mcore_ref.Float64Check`)
fails where it must: a loss or a gradient past its tolerance, a missing loss, no gradient at all.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.mcore_ref import Float64Check, Reference


def _model(grad: float = 1.0) -> tuple[torch.nn.Module, dict[str, str], Reference]:
    model = torch.nn.Linear(3, 2)
    for p in model.parameters():
        p.grad = torch.full_like(p, grad)
    names = {n: n for n, _ in model.named_parameters()}
    ref = Reference(2.0, {n: torch.ones_like(p) for n, p in model.named_parameters()})
    return model, names, ref


def test_a_step_within_the_tolerances_passes_and_reports_its_worst_errors():
    model, names, ref = _model()
    check = Float64Check()
    check.compare(ref, loss=2.0 * (1 + 5e-6), holds_loss=True, model=model, names=names)
    check.assert_ok()
    assert check.summary() == "largest relative loss error 5.00e-06, gradient 0.00e+00"


@pytest.mark.parametrize(
    ("loss", "grad", "match"),
    [
        (2.0 * (1 + 2e-5), 1.0, r"case: loss 2\.00004000 vs direct 2\.00000000"),
        (2.0, 1.0 + 2e-4, r"case: weight: \|main_grad - ref\| = "),
    ],
    ids=["loss", "gradient"],
)
def test_a_step_past_a_tolerance_fails_naming_it(loss: float, grad: float, match: str):
    model, names, ref = _model(grad)
    check = Float64Check()
    check.compare(ref, loss=loss, holds_loss=True, model=model, names=names, what="case")
    with pytest.raises(AssertionError, match=match):
        check.assert_ok()


def test_a_missing_loss_or_no_gradient_fails():
    model, names, ref = _model()
    with pytest.raises(AssertionError, match="no loss on a rank that holds it"):
        Float64Check().compare(ref, loss=None, holds_loss=True, model=model, names=names)
    with pytest.raises(AssertionError, match="no gradient was compared"):
        Float64Check().assert_ok()
