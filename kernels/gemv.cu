// gemv.cu: out = x @ W.T for a decode batch of a few rows (M <= GEMV_MAX_ROWS), fused with the
// step before it and the step after it.
//
// At batch 1 a decode step is a chain of matrix-vector products: each weight byte is read once and
// used M times, so the step costs the weights' read time plus whatever the chain wastes between
// reads. At batch 1 on an H200, cuBLAS with separate norm/SiLU/add kernels reads qkv, o and down at
// 1.3 to 2.4 TB/s. This kernel tries to keep the memory system busy from the first to the last byte:
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
//     cache block, as kv_write.cu does); the first weight tile is loaded before the input is staged.
//
// L2: a weight byte is read once a step, and the weights (2.5 GB at Llama-3.2-1B) stream through
// an L2 of 50 MB. With GEMV_EVICT_FIRST=1 the weight loads mark their lines first to go, so what is
// read again soon (the K/V cache, the block table, activations) stays in L2 between kernels and
// steps: attention's latency-bound reads hit L2 (2 to 5% of a batch-1 step on an H200).
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
// fp8.cuh's E4M3_UNPACK_FACTOR, which unpack_factor divides out).
__device__ __forceinline__ void unpack_weights(const uint4& raw, float (&out)[VEC]) { unpack_vec(raw, out); }
__device__ __forceinline__ void unpack_weights(const uint4& raw, float (&out)[16]) {
    const unsigned int words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) e4m3x4_scaled(words[i], out[4 * i], out[4 * i + 1], out[4 * i + 2], out[4 * i + 3]);
}

// What a warp's fp32 sum is multiplied by before the split warps' sums meet: the power of two that
// unpack_weights left in fp8 weights (exact), nothing for the dtype's.
template <typename WT>
__device__ __forceinline__ float unpack_factor() {
    if constexpr (sizeof(WT) == 1) {
        return 1.0f / E4M3_UNPACK_FACTOR;
    } else {
        return 1.0f;
    }
}

