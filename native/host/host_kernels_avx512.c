/* AVX-512F host kernels: 16 lanes, tails through masked loads (a masked-off
 * lane is never read, so no row needs padding). One accumulator per sum,
 * four rows at a time for independent FMA chains and memory streams. Half
 * weights (packed panels): a panel of sixteen rows is one vector, widened as
 * it is loaded (F16C's 16-lane form), in register tiles of two panels by up
 * to twelve tokens; each sum is the AVX2 set's one chain over the columns, so
 * the bits are the same. */
#include "host_kernels.h"

#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
#include <immintrin.h>

static inline __mmask16 tail_mask(uint32_t lanes)
{
    return lanes >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << lanes) - 1u);
}

/* The one way every sum is formed: full vectors in index order, then the tail. */
static inline float dot16(const float *a, const float *b, uint32_t full, __mmask16 tail)
{
    __m512 acc = _mm512_setzero_ps();
    for (uint32_t c = 0; c < full; c += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + c), _mm512_loadu_ps(b + c), acc);
    if (tail)
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, a + full), _mm512_maskz_loadu_ps(tail, b + full), acc);
    return _mm512_reduce_add_ps(acc);
}

static float dot_avx512(const float *a, const float *b, uint32_t n)
{
    return dot16(a, b, n & ~15u, tail_mask(n & 15u));
}

/* Four rows' sums with one token over columns [0, n), carried in a[4]: full
 * vectors in index order, then the masked tail. gemm forms every sum through
 * this chain. */
static inline void fma4(const float *w0, const float *w1, const float *w2, const float *w3, const float *xt,
                        uint32_t n, __m512 a[4])
{
    const uint32_t full = n & ~15u;
    __m512 a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
    for (uint32_t c = 0; c < full; c += 16) {
        const __m512 xv = _mm512_loadu_ps(xt + c);
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w0 + c), xv, a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w1 + c), xv, a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w2 + c), xv, a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(w3 + c), xv, a3);
    }
    if (n & 15u) {
        const __mmask16 tail = tail_mask(n & 15u);
        const __m512 xv = _mm512_maskz_loadu_ps(tail, xt + full);
        a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w0 + full), xv, a0);
        a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w1 + full), xv, a1);
        a2 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w2 + full), xv, a2);
        a3 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w3 + full), xv, a3);
    }
    a[0] = a0, a[1] = a1, a[2] = a2, a[3] = a3;
}

static void gemm_avx512(const float *w, size_t ldw, uint32_t rows, uint32_t k, uint32_t ntok,
                        const float *x, size_t ldx, float *y, size_t ldy)
{
    const uint32_t full = k & ~15u;
    const __mmask16 tail = tail_mask(k & 15u);
    uint32_t r = 0;
    for (; r + 4 <= rows; r += 4) {
        const float *w0 = w + r * ldw;
        for (uint32_t t = 0; t < ntok; t++) {
            __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            fma4(w0, w0 + ldw, w0 + 2 * ldw, w0 + 3 * ldw, x + t * ldx, k, a);
            for (uint32_t i = 0; i < 4; i++)
                y[t * ldy + r + i] = _mm512_reduce_add_ps(a[i]);
        }
    }
    for (; r < rows; r++)
        for (uint32_t t = 0; t < ntok; t++)
            y[t * ldy + r] = dot16(w + r * ldw, x + t * ldx, full, tail);
}

/* Four rows' sums with nt tokens (ldx apart), carried in a[nt][4], one token at
 * a time (AVX-512's 32 registers would hold more tokens' chains: the AVX2 set's
 * fma4x3 shows how). */
static inline void fma4_tokens(const float *w0, const float *w1, const float *w2, const float *w3, const float *x,
                               size_t ldx, uint32_t nt, uint32_t n, __m512 (*a)[4])
{
    for (uint32_t t = 0; t < nt; t++)
        fma4(w0, w1, w2, w3, x + t * ldx, n, a[t]);
}


/* -- half weights --------------------------------------------------------------------------- */
#define TILE_TOKENS 12u   /* two panels: 24 accumulators, 2 weight vectors, 1 broadcast of 32 registers */
#define GEMV_PANELS 8u    /* one token: eight panels at once, eight chains */

