// paged_attention.cu: decode attention (one new query token per sequence) over the paged KV pool,
// split along the context ("flash-decoding"), in one kernel.
//
// grid (NUM_HEADS / HEADS_PER_CTA, num_seqs, num_splits), ATTN_THREADS threads. The split is the
// slowest grid dimension: the GPU starts CTAs in grid order, so every (sequence, head group)'s
// first splits start first, and the idle splits of short contexts (see Splits) come last.
//
// A CTA serves one sequence and HEADS_PER_CTA query heads that share one kv head (GQA): each K/V
// row it loads is used by all of those heads, so K and V are read once per kv head, not once per
// query head.
//
// Splits: num_splits depends only on the batch size and the cache's max_model_len (so one CUDA
// graph per batch size serves every context length). Each sequence's actual context is cut into
// num_splits equal spans (whole blocks, at least ATTN_MIN_SPAN tokens), so short contexts are
// spread over many CTAs too; CTAs past the context exit at once. With clusters, a context of up to
// ATTN_CLUSTER * PARTITION_SIZE tokens is cut into ATTN_CLUSTER spans instead (at least
// ATTN_CLUSTER_MIN_SPAN tokens), all in the first cluster; the clusters past the context exit.
// A span longer than PARTITION_SIZE is walked in chunks of PARTITION_SIZE tokens, merged with an
// online softmax.
// For each chunk:
//   1. K pass: a token's K row for one kv head is HEAD_DIM contiguous elements, read as 16-byte
//      vectors (8-byte ones for a row that is not whole 16-byte vectors) by a group of ROW_LANES
//      lanes (HEAD_DIM = 64 in bf16: 8 lanes, 128 bytes; a warp reads 4 rows at once, a 128-thread
//      CTA 16 rows). Each lane dots its 16 bytes with the matching slice of every query head (in
//      registers, pre-scaled by log2(e)/sqrt(HEAD_DIM) so that softmax can use exp2), the group
//      sums with shuffles, the scores go to shared memory, and each warp keeps each head's max.
//      Loads are asynchronous copies (cp.async) into a small ring in shared memory that each
//      thread owns (it only reads back its own copies, so no barrier is needed): ATTN_STAGES steps
//      of UNROLL rows per lane are in flight while one is used, without holding registers.
//   2. After one barrier, every thread merges the warps' maxima with the earlier chunks' running
//      max (no pass over the scores, no barrier of its own).
//   3. V pass: the same lanes read V rows (the ring runs on from K to V, so the first V rows are
//      requested during the K pass), turn each row's scores into probabilities 2^(s - max) as they
//      use them, and accumulate p * v and the p's in fp32 registers; the row groups' sums then
//      meet in shared memory.
// Merge: at small batches on sm_90+ (paged_attention_decode_cluster) every ATTN_CLUSTER
// consecutive splits form a thread-block cluster and first merge in shared memory, across the
// cluster (a hardware barrier, no trip to global memory): at a batch-1 context of a few hundred
// tokens, that is the only merge, and each CTA reads only a block or two. What is left, the
// splits' or the clusters' sums ("parts"): a sequence whose context fits in one part is normalised
// and written at once. Otherwise every part writes its unnormalised output, max and sum to
// scratch, and the last CTA of the (sequence, head group) to finish (a counter, reset by that CTA
// for the next launch) merges them and writes the output. A sequence with context length 0 (a
// padding row) gets zeros.
//
// Every K/V access goes through the block table: token i of a sequence is row i % BLOCK_SIZE of
// physical block table[slot][layer][i / BLOCK_SIZE].
//
// A sliding window (-DSLIDING_WINDOW=W over 0, geometry.cuh): the new token (position context - 1)
// sees keys from first = window_first(context - 1) = context - W on. What is cut into spans is then
// not [0, context) but [base, context), base the start of first's block (the blocks before it may
// have been given back: engine/cache.py's slide), at most W + BLOCK_SIZE - 1 tokens, so a step's
// work and its splits are bounded by the window, not the context. The first chunk's tokens before
// `first` (fewer than a block) are neither loaded (zeros) nor scored.
//
// An fp8 pool (-DKV_FP8, geometry.cuh): a load holds ATTN_VEC_BYTES e4m3 values, which become
// floats as they are used (fp8.cuh), times E4M3_UNPACK_FACTOR; the layer's K scale of the CTA's kv
// head (and 1 / that factor) is folded into q's pre-scale, its V scale into the output's
// normalisation, so the loops are the same as in the model dtype, with a lane's q slice as wide
// as its K elements (KV_VEC of them, two 16-byte loads of bf16 for 16 e4m3 bytes).

#include "async_copy.cuh"
#include "fp8.cuh"
#include "geometry.cuh"

#if !defined(HEADS_PER_CTA) || !defined(PARTITION_SIZE) || !defined(ATTN_THREADS) || !defined(ATTN_UNROLL) || \
    !defined(ATTN_STAGES) || !defined(ATTN_MIN_CTAS) || !defined(ATTN_MIN_SPAN) || !defined(ATTN_CLUSTER) ||      \
    !defined(ATTN_CLUSTER_MIN_SPAN) || !defined(ATTN_VEC_BYTES) || !defined(ATTN_READ_BATCH_EARLY) ||            \
    !defined(SLIDING_WINDOW)
#error "paged_attention.cu needs -DHEADS_PER_CTA -DPARTITION_SIZE -DATTN_THREADS -DATTN_UNROLL -DATTN_STAGES -DATTN_MIN_CTAS -DATTN_MIN_SPAN -DATTN_CLUSTER -DATTN_CLUSTER_MIN_SPAN -DATTN_VEC_BYTES -DATTN_READ_BATCH_EARLY -DSLIDING_WINDOW (backends/cuda_build.py)"
#endif

