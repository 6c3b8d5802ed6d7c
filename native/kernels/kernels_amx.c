/* The amx kernel set: avx512, with the many-token GEMM (5 tokens or more) on AMX
 * tiles. Where every activation of the call is exactly a bf16 (what a GPU host
 * sends: a prefill chunk's gate/up, and on bf16 activations the down projection
 * too, ffn.c) they are the B operand as they stand. Other fp32 activations (a
 * CPU host's) take avx512's batch-invariant GEMM (kernels.h); with batch
 * invariance off they are split into three bf16 parts whose sum is each value exactly, and
 * every A tile is multiplied with the three (split3_rows): the products stay
 * exact, so the result is an fp32 GEMM's in another order of sums. The tiles
 * are not what bounds the GEMM (the decode is), so three times the tile
 * products cost little: at 32 tokens on the development VM's Xeon, one thread,
 * 265 GFLOP/s on fp32 activations against 277 on bf16 and 140 for avx512's FMAs.
 *
 * TDPBF16PS multiplies A (16 rows x 32 bf16) by B (16 column pairs x 16, one
 * dword per column) into C (16 x 16 fp32). The weights are A: a row's 32
 * decoded words (fp9_decode_avx512.h) are an A tile's row as they stand, bf16
 * patterns of value * 2^-112, taken to value * 2^-48 by adding 64 to their
 * exponents (exact; e5m3's subnormals, which TDPBF16PS would read as 0, through
 * an fp32 multiply). The activations are B, transposed once per call into token
 * tiles of 16. A micro-panel of 32 rows is decoded 128 columns at a time into
 * 8 KiB (L1) and multiplied with every token tile, the next 128 columns decoded
 * into a second buffer between those tile products; a panel's sums gather in the
 * C tiles (rows x tokens) and go to y transposed, times the scales. Eight tiles:
 * C 0-3 (32 rows x 32 tokens), A 4-5, B 6-7. Each product is exact (bf16 x bf16
 * fits fp32); the sums run in another order than _ref's.
 *
 * On the H200 host's Xeon (Sapphire/Emerald Rapids) VDPBF16PS issues on one
 * port where the FMA issues on two, so the avx512-bf16 set ran slower than
 * avx512 there (0.39 vs 0.59 of the FMA peak at 32 tokens per expert); a
 * TDPBF16PS makes 16 x 16 x 32 products.
 *
 * "amx-emu" runs the same tile program with the tile instructions emulated in C
 * (TDPBF16PS's order of sums per lane: the even product, then the odd one), so
 * a machine without AMX (the development machine, CI with AVX-512) tests the
 * program and its layouts against _ref; it is slow and never chosen. Tile
 * instructions are written as inline assembly with a memory clobber: the
 * compiler's own AMX intrinsics do not tell it that tileloadd reads (and
 * tilestored writes) the buffers the C code fills and reads. */
#define _GNU_SOURCE
#include "kernels.h"
#include "pool.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")
#include <immintrin.h>

#include "fp9_decode_avx512.h"

#define AMX_MIN_TOKENS 5     /* fewer: avx512's GEMVs (fp32 activations at 5 tokens: tiles and FMAs even) */

/* The emulated tiles: C 0-3 in c, A and B (4-7) in ab. */
typedef struct amx_emu {
    float c[4][16][16];
    uint32_t ab[4][16][16];
} amx_emu;

static void *emu_tile(amx_emu *e, int t) { return t < 4 ? (void *)e->c[t] : (void *)e->ab[t - 4]; }

static atomic_ullong emu_dots;         /* emulated TDPBF16PS so far (tests: the program ran) */

static void emu_load(void *t, const void *base, size_t stride)
{
    for (int r = 0; r < 16; r++)
        memcpy((uint8_t *)t + 64 * r, (const uint8_t *)base + r * stride, 64);
}

static void emu_store(float t[16][16], void *base, size_t stride)
{
    for (int r = 0; r < 16; r++)
        memcpy((uint8_t *)base + r * stride, t[r], 64);
}

static inline float bf16_lo(uint32_t v) { uint32_t b = v << 16; float f; memcpy(&f, &b, 4); return f; }
static inline float bf16_hi(uint32_t v) { uint32_t b = v & 0xFFFF0000u; float f; memcpy(&f, &b, 4); return f; }

