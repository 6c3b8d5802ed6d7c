/* Uploads into the cache: staged in RAM in order, verified by hash and fp9
 * header on the last byte, then persisted and indexed. Up to STAGING_SLOTS
 * uploads are in progress at once; their bytes count against the capacity. */
#define _GNU_SOURCE
#include "cache_impl.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static staging *staging_get(duck_cache *c, const uint8_t *digest, int create)
{
    staging *lru = &c->st[0];
    for (int i = 0; i < STAGING_SLOTS; i++) {
        if (c->st[i].used && memcmp(c->st[i].digest, digest, WIRE_DIGEST_BYTES) == 0)
            return &c->st[i];
        if (!c->st[i].used || (lru->used && c->st[i].touched < lru->touched))
            lru = &c->st[i];
    }
    if (!create)
        return NULL;
    if (lru->used) {
        dlog(DLOG_WARN, "cache: dropping an unfinished upload (%llu of %llu bytes) to make room",
             (unsigned long long)lru->have, (unsigned long long)lru->total);
        c->reserved -= lru->total;
        cache_mem_free(c, lru->buf);
    }
    memset(lru, 0, sizeof *lru);
    return lru;
}

int cache_upload(duck_cache *c, const wire_upload *u, const uint8_t *data,
                 wire_upload_reply *rep, uint64_t *accepted, char *err, size_t errlen)
{
    *accepted = 0;
    char name[2 * WIRE_DIGEST_BYTES + 1];
    cache_hex(u->digest, name);
    memset(rep, 0, sizeof *rep);
    if (u->total < sizeof(fp9_tensor_header) || u->total > UPLOAD_MAX_TENSOR || u->offset > u->total ||
        u->len > u->total - u->offset) {
        snprintf(err, errlen, "upload %s: part [%llu, +%u) of a %llu-byte tensor is out of range", name,
                 (unsigned long long)u->offset, u->len, (unsigned long long)u->total);
        return WIRE_E_RANGE;
    }
    cache_entry *e = cache_find(c, u->digest);
    if (e) {
        rep->have = e->len;
        rep->complete = 1;
        return WIRE_OK;
    }
    staging *s = staging_get(c, u->digest, 0);
    if (!s && (u->len == 0 || u->offset != 0))
        return WIRE_OK;   /* nothing held: have = 0, the host starts over */
    if (!s) {
        if (c->used + c->reserved + u->total > c->capacity) {
            snprintf(err, errlen, "cache full: %llu of %llu bytes used (+%llu in uploads), tensor %s needs %llu; "
                     "invalidate entries or raise --cache-capacity", (unsigned long long)c->used,
                     (unsigned long long)c->capacity, (unsigned long long)c->reserved, name,
                     (unsigned long long)u->total);
            return WIRE_E_CACHE_FULL;
        }
        s = staging_get(c, u->digest, 1);
        void *buf = cache_mem_alloc(c, u->total);
        if (!buf) {
            snprintf(err, errlen, "upload %s: cannot allocate %llu bytes", name, (unsigned long long)u->total);
            return WIRE_E_NOMEM;
        }
        s->used = 1;
        s->buf = buf;
        s->total = u->total;
        memcpy(s->digest, u->digest, WIRE_DIGEST_BYTES);
        c->reserved += u->total;
        dlog(DLOG_INFO, "cache: upload %s started (%llu bytes)", name, (unsigned long long)u->total);
    }
    s->touched = ++c->clock;
    if (s->total != u->total) {
        snprintf(err, errlen, "upload %s: total %llu differs from the %llu of the upload in progress", name,
                 (unsigned long long)u->total, (unsigned long long)s->total);
        return WIRE_E_MALFORMED;
    }
    if (u->offset == s->have && u->len) {
        memcpy(s->buf + s->have, data, u->len);
        s->have += u->len;
        *accepted = u->len;
    }
    rep->have = s->have;
    if (s->have < s->total)
        return WIRE_OK;
    uint8_t actual[WIRE_DIGEST_BYTES];
    wire_digest(s->buf, s->total, actual);
    if (memcmp(actual, u->digest, WIRE_DIGEST_BYTES) != 0) {
        char got[2 * WIRE_DIGEST_BYTES + 1];
        cache_hex(actual, got);
        snprintf(err, errlen, "upload %s: content hashes to %s; discarded", name, got);
        cache_staging_drop(c, s);
        rep->have = 0;
        return WIRE_E_HASH_MISMATCH;
    }
    e = cache_entry_new(u->digest, s->buf, s->total);
    if (!e) {
        snprintf(err, errlen, "upload %s: not a valid fp9 tensor; discarded", name);
        cache_staging_drop(c, s);
        rep->have = 0;
        return WIRE_E_BAD_TENSOR;
    }
    if (cache_persist(c, u->digest, s->buf, s->total) != 0 || cache_table_put(c, e) != 0) {
        snprintf(err, errlen, "upload %s: cannot write %s: %s", name, c->dir, strerror(errno));
        free(e);
        cache_staging_drop(c, s);
        rep->have = 0;
        return WIRE_E_IO;
    }
    c->reserved -= s->total;
    c->used += s->total;
    memset(s, 0, sizeof *s);   /* the buffer now belongs to the entry */
    rep->complete = 1;
    dlog(DLOG_INFO, "cache: %s stored (%llu bytes; %llu of %llu used)", name, (unsigned long long)e->len,
         (unsigned long long)c->used, (unsigned long long)c->capacity);
    return WIRE_OK;
}

