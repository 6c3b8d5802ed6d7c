/* MoE / MLP slice forward over the thread pool. */
#define _POSIX_C_SOURCE 200809L
#include "ffn.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Down blocks are whole micro-panels of the amx GEMM (32 rows), and so whole
 * groups of the narrow kernels' row pairs. */
#define DUCK_FFN_DOWN_ALIGN 16
/* Down blocks per thread (each streams its rows of every expert), and the most
 * bytes of one job's outputs of a block (a worker's buffer: within its L2). */
#define DUCK_FFN_DOWN_BLOCKS 2
#define DUCK_FFN_PARTS_BYTES (256u << 10)

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

/* The bench's phase profile (duck_ffn_profile): off, one relaxed load per piece. */
enum { PH_SETUP, PH_GATE_UP, PH_SILU, PH_WAIT, PH_DOWN, PH_REDUCE, PH_RUN };
static atomic_int prof_on;
static atomic_ullong prof_ns[DUCK_FFN_PHASES];

static uint64_t prof_now(void)
{
    if (!atomic_load_explicit(&prof_on, memory_order_relaxed))
        return 0;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The time since *t0 to phase ph, *t0 moved to now (nothing while off). */
static void prof_add(int ph, uint64_t *t0)
{
    if (!*t0)
        return;
    uint64_t t = prof_now();
    atomic_fetch_add_explicit(&prof_ns[ph], t - *t0, memory_order_relaxed);
    *t0 = t;
}

void duck_ffn_profile(int on, uint64_t *ns)
{
    if (on)
        for (int i = 0; i < DUCK_FFN_PHASES; i++)
            atomic_store(&prof_ns[i], 0);
    atomic_store(&prof_on, on);
    if (ns)
        for (int i = 0; i < DUCK_FFN_PHASES; i++)
            ns[i] = atomic_load(&prof_ns[i]);
}

/* A piece of work: gate/up row pairs [pb, pe) of one job, or down row pairs
 * [pb, pe) (block `block`) of every job, summed into y. */
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
    const moe_piece *pieces;        /* gate/up pieces in job order, then the down blocks */
    uint32_t npieces;
    const uint32_t *up_pieces;      /* per job: its gate/up pieces */
    atomic_uint *up_done;           /* per job: those finished */
    const uint32_t *tokens;         /* per assignment: its token */
    const float *const *xrows;      /* per assignment: its token's prepared x */
    float *const *gurows;           /* per assignment: gate/up output, 2S floats */
    float *const *actrows;          /* per assignment: prepared activation, padded */
    const float *weights;           /* per assignment: routing weight */
    float *parts;                   /* per worker: a job's outputs of one down block */
    size_t parts_stride;            /*   floats per worker (hidden of lead, then max job x block rows) */
    float **prows;                  /* per worker: max job row pointers into its parts */
    uint32_t max_count;             /* the most assignments of one job */
    float *y32;                     /* [ntok][hidden] fp32 sums (a->y itself when y is fp32) */
    int h_bf16;                     /* bf16 activations: the intermediate is rounded to bf16 */
    _Alignas(64) atomic_uint next;
} moe_task;

/* The intermediate h = silu(gate) * up (act.c). On fp32 activations it is kept
 * in fp32, times the routing weight (folded into the down kernel's input). On
 * bf16 activations (a bf16 model: what a GPU host sends) it is rounded to bf16,
 * as the model's own FFN in bf16 rounds it, and the routing weight multiplies
 * the expert's output instead (down_block): the down projection then takes
 * bf16 values too, so the sets with a bf16 GEMM (amx, avx512-bf16) run it (amx
 * runs fp32 ones on its tiles too, in three bf16 parts). */
static void gate_up_piece(const moe_task *t, const moe_piece *pc)
{
    const moe_job *job = &t->jobs[pc->job];
    const duck_expert_slice *e = &t->a->experts[job->expert];
    uint32_t first = job->first, n = job->count;
    uint64_t t0 = prof_now();
    t->k->gemm(&e->gate_up, pc->pb, pc->pe, n, t->xrows + first, t->gurows + first, 0);
    prof_add(PH_GATE_UP, &t0);
    for (uint32_t i = first; i < first + n; i++)   /* prepared for the down kernel: x 2^64 (exact) */
        duck_ffn_act(t->gurows[i], pc->pb, pc->pe, t->h_bf16 ? 0x1p64f : t->weights[i] * 0x1p64f, t->h_bf16,
                     t->actrows[i]);
    prof_add(PH_SILU, &t0);
}

