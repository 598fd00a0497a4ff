// paged_attention.cu: decode attention (one new query token per sequence) over the paged KV pool,
// split along the context ("flash-decoding"), then a reduce step that merges the splits.
//
// paged_attention_decode: grid (num_splits, NUM_HEADS / HEADS_PER_CTA, num_seqs), ATTN_THREADS.
//   A CTA serves one sequence b and HEADS_PER_CTA query heads that share one kv head (GQA): each
//   K/V row it loads is used by all of those heads, so K/V are read once per kv head, not once per
//   query head. The context is cut into chunks of PARTITION_SIZE tokens; split s takes chunks
//   s, s + num_splits, ... (num_splits depends only on the batch size and the cache's
//   max_model_len, so a CUDA graph captured once serves any context length; a CTA with no chunk
//   exits at once). For each chunk:
//     1. K pass: a token's K row for one kv head is HEAD_DIM contiguous elements, read as 16-byte
//        vectors by a group of ROW_LANES lanes (HEAD_DIM = 64 in bf16: 8 lanes, 128 bytes; a warp
//        reads 4 rows at once, a 128-thread CTA 16 rows). Each lane dots its 16 bytes with the
//        matching slice of every query head (kept in registers, pre-scaled by 1/sqrt(HEAD_DIM) and
//        log2(e) so that softmax can use exp2), the group sums with shuffles, and the scores go to
//        shared memory. UNROLL rows per lane are loaded before any is used, to keep enough bytes in
//        flight to saturate HBM.
//     2. softmax over the chunk, merged with the running max and sum of the earlier chunks
//        (online softmax across chunks, exact two-pass within one).
//     3. V pass: the same lanes read V rows and accumulate p * v in fp32 registers.
//   At the end the groups' partial outputs are summed (shuffles, then shared memory) and the
//   CTA writes its unnormalised output, max and sum to scratch buffers.
// paged_attention_reduce: one warp per (sequence, query head) merges the splits that had work and
//   writes the output in the model dtype. A sequence with context length 0 (a padding row) gets
//   zeros.
//
// Every K/V access goes through the block table: token i of a sequence is row i % BLOCK_SIZE of
// physical block table[slot][layer][i / BLOCK_SIZE].

#include "common.cuh"

#if !defined(BLOCK_SIZE) || !defined(NUM_KV_HEADS) || !defined(HEAD_DIM) || !defined(KV_DIM)
#error "paged_attention.cu needs -DBLOCK_SIZE -DNUM_KV_HEADS -DHEAD_DIM -DKV_DIM (CacheGeometry.defines())"
#endif
#if !defined(BLOCK_BYTES) || !defined(V_OFFSET)
#error "paged_attention.cu needs -DBLOCK_BYTES -DV_OFFSET (CacheGeometry.defines())"
#endif
#if !defined(NUM_HEADS)
#error "paged_attention.cu needs -DNUM_HEADS (the model's query heads)"
#endif
#if !defined(HEADS_PER_CTA) || !defined(PARTITION_SIZE) || !defined(ATTN_THREADS) || !defined(ATTN_UNROLL) || !defined(REDUCE_WARPS)
#error "paged_attention.cu needs -DHEADS_PER_CTA -DPARTITION_SIZE -DATTN_THREADS -DATTN_UNROLL -DREDUCE_WARPS (backends/cuda.py)"
#endif

static_assert(KV_DIM == NUM_KV_HEADS * HEAD_DIM, "KV_DIM must be NUM_KV_HEADS * HEAD_DIM");
static_assert(V_OFFSET == BLOCK_SIZE * KV_DIM * (int)sizeof(scalar_t), "V_OFFSET does not match the dtype");
static_assert(BLOCK_BYTES == 2 * V_OFFSET, "BLOCK_BYTES must be K + V");
static_assert(NUM_HEADS % NUM_KV_HEADS == 0, "query heads must be a multiple of kv heads");

constexpr int GQA = NUM_HEADS / NUM_KV_HEADS;  // query heads per kv head
static_assert(GQA % HEADS_PER_CTA == 0, "HEADS_PER_CTA must divide the GQA group");

