/* Poly1305's bulk in four AVX2 lanes: a lane takes block b, b+4, b+8, ... of
 * the run and multiplies by r^4 between them (Horner in steps of four); at the
 * end the lane of blocks b is multiplied by r^(4-b) and the lanes summed, which is the same polynomial
 * as the portable one-block-at-a-time loop (poly1305.c, the reference;
 * tests/firmware/test_poly1305.py holds the two together). Each lane holds a
 * number mod 2^130 - 5 in five 26-bit limbs, one per 64-bit element, so that
 * _mm256_mul_epu32 (32 x 32 -> 64 bits) makes every limb product. */
#include "poly1305_impl.h"

#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define MIN_BLOCKS 64   /* below 1 KB the r powers and the lane sums cost what the lanes save */

static const int LANE_BLOCK[4] = {0, 2, 1, 3};   /* which block of each four a lane holds */

__attribute__((target("avx2"))) static size_t avx2_blocks(uint64_t h[3], const uint64_t r[3], const uint8_t *m,
                                                          size_t nblocks)
{
    uint64_t pw[5][3];   /* r^0 (unused), r^1 .. r^4 */
    memcpy(pw[1], r, sizeof pw[1]);
    poly_mul44(pw[1], pw[1], pw[2]);
    poly_mul44(pw[2], pw[1], pw[3]);
    poly_mul44(pw[3], pw[1], pw[4]);
    uint64_t r4[5];
    poly_to26(pw[4], r4);
    const __m256i mask = _mm256_set1_epi64x((long long)M26), hibit = _mm256_set1_epi64x(1ll << 24);
    __m256i R0 = _mm256_set1_epi64x((long long)r4[0]), R1 = _mm256_set1_epi64x((long long)r4[1]),
            R2 = _mm256_set1_epi64x((long long)r4[2]), R3 = _mm256_set1_epi64x((long long)r4[3]),
            R4 = _mm256_set1_epi64x((long long)r4[4]);
    __m256i S1 = _mm256_set1_epi64x((long long)(r4[1] * 5)), S2 = _mm256_set1_epi64x((long long)(r4[2] * 5)),
            S3 = _mm256_set1_epi64x((long long)(r4[3] * 5)), S4 = _mm256_set1_epi64x((long long)(r4[4] * 5));
    uint64_t h26[5];
    poly_to26(h, h26);   /* the running value joins lane 0's first block */
    __m256i A0 = _mm256_set_epi64x(0, 0, 0, (long long)h26[0]), A1 = _mm256_set_epi64x(0, 0, 0, (long long)h26[1]),
            A2 = _mm256_set_epi64x(0, 0, 0, (long long)h26[2]), A3 = _mm256_set_epi64x(0, 0, 0, (long long)h26[3]),
            A4 = _mm256_set_epi64x(0, 0, 0, (long long)h26[4]);
    size_t groups = nblocks / 4;
    for (size_t g = 0; g < groups; g++, m += 64) {
        /* blocks 0 and 1, 2 and 3 in two loads; unpacked, the lanes hold blocks 0, 2, 1, 3 (LANE_BLOCK)
         * as low halves in T0 and high halves in T1 */
        __m256i L0 = _mm256_loadu_si256((const __m256i *)m), L1 = _mm256_loadu_si256((const __m256i *)(m + 32));
        __m256i T0 = _mm256_unpacklo_epi64(L0, L1), T1 = _mm256_unpackhi_epi64(L0, L1);
        A0 = _mm256_add_epi64(A0, _mm256_and_si256(T0, mask));
        A1 = _mm256_add_epi64(A1, _mm256_and_si256(_mm256_srli_epi64(T0, 26), mask));
        A2 = _mm256_add_epi64(A2, _mm256_and_si256(_mm256_or_si256(_mm256_srli_epi64(T0, 52),
                                                                   _mm256_slli_epi64(T1, 12)), mask));
        A3 = _mm256_add_epi64(A3, _mm256_and_si256(_mm256_srli_epi64(T1, 14), mask));
        A4 = _mm256_add_epi64(A4, _mm256_or_si256(_mm256_srli_epi64(T1, 40), hibit));
        if (g + 1 == groups)
            break;   /* the last group is added, not multiplied: the lanes get r^(4-j) below */
#define MUL(a, b) _mm256_mul_epu32(a, b)
        __m256i d0 = _mm256_add_epi64(_mm256_add_epi64(MUL(A0, R0), MUL(A1, S4)),
                                      _mm256_add_epi64(_mm256_add_epi64(MUL(A2, S3), MUL(A3, S2)), MUL(A4, S1)));
        __m256i d1 = _mm256_add_epi64(_mm256_add_epi64(MUL(A0, R1), MUL(A1, R0)),
                                      _mm256_add_epi64(_mm256_add_epi64(MUL(A2, S4), MUL(A3, S3)), MUL(A4, S2)));
        __m256i d2 = _mm256_add_epi64(_mm256_add_epi64(MUL(A0, R2), MUL(A1, R1)),
                                      _mm256_add_epi64(_mm256_add_epi64(MUL(A2, R0), MUL(A3, S4)), MUL(A4, S3)));
        __m256i d3 = _mm256_add_epi64(_mm256_add_epi64(MUL(A0, R3), MUL(A1, R2)),
                                      _mm256_add_epi64(_mm256_add_epi64(MUL(A2, R1), MUL(A3, R0)), MUL(A4, S4)));
        __m256i d4 = _mm256_add_epi64(_mm256_add_epi64(MUL(A0, R4), MUL(A1, R3)),
                                      _mm256_add_epi64(_mm256_add_epi64(MUL(A2, R2), MUL(A3, R1)), MUL(A4, R0)));
#undef MUL
        /* carries in two chains at once (0 -> 1 -> 2 -> 3 -> 4 and 3 -> 4 -> 0 -> 1), so the loop waits
         * on four steps instead of seven; limbs end below 2^26 (1 and 4 a little above), which the next
         * products take */
        __m256i c0 = _mm256_srli_epi64(d0, 26), c3 = _mm256_srli_epi64(d3, 26);
        d0 = _mm256_and_si256(d0, mask);
        d3 = _mm256_and_si256(d3, mask);
        d1 = _mm256_add_epi64(d1, c0);
        d4 = _mm256_add_epi64(d4, c3);
        __m256i c1 = _mm256_srli_epi64(d1, 26), c4 = _mm256_srli_epi64(d4, 26);
        d1 = _mm256_and_si256(d1, mask);
        d4 = _mm256_and_si256(d4, mask);
        d2 = _mm256_add_epi64(d2, c1);
        d0 = _mm256_add_epi64(d0, _mm256_add_epi64(c4, _mm256_slli_epi64(c4, 2)));   /* times 5 */
        __m256i c2 = _mm256_srli_epi64(d2, 26);
        c0 = _mm256_srli_epi64(d0, 26);
        A2 = _mm256_and_si256(d2, mask);
        A0 = _mm256_and_si256(d0, mask);
        d3 = _mm256_add_epi64(d3, c2);
        A1 = _mm256_add_epi64(d1, c0);
        c3 = _mm256_srli_epi64(d3, 26);
        A3 = _mm256_and_si256(d3, mask);
        A4 = _mm256_add_epi64(d4, c3);
    }
    uint64_t lanes[5][4];
    _mm256_storeu_si256((__m256i *)lanes[0], A0);
    _mm256_storeu_si256((__m256i *)lanes[1], A1);
    _mm256_storeu_si256((__m256i *)lanes[2], A2);
    _mm256_storeu_si256((__m256i *)lanes[3], A3);
    _mm256_storeu_si256((__m256i *)lanes[4], A4);
    uint64_t sum[3] = {0, 0, 0};
    for (int j = 0; j < 4; j++) {
        uint64_t l[5] = {lanes[0][j], lanes[1][j], lanes[2][j], lanes[3][j], lanes[4][j]}, a[3], t[3];
        poly_from26(l, a);
        poly_mul44(a, pw[4 - LANE_BLOCK[j]], t);
        sum[0] += t[0];
        sum[1] += t[1];
        sum[2] += t[2];
    }
    poly_carry44(sum);
    memcpy(h, sum, sizeof sum);
    return groups * 4;
}

size_t poly1305_avx2_blocks(uint64_t h[3], const uint64_t r[3], const uint8_t *m, size_t nblocks)
{
    static int has_avx2 = -1;
    if (has_avx2 < 0)
        has_avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
    if (!has_avx2 || nblocks < MIN_BLOCKS)
        return 0;
    return avx2_blocks(h, r, m, nblocks);
}

#else
size_t poly1305_avx2_blocks(uint64_t h[3], const uint64_t r[3], const uint8_t *m, size_t nblocks)
{
    (void)h; (void)r; (void)m; (void)nblocks;
    return 0;
}
#endif
