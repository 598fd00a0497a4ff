// paged_prefill.cu: causal attention for the new tokens of a step (prompts, prompt chunks, and the
// single tokens of decoding sequences that ride along), over the paged KV pool, on tensor cores.
//
// FlashAttention-2's scheme: a CTA takes PREFILL_BLOCK_M consecutive query rows of one sequence
// and one query head, walks that sequence's keys in tiles of PREFILL_BLOCK_N from position 0 (with
// a sliding window: from the tile holding its first row's window's first key) up to its last row's
// position, and keeps the softmax online (a running max and sum per row), so no score matrix is
// ever stored. Each of the PREFILL_WARPS warps owns PREFILL_M_TILES x 16 of the
// query rows:
//   S = Q K^T    mma.sync m16n8k16 (bf16 or fp16 in, fp32 accumulators), Q and K from shared memory
//   P = exp2(S - running max), the causal mask applied in the tiles that cross the diagonal
//   O += P V     P stays in registers (an accumulator fragment is the next mma's A fragment)
// K and V tiles are double-buffered: the next tile's cp.async copies are in flight while this one
// is multiplied.
//
// Sequences of any length share one launch: the host lists the tiles (sequence, first row), the
// longest-running (latest rows) first, and the grid is tiles x NUM_HEADS CTAs, heads fastest, so
// the GQA heads that read the same K/V run side by side and share it in L2.
//
// Split keys: where a step's tiles are too few to fill the GPU (a short chunk after a long cached
// prefix: a chat turn, or the last chunks of a long prompt) the host cuts a tile's keys into
// `parts` consecutive ranges (cuda_launch.prefill_tile_lists), each a tile of the list of its own,
// as the decode kernel splits a context. Every range starts at or before the tile's first row, so
// without a window each row sees its range's first key and its max is finite from the first tile
// on (with one, a row may see none of a range: mma.cuh's online softmax keeps it at zeros). A part
// publishes its unnormalised rows, maxima and sums (float32 scratch, a slot per listed tile), and
// the last of the tile's parts to finish (a counter, reset by that CTA) merges them and writes the
// output, as paged_attention.cu's publish_and_merge does (here each thread merges the elements it
// holds in the mma's layout).
//
// Token i of a sequence is row i % BLOCK_SIZE of physical block table[slot][layer][i / BLOCK_SIZE]:
// cached prefix blocks are read like any other. A sequence's new tokens are the last num_new of its context_len: row r sits
// at position context_len - num_new + r and sees positions 0 .. that.
//
// A sliding window (-DSLIDING_WINDOW=W over 0, geometry.cuh): row p sees positions p - W + 1 .. p.
// A CTA reads no key before window_first(its first row), the first its rows see (the blocks
// before it may have been given back: engine/cache.py's slide); its key tiles start at the tile
// holding that key, rows before it in that tile are copied as zeros, a warp skips the tiles wholly
// before its rows' windows, and each row masks the keys before its own window in the tiles that
// hold some. So a chunk's work is bounded by its rows and the window, not its position.
//
// Head dims that are not a multiple of 16 (the mma's k) are padded with zeros in shared memory
// (the pad columns are never copied into, so they stay zero); rows that are not whole 16-byte
// vectors are copied 8 bytes at a time (PREFILL_VEC_BYTES), as the decode kernel does.
//
// An fp8 pool (-DKV_FP8, geometry.cuh): the e4m3 rows are copied (cp.async, PREFILL_KV_VEC_BYTES
// at a time) into double-buffered staging tiles; once tile t has landed, each thread converts the
// bytes it copied itself (so no barrier is needed before) into the single bf16/fp16 K and V tiles
// the mma reads, exactly (every e4m3 value is a bf16 and an fp16 number), times
// E4M3_UNPACK_FACTOR (fp8.cuh), while tile t + 1 flies. The layer's K scale of the head (and
// 1 / that factor) joins the softmax's scale, its V scale the final normalisation, so the mma
// loops are the model dtype's.

