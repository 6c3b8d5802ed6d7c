/* AVX-512 fp9 kernels (F + BW + VL; FMA). Same fp32 products as _ref; only
 * the order of the sums differs.
 *
 * The GEMVs decode 32 weights per step in 16-bit lanes: zero-extend the
 * magnitude bytes to words, shift each left by 4 (the word is then the
 * weight's bf16 bit pattern, value * 2^-112, exactly as fp9.h's shift by 20
 * gives in fp32), set bit 15 under a k-mask read straight from the 64-bit
 * sign word (32 signs per mask, in column order), and split the words into
 * fp32: even columns by a shift left by 16, odd columns by masking off the
 * low half. The activations are taken in the same even/odd order (permuted
 * once per panel into a buffer on the stack). That is 6 operations and 2
 * FMAs for 32 weights where the plain 32-bit decode (decode16) takes 8 and
 * 2; on the development machine (AMD Zen 5) the GEMV ran a third faster on
 * L2-resident weights (docs/fp9.md section 5). */
#include "kernels.h"

#include "pool.h"

#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma")
#include <immintrin.h>

#include "fp9_decode_avx512.h"

/* The same weights as fp32: the even columns in *even, the odd ones in *odd. */
static inline __attribute__((always_inline)) void decode32(const uint8_t *mag, const uint64_t *sign, int h,
                                                           __m512 *even, __m512 *odd)
{
    __m512i w = decode32_words(mag, sign, h);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* n activations (a multiple of 64) into the order decode32 gives: per 32
 * columns, the 16 even ones, then the 16 odd ones. */
static void even_odd(const float *x, uint32_t n, float *out)
{
    const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i io = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (uint32_t c = 0; c < n; c += 32) {
        __m512 lo = _mm512_loadu_ps(x + c), hi = _mm512_loadu_ps(x + c + 16);
        _mm512_store_ps(out + c, _mm512_permutex2var_ps(lo, ie, hi));
        _mm512_store_ps(out + c + 16, _mm512_permutex2var_ps(lo, io, hi));
    }
}

/* The sum of the 16 lanes, in the order hsum16x16 uses for every row, so a
 * row's result does not depend on which path reduced it. */
static inline float hsum16(__m512 a)
{
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
    return _mm_cvtss_f32(q);
}

/* [hsum16(a[0]), ..., hsum16(a[15])] in one vector. */
static inline __m512 hsum16x16(const __m512 a[16])
{
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)   /* quarters (0 + 2, 1 + 3) of two rows */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)   /* one quarter per row */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)   /* lanes (0 + 2, 1 + 3) */
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
    __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
    /* lane 4q + m of e holds row 4m + q */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, e);
}

static inline void store_out(float *y, uint32_t row, uint32_t rows, float v, int accumulate)
{
    if (row < rows)
        y[row] = accumulate ? y[row] + v : v;
}

/* Batch invariance. On fp32 activations (a CPU host's) every row's sum for a
 * token is taken in one order whatever the call's token count, so a sequence's
 * bits never depend on which sequences share its step (the host step is
 * batch-invariant too: tests/engine/test_batch.py). The order is the GEMV's:
 * per 2048-column panel, one FMA chain of 16 lanes over the panel's groups (of
 * each 32 columns the even ones, then the odd ones; where there are block
 * scales the chain is cut every 128 columns and folded into a second chain,
 * times the block's scale), then hsum16 times the output scale, added to y
 * panel by panel. gemv_tokens (1 .. 4 tokens, the weights decoded in
 * registers), gemv_narrow (one token, few columns) and gemm_invariant (more:
 * the weights decoded once into L1 for every token) all take it. */
#define GEMV_MAX_TOKENS 4

