// rows.cu: the row-movement kernels of mopd.kernels (pack, unpack, run copies).
//
// Why this file exists: the bridge packs rows of a local [rows, H] buffer into per-peer staging
// buffers and unpacks received rows straight into the student's final layout. These kernels do
// those moves at close to the device's copy bandwidth. They are loaded by CuPy (cupy_rows.py,
// through cupy_loader.py, compiled once by NVRTC and cached); each has a torch twin in
// rows_torch.py with the same meaning.
//
// Layout and types:
// - A "row" is W contiguous bytes; rows are `stride` bytes apart (any stride, including views).
//   The element dtype never matters: bf16/fp16/fp32/int8 rows are all moved as bytes, in
//   vectors of VB bytes (16, 8, 4, 2 or 1). The caller (cupy_rows.py) picks the widest VB that
//   divides W, both base addresses and both row strides, so 16-byte access is used whenever the
//   rows are aligned and a narrower, still correct, path when they are not.
// - Indices, run starts and lengths are int64 (`i64`).
//
// Work split: each row is cut into chunks of GROUP lanes x U vectors; an item is one
// (row, chunk) pair. Items are numbered row-major and handed out grid-stride to groups, so
// neighbouring groups copy neighbouring chunks of the same row. A group is one thread (the
// naive "grid" variant: one vector per item), one warp, or one block. Each lane issues its U
// independent loads before its U stores (several 16-byte loads in flight per thread), and the
// row index is read once per item (every lane reads the same address: a broadcast).
//
// No lane depends on another (no shuffles, no barriers, no shared memory), so the drivers are
// __host__ __device__ and the tier-1 tests run them on the CPU thread by thread
// (MOPD_HOST_EMULATION, tests/unit/test_kernels_compile.py) to check the work split exactly.

typedef long long i64;

#define MOPD_HD __host__ __device__ __forceinline__
#define MOPD_BLOCK 256

// Vector type of VB bytes.
template <int VB> struct MopdVec;
template <> struct MopdVec<16> { typedef uint4 T; };
template <> struct MopdVec<8> { typedef uint2 T; };
template <> struct MopdVec<4> { typedef unsigned int T; };
template <> struct MopdVec<2> { typedef unsigned short T; };
template <> struct MopdVec<1> { typedef unsigned char T; };

// Memory access with a cache hint. HINT 0: plain loads and stores. HINT 1: streaming
// (ld.global.cs / st.global.cs, evict-first: every byte is touched once). HINT 2: read-only
// loads that skip L1 (ld.global.nc.L1::no_allocate) and streaming stores. The hints only apply
// to the 16/8/4-byte vectors; narrower (misaligned) paths use plain access.
template <int HINT> struct MopdMem {
  template <typename V> static MOPD_HD V load(const V* p) { return *p; }
  template <typename V> static MOPD_HD void store(V* p, const V& v) { *p = v; }
};

#ifdef __CUDA_ARCH__
#define MOPD_LD4(OP) \
  asm volatile(OP ".v4.u32 {%0,%1,%2,%3}, [%4];" \
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p))
#define MOPD_LD2(OP) asm volatile(OP ".v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p))
#define MOPD_LD1(OP) asm volatile(OP ".u32 %0, [%1];" : "=r"(v) : "l"(p))
#define MOPD_ST4 \
  asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};" \
               :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory")
#define MOPD_ST2 \
  asm volatile("st.global.cs.v2.u32 [%0], {%1,%2};" :: "l"(p), "r"(v.x), "r"(v.y) : "memory")
#define MOPD_ST1 asm volatile("st.global.cs.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory")
#else
#define MOPD_LD4(OP) v = *p
#define MOPD_LD2(OP) v = *p
#define MOPD_LD1(OP) v = *p
#define MOPD_ST4 *p = v
#define MOPD_ST2 *p = v
#define MOPD_ST1 *p = v
#endif

#define MOPD_HINTED_MEM(HINT, LOAD_OP) \
  template <> struct MopdMem<HINT> { \
    template <typename V> static MOPD_HD V load(const V* p) { return *p; } \
    template <typename V> static MOPD_HD void store(V* p, const V& v) { *p = v; } \
    static MOPD_HD uint4 load(const uint4* p) { uint4 v; MOPD_LD4(LOAD_OP); return v; } \
    static MOPD_HD uint2 load(const uint2* p) { uint2 v; MOPD_LD2(LOAD_OP); return v; } \
    static MOPD_HD unsigned int load(const unsigned int* p) { \
      unsigned int v; MOPD_LD1(LOAD_OP); return v; \
    } \
    static MOPD_HD void store(uint4* p, const uint4& v) { MOPD_ST4; } \
    static MOPD_HD void store(uint2* p, const uint2& v) { MOPD_ST2; } \
    static MOPD_HD void store(unsigned int* p, const unsigned int& v) { MOPD_ST1; } \
  };

MOPD_HINTED_MEM(1, "ld.global.cs")
MOPD_HINTED_MEM(2, "ld.global.nc.L1::no_allocate")

