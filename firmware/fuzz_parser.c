/* libFuzzer harness for everything a duck does with a datagram: the header
 * checks, reassembly, the MAC gate and every request handler. Inputs are
 * fed raw (mode 0), or sealed as the host would so that the fuzzer reaches
 * the handlers behind the MAC (modes 1, 2): the fleet key's MAC, or the link
 * MAC of the run the harness opened at set-up (RUN_OPEN with the duck's
 * challenge) under a fresh sequence; fuzzed bits pick instead an old
 * sequence (a replay, or one below the window), a stranger's link key (a
 * bad MAC), or no MAC; a fuzzed RUN_OPEN names a random challenge (stale) or
 * the duck's current one (a new run, which the harness then follows). A
 * sealed SYNTH may get its entries' digests fixed up so that descriptors
 * reach the generator, a sealed HELLO, STATS or CACHE_QUERY the duck's
 * current query nonce so that it reaches its handler.
 * Mode 3 builds forwards for a session the harness opened at set-up (two
 * synthetic experts, hidden 64) from fuzzed fields: dtypes, reply datagram
 * size, counts, ids, activations, a length off by one. Every datagram the
 * duck sends back must pass wire_check with the same key, and a forward's
 * reply must keep to the datagram size the forward stated. Built by
 * firmware/build.py (variant fuzz: clang -fsanitize=fuzzer; fuzz-gcc: the
 * same entry point driven by fuzz_main.c). */
#define _GNU_SOURCE
#include "duckfw.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FUZZ_SESSION 0x00C0FFEEu
#define FUZZ_HIDDEN 64

static duck_core core;
static wire_key host_key;                     /* the fleet key and the link of the harness's run */
static wire_key stranger;                     /* a link of another key: its MACs must not verify */
static uint32_t next_seq = 1u << 30;
static int ready;
static const duck_peer peer = {0x0100007f, 0x3930};
static uint32_t reply_limit = WIRE_MTU_MAX;   /* largest datagram the duck may send now */

static void check_out(void *ctx, const duck_peer *to, uint8_t *const *dgrams, const size_t *lens, unsigned n)
{
    for (unsigned i = 0; i < n; i++) {
        wire_header h;
        const uint8_t *p;
        if (wire_check(dgrams[i], lens[i], &core.cfg.key, 0, &h, &p) != WIRE_CHECK_OK || !(h.flags & WIRE_F_REPLY)) {
            fprintf(stderr, "the duck sent a datagram that does not check\n");
            abort();
        }
        if (lens[i] + WIRE_IP_UDP_BYTES > reply_limit) {
            fprintf(stderr, "the duck sent a %zu-byte datagram; the request allowed %u\n", lens[i], reply_limit);
            abort();
        }
    }
}

static void request(uint8_t type, uint32_t session, const void *payload, uint32_t len)
{
    static uint8_t out[WIRE_MAX_DATAGRAM + 64];
    wire_header h = {0};
    h.type = type;
    h.session = session;
    h.sequence = next_seq++;
    h.frag_count = 1;
    h.total_len = len;
    size_t n = wire_seal(&h, payload, len, &host_key, 1, out);
    core_datagram(&core, &peer, out, n);
}

/* A RUN_OPEN for the duck's current challenge; the harness's link follows. */
static void open_run(const uint8_t run[WIRE_NONCE_BYTES])
{
    wire_run_open ro;
    memcpy(ro.run, run, sizeof ro.run);
    memcpy(ro.challenge, core.challenge, sizeof ro.challenge);
    request(WIRE_T_RUN_OPEN, 0, &ro, sizeof ro);
    wire_link_set(&host_key, ro.run, ro.challenge);
}

/* Session FUZZ_SESSION, layer 0: two experts of one 64-unit slice, made by
 * SYNTH; 0 when the duck refused (fuzzed requests may have filled its cache). */
static int open_session(void)
{
    wire_session_open so = {FUZZ_HIDDEN, 0};
    request(WIRE_T_SESSION_OPEN, FUZZ_SESSION, &so, sizeof so);
    struct {
        wire_synth head;
        wire_synth_entry e[4];
    } synth;
    memset(&synth, 0, sizeof synth);
    synth.head.count = 4;
    uint8_t plan[sizeof(wire_layer_plan) + 4 * WIRE_DIGEST_BYTES];
    wire_layer_plan lp = {0, 2, FUZZ_HIDDEN, 0};
    memcpy(plan, &lp, sizeof lp);
    for (int i = 0; i < 4; i++) {   /* gate_up [128, 64], down [64, 64], twice */
        fp9_synth_desc *d = &synth.e[i].desc;
        d->version = FP9_SYNTH_VERSION;
        d->rows = d->live_rows = i % 2 ? FUZZ_HIDDEN : 128;
        d->cols = d->live_cols = i % 2 ? 64 : FUZZ_HIDDEN;
        d->prescale_log2 = fp9_synth_default_prescale_log2(d->cols);
        d->seed = (uint64_t)i + 1;
        wire_synth_digest(d, synth.e[i].digest);
        memcpy(plan + sizeof lp + (size_t)i * WIRE_DIGEST_BYTES, synth.e[i].digest, WIRE_DIGEST_BYTES);
    }
    request(WIRE_T_SYNTH, 0, &synth, sizeof synth);
    request(WIRE_T_LAYER_PLAN, FUZZ_SESSION, plan, sizeof plan);
    return core.session.id == FUZZ_SESSION && core.session.layers[0];
}

