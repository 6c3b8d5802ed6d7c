/* Private to firmware/cache*.c: the cache's state. */
#ifndef DUCKFW_CACHE_IMPL_H
#define DUCKFW_CACHE_IMPL_H

#include "duckfw.h"

#define STAGING_SLOTS 8
#define UPLOAD_MAX_TENSOR (1ull << 32)   /* 4 GiB: larger is not a slice */

/* Weight memory: tensors are bumped out of 2 MiB-aligned chunks that ask for
 * transparent huge pages (see cache.c). */
typedef struct wchunk {
    struct wchunk *next;
    uint8_t *map;          /* the mapping, map_len bytes */
    size_t map_len;
    uint8_t *next_free, *end;
    uint64_t live;         /* tensors in it */
} wchunk;

typedef struct staging {
    int used;
    uint8_t digest[WIRE_DIGEST_BYTES];
    uint64_t total, have, touched;
    uint8_t *buf;
} staging;

struct duck_cache {
    char dir[4096];
    uint64_t capacity, used, reserved;
    cache_entry **table;       /* open addressing, power-of-two size */
    uint32_t size, count;
    staging st[STAGING_SLOTS];
    uint64_t clock;
    wchunk *chunks;            /* newest first; tensors are bumped out of the first */
};

void cache_hex(const uint8_t *d, char out[2 * WIRE_DIGEST_BYTES + 1]);
/* A 64-byte aligned buffer for a tensor of len bytes (not zeroed), or NULL. */
void *cache_mem_alloc(duck_cache *c, uint64_t len);
void cache_mem_free(duck_cache *c, void *p);
cache_entry *cache_entry_new(const uint8_t *digest, void *data, uint64_t len);
int cache_table_put(duck_cache *c, cache_entry *e);
int cache_persist(duck_cache *c, const uint8_t *digest, const void *data, uint64_t len);
void cache_staging_drop(duck_cache *c, staging *s);

#endif
