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
// Compressed weights (W4A16, W8A16: pagedcli/model/quant.py's QuantWeight; the gemvq4_ and gemvq8_
// kernels, built from gemv_quant.cu, which includes this file with GEMV_QUANT defined): 4-bit values
// two a byte (the even column in the low nibble) or int8 values, with a float32 scale and offset per
// group of 2^shift consecutive inputs of a row (a row's one group: a shift past K). A 16-byte load
// holds 32 (or 16) weights of one group; each weight is dequantized exactly as the torch reference
// does, q * scale + offset with each step rounded to float32 (no fma), then the same fp32 dot, so
// the kernel computes x.float() @ w.dequantize().T up to the order of the sums. The bytes read at
// batch 1 are the values and the group scales: 4 bits plus 64 bits a group, about a quarter of
// bf16's at group 128. The lane's 32 weights then meet 64 bytes of input, which a warp would read
// from shared memory with 4-way bank conflicts; the staged input is swizzled instead (stage_input)
// so that a quarter-warp's 16-byte reads land on distinct banks.
//
// Shapes: W [N, K] row-major; `rows` input rows, at most the kernel's M; K % VEC == 0 (fp8: K % 16)
// and every row 16-byte aligned (checked in Python, which falls back to cuBLAS otherwise). Dynamic
// shared memory: M * K elements.

#include "fp8.cuh"
#include "rope_kv.cuh"

#if !defined(GEMV_THREADS) || !defined(GEMV_UNROLL) || !defined(GEMV_MIN_CTAS) || !defined(GEMV_EVICT_FIRST)
#error "gemv.cu needs -DGEMV_THREADS -DGEMV_UNROLL -DGEMV_MIN_CTAS -DGEMV_EVICT_FIRST (pagedcli/backends/cuda.py)"
#endif

#if defined(GEMV_QUANT) && !defined(GEMV_QUANT_MIN_CTAS)
#error "gemv_quant.cu needs -DGEMV_QUANT_MIN_CTAS (pagedcli/backends/cuda_build.py)"
#endif

#define GEMV_WARPS (GEMV_THREADS / WARP_SIZE)

// The weights' element: the model dtype (scalar_t), or fp8 e4m3 (Fp8: one byte, with a float scale
// per weight row; pagedcli/model/fp8.py), 16 of them to a 16-byte load.
struct Fp8 {
    unsigned char bits;
};
// Compressed weights (model/quant.py): two 4-bit values a byte, or one int8 value.
struct Int4 {
    unsigned char pair;
};
struct Int8 {
    signed char value;
};
template <typename WT>
__host__ __device__ constexpr int weight_bits() { return 8 * (int)sizeof(WT); }
template <>
__host__ __device__ constexpr int weight_bits<Int4>() { return 4; }
template <typename WT>
__host__ __device__ constexpr bool quantized() { return false; }  // group scales and offsets (Groups)
template <>
__host__ __device__ constexpr bool quantized<Int4>() { return true; }
template <>
__host__ __device__ constexpr bool quantized<Int8>() { return true; }
template <typename WT>
__host__ __device__ constexpr int weight_vec() { return 8 * (int)sizeof(uint4) / weight_bits<WT>(); }  // elements of a 16-byte load
// The staged input's swizzle (stage_input): 16-byte vectors of input a lane's load meets, less one
// (0: no swizzle, the dtype's and fp8 weights as they were measured).
template <typename WT>
__host__ __device__ constexpr int input_swizzle() { return quantized<WT>() ? weight_vec<WT>() / VEC - 1 : 0; }

// A compressed weight's groups: float32 scale and offset [N, per_row] (offset nullptr: none), a group
// 2^shift inputs long; an fp8 weight's row scales in `scale`.
struct Groups {
    const float* scale;
    const float* offset;
    int per_row;
    int shift;
};
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

