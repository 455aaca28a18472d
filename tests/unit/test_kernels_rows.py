"""Tier 1: the row-movement API (mopd.kernels.rows) and its torch twins, on CPU.

Checks the twins bit for bit against naive Python loops over rows (random shapes, every width
of dtype, strided views, empty and one-row cases), the validation rules (each bad input raises
``ValueError`` naming the values), and the backend rule of mopd.kernels.backend.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from mopd.common.log import reset_once
from mopd.kernels import backend as backend_mod
from mopd.kernels.rows import copy_runs, gather_rows, scatter_rows
from mopd.kernels.rows.torch_rows import (
    copy_runs_torch,
    gather_rows_torch,
    run_rows,
    scatter_rows_torch,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.float64]


def random_rows(n: int, h: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """``[n, h]`` of random *bits* (NaNs and infs included for floats)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    # 1-D, viewed, then shaped: a [1, k] uint8 may report stride(0) == 1 (torch 2.11, CUDA),
    # which .view(dtype) refuses for a wider dtype
    raw = torch.randint(0, 256, (n * h * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(n, h)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (so NaN payloads compare exactly)."""
    return t.contiguous().view(torch.uint8)


def poisoned(n: int, h: int, dtype: torch.dtype) -> torch.Tensor:
    """``[n, h]`` filled with the byte 0xA5, a pattern a correct kernel overwrites."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return torch.full((n * h * itemsize,), 0xA5, dtype=torch.uint8).view(dtype).view(n, h)


def naive_gather(src_NH: torch.Tensor, index: list[int], out_RH: torch.Tensor) -> torch.Tensor:
    for r, i in enumerate(index):
        out_RH[r] = src_NH[i]
    return out_RH


def naive_scatter(src_RH: torch.Tensor, index: list[int], out_NH: torch.Tensor) -> torch.Tensor:
    for r, i in enumerate(index):
        out_NH[i] = src_RH[r]
    return out_NH


def naive_runs(src_NH, src_start, dst_start, length, out_MH) -> torch.Tensor:
    for s, d, n in zip(src_start, dst_start, length, strict=True):
        for j in range(n):
            out_MH[d + j] = src_NH[s + j]
    return out_MH


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(4))
def test_gather_matches_loop(dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 40, (1,), generator=gen))
    h = int(torch.randint(1, 37, (1,), generator=gen))
    r = int(torch.randint(0, 50, (1,), generator=gen))
    src = random_rows(n, h, dtype, gen)
    index = torch.randint(0, n, (r,), generator=gen)  # repeats allowed in a gather
    out = gather_rows(src, index, out_RH=poisoned(r, h, dtype))
    ref = naive_gather(src, index.tolist(), poisoned(r, h, dtype))
    assert torch.equal(bits(out), bits(ref))
    assert torch.equal(bits(gather_rows(src, index)), bits(ref))  # allocated output


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(4))
def test_scatter_matches_loop(dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator().manual_seed(100 + seed)
    n = int(torch.randint(1, 40, (1,), generator=gen))
    h = int(torch.randint(1, 37, (1,), generator=gen))
    r = int(torch.randint(0, n + 1, (1,), generator=gen))
    src = random_rows(r, h, dtype, gen)
    index = torch.randperm(n, generator=gen)[:r]
    out = scatter_rows(src, index, poisoned(n, h, dtype))
    ref = naive_scatter(src, index.tolist(), poisoned(n, h, dtype))
    assert torch.equal(bits(out), bits(ref))
    untouched = sorted(set(range(n)) - set(index.tolist()))
    assert torch.equal(bits(out[untouched]), bits(poisoned(len(untouched), h, dtype)))


def random_runs(n: int, m: int, k: int, gen: torch.Generator) -> tuple[list[int], ...]:
    """``k`` runs with distinct, non-overlapping destinations in ``[0, m)`` (some empty)."""
    cuts = sorted(torch.randint(0, m + 1, (2 * k,), generator=gen).tolist())
    src_start, dst_start, length = [], [], []
    for a, b in zip(cuts[0::2], cuts[1::2], strict=True):
        length_k = min(b - a, n)
        length.append(length_k)
        dst_start.append(a)
        src_start.append(int(torch.randint(0, n - length_k + 1, (1,), generator=gen)))
    return src_start, dst_start, length


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(4))
def test_copy_runs_matches_loop(dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator().manual_seed(200 + seed)
    n = int(torch.randint(1, 60, (1,), generator=gen))
    m = int(torch.randint(1, 60, (1,), generator=gen))
    h = int(torch.randint(1, 37, (1,), generator=gen))
    k = int(torch.randint(0, 8, (1,), generator=gen))
    src = random_rows(n, h, dtype, gen)
    s, d, ln = random_runs(n, m, k, gen)
    as_t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    out = copy_runs(src, as_t(s), as_t(d), as_t(ln), poisoned(m, h, dtype))
    ref = naive_runs(src, s, d, ln, poisoned(m, h, dtype))
    assert torch.equal(bits(out), bits(ref))
    # the caller's total (as the executor passes it) gives the same bytes
    out = copy_runs(src, as_t(s), as_t(d), as_t(ln), poisoned(m, h, dtype), num_rows=sum(ln))
    assert torch.equal(bits(out), bits(ref))


def test_run_rows_expands_in_order() -> None:
    src_rows, dst_rows = run_rows(
        torch.tensor([5, 0, 9]), torch.tensor([0, 3, 3]), torch.tensor([3, 0, 2])
    )
    assert src_rows.tolist() == [5, 6, 7, 9, 10]
    assert dst_rows.tolist() == [0, 1, 2, 3, 4]


def test_strided_views() -> None:
    """Row strides are free: a column slice as source, a column slice of a wider buffer as out."""
    gen = torch.Generator().manual_seed(7)
    big = random_rows(20, 16, torch.bfloat16, gen)
    src = big[:, 3:12]  # stride(0) = 16, starts at element 3
    index = torch.randint(0, 20, (11,), generator=gen)
    wide_out = poisoned(11, 24, torch.bfloat16)
    out = gather_rows(src, index, out_RH=wide_out[:, 5:14])
    assert torch.equal(
        bits(out), bits(naive_gather(src, index.tolist(), poisoned(11, 9, src.dtype)))
    )
    assert torch.equal(bits(wide_out[:, :5]), bits(poisoned(11, 5, src.dtype)))
    assert torch.equal(bits(wide_out[:, 14:]), bits(poisoned(11, 10, src.dtype)))
    dst = poisoned(20, 24, torch.bfloat16)
    perm = torch.randperm(20, generator=gen)[:11]
    scatter_rows(out, perm, dst[:, 1:10])
    ref = naive_scatter(out, perm.tolist(), poisoned(20, 24, torch.bfloat16)[:, 1:10].clone())
    assert torch.equal(bits(dst[:, 1:10]), bits(ref))


def test_transpose_as_gather() -> None:
    """[S, B, H] -> [B, S, H] is one gather with index b * S + s -> s * B + b."""
    gen = torch.Generator().manual_seed(3)
    s_len, b_len, h = 7, 3, 5
    src_SBH = random_rows(s_len * b_len, h, torch.float16, gen).view(s_len, b_len, h)
    b_idx, s_idx = torch.meshgrid(torch.arange(b_len), torch.arange(s_len), indexing="ij")
    index = (s_idx * b_len + b_idx).reshape(-1)
    out = gather_rows(src_SBH.view(-1, h), index).view(b_len, s_len, h)
    assert torch.equal(bits(out), bits(src_SBH.transpose(0, 1)))


def test_empty_and_one_row() -> None:
    src = torch.arange(12.0).view(3, 4)
    empty = torch.empty(0, dtype=torch.int64)
    assert gather_rows(src, empty).shape == (0, 4)
    out = torch.full((3, 4), -1.0)
    assert torch.equal(scatter_rows(torch.empty(0, 4), empty, out), torch.full((3, 4), -1.0))
    assert torch.equal(copy_runs(src, empty, empty, empty, out), torch.full((3, 4), -1.0))
    one = torch.tensor([2])
    assert torch.equal(gather_rows(src, one), src[2:3])
    assert torch.equal(scatter_rows(src[:1], one, out)[2], src[0])


def test_twins_share_signatures() -> None:
    import inspect

    from mopd.kernels.rows import cupy_rows

    for twin, kernel in (
        (gather_rows_torch, cupy_rows.gather_rows_cupy),
        (scatter_rows_torch, cupy_rows.scatter_rows_cupy),
        (copy_runs_torch, cupy_rows.copy_runs_cupy),
    ):
        assert inspect.signature(twin) == inspect.signature(kernel), twin.__name__


# ---- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("index", "match"),
    [
        (torch.tensor([0, 3]), r"out of range: values in \[0, 3\], valid range is \[0, 3\)"),
        (torch.tensor([-1, 0]), r"out of range: values in \[-1, 0\]"),
        (torch.tensor([0, 1], dtype=torch.int32), "1-D int64 tensor.*torch.int32"),
        (torch.tensor([[0, 1]]), r"1-D int64 tensor, got shape \(1, 2\)"),
    ],
)
def test_bad_index_raises(index: torch.Tensor, match: str) -> None:
    src = torch.zeros(3, 4)
    with pytest.raises(ValueError, match=match):
        gather_rows(src, index)
    with pytest.raises(ValueError, match=match):
        scatter_rows(torch.zeros(index.shape[-1], 4), index, src)