/* TDPBF16PS: c[m][n] += a[m][k].lo * b[k][n].lo, then += a[m][k].hi * b[k][n].hi, k = 0 .. 15 */
static void emu_dp(float c[16][16], const uint32_t a[16][16], const uint32_t b[16][16])
{
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 16; n++) {
            float acc = c[m][n];
            for (int k = 0; k < 16; k++) {
                acc += bf16_lo(a[m][k]) * bf16_lo(b[k][n]);
                acc += bf16_hi(a[m][k]) * bf16_hi(b[k][n]);
            }
            c[m][n] = acc;
        }
    atomic_fetch_add_explicit(&emu_dots, 1, memory_order_relaxed);
}

#define T_ZERO(t)                                              \
    do {                                                       \
        if (e)                                                 \
            memset(e->c[t], 0, sizeof e->c[t]);                \
        else                                                   \
            __asm__ volatile("tilezero %%tmm" #t ::: "memory"); \
    } while (0)
#define T_LOAD(t, base, stride)                                                                      \
    do {                                                                                             \
        if (e)                                                                                       \
            emu_load(emu_tile(e, t), base, stride);                                                  \
        else                                                                                         \
            __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(base), "r"((long)(stride)) : "memory"); \
    } while (0)
#define T_DP(dst, src1, src2)                                                                 \
    do {                                                                                      \
        if (e)                                                                                \
            emu_dp(e->c[dst], e->ab[(src1) - 4], e->ab[(src2) - 4]);                          \
        else                                                                                  \
            __asm__ volatile("tdpbf16ps %%tmm" #src2 ", %%tmm" #src1 ", %%tmm" #dst ::: "memory"); \
    } while (0)
#define T_STORE(t, base, stride)                                                                      \
    do {                                                                                              \
        if (e)                                                                                        \
            emu_store(e->c[t], base, stride);                                                         \
        else                                                                                          \
            __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(base), "r"((long)(stride)) : "memory"); \
    } while (0)

#define AMX_PAIRS 16                /* row pairs per micro-panel: 32 rows, two A tiles */
#define AMX_COLS FP9_SCALE_BLOCK    /* columns decoded per pass (one block-scale block) */

/* Thirty-two weights (words: bf16 patterns of value * 2^-112) as bf16 of
 * value * 2^-48, exactly: adding 64 to the exponent of each nonzero word where
 * none is subnormal (e5m3's smallest magnitudes, which TDPBF16PS would read as
 * 0; rare), else the fp32 multiply by 2^64 the avx512-bf16 decode makes. */
static inline __attribute__((always_inline)) __m512i times_2_64(__m512i w)
{
    const __mmask32 nz = _mm512_test_epi16_mask(w, _mm512_set1_epi16(0x7FFF));
    const __mmask32 sub = _mm512_mask_testn_epi16_mask(nz, w, _mm512_set1_epi16(0x7F80));
    if (__builtin_expect(sub == 0, 1))
        return _mm512_mask_add_epi16(w, nz, w, _mm512_set1_epi16(64 << 7));
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    const __m512 up = _mm512_set1_ps(0x1p64f);
    __m512 even = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), up);
    __m512 odd = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(w, high)), up);
    return _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(even), 16),
                           _mm512_and_si512(_mm512_castps_si512(odd), high));
}

/* Groups [g, g + ng) of row pairs [p + pr0, p + pr1) (of a micro-panel of np
 * live pairs at p) into wa[s][32][32]: per 32 columns s, each row's columns in
 * order as bf16 times 2^64 (two A tiles of 16 rows x 64 bytes), rows past np
 * pairs zero; one line of [*ahead, ahead_end) prefetched per 32 weights decoded
 * (*ahead advances). No transposition: a row's 32 decoded words are an A
 * tile's row as they stand. */
static inline __attribute__((always_inline)) void decode_a(const fp9_matrix *m, uint32_t p, uint32_t np, uint32_t g,
                                                           uint32_t ng, uint32_t pr0, uint32_t pr1, uint16_t *wa,
                                                           const char **ahead, const char *ahead_end)
{
    const char *pf = *ahead;
    const uint32_t g0 = g - g % FP9_PANEL_GROUPS;
    for (uint32_t pr = pr0; pr < pr1; pr++) {
        const fp9_block *run = pr < np ? fp9_pair_run(m, p + pr, g0) + (g - g0) : NULL;
        for (uint32_t gi = 0; gi < ng; gi++)
            for (int h = 0; h < 2; h++)
                for (int r = 0; r < 2; r++) {
                    __m512i out = _mm512_setzero_si512();
                    if (run) {
                        if (pf < ahead_end) {
                            _mm_prefetch(pf, _MM_HINT_T0);
                            pf += 64;
                        }
                        out = times_2_64(decode32_words(run[gi].mag[r], &run[gi].sign[r], h));
                    }
                    _mm512_store_si512(wa + ((size_t)(2 * gi + h) * 32 + 2 * pr + r) * 32, out);
                }
    }
    *ahead = pf;
}

