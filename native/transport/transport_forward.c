/* One FFN layer over the fleet: the same request to every duck (sealed
 * once), their fp32 partials gathered and summed in duck order, so the sum
 * is deterministic for a given fleet. */
#define _GNU_SOURCE
#include "transport_impl.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

int duck_transport_forward(duck_transport *t, const duck_forward_args *a, duck_forward_result *res)
{
    memset(res, 0, sizeof *res);
    res->failed_duck = -1;
    if (!a || a->ntok > WIRE_MAX_TOKENS || a->topk > WIRE_MAX_TOPK || a->hidden == 0 || a->hidden > (1u << 16) ||
        (a->ntok && (!a->x || !a->y || (a->topk && (!a->expert_ids || !a->expert_weights)))))
        return fail(res, -1, DUCK_T_EARG, 0, "forward: ntok <= %d, topk <= %d, hidden 1..65536 and buffers "
                    "required", WIRE_MAX_TOKENS, WIRE_MAX_TOPK);
    size_t slots = (size_t)a->ntok * a->topk, xsize = a->x_is_bf16 ? 2 : 4;
    size_t len = sizeof(wire_forward) + 8 * slots + (size_t)a->ntok * a->hidden * xsize;
    size_t ybytes = (size_t)a->ntok * a->hidden * 4;
    size_t rcap = sizeof(wire_reply_head) + sizeof(wire_forward_reply) + ybytes;
    if (len > WIRE_MAX_MESSAGE || rcap > WIRE_MAX_MESSAGE)
        return fail(res, -1, DUCK_T_EARG, 0, "forward of %u tokens x %u hidden exceeds the %u-byte message bound",
                    a->ntok, a->hidden, WIRE_MAX_MESSAGE);
    if (reserve(&t->fwd, &t->fwd_cap, len) != 0)
        return fail(res, -1, DUCK_T_EARG, 0, "out of memory");
    wire_forward f = {a->layer, (uint16_t)a->ntok, (uint8_t)a->topk,
                      (uint8_t)(a->x_is_bf16 ? WIRE_X_BF16 : WIRE_X_F32), a->hidden, 0};
    memcpy(t->fwd, &f, sizeof f);
    if (slots) {
        memcpy(t->fwd + sizeof f, a->expert_ids, 4 * slots);
        memcpy(t->fwd + sizeof f + 4 * slots, a->expert_weights, 4 * slots);
    }
    if (a->ntok)
        memcpy(t->fwd + sizeof f + 8 * slots, a->x, (size_t)a->ntok * a->hidden * xsize);
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
    duck_transport_run(t, t->fcalls, nd);
    for (uint32_t d = 0; d < nd; d++)
        res->retransmits += t->fcalls[d].retransmits;
    for (uint32_t d = 0; d < nd; d++) {
        const duck_call *c = &t->fcalls[d];
        if (c->result == DUCK_T_ETIMEOUT)
            return fail(res, (int32_t)d, c->result, 0, "duck %u did not answer forward of layer %u within %u ms "
                        "(%u retransmits)", d, a->layer, t->cfg.deadline_us / 1000, c->retransmits);
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
        wire_forward_reply fr;
        size_t want = sizeof head + sizeof fr + ((head.flags & WIRE_R_ZERO) ? 0 : ybytes);
        if (c->reply_len != want)
            return fail(res, (int32_t)d, DUCK_T_EDUCK, WIRE_E_MALFORMED, "duck %u: forward reply of %u bytes, "
                        "expected %zu", d, c->reply_len, want);
        memcpy(&fr, (const uint8_t *)c->reply + sizeof head, sizeof fr);
        if (fr.layer != a->layer || fr.ntok != a->ntok || fr.hidden != a->hidden)
            return fail(res, (int32_t)d, DUCK_T_EDUCK, WIRE_E_MALFORMED, "duck %u: reply for layer %u, %u tokens, "
                        "hidden %u does not match the request", d, fr.layer, fr.ntok, fr.hidden);
        res->bytes_streamed += fr.bytes_streamed;
        if (fr.kernel_us > res->kernel_us_max)
            res->kernel_us_max = fr.kernel_us;
    }
    /* sum in duck order: deterministic for a given fleet */
    size_t count = (size_t)a->ntok * a->hidden;
    int first = 1;
    for (uint32_t d = 0; d < nd; d++) {
        const duck_call *c = &t->fcalls[d];
        const wire_reply_head *head = (const wire_reply_head *)c->reply;
        if (head->flags & WIRE_R_ZERO)
            continue;
        const float *p = (const float *)((const uint8_t *)c->reply + sizeof(wire_reply_head) +
                                         sizeof(wire_forward_reply));
        if (first) {
            memcpy(a->y, p, count * 4);
            first = 0;
        } else {
            for (size_t i = 0; i < count; i++)
                a->y[i] += p[i];
        }
    }
    if (first && count)
        memset(a->y, 0, count * 4);
    return DUCK_T_OK;
}
