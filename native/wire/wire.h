/* The duck wire protocol: the one definition, shared by the firmware
 * (firmware/) and the host transport (native/transport/). docs/wire.md is
 * the prose spec.
 *
 * A datagram is a 32-byte header, the fragment's payload, and, when
 * WIRE_F_MAC is set, a 16-byte MAC over the header (with checksum 0) and the
 * payload: keyed BLAKE2b-128 under the fleet key for the messages that only
 * read (WIRE_MAC_FLEET), Poly1305 under a one-time key from the duck's link
 * key for those that change its state and for forwards (WIRE_MAC_LINK; see
 * wire_mac_kind and docs/wire.md, Authentication). The checksum is CRC-32C over the header (with
 * checksum 0), the payload and the MAC. All fields are little-endian; the
 * structs below are the in-memory form on little-endian hosts, which is the
 * only kind we build for (checked at compile time). Python reads every
 * constant and layout below from the compiled cffi module (native/
 * transport/cdef.py declares the names with `...` values), never from a
 * second hand-written copy.
 */
#ifndef DUCK_WIRE_H
#define DUCK_WIRE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#define WIRE_STATIC_ASSERT(c, m) static_assert(c, m)
#else
#define WIRE_STATIC_ASSERT(c, m) _Static_assert(c, m)
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the wire structs are little-endian in memory; add byte swaps for this target"
#endif

#define WIRE_MAGIC 0x4B435544u          /* "DUCK" */
#define WIRE_VERSION 1
#define WIRE_ABI 9                      /* bump on any change of a message layout (2: SYNTH; 3: datagram
                                          size agreed per duck, partial dtype, wake-up time; 4: messages of
                                          up to 64 MiB, the duck's tokens per forward in HELLO; 5: RUN_OPEN,
                                          link-keyed Poly1305 MACs, replay window, hello's challenge and run,
                                          the drop counters bad_mac, replayed, no_run; 6: FORWARD's HOLD flag
                                          and the reply's group_ntok; 7: NACK's NO_RUN flag; 8: the query
                                          nonce: hello's query, query_ms and WIRE_HELLO_FULL, wire_query first in
                                          HELLO, STATS and CACHE_QUERY; 9: WIRE_F_TWICE) */
#define WIRE_HEADER_BYTES 32
#define WIRE_MAC_BYTES 16
#define WIRE_DIGEST_BYTES 16            /* content hash: BLAKE2b-128, unkeyed */
#define WIRE_KEY_MIN 16
#define WIRE_KEY_MAX 64
#define WIRE_NONCE_BYTES 16             /* a host's run nonce, a duck's challenge, its query nonce */
#define WIRE_LINK_KEY_BYTES 32
#define WIRE_REPLAY_WINDOW 1024         /* sequences below a duck's highest that it still takes once */
#define WIRE_IP_UDP_BYTES 28            /* IPv4 + UDP headers, counted in the MTU */
#define WIRE_MTU_DEFAULT 1500           /* before agreement, and the fallback when a larger size fails */
#define WIRE_MTU_MIN 1280
#define WIRE_MTU_MAX 65535
#define WIRE_MAX_DATAGRAM 65507         /* largest UDP payload over IPv4 */
#define WIRE_MAX_MESSAGE (64u << 20)    /* reassembled payload bound: a prefill chunk of 1024 tokens at
                                          hidden 7168 in fp32 (29.4 MB) each way, with room */
/* A NACK or RESEND names the fragments held in a bitmap that fits one
 * datagram of the smallest size (WIRE_MTU_MIN, its payload less the 16-byte
 * head): a message never has more fragments than that (9504), whatever its
 * datagram size. */
