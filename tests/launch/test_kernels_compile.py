"""Tier 2 (launch): the CUDA sources under kernels/ compile, spill nothing, and the row kernels are right.

- every ``kernels/*.cu`` compiles with ``nvcc -arch=sm_90`` and ``ptxas -v`` reports no spills;
- every kernel name the CuPy launcher can ask for (op x variant x vector width) exists;
- the bulk kernels (Hopper copy engine) build alone (``MOPD_KERNEL_SET=2``, the module CuPy
  compiles for them, apart from the vector kernels so a failure there costs only them);
- rows.cu's drivers, built for the host (``-DMOPD_HOST_EMULATION``), run every launch thread by
  thread on the CPU with the grid, block and variant the launcher would use (a bulk variant's
  vector fallback where rows are not 16-byte aligned) and the vector width it would pick; the
  result must equal the torch twin bit for bit on poisoned outputs. This checks the kernels' work
  split (chunks, lanes, unroll tails, persistent loops, flat numbering, run search and walk, the
  bulk pipeline's stage ring, batches of 32 and drain) without a GPU; grids far smaller than the
  work make every loop turn.

Skipped, with the reason, where ``nvcc`` is absent. nvcc's time follows the machine's load (a
compile that takes a minute alone takes many on a busy machine), so these tests carry the
``nvcc`` marker and no wall-clock limit; each build (source, defines, flags, nvcc version) runs
once and is kept on disk by the hash of all of them, so a second run compiles nothing.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from mopd.kernels.rows import cupy_rows
from mopd.kernels.rows.torch_rows import copy_runs_torch, gather_rows_torch, scatter_rows_torch

KERNELS_DIR = Path(cupy_rows.__file__).resolve().parents[1]  # kernels/: its families' folders
NVCC = shutil.which("nvcc")
pytestmark = [
    pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH: CUDA sources not checked"),
    pytest.mark.nvcc,
    pytest.mark.timeout(0),  # nvcc's time is the machine's load, not a fault
]

WIDTHS = (16, 8, 4, 2, 1)
OPS = ("gather", "scatter", "runs")


def _cache_dir() -> Path:
    """Where finished builds are kept (``MOPD_NVCC_CACHE``, else the user's cache folder)."""
    if "MOPD_NVCC_CACHE" in os.environ:
        return Path(os.environ["MOPD_NVCC_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mopd-bridge" / "nvcc"


def _nvcc_build(source: Path, flags: Sequence[str], output_name: str) -> tuple[Path, str]:
    """``(output, stderr)`` of ``nvcc FLAGS -o OUTPUT SOURCE``, built once per content.

    The key hashes the nvcc version, the flags and every source under kernels/ (``.cu`` files
    may include each other); a finished build is moved into place whole, so an interrupted one
    is never reused.
    """
    version = subprocess.run([NVCC, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(version.encode())
    digest.update("\0".join(flags).encode())
    digest.update(source.name.encode())
    for cu in sorted(KERNELS_DIR.rglob("*.cu*")):
        digest.update(cu.name.encode() + b"\0" + cu.read_bytes())
    entry = _cache_dir() / digest.hexdigest()[:32]
    out, log = entry / output_name, entry / "nvcc.stderr"
    if not (out.is_file() and log.is_file()):
        entry.parent.mkdir(parents=True, exist_ok=True)
        work = entry.parent / f".{entry.name}.{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        proc = subprocess.run(
            [NVCC, *flags, "-o", str(work / output_name), str(source)],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, f"nvcc failed on {source.name}:\n{proc.stderr}"
        (work / "nvcc.stderr").write_text(proc.stderr)
        try:
            work.rename(entry)
        except OSError:  # another run finished the same build first
            shutil.rmtree(work, ignore_errors=True)
    return out, log.read_text()


def _ptxas_report(cu: Path, *defines: str) -> str:
    """ptxas's report for ``cu`` built for sm_90 with ``defines``."""
    flags = [*(f"-D{d}" for d in defines), "-arch=sm_90", "-cubin", "-Xptxas", "-v"]
    return _nvcc_build(cu, flags, cu.stem + ".cubin")[1]


@pytest.mark.parametrize("cu", sorted(KERNELS_DIR.rglob("*.cu")), ids=lambda p: p.name)
def test_compiles_without_spills(cu: Path) -> None:
    report = _ptxas_report(cu)
    entries = re.findall(r"Compiling entry function '(\w+)'", report)
    assert entries, f"no kernels compiled from {cu.name}:\n{report}"
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert len(spills) >= len(entries), report
    bad = [s for s in spills if s != ("0", "0")]
    assert not bad, f"{cu.name} spills registers:\n{report}"


def test_every_launchable_row_kernel_exists() -> None:
    report = _ptxas_report(KERNELS_DIR / "rows" / "rows.cu")
    entries = set(re.findall(r"Compiling entry function '(\w+)'", report))
    wanted = {
        cupy_rows.kernel_name(op, cupy_rows.resolve_variant(v, w, cc), w)
        for op in OPS
        for v in cupy_rows.VARIANTS
        for w in WIDTHS
        for cc in ((8, 0), (9, 0))
    }
    assert wanted <= entries, sorted(wanted - entries)
    assert set(cupy_rows.DEFAULT_VARIANTS) == set(cupy_rows.OPS)
    assert set(cupy_rows.DEFAULT_VARIANTS.values()) <= set(cupy_rows.VARIANTS)
    # bulk kernels exist at 16 bytes only, with one warp per block and <= 48 KiB static smem
    for v, spec in cupy_rows.VARIANT_SPECS.items():
        if spec.fallback is not None:
            for op in OPS:
                name = cupy_rows.kernel_name(op, v, 16)
                assert name == f"mopd_{op}_{spec.kernel}_v16" and name in entries
                assert cupy_rows.kernel_name(op, v, 8) == cupy_rows.kernel_name(
                    op, spec.fallback, 8
                )


def test_bulk_kernel_set_is_its_own_module() -> None:
    """cupy_rows compiles the bulk kernels apart (MOPD_KERNEL_SET=2): exactly those, no spills."""
    report = _ptxas_report(KERNELS_DIR / "rows" / "rows.cu", "MOPD_KERNEL_SET=2")
    entries = set(re.findall(r"Compiling entry function '(\w+)'", report))
    bulk = [v for v, spec in cupy_rows.VARIANT_SPECS.items() if spec.fallback is not None]
    assert bulk
    assert entries == {cupy_rows.kernel_name(op, v, 16) for op in OPS for v in bulk}
    assert cupy_rows._defines(bulk[0]) == ("MOPD_KERNEL_SET=2",)
    assert cupy_rows._defines("warp") == ("MOPD_KERNEL_SET=1",)
    assert "0 bytes spill stores" in report and " bytes spill stores" in report
    assert not re.findall(r"[1-9]\d* bytes spill", report), report


# ---- host emulation of the kernels -----------------------------------------------------------


@pytest.fixture(scope="module")
def emulator() -> ctypes.CDLL:
    flags = ["-arch=sm_90", "-shared", "-Xcompiler", "-fPIC", "-O1", "-DMOPD_HOST_EMULATION"]
    out, _ = _nvcc_build(KERNELS_DIR / "rows" / "rows.cu", flags, "rows_emulate.so")
    lib = ctypes.CDLL(str(out))
    i64, ptr = ctypes.c_longlong, ctypes.c_void_p
    lib.mopd_emulate.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ptr,
        ptr,
        ptr,
        ptr,
        ptr,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
    ]
    lib.mopd_emulate.restype = ctypes.c_int
    return lib


def _emulate(
    lib,
    op: str,
    variant: str,
    src: torch.Tensor,
    out: torch.Tensor,
    a,
    b,
    prefix,
    n_runs: int,
    rows: int,
    rows_bound: int,
    sm_count: int,
    capability: tuple[int, int] = (9, 0),
    grid: int | None = None,
) -> str:
    """Run one launch exactly as cupy_rows would set it up; returns the variant launched."""
    itemsize = src.element_size()
    row_bytes = src.shape[1] * itemsize
    src_stride, dst_stride = src.stride(0) * itemsize, out.stride(0) * itemsize
    width = cupy_rows.vector_bytes(
        row_bytes, src.data_ptr(), out.data_ptr(), src_stride, dst_stride
    )
    launched = cupy_rows.resolve_variant(variant, width, capability)
    if grid is None:
        grid = cupy_rows.launch_grid(launched, rows_bound, row_bytes // width, sm_count)
    p = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    rc = lib.mopd_emulate(
        OPS.index(op),
        cupy_rows.VARIANT_SPECS[launched].kernel.encode(),
        width,
        src.data_ptr(),
        out.data_ptr(),
        p(a),
        p(b),
        p(prefix),
        n_runs,
        rows,
        row_bytes // width,
        src_stride,
        dst_stride,
        grid,
        cupy_rows.launch_block(launched),
    )
    assert rc == 0, f"emulation of {op}/{launched}/v{width} failed: {rc}"
    return launched


def _rand_bytes_rows(n: int, h: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    # 1-D bytes viewed as dtype, then shaped: a [1, k] uint8 may report stride(0) == 1,
    # which .view(dtype) refuses for wider dtypes
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * h * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(n, h)


def _poison(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.full((shape[0] * shape[1] * itemsize,), 0x5A, dtype=torch.uint8)
    return raw.view(dtype).view(shape)


# (dtype, H, element offset of the views): 16-byte rows, odd widths, misaligned starts.
CASES = [
    (torch.bfloat16, 64, 0),  # 128 B rows: v16
    (torch.bfloat16, 1100, 0),  # 2200 B: v8, several chunks, a tail
    (torch.float32, 2053, 0),  # v4, tail chunk
    (torch.bfloat16, 37, 1),  # view at element 1: v2
    (torch.int8, 45, 1),  # v1
    (torch.float16, 8200, 0),  # 16400 B rows: v16, chunk tail in a block
]


@pytest.mark.parametrize("variant", cupy_rows.VARIANTS)
@pytest.mark.parametrize(("dtype", "h", "offset"), CASES)
def test_emulated_kernels_match_twins(
    emulator, variant: str, dtype: torch.dtype, h: int, offset: int
) -> None:
    gen = torch.Generator().manual_seed(h * 7 + offset)
    n, r = 23, 17
    base = _rand_bytes_rows(n, h + 16, dtype, gen)
    src = base[:, offset : offset + h]  # row stride h + 16 elements, starts at element offset
    sm_count = 1  # a small persistent grid: every group loops over several items

    # gather (with a repeated row)
    index = torch.randint(0, n, (r,), generator=gen)
    out_buf = _poison((r, h + offset), dtype)
    out = out_buf[:, offset:]
    launched = _emulate(emulator, "gather", variant, src, out, index, None, None, 0, r, r, sm_count)
    aligned = offset == 0 and (h * src.element_size()) % 16 == 0
    assert launched == (variant if aligned else cupy_rows.resolve_variant(variant, 8, (9, 0)))
    ref = gather_rows_torch(src, index, out_RH=_poison((r, h), dtype))
    assert torch.equal(out.contiguous().view(torch.uint8), ref.view(torch.uint8))

    # scatter into a poisoned destination: unnamed rows keep the poison
    perm = torch.randperm(n, generator=gen)[:r]
    dst_buf = _poison((n, h + offset), dtype)
    dst = dst_buf[:, offset:]
    rows_src = _rand_bytes_rows(r, h, dtype, gen)
    _emulate(emulator, "scatter", variant, rows_src, dst, perm, None, None, 0, r, r, sm_count)
    ref = scatter_rows_torch(rows_src, perm, _poison((n, h), dtype))
    assert torch.equal(dst.contiguous().view(torch.uint8), ref.view(torch.uint8))

    # runs, including an empty one, into a poisoned destination
    src_start = torch.tensor([4, 0, 9, 20], dtype=torch.int64)
    dst_start = torch.tensor([0, 5, 5, 11], dtype=torch.int64)
    length = torch.tensor([5, 0, 6, 3], dtype=torch.int64)
    prefix = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(length, 0)])
    m = 16
    runs_buf = _poison((m, h + offset), dtype)
    runs_out = runs_buf[:, offset:]
    _emulate(
        emulator,
        "runs",
        variant,
        src,
        runs_out,
        src_start,
        dst_start,
        prefix,
        4,
        0,
        4 * min(n, m),
        sm_count,
    )
    ref = copy_runs_torch(src, src_start, dst_start, length, _poison((m, h), dtype))
    assert torch.equal(runs_out.contiguous().view(torch.uint8), ref.view(torch.uint8))


def test_vector_width_rule() -> None:
    assert cupy_rows.vector_bytes(16384, 0, 256, 16384, 16384) == 16
    assert cupy_rows.vector_bytes(16384, 2, 256, 16384, 16384) == 2  # view at element 1 (bf16)
    assert cupy_rows.vector_bytes(2200, 0, 0, 2200, 2200) == 8
    assert cupy_rows.vector_bytes(45, 0, 0, 45, 45) == 1
    assert cupy_rows.vector_bytes(16, 0, 0, 16, 24) == 8  # row stride limits the width


def test_one_row_stride_does_not_narrow_the_width() -> None:
    """torch may give a size-1 dim any stride (round 1 saw 1); one row never uses it."""
    one = torch.empty(1, 8192, dtype=torch.bfloat16).as_strided((1, 8192), (1, 1))
    many = torch.empty(5, 8192, dtype=torch.bfloat16)
    assert cupy_rows._geometry(one, many) == (16, 1024, 16384, 16384)
    assert cupy_rows._geometry(many[:, 1:], many[:2, 1:])[0] == 2  # real misalignment stays


def test_launch_grid_rule() -> None:
    # warp variant: 2 KiB chunks of 16-byte vectors; 8 warps per block
    assert cupy_rows.launch_grid("warp_cs", 1, 1024, 132) == 1  # one 16 KiB row: 8 chunks
    assert cupy_rows.launch_grid("warp_cs", 3, 1024, 132) == 3
    assert cupy_rows.launch_grid("warp_cs", 10**6, 1024, 132) == 8 * 132  # persistent cap
    assert cupy_rows.launch_grid("grid", 2, 100, 132) == 1
    assert cupy_rows.launch_grid("block_cs", 5, 1025, 132) == 10
    assert cupy_rows.launch_grid("warp_cs_flat", 10**6, 1024, 132) == 10**6  # one warp per chunk
    # flat: one thread per 4 (or 8) vectors, non-persistent
    assert cupy_rows.launch_grid("flat", 1, 1024, 132) == 1  # one 16 KiB row per block
    assert cupy_rows.launch_grid("flat", 10**6, 1024, 132) == 10**6
    assert cupy_rows.launch_grid("flat8", 3, 100, 132) == 1  # 300 vectors < 2048
    # bulk: one item (row piece) per block up to 6 one-warp blocks per SM
    assert cupy_rows.launch_grid("bulk", 5, 1024, 132) == 10  # two 8 KiB pieces per row
    assert cupy_rows.launch_grid("bulk16", 5, 1025, 132) == 10  # 16 KiB + 16 B
    assert cupy_rows.launch_grid("bulk", 10**6, 1024, 132) == 6 * 132
    assert cupy_rows.launch_block("bulk") == 32 and cupy_rows.launch_block("flat") == 256


def test_resolve_variant_rule() -> None:
    assert cupy_rows.resolve_variant("bulk", 16, (9, 0)) == "bulk"
    assert cupy_rows.resolve_variant("bulk", 8, (9, 0)) == "warp"  # not 16-byte aligned
    assert cupy_rows.resolve_variant("bulk16", 16, (8, 0)) == "warp"  # before sm_90
    assert cupy_rows.resolve_variant("flat", 2, (8, 0)) == "flat"
    assert cupy_rows.default_variant("copy_runs") in cupy_rows.VARIANTS
    with pytest.raises(ValueError, match="op must be one of"):
        cupy_rows.default_variant("runs")


@pytest.mark.parametrize("variant", ["bulk", "bulk16", "flat", "flat8", "warp16", "warp32"])
@pytest.mark.parametrize("grid", [1, 3])
def test_emulated_small_grid_loops(emulator, variant: str, grid: int) -> None:
    """A grid far smaller than the work: flat blocks loop; a bulk block wraps its stage ring many
    times and takes its items in several batches of 32 (lane 0's pipeline, then the drain)."""
    gen = torch.Generator().manual_seed(grid)
    dtype, h, n, r = torch.bfloat16, 4104, 150, 131  # 8208 B rows: bulk pieces 8192 + 16
    src = _rand_bytes_rows(n, h, dtype, gen)
    index = torch.randint(0, n, (r,), generator=gen)
    out = _poison((r, h), dtype)
    launched = _emulate(
        emulator, "gather", variant, src, out, index, None, None, 0, r, r, 1, grid=grid
    )
    assert launched == variant
    assert torch.equal(out.view(torch.uint8), src[index].view(torch.uint8))
    perm = torch.randperm(n, generator=gen)[:r]
    dst = _poison((n, h), dtype)
    rows_src = _rand_bytes_rows(r, h, dtype, gen)
    _emulate(emulator, "scatter", variant, rows_src, dst, perm, None, None, 0, r, r, 1, grid=grid)
    ref = scatter_rows_torch(rows_src, perm, _poison((n, h), dtype))
    assert torch.equal(dst.view(torch.uint8), ref.view(torch.uint8))
    # 40 runs (some empty) covering [0, m) of the destination in shuffled order
    lengths = torch.randint(0, 7, (40,), generator=gen)
    m = int(lengths.sum())
    dst_start = torch.cumsum(lengths, 0) - lengths
    src_start = torch.tensor(
        [int(torch.randint(0, n - ln + 1, (1,), generator=gen)) for ln in lengths]
    )
    order = torch.randperm(40, generator=gen)
    runs = [t[order].contiguous() for t in (src_start, dst_start, lengths)]
    prefix = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(runs[2], 0)])
    runs_out = _poison((m, h), dtype)
    _emulate(
        emulator, "runs", variant, src, runs_out, runs[0], runs[1], prefix, 40, 0, m, 1, grid=grid
    )
    ref = copy_runs_torch(src, *runs, _poison((m, h), dtype))
    assert torch.equal(runs_out.view(torch.uint8), ref.view(torch.uint8))