// Where 16-byte vector v of a staged row lives: with SWZ (input_swizzle) > 0, v's low bits XOR the
// bits above its aligned 8 vectors (a lane's load of compressed weights meets SWZ + 1 vectors, the
// lanes of a quarter-warp SWZ + 1 vectors apart: each of them then reads a bank group of its own).
// The XOR stays within v's aligned SWZ + 1 vectors: K is a whole number of them (cuda_gemv.py).
template <int SWZ>
__device__ __forceinline__ int staged_slot(int v) { return SWZ ? v ^ ((v >> 3) & SWZ) : v; }

// in rows -> the M x K input of the product, in shared memory (each thread re-reads only the vectors
// it wrote, except for the RMSNorm's sums, which cross a barrier), at staged_slot<SWZ>'s places.
template <int M, int IN, int SWZ = 0>
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
                *reinterpret_cast<uint4*>(xs + (size_t)m * K + staged_slot<SWZ>(v) * VEC) = raw;
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
                scalar_t* const slot = xs + (size_t)m * K + staged_slot<SWZ>(v) * VEC;
                load_floats<VEC>(slot, r);
                load_floats<VEC>(norm_weight + v * VEC, w);
#pragma unroll
                for (int j = 0; j < VEC; ++j) r[j] = rms_scale(r[j], w[j], inv_rms);
                store_floats<VEC>(slot, r);
            }
        }
    } else {
#pragma unroll
        for (int m = 0; m < M; ++m) {
            for (int v = threadIdx.x; v < vecs && m < rows; v += GEMV_THREADS) {
                *reinterpret_cast<uint4*>(xs + (size_t)m * K + staged_slot<SWZ>(v) * VEC) =
                    *reinterpret_cast<const uint4*>(in + m * in_stride + v * VEC);
            }
        }
    }
}

// One 16-byte vector of W: with GEMV_EVICT_FIRST, past L1 and marked for L2 to evict first (an L2
// access policy covering the access; createpolicy is one instruction, hoisted by the compiler).
__device__ __forceinline__ uint4 load_weight(const void* p) {
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

// A compressed weight's group scale or offset: read once a step like the weights, with their policy.
__device__ __forceinline__ float load_group(const float* p) {
#if GEMV_EVICT_FIRST && __CUDA_ARCH__ >= 800
    unsigned long long policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    float r;
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.f32 %0, [%1], %2;" : "=f"(r) : "l"(p), "l"(policy));
    return r;
#else
    return *p;
#endif
}

// What a lane holds of one tile: its GEMV_UNROLL 16-byte loads of W, and for compressed weights the
// scale and offset of each load's group (a load is within one group: cuda_gemv.py checks).
template <typename WT>
struct Tile {
    uint4 w[GEMV_UNROLL];
};
struct GroupedTile {
    uint4 w[GEMV_UNROLL];
    float scale[GEMV_UNROLL], offset[GEMV_UNROLL];
};
template <>
struct Tile<Int4> : GroupedTile {};
template <>
struct Tile<Int8> : GroupedTile {};

// The GEMV_UNROLL vectors of row `row`, tile `tile` that this lane reads (zeros past K), with their
// groups' scales and offsets.
template <typename WT>
__device__ __forceinline__ void load_tile(const WT* __restrict__ W, const Groups& groups, int row, int tile, int K,
                                          int lane, Tile<WT>& t) {
    const unsigned char* __restrict__ src =
        reinterpret_cast<const unsigned char*>(W) + (size_t)row * K * weight_bits<WT>() / 8;
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u) {
        const int k = tile * tile_elems<WT>() + (u * WARP_SIZE + lane) * weight_vec<WT>();
        t.w[u] = k < K ? load_weight(src + (size_t)k * weight_bits<WT>() / 8) : make_uint4(0, 0, 0, 0);
        if constexpr (quantized<WT>()) {
            const size_t at = (size_t)row * groups.per_row + (k >> groups.shift);
            t.scale[u] = k < K ? load_group(groups.scale + at) : 0.0f;
            t.offset[u] = k < K && groups.offset != nullptr ? load_group(groups.offset + at) : 0.0f;
        }
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
    if constexpr (sizeof(WT) == 1 && !quantized<WT>()) {
        return scales[row] * (1.0f / E4M3_UNPACK_FACTOR);
    } else {
        return 1.0f;
    }
}

// --- compressed weights ---
// 8 weights of a 4-bit word, dequantized as model/quant.py does: q * scale + offset, each step
// rounded to float32 (no fma), q exact. Nibble n is read in place at bit 4n (n < 5): the float of
// bits 2^23's exponent | q << 4n is 2^23 + q * 16^n, so subtracting 2^23 leaves q * 16^n exactly,
// and that times scale * 16^-n (`s[n]`: a power of two off, exact) is the float32 product q * scale.
// Nibbles 5..7 likewise after one shift. One logic op and one add a weight, not a shift, a mask and a
// conversion (which runs at a quarter of the rate).
template <bool OFFSET>
__device__ __forceinline__ void dequantize_int4(unsigned int word, const float (&s)[5], float offset, float (&w)[8]) {
    const unsigned int high = word >> 12;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
        const int at = n < 5 ? n : n - 3;
        const unsigned int bits = (n < 5 ? word : high) & (0xFu << (4 * at));
        const float q = __uint_as_float(0x4B000000u | bits) - 8388608.0f;
        const float product = __fmul_rn(q, s[at]);
        w[n] = OFFSET ? __fadd_rn(product, offset) : product;
    }
}

