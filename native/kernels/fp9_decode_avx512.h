/* The AVX-512 decode of fp9 weights that the avx512, avx512-bf16 and amx kernel
 * sets share: included by their .c files inside a target region that enables
 * AVX-512 F/BW/VL, after <immintrin.h> and kernels.h. */
#ifndef DUCK_FP9_DECODE_AVX512_H
#define DUCK_FP9_DECODE_AVX512_H

/* x's rows (cols values each) as bf16 pairs, contiguous in the calling thread's
 * scratch slot 0 (kernels_avx512.c). */
const uint32_t *duck_bf16_rows(const float *const *x, uint32_t ntok, uint32_t pad, uint32_t cols,
                               const uint32_t **rows);

/* Thirty-two weights, columns 32h .. 32h + 31 of one row of a block, as
 * words: each the weight's bf16 bit pattern (value * 2^-112). */
static inline __attribute__((always_inline)) __m512i decode32_words(const uint8_t *mag, const uint64_t *sign, int h)
{
    __m512i w = _mm512_slli_epi16(_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(mag + 32 * h))),
                                  FP9_DECODE_SHIFT - 16);
    uint32_t bits;
    memcpy(&bits, (const uint8_t *)sign + 4 * h, 4);
    return _mm512_mask_add_epi16(w, _cvtu32_mask32(bits), w, _mm512_set1_epi16((short)0x8000));
}

/* r[i] lane j <-> r[j] lane i: a 16 x 16 transpose of dwords in four
 * rounds of two-source shuffles. */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16])
{
    __m512i t[16];
    for (int i = 0; i < 8; i++) {   /* rows 2i, 2i + 1 interleaved per 128-bit lane */
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {   /* r[4i + j], lane L: column 4L + j of rows 4i .. 4i + 3 */
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) {   /* 4 x 4 transpose of the 128-bit lanes */
        t[4 * j] = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44);
        t[4 * j + 1] = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
        t[4 * j + 2] = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44);
        t[4 * j + 3] = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
    }
    for (int j = 0; j < 4; j++) {
        r[j] = _mm512_shuffle_i32x4(t[4 * j], t[4 * j + 2], 0x88);
        r[4 + j] = _mm512_shuffle_i32x4(t[4 * j], t[4 * j + 2], 0xDD);
        r[8 + j] = _mm512_shuffle_i32x4(t[4 * j + 1], t[4 * j + 3], 0x88);
        r[12 + j] = _mm512_shuffle_i32x4(t[4 * j + 1], t[4 * j + 3], 0xDD);
    }
}

/* Groups [g, g + ng) of row pairs [p, p + np) into wt[k][32]. Sixteen
 * rows at a time: their words (two columns per dword) transposed as
 * dwords, then split into the even and the odd column. pairs (the bf16
 * GEMM): wt[k / 2][32] dwords instead, each row's columns k and k + 1 as
 * two bf16 of value * 2^-48: the fp32 split times 2^64 (exact, and e5m3's
 * subnormals come out normal: VDPBF16PS would read a bf16 subnormal as 0),
 * whose low 16 bits are zero (at most 4 significant bits). */
static inline __attribute__((always_inline)) void decode_panel_as(const fp9_matrix *m, uint32_t p, uint32_t np,
                                                                  uint32_t g, uint32_t ng, float *wt,
                                                                  const char **ahead, const char *ahead_end,
                                                                  const int pairs)
{
    const char *pf = *ahead;
    const uint32_t g0 = g - g % FP9_PANEL_GROUPS;
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    for (uint32_t half = 0; half < 2; half++) {
        const uint32_t live = np > 8 * half ? (np - 8 * half < 8 ? np - 8 * half : 8) : 0;
        const fp9_block *run[8];
        for (uint32_t i = 0; i < 8; i++)
            run[i] = i < live ? fp9_pair_run(m, p + 8 * half + i, g0) + (g - g0) : NULL;
        for (uint32_t gi = 0; gi < ng; gi++)
            for (int h = 0; h < 2; h++) {
                __m512i w[16];
#pragma GCC unroll 16
                for (int r = 0; r < 16; r++) {
                    if (pf < ahead_end) {
                        _mm_prefetch(pf, _MM_HINT_T0);
                        pf += 64;
                    }
                    w[r] = run[r >> 1] ? decode32_words(run[r >> 1][gi].mag[r & 1], &run[r >> 1][gi].sign[r & 1], h)
                                       : _mm512_setzero_si512();
                }
                transpose16(w);   /* w[d] lane r: columns 2d (low word) and 2d + 1 of row r */
                if (pairs) {
                    float *out = wt + (size_t)(gi * FP9_GROUP + 32 * h) / 2 * 32 + 16 * half;
                    const __m512 up = _mm512_set1_ps(0x1p64f);
#pragma GCC unroll 16
                    for (int d = 0; d < 16; d++) {
                        __m512 even = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w[d], 16)), up);
                        __m512 odd = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(w[d], high)), up);
                        _mm512_store_si512(out + 32 * d,
                                           _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(even), 16),
                                                           _mm512_and_si512(_mm512_castps_si512(odd), high)));
                    }
                    continue;
                }
                float *out = wt + (size_t)(gi * FP9_GROUP + 32 * h) * 32 + 16 * half;
#pragma GCC unroll 16
                for (int d = 0; d < 16; d++) {
                    _mm512_store_si512(out + 64 * d, _mm512_slli_epi32(w[d], 16));
                    _mm512_store_si512(out + 64 * d + 32, _mm512_and_si512(w[d], high));
                }
            }
    }
    *ahead = pf;
}

#endif
