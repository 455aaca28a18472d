// rows.cu: the row-movement kernels of mopd.kernels (pack, unpack, run copies).
//
// Why this file exists: the bridge packs rows of a local [rows, H] buffer into per-peer staging
// buffers and unpacks received rows straight into the student's final layout. These kernels do
// those moves at close to the device's copy bandwidth. They are loaded by CuPy (cupy_rows.py,
// through cupy_loader.py, compiled once by NVRTC and cached); each has a torch twin in
// torch_rows.py with the same meaning.
//
// Layout and types:
// - A "row" is W contiguous bytes; rows are `stride` bytes apart (any stride, including views).
//   The element dtype never matters: bf16/fp16/fp32/int8 rows are all moved as bytes, in
//   vectors of VB bytes (16, 8, 4, 2 or 1). The caller (cupy_rows.py) picks the widest VB that
//   divides W, both base addresses and both row strides, so 16-byte access is used whenever the
//   rows are aligned and a narrower, still correct, path when they are not.
// - Indices, run starts and lengths are int64 (`i64`).
//
// Three families of kernels, each variant named in MOPD_VARIANTS / MOPD_BULK_VARIANTS below
// (with what it does) and launched as cupy_rows.VARIANT_SPECS says. All are bit-exact copies;
// they differ only in how the work is split and how many bytes each SM keeps in flight, which
// is what decides the share of the copy bandwidth a row copy gets (round 1 on an H200: the
// chunked warp variants stopped at ~92% even on contiguous runs, so the structure, not the
// access pattern, was the limit).
//
// 1. Chunked (kinds 0-2, mopd_index_driver / mopd_runs_driver): each row is cut into chunks of
//    GROUP lanes x U vectors; an item is one (row, chunk) pair. Items are numbered row-major and
//    handed out grid-stride to groups, so neighbouring groups copy neighbouring chunks of the
//    same row. A group is one thread (the naive "grid" variant: one vector per item), one warp,
//    or one block. Each lane issues its U independent loads before its U stores (several
//    16-byte loads in flight per thread), and the row index is read once per item (every lane
//    reads the same address: a broadcast).
// 2. Flat (kind 3, mopd_flat_driver): torch's own copy shape, the one that reaches the ceiling:
//    all vectors of the copy numbered flat, U per thread, block_dim apart, non-persistent grid.
// 3. Bulk (mopd_bulk_driver, sm_90): Hopper's bulk copy engine moves row pieces global ->
//    shared -> global through a multi-stage shared-memory pipeline driven by one thread per
//    block, so no registers hold data and the engine keeps many bytes in flight.
//
// In families 1 and 2 no lane depends on another (no shuffles, no barriers, no shared memory);
// the bulk family's lanes share item addresses by shuffles on the device and lane 0 computes
// them alone on the host. So the drivers are __host__ __device__ and the launch-tier tests run them
// on the CPU thread by thread (MOPD_HOST_EMULATION, tests/launch/test_kernels_compile.py) to
// check the work split exactly (bulk copies become byte copies there).

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

// The run k with prefix[k] <= t < prefix[k + 1], for 0 <= t < prefix[n_runs] (binary search).
MOPD_HD i64 mopd_find_run(const i64* __restrict__ prefix, i64 n_runs, i64 t) {
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
  return lo;
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
    const i64 lo = mopd_find_run(prefix, n_runs, t);
    const i64 offset = t - prefix[lo];
    mopd_copy_chunk<V, U, HINT>(src + (src_start[lo] + offset) * src_stride,
                                dst + (dst_start[lo] + offset) * dst_stride,
                                c * per_chunk + g.lane, g.size, vecs_per_row);
  }
}

