// read_floor.cu (tools/tune_decode.py): a kernel that only reads n 16-byte vectors, as gemv.cu reads
// weights (evict-first in L2, past L1; gemv.cu's grid of GEMV_THREADS-thread CTAs, READ_UNROLL loads
// a thread in flight) and does nothing else. Timed back to back in a CUDA graph at the sizes of
// Llama-3.2-1B's GEMMs, it is the floor a one-kernel-per-GEMM decode step sits on: launch, first
// bytes, the bytes, the last bytes; no staging, arithmetic or stores.

#if !defined(READ_UNROLL) || !defined(GEMV_THREADS)
#error "read_floor.cu needs -DREAD_UNROLL -DGEMV_THREADS"
#endif

extern "C" __global__ void __launch_bounds__(GEMV_THREADS) read_all(const uint4* __restrict__ p, long long n, unsigned int* out) {
    unsigned long long policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    const long long stride = (long long)gridDim.x * blockDim.x;
    unsigned int acc = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += READ_UNROLL * stride) {
        uint4 a[READ_UNROLL];
#pragma unroll
        for (int u = 0; u < READ_UNROLL; ++u) {
            a[u] = make_uint4(0u, 0u, 0u, 0u);
            if (i + u * stride < n) {
                asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                             : "=r"(a[u].x), "=r"(a[u].y), "=r"(a[u].z), "=r"(a[u].w)
                             : "l"(p + i + u * stride), "l"(policy));
            }
        }
#pragma unroll
        for (int u = 0; u < READ_UNROLL; ++u) acc ^= a[u].x ^ a[u].y ^ a[u].z ^ a[u].w;
    }
    if (acc == 0x9e3779b9u) out[0] = acc;  // never in practice: keeps the loads
}
