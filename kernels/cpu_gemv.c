/* The CPU backend's products of a decode step's few rows by a weight matrix, read once at the
   memory's speed (backends/cpu_kernels.py builds this file with the machine's compiler, -O3
   -march=native -fopenmp, and calls it through ctypes; docs/performance.md, "CPU decode", has the
   measurements that chose these over oneDNN's products for these rows).

   y[m, n] = sum_k x[m, k] * w[n, k]: x [M, K] and y [M, N] float32, row-major; w [N, K] row-major as
   torch's Linear stores it, in one of three forms:
     - float32, for 1 to MAX_ROWS rows of x (GCC's vector extensions: 16 floats, one AVX-512
       register or two AVX2 ones, so -march=native picks the machine's width);
     - int8 values with a float32 scale and offset for each group of `group` inputs of a row
       (QuantWeight's 8-bit form: w = q * scale + offset), one row of x;
     - 4-bit values, two a byte (the even column in the low nibble), the same scales and offsets,
       one row of x.
   The grouped forms sum x * q over a group, then scale that sum and add offset * (the sum of x over
   the group): what QuantWeight.dequantize and a product compute, up to the order of float
   additions. Threads: OpenMP's over the rows of w, as many as the caller says (torch's count: the
   process has torch's libgomp loaded, which this library then shares). */
#include <stdint.h>
#include <stdlib.h>

#define MAX_ROWS 8

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));

static inline v16 load(const float *p) { return *(const v16u *)p; }
static inline float hsum(v16 v) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

/* ---- float32 ------------------------------------------------------------------------------- */
#define F32_TILE(MT, NT)                                                                           \
static void f32_tile_##MT##_##NT(const float *x, const float *w, float *y, int N, int K, int n0) {  \
    v16 acc[MT][NT];                                                                               \
    for (int m = 0; m < MT; m++) for (int r = 0; r < NT; r++) acc[m][r] = (v16){0};              \
    int k = 0;                                                                                     \
    for (; k + 16 <= K; k += 16) {                                                                 \
        v16 wv[NT];                                                                                \
        for (int r = 0; r < NT; r++) wv[r] = load(w + (int64_t)(n0 + r) * K + k);                 \
        for (int m = 0; m < MT; m++) {                                                             \
            v16 xv = load(x + (int64_t)m * K + k);                                                 \
            for (int r = 0; r < NT; r++) acc[m][r] += xv * wv[r];                                  \
        }                                                                                          \
    }                                                                                              \
    for (int m = 0; m < MT; m++)                                                                   \
        for (int r = 0; r < NT; r++) {                                                             \
            float s = hsum(acc[m][r]);                                                             \
            for (int t = k; t < K; t++) s += x[(int64_t)m * K + t] * w[(int64_t)(n0 + r) * K + t];  \
            y[(int64_t)m * N + n0 + r] = s;                                                        \
        }                                                                                          \
}
F32_TILE(1, 8) F32_TILE(1, 1)
F32_TILE(2, 4) F32_TILE(2, 1)
F32_TILE(3, 4) F32_TILE(3, 1)
F32_TILE(4, 4) F32_TILE(4, 1)

#define F32_ROWS(MT, NT)                                                                           \
    do {                                                                                           \
        int full = N / NT * NT;                                                                    \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                         \
        for (int n0 = 0; n0 < full; n0 += NT) f32_tile_##MT##_##NT(x, w, y, N, K, n0);              \
        for (int n0 = full; n0 < N; n0++) f32_tile_##MT##_1(x, w, y, N, K, n0);                    \
    } while (0)

/* 5 to 8 rows: each 4 rows of w meets rows 0-3 of x, then the rest, while those rows of w are still
   in the L1 cache: w is read from memory once */
static void f32_upper(const float *x, const float *w, float *y, int M, int N, int K, int n0, int nt) {
    const float *xu = x + 4 * (int64_t)K;
    float *yu = y + 4 * (int64_t)N;
    if (nt == 4) {
        f32_tile_4_4(x, w, y, N, K, n0);
        switch (M - 4) {
            case 1: f32_tile_1_1(xu, w, yu, N, K, n0); f32_tile_1_1(xu, w, yu, N, K, n0 + 1);
                    f32_tile_1_1(xu, w, yu, N, K, n0 + 2); f32_tile_1_1(xu, w, yu, N, K, n0 + 3); break;
            case 2: f32_tile_2_4(xu, w, yu, N, K, n0); break;
            case 3: f32_tile_3_4(xu, w, yu, N, K, n0); break;
            case 4: f32_tile_4_4(xu, w, yu, N, K, n0); break;
        }
        return;
    }
    f32_tile_4_1(x, w, y, N, K, n0);
    switch (M - 4) {
        case 1: f32_tile_1_1(xu, w, yu, N, K, n0); break;
        case 2: f32_tile_2_1(xu, w, yu, N, K, n0); break;
        case 3: f32_tile_3_1(xu, w, yu, N, K, n0); break;
        case 4: f32_tile_4_1(xu, w, yu, N, K, n0); break;
    }
}

int pagedcli_gemv_f32(const float *x, const float *w, float *y, int M, int N, int K, int threads) {
    if (N < 1 || K < 1 || threads < 1) return 1;
    switch (M) {
        case 1: F32_ROWS(1, 8); return 0;
        case 2: F32_ROWS(2, 4); return 0;
        case 3: F32_ROWS(3, 4); return 0;
        case 4: F32_ROWS(4, 4); return 0;
        case 5: case 6: case 7: case 8: {
            int full = N / 4 * 4;
            #pragma omp parallel for schedule(static) num_threads(threads)
            for (int n0 = 0; n0 < full; n0 += 4) f32_upper(x, w, y, M, N, K, n0, 4);
            for (int n0 = full; n0 < N; n0++) f32_upper(x, w, y, M, N, K, n0, 1);
            return 0;
        }
        default: return 1;
    }
}