// ---- flat variants: one thread per U vectors, torch's copy shape ------------------------------
//
// What torch's own vectorized copy does (and why it reaches the copy ceiling): a non-persistent
// grid, each thread issuing U independent 16-byte loads before its U stores, the U vectors of a
// thread block_dim apart so that each load instruction of a warp is one coalesced 512-byte
// access. Here the vectors of the whole copy are numbered flat (row-major over the rows to
// copy); block b owns vectors [b * block_dim * U, (b + 1) * block_dim * U) and thread t of it
// the vectors b * block_dim * U + t + u * block_dim, u < U. Each vector's row comes from one
// division by the row width in vectors (a shift when that is a power of two, else a 32-bit
// division when the flat index fits, else a 64-bit one), and the row index (or run lookup) is
// read only when the row changes between a thread's U vectors. The loop over bases only matters
// when the grid is capped (2^31 - 1 blocks): every thread normally runs it once.

#ifdef __CUDA_ARCH__
#define MOPD_CTZ(x) (__ffsll(x) - 1)
#else
#define MOPD_CTZ(x) __builtin_ctzll(x)
#endif

// n / d for the flat vector indices n in [0, max_dividend) of one launch.
struct MopdRowDiv {
  i64 d;
  int shift;    // >= 0 when d is a power of two
  bool narrow;  // both fit in 32 bits
  MOPD_HD MopdRowDiv(i64 divisor, i64 max_dividend)
      : d(divisor),
        shift((divisor & (divisor - 1)) == 0 ? MOPD_CTZ(divisor) : -1),
        narrow(max_dividend <= 0xffffffffLL && divisor <= 0xffffffffLL) {}
  MOPD_HD i64 operator()(i64 n) const {
    if (shift >= 0) return n >> shift;
    if (narrow) return (i64)((unsigned int)n / (unsigned int)d);
    return n / d;
  }
};

// OP 0 gather (dst row r <- src row a[r]), 1 scatter (dst row a[r] <- src row r), 2 runs
// (a = src_start, b = dst_start, prefix as in mopd_runs_driver).
template <typename V, int U, int HINT, int OP>
MOPD_HD void mopd_flat_driver(const char* __restrict__ src, char* __restrict__ dst,
                              const i64* __restrict__ a, const i64* __restrict__ b,
                              const i64* __restrict__ prefix, i64 n_runs, i64 rows,
                              i64 vecs_per_row, i64 src_stride, i64 dst_stride, i64 thread,
                              i64 block_dim, i64 block_id, i64 n_blocks) {
  const i64 total_rows = OP == 2 ? prefix[n_runs] : rows;
  const i64 total = total_rows * vecs_per_row;
  const MopdRowDiv row_of(vecs_per_row, total);
  const i64 span = block_dim * U;
  for (i64 base = block_id * span + thread; base < total; base += n_blocks * span) {
    V buf[U];
    i64 dst_off[U];  // byte offset of each vector's destination
    i64 cached_t = -1, src_row = 0, dst_row = 0, run = 0;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 v = base + u * block_dim;
      if (v < total) {
        const i64 t = row_of(v);
        if (t != cached_t) {
          if (OP == 2) {
            if (cached_t < 0) {
              run = mopd_find_run(prefix, n_runs, t);
            } else {
              while (prefix[run + 1] <= t) ++run;  // t grows with u: walk forward
            }
            src_row = a[run] + (t - prefix[run]);
            dst_row = b[run] + (t - prefix[run]);
          } else {
            const i64 idx = a[t];
            src_row = OP == 0 ? idx : t;
            dst_row = OP == 0 ? t : idx;
          }
          cached_t = t;
        }
        const i64 col = v - t * vecs_per_row;
        buf[u] = MopdMem<HINT>::load(reinterpret_cast<const V*>(src + src_row * src_stride) + col);
        dst_off[u] = dst_row * dst_stride + col * (i64)sizeof(V);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (base + u * block_dim < total) {
        MopdMem<HINT>::store(reinterpret_cast<V*>(dst + dst_off[u]), buf[u]);
      }
    }
  }
}

