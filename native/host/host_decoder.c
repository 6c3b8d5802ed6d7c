/* The native CPU decoder; see host_decoder.h. A layer step is one pool run
 * in phases (host_ops.h): the input norm by token; q/k/v by head, each head
 * then normed, rotated and (keys, values) written to the cache by the worker
 * that made it; attention by (token, query head); o_proj by rows; the
 * residual add and post norm by token; for a routed layer the router's
 * logits by rows and its top-k by token. */
#include "host_decoder.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct duck_host_decoder {
    duck_host_model m;
    duck_host_layer *layers;
    duck_host_io io;
    const duck_host_kernels *k;
    duck_pool *pool;
    float scale;                 /* head_dim ** -0.5 */
    /* the step in progress */
    uint32_t ntok, next_layer;   /* next_layer: the layer step expected next; layers + 1: none begun */
    const duck_host_layer *cur;
    const float *ffn_out;        /* the previous FFN's output [ntok, hidden], or NULL */
    const uint32_t *rows;        /* finish: the tokens that get logits (NULL: all) */
    const float *logits;         /* finish: where they go, and where argmax reads them */
    int32_t *argmax;             /* finish: each row's largest logit's index, or NULL */
    duck_host_phase phases[8];
    duck_host_gemm_job gemm_o, gemm_router, gemm_lm_head;
    int64_t positions[DUCK_HOST_MAX_TOKENS];
    uint64_t slot_offset[DUCK_HOST_MAX_TOKENS];   /* elements into a layer's cache where the token's slot begins */
    /* scratch, one allocation */
    float *mem;
    float *cos, *sin;            /* [max_tokens, head_dim / 2] */
    float *x;                    /* the residual stream [max_tokens, hidden] */
    float *h;                    /* normed input of the attention [max_tokens, hidden] */
    float *q, *attn;             /* [max_tokens, heads * head_dim] */
    float *kn, *vn;              /* the new keys / values [max_tokens, kv_heads * head_dim] */
    float *o;                    /* o_proj output [max_tokens, hidden] */
    float *router;               /* router logits [max_tokens, n_experts] */
    float *scores;               /* attention scores, max_len x (heads / kv_heads) per worker */
    float *widen;                /* a half cache's keys widened, DUCK_HOST_ATTN_ROWS x head_dim per worker */
    uint32_t attn_heads;         /* query heads per attention item: 1, or a kv head's (heads / kv_heads) */
    char err[256];
};

static int fail(duck_host_decoder *d, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(d->err, sizeof d->err, fmt, ap);
    va_end(ap);
    return -1;
}

/* The cache's strides between positions and between kv heads (0 and 0: [max_len, kv_heads, head_dim]). */
static void cache_strides(const duck_host_model *m, uint64_t *pos, uint64_t *head)
{
    const int packed = !m->pos_stride && !m->head_stride;
    *pos = packed ? (uint64_t)m->kv_heads * m->head_dim : m->pos_stride;
    *head = packed ? m->head_dim : m->head_stride;
}

