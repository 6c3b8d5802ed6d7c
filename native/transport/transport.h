/* Host side of the wire: one UDP socket to a fleet of ducks, scatter of
 * requests, gather of replies with reassembly, retransmission on a timer
 * derived from each duck's measured round trip, and a failure deadline after
 * which the silent duck is named. Datagrams are as large as agreed with each
 * duck (duck_transport_agree); a size that does not get through falls back to
 * WIRE_MTU_DEFAULT. One caller at a time per transport; no call blocks past
 * its deadline. Python binds it through cffi (native/transport/cdef.py,
 * fleet.py, session.py). */
#ifndef DUCK_TRANSPORT_H
#define DUCK_TRANSPORT_H

#include <stdint.h>

#include "wire.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct duck_transport_config {
    uint32_t n_ducks;
    const uint32_t *addrs;       /* IPv4, network byte order */
    const uint16_t *ports;       /* host byte order */
    const uint8_t *key;          /* shared key, WIRE_KEY_MIN..WIRE_KEY_MAX bytes */
    uint32_t key_len;
    uint32_t mtu;                /* ceiling on the datagram size, WIRE_MTU_MIN..WIRE_MTU_MAX; 0: none */
    uint32_t retransmit_us;      /* floor of the retransmit timer, and its value before a round trip is measured */
    uint32_t deadline_us;        /* a duck silent this long has failed */
    int32_t mac_data;            /* MAC forwards too (the ducks may require it) */
    uint32_t spin_us;            /* 0: block in ppoll while waiting (shared hosts) */
    uint32_t rcvbuf;             /* socket receive buffer to ask for; 0: 64 MiB */
    uint32_t workers;            /* threads sealing and checking a large message's datagrams and summing its
                                    partials, the calling thread included (a prefill chunk: megabytes per
                                    duck): 0, as many as this process may run on, at most 8; 1: the calling
                                    thread alone */
    int32_t twice;               /* a forward of a few datagrams (decode) sent twice, its reply too (WIRE_F_TWICE):
                                    0 to a duck whose link loses datagrams, one in 16 otherwise (a probe of the
                                    loss; transport_timing.c), 1 always, -1 never */
} duck_transport_config;

/* Results of a call, besides the duck's own status inside the reply. */
#define DUCK_T_OK 0
#define DUCK_T_ETIMEOUT -1       /* no (complete) reply within the failure deadline */
#define DUCK_T_ETOOBIG -2        /* the reply does not fit the buffer given */
#define DUCK_T_EARG -3           /* bad call (duck index, sizes, two calls to one duck) */
#define DUCK_T_ESOCKET -4        /* the socket failed (errno in the transport stats) */
#define DUCK_T_EDUCK -5          /* the duck answered with an error status (forward) */
#define DUCK_T_ECOVER -6         /* ducks are lost and neither a replica nor the host can compute their slices */
#define DUCK_T_ENORUN -7         /* the duck holds no run of this host (it restarted): a link-keyed request
                                    reaches it only once a run is opened on it again (RUN_OPEN) */

/* One request to one duck. Calls that share payload, type and session in
 * one run are sealed once and share a sequence number (a forward's scatter). */
typedef struct duck_call {
    uint32_t duck;
    uint32_t type;               /* enum wire_type */
    uint32_t session;
    uint32_t payload_len;
    const void *payload;
    void *reply;                 /* receives wire_reply_head + body */
    uint32_t reply_cap;
    uint32_t reply_len;          /* out */
    int32_t result;              /* out: DUCK_T_* */
    uint32_t retransmits;        /* out */
    uint64_t rtt_ns;             /* out: send to last reply fragment */
    uint64_t work_ns;            /* the duck's expected compute for this call (0: none): the retransmit timer
                                    waits that much and the failure deadline 4x that much longer */
    uint32_t local;              /* answered on the host (reply and result already set): nothing is sent */
    uint32_t reserved;
} duck_call;