// ---- bulk variants: Hopper's bulk copy engine, global -> shared -> global ---------------------
//
// Each row is cut into pieces of PIECE bytes (the last one shorter); an item is one
// (row, piece), numbered row-major, handed out grid-stride to blocks of one warp. Lane 0 of the
// block runs a STAGES-deep pipeline through shared memory: for its k-th item it issues the
// store of item k - (STAGES - 1) (cp.async.bulk shared -> global, one bulk group each), once
// that item's load has landed (its stage's mbarrier), then the load of item k into stage
// k % STAGES (cp.async.bulk global -> shared, completing on the stage's mbarrier with the byte
// count), once the store that last used that stage has read it out (wait_group.read 1: the
// newest store may still be reading). So STAGES - 1 loads and up to two stores are in flight
// per block, issued by one thread, with no registers holding data: the copy engine moves it.
// The lanes compute the addresses of 32 items at a time in parallel (index reads, run searches)
// and hand them to lane 0 by shuffles, so index latency is paid once per 32 items.
//
// Needs sm_90 (the PTX is guarded; the launcher uses these kernels only on sm_90+) and 16-byte
// aligned addresses and sizes: only the v16 kernels exist, other widths launch the vector
// fallback named in cupy_rows.VARIANT_SPECS. Built for the host (MOPD_HOST_EMULATION), the
// copies are done at once, byte by byte, so the tier-1 emulation checks the work split.

typedef unsigned int u32;

// Bound on mbarrier polls before a bulk kernel traps instead of hanging (each try_wait may
// also suspend the thread for a while, so this is seconds, never a legitimate wait).
#define MOPD_BULK_MAX_TRIES (1u << 24)

struct MopdItem {
  i64 src_off, dst_off;  // byte offsets into src and dst
  u32 bytes;             // 0: no item
};

// Item `item` (< items) of a bulk launch: OP as in mopd_flat_driver; `rows` for OP < 2.
template <int OP>
MOPD_HD MopdItem mopd_bulk_item(const i64* __restrict__ a, const i64* __restrict__ b,
                                const i64* __restrict__ prefix, i64 n_runs, i64 item,
                                i64 pieces, i64 piece_bytes, i64 row_bytes, i64 src_stride,
                                i64 dst_stride) {
  const i64 t = item / pieces;
  const i64 off = (item - t * pieces) * piece_bytes;
  i64 src_row, dst_row;
  if (OP == 2) {
    const i64 k = mopd_find_run(prefix, n_runs, t);
    src_row = a[k] + (t - prefix[k]);
    dst_row = b[k] + (t - prefix[k]);
  } else {
    const i64 idx = a[t];
    src_row = OP == 0 ? idx : t;
    dst_row = OP == 0 ? t : idx;
  }
  MopdItem it;
  it.src_off = src_row * src_stride + off;
  it.dst_off = dst_row * dst_stride + off;
  const i64 left = row_bytes - off;
  it.bytes = (u32)(left < piece_bytes ? left : piece_bytes);
  return it;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define MOPD_BULK_PTX 1
MOPD_HD u32 mopd_smem(const void* p) {
  u32 addr;
  asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }"
               : "=r"(addr) : "l"(p));
  return addr;
}
#endif

// The pipeline state of lane 0 and its primitives (the copy engine on sm_90, plain byte copies
// on the host).
template <int PIECE, int STAGES>
struct MopdBulkPipe {
  char* buf;          // STAGES * PIECE bytes of shared memory, 128-byte aligned
  i64* ring_dst;      // [STAGES] destination offset of the item in each stage
  u32* ring_bytes;    // [STAGES] its size
  unsigned long long* bars;  // [STAGES] mbarriers
  const char* src;
  char* dst;

