/* Forwards held for one kernel pass (WIRE_FWD_HOLD). A forward the message
 * bound cuts into requests (1024 tokens of hidden 7168 in bf16 go as 2 x 512)
 * would stream every expert slice once per request; the host flags all but
 * the last request of such a group, the duck keeps them here, and the last
 * one runs the kernel once over all their tokens (handlers.c answers each).
 * Any set of forwards of one layer may share a pass: each token's rows depend
 * on its own activation and routing only, so a request that joins another
 * group after a retransmission is still answered right. */
#include "duckfw.h"

#include <stdlib.h>
#include <string.h>

static int same_key(const msg_key *a, const msg_key *b)
{
    return a->peer.addr == b->peer.addr && a->peer.port == b->peer.port && a->session == b->session &&
           a->sequence == b->sequence && a->type == b->type;
}

void hold_clear(duck_held *hd)
{
    for (uint32_t i = 0; i < hd->n; i++) {
        free(hd->f[i].payload);
        hd->f[i].payload = NULL;
    }
    hd->n = hd->ntok = 0;
    hd->bytes = 0;
}

void hold_free(duck_held *hd)
{
    hold_clear(hd);
    free(hd->scratch);
    hd->scratch = NULL;
    hd->scratch_cap = 0;
}

int hold_has(const duck_held *hd, const msg_key *k)
{
    for (uint32_t i = 0; i < hd->n; i++)
        if (same_key(&hd->f[i].key, k))
            return 1;
    return 0;
}

int hold_fits(const duck_held *hd, uint32_t session, const wire_forward *f, uint32_t len)
{
    if (!hd->n)
        return f->ntok <= DUCK_MAX_TOKENS && len <= HOLD_BUDGET;
    const wire_forward *g = &hd->f[0].f;
    return hd->f[0].key.session == session && g->layer == f->layer && g->topk == f->topk &&
           g->x_dtype == f->x_dtype && g->y_dtype == f->y_dtype && g->hidden == f->hidden &&
           hd->n < WIRE_HOLD_MAX && hd->ntok + f->ntok <= DUCK_MAX_TOKENS && hd->bytes + len <= HOLD_BUDGET;
}

int hold_add(duck_held *hd, const msg_key *k, const duck_peer *from, const wire_header *h, const wire_forward *f,
             const uint8_t *p, uint32_t len)
{
    if (hd->n >= WIRE_HOLD_MAX)
        return -1;
    uint8_t *copy = malloc(len ? len : 1);
    if (!copy)
        return -1;
    memcpy(copy, p, len);
    hd->f[hd->n] = (held_forward){*k, *from, *h, *f, copy, len};
    hd->n++;
    hd->ntok += f->ntok;
    hd->bytes += len;
    return 0;
}

static uint64_t align64(uint64_t n) { return (n + 63) & ~(uint64_t)63; }

/* One part's ids, weights and activations appended at row `row` of the pass. */
static void append(const wire_forward *f, const uint8_t *p, uint32_t row, uint32_t topk, size_t xrow,
                   int32_t *ids, float *w, uint8_t *x)
{
    size_t slots = (size_t)f->ntok * topk;
    if (slots) {
        memcpy(ids + (size_t)row * topk, p + sizeof *f, 4 * slots);
        memcpy(w + (size_t)row * topk, p + sizeof *f + 4 * slots, 4 * slots);
    }
    if (f->ntok)
        memcpy(x + row * xrow, p + sizeof *f + 8 * slots, f->ntok * xrow);
}

int hold_gather(duck_held *hd, const wire_forward *f, const uint8_t *p, duck_moe_args *a)
{
    const wire_forward *first = hd->n ? &hd->f[0].f : f;
    uint32_t ntok = hd->ntok + (p ? f->ntok : 0), topk = first->topk;
    size_t xrow = (size_t)first->hidden * wire_dtype_bytes(first->x_dtype);
    size_t yrow = (size_t)first->hidden * wire_dtype_bytes(first->y_dtype);
    uint64_t ids_at = 0, w_at = align64(4ull * ntok * topk), x_at = w_at + align64(4ull * ntok * topk);
    uint64_t y_at = x_at + align64((uint64_t)ntok * xrow), need = y_at + align64((uint64_t)ntok * yrow) + 64;
    if (need > hd->scratch_cap) {
        uint8_t *s = NULL;
        if (posix_memalign((void **)&s, 64, need) != 0)
            return -1;
        free(hd->scratch);
        hd->scratch = s;
        hd->scratch_cap = need;
    }
    int32_t *ids = (int32_t *)(hd->scratch + ids_at);
    float *w = (float *)(hd->scratch + w_at);
    uint8_t *x = hd->scratch + x_at;
    uint32_t row = 0;
    for (uint32_t i = 0; i < hd->n; i++) {
        append(&hd->f[i].f, hd->f[i].payload, row, topk, xrow, ids, w, x);
        row += hd->f[i].f.ntok;
    }
    if (p)
        append(f, p, row, topk, xrow, ids, w, x);
    memset(a, 0, sizeof *a);
    a->ntok = ntok;
    a->topk = topk;
    a->hidden = first->hidden;
    a->expert_ids = ids;
    a->expert_weights = w;
    a->x = x;
    a->x_dtype = first->x_dtype == WIRE_X_BF16 ? DUCK_DT_BF16 : DUCK_DT_F32;
    a->y_dtype = first->y_dtype == WIRE_DT_BF16 ? DUCK_DT_BF16 : DUCK_DT_F32;
    a->y = hd->scratch + y_at;
    return 0;
}
