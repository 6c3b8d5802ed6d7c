/* Same-run peers for the kernel benchmark: the machine's streaming read
 * bandwidth and a plain int8 GEMV, threaded like the fp9 kernels. */
#ifndef DUCK_BENCH_H
#define DUCK_BENCH_H

#include <stddef.h>
#include <stdint.h>

#include "pool.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Reads bytes (a multiple of 256) of buf with 32-byte vector loads split
 * over the pool; returns a value that depends on every byte. */
uint64_t duck_bench_read(duck_pool *pool, const void *buf, size_t bytes);

/* y = W x with W int8 [n, k] in panels of 2048 columns, row-major within a
 * panel (k a multiple of 32), x and y fp32:
 * widen, convert, FMA. Rows split over the pool. */
void duck_bench_int8_gemv(duck_pool *pool, const int8_t *w, uint32_t n, uint32_t k,
                          const float *x, float *y);

#ifdef __cplusplus
}
#endif
#endif