#include "async_copy.cuh"
#include "fp8.cuh"
#include "geometry.cuh"
#include "mma.cuh"

#if !defined(PREFILL_BLOCK_M) || !defined(PREFILL_BLOCK_N) || !defined(PREFILL_WARPS) || !defined(PREFILL_M_TILES) || \
    !defined(PREFILL_VEC_BYTES) || !defined(PREFILL_SHARED_BYTES) || !defined(SLIDING_WINDOW)
#error "paged_prefill.cu needs -DPREFILL_BLOCK_M -DPREFILL_BLOCK_N -DPREFILL_WARPS -DPREFILL_M_TILES -DPREFILL_VEC_BYTES -DPREFILL_SHARED_BYTES -DSLIDING_WINDOW (backends/cuda_build.py)"
#endif
#if defined(DTYPE_F32)
#error "paged_prefill.cu runs on bf16/fp16 tensor cores; float32 prefill takes the torch path (backends/cuda_build.py)"
#endif

constexpr int BLOCK_M = PREFILL_BLOCK_M;  // query rows of a CTA
constexpr int BLOCK_N = PREFILL_BLOCK_N;  // keys per tile
constexpr int WARPS = PREFILL_WARPS;
constexpr int THREADS = WARPS * WARP_SIZE;
// A warp owns M_TILES x 16 query rows: each K and V fragment it loads from shared memory feeds
// M_TILES mma row tiles.
constexpr int M_TILES = PREFILL_M_TILES;
constexpr int WARP_ROWS = 16 * M_TILES;
static_assert(BLOCK_M == WARP_ROWS * WARPS, "the CTA's rows are its warps' rows");
static_assert(BLOCK_N % 16 == 0, "a key tile is whole k-steps of the P V product");
constexpr int GQA = NUM_HEADS / NUM_KV_HEADS;

constexpr int S_TILES = BLOCK_N / 8;  // n-tiles of S (8 keys each); D_PAD, K_STEPS, O_TILES, ROW_STRIDE: mma.cuh
constexpr int TILE_ELEMS_M = BLOCK_M * ROW_STRIDE;
constexpr int TILE_ELEMS_N = BLOCK_N * ROW_STRIDE;

constexpr int VEC_BYTES_COPY = PREFILL_VEC_BYTES;
constexpr int ROW_BYTES = HEAD_DIM * (int)sizeof(scalar_t);  // a row of q
constexpr int KV_ROW_BYTES = HEAD_DIM * (int)sizeof(kv_t);  // of K or V in the pool
static_assert(ROW_BYTES % VEC_BYTES_COPY == 0, "a head's row must be a whole number of copies");
constexpr int COPIES_PER_ROW = ROW_BYTES / VEC_BYTES_COPY;

#if defined(KV_FP8)
#if !defined(PREFILL_KV_VEC_BYTES)
#error "an fp8 pool needs -DPREFILL_KV_VEC_BYTES (backends/cuda_build.py)"
#endif
constexpr int KV_COPY_BYTES = PREFILL_KV_VEC_BYTES;  // e4m3 bytes of one copy
constexpr int KV_COPIES_PER_ROW = HEAD_DIM / KV_COPY_BYTES;
static_assert(HEAD_DIM % KV_COPY_BYTES == 0, "a head's e4m3 row must be a whole number of copies");
constexpr int STAGE_BYTES = BLOCK_N * HEAD_DIM;  // one e4m3 tile (K or V), rows unpadded
// Shared memory (dynamic): Q, one K and one V tile in the model dtype (what the mma reads), then
// two staging buffers of e4m3 K and V tiles; the launch asks for the size backends/cuda_build.py
// computed, which must be this one.
constexpr int SMEM_BYTES = (TILE_ELEMS_M + 2 * TILE_ELEMS_N) * (int)sizeof(scalar_t) + 4 * STAGE_BYTES;
#else
// Shared memory (dynamic): Q, then two K tiles, then two V tiles; the launch asks for the size
// backends/cuda_build.py computed, which must be this one.
constexpr int SMEM_BYTES = (TILE_ELEMS_M + 4 * TILE_ELEMS_N) * (int)sizeof(scalar_t);
#endif
static_assert(SMEM_BYTES == PREFILL_SHARED_BYTES, "cuda_build.prefill_shared_bytes disagrees with the kernel");