// The width of one K/V (and q) load: 16 bytes, or 8 where a head's row is not a whole number of
// 16-byte vectors (head_dim 100 in bf16: 200 bytes). backends/cuda_build.py picks it.
#if ATTN_VEC_BYTES == 16
typedef uint4 kv_vec_t;
#elif ATTN_VEC_BYTES == 8
typedef uint2 kv_vec_t;
#else
#error "ATTN_VEC_BYTES must be 16 or 8"
#endif
constexpr int KV_VEC = ATTN_VEC_BYTES / (int)sizeof(kv_t);  // elements in one load
constexpr int KV_WORDS = ATTN_VEC_BYTES / 4;

// The elements of one load, as floats (common.cuh's unpack_words, for either width; fp8: times
// E4M3_UNPACK_FACTOR).
__device__ __forceinline__ void unpack_kv(const kv_vec_t& raw, float (&out)[KV_VEC]) {
#if ATTN_VEC_BYTES == 16
    const unsigned int w[KV_WORDS] = {raw.x, raw.y, raw.z, raw.w};
#else
    const unsigned int w[KV_WORDS] = {raw.x, raw.y};
#endif
#if defined(KV_FP8)
#pragma unroll
    for (int i = 0; i < KV_WORDS; ++i) e4m3x4_scaled(w[i], out[4 * i], out[4 * i + 1], out[4 * i + 2], out[4 * i + 3]);
#else
    unpack_words<KV_WORDS>(w, out);
#endif
}

constexpr int GQA = NUM_HEADS / NUM_KV_HEADS;  // query heads per kv head
static_assert(GQA % HEADS_PER_CTA == 0, "HEADS_PER_CTA must divide the GQA group");
constexpr int HEAD_SLOTS = next_pow2(HEADS_PER_CTA);  // heads padded to a power of two for the shuffles

// How a K/V row (one token, one kv head) maps onto lanes.
constexpr int ROW_BYTES = HEAD_DIM * (int)sizeof(kv_t);
static_assert(ROW_BYTES % ATTN_VEC_BYTES == 0, "a head's row must be a whole number of loads");
constexpr int ROW_VECS = ROW_BYTES / ATTN_VEC_BYTES;  // loads in a row
static_assert(ROW_VECS <= WARP_SIZE, "a head's row must fit in one warp's loads");
constexpr int ROW_LANES = next_pow2(ROW_VECS);  // lanes that share a row (the lanes past ROW_VECS idle)
constexpr int ROWS_PER_WARP = WARP_SIZE / ROW_LANES;
constexpr int NUM_WARPS = ATTN_THREADS / WARP_SIZE;
static_assert(ATTN_THREADS % WARP_SIZE == 0, "ATTN_THREADS must be whole warps");
constexpr int ROWS_PER_STEP = NUM_WARPS * ROWS_PER_WARP;  // tokens the CTA covers per load step
constexpr int UNROLL = ATTN_UNROLL;                       // rows a lane has in one load step
constexpr int STAGES = ATTN_STAGES;                       // load steps in flight (ring slots)
static_assert(STAGES >= 2, "the ring needs at least two stages");
constexpr int TOKENS_PER_ITER = ROWS_PER_STEP * UNROLL;
constexpr size_t TOKEN_STRIDE = (size_t)KV_DIM * sizeof(kv_t);  // bytes from one row of a block to the next

static_assert(PARTITION_SIZE % BLOCK_SIZE == 0, "a chunk must be whole blocks");
constexpr int BLOCKS_PER_CHUNK = PARTITION_SIZE / BLOCK_SIZE;

// Shared memory: the chunk's scores (one row of PARTITION_SIZE per head, padded so that the lanes
// writing different heads fall in different banks) and the load ring [STAGES][UNROLL][threads]
// (16 bytes each: consecutive threads, consecutive addresses); after the V pass, the per-warp sums
// reuse the space.
constexpr int SCORE_STRIDE = PARTITION_SIZE + ROWS_PER_WARP;
constexpr int SCORE_FLOATS = (HEADS_PER_CTA * SCORE_STRIDE + 3) / 4 * 4;  // the ring after it starts 16-byte aligned
constexpr int RING_FLOATS = STAGES * UNROLL * ATTN_THREADS * ATTN_VEC_BYTES / 4;
constexpr int ACC_FLOATS = NUM_WARPS * HEADS_PER_CTA * HEAD_DIM;
constexpr int SMEM_FLOATS = SCORE_FLOATS + RING_FLOATS > ACC_FLOATS ? SCORE_FLOATS + RING_FLOATS : ACC_FLOATS;
// All the static shared memory of a CTA: the buffers above, the softmax state, and merge_cluster's.
// backends/cuda_build.py mirrors this sum and takes the torch path for a shape over the limit.
constexpr int CLUSTER_MERGE_BYTES = (HEADS_PER_CTA * HEAD_DIM + (4 + ATTN_CLUSTER) * HEADS_PER_CTA) * 4;
static_assert(SMEM_FLOATS * 4 + BLOCKS_PER_CHUNK * 4 + (2 * NUM_WARPS + 4) * HEADS_PER_CTA * 4 + 4 +
                      CLUSTER_MERGE_BYTES <= 48 * 1024,
              "shared memory over 48 KiB: use a smaller PARTITION_SIZE, HEADS_PER_CTA, ATTN_STAGES or ATTN_UNROLL");

// Output elements (HEADS_PER_CTA x HEAD_DIM) each thread keeps across the chunks of its span.
constexpr int OWNED = (HEADS_PER_CTA * HEAD_DIM + ATTN_THREADS - 1) / ATTN_THREADS;

// A load the compiler may not hoist out of the chunk loop (asm volatile): reloading q per chunk
// (an L1 hit) keeps it out of the registers during the V pass.
__device__ __forceinline__ kv_vec_t load_vec_keep_in_loop(const scalar_t* p) {
    kv_vec_t r;
#if ATTN_VEC_BYTES == 16
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
#else
    asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
#endif
    return r;
}