// W8A8 (pagedcli/model/fp8.py's quantize_rows): each of the `rows` input rows (src, src_stride
// elements apart; shared or global memory) quantized to e4m3 with its own scale amax(|row|) / 448
// (1 for an all-zero row), the division and the rounding as torch's (IEEE division, round to
// nearest even, saturated). The scales go to `scale` [M]; the values to `xq` (bytes, rows
// xq_stride apart), or, with xq null, back over src as the dtype's numbers (e4m3 values are exact
// bf16, fp16 and fp32 numbers): sm_80's conversion kernel then multiplies them as it multiplies
// any input. AS_HALVES: to `xq` as fp16 numbers (exact too), for gemv8_mma's fp16 operands. The
// caller's barrier publishes both.
template <int M, bool AS_HALVES = false>
__device__ __forceinline__ void quantize_rows(const scalar_t* __restrict__ src, long long src_stride, int rows, int K,
                                              float* __restrict__ scale, unsigned char* __restrict__ xq,
                                              int xq_stride) {
    static_assert(VEC % 2 == 0, "two elements to an e4m3x2 conversion");
    __shared__ float warp_amax[M][GEMV_WARPS];
    const int vecs = K / VEC;
#pragma unroll
    for (int m = 0; m < M; ++m) {
        float amax = 0.0f;
        for (int v = threadIdx.x; v < vecs && m < rows; v += GEMV_THREADS) {
            float r[VEC];
            load_floats<VEC>(src + m * src_stride + v * VEC, r);
#pragma unroll
            for (int j = 0; j < VEC; ++j) amax = fmaxf(amax, fabsf(r[j]));
        }
        amax = warp_max(amax);
        if (threadIdx.x % WARP_SIZE == 0) warp_amax[m][threadIdx.x / WARP_SIZE] = amax;
    }
    __syncthreads();
#pragma unroll
    for (int m = 0; m < M; ++m) {
        float amax = 0.0f;
        for (int w = 0; w < GEMV_WARPS; ++w) amax = fmaxf(amax, warp_amax[m][w]);
        const float s = amax > 0.0f ? __fdiv_rn(amax, FP8_MAX) : 1.0f;
        if (threadIdx.x == 0) scale[m] = s;
        for (int v = threadIdx.x; v < vecs && m < rows; v += GEMV_THREADS) {
            float r[VEC];
            load_floats<VEC>(src + m * src_stride + v * VEC, r);
            unsigned int pairs[VEC / 2];
#pragma unroll
            for (int j = 0; j < VEC / 2; ++j) pairs[j] = e4m3x2_from_floats(__fdiv_rn(r[2 * j], s), __fdiv_rn(r[2 * j + 1], s));
            if (xq == nullptr) {
#pragma unroll
                for (int j = 0; j < VEC / 2; ++j) r[2 * j] = e4m3_to_float(pairs[j]), r[2 * j + 1] = e4m3_to_float(pairs[j] >> 8);
                store_floats<VEC>(const_cast<scalar_t*>(src) + m * src_stride + v * VEC, r);
            } else if constexpr (AS_HALVES) {  // the e4m3 values as fp16 (exact), two a word
                unsigned int* dst = reinterpret_cast<unsigned int*>(xq + (size_t)m * xq_stride + v * VEC * 2);
#pragma unroll
                for (int j = 0; j < VEC / 2; ++j) dst[j] = e4m3x2_to_halves(pairs[j]);
            } else {
                unsigned int* dst = reinterpret_cast<unsigned int*>(xq + (size_t)m * xq_stride + v * VEC);
#pragma unroll
                for (int j = 0; j < VEC / 4; ++j) dst[j] = pairs[2 * j] | (pairs[2 * j + 1] << 16);
            }
        }
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
    // a unit's rows: `span` units make a run of 2 * span rows, its first rows then its second rows
    const int span = OUT == OUT_ROPE_KV ? HALF_DIM : units;
    const auto weight_row = [&](int unit, int part) { return (unit / span) * 2 * span + unit % span + part * span; };
    int unit = blockIdx.x * groups + warp / split;

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

    // The first tile's loads go out before the input is staged: they are in flight meanwhile.
    uint4 w[GEMV_UNROLL];
    if (unit < units) load_tile(W, weight_row(unit, 0), tile_begin, K, lane, w);
    stage_input<M, IN>(xs, rows, in, in_stride, norm_weight, eps, K);
    __shared__ float act_scale[M];  // fp8 weights: the input rows' scales (W8A8)
    if constexpr (sizeof(WT) == 1) {
        __syncthreads();
        quantize_rows<M>(xs, K, rows, K, act_scale, nullptr, 0);
    }
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
#pragma unroll
            for (int m = 0; m < M; ++m) total[m] = warp_sum(acc[m]) * unpack_factor<WT>();
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
                if constexpr (sizeof(WT) == 1) {  // W8A8: the sums times the input row's scale, then the weight row's
                    const float last = scales[weight_row(unit, ROWS_PER_UNIT - 1)], first_row = scales[weight_row(unit, 0)];
#pragma unroll
                    for (int m = 0; m < M; ++m) {
                        total[m] = __fmul_rn(__fmul_rn(total[m], act_scale[m]), last);
                        first[m] = __fmul_rn(__fmul_rn(first[m], act_scale[m]), first_row);
                    }
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

// --- fp8 weights on tensor cores (sm_89+): W8A8 through mma.m16n8k32 e4m3 --------------------------
//
// A warp multiplies 16 weight rows (the mma's A: 16 x 32 e4m3) by the quantized input rows (B:
// 32 x 8, one column per input row, the columns past `rows` zero), summing in fp32. The dot
// product does not change when k is permuted the same way in both operands, so the warp takes k
// in blocks of 64 (two mmas) permuted so that each lane's A registers are two 16-byte loads
// straight from the weights, nothing converted: lane (g = lane / 4, t = lane % 4) loads bytes
// 16t .. 16t+15 of the block of weight rows g and g+8; of each 16-byte load, words 0 and 1 are
// its A registers of the block's first mma, words 2 and 3 of its second (the PTX ISA's fragment of
// m16n8k32: a lane holds k 4t..4t+3 and 16+4t..16+4t+3 of rows g and g+8, in registers 0/2 and
// 1/3). The B fragment of the same lane (k rows 4t.. and 16+4t.., column g) is then bytes
// 16t .. 16t+15 of the block of input row g: one 16-byte load from shared memory, with the
// activations in their natural order (tests/test_fp8.py's emulation of the fragments checks it).
// The accumulators (D: rows g and g+8, columns 2t and 2t+1) are the outputs of input rows 2t and
// 2t+1 for the two weight rows. Each mma starts from zero and its result is added in fp32, so
// the fp32 sum is not limited by the precision the tensor cores add with (their fp8 sums keep
// fewer bits than fp32's 24: DeepSeek-V3's report, section 3.3.2).
//
// A unit of work is 16 weight rows: 16 consecutive rows, or with OUT_SILU_MUL and OUT_ROPE_KV 8
// pairs (gate rows i..i+7 and up rows i..i+7; elements d..d+7 of a head and d+HEAD_DIM/2..), so a
// lane holds both outputs of a pair. `split` warps share a unit, each over its slice of the tiles
// (GEMV8_TILE k), and meet in shared memory; the input rows are quantized once per CTA in the
// prologue, while the first weight tile is in flight. Shared memory: the M quantized rows
// (gemv8_row_stride bytes apart), then for IN_RMS_NORM the M staged rows in the dtype (IN_PLAIN
// reads its input from global memory, twice: its amax, then its values). On sm_90 the same with
// fp16 operands (GEMV8_HALVES below).
#define GEMV8_BLOCK 64                           // k of a lane's 16-byte load of a row: two mmas
#define GEMV8_BLOCKS (GEMV_UNROLL / 2)           // blocks a tile: GEMV_UNROLL loads a lane (two rows)
#define GEMV8_TILE (GEMV8_BLOCK * GEMV8_BLOCKS)  // k of a tile
static_assert(GEMV_UNROLL % 2 == 0, "gemv8's tile loads two weight rows a block");
#if !defined(GEMV8_PAD) || !defined(GEMV8_PAD_HALVES)
#error "gemv.cu needs -DGEMV8_PAD -DGEMV8_PAD_HALVES (pagedcli/backends/cuda_build.py)"
#endif
static_assert(GEMV8_PAD % 16 == 0 && GEMV8_PAD_HALVES % 16 == 0, "quantized rows stay 16-byte aligned");

// The operands gemv8_mma gives the tensor cores: e4m3 where mma.sync takes it as it is (sm_89 and
// sm_100+), fp16 on sm_90 (unless GEMV8_MMA is 2), whose mma.sync would convert both e4m3 operands
// to fp16 itself at every mma: there the kernel converts the weights (two to a cvt.f16x2.e4m3x2)
// and stages the quantized activations as fp16 once per CTA, and m16n8k16 fp16 mmas multiply
// them (e4m3 values are exact fp16 numbers, their products exact in fp32: the same function).
// cuda_build.gemv8_operands is the Python side of this choice.
#if __CUDA_ARCH__ >= 900 && __CUDA_ARCH__ < 1000 && GEMV8_MMA == 1
#define GEMV8_HALVES 1
#else
#define GEMV8_HALVES 0
#endif

// The bytes between quantized input rows in shared memory: K's bytes (a byte, or with fp16 operands
// two, an element) rounded up to 128, plus the pad that puts the two rows of a 16-byte load phase
// on distinct banks (cuda_build.gemv8_shared_bytes counts the same).
__device__ __forceinline__ int gemv8_row_stride(int K) {
    return GEMV8_HALVES ? (2 * K + 127) / 128 * 128 + GEMV8_PAD_HALVES : (K + 127) / 128 * 128 + GEMV8_PAD;
}

#if __CUDA_ARCH__ >= 890
// d += A x B, the m16n8k16 fp16 product from zero added in fp32
__device__ __forceinline__ void mma_f16(float (&d)[4], unsigned int a0, unsigned int a1, unsigned int a2,
                                        unsigned int a3, unsigned int b0, unsigned int b1) {
    float c0, c1, c2, c3;
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %10, %10, %10};"
        : "=f"(c0), "=f"(c1), "=f"(c2), "=f"(c3)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(0.0f));
    d[0] += c0, d[1] += c1, d[2] += c2, d[3] += c3;
}

// d += A x B, the product from zero added in fp32 (a: the four A registers, b: the two B registers)
__device__ __forceinline__ void mma_e4m3(float (&d)[4], unsigned int a0, unsigned int a1, unsigned int a2,
                                         unsigned int a3, unsigned int b0, unsigned int b1) {
    float c0, c1, c2, c3;
    asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %10, %10, %10};"
        : "=f"(c0), "=f"(c1), "=f"(c2), "=f"(c3)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(0.0f));
    d[0] += c0, d[1] += c1, d[2] += c2, d[3] += c3;
}
#endif

