/* The expert FFN's intermediate, h = silu(gate) * up, for the rows a gate/up
 * piece computed (ffn.c): a prefill chunk has ntok * topk * width of them
 * (512 tokens of Qwen3-30B-A3B over 4 ducks: 786k per duck and layer), and
 * with expf called per value they took 5.9 of the 62 thread-ms of that
 * forward on the H200 host's cores (bench kernels --amx-parts, moe_profile).
 *
 * e^x is Cephes' expf scheme: n = floor(x log2 e + 1/2), r = x - n ln 2 in two
 * parts, e^r by a degree-7 polynomial, 2^n added to the exponent bits; x is
 * clamped to [-86, 88] first (so that 2^n stays a normal float: silu(v) is v
 * for v >= 86 and ~0 for v <= -88 either way). Within 2 ulp of expf there.
 * The scalar code is the reference; the AVX2 code does the same operations
 * (every multiply-add an explicit FMA in both), so both give the same bits,
 * which a test holds. */
#define _GNU_SOURCE
#include "ffn.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#define EXP_LO -86.0f
#define EXP_HI 88.0f
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f
#define P0 1.9875691500e-4f
#define P1 1.3981999507e-3f
#define P2 8.3334519073e-3f
#define P3 4.1665795894e-2f
#define P4 1.6666665459e-1f
#define P5 5.0000001201e-1f

static inline uint32_t bits_of(float v)
{
    uint32_t u;
    memcpy(&u, &v, 4);
    return u;
}

static inline float float_of(uint32_t u)
{
    float v;
    memcpy(&v, &u, 4);
    return v;
}

static inline float exp_ref(float x)
{
    if (x != x)
        return x;
    x = EXP_LO > x ? EXP_LO : x;
    x = EXP_HI < x ? EXP_HI : x;
    const float n = floorf(fmaf(x, LOG2E, 0.5f));
    float r = fmaf(-n, LN2_HI, x);
    r = fmaf(-n, LN2_LO, r);
    float p = fmaf(P0, r, P1);
    p = fmaf(p, r, P2);
    p = fmaf(p, r, P3);
    p = fmaf(p, r, P4);
    p = fmaf(p, r, P5);
    const float e = fmaf(p, r * r, r) + 1.0f;
    return float_of(bits_of(e) + ((uint32_t)(int32_t)n << 23));
}

/* v rounded to the nearest bf16 (even on ties), as duck_f32_to_bf16 rounds. */
static inline float round_bf16(float v)
{
    uint32_t u = bits_of(v);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return v;
    return float_of((u + 0x7FFFu + ((u >> 16) & 1)) & 0xFFFF0000u);
}

static inline float act_one(float g, float u, float scale, int bf16)
{
    float h = g / (1.0f + exp_ref(-g)) * u;
    return (bf16 ? round_bf16(h) : h) * scale;
}

void duck_ffn_act_ref(const float *gu, uint32_t pb, uint32_t pe, float scale, int bf16, float *out)
{
    for (uint32_t p = pb; p < pe; p++)
        out[p] = act_one(gu[2 * p], gu[2 * p + 1], scale, bf16);
}

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include <immintrin.h>

static inline __m256 exp_avx2(__m256 x)
{
    x = _mm256_max_ps(_mm256_set1_ps(EXP_LO), x);   /* lo > x ? lo : x: a NaN stays */
    x = _mm256_min_ps(_mm256_set1_ps(EXP_HI), x);
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(LOG2E), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(P0), r, _mm256_set1_ps(P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P5));
    const __m256 e = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i shift = _mm256_slli_epi32(_mm256_cvttps_epi32(n), 23);
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(e), shift));
}

static inline __m256 round_bf16_avx2(__m256 v)
{
    const __m256i u = _mm256_castps_si256(v);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)),
                                           _mm256_set1_epi32(0x7F800000));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd),
                                       _mm256_set1_epi32((int)0xFFFF0000u));
    return _mm256_castsi256_ps(_mm256_blendv_epi8(r, u, nan));
}

static void act_avx2(const float *gu, uint32_t pb, uint32_t pe, float scale, int bf16, float *out)
{
    const __m256 s = _mm256_set1_ps(scale), one = _mm256_set1_ps(1.0f);
    uint32_t p = pb;
    for (; p + 8 <= pe; p += 8) {
        const __m256 a = _mm256_loadu_ps(gu + 2 * p), b = _mm256_loadu_ps(gu + 2 * p + 8);
        /* pairs (gate, up) to 8 gates and 8 ups in order */
        const __m256 g = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
        const __m256 u = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
        const __m256 e = exp_avx2(_mm256_xor_ps(g, _mm256_set1_ps(-0.0f)));   /* -g */
        __m256 h = _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u);
        if (bf16)
            h = round_bf16_avx2(h);
        _mm256_storeu_ps(out + p, _mm256_mul_ps(h, s));
    }
    for (; p < pe; p++)
        out[p] = act_one(gu[2 * p], gu[2 * p + 1], scale, bf16);
}
#pragma GCC pop_options

static int have_avx2(void)
{
    static int has = -1;   /* the same answer from any thread that asks first */
    int h = __atomic_load_n(&has, __ATOMIC_RELAXED);
    if (h < 0) {
        __builtin_cpu_init();
        h = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        __atomic_store_n(&has, h, __ATOMIC_RELAXED);
    }
    return h;
}

void duck_ffn_act(const float *gu, uint32_t pb, uint32_t pe, float scale, int bf16, float *out)
{
    if (have_avx2())
        act_avx2(gu, pb, pe, scale, bf16, out);
    else
        duck_ffn_act_ref(gu, pb, pe, scale, bf16, out);
}
#else
void duck_ffn_act(const float *gu, uint32_t pb, uint32_t pe, float scale, int bf16, float *out)
{
    duck_ffn_act_ref(gu, pb, pe, scale, bf16, out);
}
#endif