typedef struct duck_transport_stats {
    uint64_t calls, datagrams_tx, datagrams_rx, retransmits, resend_requests, nacks;
    uint64_t timeouts, stale, malformed, unauthenticated;
    uint64_t mtu_fallbacks;      /* calls whose agreed datagram size did not get through */
    uint64_t no_run;             /* calls a duck answered with NACK NO_RUN (DUCK_T_ENORUN) */
    uint64_t lost_hints;         /* forward calls given up on at a lost hint (duck_transport_hint_lost) */
    uint64_t early_retransmits;  /* of retransmits: sent before the timer, the other ducks' calls all answered */
    uint64_t twice_calls;        /* calls whose datagrams went twice (WIRE_F_TWICE), the probes included */
    uint64_t twice_starts;       /* times a duck's link was found lossy and its forwards went twice from then */
    int32_t last_errno;
    uint32_t reserved;
} duck_transport_stats;

typedef struct duck_transport duck_transport;

/* NULL on failure with the reason in err. */
duck_transport *duck_transport_create(const duck_transport_config *cfg, char *err, uint32_t errlen);
void duck_transport_destroy(duck_transport *t);
uint32_t duck_transport_ducks(const duck_transport *t);
uint16_t duck_transport_local_port(const duck_transport *t);

/* The datagram size used with a duck (an MTU: IP and UDP headers counted)
 * is WIRE_MTU_DEFAULT until agreed. duck_transport_agree makes it the
 * smallest of what the duck announced at hello, the path MTU to it (the
 * route's IP_MTU; unknown: the duck's word) and the configured ceiling, and
 * returns it. A size that then does not get through (nothing heard for a
 * quarter of the deadline) falls back to WIRE_MTU_DEFAULT for good. */
uint32_t duck_transport_agree(duck_transport *t, uint32_t duck, uint32_t duck_mtu);
uint32_t duck_transport_mtu(const duck_transport *t, uint32_t duck);
uint32_t duck_transport_path_mtu(const duck_transport *t, uint32_t duck);
/* The socket's receive buffer in bytes (what replies in flight must fit). */
uint32_t duck_transport_rcvbuf(const duck_transport *t);
/* Threads that seal, check and sum large messages (config.workers; 1 until the first large one). */
unsigned duck_transport_workers(const duck_transport *t);
/* The retransmit timeout of the duck's next call, in microseconds. */
uint32_t duck_transport_rto_us(const duck_transport *t, uint32_t duck);

/* The run (docs/wire.md, Authentication): each transport draws a random run
 * nonce. After a duck's hello gives its challenge and a RUN_OPEN {nonce,
 * challenge} is answered OK, duck_transport_link makes the link key of that
 * duck, which every state-changing message and forward to it (and its reply)
 * is MACed under. A call of such a type to a duck without a link fails with
 * DUCK_T_EARG. */
void duck_transport_run_nonce(const duck_transport *t, uint8_t *out);   /* WIRE_NONCE_BYTES */
int duck_transport_link(duck_transport *t, uint32_t duck, const uint8_t *challenge);
int duck_transport_linked(const duck_transport *t, uint32_t duck);
/* Forgets the duck's link (it restarted, or another host opened a run there). */
void duck_transport_unlink(duck_transport *t, uint32_t duck);
/* Tests that craft datagrams as this host would: the duck's key (fleet key and
 * link), and a sequence number of this run that no call will use. */
void duck_transport_key(const duck_transport *t, uint32_t duck, wire_key *out);
uint32_t duck_transport_take_sequence(duck_transport *t);

/* Runs the calls concurrently until every one has a reply or has failed;
 * several calls to one duck are all in flight at once (it answers them in
 * order). Returns DUCK_T_OK when all got replies, else the first failing result. */
int duck_transport_run(duck_transport *t, duck_call *calls, uint32_t n);

/* Element types of x and y (native/kernels/ffn.h defines the same). */
#ifndef DUCK_DT_F32
#define DUCK_DT_F32 0
#define DUCK_DT_BF16 1
#endif

