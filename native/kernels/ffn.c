/* MoE / MLP slice forward over the thread pool. */
#define _POSIX_C_SOURCE 200809L
#include "ffn.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* All (token, slot) assignments that route to one expert. */
typedef struct moe_job {
    uint32_t expert;
    uint32_t first, count;          /* range in the assignment arrays */
} moe_job;

struct duck_ffn_workspace {
    void *mem;
    size_t cap;
};

duck_ffn_workspace *duck_ffn_workspace_create(void) { return calloc(1, sizeof(duck_ffn_workspace)); }

void duck_ffn_workspace_destroy(duck_ffn_workspace *ws)
{
    if (ws) {
        free(ws->mem);
        free(ws);
    }
}

static void *ws_reserve(duck_ffn_workspace *ws, size_t bytes)
{
    if (bytes > ws->cap) {
        void *p = NULL;
        if (posix_memalign(&p, 64, bytes) != 0)
            return NULL;
        free(ws->mem);
        ws->mem = p;
        ws->cap = bytes;
    }
    return ws->mem;
}

int duck_expert_slice_check(const duck_expert_slice *e, uint32_t hidden)
{
    const fp9_matrix *gu = &e->gate_up, *dn = &e->down;
    if (!gu->blocks || !dn->blocks || gu->cols != hidden || dn->rows != hidden ||
        gu->rows != 2 * dn->cols || gu->rows == 0)
        return DUCK_FFN_ESHAPE;
    return DUCK_FFN_OK;
}

typedef struct moe_task {
    const duck_moe_args *a;
    const duck_kernels *k;
    const moe_job *jobs;
    uint32_t njobs;
    uint32_t total_pairs;           /* sum over jobs of gate_up row pairs */
    const float *const *xrows;      /* per assignment: its token's prepared x */
    float *const *gurows;           /* per assignment: gate/up output, 2S floats */
    float *const *actrows;          /* per assignment: prepared activation, padded */
    float *const *yrows;            /* per assignment: its token's output row */
    const float *weights;           /* per assignment: routing weight */
} moe_task;

static inline unsigned long round_up(unsigned long v, unsigned long a) { return (v + a - 1) / a * a; }

static inline float silu(float v) { return v / (1.0f + expf(-v)); }

/* Phase 1: gate/up rows of every job, split evenly by row pair. */
static void phase_gate_up(void *arg, unsigned w, unsigned nw)
{
    const moe_task *t = arg;
    unsigned long begin, end, base = 0;
    duck_split(t->total_pairs, w, nw, &begin, &end);
    for (uint32_t j = 0; j < t->njobs && base < end; j++) {
        const duck_expert_slice *e = &t->a->experts[t->jobs[j].expert];
        unsigned long pairs = e->gate_up.row_pairs;
        if (base + pairs > begin) {
            /* cut inside a job at multiples of DUCK_ROW_PAIR_ALIGN, like duck_split_aligned */
            uint32_t pb = (uint32_t)(begin > base ? round_up(begin - base, DUCK_ROW_PAIR_ALIGN) : 0);
            uint32_t pe = (uint32_t)(end < base + pairs ? round_up(end - base, DUCK_ROW_PAIR_ALIGN) : pairs);
            pb = pb < pairs ? pb : (uint32_t)pairs;
            pe = pe < pairs ? pe : (uint32_t)pairs;
            uint32_t first = t->jobs[j].first, n = t->jobs[j].count;
            t->k->gemm(&e->gate_up, pb, pe, n, t->xrows + first, t->gurows + first, 0);
            for (uint32_t i = first; i < first + n; i++) {
                const float *gu = t->gurows[i];
                float scale = t->weights[i] * 0x1p64f;   /* prepared for the down kernel */
                for (uint32_t p = pb; p < pe; p++)
                    t->actrows[i][p] = silu(gu[2 * p]) * gu[2 * p + 1] * scale;
            }
        }
        base += pairs;
    }
}

