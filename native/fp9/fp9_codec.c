/* fp9 codec: scalar encode/decode, packing of fp32/bf16/fp8 sources into
 * serialized tensors, and the reference unpack. See fp9.h, docs/fp9.md. */
#include "fp9.h"

#include <math.h>
#include <string.h>

static inline uint32_t f32_bits(float v) { uint32_t u; memcpy(&u, &v, 4); return u; }
static inline float bits_f32(uint32_t u) { float v; memcpy(&v, &u, 4); return v; }

float fp9_decode(uint8_t code, int negative)
{
    float v = bits_f32((uint32_t)code << FP9_DECODE_SHIFT) * 0x1p112f;
    return negative ? -v : v;
}

uint8_t fp9_encode_rne(float magnitude)
{
    uint32_t a = f32_bits(magnitude) & 0x7fffffffu;
    if (a >= 0x38800000u) {            /* >= 2^-14: normal in e5m3 */
        /* round the 23-bit mantissa to 3 bits, ties to even; a carry
         * rolls into the exponent, which is what RNE wants */
        uint32_t r = a + 0x7ffffu + ((a >> FP9_DECODE_SHIFT) & 1u);
        uint32_t code = (r >> FP9_DECODE_SHIFT) - (FP9_REBIAS << 3);
        return code > FP9_MAX_CODE ? FP9_MAX_CODE : (uint8_t)code;
    }
    /* subnormal: multiples of 2^-17; 8 * 2^-17 is code 8, the smallest normal */
    return (uint8_t)nearbyintf(bits_f32(a) * 0x1p17f);
}

int fp8_e4m3_to_f32(uint8_t code, float *out)
{
    uint32_t e = (code >> 3) & 0xf, m = code & 7;
    if (e == 0xf && m == 7)
        return FP9_ENONFINITE;
    float v = e ? ldexpf(1.0f + m / 8.0f, (int)e - 7) : ldexpf(m / 8.0f, -6);
    *out = (code & 0x80) ? -v : v;
    return FP9_OK;
}

size_t fp9_tensor_bytes(uint32_t rows, uint32_t cols, int with_block_scales)
{
    size_t n = sizeof(fp9_tensor_header) + fp9_blocks_bytes(rows, cols);
    if (with_block_scales)
        n += (size_t)2 * ((rows + 1) / 2) * ((cols + FP9_SCALE_BLOCK - 1) / FP9_SCALE_BLOCK) * sizeof(float);
    return n;
}

size_t fp9_pack_fp8_bound(uint32_t rows, uint32_t cols) { return fp9_tensor_bytes(rows, cols, 1); }

#define FP9_MAX_DIM (1u << 24)

int fp9_tensor_view(const void *buf, size_t len, fp9_matrix *out)
{
    fp9_tensor_header h;
    if (buf == NULL || len < sizeof h || ((uintptr_t)buf & 7u))
        return FP9_EFORMAT;
    memcpy(&h, buf, sizeof h);
    if (h.magic != FP9_TENSOR_MAGIC || h.version != FP9_TENSOR_VERSION ||
        (h.flags & ~FP9_FLAG_BLOCK_SCALES) || h.rows == 0 || h.cols == 0 ||
        h.rows > FP9_MAX_DIM || h.cols > FP9_MAX_DIM || !isfinite(h.prescale))
        return FP9_EFORMAT;
    for (int i = 0; i < 11; i++)
        if (h.reserved[i])
            return FP9_EFORMAT;
    int scaled = (h.flags & FP9_FLAG_BLOCK_SCALES) != 0;
    if (len < fp9_tensor_bytes(h.rows, h.cols, scaled))
        return FP9_EFORMAT;
    const uint8_t *p = (const uint8_t *)buf;
    out->rows = h.rows;
    out->cols = h.cols;
    out->row_pairs = (h.rows + 1) / 2;
    out->groups = (h.cols + FP9_GROUP - 1) / FP9_GROUP;
    out->prescale = h.prescale;
    out->blocks = (const fp9_block *)(p + sizeof h);
    out->block_scales = NULL;
    if (scaled) {
        const float *s = (const float *)(p + sizeof h + fp9_blocks_bytes(h.rows, h.cols));
        size_t n = (size_t)2 * out->row_pairs * fp9_scale_cols(out);
        for (size_t i = 0; i < n; i++)
            if (!isfinite(s[i]))
                return FP9_EFORMAT;
        out->block_scales = s;
    }
    return FP9_OK;
}

