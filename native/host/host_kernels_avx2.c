/* AVX2+FMA host kernels: 8 lanes, tails through maskload (masked-off lanes
 * are not read). fp32 weights: same shape as the AVX-512 set, one accumulator
 * per sum, four rows at a time, their four sums reduced in one vector. Half
 * weights (packed in panels of sixteen rows) run with the rows in the lanes:
 * a register tile of sixteen rows and up to six tokens, widened with F16C as
 * they are loaded. */
#include "host_kernels.h"

#include <math.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

/* loadu(ones_then_zeros + 8 - n) has its first n lanes set */
static const int32_t ones_then_zeros[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

static inline __m256i tail_mask(uint32_t lanes)
{
    return _mm256_loadu_si256((const __m256i *)(ones_then_zeros + 8 - (lanes > 8 ? 8 : lanes)));
}

/* Every sum of a vector's lanes has one order, ((0+1)+(2+3)) + ((4+5)+(6+7)):
 * hsum for one vector, hsum4 for four at once (four rows of gemm in one
 * vector: a few shuffles for four sums instead of a few for each). */
static inline float hsum(__m256 v)
{
    const __m256 h = _mm256_hadd_ps(v, v);
    const __m256 q = _mm256_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1)));
}

static inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3)
{
    const __m256 q = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1));
}

/* The one way every sum is formed: full vectors in index order, then the tail. */
static inline float dot8(const float *a, const float *b, uint32_t full, uint32_t rest, __m256i tail)
{
    __m256 acc = _mm256_setzero_ps();
    for (uint32_t c = 0; c < full; c += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), acc);
    if (rest)
        acc = _mm256_fmadd_ps(_mm256_maskload_ps(a + full, tail), _mm256_maskload_ps(b + full, tail), acc);
    return hsum(acc);
}

static float dot_avx2(const float *a, const float *b, uint32_t n)
{
    return dot8(a, b, n & ~7u, n & 7u, tail_mask(n & 7u));
}

/* Four rows' sums with one token, columns [0, n) of w0..w3 and xt, carried in
 * a[4]: full vectors in index order, then the tail (masked-off lanes read as
 * zero). gemm forms every sum through this chain. */
static inline void fma4(const float *w0, const float *w1, const float *w2, const float *w3, const float *xt,
                        uint32_t n, __m256 a[4])
{
    const uint32_t full = n & ~7u;
    __m256 a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
    for (uint32_t c = 0; c < full; c += 8) {
        const __m256 xv = _mm256_loadu_ps(xt + c);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + c), xv, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + c), xv, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + c), xv, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + c), xv, a3);
    }
    if (n & 7u) {
        const __m256i tail = tail_mask(n & 7u);
        const __m256 xv = _mm256_maskload_ps(xt + full, tail);
        a0 = _mm256_fmadd_ps(_mm256_maskload_ps(w0 + full, tail), xv, a0);
        a1 = _mm256_fmadd_ps(_mm256_maskload_ps(w1 + full, tail), xv, a1);
        a2 = _mm256_fmadd_ps(_mm256_maskload_ps(w2 + full, tail), xv, a2);
        a3 = _mm256_fmadd_ps(_mm256_maskload_ps(w3 + full, tail), xv, a3);
    }
    a[0] = a0, a[1] = a1, a[2] = a2, a[3] = a3;
}

/* fma4 for three tokens at once: twelve independent chains, where one token's
 * four leave the FMA units waiting on their latency (about 40 % of the peak);
 * each sum's chain is fma4's, so the results are the same bits. */
