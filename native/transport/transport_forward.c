/* One FFN layer over the fleet, for any number of tokens: the tokens are cut
 * into requests as large as the ducks, the datagram sizes and the receive
 * buffer allow (a duck streams each expert once per request), and up to
 * `pipeline` requests are in flight per duck: the next waits in the duck's
 * socket while it computes, and the host sums one request's partials while
 * the ducks compute the next. Each request goes to every duck (sealed once
 * per datagram size); each partial is added into an fp32 sum as soon as it
 * and the partials of all lower-numbered ducks are in. Holding an early
 * partial until its turn keeps the order of the additions, and so the bits
 * of the sum, the same whatever order the replies arrive in.
 *
 * Slice d is duck d's, unless the duck is lost (transport_lost.c): then a
 * replica duck computes it (the same request with its layer moved by the
 * replica offset) or this host does, through the cover, which writes the
 * reply the duck would have sent into the call (a local call: not sent). A
 * call that stays silent past its lost deadline makes the forward start
 * again with that duck lost; its partials then come from elsewhere, in the
 * same order. */
#define _GNU_SOURCE
#include "transport_impl.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

_Static_assert(DUCK_DT_F32 == WIRE_DT_F32 && DUCK_DT_BF16 == WIRE_DT_BF16, "transport and wire dtypes differ");

#define MAX_FORWARD_TOKENS (1u << 24)

static int reserve(uint8_t **buf, size_t *cap, size_t need)
{
    if (need <= *cap)
        return 0;
    uint8_t *p = NULL;
    if (posix_memalign((void **)&p, 64, need) != 0)
        return -1;
    free(*buf);
    *buf = p;
    *cap = need;
    return 0;
}