static void write_header(void *dst, uint32_t rows, uint32_t cols, float prescale, int scaled)
{
    fp9_tensor_header h;
    memset(&h, 0, sizeof h);
    h.magic = FP9_TENSOR_MAGIC;
    h.version = FP9_TENSOR_VERSION;
    h.flags = scaled ? FP9_FLAG_BLOCK_SCALES : 0;
    h.rows = rows;
    h.cols = cols;
    h.prescale = prescale;
    memcpy(dst, &h, sizeof h);
}

/* A source is read through this: element (r, c) as fp32. */
typedef float (*load_fn)(const void *src, size_t i);
static float load_f32(const void *src, size_t i) { return ((const float *)src)[i]; }
static float load_bf16(const void *src, size_t i) { return bits_f32((uint32_t)((const uint16_t *)src)[i] << 16); }

/* Writes the blocks of a [rows, cols] source, each value multiplied by inv
 * (an exact power of two). Returns 1 if every weight is exactly
 * representable (decode * prescale == source), 0 otherwise. */
static int write_blocks(const void *src, load_fn load, uint32_t rows, uint32_t cols,
                        size_t stride, float inv, fp9_block *blocks)
{
    uint32_t pairs = (rows + 1) / 2, groups = (cols + FP9_GROUP - 1) / FP9_GROUP;
    int exact = 1;
    for (uint32_t p = 0; p < pairs; p++) {
        for (uint32_t g = 0; g < groups; g++) {
            fp9_block *b = &blocks[fp9_block_index(pairs, groups, p, g)];
            memset(b, 0, sizeof *b);
            for (uint32_t r = 0; r < 2; r++) {
                uint32_t row = 2 * p + r;
                if (row >= rows)
                    continue;
                for (uint32_t c = 0; c < FP9_GROUP; c++) {
                    uint32_t col = g * FP9_GROUP + c;
                    if (col >= cols)
                        break;
                    float v = load(src, (size_t)row * stride + col) * inv;
                    uint8_t code = fp9_encode_rne(fabsf(v));
                    b->mag[r][c] = code;
                    if (signbit(v) && code)
                        b->sign[r] |= 1ull << c;
                    if (fp9_decode(code, 0) != fabsf(v))
                        exact = 0;
                }
            }
        }
    }
    return exact;
}

/* Power of two that puts maxabs into e5m3's top binade [2^15, 2^16). */
static float prescale_for(float maxabs)
{
    if (!(maxabs > 0.0f))
        return 1.0f;
    int e;
    frexpf(maxabs, &e);           /* maxabs in [2^(e-1), 2^e) */
    return ldexpf(1.0f, e - 1 - 15);
}

static int pack_real(const void *src, load_fn load, uint32_t rows, uint32_t cols,
                     size_t stride, void *dst, size_t *bad_index)
{
    if (!src || !dst || rows == 0 || cols == 0 || rows > FP9_MAX_DIM || cols > FP9_MAX_DIM || stride < cols)
        return FP9_EINVAL;
    float maxabs = 0.0f;
    for (uint32_t r = 0; r < rows; r++) {
        for (uint32_t c = 0; c < cols; c++) {
            size_t i = (size_t)r * stride + c;
            float v = load(src, i);
            if (!isfinite(v)) {
                if (bad_index)
                    *bad_index = (size_t)r * cols + c;
                return FP9_ENONFINITE;
            }
            if (fabsf(v) > maxabs)
                maxabs = fabsf(v);
        }
    }
    float prescale = prescale_for(maxabs);
    write_header(dst, rows, cols, prescale, 0);
    write_blocks(src, load, rows, cols, stride, 1.0f / prescale,
                 (fp9_block *)((uint8_t *)dst + sizeof(fp9_tensor_header)));
    return FP9_OK;
}

int fp9_pack_f32(const float *src, uint32_t rows, uint32_t cols, size_t stride,
                 void *dst, size_t *bad_index)
{
    return pack_real(src, load_f32, rows, cols, stride, dst, bad_index);
}

int fp9_pack_bf16(const uint16_t *src, uint32_t rows, uint32_t cols, size_t stride,
                  void *dst, size_t *bad_index)
{
    return pack_real(src, load_bf16, rows, cols, stride, dst, bad_index);
}

/* fp8 source seen through its block scales, for write_blocks. */
typedef struct fp8_source {
    const uint8_t *codes;
    size_t stride;
    const float *scale_inv;
    uint32_t scale_stride;
    int with_scales;              /* 0: value = code * scale; 1: value = code */
} fp8_source;

static float load_fp8(const void *src, size_t i)
{
    const fp8_source *s = (const fp8_source *)src;
    size_t r = i / s->stride, c = i % s->stride;
    float v = 0.0f;   /* NaN codes were refused before packing starts */
    fp8_e4m3_to_f32(s->codes[i], &v);
    if (!s->with_scales)
        v *= s->scale_inv[(r / FP9_SCALE_BLOCK) * s->scale_stride + c / FP9_SCALE_BLOCK];
    return v;
}