static inline void fma4x3(const float *w0, const float *w1, const float *w2, const float *w3, const float *x0,
                          const float *x1, const float *x2, uint32_t n, __m256 a[3][4])
{
    const uint32_t full = n & ~7u;
    __m256 a00 = a[0][0], a01 = a[0][1], a02 = a[0][2], a03 = a[0][3];
    __m256 a10 = a[1][0], a11 = a[1][1], a12 = a[1][2], a13 = a[1][3];
    __m256 a20 = a[2][0], a21 = a[2][1], a22 = a[2][2], a23 = a[2][3];
#define FMA4X3_STEP(LOAD_X, LOAD_W, c)                                                                        \
    do {                                                                                                      \
        const __m256 v0 = LOAD_X(x0 + (c)), v1 = LOAD_X(x1 + (c)), v2 = LOAD_X(x2 + (c));                     \
        __m256 w = LOAD_W(w0 + (c));                                                                          \
        a00 = _mm256_fmadd_ps(w, v0, a00), a10 = _mm256_fmadd_ps(w, v1, a10), a20 = _mm256_fmadd_ps(w, v2, a20); \
        w = LOAD_W(w1 + (c));                                                                                 \
        a01 = _mm256_fmadd_ps(w, v0, a01), a11 = _mm256_fmadd_ps(w, v1, a11), a21 = _mm256_fmadd_ps(w, v2, a21); \
        w = LOAD_W(w2 + (c));                                                                                 \
        a02 = _mm256_fmadd_ps(w, v0, a02), a12 = _mm256_fmadd_ps(w, v1, a12), a22 = _mm256_fmadd_ps(w, v2, a22); \
        w = LOAD_W(w3 + (c));                                                                                 \
        a03 = _mm256_fmadd_ps(w, v0, a03), a13 = _mm256_fmadd_ps(w, v1, a13), a23 = _mm256_fmadd_ps(w, v2, a23); \
    } while (0)
    for (uint32_t c = 0; c < full; c += 8)
        FMA4X3_STEP(_mm256_loadu_ps, _mm256_loadu_ps, c);
    if (n & 7u) {
        const __m256i tail = tail_mask(n & 7u);
#define MASKED(p) _mm256_maskload_ps(p, tail)
        FMA4X3_STEP(MASKED, MASKED, full);
#undef MASKED
    }
#undef FMA4X3_STEP
    a[0][0] = a00, a[0][1] = a01, a[0][2] = a02, a[0][3] = a03;
    a[1][0] = a10, a[1][1] = a11, a[1][2] = a12, a[1][3] = a13;
    a[2][0] = a20, a[2][1] = a21, a[2][2] = a22, a[2][3] = a23;
}

/* fma4 for two tokens at once: eight chains, enough to keep both FMA units
 * busy; each sum's chain is fma4's. */
static inline void fma4x2(const float *w0, const float *w1, const float *w2, const float *w3, const float *x0,
                          const float *x1, uint32_t n, __m256 a[2][4])
{
    const uint32_t full = n & ~7u;
    __m256 a00 = a[0][0], a01 = a[0][1], a02 = a[0][2], a03 = a[0][3];
    __m256 a10 = a[1][0], a11 = a[1][1], a12 = a[1][2], a13 = a[1][3];
#define FMA4X2_STEP(LOAD_X, LOAD_W, c)                                                \
    do {                                                                              \
        const __m256 v0 = LOAD_X(x0 + (c)), v1 = LOAD_X(x1 + (c));                    \
        __m256 w = LOAD_W(w0 + (c));                                                  \
        a00 = _mm256_fmadd_ps(w, v0, a00), a10 = _mm256_fmadd_ps(w, v1, a10);         \
        w = LOAD_W(w1 + (c));                                                         \
        a01 = _mm256_fmadd_ps(w, v0, a01), a11 = _mm256_fmadd_ps(w, v1, a11);         \
        w = LOAD_W(w2 + (c));                                                         \
        a02 = _mm256_fmadd_ps(w, v0, a02), a12 = _mm256_fmadd_ps(w, v1, a12);         \
        w = LOAD_W(w3 + (c));                                                         \
        a03 = _mm256_fmadd_ps(w, v0, a03), a13 = _mm256_fmadd_ps(w, v1, a13);         \
    } while (0)
    for (uint32_t c = 0; c < full; c += 8)
        FMA4X2_STEP(_mm256_loadu_ps, _mm256_loadu_ps, c);
    if (n & 7u) {
        const __m256i tail = tail_mask(n & 7u);
#define MASKED(p) _mm256_maskload_ps(p, tail)
        FMA4X2_STEP(MASKED, MASKED, full);
#undef MASKED
    }
#undef FMA4X2_STEP
    a[0][0] = a00, a[0][1] = a01, a[0][2] = a02, a[0][3] = a03;
    a[1][0] = a10, a[1][1] = a11, a[1][2] = a12, a[1][3] = a13;
}