#if defined(KV_FP8)
// A lane's KV_VEC elements of q (the model dtype: Q_LOADS 16-byte loads), as floats, loaded as
// load_vec_keep_in_loop does.
constexpr int Q_LOADS = KV_VEC * (int)sizeof(scalar_t) / 16;
static_assert(KV_VEC * (int)sizeof(scalar_t) % 16 == 0, "a lane's q slice must be whole 16-byte loads");
__device__ __forceinline__ void load_q_keep_in_loop(const scalar_t* p, float (&out)[KV_VEC]) {
#pragma unroll
    for (int i = 0; i < Q_LOADS; ++i) {
        uint4 r;
        asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                     : "l"(p + i * VEC));
        float part[VEC];
        unpack_vec(r, part);
#pragma unroll
        for (int j = 0; j < VEC; ++j) out[i * VEC + j] = part[j];
    }
}
#endif

// An int written before the step's copy of its batch to the device (a length or slot, copied in by
// it; a block-table entry, scattered before it: common.cuh), read before wait_for_previous_kernels:
// from L2, past this SM's L1, which may hold lines of an earlier step's kernels. The copy is done
// by then: a kernel that follows a copy in the stream starts after it, and every kernel of ours
// after that one.
__device__ __forceinline__ int host_written(const int* p) {
    int r;
    asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(r) : "l"(p));
    return r;
}

// The physical blocks of a chunk's n tokens from `first` on, into shared memory (before or after
// the wait: the table is host-written).
__device__ __forceinline__ void load_chunk_blocks(int* chunk_blocks, const int* seq_table, int first, int n, int tid) {
    for (int i = tid; i < (n + BLOCK_SIZE - 1) / BLOCK_SIZE; i += ATTN_THREADS) {
        chunk_blocks[i] = max(host_written(seq_table + first / BLOCK_SIZE + i), 0);  // -1 would be a bug; stay in bounds
    }
}

// Whether token t of a chunk of n tokens is one the query sees: t < n, and with a sliding window
// not among the chunk's first `skip` (before the window's first key: skip <= 0 past the first chunk).
__device__ __forceinline__ bool seen(int t, int skip, int n) {
#if SLIDING_WINDOW > 0
    return t >= skip && t < n;
#else
    return t < n;  // (skip is 0)
#endif
}

// Load step g of a chunk into ring slot g % STAGES: steps 0 .. iters-1 are K, iters .. 2 iters-1 are
// V, later ones are empty. Each step is one commit group, empty or not, so that the groups a thread
// waits for are counted the same way everywhere. This lane's UNROLL rows of the step; rows past
// the chunk's n tokens (or before a window's first key: seen) become zeros.
__device__ __forceinline__ void issue_step(kv_vec_t* ring, int g, int iters, const unsigned char* k_base,
                                           const unsigned char* v_base, const int* blocks, int skip, int n,
                                           int row_in_step, bool lane_active, int tid) {
    if (g < 2 * iters) {
        const unsigned char* base = g < iters ? k_base : v_base;
        const int t0 = (g < iters ? g : g - iters) * TOKENS_PER_ITER;
        kv_vec_t* slot = ring + (size_t)(g % STAGES) * UNROLL * ATTN_THREADS + tid;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int t = t0 + u * ROWS_PER_STEP + row_in_step;
            const bool valid = seen(t, skip, n) && lane_active;
            const unsigned char* src =
                valid ? base + (size_t)blocks[t / BLOCK_SIZE] * BLOCK_BYTES + (size_t)(t % BLOCK_SIZE) * TOKEN_STRIDE
                      : base;
            copy_async<ATTN_VEC_BYTES>(slot + u * ATTN_THREADS, src, valid);
        }
    }
    copy_async_commit();
}

// This thread's UNROLL vectors of step g, once landed.
__device__ __forceinline__ void read_step(kv_vec_t (&raw)[UNROLL], const kv_vec_t* ring, int g, int tid) {
    copy_async_wait<STAGES - 2>();  // step g's group is complete (STAGES - 2 newer ones may not be)
    const kv_vec_t* slot = ring + (size_t)(g % STAGES) * UNROLL * ATTN_THREADS + tid;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) raw[u] = slot[u * ATTN_THREADS];
}

// Sum the per-head partial dot products over the ROW_LANES lanes of a row with few shuffles: each
// step halves the heads a lane keeps (it sends the half its partner keeps), until one head is left;
// the remaining steps are plain all-reduces. Afterwards the lane holds heads
// reduced_head_base(lane) + i, i < HEADS_HELD.
constexpr int HEADS_HELD = HEAD_SLOTS > ROW_LANES ? HEAD_SLOTS / ROW_LANES : 1;

__device__ __forceinline__ void reduce_row(float (&dot)[HEAD_SLOTS], int lane) {
#pragma unroll
    for (int step = 0; (ROW_LANES >> (step + 1)) > 0; ++step) {
        const int off = ROW_LANES >> (step + 1);
        const int count = HEAD_SLOTS >> step;  // heads still held (a compile-time constant here)
        if (count > 1) {
            const bool upper = (lane & off) != 0;
#pragma unroll
            for (int i = 0; i < count / 2; ++i) {
                const float send = upper ? dot[i] : dot[i + count / 2];
                const float keep = upper ? dot[i + count / 2] : dot[i];
                dot[i] = keep + __shfl_xor_sync(FULL_MASK, send, off);
            }
        } else {
            dot[0] += __shfl_xor_sync(FULL_MASK, dot[0], off);
        }
    }
}

__device__ __forceinline__ int reduced_head_base(int lane) {
    int base = 0;
#pragma unroll
    for (int step = 0; (ROW_LANES >> (step + 1)) > 0; ++step) {
        const int off = ROW_LANES >> (step + 1);
        const int count = HEAD_SLOTS >> step;
        if (count > 1 && (lane & off)) base += count / 2;
    }
    return base;
}