  MOPD_HD void init() {
#ifdef MOPD_BULK_PTX
    for (int s = 0; s < STAGES; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(mopd_smem(bars + s)) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
  }

  // Load item k (src_off, bytes) into stage k % STAGES; its destination is remembered.
  MOPD_HD void load(i64 k, const MopdItem& it) {
    const int s = (int)(k % STAGES);
    if (k >= STAGES) {
      // the store of item k - STAGES used this stage; only the newest store may still read
#ifdef MOPD_BULK_PTX
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
#endif
    }
    ring_dst[s] = it.dst_off;
    ring_bytes[s] = it.bytes;
#ifdef MOPD_BULK_PTX
    const u32 bar = mopd_smem(bars + s);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(bar), "r"(it.bytes) : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        :: "r"(mopd_smem(buf + (i64)s * PIECE)), "l"(src + it.src_off), "r"(it.bytes), "r"(bar)
        : "memory");
#elif !defined(__CUDA_ARCH__)
    for (u32 i = 0; i < it.bytes; ++i) buf[(i64)s * PIECE + i] = src[it.src_off + i];
#endif
  }

  // Store item k from its stage once its load has landed.
  MOPD_HD void store(i64 k) {
    const int s = (int)(k % STAGES);
#ifdef MOPD_BULK_PTX
    const u32 bar = mopd_smem(bars + s);
    const u32 parity = (u32)((k / STAGES) & 1);
    u32 done = 0;
    for (u32 tries = 0; !done; ++tries) {
      // A landed load completes within microseconds; a wait this long is a bug, and a trap
      // (a launch error the caller sees) is better than a hung device.
      if (tries == MOPD_BULK_MAX_TRIES) asm volatile("trap;");
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
          "selp.u32 %0, 1, 0, p; }"
          : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 :: "l"(dst + ring_dst[s]), "r"(mopd_smem(buf + (i64)s * PIECE)),
                    "r"(ring_bytes[s])
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
#elif !defined(__CUDA_ARCH__)
    for (u32 i = 0; i < ring_bytes[s]; ++i) dst[ring_dst[s] + i] = buf[(i64)s * PIECE + i];
#endif
  }

  // Every store complete (before the block's shared memory goes away).
  MOPD_HD void drain() {
#ifdef MOPD_BULK_PTX
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#endif
  }
};

template <int PIECE, int STAGES, int OP>
MOPD_HD void mopd_bulk_driver(const char* __restrict__ src, char* __restrict__ dst,
                              const i64* __restrict__ a, const i64* __restrict__ b,
                              const i64* __restrict__ prefix, i64 n_runs, i64 rows,
                              i64 row_bytes, i64 src_stride, i64 dst_stride, i64 thread,
                              i64 block_id, i64 n_blocks, MopdBulkPipe<PIECE, STAGES> pipe) {
  const i64 lane = thread & 31;
  if (thread >= 32) return;  // one warp per block
#if !defined(__CUDA_ARCH__) || defined(MOPD_BULK_PTX)
  const i64 total_rows = OP == 2 ? prefix[n_runs] : rows;
  const i64 pieces = (row_bytes + PIECE - 1) / PIECE;
  const i64 items = total_rows * pieces;
  pipe.src = src;
  pipe.dst = dst;
  if (lane == 0) pipe.init();
  const i64 lag = STAGES - 1;  // item k is stored while item k + lag is loaded
  i64 k = 0;                   // own items issued so far
  for (i64 first = block_id; first < items; first += 32 * n_blocks) {
#ifdef __CUDA_ARCH__
    // lane j: the own item first + j * n_blocks
    const i64 mine = first + lane * n_blocks;
    MopdItem it = {0, 0, 0};
    if (mine < items) {
      it = mopd_bulk_item<OP>(a, b, prefix, n_runs, mine, pieces, PIECE, row_bytes, src_stride,
                              dst_stride);
    }
    for (int j = 0; j < 32; ++j) {
      MopdItem got;
      got.src_off = __shfl_sync(0xffffffffu, it.src_off, j);
      got.dst_off = __shfl_sync(0xffffffffu, it.dst_off, j);
      got.bytes = __shfl_sync(0xffffffffu, it.bytes, j);
      if (got.bytes == 0) break;  // items grow with j: none after
      if (lane == 0) {
        if (k >= lag) pipe.store(k - lag);
        pipe.load(k, got);
      }
      ++k;
    }
#else
    if (lane != 0) return;  // host: lane 0 alone, computing the 32 items itself
    for (int j = 0; j < 32; ++j) {
      const i64 mine = first + j * n_blocks;
      if (mine >= items) break;
      const MopdItem got = mopd_bulk_item<OP>(a, b, prefix, n_runs, mine, pieces, PIECE,
                                              row_bytes, src_stride, dst_stride);
      if (k >= lag) pipe.store(k - lag);
      pipe.load(k, got);
      ++k;
    }
#endif
  }
  if (lane == 0) {
    for (i64 j = k - lag < 0 ? 0 : k - lag; j < k; ++j) pipe.store(j);
    pipe.drain();
  }
#else
  asm volatile("trap;");  // built for a pre-sm_90 device: never launched there
#endif
}

// ---- the variants ----------------------------------------------------------------------------
//
// Vector variants: (name, kind, unroll U, cache hint). Kind 0/1/2: a group per row chunk is a
// thread, a warp or a block (mopd_index_driver, mopd_runs_driver); kind 3: flat, torch's copy
// shape (mopd_flat_driver). cupy_rows.VARIANT_SPECS names them and says how they launch (grid,
// persistent or not); tests/launch/test_kernels_compile.py checks each one it names.
//   grid      the naive baseline: a thread per 16-byte vector, grid-stride
//   warp      a warp per 2 KiB chunk (U = 4 per lane), plain access
//   warp_cs   same, streaming (evict-first) loads and stores
//   warp_nc   same, read-only loads that skip L1, streaming stores
//   warp8_cs  a warp per 4 KiB chunk (U = 8), streaming
//   warp16    a warp per 8 KiB chunk (U = 16): more bytes in flight per lane, fewer items
//   warp32    a warp per 16 KiB chunk (U = 32): a whole H = 8192 bf16 row per warp
//   block_cs  a block per 16 KiB chunk, streaming
//   (cupy_rows' warp_cs_flat launches the warp_cs kernels with one warp per chunk, no loop)
//   flat      torch's copy shape, U = 4 vectors per thread, block_dim apart, plain access
//   flat_cs   same, streaming
//   flat8     same, U = 8
#define MOPD_VARIANTS(X, VB) \
  X(grid, VB, 0, 1, 0)       \
  X(warp, VB, 1, 4, 0)       \
  X(warp_cs, VB, 1, 4, 1)    \
  X(warp_nc, VB, 1, 4, 2)    \
  X(warp8_cs, VB, 1, 8, 1)   \
  X(warp16, VB, 1, 16, 0)    \
  X(warp32, VB, 1, 32, 0)    \
  X(block_cs, VB, 2, 4, 1)   \
  X(flat, VB, 3, 4, 0)       \
  X(flat_cs, VB, 3, 4, 1)    \
  X(flat8, VB, 3, 8, 0)

#define MOPD_ALL(X)      \
  MOPD_VARIANTS(X, 16)   \
  MOPD_VARIANTS(X, 8)    \
  MOPD_VARIANTS(X, 4)    \
  MOPD_VARIANTS(X, 2)    \
  MOPD_VARIANTS(X, 1)

// Bulk variants: (name, PIECE bytes, STAGES); v16 only; launched with one warp per block and
// STAGES * PIECE bytes of static shared memory (<= 48 KiB, no opt-in needed).
//   bulk      8 KiB pieces, 4 stages (3 loads in flight per block)
//   bulk16    16 KiB pieces (a whole H = 8192 bf16 row), 2 stages
#define MOPD_BULK_VARIANTS(X) \
  X(bulk, 8192, 4)            \
  X(bulk16, 16384, 2)

// One body for the kernels and the host emulation. OP 0 gather, 1 scatter, 2 runs.
template <typename V, int KIND, int U, int HINT, int OP>
MOPD_HD void mopd_vector_body(const char* __restrict__ src, char* __restrict__ dst,
                              const i64* __restrict__ a, const i64* __restrict__ b,
                              const i64* __restrict__ prefix, i64 n_runs, i64 rows,
                              i64 vecs_per_row, i64 src_stride, i64 dst_stride, i64 thread,
                              i64 block_dim, i64 block_id, i64 n_blocks) {
  if (KIND == 3) {
    mopd_flat_driver<V, U, HINT, OP>(src, dst, a, b, prefix, n_runs, rows, vecs_per_row,
                                     src_stride, dst_stride, thread, block_dim, block_id,
                                     n_blocks);
  } else if (OP == 2) {
    mopd_runs_driver<V, (KIND == 3 ? 0 : KIND), U, HINT>(src, dst, a, b, prefix, n_runs,
                                                         vecs_per_row, src_stride, dst_stride,
                                                         thread, block_dim, block_id, n_blocks);
  } else {
    mopd_index_driver<V, (KIND == 3 ? 0 : KIND), U, HINT, OP>(src, dst, a, rows, vecs_per_row,
                                                              src_stride, dst_stride, thread,
                                                              block_dim, block_id, n_blocks);
  }
}

#define MOPD_SIG_INDEX                                                                         \
  (const char* __restrict__ src, char* __restrict__ dst, const i64* __restrict__ index,       \
   i64 rows, i64 vecs_per_row, i64 src_stride, i64 dst_stride)
#define MOPD_SIG_RUNS                                                                          \
  (const char* __restrict__ src, char* __restrict__ dst, const i64* __restrict__ src_start,   \
   const i64* __restrict__ dst_start, const i64* __restrict__ prefix, i64 n_runs,             \
   i64 vecs_per_row, i64 src_stride, i64 dst_stride)

// Kernels: mopd_{gather,scatter,runs}_<variant>_v<VB>, launched with MOPD_BLOCK threads.
#define MOPD_KERNELS(NAME, VB, KIND, U, HINT)                                                  \
  extern "C" __global__ void __launch_bounds__(MOPD_BLOCK)                                     \
      mopd_gather_##NAME##_v##VB MOPD_SIG_INDEX {                                              \
    mopd_vector_body<MopdVec<VB>::T, KIND, U, HINT, 0>(src, dst, index, 0, 0, 0, rows,         \
                                                       vecs_per_row, src_stride, dst_stride,   \
                                                       threadIdx.x, blockDim.x, blockIdx.x,    \
                                                       gridDim.x);                             \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(MOPD_BLOCK)                                     \
      mopd_scatter_##NAME##_v##VB MOPD_SIG_INDEX {                                             \
    mopd_vector_body<MopdVec<VB>::T, KIND, U, HINT, 1>(src, dst, index, 0, 0, 0, rows,         \
                                                       vecs_per_row, src_stride, dst_stride,   \
                                                       threadIdx.x, blockDim.x, blockIdx.x,    \
                                                       gridDim.x);                             \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(MOPD_BLOCK)                                     \
      mopd_runs_##NAME##_v##VB MOPD_SIG_RUNS {                                                 \
    mopd_vector_body<MopdVec<VB>::T, KIND, U, HINT, 2>(src, dst, src_start, dst_start, prefix, \
                                                       n_runs, 0, vecs_per_row, src_stride,    \
                                                       dst_stride, threadIdx.x, blockDim.x,    \
                                                       blockIdx.x, gridDim.x);                 \
  }