static inline __m512 widen16(const uint16_t *h)
{
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
}

static inline void store_rows(float *y, __m512 a, uint32_t live)
{
    if (live >= DUCK_HOST_PANEL)
        _mm512_storeu_ps(y, a);
    else
        _mm512_mask_storeu_ps(y, tail_mask(live), a);
}

/* T tokens (x rows ldx apart, y rows ldy apart) against P panels (panel halves apart) from p,
 * k columns; live: the rows of the last of the P panels that exist. */
static inline __attribute__((always_inline)) void tile_h(const uint16_t *p, size_t panel, uint32_t k,
                                                         const float *x, size_t ldx, const int P, const int T,
                                                         float *y, size_t ldy, uint32_t live)
{
    __m512 a[4][TILE_TOKENS];
#pragma GCC unroll 4
    for (int j = 0; j < P; j++)
#pragma GCC unroll 12
        for (int i = 0; i < T; i++)
            a[j][i] = _mm512_setzero_ps();
    for (uint32_t c = 0; c < k; c++) {
        __m512 w[4];
#pragma GCC unroll 4
        for (int j = 0; j < P; j++)
            w[j] = widen16(p + j * panel + DUCK_HOST_PANEL * c);
#pragma GCC unroll 12
        for (int i = 0; i < T; i++) {
            const __m512 b = _mm512_set1_ps(x[i * ldx + c]);
#pragma GCC unroll 4
            for (int j = 0; j < P; j++)
                a[j][i] = _mm512_fmadd_ps(w[j], b, a[j][i]);
        }
    }
#pragma GCC unroll 12
    for (int i = 0; i < T; i++)
#pragma GCC unroll 4
        for (int j = 0; j < P; j++)
            store_rows(y + i * ldy + DUCK_HOST_PANEL * j, a[j][i], j == P - 1 ? live : DUCK_HOST_PANEL);
}

/* One token against GEMV_PANELS whole panels at once. */
static void gemv_panels_h(const uint16_t *p, size_t panel, uint32_t k, const float *x, float *y)
{
    __m512 a[GEMV_PANELS];
    for (uint32_t j = 0; j < GEMV_PANELS; j++)
        a[j] = _mm512_setzero_ps();
    for (uint32_t c = 0; c < k; c++) {
        const __m512 b = _mm512_set1_ps(x[c]);
        const uint16_t *q = p + DUCK_HOST_PANEL * c;
#pragma GCC unroll 8
        for (uint32_t j = 0; j < GEMV_PANELS; j++)
            a[j] = _mm512_fmadd_ps(widen16(q + j * panel), b, a[j]);
    }
    for (uint32_t j = 0; j < GEMV_PANELS; j++)
        _mm512_storeu_ps(y + DUCK_HOST_PANEL * j, a[j]);
}

#define TILE_CASE(P, T)                                                                                            \
    case T: tile_h(p, panel, k, x, ldx, P, T, y, ldy, live); return;

static void tile_dispatch(const uint16_t *p, size_t panel, uint32_t k, const float *x, size_t ldx, int P, int T,
                          float *y, size_t ldy, uint32_t live)
{
    if (P == 4)
        switch (T) {
            TILE_CASE(4, 1) TILE_CASE(4, 2) default: tile_h(p, panel, k, x, ldx, 4, 3, y, ldy, live); return;
        }
    if (P == 2)
        switch (T) {
            TILE_CASE(2, 1) TILE_CASE(2, 2) TILE_CASE(2, 3) TILE_CASE(2, 4) TILE_CASE(2, 5) TILE_CASE(2, 6)
            TILE_CASE(2, 7) TILE_CASE(2, 8) TILE_CASE(2, 9) TILE_CASE(2, 10) TILE_CASE(2, 11)
            default: tile_h(p, panel, k, x, ldx, 2, 12, y, ldy, live); return;
        }
    switch (T) {
        TILE_CASE(1, 1) TILE_CASE(1, 2) TILE_CASE(1, 3) TILE_CASE(1, 4) TILE_CASE(1, 5) TILE_CASE(1, 6)
        TILE_CASE(1, 7) TILE_CASE(1, 8) TILE_CASE(1, 9) TILE_CASE(1, 10) TILE_CASE(1, 11)
        default: tile_h(p, panel, k, x, ldx, 1, 12, y, ldy, live); return;
    }
}