// The lane that writes the reduced values: one per distinct set of heads (the all-reduce steps
// leave copies in the other lanes).
__device__ __forceinline__ bool reduced_writer(int lane) {
    bool writer = true;
#pragma unroll
    for (int step = 0; (ROW_LANES >> (step + 1)) > 0; ++step) {
        const int off = ROW_LANES >> (step + 1);
        if ((HEAD_SLOTS >> step) <= 1 && (lane & off)) writer = false;
    }
    return writer;
}

// --- thread-block clusters (sm_90+): the splits of one (sequence, head group) merge in shared memory

__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// The float at `p` in the shared memory of CTA `rank` of this cluster.
__device__ __forceinline__ float load_from_cluster_cta(const float* p, unsigned int rank) {
    float v = 0.0f;
#if __CUDA_ARCH__ >= 900
    unsigned int remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(shared_address(p)), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
#endif
    return v;
}

// The unnormalised sums, maxima and denominators of the CLUSTER CTAs of a cluster, merged into
// those of its first CTA (rank 0, which always has context tokens; the others may have none: max
// -inf, sums 0). Every thread of every CTA of the cluster calls this. The second barrier keeps the
// other CTAs (and their shared memory) alive until the first has read them.
template <int CLUSTER>
__device__ __forceinline__ void merge_cluster(float (&owned)[OWNED], float (&run_max)[HEADS_PER_CTA],
                                              float (&run_sum)[HEADS_PER_CTA], unsigned int rank, int tid) {
    __shared__ float shared_owned[HEADS_PER_CTA * HEAD_DIM];
    __shared__ float shared_max[HEADS_PER_CTA], shared_sum[HEADS_PER_CTA];
#pragma unroll
    for (int k = 0; k < OWNED; ++k) {
        const int i = tid + k * ATTN_THREADS;
        if (i < HEADS_PER_CTA * HEAD_DIM) shared_owned[i] = owned[k];
    }
#pragma unroll
    for (int h = 0; h < HEADS_PER_CTA; ++h) {
        if (tid == h) shared_max[h] = run_max[h], shared_sum[h] = run_sum[h];
    }
    cluster_sync();  // every CTA's sums are in its shared memory
    if (rank == 0) {
        // thread h merges head h's maxima and denominators; scale: 2^(a CTA's max - the merged max)
        __shared__ float merged_max[HEADS_PER_CTA], merged_sum[HEADS_PER_CTA], scale[CLUSTER][HEADS_PER_CTA];
        if (tid < HEADS_PER_CTA) {
            float m = neg_infinity(), sum = 0.0f;
#pragma unroll
            for (int r = 0; r < CLUSTER; ++r) m = fmaxf(m, load_from_cluster_cta(&shared_max[tid], r));
#pragma unroll
            for (int r = 0; r < CLUSTER; ++r) {
                const float c = exp2f(load_from_cluster_cta(&shared_max[tid], r) - m);  // 0 for a CTA without tokens
                scale[r][tid] = c;
                sum = fmaf(load_from_cluster_cta(&shared_sum[tid], r), c, sum);
            }
            merged_max[tid] = m, merged_sum[tid] = sum;
        }
        __syncthreads();
#pragma unroll
        for (int h = 0; h < HEADS_PER_CTA; ++h) run_max[h] = merged_max[h], run_sum[h] = merged_sum[h];
#pragma unroll
        for (int k = 0; k < OWNED; ++k) {
            const int i = tid + k * ATTN_THREADS;
            if (i < HEADS_PER_CTA * HEAD_DIM) {
                float a = 0.0f;
#pragma unroll
                for (int r = 0; r < CLUSTER; ++r) {
                    a = fmaf(load_from_cluster_cta(&shared_owned[i], r), scale[r][i / HEAD_DIM], a);
                }
                owned[k] = a;
            }
        }
    }
    cluster_sync();  // the first CTA has read the others' shared memory: they may leave
}

// out: [num_seqs, NUM_HEADS, HEAD_DIM] in the model dtype.
// q: [num_seqs, NUM_HEADS, HEAD_DIM] (the rotated queries, contiguous).
// table: this layer's block table, table[slot * table_slot_stride + logical_block].
// max_context: the table's width in tokens; longer context lengths are clamped to it.
// partial_out: [num_seqs, NUM_HEADS, num_splits, HEAD_DIM] float; partial_max, partial_sum:
// [num_seqs, NUM_HEADS, num_splits] float (log2 domain); merge_counters: [num_seqs, head groups],
// zero before the launch and zero after it.
// CLUSTER: 1, or the CTAs of a thread-block cluster along the splits (paged_attention_decode_cluster).
#define ATTENTION_PARAMS                                                                                   \
    scalar_t *__restrict__ out, const scalar_t *__restrict__ q, const unsigned char *__restrict__ pool,    \
        const int *__restrict__ table, long long table_slot_stride, const int *__restrict__ slots,         \
        const int *__restrict__ context_lens, int max_context, float *__restrict__ partial_out,            \
        float *__restrict__ partial_max, float *__restrict__ partial_sum,                                   \
        unsigned int *__restrict__ merge_counters, float scale_log2 KV_SCALE_PARAMS
#define ATTENTION_ARGS                                                                                   \
    out, q, pool, table, table_slot_stride, slots, context_lens, max_context, partial_out, partial_max, \
        partial_sum, merge_counters, scale_log2 KV_SCALE_ARGS

// --- the phases of attention<> -----------------------------------------------------------------

// Which part of a sequence's keys [base, context) split `split` covers: num_splits equal runs of
// whole blocks (or, with clusters, CLUSTER runs in the first cluster when one cluster covers them).
// base: 0, or with a sliding window the start of the block of the window's first key (a multiple
// of BLOCK_SIZE, so that every span and chunk starts on a block).
struct Span {
    int start, end;  // tokens [start, end) of the context
    int part;        // what is merged in the end: this split's sums or (CLUSTER > 1) its cluster's
    int used_parts;  // parts with tokens; a CTA whose part >= used_parts has nothing to do
};

