/* Host ops over a kernel table; see host_ops.h. */
#include "host_ops.h"

#include <math.h>
#include <sched.h>
#include <string.h>

void duck_host_rmsnorm(const duck_host_kernels *k, const float *x, const float *w, uint32_t n, float eps, float *y)
{
    /* the order of engine.layers.RMSNorm: normalize, then scale by the weight */
    const float r = 1.0f / sqrtf(k->dot(x, x, n) / (float)n + eps);
    for (uint32_t i = 0; i < n; i++)
        y[i] = w[i] * (x[i] * r);
}

void duck_host_add_rmsnorm(const duck_host_kernels *k, float *x, const float *add, const float *w, uint32_t n,
                           float eps, float *y)
{
    if (add)
        for (uint32_t i = 0; i < n; i++)
            x[i] += add[i];
    duck_host_rmsnorm(k, x, w, n, eps, y);
}

void duck_host_rope_table(int64_t position, const float *inv_freq, uint32_t half, float *cos_out, float *sin_out)
{
    const float p = (float)position;   /* positions.float(): exact below 2^24 */
    for (uint32_t i = 0; i < half; i++) {
        const float f = p * inv_freq[i];
        cos_out[i] = cosf(f);
        sin_out[i] = sinf(f);
    }
}

void duck_host_rope(const duck_host_kernels *k, float *x, uint32_t heads, uint32_t head_dim, const float *cos,
                    const float *sin, const float *norm_w, float eps)
{
    const uint32_t half = head_dim / 2;
    for (uint32_t h = 0; h < heads; h++) {
        float *v = x + (size_t)h * head_dim;
        if (norm_w)
            duck_host_rmsnorm(k, v, norm_w, head_dim, eps, v);
        for (uint32_t i = 0; i < half; i++) {
            const float a = v[i], b = v[i + half];
            v[i] = a * cos[i] - b * sin[i];
            v[i + half] = b * cos[i] + a * sin[i];
        }
    }
}

void duck_host_attend(const duck_host_kernels *k, uint32_t kv_type, const float *q, uint32_t nq, const void *keys,
                      const void *values, size_t ld, uint32_t n_ctx, uint32_t head_dim, float scale, float *scores,
                      float *widen, float *out)
{
    if (kv_type == DUCK_HOST_F16) {   /* scores[h * n_ctx + j], DUCK_HOST_ATTN_ROWS keys at a time */
        const uint16_t *kh = keys;
        for (uint32_t j0 = 0; j0 < n_ctx; j0 += DUCK_HOST_ATTN_ROWS) {
            const uint32_t n = n_ctx - j0 < DUCK_HOST_ATTN_ROWS ? n_ctx - j0 : DUCK_HOST_ATTN_ROWS;
            if (ld == head_dim)
                k->to_float(kh + j0 * ld, n * head_dim, widen);
            else
                for (uint32_t j = 0; j < n; j++)
                    k->to_float(kh + (j0 + j) * ld, head_dim, widen + (size_t)j * head_dim);
            k->gemm(widen, head_dim, n, head_dim, nq, q, head_dim, scores + j0, n_ctx);
        }
    } else {
        k->gemm(keys, ld, n_ctx, head_dim, nq, q, head_dim, scores, n_ctx);
    }
    for (uint32_t h = 0; h < nq; h++) {
        float *s = scores + (size_t)h * n_ctx, *o = out + (size_t)h * head_dim;
        const float sum = k->softmax_exp(s, n_ctx, scale);
        if (kv_type == DUCK_HOST_F16)
            k->gemv_t_h(s, values, ld, n_ctx, head_dim, o);
        else
            k->gemv_t(s, values, ld, n_ctx, head_dim, o);
        for (uint32_t i = 0; i < head_dim; i++)
            o[i] /= sum;
    }
}

void duck_host_topk_softmax(const float *logits, uint32_t n, uint32_t topk, int normalize, int32_t *ids,
                            float *weights)
{
    float top = -INFINITY, sum = 0.0f;
    for (uint32_t e = 0; e < n; e++)
        top = logits[e] > top ? logits[e] : top;
    for (uint32_t e = 0; e < n; e++)
        sum += expf(logits[e] - top);
    float chosen = 0.0f;
    for (uint32_t j = 0; j < topk; j++) {
        /* the j-th largest: a scan that skips the ones taken (topk is small) */
        int32_t best = -1;
        for (uint32_t e = 0; e < n; e++) {
            int taken = 0;
            for (uint32_t i = 0; i < j && !taken; i++)
                taken = ids[i] == (int32_t)e;
            if (!taken && (best < 0 || logits[e] > logits[best]))
                best = (int32_t)e;
        }
        ids[j] = best;
        weights[j] = expf(logits[best] - top) / sum;
        chosen += weights[j];
    }
    if (normalize)
        for (uint32_t j = 0; j < topk; j++)
            weights[j] /= chosen;
}