typedef struct duck_forward_args {
    uint32_t session, layer, ntok, topk, hidden;
    const int32_t *expert_ids;   /* [ntok][topk], negative: skip */
    const float *expert_weights; /* [ntok][topk] */
    const void *x;               /* [ntok][hidden] in x_dtype */
    uint32_t x_dtype;            /* DUCK_DT_F32 | DUCK_DT_BF16 */
    uint32_t y_dtype;            /* the type of y, and of the partials on the wire */
    void *y;                     /* [ntok][hidden]: the fp32 sum of every duck's partial (in duck order),
                                    converted once to y_dtype */
    uint32_t request_tokens;     /* most tokens per request (the ducks' HELLO max_tokens); 0:
                                    WIRE_TOKENS_DEFAULT */
    uint32_t pipeline;           /* requests in flight per duck; 0: DUCK_PIPELINE_DEFAULT */
    uint32_t group_tokens;       /* most tokens a duck runs in one kernel pass (its HELLO max_tokens): the
                                    requests of a cut forward go in groups of up to this many tokens, all
                                    but the last of each held by the ducks (WIRE_FWD_HOLD) and run with it
                                    in one pass; 0: each request its own pass */
} duck_forward_args;

/* Requests in flight per duck when a forward takes several: the next one
 * waits in the duck's socket while it computes, and the host sums one while
 * the ducks compute the next. */
#define DUCK_PIPELINE_DEFAULT 2
#define DUCK_PIPELINE_MAX 8
/* A duck's time per token before any reply measured it (timers only). */
#define DUCK_NS_PER_TOKEN_UNKNOWN 1000000u

typedef struct duck_forward_result {
    int32_t failed_duck;         /* -1, or the first duck that failed */
    int32_t result;              /* its DUCK_T_* result */
    int32_t duck_status;         /* its wire status, when it answered with an error */
    uint32_t kernel_us_max;      /* slowest duck's kernel time (the longest request's) */
    uint64_t bytes_streamed;     /* all ducks */
    uint32_t retransmits;
    uint32_t wake_ns_max;        /* slowest duck's wake-up: its request's arrival to its kernel's start */
    uint32_t mtu_fallbacks;      /* ducks whose agreed datagram size failed in this call */
    uint32_t requests;           /* requests the tokens went in, each to every duck */
    uint32_t request_tokens;     /* tokens per request (the last may have fewer) */
    uint32_t pipeline;           /* requests in flight per duck */
    uint32_t group;              /* requests per kernel pass on the ducks (1: none held) */
    uint64_t kernel_us_sum;      /* the slowest duck's kernel time, summed over the requests (a pass's
                                    time shared out over its requests by their tokens) */
    int32_t rcvbuf_short;        /* the receive buffer holds less than one request's replies of all ducks twice */
    uint32_t lost_new;           /* ducks found lost in this call (their slices then went elsewhere) */
    uint64_t host_ns;            /* time this host spent computing lost ducks' slices */
    uint32_t host_slices;        /* slices (per request) this host computed */
    uint32_t replica_slices;     /* slices (per request) a replica computed */
    char message[WIRE_MAX_ERROR_TEXT + 1];
} duck_forward_result;

/* One layer of the FFN over every duck, for any number of tokens: cut into
 * requests of at most request_tokens (and what the datagram sizes and the
 * receive buffer allow), up to `pipeline` of them in flight per duck. Each
 * partial is added as soon as it and those of all lower-numbered ducks are
 * in, so the sum is the same bits whatever order the replies arrive in. */
int duck_transport_forward(duck_transport *t, const duck_forward_args *a, duck_forward_result *res);
/* The cut a forward of these args would get (res: requests, request_tokens,
 * pipeline, rcvbuf_short), without sending anything. */
void duck_transport_plan(const duck_transport *t, const duck_forward_args *a, duck_forward_result *res);

void duck_transport_stats_get(const duck_transport *t, duck_transport_stats *out);

