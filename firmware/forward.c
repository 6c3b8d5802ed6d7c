/* FORWARD: the request checked against the session's layer plan, the
 * duck's slice run on its tokens (duck_moe_forward), the partial written
 * straight into the reply; forwards flagged WIRE_FWD_HOLD are kept (hold.c)
 * until the last of their group, and all of them answered from one pass. */
#define _POSIX_C_SOURCE 200809L
#include "duckfw.h"

#include <stdio.h>
#include <string.h>

/* --- forward: the wake-up time --------------------------------------------- */

/* From the arrival of the request's last datagram (the kernel's timestamp)
 * to now, when the kernel starts: the duck's wake-up and parsing. */
static uint32_t wake_ns(duck_core *c)
{
    if (!c->rx_ns)
        return 0;
    uint64_t now = duck_now_ns(), dt = now > c->rx_ns ? now - c->rx_ns : 0;
    c->stats.wake_ns += dt;
    return dt > UINT32_MAX ? UINT32_MAX : (uint32_t)dt;
}

static reply_slot held_slot;
reply_slot *const REPLY_HELD = &held_slot;

/* Whether any of a forward's ntok * topk expert ids (in its payload p) is routed here. */
static int routed(const wire_forward *f, const uint8_t *p)
{
    for (uint64_t i = 0; i < (uint64_t)f->ntok * f->topk; i++) {
        int32_t id;
        memcpy(&id, p + sizeof *f + 4 * i, 4);
        if (id >= 0)
            return 1;
    }
    return 0;
}

/* The reply to forward k of one pass: its rows of the pass's y (none: R_ZERO), or
 * the pass's error. NULL when out of memory. */
static reply_slot *pass_reply(duck_core *c, const msg_key *k, const wire_header *h, const wire_forward *f,
                              const uint8_t *p, const uint8_t *y, wire_forward_reply fr, int status, const char *err)
{
    uint64_t ybytes = (uint64_t)f->ntok * f->hidden * wire_dtype_bytes(f->y_dtype);
    int any = !status && routed(f, p);
    reply_slot *r = reply_new(c, k, h, (uint32_t)sizeof fr + (any ? (uint32_t)ybytes : 0));
    if (!r)
        return NULL;
    r->mtu = wire_reply_mtu(f->reply_mtu, c->cfg.mtu);
    if (status)
        return reply_fail(r, status, "forward layer %u (held for one pass): %s", f->layer, err);
    wire_reply_head head = {WIRE_OK, any ? 0 : WIRE_R_ZERO};
    fr.layer = f->layer;
    fr.ntok = f->ntok;
    fr.y_dtype = f->y_dtype;
    fr.hidden = f->hidden;
    memcpy(r->buf, &head, sizeof head);
    memcpy(reply_body(r), &fr, sizeof fr);
    if (any)
        memcpy(reply_body(r) + sizeof fr, y, ybytes);
    else
        r->len = (uint32_t)(sizeof head + sizeof fr);
    return r;
}

/* The held forwards and then forward k (payload p; NULL: none) in one kernel
 * pass: each held one is answered here, the reply to k returned. */