// How a K/V row (one token, one kv head) maps onto lanes.
constexpr int ROW_BYTES = HEAD_DIM * (int)sizeof(scalar_t);
static_assert(ROW_BYTES % VEC_BYTES == 0, "a head's row must be a whole number of 16-byte vectors");
constexpr int ROW_VECS = ROW_BYTES / VEC_BYTES;  // 16-byte vectors in a row
static_assert(ROW_VECS <= WARP_SIZE, "a head's row must fit in one warp's 16-byte loads");
constexpr int ROW_LANES = next_pow2(ROW_VECS);  // lanes that share a row (the lanes past ROW_VECS idle)
constexpr int ROWS_PER_WARP = WARP_SIZE / ROW_LANES;
constexpr int NUM_WARPS = ATTN_THREADS / WARP_SIZE;
static_assert(ATTN_THREADS % WARP_SIZE == 0, "ATTN_THREADS must be whole warps");
constexpr int ROWS_PER_STEP = NUM_WARPS * ROWS_PER_WARP;  // tokens the CTA covers per load step
constexpr int UNROLL = ATTN_UNROLL;  // rows each lane loads before using any (bytes in flight)

static_assert(PARTITION_SIZE % BLOCK_SIZE == 0, "a chunk must be whole blocks");
constexpr int BLOCKS_PER_CHUNK = PARTITION_SIZE / BLOCK_SIZE;

// Shared memory: the chunk's scores (one row of PARTITION_SIZE per head, padded so that the lanes
// writing different heads fall in different banks); later reused for the sum over warps.
constexpr int SCORE_STRIDE = PARTITION_SIZE + ROWS_PER_WARP;
constexpr int SCORE_FLOATS = HEADS_PER_CTA * SCORE_STRIDE;
constexpr int ACC_FLOATS = NUM_WARPS * HEADS_PER_CTA * HEAD_DIM;
constexpr int SMEM_FLOATS = SCORE_FLOATS > ACC_FLOATS ? SCORE_FLOATS : ACC_FLOATS;
static_assert(SMEM_FLOATS * 4 + BLOCKS_PER_CHUNK * 4 + (2 * NUM_WARPS + 1) * HEADS_PER_CTA * 4 <= 48 * 1024,
              "shared memory over 48 KiB: use a smaller PARTITION_SIZE or HEADS_PER_CTA");

// Output elements (HEADS_PER_CTA x HEAD_DIM) each thread keeps across the chunks of its split.
constexpr int OWNED = (HEADS_PER_CTA * HEAD_DIM + ATTN_THREADS - 1) / ATTN_THREADS;

