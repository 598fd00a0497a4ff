// paged_decode_mma.cu: decode attention (one new query token per sequence) on tensor cores, for
// batches large enough that every (sequence, kv head) needs only one CTA (backends/cuda.py decides).
//
// paged_attention.cu computes each score as a dot product in FP32 FMAs: at GQA 4 and head_dim 64
// that is 512 FMAs a key, and at batch 256 its CTAs spend more time issuing instructions than
// waiting for memory. Here the GQA group's query heads are the rows of one 16-row mma tile, so a
// key costs a fraction of one mma.sync m16n8k16 instead:
//   S = Q K^T    Q's rows (the group's heads; rows past GQA are zeros) in registers for the whole
//                kernel, K from shared memory (ldmatrix)
//   P = exp2(S - running max), online softmax per row, keys past the context masked
//   O += P V     P rounded to the model dtype and kept in registers (an accumulator fragment is
//                the next mma's A fragment), V by transposing loads
// as paged_prefill.cu does for prompts (mma.cuh holds the PTX both use).
//
// grid (NUM_KV_HEADS, num_seqs), DECODE_MMA_WARPS warps. The warps of a CTA take the sequence's
// key tiles of DECODE_MMA_KEYS in turn (warp w: tiles w, w + WARPS, ...), each through a ring of
// DECODE_MMA_STAGES tiles of its own in shared memory (cp.async), so a warp waits only on its own
// copies: no CTA-wide barrier until the end, where the warps' sums meet in shared memory and are
// merged (each warp's max, sum and unnormalised output, as split-KV merges its splits).
//
// With at most 8 heads in a group (GQA <= 8), rows 8 to 15 of the tile are all zeros: the mmas
// then keep only rows 0 to 7 (mma_16816_rows8), halving the accumulators and the softmax.
//
// Every K/V access goes through the block table: token i of a sequence is row i % BLOCK_SIZE of
// physical block table[slot][layer][i / BLOCK_SIZE]. A sequence with context length 0 (a padding
// row) gets zeros. Pools in the model dtype (bf16, fp16) or fp8; float32 takes paged_attention.cu.
//
// A sliding window (-DSLIDING_WINDOW=W over 0, geometry.cuh): the new token (position context - 1)
// sees keys from window_first(context - 1) = context - W on. The tiles start at the one holding
// that key (its keys before it are copied as zeros and masked: their blocks may have been given
// back, engine/cache.py's slide), so a step reads at most W + DECODE_MMA_KEYS - 1 keys a sequence.
//
// An fp8 pool (-DKV_FP8, geometry.cuh): a warp's ring holds e4m3 tiles (a byte an element, rows
// unpadded); once tile i has landed each lane converts the bytes it copied itself into the warp's
// one K and one V tile in the model dtype (mma.cuh's e4m3_to_elements: exact, times
// E4M3_UNPACK_FACTOR), which the mma reads, while the ring's next tiles fly. A CTA is one kv head,
// so its K scale (and 1 / that factor) is one factor of the softmax's scale and its V scale one of
// the normalisation: the loops are the model dtype's, as in paged_prefill.cu.

#include "async_copy.cuh"
#include "geometry.cuh"
#include "mma.cuh"

#if !defined(DECODE_MMA_WARPS) || !defined(DECODE_MMA_KEYS) || !defined(DECODE_MMA_STAGES) || \
    !defined(DECODE_MMA_VEC_BYTES) || !defined(DECODE_MMA_SHARED_BYTES) || !defined(SLIDING_WINDOW)
#error "paged_decode_mma.cu needs -DDECODE_MMA_WARPS -DDECODE_MMA_KEYS -DDECODE_MMA_STAGES -DDECODE_MMA_VEC_BYTES -DDECODE_MMA_SHARED_BYTES -DSLIDING_WINDOW (backends/cuda_build.py)"
#endif
#if defined(DTYPE_F32)
#error "paged_decode_mma.cu runs on bf16/fp16 tensor cores; float32 takes paged_attention.cu (backends/cuda_build.py)"
#endif

constexpr int WARPS = DECODE_MMA_WARPS;
constexpr int THREADS = WARPS * WARP_SIZE;
constexpr int KEYS = DECODE_MMA_KEYS;  // keys of one warp's tile
constexpr int STAGES = DECODE_MMA_STAGES;
static_assert(KEYS % 16 == 0, "a key tile is whole k-steps of the P V product");
static_assert(STAGES >= 2, "a warp's ring needs at least two tiles");
constexpr int GQA = NUM_HEADS / NUM_KV_HEADS;
static_assert(GQA <= 16, "a kv head's query heads must fit one 16-row mma tile");
constexpr bool UPPER_ROWS = GQA > 8;  // rows 8 to 15 of the tile hold heads
constexpr int C_REGS = UPPER_ROWS ? 4 : 2;  // accumulators a lane keeps per n-tile

