/* One handler per request type. Each parses its payload with explicit
 * bounds checks and answers with a wire_reply_head: status 0 and a body,
 * or a status and a message saying what was wrong. */
#define _POSIX_C_SOURCE 200809L
#include "duckfw.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* HELLO announces DUCK_MAX_TOKENS as this duck's limit per forward; the host cuts its forwards by it */
_Static_assert(DUCK_MAX_TOKENS >= WIRE_TOKENS_DEFAULT && DUCK_MAX_TOKENS <= WIRE_MAX_TOKENS,
               "the kernels' tokens per call must lie within the wire's bounds");
_Static_assert(WIRE_MAX_TOPK == DUCK_MAX_TOPK, "the wire and the kernels disagree on experts per token");

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static reply_slot *reply_new(duck_core *c, const msg_key *k, const wire_header *h, uint32_t body)
{
    uint32_t room = body > WIRE_MAX_ERROR_TEXT + 1 ? body : WIRE_MAX_ERROR_TEXT + 1;
    reply_slot *r = msgs_take_reply(&c->msgs, k, (uint32_t)sizeof(wire_reply_head) + room);
    if (!r)
        return NULL;
    r->with_mac = (h->flags & WIRE_F_MAC) != 0;
    r->mtu = core_default_mtu(c);
    memset(r->buf, 0, sizeof(wire_reply_head));
    r->len = (uint32_t)sizeof(wire_reply_head) + body;
    return r;
}

static uint8_t *body(reply_slot *r) { return r->buf + sizeof(wire_reply_head); }

__attribute__((format(printf, 3, 4))) static reply_slot *fail(reply_slot *r, int status, const char *fmt, ...)
{
    wire_reply_head head = {status, 0};
    memcpy(r->buf, &head, sizeof head);
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf((char *)body(r), WIRE_MAX_ERROR_TEXT + 1, fmt, ap);
    va_end(ap);
    n = n < 0 ? 0 : n > WIRE_MAX_ERROR_TEXT ? WIRE_MAX_ERROR_TEXT : n;
    r->len = (uint32_t)sizeof head + (uint32_t)n;
    dlog(DLOG_WARN, "%s seq %u refused: %s", wire_type_str(r->key.type), r->key.sequence, (char *)body(r));
    return r;
}

/* Without the fleet key's MAC the asker learns what a link and version check
 * needs (ABI, firmware version, datagram size, token limit, flags), nothing of
 * the duck's identity, memory, cache or session. */
static reply_slot *on_hello(duck_core *c, reply_slot *r, int authenticated)
{
    wire_hello_reply hr = {0};
    hr.fw_version = DUCKFW_VERSION_MAJOR << 16 | DUCKFW_VERSION_MINOR;
    hr.abi = WIRE_ABI;
    if (authenticated) {
        hr.duck_id = c->cfg.duck_id;
        hr.cores = (uint16_t)c->cores;
        hr.threads = (uint16_t)c->cfg.threads;
        hr.mem_bytes = c->mem_bytes;
        hr.cache_bytes = cache_used(c->cache);
        hr.cache_capacity = cache_capacity(c->cache);
        hr.cache_entries = cache_count(c->cache);
        hr.session = c->session.id;
        memcpy(hr.challenge, c->challenge, sizeof hr.challenge);
        if (c->cfg.key.has_link)
            memcpy(hr.run, c->cfg.key.run, sizeof hr.run);
    }
    hr.mtu = c->cfg.mtu;
    hr.flags = (c->cfg.data_mac ? WIRE_HELLO_DATA_MAC : 0) | (c->cfg.faults ? WIRE_HELLO_FAULTS : 0);
    snprintf(hr.name, sizeof hr.name, "%s", DUCKFW_NAME);
    hr.max_tokens = DUCK_MAX_TOKENS;
    memcpy(body(r), &hr, sizeof hr);
    return r;
}

static reply_slot *on_ping(duck_core *c, reply_slot *r, const uint8_t *p, uint32_t len)
{
    wire_ping pg;
    if (len < sizeof pg || len > WIRE_MTU_MAX)
        return fail(r, WIRE_E_MALFORMED, "ping payload is %u bytes, expected %zu..%u", len, sizeof pg, WIRE_MTU_MAX);
    memcpy(&pg, p, sizeof pg);
    uint32_t mtu = wire_reply_mtu(pg.reply_mtu, c->cfg.mtu);
    if (!mtu)
        return fail(r, WIRE_E_MALFORMED, "ping asks for reply datagrams of %u bytes, below the minimum %u",
                    pg.reply_mtu, WIRE_MTU_MIN);
    r->mtu = mtu;
    memcpy(body(r), p, len);   /* echoed whole: a padded ping proves the path both ways */
    return r;
}

/* A host's run, bound to this duck's current challenge; a run open for any
 * other challenge is an old one replayed (or raced by another host's). */
