/* The scatter/gather loop: send every call's request (calls with one payload
 * and one datagram size are sealed once), then receive, reassemble and
 * retransmit until each call has its reply or has passed the failure deadline.
 * The timers are transport_timing.c's. */
#define _GNU_SOURCE
#include "transport_impl.h"

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>

/* Once replies of a scatter have started to arrive, the others are
 * microseconds apart (fragments of one reply, or the other ducks'): poll for
 * them this long before blocking, rather than pay a sleep and a wake-up per
 * datagram (a context switch and an IPI on a VM: about 4 us each). */
#define GATHER_SPIN_US 50
/* Waits shorter than this block in ppoll (exact); longer ones in the socket's
 * receive timeout (one syscall per wake-up, to a scheduler tick). */
#define PRECISE_WAIT_NS (20u * 1000000u)

/* --- receiving --------------------------------------------------------- */

static int32_t find_duck(const duck_transport *t, const struct sockaddr_in *from)
{
    for (uint32_t d = 0; d < t->cfg.n_ducks; d++)
        if (t->dest[d].sin_port == from->sin_port && t->dest[d].sin_addr.s_addr == from->sin_addr.s_addr)
            return (int32_t)d;
    return -1;
}

/* The call of this run to duck d whose request had this sequence number; -1: none. */
static int32_t find_call(const duck_transport *t, int32_t d, uint32_t seq)
{
    for (int32_t i = d >= 0 ? t->active[d] : -1; i >= 0; i = t->st[i].next)
        if (t->st[i].seq == seq)
            return i;
    return -1;
}

/* A NACK: the duck lacks request fragments. It counts as hearing from the duck
 * (t_heard) only when it holds some of them: a duck that holds none after the
 * whole request went again (it evicted a taken request, or everything is
 * lost on the way) is as good as silent, and its lost deadline runs. One
 * that holds no run cannot take the request at all: the call fails now
 * (DUCK_T_ENORUN; a forward's duck is lost). Returns 1 when it ended the call. */
static int on_nack(duck_transport *t, duck_call *c, call_state *s, const wire_header *h, const uint8_t *p,
                   uint64_t now)
{
    wire_nack nk;
    if (h->frag_count != 1 || h->payload_len < sizeof nk) {
        t->stats.malformed++;
        return 0;
    }
    memcpy(&nk, p, sizeof nk);
    t->stats.nacks++;
    if (nk.flags & WIRE_NACK_NO_RUN) {
        if (!s->with_mac || wire_mac_kind(c->type) != WIRE_MAC_LINK || nk.frag_count) {
            t->stats.malformed++;   /* a request it could have taken, or one it says it holds part of */
            return 0;
        }
        c->result = DUCK_T_ENORUN;
        s->done = 1;
        t->stats.no_run++;
        return 1;
    }
    if (nk.frag_count == 0) {
        tr_send_request(t, c, s, NULL);
    } else if (nk.frag_count == s->req_frags && h->payload_len == sizeof nk + (nk.frag_count + 7) / 8) {
        int held = 0;
        for (uint32_t i = 0; i < (nk.frag_count + 7) / 8 && !held; i++)
            held = p[sizeof nk + i] != 0;
        if (held) {   /* our datagrams get through */
            s->progress = 1;
            s->t_heard = now;
        }
        tr_send_request(t, c, s, p + sizeof nk);
    } else {
        t->stats.malformed++;
    }
    return 0;
}

/* A received datagram, checked (on a helper thread when the batch is large):
 * its duck (-1: not one of ours), wire_check's result, header and payload. */
typedef struct rx_item {
    int32_t duck;
    int rc;
    wire_header h;
    const uint8_t *p;
    uint8_t *copy_to;             /* where its payload goes, once its call has taken it */
    int32_t completes;            /* the call it completed (its callback still due); -1: none */
} rx_item;