#define WIRE_MAX_FRAGMENTS ((WIRE_MTU_MIN - WIRE_IP_UDP_BYTES - WIRE_HEADER_BYTES - WIRE_MAC_BYTES - 16) * 8)
#define WIRE_MAX_ERROR_TEXT 200
#define WIRE_MAX_LAYERS 4096
#define WIRE_MAX_EXPERTS 1024           /* per layer plan */
#define WIRE_MAX_TOKENS 4096            /* tokens one FORWARD may carry on the wire; each duck announces its
                                          own limit in HELLO (max_tokens: its kernels' DUCK_MAX_TOKENS) */
#define WIRE_TOKENS_DEFAULT 64          /* tokens per FORWARD to a duck that has not said hello: every duck
                                          of this ABI takes them */
#define WIRE_MAX_TOPK 32                /* = DUCK_MAX_TOPK */
#define WIRE_UPLOAD_PART_MAX (1u << 20) /* bytes of tensor data in one UPLOAD */

/* Message types. Requests go host -> duck; a reply has the same type with
 * WIRE_F_REPLY set and starts with a wire_reply_head. */
enum wire_type {
    WIRE_T_HELLO = 1,            /* -> wire_hello_reply */
    WIRE_T_PING = 2,             /* wire_ping -> wire_ping (echo) */
    WIRE_T_STATS = 3,            /* -> wire_stats */
    WIRE_T_CACHE_QUERY = 4,      /* u32 count + digests -> u32 count + bitmap (1 = cached) */
    WIRE_T_CACHE_INVALIDATE = 5, /* wire_invalidate -> u32 entries dropped      (MAC) */
    WIRE_T_UPLOAD = 6,           /* wire_upload + data -> wire_upload_reply    (MAC) */
    WIRE_T_SESSION_OPEN = 7,     /* wire_session_open ->                       (MAC) */
    WIRE_T_LAYER_PLAN = 8,       /* wire_layer_plan + digests ->               (MAC) */
    WIRE_T_SESSION_CLOSE = 9,    /* ->                                         (MAC) */
    WIRE_T_FORWARD = 10,         /* wire_forward + ids + weights + x -> wire_forward_reply + y */
    WIRE_T_SHUTDOWN = 11,        /* ->                                         (MAC) */
    WIRE_T_RESEND = 12,          /* wire_resend + bitmap of reply fragments held */
    WIRE_T_NACK = 13,            /* duck -> host: wire_nack + bitmap of request fragments held */
    WIRE_T_SYNTH = 14,           /* benchmarks only: wire_synth.h              (MAC) */
    WIRE_T_RUN_OPEN = 15,        /* wire_run_open -> (fleet MAC): the host's run, bound to the duck's challenge */
    WIRE_T_COUNT = 16
};

/* Header flags. */
#define WIRE_F_MAC 0x1u      /* a MAC trails the payload */
#define WIRE_F_REPLY 0x2u    /* sent by a duck */
#define WIRE_F_TWICE 0x4u    /* a request whose sender sends each datagram twice (a lossy link, or a probe of
                                its loss): each datagram of the reply goes twice too, flagged alike, so
                                that the host can count the copies that were lost (docs/wire.md, Reliability) */
#define WIRE_F_KNOWN 0x7u    /* any other bit set is malformed */

/* Reply status (wire_reply_head.status); on a nonzero status the body is a
 * UTF-8 message of at most WIRE_MAX_ERROR_TEXT bytes saying what was wrong. */
enum wire_status {
    WIRE_OK = 0,
    WIRE_E_MALFORMED = 1,     /* payload does not parse */
    WIRE_E_UNSUPPORTED = 2,   /* unknown type or version */
    WIRE_E_NO_SESSION = 3,    /* forward/plan without the open session */
    WIRE_E_UNKNOWN_LAYER = 4,
    WIRE_E_UNKNOWN_DIGEST = 5,
    WIRE_E_CACHE_FULL = 6,
    WIRE_E_HASH_MISMATCH = 7,
    WIRE_E_BAD_TENSOR = 8,    /* not a valid fp9 tensor, or shapes that do not fit */
    WIRE_E_RANGE = 9,         /* a count or id out of range */
    WIRE_E_BUSY = 10,         /* an entry in use by the open session */
    WIRE_E_NOMEM = 11,
    WIRE_E_IO = 12,           /* cache file could not be written */
    WIRE_E_STALE = 13         /* a run open for a challenge that is not the duck's current one; a STATS or
                                 CACHE_QUERY whose query nonce is not current (wire_query) */
};

