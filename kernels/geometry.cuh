// geometry.cuh: the paged pool's geometry, as the kernels that address it receive it from
// CacheGeometry.defines() (pagedcli/config.py) and the model's head count, checked once here.
//
// A block is [2][BLOCK_SIZE][NUM_KV_HEADS][HEAD_DIM]: K rows, then V rows at V_OFFSET bytes.
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

static_assert(KV_DIM == NUM_KV_HEADS * HEAD_DIM, "KV_DIM must be NUM_KV_HEADS * HEAD_DIM");
static_assert(V_OFFSET == BLOCK_SIZE * KV_DIM * (int)sizeof(scalar_t), "V_OFFSET does not match the dtype");
static_assert(BLOCK_BYTES == 2 * V_OFFSET, "BLOCK_BYTES must be K + V");
static_assert(NUM_HEADS % NUM_KV_HEADS == 0, "query heads must be a multiple of kv heads");
