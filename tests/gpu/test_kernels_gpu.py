"""Tier 3: the CuPy row kernels on a GPU, bit-exact against their torch twins.

Every kernel (gather, scatter, runs) in every variant, on fresh random bits, for each width of
dtype, odd shapes (H not a multiple of 8, one row, empty index) and misaligned views (starting
at element 1, so the 2-byte path runs); outputs are poisoned first so an unwritten row fails.
Also: the launch follows torch's current stream (a non-default stream whose input is produced
behind a long sleep), no host synchronization happens with ``check_bounds=False``, an
explicit ``backend="cupy"`` on CPU tensors raises, the per-op defaults are exact, and the bulk
variants run the copy engine on sm_90+ (their fallback elsewhere). The bulk variants' own
checks run last (end of file), so a broken one cannot hide the others' results. The helpers
build bytes 1-D before viewing them as a dtype (a one-row ``[1, k]`` uint8 tensor may report
``stride(0) == 1``, which ``.view(dtype)`` refuses: round 1's 105 failures).
"""

from __future__ import annotations

import pytest
import torch

from mopd.kernels.backend import cupy_available, resolve_backend
from mopd.kernels.rows import copy_runs, cupy_rows, gather_rows, scatter_rows
from mopd.kernels.rows.cupy_rows import VARIANTS
from mopd.kernels.rows.torch_rows import copy_runs_torch, gather_rows_torch, scatter_rows_torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (tier 3)"),
    pytest.mark.skipif(not cupy_available(), reason="needs CuPy (import cupy failed)"),
]

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8]


def rand_rows(n: int, h: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """``[n, h]`` CUDA rows of random bits (NaN payloads included).

    The bytes are made 1-D, viewed as ``dtype``, then shaped: a ``[1, k]`` uint8 tensor may
    report ``stride(0) == 1`` (torch 2.11 on CUDA did), and ``.view(dtype)`` to a wider dtype
    then refuses it.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(
        0, 256, (n * h * itemsize,), dtype=torch.uint8, device="cuda", generator=gen
    )
    return raw.view(dtype).view(n, h)


def poison(n: int, h: int, dtype: torch.dtype) -> torch.Tensor:
    """``[n, h]`` CUDA rows of the byte 0xA5 (built 1-D first, as :func:`rand_rows`)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.full((n * h * itemsize,), 0xA5, dtype=torch.uint8, device="cuda")
    return raw.view(dtype).view(n, h)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def cuda_gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


# (n rows of the source, H, element offset of the views)
SHAPES = [
    (1000, 4096, 0),  # aligned: 16-byte path
    (333, 1001, 0),  # H not a multiple of 8
    (100, 1100, 0),  # bf16/fp16 rows of 2200 bytes: the 8-byte path
    (257, 4096, 1),  # view at element 1: misaligned
    (5, 7, 0),  # tiny
    (1, 8192, 0),  # one row
    (300, 8200, 0),  # 16400 B bf16 rows: bulk pieces 8192 + 8192 + 16, 16384 + 16
]


# Vector variants first; the bulk variants (Hopper copy engine) run last, at the end of the
# file, so that if one of them breaks the device context, every other variant has been checked.
VECTOR_VARIANTS = [v for v, spec in cupy_rows.VARIANT_SPECS.items() if spec.fallback is None]
BULK_VARIANTS = [v for v, spec in cupy_rows.VARIANT_SPECS.items() if spec.fallback is not None]
assert sorted(VECTOR_VARIANTS + BULK_VARIANTS) == sorted(VARIANTS)


def check_gather(variant: str, dtype: torch.dtype, n: int, h: int, offset: int) -> None:
    gen = cuda_gen(n + h + offset)
    src = rand_rows(n, h + 16, dtype, gen)[:, offset : offset + h]
    for r in (0, 1, 3 * n + 1):
        index = torch.randint(0, n, (r,), device="cuda", generator=gen)
        out_buf = poison(r, h + 16, dtype)
        out = out_buf[:, offset : offset + h]
        gather_rows(src, index, out_RH=out, backend="cupy", variant=variant)
        ref = gather_rows_torch(src, index, out_RH=poison(r, h, dtype))
        assert same_bits(out, ref), (variant, dtype, n, h, offset, r)
        # bytes beside the view are untouched
        assert same_bits(out_buf[:, :offset], poison(r, offset, dtype))
        assert same_bits(out_buf[:, offset + h :], poison(r, 16 - offset, dtype))
    allocated = gather_rows(src, index, backend="cupy", variant=variant)
    assert same_bits(allocated, ref)


def check_scatter(variant: str, dtype: torch.dtype, n: int, h: int, offset: int) -> None:
    gen = cuda_gen(10_000 + n + h + offset)
    for r in (0, 1, n // 2, n):
        if r > n:
            continue
        index = torch.randperm(n, device="cuda", generator=gen)[:r]
        src = rand_rows(r, h + 16, dtype, gen)[:, offset : offset + h]
        out = poison(n, h + 16, dtype)[:, offset : offset + h]
        scatter_rows(src, index, out, backend="cupy", variant=variant)
        ref = scatter_rows_torch(src, index, poison(n, h, dtype))
        assert same_bits(out, ref), (variant, dtype, n, h, offset, r)


def check_copy_runs(variant: str, dtype: torch.dtype, n: int, h: int, offset: int) -> None:
    gen = torch.Generator().manual_seed(20_000 + n + h + offset)
    m = n + 7
    # non-overlapping destination runs, some empty, sources anywhere
    cuts = sorted(torch.randint(0, m + 1, (12,), generator=gen).tolist())
    dst_start = torch.tensor(cuts[0::2], dtype=torch.int64)
    length = torch.tensor([min(b - a, n) for a, b in zip(cuts[0::2], cuts[1::2], strict=True)])
    src_start = torch.tensor(
        [int(torch.randint(0, n - ln + 1, (1,), generator=gen)) for ln in length.tolist()]
    )
    src = rand_rows(n, h + 16, dtype, cuda_gen(n))[:, offset : offset + h]
    runs = [t.cuda() for t in (src_start, dst_start, length)]
    out = poison(m, h + 16, dtype)[:, offset : offset + h]
    copy_runs(src, *runs, out, backend="cupy", variant=variant)
    ref = copy_runs_torch(src, *runs, poison(m, h, dtype))
    assert same_bits(out, ref), (variant, dtype, n, h, offset, length.tolist())
    empty = torch.empty(0, dtype=torch.int64, device="cuda")
    out2 = poison(m, h, dtype)
    copy_runs(src, empty, empty, empty, out2, backend="cupy", variant=variant)
    assert same_bits(out2, poison(m, h, dtype))


def check_large_permutation(variant: str) -> None:
    """A 64 MiB bf16 buffer, [4096, 8192], random permutation both ways and as one big run."""
    gen = cuda_gen(7)
    src = rand_rows(4096, 8192, torch.bfloat16, gen)
    perm = torch.randperm(4096, device="cuda", generator=gen)
    packed = gather_rows(src, perm, out_RH=poison(4096, 8192, torch.bfloat16), variant=variant)
    assert same_bits(packed, src[perm])
    back = scatter_rows(packed, perm, poison(4096, 8192, torch.bfloat16), variant=variant)
    assert same_bits(back, src)
    one = torch.tensor([0], device="cuda")
    whole = torch.tensor([4096], device="cuda")
    copied = copy_runs(src, one, one, whole, poison(4096, 8192, torch.bfloat16), variant=variant)
    assert same_bits(copied, src)


@pytest.mark.parametrize("variant", VECTOR_VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "h", "offset"), SHAPES)
def test_gather_bit_exact(variant: str, dtype: torch.dtype, n: int, h: int, offset: int) -> None:
    check_gather(variant, dtype, n, h, offset)


@pytest.mark.parametrize("variant", VECTOR_VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "h", "offset"), SHAPES)
def test_scatter_bit_exact(variant: str, dtype: torch.dtype, n: int, h: int, offset: int) -> None:
    check_scatter(variant, dtype, n, h, offset)


