/* One handler per request type. Each parses its payload with explicit
 * bounds checks and answers with a wire_reply_head: status 0 and a body,
 * or a status and a message saying what was wrong. */
#define _POSIX_C_SOURCE 200809L
#include "duckfw.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* HELLO announces DUCK_MAX_TOKENS as this duck's limit per forward; the host cuts its forwards by it */
_Static_assert(DUCK_MAX_TOKENS >= WIRE_TOKENS_DEFAULT && DUCK_MAX_TOKENS <= WIRE_MAX_TOKENS,
               "the kernels' tokens per call must lie within the wire's bounds");
_Static_assert(WIRE_MAX_TOPK == DUCK_MAX_TOPK, "the wire and the kernels disagree on experts per token");

/* Without the fleet key's MAC and a current query nonce (a hello's payload is
 * empty, or a wire_query) the asker learns what a link and version check
 * needs (ABI, firmware version, datagram size, token limit, flags) and the
 * query nonce, nothing of the duck's identity, memory, cache or session. A
 * MACed hello naming a nonce that is not current (a replay, or one from
 * before a restart) gets that too, and is counted. */
static reply_slot *on_hello(duck_core *c, reply_slot *r, int mac, const uint8_t *p, uint32_t len)
{
    wire_hello_reply hr = {0};
    int authenticated = mac && len == sizeof(wire_query) && query_ok(c, p, len);
    if (mac && len == sizeof(wire_query) && !authenticated)
        c->stats.replayed++;
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
    hr.flags = (c->cfg.data_mac ? WIRE_HELLO_DATA_MAC : 0) | (c->cfg.faults ? WIRE_HELLO_FAULTS : 0) |
               (authenticated ? WIRE_HELLO_FULL : 0);
    snprintf(hr.name, sizeof hr.name, "%s", DUCKFW_NAME);
    hr.max_tokens = DUCK_MAX_TOKENS;
    memcpy(hr.query, query_current(c, &hr.query_ms), sizeof hr.query);
    memcpy(reply_body(r), &hr, sizeof hr);
    return r;
}

/* A STATS or CACHE_QUERY must name a current query nonce (wire_query, first in its payload): a
 * stale one is a replay, or a host's from before the nonce changed or the duck restarted. It is
 * answered (STALE: nothing of the duck, the host asks hello for the nonce and again) and counted. */
static reply_slot *query_refused(duck_core *c, reply_slot *r, const uint8_t *p, uint32_t len)
{
    if (len < sizeof(wire_query))
        return reply_fail(r, WIRE_E_MALFORMED, "%s of %u bytes: a read-only request starts with the duck's %zu-byte "
                          "query nonce (wire ABI 8 and later; this duck's is %d)", wire_type_str(r->key.type), len,
                          sizeof(wire_query), WIRE_ABI);
    c->stats.replayed++;
    return reply_fail(r, WIRE_E_STALE, "query nonce %02x%02x%02x%02x… is not this duck's current one: say hello "
                      "for the current one", p[0], p[1], p[2], p[3]);
}

static reply_slot *on_ping(duck_core *c, reply_slot *r, const uint8_t *p, uint32_t len)
{
    wire_ping pg;
    if (len < sizeof pg || len > WIRE_MTU_MAX)
        return reply_fail(r, WIRE_E_MALFORMED, "ping payload is %u bytes, expected %zu..%u", len, sizeof pg, WIRE_MTU_MAX);
    memcpy(&pg, p, sizeof pg);
    uint32_t mtu = wire_reply_mtu(pg.reply_mtu, c->cfg.mtu);
    if (!mtu)
        return reply_fail(r, WIRE_E_MALFORMED, "ping asks for reply datagrams of %u bytes, below the minimum %u",
                    pg.reply_mtu, WIRE_MTU_MIN);
    r->mtu = mtu;
    memcpy(reply_body(r), p, len);   /* echoed whole: a padded ping proves the path both ways */
    return r;
}