/* --- a lost duck's slices (transport_lost.c) ------------------------------
 * A forward's slices are numbered like the ducks: slice d is duck d's share.
 * With a cover set, a forward call that stays silent past its lost deadline
 * does not fail the forward: its duck is marked lost, and its slices (then
 * those of every later forward) are computed by a replica duck that holds
 * them, else by the host through cover.forward, until the duck is set back
 * (duck_transport_set_lost(t, d, 0): the caller's word that it serves again).
 * The partials are summed in slice order whoever computed them, so the sum
 * is the same bits as the undisturbed run's. */

/* Computes slice `slice` of request [t0, t0 + ntok) of a forward on the host,
 * exactly as its duck does, as the duck's complete reply (wire_reply_head,
 * wire_forward_reply, the partial in a->y_dtype) of at most cap bytes;
 * returns its length, 0 on failure (the forward fails naming the slice). */
typedef uint32_t (*duck_cover_fn)(void *ctx, uint32_t slice, const duck_forward_args *a, uint32_t t0,
                                  uint32_t ntok, void *reply, uint32_t cap);

typedef struct duck_cover_config {
    duck_cover_fn forward;       /* NULL: no cover (a silent duck fails the forward at the deadline) */
    void *ctx;
    const uint64_t *slice_bytes; /* [n_ducks]: the memory the host needs to compute each slice */
    uint64_t budget_bytes;       /* the most bytes of slices the host computes at a time */
    const int32_t *replica;      /* [n_ducks]: the other duck that holds slice d; -1: none (NULL: none at all) */
    uint32_t replica_layer_offset; /* a replica holds slice d of layer L as its layer L + this */
    uint32_t lost_calls;         /* a forward's silence that marks its duck lost: this many of the duck's
                                    expected calls (measured round trip + compute, with 4 variations), */
    uint32_t lost_floor_us;      /* at least this, at most the transport's deadline */
} duck_cover_config;

/* 0, or -1 with the reason in err (sizes, replicas out of range). Copies the arrays. */
int duck_transport_set_cover(duck_transport *t, const duck_cover_config *c, char *err, uint32_t errlen);
/* Marks a duck lost (its slices go to a replica or the host) or back (1 / 0).
 * Returns 0, or DUCK_T_ECOVER with the reason in err when what is lost
 * cannot be computed (the duck stays marked; forwards fail until it is back). */
int duck_transport_set_lost(duck_transport *t, uint32_t duck, int lost, char *err, uint32_t errlen);
int duck_transport_lost(const duck_transport *t, uint32_t duck);
/* From any thread, also while a forward runs on another: the caller knows duck is gone (its process
 * exited, its health checks failed). The forward in flight gives up on its calls to it within
 * HINT_POLL_MS and, like every later forward, routes its slices elsewhere, as if it had been silent
 * past its lost deadline; without a cover it has no effect. duck_transport_set_lost(t, duck, 0) clears it. */
void duck_transport_hint_lost(duck_transport *t, uint32_t duck);
/* A count that moves at every complete reply and at the end of every run, read from any thread
 * without waiting for a run in flight: a caller that sees it still while requests wait knows the
 * fleet makes no progress (duckd's health). */
uint64_t duck_transport_progress(const duck_transport *t);
/* Who computes slice s now: its duck, its replica (a duck index), -1: the host, -2: nobody. */
#define DUCK_ROUTE_HOST -1
#define DUCK_ROUTE_NONE -2
int32_t duck_transport_route(const duck_transport *t, uint32_t slice);
/* Why some slice has no route (the ducks lost, the memory their slices need and the
 * cover budget), or "" while every slice has one. */
const char *duck_transport_cover_error(const duck_transport *t);
/* The silence after which a forward call of ntok tokens marks duck lost now, in microseconds. */
uint32_t duck_transport_lost_after_us(const duck_transport *t, uint32_t duck, uint32_t ntok);

#ifdef __cplusplus
}
#endif
#endif