// --- the phases -----------------------------------------------------------------------------

// Copy the key and value rows of BLOCK_N positions starting at `first` of the sequence, COPY pool
// bytes at a time, into k_dst and v_dst (rows DST_ROW bytes apart; one block-table lookup serves
// both); rows at or past `limit`, and before `lower` (a sliding window's first key: the blocks
// before it may have been given back), become zeros (so 0 x garbage can never make a NaN).
template <int COPY, int DST_ROW>
__device__ __forceinline__ void copy_kv_rows(unsigned char* k_dst, unsigned char* v_dst,
                                             const unsigned char* __restrict__ k_base,
                                             const int* __restrict__ seq_table, int first, int lower, int limit,
                                             int tid) {
    constexpr int COPIES = KV_ROW_BYTES / COPY;  // whole: the file's static_asserts above
    for (int i = tid; i < BLOCK_N * COPIES; i += THREADS) {
        const int r = i / COPIES, c = i % COPIES;
        const int pos = first + r;
#if SLIDING_WINDOW > 0
        const bool valid = pos >= lower && pos < limit;
#else
        const bool valid = pos < limit;  // (lower is 0)
#endif
        const size_t offset = valid ? token_offset(seq_table, pos) + (size_t)c * COPY : 0;
        const int at = r * DST_ROW + c * COPY;  // bytes into a tile
        copy_async<COPY>(k_dst + at, k_base + offset, valid);
        copy_async<COPY>(v_dst + at, k_base + V_OFFSET + offset, valid);
    }
}

// A pool in the model dtype: straight into the K and V tiles the mma reads.
__device__ __forceinline__ void copy_kv_tiles(scalar_t* k_tile, scalar_t* v_tile, const unsigned char* __restrict__ k_base,
                                              const int* __restrict__ seq_table, int first, int lower, int limit,
                                              int tid) {
    copy_kv_rows<VEC_BYTES_COPY, ROW_STRIDE * (int)sizeof(scalar_t)>(
        reinterpret_cast<unsigned char*>(k_tile), reinterpret_cast<unsigned char*>(v_tile), k_base, seq_table, first,
        lower, limit, tid);
}

#if defined(KV_FP8)
// An fp8 pool: the e4m3 rows into a staging buffer (K, then V at STAGE_BYTES).
__device__ __forceinline__ void copy_kv_stage(unsigned char* stage, const unsigned char* __restrict__ k_base,
                                              const int* __restrict__ seq_table, int first, int lower, int limit,
                                              int tid) {
    copy_kv_rows<KV_COPY_BYTES, HEAD_DIM>(stage, stage + STAGE_BYTES, k_base, seq_table, first, lower, limit, tid);
}

// The staged e4m3 tiles -> the K and V tiles of the mma. Each thread converts the copies it made
// in copy_kv_stage (the same loop), which its own wait has completed.
__device__ __forceinline__ void convert_kv_tiles(scalar_t* k_tile, scalar_t* v_tile, const unsigned char* stage,
                                                 int tid) {
    for (int i = tid; i < BLOCK_N * KV_COPIES_PER_ROW; i += THREADS) {
        const int r = i / KV_COPIES_PER_ROW, c = i % KV_COPIES_PER_ROW;
        const int at = r * HEAD_DIM + c * KV_COPY_BYTES;
        e4m3_to_elements<KV_COPY_BYTES>(stage + at, k_tile + r * ROW_STRIDE + c * KV_COPY_BYTES);
        e4m3_to_elements<KV_COPY_BYTES>(stage + STAGE_BYTES + at, v_tile + r * ROW_STRIDE + c * KV_COPY_BYTES);
    }
}
#endif