// Group geometry. KIND 0: a group is one thread; 1: one warp; 2: one block.
struct MopdGroups {
  i64 lane, size, id, count;
};

template <int KIND>
MOPD_HD MopdGroups mopd_groups(i64 thread, i64 block_dim, i64 block_id, i64 n_blocks) {
  MopdGroups g;
  if (KIND == 0) {
    g.lane = 0;
    g.size = 1;
    g.id = block_id * block_dim + thread;
    g.count = n_blocks * block_dim;
  } else if (KIND == 1) {
    g.lane = thread & 31;
    g.size = 32;
    g.id = (block_id * block_dim + thread) >> 5;
    g.count = (n_blocks * block_dim) >> 5;
  } else {
    g.lane = thread;
    g.size = block_dim;
    g.id = block_id;
    g.count = n_blocks;
  }
  return g;
}

// One lane's share of one chunk: vectors first, first + step, ..., first + (U-1)*step of the row,
// those below vecs_per_row. All U loads are issued before the first store.
template <typename V, int U, int HINT>
MOPD_HD void mopd_copy_chunk(const char* src_row, char* dst_row, i64 first, i64 step,
                             i64 vecs_per_row) {
  const V* s = reinterpret_cast<const V*>(src_row);
  V* d = reinterpret_cast<V*>(dst_row);
  V buf[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const i64 v = first + u * step;
    if (v < vecs_per_row) buf[u] = MopdMem<HINT>::load(s + v);
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const i64 v = first + u * step;
    if (v < vecs_per_row) MopdMem<HINT>::store(d + v, buf[u]);
  }
}

// Pack (MODE 0): dst row r <- src row index[r]. Unpack (MODE 1): dst row index[r] <- src row r.
// r in [0, rows).
template <typename V, int KIND, int U, int HINT, int MODE>
MOPD_HD void mopd_index_driver(const char* __restrict__ src, char* __restrict__ dst,
                               const i64* __restrict__ index, i64 rows, i64 vecs_per_row,
                               i64 src_stride, i64 dst_stride, i64 thread, i64 block_dim,
                               i64 block_id, i64 n_blocks) {
  const MopdGroups g = mopd_groups<KIND>(thread, block_dim, block_id, n_blocks);
  const i64 per_chunk = g.size * U;
  const i64 chunks = (vecs_per_row + per_chunk - 1) / per_chunk;
  const i64 items = rows * chunks;
  for (i64 item = g.id; item < items; item += g.count) {
    const i64 r = item / chunks;
    const i64 c = item - r * chunks;
    const i64 idx = index[r];
    const i64 src_row = MODE == 0 ? idx : r;
    const i64 dst_row = MODE == 0 ? r : idx;
    mopd_copy_chunk<V, U, HINT>(src + src_row * src_stride, dst + dst_row * dst_stride,
                                c * per_chunk + g.lane, g.size, vecs_per_row);
  }
}