// The weight row of mma row r (0..15: r < 8 a pair's first rows, r >= 8 its second) of unit u; -1
// past the matrix.
template <int OUT>
__device__ __forceinline__ int mma_row(int u, int r, int N) {
    if constexpr (OUT == OUT_SILU_MUL || OUT == OUT_ROPE_KV) {
        const int pair = u * 8 + (r & 7), half = N / 2;
        if (pair >= half) return -1;
        if constexpr (OUT == OUT_SILU_MUL) {
            return pair + (r >> 3) * half;
        } else {
            return pair / HALF_DIM * HEAD_DIM + pair % HALF_DIM + (r >> 3) * HALF_DIM;
        }
    } else {
        const int row = u * 16 + r;
        return row < N ? row : -1;
    }
}

// This lane's GEMV_UNROLL loads of tile `tile`: w[2b] of weight row `lo`, w[2b+1] of row `hi`, block b
// (zeros past K, and for a row of -1).
__device__ __forceinline__ void load_tile8(const Fp8* __restrict__ W, int lo, int hi, int tile, int K, int lane,
                                           uint4 (&w)[GEMV_UNROLL]) {
#pragma unroll
    for (int b = 0; b < GEMV8_BLOCKS; ++b) {
        const int k = tile * GEMV8_TILE + b * GEMV8_BLOCK + (lane % 4) * 16;
        const uint4 zero = make_uint4(0, 0, 0, 0);
        w[2 * b] = lo >= 0 && k < K ? load_weight(reinterpret_cast<const scalar_t*>(W + (size_t)lo * K + k)) : zero;
        w[2 * b + 1] = hi >= 0 && k < K ? load_weight(reinterpret_cast<const scalar_t*>(W + (size_t)hi * K + k)) : zero;
    }
}