// The query rows of the CTA (rows past the sequence's new tokens become zeros).
__device__ __forceinline__ void copy_q_tile(scalar_t* tile, const scalar_t* __restrict__ q, int first_token,
                                            int rows, int head, int tid) {
    for (int i = tid; i < BLOCK_M * COPIES_PER_ROW; i += THREADS) {
        const int r = i / COPIES_PER_ROW, c = i % COPIES_PER_ROW;
        const bool valid = r < rows;
        const unsigned char* src = reinterpret_cast<const unsigned char*>(
                                       q + ((size_t)(first_token + (valid ? r : 0)) * NUM_HEADS + head) * HEAD_DIM) +
                                   c * VEC_BYTES_COPY;
        copy_async<VEC_BYTES_COPY>(reinterpret_cast<unsigned char*>(tile + r * ROW_STRIDE) + c * VEC_BYTES_COPY, src,
                                   valid);
    }
}

// S (this warp's WARP_ROWS rows x BLOCK_N keys) = Q K^T.
__device__ __forceinline__ void score_tile(float (&s)[M_TILES][S_TILES][4], const scalar_t* q_warp,
                                           const scalar_t* k_tile, int lane) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
        for (int j = 0; j < S_TILES; ++j) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.0f;
    }
#pragma unroll
    for (int ks = 0; ks < K_STEPS; ++ks) {
        unsigned int a[M_TILES][4];  // rows 16 mt + lane % 16, columns 16 ks + 8 (lane / 16)
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
            ldmatrix_x4(a[mt], q_warp + (mt * 16 + lane % 16) * ROW_STRIDE + ks * 16 + (lane / 16) * 8);
        }
