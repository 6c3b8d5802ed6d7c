/* Host transport: the socket, the datagram size of each duck, and the
 * sealing and sending of requests. transport_run.c gathers and reassembles
 * replies and retransmits on a timer: a single-datagram request is sent
 * again; otherwise a RESEND probe is answered by the missing reply fragments
 * or by a NACK listing the request fragments the duck holds. */
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
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* Replies of every duck to the requests in flight arrive at once: 8 ducks x
 * 64 tokens x 7168 fp32 is 14.7 MB. Granted where the kernel allows
 * (CAP_NET_ADMIN or net.core.rmem_max); a forward sizes its requests and
 * the requests in flight by what was granted (transport_forward.c). */
#define SOCKET_BUFFER (64 << 20)

static uint32_t route_mtu(const struct sockaddr_in *to);

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
    if (cfg->mtu && (cfg->mtu < WIRE_MTU_MIN || cfg->mtu > WIRE_MTU_MAX))
        FAIL("mtu %u is outside %d..%d (0: no ceiling)", cfg->mtu, WIRE_MTU_MIN, WIRE_MTU_MAX);
    if (!cfg->retransmit_us || cfg->deadline_us < cfg->retransmit_us)
        FAIL("retransmit (%u us) must be > 0 and no longer than the deadline (%u us)", cfg->retransmit_us,
             cfg->deadline_us);
    memcpy(t->key.bytes, cfg->key, cfg->key_len);
    t->key.len = cfg->key_len;
    if (getrandom(t->run, sizeof t->run, 0) != (ssize_t)sizeof t->run)
        FAIL("getrandom: %s", strerror(errno));
    t->cfg.addrs = NULL;
    t->cfg.ports = NULL;
    t->cfg.key = NULL;
    t->dest = calloc(n, sizeof *t->dest);
    t->link = calloc(n, sizeof *t->link);
    t->keys = calloc(n, sizeof *t->keys);
    t->active = malloc(n * sizeof *t->active);
    t->st = calloc(n, sizeof *t->st);
    t->st_cap = n;
    t->rx = malloc(BATCH * sizeof *t->rx);
    if (!t->dest || !t->link || !t->keys || !t->active || !t->st || !t->rx)
        FAIL("out of memory for %u ducks", n);
    for (int i = 0; i < BATCH; i++) {
        t->rx_iov[i].iov_base = t->rx[i];
        t->rx_iov[i].iov_len = sizeof t->rx[i];
        t->rx_msgs[i].msg_hdr.msg_name = &t->rx_from[i];
        t->rx_msgs[i].msg_hdr.msg_namelen = sizeof t->rx_from[i];
        t->rx_msgs[i].msg_hdr.msg_iov = &t->rx_iov[i];
        t->rx_msgs[i].msg_hdr.msg_iovlen = 1;
    }
    for (uint32_t d = 0; d < n; d++) {
        t->dest[d].sin_family = AF_INET;
        t->dest[d].sin_addr.s_addr = cfg->addrs[d];
        t->dest[d].sin_port = htons(cfg->ports[d]);
        t->active[d] = -1;
        if (!cfg->ports[d])
            FAIL("duck %u has port 0", d);
        t->link[d].path_mtu = route_mtu(&t->dest[d]);
        t->link[d].mtu = tr_small_mtu(t);
        t->keys[d] = t->key;   /* no link until a RUN_OPEN (duck_transport_link) */
    }
    t->fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (t->fd < 0)
        FAIL("socket: %s", strerror(errno));
    int want = cfg->rcvbuf ? (int)(cfg->rcvbuf < (1u << 30) ? cfg->rcvbuf : (1u << 30)) : SOCKET_BUFFER;
    if (setsockopt(t->fd, SOL_SOCKET, SO_RCVBUFFORCE, &want, sizeof want) != 0)
        setsockopt(t->fd, SOL_SOCKET, SO_RCVBUF, &want, sizeof want);
    if (setsockopt(t->fd, SOL_SOCKET, SO_SNDBUFFORCE, &want, sizeof want) != 0)
        setsockopt(t->fd, SOL_SOCKET, SO_SNDBUF, &want, sizeof want);
    int got = 0;
    socklen_t optlen = sizeof got;
    getsockopt(t->fd, SOL_SOCKET, SO_RCVBUF, &got, &optlen);
    t->rcvbuf = got > 0 ? (uint32_t)got : 0;
    struct sockaddr_in any = {0};
    any.sin_family = AF_INET;
    socklen_t len = sizeof any;
    if (bind(t->fd, (struct sockaddr *)&any, sizeof any) != 0 || getsockname(t->fd, (struct sockaddr *)&any, &len))
        FAIL("bind: %s", strerror(errno));
    t->local_port = ntohs(any.sin_port);
    uint32_t start;   /* a restarted host does not reuse the old ids; 2^31 and more are left before a wrap */
    if (getrandom(&start, sizeof start, 0) != (ssize_t)sizeof start)
        FAIL("getrandom: %s", strerror(errno));
    t->seq = (start >> 1) | 1u;
    return t;
