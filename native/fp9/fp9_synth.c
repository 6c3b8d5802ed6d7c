/* Synthetic fp9 tensors: see fp9_synth.h and docs/fp9.md section 8. The
 * generator is integer work only: one splitmix64 finalizer per 8 bytes of
 * output, codes written as whole words. */
#include "fp9_synth.h"

#include <stdio.h>
#include <string.h>

#include "pool.h"

#define GOLDEN 0x9E3779B97F4A7C15ull
#define CODE_BITS_X8 (0x0101010101010101ull * FP9_SYNTH_CODE_BITS)
#define CODE_BASE_X8 (0x0101010101010101ull * FP9_SYNTH_CODE_BASE)

/* splitmix64's output function: a bijection of 64-bit words. */
static inline uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

int32_t fp9_synth_default_prescale_log2(uint32_t cols)
{
    int32_t h = 0;
    while (h < 16 && (1ull << (2 * h)) < cols)
        h++;
    return -16 - h;
}

uint64_t fp9_synth_bytes(const fp9_synth_desc *d)
{
    return sizeof(fp9_tensor_header) +
           (uint64_t)((d->rows + 1ull) / 2) * ((d->cols + (uint64_t)FP9_GROUP - 1) / FP9_GROUP) * sizeof(fp9_block);
}

int fp9_synth_check(const fp9_synth_desc *d, char *err, size_t errlen)
{
    char scratch[8];
    if (!err) {
        err = scratch;
        errlen = sizeof scratch;
    }
    if (!d) {
        snprintf(err, errlen, "no descriptor");
        return FP9_EINVAL;
    }
    if (d->version != FP9_SYNTH_VERSION) {
        snprintf(err, errlen, "unknown synth descriptor version %u (this build knows %u)", d->version,
                 FP9_SYNTH_VERSION);
        return FP9_EFORMAT;
    }
    if (d->rows == 0 || d->rows > FP9_SYNTH_MAX_DIM || d->cols == 0 || d->cols > FP9_SYNTH_MAX_DIM) {
        snprintf(err, errlen, "shape %ux%u: rows and cols must be 1..%u", d->rows, d->cols, FP9_SYNTH_MAX_DIM);
        return FP9_EINVAL;
    }
    if (d->live_rows > d->rows || d->live_cols > d->cols) {
        snprintf(err, errlen, "live region %ux%u exceeds the shape %ux%u", d->live_rows, d->live_cols, d->rows,
                 d->cols);
        return FP9_EINVAL;
    }
    if (d->prescale_log2 < FP9_SYNTH_PRESCALE_LOG2_MIN || d->prescale_log2 > FP9_SYNTH_PRESCALE_LOG2_MAX) {
        snprintf(err, errlen, "prescale_log2 %d outside %d..%d", d->prescale_log2, FP9_SYNTH_PRESCALE_LOG2_MIN,
                 FP9_SYNTH_PRESCALE_LOG2_MAX);
        return FP9_EINVAL;
    }
    uint64_t bytes = fp9_synth_bytes(d);
    if (bytes > FP9_SYNTH_MAX_BYTES) {
        snprintf(err, errlen, "shape %ux%u is %llu bytes of fp9, over the %llu-byte limit of one tensor", d->rows,
                 d->cols, (unsigned long long)bytes, (unsigned long long)FP9_SYNTH_MAX_BYTES);
        return FP9_EINVAL;
    }
    if (errlen)
        err[0] = '\0';
    return FP9_OK;
}

void fp9_synth_header(const fp9_synth_desc *d, void *dst)
{
    fp9_tensor_header h;
    memset(&h, 0, sizeof h);
    h.magic = FP9_TENSOR_MAGIC;
    h.version = FP9_TENSOR_VERSION;
    h.rows = d->rows;
    h.cols = d->cols;
    uint32_t bits = (uint32_t)(127 + d->prescale_log2) << 23;   /* 2^prescale_log2, a normal float */
    memcpy(&h.prescale, &bits, 4);
    memcpy(dst, &h, sizeof h);
}

