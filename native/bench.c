/* Benchmark peers; see bench.h. */
#include "bench.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include <immintrin.h>
#define HAVE_AVX2_PEERS 1
#endif

typedef struct read_task {
    const uint8_t *buf;
    size_t bytes;
    uint64_t out[256];
} read_task;

static void read_part(void *arg, unsigned w, unsigned nw)
{
    read_task *t = arg;
    unsigned long begin, end;
    duck_split(t->bytes / 256, w, nw, &begin, &end);
    const uint8_t *p = t->buf + begin * 256, *e = t->buf + end * 256;
#ifdef HAVE_AVX2_PEERS
    __m256i a[8];
    for (int i = 0; i < 8; i++)
        a[i] = _mm256_setzero_si256();
    for (; p < e; p += 256)
        for (int i = 0; i < 8; i++)
            a[i] = _mm256_xor_si256(a[i], _mm256_load_si256((const __m256i *)(p + 32 * i)));
    for (int i = 1; i < 8; i++)
        a[0] = _mm256_xor_si256(a[0], a[i]);
    t->out[w % 256] = (uint64_t)_mm256_extract_epi64(a[0], 0) ^ (uint64_t)_mm256_extract_epi64(a[0], 3);
#else
    uint64_t acc = 0;
    for (; p < e; p += 8)
        acc ^= *(const uint64_t *)p;
    t->out[w % 256] = acc;
#endif
}

uint64_t duck_bench_read(duck_pool *pool, const void *buf, size_t bytes)
{
    read_task t = {buf, bytes, {0}};
    duck_pool_run(pool, read_part, &t);
    uint64_t r = 0;
    for (int i = 0; i < 256; i++)
        r ^= t.out[i];
    return r;
}

typedef struct int8_task {
    const int8_t *w;
    uint32_t n, k;
    const float *x;
    float *y;
} int8_task;

static void int8_part(void *arg, unsigned w, unsigned nw)
{
    const int8_task *t = arg;
    unsigned long begin, end;
    duck_split(t->n, w, nw, &begin, &end);
    for (unsigned long r = begin; r < end; r++) {
        const int8_t *row = t->w + r * (size_t)t->k;
#ifdef HAVE_AVX2_PEERS
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        for (uint32_t c = 0; c < t->k; c += 32) {
            a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + c)))),
                                 _mm256_loadu_ps(t->x + c), a0);
            a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + c + 8)))),
                                 _mm256_loadu_ps(t->x + c + 8), a1);
            a2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + c + 16)))),
                                 _mm256_loadu_ps(t->x + c + 16), a2);
            a3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + c + 24)))),
                                 _mm256_loadu_ps(t->x + c + 24), a3);
        }
        __m256 s = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        t->y[r] = _mm_cvtss_f32(h);
#else
        float acc = 0.0f;
        for (uint32_t c = 0; c < t->k; c++)
            acc += row[c] * t->x[c];
        t->y[r] = acc;
#endif
    }
}

void duck_bench_int8_gemv(duck_pool *pool, const int8_t *w, uint32_t n, uint32_t k,
                          const float *x, float *y)
{
    int8_task t = {w, n, k, x, y};
    duck_pool_run(pool, int8_part, &t);
}

#ifdef HAVE_AVX2_PEERS
#pragma GCC pop_options
#endif