#pragma unroll
        for (int j = 0; j < S_TILES; j += 2) {  // two n-tiles of keys per ldmatrix
            unsigned int b[4];  // keys 8 j + 8 (lane / 16) + lane % 8, columns 16 ks + 8 ((lane / 8) % 2)
            ldmatrix_x4(b, k_tile + (j * 8 + (lane / 16) * 8 + lane % 8) * ROW_STRIDE + ks * 16 + ((lane / 8) % 2) * 8);
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
                mma_16816(s[mt][j], a[mt], b[0], b[1]);
                mma_16816(s[mt][j + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// Online softmax over one row tile (mma.cuh), the causal mask in the tiles that cross the
// diagonal (`mask`), and a sliding window's in those that hold keys before some row's window. A
// thread holds rows g = lane / 4 and g + 8 of the tile, at positions q_pos[0] and q_pos[1];
// without a window the CTA's first key precedes every row, so a row's max is finite from its first
// tile on.
__device__ __forceinline__ void softmax_rows(float (&s)[S_TILES][4], float (&o)[O_TILES][4], float (&run_max)[2],
                                             float (&run_sum)[2], const int (&q_pos)[2], int key0, bool mask,
                                             float scale_log2, int lane) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        online_softmax_rows(s, o, run_max[half], run_sum[half], half, mask, key0, q_pos[half], scale_log2, lane,
                            window_first(q_pos[half]));
    }
}

// O (WARP_ROWS rows x D_PAD) += P V: P from the score registers (rounded to the element type), V
// by transposing loads.
__device__ __forceinline__ void accumulate_values(float (&o)[M_TILES][O_TILES][4],
                                                  const float (&p)[M_TILES][S_TILES][4], const scalar_t* v_tile,
                                                  int lane) {
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {  // 16 keys: n-tiles 2 kk and 2 kk + 1 of S
        unsigned int a[M_TILES][4];
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
            a[mt][0] = pack2(p[mt][2 * kk][0], p[mt][2 * kk][1]);
            a[mt][1] = pack2(p[mt][2 * kk][2], p[mt][2 * kk][3]);
            a[mt][2] = pack2(p[mt][2 * kk + 1][0], p[mt][2 * kk + 1][1]);
            a[mt][3] = pack2(p[mt][2 * kk + 1][2], p[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int d = 0; d < O_TILES; d += 2) {  // two n-tiles of head dims per ldmatrix (O_TILES is even)
            unsigned int b[4];  // keys 16 kk + 8 ((lane / 8) % 2) + lane % 8, columns 8 d + 8 (lane / 16)
            ldmatrix_x4_trans(b, v_tile + (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * ROW_STRIDE + d * 8 +
                                     (lane / 16) * 8);
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
                mma_16816(o[mt][d], a[mt], b[0], b[1]);
                mma_16816(o[mt][d + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// A split tile's part: publish its rows' unnormalised sums o, maxima and sums (each row's 4 lanes
// summed into `sum`) in scratch slot `slot`, and count it. The last of the tile's parts to arrive
// returns true with every part merged into its own registers: o, each element as the thread held
// it in the mma's layout, and sum, scaled to the merged max (the others return false). The others'
// elements are read by the thread that holds them here, as independent loads.
__device__ __forceinline__ bool merge_parts(float (&o)[M_TILES][O_TILES][4], const float (&run_max)[M_TILES][2],
                                            float (&sum)[M_TILES][2], float* __restrict__ part_out,
                                            float* __restrict__ part_max, float* __restrict__ part_sum,
                                            unsigned int* __restrict__ counter, int slot, int first_slot, int parts,
                                            int head, int warp, int lane, int tid) {
    __shared__ bool last_to_finish;
    const size_t stride = (size_t)NUM_HEADS * BLOCK_M;  // rows from one slot to the next
    const size_t first = ((size_t)first_slot * NUM_HEADS + head) * BLOCK_M;  // part 0's row 0
    int row[M_TILES][2];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            row[mt][half] = warp * WARP_ROWS + mt * 16 + lane / 4 + 8 * half;
            const size_t at = first + (slot - first_slot) * stride + row[mt][half];
            if (lane % 4 == 0) part_max[at] = run_max[mt][half], part_sum[at] = sum[mt][half];
#pragma unroll
            for (int d = 0; d < O_TILES; ++d) {
                const int c = d * 8 + 2 * (lane % 4);
                if (c < HEAD_DIM) {
                    *reinterpret_cast<float2*>(part_out + at * HEAD_DIM + c) =
                        make_float2(o[mt][d][2 * half], o[mt][d][2 * half + 1]);
                }
            }
        }
    }
    __threadfence();  // our partials are visible GPU-wide before the counter moves
    __syncthreads();
    if (tid == 0) last_to_finish = atomicAdd(counter, 1u) == (unsigned int)(parts - 1);
    __syncthreads();
    if (!last_to_finish) return false;
    __threadfence();  // the other parts' partials are read after their counts
    if (tid == 0) *counter = 0u;  // ready for the next layer's launch (or a CUDA graph's replay)

    // Part by part (each part's loads independent of one another, in flight together): the merged
    // max of each row, then the parts' sums, each scaled by 2^(its max - the merged max).
    float m[M_TILES][2];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            m[mt][half] = neg_infinity(), sum[mt][half] = 0.0f;
#pragma unroll
            for (int d = 0; d < O_TILES; ++d) o[mt][d][2 * half] = o[mt][d][2 * half + 1] = 0.0f;
        }
    }
    for (int p = 0; p < parts; ++p) {
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                m[mt][half] = fmaxf(m[mt][half], load_from_l2(part_max + first + p * stride + row[mt][half]));
            }
        }
    }
    for (int p = 0; p < parts; ++p) {
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const size_t at = first + p * stride + row[mt][half];
                const float w = exp2f(load_from_l2(part_max + at) - m[mt][half]);
                // (>= 1 in the end: the part holding the max adds 2^0 x its sum >= 1)
                sum[mt][half] = fmaf(w, load_from_l2(part_sum + at), sum[mt][half]);
#pragma unroll
                for (int d = 0; d < O_TILES; ++d) {
                    const int c = d * 8 + 2 * (lane % 4);
                    if (c < HEAD_DIM) {
                        const float2 v = load2_from_l2(part_out + at * HEAD_DIM + c);
                        o[mt][d][2 * half] = fmaf(w, v.x, o[mt][d][2 * half]);
                        o[mt][d][2 * half + 1] = fmaf(w, v.y, o[mt][d][2 * half + 1]);
                    }
                }
            }
        }
    }
    return true;
}