template <int CLUSTER>
__device__ __forceinline__ Span plan_span(int context, int base, int split, int num_splits) {
    const int length = context - base;
    // Keys that one cluster covers with a chunk per CTA stay in the first cluster: its only merge
    // is the cheap one in shared memory.
    const bool one_cluster = CLUSTER > 1 && length <= CLUSTER * PARTITION_SIZE;
    const int span = one_cluster ? max((length + CLUSTER - 1) / CLUSTER, ATTN_CLUSTER_MIN_SPAN)
                                 : max((length + num_splits - 1) / num_splits, ATTN_MIN_SPAN);
    const int span_tokens = (span + BLOCK_SIZE - 1) / BLOCK_SIZE * BLOCK_SIZE;
    const int used_splits = (length + span_tokens - 1) / span_tokens;
    // A cluster with no tokens leaves whole (no barrier is pending); in one with tokens, a CTA
    // without any takes part in the cluster's merge with empty sums.
    Span s;
    s.part = split / CLUSTER;
    s.used_parts = (used_splits + CLUSTER - 1) / CLUSTER;
    s.start = base + split * span_tokens;
    s.end = min(context, s.start + span_tokens);
    return s;
}

// What one lane is in the row layout: which load of a row it makes, which token of a load step,
// and which heads' reduced scores it writes.
struct Lanes {
    int warp, lane, lane_in_row, row_in_step, score_head;
    bool active, score_writer;  // active: false for the lanes past ROW_VECS of a row
};

__device__ __forceinline__ Lanes lanes_of(int tid) {
    Lanes l;
    l.warp = tid / WARP_SIZE;
    l.lane = tid % WARP_SIZE;
    l.lane_in_row = l.lane % ROW_LANES;
    l.row_in_step = tid / ROW_LANES;
    l.active = l.lane_in_row < ROW_VECS;
    l.score_head = reduced_head_base(l.lane_in_row);
    l.score_writer = reduced_writer(l.lane_in_row);
    return l;
}

// Phase 1, the K pass: scores[h][t] = q_h . k_t (log2 units) for the chunk's n tokens. The ring's
// first STAGES - 1 steps were issued by the caller; this issues the K pass's own and, past it, the
// V pass's first ones.
__device__ __forceinline__ void score_chunk(float* scores, float (*warp_max_buf)[HEADS_PER_CTA], kv_vec_t* ring,
                                            const scalar_t* q_base, float scale_log2, const unsigned char* k_base,
                                            const unsigned char* v_base, const int* blocks, int skip, int n,
                                            int iters, const Lanes& l, int tid) {
    float qf[HEADS_PER_CTA][KV_VEC];
#pragma unroll
    for (int h = 0; h < HEADS_PER_CTA; ++h) {
        if (l.active) {
#if defined(KV_FP8)
            load_q_keep_in_loop(q_base + h * HEAD_DIM, qf[h]);
#else
            unpack_kv(load_vec_keep_in_loop(q_base + h * HEAD_DIM), qf[h]);
#endif
#pragma unroll
            for (int j = 0; j < KV_VEC; ++j) qf[h][j] *= scale_log2;
        } else {
#pragma unroll
            for (int j = 0; j < KV_VEC; ++j) qf[h][j] = 0.0f;
        }
    }
    float held_max[HEADS_HELD];  // the largest score of each head this lane holds (reduce_row)
#pragma unroll
    for (int i = 0; i < HEADS_HELD; ++i) held_max[i] = neg_infinity();
    for (int it = 0; it < iters; ++it) {
        const int t0 = it * TOKENS_PER_ITER;
        kv_vec_t cur[UNROLL];
        read_step(cur, ring, it, tid);
        issue_step(ring, it + STAGES - 1, iters, k_base, v_base, blocks, skip, n, l.row_in_step, l.active, tid);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            float kf[KV_VEC];
            unpack_kv(cur[u], kf);
            float dot[HEAD_SLOTS];
#pragma unroll
            for (int h = 0; h < HEAD_SLOTS; ++h) {
                dot[h] = 0.0f;
                if (h < HEADS_PER_CTA) {
#pragma unroll
                    for (int j = 0; j < KV_VEC; ++j) dot[h] = fmaf(qf[h][j], kf[j], dot[h]);
                }
            }
            reduce_row(dot, l.lane_in_row);
            const int t = t0 + u * ROWS_PER_STEP + l.row_in_step;
            if (seen(t, skip, n)) {  // (the tokens before a window's first are not scored: phase 3 skips them too)
#pragma unroll
                for (int i = 0; i < HEADS_HELD; ++i) {
                    held_max[i] = fmaxf(held_max[i], dot[i]);
                    if (l.score_writer && l.score_head + i < HEADS_PER_CTA) {
                        scores[(l.score_head + i) * SCORE_STRIDE + t] = dot[i];
                    }
                }
            }
        }
    }
    // the warp's max of each head: over its rows (the lanes ROW_LANES apart hold the same heads),
    // written by the first row's lanes
#pragma unroll
    for (int off = ROW_LANES; off < WARP_SIZE; off <<= 1) {
#pragma unroll
        for (int i = 0; i < HEADS_HELD; ++i) {
            held_max[i] = fmaxf(held_max[i], __shfl_xor_sync(FULL_MASK, held_max[i], off));
        }
    }
    if (l.lane < ROW_LANES && l.score_writer) {
#pragma unroll
        for (int i = 0; i < HEADS_HELD; ++i) {
            if (l.score_head + i < HEADS_PER_CTA) warp_max_buf[l.warp][l.score_head + i] = held_max[i];
        }
    }
}

