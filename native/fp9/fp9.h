/* fp9: the weight format every duck streams. docs/fp9.md is the prose spec;
 * this header is its single definition in code.
 *
 * A weight is 9 bits: an unsigned e5m3 magnitude byte (5 exponent bits,
 * bias 15, 3 mantissa bits, exponent 0 subnormal, no Inf/NaN) plus one sign
 * bit kept in a 64-bit bit-plane word per 64 consecutive weights of a row.
 *
 * A matrix [rows, cols] is stored as row-pair blocks of 2 rows x 64 columns.
 * The columns are cut into panels of 2048 (32 groups; the last panel may be
 * shorter); panels follow each other, and within a panel the blocks are
 * pair-major: the panel's groups of rows (0,1), then of rows (2,3), ...
 * A GEMV thus streams the matrix front to back while the panel's 8 KiB of
 * activations stay in L1. rows are padded to even and cols to a multiple
 * of 64 with zero weights. All fields are little-endian.
 */
#ifndef DUCK_FP9_H
#define DUCK_FP9_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FP9_GROUP 64          /* columns per block (one sign word per row) */
#define FP9_PANEL_GROUPS 32   /* groups per panel: 2048 columns */
#define FP9_SCALE_BLOCK 128   /* columns per optional block scale */
#define FP9_EXP_BIAS 15
#define FP9_MAX_CODE 0xFF     /* 1.875 * 2^16 = 122880 */
#define FP9_MAX_VALUE 122880.0f

/* Decoding is a shift: the bits (code << 20) read as an fp32 are
 * value(code) * 2^-112 (fp32 bias 127 minus fp9 bias 15), subnormals
 * included. Kernels fold 2^112 back in two halves: activations are
 * prepared as x * 2^FP9_ACT_SHIFT and outputs multiplied by
 * prescale * 2^FP9_OUT_SHIFT, so neither side overflows or goes denormal
 * for any practical activation. */
#define FP9_DECODE_SHIFT 20
#define FP9_REBIAS 112
#define FP9_ACT_SHIFT 64
#define FP9_OUT_SHIFT (FP9_REBIAS - FP9_ACT_SHIFT)  /* 48 */

/* 2 rows x 64 columns x 9 bits = 144 bytes. */
typedef struct fp9_block {
    uint64_t sign[2];     /* bit c of sign[r]: sign of column c of row r, 1 = negative */
    uint8_t mag[2][64];   /* e5m3 magnitude codes, mag[r][c] */
} fp9_block;

#if defined(__cplusplus)
static_assert(sizeof(fp9_block) == 144, "fp9_block must be 144 bytes");
#else
_Static_assert(sizeof(fp9_block) == 144, "fp9_block must be 144 bytes");
#endif

/* A matrix in memory. prescale multiplies every weight; block_scales, when
 * present, holds one fp32 per (padded row, 128 columns), row-major
 * [rows_padded][scale_cols], applied to each 128-column partial dot. */
typedef struct fp9_matrix {
    uint32_t rows, cols;          /* logical shape */
    uint32_t row_pairs, groups;   /* ceil(rows / 2), ceil(cols / 64) */
    float prescale;
    const fp9_block *blocks;      /* row_pairs * groups blocks, pair-major */
    const float *block_scales;    /* NULL, or 2*row_pairs * scale_cols floats */
} fp9_matrix;

static inline uint32_t fp9_scale_cols(const fp9_matrix *m) { return (m->groups + 1) / 2; }
static inline size_t fp9_blocks_bytes(uint32_t rows, uint32_t cols)
{
    return (size_t)((rows + 1) / 2) * ((cols + FP9_GROUP - 1) / FP9_GROUP) * sizeof(fp9_block);
}

/* The run of blocks of row pair p in the panel that starts at group g0:
 * fp9_panel_groups(m, g0) consecutive blocks. */
static inline uint32_t fp9_panel_groups(uint32_t groups, uint32_t g0)
{
    return groups - g0 < FP9_PANEL_GROUPS ? groups - g0 : FP9_PANEL_GROUPS;
}
static inline const fp9_block *fp9_pair_run(const fp9_matrix *m, uint32_t p, uint32_t g0)
{
    return m->blocks + (size_t)m->row_pairs * g0 + (size_t)p * fp9_panel_groups(m->groups, g0);
}
/* The blocks of row pairs [p, p + np) in the panel at g0: one run of *bytes
 * (blocks are pair-major within a panel). */
