/* Portable scalar reference of the fp9 kernels: the plainest reading of the
 * spec, against which the fast versions are tested. */
#include "kernels.h"

#include <string.h>

static inline float decode_scaled(uint8_t code, int negative)
{
    /* the kernel-domain decode of fp9.h: a shift, value * 2^-112 */
    uint32_t u = ((uint32_t)code << FP9_DECODE_SHIFT) | ((uint32_t)negative << 31);
    float w;
    memcpy(&w, &u, 4);
    return w;
}

static float dot_row_ref(const fp9_matrix *m, uint32_t row, const float *x)
{
    const float *scales = m->block_scales ? &m->block_scales[(size_t)row * fp9_scale_cols(m)] : NULL;
    uint32_t r = row & 1;
    float total = 0.0f, partial = 0.0f;
    for (uint32_t g = 0; g < m->groups; g++) {
        const fp9_block *b = &m->blocks[fp9_block_index(m->row_pairs, m->groups, row / 2, g)];
        for (uint32_t c = 0; c < FP9_GROUP; c++)
            partial += decode_scaled(b->mag[r][c], (int)((b->sign[r] >> c) & 1)) * x[g * FP9_GROUP + c];
        if ((g & 1) || g + 1 == m->groups) {   /* end of a 128-column scale block */
            total += scales ? partial * scales[g / 2] : partial;
            partial = 0.0f;
        }
    }
    return total * m->prescale * 0x1p48f;
}

static void gemm_ref(const fp9_matrix *m, uint32_t pair_begin, uint32_t pair_end,
                     uint32_t ntok, const float *const *x, float *const *y, int accumulate)
{
    uint32_t row_end = 2 * pair_end < m->rows ? 2 * pair_end : m->rows;
    for (uint32_t t = 0; t < ntok; t++)
        for (uint32_t row = 2 * pair_begin; row < row_end; row++) {
            float v = dot_row_ref(m, row, x[t]);
            y[t][row] = accumulate ? y[t][row] + v : v;
        }
}

static const duck_kernels k_ref = {"ref", gemm_ref};

const duck_kernels *duck_kernels_ref(void) { return &k_ref; }

void fp9_prepare_x_f32(const float *x, uint32_t n, uint32_t n_padded, float *out)
{
    for (uint32_t i = 0; i < n; i++)
        out[i] = x[i] * 0x1p64f;
    for (uint32_t i = n; i < n_padded; i++)
        out[i] = 0.0f;
}

void fp9_prepare_x_bf16(const uint16_t *x, uint32_t n, uint32_t n_padded, float *out)
{
    for (uint32_t i = 0; i < n; i++) {
        uint32_t u = (uint32_t)x[i] << 16;
        float v;
        memcpy(&v, &u, 4);
        out[i] = v * 0x1p64f;
    }
    for (uint32_t i = n; i < n_padded; i++)
        out[i] = 0.0f;
}

void duck_f32_to_bf16(const float *x, size_t n, uint16_t *out)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &x[i], 4);
        if ((u & 0x7FFFFFFFu) > 0x7F800000u)
            out[i] = (uint16_t)((u >> 16) | 0x40);
        else
            out[i] = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
    }
}
