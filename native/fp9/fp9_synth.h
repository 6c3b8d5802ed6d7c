/* Synthetic fp9 tensors for benchmarks: a 32-byte descriptor (a recipe)
 * from which a duck or the host generates, bit for bit, the same
 * serialized fp9 tensor (fp9.h, docs/fp9.md section 8). Used where real
 * weights are far too big to make on the host and upload (a DeepSeek-V3
 * layer is 12.7 GB of fp9). This header is the one definition of the
 * recipe; the wire message that carries it is WIRE_T_SYNTH (wire.h).
 *
 * Weight (row r, column c) of a live position is random: a sign bit and a
 * magnitude code in [0xE0, 0xFF] (4 binades: exponents 28..31, any
 * mantissa), scaled by prescale = 2^prescale_log2. Positions outside
 * [0, live_rows) x [0, live_cols) are zero (tensor-parallel padding).
 * The bits come from a counter-based generator keyed by the seed and the
 * logical block (row pair, group), so the result does not depend on the
 * panel layout, on the order of generation or on the number of threads.
 */
#ifndef DUCK_FP9_SYNTH_H
#define DUCK_FP9_SYNTH_H

#include <stddef.h>
#include <stdint.h>

#include "fp9.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FP9_SYNTH_VERSION 1
#define FP9_SYNTH_CODE_BASE 0xE0u        /* codes are FP9_SYNTH_CODE_BASE | (random & 0x1F) */
#define FP9_SYNTH_CODE_BITS 0x1Fu
#define FP9_SYNTH_PRESCALE_LOG2_MIN (-64)
#define FP9_SYNTH_PRESCALE_LOG2_MAX 16
#define FP9_SYNTH_MAX_DIM (1u << 24)     /* as every serialized fp9 tensor */
#define FP9_SYNTH_MAX_BYTES (1ull << 32) /* 4 GiB: larger is not a slice */
#define FP9_SYNTH_WORDS_PER_BLOCK 18     /* 2 sign words + 16 words of 8 codes */

/* 32 bytes, little-endian; hashed as is for the cache key (wire.h). */
typedef struct fp9_synth_desc {
    uint32_t version;         /* FP9_SYNTH_VERSION */
    uint32_t rows, cols;      /* 1 .. 2^24 */
    uint32_t live_rows;       /* 0 .. rows: rows at or past this are zero */
    uint32_t live_cols;       /* 0 .. cols: columns at or past this are zero */
    int32_t prescale_log2;    /* FP9_SYNTH_PRESCALE_LOG2_MIN .. _MAX */
    uint64_t seed;
} fp9_synth_desc;

#if defined(__cplusplus)
static_assert(sizeof(fp9_synth_desc) == 32, "fp9_synth_desc must be 32 bytes");
#else
_Static_assert(sizeof(fp9_synth_desc) == 32, "fp9_synth_desc must be 32 bytes");
#endif

/* The prescale exponent that makes the largest weight about 1/sqrt(cols),
 * like an nn.Linear init: -16 - h with h the least integer, 4^h >= cols. */
int32_t fp9_synth_default_prescale_log2(uint32_t cols);

/* FP9_OK, FP9_EFORMAT (unknown version) or FP9_EINVAL (a field out of
 * range, or a tensor over FP9_SYNTH_MAX_BYTES); err, if non-NULL, receives
 * a message naming the field and its value. */
int fp9_synth_check(const fp9_synth_desc *d, char *err, size_t errlen);

/* Bytes of the serialized tensor: fp9_tensor_bytes(rows, cols, 0). */
uint64_t fp9_synth_bytes(const fp9_synth_desc *d);

/* Writes the 64-byte header, and the blocks of row pairs [pair_begin,
 * pair_end) of every panel. The descriptor must have passed the check. */
void fp9_synth_header(const fp9_synth_desc *d, void *dst);
void fp9_synth_fill_pairs(const fp9_synth_desc *d, void *dst, uint32_t pair_begin, uint32_t pair_end);

/* The whole tensor into dst (8-byte aligned, at least fp9_synth_bytes),
 * split by row pairs over pool (a duck_pool, or NULL for this thread).
 * Returns FP9_OK, or FP9_EINVAL for a bad descriptor or a short dst. */
struct duck_pool;
int fp9_synth_generate(const fp9_synth_desc *d, void *dst, size_t len, struct duck_pool *pool);

#ifdef __cplusplus
}
#endif
#endif