/* The B operand: xb[j][kp][16], token tile j's 16 tokens' column pairs kp (one
 * dword, two bf16, per token), from ntt * 16 bf16 rows of kpairs dwords. */
static void activations_b(const uint32_t *rows, uint32_t ntt, uint32_t kpairs, uint32_t *xb)
{
    for (uint32_t j = 0; j < ntt; j++)
        for (uint32_t kp = 0; kp < kpairs; kp += 16) {
            __m512i r[16];
            for (int t = 0; t < 16; t++)
                r[t] = _mm512_loadu_si512(rows + ((size_t)j * 16 + t) * kpairs + kp);
            transpose16(r);   /* r[d] lane t: token t's pair kp + d */
            for (int d = 0; d < 16; d++)
                _mm512_store_si512(xb + ((size_t)j * kpairs + kp + d) * 16, r[d]);
        }
}

/* acc holds a micro-panel's sums per pair of token tiles: 4 tiles of 16 rows x
 * 16 tokens, (token tile j, row tile i) at (j / 2 * 4 + 2 * (j % 2) + i) * 256.
 * Transposed to y[t][row ..] times scale (or, if load, onto it), `live` rows. */
static void acc_out(const float *acc, uint32_t ntok, float *const *y, uint32_t row, uint32_t live, float scale,
                    int load)
{
    const __m512 s = _mm512_set1_ps(scale);
    for (uint32_t j = 0; 16 * j < ntok; j++) {
        const uint32_t nt = ntok - 16 * j < 16 ? ntok - 16 * j : 16;
        for (uint32_t i = 0; i < 2 && 16 * i < live; i++) {
            const uint32_t lv = live - 16 * i < 16 ? live - 16 * i : 16;
            const __mmask16 mk = lv >= 16 ? 0xFFFF : (__mmask16)((1u << lv) - 1);
            const float *b = acc + ((size_t)(j / 2) * 4 + 2 * (j % 2) + i) * 256;
            __m512i r[16];
            for (int q = 0; q < 16; q++)
                r[q] = _mm512_load_si512(b + 16 * q);
            transpose16(r);   /* r[t] lane q: row q for token t */
            for (uint32_t t = 0; t < nt; t++) {
                float *dst = y[16 * j + t] + row + 16 * i;
                __m512 v = load ? _mm512_maskz_loadu_ps(mk, dst) : _mm512_setzero_ps();
                _mm512_mask_storeu_ps(dst, mk, _mm512_fmadd_ps(_mm512_castsi512_ps(r[t]), s, v));
            }
        }
    }
}

/* C tile q (0-3) times the rows' block scales of columns [k0, k0 + 128) into
 * (or, unless first, onto) dst: one 16 x 16 tile of acc. */
static void scaled_into(amx_emu *e, int q, float *dst, const fp9_matrix *m, uint32_t r0, uint32_t g, int first)
{
    float tmp[16][16] __attribute__((aligned(64)));
    switch (q) {
    case 0: T_STORE(0, tmp, 64); break;
    case 1: T_STORE(1, tmp, 64); break;
    case 2: T_STORE(2, tmp, 64); break;
    default: T_STORE(3, tmp, 64); break;
    }
    const uint32_t sc = fp9_scale_cols(m);
    for (uint32_t i = 0; i < 16; i++) {
        const float bs = r0 + i < m->rows ? m->block_scales[(size_t)(r0 + i) * sc + g / 2] : 0.0f;
        __m512 v = _mm512_mul_ps(_mm512_load_ps(tmp[i]), _mm512_set1_ps(bs));
        _mm512_store_ps(dst + 16 * i, first ? v : _mm512_add_ps(_mm512_load_ps(dst + 16 * i), v));
    }
}

/* The chunk of weights (a micro-panel's 32 rows x 128 columns) the GEMM decodes
 * next: micro-panel p (np live pairs), groups [g, g + ng), the c-th of its
 * panel; and the prefetch of the micro-panel after p, a share per chunk. */