/* Four rows' sums with nt tokens (rows ldx apart), carried in a[nt][4]: three
 * tokens at a time, and what is left over in pairs (a count of 3k + 1 ends
 * with two pairs instead of a lone token, whose four chains wait on the FMA
 * latency); one token alone only when nt is 1. */
static inline void fma4_tokens(const float *w0, const float *w1, const float *w2, const float *w3, const float *x,
                               size_t ldx, uint32_t nt, uint32_t n, __m256 (*a)[4])
{
    const uint32_t triples = nt % 3 == 1 && nt >= 4 ? nt / 3 - 1 : nt / 3;
    uint32_t t = 0;
    for (; t < 3 * triples; t += 3)
        fma4x3(w0, w1, w2, w3, x + t * ldx, x + (t + 1) * ldx, x + (t + 2) * ldx, n, a + t);
    for (; t + 2 <= nt; t += 2)
        fma4x2(w0, w1, w2, w3, x + t * ldx, x + (t + 1) * ldx, n, a + t);
    if (t < nt)
        fma4(w0, w1, w2, w3, x + t * ldx, n, a[t]);
}

#define TOKEN_TILE 32u    /* tokens whose sums are carried at once */

static void gemm_avx2(const float *w, size_t ldw, uint32_t rows, uint32_t k, uint32_t ntok,
                      const float *x, size_t ldx, float *y, size_t ldy)
{
    const uint32_t full = k & ~7u, rest = k & 7u;
    const __m256i tail = tail_mask(rest);
    __m256 acc[TOKEN_TILE][4];
    uint32_t r = 0;
    for (; r + 4 <= rows; r += 4) {
        const float *w0 = w + r * ldw;
        for (uint32_t t0 = 0; t0 < ntok; t0 += TOKEN_TILE) {
            const uint32_t nt = ntok - t0 < TOKEN_TILE ? ntok - t0 : TOKEN_TILE;
            for (uint32_t t = 0; t < nt; t++)
                acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = _mm256_setzero_ps();
            fma4_tokens(w0, w0 + ldw, w0 + 2 * ldw, w0 + 3 * ldw, x + t0 * ldx, ldx, nt, k, acc);
            for (uint32_t t = 0; t < nt; t++)
                _mm_storeu_ps(y + (t0 + t) * ldy + r, hsum4(acc[t][0], acc[t][1], acc[t][2], acc[t][3]));
        }
    }
    for (; r < rows; r++)
        for (uint32_t t = 0; t < ntok; t++)
            y[t * ldy + r] = dot8(w + r * ldw, x + t * ldx, full, rest, tail);
}

/* Half weights, packed (host_kernels.h): a panel's column is sixteen halves,
 * two vectors once widened. Per column a tile loads them, broadcasts each
 * token's activation and makes two FMAs per token; each output is one FMA
 * chain over the columns in order, whatever the tile, so the tiles below
 * only choose how many chains run at once. */
#define TILE_TOKENS 6u    /* 12 accumulators, 2 row vectors, 1 broadcast: 15 of the 16 registers */
#define GEMV_PANELS 4u    /* one token: four panels at once, eight chains */

static inline __m256 widen8(const uint16_t *h)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

/* y[row i] for i < live (<= 16) from two vectors of eight rows: plain stores for a whole panel. */
static inline void store16(float *y, __m256 a0, __m256 a1, uint32_t live)
{
    if (live == DUCK_HOST_PANEL) {
        _mm256_storeu_ps(y, a0);
        _mm256_storeu_ps(y + 8, a1);
        return;
    }
    _mm256_maskstore_ps(y, tail_mask(live), a0);
    if (live > 8)
        _mm256_maskstore_ps(y + 8, tail_mask(live - 8), a1);
}

