// mma.cuh: the tensor-core PTX (sm_80+) the attention kernels share: ldmatrix, mma.sync
// m16n8k16 in bf16/fp16 with fp32 accumulators, packing floats into 16-bit pairs, and MUFU's exp2.
//
// Fragment layout of m16n8k16 (lane = 4 g + t): A holds rows g and g + 8, columns 2t, 2t + 1
// (a0, a1) and those + 8 (a2, a3); B holds column g, rows 2t, 2t + 1 and + 8 (b0, b1); C holds
// rows g (c0, c1) and g + 8 (c2, c3), columns 2t, 2t + 1.
#pragma once

#include "common.cuh"
#include "async_copy.cuh"
#include "fp8.cuh"
#include "geometry.cuh"

#if defined(DTYPE_BF16)
#define MMA_TYPES "bf16.bf16"
#else
#define MMA_TYPES "f16.f16"
#endif

// The head-dim side of the attention kernels' tiles (HEAD_DIM, geometry.cuh).
constexpr int D_PAD = (HEAD_DIM + 15) / 16 * 16;  // head dim rounded up to the mma's k (pad columns are zeros)
constexpr int K_STEPS = D_PAD / 16;               // k-steps of Q K^T
constexpr int O_TILES = D_PAD / 8;                // n-tiles of O (8 head-dim columns each)
// Shared-memory rows are padded by 16 bytes: the 8 rows one ldmatrix reads then start in
// different banks (a row stride of 4 mod 8 words).
constexpr int ROW_STRIDE = D_PAD + 8;  // elements

// Four 8x8 matrices of 16-bit elements; lane l names row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(unsigned int (&r)[4], const scalar_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int (&r)[4], const scalar_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(p)));
}

// c += a (16x16, row-major) * b (16x8, column-major), fp32 accumulators.
__device__ __forceinline__ void mma_16816(float (&c)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPES ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// mma_16816 where rows 8 to 15 of a are zeros (a1 = a3 = 0): only rows 0 to 7 of c are kept, so
// a caller with at most 8 rows holds half the accumulators (the other half are scratch outputs).
__device__ __forceinline__ void mma_16816_rows8(float (&c)[2], unsigned int a0, unsigned int a2, unsigned int b0,
                                                unsigned int b1) {
    float unused0, unused1;
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPES ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %10, %10};"
                 : "+f"(c[0]), "+f"(c[1]), "=f"(unused0), "=f"(unused1)
                 : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(0.0f));
    (void)unused0, (void)unused1;
}

// Two floats as two packed 16-bit elements (lo in the low half), rounded to nearest even.
__device__ __forceinline__ unsigned int pack2(float lo, float hi) {
    unsigned int r;
#if defined(DTYPE_BF16)
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

// 2^x, flushing results below float's normal range to zero (a probability under 2^-126 of the
// row's largest, which is 1): MUFU.EX2 alone, without exp2f's handling of subnormal results.
__device__ __forceinline__ float exp2_flush(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// One step of FlashAttention-2's online softmax over the rows of `half` of a score tile in
// accumulator layout (row g = lane / 4, or g + 8 for half 1; this lane's columns 2 (lane % 4) + e,
// e = 0, 1, of each of the N n-tiles of 8 keys from key0). With `mask`, the scores of keys past
// `last_key` (and, with a sliding window, before `first_key`) become -inf first; the row's max must
// be finite (its tile holds a key it sees), except with a window (-DSLIDING_WINDOW over 0), where a
// row may see none of a tile's keys and its running max may stay -inf for a while (then its
// probabilities are 0 and its sums stay 0, not NaN: the max is taken as 0 for the exponents). The
// running max is kept in log2 units (scores times scale_log2; the scale is positive, so the max of
// the raw scores scaled is the max of the scaled scores), and each probability is one FMA and an
// exp2: 2^(s scale - max). The running sum (this lane's columns only: summed over the row's 4
// lanes at the end) and the row's output accumulators (O_N n-tiles) are rescaled to the new max.
template <int N, int C, int O_N>
__device__ __forceinline__ void online_softmax_rows(float (&s)[N][C], float (&o)[O_N][C], float& run_max,
                                                    float& run_sum, int half, bool mask, int key0, int last_key,
                                                    float scale_log2, int lane, int first_key = 0) {
    float raw_max = neg_infinity();
#pragma unroll
    for (int j = 0; j < N; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            float& x = s[j][2 * half + e];
#if defined(SLIDING_WINDOW) && SLIDING_WINDOW > 0
            const int key = key0 + j * 8 + 2 * (lane % 4) + e;
            if (mask && (key > last_key || key < first_key)) x = neg_infinity();
#else
            if (mask && key0 + j * 8 + 2 * (lane % 4) + e > last_key) x = neg_infinity();  // (first_key is 0)
#endif
            raw_max = fmaxf(raw_max, x);
        }
    }
    raw_max = fmaxf(raw_max, __shfl_xor_sync(FULL_MASK, raw_max, 1));  // the 4 lanes of a row
    raw_max = fmaxf(raw_max, __shfl_xor_sync(FULL_MASK, raw_max, 2));
#if defined(SLIDING_WINDOW) && SLIDING_WINDOW > 0
    const float seen_max = fmaxf(run_max, raw_max * scale_log2);
    const float m = seen_max == neg_infinity() ? 0.0f : seen_max;  // (-inf - -inf would be NaN)
    const float correction = exp2_flush(run_max - m);
    run_max = seen_max;
#else
    const float m = fmaxf(run_max, raw_max * scale_log2);
    const float correction = exp2_flush(run_max - m);
    run_max = m;
#endif
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < N; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            float& x = s[j][2 * half + e];
            x = exp2_flush(fmaf(x, scale_log2, -m));
            sum += x;
        }
    }
    run_sum = run_sum * correction + sum;
#pragma unroll
    for (int d = 0; d < O_N; ++d) {
        o[d][2 * half] *= correction;
        o[d][2 * half + 1] *= correction;
    }
}

#if defined(KV_FP8)
// BYTES e4m3 values of an fp8 pool (8 or 16) as as many elements of the model dtype, times
// E4M3_UNPACK_FACTOR (fp8.cuh): exact, every e4m3 value is a bf16 and an fp16 number. The tiles
// the mma reads are then the model dtype's, and the kernels fold the factor out with the scales.
template <int BYTES>
__device__ __forceinline__ void e4m3_to_elements(const unsigned char* src, scalar_t* dst) {
    constexpr int WORDS = BYTES / 4;
    unsigned int in[WORDS], out[2 * WORDS];
    if constexpr (WORDS == 4) {
        const uint4 v = *reinterpret_cast<const uint4*>(src);
        in[0] = v.x, in[1] = v.y, in[2] = v.z, in[3] = v.w;
    } else {
        const uint2 v = *reinterpret_cast<const uint2*>(src);
        in[0] = v.x, in[1] = v.y;
    }
#pragma unroll
    for (int w = 0; w < WORDS; ++w) {
#if defined(DTYPE_F16)
        e4m3x4_halves(in[w], out[2 * w], out[2 * w + 1]);
#else
        float a, b, c, d;
        e4m3x4_scaled(in[w], a, b, c, d);
        out[2 * w] = pack2(a, b), out[2 * w + 1] = pack2(c, d);
#endif
    }
#pragma unroll
    for (int w = 0; w < 2 * WORDS; w += 4) {
        *reinterpret_cast<uint4*>(dst + 2 * w) = make_uint4(out[w], out[w + 1], out[w + 2], out[w + 3]);
    }
}
#endif