// Which kernels this compilation defines: MOPD_KERNEL_SET 0 (the default: all, for nvcc
// checks), 1 (the vector kernels) or 2 (the bulk kernels). cupy_rows.py compiles the two sets as
// separate modules, so that a bulk kernel NVRTC rejects costs the bulk variants only.
#ifndef MOPD_KERNEL_SET
#define MOPD_KERNEL_SET 0
#endif

#if MOPD_KERNEL_SET != 2
MOPD_ALL(MOPD_KERNELS)
#endif

// Bulk kernels: mopd_{gather,scatter,runs}_<variant>_v16, launched with 32 threads (one warp).
// vecs_per_row counts 16-byte vectors, as for the vector kernels.
#define MOPD_BULK_SHARED(PIECE, STAGES)                                         \
  __shared__ __align__(128) char buf[(STAGES) * (PIECE)];                       \
  __shared__ __align__(8) unsigned long long bars[STAGES];                      \
  __shared__ i64 ring_dst[STAGES];                                              \
  __shared__ u32 ring_bytes[STAGES];                                            \
  MopdBulkPipe<PIECE, STAGES> pipe = {buf, ring_dst, ring_bytes, bars, 0, 0};

#define MOPD_BULK_KERNELS(NAME, PIECE, STAGES)                                                 \
  extern "C" __global__ void __launch_bounds__(32) mopd_gather_##NAME##_v16 MOPD_SIG_INDEX {   \
    MOPD_BULK_SHARED(PIECE, STAGES)                                                            \
    mopd_bulk_driver<PIECE, STAGES, 0>(src, dst, index, 0, 0, 0, rows, vecs_per_row * 16,      \
                                       src_stride, dst_stride, threadIdx.x, blockIdx.x,        \
                                       gridDim.x, pipe);                                       \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(32) mopd_scatter_##NAME##_v16 MOPD_SIG_INDEX {  \
    MOPD_BULK_SHARED(PIECE, STAGES)                                                            \
    mopd_bulk_driver<PIECE, STAGES, 1>(src, dst, index, 0, 0, 0, rows, vecs_per_row * 16,      \
                                       src_stride, dst_stride, threadIdx.x, blockIdx.x,        \
                                       gridDim.x, pipe);                                       \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(32) mopd_runs_##NAME##_v16 MOPD_SIG_RUNS {      \
    MOPD_BULK_SHARED(PIECE, STAGES)                                                            \
    mopd_bulk_driver<PIECE, STAGES, 2>(src, dst, src_start, dst_start, prefix, n_runs, 0,      \
                                       vecs_per_row * 16, src_stride, dst_stride, threadIdx.x, \
                                       blockIdx.x, gridDim.x, pipe);                           \
  }