/* Rows in tiles of four panels (up to three tokens) or two (up to twelve), the last panels
 * one at a time; tokens in tiles of balanced sizes (32 run as 11 + 11 + 10). */
static void gemm_h_avx512(const uint16_t *w, size_t ldw, uint32_t rows, uint32_t k, uint32_t ntok,
                          const float *x, size_t ldx, float *y, size_t ldy)
{
    const size_t panel = (size_t)DUCK_HOST_PANEL * ldw;
    uint32_t r = 0;
    if (ntok == 1)
        for (; r + GEMV_PANELS * DUCK_HOST_PANEL <= rows; r += GEMV_PANELS * DUCK_HOST_PANEL)
            gemv_panels_h(w + (size_t)r * ldw, panel, k, x, y + r);
    const uint32_t most = ntok <= 3 ? 4u : 2u;
    const uint32_t ntiles = (ntok + TILE_TOKENS - 1) / TILE_TOKENS;
    while (r < rows) {
        const uint32_t left = (rows - r + DUCK_HOST_PANEL - 1) / DUCK_HOST_PANEL;   /* panels */
        const uint32_t P = left >= most ? most : left >= 2 ? 2u : 1u;
        const uint32_t last = rows - r - (P - 1) * DUCK_HOST_PANEL;
        const uint32_t live = last < DUCK_HOST_PANEL ? last : DUCK_HOST_PANEL;
        for (uint32_t j = 0, t = 0; j < ntiles; j++) {
            const uint32_t T = (ntok - t + (ntiles - j) - 1) / (ntiles - j);
            tile_dispatch(w + (size_t)r * ldw, panel, k, x + t * ldx, ldx, (int)P, (int)T, y + t * ldy + r, ldy,
                          live);
            t += T;
        }
        r += P * DUCK_HOST_PANEL;
    }
}

/* 64 columns (four vectors) per pass over the rows. */
static void gemv_t_avx512(const float *p, const float *v, size_t ldv, uint32_t rows, uint32_t n, float *y)
{
    for (uint32_t c0 = 0; c0 < n; c0 += 64) {
        const uint32_t left = n - c0;
        const __mmask16 m0 = tail_mask(left), m1 = left > 16 ? tail_mask(left - 16) : 0;
        const __mmask16 m2 = left > 32 ? tail_mask(left - 32) : 0, m3 = left > 48 ? tail_mask(left - 48) : 0;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        for (uint32_t r = 0; r < rows; r++) {
            const float *vr = v + r * ldv + c0;
            const __m512 pr = _mm512_set1_ps(p[r]);
            a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m0, vr), pr, a0);
            a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m1, vr + 16), pr, a1);
            a2 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m2, vr + 32), pr, a2);
            a3 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m3, vr + 48), pr, a3);
        }
        _mm512_mask_storeu_ps(y + c0, m0, a0);
        _mm512_mask_storeu_ps(y + c0 + 16, m1, a1);
        _mm512_mask_storeu_ps(y + c0 + 32, m2, a2);
        _mm512_mask_storeu_ps(y + c0 + 48, m3, a3);
    }
}

#pragma GCC pop_options

/* Half values, the conversions and argmax: the AVX2 set's (gemv_t_h's chains are gemv_t's here as there). */
static const duck_host_kernels k_avx512 = {"avx512",
                                           gemm_avx512,
                                           dot_avx512,
                                           gemv_t_avx512,
                                           gemm_h_avx512,
                                           duck_host_softmax_exp_avx2,
                                           duck_host_gemv_t_h_avx2,
                                           duck_host_to_half_avx2,
                                           duck_host_to_float_avx2,
                                           duck_host_argmax_avx2};

const duck_host_kernels *duck_host_kernels_avx512(void)
{
    __builtin_cpu_init();
    const int ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                   __builtin_cpu_supports("f16c");
    return ok ? &k_avx512 : NULL;
}

#else

const duck_host_kernels *duck_host_kernels_avx512(void) { return NULL; }

#endif
