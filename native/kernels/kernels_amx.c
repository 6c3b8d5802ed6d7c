/* The amx kernel set: avx512, with the many-token GEMM on AMX tiles where every
 * activation of the call is exactly a bf16 (what a GPU host sends: the gate/up
 * projections of a prefill chunk on the ducks).
 *
 * The weights are decoded exactly as the avx512-bf16 set decodes them
 * (fp9_decode_avx512.h: a micro-panel of 32 rows x 128 columns into wt[k / 2][32]
 * dwords, each row's columns k and k + 1 as two bf16 times 2^64). That layout is
 * the B operand of TDPBF16PS as it stands: a B tile is 16 column pairs (K = 32)
 * of 16 rows, one dword per row, 128 bytes apart. The A operand is 16 tokens'
 * activations as bf16, one token per tile row (64 bytes = 32 columns). One
 * C tile is then 16 tokens x 16 rows in fp32: the layout of y[t][row ..], so the
 * outputs need no transposition. Eight tiles: C 0-3 (32 tokens x 32 rows),
 * A 4-5, B 6-7. Per 128 columns (a block-scale block) the C tiles are stored,
 * times the rows' scales, onto y: the same per-block sums as _ref (within a
 * block the order of the sums differs; each product is exact: bf16 x bf16 fits
 * fp32).
 *
 * On the H200 host's Xeon (Sapphire/Emerald Rapids) VDPBF16PS issues on one
 * port where the FMA issues on two, so the avx512-bf16 set ran slower than
 * avx512 there (0.39 vs 0.59 of the FMA peak at 32 tokens per expert); a
 * TDPBF16PS makes 16 x 16 x 32 products.
 *
 * "amx-emu" runs the same tile program with the tile instructions emulated in C
 * (TDPBF16PS's order of sums per lane: the even product, then the odd one), so
 * a machine without AMX (the development machine, CI with AVX-512) tests the
 * program and its layouts against _ref; it is slow and never chosen. Its sums
 * run in the order of avx512's FMA tile (each product exact), so it gives
 * avx512's bits; the hardware may sum a pair in its own order. Tile
 * instructions are written as inline assembly with a memory clobber: the
 * compiler's own AMX intrinsics do not tell it that tileloadd reads (and
 * tilestored writes) the buffers the C code fills and reads. */
#define _GNU_SOURCE
#include "kernels.h"

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

#define AMX_ROWS 16          /* tokens per A tile */
#define AMX_MIN_TOKENS 5     /* fewer: avx512's GEMVs */

/* The emulated tiles: C 0-3 in c, A and B (4-7) in ab. */
typedef struct amx_emu {
    float c[4][16][16];
    uint32_t ab[4][16][16];
} amx_emu;

static __thread amx_emu *emu_state;   /* the call's emulated tiles, NULL on AMX */
static atomic_ullong emu_dots;         /* emulated TDPBF16PS so far (tests: the program ran) */