constexpr int S_TILES = KEYS / 8;  // n-tiles of S (8 keys each); D_PAD, K_STEPS, O_TILES, ROW_STRIDE: mma.cuh
constexpr int TILE_ELEMS = KEYS * ROW_STRIDE;
constexpr int STAGE_ELEMS = 2 * TILE_ELEMS;  // a K tile, then its V tile

constexpr int COPY_BYTES = DECODE_MMA_VEC_BYTES;  // pool bytes of one copy
constexpr int ROW_BYTES = HEAD_DIM * (int)sizeof(kv_t);  // a head's K (or V) row in the pool
static_assert(HEAD_DIM % 2 == 0, "q's elements are read in pairs");
static_assert(ROW_BYTES % COPY_BYTES == 0, "a head's row must be a whole number of copies");
constexpr int COPIES_PER_ROW = ROW_BYTES / COPY_BYTES;

// Shared memory (dynamic): each warp's ring of STAGES (K, V) tiles; with an fp8 pool the ring's
// tiles are e4m3 (RAW_TILE_BYTES each) and the warp's one K and V tile in the model dtype follow
// it. At the end the warps' outputs (GQA x HEAD_DIM floats each) reuse it. The launch asks for the
// size backends/cuda_build.py computed, which must be this one.
#if defined(KV_FP8)
constexpr int RAW_TILE_BYTES = KEYS * HEAD_DIM;  // an e4m3 K or V tile, rows unpadded
constexpr int RAW_STAGE_BYTES = 2 * RAW_TILE_BYTES;
constexpr int WARP_BYTES = STAGES * RAW_STAGE_BYTES + STAGE_ELEMS * (int)sizeof(scalar_t);
static_assert(RAW_STAGE_BYTES % 16 == 0, "the warp's tiles in the model dtype start on a 16-byte boundary");
#else
constexpr int WARP_BYTES = STAGES * STAGE_ELEMS * (int)sizeof(scalar_t);
#endif
constexpr int SMEM_BYTES = WARPS * WARP_BYTES;
static_assert(SMEM_BYTES == DECODE_MMA_SHARED_BYTES, "cuda_build.decode_mma_shared_bytes disagrees with the kernel");
static_assert(WARPS * GQA * HEAD_DIM * 4 <= SMEM_BYTES, "the warps' outputs must fit where their tiles were");

// Copy keys key0 .. key0 + KEYS - 1 of the sequence (K and V, one block-table lookup for both)
// into a stage (rows DST_ROW bytes apart, the V tile DST_TILE bytes after the K tile); keys at or
// past `context`, and before `first_key` (a window's: their blocks may have been given back),
// become zeros (so 0 x garbage can never make a NaN).
template <int DST_ROW, int DST_TILE>
__device__ __forceinline__ void copy_stage(unsigned char* stage, const unsigned char* __restrict__ k_base,
                                           const int* __restrict__ seq_table, int key0, int first_key, int context,
                                           int lane) {
#pragma unroll 4
    for (int i = lane; i < KEYS * COPIES_PER_ROW; i += WARP_SIZE) {
        const int r = i / COPIES_PER_ROW, c = i % COPIES_PER_ROW;
        const int pos = key0 + r;
#if SLIDING_WINDOW > 0
        const bool valid = pos >= first_key && pos < context;
#else
        const bool valid = pos < context;  // (first_key is 0)
#endif
        const size_t offset = valid ? token_offset(seq_table, pos) + (size_t)c * COPY_BYTES : 0;
        unsigned char* dst = stage + r * DST_ROW + c * COPY_BYTES;
        copy_async<COPY_BYTES>(dst, k_base + offset, valid);
        copy_async<COPY_BYTES>(dst + DST_TILE, k_base + V_OFFSET + offset, valid);
    }
}

#if defined(KV_FP8)
// The keys of a ring stage: e4m3 rows, unpadded.
__device__ __forceinline__ void copy_stage(unsigned char* stage, const unsigned char* __restrict__ k_base,
                                           const int* __restrict__ seq_table, int key0, int first_key, int context,
                                           int lane) {
    copy_stage<HEAD_DIM, RAW_TILE_BYTES>(stage, k_base, seq_table, key0, first_key, context, lane);
}

