// Row-wise fused passes of the vocab-parallel KL (mopd.kernels.kl), compiled by CuPy (NVRTC).
//
// Why this file exists: the torch twin of these two passes (mopd.kernels.kl.rowwise) makes about
// ten fp32 passes over each [chunk, V_local] block; these kernels read the logits once per pass
// and keep everything else in registers:
//   kl_row_stats: per row, online softmax statistics of the student (s) and teacher (u) logits:
//                 local max, sum exp(x - max), and sum exp(x - max) * (s - u), written as
//                 partials [6, C, P] (P column blocks per row; combined on the host side).
//   kl_row_grad:  out = exp(s - mS) * (alpha * (s - u) + beta) + gamma * exp(u - mT), per row
//                 coefficients [5, C] = (mS, mT, alpha, beta, gamma). out may alias s when both
//                 have one storage type (each element is read and then written by the same
//                 thread), which saves a buffer.
// Storage types: bf16 (as unsigned short bits) or float, chosen per tensor; all math is fp32.
// Entry points (extern "C"), by the storage types of (s, u) and (s, u, out):
//   kl_row_stats_bf16, _f32, _bf16_f32 (bf16 student, fp32 teacher logits);
//   kl_row_grad_bf16, _f32, _bf16_f32_bf16 (logits path: bf16 student, fp32 teacher, bf16
//   gradient), _f32_f32_bf16 (fused path: fp32 logits of bf16 inputs, bf16 gradient).
// Rows have a leading dimension (elements); columns are contiguous. vec_ok = 1 when every row
// start is 16-byte aligned: then each thread moves VEC consecutive columns per step with 16-byte
// vector accesses (VEC = 8 when any tensor is bf16, else 4; a float tensor then takes two).

struct KlBf16 {  // bf16 bits in unsigned short; 8 per 16-byte vector
    typedef unsigned short T;
    static const int VEC = 8;
    static __device__ __forceinline__ float load(T v) {
        return __uint_as_float(((unsigned int)v) << 16);
    }
    static __device__ __forceinline__ T round(float f) {
        unsigned int bits = __float_as_uint(f);
        if ((bits & 0x7f800000u) == 0x7f800000u) {  // inf or nan: keep; nan stays nan
            return (T)((bits >> 16) | ((bits & 0xffffu) ? 0x40u : 0u));
        }
        bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
        return (T)(bits >> 16);
    }
    static __device__ __forceinline__ void unpack(const uint4 v, float* x) {
        const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            x[2 * k] = __uint_as_float(w[k] << 16);
            x[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
        }
    }
    static __device__ __forceinline__ uint4 pack(const float* x) {
        unsigned int w[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            w[k] = ((unsigned int)round(x[2 * k])) | (((unsigned int)round(x[2 * k + 1])) << 16);
        }
        uint4 r;
        r.x = w[0];
        r.y = w[1];
        r.z = w[2];
        r.w = w[3];
        return r;
    }
};

struct KlF32 {  // float; 4 per 16-byte vector
    typedef float T;
    static const int VEC = 4;
    static __device__ __forceinline__ float load(T v) { return v; }
    static __device__ __forceinline__ T round(float f) { return f; }
    static __device__ __forceinline__ void unpack(const uint4 v, float* x) {
        x[0] = __uint_as_float(v.x);
        x[1] = __uint_as_float(v.y);
        x[2] = __uint_as_float(v.z);
        x[3] = __uint_as_float(v.w);
    }
    static __device__ __forceinline__ uint4 pack(const float* x) {
        uint4 r;
        r.x = __float_as_uint(x[0]);
        r.y = __float_as_uint(x[1]);
        r.z = __float_as_uint(x[2]);
        r.w = __float_as_uint(x[3]);
        return r;
    }
};

// N consecutive elements (N a multiple of K::VEC, 16-byte aligned) to and from floats.
template <class K, int N>
__device__ __forceinline__ void kl_load_n(const typename K::T* p, float* x) {
#pragma unroll
    for (int q = 0; q < N / K::VEC; ++q) {
        K::unpack(reinterpret_cast<const uint4*>(p)[q], x + q * K::VEC);
    }
}

