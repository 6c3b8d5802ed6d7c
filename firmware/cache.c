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
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cache_impl.h"

/* Weight memory. A forward streams a few hundred KiB from each of many
 * separate tensors; in 4 KiB pages that is a TLB miss (a page walk, nested
 * in a VM) every 4 KiB. So tensors are bumped out of 2 MiB-aligned chunks of
 * CHUNK_BYTES that ask for transparent huge pages (MADV_HUGEPAGE: honoured
 * where /sys/kernel/mm/transparent_hugepage/enabled is madvise or always).
 * On the dev VM a top-8 MoE forward over 128 Qwen3-30B slices ran 8-13 %
 * faster from one huge-page arena than from one allocation per tensor
 * (1 thread, medians of interleaved rounds). A 64-byte header before each
 * tensor names its chunk; a chunk is unmapped when its last tensor is freed
 * (the newest is kept and reused), so a freed tensor's bytes return to the
 * OS only with the rest of its chunk. Under AddressSanitizer every tensor is
 * its own allocation, so that reads past a tensor are still caught. */
#define CHUNK_BYTES ((size_t)64 << 20)
#define HUGE_BYTES ((size_t)2 << 20)
#define HEADER_BYTES 64

#if defined(__SANITIZE_ADDRESS__)
void *cache_mem_alloc(duck_cache *c, uint64_t len)
{
    (void)c;
    void *p = NULL;
    return len <= SIZE_MAX - 64 && posix_memalign(&p, 64, (size_t)len) == 0 ? p : NULL;
}

void cache_mem_free(duck_cache *c, void *p)
{
    (void)c;
    free(p);
}

static void mem_close(duck_cache *c) { (void)c; }
#else
static wchunk *chunk_new(size_t need)
{
    size_t len = need > CHUNK_BYTES / 2 ? (need + HUGE_BYTES - 1) / HUGE_BYTES * HUGE_BYTES : CHUNK_BYTES;
    wchunk *k = calloc(1, sizeof *k);
    uint8_t *map = k ? mmap(NULL, len + HUGE_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
                     : MAP_FAILED;
    if (map == MAP_FAILED) {
        free(k);
        return NULL;
    }
#ifdef MADV_HUGEPAGE
    madvise(map, len + HUGE_BYTES, MADV_HUGEPAGE);   /* advice: 4 KiB pages where refused */
#endif
    k->map = map;
    k->map_len = len + HUGE_BYTES;
    k->next_free = map + (-(uintptr_t)map & (HUGE_BYTES - 1));
    k->end = k->next_free + len;
    return k;
}

void *cache_mem_alloc(duck_cache *c, uint64_t len)
{
    if (len > SIZE_MAX / 2)
        return NULL;
    size_t need = HEADER_BYTES + ((size_t)len + 63) / 64 * 64;
    wchunk *k = c->chunks;
    if (!k || (size_t)(k->end - k->next_free) < need) {
        if (!(k = chunk_new(need)))
            return NULL;
        k->next = c->chunks;
        c->chunks = k;
    }
    uint8_t *p = k->next_free;
    k->next_free += need;
    k->live++;
    memcpy(p, &k, sizeof k);
    return p + HEADER_BYTES;
}

void cache_mem_free(duck_cache *c, void *data)
{
    if (!data)
        return;
    wchunk *k;
    memcpy(&k, (uint8_t *)data - HEADER_BYTES, sizeof k);
    if (--k->live)
        return;
    if (k == c->chunks) {   /* the newest: keep it for the next tensors */
        k->next_free = k->map + (-(uintptr_t)k->map & (HUGE_BYTES - 1));
        return;
    }
    for (wchunk **at = &c->chunks; *at; at = &(*at)->next)
        if (*at == k) {
            *at = k->next;
            break;
        }
    munmap(k->map, k->map_len);
    free(k);
}

static void mem_close(duck_cache *c)
{
    while (c->chunks) {
        wchunk *k = c->chunks;
        c->chunks = k->next;
        munmap(k->map, k->map_len);
        free(k);
    }
}
#endif

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

static void *read_file(duck_cache *c, const char *path, uint64_t *len)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0 || st.st_size <= 0) {
        if (fd >= 0)
            close(fd);
        return NULL;
    }
    void *p = cache_mem_alloc(c, (uint64_t)st.st_size);
    if (!p) {
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
        cache_mem_free(c, p);
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
    void *data = read_file(c, path, &len);
    if (!data) {
        dlog(DLOG_WARN, "cache: cannot read %s (%s); skipped", path, strerror(errno));
        return;
    }
    wire_digest(data, len, actual);
    cache_entry *e = memcmp(actual, digest, WIRE_DIGEST_BYTES) == 0 ? cache_entry_new(digest, data, len) : NULL;
    if (!e) {
        dlog(DLOG_ERROR, "cache: corrupt entry %s (%s); discarded", path,
             memcmp(actual, digest, WIRE_DIGEST_BYTES) ? "hash mismatch" : "not a valid fp9 tensor");
        cache_mem_free(c, data);
        unlink(path);
        (*corrupt)++;
        return;
    }
    if (c->used + len > c->capacity) {
        dlog(DLOG_WARN, "cache: %s (%llu bytes) does not fit the capacity (%llu of %llu used); not loaded",
             name, (unsigned long long)len, (unsigned long long)c->used, (unsigned long long)c->capacity);
        cache_mem_free(c, data);
        free(e);
        return;
    }
    if (cache_table_put(c, e) != 0) {
        cache_mem_free(c, data);
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
    if (c->table && !dir[0]) {   /* --memory-cache */
        dlog(DLOG_INFO, "cache: in memory only, %llu bytes", (unsigned long long)c->capacity);
        return c;
    }
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
            cache_mem_free(c, c->table[i]->data);
            free(c->table[i]);
        }
    for (int i = 0; i < STAGING_SLOTS; i++)
        cache_mem_free(c, c->st[i].buf);
    mem_close(c);
    free(c->table);
    free(c);
}

uint64_t cache_used(const duck_cache *c) { return c->used; }
uint64_t cache_capacity(const duck_cache *c) { return c->capacity; }
uint32_t cache_count(const duck_cache *c) { return c->count; }

int cache_persist(duck_cache *c, const uint8_t *digest, const void *data, uint64_t len)
{
    char name[2 * WIRE_DIGEST_BYTES + 1], path[4096 + 64], tmp[4096 + 64];
    if (!c->dir[0])
        return 0;
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
    if (!e->synthetic && c->dir[0]) {
        cache_hex(e->digest, name);
        snprintf(path, sizeof path, "%s/%s.fp9", c->dir, name);
        unlink(path);
    }
    table_del(c, e);
    c->used -= e->len;
    cache_mem_free(c, e->data);
    free(e);
}

/* An upload in progress dropped (cache_upload.c stages them; the cache owns the slots). */
void cache_staging_drop(duck_cache *c, staging *s)
{
    c->reserved -= s->total;
    cache_mem_free(c, s->buf);
    memset(s, 0, sizeof *s);
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