// out: [T, NUM_HEADS, HEAD_DIM]; q: [T, NUM_HEADS, HEAD_DIM] (rotated, contiguous).
// tile_seq, tile_row: per tile, its sequence and its first new-token row in that sequence;
// tile_part, tile_parts: which of how many key ranges of that tile it covers (0 of 1: all keys).
// The split tiles come first: tile i's partials are scratch slot i (part_out [slots, NUM_HEADS,
// BLOCK_M, HEAD_DIM], part_max and part_sum [slots, NUM_HEADS, BLOCK_M], float32), and a split
// tile's parts are consecutive, its counter that of its part 0 (counters [slots, NUM_HEADS], zero
// between launches).
// seq_start: [B] the sequence's first token in T; num_new, context_lens, slots: [B].
// table: this layer's block table, table[slot * table_slot_stride + logical_block].
// k_scale, v_scale (fp8 pools only): this layer's [NUM_KV_HEADS] float32 scales.
extern "C" __global__ void __launch_bounds__(THREADS) paged_prefill_attention(
    scalar_t* __restrict__ out, const scalar_t* __restrict__ q, const unsigned char* __restrict__ pool,
    const int* __restrict__ table, long long table_slot_stride, const int* __restrict__ tile_seq,
    const int* __restrict__ tile_row, const int* __restrict__ tile_part, const int* __restrict__ tile_parts,
    const int* __restrict__ seq_start, const int* __restrict__ num_new, const int* __restrict__ context_lens,
    const int* __restrict__ slots, float* __restrict__ part_out, float* __restrict__ part_max,
    float* __restrict__ part_sum, unsigned int* __restrict__ counters, float scale_log2 KV_SCALE_PARAMS) {
    start_after_previous_kernels();
#if __CUDA_ARCH__ >= 800
    extern __shared__ __align__(16) unsigned char smem_raw[];
    scalar_t* const q_tile = reinterpret_cast<scalar_t*>(smem_raw);
#if defined(KV_FP8)
    scalar_t* const k_tile = q_tile + TILE_ELEMS_M;  // [BLOCK_N][ROW_STRIDE]
    scalar_t* const v_tile = k_tile + TILE_ELEMS_N;
    unsigned char* const stages = reinterpret_cast<unsigned char*>(v_tile + TILE_ELEMS_N);  // [2][K, V][BLOCK_N][HEAD_DIM]
#else
    scalar_t* const k_tiles = q_tile + TILE_ELEMS_M;       // [2][BLOCK_N][ROW_STRIDE]
    scalar_t* const v_tiles = k_tiles + 2 * TILE_ELEMS_N;  // [2][BLOCK_N][ROW_STRIDE]
#endif

    const int head = blockIdx.x % NUM_HEADS, kv_head = head / GQA, tile = blockIdx.x / NUM_HEADS;
    const int seq = tile_seq[tile], row0 = tile_row[tile];
    const int tid = threadIdx.x, warp = tid / WARP_SIZE, lane = tid % WARP_SIZE;
    const int new_tokens = num_new[seq], context = context_lens[seq];
    const int rows = min(BLOCK_M, new_tokens - row0);
    const int first_pos = context - new_tokens + row0;  // position of the CTA's first row
    const int keys = first_pos + rows;                  // keys lower .. keys - 1 are seen by some row
    const int lower = window_first(first_pos);          // 0 without a sliding window
    const int num_tiles = (keys + BLOCK_N - 1) / BLOCK_N;
    const int first_token = seq_start[seq] + row0;
    // This part's key tiles: from the one holding `lower`, the tiles that start at or before the
    // first row (`lead`) cut evenly, the last part also taking those past it (the diagonal's).
    // (cuda_launch.key_parts counts the same tiles.)
    const int part = tile_part[tile], parts = tile_parts[tile];
    const int tile_low = lower / BLOCK_N;
    const int lead = first_pos / BLOCK_N + 1 - tile_low;
    const int tile_begin = tile_low + part * lead / parts;
    const int tile_end = part + 1 == parts ? num_tiles : tile_low + (part + 1) * lead / parts;

    // Zero the pad columns (D_PAD - HEAD_DIM and the 8 of ROW_STRIDE) once: no copy writes them.
#if defined(KV_FP8)
    constexpr int TILE_ROWS = BLOCK_M + 2 * BLOCK_N;
#else
    constexpr int TILE_ROWS = BLOCK_M + 4 * BLOCK_N;
#endif
    if constexpr (D_PAD != HEAD_DIM) {
        for (int r = tid; r < TILE_ROWS; r += THREADS) {
            for (int c = HEAD_DIM; c < D_PAD; ++c) q_tile[r * ROW_STRIDE + c] = 0;
        }
    }

    const int* __restrict__ seq_table = table + (size_t)slots[seq] * table_slot_stride;
    const unsigned char* __restrict__ k_base = pool + (size_t)kv_head * KV_ROW_BYTES;  // V: V_OFFSET further

#if defined(KV_FP8)
    // the head's scales, and 1 / the unpacking's factor: K's into the softmax's scale, V's into the
    // normalisation
    scale_log2 *= k_scale[kv_head] * (1.0f / E4M3_UNPACK_FACTOR);
    const float out_factor = v_scale[kv_head] * (1.0f / E4M3_UNPACK_FACTOR);
#endif

    copy_q_tile(q_tile, q, first_token, rows, head, tid);
#if defined(KV_FP8)
    copy_kv_stage(stages, k_base, seq_table, tile_begin * BLOCK_N, lower, keys, tid);
#else
    copy_kv_tiles(k_tiles, v_tiles, k_base, seq_table, tile_begin * BLOCK_N, lower, keys, tid);
#endif
    copy_async_commit();

    // This thread's rows: g and g + 8 of each of its warp's row tiles; rows past the new tokens
    // copy the last real row's position, so that they compute something finite (never written).
    const int warp_row0 = warp * WARP_ROWS;
    int q_pos[M_TILES][2];
    float o[M_TILES][O_TILES][4], run_max[M_TILES][2], run_sum[M_TILES][2];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            q_pos[mt][half] = first_pos + min(warp_row0 + mt * 16 + lane / 4 + 8 * half, rows - 1);
            run_max[mt][half] = neg_infinity();
            run_sum[mt][half] = 0.0f;
        }