static reply_slot *answer_held(duck_core *c, const msg_key *k, const wire_header *h, const wire_forward *f,
                               const uint8_t *p)
{
    duck_held *hd = &c->held;
    const wire_forward *first = hd->n ? &hd->f[0].f : f;
    const duck_layer *l = c->session.layers[first->layer];   /* a layer plan may have changed meanwhile */
    duck_moe_args a;
    wire_forward_reply fr = {0};
    int status = 0;
    const char *err = "";
    char msg[96];
    uint64_t t0 = duck_now_ns(), bytes = 0;
    if (!l || l->hidden != first->hidden) {
        status = WIRE_E_UNKNOWN_LAYER, err = "the layer's plan is gone";
    } else if (hold_gather(hd, f, p, &a) != 0) {
        status = WIRE_E_NOMEM, err = "no memory for the pass";
    } else {
        a.experts = l->experts;
        a.n_experts = l->n_experts;
        fr.wake_ns = wake_ns(c);
        int any = 0;
        for (uint64_t i = 0; i < (uint64_t)a.ntok * a.topk && !any; i++)
            any = a.expert_ids[i] >= 0;
        int rc = any ? duck_moe_forward(c->pool, c->kernels, c->ws, &a, &bytes) : DUCK_FFN_OK;
        if (rc != DUCK_FFN_OK) {
            snprintf(msg, sizeof msg, "kernel error %d", rc);
            status = rc == DUCK_FFN_ENOMEM ? WIRE_E_NOMEM : WIRE_E_RANGE, err = msg;
        }
    }
    uint64_t dt = duck_now_ns() - t0;
    if (!status) {
        c->stats.kernel_ns += dt;
        c->stats.bytes_streamed += bytes;
    }
    fr.kernel_us = (uint32_t)(dt / 1000);
    fr.group_ntok = hd->ntok + (p ? f->ntok : 0);
    size_t yrow = (size_t)first->hidden * wire_dtype_bytes(first->y_dtype);
    const uint8_t *y = status ? NULL : (const uint8_t *)a.y;
    uint32_t row = 0;
    for (uint32_t i = 0; i < hd->n; i++) {
        const held_forward *o = &hd->f[i];
        wire_forward_reply part = fr;
        part.wake_ns = 0;
        part.bytes_streamed = p || i + 1 < hd->n ? 0 : bytes;   /* the pass's bytes on its last request */
        reply_slot *r = pass_reply(c, &o->key, &o->h, &o->f, o->payload, y ? y + row * yrow : NULL, part, status, err);
        row += o->f.ntok;
        if (!r) {
            dlog(DLOG_ERROR, "no memory for the reply to held forward seq %u", o->key.sequence);
            continue;
        }
        if (status)
            c->stats.errors++;
        r->to = o->from;
        reply_send(c, r, NULL, 0);
        r->sent_ns = duck_now_ns();
    }
    reply_slot *r = NULL;
    if (p) {
        fr.bytes_streamed = bytes;
        r = pass_reply(c, k, h, f, p, y ? y + row * yrow : NULL, fr, status, err);
    }
    hold_clear(hd);
    return r;
}

void hold_answer(duck_core *c)
{
    if (c->held.n)
        answer_held(c, NULL, NULL, NULL, NULL);
}