/* Phase 2: down rows (the hidden dimension), all jobs accumulated. */
static void phase_down(void *arg, unsigned w, unsigned nw)
{
    const moe_task *t = arg;
    const duck_moe_args *a = t->a;
    unsigned long begin, end;
    duck_split_aligned((a->hidden + 1) / 2, w, nw, DUCK_ROW_PAIR_ALIGN, &begin, &end);
    uint32_t r0 = 2 * (uint32_t)begin, r1 = 2 * (uint32_t)end < a->hidden ? 2 * (uint32_t)end : a->hidden;
    for (uint32_t tok = 0; tok < a->ntok && r1 > r0; tok++)
        memset(a->y + (size_t)tok * a->hidden + r0, 0, (r1 - r0) * sizeof(float));
    for (uint32_t j = 0; j < t->njobs; j++) {
        const duck_expert_slice *e = &a->experts[t->jobs[j].expert];
        uint32_t first = t->jobs[j].first;
        t->k->gemm(&e->down, (uint32_t)begin, (uint32_t)end, t->jobs[j].count,
                   (const float *const *)(t->actrows + first), t->yrows + first, 1);
    }
}

typedef struct assignment {
    uint32_t expert, token;
    float weight;
} assignment;

static int by_expert(const void *pa, const void *pb)
{
    const assignment *x = pa, *y = pb;
    if (x->expert != y->expert)
        return x->expert < y->expert ? -1 : 1;
    return x->token < y->token ? -1 : (x->token > y->token);
}

static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

int duck_moe_forward(duck_pool *pool, const duck_kernels *k, duck_ffn_workspace *ws,
                     const duck_moe_args *a, uint64_t *bytes_streamed)
{
    if (!k || !ws || !a || a->ntok > DUCK_MAX_TOKENS || a->topk > DUCK_MAX_TOPK || a->hidden == 0 ||
        (a->ntok && (!a->x || !a->y || (a->topk && (!a->expert_ids || !a->expert_weights || !a->experts)))))
        return DUCK_FFN_EINVAL;
    uint32_t hp = (a->hidden + FP9_GROUP - 1) / FP9_GROUP * FP9_GROUP;
    assignment list[DUCK_MAX_TOKENS * DUCK_MAX_TOPK];
    uint32_t nassign = 0, max_gu = 0, max_act = 0;
    for (uint32_t t = 0; t < a->ntok; t++) {
        for (uint32_t s = 0; s < a->topk; s++) {
            int32_t id = a->expert_ids[t * a->topk + s];
            if (id < 0)
                continue;
            if ((uint32_t)id >= a->n_experts)
                return DUCK_FFN_EEXPERT;
            const duck_expert_slice *e = &a->experts[id];
            if (duck_expert_slice_check(e, a->hidden) != DUCK_FFN_OK)
                return DUCK_FFN_ESHAPE;
            if (e->gate_up.rows > max_gu)
                max_gu = e->gate_up.rows;
            if (e->down.groups * FP9_GROUP > max_act)
                max_act = e->down.groups * FP9_GROUP;
            list[nassign++] = (assignment){(uint32_t)id, t, a->expert_weights[t * a->topk + s]};
        }
    }
    if (nassign == 0) {
        memset(a->y, 0, (size_t)a->ntok * a->hidden * sizeof(float));
        if (bytes_streamed)
            *bytes_streamed = 0;
        return DUCK_FFN_OK;
    }
    qsort(list, nassign, sizeof list[0], by_expert);

    /* workspace: prepared x, per-assignment buffers and row pointers, jobs */
    size_t x_bytes = align64((size_t)a->ntok * hp * sizeof(float));
    size_t gu_stride = align64((size_t)(max_gu + 1) * sizeof(float)) / sizeof(float);
    size_t act_stride = align64((size_t)max_act * sizeof(float)) / sizeof(float);
    size_t need = x_bytes + nassign * (gu_stride + act_stride) * sizeof(float) +
                  align64(4 * nassign * sizeof(void *)) + align64(nassign * sizeof(float)) +
                  nassign * sizeof(moe_job);
    uint8_t *mem = ws_reserve(ws, need);
    if (!mem)
        return DUCK_FFN_ENOMEM;
    float *xp = (float *)mem;
    float *gu = (float *)(mem + x_bytes);
    float *act = gu + nassign * gu_stride;
    void **ptrs = (void **)(act + nassign * act_stride);
    const float **xrows = (const float **)ptrs;
    float **gurows = (float **)(ptrs + nassign), **actrows = gurows + nassign, **yrows = actrows + nassign;
    float *weights = (float *)((uint8_t *)ptrs + align64(4 * nassign * sizeof(void *)));
    moe_job *jobs = (moe_job *)((uint8_t *)weights + align64(nassign * sizeof(float)));

    for (uint32_t t = 0; t < a->ntok; t++) {
        if (a->x_is_bf16)
            fp9_prepare_x_bf16((const uint16_t *)a->x + (size_t)t * a->hidden, a->hidden, hp, xp + (size_t)t * hp);
        else
            fp9_prepare_x_f32((const float *)a->x + (size_t)t * a->hidden, a->hidden, hp, xp + (size_t)t * hp);
    }
    uint32_t njobs = 0, total_pairs = 0;
    uint64_t bytes = 0;
    for (uint32_t i = 0; i < nassign; i++) {
        xrows[i] = xp + (size_t)list[i].token * hp;
        gurows[i] = gu + i * gu_stride;
        actrows[i] = act + i * act_stride;
        memset(actrows[i], 0, act_stride * sizeof(float));   /* zero padding columns */
        yrows[i] = a->y + (size_t)list[i].token * a->hidden;
        weights[i] = list[i].weight;
        if (i == 0 || list[i].expert != list[i - 1].expert) {
            const duck_expert_slice *e = &a->experts[list[i].expert];
            jobs[njobs++] = (moe_job){list[i].expert, i, 0};
            total_pairs += e->gate_up.row_pairs;
            bytes += fp9_blocks_bytes(e->gate_up.rows, e->gate_up.cols) +
                     fp9_blocks_bytes(e->down.rows, e->down.cols);
        }
        jobs[njobs - 1].count++;
    }
    moe_task task = {a, k, jobs, njobs, total_pairs, xrows, gurows, actrows, yrows, weights};
    if (pool) {
        duck_pool_run(pool, phase_gate_up, &task);
        duck_pool_run(pool, phase_down, &task);
    } else {
        phase_gate_up(&task, 0, 1);
        phase_down(&task, 0, 1);
    }
    if (bytes_streamed)
        *bytes_streamed = bytes;
    return DUCK_FFN_OK;
}