static reply_slot *on_run_open(duck_core *c, reply_slot *r, const wire_header *h, const uint8_t *p, uint32_t len)
{
    wire_run_open ro;
    if (len != sizeof ro)
        return fail(r, WIRE_E_MALFORMED, "run open payload is %u bytes, expected %zu", len, sizeof ro);
    memcpy(&ro, p, sizeof ro);
    if (memcmp(ro.challenge, c->challenge, sizeof ro.challenge) != 0) {
        c->stats.replayed++;
        return fail(r, WIRE_E_STALE, "run open names challenge %02x%02x%02x%02x…, not this duck's current one: "
                    "say hello again and open the run with the challenge it gives", ro.challenge[0],
                    ro.challenge[1], ro.challenge[2], ro.challenge[3]);
    }
    hold_clear(&c->held);   /* held forwards of the host before belong to its run */
    run_open(c, ro.run, h->sequence);
    return r;
}

static reply_slot *on_cache_query(duck_core *c, reply_slot *r, const uint8_t *p, uint32_t len)
{
    uint32_t n;
    if (len < 4 || (memcpy(&n, p, 4), (uint64_t)n * WIRE_DIGEST_BYTES != len - 4u))
        return fail(r, WIRE_E_MALFORMED, "cache query of %u bytes is not a count and that many digests", len);
    memcpy(body(r), &n, 4);
    uint8_t *bits = body(r) + 4;
    memset(bits, 0, (n + 7) / 8);
    for (uint32_t i = 0; i < n; i++)
        if (cache_find(c->cache, p + 4 + (size_t)i * WIRE_DIGEST_BYTES))
            bits[i / 8] |= (uint8_t)(1u << (i % 8));
    return r;
}

static reply_slot *on_invalidate(duck_core *c, reply_slot *r, const uint8_t *p, uint32_t len)
{
    wire_invalidate inv;
    char err[WIRE_MAX_ERROR_TEXT];
    if (len != sizeof inv)
        return fail(r, WIRE_E_MALFORMED, "invalidate payload is %u bytes, expected %zu", len, sizeof inv);
    memcpy(&inv, p, sizeof inv);
    uint32_t dropped = 0;
    int all = (inv.flags & WIRE_INVALIDATE_ALL) != 0;
    int st = cache_invalidate(c->cache, all ? NULL : inv.digest, &dropped, err, sizeof err);
    c->stats.cache_evictions += dropped;
    dlog(DLOG_INFO, "cache: invalidated %u entr%s (%s)", dropped, dropped == 1 ? "y" : "ies", all ? "all" : "one");
    if (st != WIRE_OK)
        return fail(r, st, "%s", err);
    memcpy(body(r), &dropped, 4);
    return r;
}

static reply_slot *on_upload(duck_core *c, reply_slot *r, const uint8_t *p, uint32_t len)
{
    wire_upload u;
    wire_upload_reply rep;
    char err[WIRE_MAX_ERROR_TEXT];
    if (len < sizeof u || (memcpy(&u, p, sizeof u), u.len != len - sizeof u) || u.len > WIRE_UPLOAD_PART_MAX)
        return fail(r, WIRE_E_MALFORMED, "upload of %u bytes does not match its part header", len);
    uint64_t accepted = 0;
    int st = cache_upload(c->cache, &u, p + sizeof u, &rep, &accepted, err, sizeof err);
    if (st != WIRE_OK)
        return fail(r, st, "%s", err);
    c->stats.upload_bytes += accepted;
    c->stats.uploads_done += rep.complete && u.len;
    memcpy(body(r), &rep, sizeof rep);
    return r;
}

static reply_slot *on_synth(duck_core *c, reply_slot *r, const uint8_t *p, uint32_t len)
{
    wire_synth hd;
    wire_synth_reply rep;
    char err[WIRE_MAX_ERROR_TEXT];
    if (len < sizeof hd ||
        (memcpy(&hd, p, sizeof hd), (uint64_t)hd.count * sizeof(wire_synth_entry) != len - sizeof hd))
        return fail(r, WIRE_E_MALFORMED, "synth of %u bytes is not a %zu-byte head and %zu-byte entries", len,
                    sizeof hd, sizeof(wire_synth_entry));
    if (hd.count == 0 || hd.count > WIRE_SYNTH_MAX_ENTRIES || hd.reserved)
        return fail(r, WIRE_E_RANGE, "synth of %u entries (reserved %u): 1..%u entries and reserved 0 required",
                    hd.count, hd.reserved, WIRE_SYNTH_MAX_ENTRIES);
    /* entries are copied out: the reassembled payload has no alignment promise */
    wire_synth_entry entries[WIRE_SYNTH_MAX_ENTRIES];
    memcpy(entries, p + sizeof hd, (size_t)hd.count * sizeof *entries);
    int st = cache_synth(c->cache, entries, hd.count, c->pool, &rep, err, sizeof err);
    if (st != WIRE_OK)
        return fail(r, st, "%s", err);
    memcpy(body(r), &rep, sizeof rep);
    return r;
}