// The e4m3 stage this lane copied (copy_stage's loop: its own copies, which its wait has completed)
// into the warp's K and V tiles in the model dtype.
__device__ __forceinline__ void convert_stage(scalar_t* kv_tiles, const unsigned char* stage, int lane) {
#pragma unroll 4
    for (int i = lane; i < KEYS * COPIES_PER_ROW; i += WARP_SIZE) {
        const int r = i / COPIES_PER_ROW, c = i % COPIES_PER_ROW;
        const int at = r * HEAD_DIM + c * COPY_BYTES;
        e4m3_to_elements<COPY_BYTES>(stage + at, kv_tiles + r * ROW_STRIDE + c * COPY_BYTES);
        e4m3_to_elements<COPY_BYTES>(stage + RAW_TILE_BYTES + at, kv_tiles + TILE_ELEMS + r * ROW_STRIDE + c * COPY_BYTES);
    }
}
#else
// The keys of a ring stage: the mma's tiles themselves.
__device__ __forceinline__ void copy_stage(scalar_t* stage, const unsigned char* __restrict__ k_base,
                                           const int* __restrict__ seq_table, int key0, int first_key, int context,
                                           int lane) {
    copy_stage<ROW_STRIDE * (int)sizeof(scalar_t), TILE_ELEMS * (int)sizeof(scalar_t)>(
        reinterpret_cast<unsigned char*>(stage), k_base, seq_table, key0, first_key, context, lane);
}
#endif

// Two consecutive elements of q as one packed word (0 past the group's heads or the head dim).
__device__ __forceinline__ unsigned int q_pair(const scalar_t* __restrict__ q_group, int row, int col) {
    if (row >= GQA || col >= HEAD_DIM) return 0u;
    return *reinterpret_cast<const unsigned int*>(q_group + row * HEAD_DIM + col);  // HEAD_DIM is even
}

// c (the rows this lane keeps: C_REGS accumulators) += a b: the full mma, or with at most 8 rows
// the half one.
__device__ __forceinline__ void mma_rows(float (&c)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
    mma_16816(c, a, b0, b1);
}
__device__ __forceinline__ void mma_rows(float (&c)[2], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
    mma_16816_rows8(c, a[0], a[2], b0, b1);
}