// The accumulators' sum over the `split` warps of a group (in order: the same sum whatever the
// timing), in the first warp of the group; buffers alternate as in sum_split_k.
__device__ __forceinline__ void sum_split_k8(float (&acc)[4], int split, int warp, int lane, int parity) {
    __shared__ float partial[2][GEMV_WARPS][4][WARP_SIZE];
#pragma unroll
    for (int i = 0; i < 4; ++i) partial[parity][warp][i][lane] = acc[i];
    const int leader = warp - warp % split;
    asm volatile("bar.sync %0, %1;" ::"r"(1 + leader / split), "r"(split * WARP_SIZE) : "memory");
    if (warp != leader) return;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc[i] = 0.0f;
        for (int w = leader; w < leader + split; ++w) acc[i] += partial[parity][w][i][lane];
    }
}

// What a unit's writing lanes read besides the sums, read with the unit's first weights: the row
// scales of mma rows g and g+8, and (OUT_ADD) the residuals of the lane's outputs.
struct Ends8 {
    float scale[2];
    scalar_t residual[2][2];  // [row g, g+8][input row 2t, 2t+1], as stored
};

// gemv's arguments (M <= 8 input rows); W: fp8 values, scales: one float per weight row.
template <int M, int IN, int OUT>
__device__ __forceinline__ void gemv8_mma(const Fp8* __restrict__ W, const float* __restrict__ scales, int N, int K,
                                          int rows, int split, const scalar_t* __restrict__ in, long long in_stride,
                                          const scalar_t* __restrict__ norm_weight, float eps, void* out,
                                          long long out_stride, const RopeKV& kv) {
#if __CUDA_ARCH__ >= 890
    static_assert(M <= 8, "the mma's 8 columns");
    constexpr bool PAIRED = OUT == OUT_SILU_MUL || OUT == OUT_ROPE_KV;
    extern __shared__ uint4 shared_input[];
    const int xq_stride = gemv8_row_stride(K);
    unsigned char* __restrict__ xq = reinterpret_cast<unsigned char*>(shared_input);
    scalar_t* __restrict__ xs = reinterpret_cast<scalar_t*>(xq + (size_t)M * xq_stride);
    __shared__ float act_scale[M];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE, g = lane / 4, t = lane % 4;
    const int groups = GEMV_WARPS / split;
    const int units = PAIRED ? (N / 2 + 7) / 8 : (N + 15) / 16, unit_step = gridDim.x * groups;
    const int tiles = (K + GEMV8_TILE - 1) / GEMV8_TILE;
    const int tile_begin = warp % split * tiles / split, tile_end = (warp % split + 1) * tiles / split;
    const bool leader = warp % split == 0;
    int unit = blockIdx.x * groups + warp / split;

    // OUT_ROPE_KV: the tokens' positions and sequences, read once per CTA (the prologue's barriers
    // publish them), kept in shared memory rather than in each lane's registers
    __shared__ TokenOf tokens[M];
    if constexpr (OUT == OUT_ROPE_KV) {
        if (threadIdx.x < rows) tokens[threadIdx.x] = {kv.positions[threadIdx.x], kv.token_seq[threadIdx.x]};
    }
    const auto ends_of = [&](int u) {
        Ends8 e = {};
        if (!leader || u >= units) return e;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = mma_row<OUT>(u, g + 8 * h, N);
            e.scale[h] = row >= 0 ? scales[row] : 0.0f;
            if constexpr (OUT == OUT_ADD) {
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int m = 2 * t + c;
                    e.residual[h][c] =
                        row >= 0 && m < rows ? static_cast<const scalar_t*>(out)[(size_t)m * out_stride + row] : scalar_t{};
                }
            }
        }
        return e;
    };

    // The first tile's loads go out before the input is quantized: they are in flight meanwhile.
    uint4 w[GEMV_UNROLL];
    if (unit < units) load_tile8(W, mma_row<OUT>(unit, g, N), mma_row<OUT>(unit, g + 8, N), tile_begin, K, lane, w);
    Ends8 ends = ends_of(unit), next_ends = {};
    if constexpr (IN == IN_RMS_NORM) {
        stage_input<M, IN>(xs, rows, in, in_stride, norm_weight, eps, K);
        __syncthreads();
        quantize_rows<M, GEMV8_HALVES>(xs, K, rows, K, act_scale, xq, xq_stride);
    } else {
        quantize_rows<M, GEMV8_HALVES>(in, in_stride, rows, K, act_scale, xq, xq_stride);
    }
    __syncthreads();

    const unsigned char* __restrict__ x_row = xq + (size_t)g * xq_stride;  // B's column g: input row g
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int tile = tile_begin, parity = 0; unit < units;) {
        int next_unit = unit, next_tile = tile + 1;
        if (next_tile == tile_end) next_tile = tile_begin, next_unit += unit_step;
        uint4 next[GEMV_UNROLL];
        if (next_unit < units) {
            load_tile8(W, mma_row<OUT>(next_unit, g, N), mma_row<OUT>(next_unit, g + 8, N), next_tile, K, lane, next);
        }

#pragma unroll
        for (int b = 0; b < GEMV8_BLOCKS; ++b) {
            const int k = tile * GEMV8_TILE + b * GEMV8_BLOCK + t * 16;
            const uint4 &lo = w[2 * b], &hi = w[2 * b + 1];
#if GEMV8_HALVES
            // four m16n8k16: mma c takes word c of each weight load (A registers 0 and 2: its two
            // halves of row g, 1 and 3: of row g+8) and words 2c, 2c+1 of the input's 32 bytes (16
            // fp16 at the same k)
            uint4 x0 = make_uint4(0, 0, 0, 0), x1 = x0;
            if (g < rows && k < K) {
                const uint4* x = reinterpret_cast<const uint4*>(x_row + 2 * k);
                x0 = x[0], x1 = x[1];
            }
            const unsigned int xw[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
            const unsigned int lw[4] = {lo.x, lo.y, lo.z, lo.w}, hw[4] = {hi.x, hi.y, hi.z, hi.w};
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                mma_f16(acc, e4m3x2_to_halves(lw[c]), e4m3x2_to_halves(hw[c]), e4m3x2_to_halves(lw[c] >> 16),
                        e4m3x2_to_halves(hw[c] >> 16), xw[2 * c], xw[2 * c + 1]);
            }
#else
            const uint4 x = g < rows && k < K ? *reinterpret_cast<const uint4*>(x_row + k) : make_uint4(0, 0, 0, 0);
            mma_e4m3(acc, lo.x, hi.x, lo.y, hi.y, x.x, x.y);
            mma_e4m3(acc, lo.z, hi.z, lo.w, hi.w, x.z, x.w);
#endif
        }

        if (next_tile == tile_begin) {  // this warp's slice of the unit is done
            if (split > 1) {
                sum_split_k8(acc, split, warp, lane, parity);
                parity ^= 1;
            }
            if (leader) {
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int m = 2 * t + c;
                    if (m >= rows) continue;
                    // W8A8: the sum times the input row's scale, then the weight row's (model/fp8.py)
                    float v[2];
#pragma unroll
                    for (int h = 0; h < 2; ++h) v[h] = __fmul_rn(__fmul_rn(acc[2 * h + c], act_scale[m]), ends.scale[h]);
                    if constexpr (PAIRED) {
                        const int pair = unit * 8 + g;
                        if (pair < N / 2) {
                            if constexpr (OUT == OUT_SILU_MUL) {
                                static_cast<scalar_t*>(out)[(size_t)m * out_stride + pair] = from_float(silu_mul(v[0], v[1]));
                            } else {
                                rope_write_pair(kv, tokens[m], m, pair, round_to_dtype(v[0]), round_to_dtype(v[1]));
                            }
                        }
                    } else {
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const int row = mma_row<OUT>(unit, g + 8 * h, N);
                            if (row < 0) continue;
                            const size_t at = (size_t)m * out_stride + row;
                            if constexpr (OUT == OUT_STORE) {
                                static_cast<scalar_t*>(out)[at] = from_float(v[h]);
                            } else if constexpr (OUT == OUT_ADD) {
                                static_cast<scalar_t*>(out)[at] = from_float(__fadd_rn(to_float(ends.residual[h][c]), round_to_dtype(v[h])));
                            } else {  // OUT_FLOAT
                                static_cast<float*>(out)[at] = round_to_dtype(v[h]);
                            }
                        }
                    }
                }
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[i] = 0.0f;
            if (next_unit < units) ends = ends_of(next_unit);
        }
        unit = next_unit, tile = next_tile;
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) w[u] = next[u];
    }