typedef struct amx_cursor {
    const fp9_matrix *m;
    uint32_t pair_begin, pair_end, p0, p1, nchunks;
    uint32_t p, np, g, ng, c;
    int live;                  /* a chunk is left to decode */
    const char *next, *pf;     /* the next micro-panel's blocks, and how far prefetched */
    size_t ahead;
} amx_cursor;

#define AMX_CHUNK_GROUPS (AMX_COLS / FP9_GROUP)

static void cursor_at(amx_cursor *d, uint32_t p)
{
    d->p = p;
    d->np = d->pair_end - p < AMX_PAIRS ? d->pair_end - p : AMX_PAIRS;
    d->g = d->p0;
    d->ng = d->p1 - d->p0 < AMX_CHUNK_GROUPS ? d->p1 - d->p0 : AMX_CHUNK_GROUPS;
    d->c = 0;
    d->live = 1;
    d->next = d->pf = fp9_next_run(d->m, p, AMX_PAIRS, d->pair_begin, d->pair_end, d->p0, &d->ahead);
}

static void cursor_advance(amx_cursor *d)
{
    d->g += AMX_CHUNK_GROUPS;
    d->c++;
    if (d->g < d->p1)
        d->ng = d->p1 - d->g < AMX_CHUNK_GROUPS ? d->p1 - d->g : AMX_CHUNK_GROUPS;
    else if (d->p + AMX_PAIRS < d->pair_end)
        cursor_at(d, d->p + AMX_PAIRS);
    else
        d->live = 0;
}

/* Pairs [pr0, pr1) of the cursor's chunk into wa. */
static inline __attribute__((always_inline)) void cursor_decode(amx_cursor *d, uint32_t pr0, uint32_t pr1,
                                                                uint16_t *wa, int prefetch)
{
    const char *end = prefetch && d->next ? d->next + d->ahead * (d->c + 1) / d->nchunks : NULL;
    decode_a(d->m, d->p, d->np, d->g, d->ng, pr0, pr1, wa, &d->pf, end);
}

/* Bench only (duck_kernels_amx_parts): parts of the GEMM left out or reordered,
 * to time the others. The results are then wrong. */
static atomic_int amx_parts;

/* The GEMM of a micro-panel at a time (32 rows): per 128 columns its weights
 * are decoded once into a buffer of 8 KiB (L1) and multiplied with every token
 * tile of xb; two buffers, so that the next chunk (the next 128 columns, or the
 * next micro-panel's first) is decoded a quarter at a time between the tile
 * products of this one: the vector units decode while the tiles multiply,
 * within the core's window of instructions in flight, and the tiles never
 * load what was stored just before. The sums of a panel (2048 columns) gather
 * in the C tiles (16 rows x 16 tokens each; kept in the tiles across the panel
 * where two token tiles hold every token and there are no block scales, else
 * through acc per 128 columns, block-scaled there), then go to y transposed.
 * The order of panels and micro-panels is gemm_tokens.h's. */