static int fail(duck_forward_result *res, int32_t duck, int32_t result, int32_t status, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static int fail(duck_forward_result *res, int32_t duck, int32_t result, int32_t status, const char *fmt, ...)
{
    res->failed_duck = duck;
    res->result = result;
    res->duck_status = status;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(res->message, sizeof res->message, fmt, ap);
    va_end(ap);
    return result;
}

/* --- requests in flight and their sums ------------------------------------ */

typedef struct fwd_sum {
    uint32_t req;                 /* the request this slot carries */
    uint32_t t0, ntok;            /* its tokens */
    float *acc;                   /* its fp32 sum: rows t0.. of y when y is fp32, else the slot's buffer */
    uint32_t next;                /* the duck whose partial is added next */
    int empty, complete;
} fwd_sum;

typedef struct fwd_run {
    const duck_forward_args *a;
    duck_forward_result *res;
    uint32_t nreq, next_req, done_reqs;
    int stopped;                  /* a reply did not check: no further requests */
    fwd_sum sums[DUCK_PIPELINE_MAX];
} fwd_run;

/* Slice d of a request computed here: the duck's reply, written into the call by the cover. */
static void host_slice(duck_transport *t, fwd_run *run, duck_call *c, uint32_t d, uint32_t t0, uint32_t ntok)
{
    uint64_t start = tr_now_ns();
    c->local = 1;
    c->reply_len = t->cover.forward(t->cover.ctx, d, run->a, t0, ntok, c->reply, c->reply_cap);
    c->result = c->reply_len ? DUCK_T_OK : DUCK_T_EDUCK;
    run->res->host_ns += tr_now_ns() - start;
    run->res->host_slices++;
}

/* Request `req` into pipeline slot `slot`: its payload, and the call of each slice. */
static void fill_slot(duck_transport *t, fwd_run *run, uint32_t slot, uint32_t req)
{
    const duck_forward_args *a = run->a;
    uint32_t nd = t->cfg.n_ducks, n = run->res->request_tokens;
    uint32_t t0 = req * n, ntok = a->ntok - t0 < n ? a->ntok - t0 : n;
    size_t slots = (size_t)ntok * a->topk, xrow = (size_t)a->hidden * wire_dtype_bytes(a->x_dtype);
    uint8_t *p = t->fwd[slot].payload;
    /* reply_mtu is written per duck when the request is sealed */
    /* a group's requests but its last are held by the ducks, then run with it in one pass */
    uint32_t g = run->res->group, first = req - req % g, last = first + g < run->nreq ? first + g - 1 : run->nreq - 1;
    uint32_t group_end = (last + 1) * n < a->ntok ? (last + 1) * n : a->ntok;
    wire_forward f = {a->layer, (uint16_t)ntok, (uint8_t)a->topk, (uint8_t)a->x_dtype, a->hidden,
                      (uint8_t)a->y_dtype, req < last ? WIRE_FWD_HOLD : 0, 0};
    memcpy(p, &f, sizeof f);
    if (slots) {
        memcpy(p + sizeof f, a->expert_ids + (size_t)t0 * a->topk, 4 * slots);
        memcpy(p + sizeof f + 4 * slots, a->expert_weights + (size_t)t0 * a->topk, 4 * slots);
    }
    memcpy(p + sizeof f + 8 * slots, (const uint8_t *)a->x + t0 * xrow, ntok * xrow);
    fwd_sum *sum = &run->sums[slot];
    size_t stride = (size_t)n * a->hidden;
    *sum = (fwd_sum){req, t0, ntok,
                     a->y_dtype == DUCK_DT_F32 ? (float *)a->y + (size_t)t0 * a->hidden : t->acc + slot * stride,
                     0, 1, 0};
    int replica_filled = 0;
    for (uint32_t d = 0; d < nd; d++) {
        duck_call *c = &t->fcalls[slot * nd + d];
        int32_t route = t->route ? t->route[d] : (int32_t)d;
        memset(c, 0, sizeof *c);
        c->duck = route >= 0 ? (uint32_t)route : d;
        c->type = WIRE_T_FORWARD;
        c->session = a->session;
        c->payload = p;
        c->payload_len = (uint32_t)tr_request_bytes(a, ntok);
        c->reply = t->replies[slot * nd + d];
        c->reply_cap = t->reply_caps[slot * nd + d];
        if (route == DUCK_ROUTE_HOST) {
            host_slice(t, run, c, d, t0, ntok);
            continue;
        }
        if (route != (int32_t)d) {
            uint8_t *rp = t->fwd[slot].replica_payload;
            if (!replica_filled) {
                uint32_t layer = a->layer + t->cover.replica_layer_offset;
                memcpy(rp, p, c->payload_len);
                memcpy(rp + offsetof(wire_forward, layer), &layer, sizeof layer);
                replica_filled = 1;
            }
            c->payload = rp;
            run->res->replica_slices++;
        }
        c->work_ns = tr_work_ns(t, c->duck, group_end - first * n);   /* its pass's tokens */
    }
}

/* Whether a complete reply is a good answer to its request; *partial is
 * its partial, NULL for an all-zero one (R_ZERO). */
static int reply_ok(const duck_transport *t, const duck_forward_args *a, const fwd_sum *sum, const duck_call *c,
                    uint32_t slice, const uint8_t **partial)
{
    /* a replica answers for the layer it holds the slice as */
    uint32_t layer = c->duck == slice || c->local ? a->layer : a->layer + t->cover.replica_layer_offset;
    wire_reply_head head;
    wire_forward_reply fr;
    if (c->reply_len < TR_REPLY_HEAD)
        return 0;
    memcpy(&head, c->reply, sizeof head);
    memcpy(&fr, (const uint8_t *)c->reply + sizeof head, sizeof fr);
    int zero = (head.flags & WIRE_R_ZERO) != 0;
    if (head.status != WIRE_OK || c->reply_len != (zero ? TR_REPLY_HEAD : tr_reply_bytes(a, sum->ntok)) ||
        fr.layer != layer || fr.ntok != sum->ntok || fr.hidden != a->hidden || fr.y_dtype != a->y_dtype)
        return 0;
    *partial = zero ? NULL : (const uint8_t *)c->reply + TR_REPLY_HEAD;
    return 1;
}

/* A partial added into a request's fp32 sum, a block of elements per item
 * (on the helper threads for a prefill chunk's megabytes). The first partial
 * is copied; each element's additions come in duck order whoever runs it. */
#define SUM_BLOCK 16384
typedef struct sum_job {
    float *acc;
    const uint8_t *src;           /* the partial; NULL: the fp32 sum into y as bf16 */
    uint16_t *bf16_out;
    size_t n;
    int bf16, first;
} sum_job;

static void sum_block(void *ctx, uint32_t item)
{
    const sum_job *j = ctx;
    size_t b = (size_t)item * SUM_BLOCK, e = b + SUM_BLOCK < j->n ? b + SUM_BLOCK : j->n;
    float *acc = j->acc;
    if (!j->src) {
        wire_f32_to_bf16_n(acc + b, j->bf16_out + b, e - b);
    } else if (j->bf16) {
        const uint16_t *src = (const uint16_t *)j->src;
        if (j->first)
            for (size_t i = b; i < e; i++)
                acc[i] = wire_bf16_to_f32(src[i]);
        else
            for (size_t i = b; i < e; i++)
                acc[i] += wire_bf16_to_f32(src[i]);
    } else {
        const float *src = (const float *)j->src;
        if (j->first)
            memcpy(acc + b, src + b, (e - b) * 4);
        else
            for (size_t i = b; i < e; i++)
                acc[i] += src[i];
    }
}

static void sum_blocks(duck_transport *t, sum_job *j)
{
    tr_parallel(t, (uint32_t)((j->n + SUM_BLOCK - 1) / SUM_BLOCK), j->n * 4, sum_block, j);
}

static void add_partial(duck_transport *t, const duck_forward_args *a, fwd_sum *sum, const uint8_t *p)
{
    sum_job j = {sum->acc, p, NULL, (size_t)sum->ntok * a->hidden, a->y_dtype == DUCK_DT_BF16, sum->empty};
    sum_blocks(t, &j);
    sum->empty = 0;
}

/* Every duck's partial is in: y's rows of the request, and its counters. */
static void finish_request(duck_transport *t, fwd_run *run, uint32_t slot)
{
    const duck_forward_args *a = run->a;
    duck_forward_result *res = run->res;
    fwd_sum *sum = &run->sums[slot];
    size_t count = (size_t)sum->ntok * a->hidden;
    if (sum->empty)
        memset(sum->acc, 0, count * 4);
    if (a->y_dtype == DUCK_DT_BF16) {
        sum_job j = {sum->acc, NULL, (uint16_t *)a->y + (size_t)sum->t0 * a->hidden, count, 1, 0};
        sum_blocks(t, &j);
    }
    uint32_t kernel_us = 0, nd = t->cfg.n_ducks;
    for (uint32_t d = 0; d < nd; d++) {
        const duck_call *c = &t->fcalls[slot * nd + d];
        wire_forward_reply fr;
        memcpy(&fr, (const uint8_t *)c->reply + sizeof(wire_reply_head), sizeof fr);
        res->bytes_streamed += fr.bytes_streamed;
        res->retransmits += c->retransmits;
        res->kernel_us_max = fr.kernel_us > res->kernel_us_max ? fr.kernel_us : res->kernel_us_max;
        uint32_t share = fr.group_ntok > fr.ntok ? (uint32_t)((uint64_t)fr.kernel_us * fr.ntok / fr.group_ntok)
                                                 : fr.kernel_us;   /* of a pass over held requests: by tokens */
        kernel_us = share > kernel_us ? share : kernel_us;
        res->wake_ns_max = fr.wake_ns > res->wake_ns_max ? fr.wake_ns : res->wake_ns_max;
    }
    res->kernel_us_sum += kernel_us;
    sum->complete = 1;
    run->done_reqs++;
}

/* tr_run's completion hook: adds every partial of the call's request whose
 * turn has come; when the request is summed, the slot takes the next
 * request. A reply that does not check stops the adding and the pipeline;
 * the forward then fails on it. */
static void on_reply(duck_transport *t, duck_call *calls, uint32_t i, void *ctx)
{
    fwd_run *run = ctx;
    uint32_t nd = t->cfg.n_ducks, slot = i / nd;
    fwd_sum *sum = &run->sums[slot];
    while (sum->next < nd && t->st[slot * nd + sum->next].done && calls[slot * nd + sum->next].result == DUCK_T_OK) {
        const uint8_t *p;
        if (!reply_ok(t, run->a, sum, &calls[slot * nd + sum->next], sum->next, &p)) {
            run->stopped = 1;
            return;
        }
        if (p)
            add_partial(t, run->a, sum, p);
        sum->next++;
    }
    if (sum->next < nd || sum->complete)
        return;
    finish_request(t, run, slot);
    if (run->stopped || run->next_req >= run->nreq)
        return;
    fill_slot(t, run, slot, run->next_req++);
    if (tr_restart(t, calls, slot * nd, nd) != 0)
        run->stopped = 1;
}

/* Why the requests of a slot did not all complete: the first duck (in duck
 * order) whose call failed or whose reply does not check; DUCK_T_OK if none. */
static int slot_failure(duck_transport *t, const fwd_run *run, uint32_t slot, duck_forward_result *res)
{
    const duck_forward_args *a = run->a;
    const fwd_sum *sum = &run->sums[slot];
    uint32_t nd = t->cfg.n_ducks;
    for (uint32_t d = 0; d < nd; d++) {
        const duck_call *c = &t->fcalls[slot * nd + d];
        if (c->local && c->result != DUCK_T_OK)
            return fail(res, (int32_t)d, DUCK_T_ECOVER, 0, "this host could not compute duck %u's slice of layer %u "
                        "(an expert id out of range, or out of memory)", d, a->layer);
        if (c->result == DUCK_T_ETIMEOUT)
            return fail(res, (int32_t)c->duck, c->result, 0, "duck %u did not answer forward of layer %u within "
                        "%u ms (%u retransmits, datagrams of %u bytes)", c->duck, a->layer,
                        (uint32_t)(tr_lost_ns(t, c->duck, c->work_ns) / 1000000u), c->retransmits,
                        t->link[c->duck].mtu);
        if (c->result == DUCK_T_ENORUN)
            return fail(res, (int32_t)c->duck, c->result, 0, "duck %u holds no run of this host (it restarted) at "
                        "forward of layer %u: a run and the session must be opened on it again", c->duck, a->layer);
        if (c->result != DUCK_T_OK)
            return fail(res, (int32_t)c->duck, c->result, 0, "duck %u: transport error %d on forward of layer %u",
                        c->duck, c->result, a->layer);
        wire_reply_head head;
        memcpy(&head, c->reply, sizeof head);
        if (head.status != WIRE_OK) {
            uint32_t n = c->reply_len - (uint32_t)sizeof head;
            n = n > WIRE_MAX_ERROR_TEXT ? WIRE_MAX_ERROR_TEXT : n;
            return fail(res, (int32_t)c->duck, DUCK_T_EDUCK, head.status, "duck %u refused forward of layer %u: "
                        "%.*s", c->duck, a->layer, (int)n, (const char *)c->reply + sizeof head);
        }
        const uint8_t *p;
        if (!reply_ok(t, a, sum, c, d, &p)) {
            wire_forward_reply fr = {0};
            if (c->reply_len >= TR_REPLY_HEAD)
                memcpy(&fr, (const uint8_t *)c->reply + sizeof head, sizeof fr);
            return fail(res, (int32_t)c->duck, DUCK_T_EDUCK, WIRE_E_MALFORMED, "duck %u: forward reply of %u bytes "
                        "for layer %u, %u tokens, hidden %u, dtype %u does not match the request (layer %u, %u tokens, "
                        "hidden %u, dtype %u)", c->duck, c->reply_len, fr.layer, fr.ntok, fr.hidden, fr.y_dtype, a->layer,
                        sum->ntok, a->hidden, a->y_dtype);
        }
    }
    return DUCK_T_OK;
}

/* Buffers for w slots of n-token requests: payloads, replies, calls, the bf16 case's sums. */
static int reserve_slots(duck_transport *t, const duck_forward_args *a, uint32_t w, uint32_t n)
{
    uint32_t nd = t->cfg.n_ducks;
    if (w > t->fwd_slots) {
        fwd_slot *f = realloc(t->fwd, w * sizeof *f);
        uint8_t **r = f ? realloc(t->replies, (size_t)w * nd * sizeof *r) : NULL;
        if (r)
            t->replies = r;
        uint32_t *rc = r ? realloc(t->reply_caps, (size_t)w * nd * sizeof *rc) : NULL;
        if (rc)
            t->reply_caps = rc;
        duck_call *fc = rc ? realloc(t->fcalls, (size_t)w * nd * sizeof *fc) : NULL;
        if (f)
            t->fwd = f;
        if (!fc)
            return -1;
        t->fcalls = fc;
        memset(t->fwd + t->fwd_slots, 0, (w - t->fwd_slots) * sizeof *f);
        memset(t->replies + (size_t)t->fwd_slots * nd, 0, (size_t)(w - t->fwd_slots) * nd * sizeof *r);
        memset(t->reply_caps + (size_t)t->fwd_slots * nd, 0, (size_t)(w - t->fwd_slots) * nd * sizeof *rc);
        t->fwd_slots = w;
    }
    for (uint32_t s = 0; s < w; s++) {
        if (reserve(&t->fwd[s].payload, &t->fwd[s].cap, tr_request_bytes(a, n)) != 0)
            return -1;
        if (t->route && reserve(&t->fwd[s].replica_payload, &t->fwd[s].replica_cap, tr_request_bytes(a, n)) != 0)
            return -1;
        for (uint32_t d = 0; d < nd; d++) {
            size_t cap = t->reply_caps[s * nd + d];
            if (reserve(&t->replies[s * nd + d], &cap, tr_reply_bytes(a, n)) != 0)
                return -1;
            t->reply_caps[s * nd + d] = (uint32_t)cap;
        }
    }
    if (a->y_dtype != DUCK_DT_F32) {
        size_t cap = t->acc_cap * 4;
        if (reserve((uint8_t **)&t->acc, &cap, (size_t)w * n * a->hidden * 4) != 0)
            return -1;
        t->acc_cap = cap / 4;
    }
    return 0;
}

/* Every slice on this host (every duck lost): the requests one after the other, no calls. */
static void forward_on_host(duck_transport *t, fwd_run *run)
{
    uint32_t nd = t->cfg.n_ducks;
    for (uint32_t req = 0; req < run->nreq; req++) {
        fill_slot(t, run, 0, req);
        fwd_sum *sum = &run->sums[0];
        for (uint32_t d = 0; d < nd; d++) {
            const uint8_t *p;
            if (t->fcalls[d].result != DUCK_T_OK || !reply_ok(t, run->a, sum, &t->fcalls[d], d, &p))
                return;
            if (p)
                add_partial(t, run->a, sum, p);
        }
        finish_request(t, run, 0);
    }
}

static int all_on_host(const duck_transport *t)
{
    for (uint32_t d = 0; t->route && d < t->cfg.n_ducks; d++)
        if (t->route[d] != DUCK_ROUTE_HOST)
            return 0;
    return t->route != NULL;
}

static int forward_once(duck_transport *t, const duck_forward_args *a, duck_forward_result *res);

int duck_transport_forward(duck_transport *t, const duck_forward_args *a, duck_forward_result *res)
{
    memset(res, 0, sizeof *res);
    res->failed_duck = -1;
    for (;;) {
        res->lost_new += tr_take_hints(t);
        for (uint32_t d = 0; t->route && d < t->cfg.n_ducks; d++)
            if (t->route[d] == DUCK_ROUTE_NONE)
                return fail(res, (int32_t)d, DUCK_T_ECOVER, 0, "%s", t->cover_err);
        res->failed_duck = -1;
        res->result = res->duck_status = 0;
        res->message[0] = 0;
        int rc = forward_once(t, a, res);
        if ((rc != DUCK_T_ETIMEOUT && rc != DUCK_T_EDUCK && rc != DUCK_T_ENORUN) || !t->cover.forward)
            return rc;   /* done, or failed before any call was made */
        uint32_t lost = tr_lose_failed(t, t->fcalls, res->pipeline * t->cfg.n_ducks);
        if (!lost)
            return rc;
        res->lost_new += lost;   /* and again, their slices elsewhere */
    }
}

static int forward_once(duck_transport *t, const duck_forward_args *a, duck_forward_result *res)
{
    if (!a || a->ntok > MAX_FORWARD_TOKENS || a->topk > WIRE_MAX_TOPK || a->hidden == 0 || a->hidden > (1u << 16) ||
        a->x_dtype > DUCK_DT_BF16 || a->y_dtype > DUCK_DT_BF16 ||
        (a->ntok && (!a->x || !a->y || (a->topk && (!a->expert_ids || !a->expert_weights)))))
        return fail(res, -1, DUCK_T_EARG, 0, "forward: ntok <= %u, topk <= %d, hidden 1..65536, dtypes 0 (fp32) or "
                    "1 (bf16) and buffers required", MAX_FORWARD_TOKENS, WIRE_MAX_TOPK);
    if (a->ntok == 0)
        return DUCK_T_OK;
    duck_transport_plan(t, a, res);
    uint32_t nd = t->cfg.n_ducks, w = res->pipeline;
    if (tr_request_bytes(a, res->request_tokens) > WIRE_MAX_MESSAGE || tr_reply_bytes(a, res->request_tokens) > WIRE_MAX_MESSAGE)
        return fail(res, -1, DUCK_T_EARG, 0, "forward of hidden %u with %u experts per token does not fit the "
                    "%u-byte message bound even for one token", a->hidden, a->topk, WIRE_MAX_MESSAGE);
    if (reserve_slots(t, a, w, res->request_tokens) != 0)
        return fail(res, -1, DUCK_T_EARG, 0, "out of memory for %u requests of %u tokens in flight", w,
                    res->request_tokens);
    fwd_run run = {a, res, res->requests, w, 0, 0, {{0}}};
    if (all_on_host(t)) {
        forward_on_host(t, &run);
        return run.done_reqs == run.nreq ? DUCK_T_OK : slot_failure(t, &run, 0, res);
    }
    for (uint32_t s = 0; s < w; s++)
        fill_slot(t, &run, s, s);
    uint64_t fallbacks = t->stats.mtu_fallbacks;
    tr_run(t, t->fcalls, w * nd, on_reply, &run);
    res->mtu_fallbacks = (uint32_t)(t->stats.mtu_fallbacks - fallbacks);
    if (run.done_reqs == run.nreq)
        return DUCK_T_OK;
    for (uint32_t s = 0; s < w; s++) {
        if (run.sums[s].complete)
            continue;
        int rc = slot_failure(t, &run, s, res);
        if (rc != DUCK_T_OK)
            return rc;
    }
    return fail(res, -1, DUCK_T_EARG, 0, "forward of layer %u: %u of %u requests done, none failed", a->layer,
                run.done_reqs, run.nreq);
}
