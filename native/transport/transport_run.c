/* The scatter/gather loop: send every call's request (a group of calls with
 * one payload is sealed once), then receive, reassemble and retransmit
 * until each call has its reply or has passed the failure deadline. */
#define _GNU_SOURCE
#include "transport_impl.h"

#include <errno.h>
#include <stddef.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>

#define MID_MESSAGE_SPIN_US 50

/* --- receiving --------------------------------------------------------- */

static int32_t find_duck(const duck_transport *t, const struct sockaddr_in *from)
{
    for (uint32_t d = 0; d < t->cfg.n_ducks; d++)
        if (t->dest[d].sin_port == from->sin_port && t->dest[d].sin_addr.s_addr == from->sin_addr.s_addr)
            return (int32_t)d;
    return -1;
}

static void on_nack(duck_transport *t, const duck_call *c, call_state *s, const wire_header *h, const uint8_t *p)
{
    wire_nack nk;
    if (h->frag_count != 1 || h->payload_len < sizeof nk) {
        t->stats.malformed++;
        return;
    }
    memcpy(&nk, p, sizeof nk);
    t->stats.nacks++;
    if (nk.frag_count == 0) {
        tr_send_request(t, c, s, NULL);
    } else if (nk.frag_count == s->req_frags && h->payload_len == sizeof nk + (nk.frag_count + 7) / 8) {
        tr_send_request(t, c, s, p + sizeof nk);
    } else {
        t->stats.malformed++;
    }
}

/* Returns 1 when this datagram completed (or failed) a call. */
static int on_datagram(duck_transport *t, duck_call *calls, const uint8_t *buf, size_t len,
                       const struct sockaddr_in *from, uint64_t now)
{
    t->stats.datagrams_rx++;
    int32_t d = find_duck(t, from);
    if (d < 0 || t->active[d] < 0) {
        t->stats.stale++;
        return 0;
    }
    duck_call *c = &calls[t->active[d]];
    call_state *s = &t->st[t->active[d]];
    wire_header h;
    const uint8_t *p;
    int rc = wire_check(buf, len, &t->key, s->with_mac, &h, &p);
    if (rc != WIRE_CHECK_OK) {
        if (rc == WIRE_CHECK_MAC)
            t->stats.unauthenticated++;
        else
            t->stats.malformed++;
        return 0;
    }
    if (!(h.flags & WIRE_F_REPLY) || h.sequence != s->seq || h.session != c->session || s->done) {
        t->stats.stale++;
        return 0;
    }
    s->t_heard = now;
    if (h.type == WIRE_T_NACK) {
        on_nack(t, c, s, &h, p);
        return 0;
    }
    if (h.type != c->type) {
        t->stats.stale++;
        return 0;
    }
    if (s->rep_count == 0) {
        if (h.total_len > c->reply_cap) {
            c->result = DUCK_T_ETOOBIG;
            c->reply_len = h.total_len;
            s->done = 1;
            return 1;
        }
        s->rep_count = h.frag_count;
        s->rep_total = h.total_len;
        memset(s->bitmap, 0, (s->rep_count + 7) / 8);
    } else if (h.frag_count != s->rep_count || h.total_len != s->rep_total) {
        t->stats.malformed++;
        return 0;
    }
    uint32_t i = h.frag_index;
    if (s->bitmap[i / 8] & (1u << (i % 8)))
        return 0;
    s->bitmap[i / 8] |= (uint8_t)(1u << (i % 8));
    memcpy((uint8_t *)c->reply + (size_t)wire_frag_size(h.total_len, h.frag_count) * i, p, h.payload_len);
    if (++s->rep_have < s->rep_count) {
        t->mid_message = 1;
        return 0;
    }
    c->result = DUCK_T_OK;
    c->reply_len = s->rep_total;
    c->rtt_ns = now - s->t_start;
    s->done = 1;
    return 1;
}

static int receive(duck_transport *t, duck_call *calls, uint64_t wait_ns)
{
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH];
    struct sockaddr_in from[BATCH];
    for (int i = 0; i < BATCH; i++) {
        iov[i].iov_base = t->rx[i];
        iov[i].iov_len = sizeof t->rx[i];
        memset(&msgs[i], 0, sizeof msgs[i]);
        msgs[i].msg_hdr.msg_name = &from[i];
        msgs[i].msg_hdr.msg_namelen = sizeof from[i];
        msgs[i].msg_hdr.msg_iov = &iov[i];
        msgs[i].msg_hdr.msg_iovlen = 1;
    }
    int n = -1;
    uint64_t spin_us = t->cfg.spin_us;
    if (t->mid_message && spin_us < MID_MESSAGE_SPIN_US)
        spin_us = MID_MESSAGE_SPIN_US;   /* the rest of a reply is microseconds away */
    if (spin_us) {
        uint64_t until = tr_now_ns() + spin_us * 1000u;
        do
            n = recvmmsg(t->fd, msgs, BATCH, MSG_DONTWAIT, NULL);
        while (n < 0 && errno == EAGAIN && tr_now_ns() < until);
    }
    if (n < 0) {
        /* one blocking syscall per wake-up: the socket's receive timeout
         * (set only when the wait changes) bounds it for the timers */
        uint64_t wait_us = wait_ns / 1000u + 1;
        if (wait_us > t->rcvtimeo_us + t->rcvtimeo_us / 4 || wait_us < t->rcvtimeo_us / 2 || !t->rcvtimeo_us) {
            struct timeval tv = {(time_t)(wait_us / 1000000u), (suseconds_t)(wait_us % 1000000u)};
            setsockopt(t->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
            t->rcvtimeo_us = wait_us;
        }
        n = recvmmsg(t->fd, msgs, BATCH, MSG_WAITFORONE, NULL);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
                return 0;
            t->stats.last_errno = errno;
            return -1;
        }
    }
    int finished = 0;
    uint64_t now = tr_now_ns();
    t->mid_message = 0;
    for (int i = 0; i < n; i++)
        finished += on_datagram(t, calls, t->rx[i], msgs[i].msg_len, &from[i], now);
    return finished;
}

