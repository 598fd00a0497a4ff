// common.cuh: the element type and the helpers every pagedcli kernel shares.
//
// The Python side (pagedcli/backends/cuda.py) pastes this file into each .cu source before
// compiling it with NVRTC (CuPy's RawModule), so a change here changes the source text, and
// CuPy's on-disk kernel cache (keyed by the source text) can never serve a stale build.
//
// No CUDA header is included: NVRTC builds these sources with only its built-in declarations
// (vector types, intrinsics, math functions). bf16 and fp16 conversions are therefore written
// here: bf16 with plain bit manipulation, fp16 with the PTX `cvt` instruction.
//
// Exactly one of DTYPE_BF16, DTYPE_F16, DTYPE_F32 must be defined: the model's (and the KV pool's)
// element type. `scalar_t` is how one element is stored; all arithmetic is in float.
#pragma once

#if defined(DTYPE_BF16) + defined(DTYPE_F16) + defined(DTYPE_F32) != 1
#error "define exactly one of DTYPE_BF16, DTYPE_F16, DTYPE_F32 (the model's element type)"
#endif

#define WARP_SIZE 32
#define FULL_MASK 0xffffffffu

#if defined(DTYPE_F32)
typedef float scalar_t;
#else
typedef unsigned short scalar_t;  // the raw 16 bits of a bf16 or fp16 number
#endif

// Elements in one 16-byte vector (uint4): the widest load a thread can issue in one instruction.
#define VEC_BYTES ((int)sizeof(uint4))
#define VEC ((int)(sizeof(uint4) / sizeof(scalar_t)))

// --- scalar conversions ---------------------------------------------------------------------

__device__ __forceinline__ float to_float(scalar_t x) {
#if defined(DTYPE_F32)
    return x;
#elif defined(DTYPE_BF16)
    return __uint_as_float(((unsigned int)x) << 16);  // bf16 is the top half of a float
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
#endif
}

// float -> element type, rounding to nearest, ties to even (what torch does).
__device__ __forceinline__ scalar_t from_float(float f) {
#if defined(DTYPE_F32)
    return f;
#elif defined(DTYPE_BF16)
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it a (quiet) NaN
        return (scalar_t)((u >> 16) | 0x0040u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);  // round half to even on the 16 bits dropped
    return (scalar_t)(u >> 16);
#else
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#endif
}

// Round a float to the element type and back: where torch, computing in the model dtype, stores
// an intermediate result, we round it the same way so that bf16 results agree bit for bit.
__device__ __forceinline__ float round_to_dtype(float f) { return to_float(from_float(f)); }

// --- partial results of other CTAs -------------------------------------------------------

// A float written by another CTA of this launch: read from L2, past this SM's L1.
__device__ __forceinline__ float load_from_l2(const float* p) {
    float r;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(r) : "l"(p));
    return r;
}

// Two of them (8-byte aligned).
__device__ __forceinline__ float2 load2_from_l2(const float* p) {
    float2 r;
    asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];" : "=f"(r.x), "=f"(r.y) : "l"(p));
    return r;
}

// --- 16-byte vectors ------------------------------------------------------------------------

// WORDS 32-bit words of packed elements as floats (a word holds one float, or two bf16/fp16).
template <int WORDS>
__device__ __forceinline__ void unpack_words(const unsigned int (&w)[WORDS],
                                             float (&out)[WORDS * 4 / (int)sizeof(scalar_t)]) {
#pragma unroll
    for (int i = 0; i < WORDS; ++i) {
#if defined(DTYPE_F32)
        out[i] = __uint_as_float(w[i]);
#elif defined(DTYPE_BF16)
        out[2 * i] = __uint_as_float(w[i] << 16);
        out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
#else
        out[2 * i] = to_float((scalar_t)(w[i] & 0xffffu));
        out[2 * i + 1] = to_float((scalar_t)(w[i] >> 16));
#endif
    }
}

__device__ __forceinline__ void unpack_vec(const uint4& raw, float (&out)[VEC]) {
    const unsigned int w[4] = {raw.x, raw.y, raw.z, raw.w};
    unpack_words<4>(w, out);
}