typedef struct wire_header {
    uint32_t magic;
    uint8_t version;
    uint8_t type;
    uint16_t flags;
    uint32_t session;        /* 0 outside a session */
    uint32_t sequence;       /* request id; a duplicate gets the cached reply */
    uint16_t frag_index;
    uint16_t frag_count;     /* >= 1 */
    uint32_t payload_len;    /* bytes of payload in this datagram */
    uint32_t total_len;      /* bytes of the whole message payload */
    uint32_t checksum;       /* CRC-32C, see above */
} wire_header;
WIRE_STATIC_ASSERT(sizeof(wire_header) == WIRE_HEADER_BYTES, "wire_header must be 32 bytes");

/* Fragmentation rule: count = ceil(total / max_payload) (1 when total is 0),
 * every fragment but the last carries ceil(total / count) bytes, so a
 * receiver derives each fragment's offset and length from the header. */
static inline uint32_t wire_frag_size(uint32_t total_len, uint32_t frag_count)
{
    return frag_count ? (uint32_t)(((uint64_t)total_len + frag_count - 1) / frag_count) : 0;
}
static inline uint32_t wire_max_payload(uint32_t mtu, int with_mac)
{
    return mtu - WIRE_IP_UDP_BYTES - WIRE_HEADER_BYTES - (with_mac ? WIRE_MAC_BYTES : 0);
}
static inline uint32_t wire_frag_count(uint32_t total_len, uint32_t mtu)
{
    uint32_t maxp = wire_max_payload(mtu, 1);   /* room for a MAC whether or not one is sent */
    return total_len ? (uint32_t)(((uint64_t)total_len + maxp - 1) / maxp) : 1;
}
/* The largest message in datagrams of mtu bytes: WIRE_MAX_MESSAGE, or less
 * where WIRE_MAX_FRAGMENTS fragments do not carry it (13.5 MB at 1500). */
static inline uint32_t wire_max_message(uint32_t mtu)
{
    uint64_t n = (uint64_t)WIRE_MAX_FRAGMENTS * wire_max_payload(mtu, 1);
    return n < WIRE_MAX_MESSAGE ? (uint32_t)n : WIRE_MAX_MESSAGE;
}

/* The datagram size a reply may use, from the size its request states
 * (wire_forward.reply_mtu, wire_ping.reply_mtu; 0: not stated) and the
 * sender's own limit: unstated means WIRE_MTU_DEFAULT. 0 when the stated
 * size is below WIRE_MTU_MIN (malformed). */
static inline uint32_t wire_reply_mtu(uint32_t stated, uint32_t own_limit)
{
    uint32_t m = stated ? stated : WIRE_MTU_DEFAULT;
    if (m < WIRE_MTU_MIN)
        return 0;
    return m < own_limit ? m : own_limit;
}

typedef struct wire_reply_head {
    int32_t status;          /* enum wire_status */
    uint32_t flags;          /* WIRE_R_* */
} wire_reply_head;
WIRE_STATIC_ASSERT(sizeof(wire_reply_head) == 8, "wire_reply_head must be 8 bytes");
#define WIRE_R_ZERO 0x1u     /* forward: the partial is all zeros, y omitted */

typedef struct wire_hello_reply {
    uint32_t duck_id;
    uint32_t fw_version;     /* major << 16 | minor */
    uint32_t abi;            /* WIRE_ABI */
    uint16_t cores, threads;
    uint64_t mem_bytes;
    uint64_t cache_bytes, cache_capacity;
    uint32_t cache_entries;
    uint32_t session;        /* the open session, 0 if none */
    uint32_t mtu;
    uint32_t flags;          /* WIRE_HELLO_* */
    char name[32];           /* "duckfw 1.0", NUL-padded */
    uint32_t max_tokens;     /* tokens one FORWARD may carry to this duck (its kernels' bound),
                                WIRE_TOKENS_DEFAULT .. WIRE_MAX_TOKENS */
    uint32_t query_ms;       /* how long from now `query` is taken at least, in ms: the rest of its query
                                period and the next; a host asks for a new one before then */
    uint8_t challenge[WIRE_NONCE_BYTES];   /* what the next RUN_OPEN must name (random, new at start and after
                                              each run opened); zero without the MAC */
    uint8_t run[WIRE_NONCE_BYTES];         /* the run nonce of the host whose link the duck holds; zero: none */
    uint8_t query[WIRE_NONCE_BYTES];       /* the duck's current query nonce, in every form of the reply: what
                                              a fleet-MACed read-only request must name (wire_query) */
} wire_hello_reply;
WIRE_STATIC_ASSERT(sizeof(wire_hello_reply) == 144, "wire_hello_reply must be 144 bytes");
#define WIRE_HELLO_DATA_MAC 0x1u      /* the duck requires a MAC on forwards too */
#define WIRE_HELLO_FAULTS 0x2u        /* fault injection is on (tests only) */
#define WIRE_HELLO_FULL 0x4u          /* the whole hello: the request had the fleet MAC and a current query
                                         nonce; else only the link check's fields and `query` are set */