static inline __attribute__((always_inline)) void gemv_tokens(const fp9_matrix *m, uint32_t pair_begin,
                                                              uint32_t pair_end, const float *const *x,
                                                              float *const *y, int accumulate, const int NT)
{
    float xs[GEMV_MAX_TOKENS][FP9_PANEL_GROUPS * FP9_GROUP] __attribute__((aligned(64)));
    const float out_scale = m->prescale * 0x1p48f;
    const uint32_t groups = m->groups, sc = fp9_scale_cols(m);
    if (pair_begin >= pair_end)
        return;
    for (uint32_t g0 = 0; g0 < groups; g0 += FP9_PANEL_GROUPS) {
        const uint32_t ng = fp9_panel_groups(groups, g0);
        const int add = accumulate || g0 > 0;
        for (int i = 0; i < NT; i++)
            even_odd(x[i] + (size_t)g0 * FP9_GROUP, ng * FP9_GROUP, xs[i]);
        for (uint32_t p = pair_begin; p < pair_end; p++) {
            const fp9_block *run = fp9_pair_run(m, p, g0);
            const float *s0 = m->block_scales ? &m->block_scales[(size_t)(2 * p) * sc] : NULL;
            __m512 a[GEMV_MAX_TOKENS][2], t[GEMV_MAX_TOKENS][2];
            for (int i = 0; i < NT; i++)
                for (int r = 0; r < 2; r++)
                    a[i][r] = t[i][r] = _mm512_setzero_ps();
            for (uint32_t g = 0; g < ng; g++) {
                const fp9_block *blk = &run[g];
                _mm_prefetch((const char *)blk + DUCK_PREFETCH_BYTES, _MM_HINT_T0);
                _mm_prefetch((const char *)blk + DUCK_PREFETCH_BYTES + 64, _MM_HINT_T0);
                _mm_prefetch((const char *)blk + DUCK_PREFETCH_BYTES + 128, _MM_HINT_T0);
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    __m512 e0, o0, e1, o1;
                    decode32(blk->mag[0], &blk->sign[0], h, &e0, &o0);
                    decode32(blk->mag[1], &blk->sign[1], h, &e1, &o1);
                    for (int i = 0; i < NT; i++) {
                        __m512 xe = _mm512_load_ps(xs[i] + g * FP9_GROUP + 32 * h);
                        __m512 xo = _mm512_load_ps(xs[i] + g * FP9_GROUP + 32 * h + 16);
                        a[i][0] = _mm512_fmadd_ps(o0, xo, _mm512_fmadd_ps(e0, xe, a[i][0]));
                        a[i][1] = _mm512_fmadd_ps(o1, xo, _mm512_fmadd_ps(e1, xe, a[i][1]));
                    }
                }
                const uint32_t gg = g0 + g;
                if (s0 && ((gg & 1) || gg + 1 == groups)) {   /* end of a 128-column scale block */
                    __m512 k0 = _mm512_set1_ps(s0[gg / 2]), k1 = _mm512_set1_ps(s0[sc + gg / 2]);
                    for (int i = 0; i < NT; i++)
                        for (int r = 0; r < 2; r++) {
                            t[i][r] = _mm512_fmadd_ps(a[i][r], r ? k1 : k0, t[i][r]);
                            a[i][r] = _mm512_setzero_ps();
                        }
                }
            }
            for (int i = 0; i < NT; i++)
                for (int r = 0; r < 2; r++)
                    store_out(y[i], 2 * p + r, m->rows, hsum16(s0 ? t[i][r] : a[i][r]) * out_scale, add);
        }
    }
}

/* Many tokens in the GEMV's order: a micro-panel of INV_PAIRS row pairs is
 * decoded once per panel into an L1 buffer (per group and half: each row's
 * even, then odd columns, as decode32 gives them), then tiles of its rows by up
 * to INV_TOKENS tokens run the same chains as gemv_tokens, the weights loaded
 * from that buffer; a tile's sixteen (or fewer) sums come out of one
 * hsum16x16, which sums each row as hsum16 does. The activations of every
 * token are permuted once per panel (even_odd) into scratch slot 3. */
#define INV_PAIRS 2
#define INV_TOKENS 4          /* plain: 4 rows x 4 tokens, 16 chains */
#define INV_TOKENS_SCALED 2   /* block scales: a second chain each */
#define INV_BLOCK 32          /* tokens per pass: 256 KiB of activations at most */