def test_check_bounds_false_skips_value_checks_only() -> None:
    src = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="int64"):
        gather_rows(src, torch.tensor([0], dtype=torch.int32), check_bounds=False)
    assert gather_rows(src, torch.tensor([2]), check_bounds=False).shape == (1, 4)


def test_shape_mismatches_raise() -> None:
    src = torch.zeros(5, 4)
    index = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="out_RH has 3 rows but index_R has 2 entries"):
        gather_rows(src, index, out_RH=torch.zeros(3, 4))
    with pytest.raises(ValueError, match="row widths differ: src_NH has H=4, out_RH has H=5"):
        gather_rows(src, index, out_RH=torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"torch.float32 but out_RH is torch.float16"):
        gather_rows(src, index, out_RH=torch.zeros(2, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="src_RH has 3 rows but index_R has 2 entries"):
        scatter_rows(torch.zeros(3, 4), index, src)
    with pytest.raises(ValueError, match=r"must be 2-D \[rows, H\], got shape \(5, 2, 2\)"):
        gather_rows(src.view(5, 2, 2), index)


def test_non_contiguous_rows_rejected() -> None:
    src = torch.zeros(4, 6)
    with pytest.raises(ValueError, match=r"rows must be contiguous \(stride\(1\) == 1\)"):
        gather_rows(src.t(), torch.tensor([0]))
    with pytest.raises(ValueError, match="rows must be contiguous"):
        gather_rows(src[:, ::2], torch.tensor([0]))
    with pytest.raises(ValueError, match="rows overlap"):
        scatter_rows(torch.zeros(1, 6), torch.tensor([0]), src.view(-1)[:6].expand(4, 6))
    # a column slice has contiguous rows: accepted
    assert gather_rows(src[:, 1:4], torch.tensor([3])).shape == (1, 3)


def test_copy_runs_validation() -> None:
    src, out = torch.zeros(5, 2), torch.zeros(6, 2)
    t = lambda *xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    with pytest.raises(ValueError, match="run arrays differ in length"):
        copy_runs(src, t(0), t(0, 1), t(1), out)
    with pytest.raises(ValueError, match=r"negative run length \(-1\)"):
        copy_runs(src, t(0), t(0), t(-1), out)
    with pytest.raises(ValueError, match=r"source runs out of range.*ends <= 6.*5 rows"):
        copy_runs(src, t(2), t(0), t(4), out)
    with pytest.raises(ValueError, match=r"destination runs out of range.*ends <= 7.*6 rows"):
        copy_runs(src, t(0), t(3), t(4), out)
    with pytest.raises(ValueError, match="length_K must be a 1-D int64"):
        copy_runs(src, t(0), t(0), torch.tensor([1], dtype=torch.int32), out)
    with pytest.raises(ValueError, match=r"num_rows=3 but the runs hold 4 rows"):
        copy_runs(src, t(0, 3), t(0, 3), t(2, 2), out, num_rows=3)
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="num_rows must be a non-negative int"):
            copy_runs(src, t(0), t(0), t(2), out, num_rows=bad)
    with pytest.raises(ValueError, match="num_rows=2 but there are no runs"):
        copy_runs(src, t(), t(), t(), out, num_rows=2)