/* A forward built from fuzzed fields; mostly well formed, so that it reaches the kernel. */
static void forward(const uint8_t *data, size_t size)
{
    static uint8_t payload[sizeof(wire_forward) + 8 * 4 * 3 + 4 * 4 * FUZZ_HIDDEN];
    if (size < 8)
        return;
    if (core.session.id != FUZZ_SESSION || !core.session.layers[0])
        open_session();   /* a fuzzed request closed it */
    wire_forward f = {0};
    f.layer = data[0] % 8 == 0;                                   /* layer 1 has no plan */
    f.ntok = (uint16_t)(data[1] % 5);
    f.topk = (uint8_t)(data[2] % 4);
    f.x_dtype = (uint8_t)(data[3] % 3);                           /* 2: unknown */
    f.y_dtype = (uint8_t)(data[4] % 3);
    f.flags = (uint8_t)((data[5] & 7) == 7 ? 2u : (data[5] & 7) >= 5 ? WIRE_FWD_HOLD : 0u);   /* 2: unknown */
    f.hidden = data[6] % 8 == 0 ? FUZZ_HIDDEN / 2 : FUZZ_HIDDEN;
    f.reply_mtu = (uint16_t)(data[7] < 8 ? data[7] * 200u : WIRE_MTU_MIN + (data[7] - 8u) * 260u);
    uint32_t slots = (uint32_t)f.ntok * f.topk, xs = f.x_dtype == WIRE_DT_BF16 ? 2 : 4;
    uint32_t len = (uint32_t)sizeof f + 8 * slots + f.ntok * f.hidden * xs;
    memcpy(payload, &f, sizeof f);
    for (uint32_t i = 0; i < len - sizeof f; i++) {
        uint8_t b = 8 + i < size ? data[8 + i] : (uint8_t)(i * 37);
        if (i < 4 * slots && i % 4 == 0) {                        /* ids: -1 .. 2 (2 is out of range) */
            int32_t id = (int32_t)(b % 4) - 1;
            memcpy(payload + sizeof f + i, &id, 4);
            i += 3;
        } else {
            payload[sizeof f + i] = b;
        }
    }
    if (data[5] & 0x10)
        len--;                                                    /* does not match its counts */
    uint32_t stated = wire_reply_mtu(f.reply_mtu, core.cfg.mtu);
    reply_limit = stated ? stated : wire_reply_mtu(0, core.cfg.mtu);
    request(WIRE_T_FORWARD, FUZZ_SESSION, payload, len);
    reply_limit = WIRE_MTU_MAX;
}

static void setup(void)
{
    static char tmpl[] = "/tmp/duckfw-fuzz-XXXXXX";
    const char *dir = getenv("DUCK_FUZZ_DIR");   /* the test's tmp_path: nothing left behind */
    if (!dir && !(dir = mkdtemp(tmpl)))
        abort();
    duck_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.cache_dir = dir;
    cfg.cache_capacity = 16u << 20;
    cfg.threads = 1;
    cfg.mtu = WIRE_MTU_MAX;   /* replies cut for whatever size a request states (reply_mtu) */
    cfg.key.len = 32;
    memset(cfg.key.bytes, 0x5a, cfg.key.len);
    cfg.data_mac = 1;
    dlog_init(0, DLOG_ERROR);
    if (core_init(&core, &cfg, check_out, NULL) != 0)
        abort();
    core.cores = 4;
    host_key = cfg.key;
    stranger = cfg.key;
    stranger.bytes[0] ^= 1;
    static const uint8_t run[WIRE_NONCE_BYTES] = {1, 2, 3, 4};
    wire_link_set(&stranger, run, run);
    open_run(run);
    if (!core.cfg.key.has_link) {
        fprintf(stderr, "fuzz set-up: the run did not open\n");
        abort();
    }
    if (!open_session()) {
        fprintf(stderr, "fuzz set-up: the session did not open\n");
        abort();
    }
    ready = 1;
}