#endif
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
// gemv8_: fp8 weights, W8A8: on tensor cores from sm_89 (unless GEMV8_MMA is 0), else the input
// quantized the same way and gemv's conversion of the weights (the same function, summed in another
// order).
#if !defined(GEMV8_MMA)
#error "gemv.cu needs -DGEMV8_MMA (pagedcli/backends/cuda_build.py)"
#endif
#if __CUDA_ARCH__ >= 890 && GEMV8_MMA
#define GEMV8 gemv8_mma
#else
#define GEMV8 gemv
#endif
#define GEMV8_KERNEL(M, IN_NAME, IN, OUT_NAME, OUT)                                                          \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_CTAS) gemv8_##M##_##IN_NAME##_##OUT_NAME( \
        const Fp8* __restrict__ W, const float* __restrict__ scales, int N, int K, int rows, int split,         \
        const scalar_t* __restrict__ in, long long in_stride, const scalar_t* __restrict__ norm_weight, float eps, \
        void* out, long long out_stride) {                                                                    \
        GEMV8<M, IN, OUT>(W, scales, N, K, rows, split, in, in_stride, norm_weight, eps, out, out_stride, RopeKV{}); \
    }

// qkv with RoPE and the K/V write: kv_write.cu's arguments instead of an output.
#define ROPE_KV_PARAMS                                                                                      \
    int N, int K, int rows, int split, const scalar_t *__restrict__ in, long long in_stride,                 \
        const scalar_t *__restrict__ norm_weight, float eps, scalar_t *q_out, unsigned char *pool,           \
        const int *table, long long table_slot_stride, int max_blocks, const long long *positions,           \
        const long long *token_seq, const int *slots, const scalar_t *cos_table, const scalar_t *sin_table,  \
        int max_positions KV_SCALE_PARAMS