typedef struct rx_batch {
    duck_transport *t;
    rx_item *items;
    const uint32_t *lens;
} rx_batch;

static void check_one(void *ctx, uint32_t i)
{
    const rx_batch *b = ctx;
    duck_transport *t = b->t;
    rx_item *it = &b->items[i];
    it->duck = find_duck(t, &t->rx_from[i]);
    /* the MAC is checked against the call's need once the call is known */
    it->rc = it->duck >= 0 && t->active[it->duck] >= 0
             ? wire_check(t->rx[i], b->lens[i], &t->keys[it->duck], 0, &it->h, &it->p) : WIRE_CHECK_SHORT;
}

static void copy_one(void *ctx, uint32_t i)
{
    const rx_batch *b = ctx;
    const rx_item *it = &b->items[i];
    if (it->copy_to)
        memcpy(it->copy_to, it->p, it->h.payload_len);
}

/* A checked datagram's effect on its call: its payload's place in the reply
 * (it->copy_to; the copy is the caller's), and it->completes when it was the
 * call's last fragment. Returns 1 when it completed (or failed) a call. */
static int on_datagram(duck_transport *t, duck_call *calls, rx_item *it, uint64_t now)
{
    t->stats.datagrams_rx++;
    it->copy_to = NULL;
    it->completes = -1;
    int32_t d = it->duck;
    if (d < 0 || t->active[d] < 0) {
        t->stats.stale++;
        return 0;
    }
    const wire_header h = it->h;
    int rc = it->rc;
    int32_t found = rc == WIRE_CHECK_OK ? find_call(t, d, h.sequence) : -1;
    if (rc == WIRE_CHECK_OK && found >= 0 && t->st[found].with_mac && !(h.flags & WIRE_F_MAC))
        rc = WIRE_CHECK_MAC;
    if (rc != WIRE_CHECK_OK) {
        if (rc == WIRE_CHECK_MAC || rc == WIRE_CHECK_LINK_MAC || rc == WIRE_CHECK_NO_LINK)
            t->stats.unauthenticated++;
        else
            t->stats.malformed++;
        return 0;
    }
    if ((h.flags & (WIRE_F_REPLY | WIRE_F_TWICE)) == (WIRE_F_REPLY | WIRE_F_TWICE))
        tr_twice_copy(t, (uint32_t)d, h.sequence);   /* either copy, the second often after its call is done */
    uint32_t ci = (uint32_t)found;
    duck_call *c = found >= 0 ? &calls[ci] : NULL;
    call_state *s = found >= 0 ? &t->st[ci] : NULL;
    if (!c || !(h.flags & WIRE_F_REPLY) || h.session != c->session || s->done) {
        t->stats.stale++;
        return 0;
    }
    if (h.type == WIRE_T_NACK)
        return on_nack(t, c, s, &h, it->p, now);
    s->t_heard = now;
    if (h.type != c->type) {
        t->stats.stale++;
        return 0;
    }
    s->progress = 1;
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
    it->copy_to = (uint8_t *)c->reply + (size_t)wire_frag_size(h.total_len, h.frag_count) * i;
    if (++s->rep_have < s->rep_count)
        return 0;
    c->result = DUCK_T_OK;
    c->reply_len = s->rep_total;
    c->rtt_ns = now - s->t_start;
    s->done = 1;
    t->last_ok_ns = now;
    it->completes = (int32_t)ci;   /* its samples (the reply's kernel time) once the payload is in */
    return 1;
}

/* The datagrams recvmmsg gave: checked (CRC, MAC), taken by their calls, their
 * payloads copied into the replies, then the callbacks of the calls they
 * completed, in arrival order. The checks and the copies are shared out over
 * the helper threads when the batch is large (replies of a prefill chunk). */