typedef struct matmul_task {
    const duck_kernels *k;
    const fp9_matrix *m;
    uint32_t ntok;
    const float *const *x;
    float *const *y;
} matmul_task;

static void matmul_part(void *arg, unsigned w, unsigned nw)
{
    const matmul_task *t = arg;
    unsigned long begin, end;
    duck_split_aligned(t->m->row_pairs, w, nw, DUCK_ROW_PAIR_ALIGN, &begin, &end);
    t->k->gemm(t->m, (uint32_t)begin, (uint32_t)end, t->ntok, t->x, t->y, 0);
}

int duck_fp9_matmul(duck_pool *pool, const duck_kernels *k, duck_ffn_workspace *ws,
                    const fp9_matrix *m, uint32_t ntok, const float *x, float *y)
{
    if (!k || !ws || !m || !m->blocks || !x || !y || ntok > DUCK_MAX_TOKENS)
        return DUCK_FFN_EINVAL;
    size_t kp = (size_t)m->groups * FP9_GROUP;
    uint8_t *mem = ws_reserve(ws, align64(ntok * kp * sizeof(float)) + 2 * ntok * sizeof(void *));
    if (!mem)
        return DUCK_FFN_ENOMEM;
    float *xp = (float *)mem;
    const float **xrows = (const float **)(mem + align64(ntok * kp * sizeof(float)));
    float **yrows = (float **)(xrows + ntok);
    for (uint32_t t = 0; t < ntok; t++) {
        fp9_prepare_x_f32(x + (size_t)t * m->cols, m->cols, (uint32_t)kp, xp + t * kp);
        xrows[t] = xp + t * kp;
        yrows[t] = y + (size_t)t * m->rows;
    }
    matmul_task task = {k, m, ntok, xrows, yrows};
    if (pool)
        duck_pool_run(pool, matmul_part, &task);
    else
        matmul_part(&task, 0, 1);
    return DUCK_FFN_OK;
}
