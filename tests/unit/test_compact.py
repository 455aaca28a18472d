"""Tier 1: compact per-teacher rows and the layout order (``layout_rows`` / ``compact_rows``).

What a caller relies on: ``layout_rows`` puts each teacher's compact ``[N_k, H_k]`` rows at the
``[N]`` layout rows ``owner_N`` gives it, in order, zero elsewhere (padding, ``-1``, and the
other teachers' rows); ``compact_rows`` takes them back out, so the two are inverses, bit for
bit, for any owners, hidden sizes and dtypes; a wrong row count is a ValueError naming both.
"""

from __future__ import annotations

import pytest
import torch

from mopd.bridge import compact_rows, layout_rows

HIDDEN = {0: 3, 1: 5, 2: 1}  # teacher -> H_k (teacher 3 owns no row at all)


def _owners(n: int, seed: int) -> torch.Tensor:
    """``[N]`` int64 owners in ``-1..2`` (``-1``: padding), drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1, 3, (n,), generator=g, dtype=torch.int64)


def _compact(owner_N: torch.Tensor, dtype: torch.dtype, seed: int) -> dict[int, torch.Tensor]:
    """``teacher -> [N_k, H_k]`` random rows, one per row ``owner_N`` gives teacher k."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, h in {**HIDDEN, 3: 4}.items():
        n = int((owner_N == k).sum())
        out[k] = torch.randn((n, h), generator=g, dtype=torch.float64).to(dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("seed", range(5))
def test_layout_rows_then_compact_rows_is_the_identity(dtype: torch.dtype, seed: int) -> None:
    owner_N = _owners(40 + 7 * seed, seed)
    rows = _compact(owner_N, dtype, seed + 100)
    full = layout_rows(rows, owner_N)
    assert sorted(full) == sorted(rows)
    for k, t_NH in full.items():
        assert t_NH.shape == (owner_N.numel(), rows[k].shape[1]) and t_NH.dtype == dtype
        mine = (owner_N == k).nonzero().reshape(-1)
        # teacher k's j-th compact row sits at its j-th layout row, in order
        for j, n in enumerate(mine.tolist()):
            assert torch.equal(t_NH[n].view(torch.int8), rows[k][j].view(torch.int8))
        rest = torch.ones(owner_N.numel(), dtype=torch.bool)
        rest[mine] = False
        assert not t_NH[rest].any()  # padding and the other teachers' rows are zero
    back = compact_rows(full, owner_N)
    for k, t in rows.items():
        assert back[k].shape == t.shape
        assert torch.equal(back[k].view(torch.int8), t.view(torch.int8))


@pytest.mark.parametrize("seed", range(3))
def test_compact_rows_then_layout_rows_keeps_each_teachers_rows(seed: int) -> None:
    owner_N = _owners(33, seed)
    g = torch.Generator().manual_seed(seed)
    full = {k: torch.randn((owner_N.numel(), h), generator=g) for k, h in HIDDEN.items()}
    again = layout_rows(compact_rows(full, owner_N), owner_N)
    for k, t_NH in full.items():
        mine = (owner_N == k)[:, None]
        assert torch.equal(again[k], torch.where(mine, t_NH, torch.zeros_like(t_NH)))


def test_a_wrong_row_count_is_a_value_error_naming_both() -> None:
    owner_N = torch.tensor([0, 1, -1, 0, 0])
    with pytest.raises(
        ValueError, match=r"teacher 0: \(2, 4\) compact rows, but owner_N gives it 3"
    ):
        layout_rows({0: torch.zeros(2, 4)}, owner_N)
    with pytest.raises(ValueError, match=r"teacher 1: \(1,\) compact rows"):
        layout_rows({1: torch.zeros(1)}, owner_N)