// Phase 2, the chunk's max, merged with the earlier chunks': every thread reads the warps' maxima
// (after the barrier that ends the K pass) and moves the running max; `correction` (2^(old max -
// new max), 0 for the CTA's first chunk) is what the earlier sums are rescaled by; `head_correction`
// holds it in shared memory for the output elements, whose head is known only at run time.
__device__ __forceinline__ void chunk_max(const float (*warp_max_buf)[HEADS_PER_CTA], float (&run_max)[HEADS_PER_CTA],
                                          float (&correction)[HEADS_PER_CTA], float* head_correction, int tid) {
#pragma unroll
    for (int h = 0; h < HEADS_PER_CTA; ++h) {
        float m = run_max[h];
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w) m = fmaxf(m, warp_max_buf[w][h]);  // finite: the chunk has a seen token
        correction[h] = exp2f(run_max[h] - m);
        if (tid == h) head_correction[h] = correction[h];  // for the sums' elements (phase 3's last barrier)
        run_max[h] = m;
    }
}

// Phase 3, the V pass: each row's probabilities p = 2^(score - max), made by every lane of the row
// as it needs them, and p[h][t] * v_t summed over the chunk into `owned`, the p's into `run_sum`
// (both rescaled by the correction first): in registers per row group, across a warp's groups with
// shuffles, then across warps in shared memory (`smem`, the score buffer, once every warp is done
// with it).
__device__ __forceinline__ void accumulate_chunk(float (&owned)[OWNED], float (&run_sum)[HEADS_PER_CTA], float* smem,
                                                 const float* scores, kv_vec_t* ring,
                                                 const float (&run_max)[HEADS_PER_CTA],
                                                 const float (&correction)[HEADS_PER_CTA],
                                                 const float* head_correction, const unsigned char* k_base,
                                                 const unsigned char* v_base, const int* blocks, int skip, int n,
                                                 int iters, const Lanes& l, int tid) {
    __shared__ float warp_sum_buf[NUM_WARPS][HEADS_PER_CTA];
    float acc[HEADS_PER_CTA][KV_VEC], p_sum[HEADS_PER_CTA];
#pragma unroll
    for (int h = 0; h < HEADS_PER_CTA; ++h) {
        p_sum[h] = 0.0f;
#pragma unroll
        for (int j = 0; j < KV_VEC; ++j) acc[h][j] = 0.0f;
    }
    for (int it = 0; it < iters; ++it) {
        const int t0 = it * TOKENS_PER_ITER;
        kv_vec_t cur_v[UNROLL];
        read_step(cur_v, ring, iters + it, tid);
        issue_step(ring, iters + it + STAGES - 1, iters, k_base, v_base, blocks, skip, n, l.row_in_step, l.active,
                   tid);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int t = t0 + u * ROWS_PER_STEP + l.row_in_step;
            if (seen(t, skip, n)) {
                float vf[KV_VEC];
                unpack_kv(cur_v[u], vf);
#pragma unroll
                for (int h = 0; h < HEADS_PER_CTA; ++h) {
                    const float p = exp2f(scores[h * SCORE_STRIDE + t] - run_max[h]);
                    p_sum[h] += p;
#pragma unroll
                    for (int j = 0; j < KV_VEC; ++j) acc[h][j] = fmaf(p, vf[j], acc[h][j]);
                }
            }
        }
    }
#pragma unroll
    for (int off = ROW_LANES; off < WARP_SIZE; off <<= 1) {
#pragma unroll
        for (int h = 0; h < HEADS_PER_CTA; ++h) {
            p_sum[h] += __shfl_xor_sync(FULL_MASK, p_sum[h], off);
#pragma unroll
            for (int j = 0; j < KV_VEC; ++j) acc[h][j] += __shfl_xor_sync(FULL_MASK, acc[h][j], off);
        }
    }
    __syncthreads();  // every warp is done with the scores
    float* const warp_acc = smem;  // [NUM_WARPS][HEADS_PER_CTA][HEAD_DIM]
    if (l.lane < ROW_LANES && l.active) {
#pragma unroll
        for (int h = 0; h < HEADS_PER_CTA; ++h) {
#pragma unroll
            for (int j = 0; j < KV_VEC; ++j) {
                warp_acc[(l.warp * HEADS_PER_CTA + h) * HEAD_DIM + l.lane * KV_VEC + j] = acc[h][j];
            }
        }
    }
    if (l.lane == 0) {
#pragma unroll
        for (int h = 0; h < HEADS_PER_CTA; ++h) warp_sum_buf[l.warp][h] = p_sum[h];
    }
    __syncthreads();
#pragma unroll
    for (int h = 0; h < HEADS_PER_CTA; ++h) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w) s += warp_sum_buf[w][h];
        run_sum[h] = run_sum[h] * correction[h] + s;
    }
#pragma unroll
    for (int k = 0; k < OWNED; ++k) {
        const int i = tid + k * ATTN_THREADS;
        if (i < HEADS_PER_CTA * HEAD_DIM) {
            float s = 0.0f;
#pragma unroll
            for (int w = 0; w < NUM_WARPS; ++w) s += warp_acc[w * HEADS_PER_CTA * HEAD_DIM + i];
            owned[k] = owned[k] * head_correction[i / HEAD_DIM] + s;
        }
    }
}

// The whole context in one part: normalise and write the output (times out_factor: 1, or an fp8
// pool's V scale).
__device__ __forceinline__ void write_normalised(scalar_t* out_rows, const float (&owned)[OWNED],
                                                 const float (&run_sum)[HEADS_PER_CTA], float* head_scale,
                                                 float out_factor, int tid) {
#pragma unroll
    for (int h = 0; h < HEADS_PER_CTA; ++h) {
        if (tid == h) head_scale[h] = out_factor / run_sum[h];  // run_sum >= 1: the max term is 2^0
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < OWNED; ++k) {
        const int i = tid + k * ATTN_THREADS;
        if (i < HEADS_PER_CTA * HEAD_DIM) out_rows[i] = from_float(owned[k] * head_scale[i / HEAD_DIM]);
    }
}

