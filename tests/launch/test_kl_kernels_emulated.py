"""Tier 2 (launch): the KL's CUDA kernels (``kernels/kl/kl_kernels.cu``) run on the CPU, thread by thread.

Why this file exists: the CuPy kernels only run on a GPU, which this tier does not have. Here the
same source is compiled for the host with a small shim (one OS thread per CUDA thread, a
``std::barrier`` for ``__syncthreads`` and for warp shuffles, blocks one after another) and
launched with the grid, column split and vector-alignment flag that :mod:`mopd.kernels.kl.cupy_kernels`
would use. The results must match the torch twins: this checks the kernels' online softmax
merge, the block reduction, the column split, the vector and scalar paths and bf16 rounding,
without a GPU. ``nvcc`` checks that the same source compiles for the device
(tests/launch/test_kernels_compile.py).

Tolerances as in tier 3: maxima exact, sums rtol 1e-5, cross sums as expectations within 1e-5
of the logit spread, gradients within 1 bf16 ulp (fp32: rtol 1e-5).

Skipped, with the reason, where no C++20 host compiler (``g++``) is on PATH.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mopd.kernels.kl import cupy_kernels as kl_cupy
from mopd.kernels.kl.rowwise import combine_partials, row_grad_torch, row_stats_torch

GXX = shutil.which("g++")
pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not on PATH: kernels not emulated")
SOURCE = Path(kl_cupy.__file__).resolve().parent / "kl_kernels.cu"

_SHIM = r"""
#include <barrier>
#include <cmath>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>
#include <algorithm>
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
struct dim3_ { int x = 0, y = 0, z = 0; };
struct uint4 { unsigned int x, y, z, w; };
static dim3_ blockIdx, blockDim;
static thread_local dim3_ threadIdx;
static std::barrier<>* g_bar = nullptr;
static float g_slots[1024];
inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
using std::min;
inline void __syncthreads() { g_bar->arrive_and_wait(); }
inline float __shfl_down_sync(unsigned, float v, int off) {
    const int t = threadIdx.x;
    g_slots[t] = v;
    g_bar->arrive_and_wait();
    const float r = ((t & 31) + off < 32) ? g_slots[t + off] : v;
    g_bar->arrive_and_wait();
    return r;
}
"""

_DRIVER = r"""
static void launch(int gx, int gy, int threads, const std::function<void()>& body) {
    blockDim.x = threads;
    for (int y = 0; y < gy; ++y) {
        for (int x = 0; x < gx; ++x) {
            blockIdx.x = x;
            blockIdx.y = y;
            std::barrier<> bar(threads);
            g_bar = &bar;
            std::vector<std::thread> pool;
            for (int t = 0; t < threads; ++t) {
                pool.emplace_back([&, t] { threadIdx.x = t; body(); });
            }
            for (auto& th : pool) th.join();
        }
    }
}
#define EMU_STATS(SUFFIX, TS, TU)                                                              \
    extern "C" void emu_stats_##SUFFIX(const TS* s, long long ld_s, const TU* u, long long ld_u, \
                                       int n, int span, int vec_ok, int need_forward,            \
                                       float* part, int C, int P, int threads) {                 \
        launch(P, C, threads, [&] {                                                              \
            kl_row_stats_##SUFFIX(s, ld_s, u, ld_u, n, span, vec_ok, need_forward, part, C, P);  \
        });                                                                                      \
    }
#define EMU_GRAD(SUFFIX, TS, TU, TO)                                                           \
    extern "C" void emu_grad_##SUFFIX(const TS* s, long long ld_s, const TU* u, long long ld_u,  \
                                      TO* out, long long ld_o, int n, int span, int vec_ok,      \
                                      const float* coef, int C, int teacher_term, int P,         \
                                      int threads) {                                             \
        launch(P, C, threads, [&] {                                                              \
            kl_row_grad_##SUFFIX(s, ld_s, u, ld_u, out, ld_o, n, span, vec_ok, coef, C,          \
                                 teacher_term);                                                  \
        });                                                                                      \
    }