static inline __attribute__((always_inline)) void inv_tile(const float *wd, uint32_t g0, uint32_t ng,
                                                           const float *xs, size_t xstride, const int R,
                                                           const int NT, const fp9_matrix *m, uint32_t p,
                                                           float *const *y, int add)
{
    const uint32_t groups = m->groups, sc = fp9_scale_cols(m);
    __m512 a[16], t[16];   /* chain i * R + r: token i, row 2p + r */
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++)
        a[j] = t[j] = _mm512_setzero_ps();
    for (uint32_t g = 0; g < ng; g++) {
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const float *w = wd + (size_t)(2 * g + h) * (32 * 2 * INV_PAIRS);
            const float *xg = xs + g * FP9_GROUP + 32 * h;
#pragma GCC unroll 4
            for (int i = 0; i < NT; i++) {
                __m512 xe = _mm512_load_ps(xg + i * xstride), xo = _mm512_load_ps(xg + i * xstride + 16);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++)
                    a[i * R + r] = _mm512_fmadd_ps(_mm512_load_ps(w + 32 * r + 16), xo,
                                                   _mm512_fmadd_ps(_mm512_load_ps(w + 32 * r), xe, a[i * R + r]));
            }
        }
        const uint32_t gg = g0 + g;
        if (m->block_scales && ((gg & 1) || gg + 1 == groups))
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m512 k = _mm512_set1_ps(m->block_scales[(size_t)(2 * p + r) * sc + gg / 2]);
#pragma GCC unroll 4
                for (int i = 0; i < NT; i++) {
                    t[i * R + r] = _mm512_fmadd_ps(a[i * R + r], k, t[i * R + r]);
                    a[i * R + r] = _mm512_setzero_ps();
                }
            }
    }
    float sums[16] __attribute__((aligned(64)));
    _mm512_store_ps(sums, _mm512_mul_ps(hsum16x16(m->block_scales ? t : a), _mm512_set1_ps(m->prescale * 0x1p48f)));
    for (int i = 0; i < NT; i++)
        for (int r = 0; r < R; r++)
            store_out(y[i], 2 * p + r, m->rows, sums[i * R + r], add);
}

#define INV_TILE(R, T) \
    case T: inv_tile(wd, g0, ng, xs + (size_t)t * cols, cols, R, T, m, p, y + c0 + t, add); break;

static void gemm_invariant(const fp9_matrix *m, uint32_t pair_begin, uint32_t pair_end, uint32_t ntok,
                           const float *const *x, float *const *y, int accumulate)
{
    float wd[FP9_PANEL_GROUPS * 2 * 32 * 2 * INV_PAIRS] __attribute__((aligned(64)));
    float stack_xs[GEMV_MAX_TOKENS * FP9_PANEL_GROUPS * FP9_GROUP] __attribute__((aligned(64)));
    const uint32_t groups = m->groups;
    const uint32_t tmax = m->block_scales ? INV_TOKENS_SCALED : INV_TOKENS;
    const uint32_t cols_max = fp9_panel_groups(groups, 0) * FP9_GROUP;
    float *xs = duck_thread_scratch(3, (size_t)(ntok < INV_BLOCK ? ntok : INV_BLOCK) * cols_max * sizeof(float));
    /* at most INV_BLOCK tokens per pass (their activations within L2); out of
     * memory, as many as the stack holds (the same bits either way) */
    const uint32_t chunk = xs ? (ntok < INV_BLOCK ? ntok : INV_BLOCK) : GEMV_MAX_TOKENS;
    if (!xs)
        xs = stack_xs;
    for (uint32_t c0 = 0; c0 < ntok; c0 += chunk) {
        const uint32_t nc = ntok - c0 < chunk ? ntok - c0 : chunk;
        const uint32_t ntiles = (nc + tmax - 1) / tmax;
        for (uint32_t g0 = 0; g0 < groups; g0 += FP9_PANEL_GROUPS) {
            const uint32_t ng = fp9_panel_groups(groups, g0), cols = ng * FP9_GROUP;
            const int add = accumulate || g0 > 0;
            for (uint32_t i = 0; i < nc; i++)
                even_odd(x[c0 + i] + (size_t)g0 * FP9_GROUP, cols, xs + (size_t)i * cols);
            for (uint32_t p = pair_begin; p < pair_end; p += INV_PAIRS) {
                const uint32_t np = pair_end - p < INV_PAIRS ? pair_end - p : INV_PAIRS;
                for (uint32_t q = 0; q < np; q++) {
                    const fp9_block *run = fp9_pair_run(m, p + q, g0);
                    for (uint32_t g = 0; g < ng; g++) {
                        _mm_prefetch((const char *)&run[g] + DUCK_PREFETCH_BYTES, _MM_HINT_T0);
                        _mm_prefetch((const char *)&run[g] + DUCK_PREFETCH_BYTES + 64, _MM_HINT_T0);
                        _mm_prefetch((const char *)&run[g] + DUCK_PREFETCH_BYTES + 128, _MM_HINT_T0);
                        for (int h = 0; h < 2; h++)
                            for (int r = 0; r < 2; r++) {
                                __m512 e, o;
                                float *w = wd + (size_t)(2 * g + h) * (32 * 2 * INV_PAIRS) + 32 * (2 * q + r);
                                decode32(run[g].mag[r], &run[g].sign[r], h, &e, &o);
                                _mm512_store_ps(w, e);
                                _mm512_store_ps(w + 16, o);
                            }
                    }
                }
                for (uint32_t j = 0, t = 0; j < ntiles; j++) {
                    const uint32_t nt = nc / ntiles + (j < nc % ntiles);
                    if (np == INV_PAIRS)
                        switch (nt) { INV_TILE(4, 1) INV_TILE(4, 2) INV_TILE(4, 3) INV_TILE(4, 4) default: break; }
                    else
                        switch (nt) { INV_TILE(2, 1) INV_TILE(2, 2) INV_TILE(2, 3) INV_TILE(2, 4) default: break; }
                    t += nt;
                }
            }
        }
    }
}

