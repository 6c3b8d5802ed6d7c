/* The portable core: every datagram is checked, authenticated where its type
 * demands, deduplicated against the last-reply cache, reassembled, handled
 * and answered. Nothing here trusts a byte it has not bounds-checked, and
 * nothing here exits: the loop goes back to serving after any error. */
#define _POSIX_C_SOURCE 200809L
#include "duckfw.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>


/* Whether the duck refuses a request of this type without its MAC (wire_types: HELLO is open,
 * an unauthenticated asker getting only what a link check needs, handlers.c on_hello; PING too;
 * forwards need one unless the duck runs with --no-data-mac). */
static int needs_mac(const duck_core *c, unsigned type)
{
    int need = wire_mac_need(type);
    return need == WIRE_MAC_REQUIRED || (need == WIRE_MAC_DATA && c->cfg.data_mac);
}

int core_init(duck_core *c, const duck_config *cfg, duck_send_fn send, void *send_ctx)
{
    memset(c, 0, sizeof *c);
    c->cfg = *cfg;
    c->send = send;
    c->send_ctx = send_ctx;
    c->rng = 0x9E3779B97F4A7C15ull ^ cfg->fault_seed;
    c->kernels = duck_kernels_best();
    const char *inv = getenv("DUCK_BATCH_INVARIANT");   /* kernels.h: on unless "0" */
    duck_kernels_set_batch_invariant(!(inv && strcmp(inv, "0") == 0));
    c->cfg.key.has_link = 0;   /* no run until a host opens one for this start's challenge */
    run_new_challenge(c);
    query_init(c);
    c->ws = duck_ffn_workspace_create();
    c->out = malloc((size_t)DUCK_SEND_BATCH * (cfg->mtu + 64));
    c->out_ptrs = calloc(2 * DUCK_SEND_BATCH, sizeof *c->out_ptrs);
    c->out_lens = calloc(3 * DUCK_SEND_BATCH, sizeof *c->out_lens);
    if (!c->ws || !c->out || !c->out_ptrs || !c->out_lens) {
        dlog(DLOG_ERROR, "out of memory at start");
        return -1;
    }
    c->cache = cache_open(cfg->cache_dir, cfg->cache_capacity, &c->stats.cache_corrupt);
    if (!c->cache)
        return -1;
    if (cfg->threads > 1) {
        c->pool = duck_pool_create(cfg->threads, cfg->pin, cfg->spin_us);
        if (!c->pool) {
            dlog(DLOG_ERROR, "cannot start %u worker threads", cfg->threads);
            return -1;
        }
    }
    dlog(DLOG_INFO, "kernels %s%s, %u worker thread(s)%s, idle %s (%u us)", c->kernels->name,
         duck_kernels_batch_invariant() ? "" : " (batch invariance off)", cfg->threads,
         cfg->pin ? " pinned" : "", cfg->spin_us ? "spin-then-block" : "block", cfg->spin_us);
    return 0;
}

void core_free(duck_core *c)
{
    hold_free(&c->held);
    session_close(&c->session);
    msgs_free(&c->msgs);
    cache_close(c->cache);
    if (c->pool)
        duck_pool_destroy(c->pool);
    duck_ffn_workspace_destroy(c->ws);
    free(c->out);
    free(c->out_ptrs);
    free(c->out_lens);
    c->cache = NULL;
    c->pool = NULL;
    c->ws = NULL;
    c->out = NULL;
}

/* The key a message is remembered under: a link-keyed message by its
 * session, sequence and type alone (it is taken once whoever sends it: a
 * copy from another address is the same message), others with the sender. */
static msg_key message_key(const duck_peer *from, uint32_t session, uint32_t sequence, unsigned type)
{
    msg_key k = {*from, session, sequence, (uint8_t)type};
    if (wire_mac_kind(type) == WIRE_MAC_LINK)
        memset(&k.peer, 0, sizeof k.peer);
    return k;
}