// One key tile of this warp: S = Q K^T, the online softmax (row g = lane / 4 and, with UPPER_ROWS,
// g + 8; key column 2 (lane % 4) + {0, 1} of each n-tile), O += P V.
__device__ __forceinline__ void attend_tile(float (&o)[O_TILES][C_REGS], float (&run_max)[2], float (&run_sum)[2],
                                            const unsigned int (&qa)[K_STEPS][4], const scalar_t* k_tile,
                                            const scalar_t* v_tile, int key0, int first_key, int context,
                                            float scale_log2, int lane) {
    float s[S_TILES][C_REGS];
#pragma unroll
    for (int j = 0; j < S_TILES; ++j) {
#pragma unroll
        for (int e = 0; e < C_REGS; ++e) s[j][e] = 0.0f;
    }
#pragma unroll
    for (int ks = 0; ks < K_STEPS; ++ks) {
#pragma unroll
        for (int j = 0; j < S_TILES; j += 2) {  // two n-tiles of keys per ldmatrix
            unsigned int b[4];  // keys 8 j + 8 (lane / 16) + lane % 8, columns 16 ks + 8 ((lane / 8) % 2)
            ldmatrix_x4(b, k_tile + (j * 8 + (lane / 16) * 8 + lane % 8) * ROW_STRIDE + ks * 16 + ((lane / 8) % 2) * 8);
            mma_rows(s[j], qa[ks], b[0], b[1]);
            mma_rows(s[j + 1], qa[ks], b[2], b[3]);
        }
    }
    // the last tile: mask the keys past the context; a window's first: those before first_key
    const bool partial = key0 + KEYS > context || (SLIDING_WINDOW > 0 && key0 < first_key);
#pragma unroll
    for (int half = 0; half < C_REGS / 2; ++half) {  // a row's max is finite: the tile holds a key it sees
        online_softmax_rows(s, o, run_max[half], run_sum[half], half, partial, key0, context - 1, scale_log2, lane,
                            first_key);
    }
#pragma unroll
    for (int kk = 0; kk < KEYS / 16; ++kk) {  // 16 keys: n-tiles 2 kk and 2 kk + 1 of S
        unsigned int a[4];
        a[0] = pack2(s[2 * kk][0], s[2 * kk][1]);
        a[2] = pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        if constexpr (UPPER_ROWS) {
            a[1] = pack2(s[2 * kk][2], s[2 * kk][3]);
            a[3] = pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        } else {
            a[1] = a[3] = 0u;
        }
#pragma unroll
        for (int d = 0; d < O_TILES; d += 2) {  // two n-tiles of head dims per ldmatrix (O_TILES is even)
            unsigned int b[4];  // keys 16 kk + 8 ((lane / 8) % 2) + lane % 8, columns 8 d + 8 (lane / 16)
            ldmatrix_x4_trans(b, v_tile + (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * ROW_STRIDE + d * 8 +
                                     (lane / 16) * 8);
            mma_rows(o[d], a, b[0], b[1]);
            mma_rows(o[d + 1], a, b[2], b[3]);
        }
    }
}

// out: [num_seqs, NUM_HEADS, HEAD_DIM] in the model dtype.
// q: [num_seqs, NUM_HEADS, HEAD_DIM] (the rotated queries, contiguous).
// table: this layer's block table, table[slot * table_slot_stride + logical_block].
// max_context: the table's width in tokens; longer context lengths are clamped to it.
extern "C" __global__ void __launch_bounds__(THREADS) paged_attention_decode_mma(
    scalar_t* __restrict__ out, const scalar_t* __restrict__ q, const unsigned char* __restrict__ pool,
    const int* __restrict__ table, long long table_slot_stride, const int* __restrict__ slots,
    const int* __restrict__ context_lens, int max_context, float scale_log2 KV_SCALE_PARAMS) {
    start_after_previous_kernels();
#if __CUDA_ARCH__ >= 800
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ float warp_max[WARPS][GQA], warp_sum[WARPS][GQA];
    const int kv_head = blockIdx.x, seq = blockIdx.y;
    const int tid = threadIdx.x, warp = tid / WARP_SIZE, lane = tid % WARP_SIZE;
    scalar_t* __restrict__ out_rows = out + ((size_t)seq * NUM_HEADS + kv_head * GQA) * HEAD_DIM;
    const int context = min(max(context_lens[seq], 0), max_context);
    if (context == 0) {  // padding row: zeros
        for (int i = tid; i < GQA * HEAD_DIM; i += THREADS) out_rows[i] = from_float(0.0f);
        return;
    }
    const int* __restrict__ seq_table = table + (size_t)slots[seq] * table_slot_stride;
    const unsigned char* __restrict__ k_base = pool + (size_t)kv_head * ROW_BYTES;  // V: V_OFFSET further
#if defined(KV_FP8)
    unsigned char* const ring = smem_raw + warp * WARP_BYTES;
    scalar_t* const kv_tiles = reinterpret_cast<scalar_t*>(ring + STAGES * RAW_STAGE_BYTES);  // after the ring
    // the head's scales, and 1 / the unpacking's factor: K's into the softmax's scale, V's into the
    // normalisation
    scale_log2 *= k_scale[kv_head] * (1.0f / E4M3_UNPACK_FACTOR);
    const float out_factor = v_scale[kv_head] * (1.0f / E4M3_UNPACK_FACTOR);
    constexpr int RAW_STAGE = RAW_STAGE_BYTES;  // ring elements (bytes) a stage
    // Zero the pad columns (D_PAD - HEAD_DIM) of the warp's K and V tiles once: no conversion writes them.
    if constexpr (D_PAD != HEAD_DIM) {
        for (int r = lane; r < 2 * KEYS; r += WARP_SIZE) {
            for (int c = HEAD_DIM; c < D_PAD; ++c) kv_tiles[r * ROW_STRIDE + c] = 0;
        }
    }
#else
    scalar_t* const ring = reinterpret_cast<scalar_t*>(smem_raw) + warp * STAGES * STAGE_ELEMS;
    constexpr int RAW_STAGE = STAGE_ELEMS;  // ring elements a stage

    // Zero the pad columns (D_PAD - HEAD_DIM) of this warp's ring once: no copy writes them.
    if constexpr (D_PAD != HEAD_DIM) {
        for (int r = lane; r < STAGES * 2 * KEYS; r += WARP_SIZE) {
            for (int c = HEAD_DIM; c < D_PAD; ++c) ring[r * ROW_STRIDE + c] = 0;
        }
    }
#endif

    // This warp's tiles: w, w + WARPS, ... of the num_tiles from key_base (the tile holding the
    // window's first key; 0 without a window); the first STAGES - 1 start now.
    const int first_key = window_first(context - 1);
    const int key_base = first_key / KEYS * KEYS;
    const int num_tiles = (context - key_base + KEYS - 1) / KEYS;
    const int my_tiles = warp < num_tiles ? (num_tiles - warp + WARPS - 1) / WARPS : 0;
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        if (i < my_tiles) {
            copy_stage(ring + i * RAW_STAGE, k_base, seq_table, key_base + (warp + i * WARPS) * KEYS, first_key,
                       context, lane);
        }
        copy_async_commit();  // one group a tile, empty or not, so that the waits count alike
    }

    // Q's A fragments for every k-step: rows g, g + 8 (heads of the group), columns 2t (+ 8).
    const scalar_t* __restrict__ q_group = q + ((size_t)seq * NUM_HEADS + kv_head * GQA) * HEAD_DIM;
    unsigned int qa[K_STEPS][4];
#pragma unroll
    for (int ks = 0; ks < K_STEPS; ++ks) {
        const int g = lane / 4, col = ks * 16 + 2 * (lane % 4);
        qa[ks][0] = q_pair(q_group, g, col);
        qa[ks][2] = q_pair(q_group, g, col + 8);
        qa[ks][1] = UPPER_ROWS ? q_pair(q_group, g + 8, col) : 0u;
        qa[ks][3] = UPPER_ROWS ? q_pair(q_group, g + 8, col + 8) : 0u;
    }

    float o[O_TILES][C_REGS], run_max[2] = {neg_infinity(), neg_infinity()}, run_sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int d = 0; d < O_TILES; ++d) {
#pragma unroll
        for (int e = 0; e < C_REGS; ++e) o[d][e] = 0.0f;
    }
    for (int i = 0; i < my_tiles; ++i) {
        const int next = i + STAGES - 1;  // into the stage tile i - 1 used (the warp is done with it)
        if (next < my_tiles) {
            copy_stage(ring + (next % STAGES) * RAW_STAGE, k_base, seq_table, key_base + (warp + next * WARPS) * KEYS,
                       first_key, context, lane);
        }
        copy_async_commit();
        copy_async_wait<STAGES - 1>();  // tile i's group has landed (this lane's copies)
#if defined(KV_FP8)
        convert_stage(kv_tiles, ring + (i % STAGES) * RAW_STAGE, lane);  // this lane's copies, as the model dtype
        __syncwarp();                                                     // and every lane's
        const scalar_t* stage = kv_tiles;
#else
        __syncwarp();                   // and every lane's
        const scalar_t* stage = ring + (i % STAGES) * RAW_STAGE;
#endif
        attend_tile(o, run_max, run_sum, qa, stage, stage + TILE_ELEMS, key_base + (warp + i * WARPS) * KEYS,
                    first_key, context, scale_log2, lane);
        __syncwarp();  // every lane is done with the stage before it is copied into again
    }

    // Merge the warps: each row's max, sum (over its 4 lanes) and unnormalised output go to shared
    // memory (the outputs where the rings were, once every warp is done), then each thread merges
    // GQA x HEAD_DIM / THREADS output elements. A warp without tiles has max -inf, sums 0.
    float* const warp_out = reinterpret_cast<float*>(smem_raw);  // [WARPS][GQA][HEAD_DIM]
    __syncthreads();