// 4 int8 weights the same way: byte b XOR 0x80 (q + 128, unsigned) in place at bit 8b (b < 2, the
// upper two after a shift) under 2^23's exponent, less 2^23 + 128 * 256^b: q * 256^b exactly; times
// scale * 256^-b (s0, s1).
template <bool OFFSET>
__device__ __forceinline__ void dequantize_int8(unsigned int word, float s0, float s1, float offset, float* w) {
    const unsigned int high = word >> 16;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
        const int at = b & 1;
        const unsigned int bits = ((b < 2 ? word : high) & (0xFFu << (8 * at))) ^ (0x4B000000u | (0x80u << (8 * at)));
        const float q = __uint_as_float(bits) - (at ? 8421376.0f : 8388736.0f);  // 2^23 + 128 * 256^at
        const float product = __fmul_rn(q, at ? s1 : s0);
        w[b] = OFFSET ? __fadd_rn(product, offset) : product;
    }
}

// acc[m] += 8 dequantized weights times the staged input at k..k+7 of row m.
template <int M, int SWZ>
__device__ __forceinline__ void dot8(const float (&w)[8], const scalar_t* __restrict__ xs, int K, int k, int rows,
                                     float (&acc)[M]) {
    const int v = k / VEC;
#pragma unroll
    for (int m = 0; m < M; ++m) {
        if (M > 1 && m >= rows) break;
#pragma unroll
        for (int h = 0; h < 8 / VEC; ++h) {
            float x[VEC];
            load_floats<VEC>(xs + (size_t)m * K + staged_slot<SWZ>(v + h) * VEC, x);
#pragma unroll
            for (int j = 0; j < VEC; ++j) acc[m] = fmaf(w[h * VEC + j], x[j], acc[m]);
        }
    }
}