/* Zeroes what lies outside the live region: rows of the pair at or past
 * live_rows, and columns at or past live_cols (live_in_block of 64). */
static void mask_block(fp9_block *b, int row0_live, int row1_live, uint32_t live_in_block)
{
    uint64_t cols = live_in_block >= 64 ? ~0ull : (1ull << live_in_block) - 1;
    for (int r = 0; r < 2; r++) {
        int live = r ? row1_live : row0_live;
        b->sign[r] &= live ? cols : 0;
        uint32_t keep = live ? live_in_block : 0;
        if (keep < 64)
            memset(b->mag[r] + keep, 0, 64 - keep);
    }
}

void fp9_synth_fill_pairs(const fp9_synth_desc *d, void *dst, uint32_t pair_begin, uint32_t pair_end)
{
    uint32_t pairs = (d->rows + 1) / 2, groups = (d->cols + FP9_GROUP - 1) / FP9_GROUP;
    fp9_block *blocks = (fp9_block *)((uint8_t *)dst + sizeof(fp9_tensor_header));
    uint64_t key = mix64(d->seed);
    if (pair_end > pairs)
        pair_end = pairs;
    for (uint32_t g0 = 0; g0 < groups; g0 += FP9_PANEL_GROUPS) {
        uint32_t n = fp9_panel_groups(groups, g0);
        for (uint32_t p = pair_begin; p < pair_end; p++) {
            fp9_block *run = blocks + (size_t)pairs * g0 + (size_t)p * n;
            int row0_live = 2 * p < d->live_rows, row1_live = 2 * p + 1 < d->live_rows;
            for (uint32_t j = 0; j < n; j++) {
                uint32_t g = g0 + j;
                uint64_t x = key + GOLDEN * (FP9_SYNTH_WORDS_PER_BLOCK * ((uint64_t)p * groups + g));
                uint64_t w[FP9_SYNTH_WORDS_PER_BLOCK];
                for (int k = 0; k < FP9_SYNTH_WORDS_PER_BLOCK; k++) {
                    x += GOLDEN;
                    w[k] = mix64(x);
                }
                for (int k = 2; k < FP9_SYNTH_WORDS_PER_BLOCK; k++)
                    w[k] = (w[k] & CODE_BITS_X8) | CODE_BASE_X8;
                memcpy(&run[j], w, sizeof w);
                uint32_t live_cols = d->live_cols > 64 * g ? d->live_cols - 64 * g : 0;
                if (!row1_live || live_cols < 64)
                    mask_block(&run[j], row0_live, row1_live, live_cols);
            }
        }
    }
}

_Static_assert(sizeof(uint64_t) * FP9_SYNTH_WORDS_PER_BLOCK == sizeof(fp9_block), "one word per 8 bytes of block");

typedef struct synth_task {
    const fp9_synth_desc *d;
    void *dst;
} synth_task;

static void synth_worker(void *arg, unsigned w, unsigned nw)
{
    const synth_task *t = arg;
    unsigned long begin, end;
    duck_split((t->d->rows + 1ul) / 2, w, nw, &begin, &end);
    if (w == 0)
        fp9_synth_header(t->d, t->dst);
    fp9_synth_fill_pairs(t->d, t->dst, (uint32_t)begin, (uint32_t)end);
}

int fp9_synth_generate(const fp9_synth_desc *d, void *dst, size_t len, struct duck_pool *pool)
{
    if (!dst || ((uintptr_t)dst & 7u) || fp9_synth_check(d, NULL, 0) != FP9_OK || len < fp9_synth_bytes(d))
        return FP9_EINVAL;
    synth_task t = {d, dst};
    if (pool)
        duck_pool_run(pool, synth_worker, &t);
    else
        synth_worker(&t, 0, 1);
    return FP9_OK;
}
