/* AVX2+FMA fp9 kernels. Decoding is integer work: zero-extend the magnitude
 * bytes, shift them into the fp32 exponent/mantissa position, XOR the sign
 * bit in; the rebias lives in the prepared activation and the output scale,
 * so there is no add. The rows of a GEMV share every activation load. */
#include "kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include <immintrin.h>

/* Shift counts moving bit (8*j + lane) of a 32-bit sign half to bit 31. */
#define SIGN_COUNTS(j) _mm256_setr_epi32(31 - 8 * (j), 30 - 8 * (j), 29 - 8 * (j), 28 - 8 * (j), \
                                         27 - 8 * (j), 26 - 8 * (j), 25 - 8 * (j), 24 - 8 * (j))

static inline __m256 decode8(const uint8_t *mag, __m256i sign_half, __m256i counts, __m256i sign_bit)
{
    __m256i u = _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mag)),
                                  FP9_DECODE_SHIFT);
    __m256i s = _mm256_and_si256(_mm256_sllv_epi32(sign_half, counts), sign_bit);
    return _mm256_castsi256_ps(_mm256_xor_si256(u, s));
}

/* The GEMV applies the sign to the activation instead: blendv reads only
 * bit 31 of the shifted sign word, so no mask is needed (11 % faster than
 * the and + xor of decode8 on the development machine). */
static inline __m256 magnitude8(const uint8_t *mag)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mag)), FP9_DECODE_SHIFT));
}

static inline __m256 signed_x(__m256 x, __m256 neg_x, __m256i sign_half, __m256i counts)
{
    return _mm256_blendv_ps(x, neg_x, _mm256_castsi256_ps(_mm256_sllv_epi32(sign_half, counts)));
}

/* acc + (+-w) * x for eight weights. Two ways to apply the sign, chosen per
 * CPU vendor: blendv costs one op on AMD Zen but 2-3 on Intel cores, where
 * the AND + XOR on the weight measured faster. */
static inline __attribute__((always_inline)) __m256 fma_signed(int blend, __m256 acc, const uint8_t *mag,
                                                               __m256 x, __m256 neg_x, __m256i sign_half,
                                                               __m256i counts, __m256i sign_bit)
{
    if (blend)
        return _mm256_fmadd_ps(magnitude8(mag), signed_x(x, neg_x, sign_half, counts), acc);
    return _mm256_fmadd_ps(decode8(mag, sign_half, counts, sign_bit), x, acc);
}

static inline void store_out(float *y, uint32_t row, uint32_t rows, float v, int accumulate)
{
    if (row < rows)
        y[row] = accumulate ? y[row] + v : v;
}

/* Sums of eight accumulators, one per lane: [hsum8 of a[0], ..., of a[7]]. Each
 * lane's sum is (l0 + l1) + (l2 + l3) plus (l4 + l5) + (l6 + l7), whichever
 * lane the row takes. */