/* Rows [2 pb, 2 pe) of y, from 0: every job in expert order, each waiting for
 * its gate/up, its down rows of the block computed into worker w's parts (a
 * job's tokens x the block's rows: in L2, where a buffer of every assignment's
 * whole output was tens of MB written and read back once), then added onto its
 * tokens' rows (times the routing weight on bf16 activations). So each token's
 * sum runs in expert order from 0 whatever the threads do; then rounded to
 * bf16 if so asked. */
static void down_block(const moe_task *t, const moe_piece *pc, unsigned w)
{
    const duck_moe_args *a = t->a;
    const uint32_t r0 = 2 * pc->pb, r1 = 2 * pc->pe < a->hidden ? 2 * pc->pe : a->hidden, nr = r1 - r0;
    /* row i of the parts at lead + i * nr; the kernel writes row r of it at [r]: a pointer
     * r0 floats before (the lead of hidden floats keeps it inside the buffer) */
    float *parts = t->parts + (size_t)w * t->parts_stride + a->hidden;
    float **prow = t->prows + (size_t)w * t->max_count;
    uint64_t t0 = prof_now();
    for (uint32_t tok = 0; tok < a->ntok; tok++)
        memset(t->y32 + (size_t)tok * a->hidden + r0, 0, nr * sizeof(float));
    prof_add(PH_REDUCE, &t0);
    for (uint32_t j = 0; j < t->njobs; j++) {
        const moe_job *job = &t->jobs[j];
        duck_pool_latch_wait(t->pool, &t->up_done[j], t->up_pieces[j]);
        prof_add(PH_WAIT, &t0);
        for (uint32_t i = 0; i < job->count; i++)
            prow[i] = parts + (size_t)i * nr - r0;
        t->k->gemm(&a->experts[job->expert].down, pc->pb, pc->pe, job->count,
                   (const float *const *)(t->actrows + job->first), prow, 0);
        prof_add(PH_DOWN, &t0);
        for (uint32_t i = 0; i < job->count; i++) {
            float *y = t->y32 + (size_t)t->tokens[job->first + i] * a->hidden;
            const float *part = prow[i];
            if (t->h_bf16) {
                const float wt = t->weights[job->first + i];
                for (uint32_t r = r0; r < r1; r++)
                    y[r] += wt * part[r];
            } else {
                for (uint32_t r = r0; r < r1; r++)
                    y[r] += part[r];
            }
        }
        prof_add(PH_REDUCE, &t0);
    }
    if (a->y_dtype == DUCK_DT_BF16)
        for (uint32_t tok = 0; tok < a->ntok; tok++)
            duck_f32_to_bf16(t->y32 + (size_t)tok * a->hidden + r0, nr,
                             (uint16_t *)a->y + (size_t)tok * a->hidden + r0);
    prof_add(PH_REDUCE, &t0);
}

/* Run by every thread that joins: claim pieces in order until none is
 * left. A down block waits for each job's gate/up pieces in turn (claimed
 * long before, normally done), so there is no barrier between the phases. */
static void moe_run(void *arg, unsigned w, unsigned nw)
{
    moe_task *t = arg;
    (void)nw;
    for (unsigned c; (c = atomic_fetch_add(&t->next, 1)) < t->npieces;) {
        const moe_piece *pc = &t->pieces[c];
        if (pc->block == UP_PIECE) {
            gate_up_piece(t, pc);
            duck_pool_latch_add(t->pool, &t->up_done[pc->job], t->up_pieces[pc->job]);
        } else {
            down_block(t, pc, w);
        }
    }
}

typedef struct assignment {
    uint32_t expert, token;
    float weight;
} assignment;

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

/* Row pairs per down block: DUCK_FFN_DOWN_BLOCKS per thread where the down
 * weights make pieces of at least DUCK_FFN_MIN_PIECE_BYTES, and small enough
 * that a job's outputs of a block stay within DUCK_FFN_PARTS_BYTES. */