// A 16-byte load the compiler may not hoist out of the chunk loop (asm volatile): reloading q per
// chunk (an L1 hit) keeps it out of the registers during the V pass.
__device__ __forceinline__ uint4 load_vec_keep_in_loop(const scalar_t* p) {
    uint4 r;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

// Byte offset of token row `row` of a block, head `kv_head`, 16-byte vector `vec`.
__device__ __forceinline__ size_t row_offset(int row, int kv_head, int vec) {
    return (size_t)row * KV_DIM * sizeof(scalar_t) + (size_t)kv_head * ROW_BYTES + (size_t)vec * VEC_BYTES;
}

// q: [num_seqs, NUM_HEADS, HEAD_DIM] (the rotated queries, contiguous).
// table: this layer's block table, table[slot * table_slot_stride + logical_block].
// partial_out: [num_seqs, NUM_HEADS, num_splits, HEAD_DIM] float; partial_max, partial_sum:
// [num_seqs, NUM_HEADS, num_splits] float (log2 domain).
// max_context: the table's width in tokens; longer context lengths are clamped to it.
extern "C" __global__ void __launch_bounds__(ATTN_THREADS) paged_attention_decode(
    const scalar_t* __restrict__ q, const unsigned char* __restrict__ pool,
    const int* __restrict__ table, long long table_slot_stride,
    const int* __restrict__ slots, const int* __restrict__ context_lens, int max_context,
    float* __restrict__ partial_out, float* __restrict__ partial_max, float* __restrict__ partial_sum,
    float scale_log2) {
    const int split = blockIdx.x;
    const int num_splits = gridDim.x;
    const int head0 = blockIdx.y * HEADS_PER_CTA;  // first query head of this CTA
    const int kv_head = head0 / GQA;
    const int seq = blockIdx.z;

    const int context = min(max(context_lens[seq], 0), max_context);
    const int num_chunks = (context + PARTITION_SIZE - 1) / PARTITION_SIZE;
    if (split >= num_chunks) return;  // nothing to do (a whole CTA leaves: no barrier is pending)

    __shared__ float smem[SMEM_FLOATS];  // scores [HEADS_PER_CTA][SCORE_STRIDE], later per-warp sums
    __shared__ int chunk_blocks[BLOCKS_PER_CHUNK];
    __shared__ float warp_max_buf[NUM_WARPS][HEADS_PER_CTA];
    __shared__ float warp_sum_buf[NUM_WARPS][HEADS_PER_CTA];
    __shared__ float head_correction[HEADS_PER_CTA];
    float* const scores = smem;

    const int tid = threadIdx.x;
    const int warp = tid / WARP_SIZE;
    const int lane = tid % WARP_SIZE;
    const int lane_in_row = lane % ROW_LANES;          // which 16-byte vector of the row
    const int row_in_step = tid / ROW_LANES;           // which token of a load step
    const bool lane_active = lane_in_row < ROW_VECS;   // idle when the row is not a power of two

    // Running softmax state per head (identical in every thread) and, for the HEADS_PER_CTA x
    // HEAD_DIM outputs, the unnormalised sums over this CTA's chunks: thread tid owns elements
    // tid, tid + ATTN_THREADS, ...
    float run_max[HEADS_PER_CTA], run_sum[HEADS_PER_CTA], owned[OWNED];
#pragma unroll
    for (int h = 0; h < HEADS_PER_CTA; ++h) {
        run_max[h] = neg_infinity();
        run_sum[h] = 0.0f;
    }
#pragma unroll
    for (int k = 0; k < OWNED; ++k) owned[k] = 0.0f;

    const int* __restrict__ seq_table = table + slots[seq] * table_slot_stride;
    const unsigned char* __restrict__ k_base = pool + row_offset(0, kv_head, lane_in_row);
    const unsigned char* __restrict__ v_base = k_base + V_OFFSET;
    const scalar_t* __restrict__ q_base = q + ((size_t)seq * NUM_HEADS + head0) * HEAD_DIM + lane_in_row * VEC;

    for (int chunk = split; chunk < num_chunks; chunk += num_splits) {
        const int chunk_start = chunk * PARTITION_SIZE;
        const int n = min(PARTITION_SIZE, context - chunk_start);  // tokens in this chunk

        __syncthreads();  // the previous chunk is done with chunk_blocks and smem
        for (int i = tid; i < (n + BLOCK_SIZE - 1) / BLOCK_SIZE; i += ATTN_THREADS) {
            chunk_blocks[i] = max(seq_table[chunk_start / BLOCK_SIZE + i], 0);  // -1 would be a bug; stay in bounds
        }
        __syncthreads();

        // 1. K pass: scores[h][t] = q_h . k_t (log2 units). q lives in registers during this pass
        //    only: this lane's 16-byte slice of each head, pre-scaled by scale_log2.
        {
            float qf[HEADS_PER_CTA][VEC];
#pragma unroll
            for (int h = 0; h < HEADS_PER_CTA; ++h) {
                if (lane_active) {
                    unpack_vec(load_vec_keep_in_loop(q_base + h * HEAD_DIM), qf[h]);
#pragma unroll
                    for (int j = 0; j < VEC; ++j) qf[h][j] *= scale_log2;
                } else {
#pragma unroll
                    for (int j = 0; j < VEC; ++j) qf[h][j] = 0.0f;
                }
            }
            for (int t0 = 0; t0 < n; t0 += ROWS_PER_STEP * UNROLL) {
                uint4 raw[UNROLL];
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    const int t = t0 + u * ROWS_PER_STEP + row_in_step;
                    raw[u] = make_uint4(0u, 0u, 0u, 0u);
                    if (t < n && lane_active) {
                        const size_t block = (size_t)chunk_blocks[t / BLOCK_SIZE];
                        raw[u] = *reinterpret_cast<const uint4*>(
                            k_base + block * BLOCK_BYTES + (size_t)(t % BLOCK_SIZE) * KV_DIM * sizeof(scalar_t));
                    }
                }
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    float kf[VEC];
                    unpack_vec(raw[u], kf);
                    float dot[HEADS_PER_CTA];
#pragma unroll
                    for (int h = 0; h < HEADS_PER_CTA; ++h) {
                        dot[h] = 0.0f;
#pragma unroll
                        for (int j = 0; j < VEC; ++j) dot[h] = fmaf(qf[h][j], kf[j], dot[h]);
                    }
#pragma unroll
                    for (int off = ROW_LANES / 2; off > 0; off >>= 1) {
#pragma unroll
                        for (int h = 0; h < HEADS_PER_CTA; ++h) dot[h] += __shfl_xor_sync(FULL_MASK, dot[h], off);
                    }
                    const int t = t0 + u * ROWS_PER_STEP + row_in_step;
                    if (t < n) {
#pragma unroll
                        for (int h = 0; h < HEADS_PER_CTA; ++h) {
                            if (lane_in_row == h % ROW_LANES) scores[h * SCORE_STRIDE + t] = dot[h];
                        }
                    }
                }
            }
        }
        __syncthreads();

        // 2. Softmax over the chunk, merged with the earlier chunks: probabilities relative to the
        //    new running max replace the scores; the earlier sums are rescaled by `correction`.
        float new_max[HEADS_PER_CTA];
#pragma unroll
        for (int h = 0; h < HEADS_PER_CTA; ++h) {
            float m = neg_infinity();
            for (int t = tid; t < n; t += ATTN_THREADS) m = fmaxf(m, scores[h * SCORE_STRIDE + t]);
            m = warp_max(m);
            if (lane == 0) warp_max_buf[warp][h] = m;
        }
        __syncthreads();
#pragma unroll
        for (int h = 0; h < HEADS_PER_CTA; ++h) {
            float m = run_max[h];
#pragma unroll
            for (int w = 0; w < NUM_WARPS; ++w) m = fmaxf(m, warp_max_buf[w][h]);
            new_max[h] = m;  // finite: the chunk has at least one token
            float s = 0.0f;
            for (int t = tid; t < n; t += ATTN_THREADS) {
                const float p = exp2f(scores[h * SCORE_STRIDE + t] - m);
                scores[h * SCORE_STRIDE + t] = p;
                s += p;
            }
            s = warp_sum(s);
            if (lane == 0) warp_sum_buf[warp][h] = s;
        }
        __syncthreads();  // probabilities and per-warp sums are complete
#pragma unroll
        for (int h = 0; h < HEADS_PER_CTA; ++h) {
            float s = 0.0f;
#pragma unroll
            for (int w = 0; w < NUM_WARPS; ++w) s += warp_sum_buf[w][h];
            const float correction = exp2f(run_max[h] - new_max[h]);  // 0 for the CTA's first chunk
            run_sum[h] = run_sum[h] * correction + s;
            run_max[h] = new_max[h];
            if (tid == h) head_correction[h] = correction;  // read after the next barrier
        }

        // 3. V pass: acc[h] = sum over the chunk's rows of this lane group of p[h][t] * v_t.
        float acc[HEADS_PER_CTA][VEC];
#pragma unroll
        for (int h = 0; h < HEADS_PER_CTA; ++h) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) acc[h][j] = 0.0f;
        }
        for (int t0 = 0; t0 < n; t0 += ROWS_PER_STEP * UNROLL) {
            uint4 raw[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int t = t0 + u * ROWS_PER_STEP + row_in_step;
                raw[u] = make_uint4(0u, 0u, 0u, 0u);
                if (t < n && lane_active) {
                    const size_t block = (size_t)chunk_blocks[t / BLOCK_SIZE];
                    raw[u] = *reinterpret_cast<const uint4*>(
                        v_base + block * BLOCK_BYTES + (size_t)(t % BLOCK_SIZE) * KV_DIM * sizeof(scalar_t));
                }
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int t = t0 + u * ROWS_PER_STEP + row_in_step;
                if (t < n) {
                    float vf[VEC];
                    unpack_vec(raw[u], vf);
#pragma unroll
                    for (int h = 0; h < HEADS_PER_CTA; ++h) {
                        const float p = scores[h * SCORE_STRIDE + t];
#pragma unroll
                        for (int j = 0; j < VEC; ++j) acc[h][j] = fmaf(p, vf[j], acc[h][j]);
                    }
                }
            }
        }

        // Sum acc over the row groups: across the groups of a warp with shuffles, then across warps
        // in shared memory (reusing the score buffer once every warp is done with it), into `owned`.