static const char *check_model(const duck_host_model *m, const duck_host_io *io)
{
    if (!m->hidden || !m->heads || !m->kv_heads || !m->head_dim || !m->layers || !m->vocab || !m->max_len)
        return "hidden, heads, kv_heads, head_dim, layers, vocab and max_len must all be positive";
    if (m->head_dim % 2)
        return "head_dim must be even for rotary embeddings";
    if (m->heads % m->kv_heads)
        return "heads must be a multiple of kv_heads";
    if (!m->max_tokens || m->max_tokens > DUCK_HOST_MAX_TOKENS)
        return "max_tokens must be in 1..DUCK_HOST_MAX_TOKENS";
    if (!m->inv_freq || !m->embed || !m->final_norm || !m->lm_head || !m->layer || !io || !io->ffn_in)
        return "inv_freq, embed, final_norm, lm_head, the layer table and io.ffn_in are required";
    if (!(m->eps > 0.0f))
        return "eps must be positive";
    if (m->wtype != DUCK_HOST_F32 && m->wtype != DUCK_HOST_F16)
        return "wtype must be DUCK_HOST_F32 or DUCK_HOST_F16";
    if (m->wtype == DUCK_HOST_F16 && m->head_dim % DUCK_HOST_PANEL)
        return "half weights need head_dim a multiple of 16 (a head's rows start a packed panel)";
    if (m->kv_type != DUCK_HOST_F32 && m->kv_type != DUCK_HOST_F16)
        return "kv_type must be DUCK_HOST_F32 or DUCK_HOST_F16";
    uint64_t pos, head;
    cache_strides(m, &pos, &head);
    const uint64_t D = m->head_dim, slot = (uint64_t)m->max_len * m->kv_heads * D;
    if (!(head == D && pos >= m->kv_heads * D) && !(pos == D && head >= m->max_len * D))
        return "the cache's strides must be [max_len, kv_heads, head_dim] (pos_stride >= kv_heads * head_dim, "
               "head_stride = head_dim) or heads outer (pos_stride = head_dim, head_stride >= max_len * head_dim)";
    if (m->slots > 1 && m->slot_stride < slot)
        return "slot_stride is less than one slot's cache (max_len * kv_heads * head_dim)";
    int routed = 0;
    for (uint32_t i = 0; i < m->layers; i++) {
        const duck_host_layer *l = &m->layer[i];
        if (!l->input_norm || !l->post_norm || !l->wq || !l->wk || !l->wv || !l->wo || !l->k_cache || !l->v_cache)
            return "a layer lacks a norm, a projection or its cache";
        routed |= l->router != NULL;
    }
    if (routed && (!m->n_experts || !m->topk || m->topk > m->n_experts || m->topk > DUCK_HOST_MAX_TOPK ||
                   !io->expert_ids || !io->expert_weights))
        return "routed layers need n_experts, topk in 1..min(n_experts, 32) and io's expert buffers";
    return NULL;
}

duck_host_decoder *duck_host_decoder_create(const duck_host_model *m, const duck_host_io *io,
                                            const duck_host_kernels *k, duck_pool *pool, char *err,
                                            uint32_t errlen)
{
    const char *bad = k ? check_model(m, io) : "no kernel set";
    if (bad) {
        if (err && errlen)
            snprintf(err, errlen, "%s", bad);
        return NULL;
    }
    duck_host_decoder *d = calloc(1, sizeof *d);
    if (!d)
        goto oom;
    d->m = *m;
    d->io = *io;
    d->k = k;
    d->pool = pool;
    d->scale = 1.0f / sqrtf((float)m->head_dim);
    d->next_layer = m->layers + 1;
    d->layers = malloc(sizeof *d->layers * m->layers);
    if (!d->layers)
        goto oom;
    memcpy(d->layers, m->layer, sizeof *d->layers * m->layers);
    d->m.layer = d->layers;
    cache_strides(m, &d->m.pos_stride, &d->m.head_stride);

    const size_t T = m->max_tokens, half = m->head_dim / 2, qd = (size_t)m->heads * m->head_dim;
    const size_t kvd = (size_t)m->kv_heads * m->head_dim, workers = pool ? duck_pool_size(pool) : 1;
    const size_t sizes[] = {T * half, T * half, T * m->hidden, T * m->hidden, T * qd, T * qd, T * kvd, T * kvd,
                            T * m->hidden, T * m->n_experts, workers * m->max_len * (m->heads / m->kv_heads),
                            m->kv_type == DUCK_HOST_F16 ? workers * DUCK_HOST_ATTN_ROWS * m->head_dim : 0};
    float **slots[] = {&d->cos, &d->sin, &d->x, &d->h, &d->q, &d->attn, &d->kn, &d->vn, &d->o, &d->router,
                       &d->scores, &d->widen};
    size_t total = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++)
        total += (sizes[i] + 15) & ~(size_t)15;   /* each slot 64-byte aligned */
    d->mem = aligned_alloc(64, total * sizeof(float));
    if (!d->mem)
        goto oom;
    memset(d->mem, 0, total * sizeof(float));
    float *p = d->mem;
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        *slots[i] = p;
        p += (sizes[i] + 15) & ~(size_t)15;
    }
    return d;
oom:
    if (err && errlen)
        snprintf(err, errlen, "out of memory for the decoder's buffers");
    duck_host_decoder_destroy(d);
    return NULL;
}

