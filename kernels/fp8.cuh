// fp8.cuh: float8 e4m3 (pagedcli/model/fp8.py: 1 sign, 4 exponent bits with bias 7, 3 mantissa bits)
// read as floats.
#pragma once

#include "common.cuh"

#define E4M3_MAX 448.0f  // e4m3's largest finite value (torch.finfo(torch.float8_e4m3fn).max)

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

// Four e4m3 bytes (the lowest first) as two fp16 pairs (bytes 0 and 1 in `lo`, 2 and 3 in `hi`,
// the lower byte in the lower half), each times E4M3_UNPACK_FACTOR, exactly: the tiles of the
// prefill kernel's fp16 mma.
__device__ __forceinline__ void e4m3x4_halves(unsigned int word, unsigned int& lo, unsigned int& hi) {
#if __CUDA_ARCH__ >= 890
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(lo) : "h"((unsigned short)(word & 0xffffu)));
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(hi) : "h"((unsigned short)(word >> 16)));
#else
    asm("prmt.b32 %0, %1, 0, 0x4140;" : "=r"(lo) : "r"(word));
    asm("prmt.b32 %0, %1, 0, 0x4342;" : "=r"(hi) : "r"(word));
    lo = e4m3_pair_as_halves(lo), hi = e4m3_pair_as_halves(hi);
#endif
}

// --- float -> e4m3: the fp8 KV cache's writes ---------------------------------------------------
// torch's cast, which the reference applies to x.clamp(-448, 448) (model/fp8.py's to_fp8): round to
// nearest even, saturate at +-448, NaN stays NaN. __host__ too, so that a CPU test can compile the
// software version into a small program and compare it with torch over every input it cares for.

__host__ __device__ __forceinline__ unsigned int fp8_bits_of(float f) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    unsigned int u;
    __builtin_memcpy(&u, &f, sizeof(u));
    return u;
#endif
}

__host__ __device__ __forceinline__ float fp8_float_of(unsigned int u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    __builtin_memcpy(&f, &u, sizeof(f));
    return f;
#endif
}

// The e4m3 byte of f, bit for bit as torch's fp8e4m3fn_from_fp32_value (c10) computes it: what runs
// before sm_89's conversion instruction.
__host__ __device__ __forceinline__ unsigned int e4m3_from_float_software(float f) {
    unsigned int bits = fp8_bits_of(f);
    const unsigned int sign = (bits >> 24) & 0x80u;
    bits &= 0x7fffffffu;
    unsigned int r;
    if (bits >= (1087u << 20)) {  // 480 (the first value past e4m3's range) and up, inf, NaN
        r = bits > 0x7f800000u ? 0x7fu : 0x7eu;  // NaN stays NaN, the rest saturates to 448
    } else if (bits < (121u << 23)) {  // under 2^-6, e4m3's smallest normal: a subnormal (or zero)
        // + 2^14 leaves |f| rounded to nearest even on a multiple of 2^-9 (e4m3's smallest
        // subnormal), which is then the float's low mantissa bits
#if defined(__CUDA_ARCH__)
        const float sum = __fadd_rn(fp8_float_of(bits), 16384.0f);
#else
        const float sum = fp8_float_of(bits) + 16384.0f;
#endif
        r = fp8_bits_of(sum) - (141u << 23);
    } else {
        // rebias the exponent (127 -> 7), round the 20 dropped mantissa bits to nearest even
        bits += ((unsigned int)(7 - 127) << 23) + 0x7ffffu + ((bits >> 20) & 1u);
        r = (bits >> 20) & 0xffu;
        if (r == 0x7fu) r = 0x7eu;  // rounded up past 448 (0x7f is NaN): saturate
    }
    return r | sign;
}

// The same on the GPU: sm_89+ converts in one instruction (which saturates with .satfinite).
__device__ __forceinline__ unsigned int e4m3_from_float(float f) {
#if __CUDA_ARCH__ >= 890
    unsigned short pair;  // f in the low byte (the instruction's second operand)
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(f));
    return pair & 0xffu;
#else
    return e4m3_from_float_software(f);
#endif
}
