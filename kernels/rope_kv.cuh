// rope_kv.cuh: what kv_write.cu and gemv.cu's qkv epilogue share: the rotary pair with the
// reference's roundings, where a token's K/V row lives in the paged pool (geometry.cuh), and how
// an element is stored there (as it is, or quantized to e4m3 for an fp8 pool).
//
// RoPE pairs element i with i + HEAD_DIM/2 ("rotate half", as Hugging Face Llama). The rounding
// order is the reference's in the model dtype (pagedcli/rope.py: x * cos + rotate_half(x) * sin):
// each product rounded to the dtype, then their sum rounded. The products of two bf16/fp16
// numbers are exact in float, so the results match torch bit for bit; __fmul_rn/__fadd_rn keep the
// compiler from fusing them into an FMA (which would change the fp32 results).
#pragma once

#include "fp8.cuh"
#include "geometry.cuh"

static_assert(HEAD_DIM % 2 == 0, "rotary embedding needs an even head_dim");

#define HALF_DIM (HEAD_DIM / 2)

// out1 = x1*cos1 - x2*sin1, out2 = x2*cos2 + x1*sin2, with the reference's roundings.
__device__ __forceinline__ void rotate_pair(float x1, float x2, float c1, float c2, float s1, float s2,
                                            float& out1, float& out2) {
    const float a1 = round_to_dtype(__fmul_rn(x1, c1));
    const float b1 = round_to_dtype(__fmul_rn(x2, s1));  // rotate_half gives -x2: -(x2*s1), exactly
    const float a2 = round_to_dtype(__fmul_rn(x2, c2));
    const float b2 = round_to_dtype(__fmul_rn(x1, s2));
    out1 = round_to_dtype(__fsub_rn(a1, b1));
    out2 = round_to_dtype(__fadd_rn(a2, b2));
}

// The pool row (K at the returned address, V at + V_OFFSET) of the token at position `pos` of the
// sequence in `slot`, or nullptr when its block is not assigned (-1) or past the table.
// table: this layer's block table, table[slot * table_slot_stride + logical_block].
__device__ __forceinline__ unsigned char* kv_row(unsigned char* pool, const int* __restrict__ table,
                                                 long long table_slot_stride, int max_blocks, int slot,
                                                 long long pos) {
    const int logical_block = (int)(pos / BLOCK_SIZE);
    const int physical = logical_block < max_blocks ? table[slot * table_slot_stride + logical_block] : -1;
    if (physical < 0) return nullptr;
    return pool + (size_t)physical * BLOCK_BYTES + (size_t)(pos % BLOCK_SIZE) * KV_DIM * sizeof(kv_t);
}

// Element x of kv head `head`'s K (or V: is_v) row as the pool stores it: x itself, or for an fp8
// pool e4m3(x / scale) as model/fp8.py's quantize_kv computes it: the exact quotient (float
// division, rounded once, as torch's), saturated at +-448, rounded to nearest even (fp8.cuh).
__device__ __forceinline__ kv_t to_kv(float x, const KvScales& scales, bool is_v, int head) {
#if defined(KV_FP8)
    return (kv_t)e4m3_from_float(__fdiv_rn(x, (is_v ? scales.v : scales.k)[head]));
#else
    return from_float(x);
#endif
}

// A rotary pair (elements d and d + HALF_DIM) of one kv head's K (or V) into the pool row `row`
// (kv_row's), and how it is stored.
__device__ __forceinline__ void store_kv_pair(unsigned char* row, bool is_v, int head, int d, float x1, float x2,
                                              const KvScales& scales) {
    kv_t* const dst = reinterpret_cast<kv_t*>(row + (is_v ? V_OFFSET : 0)) + head * HEAD_DIM;
    dst[d] = to_kv(x1, scales, is_v, head);
    dst[d + HALF_DIM] = to_kv(x2, scales, is_v, head);
}