/* First in the payload of a fleet-MACed HELLO, STATS and CACHE_QUERY: the
 * duck's current query nonce (its hello's `query`), inside the MACed bytes,
 * so that a captured read-only request is answered only while that nonce is
 * current or just before (docs/wire.md, Authentication, Read-only requests).
 * A duck draws a new one every query period and takes the one before for
 * one more period; a restart forgets both. */
typedef struct wire_query {
    uint8_t nonce[WIRE_NONCE_BYTES];
} wire_query;
WIRE_STATIC_ASSERT(sizeof(wire_query) == 16, "wire_query must be 16 bytes");

/* Echoed whole, with any padding that follows: a ping padded to the agreed
 * datagram size, with reply_mtu the same, proves the path both ways. */
typedef struct wire_ping {
    uint64_t t_ns;
    uint16_t reply_mtu;      /* largest datagram of the echo; 0: WIRE_MTU_DEFAULT */
    uint16_t reserved;
    uint32_t reserved2;
} wire_ping;
WIRE_STATIC_ASSERT(sizeof(wire_ping) == 16, "wire_ping must be 16 bytes");

typedef struct wire_stats {
    uint64_t datagrams_rx, datagrams_tx;
    uint64_t requests, forwards, duplicates, resends;
    uint64_t malformed, unauthenticated, stale, injected_drops;
    uint64_t errors;         /* requests answered with a nonzero status */
    uint64_t bytes_streamed, kernel_ns;
    uint64_t uploads_done, upload_bytes, cache_evictions;
    uint64_t cache_corrupt;  /* entries discarded at load for a bad hash */
    uint64_t wake_ns;        /* sum over forwards of wire_forward_reply.wake_ns */
    uint64_t bad_mac;        /* a link MAC that does not verify (another run, another duck's, forged) */
    uint64_t replayed;       /* a sequence already taken or below the replay window; a stale run open; a
                              * read-only request with a query nonce that is not current */
    uint64_t no_run;         /* a link-keyed message while no run is open (the duck restarted) */
    uint64_t early_resends;  /* a RESEND that came before its reply went out (the host's timer ran out
                              * while the duck worked): the reply answers it; not a drop */
    uint64_t reserved[2];
} wire_stats;
WIRE_STATIC_ASSERT(sizeof(wire_stats) == 192, "wire_stats must be 192 bytes");

/* Host -> duck, fleet MAC: the host's run (its random nonce, new per
 * transport) and the challenge the duck's hello gave. The duck takes it only
 * for its current challenge (then draws a new one), derives the link key from
 * the fleet key, run and challenge, and from then on takes link-keyed messages
 * only with sequences above this request's. */
typedef struct wire_run_open {
    uint8_t run[WIRE_NONCE_BYTES];
    uint8_t challenge[WIRE_NONCE_BYTES];
} wire_run_open;
WIRE_STATIC_ASSERT(sizeof(wire_run_open) == 32, "wire_run_open must be 32 bytes");

#define WIRE_INVALIDATE_ALL 0x1u
typedef struct wire_invalidate {
    uint32_t flags;          /* WIRE_INVALIDATE_ALL, or one digest */
    uint32_t reserved;
    uint8_t digest[WIRE_DIGEST_BYTES];
} wire_invalidate;
WIRE_STATIC_ASSERT(sizeof(wire_invalidate) == 24, "wire_invalidate must be 24 bytes");

/* A part of a serialized fp9 tensor. len 0 asks for the state only. A part
 * must start at the duck's current `have` (parts are sent in order; a
 * restarted upload resumes from `have`). */
