/* fp9 matrix kernels: each op has a portable scalar reference (_ref), an
 * AVX2+FMA version and an AVX-512 version, chosen at run time by CPU
 * feature detection. */
#ifndef DUCK_KERNELS_H
#define DUCK_KERNELS_H

#include "fp9.h"
#include "pool.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Callers splitting a matrix between threads cut at multiples of this many
 * row pairs: kernels may group pairs (up to 4) and the grouping must not
 * depend on the split, so that results do not depend on the thread count. */
#define DUCK_ROW_PAIR_ALIGN 4

/* The GEMVs prefetch the weights this far ahead of those in use: with the
 * hardware prefetchers alone one thread of the development machine (Zen 5)
 * streamed fp9 at 0.6-0.7 of its read bandwidth; 8 KiB ahead brought it to
 * about the read bandwidth, better than 4 or 16 KiB (medians of interleaved
 * rounds). The int8 peer of the benchmark prefetches the same way. */
#define DUCK_PREFETCH_BYTES 8192

/* Most tokens one MoE forward or matmul call holds (the kernels' gemm takes
 * any count): a prefill chunk. A wire forward holds at most WIRE_MAX_TOKENS
 * of them (the firmware checks WIRE_MAX_TOKENS <= DUCK_MAX_TOKENS). */
#define DUCK_MAX_TOKENS 1024

/* y[t][row] (= or +=) prescale * sum_k W[row, k] * x[t][k], for the rows of
 * row pairs [pair_begin, pair_end) and tokens t < ntok (any count). Each x[t]
 * is a prepared activation (fp9_prepare_x_*) of groups * 64 floats; each
 * y[t] holds at least m->rows floats. Rows past m->rows are not written.
 * Every weight byte of the range is read from memory once per call. */
typedef void (*fp9_gemm_fn)(const fp9_matrix *m, uint32_t pair_begin, uint32_t pair_end,
                            uint32_t ntok, const float *const *x, float *const *y,
                            int accumulate);

typedef struct duck_kernels {
    const char *name;
    fp9_gemm_fn gemm;
} duck_kernels;

const duck_kernels *duck_kernels_ref(void);
/* NULL where the build or the CPU lacks AVX2+FMA. The AVX2 set comes in two
 * variants that differ in how the GEMV applies signs ("avx2-xor": AND + XOR on
 * the weight; "avx2-blend": blendv on the activation); duck_kernels_avx2()
 * picks the one faster on this CPU's vendor. */
const duck_kernels *duck_kernels_avx2(void);
const duck_kernels *duck_kernels_avx2_variant(int blend);
/* NULL where the build or the CPU lacks AVX-512 F/BW/VL (and FMA). */
const duck_kernels *duck_kernels_avx512(void);
/* avx512 with a bf16 GEMM (VDPBF16PS) for calls whose activations are all exactly
 * bf16 (what a GPU host sends); NULL where the CPU lacks AVX512_BF16. */
const duck_kernels *duck_kernels_avx512_bf16(void);
/* avx512 with the bf16 GEMM on AMX tiles (TDPBF16PS); NULL where the CPU lacks
 * AMX-BF16 (or AVX512_BF16) or the kernel refuses the tile state. amx-emu: the same
 * tile program with the tile instructions emulated in C (tests; never chosen). */
const duck_kernels *duck_kernels_amx(void);
const duck_kernels *duck_kernels_amx_emulated(void);
/* The AMX tile rate for the kernel benchmark: rounds of four TDPBF16PS on every
 * thread of the pool, with nothing else (mode 0), with the GEMM's A and B tile
 * loads (1), and with the A buffer stored by vector stores first (2); returns the
 * floating-point operations done, 0 where amx does not run (timed by the caller). */
uint64_t duck_kernels_amx_probe(duck_pool *pool, int mode, uint64_t rounds);
/* Bench only: the amx GEMM (and amx-emu's) with parts of it left out or
 * reordered, to time the others (bench kernels --amx-parts); 0 restores it. The
 * results are wrong while any part is left out. */
#define DUCK_AMX_PART_NO_DECODE 1      /* the weights decoded once per panel, not per chunk */
#define DUCK_AMX_PART_NO_TILES 2       /* no tile loads, products or stores */
#define DUCK_AMX_PART_NO_OUT 4         /* the sums not written to y */
#define DUCK_AMX_PART_NO_PREFETCH 8    /* no prefetch of the next micro-panel */
#define DUCK_AMX_PART_SERIAL 16        /* each chunk decoded whole before its products (not between) */
void duck_kernels_amx_parts(int parts);
/* The tile products amx-emu has emulated so far (tests: its tile program ran). */
unsigned long long duck_kernels_amx_emulated_dots(void);
/* The fastest the CPU supports: amx, else avx512-bf16 on AMD (on Intel's cores
 * VDPBF16PS ran slower than the FMA), else avx512, else avx2, else ref;
 * DUCK_KERNELS=ref|avx2|avx2-xor|avx2-blend|avx512|avx512-bf16|amx|amx-emu in the
 * environment forces one (a choice the CPU cannot run falls back to the best it can). */
const duck_kernels *duck_kernels_best(void);
/* The set of that name ("best" too), or NULL where this CPU or build lacks it
 * or the name is unknown. */
const duck_kernels *duck_kernels_named(const char *name);

/* Batch invariance of fp32 activations (a CPU host's), on by default: every set
 * sums a token's rows in one order whatever the call's token count (the
 * GEMV's: kernels_avx2.c, kernels_avx512.c; ref's own), so a sequence's results
 * do not depend on which sequences share its step. Off, the avx2, avx512 and amx
 * sets take their faster many-token GEMMs on fp32 activations too (FMA tiles,
 * AMX tiles in three bf16 parts), whose sums depend on the token count. bf16
 * activations (a GPU host's) take those GEMMs either way. Process-wide; the
 * firmware turns it off where DUCK_BATCH_INVARIANT=0 is in its environment. */
void duck_kernels_set_batch_invariant(int on);
int duck_kernels_batch_invariant(void);

/* Activation in kernel form: x * 2^FP9_ACT_SHIFT, zero-padded to n_padded
 * (a multiple of 64, >= n). */
void fp9_prepare_x_f32(const float *x, uint32_t n, uint32_t n_padded, float *out);
void fp9_prepare_x_bf16(const uint16_t *x, uint32_t n, uint32_t n_padded, float *out);

/* fp32 to bf16 bits, rounding to nearest even (NaN stays a quiet NaN). */
void duck_f32_to_bf16(const float *x, size_t n, uint16_t *out);

#ifdef __cplusplus
}
#endif
#endif
