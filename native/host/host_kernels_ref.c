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

static const duck_host_kernels k_ref = {"ref", gemm_ref, dot_ref, gemv_t_ref, gemm_h_ref, softmax_exp_ref};

const duck_host_kernels *duck_host_kernels_ref(void) { return &k_ref; }
