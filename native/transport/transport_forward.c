/* One FFN layer over the fleet: the same request to every duck (sealed once
 * per datagram size), each partial added into an fp32 sum as soon as it and
 * the partials of all lower-numbered ducks are in. Holding an early partial
 * until its turn keeps the order of the additions, and so the bits of the
 * sum, the same whatever order the replies arrive in; most of the adding
 * still overlaps the wait for the slowest duck. */
#define _GNU_SOURCE
#include "transport_impl.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

_Static_assert(DUCK_DT_F32 == WIRE_DT_F32 && DUCK_DT_BF16 == WIRE_DT_BF16, "transport and wire dtypes differ");

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

/* The sum in progress. */
typedef struct fwd_sum {
    const duck_forward_args *a;
    size_t count;                 /* ntok * hidden */
    size_t partial_bytes;         /* of one duck's partial on the wire */
    float *acc;                   /* a->y when y is fp32 */
    uint32_t next;                /* the duck whose partial is added next */
    int empty;                    /* nothing added yet */
} fwd_sum;

/* Whether a complete reply is a good answer to the request; *partial is
 * its partial, NULL for an all-zero one (R_ZERO). */
static int reply_ok(const fwd_sum *sum, const duck_call *c, const uint8_t **partial)
{
    wire_reply_head head;
    wire_forward_reply fr;
    if (c->reply_len < sizeof head + sizeof fr)
        return 0;
    memcpy(&head, c->reply, sizeof head);
    memcpy(&fr, (const uint8_t *)c->reply + sizeof head, sizeof fr);
    int zero = (head.flags & WIRE_R_ZERO) != 0;
    if (head.status != WIRE_OK || c->reply_len != sizeof head + sizeof fr + (zero ? 0 : sum->partial_bytes) ||
        fr.layer != sum->a->layer || fr.ntok != sum->a->ntok || fr.hidden != sum->a->hidden ||
        fr.y_dtype != sum->a->y_dtype)
        return 0;
    *partial = zero ? NULL : (const uint8_t *)c->reply + sizeof head + sizeof fr;
    return 1;
}

static void add_partial(fwd_sum *sum, const uint8_t *p)
{
    float *acc = sum->acc;
    size_t n = sum->count;
    if (sum->a->y_dtype == DUCK_DT_BF16) {
        const uint16_t *src = (const uint16_t *)p;
        if (sum->empty)
            for (size_t i = 0; i < n; i++)
                acc[i] = wire_bf16_to_f32(src[i]);
        else
            for (size_t i = 0; i < n; i++)
                acc[i] += wire_bf16_to_f32(src[i]);
    } else {
        const float *src = (const float *)p;
        if (sum->empty)
            memcpy(acc, src, n * 4);
        else
            for (size_t i = 0; i < n; i++)
                acc[i] += src[i];
    }
    sum->empty = 0;
}

/* tr_run's completion hook: adds every partial whose turn has come. A reply
 * that does not check stops the adding; the forward then fails on it. */
static void on_reply(duck_transport *t, duck_call *calls, uint32_t i, void *ctx)
{
    fwd_sum *sum = ctx;
    (void)i;
    while (sum->next < t->cfg.n_ducks && t->st[sum->next].done && calls[sum->next].result == DUCK_T_OK) {
        const uint8_t *p;
        if (!reply_ok(sum, &calls[sum->next], &p))
            return;
        if (p)
            add_partial(sum, p);
        sum->next++;
    }
}

/* The first duck (in duck order) whose call failed or whose reply does not
 * check, as the forward's result; DUCK_T_OK when there is none. */
static int check_replies(duck_transport *t, const fwd_sum *sum, duck_forward_result *res)
{
    const duck_forward_args *a = sum->a;
    for (uint32_t d = 0; d < t->cfg.n_ducks; d++) {
        const duck_call *c = &t->fcalls[d];
        if (c->result == DUCK_T_ETIMEOUT)
            return fail(res, (int32_t)d, c->result, 0, "duck %u did not answer forward of layer %u within %u ms "
                        "(%u retransmits, datagrams of %u bytes)", d, a->layer, t->cfg.deadline_us / 1000,
                        c->retransmits, t->link[d].mtu);
        if (c->result != DUCK_T_OK)
            return fail(res, (int32_t)d, c->result, 0, "duck %u: transport error %d on forward of layer %u", d,
                        c->result, a->layer);
        wire_reply_head head;
        memcpy(&head, c->reply, sizeof head);
        if (head.status != WIRE_OK) {
            uint32_t n = c->reply_len - (uint32_t)sizeof head;
            n = n > WIRE_MAX_ERROR_TEXT ? WIRE_MAX_ERROR_TEXT : n;
            return fail(res, (int32_t)d, DUCK_T_EDUCK, head.status, "duck %u refused forward of layer %u: %.*s", d,
                        a->layer, (int)n, (const char *)c->reply + sizeof head);
        }
        const uint8_t *p;
        if (!reply_ok(sum, c, &p)) {
            wire_forward_reply fr = {0};
            if (c->reply_len >= sizeof head + sizeof fr)
                memcpy(&fr, (const uint8_t *)c->reply + sizeof head, sizeof fr);
            return fail(res, (int32_t)d, DUCK_T_EDUCK, WIRE_E_MALFORMED, "duck %u: forward reply of %u bytes for "
                        "layer %u, %u tokens, hidden %u, dtype %u does not match the request (layer %u, %u tokens, "
                        "hidden %u, dtype %u)", d, c->reply_len, fr.layer, fr.ntok, fr.hidden, fr.y_dtype, a->layer,
                        a->ntok, a->hidden, a->y_dtype);
        }
        wire_forward_reply fr;
        memcpy(&fr, (const uint8_t *)c->reply + sizeof head, sizeof fr);
        res->bytes_streamed += fr.bytes_streamed;
        if (fr.kernel_us > res->kernel_us_max)
            res->kernel_us_max = fr.kernel_us;
        if (fr.wake_ns > res->wake_ns_max)
            res->wake_ns_max = fr.wake_ns;
    }
    return DUCK_T_OK;
}

