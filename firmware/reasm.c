/* Reassembly of fragmented requests and the last-reply cache that makes
 * requests idempotent: a duplicate sequence is answered from here. */
#include "duckfw.h"

#include <stdlib.h>
#include <string.h>

static int key_eq(const msg_key *a, const msg_key *b)
{
    return a->peer.addr == b->peer.addr && a->peer.port == b->peer.port && a->session == b->session &&
           a->sequence == b->sequence && a->type == b->type;
}

static int grow(uint8_t **buf, uint32_t *cap, uint32_t need)
{
    if (need <= *cap && *buf)
        return 0;
    uint32_t n = need < 4096 ? 4096 : need;
    void *p = NULL;
    if (posix_memalign(&p, 64, n) != 0)
        return -1;
    free(*buf);
    *buf = p;
    *cap = n;
    return 0;
}

void msgs_free(duck_msgs *m)
{
    for (int i = 0; i < REASM_SLOTS; i++)
        free(m->rs[i].buf);
    for (int i = 0; i < REPLY_SLOTS; i++)
        free(m->rp[i].buf);
    memset(m, 0, sizeof *m);
}

reply_slot *msgs_find_reply(duck_msgs *m, const msg_key *k)
{
    for (int i = 0; i < REPLY_SLOTS; i++)
        if (m->rp[i].used && key_eq(&m->rp[i].key, k)) {
            m->rp[i].touched = ++m->clock;
            return &m->rp[i];
        }
    return NULL;
}

/* Buffers of the other reply slots are freed, least recently used first,
 * until they and `keep` (grown to need) fit REPLY_BUDGET. */
static void reply_room(duck_msgs *m, const reply_slot *keep, uint32_t need)
{
    for (;;) {
        uint64_t total = keep->cap > need ? keep->cap : need;
        reply_slot *victim = NULL;
        for (int i = 0; i < REPLY_SLOTS; i++) {
            reply_slot *r = &m->rp[i];
            if (r == keep || !r->buf)
                continue;
            total += r->cap;
            if (!victim || (victim->used && (!r->used || r->touched < victim->touched)))
                victim = r;
        }
        if (total <= REPLY_BUDGET || !victim)
            return;
        free(victim->buf);
        victim->buf = NULL;
        victim->cap = 0;
        victim->used = 0;   /* its duplicates are computed again */
    }
}

reply_slot *msgs_take_reply(duck_msgs *m, const msg_key *k, uint32_t cap)
{
    reply_slot *r = &m->rp[0];
    for (int i = 1; i < REPLY_SLOTS; i++)
        if (!m->rp[i].used || (r->used && m->rp[i].touched < r->touched))
            r = &m->rp[i];
    reply_room(m, r, cap);
    if (grow(&r->buf, &r->cap, cap) != 0)
        return NULL;
    r->used = 1;
    r->key = *k;
    r->len = 0;
    r->with_mac = 0;
    r->twice = 0;
    r->sent_ns = 0;
    r->to = k->peer;
    r->touched = ++m->clock;
    return r;
}

reasm_slot *msgs_find_reasm(duck_msgs *m, const msg_key *k)
{
    for (int i = 0; i < REASM_SLOTS; i++)
        if (m->rs[i].used && key_eq(&m->rs[i].key, k))
            return &m->rs[i];
    return NULL;
}

/* Buffers of the other reassembly slots are freed (idle ones first, then
 * the least recently touched incomplete messages, dropped) until they and
 * `keep` (grown to need) fit REASM_BUDGET. Returns 1 if a message was dropped. */
static int reasm_room(duck_msgs *m, const reasm_slot *keep, uint32_t need)
{
    int dropped = 0;
    for (;;) {
        uint64_t total = keep->cap > need ? keep->cap : need;
        reasm_slot *victim = NULL;
        for (int i = 0; i < REASM_SLOTS; i++) {
            reasm_slot *s = &m->rs[i];
            if (s == keep || !s->buf)
                continue;
            total += s->cap;
            if (!victim || (victim->used && (!s->used || s->touched < victim->touched)))
                victim = s;
        }
        if (total <= REASM_BUDGET || !victim)
            return dropped;
        dropped |= victim->used;
        free(victim->buf);
        victim->buf = NULL;
        victim->cap = 0;
        victim->used = 0;
    }
}

reasm_slot *msgs_add_fragment(duck_msgs *m, const msg_key *k, const wire_header *h,
                              const uint8_t *payload, int *evicted)
{
    *evicted = 0;
    reasm_slot *s = msgs_find_reasm(m, k);
    if (s && (s->total_len != h->total_len || s->frag_count != h->frag_count || s->flags != h->flags)) {
        *evicted = -1;   /* same id, other geometry: not ours to trust, drop */
        return NULL;
    }
    if (!s) {
        s = &m->rs[0];
        for (int i = 1; i < REASM_SLOTS; i++)
            if (!m->rs[i].used || (s->used && m->rs[i].touched < s->touched))
                s = &m->rs[i];
        *evicted = s->used | reasm_room(m, s, h->total_len);
        if (grow(&s->buf, &s->cap, h->total_len) != 0) {
            s->used = 0;
            return NULL;
        }
        s->used = 1;
        s->key = *k;
        s->frag_count = h->frag_count;
        s->total_len = h->total_len;
        s->flags = h->flags;
        s->received = 0;
        memset(s->bitmap, 0, (h->frag_count + 7) / 8);
    }
    s->touched = ++m->clock;
    uint32_t i = h->frag_index;
    if (!(s->bitmap[i / 8] & (1u << (i % 8)))) {
        /* wire_check proved offset + payload_len <= total_len */
        memcpy(s->buf + (size_t)wire_frag_size(h->total_len, h->frag_count) * i, payload, h->payload_len);
        s->bitmap[i / 8] |= (uint8_t)(1u << (i % 8));
        s->received++;
    }
    return s->received == s->frag_count ? s : NULL;
}

void msgs_release(reasm_slot *s) { s->used = 0; }