void duck_host_decoder_destroy(duck_host_decoder *d)
{
    if (!d)
        return;
    free(d->mem);
    free(d->layers);
    free(d);
}

const char *duck_host_decoder_error(const duck_host_decoder *d) { return d->err; }

int duck_host_begin(duck_host_decoder *d, uint32_t ntok, const int64_t *ids, const int64_t *positions)
{
    return duck_host_begin_slots(d, ntok, ids, positions, NULL);
}

int duck_host_begin_slots(duck_host_decoder *d, uint32_t ntok, const int64_t *ids, const int64_t *positions,
                          const uint32_t *slots)
{
    const duck_host_model *m = &d->m;
    const uint32_t n_slots = m->slots > 1 ? m->slots : 1;
    d->next_layer = m->layers + 1;
    if (ntok == 0 || ntok > m->max_tokens)
        return fail(d, "%u tokens in one step: this decoder takes 1 to %u", ntok, m->max_tokens);
    const uint32_t half = m->head_dim / 2;
    for (uint32_t t = 0; t < ntok; t++) {
        if (ids[t] < 0 || ids[t] >= m->vocab)
            return fail(d, "token id %lld is outside the vocabulary of %u", (long long)ids[t], m->vocab);
        if (positions[t] < 0 || positions[t] >= m->max_len)
            return fail(d, "position %lld is beyond the KV cache (max_model_len=%u): make a longer cache",
                        (long long)positions[t], m->max_len);
        if (slots && slots[t] >= n_slots)
            return fail(d, "slot %u: the cache holds %u sequences", slots[t], n_slots);
        d->slot_offset[t] = slots ? (uint64_t)slots[t] * m->slot_stride : 0;
        memcpy(d->x + (size_t)t * m->hidden, m->embed + (size_t)ids[t] * m->hidden, sizeof(float) * m->hidden);
        duck_host_rope_table(positions[t], m->inv_freq, half, d->cos + (size_t)t * half, d->sin + (size_t)t * half);
        d->positions[t] = positions[t];
    }
    d->ntok = ntok;
    d->next_layer = 0;
    d->err[0] = 0;
    return 0;
}

static void add_bias(float *v, const float *b, uint32_t n)
{
    if (b)
        for (uint32_t i = 0; i < n; i++)
            v[i] += b[i];
}

/* Head unit u: query heads first, then key heads, then value heads. */
static void qkv_unit(void *ctx, uint32_t u, unsigned worker)
{
    (void)worker;
    duck_host_decoder *d = ctx;
    const duck_host_model *m = &d->m;
    const duck_host_layer *l = d->cur;
    const uint32_t D = m->head_dim, H = m->hidden, T = d->ntok, half = D / 2;
    const size_t qd = (size_t)m->heads * D, kvd = (size_t)m->kv_heads * D;
    if (u < m->heads) {
        float *q = d->q + (size_t)u * D;
        duck_host_gemm_rows(d->k, m->wtype, l->wq, H, u * D, D, H, T, d->h, H, q, qd);
        for (uint32_t t = 0; t < T; t++) {
            add_bias(q + t * qd, l->bq ? l->bq + (size_t)u * D : NULL, D);
            duck_host_rope(d->k, q + t * qd, 1, D, d->cos + t * half, d->sin + t * half, l->q_norm, m->eps);
        }
        return;
    }
    const int is_key = u < m->heads + m->kv_heads;
    const uint32_t j = is_key ? u - m->heads : u - m->heads - m->kv_heads;
    const float *b = is_key ? l->bk : l->bv;
    float *out = (is_key ? d->kn : d->vn) + (size_t)j * D;
    void *cache = is_key ? l->k_cache : l->v_cache;
    duck_host_gemm_rows(d->k, m->wtype, is_key ? l->wk : l->wv, H, j * D, D, H, T, d->h, H, out, kvd);
    for (uint32_t t = 0; t < T; t++) {
        float *v = out + t * kvd;
        add_bias(v, b ? b + (size_t)j * D : NULL, D);
        if (is_key)
            duck_host_rope(d->k, v, 1, D, d->cos + t * half, d->sin + t * half, l->k_norm, m->eps);
        const uint64_t at = d->slot_offset[t] + (uint64_t)d->positions[t] * m->pos_stride + j * m->head_stride;
        if (m->kv_type == DUCK_HOST_F16)
            d->k->to_half(v, D, (uint16_t *)cache + at);
        else
            memcpy((float *)cache + at, v, sizeof(float) * D);
    }
}