static void on_resend(duck_core *c, const duck_peer *from, const wire_header *h, const uint8_t *p)
{
    wire_resend rs;
    if (h->frag_count != 1 || h->payload_len < sizeof rs) {
        c->stats.malformed++;
        return;
    }
    memcpy(&rs, p, sizeof rs);
    uint32_t bytes = (rs.reply_frags + 7u) / 8u;
    if (rs.reply_frags > WIRE_MAX_FRAGMENTS || h->payload_len != sizeof rs + bytes) {
        c->stats.malformed++;
        return;
    }
    msg_key k = message_key(from, h->session, rs.sequence, rs.type);
    c->stats.resends++;
    reply_slot *r = msgs_find_reply(&c->msgs, &k);
    if (r) {
        if (reply_asked_before(c, r))
            c->stats.early_resends++;
        else
            reply_send(c, r, rs.reply_frags ? p + sizeof rs : NULL, rs.reply_frags);
        return;
    }
    if (rs.type == WIRE_T_FORWARD && hold_has(&c->held, &k)) {
        hold_answer(c);   /* asked for a held forward's reply: the pass runs now (see datagram_checked) */
        return;
    }
    /* A link-keyed request while no run is open: every copy of it would be dropped
     * (no_run), so "send it all again" would go on for ever; the host hears that it
     * must open a run here first (a restarted duck) */
    int no_run = wire_mac_kind(rs.type) == WIRE_MAC_LINK && needs_mac(c, rs.type) && !c->cfg.key.has_link;
    nack_send(c, from, &k, msgs_find_reasm(&c->msgs, &k), (h->flags & WIRE_F_MAC) != 0, no_run);
}

static void refuse(duck_core *c, uint64_t *counter, const char *why, const duck_peer *from, size_t len)
{
    uint64_t n = ++*counter;
    c->dropped = 1;
    /* a flood of garbage must not become a flood of log lines */
    if (n <= 10 || (n & (n - 1)) == 0)
        dlog(DLOG_WARN, "dropped a %zu-byte datagram from port %u: %s (%llu so far)", len,
             (unsigned)((from->port >> 8) | ((from->port & 0xFF) << 8)), why, (unsigned long long)n);
}

static void datagram_checked(duck_core *c, const duck_peer *from, size_t len, int rc, wire_header h,
                             const uint8_t *payload);

void core_datagram(duck_core *c, const duck_peer *from, const uint8_t *buf, size_t len)
{
    wire_header h;
    const uint8_t *payload = NULL;
    int rc = wire_check(buf, len, &c->cfg.key, 0, &h, &payload);
    datagram_checked(c, from, len, rc, h, payload);
}

typedef struct check_job {
    const duck_core *c;
    const uint8_t *const *bufs;
    const size_t *lens;
    const uint8_t *drop;
    int *rc;
    wire_header *h;
    const uint8_t **payload;
} check_job;

static void check_one(void *ctx, unsigned i)
{
    const check_job *j = ctx;
    if (!j->drop[i])
        j->rc[i] = wire_check(j->bufs[i], j->lens[i], &j->c->cfg.key, 0, &j->h[i], &j->payload[i]);
}

/* Whether every datagram of the batch is a fragment of a large forward: the
 * checks of those depend on nothing that taking the others changes (a
 * RUN_OPEN in the batch would change the link key the later ones need). */
static int batch_parallel(const duck_core *c, const uint8_t *const *bufs, const size_t *lens, unsigned n)
{
    size_t bytes = 0;
    for (unsigned i = 0; i < n; i++) {
        if (lens[i] < WIRE_HEADER_BYTES || bufs[i][offsetof(wire_header, type)] != WIRE_T_FORWARD)
            return 0;
        bytes += lens[i];
    }
    return c->pool && n > 1 && bytes >= DUCK_PAR_MIN_BYTES;
}

void core_batch(duck_core *c, const duck_peer *from, const uint8_t *const *bufs, const size_t *lens,
                const uint64_t *rx_ns, const uint8_t *drop, unsigned n)
{
    static int rc[CORE_BATCH_MAX];
    static wire_header h[CORE_BATCH_MAX];
    static const uint8_t *payload[CORE_BATCH_MAX];
    int par = n <= CORE_BATCH_MAX && batch_parallel(c, bufs, lens, n);
    if (par) {
        check_job j = {c, bufs, lens, drop, rc, h, payload};
        duck_pool_for(c->pool, n, check_one, &j);
    }
    for (unsigned i = 0; i < n && !c->shutdown; i++) {
        c->rx_ns = rx_ns[i];
        if (drop[i]) {   /* larger than any datagram of ours */
            c->stats.datagrams_rx++;
            c->stats.malformed++;
            continue;
        }
        if (fault_drop(c))
            continue;
        if (par)
            datagram_checked(c, &from[i], lens[i], rc[i], h[i], payload[i]);
        else
            core_datagram(c, &from[i], bufs[i], lens[i]);
    }
}