static inline const char *fp9_pairs_run(const fp9_matrix *m, uint32_t p, uint32_t np, uint32_t g0, size_t *bytes)
{
    *bytes = (size_t)np * fp9_panel_groups(m->groups, g0) * sizeof(fp9_block);
    return (const char *)fp9_pair_run(m, p, g0);
}
/* What a GEMM walking [pair_begin, pair_end) in micro-panels of `step` pairs, panel
 * by panel, reads after the micro-panel at p of the panel at g0: the next
 * micro-panel of the panel, else the first of the next panel; NULL (*bytes 0)
 * after the last. The GEMMs prefetch it while they decode (the strided reads of a
 * micro-panel defeat the hardware prefetchers). */
static inline const char *fp9_next_run(const fp9_matrix *m, uint32_t p, uint32_t step, uint32_t pair_begin,
                                       uint32_t pair_end, uint32_t g0, size_t *bytes)
{
    const uint32_t p1 = g0 + fp9_panel_groups(m->groups, g0);
    *bytes = 0;
    if (p + step < pair_end)
        return fp9_pairs_run(m, p + step, pair_end - p - step < step ? pair_end - p - step : step, g0, bytes);
    if (p1 < m->groups)
        return fp9_pairs_run(m, pair_begin, pair_end - pair_begin < step ? pair_end - pair_begin : step, p1, bytes);
    return NULL;
}
static inline size_t fp9_block_index(uint32_t row_pairs, uint32_t groups, uint32_t p, uint32_t g)
{
    uint32_t g0 = g - g % FP9_PANEL_GROUPS;
    return (size_t)row_pairs * g0 + (size_t)p * fp9_panel_groups(groups, g0) + (g - g0);
}

/* Serialized form (weight upload, cache files, disk cache): a 64-byte
 * header, the blocks, then the block scales if FP9_FLAG_BLOCK_SCALES. */
#define FP9_TENSOR_MAGIC 0x54395046u  /* "FP9T" */
#define FP9_TENSOR_VERSION 1
#define FP9_FLAG_BLOCK_SCALES 1u

typedef struct fp9_tensor_header {
    uint32_t magic;
    uint16_t version;
    uint16_t flags;
    uint32_t rows, cols;
    float prescale;
    uint32_t reserved[11];        /* zero */
} fp9_tensor_header;

#if defined(__cplusplus)
static_assert(sizeof(fp9_tensor_header) == 64, "fp9_tensor_header must be 64 bytes");
#else
_Static_assert(sizeof(fp9_tensor_header) == 64, "fp9_tensor_header must be 64 bytes");
#endif

/* Size in bytes of a serialized tensor. */
size_t fp9_tensor_bytes(uint32_t rows, uint32_t cols, int with_block_scales);

/* Point a matrix view at a serialized tensor; checks magic, version, flags
 * and that len covers the whole tensor. Returns 0, or a negative FP9_E*. */
int fp9_tensor_view(const void *buf, size_t len, fp9_matrix *out);

/* Error codes of the codec. */
#define FP9_OK 0
#define FP9_EINVAL -1      /* bad shape or argument */
#define FP9_ENONFINITE -2  /* NaN or Inf in the source */
#define FP9_EFORMAT -3     /* not a valid serialized tensor */
#define FP9_ESCALE -4      /* block scale not finite or not positive */

/* Scalar codec. */
float fp9_decode(uint8_t code, int negative);       /* exact */
uint8_t fp9_encode_rne(float magnitude);            /* |v| -> code, RNE, saturating */

/* Packing into a serialized tensor buffer of fp9_tensor_bytes() bytes.
 * Sources are row-major [rows, cols] with the given row stride (elements).
 * On FP9_ENONFINITE, *bad_index (if non-NULL) receives the flat index. */
int fp9_pack_f32(const float *src, uint32_t rows, uint32_t cols, size_t stride,
                 void *dst, size_t *bad_index);
int fp9_pack_bf16(const uint16_t *src, uint32_t rows, uint32_t cols, size_t stride,
                  void *dst, size_t *bad_index);
/* fp8 e4m3fn with Hugging Face weight_scale_inv [ceil(rows/128), ceil(cols/128)].
 * Power-of-two scales fold into the prescale when the whole range fits
 * (bit-exact); otherwise the tensor keeps per-(row, 128 columns) block
 * scales (still bit-exact for the codes). with_block_scales receives which. */
int fp8_e4m3_to_f32(uint8_t code, float *out);
int fp9_pack_fp8(const uint8_t *src, uint32_t rows, uint32_t cols, size_t stride,
                 const float *scale_inv, uint32_t scale_stride,
                 void *dst, size_t dst_len, int *with_block_scales, size_t *bad_index);
size_t fp9_pack_fp8_bound(uint32_t rows, uint32_t cols);  /* worst-case dst size */

/* Reference decode of a whole tensor to fp32 [rows, cols]. */
void fp9_unpack_f32(const fp9_matrix *m, float *dst, size_t stride);

#ifdef __cplusplus
}
#endif
#endif
