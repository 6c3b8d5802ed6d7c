/* Benchmark peers; see bench.h. */
#define _POSIX_C_SOURCE 200809L
#include "bench.h"
#include "kernels.h"

#include <stdlib.h>
#include <time.h>

typedef struct read_task {
    const uint8_t *buf;
    size_t bytes;
    int avx2;
    uint64_t out[256];
} read_task;

typedef struct fma_task {
    int isa;
    uint64_t rounds;
    float out[256];   /* one per thread, so that no chain is dead code */
} fma_task;

/* Independent FMA chains per round: the FMA latency (4 cycles on current
 * cores) times the FMA ports (2), plus room; all in registers. */
#define FMA_CHAINS_AVX2 12
#define FMA_CHAINS_AVX512 16
#define FMA_CHAINS_SCALAR 8

typedef struct gemm_task {
    const duck_kernels *k;
    const duck_expert_slice *experts;
    uint32_t n, ntok;
    const float *const *x, *const *h;
    float *const *gu, *const *y;
} gemm_task;

typedef struct int8_task {
    const int8_t *w;
    uint32_t n, k;
    const float *x;
    float *y;
    int isa;
} int8_task;

#define INT8_PANEL 2048   /* the fp9 layout's panel width, for a like-for-like peer */

static uint64_t read_scalar(const uint8_t *p, const uint8_t *e)
{
    uint64_t acc = 0;
    for (; p < e; p += 8)
        acc ^= *(const uint64_t *)p;
    return acc;
}

static float fma_scalar(uint64_t rounds)
{
    float a[FMA_CHAINS_SCALAR], m = 0.999f, b = 1e-3f;
    for (int i = 0; i < FMA_CHAINS_SCALAR; i++)
        a[i] = (float)i;
    for (uint64_t r = 0; r < rounds; r++)
        for (int i = 0; i < FMA_CHAINS_SCALAR; i++)
            a[i] = a[i] * m + b;
    float s = 0.0f;
    for (int i = 0; i < FMA_CHAINS_SCALAR; i++)
        s += a[i];
    return s;
}

static float dot_int8_scalar(const int8_t *row, const float *x, uint32_t k)
{
    float acc = 0.0f;
    for (uint32_t c = 0; c < k; c++)
        acc += row[c] * x[c];
    return acc;
}

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include <immintrin.h>

static uint64_t read_avx2(const uint8_t *p, const uint8_t *e)
{
    __m256i a[8];
    for (int i = 0; i < 8; i++)
        a[i] = _mm256_setzero_si256();
    for (; p < e; p += 256)
        for (int i = 0; i < 8; i++)
            a[i] = _mm256_xor_si256(a[i], _mm256_load_si256((const __m256i *)(p + 32 * i)));
    for (int i = 1; i < 8; i++)
        a[0] = _mm256_xor_si256(a[0], a[i]);
    return (uint64_t)_mm256_extract_epi64(a[0], 0) ^ (uint64_t)_mm256_extract_epi64(a[0], 3);
}

/* FMA_CHAINS chains of a[i] = a[i] * m + b in registers of type V (the
 * multiplier below 1 keeps every chain finite); returns their sum's lane 0. */
#define FMA_PEAK_FN(name, V, CHAINS, set1, fmadd, add, first)    \
    static float name(uint64_t rounds)                            \
    {                                                             \
        V a[CHAINS];                                              \
        const V m = set1(0.999f), b = set1(1e-3f);                \
        for (int i = 0; i < CHAINS; i++)                          \
            a[i] = set1((float)i);                                \
        for (uint64_t r = 0; r < rounds; r++)                     \
            _Pragma("GCC unroll 16") for (int i = 0; i < CHAINS; i++) \
                a[i] = fmadd(a[i], m, b);                         \
        for (int i = 1; i < CHAINS; i++)                          \
            a[0] = add(a[0], a[i]);                               \
        return first(a[0]);                                       \
    }

FMA_PEAK_FN(fma_avx2, __m256, FMA_CHAINS_AVX2, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_add_ps, _mm256_cvtss_f32)

#define WIDEN_FMA(acc, off) \
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + c + off)))), \
                          _mm256_loadu_ps(x + c + off), acc)

