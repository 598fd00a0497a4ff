// gemv.cu: out = x @ W.T for a decode batch of a few rows (M <= GEMV_MAX_ROWS), fused with the
// step before it and the step after it.
//
// At batch 1 a decode step is a chain of matrix-vector products: each weight byte is read once and
// used M times, so the step costs the weights' read time plus whatever the chain wastes between
// reads. At batch 1, cuBLAS with separate norm/SiLU/add kernels reads qkv, o and down well below the
// memory's bandwidth (docs/performance-log.md, "Each GEMM at batch 1"). This kernel tries to keep the memory system busy from the first to the last byte:
//   - one warp per weight row at a time (or 2 to 4 warps, each over a slice of K, when the rows are
//     too few to give every warp slot of the GPU one), 16-byte loads, GEMV_UNROLL of them per lane
//     in flight, and the next tile's loads issued before the current tile's arithmetic (double
//     buffering in registers), across row boundaries too;
//   - what comes before the product is done on the (small) input while it is staged in shared
//     memory: RMSNorm (before qkv, gate/up and the LM head); what comes after it is done as each
//     row is written: the residual add (after o and down), the float logits, or silu(gate) * up
//     (after gate/up: one warp computes gate row i and up row i one after the other, so only the
//     activation is written and down reads half as much), or RoPE and the K/V write (after qkv: a
//     warp computes the two rows of a rotary pair, rotates them and writes q, or k and v into their
//     cache block, as kv_write.cu does); the first weight tile is loaded before the input is staged,
//     and on sm_90+ before the previous kernel has finished (common.cuh's programmatic launch).
//
// L2: a weight byte is read once a step, and the weights (2.5 GB at Llama-3.2-1B) stream through
// an L2 of 50 MB. With GEMV_EVICT_FIRST=1 the weight loads mark their lines first to go, so what is
// read again soon (the K/V cache, the block table, activations) stays in L2 between kernels and
// steps: attention's latency-bound reads hit L2 (docs/performance-log.md, "What won").
//
// Rounding is the torch reference's: the input is rounded to the dtype after each elementwise step
// as torch stores it (common.cuh's formulas, as in elementwise.cu), products accumulate in fp32 (as cuBLAS),
// and the result is rounded to the dtype once; the residual add rounds like torch's bf16 add.
//
// FP8 weights (`--quantization fp8`, pagedcli/model/fp8.py; the gemv8_ kernels): e4m3 values with
// a float scale per weight row. A 16-byte load then holds 16 weights, which become floats through
// fp16 (fp8.cuh), and a row's fp32 sum is multiplied by its scale: the
// torch reference's fp8_linear, which sums x times the fp8 values in fp32, then scales.
//
// Shapes: W [N, K] row-major; `rows` input rows, at most the kernel's M; K % VEC == 0 (fp8: K % 16)
// and every row 16-byte aligned (checked in Python, which falls back to cuBLAS otherwise). Dynamic
// shared memory: M * K elements.

#include "fp8.cuh"
#include "rope_kv.cuh"

#if !defined(GEMV_THREADS) || !defined(GEMV_UNROLL) || !defined(GEMV_MIN_CTAS) || !defined(GEMV_EVICT_FIRST)
#error "gemv.cu needs -DGEMV_THREADS -DGEMV_UNROLL -DGEMV_MIN_CTAS -DGEMV_EVICT_FIRST (pagedcli/backends/cuda.py)"
#endif

#define GEMV_WARPS (GEMV_THREADS / WARP_SIZE)

// The weights' element: the model dtype (scalar_t), or fp8 e4m3 (Fp8: one byte, with a float scale
// per weight row; pagedcli/model/fp8.py), 16 of them to a 16-byte load.
struct Fp8 {
    unsigned char bits;
};
template <typename WT>
__host__ __device__ constexpr int weight_vec() { return (int)sizeof(uint4) / (int)sizeof(WT); }  // elements of a 16-byte load
template <typename WT>
__host__ __device__ constexpr int tile_elems() { return WARP_SIZE * weight_vec<WT>() * GEMV_UNROLL; }  // of a row, one warp step