static void sealed(const uint8_t *data, size_t size)
{
    static uint8_t out[WIRE_MAX_DATAGRAM + 64];
    if (size < 8)
        return;
    wire_header h = {0};
    h.type = (uint8_t)(data[0] % (WIRE_T_COUNT + 1));
    h.flags = data[1] & 0x7;
    memcpy(&h.session, data + 2, 2);
    /* a fresh sequence; with bit 3 an old one: a replay, or one below the window */
    h.sequence = data[5] & 8 ? next_seq - 1 - (uint32_t)data[4] * (data[1] & 0x80 ? 64u : 1u) : next_seq++;
    const wire_key *key = data[5] & 16 ? &stranger : &host_key;
    uint32_t len = (uint32_t)(size - 8);
    if (len > WIRE_MAX_DATAGRAM - 64)
        len = WIRE_MAX_DATAGRAM - 64;
    if (data[5] & 1) {   /* a fragment of a larger message */
        h.frag_count = (uint16_t)(2 + data[6] % 8);
        h.frag_index = (uint16_t)(data[7] % h.frag_count);
        h.total_len = len * h.frag_count;
    } else {
        h.frag_count = 1;
        h.total_len = len;
    }
    const uint8_t *payload = data + 8;
    static uint8_t run_open[sizeof(wire_run_open)];
    if (h.type == WIRE_T_RUN_OPEN && (data[5] & 32) && len >= sizeof run_open) {   /* the current challenge */
        memcpy(run_open, payload, sizeof run_open);
        memcpy(run_open + WIRE_NONCE_BYTES, core.challenge, WIRE_NONCE_BYTES);
        payload = run_open;
        len = sizeof run_open;
        h.frag_count = 1;
        h.frag_index = 0;
        h.total_len = len;
    }
    if (h.type == WIRE_T_SYNTH && (data[5] & 4)) {   /* digests right: past the hash check */
        static uint8_t fixed[WIRE_MAX_DATAGRAM];
        memcpy(fixed, payload, len);
        wire_synth_entry e;
        for (size_t off = sizeof(wire_synth); off + sizeof e <= len; off += sizeof e) {
            memcpy(&e, fixed + off, sizeof e);
            wire_synth_digest(&e.desc, e.digest);
            memcpy(fixed + off, &e, sizeof e);
        }
        payload = fixed;
    }
    if ((h.type == WIRE_T_HELLO || h.type == WIRE_T_STATS || h.type == WIRE_T_CACHE_QUERY) && (data[5] & 64) &&
        len >= sizeof(wire_query)) {   /* the current query nonce: past the freshness check */
        static uint8_t named[WIRE_MAX_DATAGRAM];
        memcpy(named, payload, len);
        memcpy(named, query_current(&core, NULL), WIRE_NONCE_BYTES);
        payload = named;
    }
    uint8_t challenge[WIRE_NONCE_BYTES];
    memcpy(challenge, core.challenge, sizeof challenge);
    size_t n = wire_seal(&h, payload, len, key, (data[5] & 2) == 0, out);
    core_datagram(&core, &peer, out, n);
    if (memcmp(challenge, core.challenge, sizeof challenge) != 0)   /* a run opened: the harness follows it */
        wire_link_set(&host_key, payload, challenge);
}

/* What the run reached, by the duck's own counters: requests handled (forwards
 * among them) and datagrams refused by reason. */
__attribute__((destructor)) static void report(void)
{
    if (!ready)
        return;
    const wire_stats *s = &core.stats;
    fprintf(stderr, "fuzz: duck counters: %llu datagrams, %llu requests handled (%llu forwards, %llu errors), "
            "%llu duplicates, refused: %llu malformed, %llu unauthenticated, %llu bad MAC, %llu replayed, "
            "%llu no run, %llu stale\n", (unsigned long long)s->datagrams_rx, (unsigned long long)s->requests,
            (unsigned long long)s->forwards, (unsigned long long)s->errors, (unsigned long long)s->duplicates,
            (unsigned long long)s->malformed, (unsigned long long)s->unauthenticated,
            (unsigned long long)s->bad_mac, (unsigned long long)s->replayed, (unsigned long long)s->no_run,
            (unsigned long long)s->stale);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!ready)
        setup();
    if (size == 0)
        return 0;
    switch (data[0] % 4) {
    case 0:
        core_datagram(&core, &peer, data + 1, size - 1);
        break;
    case 1:
        sealed(data + 1, size - 1);
        break;
    case 3:
        forward(data + 1, size - 1);
        break;
    default:   /* several sealed messages: each prefixed by a length byte */
        for (size_t i = 1; i < size;) {
            size_t n = data[i++];
            if (n > size - i)
                n = size - i;
            sealed(data + i, n);
            i += n;
        }
        break;
    }
    core.shutdown = 0;   /* a fuzzed SHUTDOWN must not end the run */
    return 0;
}