/* ---- grouped int8 and 4-bit, one row of x (AVX-512) ----------------------------------------------
   Decode at batch 1, the common case: x [1, K] against 4 rows of w at once (4 independent chains
   of FMAs), the bytes widened by vpmovsxbd / vpmovzxbd. xs [K / group]: the sum of x over each group
   (for the offsets); 4-bit reads x as x4, its even columns then its odd ones ([2, K / 2]), so that a
   byte's low nibble meets an even column's x and its high nibble the odd one's. Groups are multiples
   of 16 values (int8) or 32 (4-bit). Without AVX-512 (GCC's vector extensions compile these conversions to
   slower code than oneDNN's product of the dequantized copy) the backend keeps that copy. */
#ifdef __AVX512F__
#include <immintrin.h>

#define GROUPED_ROWS(NAME, STEP, ...)                                                              \
static inline __attribute__((always_inline)) void NAME##_rows(                                     \
        const float *x, const float *xs, const void *q, const float *scale, const float *offset,   \
        float *y, int K, int group, int n0, int rows) {                                            \
    int groups = K / group;                                                                        \
    __m512 total[4];                                                                               \
    float shift[4] = {0.0f, 0.0f, 0.0f, 0.0f};                                                    \
    for (int r = 0; r < rows; r++) total[r] = _mm512_setzero_ps();                                 \
    for (int g = 0; g < groups; g++) {                                                             \
        __m512 part[4];                                                                            \
        for (int r = 0; r < rows; r++) part[r] = _mm512_setzero_ps();                              \
        for (int k = g * group; k < (g + 1) * group; k += STEP) { __VA_ARGS__ }                    \
        for (int r = 0; r < rows; r++) {                                                           \
            int64_t at = (int64_t)(n0 + r) * groups + g;                                           \
            total[r] = _mm512_fmadd_ps(part[r], _mm512_set1_ps(scale[at]), total[r]);              \
            if (offset) shift[r] += offset[at] * xs[g];                                            \
        }                                                                                          \
    }                                                                                              \
    for (int r = 0; r < rows; r++) y[n0 + r] = _mm512_reduce_add_ps(total[r]) + shift[r];          \
}

GROUPED_ROWS(q8, 16,
    __m512 xv = _mm512_loadu_ps(x + k);
    for (int r = 0; r < rows; r++) {
        __m128i b = _mm_loadu_si128((const __m128i *)((const signed char *)q + (int64_t)(n0 + r) * K + k));
        part[r] = _mm512_fmadd_ps(xv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), part[r]);
    })

GROUPED_ROWS(q4, 32,
    __m512 xe = _mm512_loadu_ps(x + k / 2), xo = _mm512_loadu_ps(x + K / 2 + k / 2);
    for (int r = 0; r < rows; r++) {
        __m512i b = _mm512_cvtepu8_epi32(
            _mm_loadu_si128((const __m128i *)((const unsigned char *)q + (int64_t)(n0 + r) * (K / 2) + k / 2)));
        __m512 low = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
        __m512 high = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
        part[r] = _mm512_fmadd_ps(xo, high, _mm512_fmadd_ps(xe, low, part[r]));
    })

#endif

/* 1: the grouped kernels below are built (AVX-512); 0: they refuse every call */
int pagedcli_grouped_kernels(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

/* xs (the sum of x over each group) and, 4-bit, x4 (x's even columns, then its odd ones) are made
   here, once a call, in a buffer of the heap (K is the model's: a stack could not be trusted with
   it) */
/* w's rows 4 at a time across the threads, then the last 1 to 3 */
#define IN_FOURS(ROWS, X)                                                                          \
    do {                                                                                           \
        int full = N / 4 * 4;                                                                      \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                         \
        for (int n0 = 0; n0 < full; n0 += 4) ROWS(X, xs, q, scale, offset, y, K, group, n0, 4);     \
        if (full < N) ROWS(X, xs, q, scale, offset, y, K, group, full, N - full);                  \
    } while (0)

static float *group_sums(const float *x, int K, int group, int extra) {
    float *xs = malloc(sizeof(float) * ((size_t)(K / group) + (size_t)extra));
    if (!xs) return NULL;
    for (int g = 0; g < K / group; g++) {
        float s = 0.0f;
        for (int k = g * group; k < (g + 1) * group; k++) s += x[k];
        xs[g] = s;
    }
    return xs;
}

int pagedcli_gemv_q8(const float *x, const signed char *q, const float *scale, const float *offset, float *y,
                     int N, int K, int group, int threads) {
#ifdef __AVX512F__
    if (N < 1 || K < 1 || group < 16 || group % 16 || K % group || threads < 1) return 1;
    float *xs = group_sums(x, K, group, 0);
    if (!xs) return 1;
    IN_FOURS(q8_rows, x);
    free(xs);
    return 0;
#else
    return 1;
#endif
}

int pagedcli_gemv_q4(const float *x, const unsigned char *q, const float *scale, const float *offset, float *y,
                     int N, int K, int group, int threads) {
#ifdef __AVX512F__
    if (N < 1 || K < 1 || group < 32 || group % 32 || K % group || threads < 1) return 1;
    float *xs = group_sums(x, K, group, K);
    if (!xs) return 1;
    float *x4 = xs + K / group;
    for (int k = 0; k < K / 2; k++) {
        x4[k] = x[2 * k];
        x4[K / 2 + k] = x[2 * k + 1];
    }
    IN_FOURS(q4_rows, x4);
    free(xs);
    return 0;
#else
    return 1;
#endif
}
