// fp8_quant.cu: activations quantized per row (per token) to float8 e4m3, the input of the fp8
// tensor-core GEMMs (`--quantization fp8` on more than W8A16_MAX_ROWS rows; model/fp8.py's
// quantize_rows computes the same bytes).
//
// quantize_rows:          y = x
// rms_norm_quantize_rows: y = weight * RMSNorm(x), rounded to the model dtype where elementwise.cu's
//                         rms_norm rounds it (the GEMM would read that row; here it never leaves the CTA)
// then for each row: scale = amax(|y|) / 448 (1 for a row of zeros), values = e4m3(y / scale),
// saturated (fp8.cuh's e4m3_from_float, torch's cast of the clamped value). (A row holding a NaN:
// fmaxf passes it over, so the scale is its other values', where the reference's is 1; the
// product's row is NaN either way.)
//
// One CTA per row, which reads its row once per pass (the sum of squares, the largest magnitude,
// the values): a few KiB that stay in L1. Each kernel comes in two widths, as elementwise.cu's:
// V = VEC (16-byte loads; the Python side checks rows are whole, aligned vectors) and V = 1.

#include "common.cuh"
#include "fp8.cuh"

#define QUANT_MAX_WARPS (1024 / WARP_SIZE)

// The CTA's sum (or largest value) of one float a thread; every thread gets it.
template <bool MAX>
__device__ __forceinline__ float block_reduce(float x, float (&warp_results)[QUANT_MAX_WARPS]) {
    x = MAX ? warp_max(x) : warp_sum(x);
    if (threadIdx.x % WARP_SIZE == 0) warp_results[threadIdx.x / WARP_SIZE] = x;
    __syncthreads();
    float total = warp_results[0];
    for (int w = 1; w < (int)(blockDim.x / WARP_SIZE); ++w)
        total = MAX ? fmaxf(total, warp_results[w]) : total + warp_results[w];
    return total;
}

// V e4m3 bytes of y / scale at p (V divides the row, so whole words when V is 4 or 8).
template <int V>
__device__ __forceinline__ void store_e4m3(unsigned char* __restrict__ p, const float (&y)[V], float scale) {
    unsigned int bytes[V];
#pragma unroll
    for (int j = 0; j < V; ++j) bytes[j] = e4m3_from_float(__fdiv_rn(y[j], scale));
    if constexpr (V % 4 == 0) {
        unsigned int words[V / 4];
#pragma unroll
        for (int w = 0; w < V / 4; ++w)
            words[w] = bytes[4 * w] | (bytes[4 * w + 1] << 8) | (bytes[4 * w + 2] << 16) | (bytes[4 * w + 3] << 24);
        if constexpr (V == 8) {
            *reinterpret_cast<uint2*>(p) = make_uint2(words[0], words[1]);
        } else {
#pragma unroll
            for (int w = 0; w < V / 4; ++w) reinterpret_cast<unsigned int*>(p)[w] = words[w];
        }
    } else {
#pragma unroll
        for (int j = 0; j < V; ++j) p[j] = (unsigned char)bytes[j];
    }
}

// The row's y at column i: x, or its RMSNorm (inv_rms given) times the norm's weight, rounded.
template <int V, bool NORM>
__device__ __forceinline__ void row_values(const scalar_t* __restrict__ x, const scalar_t* __restrict__ weight,
                                           int i, float inv_rms, float (&y)[V]) {
    load_floats<V>(x + i, y);
    if constexpr (NORM) {
        float w[V];
        load_floats<V>(weight + i, w);
#pragma unroll
        for (int j = 0; j < V; ++j) y[j] = round_to_dtype(rms_scale(y[j], w[j], inv_rms));
    }
}

// x: [rows, hidden] with row stride x_stride; values: [rows, hidden] contiguous; scales: [rows].
template <int V, bool NORM>
__device__ __forceinline__ void quantize_rows_impl(const scalar_t* __restrict__ x, long long x_stride,
                                                   const scalar_t* __restrict__ weight, float eps,
                                                   unsigned char* __restrict__ values, float* __restrict__ scales,
                                                   int hidden) {
    __shared__ float sums[QUANT_MAX_WARPS], maxima[QUANT_MAX_WARPS];
    const scalar_t* __restrict__ row = x + (size_t)blockIdx.x * x_stride;
    float inv_rms = 1.0f;
    if constexpr (NORM) {
        float sum_sq = 0.0f;
        for (int i = threadIdx.x * V; i < hidden; i += blockDim.x * V) {
            float r[V];
            load_floats<V>(row + i, r);
#pragma unroll
            for (int j = 0; j < V; ++j) sum_sq = fmaf(r[j], r[j], sum_sq);
        }
        inv_rms = rms_inverse(block_reduce<false>(sum_sq, sums), hidden, eps);
    }
    float amax = 0.0f;
    for (int i = threadIdx.x * V; i < hidden; i += blockDim.x * V) {
        float y[V];
        row_values<V, NORM>(row, weight, i, inv_rms, y);
#pragma unroll
        for (int j = 0; j < V; ++j) amax = fmaxf(amax, fabsf(y[j]));
    }
    amax = block_reduce<true>(amax, maxima);
    const float scale = amax > 0.0f ? __fdiv_rn(amax, E4M3_MAX) : 1.0f;  // model/fp8.py's scale_of
    if (threadIdx.x == 0) scales[blockIdx.x] = scale;
    unsigned char* __restrict__ out = values + (size_t)blockIdx.x * hidden;
    for (int i = threadIdx.x * V; i < hidden; i += blockDim.x * V) {
        float y[V];
        row_values<V, NORM>(row, weight, i, inv_rms, y);
        store_e4m3<V>(out + i, y, scale);
    }
}

#define QUANTIZE_KERNELS(SUFFIX, V)                                                                              \
    extern "C" __global__ void __launch_bounds__(1024) quantize_rows_##SUFFIX(                                   \
        const scalar_t* __restrict__ x, long long x_stride, unsigned char* __restrict__ values,                \
        float* __restrict__ scales, int hidden) {                                                               \
        start_after_previous_kernels();                                                                         \
        quantize_rows_impl<V, false>(x, x_stride, nullptr, 0.0f, values, scales, hidden);                       \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(1024) rms_norm_quantize_rows_##SUFFIX(                          \
        const scalar_t* __restrict__ x, long long x_stride, const scalar_t* __restrict__ weight, float eps,    \
        unsigned char* __restrict__ values, float* __restrict__ scales, int hidden) {                           \
        start_after_previous_kernels();                                                                         \
        quantize_rows_impl<V, true>(x, x_stride, weight, eps, values, scales, hidden);                          \
    }

QUANTIZE_KERNELS(vec, VEC)
QUANTIZE_KERNELS(scalar, 1)