#define ROPE_KV_BODY(M, GEMV_FN, SCALES)                                                                       \
    const RopeKV kv{q_out, pool, table, table_slot_stride, max_blocks, positions, token_seq, slots, cos_table, \
                    sin_table, max_positions, KV_SCALES};                                                    \
    GEMV_FN<M, IN_RMS_NORM, OUT_ROPE_KV>(W, SCALES, N, K, rows, split, in, in_stride, norm_weight, eps, nullptr, 0, kv);
#define GEMV_ROPE_KV_KERNEL(M)                                                                                \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_CTAS) gemv_##M##_rms_norm_rope_kv(      \
        const scalar_t* __restrict__ W, ROPE_KV_PARAMS) {                                                     \
        ROPE_KV_BODY(M, gemv, nullptr)                                                                           \
    }
#define GEMV8_ROPE_KV_KERNEL(M)                                                                               \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_CTAS) gemv8_##M##_rms_norm_rope_kv(     \
        const Fp8* __restrict__ W, const float* __restrict__ scales, ROPE_KV_PARAMS) {                        \
        ROPE_KV_BODY(M, GEMV8, scales)                                                                           \
    }

// The combinations a Llama layer uses, for each batch-size bucket: cuda_build.py's GEMV_ROW_BUCKETS
// and, for fp8 weights (GEMV8_OPS; the float output: an fp8 LM head), GEMV8_ROW_BUCKETS.
#define GEMV_KERNELS(M)                                          \
    GEMV_KERNEL(M, rms_norm, IN_RMS_NORM, store, OUT_STORE)       \
    GEMV_KERNEL(M, rms_norm, IN_RMS_NORM, float, OUT_FLOAT)       \
    GEMV_KERNEL(M, rms_norm, IN_RMS_NORM, silu_mul, OUT_SILU_MUL) \
    GEMV_KERNEL(M, plain, IN_PLAIN, add, OUT_ADD)                 \
    GEMV_ROPE_KV_KERNEL(M)
#define GEMV8_KERNELS(M)                                           \
    GEMV8_KERNEL(M, rms_norm, IN_RMS_NORM, store, OUT_STORE)       \
    GEMV8_KERNEL(M, rms_norm, IN_RMS_NORM, float, OUT_FLOAT)       \
    GEMV8_KERNEL(M, rms_norm, IN_RMS_NORM, silu_mul, OUT_SILU_MUL) \
    GEMV8_KERNEL(M, plain, IN_PLAIN, add, OUT_ADD)                 \
    GEMV8_ROPE_KV_KERNEL(M)

GEMV_KERNELS(1)
GEMV_KERNELS(2)
GEMV8_KERNELS(1)
GEMV8_KERNELS(2)
GEMV8_KERNELS(4)
GEMV8_KERNELS(8)
