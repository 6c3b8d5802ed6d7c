/* A request's reply: made in the last-reply cache (reasm.c keeps it for
 * duplicates and RESENDs), sealed into datagrams of the size the host takes,
 * and sent, twice where the request asked (WIRE_F_TWICE); and the NACK that
 * names a request's missing fragments. core.c, handlers.c and forward.c
 * answer through here; nothing here reads a request. */
#define _POSIX_C_SOURCE 200809L
#include "duckfw.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

uint32_t reply_default_mtu(const duck_core *c) { return wire_reply_mtu(0, c->cfg.mtu); }

reply_slot *reply_new(duck_core *c, const msg_key *k, const wire_header *h, uint32_t body)
{
    uint32_t room = body > WIRE_MAX_ERROR_TEXT + 1 ? body : WIRE_MAX_ERROR_TEXT + 1;
    reply_slot *r = msgs_take_reply(&c->msgs, k, (uint32_t)sizeof(wire_reply_head) + room);
    if (!r)
        return NULL;
    r->with_mac = (h->flags & WIRE_F_MAC) != 0;
    r->twice = (h->flags & WIRE_F_TWICE) != 0;
    r->mtu = reply_default_mtu(c);
    memset(r->buf, 0, sizeof(wire_reply_head));
    r->len = (uint32_t)sizeof(wire_reply_head) + body;
    return r;
}

uint8_t *reply_body(reply_slot *r) { return r->buf + sizeof(wire_reply_head); }

reply_slot *reply_fail(reply_slot *r, int status, const char *fmt, ...)
{
    wire_reply_head head = {status, 0};
    memcpy(r->buf, &head, sizeof head);
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf((char *)reply_body(r), WIRE_MAX_ERROR_TEXT + 1, fmt, ap);
    va_end(ap);
    n = n < 0 ? 0 : n > WIRE_MAX_ERROR_TEXT ? WIRE_MAX_ERROR_TEXT : n;
    r->len = (uint32_t)sizeof head + (uint32_t)n;
    dlog(DLOG_WARN, "%s seq %u refused: %s", wire_type_str(r->key.type), r->key.sequence, (char *)reply_body(r));
    return r;
}

/* Whether the datagram in hand arrived before reply r was first sent: a
 * RESEND or duplicate the host sent while this duck computed (its timer
 * does not know how long a large forward takes). The reply that was just
 * sent answers it; sending the reply again would only double the traffic. */
int reply_asked_before(const duck_core *c, const reply_slot *r)
{
    return c->rx_ns && r->sent_ns && c->rx_ns < r->sent_ns;
}

typedef struct seal_job {
    const duck_core *c;
    const wire_header *base;
    const uint8_t *payload;
    uint32_t total, count, fsize;
    int with_mac;
    const uint32_t *frags;        /* the fragment each place of the batch holds */
} seal_job;

static void seal_one(void *ctx, unsigned k)
{
    const seal_job *j = ctx;
    const duck_core *c = j->c;
    uint32_t i = j->frags[k], off = j->fsize * i, len = j->total - off < j->fsize ? j->total - off : j->fsize;
    wire_header h = *j->base;
    h.frag_index = (uint16_t)i;
    h.frag_count = (uint16_t)j->count;
    h.total_len = j->total;
    c->out_lens[k] = wire_seal(&h, j->payload + off, len, &c->cfg.key, j->with_mac,
                               c->out + (size_t)k * (c->cfg.mtu + 64));
}

/* Seals fragments [0, count) of one message in datagrams of at most mtu
 * bytes, skipping those marked in `have`, and sends them in batches; a large
 * message's batches are sealed over the pool (a prefill chunk's partial).
 * twice: each batch goes twice, the copies after the batch (a lossy link's
 * reply: a datagram is lost only when both copies are). */
static void send_message(duck_core *c, const duck_peer *to, const wire_header *base, const uint8_t *payload,
                         uint32_t total, uint32_t mtu, int with_mac, const uint8_t *have, uint32_t have_bits,
                         int twice)
{
    uint32_t count = wire_frag_count(total, mtu);
    uint32_t fsize = wire_frag_size(total, count);
    uint32_t frags[DUCK_SEND_BATCH];
    if (have && have_bits != count)
        have = NULL;   /* the peer's view of the geometry is not ours: send all */
    int par = c->pool && total >= DUCK_PAR_MIN_BYTES;
    seal_job j = {c, base, payload, total, count, fsize, with_mac, frags};
    for (uint32_t i = 0; i < count;) {
        unsigned n = 0;
        for (; i < count && n < DUCK_SEND_BATCH; i++)
            if (!have || !(have[i / 8] & (1u << (i % 8))))
                frags[n++] = i;
        duck_pool_for(par ? c->pool : NULL, n, seal_one, &j);
        unsigned m = 0;
        size_t *lens = c->out_lens + DUCK_SEND_BATCH;
        for (int copy = 0; copy <= (twice != 0); copy++)
            for (unsigned k = 0; k < n; k++) {
                if (fault_drop(c))
                    continue;
                c->out_ptrs[m] = c->out + (size_t)k * (c->cfg.mtu + 64);
                lens[m++] = c->out_lens[k];
            }
        if (m) {
            c->send(c->send_ctx, to, c->out_ptrs, lens, m);
            c->stats.datagrams_tx += m;
        }
    }
}

void reply_send(duck_core *c, const reply_slot *r, const uint8_t *have, uint32_t have_bits)
{
    wire_header h = {0};
    h.type = r->key.type;
    h.flags = WIRE_F_REPLY | (r->twice ? WIRE_F_TWICE : 0);   /* the host counts the copies: its link's loss */
    h.session = r->key.session;
    h.sequence = r->key.sequence;
    send_message(c, &r->to, &h, r->buf, r->len, r->mtu, r->with_mac, have, have_bits, r->twice);
}

void nack_send(duck_core *c, const duck_peer *to, const msg_key *k, const reasm_slot *s, int with_mac, int no_run)
{
    uint8_t buf[sizeof(wire_nack) + WIRE_MAX_FRAGMENTS / 8];
    wire_nack n = {0};
    n.sequence = k->sequence;
    n.type = k->type;
    n.frag_count = s ? s->frag_count : 0;
    if (!s && no_run)
        n.flags = WIRE_NACK_NO_RUN;
    memcpy(buf, &n, sizeof n);
    uint32_t bytes = s ? (s->frag_count + 7u) / 8u : 0;
    if (s)
        memcpy(buf + sizeof n, s->bitmap, bytes);
    wire_header h = {0};
    h.type = WIRE_T_NACK;
    h.flags = WIRE_F_REPLY;
    h.session = k->session;
    h.sequence = k->sequence;
    send_message(c, to, &h, buf, (uint32_t)sizeof n + bytes, reply_default_mtu(c), with_mac, NULL, 0, 0);
}