/* Item i: token i / units, the unit's query heads (attn_heads of them, one
 * kv head's or one), over positions 0..its own of its slot. */
static void attention_item(void *ctx, uint32_t i, unsigned worker)
{
    duck_host_decoder *d = ctx;
    const duck_host_model *m = &d->m;
    const uint32_t D = m->head_dim, nq = d->attn_heads, units = m->heads / nq, t = i / units;
    const uint32_t h = (i % units) * nq, kvh = h / (m->heads / m->kv_heads);
    const size_t qd = (size_t)m->heads * D, size = m->kv_type == DUCK_HOST_F16 ? 2u : 4u;
    const uint64_t at = d->slot_offset[t] + kvh * m->head_stride;
    duck_host_attend(d->k, m->kv_type, d->q + t * qd + (size_t)h * D, nq, (const char *)d->cur->k_cache + at * size,
                     (const char *)d->cur->v_cache + at * size, m->pos_stride, (uint32_t)d->positions[t] + 1, D,
                     d->scale, d->scores + (size_t)worker * m->max_len * (m->heads / m->kv_heads),
                     d->widen + (size_t)worker * DUCK_HOST_ATTN_ROWS * D, d->attn + t * qd + (size_t)h * D);
}

/* Item t: the residual add of the previous FFN's output, then the input norm. */
static void input_norm_item(void *ctx, uint32_t t, unsigned worker)
{
    (void)worker;
    duck_host_decoder *d = ctx;
    const uint32_t H = d->m.hidden;
    duck_host_add_rmsnorm(d->k, d->x + t * H, d->ffn_out ? d->ffn_out + t * H : NULL, d->cur->input_norm, H,
                          d->m.eps, d->h + t * H);
}

/* Item t: x + o_proj(attention) (the bias belongs to the projection), then the
 * post-attention norm into the FFN's input. */
static void post_norm_item(void *ctx, uint32_t t, unsigned worker)
{
    (void)worker;
    duck_host_decoder *d = ctx;
    const uint32_t H = d->m.hidden;
    float *x = d->x + t * H;
    const float *o = d->o + t * H, *bo = d->cur->bo;
    for (uint32_t i = 0; i < H; i++)
        x[i] += bo ? o[i] + bo[i] : o[i];
    duck_host_rmsnorm(d->k, x, d->cur->post_norm, H, d->m.eps, d->io.ffn_in + t * H);
}

static void topk_item(void *ctx, uint32_t t, unsigned worker)
{
    (void)worker;
    duck_host_decoder *d = ctx;
    const duck_host_model *m = &d->m;
    duck_host_topk_softmax(d->router + (size_t)t * m->n_experts, m->n_experts, m->topk, m->norm_topk,
                           d->io.expert_ids + t * m->topk, d->io.expert_weights + t * m->topk);
}

/* Item i: the i-th token that gets logits (rows[i], or i), normed into row i of h. */
static void final_norm_item(void *ctx, uint32_t i, unsigned worker)
{
    (void)worker;
    duck_host_decoder *d = ctx;
    const uint32_t H = d->m.hidden, t = d->rows ? d->rows[i] : i;
    duck_host_add_rmsnorm(d->k, d->x + t * H, d->ffn_out + t * H, d->m.final_norm, H, d->m.eps, d->h + i * H);
}

/* Item i: the index of row i's largest logit. */
static void argmax_item(void *ctx, uint32_t i, unsigned worker)
{
    (void)worker;
    duck_host_decoder *d = ctx;
    d->argmax[i] = (int32_t)d->k->argmax(d->logits + (size_t)i * d->m.vocab, d->m.vocab);
}

static duck_host_phase *add_phase(duck_host_phase *p, uint32_t n, duck_host_body_fn body, void *ctx)
{
    p->n = n;
    p->body = body;
    p->ctx = ctx;
    return p + 1;
}