/* A host's run, bound to this duck's current challenge; a run open for any
 * other challenge is an old one replayed (or raced by another host's). */
static reply_slot *on_run_open(duck_core *c, reply_slot *r, const wire_header *h, const uint8_t *p, uint32_t len)
{
    wire_run_open ro;
    if (len != sizeof ro)
        return reply_fail(r, WIRE_E_MALFORMED, "run open payload is %u bytes, expected %zu", len, sizeof ro);
    memcpy(&ro, p, sizeof ro);
    if (memcmp(ro.challenge, c->challenge, sizeof ro.challenge) != 0) {
        c->stats.replayed++;
        return reply_fail(r, WIRE_E_STALE, "run open names challenge %02x%02x%02x%02x…, not this duck's current one: "
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
        return reply_fail(r, WIRE_E_MALFORMED, "cache query of %u bytes is not a count and that many digests", len);
    memcpy(reply_body(r), &n, 4);
    uint8_t *bits = reply_body(r) + 4;
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
        return reply_fail(r, WIRE_E_MALFORMED, "invalidate payload is %u bytes, expected %zu", len, sizeof inv);
    memcpy(&inv, p, sizeof inv);
    uint32_t dropped = 0;
    int all = (inv.flags & WIRE_INVALIDATE_ALL) != 0;
    int st = cache_invalidate(c->cache, all ? NULL : inv.digest, &dropped, err, sizeof err);
    c->stats.cache_evictions += dropped;
    dlog(DLOG_INFO, "cache: invalidated %u entr%s (%s)", dropped, dropped == 1 ? "y" : "ies", all ? "all" : "one");
    if (st != WIRE_OK)
        return reply_fail(r, st, "%s", err);
    memcpy(reply_body(r), &dropped, 4);
    return r;
}

static reply_slot *on_upload(duck_core *c, reply_slot *r, const uint8_t *p, uint32_t len)
{
    wire_upload u;
    wire_upload_reply rep;
    char err[WIRE_MAX_ERROR_TEXT];
    if (len < sizeof u || (memcpy(&u, p, sizeof u), u.len != len - sizeof u) || u.len > WIRE_UPLOAD_PART_MAX)
        return reply_fail(r, WIRE_E_MALFORMED, "upload of %u bytes does not match its part header", len);
    uint64_t accepted = 0;
    int st = cache_upload(c->cache, &u, p + sizeof u, &rep, &accepted, err, sizeof err);
    if (st != WIRE_OK)
        return reply_fail(r, st, "%s", err);
    c->stats.upload_bytes += accepted;
    c->stats.uploads_done += rep.complete && u.len;
    memcpy(reply_body(r), &rep, sizeof rep);
    return r;
}

static reply_slot *on_synth(duck_core *c, reply_slot *r, const uint8_t *p, uint32_t len)
{
    wire_synth hd;
    wire_synth_reply rep;
    char err[WIRE_MAX_ERROR_TEXT];
    if (len < sizeof hd ||
        (memcpy(&hd, p, sizeof hd), (uint64_t)hd.count * sizeof(wire_synth_entry) != len - sizeof hd))
        return reply_fail(r, WIRE_E_MALFORMED, "synth of %u bytes is not a %zu-byte head and %zu-byte entries", len,
                    sizeof hd, sizeof(wire_synth_entry));
    if (hd.count == 0 || hd.count > WIRE_SYNTH_MAX_ENTRIES || hd.reserved)
        return reply_fail(r, WIRE_E_RANGE, "synth of %u entries (reserved %u): 1..%u entries and reserved 0 required",
                    hd.count, hd.reserved, WIRE_SYNTH_MAX_ENTRIES);
    /* entries are copied out: the reassembled payload has no alignment promise */
    wire_synth_entry entries[WIRE_SYNTH_MAX_ENTRIES];
    memcpy(entries, p + sizeof hd, (size_t)hd.count * sizeof *entries);
    int st = cache_synth(c->cache, entries, hd.count, c->pool, &rep, err, sizeof err);
    if (st != WIRE_OK)
        return reply_fail(r, st, "%s", err);
    memcpy(reply_body(r), &rep, sizeof rep);
    return r;
}

static reply_slot *on_session_open(duck_core *c, reply_slot *r, const wire_header *h, const uint8_t *p,
                                   uint32_t len)
{
    wire_session_open so;
    if (len != sizeof so)
        return reply_fail(r, WIRE_E_MALFORMED, "session open payload is %u bytes, expected %zu", len, sizeof so);
    memcpy(&so, p, sizeof so);
    if (h->session == 0 || so.hidden == 0 || so.hidden > (1u << 16))
        return reply_fail(r, WIRE_E_RANGE, "session id must be nonzero and hidden in 1..65536 (got %u, %u)",
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
        return reply_fail(r, WIRE_E_NO_SESSION, "no open session %08x (open: %08x)", h->session, c->session.id);
    if (len < sizeof lp || (memcpy(&lp, p, sizeof lp),
                            (uint64_t)lp.n_experts * 2 * WIRE_DIGEST_BYTES != len - sizeof lp))
        return reply_fail(r, WIRE_E_MALFORMED, "layer plan of %u bytes does not match its expert count", len);
    int st = session_set_layer(&c->session, c->cache, &lp, p + sizeof lp, err, sizeof err);
    if (st != WIRE_OK)
        return reply_fail(r, st, "%s", err);
    dlog(DLOG_INFO, "session %08x layer %u planned (%u experts)", c->session.id, lp.layer, lp.n_experts);
    return r;
}

reply_slot *handle_request(duck_core *c, const msg_key *k, const wire_header *h,
                           const uint8_t *payload, uint32_t len)
{
    c->stats.requests++;
    if (h->type == WIRE_T_FORWARD) {
        reply_slot *r = forward_request(c, k, h, payload, len);
        if (r && r != REPLY_HELD && ((const wire_reply_head *)r->buf)->status != WIRE_OK)
            c->stats.errors++;
        return r;
    }
    uint32_t n = h->type < WIRE_T_COUNT ? wire_types[h->type].reply_size : 0;
    if (h->type == WIRE_T_CACHE_QUERY)
        n = 4 + (len / WIRE_DIGEST_BYTES + 7) / 8;
    int fresh = (h->type != WIRE_T_STATS && h->type != WIRE_T_CACHE_QUERY) || query_ok(c, payload, len);
    if (h->type == WIRE_T_PING && len <= WIRE_MTU_MAX)
        n = len;   /* the echo */
    reply_slot *r = reply_new(c, k, h, n);
    if (!r)
        return NULL;
    memset(reply_body(r), 0, n);
    switch (h->type) {
    case WIRE_T_HELLO: r = on_hello(c, r, (h->flags & WIRE_F_MAC) != 0, payload, len); break;
    case WIRE_T_PING: r = on_ping(c, r, payload, len); break;
    case WIRE_T_STATS:
        if (!fresh)
            r = query_refused(c, r, payload, len);
        else if (len != sizeof(wire_query))
            r = reply_fail(r, WIRE_E_MALFORMED, "stats payload is %u bytes, expected %zu (the query nonce)", len,
                           sizeof(wire_query));
        else
            memcpy(reply_body(r), &c->stats, sizeof c->stats);
        break;
    case WIRE_T_CACHE_QUERY:
        r = fresh ? on_cache_query(c, r, payload + sizeof(wire_query), len - (uint32_t)sizeof(wire_query))
                  : query_refused(c, r, payload, len);
        break;
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
    default: r = reply_fail(r, WIRE_E_UNSUPPORTED, "type %u is not a request", h->type); break;
    }
    if (((const wire_reply_head *)r->buf)->status != WIRE_OK)
        c->stats.errors++;
    return r;
}