/* T tokens (x rows ldx apart, y rows ldy apart) against one panel p, k columns. */
static inline __attribute__((always_inline)) void tile_h(const uint16_t *p, uint32_t k, const float *x, size_t ldx,
                                                         const int T, float *y, size_t ldy, uint32_t live)
{
    __m256 c0[TILE_TOKENS], c1[TILE_TOKENS];
#pragma GCC unroll 6
    for (int i = 0; i < T; i++)
        c0[i] = c1[i] = _mm256_setzero_ps();
    for (uint32_t c = 0; c < k; c++) {
        const __m256 w0 = widen8(p + DUCK_HOST_PANEL * c), w1 = widen8(p + DUCK_HOST_PANEL * c + 8);
#pragma GCC unroll 6
        for (int i = 0; i < T; i++) {
            const __m256 b = _mm256_broadcast_ss(x + i * ldx + c);
            c0[i] = _mm256_fmadd_ps(w0, b, c0[i]);
            c1[i] = _mm256_fmadd_ps(w1, b, c1[i]);
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < T; i++)
        store16(y + i * ldy, c0[i], c1[i], live);
}

/* One token against GEMV_PANELS whole panels at once (the latency of one panel's two chains hidden). */
static void gemv_panels_h(const uint16_t *p, size_t panel, uint32_t k, const float *x, float *y)
{
    __m256 a[2 * GEMV_PANELS];
    for (uint32_t i = 0; i < 2 * GEMV_PANELS; i++)
        a[i] = _mm256_setzero_ps();
    for (uint32_t c = 0; c < k; c++) {
        const __m256 b = _mm256_broadcast_ss(x + c);
        const uint16_t *q = p + DUCK_HOST_PANEL * c;
#pragma GCC unroll 4
        for (uint32_t j = 0; j < GEMV_PANELS; j++) {
            a[2 * j] = _mm256_fmadd_ps(widen8(q + j * panel), b, a[2 * j]);
            a[2 * j + 1] = _mm256_fmadd_ps(widen8(q + j * panel + 8), b, a[2 * j + 1]);
        }
    }
    for (uint32_t i = 0; i < 2 * GEMV_PANELS; i++)
        _mm256_storeu_ps(y + 8 * i, a[i]);
}

static void gemm_h_avx2(const uint16_t *w, size_t ldw, uint32_t rows, uint32_t k, uint32_t ntok,
                        const float *x, size_t ldx, float *y, size_t ldy)
{
    const size_t panel = (size_t)DUCK_HOST_PANEL * ldw;
    uint32_t r = 0;
    if (ntok == 1)
        for (; r + GEMV_PANELS * DUCK_HOST_PANEL <= rows; r += GEMV_PANELS * DUCK_HOST_PANEL)
            gemv_panels_h(w + (size_t)r * ldw, panel, k, x, y + r);
    /* tiles of balanced sizes: 16 tokens run as 6 + 5 + 5 */
    const uint32_t ntiles = (ntok + TILE_TOKENS - 1) / TILE_TOKENS;
    for (; r < rows; r += DUCK_HOST_PANEL) {
        const uint16_t *p = w + (size_t)r * ldw;
        const uint32_t live = rows - r < DUCK_HOST_PANEL ? rows - r : DUCK_HOST_PANEL;
        for (uint32_t j = 0, t = 0; j < ntiles; j++) {
            const uint32_t T = (ntok - t + (ntiles - j) - 1) / (ntiles - j);
            const float *xt = x + t * ldx;
            float *yt = y + t * ldy + r;
            switch (T) {
            case 1: tile_h(p, k, xt, ldx, 1, yt, ldy, live); break;
            case 2: tile_h(p, k, xt, ldx, 2, yt, ldy, live); break;
            case 3: tile_h(p, k, xt, ldx, 3, yt, ldy, live); break;
            case 4: tile_h(p, k, xt, ldx, 4, yt, ldy, live); break;
            case 5: tile_h(p, k, xt, ldx, 5, yt, ldy, live); break;
            default: tile_h(p, k, xt, ldx, 6, yt, ldy, live); break;
            }
            t += T;
        }
    }
}

/* 64 columns (eight vectors, eight chains) per pass over the rows; plain
 * loads where the 64 are whole, masked ones for the last columns. Each
 * column's sum is one chain over the rows in order. */
static inline __attribute__((always_inline)) void gemv_t_block(const float *p, const float *v, size_t ldv,
                                                               uint32_t rows, float *y, uint32_t left)
{
    __m256i m[8];
    for (int i = 0; i < 8; i++)
        m[i] = tail_mask(left > 8u * i ? left - 8u * i : 0);
    __m256 a[8];
    for (int i = 0; i < 8; i++)
        a[i] = _mm256_setzero_ps();
    for (uint32_t r = 0; r < rows; r++) {
        const float *vr = v + r * ldv;
        const __m256 pr = _mm256_broadcast_ss(p + r);
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++)
            a[i] = _mm256_fmadd_ps(left >= 64 ? _mm256_loadu_ps(vr + 8 * i) : _mm256_maskload_ps(vr + 8 * i, m[i]),
                                   pr, a[i]);
    }
    for (int i = 0; i < 8; i++) {
        if (left >= 8u * (i + 1))
            _mm256_storeu_ps(y + 8 * i, a[i]);
        else if (left > 8u * i)
            _mm256_maskstore_ps(y + 8 * i, m[i], a[i]);
    }
}

