/* Private to native/transport*.c: the transport's state. */
#ifndef DUCK_TRANSPORT_IMPL_H
#define DUCK_TRANSPORT_IMPL_H

#include <netinet/in.h>
#include <sys/socket.h>

#include "transport.h"

#define BATCH 64

/* What the transport knows of one duck across calls. */
typedef struct duck_link {
    uint32_t mtu;                 /* agreed datagram size (WIRE_MTU_DEFAULT until agreed) */
    uint32_t path_mtu;            /* the route's MTU to the duck (IP_MTU), 0 if unknown */
    uint64_t srtt_ns, rttvar_ns;  /* smoothed round trip and its variation (RFC 6298); 0: no sample */
    uint64_t backoff_ns;          /* the interval a retransmitted call completed in, kept until a clean sample */
} duck_link;

typedef struct call_state {
    uint32_t seq;
    int with_mac, done, progress; /* progress: a reply fragment, or a NACK holding request fragments */
    uint32_t mtu;                 /* datagram size of this call, both ways */
    uint32_t req_frags;
    uint64_t t_start, t_heard, t_next, interval, cap;
    uint32_t rep_count, rep_have, rep_total;
    uint8_t bitmap[WIRE_MAX_FRAGMENTS / 8];
} call_state;

struct duck_transport {
    duck_transport_config cfg;
    wire_key key;
    int fd;
    uint16_t local_port;
    uint32_t seq;
    uint32_t rcvbuf;              /* the socket's receive buffer as the kernel reports it */
    struct sockaddr_in *dest;
    duck_link *link;
    int32_t *active;              /* duck -> call index during a run */
    call_state *st;
    uint8_t *seal;                /* sealed datagrams of one message, seal_stride apart */
    size_t seal_cap, seal_stride;
    uint8_t (*rx)[WIRE_MAX_DATAGRAM + 1];
    struct mmsghdr rx_msgs[BATCH];    /* pointing at rx, set up once */
    struct iovec rx_iov[BATCH];
    struct sockaddr_in rx_from[BATCH];
    struct mmsghdr tx_msgs[BATCH];
    struct iovec tx_iov[BATCH];
    unsigned tx_n;
    uint8_t *fwd;                 /* forward request payload */
    size_t fwd_cap;
    uint8_t **replies;            /* per duck forward reply buffers */
    uint32_t *reply_caps;
    float *acc;                   /* fp32 sum of the partials (when y is not fp32) */
    size_t acc_cap;
    duck_call *fcalls;
    uint64_t rcvtimeo_us;         /* the socket's receive timeout now */
    int gathering;                /* replies of this run have started to arrive: poll briefly for the rest */
    duck_transport_stats stats;
};

/* Called by tr_run when call i has its complete reply (result DUCK_T_OK). */
typedef void (*tr_done_fn)(duck_transport *t, duck_call *calls, uint32_t i, void *ctx);

/* Shared by transport.c, transport_run.c and transport_forward.c. */
uint64_t tr_now_ns(void);
void tr_tx_flush(duck_transport *t);
void tr_tx_add(duck_transport *t, uint32_t duck, uint8_t *dgram, size_t len);
/* The datagram size below the agreed one that a failed size falls back to. */
uint32_t tr_small_mtu(const duck_transport *t);
/* Seals the fragments of a call's request (those not set in `have`, or all)
 * into t->seal, t->seal_stride apart; returns how many (lens: their lengths),
 * or 0 when out of memory. */
uint32_t tr_seal_request(duck_transport *t, const duck_call *c, const call_state *s, const uint8_t *have,
                         size_t *lens);
void tr_send_request(duck_transport *t, const duck_call *c, const call_state *s, const uint8_t *have);
void tr_send_resend(duck_transport *t, const duck_call *c, const call_state *s);
/* The retransmit timeout of a duck's next call (see transport_run.c). */
uint64_t tr_rto_ns(const duck_transport *t, uint32_t duck);
int tr_run(duck_transport *t, duck_call *calls, uint32_t n, tr_done_fn done, void *ctx);

#endif