static inline __m256 hsum8(const __m256 a[8])
{
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Batch invariance (kernels.h): a row's sum for a token is taken in one order
 * whatever the call's token count. Per 2048-column panel, one FMA chain of 8
 * lanes per row over the panel's groups, each group's columns 8j .. 8j + 7 for
 * j = 0 .. 7 in turn; where there are block scales the chain is cut every 128
 * columns and folded into a second one, times the block's scale; then hsum8's
 * sum of the lanes, times the output scale, added to y panel by panel. The GEMV
 * (one token) and gemm_invariant (more) both take it. */

/* y rows of pairs [p, p + NP) (NP <= 4; 2 with block scales) for one token and
 * one panel: eight chains (four with scales), each activation load shared by
 * every row. */
static inline __attribute__((always_inline)) void gemv_rows(const fp9_matrix *m, uint32_t p, const int NP,
                                                            uint32_t g0, uint32_t ng, const float *x, float *y,
                                                            int add, int blend)
{
    const __m256i c[4] = {SIGN_COUNTS(0), SIGN_COUNTS(1), SIGN_COUNTS(2), SIGN_COUNTS(3)};
    const __m256i sign_int = _mm256_set1_epi32((int)0x80000000u);
    const uint32_t sc = fp9_scale_cols(m);
    const int scaled = m->block_scales != NULL;
    const fp9_block *run = fp9_pair_run(m, p, g0);   /* pair p + i at run + i * ng */
    __m256 a[8], t[8];
    for (int r = 0; r < 8; r++)
        a[r] = t[r] = _mm256_setzero_ps();
    for (uint32_t g = 0; g < ng; g++) {
        for (int i = 0; i < NP; i++)
            for (int l = 0; l < 3; l++)   /* each 144-byte block DUCK_PREFETCH_BYTES ahead */
                _mm_prefetch((const char *)(run + (size_t)i * ng + g) + DUCK_PREFETCH_BYTES + 64 * l, _MM_HINT_T0);
        const float *xg = x + (size_t)g * FP9_GROUP;
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            __m256 xv = _mm256_loadu_ps(xg + 8 * j);
            __m256 xn = _mm256_xor_ps(xv, _mm256_castsi256_ps(sign_int));
#pragma GCC unroll 8
            for (int r = 0; r < 2 * NP; r++) {
                const fp9_block *b = run + (size_t)(r >> 1) * ng + g;
                __m256i half = _mm256_set1_epi32((int)(uint32_t)(b->sign[r & 1] >> (32 * (j >> 2))));
                a[r] = fma_signed(blend, a[r], b->mag[r & 1] + 8 * j, xv, xn, half, c[j & 3], sign_int);
            }
        }
        const uint32_t gg = g0 + g;
        if (scaled && ((gg & 1) || gg + 1 == m->groups))   /* end of a 128-column scale block */
            for (int r = 0; r < 2 * NP; r++) {
                t[r] = _mm256_fmadd_ps(a[r], _mm256_set1_ps(m->block_scales[(size_t)(2 * p + r) * sc + gg / 2]), t[r]);
                a[r] = _mm256_setzero_ps();
            }
    }
    float sums[8] __attribute__((aligned(32)));
    _mm256_store_ps(sums, _mm256_mul_ps(hsum8(scaled ? t : a), _mm256_set1_ps(m->prescale * 0x1p48f)));
    for (int r = 0; r < 2 * NP; r++)
        store_out(y, 2 * p + r, m->rows, sums[r], add);
}

static inline __attribute__((always_inline)) void gemv_avx2(const fp9_matrix *m, uint32_t pair_begin,
                                                            uint32_t pair_end, const float *x, float *y,
                                                            int accumulate, int blend)
{
    const uint32_t step = m->block_scales ? 2 : 4;
    for (uint32_t g0 = 0; g0 < m->groups; g0 += FP9_PANEL_GROUPS) {
        const uint32_t ng = fp9_panel_groups(m->groups, g0);
        const int add = accumulate || g0 > 0;
        for (uint32_t p = pair_begin; p < pair_end; p += step)
            switch (pair_end - p < step ? pair_end - p : step) {
            case 1: gemv_rows(m, p, 1, g0, ng, x + (size_t)g0 * FP9_GROUP, y, add, blend); break;
            case 2: gemv_rows(m, p, 2, g0, ng, x + (size_t)g0 * FP9_GROUP, y, add, blend); break;
            case 3: gemv_rows(m, p, 3, g0, ng, x + (size_t)g0 * FP9_GROUP, y, add, blend); break;
            default: gemv_rows(m, p, 4, g0, ng, x + (size_t)g0 * FP9_GROUP, y, add, blend); break;
            }
    }
}

/* Many tokens in the GEMV's order: a micro-panel of two row pairs is decoded
 * once per panel into an L1 buffer (per group and j: each row's eight signed
 * weights), then tiles of its four rows by up to two tokens (one with block
 * scales) run the GEMV's chains on it, each activation load shared by the four
 * rows. At most INV_BLOCK tokens per pass. */
#define INV_ROWS 4
#define INV_BLOCK 32

static inline __attribute__((always_inline)) void inv_tile(const float *wd, uint32_t g0, uint32_t ng,
                                                           const float *const *x, const int R, const int NT,
                                                           const fp9_matrix *m, uint32_t p, float *const *y,
                                                           int add)
{
    const uint32_t sc = fp9_scale_cols(m);
    const int scaled = m->block_scales != NULL;
    __m256 a[8], t[8];   /* chain i * R + r: token i, row 2p + r */
    for (int k = 0; k < 8; k++)
        a[k] = t[k] = _mm256_setzero_ps();
    for (uint32_t g = 0; g < ng; g++) {
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            const float *w = wd + ((size_t)g * 8 + j) * 8 * INV_ROWS;
            __m256 xv[2];
#pragma GCC unroll 2
            for (int i = 0; i < NT; i++)
                xv[i] = _mm256_loadu_ps(x[i] + (size_t)(g0 + g) * FP9_GROUP + 8 * j);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                __m256 wv = _mm256_load_ps(w + 8 * r);
#pragma GCC unroll 2
                for (int i = 0; i < NT; i++)
                    a[i * R + r] = _mm256_fmadd_ps(wv, xv[i], a[i * R + r]);
            }
        }
        const uint32_t gg = g0 + g;
        if (scaled && ((gg & 1) || gg + 1 == m->groups))
            for (int r = 0; r < R; r++) {
                const __m256 k = _mm256_set1_ps(m->block_scales[(size_t)(2 * p + r) * sc + gg / 2]);
                for (int i = 0; i < NT; i++) {
                    t[i * R + r] = _mm256_fmadd_ps(a[i * R + r], k, t[i * R + r]);
                    a[i * R + r] = _mm256_setzero_ps();
                }
            }
    }
    float sums[8] __attribute__((aligned(32)));
    _mm256_store_ps(sums, _mm256_mul_ps(hsum8(scaled ? t : a), _mm256_set1_ps(m->prescale * 0x1p48f)));
    for (int i = 0; i < NT; i++)
        for (int r = 0; r < R; r++)
            store_out(y[i], 2 * p + r, m->rows, sums[i * R + r], add);
}