static void gemv_t_avx2(const float *p, const float *v, size_t ldv, uint32_t rows, uint32_t n, float *y)
{
    uint32_t c0 = 0;
    for (; c0 + 64 <= n; c0 += 64)
        gemv_t_block(p, v + c0, ldv, rows, y + c0, 64);
    if (c0 < n)
        gemv_t_block(p, v + c0, ldv, rows, y + c0, n - c0);
}

/* gemv_t_block over half values: each row's 64 columns widened as they are
 * loaded (F16C), the same chains. A short block (left < 64) widens its row
 * into a zeroed row of 64 first. */
static inline __attribute__((always_inline)) void gemv_t_h_block(const float *p, const uint16_t *v, size_t ldv,
                                                                 uint32_t rows, float *y, uint32_t left)
{
    __m256 a[8];
    for (int i = 0; i < 8; i++)
        a[i] = _mm256_setzero_ps();
    float row[64] __attribute__((aligned(32))) = {0};
    for (uint32_t r = 0; r < rows; r++) {
        const uint16_t *vr = v + r * ldv;
        const __m256 pr = _mm256_broadcast_ss(p + r);
        if (left >= 64) {
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++)
                a[i] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(vr + 8 * i))), pr, a[i]);
        } else {
            for (uint32_t c = 0; c < left; c++)
                row[c] = _cvtsh_ss(vr[c]);
            for (int i = 0; i < 8; i++)
                a[i] = _mm256_fmadd_ps(_mm256_load_ps(row + 8 * i), pr, a[i]);
        }
    }
    for (int i = 0; i < 8; i++) {
        if (left >= 8u * (i + 1))
            _mm256_storeu_ps(y + 8 * i, a[i]);
        else if (left > 8u * i)
            _mm256_maskstore_ps(y + 8 * i, tail_mask(left - 8u * i), a[i]);
    }
}

void duck_host_gemv_t_h_avx2(const float *p, const uint16_t *v, size_t ldv, uint32_t rows, uint32_t n, float *y)
{
    uint32_t c0 = 0;
    for (; c0 + 64 <= n; c0 += 64)
        gemv_t_h_block(p, v + c0, ldv, rows, y + c0, 64);
    if (c0 < n)
        gemv_t_h_block(p, v + c0, ldv, rows, y + c0, n - c0);
}

void duck_host_to_half_avx2(const float *x, uint32_t n, uint16_t *out)
{
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; i++)
        out[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

void duck_host_to_float_avx2(const uint16_t *h, uint32_t n, float *out)
{
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < n; i++)
        out[i] = _cvtsh_ss(h[i]);
}

