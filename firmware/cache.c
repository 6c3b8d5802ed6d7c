/* The weight cache: serialized fp9 tensors held in RAM, content-addressed by
 * their BLAKE2b-128 digest (= native.fp9.Fp9Tensor.digest()), persisted as
 * <dir>/<hex digest>.fp9 so a restarted duck needs no re-upload, verified
 * on load and on upload, bounded by a capacity in bytes. */
#define _GNU_SOURCE
#include "duckfw.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cache_impl.h"

void cache_hex(const uint8_t *d, char out[2 * WIRE_DIGEST_BYTES + 1])
{
    for (int i = 0; i < WIRE_DIGEST_BYTES; i++)
        sprintf(out + 2 * i, "%02x", d[i]);
}

static int unhex(const char *s, uint8_t *d)
{
    for (int i = 0; i < WIRE_DIGEST_BYTES; i++) {
        unsigned v;
        if (sscanf(s + 2 * i, "%2x", &v) != 1)
            return -1;
        d[i] = (uint8_t)v;
    }
    return 0;
}

static uint32_t slot_of(const duck_cache *c, const uint8_t *digest)
{
    uint32_t h;
    memcpy(&h, digest, 4);
    return h & (c->size - 1);
}

cache_entry *cache_find(duck_cache *c, const uint8_t digest[WIRE_DIGEST_BYTES])
{
    for (uint32_t i = slot_of(c, digest);; i = (i + 1) & (c->size - 1)) {
        if (!c->table[i])
            return NULL;
        if (memcmp(c->table[i]->digest, digest, WIRE_DIGEST_BYTES) == 0)
            return c->table[i];
    }
}

int cache_table_put(duck_cache *c, cache_entry *e)
{
    if (2 * (c->count + 1) > c->size) {
        uint32_t old_size = c->size;
        cache_entry **old = c->table;
        cache_entry **grown = calloc(2 * (size_t)old_size, sizeof *grown);
        if (!grown)
            return -1;
        c->table = grown;
        c->size = 2 * old_size;
        c->count = 0;
        for (uint32_t i = 0; i < old_size; i++)
            if (old[i])
                cache_table_put(c, old[i]);
        free(old);
    }
    uint32_t i = slot_of(c, e->digest);
    while (c->table[i])
        i = (i + 1) & (c->size - 1);
    c->table[i] = e;
    c->count++;
    return 0;
}

/* Backward-shift deletion keeps probe chains intact without tombstones. */
static void table_del(duck_cache *c, cache_entry *e)
{
    uint32_t i = slot_of(c, e->digest), mask = c->size - 1;
    while (c->table[i] != e)
        i = (i + 1) & mask;
    c->table[i] = NULL;
    c->count--;
    for (uint32_t j = (i + 1) & mask; c->table[j]; j = (j + 1) & mask) {
        cache_entry *m = c->table[j];
        c->table[j] = NULL;
        c->count--;
        cache_table_put(c, m);
    }
}

cache_entry *cache_entry_new(const uint8_t *digest, void *data, uint64_t len)
{
    cache_entry *e = calloc(1, sizeof *e);
    if (!e)
        return NULL;
    memcpy(e->digest, digest, WIRE_DIGEST_BYTES);
    e->data = data;
    e->len = len;
    if (fp9_tensor_view(data, len, &e->m) != FP9_OK) {
        free(e);
        return NULL;
    }
    return e;
}

static void *read_file(const char *path, uint64_t *len)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0 || st.st_size <= 0) {
        if (fd >= 0)
            close(fd);
        return NULL;
    }
    void *p = NULL;
    if (posix_memalign(&p, 64, (size_t)st.st_size) != 0) {
        close(fd);
        return NULL;
    }
    size_t got = 0;
    while (got < (size_t)st.st_size) {
        ssize_t r = read(fd, (uint8_t *)p + got, (size_t)st.st_size - got);
        if (r <= 0)
            break;
        got += (size_t)r;
    }
    close(fd);
    if (got != (size_t)st.st_size) {
        free(p);
        return NULL;
    }
    *len = got;
    return p;
}

static void load_entry(duck_cache *c, const char *name, uint64_t *corrupt)
{
    uint8_t digest[WIRE_DIGEST_BYTES], actual[WIRE_DIGEST_BYTES];
    char path[4096 + 64];
    if (strlen(name) != 2 * WIRE_DIGEST_BYTES + 4 || strcmp(name + 2 * WIRE_DIGEST_BYTES, ".fp9") != 0 ||
        unhex(name, digest) != 0)
        return;
    snprintf(path, sizeof path, "%s/%s", c->dir, name);
    uint64_t len = 0;
    void *data = read_file(path, &len);
    if (!data) {
        dlog(DLOG_WARN, "cache: cannot read %s (%s); skipped", path, strerror(errno));
        return;
    }
    wire_digest(data, len, actual);
    cache_entry *e = memcmp(actual, digest, WIRE_DIGEST_BYTES) == 0 ? cache_entry_new(digest, data, len) : NULL;
    if (!e) {
        dlog(DLOG_ERROR, "cache: corrupt entry %s (%s); discarded", path,
             memcmp(actual, digest, WIRE_DIGEST_BYTES) ? "hash mismatch" : "not a valid fp9 tensor");
        free(data);
        unlink(path);
        (*corrupt)++;
        return;
    }
    if (c->used + len > c->capacity) {
        dlog(DLOG_WARN, "cache: %s (%llu bytes) does not fit the capacity (%llu of %llu used); not loaded",
             name, (unsigned long long)len, (unsigned long long)c->used, (unsigned long long)c->capacity);
        free(data);
        free(e);
        return;
    }
    if (cache_table_put(c, e) != 0) {
        free(data);
        free(e);
        return;
    }
    c->used += len;
}