int duck_transport_forward(duck_transport *t, const duck_forward_args *a, duck_forward_result *res)
{
    memset(res, 0, sizeof *res);
    res->failed_duck = -1;
    if (!a || a->ntok > WIRE_MAX_TOKENS || a->topk > WIRE_MAX_TOPK || a->hidden == 0 || a->hidden > (1u << 16) ||
        a->x_dtype > DUCK_DT_BF16 || a->y_dtype > DUCK_DT_BF16 ||
        (a->ntok && (!a->x || !a->y || (a->topk && (!a->expert_ids || !a->expert_weights)))))
        return fail(res, -1, DUCK_T_EARG, 0, "forward: ntok <= %d, topk <= %d, hidden 1..65536, dtypes 0 (fp32) or "
                    "1 (bf16) and buffers required", WIRE_MAX_TOKENS, WIRE_MAX_TOPK);
    size_t slots = (size_t)a->ntok * a->topk, count = (size_t)a->ntok * a->hidden;
    size_t xbytes = count * wire_dtype_bytes(a->x_dtype), partial = count * wire_dtype_bytes(a->y_dtype);
    size_t len = sizeof(wire_forward) + 8 * slots + xbytes;
    size_t rcap = sizeof(wire_reply_head) + sizeof(wire_forward_reply) + partial;
    if (len > WIRE_MAX_MESSAGE || rcap > WIRE_MAX_MESSAGE)
        return fail(res, -1, DUCK_T_EARG, 0, "forward of %u tokens x %u hidden exceeds the %u-byte message bound",
                    a->ntok, a->hidden, WIRE_MAX_MESSAGE);
    if (reserve(&t->fwd, &t->fwd_cap, len) != 0)
        return fail(res, -1, DUCK_T_EARG, 0, "out of memory");
    /* reply_mtu is written per duck when the request is sealed */
    wire_forward f = {a->layer, (uint16_t)a->ntok, (uint8_t)a->topk, (uint8_t)a->x_dtype, a->hidden,
                      (uint8_t)a->y_dtype, 0, 0};
    memcpy(t->fwd, &f, sizeof f);
    if (slots) {
        memcpy(t->fwd + sizeof f, a->expert_ids, 4 * slots);
        memcpy(t->fwd + sizeof f + 4 * slots, a->expert_weights, 4 * slots);
    }
    if (a->ntok)
        memcpy(t->fwd + sizeof f + 8 * slots, a->x, xbytes);
    fwd_sum sum = {a, count, partial, (float *)a->y, 0, 1};
    if (a->y_dtype != DUCK_DT_F32) {
        size_t cap = t->acc_cap * 4;
        if (reserve((uint8_t **)&t->acc, &cap, count * 4) != 0)
            return fail(res, -1, DUCK_T_EARG, 0, "out of memory");
        t->acc_cap = cap / 4;
        sum.acc = t->acc;
    }
    uint32_t nd = t->cfg.n_ducks;
    for (uint32_t d = 0; d < nd; d++) {
        size_t cap = t->reply_caps[d];
        if (reserve(&t->replies[d], &cap, rcap) != 0)
            return fail(res, (int32_t)d, DUCK_T_EARG, 0, "out of memory");
        t->reply_caps[d] = (uint32_t)cap;
        duck_call *c = &t->fcalls[d];
        memset(c, 0, sizeof *c);
        c->duck = d;
        c->type = WIRE_T_FORWARD;
        c->session = a->session;
        c->payload = t->fwd;
        c->payload_len = (uint32_t)len;
        c->reply = t->replies[d];
        c->reply_cap = (uint32_t)cap;
    }
    uint64_t fallbacks = t->stats.mtu_fallbacks;
    tr_run(t, t->fcalls, nd, on_reply, &sum);
    res->mtu_fallbacks = (uint32_t)(t->stats.mtu_fallbacks - fallbacks);
    for (uint32_t d = 0; d < nd; d++)
        res->retransmits += t->fcalls[d].retransmits;
    int rc = check_replies(t, &sum, res);
    if (rc != DUCK_T_OK)
        return rc;
    on_reply(t, t->fcalls, nd, &sum);   /* every reply checks: nothing is left, but be sure */
    if (sum.empty)
        memset(sum.acc, 0, count * 4);
    if (a->y_dtype == DUCK_DT_BF16)
        wire_f32_to_bf16_n(sum.acc, (uint16_t *)a->y, count);
    return DUCK_T_OK;
}