#undef FAIL
}

void duck_transport_destroy(duck_transport *t)
{
    if (!t)
        return;
    if (t->fd >= 0)
        close(t->fd);
    for (uint32_t i = 0; t->replies && i < t->fwd_slots * t->cfg.n_ducks; i++)
        free(t->replies[i]);
    for (uint32_t s = 0; t->fwd && s < t->fwd_slots; s++) {
        free(t->fwd[s].payload);
        free(t->fwd[s].replica_payload);
    }
    if (t->pool)
        duck_pool_destroy(t->pool);
    free(t->slice_bytes);
    free(t->replica);
    free(t->route);
    free(t->replies);
    free(t->reply_caps);
    free(t->fcalls);
    free(t->dest);
    free(t->link);
    if (t->keys)
        memset(t->keys, 0, (size_t)t->cfg.n_ducks * sizeof *t->keys);
    free(t->keys);
    memset(&t->key, 0, sizeof t->key);
    free(t->active);
    free(t->acc);
    free(t->st);
    free(t->rx);
    free(t->seal);
    free(t->fwd);
    free(t);
}

uint32_t duck_transport_ducks(const duck_transport *t) { return t->cfg.n_ducks; }
uint16_t duck_transport_local_port(const duck_transport *t) { return t->local_port; }
void duck_transport_stats_get(const duck_transport *t, duck_transport_stats *out) { *out = t->stats; }
uint32_t duck_transport_rcvbuf(const duck_transport *t) { return t->rcvbuf; }

/* --- the run ------------------------------------------------------------- */

void duck_transport_run_nonce(const duck_transport *t, uint8_t *out) { memcpy(out, t->run, sizeof t->run); }

int duck_transport_link(duck_transport *t, uint32_t duck, const uint8_t *challenge)
{
    if (duck >= t->cfg.n_ducks)
        return DUCK_T_EARG;
    wire_link_set(&t->keys[duck], t->run, challenge);
    return DUCK_T_OK;
}

int duck_transport_linked(const duck_transport *t, uint32_t duck)
{
    return duck < t->cfg.n_ducks && t->keys[duck].has_link;
}

void duck_transport_key(const duck_transport *t, uint32_t duck, wire_key *out)
{
    *out = duck < t->cfg.n_ducks ? t->keys[duck] : t->key;
}

uint32_t duck_transport_take_sequence(duck_transport *t) { return ++t->seq; }

void duck_transport_unlink(duck_transport *t, uint32_t duck)
{
    if (duck < t->cfg.n_ducks)
        t->keys[duck] = t->key;
}

/* --- datagram size ------------------------------------------------------- */

/* The MTU of the route to a duck: a connected UDP socket's IP_MTU (65536 on
 * loopback, the NIC's on a LAN); 0 when there is no route. */
static uint32_t route_mtu(const struct sockaddr_in *to)
{
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return 0;
    int mtu = 0;
    socklen_t len = sizeof mtu;
    if (connect(fd, (const struct sockaddr *)to, sizeof *to) != 0 ||
        getsockopt(fd, IPPROTO_IP, IP_MTU, &mtu, &len) != 0 || mtu <= 0)
        mtu = 0;
    close(fd);
    return (uint32_t)mtu;
}

uint32_t tr_small_mtu(const duck_transport *t)
{
    return t->cfg.mtu && t->cfg.mtu < WIRE_MTU_DEFAULT ? t->cfg.mtu : WIRE_MTU_DEFAULT;
}

uint32_t duck_transport_agree(duck_transport *t, uint32_t duck, uint32_t duck_mtu)
{
    if (duck >= t->cfg.n_ducks)
        return 0;
    uint32_t m = duck_mtu < WIRE_MTU_MIN ? WIRE_MTU_MIN : duck_mtu > WIRE_MTU_MAX ? WIRE_MTU_MAX : duck_mtu;
    uint32_t path = t->link[duck].path_mtu;
    if (path && path < m)
        m = path < WIRE_MTU_MIN ? WIRE_MTU_MIN : path;
    if (t->cfg.mtu && t->cfg.mtu < m)
        m = t->cfg.mtu;
    t->link[duck].mtu = m;
    return m;
}

uint32_t duck_transport_mtu(const duck_transport *t, uint32_t duck)
{
    return duck < t->cfg.n_ducks ? t->link[duck].mtu : 0;
}