typedef struct wire_upload {
    uint8_t digest[WIRE_DIGEST_BYTES];
    uint64_t total;          /* bytes of the whole serialized tensor */
    uint64_t offset;
    uint32_t len;
    uint32_t reserved;
} wire_upload;
WIRE_STATIC_ASSERT(sizeof(wire_upload) == 40, "wire_upload must be 40 bytes");

typedef struct wire_upload_reply {
    uint64_t have;           /* contiguous bytes held; == total when cached */
    uint32_t complete;       /* 1: verified and in the cache */
    uint32_t reserved;
} wire_upload_reply;
WIRE_STATIC_ASSERT(sizeof(wire_upload_reply) == 16, "wire_upload_reply must be 16 bytes");

/* Opens the session named by the header's session field (nonzero); an open
 * session of another id is closed first. */
typedef struct wire_session_open {
    uint32_t hidden;
    uint32_t flags;          /* reserved, 0 */
} wire_session_open;
WIRE_STATIC_ASSERT(sizeof(wire_session_open) == 8, "wire_session_open must be 8 bytes");

/* A layer of the session: n_experts pairs of digests (gate_up, down). */
typedef struct wire_layer_plan {
    uint32_t layer;
    uint32_t n_experts;
    uint32_t hidden;
    uint32_t reserved;
} wire_layer_plan;
WIRE_STATIC_ASSERT(sizeof(wire_layer_plan) == 16, "wire_layer_plan must be 16 bytes");

/* Element types of activations and partials. */
#define WIRE_DT_F32 0
#define WIRE_DT_BF16 1               /* the high half of an fp32, rounded to nearest even */
#define WIRE_X_F32 WIRE_DT_F32
#define WIRE_X_BF16 WIRE_DT_BF16
static inline uint32_t wire_dtype_bytes(uint32_t dtype) { return dtype == WIRE_DT_BF16 ? 2 : 4; }

/* Followed by int32 expert_ids[ntok*topk] (negative: skip), float
 * weights[ntok*topk], x[ntok*hidden] in x_dtype. */
typedef struct wire_forward {
    uint32_t layer;
    uint16_t ntok;
    uint8_t topk;
    uint8_t x_dtype;         /* WIRE_DT_F32 | WIRE_DT_BF16 */
    uint32_t hidden;
    uint8_t y_dtype;         /* the partial's type in the reply: WIRE_DT_F32 | WIRE_DT_BF16 */
    uint8_t flags;           /* WIRE_FWD_*; other bits 0 */
    uint16_t reply_mtu;      /* largest reply datagram the host takes from this duck; 0: WIRE_MTU_DEFAULT */
} wire_forward;
WIRE_STATIC_ASSERT(sizeof(wire_forward) == 16, "wire_forward must be 16 bytes");

/* More requests of the same forward follow at once: the duck holds this one
 * (no reply yet) and runs it in one kernel pass with those that follow, up to
 * the first without the flag; then every one of them is answered, each with
 * its own tokens' partials. One pass streams each expert slice once for all
 * their tokens (a forward cut by the message size: docs/wire.md, Long forwards). */
#define WIRE_FWD_HOLD 1u
#define WIRE_HOLD_MAX 8              /* forwards a duck holds for one pass; a ninth runs the group first */

/* After the wire_reply_head; then y[ntok*hidden] in y_dtype unless WIRE_R_ZERO. */
typedef struct wire_forward_reply {
    uint32_t layer;
    uint16_t ntok;
    uint8_t y_dtype;         /* as asked */
    uint8_t reserved;
    uint32_t hidden;
    uint32_t kernel_us;
    uint64_t bytes_streamed;
    uint32_t wake_ns;        /* the request's arrival at the duck (kernel timestamp of its last datagram)
                                to the start of the kernel; 0 when the platform has no timestamp */
    uint32_t group_ntok;     /* the tokens of the kernel pass that computed this request: ntok, or more
                                when it ran with held ones (WIRE_FWD_HOLD); kernel_us is that pass's,
                                bytes_streamed too on the last request of the pass and 0 on the others */
    uint32_t reserved2[6];   /* 0; with the reply head, y starts 64 bytes in: cache-line aligned */
} wire_forward_reply;
WIRE_STATIC_ASSERT(sizeof(wire_forward_reply) == 56, "wire_forward_reply must be 56 bytes");
WIRE_STATIC_ASSERT((sizeof(wire_reply_head) + sizeof(wire_forward_reply)) % 64 == 0, "y must start aligned");

