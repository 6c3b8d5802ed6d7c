/* Host transport: the socket, and the sealing and sending of requests.
 * transport_run.c gathers and reassembles replies and retransmits on a
 * deadline: a single-datagram request is sent again; otherwise a RESEND
 * probe is answered by the missing reply fragments or by a NACK listing
 * the request fragments the duck holds. */
#define _GNU_SOURCE
#include "transport_impl.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define SOCKET_BUFFER (16 << 20)

uint64_t tr_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

duck_transport *duck_transport_create(const duck_transport_config *cfg, char *err, uint32_t errlen)
{
#define FAIL(...) do { snprintf(err, errlen, __VA_ARGS__); duck_transport_destroy(t); return NULL; } while (0)
    duck_transport *t = calloc(1, sizeof *t);
    if (!t) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    t->fd = -1;
    t->cfg = *cfg;
    uint32_t n = cfg->n_ducks;
    if (n == 0 || n > 65536)
        FAIL("a fleet has 1..65536 ducks, got %u", n);
    if (cfg->key_len < WIRE_KEY_MIN || cfg->key_len > WIRE_KEY_MAX)
        FAIL("the shared key is %u bytes; it must be %d..%d", cfg->key_len, WIRE_KEY_MIN, WIRE_KEY_MAX);
    if (cfg->mtu < WIRE_MTU_MIN || cfg->mtu > WIRE_MTU_MAX)
        FAIL("mtu %u is outside %d..%d", cfg->mtu, WIRE_MTU_MIN, WIRE_MTU_MAX);
    if (!cfg->retransmit_us || cfg->deadline_us < cfg->retransmit_us)
        FAIL("retransmit (%u us) must be > 0 and no longer than the deadline (%u us)", cfg->retransmit_us,
             cfg->deadline_us);
    memcpy(t->key.bytes, cfg->key, cfg->key_len);
    t->key.len = cfg->key_len;
    t->cfg.addrs = NULL;
    t->cfg.ports = NULL;
    t->cfg.key = NULL;
    t->dest = calloc(n, sizeof *t->dest);
    t->active = malloc(n * sizeof *t->active);
    t->st = calloc(n, sizeof *t->st);
    t->rx = malloc(BATCH * sizeof *t->rx);
    t->replies = calloc(n, sizeof *t->replies);
    t->reply_caps = calloc(n, sizeof *t->reply_caps);
    t->fcalls = calloc(n, sizeof *t->fcalls);
    if (!t->dest || !t->active || !t->st || !t->rx || !t->replies || !t->reply_caps || !t->fcalls)
        FAIL("out of memory for %u ducks", n);
    for (uint32_t d = 0; d < n; d++) {
        t->dest[d].sin_family = AF_INET;
        t->dest[d].sin_addr.s_addr = cfg->addrs[d];
        t->dest[d].sin_port = htons(cfg->ports[d]);
        t->active[d] = -1;
        if (!cfg->ports[d])
            FAIL("duck %u has port 0", d);
    }
    t->fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (t->fd < 0)
        FAIL("socket: %s", strerror(errno));
    int want = SOCKET_BUFFER;
    if (setsockopt(t->fd, SOL_SOCKET, SO_RCVBUFFORCE, &want, sizeof want) != 0)
        setsockopt(t->fd, SOL_SOCKET, SO_RCVBUF, &want, sizeof want);
    if (setsockopt(t->fd, SOL_SOCKET, SO_SNDBUFFORCE, &want, sizeof want) != 0)
        setsockopt(t->fd, SOL_SOCKET, SO_SNDBUF, &want, sizeof want);
    struct sockaddr_in any = {0};
    any.sin_family = AF_INET;
    socklen_t len = sizeof any;
    if (bind(t->fd, (struct sockaddr *)&any, sizeof any) != 0 || getsockname(t->fd, (struct sockaddr *)&any, &len))
        FAIL("bind: %s", strerror(errno));
    t->local_port = ntohs(any.sin_port);
    uint64_t seed = tr_now_ns() ^ ((uint64_t)getpid() << 32);
    t->seq = (uint32_t)(seed ^ (seed >> 29)) | 1u;   /* a restarted host does not reuse the old ids */
    return t;
#undef FAIL
}

void duck_transport_destroy(duck_transport *t)
{
    if (!t)
        return;
    if (t->fd >= 0)
        close(t->fd);
    for (uint32_t d = 0; t->replies && d < t->cfg.n_ducks; d++)
        free(t->replies[d]);
    free(t->replies);
    free(t->reply_caps);
    free(t->fcalls);
    free(t->dest);
    free(t->active);
    free(t->st);
    free(t->rx);
    free(t->seal);
    free(t->fwd);
    free(t);
}

uint32_t duck_transport_ducks(const duck_transport *t) { return t->cfg.n_ducks; }
uint16_t duck_transport_local_port(const duck_transport *t) { return t->local_port; }
void duck_transport_stats_get(const duck_transport *t, duck_transport_stats *out) { *out = t->stats; }