static void gemm_invariant(const fp9_matrix *m, uint32_t pair_begin, uint32_t pair_end, uint32_t ntok,
                           const float *const *x, float *const *y, int accumulate)
{
    float wd[FP9_PANEL_GROUPS * 8 * 8 * INV_ROWS] __attribute__((aligned(32)));
    const __m256i c[4] = {SIGN_COUNTS(0), SIGN_COUNTS(1), SIGN_COUNTS(2), SIGN_COUNTS(3)};
    const __m256i sign_bit = _mm256_set1_epi32((int)0x80000000u);
    const uint32_t tmax = m->block_scales ? 1 : 2;
    for (uint32_t b0 = 0; b0 < ntok; b0 += INV_BLOCK) {
        const uint32_t nb = ntok - b0 < INV_BLOCK ? ntok - b0 : INV_BLOCK;
        for (uint32_t g0 = 0; g0 < m->groups; g0 += FP9_PANEL_GROUPS) {
            const uint32_t ng = fp9_panel_groups(m->groups, g0);
            const int add = accumulate || g0 > 0;
            for (uint32_t p = pair_begin; p < pair_end; p += INV_ROWS / 2) {
                const uint32_t np = pair_end - p < INV_ROWS / 2 ? pair_end - p : INV_ROWS / 2;
                for (uint32_t q = 0; q < np; q++) {
                    const fp9_block *run = fp9_pair_run(m, p + q, g0);
                    for (uint32_t g = 0; g < ng; g++) {
                        for (int l = 0; l < 3; l++)
                            _mm_prefetch((const char *)&run[g] + DUCK_PREFETCH_BYTES + 64 * l, _MM_HINT_T0);
                        for (int r = 0; r < 2; r++) {
                            const uint64_t sign = run[g].sign[r];
                            for (int j = 0; j < 8; j++) {
                                __m256i half = _mm256_set1_epi32((int)(uint32_t)(sign >> (32 * (j >> 2))));
                                _mm256_store_ps(wd + ((size_t)g * 8 + j) * 8 * INV_ROWS + 8 * (2 * q + r),
                                                decode8(run[g].mag[r] + 8 * j, half, c[j & 3], sign_bit));
                            }
                        }
                    }
                }
                for (uint32_t t = 0; t < nb; t += tmax) {
                    const uint32_t nt = nb - t < tmax ? nb - t : tmax;
                    const float *const *xt = x + b0 + t;
                    float *const *yt = y + b0 + t;
                    if (np == 2)
                        nt == 2 ? inv_tile(wd, g0, ng, xt, 4, 2, m, p, yt, add) : inv_tile(wd, g0, ng, xt, 4, 1, m, p, yt, add);
                    else
                        nt == 2 ? inv_tile(wd, g0, ng, xt, 2, 2, m, p, yt, add) : inv_tile(wd, g0, ng, xt, 2, 1, m, p, yt, add);
                }
            }
        }
    }
}

#define GEMM_PAIRS 8    /* rows per tile: 16, two vectors */
#define GEMM_TOKENS 6   /* tokens per tile: 12 accumulators, 15 of the 16 registers in use */

/* Sixteen weights of a row as 16-bit words: the magnitude byte, and bit 11 set
 * where the weight is negative (bit 31 once widened to 32 bits and shifted by
 * FP9_DECODE_SHIFT: the fp32 sign). */
