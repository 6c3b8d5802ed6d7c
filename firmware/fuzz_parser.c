/* libFuzzer harness for everything a duck does with a datagram: the header
 * checks, reassembly, the MAC gate and every request handler. Inputs are
 * fed raw (mode 0), or sealed with the harness key so that the fuzzer
 * reaches the handlers behind the MAC (modes 1, 2); a sealed SYNTH may get
 * its entries' digests fixed up so that descriptors reach the generator.
 * Every datagram the duck sends back must pass wire_check with the same key. Built by
 * firmware/build.py (variant fuzz: clang -fsanitize=fuzzer; fuzz-gcc: the
 * same entry point driven by fuzz_main.c). */
#define _GNU_SOURCE
#include "duckfw.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static duck_core core;
static int ready;
static const duck_peer peer = {0x0100007f, 0x3930};

static void check_out(void *ctx, const duck_peer *to, uint8_t *const *dgrams, const size_t *lens, unsigned n)
{
    for (unsigned i = 0; i < n; i++) {
        wire_header h;
        const uint8_t *p;
        if (wire_check(dgrams[i], lens[i], &core.cfg.key, 0, &h, &p) != WIRE_CHECK_OK || !(h.flags & WIRE_F_REPLY)) {
            fprintf(stderr, "the duck sent a datagram that does not check\n");
            abort();
        }
    }
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
    cfg.mtu = WIRE_MTU_DEFAULT;
    cfg.key.len = 32;
    memset(cfg.key.bytes, 0x5a, cfg.key.len);
    dlog_init(0, DLOG_ERROR);
    if (core_init(&core, &cfg, check_out, NULL) != 0)
        abort();
    core.cores = 4;
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
    h.sequence = data[4];
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
    size_t n = wire_seal(&h, payload, len, &core.cfg.key, (data[5] & 2) == 0, out);
    core_datagram(&core, &peer, out, n);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!ready)
        setup();
    if (size == 0)
        return 0;
    switch (data[0] % 3) {
    case 0:
        core_datagram(&core, &peer, data + 1, size - 1);
        break;
    case 1:
        sealed(data + 1, size - 1);
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