// What the input rows are, before the product.
#define IN_PLAIN 0     // x itself
#define IN_RMS_NORM 1  // RMSNorm(residual) * norm_weight: in = the residual rows
// What is written, after it.
#define OUT_STORE 0     // out = x @ W.T, in the dtype
#define OUT_ADD 1       // out += x @ W.T: out is the residual stream, updated in place
#define OUT_FLOAT 2     // out = x @ W.T rounded to the dtype, stored as float (the logits)
#define OUT_SILU_MUL 3  // W = [gate (N/2 rows) | up (N/2 rows)]: out [rows, N/2] = silu(gate) * up
#define OUT_ROPE_KV 4   // W = qkv: rotated q to RopeKV::q_out, rotated k and v into the pool

// Where OUT_ROPE_KV puts its results (kv_write.cu's arguments): row m of the input is token m.
struct RopeKV {
    scalar_t* q_out;  // [rows, NUM_HEADS, HEAD_DIM]
    unsigned char* pool;
    const int* table;  // this layer's block table
    long long table_slot_stride;
    int max_blocks;
    const long long* positions;  // [rows]; negative: a padding row (q zeros, nothing written)
    const long long* token_seq;  // [rows]: the sequence of each token
    const int* slots;            // [sequences]
    const scalar_t* cos_table;
    const scalar_t* sin_table;
    int max_positions;
    KvScales scales;  // an fp8 pool's (rope_kv.cuh's store_kv_pair); nothing otherwise
};

// Token m's position (negative: a padding row) and sequence, read at the kernel's start by the lane
// that writes token m (two independent reads, not waited for until a unit ends): the reads a unit's
// end then waits for are the rotation's cos/sin, and for k and v the slot and the block table.
struct TokenOf {
    long long pos;
    long long seq;
};

// Token m's two outputs of rotary pair `unit` (head unit / HALF_DIM, element unit % HALF_DIM of
// the qkv projection), as the GEMM would have stored them: rotated into q_out, or into the pool.
__device__ __forceinline__ void rope_write_pair(const RopeKV& kv, const TokenOf& token, int m, int unit, float x1,
                                                float x2) {
    const int head = unit / HALF_DIM, d = unit % HALF_DIM;
    const long long pos = token.pos;
    const bool valid = pos >= 0 && pos < kv.max_positions;
    float out1 = 0.0f, out2 = 0.0f;
    if (valid && head < NUM_HEADS + NUM_KV_HEADS) {
        const scalar_t* cos_row = kv.cos_table + pos * HEAD_DIM;
        const scalar_t* sin_row = kv.sin_table + pos * HEAD_DIM;
        rotate_pair(x1, x2, to_float(cos_row[d]), to_float(cos_row[d + HALF_DIM]), to_float(sin_row[d]),
                    to_float(sin_row[d + HALF_DIM]), out1, out2);
    }
    scalar_t* dst;
    if (head < NUM_HEADS) {  // q: zeros for a padding row
        dst = kv.q_out + ((size_t)m * NUM_HEADS + head) * HEAD_DIM;
    } else {
        unsigned char* const row =
            valid ? kv_row(kv.pool, kv.table, kv.table_slot_stride, kv.max_blocks, kv.slots[token.seq], pos) : nullptr;
        if (row == nullptr) return;
#if defined(KV_FP8)  // k, and v as it is, quantized into the pool
        const bool is_v = head >= NUM_HEADS + NUM_KV_HEADS;
        store_kv_pair(row, is_v, head - NUM_HEADS - (is_v ? NUM_KV_HEADS : 0), d, is_v ? x1 : out1, is_v ? x2 : out2,
                      kv.scales);
        return;
#else
        if (head < NUM_HEADS + NUM_KV_HEADS) {
            dst = reinterpret_cast<scalar_t*>(row) + (head - NUM_HEADS) * HEAD_DIM;
        } else {  // v: as it is
            dst = reinterpret_cast<scalar_t*>(row + V_OFFSET) + (head - NUM_HEADS - NUM_KV_HEADS) * HEAD_DIM;
            out1 = x1, out2 = x2;
        }
#endif
    }
    dst[d] = from_float(out1);
    dst[d + HALF_DIM] = from_float(out2);
}