// Several parts: publish this one's unnormalised output, max and sum, and count it; the last part
// of this (sequence, head group) to arrive merges them all and writes the output (times out_factor).
__device__ __forceinline__ void publish_and_merge(scalar_t* out_rows, const float (&owned)[OWNED],
                                                  const float (&run_max)[HEADS_PER_CTA],
                                                  const float (&run_sum)[HEADS_PER_CTA], float* partial_out,
                                                  float* partial_max, float* partial_sum, unsigned int* counter,
                                                  size_t row0, int part, int used_parts, int num_splits,
                                                  float* head_scale, float out_factor, const Lanes& l, int tid) {
    __shared__ float head_max[HEADS_PER_CTA];
    __shared__ bool last_to_finish;
#pragma unroll
    for (int k = 0; k < OWNED; ++k) {
        const int i = tid + k * ATTN_THREADS;
        if (i < HEADS_PER_CTA * HEAD_DIM) {
            partial_out[(row0 + (size_t)(i / HEAD_DIM) * num_splits + part) * HEAD_DIM + i % HEAD_DIM] = owned[k];
        }
    }
#pragma unroll
    for (int h = 0; h < HEADS_PER_CTA; ++h) {
        if (tid == h) {
            partial_max[row0 + (size_t)h * num_splits + part] = run_max[h];
            partial_sum[row0 + (size_t)h * num_splits + part] = run_sum[h];
        }
    }
    __threadfence();  // our partials are visible GPU-wide before the counter moves
    __syncthreads();
    if (tid == 0) last_to_finish = atomicAdd(counter, 1u) == (unsigned int)(used_parts - 1);
    __syncthreads();
    if (!last_to_finish) return;
    __threadfence();  // the other splits' partials are read after their counts
    if (tid == 0) *counter = 0u;  // ready for the next launch (or CUDA-graph replay)

    // The merged max and 1 / denominator of each head: a warp per head, its lanes over the parts.
    for (int h = l.warp; h < HEADS_PER_CTA; h += NUM_WARPS) {
        const float* maxes = partial_max + row0 + (size_t)h * num_splits;
        const float* sums = partial_sum + row0 + (size_t)h * num_splits;
        float m = neg_infinity();
        for (int s = l.lane; s < used_parts; s += WARP_SIZE) m = fmaxf(m, load_from_l2(maxes + s));
        m = warp_max(m);
        float denom = 0.0f;
        for (int s = l.lane; s < used_parts; s += WARP_SIZE) {
            denom += load_from_l2(sums + s) * exp2f(load_from_l2(maxes + s) - m);
        }
        denom = warp_sum(denom);  // >= 1: the split holding the max contributes 2^0 * (sum >= 1)
        if (l.lane == 0) {
            head_max[h] = m;
            head_scale[h] = out_factor / denom;
        }
    }
    __syncthreads();
    for (int i = tid; i < HEADS_PER_CTA * HEAD_DIM; i += ATTN_THREADS) {
        const int h = i / HEAD_DIM;
        const float* maxes = partial_max + row0 + (size_t)h * num_splits;
        const float* parts = partial_out + (row0 + (size_t)h * num_splits) * HEAD_DIM + i % HEAD_DIM;
        float a = 0.0f;
#pragma unroll 8
        for (int s = 0; s < used_parts; ++s) {  // unrolled: eight L2 reads in flight, not one
            a = fmaf(exp2f(load_from_l2(maxes + s) - head_max[h]), load_from_l2(parts + (size_t)s * HEAD_DIM), a);
        }
        out_rows[i] = from_float(a * head_scale[h]);
    }
}

