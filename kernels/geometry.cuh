// geometry.cuh: the paged pool's geometry, as the kernels that address it receive it from
// CacheGeometry.defines() (pagedcli/config.py) and the model's head count, checked once here.
//
// A block is [2][BLOCK_SIZE][NUM_KV_HEADS][HEAD_DIM]: K rows, then V rows at V_OFFSET bytes.
//
// The pool's element (`kv_t`) is the model's (scalar_t), or with -DKV_FP8 (backends/cuda_build.py,
// `kv_cache_dtype` fp8) one e4m3 byte: stored = e4m3(x / scale), read = stored * scale, a float32
// scale per layer and kv head (pagedcli/model/fp8.py). The kernels that touch the pool then take
// this layer's scales, k_scale[NUM_KV_HEADS] and v_scale[NUM_KV_HEADS], as their last parameters
// (KV_SCALE_PARAMS); a pool in the model dtype adds none, so its kernels are what they were.
#pragma once

#include "common.cuh"

#if !defined(BLOCK_SIZE) || !defined(NUM_KV_HEADS) || !defined(HEAD_DIM) || !defined(KV_DIM)
#error "needs -DBLOCK_SIZE -DNUM_KV_HEADS -DHEAD_DIM -DKV_DIM (CacheGeometry.defines())"
#endif
#if !defined(BLOCK_BYTES) || !defined(V_OFFSET)
#error "needs -DBLOCK_BYTES -DV_OFFSET (CacheGeometry.defines())"
#endif
#if !defined(NUM_HEADS)
#error "needs -DNUM_HEADS (the model's query heads)"
#endif

#if defined(KV_FP8)
typedef unsigned char kv_t;  // an e4m3 byte (fp8.cuh)
// This layer's scales (float32, one per kv head), for K and for V.
struct KvScales {
    const float* k;
    const float* v;
};
#define KV_SCALE_PARAMS , const float *__restrict__ k_scale, const float *__restrict__ v_scale
#define KV_SCALE_ARGS , k_scale, v_scale
#define KV_SCALES KvScales{k_scale, v_scale}
#else
typedef scalar_t kv_t;
struct KvScales {};  // nothing: the pool holds the values themselves
#define KV_SCALE_PARAMS
#define KV_SCALE_ARGS
#define KV_SCALES KvScales{}
#endif

static_assert(KV_DIM == NUM_KV_HEADS * HEAD_DIM, "KV_DIM must be NUM_KV_HEADS * HEAD_DIM");
static_assert(V_OFFSET == BLOCK_SIZE * KV_DIM * (int)sizeof(kv_t), "V_OFFSET does not match the pool's dtype");
static_assert(BLOCK_BYTES == 2 * V_OFFSET, "BLOCK_BYTES must be K + V");
static_assert(NUM_HEADS % NUM_KV_HEADS == 0, "query heads must be a multiple of kv heads");

// A sliding window (-DSLIDING_WINDOW=W, which the attention kernels take; 0: none): a query at
// position p sees keys p - W + 1 .. p, itself and the W - 1 before it (transformers' rule). After
// each step engine/cache.py's `slide` gives back a sequence's blocks wholly before its next
// query's window (their table entries become -1): an attention kernel reads no key before
// window_first(its earliest query's position), whose block is always held.
#if defined(SLIDING_WINDOW)
static_assert(SLIDING_WINDOW >= 0, "SLIDING_WINDOW is a window's length in tokens, or 0 for none");
__device__ __forceinline__ int window_first(int pos) {
#if SLIDING_WINDOW > 0
    return max(pos - SLIDING_WINDOW + 1, 0);
#else
    return 0;
#endif
}
#endif

// Where token `pos` of a sequence sits in the pool, in bytes from the start of a kv head's K row of
// block 0: row pos % BLOCK_SIZE of physical block seq_table[pos / BLOCK_SIZE] (the sequence's row
// of this layer's block table; a -1 there would be a bug, and block 0 keeps the read in bounds).
// Its V row is V_OFFSET bytes further.
__device__ __forceinline__ size_t token_offset(const int* __restrict__ seq_table, int pos) {
    const int block = max(seq_table[pos / BLOCK_SIZE], 0);
    return (size_t)block * BLOCK_BYTES + (size_t)(pos % BLOCK_SIZE) * ((size_t)KV_DIM * sizeof(kv_t));
}