#pragma unroll
        for (int d = 0; d < O_TILES; ++d) o[mt][d][0] = o[mt][d][1] = o[mt][d][2] = o[mt][d][3] = 0.0f;
    }
    const int warp_last = first_pos + min(warp_row0 + WARP_ROWS - 1, rows - 1);  // this warp's latest position
    // the first key this warp's earliest row sees, and the first its latest row sees (a key tile
    // before the latter holds keys some row of the warp must mask)
    const int warp_lower = window_first(first_pos + min(warp_row0, rows - 1));
    const int warp_all_see = window_first(warp_last);
    const scalar_t* q_warp = q_tile + warp_row0 * ROW_STRIDE;

    for (int t = tile_begin; t < tile_end; ++t) {
        const int buf = (t - tile_begin) % 2, key0 = t * BLOCK_N;
#if defined(KV_FP8)
        if (t + 1 < tile_end) {  // the next tile's copies fly while this one is converted and multiplied
            copy_kv_stage(stages + (buf ^ 1) * 2 * STAGE_BYTES, k_base, seq_table, key0 + BLOCK_N, lower, keys, tid);
        }
        copy_async_commit();
        copy_async_wait<1>();  // every group but the newest: tile t (and Q) have landed
        // (the barrier that ended the last tile: every warp is done with k_tile and v_tile)
        convert_kv_tiles(k_tile, v_tile, stages + buf * 2 * STAGE_BYTES, tid);
        __syncthreads();
#else
        if (t + 1 < tile_end) {  // the next tile's copies fly while this one is multiplied
            copy_kv_tiles(k_tiles + (buf ^ 1) * TILE_ELEMS_N, v_tiles + (buf ^ 1) * TILE_ELEMS_N, k_base, seq_table,
                          key0 + BLOCK_N, lower, keys, tid);
        }
        copy_async_commit();
        copy_async_wait<1>();  // every group but the newest: tile t (and Q) have landed
        __syncthreads();
#endif
        // a warp whose rows all precede the tile, or whose windows all start past it, has nothing to add
        if (key0 <= warp_last && (SLIDING_WINDOW == 0 || key0 + BLOCK_N > warp_lower)) {
            float s[M_TILES][S_TILES][4];
#if defined(KV_FP8)
            score_tile(s, q_warp, k_tile, lane);
#else
            score_tile(s, q_warp, k_tiles + buf * TILE_ELEMS_N, lane);
#endif
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
                const bool diagonal = key0 + BLOCK_N - 1 > first_pos + warp_row0 + mt * 16;  // a key after a row
                const bool before_window = SLIDING_WINDOW > 0 && key0 < warp_all_see;  // a key before a row's window
                softmax_rows(s[mt], o[mt], run_max[mt], run_sum[mt], q_pos[mt], key0, diagonal || before_window,
                             scale_log2, lane);
            }
#if defined(KV_FP8)
            accumulate_values(o, s, v_tile, lane);
#else
            accumulate_values(o, s, v_tiles + buf * TILE_ELEMS_N, lane);
#endif
        }
        __syncthreads();  // everyone is done with buffer `buf` before tile t + 2 is copied into it
    }