template <class K, int N>
__device__ __forceinline__ void kl_store_n(typename K::T* p, const float* x) {
#pragma unroll
    for (int q = 0; q < N / K::VEC; ++q) {
        reinterpret_cast<uint4*>(p)[q] = K::pack(x + q * K::VEC);
    }
}

template <class A, class B>
struct KlVec2 {  // the vector step of two storage types: the wider element count
    static const int VEC = A::VEC > B::VEC ? A::VEC : B::VEC;
};

#define KL_NEG_INF (__int_as_float(0xff800000))

// (m, z, a): running max, sum exp(x - m), sum exp(x - m) * d.
__device__ __forceinline__ void kl_push(float& m, float& z, float& a, float x, float d) {
    if (x > m) {
        const float f = expf(m - x);  // m = -inf -> 0
        z = z * f + 1.0f;
        a = a * f + d;
        m = x;
    } else {
        const float e = expf(x - m);
        z += e;
        a += e * d;
    }
}

__device__ __forceinline__ void kl_merge(float& m, float& z, float& a, float m2, float z2, float a2) {
    if (m2 == KL_NEG_INF) return;
    if (m == KL_NEG_INF) {
        m = m2;
        z = z2;
        a = a2;
        return;
    }
    if (m2 > m) {
        const float f = expf(m - m2);
        z = z * f + z2;
        a = a * f + a2;
        m = m2;
    } else {
        const float f = expf(m2 - m);
        z += z2 * f;
        a += a2 * f;
    }
}

template <class KS, class KU>
__device__ __forceinline__ void kl_row_stats_impl(
    const typename KS::T* __restrict__ s, const long long ld_s,
    const typename KU::T* __restrict__ u, const long long ld_u, const int n, const int span,
    const int vec_ok, const int need_forward, float* __restrict__ part, const int C,
    const int P) {
    const int VEC = KlVec2<KS, KU>::VEC;
    const int row = blockIdx.y;
    const int p = blockIdx.x;
    const typename KS::T* srow = s + (long long)row * ld_s;
    const typename KU::T* urow = u + (long long)row * ld_u;
    const int begin = p * span;
    const int end = min(n, begin + span);
    float mS = KL_NEG_INF, zS = 0.0f, aS = 0.0f;
    float mT = KL_NEG_INF, zT = 0.0f, bT = 0.0f;
    int scalar_from = begin;
    if (vec_ok && end > begin) {
        const int nvec = (end - begin) / VEC;
        for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
            const int j = begin + i * VEC;
            float xs[VEC], xu[VEC];
            kl_load_n<KS, VEC>(srow + j, xs);
            kl_load_n<KU, VEC>(urow + j, xu);
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
                const float d = xs[k] - xu[k];
                kl_push(mS, zS, aS, xs[k], d);
                kl_push(mT, zT, bT, xu[k], d);
            }
        }
        scalar_from = begin + nvec * VEC;
    }
    for (int j = scalar_from + threadIdx.x; j < end; j += blockDim.x) {
        const float x = KS::load(srow[j]);
        const float y = KU::load(urow[j]);
        const float d = x - y;
        kl_push(mS, zS, aS, x, d);
        kl_push(mT, zT, bT, y, d);
    }
    // warp reduction
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float m2 = __shfl_down_sync(0xffffffffu, mS, off);
        const float z2 = __shfl_down_sync(0xffffffffu, zS, off);
        const float a2 = __shfl_down_sync(0xffffffffu, aS, off);
        const float n2 = __shfl_down_sync(0xffffffffu, mT, off);
        const float y2 = __shfl_down_sync(0xffffffffu, zT, off);
        const float b2 = __shfl_down_sync(0xffffffffu, bT, off);
        kl_merge(mS, zS, aS, m2, z2, a2);
        kl_merge(mT, zT, bT, n2, y2, b2);
    }
    __shared__ float sh[6][32];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    if (lane == 0) {
        sh[0][warp] = mS; sh[1][warp] = zS; sh[2][warp] = aS;
        sh[3][warp] = mT; sh[4][warp] = zT; sh[5][warp] = bT;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < nwarps; ++w) {
            kl_merge(mS, zS, aS, sh[0][w], sh[1][w], sh[2][w]);
            kl_merge(mT, zT, bT, sh[3][w], sh[4][w], sh[5][w]);
        }
        const long long cp = (long long)C * P;
        const long long at = (long long)row * P + p;
        part[0 * cp + at] = mS;
        part[1 * cp + at] = mT;
        part[2 * cp + at] = zS;
        part[3 * cp + at] = zT;
        part[4 * cp + at] = aS;
        part[5 * cp + at] = need_forward ? bT : 0.0f;
    }
}