static inline __attribute__((always_inline)) __m256i words16(const uint8_t *mag, uint32_t signs16, __m256i lane_bits)
{
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)mag));
    const __m256i s = _mm256_and_si256(_mm256_set1_epi16((short)signs16), lane_bits);
    return _mm256_or_si256(w, _mm256_and_si256(_mm256_cmpeq_epi16(s, lane_bits), _mm256_set1_epi16(0x0800)));
}

/* Groups [g, g + ng) of row pairs [p, p + np) into wt[k][16]: eight rows of
 * sixteen columns at a time as 16-bit words (words16), transposed as words
 * (an 8 x 8 transpose in each 128-bit lane: columns c and c + 8), then widened
 * to fp32 bit patterns column by column. */
static void decode_panel(const fp9_matrix *m, uint32_t p, uint32_t np, uint32_t g, uint32_t ng, float *wt,
                         const char **ahead, const char *ahead_end)
{
    const char *pf = *ahead;
    const __m256i lane_bits = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                                16384, (short)0x8000);
    const uint32_t g0 = g - g % FP9_PANEL_GROUPS;
    for (uint32_t half = 0; half < 2; half++) {
        const uint32_t live = np > 4 * half ? (np - 4 * half < 4 ? np - 4 * half : 4) : 0;
        const fp9_block *run[4];
        for (uint32_t i = 0; i < 4; i++)
            run[i] = i < live ? fp9_pair_run(m, p + 4 * half + i, g0) + (g - g0) : NULL;
        for (uint32_t gi = 0; gi < ng; gi++)
            for (int j = 0; j < 4; j++) {   /* columns 16j .. 16j + 15 of the group */
                __m256i w[8];
#pragma GCC unroll 8
                for (int r = 0; r < 8; r++) {
                    if (pf < ahead_end) {
                        _mm_prefetch(pf, _MM_HINT_T0);
                        pf += 64;
                    }
                    const fp9_block *b = run[r >> 1] ? &run[r >> 1][gi] : NULL;
                    w[r] = b ? words16(b->mag[r & 1] + 16 * j, (uint32_t)(b->sign[r & 1] >> (16 * j)) & 0xFFFFu,
                                       lane_bits)
                             : _mm256_setzero_si256();
                }
                __m256i t[8], u[8];
                for (int i = 0; i < 4; i++) {   /* rows 2i, 2i + 1 interleaved */
                    t[2 * i] = _mm256_unpacklo_epi16(w[2 * i], w[2 * i + 1]);
                    t[2 * i + 1] = _mm256_unpackhi_epi16(w[2 * i], w[2 * i + 1]);
                }
                for (int i = 0; i < 2; i++) {   /* rows 4i .. 4i + 3 interleaved */
                    u[4 * i] = _mm256_unpacklo_epi32(t[4 * i], t[4 * i + 2]);
                    u[4 * i + 1] = _mm256_unpackhi_epi32(t[4 * i], t[4 * i + 2]);
                    u[4 * i + 2] = _mm256_unpacklo_epi32(t[4 * i + 1], t[4 * i + 3]);
                    u[4 * i + 3] = _mm256_unpackhi_epi32(t[4 * i + 1], t[4 * i + 3]);
                }
                float *out = wt + (size_t)(gi * FP9_GROUP + 16 * j) * 16 + 8 * half;
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++)   /* columns 2i, 2i + 1 (and + 8): the eight rows' words */
                    for (int o = 0; o < 2; o++) {
                        const __m256i v = o ? _mm256_unpackhi_epi64(u[i], u[4 + i]) : _mm256_unpacklo_epi64(u[i], u[4 + i]);
                        const int c = 2 * i + o;
                        _mm256_store_si256((__m256i *)(out + 16 * c), _mm256_slli_epi32(
                            _mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)), FP9_DECODE_SHIFT));
                        _mm256_store_si256((__m256i *)(out + 16 * (c + 8)), _mm256_slli_epi32(
                            _mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1)), FP9_DECODE_SHIFT));
                    }
            }
    }
    *ahead = pf;
}

static inline __attribute__((always_inline)) void tile(const float *wt, uint32_t n, const float *const *x,
                                                       uint32_t k0, const int T, float *const *y, uint32_t row,
                                                       uint32_t live, const float *scale, int load)
{
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)live), lanes);
    const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)live - 8), lanes);
    /* FMA chains: at least 8 in flight (latency 4, two ports); a tile of
     * few tokens takes the even and the odd columns in separate chains */
    const int S = T <= GEMM_TOKENS / 2 ? 2 : 1;
    __m256 c0[2][GEMM_TOKENS], c1[2][GEMM_TOKENS];
    const float *xs[GEMM_TOKENS];
