/* Private to native/transport*.c: the transport's state. */
#ifndef DUCK_TRANSPORT_IMPL_H
#define DUCK_TRANSPORT_IMPL_H

#include <netinet/in.h>
#include <sys/socket.h>

#include "pool.h"
#include "transport.h"

#define BATCH 64
/* The most bytes of sealed datagrams one scatter queues before it sends. */
#define SEAL_BATCH_BYTES ((size_t)4 << 20)

/* A call sent twice (WIRE_F_TWICE), until its reply's copies are counted: how many of them arrived
 * (transport_timing.c, tr_loss_sample). */
typedef struct twice_probe {
    uint32_t seq;
    uint16_t frags;               /* its reply's datagrams (once complete) */
    uint8_t copies;               /* of them, copies that arrived */
    uint8_t state;                /* PROBE_* */
} twice_probe;
#define LINK_PROBES 8

/* What the transport knows of one duck across calls. */
typedef struct duck_link {
    uint32_t mtu;                 /* agreed datagram size (WIRE_MTU_DEFAULT until agreed) */
    uint32_t path_mtu;            /* the route's MTU to the duck (IP_MTU), 0 if unknown */
    uint64_t srtt_ns, rttvar_ns;  /* smoothed round trip, the duck's compute taken out, and its variation
                                     (RFC 6298); 0: no sample */
    uint64_t backoff_ns;          /* the interval a retransmitted call completed in, kept until a clean sample */
    uint64_t ns_per_token;        /* the duck's kernel time per forward token (smoothed over its replies); 0: none */
    uint64_t ns_per_token_var;    /* and its variation, as rttvar is the round trip's */
    twice_probe probes[LINK_PROBES]; /* the last calls sent twice, their copies still counted */
    uint32_t probe_next;
    uint32_t copies_due, copies_seen; /* since the last verdict: the reply copies of the calls sent twice that
                                     needed no retransmit, and those of them that arrived */
    uint32_t small_calls;         /* small forwards started: every PROBE_EVERY-th goes twice while the link is
                                     not lossy (a probe of its loss) */
    int lossy;                    /* the last verdict: every small forward goes twice */
    int lost;                     /* its slices go to a replica or the host (transport_lost.c) */
    uint32_t lost_hint;           /* set from another thread (duck_transport_hint_lost): read atomically */
} duck_link;

typedef struct call_state {
    uint32_t seq;
    int with_mac, done, progress; /* progress: a reply fragment, or a NACK holding request fragments */
    int twice;                    /* every datagram of the call goes twice, and the duck's reply's too */
    int queued;                   /* sent while an earlier call to the duck was in flight: its round trip
                                     includes a wait, so it gives no sample */
    int32_t next;                 /* the next call to the same duck in this run; -1: none */
    uint32_t mtu;                 /* datagram size of this call, both ways */
    uint32_t req_frags;
    uint64_t t_start, t_heard, t_next, interval, cap;
    uint64_t rto;                 /* the duck's retransmit timeout when the call started */
    uint64_t work_ns;             /* the duck's expected compute before it answers (queued calls' included) */
    uint64_t deadline_ns;         /* silence that fails the call: the deadline plus 4 x work_ns, or (a forward
                                     with a cover) the lost deadline, once retransmitted LOST_RETRANSMITS times */
    uint64_t hard_ns;             /* silence that fails it however few retransmits: the deadline plus 4 x work_ns */
    uint32_t rep_count, rep_have, rep_total;
    uint8_t bitmap[WIRE_MAX_FRAGMENTS / 8];
} call_state;

/* One forward request in flight (a slot of the pipeline). */
typedef struct fwd_slot {
    uint8_t *payload;
    size_t cap;
    uint8_t *replica_payload;     /* the same request for replicas: layer + replica_layer_offset */
    size_t replica_cap;
} fwd_slot;

