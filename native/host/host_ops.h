/* The host ops of a decode step (norms, rotary, cached attention, router,
 * pooled GEMM), written once over a kernel table (host_kernels.h): with
 * duck_host_kernels_ref() they are the reference, with the AVX2 or AVX-512
 * set the fast path. Everything is fp32, like engine/layers.py, but for the
 * GEMMs' weights, which may be half. */
#ifndef DUCK_HOST_OPS_H
#define DUCK_HOST_OPS_H

#include "host_kernels.h"
#include "pool.h"

#include <stdatomic.h>

#ifdef __cplusplus
extern "C" {
#endif

/* y = w * (x / sqrt(mean(x^2) + eps)), n values (engine.layers.RMSNorm) */
void duck_host_rmsnorm(const duck_host_kernels *k, const float *x, const float *w, uint32_t n, float eps, float *y);
/* x += add (a residual add; add may be NULL), then y = rmsnorm(x) */
void duck_host_add_rmsnorm(const duck_host_kernels *k, float *x, const float *add, const float *w, uint32_t n,
                           float eps, float *y);

/* cos / sin of (float)position * inv_freq[i] for i < half, in fp32 as
 * engine.ops.qk_norm_rope_ref computes them */
void duck_host_rope_table(int64_t position, const float *inv_freq, uint32_t half, float *cos_out, float *sin_out);
/* In place on heads consecutive vectors of head_dim: an optional per-head
 * RMSNorm (norm_w: [head_dim], or NULL; Qwen3's q_norm / k_norm), then the
 * half-split rotation (Hugging Face rotate_half) by a duck_host_rope_table. */
void duck_host_rope(const duck_host_kernels *k, float *x, uint32_t heads, uint32_t head_dim, const float *cos,
                    const float *sin, const float *norm_w, float eps);

/* nq query heads (q: nq consecutive vectors of head_dim; GQA: the heads of one
 * kv head) over the same cached positions [0, n_ctx): out (nq consecutive
 * vectors) = softmax(scale * q K^T) V per head, the softmax in fp32. keys /
 * values point at this kv head's vector of position 0; ld elements lie between
 * positions. scores: nq * n_ctx floats of scratch. The keys are read once for
 * all nq heads, and each head's result is the one it gets alone (the kernels
 * form each sum the same way whatever the number of heads).
 *
 * kv_type DUCK_HOST_F16: keys and values are IEEE halves (a half KV cache, ld
 * halves between positions); the keys are widened DUCK_HOST_ATTN_ROWS
 * positions at a time into widen (DUCK_HOST_ATTN_ROWS * head_dim floats of
 * scratch), the values as gemv_t_h reads them: the result is the fp32 one on
 * the widened cache, bit for bit. */
#define DUCK_HOST_ATTN_ROWS 64u
void duck_host_attend(const duck_host_kernels *k, uint32_t kv_type, const float *q, uint32_t nq, const void *keys,
                      const void *values, size_t ld, uint32_t n_ctx, uint32_t head_dim, float scale, float *scores,
                      float *widen, float *out);

/* The softmax router of one token: probabilities of n logits, the topk largest
 * (ties: the lower id first) as ids and weights, renormalized to sum 1 when
 * normalize (norm_topk_prob), as engine.models.base.TopKRouter. */
void duck_host_topk_softmax(const float *logits, uint32_t n, uint32_t topk, int normalize, int32_t *ids,
                            float *weights);

/* Work for the pool in phases: each phase is n items, body(ctx, item, worker)
 * runs once per item on whichever worker claims it, and no item of a phase
 * starts before every item of the phase before has finished. A whole decode
 * layer is one pool run this way: a worker that wakes late (the pool's
 * workers block between runs) joins at whatever phase is under way, and a
 * worker waits only for items other workers are running, never for one
 * that sleeps. */
typedef void (*duck_host_body_fn)(void *ctx, uint32_t item, unsigned worker);
typedef struct duck_host_phase {
    uint32_t n;
    duck_host_body_fn body;
    void *ctx;
    atomic_uint next, done;   /* claimed, finished: zero before the run */
} duck_host_phase;
/* pool NULL (or of one thread): every phase in order on the calling thread, worker 0. */
void duck_host_run_phases(duck_pool *pool, duck_host_phase *phases, uint32_t n_phases);

/* The weights of the host's GEMMs: the model's own fp32 tensors, or IEEE half
 * copies of them packed in panels (the projections and lm_head: half the bytes
 * per token; host_kernels.h's gemm_h). */
#define DUCK_HOST_F32 0u
#define DUCK_HOST_F16 1u

/* y[t * ldy + i] = row r0 + i of w [*, ldw] (wtype) . x[t], i < rows: the kernel
 * set's gemm or gemm_h (y points at row r0's output; with half weights r0 is a
 * multiple of DUCK_HOST_PANEL). */
void duck_host_gemm_rows(const duck_host_kernels *k, uint32_t wtype, const void *w, size_t ldw, uint32_t r0,
                         uint32_t rows, uint32_t kdim, uint32_t ntok, const float *x, size_t ldx, float *y,
                         size_t ldy);

/* The items of a row-split GEMM job, for a phase: y[ntok, rows] = x W^T. */
typedef struct duck_host_gemm_job {
    const duck_host_kernels *k;
    const void *w;            /* [rows, kdim] of wtype */
    const float *x;
    float *y;
    uint32_t rows, kdim, ntok, wtype, rows_per_item;
} duck_host_gemm_job;
/* Fills a phase with the job's items (about 64 KiB of weights each). */
void duck_host_gemm_phase(duck_host_gemm_job *job, duck_host_phase *phase);

/* y[ntok, rows] = x[ntok, kdim] W[rows, kdim]^T, W of wtype, rows split over the
 * pool (NULL: the calling thread); results do not depend on the split. */
void duck_host_gemm(duck_pool *pool, const duck_host_kernels *k, uint32_t wtype, const void *w, uint32_t rows,
                    uint32_t kdim, uint32_t ntok, const float *x, float *y);

#ifdef __cplusplus
}
#endif
#endif