#if MOPD_KERNEL_SET != 1
MOPD_BULK_VARIANTS(MOPD_BULK_KERNELS)
#endif

#ifdef MOPD_HOST_EMULATION
// Host emulation for the tier-1 tests: runs a kernel's body for every (block, thread) of a
// launch of n_blocks x block_dim, one thread after another. Exact, because no lane reads what
// another writes (the bulk body runs lane 0 alone on the host, computing its items itself; its
// "shared memory" is a host buffer per block). op: 0 gather, 1 scatter, 2 runs. Returns 0, or
// -1 for an unknown name, -2 for a block_dim the kernel is not launched with.
#include <vector>
#include <cstring>

template <typename V, int KIND, int U, int HINT>
int mopd_emulate_vector(int op, const char* src, char* dst, const i64* a, const i64* b,
                        const i64* prefix, i64 n_runs, i64 rows, i64 vecs_per_row,
                        i64 src_stride, i64 dst_stride, i64 n_blocks, i64 block_dim) {
  if (block_dim != MOPD_BLOCK) return -2;
  for (i64 blk = 0; blk < n_blocks; ++blk) {
    for (i64 t = 0; t < block_dim; ++t) {
      if (op == 2) {
        mopd_vector_body<V, KIND, U, HINT, 2>(src, dst, a, b, prefix, n_runs, rows, vecs_per_row,
                                              src_stride, dst_stride, t, block_dim, blk,
                                              n_blocks);
      } else if (op == 1) {
        mopd_vector_body<V, KIND, U, HINT, 1>(src, dst, a, b, prefix, n_runs, rows, vecs_per_row,
                                              src_stride, dst_stride, t, block_dim, blk,
                                              n_blocks);
      } else {
        mopd_vector_body<V, KIND, U, HINT, 0>(src, dst, a, b, prefix, n_runs, rows, vecs_per_row,
                                              src_stride, dst_stride, t, block_dim, blk,
                                              n_blocks);
      }
    }
  }
  return 0;
}

