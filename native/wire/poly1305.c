/* Poly1305 (RFC 8439 §2.5), written from the RFC: the one-time MAC of the
 * data path. The accumulator h and the key part r are held in three limbs
 * of 44, 44 and 42 bits, so that every product fits in 128 bits; reduction
 * modulo p = 2^130 - 5 folds what is above bit 130 back in times 5 (2^130 =
 * 5 mod p), and a limb product that lands at bit 132 comes back times 20.
 * Tests hold it to the RFC's vectors and to a Python big-integer reference
 * (tests/firmware/test_poly1305.py). This is the portable reference
 * (wire_poly1305_ref); wire_poly1305 hands runs of 64 blocks and more to the
 * AVX2 lanes (poly1305_avx2.c) where the CPU has them. */
#include "wire.h"
#include "poly1305_impl.h"

#include <string.h>

typedef poly_u128 u128;

static inline uint64_t le64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);   /* little-endian host (wire.h) */
    return v;
}

typedef struct poly_state {
    uint64_t r0, r1, r2, s1, s2;   /* r in limbs; s1, s2: r1, r2 times 20 */
    uint64_t h0, h1, h2;
    uint64_t pad0, pad1;           /* s, added at the end */
    int ref;                       /* the portable loop only */
} poly_state;

static void poly_init(poly_state *st, const uint8_t key[32], int ref)
{
    st->ref = ref;
    uint64_t t0 = le64(key), t1 = le64(key + 8);
    /* clamp: r &= 0x0ffffffc0ffffffc0ffffffc0fffffff */
    t0 &= 0x0FFFFFFC0FFFFFFFull;
    t1 &= 0x0FFFFFFC0FFFFFFCull;
    st->r0 = t0 & M44;
    st->r1 = ((t0 >> 44) | (t1 << 20)) & M44;
    st->r2 = (t1 >> 24) & M42;
    st->s1 = st->r1 * 20;
    st->s2 = st->r2 * 20;
    st->h0 = st->h1 = st->h2 = 0;
    st->pad0 = le64(key + 16);
    st->pad1 = le64(key + 24);
}

/* h = (h + block) * r mod p for each full 16-byte block; hibit is 2^128 in
 * the top limb (1 << 40), 0 for the padded last block. */
static void poly_blocks(poly_state *st, const uint8_t *m, size_t nblocks, uint64_t hibit)
{
    uint64_t r0 = st->r0, r1 = st->r1, r2 = st->r2, s1 = st->s1, s2 = st->s2;
    uint64_t h0 = st->h0, h1 = st->h1, h2 = st->h2;
    while (nblocks--) {
        uint64_t t0 = le64(m), t1 = le64(m + 8);
        h0 += t0 & M44;
        h1 += ((t0 >> 44) | (t1 << 20)) & M44;
        h2 += ((t1 >> 24) & M42) | hibit;
        u128 d0 = (u128)h0 * r0 + (u128)h1 * s2 + (u128)h2 * s1;
        u128 d1 = (u128)h0 * r1 + (u128)h1 * r0 + (u128)h2 * s2;
        u128 d2 = (u128)h0 * r2 + (u128)h1 * r1 + (u128)h2 * r0;
        uint64_t c = (uint64_t)(d0 >> 44);
        h0 = (uint64_t)d0 & M44;
        d1 += c;
        c = (uint64_t)(d1 >> 44);
        h1 = (uint64_t)d1 & M44;
        d2 += c;
        c = (uint64_t)(d2 >> 42);
        h2 = (uint64_t)d2 & M42;
        h0 += c * 5;
        c = h0 >> 44;
        h0 &= M44;
        h1 += c;
        m += 16;
    }
    st->h0 = h0;
    st->h1 = h1;
    st->h2 = h2;
}