struct duck_transport {
    duck_transport_config cfg;
    wire_key key;                 /* the fleet key */
    wire_key *keys;               /* per duck: the fleet key and, once a RUN_OPEN took, the link key */
    uint8_t run[WIRE_NONCE_BYTES];/* this transport's run nonce (random) */
    int fd;
    uint16_t local_port;
    uint32_t seq;
    uint32_t rcvbuf;              /* the socket's receive buffer as the kernel reports it */
    struct sockaddr_in *dest;
    duck_link *link;
    int32_t *active;              /* duck -> its first call during a run (then call_state.next) */
    call_state *st;               /* per call of a run, st_cap of them */
    uint32_t st_cap;
    uint8_t *seal;                /* sealed datagrams of one message, seal_stride apart */
    size_t seal_cap, seal_stride;
    uint8_t (*rx)[WIRE_MAX_DATAGRAM + 1];
    struct mmsghdr rx_msgs[BATCH];    /* pointing at rx, set up once */
    struct iovec rx_iov[BATCH];
    struct sockaddr_in rx_from[BATCH];
    struct mmsghdr tx_msgs[BATCH];
    struct iovec tx_iov[BATCH];
    unsigned tx_n;
    fwd_slot *fwd;                /* forward request payloads, one per pipeline slot */
    uint8_t **replies;            /* forward reply buffers, per slot and duck (slot * n_ducks + duck) */
    uint32_t *reply_caps;
    uint32_t fwd_slots;           /* slots allocated */
    float *acc;                   /* fp32 sum of the partials (when y is not fp32) */
    size_t acc_cap;
    duck_call *fcalls;            /* per slot and duck */
    uint64_t rcvtimeo_us;         /* the socket's receive timeout now */
    int gathering;                /* replies of this run have started to arrive: poll briefly for the rest */
    duck_transport_stats stats;
    uint64_t progress;            /* moves at every reply and at the end of every run: read from any thread */
    uint64_t last_ok_ns;          /* when the run's latest call completed (0: none yet) */
    /* lost ducks (transport_lost.c) */
    duck_cover_config cover;      /* its arrays point at slice_bytes and replica below */
    uint64_t *slice_bytes;
    int32_t *replica;
    int32_t *route;               /* slice -> the duck computing it, DUCK_ROUTE_HOST or DUCK_ROUTE_NONE */
    char cover_err[WIRE_MAX_ERROR_TEXT + 1];   /* why some slice has no route */
    /* helper threads for large messages (transport_par.c), made at the first */
    duck_pool *pool;
    int pool_tried;
};

/* A forward request of n tokens and its reply, in bytes (transport_plan.c, transport_forward.c). */
#define TR_REPLY_HEAD (sizeof(wire_reply_head) + sizeof(wire_forward_reply))
static inline size_t tr_request_bytes(const duck_forward_args *a, uint64_t n)
{
    return sizeof(wire_forward) + 8 * n * a->topk + n * a->hidden * wire_dtype_bytes(a->x_dtype);
}
static inline size_t tr_reply_bytes(const duck_forward_args *a, uint64_t n)
{
    return TR_REPLY_HEAD + n * a->hidden * wire_dtype_bytes(a->y_dtype);
}

/* Called by tr_run when call i has its complete reply (result DUCK_T_OK).
 * It may give calls that are done a new request and start them again
 * (tr_restart): a pipeline of requests within one run. */
typedef void (*tr_done_fn)(duck_transport *t, duck_call *calls, uint32_t i, void *ctx);

/* Runs fn(ctx, i) for every i in [0, n): shared out over the helper threads
 * when the items touch `bytes` bytes in all, enough to pay for waking them;
 * otherwise here, in order (transport_par.c). fn must not depend on the order. */
typedef duck_item_fn tr_item_fn;   /* fn(ctx, item) */
void tr_parallel(duck_transport *t, uint32_t n, size_t bytes, tr_item_fn fn, void *ctx);

/* Shared by transport.c, transport_run.c and transport_forward.c. */
uint64_t tr_now_ns(void);
void tr_tx_flush(duck_transport *t);
void tr_tx_add(duck_transport *t, uint32_t duck, uint8_t *dgram, size_t len);
/* n sealed datagrams at t->seal + at (seal_stride apart) queued for duck, each twice where twice. */
void tr_tx_sealed(duck_transport *t, uint32_t duck, size_t at, const size_t *lens, uint32_t n, int twice);
/* The datagram size below the agreed one that a failed size falls back to. */
uint32_t tr_small_mtu(const duck_transport *t);
/* Seals the fragments of a call's request (those not set in `have`, or all)
 * into t->seal from byte *at on, t->seal_stride apart; returns how many
 * (lens: their lengths), or 0 when out of memory. Where they do not fit
 * behind what is queued, the queue is sent first and *at becomes 0: the
 * caller queues them from t->seal + *at. */