// One CTA: its span of one sequence's context for HEADS_PER_CTA query heads, chunk by chunk
// (phases 1 to 3), then the merge.
template <int CLUSTER>
__device__ __forceinline__ void attention(ATTENTION_PARAMS) {
    const int split = blockIdx.z, num_splits = gridDim.z;
    const int head0 = blockIdx.x * HEADS_PER_CTA;  // first query head of this CTA
    const int kv_head = head0 / GQA;
    const int seq = blockIdx.y;
    const int tid = threadIdx.x;
    scalar_t* __restrict__ out_rows = out + ((size_t)seq * NUM_HEADS + head0) * HEAD_DIM;

    // With ATTN_READ_BATCH_EARLY, the length, the slot and the first chunk's blocks are read
    // before the wait (common.cuh), while the kernel ahead (the qkv projection, which writes q and
    // the newest K/V row) still runs, so the chain length -> block table -> K starts at the K
    // loads. Only what was written before the step's batch copy may be read there (host_written).
    // The plan sets it with fp8 weights, where it measured faster; with bf16 weights waiting first
    // measured faster (docs/performance-log.md, "Each kernel started before the one ahead of it ends
    // (programmatic dependent launch)").
    allow_next_kernel();
    if constexpr (!ATTN_READ_BATCH_EARLY) wait_for_previous_kernels();
    const int context = min(max(host_written(context_lens + seq), 0), max_context);
    const int slot = host_written(slots + seq);
    const bool padding = context == 0;  // a padding row: zeros, written by split 0's CTA
    const int first = window_first(context - 1);  // the first key the new token sees (0 without a window)
    const Span span = plan_span<CLUSTER>(context, first / BLOCK_SIZE * BLOCK_SIZE, split, num_splits);
    if (padding ? split != 0 : span.part >= span.used_parts) {
        // Nothing to do, but leave only once the kernel ahead is done, as the others do (leaving
        // at once measured slower: the SM goes early to the kernels after this one).
        wait_for_previous_kernels();
        return;
    }
    __shared__ __align__(16) float smem[SMEM_FLOATS];  // scores and load ring; later per-warp sums
    __shared__ int chunk_blocks[BLOCKS_PER_CHUNK];
    __shared__ float warp_max[NUM_WARPS][HEADS_PER_CTA];  // each warp's max score of each head, this chunk
    __shared__ float head_correction[HEADS_PER_CTA];
    __shared__ float head_scale[HEADS_PER_CTA];  // 1 / softmax denominator, for the final writes
    float* const scores = smem;
    kv_vec_t* const ring = reinterpret_cast<kv_vec_t*>(smem + SCORE_FLOATS);
    const Lanes l = lanes_of(tid);

    // Running softmax state per head (identical in every thread) and, for the HEADS_PER_CTA x
    // HEAD_DIM outputs, the unnormalised sums over this CTA's chunks: thread tid owns elements
    // tid, tid + ATTN_THREADS, ...
    float run_max[HEADS_PER_CTA], run_sum[HEADS_PER_CTA], owned[OWNED];
#pragma unroll
    for (int h = 0; h < HEADS_PER_CTA; ++h) {
        run_max[h] = neg_infinity();
        run_sum[h] = 0.0f;
    }
#pragma unroll
    for (int k = 0; k < OWNED; ++k) owned[k] = 0.0f;

    const int* __restrict__ seq_table = table + slot * table_slot_stride;
    const unsigned char* __restrict__ k_base = pool + (size_t)kv_head * ROW_BYTES + (size_t)l.lane_in_row * ATTN_VEC_BYTES;
    const unsigned char* __restrict__ v_base = k_base + V_OFFSET;
    const scalar_t* __restrict__ q_base = q + ((size_t)seq * NUM_HEADS + head0) * HEAD_DIM + l.lane_in_row * KV_VEC;

    if (!padding) {
        load_chunk_blocks(chunk_blocks, seq_table, span.start, min(PARTITION_SIZE, span.end - span.start), tid);
        __syncthreads();
    }
    wait_for_previous_kernels();  // (a second call returns at once)
    if (padding) {
        for (int i = tid; i < HEADS_PER_CTA * HEAD_DIM; i += ATTN_THREADS) out_rows[i] = from_float(0.0f);
        return;
    }
#if defined(KV_FP8)
    // the kv head's scales, and 1 / the unpacking's factor: K's folded into q's pre-scale (the
    // scores), V's into the output's normalisation
    scale_log2 *= k_scale[kv_head] * (1.0f / E4M3_UNPACK_FACTOR);
    const float out_factor = v_scale[kv_head] * (1.0f / E4M3_UNPACK_FACTOR);
#else
    const float out_factor = 1.0f;
#endif
    // q's lines are requested into L1 first: their latency overlaps the K loads' instead of
    // preceding them.
    constexpr int Q_BYTES = HEADS_PER_CTA * HEAD_DIM * (int)sizeof(scalar_t);
    for (int b = tid * 128; b < Q_BYTES; b += ATTN_THREADS * 128) {
        asm volatile("prefetch.global.L1 [%0];" ::"l"(reinterpret_cast<const unsigned char*>(
                         q + ((size_t)seq * NUM_HEADS + head0) * HEAD_DIM) + b));
    }

    for (int chunk_start = span.start; chunk_start < span.end; chunk_start += PARTITION_SIZE) {
        const int n = min(PARTITION_SIZE, span.end - chunk_start);  // tokens in this chunk
        const int skip = first - chunk_start;  // its tokens before the window's first key (<= 0: none)

        if (chunk_start != span.start) {  // (the first chunk's blocks were read before the wait)
            __syncthreads();  // the previous chunk is done with chunk_blocks and smem
            load_chunk_blocks(chunk_blocks, seq_table, chunk_start, n, tid);
            __syncthreads();
        }

        // Start the load ring: the first STAGES - 1 steps (K rows, then V rows).
        const int iters = (n + TOKENS_PER_ITER - 1) / TOKENS_PER_ITER;  // load steps per pass
#pragma unroll
        for (int g = 0; g < STAGES - 1; ++g) {
            issue_step(ring, g, iters, k_base, v_base, chunk_blocks, skip, n, l.row_in_step, l.active, tid);
        }
        score_chunk(scores, warp_max, ring, q_base, scale_log2, k_base, v_base, chunk_blocks, skip, n, iters, l, tid);
        __syncthreads();  // the scores and the warps' maxima are complete
        float correction[HEADS_PER_CTA];
        chunk_max(warp_max, run_max, correction, head_correction, tid);
        accumulate_chunk(owned, run_sum, smem, scores, ring, run_max, correction, head_correction, k_base, v_base,
                         chunk_blocks, skip, n, iters, l, tid);
    }

    if constexpr (CLUSTER > 1) {
        merge_cluster<CLUSTER>(owned, run_max, run_sum, split % CLUSTER, tid);
        if (split % CLUSTER != 0) return;
    }
    if (span.used_parts == 1) {
        write_normalised(out_rows, owned, run_sum, head_scale, out_factor, tid);
        return;
    }
    const size_t row0 = ((size_t)seq * NUM_HEADS + head0) * num_splits;  // (seq, head0, split 0)
    publish_and_merge(out_rows, owned, run_max, run_sum, partial_out, partial_max, partial_sum,
                      merge_counters + (size_t)seq * gridDim.x + blockIdx.x, row0, span.part, span.used_parts,
                      num_splits, head_scale, out_factor, l, tid);
}

// ATTN_MIN_CTAS resident CTAs per SM bound the registers (the compiler would otherwise take more,
// and fewer CTAs would keep fewer loads in flight).
extern "C" __global__ void __launch_bounds__(ATTN_THREADS, ATTN_MIN_CTAS) paged_attention_decode(ATTENTION_PARAMS) {
    attention<1>(ATTENTION_ARGS);  // (it waits for the kernel ahead itself, once its reads of the batch are out)
}

// Small batches on sm_90+ (backends/cuda.py decides): ATTN_CLUSTER consecutive splits form a
// thread-block cluster and merge through each other's shared memory, not through global memory
// and a counter; the span rule allows shorter spans (ATTN_CLUSTER_MIN_SPAN), so that a short
// context is read by several CTAs at once. Parts that are clusters still merge as above.
#if __CUDA_ARCH__ >= 900
extern "C" __global__ void __cluster_dims__(1, 1, ATTN_CLUSTER) __launch_bounds__(ATTN_THREADS, ATTN_MIN_CTAS)
    paged_attention_decode_cluster(ATTENTION_PARAMS) {
    attention<ATTN_CLUSTER>(ATTENTION_ARGS);
}
#endif
