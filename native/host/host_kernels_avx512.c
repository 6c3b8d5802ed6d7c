/* AVX-512F host kernels: 16 lanes, tails through masked loads (a masked-off
 * lane is never read, so no row needs padding). One accumulator per sum,
 * four rows at a time for independent FMA chains and memory streams. Half
 * weights (packed panels) run through the AVX2 set's kernel. */
#include "host_kernels.h"

#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f")
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

/* Half weights: the AVX2 set's packed kernel (a panel of sixteen rows is two 8-lane vectors there);
 * half values, the conversions and argmax: the AVX2 set's too (gemv_t_h's chains are gemv_t's here as there). */
static const duck_host_kernels k_avx512 = {"avx512",
                                           gemm_avx512,
                                           dot_avx512,
                                           gemv_t_avx512,
                                           duck_host_gemm_h_avx2,
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