def test_bad_variant_and_backend_raise() -> None:
    src = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="variant must be None or one of"):
        gather_rows(src, torch.tensor([0]), variant="fastest")
    with pytest.raises(ValueError, match="backend must be one of"):
        gather_rows(src, torch.tensor([0]), backend="triton")  # type: ignore[arg-type]


def test_variant_ignored_by_twin_warns() -> None:
    with pytest.warns(UserWarning, match="variant='warp' is ignored"):
        gather_rows(torch.zeros(3, 4), torch.tensor([0]), variant="warp")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gather_rows(torch.zeros(3, 4), torch.tensor([0]))


# ---- backend choice --------------------------------------------------------------------------


def test_explicit_cupy_on_cpu_raises() -> None:
    src = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="backend='cupy' needs CUDA tensors, got tensors on"):
        gather_rows(src, torch.tensor([0]), backend="cupy")
    with pytest.raises(ValueError, match="backend='cupy' needs CUDA tensors"):
        copy_runs(
            src,
            torch.tensor([0]),
            torch.tensor([0]),
            torch.tensor([1]),
            src.clone(),
            backend="cupy",
        )


class _FakeCuda:
    """Just enough of a CUDA tensor for resolve_backend (it reads .device and .is_cuda)."""

    is_cuda = True
    device = torch.device("cuda", 0)