@pytest.mark.parametrize("variant", VECTOR_VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "h", "offset"), SHAPES)
def test_copy_runs_bit_exact(variant: str, dtype: torch.dtype, n: int, h: int, offset: int) -> None:
    check_copy_runs(variant, dtype, n, h, offset)


@pytest.mark.parametrize("variant", VECTOR_VARIANTS)
def test_large_permutation(variant: str) -> None:
    check_large_permutation(variant)


def test_transpose_sbh_to_bsh() -> None:
    s_len, b_len, h = 513, 3, 1000
    src_SBH = rand_rows(s_len * b_len, h, torch.bfloat16, cuda_gen(3)).view(s_len, b_len, h)
    b_idx, s_idx = torch.meshgrid(
        torch.arange(b_len, device="cuda"), torch.arange(s_len, device="cuda"), indexing="ij"
    )
    index = (s_idx * b_len + b_idx).reshape(-1)
    out = gather_rows(src_SBH.view(-1, h), index, backend="cupy").view(b_len, s_len, h)
    assert same_bits(out, src_SBH.transpose(0, 1))


def test_runs_on_torch_current_stream() -> None:
    """Input produced on a side stream behind a ~50 ms sleep: the kernel must wait for it."""
    side = torch.cuda.Stream()
    n, h = 2048, 4096
    gen = cuda_gen(11)
    fresh = rand_rows(n, h, torch.bfloat16, gen)
    perm = torch.randperm(n, device="cuda", generator=gen)
    runs = [torch.tensor(x, device="cuda") for x in ([0, 1000], [1048, 0], [1000, 1048])]
    src = torch.zeros(n, h, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time on this stream
        src.copy_(fresh)
        packed = gather_rows(src, perm, backend="cupy", check_bounds=False)
        unpacked = scatter_rows(
            packed, perm, poison(n, h, torch.bfloat16), backend="cupy", check_bounds=False
        )
        moved = copy_runs(
            src, *runs, poison(n, h, torch.bfloat16), backend="cupy", check_bounds=False
        )
    side.synchronize()
    assert same_bits(packed, fresh[perm])
    assert same_bits(unpacked, fresh)
    expected = torch.cat([fresh[1000:2048], fresh[0:1000]])
    assert same_bits(moved, expected)


def test_no_host_sync_without_bound_checks() -> None:
    n, h = 512, 1024
    src = rand_rows(n, h, torch.float16, cuda_gen(5))
    perm = torch.randperm(n, device="cuda")
    runs = [torch.tensor(x, device="cuda") for x in ([0], [0], [n])]
    out = poison(n, h, torch.float16)
    gather_rows(src, perm, out_RH=out, backend="cupy")  # warm up: compile, load
    copy_runs(src, *runs, out, backend="cupy")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gather_rows(src, perm, out_RH=out, backend="cupy", check_bounds=False)
        scatter_rows(src, perm, out, backend="cupy", check_bounds=False)
        copy_runs(src, *runs, out, backend="cupy", check_bounds=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_auto_uses_cupy_on_cuda_and_explicit_cupy_on_cpu_raises() -> None:
    x = torch.zeros(2, 2, device="cuda")
    assert resolve_backend("auto", "t", x) == "cupy"
    with pytest.raises(ValueError, match="backend='cupy' needs CUDA tensors"):
        gather_rows(torch.zeros(3, 4), torch.tensor([0]), backend="cupy")
    with pytest.raises(ValueError, match="backend='cupy' needs CUDA tensors"):
        scatter_rows(torch.zeros(1, 4), torch.tensor([0]), torch.zeros(3, 4), backend="cupy")


def test_inputs_requiring_grad() -> None:
    """DLPack refuses tensors that require grad: the launcher detaches (as the twins do)."""
    src = torch.randn(64, 1000, device="cuda", requires_grad=True)
    index = torch.randperm(64, device="cuda")
    out = gather_rows(src, index, backend="cupy")
    assert same_bits(out, src.detach()[index])
    dst = torch.zeros(64, 1000, device="cuda", requires_grad=True)
    scatter_rows(src, index, dst, backend="cupy")
    assert same_bits(dst.detach()[index], src.detach())


def test_helpers_handle_one_row() -> None:
    """The round-1 failure: one-row helpers must give [1, h] of the dtype, contiguous."""
    for dtype in DTYPES:
        for n in (0, 1, 2):
            t = rand_rows(n, 7, dtype, cuda_gen(0))
            assert t.shape == (n, 7) and t.dtype == dtype and t.is_contiguous()
            assert poison(n, 7, dtype).shape == (n, 7)


def test_bulk_variants_launch_bulk_kernels_on_sm90() -> None:
    """On sm_90+ with 16-byte rows the bulk variants run the copy engine, not their fallback."""
    capability = torch.cuda.get_device_capability()
    for name, spec in cupy_rows.VARIANT_SPECS.items():
        if spec.fallback is None:
            continue
        launched = cupy_rows.resolve_variant(name, 16, capability)
        assert launched == (name if capability >= (9, 0) else spec.fallback)
        assert cupy_rows.resolve_variant(name, 8, capability) == spec.fallback


def test_defaults_are_exact() -> None:
    """The default path (variant=None: DEFAULT_VARIANTS per op), 16 KiB rows, odd row counts."""
    gen = cuda_gen(17)
    src = rand_rows(777, 8192, torch.bfloat16, gen)
    perm = torch.randperm(777, device="cuda", generator=gen)
    assert same_bits(gather_rows(src, perm, out_RH=poison(777, 8192, torch.bfloat16)), src[perm])
    back = scatter_rows(src[perm], perm, poison(777, 8192, torch.bfloat16))
    assert same_bits(back, src)
    runs = [torch.tensor(x, device="cuda") for x in ([500, 0], [0, 277], [277, 500])]
    moved = copy_runs(src, *runs, poison(777, 8192, torch.bfloat16))
    assert same_bits(moved, torch.cat([src[500:777], src[0:500]]))


# ---- bulk variants, last -------------------------------------------------------------------


@pytest.mark.parametrize("variant", BULK_VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "h", "offset"), SHAPES)
def test_bulk_gather_bit_exact(
    variant: str, dtype: torch.dtype, n: int, h: int, offset: int
) -> None:
    check_gather(variant, dtype, n, h, offset)


@pytest.mark.parametrize("variant", BULK_VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "h", "offset"), SHAPES)
def test_bulk_scatter_bit_exact(
    variant: str, dtype: torch.dtype, n: int, h: int, offset: int
) -> None:
    check_scatter(variant, dtype, n, h, offset)


@pytest.mark.parametrize("variant", BULK_VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "h", "offset"), SHAPES)
def test_bulk_copy_runs_bit_exact(
    variant: str, dtype: torch.dtype, n: int, h: int, offset: int
) -> None:
    check_copy_runs(variant, dtype, n, h, offset)


@pytest.mark.parametrize("variant", BULK_VARIANTS)
def test_bulk_large_permutation(variant: str) -> None:
    check_large_permutation(variant)
