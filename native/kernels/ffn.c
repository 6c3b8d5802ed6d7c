/* MoE / MLP slice forward over the thread pool. */
#define _POSIX_C_SOURCE 200809L
#include "ffn.h"

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Down pieces are whole groups of the narrow kernels' row pairs. */
#define DUCK_FFN_DOWN_ALIGN 8
/* Partials (assignments x hidden floats) from which a call's reduction is cut
 * into at least one block of rows per thread: a prefill chunk's sum (512 tokens
 * x top-8 x 2048: 33 MB of partials) took one thread while the others waited. */
#define DUCK_FFN_REDUCE_SPLIT (1u << 20)

/* All (token, slot) assignments that route to one expert. */
typedef struct moe_job {
    uint32_t expert;
    uint32_t first, count;          /* range in the assignment arrays */
} moe_job;

/* Grown on demand, kept between calls: a forward of DUCK_MAX_TOKENS tokens
 * needs more than a thread's stack should hold. */
typedef struct ws_buffer {
    void *mem;
    size_t cap;
} ws_buffer;

struct duck_ffn_workspace {
    ws_buffer main;     /* prepared x, per-assignment rows, pieces, counters */
    ws_buffer routes;   /* the (expert, token) assignments, sorted */
};

duck_ffn_workspace *duck_ffn_workspace_create(void) { return calloc(1, sizeof(duck_ffn_workspace)); }

void duck_ffn_workspace_destroy(duck_ffn_workspace *ws)
{
    if (ws) {
        free(ws->main.mem);
        free(ws->routes.mem);
        free(ws);
    }
}

static void *ws_reserve(ws_buffer *b, size_t bytes)
{
    if (bytes > b->cap) {
        void *p = NULL;
        if (posix_memalign(&p, 64, bytes) != 0)
            return NULL;
        free(b->mem);
        b->mem = p;
        b->cap = bytes;
    }
    return b->mem;
}

int duck_expert_slice_check(const duck_expert_slice *e, uint32_t hidden)
{
    const fp9_matrix *gu = &e->gate_up, *dn = &e->down;
    if (!gu->blocks || !dn->blocks || gu->cols != hidden || dn->rows != hidden ||
        gu->rows != 2 * dn->cols || gu->rows == 0)
        return DUCK_FFN_ESHAPE;
    return DUCK_FFN_OK;
}

/* A piece of work: gate/up row pairs [pb, pe) of one job, or down row
 * pairs [pb, pe) (block `block`) of one job into its partial outputs. */
#define UP_PIECE UINT32_MAX

typedef struct moe_piece {
    uint32_t job, pb, pe, block;
} moe_piece;

typedef struct moe_task {
    const duck_moe_args *a;
    const duck_kernels *k;
    duck_pool *pool;
    const moe_job *jobs;
    uint32_t njobs;
    const moe_piece *pieces;        /* gate/up pieces in job order, then down pieces */
    uint32_t npieces;
    uint32_t block_pairs;           /* down row pairs per block */
    const uint32_t *up_pieces;      /* per job: its gate/up pieces */
    atomic_uint *up_done;           /* per job: those finished */
    atomic_uint *block_done;        /* per block: jobs whose down rows of it are finished */
    const uint32_t *tok_start;      /* [ntok + 1]: token t's assignments are */
    const uint32_t *tok_list;       /*   tok_list[tok_start[t] .. tok_start[t + 1]), ascending */
    const float *const *xrows;      /* per assignment: its token's prepared x */
    float *const *gurows;           /* per assignment: gate/up output, 2S floats */
    float *const *actrows;          /* per assignment: prepared activation, padded */
    float *const *partrows;         /* per assignment: its expert's weighted output, hidden floats */
    const float *weights;           /* per assignment: routing weight */
    float *y32;                     /* [ntok][hidden] fp32 sums (a->y itself when y is fp32) */
    int h_bf16;                     /* bf16 activations: the intermediate is rounded to bf16 */
    _Alignas(64) atomic_uint next;
} moe_task;

