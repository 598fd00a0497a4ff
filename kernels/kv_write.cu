// kv_write.cu: rotary embedding on q and k, fused with the write of k and v into the paged pool.
//
// One row of CTAs per new token t (T tokens in the step: a whole prompt per sequence at prefill, one
// token per sequence at decode). Token t belongs to sequence b = token_seq[t] and sits at position
// p = positions[t]; its K and V go to physical block table[slots[b]][layer][p / BLOCK_SIZE],
// row p % BLOCK_SIZE (the block layout: geometry.cuh).
//
// RoPE's pairs and roundings, and the pool row's address: rope_kv.cuh.
//
// Tokens whose position is negative (padding rows of a CUDA-graph bucket) write nothing to the
// pool; their rotated q is zeros, so that what follows stays finite.
//
// An fp8 pool (-DKV_FP8) stores the rotated k and the v as e4m3 with this layer's scales
// (rope_kv.cuh's to_kv), which the kernel then takes as its last two parameters.

#include "rope_kv.cuh"

// Work items of one token: a rotary pair of each q head, then of each k head, then each V element.
// Consecutive threads take consecutive items, so a warp's loads and stores are contiguous.
#define Q_PAIRS (NUM_HEADS * HALF_DIM)
#define K_PAIRS (NUM_KV_HEADS * HALF_DIM)
#define TOKEN_ITEMS (Q_PAIRS + K_PAIRS + KV_DIM)

// grid (T, any): CTA (t, y) takes items y * blockDim + tid, + gridDim.y * blockDim, ... of token t
// (one item per thread when gridDim.y * blockDim >= TOKEN_ITEMS: at decode, few tokens, all the
// parallelism is within a token).
// q, k, v: [T, heads, HEAD_DIM] with the heads of a token contiguous and `*_stride` elements from
// one token to the next (they are column slices of the fused qkv projection).
// q_out: [T, NUM_HEADS, HEAD_DIM], contiguous.
// table: the block table of this layer: table[slot * table_slot_stride + logical_block].
// k_scale, v_scale (fp8 pools only): this layer's [NUM_KV_HEADS] float32 scales.
extern "C" __global__ void rope_write_kv(
    const scalar_t* __restrict__ q, const scalar_t* __restrict__ k, const scalar_t* __restrict__ v,
    long long q_stride, long long k_stride, long long v_stride,
    scalar_t* __restrict__ q_out, unsigned char* __restrict__ pool,
    const int* __restrict__ table, long long table_slot_stride, int max_blocks,
    const long long* __restrict__ positions, const long long* __restrict__ token_seq,
    const int* __restrict__ slots,
    const scalar_t* __restrict__ cos_table, const scalar_t* __restrict__ sin_table, int max_positions KV_SCALE_PARAMS) {
    const long long t = blockIdx.x;
    const long long pos = positions[t];
    // padding row (or no rotary row for it): no K/V write, zeros for q
    const bool valid = pos >= 0 && pos < max_positions;
    scalar_t* __restrict__ q_dst = q_out + t * (NUM_HEADS * HEAD_DIM);

    // Where this token's K/V row goes (nowhere for padding, or an unassigned block).
    unsigned char* const row_base =
        valid ? kv_row(pool, table, table_slot_stride, max_blocks, slots[token_seq[t]], pos) : nullptr;
    kv_t* const k_dst = reinterpret_cast<kv_t*>(row_base);
    kv_t* const v_dst = row_base != nullptr ? reinterpret_cast<kv_t*>(row_base + V_OFFSET) : nullptr;
#if defined(KV_FP8)
    const KvScales scales = KV_SCALES;  // (k_dst unused: store_kv_pair addresses the row)
    (void)k_dst;
#endif
    const scalar_t* __restrict__ cos_row = cos_table + (valid ? pos : 0) * HEAD_DIM;
    const scalar_t* __restrict__ sin_row = sin_table + (valid ? pos : 0) * HEAD_DIM;

    for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < TOKEN_ITEMS; i += gridDim.y * blockDim.x) {
        if (i >= Q_PAIRS + K_PAIRS) {  // V is copied as it is (quantized, for an fp8 pool)
            if (row_base != nullptr) {
                const int e = i - Q_PAIRS - K_PAIRS;
#if defined(KV_FP8)
                v_dst[e] = to_kv(to_float(v[t * v_stride + e]), scales, true, e / HEAD_DIM);
#else
                v_dst[e] = v[t * v_stride + e];
#endif
            }
            continue;
        }
        const int head = i / HALF_DIM;  // q heads first, then k heads
        const int j = i % HALF_DIM;
        const scalar_t* src;
        scalar_t* dst;
        if (head < NUM_HEADS) {
            dst = q_dst + head * HEAD_DIM;
            if (!valid) {
                dst[j] = dst[j + HALF_DIM] = from_float(0.0f);
                continue;
            }
            src = q + t * q_stride + head * HEAD_DIM;
        } else {
            if (row_base == nullptr) continue;
            src = k + t * k_stride + (head - NUM_HEADS) * HEAD_DIM;
#if !defined(KV_FP8)
            dst = k_dst + (head - NUM_HEADS) * HEAD_DIM;
#endif
        }
        const float c1 = to_float(cos_row[j]), c2 = to_float(cos_row[j + HALF_DIM]);
        const float s1 = to_float(sin_row[j]), s2 = to_float(sin_row[j + HALF_DIM]);
        float out1, out2;
        rotate_pair(to_float(src[j]), to_float(src[j + HALF_DIM]), c1, c2, s1, s2, out1, out2);
#if defined(KV_FP8)
        if (head >= NUM_HEADS) {  // k, quantized into the pool
            store_kv_pair(row_base, false, head - NUM_HEADS, j, out1, out2, scales);
            continue;
        }
#endif
        dst[j] = from_float(out1);
        dst[j + HALF_DIM] = from_float(out2);
    }
}