#pragma unroll
        for (int off = ROW_LANES; off < WARP_SIZE; off <<= 1) {
#pragma unroll
            for (int h = 0; h < HEADS_PER_CTA; ++h) {
#pragma unroll
                for (int j = 0; j < VEC; ++j) acc[h][j] += __shfl_xor_sync(FULL_MASK, acc[h][j], off);
            }
        }
        __syncthreads();
        float* const warp_acc = smem;  // [NUM_WARPS][HEADS_PER_CTA][HEAD_DIM]
        if (lane < ROW_LANES && lane_active) {
#pragma unroll
            for (int h = 0; h < HEADS_PER_CTA; ++h) {
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    warp_acc[(warp * HEADS_PER_CTA + h) * HEAD_DIM + lane * VEC + j] = acc[h][j];
                }
            }
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < OWNED; ++k) {
            const int i = tid + k * ATTN_THREADS;
            if (i < HEADS_PER_CTA * HEAD_DIM) {
                float s = 0.0f;
#pragma unroll
                for (int w = 0; w < NUM_WARPS; ++w) s += warp_acc[w * HEADS_PER_CTA * HEAD_DIM + i];
                owned[k] = owned[k] * head_correction[i / HEAD_DIM] + s;
            }
        }
    }

    // This split's unnormalised output, max and sum, for the reduce kernel.
    const size_t out_row0 = ((size_t)seq * NUM_HEADS + head0) * num_splits + split;  // (seq, head0, split)
