/* Portable scalar reference of the host kernels: plain loops, one fp32
 * accumulator per sum, in index order. */
#include "host_kernels.h"

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

static void gemv_t_ref(const float *p, const float *v, size_t ldv, uint32_t rows, uint32_t n, float *y)
{
    for (uint32_t c = 0; c < n; c++) {
        float acc = 0.0f;
        for (uint32_t r = 0; r < rows; r++)
            acc += p[r] * v[r * ldv + c];
        y[c] = acc;
    }
}

static const duck_host_kernels k_ref = {"ref", gemm_ref, dot_ref, gemv_t_ref};

const duck_host_kernels *duck_host_kernels_ref(void) { return &k_ref; }
