/* Portable scalar reference of the host kernels: plain loops, one fp32
 * accumulator per sum, in index order. */
#include "host_kernels.h"

#include <math.h>
#include <string.h>

float duck_half_to_float(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0x1Fu)                      /* infinity, NaN (payload kept) */
        bits = sign | 0x7F800000u | (man << 13);
    else if (exp)                          /* normal: rebias 15 -> 127 */
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    else {                                 /* zero or subnormal: man * 2^-24, exact in fp32 */
        const float v = ldexpf((float)man, -24);
        memcpy(&bits, &v, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

uint16_t duck_float_to_half(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u)                  /* NaN: quiet, the payload's top bits kept */
        return sign | 0x7E00u | (uint16_t)((ax >> 13) & 0x3FFu);
    if (ax >= 0x477FF000u)                 /* 65520 and up (ties to even go up): infinity */
        return sign | 0x7C00u;
    if (ax < 0x38800000u) {                /* below 2^-14: a subnormal half, man * 2^-24 */
        float v;
        memcpy(&v, &ax, sizeof v);
        return sign | (uint16_t)lrintf(v * 0x1p24f);   /* exact scaling; the default mode rounds ties to even */
    }
    const uint32_t h = ((ax >> 23) - 112u) << 10 | (ax >> 13 & 0x3FFu), rest = ax & 0x1FFFu;
    return sign | (uint16_t)(h + (rest > 0x1000u || (rest == 0x1000u && (h & 1u))));   /* a carry rounds into the exponent */
}

static float dot_ref(const float *a, const float *b, uint32_t n)
{
    float acc = 0.0f;
    for (uint32_t i = 0; i < n; i++)
        acc += a[i] * b[i];
    return acc;
}

static void gemm_ref(const float *w, size_t ldw, uint32_t rows, uint32_t k, uint32_t ntok,
                     const float *x, size_t ldx, float *y, size_t ldy)
{
    for (uint32_t r = 0; r < rows; r++)
        for (uint32_t t = 0; t < ntok; t++)
            y[t * ldy + r] = dot_ref(w + r * ldw, x + t * ldx, k);
}

size_t duck_host_packed_halves(uint32_t rows, uint32_t k)
{
    return (size_t)(rows + DUCK_HOST_PANEL - 1) / DUCK_HOST_PANEL * DUCK_HOST_PANEL * k;
}

void duck_host_pack_half(const uint16_t *w, size_t ldw, uint32_t rows, uint32_t k, uint16_t *out)
{
    const uint32_t padded = (rows + DUCK_HOST_PANEL - 1) / DUCK_HOST_PANEL * DUCK_HOST_PANEL;
    for (uint32_t r = 0; r < padded; r++)
        for (uint32_t c = 0; c < k; c++)
            out[(size_t)(r - r % DUCK_HOST_PANEL) * k + (size_t)c * DUCK_HOST_PANEL + r % DUCK_HOST_PANEL] =
                r < rows ? w[(size_t)r * ldw + c] : 0;
}

/* Row r, column c of packed half weights (host_kernels.h). */
static float packed(const uint16_t *w, size_t ldw, uint32_t r, uint32_t c)
{
    return duck_half_to_float(w[(size_t)(r - r % DUCK_HOST_PANEL) * ldw + (size_t)c * DUCK_HOST_PANEL +
                                r % DUCK_HOST_PANEL]);
}

static void gemm_h_ref(const uint16_t *w, size_t ldw, uint32_t rows, uint32_t k, uint32_t ntok,
                       const float *x, size_t ldx, float *y, size_t ldy)
{
    for (uint32_t r = 0; r < rows; r++)
        for (uint32_t t = 0; t < ntok; t++) {
            const float *xt = x + t * ldx;
            float acc = 0.0f;
            for (uint32_t c = 0; c < k; c++)
                acc += packed(w, ldw, r, c) * xt[c];
            y[t * ldy + r] = acc;
        }
}

static void gemv_t_ref(const float *p, const float *v, size_t ldv, uint32_t rows, uint32_t n, float *y)
{
    for (uint32_t c = 0; c < n; c++) {
        float acc = 0.0f;
        for (uint32_t r = 0; r < rows; r++)
            acc += p[r] * v[r * ldv + c];
        y[c] = acc;
    }
}

static void gemv_t_h_ref(const float *p, const uint16_t *v, size_t ldv, uint32_t rows, uint32_t n, float *y)
{
    for (uint32_t c = 0; c < n; c++) {
        float acc = 0.0f;
        for (uint32_t r = 0; r < rows; r++)
            acc += p[r] * duck_half_to_float(v[r * ldv + c]);
        y[c] = acc;
    }
}

static void to_half_ref(const float *x, uint32_t n, uint16_t *out)
{
    for (uint32_t i = 0; i < n; i++)
        out[i] = duck_float_to_half(x[i]);
}

static void to_float_ref(const uint16_t *h, uint32_t n, float *out)
{
    for (uint32_t i = 0; i < n; i++)
        out[i] = duck_half_to_float(h[i]);
}

static uint32_t argmax_ref(const float *x, uint32_t n)
{
    uint32_t best = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (isnan(x[i]))
            return i;
        if (x[i] > x[best])
            best = i;
    }
    return best;
}

static float softmax_exp_ref(float *s, uint32_t n, float scale)
{
    float top = -INFINITY;
    for (uint32_t j = 0; j < n; j++) {
        s[j] *= scale;
        top = s[j] > top ? s[j] : top;
    }
    float sum = 0.0f;
    for (uint32_t j = 0; j < n; j++) {
        s[j] = expf(s[j] - top);
        sum += s[j];
    }
    return sum;
}

static const duck_host_kernels k_ref = {"ref",           gemm_ref,     dot_ref,      gemv_t_ref, gemm_h_ref,
                                        softmax_exp_ref, gemv_t_h_ref, to_half_ref, to_float_ref, argmax_ref};

const duck_host_kernels *duck_host_kernels_ref(void) { return &k_ref; }