duck_cache *cache_open(const char *dir, uint64_t capacity, uint64_t *corrupt)
{
    duck_cache *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    snprintf(c->dir, sizeof c->dir, "%s", dir);
    c->capacity = capacity;
    c->size = 64;
    c->table = calloc(c->size, sizeof *c->table);
    if (!c->table || (mkdir(dir, 0755) != 0 && errno != EEXIST)) {
        dlog(DLOG_ERROR, "cache: cannot create %s: %s", dir, strerror(errno));
        cache_close(c);
        return NULL;
    }
    DIR *d = opendir(dir);
    if (!d) {
        dlog(DLOG_ERROR, "cache: cannot open %s: %s", dir, strerror(errno));
        cache_close(c);
        return NULL;
    }
    for (struct dirent *de; (de = readdir(d));) {
        if (strstr(de->d_name, ".tmp")) {   /* a write cut short by a crash */
            char path[4096 + 300];
            snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
            unlink(path);
            continue;
        }
        load_entry(c, de->d_name, corrupt);
    }
    closedir(d);
    dlog(DLOG_INFO, "cache: %u entries, %llu of %llu bytes, from %s", c->count,
         (unsigned long long)c->used, (unsigned long long)c->capacity, dir);
    return c;
}

void cache_close(duck_cache *c)
{
    if (!c)
        return;
    for (uint32_t i = 0; c->table && i < c->size; i++)
        if (c->table[i]) {
            free(c->table[i]->data);
            free(c->table[i]);
        }
    for (int i = 0; i < STAGING_SLOTS; i++)
        free(c->st[i].buf);
    free(c->table);
    free(c);
}

uint64_t cache_used(const duck_cache *c) { return c->used; }
uint64_t cache_capacity(const duck_cache *c) { return c->capacity; }
uint32_t cache_count(const duck_cache *c) { return c->count; }

int cache_persist(duck_cache *c, const uint8_t *digest, const void *data, uint64_t len)
{
    char name[2 * WIRE_DIGEST_BYTES + 1], path[4096 + 64], tmp[4096 + 64];
    cache_hex(digest, name);
    snprintf(path, sizeof path, "%s/%s.fp9", c->dir, name);
    snprintf(tmp, sizeof tmp, "%s/%s.fp9.tmp", c->dir, name);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return -1;
    uint64_t done = 0;
    while (done < len) {
        ssize_t w = write(fd, (const uint8_t *)data + done, (size_t)(len - done));
        if (w <= 0)
            break;
        done += (uint64_t)w;
    }
    if (close(fd) != 0 || done != len || rename(tmp, path) != 0) {
        unlink(tmp);
        return -1;
    }
    return 0;
}

static void drop_entry(duck_cache *c, cache_entry *e)
{
    char name[2 * WIRE_DIGEST_BYTES + 1], path[4096 + 64];
    if (!e->synthetic) {
        cache_hex(e->digest, name);
        snprintf(path, sizeof path, "%s/%s.fp9", c->dir, name);
        unlink(path);
    }
    table_del(c, e);
    c->used -= e->len;
    free(e->data);
    free(e);
}

int cache_invalidate(duck_cache *c, const uint8_t *digest, uint32_t *dropped, char *err, size_t errlen)
{
    *dropped = 0;
    if (digest) {
        cache_entry *e = cache_find(c, digest);
        if (!e)
            return WIRE_OK;
        if (e->refs) {
            char name[2 * WIRE_DIGEST_BYTES + 1];
            cache_hex(digest, name);
            snprintf(err, errlen, "entry %s is used by the open session; close it first", name);
            return WIRE_E_BUSY;
        }
        drop_entry(c, e);
        *dropped = 1;
        return WIRE_OK;
    }
    uint32_t busy = 0, n = 0;
    cache_entry **all = malloc((c->count + 1) * sizeof *all);
    if (!all) {
        snprintf(err, errlen, "out of memory listing the cache");
        return WIRE_E_NOMEM;
    }
    for (uint32_t i = 0; i < c->size; i++)
        if (c->table[i])
            all[n++] = c->table[i];
    for (uint32_t i = 0; i < n; i++) {
        if (all[i]->refs) {
            busy++;
            continue;
        }
        drop_entry(c, all[i]);
        (*dropped)++;
    }
    free(all);
    for (int i = 0; i < STAGING_SLOTS; i++)
        if (c->st[i].used)
            cache_staging_drop(c, &c->st[i]);
    if (busy) {
        snprintf(err, errlen, "%u entries are used by the open session and were kept", busy);
        return WIRE_E_BUSY;
    }
    return WIRE_OK;
}
