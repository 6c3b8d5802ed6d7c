/* Private to firmware/cache*.c: the cache's state. */
#ifndef DUCKFW_CACHE_IMPL_H
#define DUCKFW_CACHE_IMPL_H

#include "duckfw.h"

#define STAGING_SLOTS 8
#define UPLOAD_MAX_TENSOR (1ull << 32)   /* 4 GiB: larger is not a slice */

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
};

void cache_hex(const uint8_t *d, char out[2 * WIRE_DIGEST_BYTES + 1]);
cache_entry *cache_entry_new(const uint8_t *digest, void *data, uint64_t len);
int cache_table_put(duck_cache *c, cache_entry *e);
int cache_persist(duck_cache *c, const uint8_t *digest, const void *data, uint64_t len);
void cache_staging_drop(duck_cache *c, staging *s);

#endif