static void gemm_tiles(const fp9_matrix *m, uint32_t pair_begin, uint32_t pair_end, uint32_t ntok,
                       const uint32_t *xb, uint32_t nparts, float *acc, float *const *y, int accumulate, amx_emu *e)
{
    uint16_t wa[2][AMX_COLS * 2 * AMX_PAIRS] __attribute__((aligned(64)));
    const uint32_t kpairs = m->groups * FP9_GROUP / 2, ntt = (ntok + 15) / 16;
    const size_t part = (size_t)ntt * kpairs * 16;   /* dwords of xb per part */
    const float out_scale = m->prescale * 0x1p48f * 0x1p-64f;   /* the weights decoded times 2^64 */
    const int keep = ntt <= 2 && !m->block_scales;
    const int parts = atomic_load_explicit(&amx_parts, memory_order_relaxed);
    const int decode = !(parts & DUCK_AMX_PART_NO_DECODE), tiles = !(parts & DUCK_AMX_PART_NO_TILES);
    const int interleave = !(parts & DUCK_AMX_PART_SERIAL), prefetch = !(parts & DUCK_AMX_PART_NO_PREFETCH);
    for (uint32_t p0 = 0; p0 < m->groups; p0 += FP9_PANEL_GROUPS) {
        const uint32_t p1 = p0 + fp9_panel_groups(m->groups, p0);
        amx_cursor d = {.m = m, .pair_begin = pair_begin, .pair_end = pair_end, .p0 = p0, .p1 = p1,
                        .nchunks = (p1 - p0 + AMX_CHUNK_GROUPS - 1) / AMX_CHUNK_GROUPS};
        cursor_at(&d, pair_begin);
        cursor_decode(&d, 0, AMX_PAIRS, wa[0], prefetch);
        if (!decode)
            memcpy(wa[1], wa[0], sizeof wa[1]);
        cursor_advance(&d);
        int buf = 0;
        for (uint32_t p = pair_begin; p < pair_end; p += AMX_PAIRS) {
            const uint32_t np = pair_end - p < AMX_PAIRS ? pair_end - p : AMX_PAIRS;
            const uint32_t row = 2 * p, live = m->rows - row < 2 * np ? m->rows - row : 2 * np;
            for (uint32_t g = p0; g < p1; g += AMX_CHUNK_GROUPS) {
                const uint32_t ng = p1 - g < AMX_CHUNK_GROUPS ? p1 - g : AMX_CHUNK_GROUPS;
                const uint32_t steps = ng * FP9_GROUP / 32, kp0 = g * FP9_GROUP / 2;
                const int first = g == p0, last = g + AMX_CHUNK_GROUPS >= p1;
                const uint16_t *cur = wa[buf];
                uint16_t *nxt = wa[buf ^ 1];
                const int ahead = d.live && decode;
                for (uint32_t tt = 0; tt < ntt && tiles; tt += 2) {
                    const int two = tt + 1 < ntt;
                    float *blk = acc + (size_t)tt * 512;
                    if (!keep && !m->block_scales && !first) {
                        T_LOAD(0, blk, 64);
                        T_LOAD(1, blk + 256, 64);
                        if (two) {
                            T_LOAD(2, blk + 512, 64);
                            T_LOAD(3, blk + 768, 64);
                        }
                    } else if (!keep || first) {
                        T_ZERO(0);
                        T_ZERO(1);
                        if (two) {
                            T_ZERO(2);
                            T_ZERO(3);
                        }
                    }
                    for (uint32_t s = 0; s < steps; s++) {   /* 32 columns: 16 pairs */
                        T_LOAD(4, cur + (size_t)s * 1024, 64);         /* rows 0-15 */
                        T_LOAD(5, cur + (size_t)s * 1024 + 512, 64);   /* rows 16-31 */
                        for (uint32_t q = 0; q < nparts; q++) {       /* fp32 activations: hi, mid, lo */
                            const uint32_t *xq = xb + (size_t)q * part;
                            T_LOAD(6, xq + ((size_t)tt * kpairs + kp0 + 16 * s) * 16, 64);
                            T_DP(0, 4, 6);
                            T_DP(1, 5, 6);
                            if (two) {
                                T_LOAD(7, xq + ((size_t)(tt + 1) * kpairs + kp0 + 16 * s) * 16, 64);
                                T_DP(2, 4, 7);
                                T_DP(3, 5, 7);
                            }
                        }
                        if (tt == 0 && ahead && interleave)   /* a share of the next chunk's rows */
                            cursor_decode(&d, s * AMX_PAIRS / steps, (s + 1) * AMX_PAIRS / steps, nxt, prefetch);
                    }
                    if (m->block_scales) {
                        for (int q = 0; q < (two ? 4 : 2); q++)
                            scaled_into(e, q, blk + 256 * q, m, row + 16 * (q & 1), g, first);
                    } else if (!keep || last) {
                        T_STORE(0, blk, 64);
                        T_STORE(1, blk + 256, 64);
                        if (two) {
                            T_STORE(2, blk + 512, 64);
                            T_STORE(3, blk + 768, 64);
                        }
                    }
                }
                if (ahead && (!interleave || !tiles))
                    cursor_decode(&d, 0, AMX_PAIRS, nxt, prefetch);
                if (d.live)
                    cursor_advance(&d);
                buf ^= 1;
            }
            if (!(parts & DUCK_AMX_PART_NO_OUT))
                acc_out(acc, ntok, y, row, live, out_scale, accumulate || p0 > 0);
        }
    }
}

/* Palette 1, tiles 0-7 of 16 rows x 64 bytes. */
static void amx_configure(void)
{
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((aligned(64))) cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg) : "memory");
}