// in rows -> the M x K input of the product, in shared memory (each thread re-reads only the vectors
// it wrote, except for the RMSNorm's sums, which cross a barrier).
template <int M, int IN>
__device__ __forceinline__ void stage_input(scalar_t* __restrict__ xs, int rows, const scalar_t* __restrict__ in,
                                            long long in_stride, const scalar_t* __restrict__ norm_weight,
                                            float eps, int K) {
    const int vecs = K / VEC;
    if constexpr (IN == IN_RMS_NORM) {
        __shared__ float warp_sums[M][GEMV_WARPS];
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float sum_sq = 0.0f;
            for (int v = threadIdx.x; v < vecs && m < rows; v += GEMV_THREADS) {
                const uint4 raw = *reinterpret_cast<const uint4*>(in + m * in_stride + v * VEC);
                *reinterpret_cast<uint4*>(xs + (size_t)m * K + v * VEC) = raw;
                float r[VEC];
                unpack_vec(raw, r);
#pragma unroll
                for (int j = 0; j < VEC; ++j) sum_sq = fmaf(r[j], r[j], sum_sq);
            }
            sum_sq = warp_sum(sum_sq);
            if (threadIdx.x % WARP_SIZE == 0) warp_sums[m][threadIdx.x / WARP_SIZE] = sum_sq;
        }
        __syncthreads();
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float total = 0.0f;
            for (int w = 0; w < GEMV_WARPS; ++w) total += warp_sums[m][w];
            const float inv_rms = rms_inverse(total, K, eps);
            for (int v = threadIdx.x; v < vecs && m < rows; v += GEMV_THREADS) {
                float r[VEC], w[VEC];
                load_floats<VEC>(xs + (size_t)m * K + v * VEC, r);
                load_floats<VEC>(norm_weight + v * VEC, w);
#pragma unroll
                for (int j = 0; j < VEC; ++j) r[j] = rms_scale(r[j], w[j], inv_rms);
                store_floats<VEC>(xs + (size_t)m * K + v * VEC, r);
            }
        }
    } else {
#pragma unroll
        for (int m = 0; m < M; ++m) {
            for (int v = threadIdx.x; v < vecs && m < rows; v += GEMV_THREADS) {
                *reinterpret_cast<uint4*>(xs + (size_t)m * K + v * VEC) =
                    *reinterpret_cast<const uint4*>(in + m * in_stride + v * VEC);
            }
        }
    }
}

// One 16-byte vector of W: with GEMV_EVICT_FIRST, past L1 and marked for L2 to evict first (an L2
// access policy covering the access; createpolicy is one instruction, hoisted by the compiler).
__device__ __forceinline__ uint4 load_weight(const scalar_t* p) {
#if GEMV_EVICT_FIRST && __CUDA_ARCH__ >= 800
    unsigned long long policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p), "l"(policy));
    return r;
#else
    return *reinterpret_cast<const uint4*>(p);
#endif
}

// The GEMV_UNROLL vectors of row `row`, tile `tile` that this lane reads (zeros past K).
template <typename WT>
__device__ __forceinline__ void load_tile(const WT* __restrict__ W, int row, int tile, int K, int lane,
                                          uint4 (&w)[GEMV_UNROLL]) {
    const WT* __restrict__ src = W + (size_t)row * K;
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u) {
        const int k = tile * tile_elems<WT>() + (u * WARP_SIZE + lane) * weight_vec<WT>();
        w[u] = k < K ? load_weight(reinterpret_cast<const scalar_t*>(src + k)) : make_uint4(0, 0, 0, 0);
    }
}

// A 16-byte vector of weights as floats: the dtype's VEC elements, or 16 fp8 values (times
// fp8.cuh's E4M3_UNPACK_FACTOR, which row_scale divides out).
__device__ __forceinline__ void unpack_weights(const uint4& raw, float (&out)[VEC]) { unpack_vec(raw, out); }
__device__ __forceinline__ void unpack_weights(const uint4& raw, float (&out)[16]) {
    const unsigned int words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) e4m3x4_scaled(words[i], out[4 * i], out[4 * i + 1], out[4 * i + 2], out[4 * i + 3]);
}

// What a finished row's fp32 sum is multiplied by: nothing for the dtype's weights; the row's scale
// (over the factor unpack_weights left in, a power of two: exact) for fp8.
template <typename WT>
__device__ __forceinline__ float row_scale(const float* __restrict__ scales, int row) {
    if constexpr (sizeof(WT) == 1) {
        return scales[row] * (1.0f / E4M3_UNPACK_FACTOR);
    } else {
        return 1.0f;
    }
}

// silu(gate) * up of the GEMM's gate and up outputs, each rounded as torch would have stored it.
__device__ __forceinline__ float silu_mul(float gate, float up) {
    return silu_times(round_to_dtype(gate), round_to_dtype(up));
}

