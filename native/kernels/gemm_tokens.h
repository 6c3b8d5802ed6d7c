/* The many-token GEMM of the vector kernel sets: decode a chunk of a row
 * pair once into L1 and reuse it for every token, panel by panel like the
 * GEMV, so the weights stream. Included by kernels_avx2.c and
 * kernels_avx512.c inside their target regions, after they define
 *   TOKENS_TILE    tokens per register tile;
 *   decode_pair(m, p, g0, ng, w0, w1)  groups [g0, g0 + ng) of row pair p
 *                  into two fp32 rows, block scales folded in;
 *   tile(w0, w1, n, x, k0, T, ys0, ys1)  adds the dots of n decoded columns
 *                  with x[i] + k0 for T (1 .. TOKENS_TILE) tokens to ys0/ys1;
 *   store_out(y, row, rows, v, accumulate). */
#ifndef TOKENS_TILE
#error "define TOKENS_TILE, decode_pair, tile and store_out before including gemm_tokens.h"
#endif

#define TOKENS_CHUNK 1024   /* columns decoded per pass: 2 rows x 4 KiB stay in L1 */

/* T tokens with a tile of at most TOKENS_TILE, T known at compile time in each case. */
#define TOKENS_TAIL(T) \
    case T: tile(w0, w1, n, x + t, k0, (T) < TOKENS_TILE ? (T) : TOKENS_TILE, ys0 + t, ys1 + t); break;

static void gemm_tokens(const fp9_matrix *m, uint32_t pair_begin, uint32_t pair_end, uint32_t ntok,
                        const float *const *x, float *const *y, int accumulate)
{
    float w0[TOKENS_CHUNK] __attribute__((aligned(64))), w1[TOKENS_CHUNK] __attribute__((aligned(64)));
    float ys0[DUCK_MAX_TOKENS], ys1[DUCK_MAX_TOKENS];
    const float out_scale = m->prescale * 0x1p48f;
    for (uint32_t p0 = 0; p0 < m->groups; p0 += FP9_PANEL_GROUPS) {
        const uint32_t p1 = p0 + fp9_panel_groups(m->groups, p0);
        for (uint32_t p = pair_begin; p < pair_end; p++) {
            for (uint32_t t = 0; t < ntok; t++)
                ys0[t] = ys1[t] = 0.0f;
            for (uint32_t g0 = p0; g0 < p1; g0 += TOKENS_CHUNK / FP9_GROUP) {
                uint32_t ng = p1 - g0 < TOKENS_CHUNK / FP9_GROUP ? p1 - g0 : TOKENS_CHUNK / FP9_GROUP;
                uint32_t n = ng * FP9_GROUP, k0 = g0 * FP9_GROUP;
                decode_pair(m, p, g0, ng, w0, w1);
                uint32_t t = 0;
                for (; t + TOKENS_TILE <= ntok; t += TOKENS_TILE)
                    tile(w0, w1, n, x + t, k0, TOKENS_TILE, ys0 + t, ys1 + t);
                switch (ntok - t) {   /* fewer than TOKENS_TILE (at most 8) left */
                    TOKENS_TAIL(1) TOKENS_TAIL(2) TOKENS_TAIL(3) TOKENS_TAIL(4) TOKENS_TAIL(5) TOKENS_TAIL(6)
                    TOKENS_TAIL(7)
                default: break;
                }
            }
            const int add = accumulate || p0 > 0;
            for (uint32_t t = 0; t < ntok; t++) {
                store_out(y[t], 2 * p, m->rows, ys0[t] * out_scale, add);
                store_out(y[t], 2 * p + 1, m->rows, ys1[t] * out_scale, add);
            }
        }
    }
}

#undef TOKENS_TAIL
