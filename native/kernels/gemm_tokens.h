/* The many-token GEMM of the vector kernel sets. The weights of a
 * micro-panel (GEMM_PAIRS row pairs) are decoded once per 128 columns into
 * an L1 buffer, transposed: column k is 2 * GEMM_PAIRS consecutive floats,
 * one per row. A register tile then computes those rows for up to
 * GEMM_TOKENS tokens: per column, the rows are vector loads, each token's
 * activation a broadcast, each pair of them one FMA; the rows sit in vector
 * lanes, so the outputs need no horizontal sums. Every 128 columns (one
 * block-scale block) the tile adds its partial dots, times the rows' scales
 * (prescale * 2^48, and the block scale where there is one), to y: per
 * 128-column block, like _ref (within a block the order of the sums
 * differs). A row is one lane of the tile whatever its place in it, so
 * the row split never changes a bit; a kernel set may sum a block in a
 * different order for tiles of few tokens (more FMA chains), so a token's
 * bits may depend on how many tokens share the call.
 *
 * Included by kernels_avx2.c and kernels_avx512.c inside their target
 * regions, after they define
 *   GEMM_PAIRS, GEMM_TOKENS;
 *   decode_panel(m, p, np, g, ng, wt, ahead, ahead_end)   groups [g, g + ng)
 *       of row pairs [p, p + np) (np <= GEMM_PAIRS) into wt[k][2 * GEMM_PAIRS],
 *       rows past np pairs zero; prefetching one line of [*ahead, ahead_end)
 *       per row it decodes (*ahead advances);
 *   tile(wt, n, x, k0, T, y, row, live, scale, load)   y[t][row + i] for
 *       i < live (= or, if load, +=) scale[i] times the dots of n decoded
 *       columns with x[t] + k0, for T (1 .. GEMM_TOKENS) tokens. */
#ifndef GEMM_PAIRS
#error "define GEMM_PAIRS, GEMM_TOKENS, decode_panel and tile before including gemm_tokens.h"
#endif
/* A kernel set may include this twice, the second time with other activations
 * (GEMM_X_T: what x points to), another name (GEMM_FN), its own decode_panel and
 * tile, and a factor its decoded weights carry beyond fp9.h's (GEMM_OUT_EXTRA,
 * folded into the outputs' scale). */
#ifndef GEMM_X_T
#define GEMM_X_T float
#endif
#ifndef GEMM_FN
#define GEMM_FN gemm_tokens
#endif
#ifndef GEMM_OUT_EXTRA
#define GEMM_OUT_EXTRA 1.0f
#endif

#ifndef GEMM_TOKENS_COMMON   /* once per file, whichever inclusion comes first */
#define GEMM_TOKENS_COMMON
#define GEMM_COLS FP9_SCALE_BLOCK   /* columns decoded per pass */
#endif

#define GEMM_TILE(T) \
    case T: tile(wt, n, x + t, k0, T, y + t, row, live, scale, load); break;

static void GEMM_FN(const fp9_matrix *m, uint32_t pair_begin, uint32_t pair_end, uint32_t ntok,
                    const GEMM_X_T *const *x, float *const *y, int accumulate)
{
    float wt[GEMM_COLS * 2 * GEMM_PAIRS] __attribute__((aligned(64)));
    float scale[2 * GEMM_PAIRS] __attribute__((aligned(64)));
    const float out_scale = m->prescale * 0x1p48f * GEMM_OUT_EXTRA;
    const uint32_t sc = fp9_scale_cols(m);
    /* tiles of balanced sizes: 16 tokens run as 8 + 8, not 12 + 4 */
    const uint32_t ntiles = (ntok + GEMM_TOKENS - 1) / GEMM_TOKENS;
    for (uint32_t p0 = 0; p0 < m->groups; p0 += FP9_PANEL_GROUPS) {
        const uint32_t p1 = p0 + fp9_panel_groups(m->groups, p0);
        const uint32_t nchunks = (p1 - p0 + GEMM_COLS / FP9_GROUP - 1) / (GEMM_COLS / FP9_GROUP);
        for (uint32_t p = pair_begin; p < pair_end; p += GEMM_PAIRS) {
            const uint32_t np = pair_end - p < GEMM_PAIRS ? pair_end - p : GEMM_PAIRS;
            const uint32_t row = 2 * p, live = m->rows - row < 2 * np ? m->rows - row : 2 * np;
            /* the weights of the next micro-panel, a share of them per chunk, prefetched
             * line by line among the decode's loads (bursts measured slower): the strided
             * reads of a micro-panel defeat the hardware prefetchers */
            size_t ahead;
            const char *next = fp9_next_run(m, p, GEMM_PAIRS, pair_begin, pair_end, p0, &ahead), *cursor = next;
            for (uint32_t i = 0; i < 2 * GEMM_PAIRS; i++)
                scale[i] = out_scale;
            for (uint32_t g = p0, c = 0; g < p1; g += GEMM_COLS / FP9_GROUP, c++) {
                const uint32_t ng = p1 - g < GEMM_COLS / FP9_GROUP ? p1 - g : GEMM_COLS / FP9_GROUP;
                const uint32_t n = ng * FP9_GROUP, k0 = g * FP9_GROUP;
                const int load = accumulate || g > 0;
                if (m->block_scales)
                    for (uint32_t i = 0; i < 2 * np; i++)
                        scale[i] = m->block_scales[(size_t)(row + i) * sc + g / 2] * out_scale;
                decode_panel(m, p, np, g, ng, wt, &cursor, next ? next + ahead * (c + 1) / nchunks : NULL);
                for (uint32_t j = 0, t = 0; j < ntiles; j++) {
                    const uint32_t nt = ntok / ntiles + (j < ntok % ntiles);
                    switch (nt) {
                        GEMM_TILE(1) GEMM_TILE(2) GEMM_TILE(3) GEMM_TILE(4) GEMM_TILE(5) GEMM_TILE(6)
#if GEMM_TOKENS > 6
                        GEMM_TILE(7) GEMM_TILE(8) GEMM_TILE(9) GEMM_TILE(10) GEMM_TILE(11) GEMM_TILE(12)
#endif
                    default: break;
                    }
                    t += nt;
                }
            }
        }
    }
}

#undef GEMM_TILE
#undef GEMM_X_T
#undef GEMM_FN
#undef GEMM_OUT_EXTRA