int duck_host_layer_step(duck_host_decoder *d, uint32_t layer, const float *ffn_out)
{
    const duck_host_model *m = &d->m;
    if (d->next_layer > m->layers)
        return fail(d, "layer step %u without duck_host_begin", layer);
    if (layer != d->next_layer)
        return fail(d, "layer step %u out of order: layer %u comes next", layer, d->next_layer);
    if (layer > 0 && !ffn_out)
        return fail(d, "layer step %u needs layer %u's FFN output", layer, layer - 1);
    const duck_host_layer *l = d->cur = &d->layers[layer];
    const uint32_t H = m->hidden, T = d->ntok;
    d->ffn_out = layer ? ffn_out : NULL;
    d->gemm_o = (duck_host_gemm_job){d->k, l->wo, d->attn, d->o, H, m->heads * m->head_dim, T, m->wtype, 0};
    duck_host_phase *p = d->phases;
    p = add_phase(p, T, input_norm_item, d);
    p = add_phase(p, m->heads + 2 * m->kv_heads, qkv_unit, d);
    /* a kv head's query heads together (its keys and values read once, their
     * scores' FMA chains side by side) when that leaves every worker items enough */
    const uint32_t groups = m->heads / m->kv_heads, workers = d->pool ? duck_pool_size(d->pool) : 1;
    d->attn_heads = T * m->kv_heads >= 4 * workers ? groups : 1;
    p = add_phase(p, T * (m->heads / d->attn_heads), attention_item, d);
    duck_host_gemm_phase(&d->gemm_o, p++);
    p = add_phase(p, T, post_norm_item, d);
    if (l->router) {
        d->gemm_router = (duck_host_gemm_job){d->k, l->router, d->io.ffn_in, d->router, m->n_experts, H, T,
                                              DUCK_HOST_F32, 0};
        duck_host_gemm_phase(&d->gemm_router, p++);
        p = add_phase(p, T, topk_item, d);
    }
    duck_host_run_phases(d->pool, d->phases, (uint32_t)(p - d->phases));
    d->next_layer = layer + 1;
    return l->router != NULL;
}

int duck_host_finish(duck_host_decoder *d, const float *ffn_out, float *logits)
{
    return duck_host_finish_rows(d, ffn_out, NULL, d->ntok, logits);
}

int duck_host_finish_rows(duck_host_decoder *d, const float *ffn_out, const uint32_t *rows, uint32_t nrows,
                          float *logits)
{
    return duck_host_finish_argmax(d, ffn_out, rows, nrows, logits, NULL);
}

int duck_host_finish_argmax(duck_host_decoder *d, const float *ffn_out, const uint32_t *rows, uint32_t nrows,
                            float *logits, int32_t *argmax)
{
    const duck_host_model *m = &d->m;
    if (d->next_layer != m->layers)
        return fail(d, "finish before the last layer step (layer %u comes next of %u)", d->next_layer, m->layers);
    if (!ffn_out || !logits)
        return fail(d, "finish needs the last layer's FFN output and a logits buffer");
    if (nrows > d->ntok)
        return fail(d, "logits of %u tokens asked of a step of %u", nrows, d->ntok);
    for (uint32_t i = 0; rows && i < nrows; i++)
        if (rows[i] >= d->ntok || (i && rows[i] <= rows[i - 1]))
            return fail(d, "logit rows must be increasing token indices below %u (row %u is %u)", d->ntok, i,
                        rows[i]);
    d->ffn_out = ffn_out;
    d->rows = rows;
    d->logits = logits;
    d->argmax = argmax;
    d->gemm_lm_head = (duck_host_gemm_job){d->k, m->lm_head, d->h, logits, m->vocab, m->hidden, nrows, m->wtype, 0};
    duck_host_phase *p = add_phase(d->phases, nrows, final_norm_item, d);
    duck_host_gemm_phase(&d->gemm_lm_head, p++);
    if (argmax)
        p = add_phase(p, nrows, argmax_item, d);
    duck_host_run_phases(d->pool, d->phases, (uint32_t)(p - d->phases));
    d->next_layer = m->layers + 1;
    return 0;
}