#pragma unroll
    for (int k = 0; k < OWNED; ++k) {
        const int i = tid + k * ATTN_THREADS;
        if (i < HEADS_PER_CTA * HEAD_DIM) {
            const int h = i / HEAD_DIM;
            partial_out[(out_row0 + (size_t)h * num_splits) * HEAD_DIM + i % HEAD_DIM] = owned[k];
        }
    }
#pragma unroll
    for (int h = 0; h < HEADS_PER_CTA; ++h) {
        if (tid == h) {
            partial_max[out_row0 + (size_t)h * num_splits] = run_max[h];
            partial_sum[out_row0 + (size_t)h * num_splits] = run_sum[h];
        }
    }
}

// Merge the splits of each (sequence, query head): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.
// grid: ceil(num_seqs * NUM_HEADS / REDUCE_WARPS), block: REDUCE_WARPS * 32.
// out: [num_seqs, NUM_HEADS, HEAD_DIM] in the model dtype.
extern "C" __global__ void __launch_bounds__(REDUCE_WARPS * WARP_SIZE) paged_attention_reduce(
    scalar_t* __restrict__ out, const float* __restrict__ partial_out, const float* __restrict__ partial_max,
    const float* __restrict__ partial_sum, const int* __restrict__ context_lens, int max_context, int num_seqs,
    int num_splits) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int row = blockIdx.x * REDUCE_WARPS + threadIdx.x / WARP_SIZE;  // seq * NUM_HEADS + head
    if (row >= num_seqs * NUM_HEADS) return;
    const int seq = row / NUM_HEADS;

    const int context = min(max(context_lens[seq], 0), max_context);
    const int num_chunks = (context + PARTITION_SIZE - 1) / PARTITION_SIZE;
    const int used = min(num_splits, num_chunks);  // splits that had at least one chunk
    scalar_t* __restrict__ dst = out + (size_t)row * HEAD_DIM;
    if (used == 0) {  // padding row: zeros, not garbage
        for (int d = lane; d < HEAD_DIM; d += WARP_SIZE) dst[d] = from_float(0.0f);
        return;
    }

    const float* __restrict__ maxes = partial_max + (size_t)row * num_splits;
    const float* __restrict__ sums = partial_sum + (size_t)row * num_splits;
    float m = neg_infinity();
    for (int s = lane; s < used; s += WARP_SIZE) m = fmaxf(m, maxes[s]);
    m = warp_max(m);
    float denom = 0.0f;
    for (int s = lane; s < used; s += WARP_SIZE) denom += sums[s] * exp2f(maxes[s] - m);
    denom = warp_sum(denom);  // >= 1: the split holding the maximum contributes 2^0 * (sum >= 1)
    const float inv_denom = 1.0f / denom;

    const float* __restrict__ parts = partial_out + (size_t)row * num_splits * HEAD_DIM;
    for (int d = lane; d < HEAD_DIM; d += WARP_SIZE) {
        float a = 0.0f;
        for (int s = 0; s < used; ++s) a = fmaf(exp2f(maxes[s] - m), parts[(size_t)s * HEAD_DIM + d], a);
        dst[d] = from_float(a * inv_denom);
    }
}