uint32_t duck_transport_path_mtu(const duck_transport *t, uint32_t duck)
{
    return duck < t->cfg.n_ducks ? t->link[duck].path_mtu : 0;
}

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

/* Where a request states the largest reply datagram the host takes: the
 * transport writes the call's datagram size there when it seals fragment 0. */
static void state_reply_mtu(uint32_t type, uint8_t *payload, uint32_t len, uint32_t mtu)
{
    uint16_t v = (uint16_t)mtu;
    if (type == WIRE_T_FORWARD && len >= sizeof(wire_forward))
        memcpy(payload + offsetof(wire_forward, reply_mtu), &v, sizeof v);
    else if (type == WIRE_T_PING && len >= sizeof(wire_ping))
        memcpy(payload + offsetof(wire_ping, reply_mtu), &v, sizeof v);
}

typedef struct seal_job {
    duck_transport *t;
    const duck_call *c;
    const call_state *s;
    uint8_t *out;                 /* the first datagram's place; stride apart */
    size_t stride, *lens;
    uint32_t fsize;
    const uint16_t *frags;        /* the fragment each place holds */
} seal_job;

static void seal_one(void *ctx, uint32_t n)
{
    const seal_job *j = ctx;
    const duck_call *c = j->c;
    uint32_t i = j->frags[n], off = j->fsize * i;
    uint32_t len = c->payload_len - off < j->fsize ? c->payload_len - off : j->fsize;
    uint8_t *out = j->out + (size_t)n * j->stride;
    if (len)
        memcpy(out + WIRE_HEADER_BYTES, (const uint8_t *)c->payload + off, len);
    if (i == 0)
        state_reply_mtu(c->type, out + WIRE_HEADER_BYTES, len, j->s->mtu);
    wire_header h = {0};
    h.type = (uint8_t)c->type;
    h.flags = j->s->twice ? WIRE_F_TWICE : 0;
    h.session = c->session;
    h.sequence = j->s->seq;
    h.frag_count = (uint16_t)j->s->req_frags;
    h.frag_index = (uint16_t)i;
    h.total_len = c->payload_len;
    j->lens[n] = wire_seal_in_place(&h, len, &j->t->keys[c->duck], j->s->with_mac, out);
}

uint32_t tr_seal_request(duck_transport *t, const duck_call *c, const call_state *s, const uint8_t *have,
                         size_t *lens, size_t *at)
{
    static __thread uint16_t frags[WIRE_MAX_FRAGMENTS];
    size_t stride = (size_t)s->mtu + 64, need = (size_t)s->req_frags * stride;
    if (*at + need > t->seal_cap) {
        tr_tx_flush(t);   /* what is queued points into the buffer */
        *at = 0;
        if (!tr_seal_reserve(t, need))
            return 0;
    }
    t->seal_stride = stride;
    uint32_t fsize = wire_frag_size(c->payload_len, s->req_frags), n = 0;
    for (uint32_t i = 0; i < s->req_frags; i++)
        if (!have || !(have[i / 8] & (1u << (i % 8))))
            frags[n++] = (uint16_t)i;
    seal_job job = {t, c, s, t->seal + *at, stride, lens, fsize, frags};
    tr_parallel(t, n, (size_t)n * fsize, seal_one, &job);
    return n;
}

int tr_seal_reserve(duck_transport *t, size_t bytes)
{
    if (bytes <= t->seal_cap)
        return 1;
    uint8_t *p = realloc(t->seal, bytes);
    if (!p)
        return 0;
    t->seal = p;
    t->seal_cap = bytes;
    return 1;
}

void tr_send_request(duck_transport *t, const duck_call *c, const call_state *s, const uint8_t *have)
{
    static __thread size_t lens[WIRE_MAX_FRAGMENTS];
    size_t at = 0;
    tr_tx_flush(t);
    uint32_t n = tr_seal_request(t, c, s, have, lens, &at);
    tr_tx_sealed(t, c->duck, at, lens, n, s->twice);
    tr_tx_flush(t);
}

void tr_tx_sealed(duck_transport *t, uint32_t duck, size_t at, const size_t *lens, uint32_t n, int twice)
{
    for (int copy = 0; copy <= twice; copy++)
        for (uint32_t i = 0; i < n; i++)
            tr_tx_add(t, duck, t->seal + at + (size_t)i * t->seal_stride, lens[i]);
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
    size_t len = wire_seal(&h, payload, h.total_len, &t->keys[c->duck], s->with_mac, dgram);
    for (int copy = 0; copy <= s->twice; copy++)
        tr_tx_add(t, c->duck, dgram, len);
    tr_tx_flush(t);
    t->stats.resend_requests++;
}