/* Waits for items other workers are running: a short, bounded wait (an item
 * is a few microseconds of work), so it spins, yielding the CPU if the
 * runner has been preempted. */
static void wait_phase_done(duck_host_phase *ph)
{
    for (unsigned spins = 0; atomic_load_explicit(&ph->done, memory_order_acquire) < ph->n; spins++) {
        if (spins < 4096) {
#if defined(__x86_64__)
            __builtin_ia32_pause();
#endif
        } else {
            sched_yield();
        }
    }
}

typedef struct phase_run {
    duck_host_phase *phases;
    uint32_t n_phases;
} phase_run;

static void phase_task(void *arg, unsigned worker, unsigned nworkers)
{
    (void)nworkers;
    phase_run *run = arg;
    for (uint32_t p = 0; p < run->n_phases; p++) {
        duck_host_phase *ph = &run->phases[p];
        if (p > 0)
            wait_phase_done(&run->phases[p - 1]);
        for (;;) {
            const uint32_t item = atomic_fetch_add_explicit(&ph->next, 1, memory_order_relaxed);
            if (item >= ph->n)
                break;
            ph->body(ph->ctx, item, worker);
            atomic_fetch_add_explicit(&ph->done, 1, memory_order_release);
        }
    }
    /* the caller returns with every result in place (and the pool's join then
     * rarely has to sleep: the other workers are finishing their last item) */
    if (worker == 0 && run->n_phases)
        wait_phase_done(&run->phases[run->n_phases - 1]);
}

void duck_host_run_phases(duck_pool *pool, duck_host_phase *phases, uint32_t n_phases)
{
    for (uint32_t p = 0; p < n_phases; p++) {
        atomic_store_explicit(&phases[p].next, 0, memory_order_relaxed);
        atomic_store_explicit(&phases[p].done, 0, memory_order_relaxed);
    }
    phase_run run = {phases, n_phases};
    if (!pool || duck_pool_size(pool) == 1)
        phase_task(&run, 0, 1);
    else
        duck_pool_run(pool, phase_task, &run);
}

/* Rows per item: about 64 KiB of weights, a multiple of the half weights' 16-row panel
 * (an item starts at a panel) and so of the fp32 kernels' 4-row block. */
#define GEMM_ITEM_BYTES 65536u

static size_t wtype_bytes(uint32_t wtype) { return wtype == DUCK_HOST_F16 ? 2u : 4u; }

void duck_host_gemm_rows(const duck_host_kernels *k, uint32_t wtype, const void *w, size_t ldw, uint32_t r0,
                         uint32_t rows, uint32_t kdim, uint32_t ntok, const float *x, size_t ldx, float *y,
                         size_t ldy)
{
    if (wtype == DUCK_HOST_F16)
        k->gemm_h((const uint16_t *)w + (size_t)r0 * ldw, ldw, rows, kdim, ntok, x, ldx, y, ldy);
    else
        k->gemm((const float *)w + (size_t)r0 * ldw, ldw, rows, kdim, ntok, x, ldx, y, ldy);
}

static void gemm_item(void *ctx, uint32_t item, unsigned worker)
{
    (void)worker;
    const duck_host_gemm_job *j = ctx;
    const uint32_t r0 = item * j->rows_per_item;
    const uint32_t n = j->rows - r0 < j->rows_per_item ? j->rows - r0 : j->rows_per_item;
    duck_host_gemm_rows(j->k, j->wtype, j->w, j->kdim, r0, n, j->kdim, j->ntok, j->x, j->kdim, j->y + r0, j->rows);
}

void duck_host_gemm_phase(duck_host_gemm_job *job, duck_host_phase *phase)
{
    uint32_t per = (uint32_t)(GEMM_ITEM_BYTES / (wtype_bytes(job->wtype) * (job->kdim ? job->kdim : 1u)));
    job->rows_per_item = per < DUCK_HOST_PANEL ? DUCK_HOST_PANEL : per & ~(DUCK_HOST_PANEL - 1u);
    phase->n = job->ntok ? (job->rows + job->rows_per_item - 1) / job->rows_per_item : 0;
    phase->body = gemm_item;
    phase->ctx = job;
}

void duck_host_gemm(duck_pool *pool, const duck_host_kernels *k, uint32_t wtype, const void *w, uint32_t rows,
                    uint32_t kdim, uint32_t ntok, const float *x, float *y)
{
    duck_host_gemm_job job = {k, w, x, y, rows, kdim, ntok, wtype, 0};
    duck_host_phase phase;
    duck_host_gemm_phase(&job, &phase);
    duck_host_run_phases(pool, &phase, 1);
}