typedef unsigned short bf16_t;
EMU_STATS(bf16, bf16_t, bf16_t)
EMU_STATS(f32, float, float)
EMU_STATS(bf16_f32, bf16_t, float)
EMU_GRAD(bf16, bf16_t, bf16_t, bf16_t)
EMU_GRAD(f32, float, float, float)
EMU_GRAD(bf16_f32_bf16, bf16_t, float, bf16_t)
EMU_GRAD(f32_f32_bf16, float, float, bf16_t)
"""

THREADS = 64  # fewer than the device's 256 (two warps or more exercise the block reduction)


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    d = tmp_path_factory.mktemp("kl_emu")
    src = d / "emu.cpp"
    src.write_text(_SHIM + f'#include "{SOURCE}"\n' + _DRIVER)
    out = d / "kl_emu.so"
    proc = subprocess.run(
        [GXX, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-Wno-unknown-pragmas",
         "-o", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return ctypes.CDLL(str(out))


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def _stats(emu: ctypes.CDLL, s: torch.Tensor, u: torch.Tensor, need_forward: bool) -> torch.Tensor:
    C = s.shape[0]
    n, span, P = kl_cupy._geometry(s, u)
    part = torch.full((6, C, P), float("nan"))
    fn = getattr(emu, f"emu_stats_{kl_cupy.STATS_KERNELS[s.dtype, u.dtype]}")
    fn(
        _ptr(s), ctypes.c_longlong(kl_cupy._ld(s)), _ptr(u), ctypes.c_longlong(kl_cupy._ld(u)),
        n, span, kl_cupy._vec_ok(s, u), int(need_forward), _ptr(part), C, P, THREADS,
    )  # fmt: skip
    return combine_partials(part)


def _grad(
    emu: ctypes.CDLL,
    s: torch.Tensor,
    u: torch.Tensor,
    coef: torch.Tensor,
    out: torch.Tensor,
    teacher_term: bool,
) -> None:
    C = s.shape[0]
    n, span, P = kl_cupy._geometry(s, u, out)
    coef = coef.float().contiguous()
    fn = getattr(emu, f"emu_grad_{kl_cupy.GRAD_KERNELS[s.dtype, u.dtype, out.dtype]}")
    fn(
        _ptr(s), ctypes.c_longlong(kl_cupy._ld(s)), _ptr(u), ctypes.c_longlong(kl_cupy._ld(u)),
        _ptr(out), ctypes.c_longlong(kl_cupy._ld(out)), n, span,
        kl_cupy._vec_ok(s, u, out), _ptr(coef), C, int(teacher_term), P, THREADS,
    )  # fmt: skip


def _pair(
    C: int, n: int, dtypes: tuple[torch.dtype, torch.dtype], ld: int | None, offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Student and teacher ``[C, n]`` views of the given dtypes, row stride ``ld``, starting
    ``offset`` elements into their buffers; the teacher is the student plus noise."""
    g = torch.Generator().manual_seed(C * 1000 + n)
    ld = n if ld is None else ld
    base = torch.randn(C * ld + offset + 8, generator=g) * 4
    flats = (base, base + torch.randn(base.shape, generator=g) * 0.5)
    out = [
        f.to(dt).as_strided((C, n), (ld, 1), storage_offset=offset)
        for f, dt in zip(flats, dtypes, strict=True)
    ]
    return out[0], out[1]


BF16, F32 = torch.bfloat16, torch.float32
#: (student, teacher, gradient) storage dtypes the kernels take: uniform, the logits path's
#: bf16 student with fp32 teacher logits, the fused path's fp32 logits with a bf16 gradient
DTYPES = [(BF16, BF16, BF16), (F32, F32, F32), (BF16, F32, BF16), (F32, F32, BF16)]


SHAPES = [
    # (C, n, ld, offset): vector path; n % VEC != 0 (tail); strided rows; unaligned (scalar
    # path); several column blocks per row (P > 1)
    (3, 64, None, 0),
    (2, 101, None, 0),
    (3, 40, 48, 0),
    (2, 77, 80, 1),
    (2, 9000, None, 0),
]


@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: "-".join(str(x)[6:] for x in d))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_emulated_kernels_match_twins(
    emu: ctypes.CDLL,
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype],
    shape: tuple[int, int, int | None, int],
) -> None:
    C, n, ld, offset = shape
    s_dtype, u_dtype, out_dtype = dtypes
    s, u = _pair(C, n, (s_dtype, u_dtype), ld, offset)
    if shape[3]:
        assert kl_cupy._vec_ok(s, u) == 0  # the scalar path is what this case is for
    if n == 9000:
        assert kl_cupy._geometry(s, u)[2] > 1  # rows split over column blocks
    spread = float(s.float().abs().amax()) + float(u.float().abs().amax())
    for need_forward in (False, True):
        got = _stats(emu, s, u, need_forward)
        want = row_stats_torch(s, u, need_forward=need_forward)
        assert not torch.isnan(got).any()
        torch.testing.assert_close(got[:2], want[:2], rtol=0, atol=0)
        torch.testing.assert_close(got[2:4], want[2:4], rtol=1e-5, atol=0)
        z = want[[2, 3]]
        torch.testing.assert_close(got[4:] / z, want[4:] / z, rtol=0, atol=1e-5 * spread)
    coef = torch.randn(5, C, generator=torch.Generator().manual_seed(2))
    coef[0], coef[1] = want[0], want[1]
    for teacher_term in (False, True):
        want_g = row_grad_torch(
            s, u, coef, torch.empty((C, n), dtype=out_dtype), teacher_term=teacher_term
        )
        out = torch.full((C, n), float("nan"), dtype=out_dtype)  # poisoned
        _grad(emu, s, u, coef, out, teacher_term)
        assert not torch.isnan(out).any()
        tol = 2**-7 if out_dtype == torch.bfloat16 else 1e-5
        scale = float(want_g.float().abs().amax())
        torch.testing.assert_close(out, want_g, rtol=tol, atol=1e-5 * scale)
        if s_dtype == out_dtype:  # in place over the student logits, as the fused fp32 path
            s_copy = s.clone()
            _grad(emu, s_copy, u, coef, s_copy, teacher_term)
            torch.testing.assert_close(s_copy, want_g, rtol=tol, atol=1e-5 * scale)