def test_auto_falls_back_once_when_cupy_missing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(backend_mod, "_cupy_import_error", lambda: "ImportError: no cupy")
    reset_once()
    with caplog.at_level(logging.WARNING, logger=backend_mod.__name__):
        assert backend_mod.resolve_backend("auto", "op_x", _FakeCuda()) == "torch"
        assert backend_mod.resolve_backend("auto", "op_x", _FakeCuda()) == "torch"
    fallbacks = [r for r in caplog.records if "falling back" in r.getMessage()]
    assert len(fallbacks) == 1 and "no cupy" in fallbacks[0].getMessage()
    with pytest.raises(RuntimeError, match="backend='cupy' requested but CuPy is unusable"):
        backend_mod.resolve_backend("cupy", "op_x", _FakeCuda())


def test_auto_picks_cupy_on_cuda_when_present(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend_mod, "_cupy_import_error", lambda: None)
    assert backend_mod.resolve_backend("auto", "op_y", _FakeCuda()) == "cupy"
    assert backend_mod.resolve_backend("cupy", "op_y", _FakeCuda()) == "cupy"
    assert backend_mod.resolve_backend("torch", "op_y", _FakeCuda()) == "torch"
    # CPU tensors: the twin, silently, even with CuPy present
    assert backend_mod.resolve_backend("auto", "op_y", torch.zeros(1)) == "torch"


def test_inputs_requiring_grad_move_outside_autograd() -> None:
    src = torch.randn(4, 3, requires_grad=True)
    out = torch.zeros(4, 3, requires_grad=True)
    index = torch.tensor([3, 1, 2, 0])
    assert torch.equal(gather_rows(src, index).detach(), src.detach()[index])
    scatter_rows(src, index, out)
    assert torch.equal(out.detach()[index], src.detach())
    run = torch.tensor([0])
    copy_runs(src, run, run, torch.tensor([4]), out)
    assert torch.equal(out.detach(), src.detach())