static uint32_t down_block_pairs(uint32_t hidden, size_t down_bytes, unsigned nthreads, uint32_t max_count)
{
    const uint32_t pairs = (hidden + 1) / 2;
    size_t blocks = (size_t)nthreads * DUCK_FFN_DOWN_BLOCKS;
    size_t by_bytes = down_bytes / DUCK_FFN_MIN_PIECE_BYTES;
    blocks = nthreads <= 1 ? 1 : blocks < by_bytes ? blocks : by_bytes ? by_bytes : 1;
    size_t by_parts = ((size_t)max_count * hidden * sizeof(float) + DUCK_FFN_PARTS_BYTES - 1) / DUCK_FFN_PARTS_BYTES;
    blocks = blocks > by_parts ? blocks : by_parts;
    size_t per = (pairs + blocks - 1) / blocks;
    per = (per + DUCK_FFN_DOWN_ALIGN - 1) / DUCK_FFN_DOWN_ALIGN * DUCK_FFN_DOWN_ALIGN;
    return (uint32_t)(per < pairs ? per : (pairs + DUCK_FFN_DOWN_ALIGN - 1) / DUCK_FFN_DOWN_ALIGN * DUCK_FFN_DOWN_ALIGN);
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
    uint64_t t0 = prof_now();
    /* the assignments in token order, then sorted by expert (a counting sort: stable, so each
     * expert's tokens ascend), and a count per expert */
    size_t slots = (size_t)a->ntok * a->topk + 1;
    uint8_t *routes = ws_reserve(&ws->routes, 2 * slots * sizeof(assignment) + ((size_t)a->n_experts + 1) * 4);
    if (!routes)
        return DUCK_FFN_ENOMEM;
    assignment *in = (assignment *)routes, *list = in + slots;
    uint32_t *per_expert = (uint32_t *)(list + slots);
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
            in[nassign++] = (assignment){(uint32_t)id, t, a->expert_weights[t * a->topk + s]};
        }
    }
    if (nassign == 0) {
        zero_output(a);
        if (bytes_streamed)
            *bytes_streamed = 0;
        return DUCK_FFN_OK;
    }
    memset(per_expert, 0, ((size_t)a->n_experts + 1) * 4);
    for (uint32_t i = 0; i < nassign; i++)
        per_expert[in[i].expert + 1]++;
    uint32_t njobs = 0, max_count = 0;
    for (uint32_t e = 0; e < a->n_experts; e++) {
        njobs += per_expert[e + 1] != 0;
        max_count = per_expert[e + 1] > max_count ? per_expert[e + 1] : max_count;
        per_expert[e + 1] += per_expert[e];
    }
    for (uint32_t i = 0; i < nassign; i++)
        list[per_expert[in[i].expert]++] = in[i];

    /* pieces: a few per thread and phase (whole jobs on one thread) */
    size_t gate_up_bytes = 0, down_bytes = 0;
    for (uint32_t i = 0; i < nassign; i++)
        if (i == 0 || list[i].expert != list[i - 1].expert) {
            const duck_expert_slice *e = &a->experts[list[i].expert];
            gate_up_bytes += (size_t)e->gate_up.row_pairs * e->gate_up.groups * sizeof(fp9_block);
            down_bytes += (size_t)e->down.groups * sizeof(fp9_block) * e->down.row_pairs;
        }
    unsigned nthreads = pool ? duck_pool_size(pool) : 1;
    size_t up_piece = piece_bytes(gate_up_bytes, nthreads);
    uint32_t block_pairs = down_block_pairs(a->hidden, down_bytes, nthreads, max_count);
    uint32_t pairs = (a->hidden + 1) / 2, nblocks = (pairs + block_pairs - 1) / block_pairs;
    uint32_t block_rows = 2 * block_pairs < a->hidden ? 2 * block_pairs : a->hidden;
    uint32_t npieces = nblocks;
    for (uint32_t i = 0; i < nassign; i++)
        if (i == 0 || list[i].expert != list[i - 1].expert) {
            const fp9_matrix *gu = &a->experts[list[i].expert].gate_up;
            uint32_t per = piece_pairs((size_t)gu->groups * sizeof(fp9_block), DUCK_ROW_PAIR_ALIGN, up_piece);
            npieces += (gu->row_pairs + per - 1) / per;
        }

    /* workspace: prepared x, fp32 y (for a bf16 y), per-assignment buffers, row pointers,
     * tokens and weights, each worker's block outputs and their row pointers, jobs, pieces,
     * counters */
    size_t x_bytes = align64((size_t)a->ntok * hp * sizeof(float));
    size_t y32_bytes = a->y_dtype == DUCK_DT_BF16 ? align64((size_t)a->ntok * a->hidden * sizeof(float)) : 0;
    size_t gu_stride = align64((size_t)(max_gu + 1) * sizeof(float)) / sizeof(float);
    size_t act_stride = align64((size_t)max_act * sizeof(float)) / sizeof(float);
    size_t parts_stride = align64(((size_t)a->hidden + (size_t)max_count * block_rows) * sizeof(float)) / sizeof(float);
    size_t need = x_bytes + y32_bytes + nassign * (gu_stride + act_stride) * sizeof(float) +
                  nthreads * parts_stride * sizeof(float) + align64(3 * nassign * sizeof(void *)) +
                  align64((size_t)nthreads * max_count * sizeof(float *)) + align64(2 * (size_t)nassign * 4) +
                  align64(njobs * sizeof(moe_job)) + align64(npieces * sizeof(moe_piece)) +
                  align64((size_t)njobs * sizeof(atomic_uint)) + align64(njobs * sizeof(uint32_t));
    uint8_t *mem = ws_reserve(&ws->main, need);
    if (!mem)
        return DUCK_FFN_ENOMEM;
    float *xp = (float *)mem;
    float *y32 = y32_bytes ? (float *)(mem + x_bytes) : (float *)a->y;
    float *gu = (float *)(mem + x_bytes + y32_bytes);
    float *act = gu + nassign * gu_stride, *parts = act + nassign * act_stride;
    void **ptrs = (void **)(parts + nthreads * parts_stride);
    const float **xrows = (const float **)ptrs;
    float **gurows = (float **)(ptrs + nassign), **actrows = gurows + nassign;
    float **prows = (float **)((uint8_t *)ptrs + align64(3 * nassign * sizeof(void *)));
    uint32_t *tokens = (uint32_t *)((uint8_t *)prows + align64((size_t)nthreads * max_count * sizeof(float *)));
    float *weights = (float *)(tokens + nassign);
    moe_job *jobs = (moe_job *)((uint8_t *)tokens + align64(2 * (size_t)nassign * 4));
    moe_piece *pieces = (moe_piece *)((uint8_t *)jobs + align64(njobs * sizeof(moe_job)));
    atomic_uint *up_done = (atomic_uint *)((uint8_t *)pieces + align64(npieces * sizeof(moe_piece)));
    uint32_t *up_pieces = (uint32_t *)((uint8_t *)up_done + align64((size_t)njobs * sizeof(atomic_uint)));

    for (uint32_t t = 0; t < a->ntok; t++) {
        if (a->x_dtype == DUCK_DT_BF16)
            fp9_prepare_x_bf16((const uint16_t *)a->x + (size_t)t * a->hidden, a->hidden, hp, xp + (size_t)t * hp);
        else
            fp9_prepare_x_f32((const float *)a->x + (size_t)t * a->hidden, a->hidden, hp, xp + (size_t)t * hp);
    }
    uint32_t nj = 0, np = 0;
    uint64_t bytes = 0;
    for (uint32_t i = 0; i < nassign; i++) {
        xrows[i] = xp + (size_t)list[i].token * hp;
        gurows[i] = gu + i * gu_stride;
        actrows[i] = act + i * act_stride;
        memset(actrows[i], 0, act_stride * sizeof(float));   /* zero padding columns */
        tokens[i] = list[i].token;
        weights[i] = list[i].weight;
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
    for (uint32_t b = 0; b < nblocks; b++)
        pieces[np++] = (moe_piece){0, b * block_pairs, (b + 1) * block_pairs < pairs ? (b + 1) * block_pairs : pairs, b};

    moe_task task = {.a = a, .k = k, .pool = pool, .jobs = jobs, .njobs = njobs, .pieces = pieces,
                     .npieces = npieces, .up_pieces = up_pieces, .up_done = up_done, .tokens = tokens,
                     .xrows = xrows, .gurows = gurows, .actrows = actrows, .weights = weights, .parts = parts,
                     .parts_stride = parts_stride, .prows = prows, .max_count = max_count, .y32 = y32,
                     .h_bf16 = a->x_dtype == DUCK_DT_BF16};
    atomic_init(&task.next, 0);
    prof_add(PH_SETUP, &t0);
    if (pool)
        duck_pool_run_shared(pool, moe_run, &task);
    else
        moe_run(&task, 0, 1);
    prof_add(PH_RUN, &t0);
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