// acc[m] += one 16-byte load of compressed weights (inputs k.., one group) times the staged rows.
template <int M, typename WT, bool OFFSET>
__device__ __forceinline__ void dot_grouped(const uint4& raw, float scale, float offset,
                                            const scalar_t* __restrict__ xs, int K, int k, int rows,
                                            float (&acc)[M]) {
    constexpr int SWZ = input_swizzle<WT>();
    const unsigned int words[4] = {raw.x, raw.y, raw.z, raw.w};
    if constexpr (weight_bits<WT>() == 4) {
        const float s[5] = {scale, scale * 0x1p-4f, scale * 0x1p-8f, scale * 0x1p-12f, scale * 0x1p-16f};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float w[8];
            dequantize_int4<OFFSET>(words[i], s, offset, w);
            dot8<M, SWZ>(w, xs, K, k + 8 * i, rows, acc);
        }
    } else {
        const float s1 = scale * 0x1p-8f;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float w[8];
            dequantize_int8<OFFSET>(words[2 * i], scale, s1, offset, w);
            dequantize_int8<OFFSET>(words[2 * i + 1], scale, s1, offset, w + 4);
            dot8<M, SWZ>(w, xs, K, k + 8 * i, rows, acc);
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
// WT: the weights' element (scalar_t; Fp8 with wgroups.scale: one float per weight row; Int4 or
// Int8 with their groups).
template <int M, int IN, int OUT, typename WT>
__device__ __forceinline__ void gemv(const WT* __restrict__ W, const Groups wgroups, int N, int K,
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
    Tile<WT> w;
    if (unit < units) load_tile(W, wgroups, weight_row(unit, 0), tile_begin, K, lane, w);
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

    stage_input<M, IN, input_swizzle<WT>()>(xs, rows, in, in_stride, norm_weight, eps, K);
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
        Tile<WT> next;
        if (next_unit < units) load_tile(W, wgroups, weight_row(next_unit, next_part), next_tile, K, lane, next);
        if (OUT == OUT_ADD && next_unit != unit) next_residual = residual_of(next_unit);

#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            const int k = tile * TILE + (u * WARP_SIZE + lane) * W_VEC;
            if constexpr (quantized<WT>()) {
                if (k < K) {
                    if (wgroups.offset != nullptr) {
                        dot_grouped<M, WT, true>(w.w[u], w.scale[u], w.offset[u], xs, K, k, rows, acc);
                    } else {
                        dot_grouped<M, WT, false>(w.w[u], w.scale[u], 0.0f, xs, K, k, rows, acc);
                    }
                }
            } else if (k < K) {
                float wf[W_VEC];
                unpack_weights(w.w[u], wf);
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
            const float scale = row_scale<WT>(wgroups.scale, weight_row(unit, part));
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
        w = next;
    }
}

// One kernel per (rows, input step, output step): gemv_<M>_<in>_<out>, e.g. gemv_1_rms_norm_store;
// pagedcli/backends/cuda_build.py's gemv_kernel_names() lists the same.
// gemv8_...: the same with fp8 weights and their row scales (the rope_kv kernels likewise).
// gemvq4_... and gemvq8_...: compressed weights with their groups (gemv_quant.cu's build only:
// cuda_build.quant_kernel_names()).
#define GEMV_KERNEL(M, IN_NAME, IN, OUT_NAME, OUT)                                                           \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_CTAS) gemv_##M##_##IN_NAME##_##OUT_NAME( \
        const scalar_t* __restrict__ W, int N, int K, int rows, int split, const scalar_t* __restrict__ in,    \
        long long in_stride, const scalar_t* __restrict__ norm_weight, float eps, void* out, long long out_stride) { \
        gemv<M, IN, OUT>(W, Groups{}, N, K, rows, split, in, in_stride, norm_weight, eps, out, out_stride, RopeKV{}); \
    }
#define GEMV8_KERNEL(M, IN_NAME, IN, OUT_NAME, OUT)                                                          \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_CTAS) gemv8_##M##_##IN_NAME##_##OUT_NAME( \
        const Fp8* __restrict__ W, const float* __restrict__ scales, int N, int K, int rows, int split,         \
        const scalar_t* __restrict__ in, long long in_stride, const scalar_t* __restrict__ norm_weight, float eps, \
        void* out, long long out_stride) {                                                                    \
        gemv<M, IN, OUT>(W, Groups{scales, nullptr, 0, 0}, N, K, rows, split, in, in_stride, norm_weight, eps, out, \
                         out_stride, RopeKV{});                                                               \
    }
// A compressed weight's arguments: its values, then its groups (scale, offset or null, groups a
// row, log2 of a group's inputs).
#define GROUPS_PARAMS(WT)                                                                                    \
    const WT *__restrict__ W, const float *__restrict__ scales, const float *__restrict__ offsets, int per_row, \
        int shift