int fp9_pack_fp8(const uint8_t *src, uint32_t rows, uint32_t cols, size_t stride,
                 const float *scale_inv, uint32_t scale_stride,
                 void *dst, size_t dst_len, int *with_block_scales, size_t *bad_index)
{
    uint32_t srows = (rows + FP9_SCALE_BLOCK - 1) / FP9_SCALE_BLOCK;
    uint32_t scols = (cols + FP9_SCALE_BLOCK - 1) / FP9_SCALE_BLOCK;
    if (!src || !scale_inv || !dst || rows == 0 || cols == 0 || rows > FP9_MAX_DIM ||
        cols > FP9_MAX_DIM || stride < cols || scale_stride < scols)
        return FP9_EINVAL;
    int pow2 = 1;
    float max_scale = 0.0f;
    for (uint32_t i = 0; i < srows; i++) {
        for (uint32_t j = 0; j < scols; j++) {
            float s = scale_inv[(size_t)i * scale_stride + j];
            if (!isfinite(s) || !(s > 0.0f))
                return FP9_ESCALE;
            int e;
            if (frexpf(s, &e) != 0.5f)
                pow2 = 0;
            if (s > max_scale)
                max_scale = s;
        }
    }
    float maxabs = 0.0f;
    for (uint32_t r = 0; r < rows; r++) {
        for (uint32_t c = 0; c < cols; c++) {
            uint8_t code = src[(size_t)r * stride + c];
            float v;
            if (fp8_e4m3_to_f32(code, &v) != FP9_OK) {
                if (bad_index)
                    *bad_index = (size_t)r * cols + c;
                return FP9_ENONFINITE;
            }
            v = fabsf(v) * scale_inv[(size_t)(r / FP9_SCALE_BLOCK) * scale_stride + c / FP9_SCALE_BLOCK];
            if (v > maxabs)
                maxabs = v;
        }
    }
    fp8_source s = {src, stride, scale_inv, scale_stride, 0};
    fp9_block *blocks = (fp9_block *)((uint8_t *)dst + sizeof(fp9_tensor_header));
    if (pow2) {
        /* fold the scales into one prescale if every weight stays exact */
        float prescale = prescale_for(maxabs);
        if (dst_len < fp9_tensor_bytes(rows, cols, 0))
            return FP9_EINVAL;
        if (write_blocks(&s, load_fp8, rows, cols, stride, 1.0f / prescale, blocks)) {
            write_header(dst, rows, cols, prescale, 0);
            *with_block_scales = 0;
            return FP9_OK;
        }
    }
    /* codes as they are (every e4m3 value is an e5m3 value), scales per
     * (row, 128 columns) */
    if (dst_len < fp9_tensor_bytes(rows, cols, 1))
        return FP9_EINVAL;
    s.with_scales = 1;
    write_blocks(&s, load_fp8, rows, cols, stride, 1.0f, blocks);
    write_header(dst, rows, cols, 1.0f, 1);
    uint32_t pairs = (rows + 1) / 2, groups = (cols + FP9_GROUP - 1) / FP9_GROUP;
    uint32_t sc = (groups + 1) / 2;
    float *scales = (float *)((uint8_t *)blocks + fp9_blocks_bytes(rows, cols));
    for (uint32_t r = 0; r < 2 * pairs; r++)
        for (uint32_t j = 0; j < sc; j++)
            scales[(size_t)r * sc + j] = r < rows ? scale_inv[(size_t)(r / FP9_SCALE_BLOCK) * scale_stride + j] : 0.0f;
    *with_block_scales = 1;
    return FP9_OK;
}

void fp9_unpack_f32(const fp9_matrix *m, float *dst, size_t stride)
{
    uint32_t sc = fp9_scale_cols(m);
    for (uint32_t row = 0; row < m->rows; row++) {
        for (uint32_t col = 0; col < m->cols; col++) {
            const fp9_block *blk = &m->blocks[fp9_block_index(m->row_pairs, m->groups, row / 2, col / FP9_GROUP)];
            uint32_t r = row & 1, c = col % FP9_GROUP;
            float v = fp9_decode(blk->mag[r][c], (int)((blk->sign[r] >> c) & 1)) * m->prescale;
            if (m->block_scales)
                v *= m->block_scales[(size_t)row * sc + col / FP9_SCALE_BLOCK];
            dst[(size_t)row * stride + col] = v;
        }
    }
}