/* Two passes: the largest value (four chains of maxima, NaN noted on the way: then
 * the first NaN is the answer), then the first index holding it. */
uint32_t duck_host_argmax_avx2(const float *x, uint32_t n)
{
    const uint32_t full = n & ~31u;
    __m256 m[4], nan = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++)
        m[j] = _mm256_set1_ps(-INFINITY);
    for (uint32_t i = 0; i < full; i += 32)
        for (int j = 0; j < 4; j++) {
            const __m256 v = _mm256_loadu_ps(x + i + 8 * j);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            m[j] = _mm256_max_ps(m[j], v);
        }
    const __m256 m4 = _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3]));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m4), _mm256_extractf128_ps(m4, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    float top = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
    int any_nan = _mm256_movemask_ps(nan) != 0;
    for (uint32_t i = full; i < n; i++) {
        any_nan |= isnan(x[i]);
        top = x[i] > top ? x[i] : top;
    }
    if (any_nan)
        for (uint32_t i = 0; i < n; i++)
            if (isnan(x[i]))
                return i;
    const __m256 t = _mm256_set1_ps(top);
    for (uint32_t i = 0; i < full; i += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), t, _CMP_EQ_OQ));
        if (hit)
            return i + (uint32_t)__builtin_ctz((unsigned)hit);
    }
    for (uint32_t i = full; i < n; i++)
        if (x[i] == top)
            return i;
    return 0;   /* not reached: top is one of x */
}

/* e^x, x <= 0 here (a score less the largest): Cephes' expf in 8 lanes. x = n ln2 + r
 * with |r| <= ln2 / 2 (ln2 in two parts, so r is exact), e^r a degree-7 polynomial,
 * 2^n put into the exponent; x below -87.3 gives 2^-126 where expf underflows,
 * nothing beside the largest score's 1. */
static inline __m256 exp_avx2(__m256 x)
{
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365447504f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

float duck_host_softmax_exp_avx2(float *s, uint32_t n, float scale)
{
    const uint32_t full = n & ~7u, rest = n & 7u;
    const __m256i tail = tail_mask(rest);
    const __m256 sc = _mm256_set1_ps(scale);
    __m256 top = _mm256_set1_ps(-INFINITY);
    for (uint32_t j = 0; j < full; j += 8) {
        const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(s + j), sc);
        _mm256_storeu_ps(s + j, v);
        top = _mm256_max_ps(top, v);
    }
    if (rest) {
        const __m256 v = _mm256_mul_ps(_mm256_maskload_ps(s + full, tail), sc);
        _mm256_maskstore_ps(s + full, tail, v);
        top = _mm256_blendv_ps(top, _mm256_max_ps(top, v), _mm256_castsi256_ps(tail));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    const __m256 shift = _mm256_set1_ps(_mm_cvtss_f32(m));
    __m256 sum = _mm256_setzero_ps();
    for (uint32_t j = 0; j < full; j += 8) {
        const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift));
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    if (rest) {
        const __m256 e = _mm256_and_ps(exp_avx2(_mm256_sub_ps(_mm256_maskload_ps(s + full, tail), shift)),
                                       _mm256_castsi256_ps(tail));
        _mm256_maskstore_ps(s + full, tail, e);
        sum = _mm256_add_ps(sum, e);
    }
    return hsum(sum);
}

#pragma GCC pop_options

static const duck_host_kernels k_avx2 = {"avx2",
                                         gemm_avx2,
                                         dot_avx2,
                                         gemv_t_avx2,
                                         gemm_h_avx2,
                                         duck_host_softmax_exp_avx2,
                                         duck_host_gemv_t_h_avx2,
                                         duck_host_to_half_avx2,
                                         duck_host_to_float_avx2,
                                         duck_host_argmax_avx2};

const duck_host_kernels *duck_host_kernels_avx2(void)
{
    __builtin_cpu_init();
    const int ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    return ok ? &k_avx2 : NULL;
}

#else

const duck_host_kernels *duck_host_kernels_avx2(void) { return NULL; }

#endif