static reply_slot *on_session_open(duck_core *c, reply_slot *r, const wire_header *h, const uint8_t *p,
                                   uint32_t len)
{
    wire_session_open so;
    if (len != sizeof so)
        return fail(r, WIRE_E_MALFORMED, "session open payload is %u bytes, expected %zu", len, sizeof so);
    memcpy(&so, p, sizeof so);
    if (h->session == 0 || so.hidden == 0 || so.hidden > (1u << 16))
        return fail(r, WIRE_E_RANGE, "session id must be nonzero and hidden in 1..65536 (got %u, %u)",
                    h->session, so.hidden);
    if (c->session.id == h->session && c->session.hidden == so.hidden)
        return r;   /* reopened: keep the resident plans */
    if (c->session.id)
        dlog(DLOG_INFO, "session %08x closed (replaced)", c->session.id);
    hold_clear(&c->held);
    session_close(&c->session);
    c->session.id = h->session;
    c->session.hidden = so.hidden;
    dlog(DLOG_INFO, "session %08x opened (hidden %u)", h->session, so.hidden);
    return r;
}

static reply_slot *on_layer_plan(duck_core *c, reply_slot *r, const wire_header *h, const uint8_t *p,
                                 uint32_t len)
{
    wire_layer_plan lp;
    char err[WIRE_MAX_ERROR_TEXT];
    if (!c->session.id || h->session != c->session.id)
        return fail(r, WIRE_E_NO_SESSION, "no open session %08x (open: %08x)", h->session, c->session.id);
    if (len < sizeof lp || (memcpy(&lp, p, sizeof lp),
                            (uint64_t)lp.n_experts * 2 * WIRE_DIGEST_BYTES != len - sizeof lp))
        return fail(r, WIRE_E_MALFORMED, "layer plan of %u bytes does not match its expert count", len);
    int st = session_set_layer(&c->session, c->cache, &lp, p + sizeof lp, err, sizeof err);
    if (st != WIRE_OK)
        return fail(r, st, "%s", err);
    dlog(DLOG_INFO, "session %08x layer %u planned (%u experts)", c->session.id, lp.layer, lp.n_experts);
    return r;
}

/* --- forward: the wake-up time --------------------------------------------- */

/* From the arrival of the request's last datagram (the kernel's timestamp)
 * to now, when the kernel starts: the duck's wake-up and parsing. */
