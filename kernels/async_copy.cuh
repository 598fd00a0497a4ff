// async_copy.cuh: copies from global to shared memory that hold no registers while they fly
// (cp.async, sm_80+; plain copies before), for the attention kernels' load pipelines.
#pragma once

// The shared-memory address of a generic pointer into shared memory (what cp.async, ldmatrix and
// mapa take).
__device__ __forceinline__ unsigned int shared_address(const void* p) {
    unsigned int a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

template <int BYTES> struct VecOf;  // the vector type of a copy's width
template <> struct VecOf<16> { typedef uint4 type; };
template <> struct VecOf<8> { typedef uint2 type; };

// One copy of BYTES (16 or 8) from global to shared memory; zeros (and no read) when !valid.
// 16 bytes bypass L1 (.cg); 8-byte copies exist only through it (.ca).
template <int BYTES>
__device__ __forceinline__ void copy_async(void* dst, const void* src, bool valid) {
    static_assert(BYTES == 16 || BYTES == 8, "cp.async copies 16 or 8 bytes here");
#if __CUDA_ARCH__ >= 800
    if constexpr (BYTES == 16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                     :: "r"(shared_address(dst)), "l"(src), "r"(valid ? 16 : 0) : "memory");
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;"
                     :: "r"(shared_address(dst)), "l"(src), "r"(valid ? 8 : 0) : "memory");
    }
#else
    using vec_t = typename VecOf<BYTES>::type;
    if (valid) *reinterpret_cast<vec_t*>(dst) = *reinterpret_cast<const vec_t*>(src);
    else *reinterpret_cast<vec_t*>(dst) = vec_t{};
#endif
}

__device__ __forceinline__ void copy_async_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void copy_async_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
#endif
}
