/* Synthetic tensors for benchmarks (WIRE_T_SYNTH): generated in RAM from
 * their descriptors (native/fp9/fp9_synth.h) instead of uploaded, keyed by
 * wire_synth_digest, counted against the capacity like any entry, never
 * written to disk (the host makes them again after a restart: generating
 * is faster than reading them back would be). */
#define _GNU_SOURCE
#include "cache_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Whether an earlier entry of the request has the same digest. */
static int repeated(const wire_synth_entry *entries, uint32_t i)
{
    for (uint32_t j = 0; j < i; j++)
        if (memcmp(entries[j].digest, entries[i].digest, WIRE_DIGEST_BYTES) == 0)
            return 1;
    return 0;
}

static int check_entries(duck_cache *c, const wire_synth_entry *entries, uint32_t n, uint64_t *need, char *err,
                         size_t errlen)
{
    *need = 0;
    for (uint32_t i = 0; i < n; i++) {
        const wire_synth_entry *e = &entries[i];
        char why[WIRE_MAX_ERROR_TEXT];
        int st = fp9_synth_check(&e->desc, why, sizeof why);
        if (st != FP9_OK) {
            snprintf(err, errlen, "synth entry %u of %u: %s", i, n, why);
            return st == FP9_EFORMAT ? WIRE_E_UNSUPPORTED : WIRE_E_RANGE;
        }
        uint8_t want[WIRE_DIGEST_BYTES];
        wire_synth_digest(&e->desc, want);
        if (memcmp(want, e->digest, WIRE_DIGEST_BYTES) != 0) {
            char got[2 * WIRE_DIGEST_BYTES + 1], mine[2 * WIRE_DIGEST_BYTES + 1];
            cache_hex(e->digest, got);
            cache_hex(want, mine);
            snprintf(err, errlen, "synth entry %u of %u: digest %s is not the descriptor's %s; host and duck "
                     "disagree on the synth recipe", i, n, got, mine);
            return WIRE_E_HASH_MISMATCH;
        }
        if (!cache_find(c, e->digest) && !repeated(entries, i))
            *need += fp9_synth_bytes(&e->desc);
    }
    return WIRE_OK;
}

int cache_synth(duck_cache *c, const wire_synth_entry *entries, uint32_t n, duck_pool *pool,
                wire_synth_reply *rep, char *err, size_t errlen)
{
    memset(rep, 0, sizeof *rep);
    uint64_t need = 0;
    int st = check_entries(c, entries, n, &need, err, errlen);
    if (st != WIRE_OK)
        return st;
    if (c->used + c->reserved + need > c->capacity) {
        snprintf(err, errlen, "cache full: %llu of %llu bytes used (+%llu in uploads), %u synthetic tensors need "
                 "%llu; invalidate entries or raise --cache-capacity", (unsigned long long)c->used,
                 (unsigned long long)c->capacity, (unsigned long long)c->reserved, n, (unsigned long long)need);
        return WIRE_E_CACHE_FULL;
    }
    for (uint32_t i = 0; i < n; i++) {
        const wire_synth_entry *se = &entries[i];
        if (cache_find(c, se->digest)) {
            rep->present++;
            continue;
        }
        uint64_t len = fp9_synth_bytes(&se->desc);
        void *buf = cache_mem_alloc(c, len);
        if (!buf) {
            snprintf(err, errlen, "synth entry %u of %u: cannot allocate %llu bytes", i, n, (unsigned long long)len);
            return WIRE_E_NOMEM;
        }
        cache_entry *e = NULL;
        if (fp9_synth_generate(&se->desc, buf, (size_t)len, pool) != FP9_OK ||
            !(e = cache_entry_new(se->digest, buf, len)) || cache_table_put(c, e) != 0) {
            snprintf(err, errlen, "synth entry %u of %u: %s", i, n,
                     e ? "out of memory indexing the cache" : "generated tensor does not check (a bug)");
            free(e);
            cache_mem_free(c, buf);
            return e ? WIRE_E_NOMEM : WIRE_E_BAD_TENSOR;
        }
        e->synthetic = 1;
        c->used += len;
        rep->created++;
        rep->bytes_created += len;
    }
    dlog(DLOG_INFO, "cache: synthesized %u tensors (%llu bytes), %u already held; %llu of %llu used", rep->created,
         (unsigned long long)rep->bytes_created, rep->present, (unsigned long long)c->used,
         (unsigned long long)c->capacity);
    return WIRE_OK;
}