/* fp32 activations as three bf16 parts whose sum is each value exactly: hi its top 16
 * bits, mid the top 16 bits of x - hi, lo the rest (x - hi - mid has at most 8
 * significant bits; its exponent is at least x's - 24, so for the GEMM's prepared
 * activations, x * 2^64, never a bf16 subnormal). Rows as duck_bf16_rows lays them
 * out, part q's at q * (ntok rounded up to pad) * cols / 2 dwords, in this thread's
 * scratch slot 0. Products of the parts with the weights are exact; their sums go
 * into the same fp32 tiles, so the result is the fp32 GEMM's in another order of
 * sums (three terms per product). */
static const uint32_t *split3_rows(const float *const *x, uint32_t ntok, uint32_t pad, uint32_t cols)
{
    const uint32_t padded = (ntok + pad - 1) / pad * pad;
    const size_t part = (size_t)padded * cols / 2;
    uint32_t *buf = duck_thread_scratch(0, 3 * part * sizeof(uint32_t));
    if (!buf)
        return NULL;
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    for (uint32_t t = 0; t < ntok; t++)
        for (uint32_t c = 0; c < cols; c += 32) {
            __m512 v[2] = {_mm512_loadu_ps(x[t] + c), _mm512_loadu_ps(x[t] + c + 16)};
            for (int q = 0; q < 3; q++) {
                __m512 top[2], rest[2];
                for (int i = 0; i < 2; i++) {
                    top[i] = q < 2 ? _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v[i]), high)) : v[i];
                    rest[i] = _mm512_sub_ps(v[i], top[i]);
                }
                /* exact: each value is a bf16 already */
                _mm512_storeu_si512(buf + q * part + ((size_t)t * cols + c) / 2,
                                    (__m512i)_mm512_cvtne2ps_pbh(top[1], top[0]));
                v[0] = rest[0], v[1] = rest[1];
            }
        }
    for (int q = 0; q < 3; q++)
        memset(buf + q * part + (size_t)ntok * cols / 2, 0, (size_t)(padded - ntok) * cols / 2 * sizeof(uint32_t));
    return buf;
}

static void gemm_amx_with(const fp9_matrix *m, uint32_t pair_begin, uint32_t pair_end, uint32_t ntok,
                          const float *const *x, float *const *y, int accumulate, amx_emu *e)
{
    const uint32_t cols = m->groups * FP9_GROUP, ntt = (ntok + 15) / 16;
    const uint32_t *rows = NULL;
    uint32_t nparts = 1;
    uint32_t *xb;
    float *acc;
    if (ntok >= AMX_MIN_TOKENS && pair_begin < pair_end &&
        !(rows = duck_bf16_rows(x, ntok, 16 /* a tile's rows */, cols, NULL)) && !duck_kernels_batch_invariant())
        rows = split3_rows(x, ntok, 16, cols), nparts = 3;
    const size_t part = (size_t)ntt * 16 * cols / 2;   /* dwords of a part's rows, and of its B tiles */
    if (rows && (xb = duck_thread_scratch(1, nparts * part * sizeof(uint32_t))) &&
        (acc = duck_thread_scratch(2, (size_t)(ntt + 1) / 2 * 4 * 256 * sizeof(float)))) {
        for (uint32_t q = 0; q < nparts; q++)
            activations_b(rows + q * part, ntt, cols / 2, xb + q * part);
        if (!e)
            amx_configure();
        gemm_tiles(m, pair_begin, pair_end, ntok, xb, nparts, acc, y, accumulate, e);
        if (!e)
            __asm__ volatile("tilerelease" ::: "memory");
        return;
    }
    duck_kernels_avx512()->gemm(m, pair_begin, pair_end, ntok, x, y, accumulate);
}

/* The tile rate alone, for the kernel benchmark (duck_kernels_amx_probe): rounds
 * of four TDPBF16PS into the four C tiles, with the GEMM's inner loop around them
 * by mode: 0 none (A and B loaded once: the tiles' own rate), 1 the A and B tile
 * loads from L1 (two token tiles' worth), 2 also the A buffer rewritten by vector
 * stores just before its loads, as the decode writes it. */
typedef struct probe_job {
    int mode;
    uint64_t rounds;
} probe_job;