/* A plain widen-convert-FMA dot product: k a multiple of 32. */
static float dot_int8_avx2(const int8_t *row, const float *x, uint32_t k)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (uint32_t c = 0; c < k; c += 32) {
        _mm_prefetch((const char *)row + c + DUCK_PREFETCH_BYTES, _MM_HINT_T0);
        WIDEN_FMA(a0, 0);
        WIDEN_FMA(a1, 8);
        WIDEN_FMA(a2, 16);
        WIDEN_FMA(a3, 24);
    }
    __m256 s = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma")
FMA_PEAK_FN(fma_avx512, __m512, FMA_CHAINS_AVX512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_add_ps,
            _mm512_cvtss_f32)

#define WIDEN_FMA16(acc, off) \
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + c + off)))), \
                          _mm512_loadu_ps(x + c + off), acc)

/* The same on sixteen weights at a time: k a multiple of 64. */
static float dot_int8_avx512(const int8_t *row, const float *x, uint32_t k)
{
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (uint32_t c = 0; c < k; c += 64) {
        _mm_prefetch((const char *)row + c + DUCK_PREFETCH_BYTES, _MM_HINT_T0);
        WIDEN_FMA16(a0, 0);
        WIDEN_FMA16(a1, 16);
        WIDEN_FMA16(a2, 32);
        WIDEN_FMA16(a3, 48);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}
#pragma GCC pop_options

static int isa_supported(int isa)
{
    __builtin_cpu_init();
    if (isa == DUCK_BENCH_AVX512)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
    if (isa == DUCK_BENCH_AVX2)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return isa == DUCK_BENCH_SCALAR;
}
#else
static uint64_t read_avx2(const uint8_t *p, const uint8_t *e) { return read_scalar(p, e); }
static float fma_avx2(uint64_t rounds) { return fma_scalar(rounds); }
static float fma_avx512(uint64_t rounds) { return fma_scalar(rounds); }
static float dot_int8_avx2(const int8_t *row, const float *x, uint32_t k) { return dot_int8_scalar(row, x, k); }
static float dot_int8_avx512(const int8_t *row, const float *x, uint32_t k) { return dot_int8_scalar(row, x, k); }
static int isa_supported(int isa) { return isa == DUCK_BENCH_SCALAR; }
#endif

int duck_bench_isa(int want)
{
    int isa = want < DUCK_BENCH_SCALAR || want > DUCK_BENCH_AVX512 ? DUCK_BENCH_AVX512 : want;
    while (isa > DUCK_BENCH_SCALAR && !isa_supported(isa))
        isa--;
    return isa;
}

static void read_part(void *arg, unsigned w, unsigned nw)
{
    read_task *t = arg;
    unsigned long begin, end;
    duck_split(t->bytes / 256, w, nw, &begin, &end);
    const uint8_t *p = t->buf + begin * 256, *e = t->buf + end * 256;
    t->out[w % 256] = t->avx2 ? read_avx2(p, e) : read_scalar(p, e);
}

uint64_t duck_bench_read(duck_pool *pool, const void *buf, size_t bytes)
{
    read_task t = {buf, bytes, duck_bench_isa(DUCK_BENCH_AVX2) == DUCK_BENCH_AVX2, {0}};
    duck_pool_run(pool, read_part, &t);
    uint64_t r = 0;
    for (int i = 0; i < 256; i++)
        r ^= t.out[i];
    return r;
}

static void fma_part(void *arg, unsigned w, unsigned nw)
{
    fma_task *t = arg;
    (void)nw;
    t->out[w % 256] = t->isa == DUCK_BENCH_AVX512 ? fma_avx512(t->rounds)
                      : t->isa == DUCK_BENCH_AVX2 ? fma_avx2(t->rounds)
                                                  : fma_scalar(t->rounds);
}

uint64_t duck_bench_fma(duck_pool *pool, int isa, uint64_t rounds)
{
    fma_task t = {duck_bench_isa(isa), rounds, {0}};
    duck_pool_run(pool, fma_part, &t);
    volatile float sink = 0.0f;
    for (int i = 0; i < 256; i++)
        sink += t.out[i];
    (void)sink;
    uint64_t per_round = t.isa == DUCK_BENCH_AVX512 ? FMA_CHAINS_AVX512 * 16
                         : t.isa == DUCK_BENCH_AVX2 ? FMA_CHAINS_AVX2 * 8
                                                    : FMA_CHAINS_SCALAR;
    return 2 * per_round * rounds * duck_pool_size(pool);
}

static void gemm_part(void *arg, unsigned w, unsigned nw)
{
    const gemm_task *t = arg;
    for (uint32_t i = 0; i < t->n; i++) {
        const duck_expert_slice *e = &t->experts[i];
        unsigned long begin, end;
        duck_split_aligned(e->gate_up.row_pairs, w, nw, DUCK_ROW_PAIR_ALIGN, &begin, &end);
        t->k->gemm(&e->gate_up, (uint32_t)begin, (uint32_t)end, t->ntok, t->x, t->gu, 0);
        duck_split_aligned(e->down.row_pairs, w, nw, DUCK_ROW_PAIR_ALIGN, &begin, &end);
        t->k->gemm(&e->down, (uint32_t)begin, (uint32_t)end, t->ntok, t->h, t->y, 0);
    }
}

void duck_bench_gemm(duck_pool *pool, const duck_kernels *k, const duck_expert_slice *experts, uint32_t n,
                     uint32_t ntok, const float *const *x, const float *const *h, float *const *gu, float *const *y)
{
    gemm_task t = {k, experts, n, ntok, x, h, gu, y};
    duck_pool_run(pool, gemm_part, &t);
}

/* The matrix is stored in panels of 2048 columns, row-major inside a panel,
 * like fp9's panels, so that x stays in L1 for the peer too. */
static void int8_part(void *arg, unsigned w, unsigned nw)
{
    const int8_task *t = arg;
    unsigned long begin, end;
    duck_split(t->n, w, nw, &begin, &end);
    for (uint32_t p0 = 0; p0 < t->k; p0 += INT8_PANEL) {
        uint32_t pw = t->k - p0 < INT8_PANEL ? t->k - p0 : INT8_PANEL;
        const int8_t *panel = t->w + (size_t)t->n * p0;
        for (unsigned long r = begin; r < end; r++) {
            const int8_t *row = panel + r * (size_t)pw;
            float v = t->isa == DUCK_BENCH_AVX512 ? dot_int8_avx512(row, t->x + p0, pw)
                      : t->isa == DUCK_BENCH_AVX2 ? dot_int8_avx2(row, t->x + p0, pw)
                                                  : dot_int8_scalar(row, t->x + p0, pw);
            t->y[r] = p0 ? t->y[r] + v : v;
        }
    }
}

int duck_bench_int8_gemv(duck_pool *pool, int isa, const int8_t *w, uint32_t n, uint32_t k,
                         const float *x, float *y)
{
    int8_task t = {w, n, k, x, y, duck_bench_isa(isa)};
    duck_pool_run(pool, int8_part, &t);
    return t.isa;
}

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

typedef struct wake_task {
    double start_us[256];
} wake_task;

static void note_start(void *arg, unsigned w, unsigned nw)
{
    (void)nw;
    ((wake_task *)arg)->start_us[w % 256] = now_us();
}

static int by_value(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

void duck_bench_pool_wake(duck_pool *pool, uint32_t runs, uint32_t gap_us, int shared,
                          double *wake_us, double *run_us)
{
    double *wake = calloc(runs ? runs : 1, sizeof(double)), *run = calloc(runs ? runs : 1, sizeof(double));
    unsigned n = duck_pool_size(pool) < 256 ? duck_pool_size(pool) : 256;
    for (uint32_t r = 0; r < runs; r++) {
        if (gap_us) {
            struct timespec gap = {0, (long)gap_us * 1000};
            nanosleep(&gap, NULL);
        }
        wake_task t;
        for (unsigned w = 0; w < n; w++)
            t.start_us[w] = 0;
        double t0 = now_us();
        if (shared)
            duck_pool_run_shared(pool, note_start, &t);
        else
            duck_pool_run(pool, note_start, &t);
        double t1 = now_us(), last = t0;
        for (unsigned w = 1; w < n; w++)
            last = t.start_us[w] > last ? t.start_us[w] : last;
        wake[r] = last - t0;
        run[r] = t1 - t0;
    }
    qsort(wake, runs, sizeof(double), by_value);
    qsort(run, runs, sizeof(double), by_value);
    *wake_us = runs ? wake[runs / 2] : 0;
    *run_us = runs ? run[runs / 2] : 0;
    free(wake);
    free(run);
}