// Runs: for k in [0, n_runs), dst rows dst_start[k] + j <- src rows src_start[k] + j,
// j in [0, length[k]). prefix holds n_runs + 1 exclusive sums of the lengths (prefix[0] = 0,
// prefix[n_runs] = total rows), on the device: the host never needs the total. The flat row t
// of an item belongs to the run k with prefix[k] <= t < prefix[k + 1] (binary search, L1-cached).
template <typename V, int KIND, int U, int HINT>
MOPD_HD void mopd_runs_driver(const char* __restrict__ src, char* __restrict__ dst,
                              const i64* __restrict__ src_start, const i64* __restrict__ dst_start,
                              const i64* __restrict__ prefix, i64 n_runs, i64 vecs_per_row,
                              i64 src_stride, i64 dst_stride, i64 thread, i64 block_dim,
                              i64 block_id, i64 n_blocks) {
  const MopdGroups g = mopd_groups<KIND>(thread, block_dim, block_id, n_blocks);
  const i64 per_chunk = g.size * U;
  const i64 chunks = (vecs_per_row + per_chunk - 1) / per_chunk;
  const i64 items = prefix[n_runs] * chunks;
  for (i64 item = g.id; item < items; item += g.count) {
    const i64 t = item / chunks;
    const i64 c = item - t * chunks;
    i64 lo = 0;
    i64 hi = n_runs;  // invariant: prefix[lo] <= t < prefix[hi]
    while (hi - lo > 1) {
      const i64 mid = (lo + hi) >> 1;
      if (prefix[mid] <= t) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    const i64 offset = t - prefix[lo];
    mopd_copy_chunk<V, U, HINT>(src + (src_start[lo] + offset) * src_stride,
                                dst + (dst_start[lo] + offset) * dst_stride,
                                c * per_chunk + g.lane, g.size, vecs_per_row);
  }
}

// The kernel variants: (name, group kind, unroll U, cache hint). cupy_rows.VARIANT_SPECS names
// them (and how to launch them); tests/unit/test_kernels_compile.py checks each one it names.
#define MOPD_VARIANTS(X, VB) \
  X(grid, VB, 0, 1, 0)       \
  X(warp, VB, 1, 4, 0)       \
  X(warp_cs, VB, 1, 4, 1)    \
  X(warp_nc, VB, 1, 4, 2)    \
  X(warp8_cs, VB, 1, 8, 1)   \
  X(block_cs, VB, 2, 4, 1)

#define MOPD_ALL(X)      \
  MOPD_VARIANTS(X, 16)   \
  MOPD_VARIANTS(X, 8)    \
  MOPD_VARIANTS(X, 4)    \
  MOPD_VARIANTS(X, 2)    \
  MOPD_VARIANTS(X, 1)

// Kernels: mopd_{gather,scatter,runs}_<variant>_v<VB>, launched with MOPD_BLOCK threads.
#define MOPD_KERNELS(NAME, VB, KIND, U, HINT)                                                  \
  extern "C" __global__ void __launch_bounds__(MOPD_BLOCK)                                     \
      mopd_gather_##NAME##_v##VB(const char* __restrict__ src, char* __restrict__ dst,         \
                                 const i64* __restrict__ index, i64 rows, i64 vecs_per_row,    \
                                 i64 src_stride, i64 dst_stride) {                             \
    mopd_index_driver<MopdVec<VB>::T, KIND, U, HINT, 0>(src, dst, index, rows, vecs_per_row,   \
                                                        src_stride, dst_stride, threadIdx.x,   \
                                                        blockDim.x, blockIdx.x, gridDim.x);    \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(MOPD_BLOCK)                                     \
      mopd_scatter_##NAME##_v##VB(const char* __restrict__ src, char* __restrict__ dst,        \
                                  const i64* __restrict__ index, i64 rows, i64 vecs_per_row,   \
                                  i64 src_stride, i64 dst_stride) {                            \
    mopd_index_driver<MopdVec<VB>::T, KIND, U, HINT, 1>(src, dst, index, rows, vecs_per_row,   \
                                                        src_stride, dst_stride, threadIdx.x,   \
                                                        blockDim.x, blockIdx.x, gridDim.x);    \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(MOPD_BLOCK) mopd_runs_##NAME##_v##VB(           \
      const char* __restrict__ src, char* __restrict__ dst, const i64* __restrict__ src_start, \
      const i64* __restrict__ dst_start, const i64* __restrict__ prefix, i64 n_runs,           \
      i64 vecs_per_row, i64 src_stride, i64 dst_stride) {                                      \
    mopd_runs_driver<MopdVec<VB>::T, KIND, U, HINT>(src, dst, src_start, dst_start, prefix,    \
                                                    n_runs, vecs_per_row, src_stride,          \
                                                    dst_stride, threadIdx.x, blockDim.x,       \
                                                    blockIdx.x, gridDim.x);                    \
  }

MOPD_ALL(MOPD_KERNELS)

#ifdef MOPD_HOST_EMULATION
// Host emulation for the tier-1 tests: runs a kernel's driver for every (block, thread) of a
// launch of n_blocks x MOPD_BLOCK, one thread after another. Exact, because no lane reads what
// another writes. op: 0 gather, 1 scatter, 2 runs. Returns 0, or -1 for an unknown name.
#include <cstring>

#define MOPD_EMULATE(NAME, VB, KIND, U, HINT)                                                   \
  if (vb == VB && std::strcmp(variant, #NAME) == 0) {                                           \
    for (i64 b = 0; b < n_blocks; ++b) {                                                        \
      for (i64 t = 0; t < MOPD_BLOCK; ++t) {                                                    \
        if (op == 2) {                                                                          \
          mopd_runs_driver<MopdVec<VB>::T, KIND, U, HINT>(src, dst, a, b_arr, prefix, n_runs,   \
                                                          vecs_per_row, src_stride,             \
                                                          dst_stride, t, MOPD_BLOCK, b,         \
                                                          n_blocks);                            \
        } else if (op == 1) {                                                                   \
          mopd_index_driver<MopdVec<VB>::T, KIND, U, HINT, 1>(src, dst, a, rows, vecs_per_row,  \
                                                              src_stride, dst_stride, t,        \
                                                              MOPD_BLOCK, b, n_blocks);         \
        } else {                                                                                \
          mopd_index_driver<MopdVec<VB>::T, KIND, U, HINT, 0>(src, dst, a, rows, vecs_per_row,  \
                                                              src_stride, dst_stride, t,        \
                                                              MOPD_BLOCK, b, n_blocks);         \
        }                                                                                       \
      }                                                                                         \
    }                                                                                           \
    return 0;                                                                                   \
  }

extern "C" int mopd_emulate(int op, const char* variant, int vb, const char* src, char* dst,
                            const i64* a, const i64* b_arr, const i64* prefix, i64 n_runs,
                            i64 rows, i64 vecs_per_row, i64 src_stride, i64 dst_stride,
                            i64 n_blocks) {
  MOPD_ALL(MOPD_EMULATE)
  return -1;
}
#endif  // MOPD_HOST_EMULATION