template <class KS, class KU, class KO>
__device__ __forceinline__ void kl_row_grad_impl(
    const typename KS::T* s, const long long ld_s, const typename KU::T* __restrict__ u,
    const long long ld_u, typename KO::T* out, const long long ld_o, const int n,
    const int span, const int vec_ok, const float* __restrict__ coef, const int C,
    const int teacher_term) {
    const int VEC = KlVec2<KlVec2<KS, KU>, KO>::VEC;
    const int row = blockIdx.y;
    const int p = blockIdx.x;
    const typename KS::T* srow = s + (long long)row * ld_s;
    const typename KU::T* urow = u + (long long)row * ld_u;
    typename KO::T* orow = out + (long long)row * ld_o;
    const float mS = coef[0 * C + row];
    const float mT = coef[1 * C + row];
    const float alpha = coef[2 * C + row];
    const float beta = coef[3 * C + row];
    const float gamma = coef[4 * C + row];
    const int begin = p * span;
    const int end = min(n, begin + span);
    int scalar_from = begin;
    if (vec_ok && end > begin) {
        const int nvec = (end - begin) / VEC;
        for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
            const int j = begin + i * VEC;
            float xs[VEC], xu[VEC], g[VEC];
            kl_load_n<KS, VEC>(srow + j, xs);
            kl_load_n<KU, VEC>(urow + j, xu);
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
                g[k] = expf(xs[k] - mS) * (alpha * (xs[k] - xu[k]) + beta);
                if (teacher_term) g[k] += gamma * expf(xu[k] - mT);
            }
            kl_store_n<KO, VEC>(orow + j, g);
        }
        scalar_from = begin + nvec * VEC;
    }
    for (int j = scalar_from + threadIdx.x; j < end; j += blockDim.x) {
        const float x = KS::load(srow[j]);
        const float y = KU::load(urow[j]);
        float g = expf(x - mS) * (alpha * (x - y) + beta);
        if (teacher_term) g += gamma * expf(y - mT);
        orow[j] = KO::round(g);
    }
}

#define KL_STATS_ENTRY(SUFFIX, TS, TU)                                                          \
    extern "C" __global__ void kl_row_stats_##SUFFIX(                                             \
        const TS::T* __restrict__ s, const long long ld_s, const TU::T* __restrict__ u,          \
        const long long ld_u, const int n, const int span, const int vec_ok,                     \
        const int need_forward, float* __restrict__ part, const int C, const int P) {            \
        kl_row_stats_impl<TS, TU>(s, ld_s, u, ld_u, n, span, vec_ok, need_forward, part, C, P);  \
    }

#define KL_GRAD_ENTRY(SUFFIX, TS, TU, TO)                                                        \
    extern "C" __global__ void kl_row_grad_##SUFFIX(                                              \
        const TS::T* s, const long long ld_s, const TU::T* __restrict__ u, const long long ld_u,  \
        TO::T* out, const long long ld_o, const int n, const int span, const int vec_ok,         \
        const float* __restrict__ coef, const int C, const int teacher_term) {                   \
        kl_row_grad_impl<TS, TU, TO>(s, ld_s, u, ld_u, out, ld_o, n, span, vec_ok, coef, C,      \
                                     teacher_term);                                              \
    }

KL_STATS_ENTRY(bf16, KlBf16, KlBf16)
KL_STATS_ENTRY(f32, KlF32, KlF32)
KL_STATS_ENTRY(bf16_f32, KlBf16, KlF32)
KL_GRAD_ENTRY(bf16, KlBf16, KlBf16, KlBf16)
KL_GRAD_ENTRY(f32, KlF32, KlF32, KlF32)
KL_GRAD_ENTRY(bf16_f32_bf16, KlBf16, KlF32, KlBf16)
KL_GRAD_ENTRY(f32_f32_bf16, KlF32, KlF32, KlBf16)