def test_bulk_variant_needs_sm90_when_named(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On a pre-sm_90 device: a named bulk variant raises; a bulk default falls back, logged once."""
    from mopd.kernels.rows import cupy_rows

    cuda0 = torch.device("cuda", 0)
    monkeypatch.setattr(cupy_rows, "_device_facts", lambda index: (108, (8, 0)))
    reset_once()
    with pytest.raises(ValueError, match=r"variant 'bulk' needs an sm_90\+ device.*sm_80"):
        cupy_rows._plan("gather", "bulk", 16, cuda0)
    assert cupy_rows._plan("gather", "flat", 16, cuda0) == ("flat", 108, 256)
    monkeypatch.setitem(cupy_rows.DEFAULT_VARIANTS, "gather", "bulk16")
    with caplog.at_level(logging.WARNING, logger=cupy_rows.__name__):
        assert cupy_rows._plan("gather", None, 16, cuda0) == ("warp", 108, 256)
        assert cupy_rows._plan("gather", None, 16, cuda0) == ("warp", 108, 256)
    assert len([r for r in caplog.records if "needs sm_90+" in r.getMessage()]) == 1
    monkeypatch.setattr(cupy_rows, "_device_facts", lambda index: (132, (9, 0)))
    assert cupy_rows._plan("gather", None, 16, cuda0) == ("bulk16", 132, 32)
    assert cupy_rows._plan("runs", "bulk", 8, cuda0) == ("warp", 132, 256)  # misaligned


def test_set_default_variants_validates_and_returns_the_old_ones() -> None:
    from mopd.kernels import set_default_variants
    from mopd.kernels.rows import cupy_rows

    before = dict(cupy_rows.DEFAULT_VARIANTS)
    try:
        old = set_default_variants({"gather": "flat", "copy_runs": "bulk16"})
        assert old == before
        assert cupy_rows.default_variant("gather") == "flat"
        assert cupy_rows.default_variant("copy_runs") == "bulk16"
        assert cupy_rows.default_variant("scatter") == before["scatter"]
        with pytest.raises(
            ValueError, match=r"unknown op\(s\) \['pack'\].*variant\(s\) \['fast'\]"
        ):
            set_default_variants({"pack": "warp", "gather": "fast"})
        assert cupy_rows.default_variant("gather") == "flat"  # nothing changed
    finally:
        set_default_variants(before)
    assert before == cupy_rows.DEFAULT_VARIANTS


def test_overlapping_source_and_destination_raise() -> None:
    buf = torch.arange(40.0).view(10, 4)
    idx = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="out_RH overlaps src_NH in memory"):
        gather_rows(buf, idx, out_RH=buf[5:8])
    with pytest.raises(ValueError, match="out_NH overlaps src_RH in memory"):
        scatter_rows(buf[:3], torch.tensor([4, 5, 6]), buf)
    run = torch.tensor([0])
    with pytest.raises(ValueError, match="out_MH overlaps src_NH in memory"):
        copy_runs(buf[:4], run, run, torch.tensor([2]), buf[2:6])
    # disjoint views of one buffer are fine: other rows, or other columns of the same rows
    gather_rows(buf[:5], idx, out_RH=buf[5:8])
    left, right = buf[:, :2], buf[:, 2:]
    scatter_rows(left[:3], torch.tensor([7, 8, 9]), right)
    assert torch.equal(buf[7:10, 2:], buf[:3, :2])


def test_rows_overlap_rule() -> None:
    from mopd.kernels.rows import rows_overlap

    x = torch.zeros(8, 6)
    assert rows_overlap(x[:4], x[3:])
    assert not rows_overlap(x[:4], x[4:])
    assert not rows_overlap(x[:, :3], x[:, 3:])  # interleaved column halves
    assert rows_overlap(x[:, :4], x[:, 3:])  # one shared column
    assert not rows_overlap(x[:, 4:], x[1:, :4])  # the period wraps: still disjoint
    assert not rows_overlap(x[:0], x)  # empty
    assert not rows_overlap(x, torch.zeros(8, 6))  # other storage
    one = x[2:3, 1:2]
    assert rows_overlap(one, x[:, 1:2]) and not rows_overlap(one, x[:, 2:])


def test_compile_failure_falls_back_to_the_twin_under_auto_only(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from mopd.kernels.backend import KernelCompileError
    from mopd.kernels.rows import ops as rows_mod

    def broken(*args: object, **kwargs: object) -> None:
        raise KernelCompileError("nvcc could not build rows.cu: no compiler")

    monkeypatch.setattr(rows_mod, "_pick", lambda backend, op, variant, *ts: "cupy")
    monkeypatch.setattr(rows_mod, "gather_rows_cupy", broken)
    reset_once()
    src, idx = torch.arange(12.0).view(6, 2), torch.tensor([5, 0])
    with caplog.at_level(logging.WARNING, logger=backend_mod.__name__):
        for _ in range(2):
            assert torch.equal(gather_rows(src, idx), src[idx])
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "gather_rows: nvcc could not build rows.cu" in msgs[0], msgs
    with pytest.raises(KernelCompileError, match="no compiler"):
        gather_rows(src, idx, backend="cupy")


def test_a_failed_build_is_remembered_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    from mopd.kernels import cupy_loader
    from mopd.kernels.backend import KernelCompileError

    builds: list[tuple] = []

    def module(*key: object) -> None:
        builds.append(key)
        raise OSError("nvcc: not found")

    monkeypatch.setattr(cupy_loader, "_module", module)
    monkeypatch.setattr(cupy_loader, "_failures", {})
    for name in ("k1", "k2", "k1"):
        with pytest.raises(KernelCompileError, match=r"nvcc could not build rows\.cu.*not found"):
            cupy_loader._function("rows.cu", name, 0, "nvcc", ("X=1",))
    assert builds == [("rows.cu", 0, "nvcc", ("X=1",))]