static int take_batch(duck_transport *t, duck_call *calls, int n, tr_done_fn done, void *ctx)
{
    static __thread rx_item items[BATCH];
    static __thread uint32_t lens[BATCH];
    size_t bytes = 0;
    for (int i = 0; i < n; i++)
        bytes += lens[i] = t->rx_msgs[i].msg_len;
    rx_batch b = {t, items, lens};
    tr_parallel(t, (uint32_t)n, bytes, check_one, &b);
    int finished = 0;
    uint64_t now = tr_now_ns();
    for (int i = 0; i < n; i++)
        finished += on_datagram(t, calls, &items[i], now);
    tr_parallel(t, (uint32_t)n, bytes, copy_one, &b);
    /* the samples read the replies (the duck's kernel time), so they follow the copies; all of
     * them precede the callbacks, which may start calls again (their states anew) */
    for (int i = 0; i < n; i++) {
        t->rx_msgs[i].msg_hdr.msg_namelen = sizeof t->rx_from[i];   /* the kernel overwrote it */
        if (items[i].completes >= 0) {
            tr_rtt_sample(&t->link[items[i].duck], &calls[items[i].completes], &t->st[items[i].completes], now);
            tr_loss_sample(t, &calls[items[i].completes], &t->st[items[i].completes]);
        }
    }
    for (int i = 0; i < n; i++)
        if (items[i].completes >= 0) {
            __atomic_fetch_add(&t->progress, 1, __ATOMIC_RELAXED);
            if (done)
                done(t, calls, (uint32_t)items[i].completes, ctx);
        }
    return finished;
}

/* Takes what has arrived, waiting up to wait_ns for the first datagram
 * (nowait: not at all). Returns -1 when the socket failed. */
