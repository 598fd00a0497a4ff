// elementwise.cu: the elementwise steps of a Llama layer, for batches too large for gemv.cu
// (which fuses them into its GEMVs at small batches).
//
// rms_norm:     out = weight * RMSNorm(x).
// add_rms_norm: residual += product, then out = weight * RMSNorm(residual): the residual add after
//               the o or down projection and the norm before the next GEMM, in one pass (the sum
//               is rounded to the dtype before the norm reads it, as the reference's add stores it).
// silu_mul:     out = silu(gate) * up, gate and up being the two halves of the last dimension.
//
// Each kernel rounds where the torch reference (pagedcli/backends/torch.py) rounds: the formulas are
// common.cuh's rms_inverse, rms_scale and silu_times, which gemv.cu uses too.
//
// Each kernel comes in two widths: V = VEC (16-byte loads; rows must be a whole number of vectors
// and 16-byte aligned, which the Python side checks) and V = 1 (any shape).

#include "common.cuh"

#define RMS_MAX_WARPS (1024 / WARP_SIZE)

// One CTA per row. x, out: [rows, hidden] contiguous; weight: [hidden]. With ADD, x is the residual
// and `product` is added to it first (the sums are written back to x; a thread reads back only
// the elements it wrote, so the second pass needs no barrier for them). The sum of squares runs
// in the same order either way, so add_rms_norm's out is rms_norm's of the stored sums, bit for bit.
template <int V, bool ADD>
__device__ __forceinline__ void rms_norm_impl(scalar_t* __restrict__ x, const scalar_t* __restrict__ product,
                                              const scalar_t* __restrict__ weight, scalar_t* __restrict__ out,
                                              int hidden, float eps) {
    __shared__ float warp_sums[RMS_MAX_WARPS];
    const size_t base = (size_t)blockIdx.x * hidden;

    float sum_sq = 0.0f;
    for (int i = threadIdx.x * V; i < hidden; i += blockDim.x * V) {
        float r[V];
        load_floats<V>(x + base + i, r);
        if constexpr (ADD) {
            float p[V];
            load_floats<V>(product + base + i, p);
#pragma unroll
            for (int j = 0; j < V; ++j) r[j] = round_to_dtype(__fadd_rn(r[j], p[j]));
            store_floats<V>(x + base + i, r);
        }
#pragma unroll
        for (int j = 0; j < V; ++j) sum_sq = fmaf(r[j], r[j], sum_sq);
    }
    sum_sq = warp_sum(sum_sq);
    if (threadIdx.x % WARP_SIZE == 0) warp_sums[threadIdx.x / WARP_SIZE] = sum_sq;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < (int)(blockDim.x / WARP_SIZE); ++w) total += warp_sums[w];
    const float inv_rms = rms_inverse(total, hidden, eps);

    for (int i = threadIdx.x * V; i < hidden; i += blockDim.x * V) {
        float r[V], w[V];
        load_floats<V>(x + base + i, r);
        load_floats<V>(weight + i, w);
#pragma unroll
        for (int j = 0; j < V; ++j) r[j] = rms_scale(r[j], w[j], inv_rms);
        store_floats<V>(out + base + i, r);
    }
}

extern "C" __global__ void __launch_bounds__(1024) rms_norm_vec(
    const scalar_t* __restrict__ x, const scalar_t* __restrict__ weight, scalar_t* __restrict__ out, int hidden,
    float eps) {
    start_after_previous_kernels();
    rms_norm_impl<VEC, false>(const_cast<scalar_t*>(x), nullptr, weight, out, hidden, eps);  // (not written)
}

extern "C" __global__ void __launch_bounds__(1024) rms_norm_scalar(
    const scalar_t* __restrict__ x, const scalar_t* __restrict__ weight, scalar_t* __restrict__ out, int hidden,
    float eps) {
    start_after_previous_kernels();
    rms_norm_impl<1, false>(const_cast<scalar_t*>(x), nullptr, weight, out, hidden, eps);  // (not written)
}

// residual, product, out: [rows, hidden] contiguous; residual is updated in place.
extern "C" __global__ void __launch_bounds__(1024) add_rms_norm_vec(
    scalar_t* __restrict__ residual, const scalar_t* __restrict__ product, const scalar_t* __restrict__ weight,
    scalar_t* __restrict__ out, int hidden, float eps) {
    start_after_previous_kernels();
    rms_norm_impl<VEC, true>(residual, product, weight, out, hidden, eps);
}

extern "C" __global__ void __launch_bounds__(1024) add_rms_norm_scalar(
    scalar_t* __restrict__ residual, const scalar_t* __restrict__ product, const scalar_t* __restrict__ weight,
    scalar_t* __restrict__ out, int hidden, float eps) {
    start_after_previous_kernels();
    rms_norm_impl<1, true>(residual, product, weight, out, hidden, eps);
}

// gate_up: [rows, 2 * inter] contiguous; out: [rows, inter]. Grid-stride over groups of V outputs.
template <int V>
__device__ __forceinline__ void silu_mul_impl(const scalar_t* __restrict__ gate_up, scalar_t* __restrict__ out,
                                              int inter, long long total) {
    const long long stride = (long long)gridDim.x * blockDim.x * V;
    for (long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * V; i < total; i += stride) {
        const long long row = i / inter;
        const long long col = i % inter;
        const scalar_t* __restrict__ g_src = gate_up + row * 2 * inter + col;
        float g[V], u[V];
        load_floats<V>(g_src, g);
        load_floats<V>(g_src + inter, u);
#pragma unroll
        for (int j = 0; j < V; ++j) g[j] = silu_times(g[j], u[j]);
        store_floats<V>(out + i, g);
    }
}

extern "C" __global__ void silu_mul_vec(const scalar_t* __restrict__ gate_up, scalar_t* __restrict__ out, int inter,
                                        long long total) {
    start_after_previous_kernels();
    silu_mul_impl<VEC>(gate_up, out, inter, total);
}

extern "C" __global__ void silu_mul_scalar(const scalar_t* __restrict__ gate_up, scalar_t* __restrict__ out,
                                           int inter, long long total) {
    start_after_previous_kernels();
    silu_mul_impl<1>(gate_up, out, inter, total);
}
