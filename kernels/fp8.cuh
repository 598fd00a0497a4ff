// fp8.cuh: float8 e4m3 (pagedcli/model/fp8.py: 1 sign, 4 exponent bits with bias 7, 3 mantissa bits)
// read as floats.
#pragma once

#include "common.cuh"

// One half's bits from an e4m3 byte in bits 0-7 and another in bits 16-23 of `pair`, both moved to
// fp16's layout: sign to bit 15, exponent and mantissa to bits 7-13. fp16 has 5 exponent bits with
// bias 15, so the half is the e4m3 value times 2^-8, exactly, subnormals included (they become
// fp16 subnormals): the conversion before sm_89's fp8 instructions.
__device__ __forceinline__ unsigned int e4m3_pair_as_halves(unsigned int pair) {
    return ((pair & 0x00800080u) << 8) | ((pair & 0x007f007fu) << 7);
}

__device__ __forceinline__ float half_bits_to_float(unsigned int h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)h));
    return f;
}

// What e4m3x4_scaled's floats are times the e4m3 values: sm_89+ converts two e4m3 to two fp16 in one
// instruction, exactly; before it, the bit moves give the values times 2^-8.
#if __CUDA_ARCH__ >= 890
#define E4M3_UNPACK_FACTOR 1.0f
#else
#define E4M3_UNPACK_FACTOR 0.00390625f  // 2^-8
#endif

// Four e4m3 bytes (the lowest first) as floats, each times E4M3_UNPACK_FACTOR (the caller's scale
// divides it out).
__device__ __forceinline__ void e4m3x4_scaled(unsigned int word, float& a, float& b, float& c, float& d) {
    unsigned int lo, hi;  // fp16 pairs of bytes 0 and 1, and of 2 and 3
#if __CUDA_ARCH__ >= 890
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(lo) : "h"((unsigned short)(word & 0xffffu)));
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(hi) : "h"((unsigned short)(word >> 16)));
#else
    asm("prmt.b32 %0, %1, 0, 0x4140;" : "=r"(lo) : "r"(word));  // bytes 0 and 1 at bits 0 and 16
    asm("prmt.b32 %0, %1, 0, 0x4342;" : "=r"(hi) : "r"(word));
    lo = e4m3_pair_as_halves(lo), hi = e4m3_pair_as_halves(hi);
#endif
    a = half_bits_to_float(lo & 0xffffu), b = half_bits_to_float(lo >> 16);
    c = half_bits_to_float(hi & 0xffffu), d = half_bits_to_float(hi >> 16);
}
