/* The half-weight GEMM (duck_host_gemm_h_fn) of one SIMD set: a template body
 * (no include guard, meant to be included once per set) included by
 * host_kernels_avx2.c and host_kernels_avx512.c after they define
 *
 *   GEMM_H        the function's name
 *   VEC           the set's fp32 vector type, of VEC_LANES floats; VEC_ZERO(), VEC_SUM(v)
 *                 its zero and horizontal sum; VEC_WIDEN(p, h) VEC_LANES halves at h
 *                 to floats at p (aligned)
 *   fma4_tokens   four rows' sums with nt tokens (ldx apart) over n columns, carried in
 *                 VEC a[nt][4] (the chains the set's fp32 gemm forms every sum with)
 *   TOKEN_TILE    the most tokens whose sums are carried at once
 *
 * Four rows at a time: the rows are widened PANEL_K columns at a time, and
 * the tokens of a tile of TOKEN_TILE run fma4_tokens over the panel with their
 * sums carried from one panel to the next; the sums of rows past the last
 * are dropped. The same FMAs in the same order as the set's gemm on the
 * widened weights, so the results are the same bits. */

#define PANEL_K 1024u     /* 4 x 1024 floats: 16 KiB, in L1 */

/* Rows [0, live) of w, columns [0, n), widened into the panel: zero past n up
 * to a whole vector, and the rows past live all zero. */
static void widen_panel(const uint16_t *w, size_t ldw, uint32_t live, uint32_t n, float *panel)
{
    const uint32_t padded = (n + VEC_LANES - 1) & ~(VEC_LANES - 1);
    for (uint32_t i = 0; i < 4; i++) {
        float *p = panel + (size_t)i * PANEL_K;
        if (i >= live) {
            memset(p, 0, sizeof(float) * padded);
            continue;
        }
        const uint16_t *wr = w + i * ldw;
        uint32_t c = 0;
        for (; c + VEC_LANES <= n; c += VEC_LANES)
            VEC_WIDEN(p + c, wr + c);
        for (; c < padded; c++)
            p[c] = c < n ? duck_half_to_float(wr[c]) : 0.0f;
    }
}

static void GEMM_H(const uint16_t *w, size_t ldw, uint32_t rows, uint32_t k, uint32_t ntok, const float *x,
                   size_t ldx, float *y, size_t ldy)
{
    float panel[4 * PANEL_K] __attribute__((aligned(64)));
    VEC acc[TOKEN_TILE][4];
    for (uint32_t r = 0; r < rows; r += 4) {
        const uint32_t live = rows - r < 4 ? rows - r : 4;
        for (uint32_t t0 = 0; t0 < ntok; t0 += TOKEN_TILE) {
            const uint32_t nt = ntok - t0 < TOKEN_TILE ? ntok - t0 : TOKEN_TILE;
            for (uint32_t t = 0; t < nt; t++)
                acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = VEC_ZERO();
            for (uint32_t c0 = 0; c0 < k; c0 += PANEL_K) {
                const uint32_t n = k - c0 < PANEL_K ? k - c0 : PANEL_K;
                widen_panel(w + (size_t)r * ldw + c0, ldw, live, n, panel);
                fma4_tokens(panel, panel + PANEL_K, panel + 2 * PANEL_K, panel + 3 * PANEL_K,
                            x + (size_t)t0 * ldx + c0, ldx, nt, n, acc);
            }
            for (uint32_t t = 0; t < nt; t++)
                for (uint32_t i = 0; i < live; i++)
                    y[(size_t)(t0 + t) * ldy + r + i] = VEC_SUM(acc[t][i]);
        }
    }
}

#undef GEMM_H
#undef VEC
#undef VEC_LANES
#undef VEC_ZERO
#undef VEC_SUM
#undef VEC_WIDEN
#undef PANEL_K
#undef TOKEN_TILE
