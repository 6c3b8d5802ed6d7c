/* Benchmark peers; see bench.h. */
#include "bench.h"

typedef struct read_task {
    const uint8_t *buf;
    size_t bytes;
    int avx2;
    uint64_t out[256];
} read_task;

typedef struct int8_task {
    const int8_t *w;
    uint32_t n, k;
    const float *x;
    float *y;
    int avx2;
} int8_task;

#define INT8_PANEL 2048   /* the fp9 layout's panel width, for a like-for-like peer */

static uint64_t read_scalar(const uint8_t *p, const uint8_t *e)
{
    uint64_t acc = 0;
    for (; p < e; p += 8)
        acc ^= *(const uint64_t *)p;
    return acc;
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

#define WIDEN_FMA(acc, off) \
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + c + off)))), \
                          _mm256_loadu_ps(x + c + off), acc)

/* A plain widen-convert-FMA dot product: k a multiple of 32. */
static float dot_int8_avx2(const int8_t *row, const float *x, uint32_t k)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (uint32_t c = 0; c < k; c += 32) {
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

static int have_avx2(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#else
static uint64_t read_avx2(const uint8_t *p, const uint8_t *e) { return read_scalar(p, e); }
static float dot_int8_avx2(const int8_t *row, const float *x, uint32_t k) { return dot_int8_scalar(row, x, k); }
static int have_avx2(void) { return 0; }
#endif

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
    read_task t = {buf, bytes, have_avx2(), {0}};
    duck_pool_run(pool, read_part, &t);
    uint64_t r = 0;
    for (int i = 0; i < 256; i++)
        r ^= t.out[i];
    return r;
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
            float v = t->avx2 ? dot_int8_avx2(row, t->x + p0, pw) : dot_int8_scalar(row, t->x + p0, pw);
            t->y[r] = p0 ? t->y[r] + v : v;
        }
    }
}

void duck_bench_int8_gemv(duck_pool *pool, const int8_t *w, uint32_t n, uint32_t k,
                          const float *x, float *y)
{
    int8_task t = {w, n, k, x, y, have_avx2()};
    duck_pool_run(pool, int8_part, &t);
}
