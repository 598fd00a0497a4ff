// argmax.cu: greedy decoding's argmax over each row of the float32 logits.
//
// torch's argmax reduces a 128k-wide row in one CTA, longer than a transformer layer at batch 1
// (docs/performance-log.md, "Where a batch-1 step goes"). Here each row is cut into gridDim.x chunks, one CTA each: the CTA reduces
// its chunk to a key, and folds it into the row's key with one 64-bit atomicMax. The key orders by
// value, then by the smaller index (torch returns the first maximum): (ordered float bits << 32) |
// (0xffffffff - index). The last CTA of a row to finish writes the token and zeroes the row's key
// and counter for the next launch.
//
// A row holding a NaN or an inf (a float16 overflow, a broken weight) gets the token NOT_FINITE
// (pagedcli/backends: -1): the engine then fails that request alone. The check rides on the same
// pass over the logits; a CTA that saw one sets the flag bit of the row's counter before it counts
// itself done, so the last CTA's count sees every CTA's flag.
//
// argmax_rows_widen takes the LM head's product in the model dtype (cuBLAS's output past gemv.cu's
// rows) and writes the float32 logits as it reads them: the widening is exact, so its tokens are
// argmax_rows' over those logits, and the step needs no separate conversion kernel.

#include "common.cuh"

#if !defined(ARGMAX_THREADS) || !defined(NOT_FINITE)
#error "argmax.cu needs -DARGMAX_THREADS -DNOT_FINITE (pagedcli/backends/cuda_build.py)"
#endif

#define NOT_FINITE_FLAG 0x80000000u  // in counters[row]: some CTA of the row saw a NaN or an inf

// Float bits as an unsigned integer that orders like the float (negative numbers reversed).
__device__ __forceinline__ unsigned long long argmax_key(float value, int index) {
    const unsigned int bits = __float_as_uint(value);
    const unsigned int ordered = (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
    return ((unsigned long long)ordered << 32) | (0xffffffffu - (unsigned int)index);
}

__device__ __forceinline__ unsigned long long warp_max_key(unsigned long long key) {
#pragma unroll
    for (int off = WARP_SIZE / 2; off > 0; off >>= 1) {
        const unsigned long long other = __shfl_xor_sync(FULL_MASK, key, off);
        key = other > key ? other : key;
    }
    return key;
}

// One CTA's part of a row, reduced: every thread passes its best key and whether its values were
// all finite; thread 0 folds the CTA's key into the row's, and the row's last CTA writes the token.
__device__ __forceinline__ void finish_chunk(unsigned long long best, bool finite, int row, long long* __restrict__ tokens,
                                             unsigned long long* __restrict__ keys, unsigned int* __restrict__ counters) {
    __shared__ unsigned long long warp_keys[ARGMAX_THREADS / WARP_SIZE];
    best = warp_max_key(best);
    if (threadIdx.x % WARP_SIZE == 0) warp_keys[threadIdx.x / WARP_SIZE] = best;
    const bool chunk_finite = __syncthreads_and(finite);
    if (threadIdx.x != 0) return;
    for (int w = 1; w < ARGMAX_THREADS / WARP_SIZE; ++w) best = warp_keys[w] > best ? warp_keys[w] : best;
    atomicMax(keys + row, best);
    if (!chunk_finite) atomicOr(counters + row, NOT_FINITE_FLAG);
    __threadfence();  // our key is in before we count ourselves done
    const unsigned int before = atomicAdd(counters + row, 1u);
    if ((before & ~NOT_FINITE_FLAG) == gridDim.x - 1) {  // the last CTA of this row
        const unsigned long long final_key = atomicExch(keys + row, 0ull);
        // `before` holds every CTA's flag, this one's too: its atomicOr came first, on the same word
        tokens[row] = (before & NOT_FINITE_FLAG) ? (long long)NOT_FINITE
                                                 : (long long)(0xffffffffu - (unsigned int)(final_key & 0xffffffffu));
        counters[row] = 0;
    }
}

__device__ __forceinline__ bool is_finite(float value) {
    return (__float_as_uint(value) & 0x7f800000u) != 0x7f800000u;  // exponent all ones: inf or NaN
}

// grid (chunks, rows). logits: [rows, vocab], row_stride floats apart; tokens: [rows] int64.
// keys, counters: [rows] each, zero before the launch and zero after it.
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS) argmax_rows(
    const float* __restrict__ logits, long long row_stride, int vocab, long long* __restrict__ tokens,
    unsigned long long* __restrict__ keys, unsigned int* __restrict__ counters) {
    start_after_previous_kernels();
    const int row = blockIdx.y;
    const int chunk = (vocab + gridDim.x - 1) / gridDim.x;
    const int begin = blockIdx.x * chunk, end = min(vocab, begin + chunk);
    const float* __restrict__ x = logits + row * row_stride;

    unsigned long long best = 0;
    bool finite = true;
    for (int i = begin + threadIdx.x; i < end; i += ARGMAX_THREADS) {
        const float value = x[i];
        finite &= is_finite(value);
        const unsigned long long key = argmax_key(value, i);
        best = key > best ? key : best;
    }
    finish_chunk(best, finite, row, tokens, keys, counters);
}

// grid (chunks, rows). product: [rows, vocab] in the model dtype, product_stride elements apart;
// logits: [rows, vocab] float32 out, logits_stride apart. vectors != 0: both strides, vocab and
// both base addresses are whole 16-byte vectors of the product (VEC elements), so every chunk
// (a multiple of VEC) is read and written in vectors.
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS) argmax_rows_widen(
    const scalar_t* __restrict__ product, long long product_stride, float* __restrict__ logits,
    long long logits_stride, int vocab, int vectors, long long* __restrict__ tokens,
    unsigned long long* __restrict__ keys, unsigned int* __restrict__ counters) {
    start_after_previous_kernels();
    const int row = blockIdx.y;
    const int chunk = ((vocab + gridDim.x - 1) / gridDim.x + VEC - 1) / VEC * VEC;
    const int begin = blockIdx.x * chunk, end = min(vocab, begin + chunk);
    const scalar_t* __restrict__ x = product + row * product_stride;
    float* __restrict__ out = logits + row * logits_stride;

    unsigned long long best = 0;
    bool finite = true;
    if (vectors) {
        for (int i = begin + threadIdx.x * VEC; i < end; i += ARGMAX_THREADS * VEC) {
            float values[VEC];
            unpack_vec(*reinterpret_cast<const uint4*>(x + i), values);
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                finite &= is_finite(values[j]);
                const unsigned long long key = argmax_key(values[j], i + j);
                best = key > best ? key : best;
            }
#pragma unroll
            for (int j = 0; j < VEC; j += 4)
                *reinterpret_cast<float4*>(out + i + j) = make_float4(values[j], values[j + 1], values[j + 2], values[j + 3]);
        }
    } else {
        for (int i = begin + threadIdx.x; i < end; i += ARGMAX_THREADS) {
            const float value = to_float(x[i]);
            out[i] = value;
            finite &= is_finite(value);
            const unsigned long long key = argmax_key(value, i);
            best = key > best ? key : best;
        }
    }
    finish_chunk(best, finite, row, tokens, keys, counters);
}