#if !defined(KV_FP8)
    const float out_factor = 1.0f;
#endif
    // Each row's sum over its 4 lanes; a split tile's parts merged (the last part to finish writes).
    float sum[M_TILES][2];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            sum[mt][half] = run_sum[mt][half];
            sum[mt][half] += __shfl_xor_sync(FULL_MASK, sum[mt][half], 1);
            sum[mt][half] += __shfl_xor_sync(FULL_MASK, sum[mt][half], 2);
        }
    }
    if (parts > 1 && !merge_parts(o, run_max, sum, part_out, part_max, part_sum,
                                  counters + (size_t)(tile - part) * NUM_HEADS + head, tile, tile - part, parts, head,
                                  warp, lane, tid)) {
        return;
    }
    // Normalise, then write rows < rows, columns < HEAD_DIM.
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const float inv = out_factor / sum[mt][half];  // sum >= 1: the max term is 2^0
            const int r = warp_row0 + mt * 16 + lane / 4 + 8 * half;
            if (r < rows) {
                scalar_t* dst = out + ((size_t)(first_token + r) * NUM_HEADS + head) * HEAD_DIM;
#pragma unroll
                for (int d = 0; d < O_TILES; ++d) {
                    const int c = d * 8 + 2 * (lane % 4);
                    if (c < HEAD_DIM) {  // HEAD_DIM is even: the pair is whole
                        *reinterpret_cast<unsigned int*>(dst + c) =
                            pack2(o[mt][d][2 * half] * inv, o[mt][d][2 * half + 1] * inv);
                    }
                }
            }
        }
    }
#endif
}