#define GEMVQ_KERNEL(BITS, M, IN_NAME, IN, OUT_NAME, OUT)                                                    \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_QUANT_MIN_CTAS)                          \
        gemvq##BITS##_##M##_##IN_NAME##_##OUT_NAME(GROUPS_PARAMS(Int##BITS), int N, int K, int rows, int split, \
                                                   const scalar_t* __restrict__ in, long long in_stride,        \
                                                   const scalar_t* __restrict__ norm_weight, float eps, void* out, \
                                                   long long out_stride) {                                    \
        gemv<M, IN, OUT>(W, Groups{scales, offsets, per_row, shift}, N, K, rows, split, in, in_stride, norm_weight, \
                         eps, out, out_stride, RopeKV{});                                                     \
    }

// qkv with RoPE and the K/V write: kv_write.cu's arguments instead of an output.
#define ROPE_KV_PARAMS                                                                                      \
    int N, int K, int rows, int split, const scalar_t *__restrict__ in, long long in_stride,                 \
        const scalar_t *__restrict__ norm_weight, float eps, scalar_t *q_out, unsigned char *pool,           \
        const int *table, long long table_slot_stride, int max_blocks, const long long *positions,           \
        const long long *token_seq, const int *slots, const scalar_t *cos_table, const scalar_t *sin_table,  \
        int max_positions KV_SCALE_PARAMS
#define ROPE_KV_BODY(M, GROUPS)                                                                                \
    const RopeKV kv{q_out, pool, table, table_slot_stride, max_blocks, positions, token_seq, slots, cos_table, \
                    sin_table, max_positions, KV_SCALES};                                                    \
    gemv<M, IN_RMS_NORM, OUT_ROPE_KV>(W, GROUPS, N, K, rows, split, in, in_stride, norm_weight, eps, nullptr, 0, kv);
#define GEMV_ROPE_KV_KERNEL(M)                                                                                \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_CTAS) gemv_##M##_rms_norm_rope_kv(      \
        const scalar_t* __restrict__ W, ROPE_KV_PARAMS) {                                                     \
        ROPE_KV_BODY(M, Groups{})                                                                                \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_CTAS) gemv8_##M##_rms_norm_rope_kv(     \
        const Fp8* __restrict__ W, const float* __restrict__ scales, ROPE_KV_PARAMS) {                        \
        ROPE_KV_BODY(M, (Groups{scales, nullptr, 0, 0}))                                                         \
    }
#define GEMVQ_ROPE_KV_KERNEL(BITS, M)                                                                         \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_QUANT_MIN_CTAS)                          \
        gemvq##BITS##_##M##_rms_norm_rope_kv(                                                                \
        GROUPS_PARAMS(Int##BITS), ROPE_KV_PARAMS) {                                                           \
        ROPE_KV_BODY(M, (Groups{scales, offsets, per_row, shift}))                                               \
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
#define GEMVQ_KERNELS(BITS, M)                                           \
    GEMVQ_KERNEL(BITS, M, rms_norm, IN_RMS_NORM, store, OUT_STORE)        \
    GEMVQ_KERNEL(BITS, M, rms_norm, IN_RMS_NORM, float, OUT_FLOAT)        \
    GEMVQ_KERNEL(BITS, M, rms_norm, IN_RMS_NORM, silu_mul, OUT_SILU_MUL)  \
    GEMVQ_KERNEL(BITS, M, plain, IN_PLAIN, add, OUT_ADD)                  \
    GEMVQ_ROPE_KV_KERNEL(BITS, M)

// gemv.cu's own build: the dtype's and fp8 weights; gemv_quant.cu's: compressed weights (a model
// without them compiles none of them).
#if defined(GEMV_QUANT)
GEMVQ_KERNELS(4, 1)
GEMVQ_KERNELS(4, 2)
GEMVQ_KERNELS(8, 1)
GEMVQ_KERNELS(8, 2)
#else
GEMV_KERNELS(1)
GEMV_KERNELS(2)
#endif