__device__ __forceinline__ uint4 pack_vec(const float (&in)[VEC]) {
    unsigned int w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#if defined(DTYPE_F32)
        w[i] = __float_as_uint(in[i]);
#else
        w[i] = (unsigned int)from_float(in[2 * i]) | ((unsigned int)from_float(in[2 * i + 1]) << 16);
#endif
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// N consecutive elements as floats: one 16-byte load when N == VEC (the caller guarantees the
// alignment), else N scalar loads.
template <int N>
__device__ __forceinline__ void load_floats(const scalar_t* __restrict__ p, float (&out)[N]) {
    if constexpr (N == VEC) {
        unpack_vec(*reinterpret_cast<const uint4*>(p), out);
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) out[i] = to_float(p[i]);
    }
}

template <int N>
__device__ __forceinline__ void store_floats(scalar_t* __restrict__ p, const float (&in)[N]) {
    if constexpr (N == VEC) {
        *reinterpret_cast<uint4*>(p) = pack_vec(in);
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) p[i] = from_float(in[i]);
    }
}

// --- reductions -----------------------------------------------------------------------------

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int off = WARP_SIZE / 2; off > 0; off >>= 1) x += __shfl_xor_sync(FULL_MASK, x, off);
    return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int off = WARP_SIZE / 2; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(FULL_MASK, x, off));
    return x;
}

__device__ __forceinline__ float neg_infinity() { return __int_as_float(0xff800000); }

// Smallest power of two >= n (n >= 1), for compile-time lane counts.
__host__ __device__ constexpr int next_pow2(int n) { return n <= 1 ? 1 : 2 * next_pow2((n + 1) / 2); }

// --- the layer's elementwise formulas, rounded where the torch reference rounds ----------------
// (pagedcli/backends/torch.py computes in the model dtype; elementwise.cu and gemv.cu both use these.)
// __fmul_rn/__fadd_rn keep the compiler from fusing products and sums into FMAs where torch computes
// them separately.

// RMSNorm's 1 / rms from the fp32 sum of squares of n elements.
__device__ __forceinline__ float rms_inverse(float sum_sq, int n, float eps) {
    return rsqrtf(__fadd_rn(sum_sq / (float)n, eps));
}

// weight * RMSNorm(x): the normalised value rounded, then multiplied by the weight (the caller's
// store rounds again).
__device__ __forceinline__ float rms_scale(float x, float weight, float inv_rms) {
    return __fmul_rn(weight, round_to_dtype(__fmul_rn(x, inv_rms)));
}

// silu(gate) * up: silu = gate / (1 + exp(-gate)) rounded, then times up (the caller's store rounds).
__device__ __forceinline__ float silu_times(float gate, float up) {
    return __fmul_rn(round_to_dtype(__fdiv_rn(gate, __fadd_rn(1.0f, expf(-gate)))), up);
}

// --- programmatic dependent launch (sm_90+) ----------------------------------------------------
// On sm_90+ the launcher (pagedcli/backends/cuda_launch.py) lets each of our kernels start before
// the kernel ahead of it in the stream has finished, so that a chain of short kernels (a decode step
// at batch 1 is ~80 of them) does not pay each launch, and each first load, after the previous
// kernel's last byte. Therefore every kernel of ours calls wait_for_previous_kernels() before its
// first read of anything an earlier kernel wrote and before its first write: it returns once the
// kernel ahead has completed and its writes are visible (and so, transitively, every kernel before
// that one). Only what no kernel of the step writes may be read before it: gemv.cu loads its first
// weight tile there, and paged_attention.cu (with fp8 weights) the batch's lengths and slots and
// its block table. Those are written before the step's host-to-device copy of its batch (the
// table by torch's scatter in KVCache.sync_device_table, engine/runner.py), and a kernel that
// follows a copy in the stream starts only once the copy is done. A CPU test
// (tests/test_kernels_compile.py) checks this order in the PTX of every kernel the Llama-3.2-1B plan
// builds (bf16 and fp8 pools, bf16 and fp8 weights, float32).
// A kernel may be scheduled early once every CTA of the one ahead has called allow_next_kernel()
// (or exited); ours call it at their start, so that the next kernel's CTAs take each SM as this
// kernel's CTAs leave it, and gemv.cu's then have their first weights in flight. Launched without
// the attribute (before sm_90, a driver before CUDA 12.3, or PROGRAMMATIC_LAUNCH off) both are
// no-ops.
__device__ __forceinline__ void allow_next_kernel() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_previous_kernels() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Both, for a kernel that has nothing to do before the wait.
__device__ __forceinline__ void start_after_previous_kernels() {
    allow_next_kernel();
    wait_for_previous_kernels();
}