static uint32_t wake_ns(duck_core *c)
{
    if (!c->rx_ns)
        return 0;
    uint64_t now = now_ns(), dt = now > c->rx_ns ? now - c->rx_ns : 0;
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
        return fail(r, status, "forward layer %u (held for one pass): %s", f->layer, err);
    wire_reply_head head = {WIRE_OK, any ? 0 : WIRE_R_ZERO};
    fr.layer = f->layer;
    fr.ntok = f->ntok;
    fr.y_dtype = f->y_dtype;
    fr.hidden = f->hidden;
    memcpy(r->buf, &head, sizeof head);
    memcpy(body(r), &fr, sizeof fr);
    if (any)
        memcpy(body(r) + sizeof fr, y, ybytes);
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
    uint64_t t0 = now_ns(), bytes = 0;
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
    uint64_t dt = now_ns() - t0;
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
        core_send_reply(c, r, NULL, 0);
        r->sent_ns = now_ns();
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

static reply_slot *on_forward(duck_core *c, const msg_key *k, const wire_header *h, const uint8_t *p,
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
        return fail(r, WIRE_E_MALFORMED, "forward of %u bytes does not match ntok %u (at most %u), topk %u, "
                    "hidden %u, dtype %u -> %u, reply datagrams %u (flags %u)", len, f.ntok, WIRE_MAX_TOKENS,
                    f.topk, f.hidden, f.x_dtype, f.y_dtype, f.reply_mtu, f.flags);
    if (!ok_tokens)
        return fail(r, WIRE_E_RANGE, "forward of %u tokens: this duck takes at most %u per forward (its hello's "
                    "max_tokens); cut the forward into requests of at most that", f.ntok, DUCK_MAX_TOKENS);
    if (!ok_reply)
        return fail(r, WIRE_E_RANGE, "forward of %u tokens x hidden %u: its reply of %llu bytes exceeds the "
                    "%u bytes that %u datagrams of %u bytes carry; send fewer tokens per forward", f.ntok, f.hidden,
                    (unsigned long long)reply_bytes, wire_max_message(reply_mtu), WIRE_MAX_FRAGMENTS, reply_mtu);
    r->mtu = reply_mtu;
    if (!c->session.id || h->session != c->session.id)
        return fail(r, WIRE_E_NO_SESSION, "no open session %08x (open: %08x)", h->session, c->session.id);
    const duck_layer *l = f.layer < WIRE_MAX_LAYERS ? c->session.layers[f.layer] : NULL;
    if (!l)
        return fail(r, WIRE_E_UNKNOWN_LAYER, "layer %u has no plan in session %08x", f.layer, c->session.id);
    if (f.hidden != l->hidden)
        return fail(r, WIRE_E_RANGE, "forward hidden %u, layer %u has %u", f.hidden, f.layer, l->hidden);
    const int32_t *ids = (const int32_t *)(p + sizeof f);
    int any = 0;
    for (uint64_t i = 0; i < slots; i++) {
        int32_t id;
        memcpy(&id, ids + i, 4);
        if (id >= 0 && (uint32_t)id >= l->n_experts)
            return fail(r, WIRE_E_RANGE, "expert id %d out of range: layer %u has %u experts", id, f.layer,
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
        a.y = body(r) + sizeof fr;
        fr.wake_ns = wake_ns(c);
        uint64_t t0 = now_ns(), bytes = 0;
        int rc = duck_moe_forward(c->pool, c->kernels, c->ws, &a, &bytes);
        uint64_t dt = now_ns() - t0;
        if (rc != DUCK_FFN_OK)
            return fail(r, rc == DUCK_FFN_ENOMEM ? WIRE_E_NOMEM : WIRE_E_RANGE,
                        "forward layer %u: kernel error %d", f.layer, rc);
        fr.kernel_us = (uint32_t)(dt / 1000);
        fr.bytes_streamed = bytes;
        c->stats.kernel_ns += dt;
        c->stats.bytes_streamed += bytes;
    }
    memcpy(r->buf, &head, sizeof head);
    memcpy(body(r), &fr, sizeof fr);
    return r;
}

reply_slot *handle_request(duck_core *c, const msg_key *k, const wire_header *h,
                           const uint8_t *payload, uint32_t len)
{
    c->stats.requests++;
    if (h->type == WIRE_T_FORWARD) {
        reply_slot *r = on_forward(c, k, h, payload, len);
        if (r && r != REPLY_HELD && ((const wire_reply_head *)r->buf)->status != WIRE_OK)
            c->stats.errors++;
        return r;
    }
    uint32_t sizes[WIRE_T_COUNT] = {0, sizeof(wire_hello_reply), sizeof(wire_ping), sizeof(wire_stats),
                                    0, 4, sizeof(wire_upload_reply), 0, 0, 0, 0, 0, 0, 0,
                                    sizeof(wire_synth_reply), 0};
    uint32_t n = h->type < WIRE_T_COUNT ? sizes[h->type] : 0;
    if (h->type == WIRE_T_CACHE_QUERY)
        n = 4 + (len / WIRE_DIGEST_BYTES + 7) / 8;
    if (h->type == WIRE_T_PING && len <= WIRE_MTU_MAX)
        n = len;   /* the echo */
    reply_slot *r = reply_new(c, k, h, n);
    if (!r)
        return NULL;
    memset(body(r), 0, n);
    switch (h->type) {
    case WIRE_T_HELLO: r = on_hello(c, r, (h->flags & WIRE_F_MAC) != 0); break;
    case WIRE_T_PING: r = on_ping(c, r, payload, len); break;
    case WIRE_T_STATS: memcpy(body(r), &c->stats, sizeof c->stats); break;
    case WIRE_T_CACHE_QUERY: r = on_cache_query(c, r, payload, len); break;
    case WIRE_T_CACHE_INVALIDATE: r = on_invalidate(c, r, payload, len); break;
    case WIRE_T_UPLOAD: r = on_upload(c, r, payload, len); break;
    case WIRE_T_SYNTH: r = on_synth(c, r, payload, len); break;
    case WIRE_T_SESSION_OPEN: r = on_session_open(c, r, h, payload, len); break;
    case WIRE_T_RUN_OPEN: r = on_run_open(c, r, h, payload, len); break;
    case WIRE_T_LAYER_PLAN: r = on_layer_plan(c, r, h, payload, len); break;
    case WIRE_T_SESSION_CLOSE:
        if (c->session.id && h->session == c->session.id) {
            dlog(DLOG_INFO, "session %08x closed", c->session.id);
            hold_clear(&c->held);
            session_close(&c->session);
        }
        break;
    case WIRE_T_SHUTDOWN:
        dlog(DLOG_INFO, "shutdown requested by the host");
        c->shutdown = 1;
        break;
    default: r = fail(r, WIRE_E_UNSUPPORTED, "type %u is not a request", h->type); break;
    }
    if (((const wire_reply_head *)r->buf)->status != WIRE_OK)
        c->stats.errors++;
    return r;
}