#undef INV_TILE

/* Narrow matrices (the down slices: K = 64 .. 256 columns, one token) have
 * too few columns to hide a horizontal sum per row: eight pairs go
 * together and their sixteen sums come out of one transposing reduction.
 * A leftover pair takes the same FMA chain and the same order of sums
 * (hsum16), so the result of a row does not depend on how rows are split. */
#define NARROW_MAX_GROUPS 4
#define NARROW_PAIRS 8

static inline __attribute__((always_inline)) __m512 narrow_row(const fp9_block *run, uint32_t groups, int r,
                                                               const float *xs, __m512 acc)
{
    for (uint32_t g = 0; g < groups; g++)
        for (int h = 0; h < 2; h++) {
            __m512 e, o;
            decode32(run[g].mag[r], &run[g].sign[r], h, &e, &o);
            acc = _mm512_fmadd_ps(e, _mm512_load_ps(xs + g * FP9_GROUP + 32 * h), acc);
            acc = _mm512_fmadd_ps(o, _mm512_load_ps(xs + g * FP9_GROUP + 32 * h + 16), acc);
        }
    return acc;
}

static void gemv_narrow(const fp9_matrix *m, uint32_t pair_begin, uint32_t pair_end, const float *x,
                        float *y, int accumulate)
{
    float xs[NARROW_MAX_GROUPS * FP9_GROUP] __attribute__((aligned(64)));
    const float out_scale = m->prescale * 0x1p48f;
    const uint32_t groups = m->groups;
    even_odd(x, groups * FP9_GROUP, xs);
    uint32_t p = pair_begin;
    for (; p + NARROW_PAIRS <= pair_end; p += NARROW_PAIRS) {
        const fp9_block *run = fp9_pair_run(m, p, 0);   /* pair p + i at run + i * groups */
        for (uint32_t off = 0; off < NARROW_PAIRS * groups * sizeof(fp9_block); off += 64)
            _mm_prefetch((const char *)run + off + DUCK_PREFETCH_BYTES, _MM_HINT_T0);
        __m512 a[16];
#pragma GCC unroll 16
        for (int r = 0; r < 16; r++)
            a[r] = narrow_row(run + (size_t)(r >> 1) * groups, groups, r & 1, xs, _mm512_setzero_ps());
        __m512 sums = _mm512_mul_ps(hsum16x16(a), _mm512_set1_ps(out_scale));
        uint32_t row = 2 * p;
        __mmask16 live = row + 16 <= m->rows ? (__mmask16)0xFFFF : (__mmask16)((1u << (m->rows - row)) - 1);
        if (accumulate)
            sums = _mm512_add_ps(sums, _mm512_maskz_loadu_ps(live, y + row));
        _mm512_mask_storeu_ps(y + row, live, sums);
    }
    for (; p < pair_end; p++) {
        const fp9_block *run = fp9_pair_run(m, p, 0);
        for (int r = 0; r < 2; r++)
            store_out(y, 2 * p + r, m->rows, hsum16(narrow_row(run, groups, r, xs, _mm512_setzero_ps())) * out_scale,
                      accumulate);
    }
}

#define GEMM_PAIRS 16   /* rows per tile: 32, two vectors */
#define GEMM_TOKENS 12  /* tokens per tile: 24 accumulators */

static void decode_panel(const fp9_matrix *m, uint32_t p, uint32_t np, uint32_t g, uint32_t ng, float *wt,
                         const char **ahead, const char *ahead_end)
{
    decode_panel_as(m, p, np, g, ng, wt, ahead, ahead_end, 0);
}

/* A tile's sums c0 (rows 0-15), c1 (16-31) of T tokens, times the rows' scales, into (or, if
 * load, onto) y[t][row ..], its first `live` rows only. */