static void emu_load(uint32_t t[16][16], const void *base, size_t stride)
{
    for (int r = 0; r < 16; r++)
        memcpy(t[r], (const uint8_t *)base + r * stride, 64);
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
            emu_load(e->ab[(t) - 4], base, stride);                                                  \
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

/* c[i][0 .. 31] (tokens i < nt, the tile's 32 rows) times the rows' scales into
 * (or, if load, onto) y[i][row ..], its first `live` rows only. */
static inline __attribute__((always_inline)) void rows_out(const float (*c)[32], uint32_t nt, float *const *y,
                                                           uint32_t row, uint32_t live, const float *scale, int load)
{
    const __mmask16 m0 = live >= 16 ? 0xFFFF : (__mmask16)((1u << live) - 1);
    const __mmask16 m1 = live >= 32 ? 0xFFFF : live > 16 ? (__mmask16)((1u << (live - 16)) - 1) : 0;
    const __m512 s0 = _mm512_load_ps(scale), s1 = _mm512_load_ps(scale + 16);
    for (uint32_t i = 0; i < nt; i++) {
        __m512 y0 = load ? _mm512_maskz_loadu_ps(m0, y[i] + row) : _mm512_setzero_ps();
        __m512 y1 = load ? _mm512_maskz_loadu_ps(m1, y[i] + row + 16) : _mm512_setzero_ps();
        _mm512_mask_storeu_ps(y[i] + row, m0, _mm512_fmadd_ps(_mm512_load_ps(c[i]), s0, y0));
        _mm512_mask_storeu_ps(y[i] + row + 16, m1, _mm512_fmadd_ps(_mm512_load_ps(c[i] + 16), s1, y1));
    }
}

/* n decoded columns (wt, from column k0) of 32 rows for every token of the call:
 * x[0] is the first of ntok bf16 rows, contiguous, padded with zero rows to a
 * multiple of 16. */
static inline __attribute__((always_inline)) void tile_all(const fp9_matrix *m, const float *wt, uint32_t n,
                                                           const uint32_t *const *x, uint32_t k0, uint32_t ntok,
                                                           float *const *y, uint32_t row, uint32_t live,
                                                           const float *scale, int load)
{
    amx_emu *e = emu_state;
    const size_t xs = (size_t)m->groups * FP9_GROUP * 2;   /* bytes per token */
    const uint8_t *x0 = (const uint8_t *)x[0] + (size_t)k0 * 2;
    const uint32_t *w = (const uint32_t *)wt;
    float c[2 * AMX_ROWS][32] __attribute__((aligned(64)));
    for (uint32_t t0 = 0; t0 < ntok; t0 += 2 * AMX_ROWS) {
        const int two = ntok - t0 > AMX_ROWS;
        const uint8_t *a = x0 + t0 * xs;
        T_ZERO(0);
        T_ZERO(1);
        if (two) {
            T_ZERO(2);
            T_ZERO(3);
        }
        for (uint32_t s = 0; s < n / 32; s++) {   /* 32 columns: 16 pairs */
            T_LOAD(6, w + 512 * s, 128);          /* rows 0-15 */
            T_LOAD(7, w + 512 * s + 16, 128);     /* rows 16-31 */
            T_LOAD(4, a + 64 * s, xs);
            T_DP(0, 4, 6);
            T_DP(1, 4, 7);
            if (two) {
                T_LOAD(5, a + AMX_ROWS * xs + 64 * s, xs);
                T_DP(2, 5, 6);
                T_DP(3, 5, 7);
            }
        }
        T_STORE(0, &c[0][0], 128);
        T_STORE(1, &c[0][16], 128);
        if (two) {
            T_STORE(2, &c[AMX_ROWS][0], 128);
            T_STORE(3, &c[AMX_ROWS][16], 128);
        }
        rows_out((const float (*)[32])c, ntok - t0 < 2 * AMX_ROWS ? ntok - t0 : 2 * AMX_ROWS, y + t0, row, live,
                 scale, load);
    }
}

static void decode_panel_pairs(const fp9_matrix *m, uint32_t p, uint32_t np, uint32_t g, uint32_t ng, float *wt,
                               const char **ahead, const char *ahead_end)
{
    decode_panel_as(m, p, np, g, ng, wt, ahead, ahead_end, 1);
}

#define GEMM_PAIRS 16
#define GEMM_TOKENS 12   /* unused: the tile takes every token */
#define decode_panel decode_panel_pairs
#define GEMM_TILE_ALL tile_all
#define GEMM_X_T uint32_t
#define GEMM_FN gemm_tokens_amx
#define GEMM_OUT_EXTRA 0x1p-64f   /* the weights decoded times 2^64 */
#include "gemm_tokens.h"
#undef decode_panel

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

static void gemm_amx_with(const fp9_matrix *m, uint32_t pair_begin, uint32_t pair_end, uint32_t ntok,
                          const float *const *x, float *const *y, int accumulate, amx_emu *e)
{
    const uint32_t *first;
    if (ntok >= AMX_MIN_TOKENS && pair_begin < pair_end &&
        (first = duck_bf16_rows(x, ntok, AMX_ROWS, m->groups * FP9_GROUP, NULL))) {
        emu_state = e;
        if (!e)
            amx_configure();
        gemm_tokens_amx(m, pair_begin, pair_end, ntok, &first, y, accumulate);
        if (!e)
            __asm__ volatile("tilerelease" ::: "memory");
        emu_state = NULL;
        return;
    }
    duck_kernels_avx512()->gemm(m, pair_begin, pair_end, ntok, x, y, accumulate);
}

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
const duck_kernels *duck_kernels_amx_emulated(void) { return NULL; }
unsigned long long duck_kernels_amx_emulated_dots(void) { return 0; }

#endif
