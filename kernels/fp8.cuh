// fp8.cuh: float8 e4m3 (pagedcli/model/fp8.py: 1 sign, 4 exponent bits with bias 7, 3 mantissa bits)
// read as floats.
#pragma once

#include "common.cuh"

// One half's bits from an e4m3 byte in bits 0-7 and another in bits 16-23 of `pair`, both moved to
// fp16's layout: sign to bit 15, exponent and mantissa to bits 7-13. fp16 has 5 exponent bits with
// bias 15, so the half is the e4m3 value times 2^-8, exactly, subnormals included (they become
// fp16 subnormals); no instruction of sm_89's fp8 conversions needed.
__device__ __forceinline__ unsigned int e4m3_pair_as_halves(unsigned int pair) {
    return ((pair & 0x00800080u) << 8) | ((pair & 0x007f007fu) << 7);
}

__device__ __forceinline__ float half_bits_to_float(unsigned int h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)h));
    return f;
}

// Four e4m3 bytes (the lowest first) as floats, each times 2^-8 (the caller's scale takes 2^8 back).
__device__ __forceinline__ void e4m3x4_scaled(unsigned int word, float& a, float& b, float& c, float& d) {
    unsigned int lo, hi;  // bytes 0 and 1, and 2 and 3, at bits 0 and 16
    asm("prmt.b32 %0, %1, 0, 0x4140;" : "=r"(lo) : "r"(word));
    asm("prmt.b32 %0, %1, 0, 0x4342;" : "=r"(hi) : "r"(word));
    lo = e4m3_pair_as_halves(lo), hi = e4m3_pair_as_halves(hi);
    a = half_bits_to_float(lo & 0xffffu), b = half_bits_to_float(lo >> 16);
    c = half_bits_to_float(hi & 0xffffu), d = half_bits_to_float(hi >> 16);
}
