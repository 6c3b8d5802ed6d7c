/* fp32 kernels of the host's own decode step (engine.cpu's native decoder):
 * the few primitives every host op is built from, as a table with a portable
 * scalar reference (_ref), an AVX2+FMA+F16C set and an AVX-512F set, chosen at
 * run time from what the CPU has. Weights are the model's own fp32 tensors,
 * read in place, or IEEE half (fp16) copies of them for the projections and
 * lm_head: half the bytes a decode step reads, the arithmetic still fp32. */
#ifndef DUCK_HOST_KERNELS_H
#define DUCK_HOST_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* y[t * ldy + r] = sum_c w[r * ldw + c] * x[t * ldx + c] for rows r < rows,
 * tokens t < ntok, c < k. Each (row, token) sum is formed the same way
 * whatever rows and ntok are, so results do not depend on how callers split
 * the rows between threads. */
typedef void (*duck_host_gemm_fn)(const float *w, size_t ldw, uint32_t rows, uint32_t k,
                                  uint32_t ntok, const float *x, size_t ldx, float *y, size_t ldy);
/* The same with IEEE half weights packed in panels of DUCK_HOST_PANEL rows
 * (duck_host_pack_half): panel p holds rows 16p .. 16p + 15 column by column,
 * w[(16p) * ldw + 16c + i] = row 16p + i, column c (ldw: the columns a row was
 * packed with; rows past the matrix's last are zero), and w points at the
 * first row's panel. Each (row, token) sum is one chain over the columns in
 * index order (fused multiply-adds in the vector sets), so a token's result
 * depends neither on the row split nor on how many tokens share the call. */
typedef void (*duck_host_gemm_h_fn)(const uint16_t *w, size_t ldw, uint32_t rows, uint32_t k,
                                    uint32_t ntok, const float *x, size_t ldx, float *y, size_t ldy);
#define DUCK_HOST_PANEL 16u
/* sum_i a[i] * b[i], i < n */
typedef float (*duck_host_dot_fn)(const float *a, const float *b, uint32_t n);
/* y[c] = sum_r p[r] * v[r * ldv + c] for c < n (attention's weighted sum of values) */
typedef void (*duck_host_gemv_t_fn)(const float *p, const float *v, size_t ldv, uint32_t rows, uint32_t n,
                                    float *y);

/* The same over IEEE half values (a half KV cache): v widened to fp32 as it is
 * read; each column's sum is gemv_t's chain over the rows, so the bits are
 * gemv_t's on the widened values. */
typedef void (*duck_host_gemv_t_h_fn)(const float *p, const uint16_t *v, size_t ldv, uint32_t rows, uint32_t n,
                                      float *y);
/* out[i] = x[i] as the nearest IEEE half, ties to even (torch's .half(): beyond
 * 65504 infinity, below 2^-24 zero); NaN stays NaN. */
typedef void (*duck_host_to_half_fn)(const float *x, uint32_t n, uint16_t *out);
/* out[i] = h[i] widened to fp32 (exact). */
typedef void (*duck_host_to_float_fn)(const uint16_t *h, uint32_t n, float *out);
/* The index of the largest of x[0..n), n >= 1: the first of equal maxima, and the first
 * NaN where there is one (torch.argmax's answer, the greedy token). */
typedef uint32_t (*duck_host_argmax_fn)(const float *x, uint32_t n);

/* Attention's softmax numerators: s[j] = exp(scale * s[j] - m) for j < n, m the
 * largest scale * s[j]; returns their sum. The reference calls expf; the vector
 * sets a polynomial exp within 2 ulp of it (a score's weight, not its rank, moves). */
typedef float (*duck_host_softmax_exp_fn)(float *s, uint32_t n, float scale);

typedef struct duck_host_kernels {
    const char *name;
    duck_host_gemm_fn gemm;
    duck_host_dot_fn dot;
    duck_host_gemv_t_fn gemv_t;
    duck_host_gemm_h_fn gemm_h;
    duck_host_softmax_exp_fn softmax_exp;
    duck_host_gemv_t_h_fn gemv_t_h;
    duck_host_to_half_fn to_half;
    duck_host_to_float_fn to_float;
    duck_host_argmax_fn argmax;
} duck_host_kernels;

/* IEEE half -> fp32, exact (subnormals, infinities and NaN included) */
float duck_half_to_float(uint16_t h);
/* fp32 -> the nearest IEEE half, ties to even (to_half's rounding; NaN stays a quiet NaN) */
uint16_t duck_float_to_half(float f);
/* Halves w [rows, k] (rows ldw apart) into gemm_h's panels at out, which holds
 * duck_host_packed_halves(rows, k) of them (the last panel's missing rows zero). */
size_t duck_host_packed_halves(uint32_t rows, uint32_t k);
void duck_host_pack_half(const uint16_t *w, size_t ldw, uint32_t rows, uint32_t k, uint16_t *out);

const duck_host_kernels *duck_host_kernels_ref(void);
/* The AVX2+FMA+F16C kernels the AVX-512 set shares (every AVX-512F CPU has these). */
float duck_host_softmax_exp_avx2(float *s, uint32_t n, float scale);
void duck_host_gemv_t_h_avx2(const float *p, const uint16_t *v, size_t ldv, uint32_t rows, uint32_t n, float *y);
void duck_host_to_half_avx2(const float *x, uint32_t n, uint16_t *out);
void duck_host_to_float_avx2(const uint16_t *h, uint32_t n, float *out);
uint32_t duck_host_argmax_avx2(const float *x, uint32_t n);
/* NULL where the build or the CPU lacks AVX2+FMA+F16C */
const duck_host_kernels *duck_host_kernels_avx2(void);
/* NULL where the build or the CPU lacks AVX-512F */
const duck_host_kernels *duck_host_kernels_avx512(void);
/* The fastest this CPU runs; DUCK_HOST_KERNELS=ref|avx2|avx512 in the
 * environment forces one (an unsupported choice falls back to the next best). */
const duck_host_kernels *duck_host_kernels_best(void);

#ifdef __cplusplus
}
#endif
#endif