uint32_t tr_seal_request(duck_transport *t, const duck_call *c, const call_state *s, const uint8_t *have,
                         size_t *lens, size_t *at);
/* Makes room for `bytes` of sealed datagrams (nothing may be queued: it may
 * move the buffer); 0 when out of memory. */
int tr_seal_reserve(duck_transport *t, size_t bytes);
void tr_send_request(duck_transport *t, const duck_call *c, const call_state *s, const uint8_t *have);
void tr_send_resend(duck_transport *t, const duck_call *c, const call_state *s);
/* The retransmit timeout of a duck's next call (transport_timing.c). */
uint64_t tr_rto_ns(const duck_transport *t, uint32_t duck);
/* A completed call's samples: its duck's round trip (unless retransmitted or
 * queued) and time per token. */
void tr_rtt_sample(duck_link *l, const duck_call *c, const call_state *s, uint64_t now);
/* Whether a call goes twice (WIRE_F_TWICE), decided as it starts; and, as it completes, what it
 * says of its duck's link (a lossy link's small forwards go twice for a while). */
int tr_send_twice(duck_transport *t, const duck_call *c, const call_state *s);
void tr_twice_sent(duck_transport *t, uint32_t duck, uint32_t seq);
void tr_twice_copy(duck_transport *t, uint32_t duck, uint32_t seq);
void tr_loss_sample(duck_transport *t, const duck_call *c, const call_state *s);
/* A call's retransmit interval, its cap and its failure deadline, from now. */
void tr_start_timer(const duck_transport *t, const duck_call *c, call_state *s, uint64_t now);
uint64_t tr_sibling_wait_ns(const duck_transport *t, const duck_call *c, const call_state *s);
int tr_run(duck_transport *t, duck_call *calls, uint32_t n, tr_done_fn done, void *ctx);
/* From a done callback: sends calls [first, first + count) again, each with
 * its (new) payload and a new sequence number (shared by calls of one
 * payload to different ducks). Returns 0, or -1 when out of memory. */
int tr_restart(duck_transport *t, duck_call *calls, uint32_t first, uint32_t count);
/* The kernel time a duck reports in a complete forward reply (0 if none). */
uint64_t tr_forward_kernel_ns(const duck_call *c);
/* The compute a forward of ntok tokens is expected to take on a duck (its
 * measured time per token, plus 4 times the variation; a guess before any). */
uint64_t tr_work_ns(const duck_transport *t, uint32_t duck, uint32_t ntok);
/* A forward call is lost only after this many retransmits went unanswered too: on a lossy link
 * (5 %) a few datagrams in a row are lost now and then, a duck is seldom silent to four. */
#define LOST_RETRANSMITS 3
/* A run with a cover wakes at least this often to take lost hints (duck_transport_hint_lost). */
#define HINT_POLL_NS (50u * 1000000u)
/* Whether another thread said that duck is gone (transport_lost.c). */
int tr_hinted(const duck_transport *t, uint32_t duck);
/* Marks lost every duck hinted so and not lost yet (with a cover); returns how many. */
uint32_t tr_take_hints(duck_transport *t);
/* When a call that is still open fails for silence (transport_timing.c). */
uint64_t tr_fail_at(const duck_call *c, const call_state *s);
/* The silence that marks a forward call's duck lost (cover set), else the failure deadline (timing). */
uint64_t tr_lost_ns(const duck_transport *t, uint32_t duck, uint64_t work_ns);
/* Routes every slice (its duck, else its live replica, else the host within the budget); 0, or
 * DUCK_T_ECOVER with t->cover_err set when some slice has none (transport_lost.c). */
int tr_reroute(duck_transport *t);
/* Marks lost the ducks of failed forward calls that show them gone (silent past the lost
 * deadline, or without their session); reroutes; returns how many were newly lost. */
uint32_t tr_lose_failed(duck_transport *t, const duck_call *calls, uint32_t n);

#endif