#pragma GCC unroll 6
    for (int i = 0; i < T; i++) {
        xs[i] = x[i] + k0;
        c0[0][i] = c1[0][i] = c0[1][i] = c1[1][i] = _mm256_setzero_ps();
    }
    for (uint32_t k = 0; k < n; k += S)
#pragma GCC unroll 2
        for (int s = 0; s < S; s++) {
            __m256 w0 = _mm256_load_ps(wt + 16 * (k + s)), w1 = _mm256_load_ps(wt + 16 * (k + s) + 8);
#pragma GCC unroll 6
            for (int i = 0; i < T; i++) {
                __m256 b = _mm256_broadcast_ss(xs[i] + k + s);
                c0[s][i] = _mm256_fmadd_ps(w0, b, c0[s][i]);
                c1[s][i] = _mm256_fmadd_ps(w1, b, c1[s][i]);
            }
        }
    if (S == 2)
#pragma GCC unroll 6
        for (int i = 0; i < T; i++) {
            c0[0][i] = _mm256_add_ps(c0[0][i], c0[1][i]);
            c1[0][i] = _mm256_add_ps(c1[0][i], c1[1][i]);
        }
    const __m256 s0 = _mm256_load_ps(scale), s1 = _mm256_load_ps(scale + 8);
    if (live >= 16) {   /* every row live: plain loads and stores (masked stores are slow on AMD's cores) */
#pragma GCC unroll 6
        for (int i = 0; i < T; i++) {
            float *yr = y[i] + row;
            __m256 y0 = load ? _mm256_loadu_ps(yr) : _mm256_setzero_ps();
            __m256 y1 = load ? _mm256_loadu_ps(yr + 8) : _mm256_setzero_ps();
            _mm256_storeu_ps(yr, _mm256_fmadd_ps(c0[0][i], s0, y0));
            _mm256_storeu_ps(yr + 8, _mm256_fmadd_ps(c1[0][i], s1, y1));
        }
        return;
    }
#pragma GCC unroll 6
    for (int i = 0; i < T; i++) {
        __m256 y0 = load ? _mm256_maskload_ps(y[i] + row, m0) : _mm256_setzero_ps();
        __m256 y1 = load ? _mm256_maskload_ps(y[i] + row + 8, m1) : _mm256_setzero_ps();
        _mm256_maskstore_ps(y[i] + row, m0, _mm256_fmadd_ps(c0[0][i], s0, y0));
        _mm256_maskstore_ps(y[i] + row + 8, m1, _mm256_fmadd_ps(c1[0][i], s1, y1));
    }
}

#include "gemm_tokens.h"

static inline __attribute__((always_inline)) void gemm_variant(
    const fp9_matrix *m, uint32_t pair_begin, uint32_t pair_end, uint32_t ntok,
    const float *const *x, float *const *y, int accumulate, int blend)
{
    if (ntok == 1)
        gemv_avx2(m, pair_begin, pair_end, x[0], y[0], accumulate, blend);
    else if (duck_kernels_batch_invariant())
        gemm_invariant(m, pair_begin, pair_end, ntok, x, y, accumulate);
    else
        gemm_tokens(m, pair_begin, pair_end, ntok, x, y, accumulate);
}

static void gemm_avx2_xor(const fp9_matrix *m, uint32_t pb, uint32_t pe, uint32_t ntok,
                          const float *const *x, float *const *y, int accumulate)
{
    gemm_variant(m, pb, pe, ntok, x, y, accumulate, 0);
}

static void gemm_avx2_blend(const fp9_matrix *m, uint32_t pb, uint32_t pe, uint32_t ntok,
                            const float *const *x, float *const *y, int accumulate)
{
    gemm_variant(m, pb, pe, ntok, x, y, accumulate, 1);
}

#pragma GCC pop_options

static const duck_kernels k_avx2_xor = {"avx2-xor", gemm_avx2_xor};
static const duck_kernels k_avx2_blend = {"avx2-blend", gemm_avx2_blend};

const duck_kernels *duck_kernels_avx2_variant(int blend)
{
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma"))
        return NULL;
    return blend ? &k_avx2_blend : &k_avx2_xor;
}

const duck_kernels *duck_kernels_avx2(void)
{
    __builtin_cpu_init();
    return duck_kernels_avx2_variant(__builtin_cpu_is("amd"));
}

#else

const duck_kernels *duck_kernels_avx2_variant(int blend) { (void)blend; return NULL; }
const duck_kernels *duck_kernels_avx2(void) { return NULL; }

#endif