/* --- sending ----------------------------------------------------------- */

void tr_tx_flush(duck_transport *t)
{
    unsigned sent = 0;
    int spins = 0;
    while (sent < t->tx_n) {
        int r = sendmmsg(t->fd, t->tx_msgs + sent, t->tx_n - sent, MSG_DONTWAIT);
        if (r > 0) {
            sent += (unsigned)r;
            continue;
        }
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == EAGAIN || errno == ENOBUFS) && ++spins < 1000) {
            struct pollfd p = {t->fd, POLLOUT, 0};
            poll(&p, 1, 1);
            continue;
        }
        t->stats.last_errno = errno;   /* what is lost is retransmitted on the deadline */
        break;
    }
    t->stats.datagrams_tx += sent;
    t->tx_n = 0;
}

void tr_tx_add(duck_transport *t, uint32_t duck, uint8_t *dgram, size_t len)
{
    struct mmsghdr *m = &t->tx_msgs[t->tx_n];
    memset(m, 0, sizeof *m);
    t->tx_iov[t->tx_n].iov_base = dgram;
    t->tx_iov[t->tx_n].iov_len = len;
    m->msg_hdr.msg_name = &t->dest[duck];
    m->msg_hdr.msg_namelen = sizeof t->dest[duck];
    m->msg_hdr.msg_iov = &t->tx_iov[t->tx_n];
    m->msg_hdr.msg_iovlen = 1;
    if (++t->tx_n == BATCH)
        tr_tx_flush(t);
}

int tr_seal_room(duck_transport *t, uint32_t frags)
{
    size_t need = (size_t)frags * (t->cfg.mtu + 64);
    if (need <= t->seal_cap)
        return 0;
    uint8_t *p = realloc(t->seal, need);
    if (!p)
        return -1;
    t->seal = p;
    t->seal_cap = need;
    return 0;
}

uint32_t tr_frag_count(const duck_transport *t, uint32_t total)
{
    uint32_t maxp = wire_max_payload(t->cfg.mtu, 1);
    return total ? (total + maxp - 1) / maxp : 1;
}

/* Seals the fragments of a call's request (those not set in `have`, or all)
 * into t->seal; returns how many, with their lengths in lens. */
uint32_t tr_seal_request(duck_transport *t, const duck_call *c, const call_state *s, const uint8_t *have,
                             size_t *lens, uint32_t *index)
{
    wire_header h = {0};
    h.type = (uint8_t)c->type;
    h.session = c->session;
    h.sequence = s->seq;
    h.frag_count = (uint16_t)s->req_frags;
    h.total_len = c->payload_len;
    uint32_t fsize = wire_frag_size(c->payload_len, s->req_frags), n = 0;
    for (uint32_t i = 0; i < s->req_frags; i++) {
        if (have && (have[i / 8] & (1u << (i % 8))))
            continue;
        uint32_t off = fsize * i, len = c->payload_len - off < fsize ? c->payload_len - off : fsize;
        h.frag_index = (uint16_t)i;
        lens[n] = wire_seal(&h, (const uint8_t *)c->payload + off, len, &t->key, s->with_mac,
                            t->seal + (size_t)n * (t->cfg.mtu + 64));
        index[n++] = i;
    }
    return n;
}

void tr_send_request(duck_transport *t, const duck_call *c, const call_state *s, const uint8_t *have)
{
    static __thread size_t lens[WIRE_MAX_FRAGMENTS];
    static __thread uint32_t index[WIRE_MAX_FRAGMENTS];
    uint32_t n = tr_seal_request(t, c, s, have, lens, index);
    for (uint32_t i = 0; i < n; i++)
        tr_tx_add(t, c->duck, t->seal + (size_t)i * (t->cfg.mtu + 64), lens[i]);
    tr_tx_flush(t);
}

void tr_send_resend(duck_transport *t, const duck_call *c, const call_state *s)
{
    uint8_t payload[sizeof(wire_resend) + WIRE_MAX_FRAGMENTS / 8], dgram[WIRE_MAX_DATAGRAM];
    wire_resend rs = {0};
    rs.sequence = s->seq;
    rs.type = (uint8_t)c->type;
    rs.reply_frags = s->rep_count;
    memcpy(payload, &rs, sizeof rs);
    uint32_t bytes = (s->rep_count + 7) / 8;
    memcpy(payload + sizeof rs, s->bitmap, bytes);
    wire_header h = {0};
    h.type = WIRE_T_RESEND;
    h.session = c->session;
    h.sequence = s->seq;
    h.frag_count = 1;
    h.total_len = (uint32_t)sizeof rs + bytes;
    size_t len = wire_seal(&h, payload, h.total_len, &t->key, s->with_mac, dgram);
    tr_tx_add(t, c->duck, dgram, len);
    tr_tx_flush(t);
    t->stats.resend_requests++;
}