static void poly_update(poly_state *st, uint8_t *tail, size_t *tail_n, const uint8_t *m, size_t len)
{
    if (*tail_n) {
        size_t take = 16 - *tail_n < len ? 16 - *tail_n : len;
        memcpy(tail + *tail_n, m, take);
        *tail_n += take;
        m += take;
        len -= take;
        if (*tail_n < 16)
            return;
        poly_blocks(st, tail, 1, 1ull << 40);
        *tail_n = 0;
    }
    size_t n = len / 16, done = 0;
    if (!st->ref) {
        uint64_t h[3] = {st->h0, st->h1, st->h2}, r[3] = {st->r0, st->r1, st->r2};
        done = poly1305_avx2_blocks(h, r, m, n);
        st->h0 = h[0];
        st->h1 = h[1];
        st->h2 = h[2];
    }
    poly_blocks(st, m + 16 * done, n - done, 1ull << 40);
    memcpy(tail, m + (len & ~(size_t)15), len & 15);
    *tail_n = len & 15;
}

static void poly_finish(poly_state *st, uint8_t *tail, size_t tail_n, uint8_t out[16])
{
    if (tail_n) {   /* the last partial block: a 1 byte after it, then zeros; no 2^128 */
        tail[tail_n] = 1;
        memset(tail + tail_n + 1, 0, 15 - tail_n);
        poly_blocks(st, tail, 1, 0);
    }
    uint64_t h0 = st->h0, h1 = st->h1, h2 = st->h2, c;
    /* carry fully */
    c = h1 >> 44; h1 &= M44; h2 += c;
    c = h2 >> 42; h2 &= M42; h0 += c * 5;
    c = h0 >> 44; h0 &= M44; h1 += c;
    c = h1 >> 44; h1 &= M44; h2 += c;
    c = h2 >> 42; h2 &= M42; h0 += c * 5;
    c = h0 >> 44; h0 &= M44; h1 += c;
    /* g = h + 5 - 2^130: if it does not borrow, h >= p and g is h mod p */
    uint64_t g0 = h0 + 5;
    c = g0 >> 44; g0 &= M44;
    uint64_t g1 = h1 + c;
    c = g1 >> 44; g1 &= M44;
    uint64_t g2 = h2 + c - (1ull << 42);
    uint64_t keep_g = (g2 >> 63) - 1;   /* all ones when g2 did not go negative */
    h0 = (h0 & ~keep_g) | (g0 & keep_g);
    h1 = (h1 & ~keep_g) | (g1 & keep_g);
    h2 = (h2 & ~keep_g) | (g2 & keep_g & M42);
    /* tag = (h + s) mod 2^128 */
    uint64_t s0 = st->pad0, s1 = st->pad1;
    h0 += s0 & M44;
    c = h0 >> 44; h0 &= M44;
    h1 += (((s0 >> 44) | (s1 << 20)) & M44) + c;
    c = h1 >> 44; h1 &= M44;
    h2 += ((s1 >> 24) & M42) + c;
    h2 &= M42;
    uint64_t o0 = h0 | (h1 << 44), o1 = (h1 >> 20) | (h2 << 24);
    memcpy(out, &o0, 8);
    memcpy(out + 8, &o1, 8);
}

static void poly1305(const uint8_t key[32], const void *a, size_t alen, const void *b, size_t blen, uint8_t out[16],
                     int ref)
{
    poly_state st;
    uint8_t tail[16];
    size_t tail_n = 0;
    poly_init(&st, key, ref);
    poly_update(&st, tail, &tail_n, a, alen);
    if (blen)
        poly_update(&st, tail, &tail_n, b, blen);
    poly_finish(&st, tail, tail_n, out);
}

void wire_poly1305(const uint8_t key[32], const void *a, size_t alen, const void *b, size_t blen, uint8_t out[16])
{
    poly1305(key, a, alen, b, blen, out, 0);
}

void wire_poly1305_ref(const uint8_t key[32], const void *a, size_t alen, const void *b, size_t blen,
                       uint8_t out[16])
{
    poly1305(key, a, alen, b, blen, out, 1);
}