static void probe_task(void *arg, unsigned worker, unsigned nworkers)
{
    (void)worker;
    (void)nworkers;
    const probe_job *j = arg;
    amx_emu *e = NULL;
    uint16_t wa[1024] __attribute__((aligned(64)));
    uint32_t xb[512] __attribute__((aligned(64)));
    for (int i = 0; i < 1024; i++)
        wa[i] = (uint16_t)(0x3F80 + (i & 7));       /* bf16 1.0 .. 1.05: no subnormals, no overflow */
    for (int i = 0; i < 512; i++)
        xb[i] = 0x3C003C00u;                         /* bf16 pairs of 2^-7 */
    amx_configure();
    T_ZERO(0);
    T_ZERO(1);
    T_ZERO(2);
    T_ZERO(3);
    T_LOAD(4, wa, 64);
    T_LOAD(5, wa + 512, 64);
    T_LOAD(6, xb, 64);
    T_LOAD(7, xb + 256, 64);
    const __m512i v = _mm512_load_si512(wa);
    for (uint64_t r = 0; r < j->rounds; r++) {
        if (j->mode == 2)
            for (int q = 0; q < 32; q++)
                _mm512_store_si512(wa + 32 * q, _mm512_add_epi16(v, _mm512_set1_epi16((short)(r & 1))));
        if (j->mode >= 1) {
            T_LOAD(4, wa, 64);
            T_LOAD(5, wa + 512, 64);
            T_LOAD(6, xb, 64);
            T_LOAD(7, xb + 256, 64);
        }
        T_DP(0, 4, 6);
        T_DP(1, 5, 6);
        T_DP(2, 4, 7);
        T_DP(3, 5, 7);
    }
    float out[256] __attribute__((aligned(64)));
    T_STORE(0, out, 64);
    __asm__ volatile("tilerelease" ::: "memory");
}

uint64_t duck_kernels_amx_probe(duck_pool *pool, int mode, uint64_t rounds)
{
    if (!duck_kernels_amx() || mode < 0 || mode > 2)
        return 0;
    probe_job j = {mode, rounds};
    duck_pool_run(pool, probe_task, &j);
    return (uint64_t)duck_pool_size(pool) * rounds * 4 * 16 * 16 * 32 * 2;
}

void duck_kernels_amx_parts(int parts) { atomic_store(&amx_parts, parts); }

static void gemm_amx(const fp9_matrix *m, uint32_t pair_begin, uint32_t pair_end, uint32_t ntok,
                     const float *const *x, float *const *y, int accumulate)
{
    gemm_amx_with(m, pair_begin, pair_end, ntok, x, y, accumulate, NULL);
}

static void gemm_amx_emu(const fp9_matrix *m, uint32_t pair_begin, uint32_t pair_end, uint32_t ntok,
                         const float *const *x, float *const *y, int accumulate)
{
    amx_emu e;
    gemm_amx_with(m, pair_begin, pair_end, ntok, x, y, accumulate, &e);
}

#pragma GCC pop_options

static const duck_kernels k_amx = {"amx", gemm_amx};
static const duck_kernels k_amx_emu = {"amx-emu", gemm_amx_emu};

/* AMX-TILE and AMX-BF16 in CPUID, and the kernel's leave to use the tile data
 * (Linux asks each process to request it: arch_prctl ARCH_REQ_XCOMP_PERM). */
static int amx_usable(void)
{
    static atomic_int state = -1;
    int s = atomic_load(&state);
    if (s < 0) {
        unsigned a, b, c, d;
        s = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 22 & 1) &&
            syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
        atomic_store(&state, s);
    }
    return s;
}

const duck_kernels *duck_kernels_amx(void)
{
    return duck_kernels_avx512_bf16() && amx_usable() ? &k_amx : NULL;
}

const duck_kernels *duck_kernels_amx_emulated(void)
{
    return duck_kernels_avx512_bf16() ? &k_amx_emu : NULL;
}

unsigned long long duck_kernels_amx_emulated_dots(void) { return atomic_load(&emu_dots); }

#else

const duck_kernels *duck_kernels_amx(void) { return NULL; }
uint64_t duck_kernels_amx_probe(duck_pool *pool, int mode, uint64_t rounds)
{
    (void)pool, (void)mode, (void)rounds;
    return 0;
}
const duck_kernels *duck_kernels_amx_emulated(void) { return NULL; }
unsigned long long duck_kernels_amx_emulated_dots(void) { return 0; }
void duck_kernels_amx_parts(int parts) { (void)parts; }

#endif
