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

// Work items of one token: V rotary pairs of a q head (elements j .. j+V-1 and their partners
// HALF_DIM on), then of a k head, then V elements of V. Consecutive threads take consecutive items,
// so a warp's loads and stores are contiguous. V is 1 (rope_write_kv_scalar) or ROPE_VEC
// (rope_write_kv_vec): VEC, 16-byte loads and stores, where a head's half is a whole number of
// vectors, else 1 (backends/cuda_build.py defines it). The Python side launches the vector kernel
// where the tensors' starts and token strides are aligned (the rows within them then are: HEAD_DIM
// is whole vectors) and the grid is large enough (cuda_build.ROPE_VEC_MIN_CTAS_PER_SM).
#if !defined(ROPE_VEC)
#error "kv_write.cu needs -DROPE_VEC (backends/cuda_build.py)"
#endif
static_assert(ROPE_VEC == 1 || ROPE_VEC == VEC, "ROPE_VEC: one element or one 16-byte vector");
static_assert(HALF_DIM % ROPE_VEC == 0, "ROPE_VEC must divide half a head");

// grid (T, any): CTA (t, y) takes items y * blockDim + tid, + gridDim.y * blockDim, ... of token t
// (one item per thread when gridDim.y * blockDim >= the token's items: at decode, few tokens, all
// the parallelism is within a token).
// q, k, v: [T, heads, HEAD_DIM] with the heads of a token contiguous and `*_stride` elements from
// one token to the next (they are column slices of the fused qkv projection).
// q_out: [T, NUM_HEADS, HEAD_DIM], contiguous.
// table: the block table of this layer: table[slot * table_slot_stride + logical_block].
// k_scale, v_scale (fp8 pools only): this layer's [NUM_KV_HEADS] float32 scales.
#define ROPE_WRITE_KV_PARAMS                                                                                   \
    const scalar_t *__restrict__ q, const scalar_t *__restrict__ k, const scalar_t *__restrict__ v,          \
        long long q_stride, long long k_stride, long long v_stride, scalar_t *__restrict__ q_out,              \
        unsigned char *__restrict__ pool, const int *__restrict__ table, long long table_slot_stride,          \
        int max_blocks, const long long *__restrict__ positions, const long long *__restrict__ token_seq,      \
        const int *__restrict__ slots, const scalar_t *__restrict__ cos_table,                                 \
        const scalar_t *__restrict__ sin_table, int max_positions KV_SCALE_PARAMS
#define ROPE_WRITE_KV_ARGS                                                                                     \
    q, k, v, q_stride, k_stride, v_stride, q_out, pool, table, table_slot_stride, max_blocks, positions,       \
        token_seq, slots, cos_table, sin_table, max_positions KV_SCALE_ARGS

template <int V>
__device__ __forceinline__ void rope_write_kv_impl(ROPE_WRITE_KV_PARAMS) {
    constexpr int Q_ITEMS = NUM_HEADS * HALF_DIM / V;
    constexpr int K_ITEMS = NUM_KV_HEADS * HALF_DIM / V;
    constexpr int TOKEN_ITEMS = Q_ITEMS + K_ITEMS + KV_DIM / V;
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
        if (i >= Q_ITEMS + K_ITEMS) {  // V is copied as it is (quantized, for an fp8 pool)
            if (row_base != nullptr) {
                const int e = (i - Q_ITEMS - K_ITEMS) * V;
                float x[V];
                load_floats<V>(v + t * v_stride + e, x);
#if defined(KV_FP8)
#pragma unroll
                for (int u = 0; u < V; ++u) v_dst[e + u] = to_kv(x[u], scales, true, (e + u) / HEAD_DIM);
#else
                store_floats<V>(v_dst + e, x);  // (a model-dtype value through float and back: exact)
#endif
            }
            continue;
        }
        const int head = i * V / HALF_DIM;  // q heads first, then k heads
        const int j = i * V % HALF_DIM;
        const scalar_t* src;
        scalar_t* dst;
        if (head < NUM_HEADS) {
            dst = q_dst + head * HEAD_DIM;
            if (!valid) {
                float zeros[V];
#pragma unroll
                for (int u = 0; u < V; ++u) zeros[u] = 0.0f;
                store_floats<V>(dst + j, zeros);
                store_floats<V>(dst + j + HALF_DIM, zeros);
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
        float x1[V], x2[V], c1[V], c2[V], s1[V], s2[V], out1[V], out2[V];
        load_floats<V>(src + j, x1);
        load_floats<V>(src + j + HALF_DIM, x2);
        load_floats<V>(cos_row + j, c1);
        load_floats<V>(cos_row + j + HALF_DIM, c2);
        load_floats<V>(sin_row + j, s1);
        load_floats<V>(sin_row + j + HALF_DIM, s2);
#pragma unroll
        for (int u = 0; u < V; ++u) rotate_pair(x1[u], x2[u], c1[u], c2[u], s1[u], s2[u], out1[u], out2[u]);
#if defined(KV_FP8)
        if (head >= NUM_HEADS) {  // k, quantized into the pool
#pragma unroll
            for (int u = 0; u < V; ++u)
                store_kv_pair(row_base, false, head - NUM_HEADS, j + u, out1[u], out2[u], scales);
            continue;
        }
#endif
        store_floats<V>(dst + j, out1);
        store_floats<V>(dst + j + HALF_DIM, out2);
    }
}

extern "C" __global__ void rope_write_kv_vec(ROPE_WRITE_KV_PARAMS) {
    start_after_previous_kernels();
    rope_write_kv_impl<ROPE_VEC>(ROPE_WRITE_KV_ARGS);
}

extern "C" __global__ void rope_write_kv_scalar(ROPE_WRITE_KV_PARAMS) {
    start_after_previous_kernels();
    rope_write_kv_impl<1>(ROPE_WRITE_KV_ARGS);
}