#pragma unroll
    for (int half = 0; half < C_REGS / 2; ++half) {
        float sum = run_sum[half];
        sum += __shfl_xor_sync(FULL_MASK, sum, 1);
        sum += __shfl_xor_sync(FULL_MASK, sum, 2);
        const int row = lane / 4 + 8 * half;
        if (row < GQA) {
            if (lane % 4 == 0) warp_max[warp][row] = run_max[half], warp_sum[warp][row] = sum;
#pragma unroll
            for (int d = 0; d < O_TILES; ++d) {
                const int c = d * 8 + 2 * (lane % 4);
                if (c < HEAD_DIM) {  // HEAD_DIM is even: the pair is whole
                    float* dst = warp_out + (warp * GQA + row) * HEAD_DIM + c;
                    dst[0] = o[d][2 * half], dst[1] = o[d][2 * half + 1];
                }
            }
        }
    }
    __syncthreads();
    for (int i = tid; i < GQA * HEAD_DIM; i += THREADS) {
        const int row = i / HEAD_DIM;
        float m = neg_infinity();
#pragma unroll
        for (int w = 0; w < WARPS; ++w) m = fmaxf(m, warp_max[w][row]);  // finite: warp 0 has key first_key
        float denom = 0.0f, acc = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float c = exp2_flush(warp_max[w][row] - m);  // 0 for a warp without tiles
            denom = fmaf(warp_sum[w][row], c, denom);
            acc = fmaf(warp_out[(w * GQA) * HEAD_DIM + i], c, acc);
        }
#if defined(KV_FP8)
        out_rows[i] = from_float(acc * (out_factor / denom));  // denom >= 1: the max term is 2^0
#else
        out_rows[i] = from_float(acc / denom);  // denom >= 1: the max term is 2^0
#endif
    }
#endif
}