// The sum of a unit's partial results over the `split` warps that share it (K slices, in order:
// the same sum whatever the timing), in the first of those warps. Every warp of the group calls
// this once per unit; the partials alternate between two buffers, so the group's one barrier per
// unit also keeps a buffer from being overwritten while the first warp still reads it.
template <int M>
__device__ __forceinline__ void sum_split_k(float (&first)[M], float (&second)[M], int split, int warp, int lane,
                                            int parity) {
    __shared__ float partial[2][GEMV_WARPS][2][M];
    if (lane < M) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
            if (lane == m) partial[parity][warp][0][m] = first[m], partial[parity][warp][1][m] = second[m];
        }
    }
    const int leader = warp - warp % split;
    asm volatile("bar.sync %0, %1;" ::"r"(1 + leader / split), "r"(split * WARP_SIZE) : "memory");
    if (warp != leader) return;
#pragma unroll
    for (int m = 0; m < M; ++m) {
        first[m] = second[m] = 0.0f;
        for (int w = leader; w < leader + split; ++w) {
            first[m] += partial[parity][w][0][m];
            second[m] += partial[parity][w][1][m];
        }
    }
}

// M: the most input rows this instance takes (1 or 2: cuda.py's GEMV_ROW_BUCKETS); rows <= M.
// A unit of work is one weight row, or two with OUT_SILU_MUL (gate row i, then up row i, N/2 rows
// apart) and OUT_ROPE_KV (element d of a head, then element d + HEAD_DIM/2).
// split (dividing GEMV_WARPS, at most K's tiles): warps per unit, each over its slice of the tiles. A
// few thousand rows (o, down, qkv at Llama-3.2-1B) fill only half of the GPU's warp slots with a
// warp per row, and bytes in flight are what a GEMV's speed is made of; with split 2 every slot
// streams. The split warps' sums meet in shared memory (sum_split_k).
// grid: at most the CTAs the GPU holds at once (Python sizes it); the warp group g (warps
// g * split ...) of CTA c takes unit c * GEMV_WARPS / split + g, then every gridDim.x *
// GEMV_WARPS / split units after it.
// in: `rows` rows, in_stride elements apart; out: `rows` rows, out_stride elements apart (scalar_t,
// or float for OUT_FLOAT); norm_weight and eps: for IN_RMS_NORM only; kv: for OUT_ROPE_KV only.
// WT: the weights' element (scalar_t, or Fp8 with `scales`: one float per weight row).
template <int M, int IN, int OUT, typename WT>
__device__ __forceinline__ void gemv(const WT* __restrict__ W, const float* __restrict__ scales, int N, int K,
                                     int rows, int split, const scalar_t* __restrict__ in, long long in_stride,
                                     const scalar_t* __restrict__ norm_weight, float eps, void* out,
                                     long long out_stride, const RopeKV& kv) {
    constexpr int TILE = tile_elems<WT>(), W_VEC = weight_vec<WT>();
    constexpr int ROWS_PER_UNIT = OUT == OUT_SILU_MUL || OUT == OUT_ROPE_KV ? 2 : 1;
    extern __shared__ uint4 shared_input[];
    scalar_t* __restrict__ xs = reinterpret_cast<scalar_t*>(shared_input);
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int groups = GEMV_WARPS / split;
    const int units = N / ROWS_PER_UNIT, unit_step = gridDim.x * groups;
    const int tiles = (K + TILE - 1) / TILE;
    const int tile_begin = warp % split * tiles / split, tile_end = (warp % split + 1) * tiles / split;
    // a unit's rows: HALF_DIM units of RoPE make a run of HEAD_DIM rows, its first rows then its
    // second rows; gate and up are the two halves of W (no division by a run-time span: a row of fp8
    // weights is one tile, so what a row costs beyond its products counts)
    const auto weight_row = [&](int unit, int part) {
        if constexpr (OUT == OUT_ROPE_KV) {
            return (unit / HALF_DIM) * 2 * HALF_DIM + unit % HALF_DIM + part * HALF_DIM;
        } else {
            return unit + part * units;
        }
    };
    int unit = blockIdx.x * groups + warp / split;

    // The first tile's loads go out before anything else: no kernel writes the weights, so they may
    // be read before the previous kernel has finished (common.cuh's programmatic launch), and they
    // are in flight while the input is staged.
    allow_next_kernel();
    uint4 w[GEMV_UNROLL];
    if (unit < units) load_tile(W, weight_row(unit, 0), tile_begin, K, lane, w);
    wait_for_previous_kernels();

    // What lane m needs to write row m besides the sums, read early, so that the end of a unit waits
    // on fewer reads: its token's position and sequence (OUT_ROPE_KV), and the residual it adds to
    // (OUT_ADD), read for each unit with the unit's first weights (no other warp writes it).
    TokenOf token{-1, 0};
    if constexpr (OUT == OUT_ROPE_KV) {
        if (lane < rows) token = {kv.positions[lane], kv.token_seq[lane]};
    }
    const auto residual_of = [&](int u) {
        return OUT == OUT_ADD && lane < rows && u < units
                   ? to_float(static_cast<const scalar_t*>(out)[(size_t)lane * out_stride + u])
                   : 0.0f;
    };
    float residual = residual_of(unit), next_residual = 0.0f;

    stage_input<M, IN>(xs, rows, in, in_stride, norm_weight, eps, K);
    __syncthreads();

    float acc[M], first[M];  // first: the gate rows' results while the up rows are computed
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = first[m] = 0.0f;
    for (int part = 0, tile = tile_begin, parity = 0; unit < units;) {
        // the next tile (this row's next, the unit's next row, or the warp's next unit) is loaded
        // before this tile's arithmetic
        int next_unit = unit, next_part = part, next_tile = tile + 1;
        if (next_tile == tile_end) {
            next_tile = tile_begin;
            if (++next_part == ROWS_PER_UNIT) next_part = 0, next_unit += unit_step;
        }
        uint4 next[GEMV_UNROLL];
        if (next_unit < units) load_tile(W, weight_row(next_unit, next_part), next_tile, K, lane, next);
        if (OUT == OUT_ADD && next_unit != unit) next_residual = residual_of(next_unit);

#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            const int k = tile * TILE + (u * WARP_SIZE + lane) * W_VEC;
            if (k < K) {
                float wf[W_VEC];
                unpack_weights(w[u], wf);
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    if (M > 1 && m >= rows) break;
#pragma unroll
                    for (int h = 0; h < W_VEC; h += VEC) {  // the input's 16-byte vectors under this load
                        float x[VEC];
                        load_floats<VEC>(xs + (size_t)m * K + k + h, x);
#pragma unroll
                        for (int j = 0; j < VEC; ++j) acc[m] = fmaf(wf[h + j], x[j], acc[m]);
                    }
                }
            }
        }

        if (next_tile == tile_begin) {  // this warp's slice of a row is complete: reduce across the warp
            float (&total)[M] = acc;  // the warp's sums replace its lanes' (and are zeroed below)
            const float scale = row_scale<WT>(scales, weight_row(unit, part));
#pragma unroll
            for (int m = 0; m < M; ++m) total[m] = warp_sum(acc[m]) * scale;
            if (ROWS_PER_UNIT == 2 && part == 0) {  // kept until the unit's second row is done
#pragma unroll
                for (int m = 0; m < M; ++m) first[m] = total[m];
            } else {
                bool writer = true;
                if (split > 1) {
                    sum_split_k<M>(first, total, split, warp, lane, parity);
                    parity ^= 1;
                    writer = warp % split == 0;
                }
                // lane m writes row m
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    if (writer && lane == m && m < rows) {
                        const size_t at = (size_t)m * out_stride + unit;
                        if constexpr (OUT == OUT_STORE) {
                            static_cast<scalar_t*>(out)[at] = from_float(total[m]);
                        } else if constexpr (OUT == OUT_ADD) {
                            static_cast<scalar_t*>(out)[at] = from_float(__fadd_rn(residual, round_to_dtype(total[m])));
                        } else if constexpr (OUT == OUT_FLOAT) {
                            static_cast<float*>(out)[at] = round_to_dtype(total[m]);
                        } else if constexpr (OUT == OUT_SILU_MUL) {
                            static_cast<scalar_t*>(out)[at] = from_float(silu_mul(first[m], total[m]));
                        } else {
                            rope_write_pair(kv, token, m, unit, round_to_dtype(first[m]), round_to_dtype(total[m]));
                        }
                    }
                }
            }