static int receive(duck_transport *t, duck_call *calls, uint64_t wait_ns, int nowait, tr_done_fn done, void *ctx)
{
    struct mmsghdr *msgs = t->rx_msgs;
    int n = -1;
    uint64_t spin_us = t->cfg.spin_us;
    if (t->gathering && spin_us < GATHER_SPIN_US)
        spin_us = GATHER_SPIN_US;
    if (nowait) {
        n = recvmmsg(t->fd, msgs, BATCH, MSG_DONTWAIT, NULL);
        if (n < 0)
            return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : (t->stats.last_errno = errno, -1);
    } else if (spin_us) {
        /* poll, yielding the CPU to anything else runnable on it (a duck sharing this core) */
        uint64_t until = tr_now_ns() + spin_us * 1000u;
        while ((n = recvmmsg(t->fd, msgs, BATCH, MSG_DONTWAIT, NULL)) < 0 && errno == EAGAIN &&
               tr_now_ns() < until)
            sched_yield();
    }
    if (n < 0 && wait_ns < PRECISE_WAIT_NS) {
        /* a short wait (a retransmit timer of a few ms): the socket's receive
         * timeout counts in scheduler ticks (4 ms at HZ=250, rounded up), which
         * would turn a 1 ms timer into 4..8 ms; ppoll's is exact */
        struct pollfd p = {t->fd, POLLIN, 0};
        struct timespec ts = {(time_t)(wait_ns / 1000000000u), (long)(wait_ns % 1000000000u)};
        int r = ppoll(&p, 1, &ts, NULL);
        if (r < 0 && errno != EINTR) {
            t->stats.last_errno = errno;
            return -1;
        }
        if (r <= 0)
            return 0;
        n = recvmmsg(t->fd, msgs, BATCH, MSG_DONTWAIT, NULL);
        if (n < 0)
            return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : (t->stats.last_errno = errno, -1);
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
    t->gathering = 1;
    return take_batch(t, calls, n, done, ctx);
}

/* Whether the host signs a request (wire_types): everything that may carry a MAC does, a forward
 * unless mac_data is off (a duck answers an unauthenticated HELLO with the bare minimum and
 * refuses what needs one without it: firmware/core.c needs_mac). */
static int needs_mac(const duck_transport *t, uint32_t type)
{
    int need = wire_mac_need(type);
    return need == WIRE_MAC_DATA ? t->cfg.mac_data : need != WIRE_MAC_NONE;
}

/* The agreed size did not get through (nothing of the reply, no request
 * fragment acknowledged): this duck uses the small size from now on, and
 * the call starts over as a new request, since the duck may hold the old
 * one in the other geometry. */
static void fall_back(duck_transport *t, duck_call *c, call_state *s, uint64_t now)
{
    uint32_t small = tr_small_mtu(t);
    t->link[c->duck].mtu = small;
    s->mtu = small;
    s->req_frags = wire_frag_count(c->payload_len, small);
    s->seq = ++t->seq;
    s->rep_count = s->rep_have = s->rep_total = 0;
    tr_start_timer(t, c, s, now);
    t->stats.mtu_fallbacks++;
    c->retransmits++;
    tr_send_request(t, c, s, NULL);
}

int duck_transport_run(duck_transport *t, duck_call *calls, uint32_t n)
{
    return tr_run(t, calls, n, NULL, NULL);
}

static int reserve_states(duck_transport *t, uint32_t n)
{
    if (n <= t->st_cap)
        return 0;
    call_state *st = realloc(t->st, (size_t)n * sizeof *st);
    if (!st)
        return -1;
    t->st = st;
    t->st_cap = n;
    return 0;
}

static int call_ok(const duck_transport *t, const duck_call *c)
{
    if (c->local)
        return c->duck < t->cfg.n_ducks && c->reply;
    if (c->duck < t->cfg.n_ducks && c->type < WIRE_T_COUNT && wire_mac_kind(c->type) == WIRE_MAC_LINK &&
        needs_mac(t, c->type) && !t->keys[c->duck].has_link)
        return 0;   /* no run open with this duck: its MAC cannot be made */
    return c->duck < t->cfg.n_ducks && c->type != 0 && c->type < WIRE_T_COUNT && c->payload_len <= WIRE_MAX_MESSAGE &&
           (!c->payload_len || c->payload) && c->reply && c->reply_cap >= sizeof(wire_reply_head) &&
           wire_frag_count(c->payload_len, tr_small_mtu(t)) <= WIRE_MAX_FRAGMENTS;
}

/* Starts calls [first, first + count): fresh state, a sequence number (one
 * for consecutive calls of one payload to different ducks, a scatter, sealed
 * once per datagram size), the timer, the request sent. A call sent while
 * another to its duck is in flight expects that one's compute too. A local
 * call (answered on the host) is done as it is: nothing is sent. */
static int send_calls(duck_transport *t, duck_call *calls, uint32_t first, uint32_t count, uint64_t now)
{
    static __thread size_t lens[WIRE_MAX_FRAGMENTS];
    uint32_t nseal = 0;
    int64_t sealed = -1;   /* the last call sent: its sequence number and seal may be shared */
    size_t at = 0, end = 0;   /* where the last seal went in t->seal, and where the next may go */
    /* Every duck's own seal (its link MAC) side by side, so that one sendmmsg
     * carries the whole scatter: sent duck by duck, the first duck woken would
     * preempt the host before the others have their request. Large messages
     * (prefill chunks) are sent as they are sealed. */
    size_t room = 0;
    for (uint32_t i = first; i < first + count; i++)
        if (!calls[i].local && calls[i].duck < t->cfg.n_ducks)
            room += (size_t)wire_frag_count(calls[i].payload_len, t->link[calls[i].duck].mtu) *
                    (t->link[calls[i].duck].mtu + 64);
    tr_tx_flush(t);
    if (room <= SEAL_BATCH_BYTES && !tr_seal_reserve(t, room))
        return -1;
    for (uint32_t i = first; i < first + count; i++) {
        duck_call *c = &calls[i];
        call_state *s = &t->st[i];
        int32_t next = s->next;
        memset(s, 0, offsetof(call_state, bitmap));
        s->next = next;
        if (c->local) {
            s->done = 1;
            continue;
        }
        const duck_call *prev = sealed >= 0 ? &calls[sealed] : NULL;
        int same_msg = prev && c->payload == prev->payload && c->payload_len == prev->payload_len &&
                       c->type == prev->type && c->session == prev->session && c->duck != prev->duck;
        c->result = DUCK_T_EARG;
        c->reply_len = 0;
        c->retransmits = 0;
        c->rtt_ns = 0;
        s->with_mac = needs_mac(t, c->type);
        s->mtu = t->link[c->duck].mtu;
        s->req_frags = wire_frag_count(c->payload_len, s->mtu);
        s->twice = tr_send_twice(t, c, s);
        s->seq = same_msg ? t->st[sealed].seq : ++t->seq;
        if (s->twice) {
            t->stats.twice_calls++;
            tr_twice_sent(t, c->duck, s->seq);
        }
        s->t_start = s->t_heard = now;
        uint64_t ahead = 0;   /* until the duck is through the calls in flight before this one */
        for (int32_t j = t->active[c->duck]; j >= 0; j = t->st[j].next) {
            const call_state *o = &t->st[j];
            if ((uint32_t)j == i || o->done)
                continue;
            uint64_t left = o->t_start + o->work_ns > now ? o->t_start + o->work_ns - now : 0;
            ahead = left > ahead ? left : ahead;
            s->queued = 1;
        }
        s->work_ns = c->work_ns + ahead;
        tr_start_timer(t, c, s, now);
        int own_mac = s->with_mac && wire_mac_kind(c->type) == WIRE_MAC_LINK;   /* each duck's link key */
        if (!same_msg || s->mtu != t->st[sealed].mtu || s->twice != t->st[sealed].twice || own_mac) {
            at = end;
            nseal = tr_seal_request(t, c, s, NULL, lens, &at);
            if (!nseal)
                return -1;
            end = at + (size_t)nseal * t->seal_stride;
        }
        sealed = i;
        tr_tx_sealed(t, c->duck, at, lens, nseal, s->twice);
    }
    tr_tx_flush(t);
    t->stats.calls += count;
    return 0;
}

int tr_restart(duck_transport *t, duck_call *calls, uint32_t first, uint32_t count)
{
    for (uint32_t i = first; i < first + count; i++)
        if (!call_ok(t, &calls[i]))
            return -1;
    return send_calls(t, calls, first, count, tr_now_ns());
}

/* The socket failed: every call still open fails with it. */
static void fail_open(duck_transport *t, duck_call *calls, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        if (!t->st[i].done) {
            calls[i].result = DUCK_T_ESOCKET;
            t->st[i].done = 1;
        }
}

int tr_run(duck_transport *t, duck_call *calls, uint32_t n, tr_done_fn done, void *ctx)
{
    uint32_t nd = t->cfg.n_ducks;
    int result = DUCK_T_OK;
    if (reserve_states(t, n) != 0)
        return DUCK_T_EARG;
    for (uint32_t d = 0; d < nd; d++)
        t->active[d] = -1;
    for (uint32_t i = n; i-- > 0;) {   /* each duck's calls chained in order */
        duck_call *c = &calls[i];
        if (!c->local)
            c->result = DUCK_T_EARG;
        if (!call_ok(t, c)) {
            for (uint32_t d = 0; d < nd; d++)
                t->active[d] = -1;
            return DUCK_T_EARG;
        }
        t->st[i].next = t->active[c->duck];
        t->active[c->duck] = (int32_t)i;
        t->st[i].done = 1;   /* not in flight until sent */
        t->st[i].work_ns = 0;
    }
    t->gathering = 0;   /* the first wait is as configured (a long layer may be computing) */
    if (send_calls(t, calls, 0, n, tr_now_ns()) != 0) {
        for (uint32_t d = 0; d < nd; d++)
            t->active[d] = -1;
        return DUCK_T_EARG;
    }
    uint64_t deadline = (uint64_t)t->cfg.deadline_us * 1000u, fallback_after = deadline / 4;
    uint32_t small = tr_small_mtu(t);
    int drained = 0;
    t->last_ok_ns = 0;
    for (;;) {
        uint64_t now = tr_now_ns(), wake = now + deadline;
        uint32_t remaining = 0, open = 0;
        for (uint32_t i = 0; i < n; i++)
            open += !t->st[i].done;
        /* the ducks of a tensor-parallel step answer together: once most calls of the run have
         * their replies, a silent one most likely lost a datagram, and waits a sibling's spread
         * for it, not its whole timer (once; later retransmits follow the timer) */
        int lone = n > 1 && 2 * open <= n && t->last_ok_ns;
        /* a timer due: take what is already in the socket first (a host that was not
         * scheduled for a while must not retransmit for, or give up on, replies it holds) */
        int due = 0;
        for (uint32_t i = 0; i < n && !drained && !due; i++)
            due = !t->st[i].done && (now >= t->st[i].t_next || now >= tr_fail_at(&calls[i], &t->st[i]));
        if (due) {
            drained = 1;
            if (receive(t, calls, 0, 1, done, ctx) >= 0)
                continue;
            fail_open(t, calls, n);
            break;
        }
        drained = 0;
        for (uint32_t i = 0; i < n; i++) {
            call_state *s = &t->st[i];
            duck_call *c = &calls[i];
            if (s->done)
                continue;
            uint64_t fail_at = tr_fail_at(c, s);
            if (c->type == WIRE_T_FORWARD && t->cover.forward && tr_hinted(t, c->duck)) {
                c->result = DUCK_T_ETIMEOUT;   /* the caller knows it is gone: lost now, not at its deadline */
                s->done = 1;
                t->stats.lost_hints++;
                continue;
            }
            if (now >= fail_at) {
                c->result = DUCK_T_ETIMEOUT;
                s->done = 1;
                t->stats.timeouts++;
                continue;
            }
            remaining++;
            if (lone && !c->retransmits && s->t_next > now) {
                uint64_t early = t->last_ok_ns + tr_sibling_wait_ns(t, c, s);
                if (early < s->t_next)
                    s->t_next = early > now ? early : now;
            }
            uint64_t fallback_at = s->t_start + fallback_after + s->work_ns;
            if (s->mtu > small && !s->progress && c->retransmits && now >= fallback_at) {
                fall_back(t, c, s, now);
            } else if (now >= s->t_next) {
                if (!c->retransmits && now < s->t_start + s->interval)
                    t->stats.early_retransmits++;
                if (s->req_frags == 1 && s->rep_count == 0)
                    tr_send_request(t, c, s, NULL);   /* the duck answers a duplicate from its cache */
                else
                    tr_send_resend(t, c, s);
                c->retransmits++;
                t->stats.retransmits++;
                s->interval = s->interval * 2 < s->cap ? s->interval * 2 : s->cap;
                s->t_next = now + s->interval;
            }
            if (s->t_next < wake)
                wake = s->t_next;
            if (s->mtu > small && !s->progress && c->retransmits && fallback_at < wake)
                wake = fallback_at > now ? fallback_at : now;
            if (fail_at < wake)
                wake = fail_at;
        }
        if (!remaining)
            break;
        if (t->cover.forward && wake > now + HINT_POLL_NS)
            wake = now + HINT_POLL_NS;
        if (receive(t, calls, wake > now ? wake - now : 0, 0, done, ctx) < 0) {
            fail_open(t, calls, n);
            break;
        }
    }
    for (uint32_t i = 0; i < n; i++) {
        t->active[calls[i].duck] = -1;
        if (calls[i].result != DUCK_T_OK && result == DUCK_T_OK)
            result = calls[i].result;
    }
    __atomic_fetch_add(&t->progress, 1, __ATOMIC_RELAXED);
    return result;
}