/* fp32 -> bf16, round to nearest even; a NaN stays a (quiet) NaN. */
static inline uint16_t wire_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static inline float wire_bf16_to_f32(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Host -> duck: "what of request `sequence` do you have?" The duck resends
 * the reply fragments not set in the bitmap that follows (reply_frags bits),
 * or, if it is still missing request fragments, answers WIRE_T_NACK. */
typedef struct wire_resend {
    uint32_t sequence;
    uint8_t type;
    uint8_t reserved[3];
    uint32_t reply_frags;    /* bits in the bitmap; 0: nothing of the reply arrived */
    uint32_t reserved2;
} wire_resend;
WIRE_STATIC_ASSERT(sizeof(wire_resend) == 16, "wire_resend must be 16 bytes");

/* Duck -> host: the request fragments held (bitmap of frag_count bits);
 * frag_count 0 means the request is unknown: send it all again, unless
 * flags has WIRE_NACK_NO_RUN: the request's type carries the link MAC and
 * the duck holds no run (it restarted), so no copy of it can be taken until
 * the host opens a run on it again. */
typedef struct wire_nack {
    uint32_t sequence;
    uint8_t type;
    uint8_t flags;           /* WIRE_NACK_* */
    uint8_t reserved[2];
    uint32_t frag_count;
    uint32_t reserved2;
} wire_nack;
WIRE_STATIC_ASSERT(sizeof(wire_nack) == 16, "wire_nack must be 16 bytes");
#define WIRE_NACK_NO_RUN 0x1u
WIRE_STATIC_ASSERT(sizeof(wire_nack) + WIRE_MAX_FRAGMENTS / 8 ==
                   WIRE_MTU_MIN - WIRE_IP_UDP_BYTES - WIRE_HEADER_BYTES - WIRE_MAC_BYTES &&
                   sizeof(wire_resend) == sizeof(wire_nack), "a NACK or RESEND bitmap fits one datagram");
WIRE_STATIC_ASSERT((uint64_t)WIRE_MAX_FRAGMENTS * (WIRE_MAX_DATAGRAM - WIRE_HEADER_BYTES - WIRE_MAC_BYTES) >=
                   WIRE_MAX_MESSAGE, "the largest message fits in loopback datagrams");

/* --- integrity and header checks: native/wire.c ------------------------- */

/* Why a datagram was refused (wire_check); each has a counter on the duck. */
enum wire_check_result {
    WIRE_CHECK_OK = 0,
    WIRE_CHECK_SHORT = -1,     /* shorter than the header */
    WIRE_CHECK_MAGIC = -2,     /* bad magic or version */
    WIRE_CHECK_LENGTH = -3,    /* lengths disagree with the datagram or limits */
    WIRE_CHECK_FRAGMENT = -4,  /* fragment index/count/size inconsistent */
    WIRE_CHECK_CHECKSUM = -5,
    WIRE_CHECK_MAC = -6,       /* MAC missing where required, or wrong (fleet MAC) */
    WIRE_CHECK_TYPE = -7,      /* unknown type or flags */
    WIRE_CHECK_LINK_MAC = -8,  /* a link MAC that does not verify */
    WIRE_CHECK_NO_LINK = -9    /* a link MAC, and no link key to check it with */
};

/* The fleet key, and the link key of one host run with one duck once a
 * RUN_OPEN made it (wire_link_set). */
typedef struct wire_key {
    uint8_t bytes[WIRE_KEY_MAX];
    uint32_t len;            /* 0: no key */
    uint32_t has_link;
    uint8_t run[WIRE_NONCE_BYTES];
    uint64_t link_prf[8];    /* BLAKE2b state keyed with the link key, its key block compressed */
} wire_key;

/* Which key's MAC a message type carries (a reply the same as its request): the fleet key's for
 * what tells what a duck holds, opens a run or asks for a resend; the run's link key's for what
 * changes the duck's state. */
enum wire_mac_kind { WIRE_MAC_FLEET = 0, WIRE_MAC_LINK = 1 };
/* Whether a request must carry that MAC: never (PING: an echo), optional (HELLO: the host signs it,
 * a duck answers an unsigned one with what a link check needs), required, or required unless the
 * fleet runs forwards unMACed (FORWARD: fleet.data_mac, duck --no-data-mac). */
enum wire_mac_need { WIRE_MAC_NONE = 0, WIRE_MAC_OPTIONAL = 1, WIRE_MAC_REQUIRED = 2, WIRE_MAC_DATA = 3 };

/* One row per message type (index: its WIRE_T_ value), read by the host's transport, the duck and
 * the tests alike, instead of a switch of their own each. */
typedef struct wire_type_info {
    const char *name;
    uint8_t mac_kind;       /* enum wire_mac_kind */
    uint8_t mac_need;       /* enum wire_mac_need */
    uint32_t reply_size;    /* the reply body's fixed size (0: none, or the handler sizes it: CACHE_QUERY, PING) */
} wire_type_info;
extern const wire_type_info wire_types[WIRE_T_COUNT];

static inline int wire_mac_kind(unsigned type)
{
    return type < WIRE_T_COUNT ? wire_types[type].mac_kind : WIRE_MAC_FLEET;
}

static inline int wire_mac_need(unsigned type)
{
    return type < WIRE_T_COUNT ? wire_types[type].mac_need : WIRE_MAC_NONE;
}

/* Link key = BLAKE2b-256 keyed with the fleet key over "duck-link-v1" ||
 * run || challenge; sets key's link (key->bytes, len: the fleet key). */
void wire_link_set(wire_key *key, const uint8_t run[WIRE_NONCE_BYTES], const uint8_t challenge[WIRE_NONCE_BYTES]);
/* Poly1305 (RFC 8439) of a || b under a one-time 32-byte key (r || s);
 * _ref: the portable loop alone (the reference of the AVX2 lanes). */
void wire_poly1305(const uint8_t key[32], const void *a, size_t alen, const void *b, size_t blen, uint8_t out[16]);
void wire_poly1305_ref(const uint8_t key[32], const void *a, size_t alen, const void *b, size_t blen,
                       uint8_t out[16]);
/* The link MAC of one datagram: Poly1305 of header || payload under the
 * one-time key BLAKE2b-256(link key, header), the header with checksum 0. */
void wire_link_mac(const wire_key *key, const void *hdr, const void *payload, size_t len, uint8_t out[WIRE_MAC_BYTES]);

uint32_t wire_crc32c(uint32_t crc, const void *data, size_t len);
void wire_digest(const void *data, size_t len, uint8_t out[WIRE_DIGEST_BYTES]);
/* BLAKE2b-128 of tag (taglen bytes) followed by data: a digest namespace of its own. */
void wire_digest_tagged(const void *tag, size_t taglen, const void *data, size_t len,
                        uint8_t out[WIRE_DIGEST_BYTES]);
void wire_mac(const wire_key *key, const void *hdr, const void *payload, size_t len,
              uint8_t out[WIRE_MAC_BYTES]);

/* Writes header + payload (+ MAC if key and with_mac: of the type's kind,
 * none when it is WIRE_MAC_LINK and key has no link) into out, which holds
 * at least WIRE_HEADER_BYTES + len + WIRE_MAC_BYTES bytes; returns the
 * datagram length. h->payload_len is set from len. */
size_t wire_seal(const wire_header *h, const void *payload, uint32_t len,
                 const wire_key *key, int with_mac, uint8_t *out);
/* The same with the payload already in place at out + WIRE_HEADER_BYTES
 * (a sender that patches a field of it first). */
size_t wire_seal_in_place(const wire_header *h, uint32_t len, const wire_key *key, int with_mac, uint8_t *out);

/* n values fp32 -> bf16 (wire_f32_to_bf16 each), for partials and sums. */
void wire_f32_to_bf16_n(const float *src, uint16_t *dst, size_t n);

/* Validates a received datagram: sizes, magic, version, type, flags,
 * fragment geometry, checksum, and the MAC of the type's kind when present
 * (or when require_mac). On success *h is a copy of the header and *payload points
 * into buf. Never reads past buf + len. */
int wire_check(const uint8_t *buf, size_t len, const wire_key *key, int require_mac,
               wire_header *h, const uint8_t **payload);
const char *wire_check_str(int result);
const char *wire_type_str(unsigned type);

#ifdef __cplusplus
}
#endif
#endif