static inline __attribute__((always_inline)) void tile_out(const __m512 *c0, const __m512 *c1, const int T,
                                                           float *const *y, uint32_t row, uint32_t live,
                                                           const float *scale, int load)
{
    const __mmask16 m0 = live >= 16 ? 0xFFFF : (__mmask16)((1u << live) - 1);
    const __mmask16 m1 = live >= 32 ? 0xFFFF : live > 16 ? (__mmask16)((1u << (live - 16)) - 1) : 0;
    const __m512 s0 = _mm512_load_ps(scale), s1 = _mm512_load_ps(scale + 16);
#pragma GCC unroll 12
    for (int i = 0; i < T; i++) {
        __m512 y0 = load ? _mm512_maskz_loadu_ps(m0, y[i] + row) : _mm512_setzero_ps();
        __m512 y1 = load ? _mm512_maskz_loadu_ps(m1, y[i] + row + 16) : _mm512_setzero_ps();
        _mm512_mask_storeu_ps(y[i] + row, m0, _mm512_fmadd_ps(c0[i], s0, y0));
        _mm512_mask_storeu_ps(y[i] + row + 16, m1, _mm512_fmadd_ps(c1[i], s1, y1));
    }
}

static inline __attribute__((always_inline)) void tile(const float *wt, uint32_t n, const float *const *x,
                                                       uint32_t k0, const int T, float *const *y, uint32_t row,
                                                       uint32_t live, const float *scale, int load)
{
    __m512 c0[GEMM_TOKENS], c1[GEMM_TOKENS];
    const float *xs[GEMM_TOKENS];
#pragma GCC unroll 12
    for (int i = 0; i < T; i++) {
        xs[i] = x[i] + k0;
        c0[i] = c1[i] = _mm512_setzero_ps();
    }
    for (uint32_t k = 0; k < n; k++) {
        __m512 w0 = _mm512_load_ps(wt + 32 * k), w1 = _mm512_load_ps(wt + 32 * k + 16);
#pragma GCC unroll 12
        for (int i = 0; i < T; i++) {
            __m512 b = _mm512_set1_ps(xs[i][k]);
            c0[i] = _mm512_fmadd_ps(w0, b, c0[i]);
            c1[i] = _mm512_fmadd_ps(w1, b, c1[i]);
        }
    }
    tile_out(c0, c1, T, y, row, live, scale, load);
}

#include "gemm_tokens.h"

static void gemm_avx512(const fp9_matrix *m, uint32_t pair_begin, uint32_t pair_end, uint32_t ntok,
                        const float *const *x, float *const *y, int accumulate)
{
    switch (ntok) {
    case 0: return;
    case 1:
        if (m->groups <= NARROW_MAX_GROUPS && !m->block_scales)
            gemv_narrow(m, pair_begin, pair_end, x[0], y[0], accumulate);
        else
            gemv_tokens(m, pair_begin, pair_end, x, y, accumulate, 1);
        return;
    case 2: gemv_tokens(m, pair_begin, pair_end, x, y, accumulate, 2); return;
    case 3: gemv_tokens(m, pair_begin, pair_end, x, y, accumulate, 3); return;
    case 4: gemv_tokens(m, pair_begin, pair_end, x, y, accumulate, 4); return;
    default: break;
    }
    if (duck_kernels_batch_invariant())
        gemm_invariant(m, pair_begin, pair_end, ntok, x, y, accumulate);
    else
        gemm_tokens(m, pair_begin, pair_end, ntok, x, y, accumulate);
}

#pragma GCC pop_options

/* The bf16 set (avx512-bf16): where every activation of a GEMM call is exactly a
 * bf16 (a GPU host sends them so: fp9_prepare_x_bf16), the tile multiplies bf16
 * pairs with VDPBF16PS, two products per lane and instruction where the FMA makes
 * one. Exact products (bf16 x bf16 fits fp32), summed in fp32 in another order
 * than the FMA tile's; the weights are decoded to bf16 exactly (decode_panel_as).
 * Calls of other activations, and of few tokens (the GEMVs), are avx512's. */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")