reply_slot *forward_request(duck_core *c, const msg_key *k, const wire_header *h, const uint8_t *p,
                            uint32_t len)
{
    wire_forward f;
    memset(&f, 0, sizeof f);
    if (len >= sizeof f)
        memcpy(&f, p, sizeof f);
    uint64_t slots = (uint64_t)f.ntok * f.topk, xsize = f.x_dtype == WIRE_X_BF16 ? 2 : 4;
    uint64_t ybytes = (uint64_t)f.ntok * f.hidden * wire_dtype_bytes(f.y_dtype);
    uint32_t reply_mtu = wire_reply_mtu(f.reply_mtu, c->cfg.mtu);
    uint64_t reply_bytes = sizeof(wire_reply_head) + sizeof(wire_forward_reply) + ybytes;
    int ok_shape = len >= sizeof f && f.ntok <= WIRE_MAX_TOKENS && f.topk <= WIRE_MAX_TOPK && f.x_dtype <= 1 &&
                   f.hidden <= (1u << 16) && f.y_dtype <= 1 && !(f.flags & ~WIRE_FWD_HOLD) && reply_mtu &&
                   len == sizeof f + 8 * slots + (uint64_t)f.ntok * f.hidden * xsize;
    /* the reply must be cut in at most WIRE_MAX_FRAGMENTS datagrams of the size the host takes */
    int ok_tokens = ok_shape && f.ntok <= DUCK_MAX_TOKENS;
    int ok_reply = ok_tokens && reply_bytes <= wire_max_message(reply_mtu);
    reply_slot *r = reply_new(c, k, h, (uint32_t)sizeof(wire_forward_reply) + (ok_reply ? (uint32_t)ybytes : 0));
    if (!r)
        return NULL;
    if (!ok_shape)
        return reply_fail(r, WIRE_E_MALFORMED, "forward of %u bytes does not match ntok %u (at most %u), topk %u, "
                    "hidden %u, dtype %u -> %u, reply datagrams %u (flags %u)", len, f.ntok, WIRE_MAX_TOKENS,
                    f.topk, f.hidden, f.x_dtype, f.y_dtype, f.reply_mtu, f.flags);
    if (!ok_tokens)
        return reply_fail(r, WIRE_E_RANGE, "forward of %u tokens: this duck takes at most %u per forward (its hello's "
                    "max_tokens); cut the forward into requests of at most that", f.ntok, DUCK_MAX_TOKENS);
    if (!ok_reply)
        return reply_fail(r, WIRE_E_RANGE, "forward of %u tokens x hidden %u: its reply of %llu bytes exceeds the "
                    "%u bytes that %u datagrams of %u bytes carry; send fewer tokens per forward", f.ntok, f.hidden,
                    (unsigned long long)reply_bytes, wire_max_message(reply_mtu), WIRE_MAX_FRAGMENTS, reply_mtu);
    r->mtu = reply_mtu;
    if (!c->session.id || h->session != c->session.id)
        return reply_fail(r, WIRE_E_NO_SESSION, "no open session %08x (open: %08x)", h->session, c->session.id);
    const duck_layer *l = f.layer < WIRE_MAX_LAYERS ? c->session.layers[f.layer] : NULL;
    if (!l)
        return reply_fail(r, WIRE_E_UNKNOWN_LAYER, "layer %u has no plan in session %08x", f.layer, c->session.id);
    if (f.hidden != l->hidden)
        return reply_fail(r, WIRE_E_RANGE, "forward hidden %u, layer %u has %u", f.hidden, f.layer, l->hidden);
    const int32_t *ids = (const int32_t *)(p + sizeof f);
    int any = 0;
    for (uint64_t i = 0; i < slots; i++) {
        int32_t id;
        memcpy(&id, ids + i, 4);
        if (id >= 0 && (uint32_t)id >= l->n_experts)
            return reply_fail(r, WIRE_E_RANGE, "expert id %d out of range: layer %u has %u experts", id, f.layer,
                        l->n_experts);
        any |= id >= 0;
    }
    c->stats.forwards++;
    duck_held *hd = &c->held;
    if (hd->n && !hold_fits(hd, h->session, &f, len))
        answer_held(c, NULL, NULL, NULL, NULL);   /* another layer (or no room): the held ones alone, answered now */
    if ((f.flags & WIRE_FWD_HOLD) && hold_fits(hd, h->session, &f, len) && hold_add(hd, k, &c->from, h, &f, p, len) == 0) {
        r->used = 0;   /* no reply until the pass */
        return REPLY_HELD;
    }
    if (hd->n) {
        r->used = 0;
        return answer_held(c, k, h, &f, p);
    }
    wire_forward_reply fr = {f.layer, f.ntok, f.y_dtype, 0, f.hidden, 0, 0, 0, f.ntok, {0}};
    wire_reply_head head = {WIRE_OK, 0};
    if (!any || f.ntok == 0) {
        head.flags = WIRE_R_ZERO;   /* nothing routed here: no bytes to send back */
        r->len = (uint32_t)(sizeof head + sizeof fr);
        fr.wake_ns = wake_ns(c);
    } else {
        duck_moe_args a = {0};
        a.experts = l->experts;
        a.n_experts = l->n_experts;
        a.ntok = f.ntok;
        a.topk = f.topk;
        a.hidden = f.hidden;
        a.expert_ids = ids;
        a.expert_weights = (const float *)(p + sizeof f + 4 * slots);
        a.x = p + sizeof f + 8 * slots;
        a.x_dtype = f.x_dtype == WIRE_X_BF16 ? DUCK_DT_BF16 : DUCK_DT_F32;
        /* the partial straight into the reply, rounded once (to nearest even) where bf16 is asked */
        a.y_dtype = f.y_dtype == WIRE_DT_BF16 ? DUCK_DT_BF16 : DUCK_DT_F32;
        a.y = reply_body(r) + sizeof fr;
        fr.wake_ns = wake_ns(c);
        uint64_t t0 = duck_now_ns(), bytes = 0;
        int rc = duck_moe_forward(c->pool, c->kernels, c->ws, &a, &bytes);
        uint64_t dt = duck_now_ns() - t0;
        if (rc != DUCK_FFN_OK)
            return reply_fail(r, rc == DUCK_FFN_ENOMEM ? WIRE_E_NOMEM : WIRE_E_RANGE,
                        "forward layer %u: kernel error %d", f.layer, rc);
        fr.kernel_us = (uint32_t)(dt / 1000);
        fr.bytes_streamed = bytes;
        c->stats.kernel_ns += dt;
        c->stats.bytes_streamed += bytes;
    }
    memcpy(r->buf, &head, sizeof head);
    memcpy(reply_body(r), &fr, sizeof fr);
    return r;
}