#pragma unroll
            for (int m = 0; m < M; ++m) acc[m] = 0.0f;
        }
        if (next_unit != unit) residual = next_residual;
        unit = next_unit, part = next_part, tile = next_tile;
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) w[u] = next[u];
    }
}

// One kernel per (rows, input step, output step): gemv_<M>_<in>_<out>, e.g. gemv_1_rms_norm_store;
// pagedcli/backends/cuda.py's gemv_kernel_names() lists the same.
// gemv8_...: the same with fp8 weights and their row scales (the rope_kv kernels likewise).
#define GEMV_KERNEL(M, IN_NAME, IN, OUT_NAME, OUT)                                                           \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_CTAS) gemv_##M##_##IN_NAME##_##OUT_NAME( \
        const scalar_t* __restrict__ W, int N, int K, int rows, int split, const scalar_t* __restrict__ in,    \
        long long in_stride, const scalar_t* __restrict__ norm_weight, float eps, void* out, long long out_stride) { \
        gemv<M, IN, OUT>(W, nullptr, N, K, rows, split, in, in_stride, norm_weight, eps, out, out_stride, RopeKV{}); \
    }
#define GEMV8_KERNEL(M, IN_NAME, IN, OUT_NAME, OUT)                                                          \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_CTAS) gemv8_##M##_##IN_NAME##_##OUT_NAME( \
        const Fp8* __restrict__ W, const float* __restrict__ scales, int N, int K, int rows, int split,         \
        const scalar_t* __restrict__ in, long long in_stride, const scalar_t* __restrict__ norm_weight, float eps, \
        void* out, long long out_stride) {                                                                    \
        gemv<M, IN, OUT>(W, scales, N, K, rows, split, in, in_stride, norm_weight, eps, out, out_stride, RopeKV{}); \
    }