template <int PIECE, int STAGES>
int mopd_emulate_bulk(int op, const char* src, char* dst, const i64* a, const i64* b,
                      const i64* prefix, i64 n_runs, i64 rows, i64 vecs_per_row, i64 src_stride,
                      i64 dst_stride, i64 n_blocks, i64 block_dim) {
  if (block_dim != 32) return -2;
  std::vector<char> buf((size_t)STAGES * PIECE, (char)0x77);  // stale bytes must not leak
  i64 ring_dst[STAGES];
  u32 ring_bytes[STAGES];
  unsigned long long bars[STAGES];
  for (i64 blk = 0; blk < n_blocks; ++blk) {
    for (i64 t = 0; t < block_dim; ++t) {
      MopdBulkPipe<PIECE, STAGES> pipe = {buf.data(), ring_dst, ring_bytes, bars, 0, 0};
      if (op == 2) {
        mopd_bulk_driver<PIECE, STAGES, 2>(src, dst, a, b, prefix, n_runs, rows,
                                           vecs_per_row * 16, src_stride, dst_stride, t, blk,
                                           n_blocks, pipe);
      } else if (op == 1) {
        mopd_bulk_driver<PIECE, STAGES, 1>(src, dst, a, b, prefix, n_runs, rows,
                                           vecs_per_row * 16, src_stride, dst_stride, t, blk,
                                           n_blocks, pipe);
      } else {
        mopd_bulk_driver<PIECE, STAGES, 0>(src, dst, a, b, prefix, n_runs, rows,
                                           vecs_per_row * 16, src_stride, dst_stride, t, blk,
                                           n_blocks, pipe);
      }
    }
  }
  return 0;
}