static inline float silu(float v) { return v / (1.0f + expf(-v)); }

/* v rounded to the nearest bf16 (even on ties), as duck_f32_to_bf16 rounds. */
static inline float round_bf16(float v)
{
    uint32_t u;
    memcpy(&u, &v, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return v;
    u = (u + 0x7FFFu + ((u >> 16) & 1)) & 0xFFFF0000u;
    memcpy(&v, &u, 4);
    return v;
}

/* The intermediate h = silu(gate) * up. On fp32 activations it is kept in fp32,
 * times the routing weight (folded into the down kernel's input). On bf16
 * activations (a bf16 model: what a GPU host sends) it is rounded to bf16, as
 * the model's own FFN in bf16 rounds it, and the routing weight multiplies the
 * expert's output instead (reduce_block): the down projection then takes bf16
 * values too, so the sets with a bf16 GEMM (amx, avx512-bf16) run it. */
static void gate_up_piece(const moe_task *t, const moe_piece *pc)
{
    const moe_job *job = &t->jobs[pc->job];
    const duck_expert_slice *e = &t->a->experts[job->expert];
    uint32_t first = job->first, n = job->count;
    t->k->gemm(&e->gate_up, pc->pb, pc->pe, n, t->xrows + first, t->gurows + first, 0);
    for (uint32_t i = first; i < first + n; i++) {
        const float *gu = t->gurows[i];
        if (t->h_bf16) {
            for (uint32_t p = pc->pb; p < pc->pe; p++)   /* prepared for the down kernel: x 2^64, exact */
                t->actrows[i][p] = round_bf16(silu(gu[2 * p]) * gu[2 * p + 1]) * 0x1p64f;
            continue;
        }
        float scale = t->weights[i] * 0x1p64f;   /* prepared for the down kernel */
        for (uint32_t p = pc->pb; p < pc->pe; p++)
            t->actrows[i][p] = silu(gu[2 * p]) * gu[2 * p + 1] * scale;
    }
}

/* y rows of a block once every job's partials of it are in: summed per
 * token in expert order, from 0 (the order and the bits of accumulating
 * job by job), then rounded to bf16 if so asked. */
static void reduce_block(const moe_task *t, uint32_t block)
{
    const duck_moe_args *a = t->a;
    uint32_t r0 = 2 * block * t->block_pairs;
    uint32_t r1 = r0 + 2 * t->block_pairs < a->hidden ? r0 + 2 * t->block_pairs : a->hidden;
    for (uint32_t tok = 0; tok < a->ntok; tok++) {
        float *y = t->y32 + (size_t)tok * a->hidden;
        memset(y + r0, 0, (r1 - r0) * sizeof(float));
        for (uint32_t k = t->tok_start[tok]; k < t->tok_start[tok + 1]; k++) {
            const float *part = t->partrows[t->tok_list[k]];
            if (t->h_bf16) {
                const float w = t->weights[t->tok_list[k]];
                for (uint32_t r = r0; r < r1; r++)
                    y[r] += w * part[r];
            } else {
                for (uint32_t r = r0; r < r1; r++)
                    y[r] += part[r];
            }
        }
        if (a->y_dtype == DUCK_DT_BF16)
            duck_f32_to_bf16(y + r0, r1 - r0, (uint16_t *)a->y + (size_t)tok * a->hidden + r0);
    }
}

static void down_piece(const moe_task *t, const moe_piece *pc)
{
    duck_pool_latch_wait(t->pool, &t->up_done[pc->job], t->up_pieces[pc->job]);
    const moe_job *job = &t->jobs[pc->job];
    t->k->gemm(&t->a->experts[job->expert].down, pc->pb, pc->pe, job->count,
               (const float *const *)(t->actrows + job->first), t->partrows + job->first, 0);
    if (atomic_fetch_add(&t->block_done[pc->block], 1) + 1 == t->njobs)
        reduce_block(t, pc->block);   /* the last job to finish this block sums it */
}

/* Run by every thread that joins: claim pieces in order until none is
 * left. A down piece waits only for its own job's gate/up pieces (claimed
 * long before, normally done), so there is no barrier between the phases
 * and every down piece streams one expert's rows. */
static void moe_run(void *arg, unsigned w, unsigned nw)
{
    moe_task *t = arg;
    (void)w, (void)nw;
    for (unsigned c; (c = atomic_fetch_add(&t->next, 1)) < t->npieces;) {
        const moe_piece *pc = &t->pieces[c];
        if (pc->block == UP_PIECE) {
            gate_up_piece(t, pc);
            duck_pool_latch_add(t->pool, &t->up_done[pc->job], t->up_pieces[pc->job]);
        } else {
            down_piece(t, pc);
        }
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

/* Row pairs of about piece_bytes of weights at pair_bytes each, a multiple
 * of align (at least align). */
static uint32_t piece_pairs(size_t pair_bytes, uint32_t align, size_t piece_bytes)
{
    size_t n = piece_bytes / (pair_bytes ? pair_bytes : 1) / align * align;
    return n < align ? align : (uint32_t)(n > 0x10000000u ? 0x10000000u : n);
}

/* Bytes per piece for a phase of total bytes on nthreads: whole jobs (the
 * longest streams) on one thread, else a few pieces per thread so that the
 * threads end the phase together. Piece boundaries only decide which
 * thread computes a row, never how: the result is the same for any size. */
static size_t piece_bytes(size_t total, unsigned nthreads)
{
    if (nthreads <= 1)
        return SIZE_MAX;
    size_t b = total / ((size_t)nthreads * DUCK_FFN_PIECES_PER_THREAD);
    return b > DUCK_FFN_MIN_PIECE_BYTES ? b : DUCK_FFN_MIN_PIECE_BYTES;
}

static void zero_output(const duck_moe_args *a)
{
    memset(a->y, 0, (size_t)a->ntok * a->hidden * (a->y_dtype == DUCK_DT_BF16 ? 2 : 4));
}

int duck_moe_forward(duck_pool *pool, const duck_kernels *k, duck_ffn_workspace *ws,
                     const duck_moe_args *a, uint64_t *bytes_streamed)
{
    if (!k || !ws || !a || a->ntok > DUCK_MAX_TOKENS || a->topk > DUCK_MAX_TOPK || a->hidden == 0 ||
        a->x_dtype > DUCK_DT_BF16 || a->y_dtype > DUCK_DT_BF16 ||
        (a->ntok && (!a->x || !a->y || (a->topk && (!a->expert_ids || !a->expert_weights || !a->experts)))))
        return DUCK_FFN_EINVAL;
    uint32_t hp = (a->hidden + FP9_GROUP - 1) / FP9_GROUP * FP9_GROUP;
    assignment *list = ws_reserve(&ws->routes, ((size_t)a->ntok * a->topk + 1) * sizeof(assignment));
    if (!list)
        return DUCK_FFN_ENOMEM;
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
        zero_output(a);
        if (bytes_streamed)
            *bytes_streamed = 0;
        return DUCK_FFN_OK;
    }
    qsort(list, nassign, sizeof list[0], by_expert);

    /* pieces: a few per thread and phase (whole jobs on one thread) */
    uint32_t njobs = 0;
    size_t gate_up_bytes = 0, down_bytes = 0, down_pair_bytes = 0;
    for (uint32_t i = 0; i < nassign; i++)
        if (i == 0 || list[i].expert != list[i - 1].expert) {
            const duck_expert_slice *e = &a->experts[list[i].expert];
            size_t pair = (size_t)e->down.groups * sizeof(fp9_block);
            njobs++;
            gate_up_bytes += (size_t)e->gate_up.row_pairs * e->gate_up.groups * sizeof(fp9_block);
            down_bytes += pair * e->down.row_pairs;
            down_pair_bytes = pair > down_pair_bytes ? pair : down_pair_bytes;
        }
    unsigned nthreads = pool ? duck_pool_size(pool) : 1;
    size_t up_piece = piece_bytes(gate_up_bytes, nthreads);
    uint32_t block_pairs = piece_pairs(down_pair_bytes, DUCK_FFN_DOWN_ALIGN, piece_bytes(down_bytes, nthreads));
    if (nthreads > 1 && (size_t)nassign * a->hidden >= DUCK_FFN_REDUCE_SPLIT) {
        uint32_t per = ((a->hidden + 1) / 2 + nthreads - 1) / nthreads;
        per = (per + DUCK_FFN_DOWN_ALIGN - 1) / DUCK_FFN_DOWN_ALIGN * DUCK_FFN_DOWN_ALIGN;
        block_pairs = per < block_pairs ? per : block_pairs;
    }
    uint32_t nblocks = ((a->hidden + 1) / 2 + block_pairs - 1) / block_pairs;
    uint32_t npieces = njobs * nblocks;
    for (uint32_t i = 0; i < nassign; i++)
        if (i == 0 || list[i].expert != list[i - 1].expert) {
            const fp9_matrix *gu = &a->experts[list[i].expert].gate_up;
            uint32_t per = piece_pairs((size_t)gu->groups * sizeof(fp9_block), DUCK_ROW_PAIR_ALIGN, up_piece);
            npieces += (gu->row_pairs + per - 1) / per;
        }

    /* workspace: prepared x, fp32 y (for a bf16 y), per-assignment buffers and row pointers,
     * jobs, pieces, counters, the tokens' assignment lists */
    size_t x_bytes = align64((size_t)a->ntok * hp * sizeof(float));
    size_t y32_bytes = a->y_dtype == DUCK_DT_BF16 ? align64((size_t)a->ntok * a->hidden * sizeof(float)) : 0;
    size_t gu_stride = align64((size_t)(max_gu + 1) * sizeof(float)) / sizeof(float);
    size_t act_stride = align64((size_t)max_act * sizeof(float)) / sizeof(float);
    size_t part_stride = align64((size_t)a->hidden * sizeof(float)) / sizeof(float);
    size_t need = x_bytes + y32_bytes + nassign * (gu_stride + act_stride + part_stride) * sizeof(float) +
                  align64(5 * nassign * sizeof(void *)) + align64(njobs * sizeof(moe_job)) +
                  align64(npieces * sizeof(moe_piece)) + align64(((size_t)njobs + nblocks) * sizeof(atomic_uint)) +
                  align64((njobs + a->ntok + 1 + (size_t)nassign) * sizeof(uint32_t));
    uint8_t *mem = ws_reserve(&ws->main, need);
    if (!mem)
        return DUCK_FFN_ENOMEM;
    float *xp = (float *)mem;
    float *y32 = y32_bytes ? (float *)(mem + x_bytes) : (float *)a->y;
    float *gu = (float *)(mem + x_bytes + y32_bytes);
    float *act = gu + nassign * gu_stride, *part = act + nassign * act_stride;
    void **ptrs = (void **)(part + nassign * part_stride);
    const float **xrows = (const float **)ptrs;
    float **gurows = (float **)(ptrs + nassign), **actrows = gurows + nassign, **partrows = actrows + nassign;
    float *weights = (float *)(partrows + nassign);
    moe_job *jobs = (moe_job *)((uint8_t *)ptrs + align64(5 * nassign * sizeof(void *)));
    moe_piece *pieces = (moe_piece *)((uint8_t *)jobs + align64(njobs * sizeof(moe_job)));
    atomic_uint *up_done = (atomic_uint *)((uint8_t *)pieces + align64(npieces * sizeof(moe_piece)));
    atomic_uint *block_done = up_done + njobs;
    uint32_t *up_pieces = (uint32_t *)((uint8_t *)up_done + align64(((size_t)njobs + nblocks) * sizeof(atomic_uint)));
    uint32_t *tok_start = up_pieces + njobs, *tok_list = tok_start + a->ntok + 1;

    for (uint32_t t = 0; t < a->ntok; t++) {
        if (a->x_dtype == DUCK_DT_BF16)
            fp9_prepare_x_bf16((const uint16_t *)a->x + (size_t)t * a->hidden, a->hidden, hp, xp + (size_t)t * hp);
        else
            fp9_prepare_x_f32((const float *)a->x + (size_t)t * a->hidden, a->hidden, hp, xp + (size_t)t * hp);
    }
    uint32_t nj = 0, np = 0;
    uint64_t bytes = 0;
    memset(tok_start, 0, (a->ntok + 1) * sizeof(uint32_t));
    for (uint32_t i = 0; i < nassign; i++) {
        xrows[i] = xp + (size_t)list[i].token * hp;
        gurows[i] = gu + i * gu_stride;
        actrows[i] = act + i * act_stride;
        memset(actrows[i], 0, act_stride * sizeof(float));   /* zero padding columns */
        partrows[i] = part + i * part_stride;
        weights[i] = list[i].weight;
        tok_start[list[i].token + 1]++;
        if (i == 0 || list[i].expert != list[i - 1].expert) {
            const duck_expert_slice *e = &a->experts[list[i].expert];
            uint32_t per = piece_pairs((size_t)e->gate_up.groups * sizeof(fp9_block), DUCK_ROW_PAIR_ALIGN, up_piece);
            up_pieces[nj] = 0;
            for (uint32_t pb = 0; pb < e->gate_up.row_pairs; pb += per, up_pieces[nj]++)
                pieces[np++] = (moe_piece){nj, pb, pb + per < e->gate_up.row_pairs ? pb + per : e->gate_up.row_pairs,
                                           UP_PIECE};
            atomic_init(&up_done[nj], 0);
            jobs[nj++] = (moe_job){list[i].expert, i, 0};
            bytes += fp9_blocks_bytes(e->gate_up.rows, e->gate_up.cols) +
                     fp9_blocks_bytes(e->down.rows, e->down.cols);
        }
        jobs[nj - 1].count++;
    }
    for (uint32_t t = 0; t < a->ntok; t++)
        tok_start[t + 1] += tok_start[t];
    /* a counting sort, ascending per token: tok_start[t] serves as token t's
     * cursor (ending at the start of t + 1), then moves back one token */
    for (uint32_t i = 0; i < nassign; i++)
        tok_list[tok_start[list[i].token]++] = i;
    for (uint32_t t = a->ntok; t > 0; t--)
        tok_start[t] = tok_start[t - 1];
    tok_start[0] = 0;
    uint32_t pairs = (a->hidden + 1) / 2;
    for (uint32_t j = 0; j < njobs; j++)
        for (uint32_t b = 0; b < nblocks; b++)
            pieces[np++] = (moe_piece){j, b * block_pairs, (b + 1) * block_pairs < pairs ? (b + 1) * block_pairs : pairs,
                                       b};
    for (uint32_t b = 0; b < nblocks; b++)
        atomic_init(&block_done[b], 0);

    moe_task task = {.a = a, .k = k, .pool = pool, .jobs = jobs, .njobs = njobs, .pieces = pieces,
                     .npieces = npieces, .block_pairs = block_pairs, .up_pieces = up_pieces, .up_done = up_done,
                     .block_done = block_done, .tok_start = tok_start, .tok_list = tok_list, .xrows = xrows,
                     .gurows = gurows, .actrows = actrows, .partrows = partrows, .weights = weights, .y32 = y32,
                     .h_bf16 = a->x_dtype == DUCK_DT_BF16};
    atomic_init(&task.next, 0);
    if (pool)
        duck_pool_run_shared(pool, moe_run, &task);
    else
        moe_run(&task, 0, 1);
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
    uint8_t *mem = ws_reserve(&ws->main, align64(ntok * kp * sizeof(float)) + 2 * ntok * sizeof(void *));
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