// qkv with RoPE and the K/V write: kv_write.cu's arguments instead of an output.
#define ROPE_KV_PARAMS                                                                                      \
    int N, int K, int rows, int split, const scalar_t *__restrict__ in, long long in_stride,                 \
        const scalar_t *__restrict__ norm_weight, float eps, scalar_t *q_out, unsigned char *pool,           \
        const int *table, long long table_slot_stride, int max_blocks, const long long *positions,           \
        const long long *token_seq, const int *slots, const scalar_t *cos_table, const scalar_t *sin_table,  \
        int max_positions KV_SCALE_PARAMS
#define ROPE_KV_BODY(M, SCALES)                                                                                \
    const RopeKV kv{q_out, pool, table, table_slot_stride, max_blocks, positions, token_seq, slots, cos_table, \
                    sin_table, max_positions, KV_SCALES};                                                    \
    gemv<M, IN_RMS_NORM, OUT_ROPE_KV>(W, SCALES, N, K, rows, split, in, in_stride, norm_weight, eps, nullptr, 0, kv);
#define GEMV_ROPE_KV_KERNEL(M)                                                                                \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_CTAS) gemv_##M##_rms_norm_rope_kv(      \
        const scalar_t* __restrict__ W, ROPE_KV_PARAMS) {                                                     \
        ROPE_KV_BODY(M, nullptr)                                                                                 \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_CTAS) gemv8_##M##_rms_norm_rope_kv(     \
        const Fp8* __restrict__ W, const float* __restrict__ scales, ROPE_KV_PARAMS) {                        \
        ROPE_KV_BODY(M, scales)                                                                                  \
    }

// The combinations a Llama layer and its LM head use, for each batch-size bucket up to GEMV_MAX_ROWS.
#define GEMV_KERNELS(M)                                           \
    GEMV_KERNEL(M, rms_norm, IN_RMS_NORM, store, OUT_STORE)        \
    GEMV_KERNEL(M, rms_norm, IN_RMS_NORM, float, OUT_FLOAT)        \
    GEMV_KERNEL(M, rms_norm, IN_RMS_NORM, silu_mul, OUT_SILU_MUL)  \
    GEMV_KERNEL(M, plain, IN_PLAIN, add, OUT_ADD)                  \
    GEMV8_KERNEL(M, rms_norm, IN_RMS_NORM, store, OUT_STORE)       \
    GEMV8_KERNEL(M, rms_norm, IN_RMS_NORM, float, OUT_FLOAT)       \
    GEMV8_KERNEL(M, rms_norm, IN_RMS_NORM, silu_mul, OUT_SILU_MUL) \
    GEMV8_KERNEL(M, plain, IN_PLAIN, add, OUT_ADD)                 \
    GEMV_ROPE_KV_KERNEL(M)

GEMV_KERNELS(1)
GEMV_KERNELS(2)
