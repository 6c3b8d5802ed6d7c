/* Wire integrity: CRC-32C checksum, BLAKE2b (RFC 7693; the content digest
 * and, keyed, the fleet MAC and the link key's PRF), the link MAC
 * (Poly1305: poly1305.c), sealing and checking of datagrams. No external
 * crypto library: BLAKE2b is short, and tests hold it to Python's hashlib. */
#include "wire.h"
#include "wire_synth.h"

#include <string.h>

/* --- CRC-32C (Castagnoli), reflected, init/xorout 0xFFFFFFFF ------------ */

static uint32_t crc_table[8][256];
static int crc_ready;

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xFF];
    /* threads may check datagrams at once (the transport's helpers): the tables before the flag */
    __atomic_store_n(&crc_ready, 1, __ATOMIC_RELEASE);
}

static uint32_t crc_generic(uint32_t c, const uint8_t *p, size_t n)
{
    if (!__atomic_load_n(&crc_ready, __ATOMIC_ACQUIRE))
        crc_init();
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        v ^= c;
        c = crc_table[7][v & 0xFF] ^ crc_table[6][(v >> 8) & 0xFF] ^ crc_table[5][(v >> 16) & 0xFF] ^
            crc_table[4][(v >> 24) & 0xFF] ^ crc_table[3][(v >> 32) & 0xFF] ^
            crc_table[2][(v >> 40) & 0xFF] ^ crc_table[1][(v >> 48) & 0xFF] ^ crc_table[0][v >> 56];
        p += 8;
        n -= 8;
    }
    while (n--)
        c = (c >> 8) ^ crc_table[0][(c ^ *p++) & 0xFF];
    return c;
}

#if defined(__x86_64__) && defined(__GNUC__)
/* The crc32 instruction has a latency of 3 cycles and a throughput of 1: one
 * chain of it runs at a third of its speed. Long inputs go as three chains
 * over three consecutive blocks of CRC_BLOCK bytes, joined by shifting the
 * first two over the bytes that follow them. Shifting a raw CRC register
 * over n zero bytes is linear over GF(2): shift_n[k][b] is the shift of
 * byte b at position k of the register, so a shift is four lookups. */
#define CRC_BLOCK 512
static uint32_t shift_1[4][256], shift_2[4][256];   /* over CRC_BLOCK and 2 * CRC_BLOCK zero bytes */
static int shift_ready;

__attribute__((target("sse4.2"))) static uint32_t crc_sse42_1way(uint32_t c, const uint8_t *p, size_t n)
{
    uint64_t c64 = c;
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c64 = __builtin_ia32_crc32di(c64, v);
        p += 8;
        n -= 8;
    }
    c = (uint32_t)c64;
    while (n--)
        c = __builtin_ia32_crc32qi(c, *p++);
    return c;
}

static void shift_init(void)
{
    static const uint8_t zeros[2 * CRC_BLOCK];
    for (int k = 0; k < 4; k++)
        for (uint32_t b = 0; b < 256; b++) {
            shift_1[k][b] = crc_sse42_1way(b << (8 * k), zeros, CRC_BLOCK);
            shift_2[k][b] = crc_sse42_1way(b << (8 * k), zeros, 2 * CRC_BLOCK);
        }
    __atomic_store_n(&shift_ready, 1, __ATOMIC_RELEASE);
}

static inline uint32_t shift(uint32_t (*t)[256], uint32_t c)
{
    return t[0][c & 0xFF] ^ t[1][(c >> 8) & 0xFF] ^ t[2][(c >> 16) & 0xFF] ^ t[3][c >> 24];
}

__attribute__((target("sse4.2"))) static uint32_t crc_sse42(uint32_t c, const uint8_t *p, size_t n)
{
    if (n >= 3 * CRC_BLOCK && !__atomic_load_n(&shift_ready, __ATOMIC_ACQUIRE))
        shift_init();
    while (n >= 3 * CRC_BLOCK) {
        uint64_t a = c, b = 0, d = 0;
        for (size_t i = 0; i < CRC_BLOCK; i += 8) {
            uint64_t va, vb, vd;
            memcpy(&va, p + i, 8);
            memcpy(&vb, p + CRC_BLOCK + i, 8);
            memcpy(&vd, p + 2 * CRC_BLOCK + i, 8);
            a = __builtin_ia32_crc32di(a, va);
            b = __builtin_ia32_crc32di(b, vb);
            d = __builtin_ia32_crc32di(d, vd);
        }
        c = shift(shift_2, (uint32_t)a) ^ shift(shift_1, (uint32_t)b) ^ (uint32_t)d;
        p += 3 * CRC_BLOCK;
        n -= 3 * CRC_BLOCK;
    }
    return crc_sse42_1way(c, p, n);
}
#endif