static void datagram_checked(duck_core *c, const duck_peer *from, size_t len, int rc, wire_header h,
                             const uint8_t *payload)
{
    c->stats.datagrams_rx++;
    c->mid_message = 0;
    c->dropped = 0;
    if (rc != WIRE_CHECK_OK) {
        uint64_t *counter = rc == WIRE_CHECK_MAC ? &c->stats.unauthenticated
                          : rc == WIRE_CHECK_LINK_MAC ? &c->stats.bad_mac
                          : rc == WIRE_CHECK_NO_LINK ? &c->stats.no_run : &c->stats.malformed;
        refuse(c, counter, wire_check_str(rc), from, len);
        return;
    }
    if (h.flags & WIRE_F_REPLY || h.type == WIRE_T_NACK) {
        refuse(c, &c->stats.malformed, "a reply sent to a duck", from, len);
        return;
    }
    if (needs_mac(c, h.type) && !(h.flags & WIRE_F_MAC)) {
        refuse(c, &c->stats.unauthenticated, "no MAC on a message that needs one", from, len);
        return;
    }
    if (h.type == WIRE_T_RESEND) {
        on_resend(c, from, &h, payload);
        return;
    }
    msg_key k = message_key(from, h.session, h.sequence, h.type);
    reply_slot *done = msgs_find_reply(&c->msgs, &k);
    if (done) {   /* answered to where the reply went first: a replay from elsewhere gets nothing */
        c->stats.duplicates++;
        if (h.frag_index == 0 && !reply_asked_before(c, done))
            reply_send(c, done, NULL, 0);
        return;
    }
    if (h.type == WIRE_T_FORWARD && hold_has(&c->held, &k)) {
        /* a copy of a held forward: its host waits for it (the group's last request was
         * lost or came first), so the held ones run now; the copy's other fragments
         * then find the reply */
        c->stats.duplicates++;
        hold_answer(c);
        return;
    }
    int windowed = wire_mac_kind(h.type) == WIRE_MAC_LINK && (h.flags & WIRE_F_MAC);
    if (windowed && !run_window_ok(c, h.sequence)) {
        refuse(c, &c->stats.replayed, "a sequence already taken or below the replay window (a replay)", from, len);
        return;
    }
    if (h.total_len > CONTROL_MESSAGE_MAX &&
        (h.type != WIRE_T_FORWARD || !c->session.id || h.session != c->session.id)) {
        refuse(c, &c->stats.malformed, "a message this large must be a forward of the open session", from, len);
        return;
    }
    reply_slot *r;
    c->from = *from;
    if (h.frag_count == 1) {
        if (windowed)
            run_window_take(c, h.sequence);
        fault_delay(c);
        r = handle_request(c, &k, &h, payload, h.payload_len);
    } else {
        int evicted = 0;
        reasm_slot *s = msgs_add_fragment(&c->msgs, &k, &h, payload, &evicted);
        if (evicted > 0)
            c->stats.stale++;
        if (evicted < 0)
            c->stats.malformed++;
        if (!s) {
            c->mid_message = evicted >= 0;
            return;
        }
        if (windowed)
            run_window_take(c, h.sequence);
        fault_delay(c);
        r = handle_request(c, &k, &h, s->buf, s->total_len);
        msgs_release(s);
    }
    if (r == REPLY_HELD)
        return;
    if (!r) {
        dlog(DLOG_ERROR, "no memory for the reply to %s seq %u", wire_type_str(h.type), h.sequence);
        return;
    }
    r->to = *from;
    reply_send(c, r, NULL, 0);
    r->sent_ns = duck_now_ns();
}