def test_geometry_covers_every_column() -> None:
    for C, n, dtype in [(1, 151936, torch.bfloat16), (832, 151936, torch.bfloat16),
                        (5, 37, torch.float32), (4000, 10, torch.bfloat16)]:  # fmt: skip
        t = torch.empty((C, n), dtype=dtype)
        u = torch.empty((C, n), dtype=torch.float32)  # fp32 teacher logits beside it
        n_, span, P = kl_cupy._geometry(t, u)
        vec = 16 // t.element_size()
        assert n_ == n and span % vec == 0 and (P - 1) * span < n <= P * span
        assert P * C < kl_cupy._TARGET_BLOCKS + C  # no more blocks than the target needs


@pytest.fixture
def emulated_cupy(emu: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Route :mod:`mopd.kernels.kl.cupy_kernels`'s launches to the emulator (CPU tensors, no CuPy).

    Everything of the launcher runs as on a GPU (geometry, alignment flags, argument order,
    partial combination); only ``get_kernel`` / ``on_torch_stream`` / ``to_cupy`` are replaced.
    """
    import contextlib

    from mopd.kernels.kl import prepare as kl_prepare
    from mopd.kernels.kl import rowwise as kl_rowwise

    launched: list[str] = []

    def as_c(a: object) -> object:
        if isinstance(a, torch.Tensor):
            return _ptr(a)
        if a.dtype.itemsize == 8:
            return ctypes.c_longlong(int(a))
        return int(a)

    def get_kernel(filename: str, name: str, device: torch.device) -> Callable[..., None]:
        assert filename == "kl/kl_kernels.cu" and device.type == "cpu"
        op, suffix = name.removeprefix("kl_row_").split("_", 1)
        fn = getattr(emu, f"emu_{op}_{suffix}")

        def launch(grid: tuple[int, ...], block: tuple[int, ...], args: tuple) -> None:
            assert block == (kl_cupy._THREADS,)
            launched.append(name)
            c_args = [as_c(a) for a in args]
            fn(*c_args, *([] if op == "stats" else [grid[0]]), THREADS)

        return launch

    monkeypatch.setattr(kl_cupy, "get_kernel", get_kernel)
    monkeypatch.setattr(kl_cupy, "on_torch_stream", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(kl_cupy, "to_cupy", lambda t: t)
    monkeypatch.setattr(kl_rowwise, "resolve_backend", lambda backend, *t: backend)
    monkeypatch.setattr(kl_prepare, "resolve_chunk_backend", lambda backend, *a: backend)
    return launched


@pytest.mark.parametrize("kind", ["reverse", "mixed"])
def test_loss_through_the_cupy_launcher_matches_the_twin(
    emulated_cupy: list[str], kind: str
) -> None:
    from mopd.kernels.kl import KLConfig, fused_vocab_parallel_kl, vocab_parallel_kl

    g = torch.Generator().manual_seed(9)
    T, H, V, V_real = 37, 16, 200, 190
    h = torch.randn(T, H, generator=g).bfloat16()
    w = (torch.randn(V, H, generator=g) / 2).bfloat16()
    t_h = [torch.randn(T, 12, generator=g).bfloat16(), torch.randn(T, 8, generator=g).bfloat16()]
    t_w = [(torch.randn(V, k, generator=g) / 2).bfloat16() for k in (12, 8)]
    index_T = torch.randint(0, 2, (T,), generator=g)
    mask_T = torch.rand(T, generator=g) > 0.2
    results = {}
    for backend in ("cupy", "torch"):
        for fused in (True, False):
            hh = h.clone().requires_grad_(True)
            ww = w.clone().requires_grad_(True)
            cfg = KLConfig(kind=kind, chunk_tokens=8, backend=backend)  # type: ignore[arg-type]
            kw = dict(vocab_start=0, vocab_size=V_real, loss_mask_T=mask_T, teacher_index_T=index_T)
            if fused:
                out = fused_vocab_parallel_kl(hh, ww, t_h, t_w, config=cfg, **kw)
                grads = torch.autograd.grad(out, (hh, ww))
            else:
                logits = (h @ w.T).requires_grad_(True)
                out = vocab_parallel_kl(logits, t_h, t_w, config=cfg, **kw)
                grads = torch.autograd.grad(out, (logits,))
            results[backend, fused] = (out.detach(), grads)
    # bf16 logits with fp32 teacher logits; the fused path's fp32 logits with a bf16 gradient
    assert set(emulated_cupy) == {
        "kl_row_stats_bf16_f32", "kl_row_grad_bf16_f32_bf16",
        "kl_row_stats_f32", "kl_row_grad_f32_f32_bf16",
    }  # fmt: skip
    for fused in (True, False):
        (a, ga), (b, gb) = results["cupy", fused], results["torch", fused]
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for x, y in zip(ga, gb, strict=True):
            scale = float(y.float().abs().amax())
            torch.testing.assert_close(x, y, rtol=2**-6, atol=2e-3 * scale)