uint32_t wire_crc32c(uint32_t crc, const void *data, size_t len)
{
    uint32_t c = ~crc;
#if defined(__x86_64__) && defined(__GNUC__)
    static int has_sse42 = -1;
    if (has_sse42 < 0)
        has_sse42 = __builtin_cpu_supports("sse4.2") ? 1 : 0;
    if (has_sse42)
        return ~crc_sse42(c, data, len);
#endif
    return ~crc_generic(c, data, len);
}

/* --- BLAKE2b ---------------------------------------------------------- */

typedef struct blake2b_state {
    uint64_t h[8], t;
    uint8_t buf[128];
    size_t fill, outlen;
} blake2b_state;

static const uint64_t B2_IV[8] = {
    0x6a09e667f3bcc908ull, 0xbb67ae8584caa73bull, 0x3c6ef372fe94f82bull, 0xa54ff53a5f1d36f1ull,
    0x510e527fade682d1ull, 0x9b05688c2b3e6c1full, 0x1f83d9abfb41bd6bull, 0x5be0cd19137e2179ull};

static const uint8_t B2_SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

static inline uint64_t rotr64(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

#define B2_G(a, b, c, d, x, y)          \
    do {                                \
        a = a + b + x;                  \
        d = rotr64(d ^ a, 32);          \
        c = c + d;                      \
        b = rotr64(b ^ c, 24);          \
        a = a + b + y;                  \
        d = rotr64(d ^ a, 16);          \
        c = c + d;                      \
        b = rotr64(b ^ c, 63);          \
    } while (0)

static void b2_compress(blake2b_state *s, const uint8_t *block, int last)
{
    uint64_t m[16], v[16];
    memcpy(m, block, 128);   /* little-endian host */
    for (int i = 0; i < 8; i++) {
        v[i] = s->h[i];
        v[i + 8] = B2_IV[i];
    }
    v[12] ^= s->t;
    if (last)
        v[14] = ~v[14];
    for (int r = 0; r < 12; r++) {
        const uint8_t *sg = B2_SIGMA[r];
        B2_G(v[0], v[4], v[8], v[12], m[sg[0]], m[sg[1]]);
        B2_G(v[1], v[5], v[9], v[13], m[sg[2]], m[sg[3]]);
        B2_G(v[2], v[6], v[10], v[14], m[sg[4]], m[sg[5]]);
        B2_G(v[3], v[7], v[11], v[15], m[sg[6]], m[sg[7]]);
        B2_G(v[0], v[5], v[10], v[15], m[sg[8]], m[sg[9]]);
        B2_G(v[1], v[6], v[11], v[12], m[sg[10]], m[sg[11]]);
        B2_G(v[2], v[7], v[8], v[13], m[sg[12]], m[sg[13]]);
        B2_G(v[3], v[4], v[9], v[14], m[sg[14]], m[sg[15]]);
    }
    for (int i = 0; i < 8; i++)
        s->h[i] ^= v[i] ^ v[i + 8];
}

static void b2_update(blake2b_state *s, const void *data, size_t len)
{
    const uint8_t *p = data;
    while (len) {
        if (s->fill == 128) {   /* keep the last block until final */
            s->t += 128;
            b2_compress(s, s->buf, 0);
            s->fill = 0;
        }
        size_t take = 128 - s->fill < len ? 128 - s->fill : len;
        memcpy(s->buf + s->fill, p, take);
        s->fill += take;
        p += take;
        len -= take;
    }
}

static void b2_init(blake2b_state *s, size_t outlen, const uint8_t *key, size_t keylen)
{
    memcpy(s->h, B2_IV, sizeof s->h);
    s->h[0] ^= 0x01010000ull ^ ((uint64_t)keylen << 8) ^ outlen;
    s->t = 0;
    s->fill = 0;
    s->outlen = outlen;
    if (keylen) {
        uint8_t block[128] = {0};
        memcpy(block, key, keylen);
        b2_update(s, block, 128);
    }
}

static void b2_final(blake2b_state *s, uint8_t *out)
{
    s->t += s->fill;
    memset(s->buf + s->fill, 0, 128 - s->fill);
    b2_compress(s, s->buf, 1);
    memcpy(out, s->h, s->outlen);
}

void wire_digest(const void *data, size_t len, uint8_t out[WIRE_DIGEST_BYTES])
{
    blake2b_state s;
    b2_init(&s, WIRE_DIGEST_BYTES, NULL, 0);
    b2_update(&s, data, len);
    b2_final(&s, out);
}

void wire_digest_tagged(const void *tag, size_t taglen, const void *data, size_t len,
                        uint8_t out[WIRE_DIGEST_BYTES])
{
    blake2b_state s;
    b2_init(&s, WIRE_DIGEST_BYTES, NULL, 0);
    b2_update(&s, tag, taglen);
    b2_update(&s, data, len);
    b2_final(&s, out);
}

void wire_mac(const wire_key *key, const void *hdr, const void *payload, size_t len,
              uint8_t out[WIRE_MAC_BYTES])
{
    blake2b_state s;
    b2_init(&s, WIRE_MAC_BYTES, key->bytes, key->len);
    b2_update(&s, hdr, WIRE_HEADER_BYTES);
    b2_update(&s, payload, len);
    b2_final(&s, out);
}

/* --- the link key and its one-time Poly1305 keys ---------------------- */

void wire_link_set(wire_key *key, const uint8_t run[WIRE_NONCE_BYTES], const uint8_t challenge[WIRE_NONCE_BYTES])
{
    static const char tag[] = "duck-link-v1";
    uint8_t link[WIRE_LINK_KEY_BYTES];
    blake2b_state s;
    b2_init(&s, WIRE_LINK_KEY_BYTES, key->bytes, key->len);
    b2_update(&s, tag, sizeof tag - 1);
    b2_update(&s, run, WIRE_NONCE_BYTES);
    b2_update(&s, challenge, WIRE_NONCE_BYTES);
    b2_final(&s, link);
    /* the PRF of the one-time keys, its key block compressed once here */
    uint8_t block[128] = {0};
    memcpy(block, link, sizeof link);
    b2_init(&s, 32, NULL, 0);
    s.h[0] ^= (uint64_t)WIRE_LINK_KEY_BYTES << 8;
    s.t = 128;
    b2_compress(&s, block, 0);
    memcpy(key->link_prf, s.h, sizeof key->link_prf);
    memcpy(key->run, run, WIRE_NONCE_BYTES);
    key->has_link = 1;
    memset(link, 0, sizeof link);
    memset(block, 0, sizeof block);
}

void wire_link_mac(const wire_key *key, const void *hdr, const void *payload, size_t len, uint8_t out[WIRE_MAC_BYTES])
{
    blake2b_state s;
    uint8_t otk[32];
    memcpy(s.h, key->link_prf, sizeof s.h);
    s.t = 128;
    s.fill = 0;
    s.outlen = sizeof otk;
    b2_update(&s, hdr, WIRE_HEADER_BYTES);
    b2_final(&s, otk);
    wire_poly1305(otk, hdr, WIRE_HEADER_BYTES, payload, len, out);
}

/* The MAC of the type's kind; -1 when it is a link MAC and there is no link. */
static int type_mac(const wire_key *key, unsigned type, const void *hdr, const void *payload, size_t len,
                    uint8_t out[WIRE_MAC_BYTES])
{
    if (wire_mac_kind(type) == WIRE_MAC_FLEET) {
        wire_mac(key, hdr, payload, len, out);
        return 0;
    }
    if (!key->has_link)
        return -1;
    wire_link_mac(key, hdr, payload, len, out);
    return 0;
}

/* --- datagrams -------------------------------------------------------- */

size_t wire_seal(const wire_header *h, const void *payload, uint32_t len,
                 const wire_key *key, int with_mac, uint8_t *out)
{
    if (len)
        memcpy(out + WIRE_HEADER_BYTES, payload, len);
    return wire_seal_in_place(h, len, key, with_mac, out);
}

size_t wire_seal_in_place(const wire_header *h, uint32_t len, const wire_key *key, int with_mac, uint8_t *out)
{
    wire_header hd = *h;
    hd.magic = WIRE_MAGIC;
    hd.version = WIRE_VERSION;
    hd.payload_len = len;
    hd.checksum = 0;
    with_mac = with_mac && key && key->len && (wire_mac_kind(hd.type) == WIRE_MAC_FLEET || key->has_link);
    hd.flags = (uint16_t)((hd.flags & ~WIRE_F_MAC) | (with_mac ? WIRE_F_MAC : 0));
    memcpy(out, &hd, WIRE_HEADER_BYTES);
    size_t n = WIRE_HEADER_BYTES + len;
    if (with_mac) {
        type_mac(key, hd.type, out, out + WIRE_HEADER_BYTES, len, out + n);
        n += WIRE_MAC_BYTES;
    }
    hd.checksum = wire_crc32c(0, out, n);
    memcpy(out + offsetof(wire_header, checksum), &hd.checksum, 4);
    return n;
}

/* Constant-time compare: a MAC check must not leak how many bytes matched. */
static int mac_equal(const uint8_t *a, const uint8_t *b)
{
    uint8_t d = 0;
    for (int i = 0; i < WIRE_MAC_BYTES; i++)
        d |= (uint8_t)(a[i] ^ b[i]);
    return d == 0;
}

int wire_check(const uint8_t *buf, size_t len, const wire_key *key, int require_mac,
               wire_header *h, const uint8_t **payload)
{
    if (!buf || len < WIRE_HEADER_BYTES)
        return WIRE_CHECK_SHORT;
    memcpy(h, buf, WIRE_HEADER_BYTES);
    if (h->magic != WIRE_MAGIC || h->version != WIRE_VERSION)
        return WIRE_CHECK_MAGIC;
    int has_mac = (h->flags & WIRE_F_MAC) != 0;
    if (len > WIRE_MAX_DATAGRAM || h->total_len > WIRE_MAX_MESSAGE ||
        len != WIRE_HEADER_BYTES + (size_t)h->payload_len + (has_mac ? WIRE_MAC_BYTES : 0))
        return WIRE_CHECK_LENGTH;
    if (h->frag_count == 0 || h->frag_count > WIRE_MAX_FRAGMENTS || h->frag_index >= h->frag_count ||
        (h->total_len == 0 && h->frag_count != 1))
        return WIRE_CHECK_FRAGMENT;
    uint32_t fsize = wire_frag_size(h->total_len, h->frag_count);
    uint64_t offset = (uint64_t)fsize * h->frag_index;
    if (offset > h->total_len || h->payload_len != (uint32_t)(h->total_len - offset < fsize ? h->total_len - offset : fsize) ||
        (h->frag_count > 1 && (uint64_t)fsize * (h->frag_count - 1) >= h->total_len))
        return WIRE_CHECK_FRAGMENT;
    uint32_t want = h->checksum;
    wire_header zero = *h;
    zero.checksum = 0;
    uint32_t crc = wire_crc32c(0, &zero, WIRE_HEADER_BYTES);
    crc = wire_crc32c(crc, buf + WIRE_HEADER_BYTES, len - WIRE_HEADER_BYTES);
    if (crc != want)
        return WIRE_CHECK_CHECKSUM;
    if (h->type == 0 || h->type >= WIRE_T_COUNT || (h->flags & ~WIRE_F_KNOWN))
        return WIRE_CHECK_TYPE;
    if (has_mac || require_mac) {
        int link = wire_mac_kind(h->type) == WIRE_MAC_LINK;
        if (!has_mac || !key || !key->len)
            return WIRE_CHECK_MAC;
        uint8_t mac[WIRE_MAC_BYTES];
        if (type_mac(key, h->type, &zero, buf + WIRE_HEADER_BYTES, h->payload_len, mac) != 0)
            return WIRE_CHECK_NO_LINK;
        if (!mac_equal(mac, buf + WIRE_HEADER_BYTES + h->payload_len))
            return link ? WIRE_CHECK_LINK_MAC : WIRE_CHECK_MAC;
    }
    *payload = buf + WIRE_HEADER_BYTES;
    return WIRE_CHECK_OK;
}

void wire_f32_to_bf16_n(const float *src, uint16_t *dst, size_t n)
{
    for (size_t i = 0; i < n; i++) {   /* branch-free so that it vectorizes */
        uint32_t u;
        memcpy(&u, src + i, 4);
        uint16_t rounded = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
        uint16_t quiet = (uint16_t)((u >> 16) | 0x40u);
        dst[i] = (u & 0x7FFFFFFFu) > 0x7F800000u ? quiet : rounded;
    }
}

const char *wire_check_str(int result)
{
    switch (result) {
    case WIRE_CHECK_OK: return "ok";
    case WIRE_CHECK_SHORT: return "shorter than a header";
    case WIRE_CHECK_MAGIC: return "bad magic or version";
    case WIRE_CHECK_LENGTH: return "length disagrees with the header or limits";
    case WIRE_CHECK_FRAGMENT: return "inconsistent fragment geometry";
    case WIRE_CHECK_CHECKSUM: return "checksum mismatch";
    case WIRE_CHECK_MAC: return "MAC missing or wrong";
    case WIRE_CHECK_TYPE: return "unknown type or flags";
    case WIRE_CHECK_LINK_MAC: return "link MAC wrong (forged, or of another run or duck)";
    case WIRE_CHECK_NO_LINK: return "link MAC, and no run open";
    default: return "unknown check result";
    }
}

const wire_type_info wire_types[WIRE_T_COUNT] = {
    [0] = {"invalid", WIRE_MAC_FLEET, WIRE_MAC_NONE, 0},
    [WIRE_T_HELLO] = {"hello", WIRE_MAC_FLEET, WIRE_MAC_OPTIONAL, sizeof(wire_hello_reply)},
    [WIRE_T_PING] = {"ping", WIRE_MAC_FLEET, WIRE_MAC_NONE, sizeof(wire_ping)},
    [WIRE_T_STATS] = {"stats", WIRE_MAC_FLEET, WIRE_MAC_REQUIRED, sizeof(wire_stats)},
    [WIRE_T_CACHE_QUERY] = {"cache_query", WIRE_MAC_FLEET, WIRE_MAC_REQUIRED, 0},
    [WIRE_T_CACHE_INVALIDATE] = {"cache_invalidate", WIRE_MAC_LINK, WIRE_MAC_REQUIRED, 4},
    [WIRE_T_UPLOAD] = {"upload", WIRE_MAC_LINK, WIRE_MAC_REQUIRED, sizeof(wire_upload_reply)},
    [WIRE_T_SESSION_OPEN] = {"session_open", WIRE_MAC_LINK, WIRE_MAC_REQUIRED, 0},
    [WIRE_T_LAYER_PLAN] = {"layer_plan", WIRE_MAC_LINK, WIRE_MAC_REQUIRED, 0},
    [WIRE_T_SESSION_CLOSE] = {"session_close", WIRE_MAC_LINK, WIRE_MAC_REQUIRED, 0},
    [WIRE_T_FORWARD] = {"forward", WIRE_MAC_LINK, WIRE_MAC_DATA, 0},
    [WIRE_T_SHUTDOWN] = {"shutdown", WIRE_MAC_LINK, WIRE_MAC_REQUIRED, 0},
    [WIRE_T_RESEND] = {"resend", WIRE_MAC_FLEET, WIRE_MAC_REQUIRED, 0},
    [WIRE_T_NACK] = {"nack", WIRE_MAC_FLEET, WIRE_MAC_NONE, 0},
    [WIRE_T_SYNTH] = {"synth", WIRE_MAC_LINK, WIRE_MAC_REQUIRED, sizeof(wire_synth_reply)},
    [WIRE_T_RUN_OPEN] = {"run_open", WIRE_MAC_FLEET, WIRE_MAC_REQUIRED, 0},
};

const char *wire_type_str(unsigned type)
{
    return type < WIRE_T_COUNT ? wire_types[type].name : "unknown";
}