static int needs_mac(const duck_transport *t, uint32_t type)
{
    return type == WIRE_T_FORWARD ? t->cfg.mac_data
         : type != WIRE_T_HELLO && type != WIRE_T_PING && type != WIRE_T_STATS && type != WIRE_T_CACHE_QUERY;
}

int duck_transport_run(duck_transport *t, duck_call *calls, uint32_t n)
{
    uint32_t nd = t->cfg.n_ducks;
    static __thread size_t lens[WIRE_MAX_FRAGMENTS];
    static __thread uint32_t index[WIRE_MAX_FRAGMENTS];
    int result = DUCK_T_OK;
    for (uint32_t d = 0; d < nd; d++)
        t->active[d] = -1;
    for (uint32_t i = 0; i < n; i++) {
        duck_call *c = &calls[i];
        c->result = DUCK_T_EARG;
        c->reply_len = 0;
        c->retransmits = 0;
        c->rtt_ns = 0;
        if (c->duck >= nd || t->active[c->duck] >= 0 || c->type == 0 || c->type >= WIRE_T_COUNT ||
            c->payload_len > WIRE_MAX_MESSAGE || (c->payload_len && !c->payload) || !c->reply ||
            c->reply_cap < sizeof(wire_reply_head) || tr_frag_count(t, c->payload_len) > WIRE_MAX_FRAGMENTS) {
            for (uint32_t d = 0; d < nd; d++)
                t->active[d] = -1;
            return DUCK_T_EARG;
        }
        t->active[c->duck] = (int32_t)i;
    }
    uint64_t start = tr_now_ns();
    uint32_t nseal = 0;
    for (uint32_t i = 0; i < n; i++) {
        duck_call *c = &calls[i];
        call_state *s = &t->st[i];
        int same = i > 0 && c->payload == calls[i - 1].payload && c->payload_len == calls[i - 1].payload_len &&
                   c->type == calls[i - 1].type && c->session == calls[i - 1].session;
        memset(s, 0, offsetof(call_state, bitmap));
        s->with_mac = needs_mac(t, c->type);
        s->req_frags = tr_frag_count(t, c->payload_len);
        s->seq = same ? t->st[i - 1].seq : ++t->seq;
        s->t_start = s->t_heard = start;
        s->interval = (uint64_t)t->cfg.retransmit_us * 1000u;
        s->t_next = start + s->interval;
        /* a scatter: the datagrams are sealed once and sent to every duck of the group */
        if (!same) {
            if (tr_seal_room(t, s->req_frags) != 0)
                return DUCK_T_EARG;
            nseal = tr_seal_request(t, c, s, NULL, lens, index);
        }
        for (uint32_t f = 0; f < nseal; f++)
            tr_tx_add(t, c->duck, t->seal + (size_t)f * (t->cfg.mtu + 64), lens[f]);
        if (i + 1 == n || !(c->payload == calls[i + 1].payload && c->type == calls[i + 1].type))
            tr_tx_flush(t);
    }
    t->stats.calls += n;
    uint32_t remaining = n;
    uint64_t deadline = (uint64_t)t->cfg.deadline_us * 1000u, cap = 8 * (uint64_t)t->cfg.retransmit_us * 1000u;
    while (remaining) {
        uint64_t now = tr_now_ns(), wake = now + deadline;
        for (uint32_t i = 0; i < n; i++) {
            call_state *s = &t->st[i];
            duck_call *c = &calls[i];
            if (s->done)
                continue;
            if (now - s->t_heard >= deadline) {
                c->result = DUCK_T_ETIMEOUT;
                s->done = 1;
                remaining--;
                t->stats.timeouts++;
                continue;
            }
            if (now >= s->t_next) {
                if (tr_seal_room(t, s->req_frags) != 0)
                    return DUCK_T_EARG;
                if (s->req_frags == 1 && s->rep_count == 0)
                    tr_send_request(t, c, s, NULL);   /* the duck answers a duplicate from its cache */
                else
                    tr_send_resend(t, c, s);
                c->retransmits++;
                t->stats.retransmits++;
                s->interval = s->interval * 2 < cap ? s->interval * 2 : cap;
                s->t_next = now + s->interval;
            }
            if (s->t_next < wake)
                wake = s->t_next;
            if (s->t_heard + deadline < wake)
                wake = s->t_heard + deadline;
        }
        if (!remaining)
            break;
        int r = receive(t, calls, wake > now ? wake - now : 0);
        if (r < 0) {
            for (uint32_t i = 0; i < n; i++)
                if (!t->st[i].done)
                    calls[i].result = DUCK_T_ESOCKET;
            break;
        }
        remaining -= (uint32_t)r;
    }
    for (uint32_t i = 0; i < n; i++) {
        t->active[calls[i].duck] = -1;
        if (calls[i].result != DUCK_T_OK && result == DUCK_T_OK)
            result = calls[i].result;
    }
    return result;
}