static inline __attribute__((always_inline)) void tile_bf16(const float *wt, uint32_t n, const uint32_t *const *x,
                                                            uint32_t k0, const int T, float *const *y, uint32_t row,
                                                            uint32_t live, const float *scale, int load)
{
    const uint32_t *pairs = (const uint32_t *)wt;
    __m512 c0[GEMM_TOKENS], c1[GEMM_TOKENS];
    const uint32_t *xs[GEMM_TOKENS];
#pragma GCC unroll 12
    for (int i = 0; i < T; i++) {
        xs[i] = x[i] + k0 / 2;
        c0[i] = c1[i] = _mm512_setzero_ps();
    }
    for (uint32_t k = 0; k < n / 2; k++) {
        __m512bh w0 = (__m512bh)_mm512_load_si512(pairs + 32 * k);
        __m512bh w1 = (__m512bh)_mm512_load_si512(pairs + 32 * k + 16);
#pragma GCC unroll 12
        for (int i = 0; i < T; i++) {
            __m512bh b = (__m512bh)_mm512_set1_epi32((int)xs[i][k]);
            c0[i] = _mm512_dpbf16_ps(c0[i], w0, b);
            c1[i] = _mm512_dpbf16_ps(c1[i], w1, b);
        }
    }
    tile_out(c0, c1, T, y, row, live, scale, load);
}

static void decode_panel_pairs(const fp9_matrix *m, uint32_t p, uint32_t np, uint32_t g, uint32_t ng, float *wt,
                               const char **ahead, const char *ahead_end)
{
    decode_panel_as(m, p, np, g, ng, wt, ahead, ahead_end, 1);
}

#define decode_panel decode_panel_pairs
#define tile tile_bf16
#define GEMM_X_T uint32_t
#define GEMM_FN gemm_tokens_bf16
#define GEMM_OUT_EXTRA 0x1p-64f   /* the weights decoded times 2^64 */
#include "gemm_tokens.h"
#undef decode_panel
#undef tile

/* x's rows (cols values each) as bf16 pairs, contiguous in this thread's buffer,
 * rows[t] the row of token t (rows may be NULL); rows past ntok up to a multiple
 * of pad are zeros. NULL when a value is not exactly a bf16 (or no memory): the
 * caller takes the FMA path. */
const uint32_t *duck_bf16_rows(const float *const *x, uint32_t ntok, uint32_t pad, uint32_t cols,
                               const uint32_t **rows)
{
    const uint32_t padded = (ntok + pad - 1) / pad * pad;
    uint32_t *buf = duck_thread_scratch(0, (size_t)padded * cols * 2);
    if (!buf)
        return NULL;
    for (uint32_t t = 0; t < ntok; t++) {
        uint32_t *out = buf + (size_t)t * cols / 2;
        for (uint32_t c = 0; c < cols; c += 32) {
            __m512 lo = _mm512_loadu_ps(x[t] + c), hi = _mm512_loadu_ps(x[t] + c + 16);
            const __m512i low_bits = _mm512_set1_epi32(0xFFFF);
            if (_mm512_test_epi32_mask(_mm512_castps_si512(lo), low_bits) |
                _mm512_test_epi32_mask(_mm512_castps_si512(hi), low_bits))
                return NULL;
            _mm512_storeu_si512(out + c / 2, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));   /* columns c .. c + 31 in order */
        }
        if (rows)
            rows[t] = out;
    }
    memset(buf + (size_t)ntok * cols / 2, 0, (size_t)(padded - ntok) * cols / 2 * sizeof(uint32_t));
    return buf;
}

static void gemm_avx512_bf16(const fp9_matrix *m, uint32_t pair_begin, uint32_t pair_end, uint32_t ntok,
                             const float *const *x, float *const *y, int accumulate)
{
    const uint32_t *rows[256];
    if (ntok > GEMV_MAX_TOKENS && ntok <= 256 && pair_begin < pair_end &&
        duck_bf16_rows(x, ntok, 1, m->groups * FP9_GROUP, rows)) {
        gemm_tokens_bf16(m, pair_begin, pair_end, ntok, rows, y, accumulate);
        return;
    }
    gemm_avx512(m, pair_begin, pair_end, ntok, x, y, accumulate);
}

#pragma GCC pop_options

static const duck_kernels k_avx512 = {"avx512", gemm_avx512};
static const duck_kernels k_avx512_bf16 = {"avx512-bf16", gemm_avx512_bf16};

const duck_kernels *duck_kernels_avx512_bf16(void)
{
    __builtin_cpu_init();
    if (!duck_kernels_avx512() || !__builtin_cpu_supports("avx512bf16"))
        return NULL;
    return &k_avx512_bf16;
}

const duck_kernels *duck_kernels_avx512(void)
{
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("fma"))
        return NULL;
    return &k_avx512;
}

#else

const duck_kernels *duck_kernels_avx512(void) { return NULL; }
const duck_kernels *duck_kernels_avx512_bf16(void) { return NULL; }

#endif