#define MOPD_EMULATE(NAME, VB, KIND, U, HINT)                                                  \
  if (vb == VB && std::strcmp(variant, #NAME) == 0) {                                          \
    return mopd_emulate_vector<MopdVec<VB>::T, KIND, U, HINT>(                                 \
        op, src, dst, a, b_arr, prefix, n_runs, rows, vecs_per_row, src_stride, dst_stride,    \
        n_blocks, block_dim);                                                                  \
  }
#define MOPD_EMULATE_BULK(NAME, PIECE, STAGES)                                                 \
  if (vb == 16 && std::strcmp(variant, #NAME) == 0) {                                          \
    return mopd_emulate_bulk<PIECE, STAGES>(op, src, dst, a, b_arr, prefix, n_runs, rows,      \
                                            vecs_per_row, src_stride, dst_stride, n_blocks,    \
                                            block_dim);                                        \
  }

extern "C" int mopd_emulate(int op, const char* variant, int vb, const char* src, char* dst,
                            const i64* a, const i64* b_arr, const i64* prefix, i64 n_runs,
                            i64 rows, i64 vecs_per_row, i64 src_stride, i64 dst_stride,
                            i64 n_blocks, i64 block_dim) {
  MOPD_ALL(MOPD_EMULATE)
  MOPD_BULK_VARIANTS(MOPD_EMULATE_BULK)
  return -1;
}
#endif  // MOPD_HOST_EMULATION
