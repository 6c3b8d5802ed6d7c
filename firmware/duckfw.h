/* duckfw: the duck runtime. The portable core (core.c, handlers.c,
 * cache.c, session.c, reasm.c) takes datagrams and hands replies to a send
 * callback; the platform layer (net_linux.c, main.c) owns sockets, threads
 * and signals. The wire format is native/wire/wire.h; the kernels are native/kernels/. */
#ifndef DUCKFW_H
#define DUCKFW_H

#include <stdarg.h>
#include <stdint.h>

#include "ffn.h"
#include "wire.h"
#include "wire_synth.h"

#define DUCKFW_VERSION_MAJOR 1
#define DUCKFW_VERSION_MINOR 0
#define DUCKFW_NAME "duckfw 1.0"

/* --- logging (log.c): one line per event on stderr --------------------- */
enum { DLOG_ERROR = 0, DLOG_WARN = 1, DLOG_INFO = 2, DLOG_DEBUG = 3 };
/* CLOCK_MONOTONIC in ns (log.c). */
uint64_t duck_now_ns(void);
void dlog_init(uint32_t duck_id, int level);
int dlog_enabled(int level);
void dlog(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* --- configuration (main.c fills it) ----------------------------------- */
typedef struct duck_config {
    const char *bind_addr;
    uint16_t port;
    const char *port_file;     /* where the bound port is written, or NULL */
    uint32_t duck_id;
    const char *cache_dir;
    uint64_t cache_capacity;   /* bytes */
    unsigned threads;
    int pin;
    unsigned spin_us;          /* 0: block when idle; else spin (yielding) this long, then block */
    uint32_t mtu;              /* largest datagram taken and sent (configured, or the interface's) */
    int data_mac;              /* require a MAC on forwards too (the default; duckfw --no-data-mac clears it) */
    uint32_t query_period_ms;  /* a new query nonce this often, the one before taken as long again (0: the
                                  default, DUCK_QUERY_PERIOD_MS; duckfw --query-period-ms) */
    wire_key key;
    int faults;                /* fault injection allowed and on */
    double drop_rate;          /* of datagrams, each direction */
    uint32_t delay_us;         /* before handling each request */
    uint32_t fault_seed;
} duck_config;

#define DUCK_QUERY_PERIOD_MS 60000u

/* --- weight cache (cache.c) -------------------------------------------- */
typedef struct cache_entry {
    uint8_t digest[WIRE_DIGEST_BYTES];
    void *data;                /* 64-byte aligned serialized fp9 tensor */
    uint64_t len;
    fp9_matrix m;
    unsigned refs;             /* layer plans using it */
    int synthetic;             /* made from a descriptor (SYNTH): RAM only, no file */
} cache_entry;

typedef struct duck_cache duck_cache;
/* Loads and verifies every entry under dir (creating dir if needed). A
 * corrupt entry is reported, counted in *corrupt and deleted. */
duck_cache *cache_open(const char *dir, uint64_t capacity, uint64_t *corrupt);
void cache_close(duck_cache *c);
cache_entry *cache_find(duck_cache *c, const uint8_t digest[WIRE_DIGEST_BYTES]);
uint64_t cache_used(const duck_cache *c);
uint64_t cache_capacity(const duck_cache *c);
uint32_t cache_count(const duck_cache *c);
/* Handles one UPLOAD part; returns a wire status, fills *rep and *accepted
 * (bytes taken: 0 for a part that is not at `have`), and writes an error
 * text into err on failure. */
int cache_upload(duck_cache *c, const wire_upload *u, const uint8_t *data,
                 wire_upload_reply *rep, uint64_t *accepted, char *err, size_t errlen);
/* Handles a SYNTH request: checks every entry (descriptor, digest), then
 * the capacity for those not cached yet, then generates them over pool
 * (NULL: this thread). Returns a wire status; err says what was wrong. */
int cache_synth(duck_cache *c, const wire_synth_entry *entries, uint32_t n, duck_pool *pool,
                wire_synth_reply *rep, char *err, size_t errlen);
/* Drops one entry (or all with digest NULL); entries in use are kept and
 * reported as WIRE_E_BUSY. *dropped receives the count. */
int cache_invalidate(duck_cache *c, const uint8_t *digest, uint32_t *dropped, char *err, size_t errlen);

/* --- session: resident layer plans (session.c) -------------------------- */
typedef struct duck_layer {
    uint32_t n_experts, hidden;
    duck_expert_slice *experts;
    cache_entry **refs;        /* 2 * n_experts */
} duck_layer;

typedef struct duck_session {
    uint32_t id;               /* 0: none open */
    uint32_t hidden;
    duck_layer *layers[WIRE_MAX_LAYERS];
    uint32_t n_layers;
} duck_session;

void session_close(duck_session *s);
int session_set_layer(duck_session *s, duck_cache *c, const wire_layer_plan *p,
                      const uint8_t *digests, char *err, size_t errlen);

/* --- reassembly and the last-reply cache (reasm.c) ---------------------- */
typedef struct duck_peer {
    uint32_t addr;             /* IPv4, network order */
    uint16_t port;             /* network order */
} duck_peer;

#define REASM_SLOTS 4
#define REPLY_SLOTS 8
/* Memory bounds: the buffers of messages being reassembled, and of the
 * replies kept for duplicates, each hold at most this many bytes in all
 * (the least recently used go first). A message above CONTROL_MESSAGE_MAX
 * is taken only as a FORWARD of the open session: a peer that does not know
 * the session cannot make the duck hold large buffers. */
#define REASM_BUDGET (2ull * WIRE_MAX_MESSAGE)
#define REPLY_BUDGET (2ull * WIRE_MAX_MESSAGE)
#define CONTROL_MESSAGE_MAX (2u << 20)

typedef struct msg_key {
    duck_peer peer;
    uint32_t session, sequence;
    uint8_t type;
} msg_key;

typedef struct reasm_slot {
    int used;
    msg_key key;
    uint16_t frag_count, received;
    uint32_t total_len;
    uint16_t flags;            /* header flags of the fragments */
    uint64_t touched;
    uint8_t bitmap[WIRE_MAX_FRAGMENTS / 8];
    uint8_t *buf;
    uint32_t cap;
} reasm_slot;

typedef struct reply_slot {
    int used;
    msg_key key;
    duck_peer to;              /* where the reply went: a duplicate's answer goes there, not to its sender */
    int with_mac;
    int twice;                 /* the request came with WIRE_F_TWICE: each datagram of the reply goes twice */
    uint32_t mtu;              /* datagram size the reply is cut for (a RESEND gets the same geometry) */
    uint64_t touched;
    uint64_t sent_ns;          /* CLOCK_MONOTONIC when the reply was first sent: a RESEND or a duplicate that
                                  arrived before then asked before the reply existed, and is answered by it */
    uint8_t *buf;              /* reply payload (wire_reply_head + body) */
    uint32_t len, cap;
} reply_slot;

typedef struct duck_msgs {
    reasm_slot rs[REASM_SLOTS];
    reply_slot rp[REPLY_SLOTS];
    uint64_t clock;
} duck_msgs;

void msgs_free(duck_msgs *m);
reply_slot *msgs_find_reply(duck_msgs *m, const msg_key *k);
/* The least recently used reply slot, reset for k, with room for cap bytes
 * (NULL if out of memory); older replies are dropped to keep REPLY_BUDGET. */
reply_slot *msgs_take_reply(duck_msgs *m, const msg_key *k, uint32_t cap);
reasm_slot *msgs_find_reasm(duck_msgs *m, const msg_key *k);
/* Adds a fragment; returns the slot when the message is complete, NULL
 * otherwise. *evicted is 1 when an incomplete message was dropped for room
 * (a slot, or REASM_BUDGET), -1 when the fragment contradicts its message's
 * geometry (dropped). */
reasm_slot *msgs_add_fragment(duck_msgs *m, const msg_key *k, const wire_header *h,
                              const uint8_t *payload, int *evicted);
void msgs_release(reasm_slot *s);

/* --- forwards held for one kernel pass (hold.c) ------------------------- */
/* A FORWARD with WIRE_FWD_HOLD is kept (its payload copied) until one of the
 * same layer without the flag comes: then one duck_moe_forward runs over all
 * their tokens and each is answered with its own rows. At most WIRE_HOLD_MAX
 * forwards, DUCK_MAX_TOKENS tokens and HOLD_BUDGET payload bytes are held. */
#define HOLD_BUDGET WIRE_MAX_MESSAGE

typedef struct held_forward {
    msg_key key;
    duck_peer from;            /* where its reply goes */
    wire_header h;
    wire_forward f;
    uint8_t *payload;          /* the whole FORWARD payload, copied */
    uint32_t len;
} held_forward;

typedef struct duck_held {
    uint32_t n, ntok;
    uint64_t bytes;
    held_forward f[WIRE_HOLD_MAX];
    uint8_t *scratch;          /* the pass's ids, weights, x and y */
    size_t scratch_cap;
} duck_held;

/* The held forwards dropped (a session or run change: their host is gone). */
void hold_clear(duck_held *hd);
void hold_free(duck_held *hd);
/* Whether k is a held forward (a duplicate of it: its answer is on its way). */
int hold_has(const duck_held *hd, const msg_key *k);
/* Whether forward f (len payload bytes, of session s) may join the held ones
 * in one pass: same session, layer and types, the tokens and bytes within bounds. */
int hold_fits(const duck_held *hd, uint32_t session, const wire_forward *f, uint32_t len);
/* Keeps forward k; -1 when out of memory (it is then run alone). */
int hold_add(duck_held *hd, const msg_key *k, const duck_peer *from, const wire_header *h, const wire_forward *f,
             const uint8_t *p, uint32_t len);
/* The kernel's arguments over the held forwards and then f's payload p (NULL:
 * the held ones alone), rows in that order, y in the scratch; -1: no memory. */
int hold_gather(duck_held *hd, const wire_forward *f, const uint8_t *p, duck_moe_args *a);

/* --- the core (core.c, handlers.c) -------------------------------------- */
typedef void (*duck_send_fn)(void *ctx, const duck_peer *to, uint8_t *const *dgrams,
                             const size_t *lens, unsigned n);

typedef struct duck_core {
    duck_config cfg;
    duck_cache *cache;
    duck_session session;
    duck_msgs msgs;
    duck_pool *pool;
    const duck_kernels *kernels;
    duck_ffn_workspace *ws;
    wire_stats stats;
    duck_send_fn send;
    void *send_ctx;
    uint8_t *out;              /* sealed datagrams of one batch */
    uint8_t **out_ptrs;        /* what one send takes: 2 x DUCK_SEND_BATCH places (a reply sent twice) */
    size_t *out_lens;          /* the sealed datagrams' lengths, then (from DUCK_SEND_BATCH on) the send's */
    uint64_t rng;
    int shutdown;              /* a SHUTDOWN was accepted */
    int mid_message;           /* the last datagram left a message incomplete */
    int dropped;               /* the last datagram was dropped: under a flood the next is microseconds away */
    uint64_t rx_ns;            /* CLOCK_MONOTONIC arrival of the datagram in hand, set by the
                                  platform from the kernel's timestamp; 0: unknown */
    uint64_t cores, mem_bytes;
    /* the run (replay.c): the challenge the next RUN_OPEN must name, and the
     * sequences of link-keyed messages taken in the run open now */
    uint8_t challenge[WIRE_NONCE_BYTES];
    uint32_t win_top;          /* the highest sequence taken */
    uint64_t win[WIRE_REPLAY_WINDOW / 64];   /* bit (seq % WINDOW): seq taken, for seq in (top - WINDOW, top] */
    /* the query nonces (replay.c): [0] of the current query period, [1] of the one before (taken while
     * query_prev); periods counted from query_t0, this start's */
    uint8_t query[2][WIRE_NONCE_BYTES];
    uint64_t query_t0, query_epoch;
    int query_prev;
    duck_held held;            /* forwards held for one kernel pass (WIRE_FWD_HOLD) */
    duck_peer from;            /* the sender of the message in hand */
} duck_core;

int core_init(duck_core *c, const duck_config *cfg, duck_send_fn send, void *send_ctx);
void core_free(duck_core *c);
/* Everything that arrives goes through here; never trusts the bytes. */
void core_datagram(duck_core *c, const duck_peer *from, const uint8_t *buf, size_t len);
/* A batch of datagrams as they came: their checks (CRC, MAC) shared out over
 * the pool when the batch is a large message's fragments (a prefill chunk is
 * megabytes), then each taken in order as core_datagram takes it. drop[i]
 * set: datagram i is counted and dropped (truncated). rx_ns[i]: its arrival. */
#define CORE_BATCH_MAX 64
void core_batch(duck_core *c, const duck_peer *from, const uint8_t *const *bufs, const size_t *lens,
                const uint64_t *rx_ns, const uint8_t *drop, unsigned n);
/* --- fault injection (fault.c) ---------------------------------------------- */
/* 1 when this datagram is to be dropped. */
int fault_drop(duck_core *c);
/* A slow duck: sleeps --delay-us, once per complete request. */
void fault_delay(const duck_core *c);
/* --- replies: made, sealed and sent (reply.c) ------------------------------ */
#define DUCK_SEND_BATCH 64
/* Below this many bytes a message's datagrams are sealed and checked on the
 * serving thread alone: waking the pool would cost more than it saves. */
#define DUCK_PAR_MIN_BYTES ((size_t)256 << 10)
/* The datagram size of replies that do not state one (WIRE_MTU_DEFAULT, or
 * less if the duck's own is less). */
uint32_t reply_default_mtu(const duck_core *c);
/* Seals and sends reply fragments, r->mtu large; bitmap (or NULL: all) marks
 * those the peer already has. */
void reply_send(duck_core *c, const reply_slot *r, const uint8_t *have, uint32_t have_bits);
/* Whether the datagram in hand arrived before r was first sent (see reply.c). */
int reply_asked_before(const duck_core *c, const reply_slot *r);
/* NACK: the fragments of request k held (s; NULL: none) sent to the asker; no_run: holding none,
 * the duck cannot take it at all (WIRE_NACK_NO_RUN). */
void nack_send(duck_core *c, const duck_peer *to, const msg_key *k, const reasm_slot *s, int with_mac, int no_run);
/* --- the run and the replay window (replay.c) ---------------------------- */
/* A fresh random challenge (getrandom). */
void run_new_challenge(duck_core *c);
/* A RUN_OPEN naming this challenge and run, of sequence seq: the link key is
 * made and the window starts at seq. */
void run_open(duck_core *c, const uint8_t run[WIRE_NONCE_BYTES], uint32_t seq);
/* 1 when a link-keyed message of this sequence may still be taken. */
int run_window_ok(const duck_core *c, uint32_t seq);
void run_window_take(duck_core *c, uint32_t seq);
/* --- the query nonce of read-only requests (replay.c) ------------------- */
/* This start's first query nonce (the earlier start's are forgotten). */
void query_init(duck_core *c);
/* The current query nonce, a new one drawn when its period has passed;
 * *left_ms (if not NULL): how long it is taken from now (the rest of its
 * period and the next). */
const uint8_t *query_current(duck_core *c, uint32_t *left_ms);
/* 1 when p (len bytes) starts with a wire_query naming the current query
 * nonce or, within one period of the change, the one before. */
int query_ok(duck_core *c, const uint8_t *p, uint32_t len);

/* A reply to request k in the last-reply cache with room for body bytes (at
 * least an error text's), its head zeroed; NULL when out of memory. */
reply_slot *reply_new(duck_core *c, const msg_key *k, const wire_header *h, uint32_t body);
uint8_t *reply_body(reply_slot *r);
/* r made an error reply: status and the message (logged), r returned. */
__attribute__((format(printf, 3, 4))) reply_slot *reply_fail(reply_slot *r, int status, const char *fmt, ...);
/* A FORWARD request's reply (forward.c): REPLY_HELD while it waits for its group. */
reply_slot *forward_request(duck_core *c, const msg_key *k, const wire_header *h, const uint8_t *p, uint32_t len);

/* Runs one complete request and returns its reply, kept in the last-reply
 * cache under k (handlers.c); NULL when out of memory. */
reply_slot *handle_request(duck_core *c, const msg_key *k, const wire_header *h,
                           const uint8_t *payload, uint32_t len);
/* The held forwards run in one pass and answered now (nothing held: nothing; forward.c). */
void hold_answer(duck_core *c);
/* handle_request's answer to a forward it holds (WIRE_FWD_HOLD): nothing to send yet */
extern reply_slot *const REPLY_HELD;

#endif
