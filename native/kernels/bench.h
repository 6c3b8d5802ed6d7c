/* Same-run peers for the kernel benchmark: the machine's streaming read
 * bandwidth and a plain int8 GEMV, threaded like the fp9 kernels. */
#ifndef DUCK_BENCH_H
#define DUCK_BENCH_H

#include <stddef.h>
#include <stdint.h>

#include "ffn.h"
#include "pool.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Reads bytes (a multiple of 256) of buf with 32-byte vector loads split
 * over the pool; returns a value that depends on every byte. */
uint64_t duck_bench_read(duck_pool *pool, const void *buf, size_t bytes);

/* Instruction sets of the int8 peer, so that it runs on the same vector
 * width as the fp9 kernels it is compared with. */
#define DUCK_BENCH_SCALAR 0
#define DUCK_BENCH_AVX2 1     /* AVX2 + FMA, 8 lanes */
#define DUCK_BENCH_AVX512 2   /* AVX-512 F/BW/VL + FMA, 16 lanes */

/* want, or the best below it that this CPU and build have (want < 0: the best). */
int duck_bench_isa(int want);

/* y = W x with W int8 [n, k] in panels of 2048 columns, row-major within a
 * panel (k a multiple of 64), x and y fp32: widen, convert, FMA, on the
 * instruction set duck_bench_isa(isa), which it returns, prefetching
 * DUCK_PREFETCH_BYTES ahead like the fp9 GEMVs. Rows split over the pool.
 * Exact int8 weights times fp32 activations: the same math as the fp9
 * kernels (a VNNI int8 x int8 dot would quantize the activations too). */
int duck_bench_int8_gemv(duck_pool *pool, int isa, const int8_t *w, uint32_t n, uint32_t k,
                         const float *x, float *y);

/* The FMA peak: every thread of the pool runs rounds of independent
 * chains of fused multiply-adds on registers (no memory), on the
 * instruction set duck_bench_isa(isa); returns the floating-point
 * operations done by all of them together (2 per lane and FMA). Timed by
 * the caller: the GEMM's figure of merit is its share of this. */
uint64_t duck_bench_fma(duck_pool *pool, int isa, uint64_t rounds);

/* Prefill's GEMMs without the rest of the forward: for each of n experts,
 * gate_up x[t] -> gu[t] and down h[t] -> y[t] for ntok tokens (prepared
 * activations), the rows of both split over the pool's threads as the MoE
 * forward splits them; one pool run for all n. */
void duck_bench_gemm(duck_pool *pool, const duck_kernels *k, const duck_expert_slice *experts, uint32_t n,
                     uint32_t ntok, const float *const *x, const float *const *h, float *const *gu, float *const *y);

/* The pool's wake-up: runs empty tasks, each gap_us after the last (long
 * enough, and workers of a pool with spin_us 0 are asleep), and gives the
 * medians of the time until the last worker started (*wake_us; in a shared
 * run, of those that joined at all) and of a whole run (*run_us). */
void duck_bench_pool_wake(duck_pool *pool, uint32_t runs, uint32_t gap_us, int shared,
                          double *wake_us, double *run_us);

#ifdef __cplusplus
}
#endif
#endif
