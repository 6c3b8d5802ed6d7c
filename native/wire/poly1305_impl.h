/* Private to native/wire/poly1305*.c: numbers mod p = 2^130 - 5 in three limbs
 * of 44, 44 and 42 bits (the portable code's form) and in five of 26 bits
 * (the AVX2 lanes' form), and the conversions between them. */
#ifndef DUCK_POLY1305_IMPL_H
#define DUCK_POLY1305_IMPL_H

#include <stddef.h>
#include <stdint.h>

#define M44 0xFFFFFFFFFFFull
#define M42 0x3FFFFFFFFFFull
#define M26 0x3FFFFFFull

typedef unsigned __int128 poly_u128;

/* Limbs back under 44/44/42 bits (what is above 2^130 folded in times 5);
 * the value may still be at or above p. */
static inline void poly_carry44(uint64_t a[3])
{
    for (int pass = 0; pass < 2; pass++) {
        uint64_t c = a[0] >> 44; a[0] &= M44; a[1] += c;
        c = a[1] >> 44; a[1] &= M44; a[2] += c;
        c = a[2] >> 42; a[2] &= M42; a[0] += c * 5;
    }
    uint64_t c = a[0] >> 44; a[0] &= M44; a[1] += c;
}

/* out = a * b mod p (partly reduced); a, b of at most ~45-bit limbs. */
static inline void poly_mul44(const uint64_t a[3], const uint64_t b[3], uint64_t out[3])
{
    uint64_t s1 = b[1] * 20, s2 = b[2] * 20;   /* 2^132 = 4 * 2^130 = 20 mod p */
    poly_u128 d0 = (poly_u128)a[0] * b[0] + (poly_u128)a[1] * s2 + (poly_u128)a[2] * s1;
    poly_u128 d1 = (poly_u128)a[0] * b[1] + (poly_u128)a[1] * b[0] + (poly_u128)a[2] * s2;
    poly_u128 d2 = (poly_u128)a[0] * b[2] + (poly_u128)a[1] * b[1] + (poly_u128)a[2] * b[0];
    uint64_t c = (uint64_t)(d0 >> 44);
    out[0] = (uint64_t)d0 & M44;
    d1 += c;
    c = (uint64_t)(d1 >> 44);
    out[1] = (uint64_t)d1 & M44;
    d2 += c;
    c = (uint64_t)(d2 >> 42);
    out[2] = (uint64_t)d2 & M42;
    out[0] += c * 5;
    poly_carry44(out);
}

/* 44/44/42-bit limbs (with carries pending) -> five 26-bit limbs of the same number. */
static inline void poly_to26(const uint64_t in[3], uint64_t l[5])
{
    uint64_t a[3] = {in[0], in[1], in[2]};
    while ((a[0] >> 44) | (a[1] >> 44) | (a[2] >> 42))
        poly_carry44(a);
    l[0] = a[0] & M26;
    l[1] = ((a[0] >> 26) | (a[1] << 18)) & M26;
    l[2] = (a[1] >> 8) & M26;
    l[3] = ((a[1] >> 34) | (a[2] << 10)) & M26;
    l[4] = (a[2] >> 16) & M26;
}

/* Five 26-bit limbs (any carries pending) -> 44/44/42-bit limbs, carried. */
static inline void poly_from26(const uint64_t in[5], uint64_t a[3])
{
    uint64_t l[5] = {in[0], in[1], in[2], in[3], in[4]};
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < 4; i++) {
            l[i + 1] += l[i] >> 26;
            l[i] &= M26;
        }
        l[0] += (l[4] >> 26) * 5;
        l[4] &= M26;
    }
    l[1] += l[0] >> 26;
    l[0] &= M26;
    a[0] = (l[0] | (l[1] << 26)) & M44;
    a[1] = ((l[1] >> 18) | (l[2] << 8) | (l[3] << 34)) & M44;
    a[2] = (l[3] >> 10) | (l[4] << 16);
    poly_carry44(a);
}

/* The AVX2 lanes (poly1305_avx2.c): runs h = (h + m_i) * r over the first
 * 4 * floor(nblocks / 4) full blocks (each with 2^128 added) and returns how
 * many it took; 0 when the CPU has no AVX2 or nblocks is too small to pay. */
size_t poly1305_avx2_blocks(uint64_t h[3], const uint64_t r[3], const uint8_t *m, size_t nblocks);

#endif
