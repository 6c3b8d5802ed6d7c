/* Standalone test of the C floor, built with ASan/UBSan by the test suite
 * (tests/native/test_c_build.py): AVX2 against _ref on odd shapes, the
 * codec, the pool and the MoE forward. Exit status = number of failures. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ffn.h"
#include "fp9_synth.h"
#include "test_check.h"

static void *pack_random(uint32_t rows, uint32_t cols, fp9_matrix *m)
{
    float *w = malloc(sizeof(float) * rows * cols);
    for (size_t i = 0; i < (size_t)rows * cols; i++)
        w[i] = frand() * 0.1f;
    void *buf = aligned_alloc(64, (fp9_tensor_bytes(rows, cols, 0) + 63) / 64 * 64);
    CHECK(fp9_pack_f32(w, rows, cols, cols, buf, NULL) == FP9_OK, "pack %ux%u", rows, cols);
    CHECK(fp9_tensor_view(buf, fp9_tensor_bytes(rows, cols, 0), m) == FP9_OK, "view %ux%u", rows, cols);
    free(w);
    return buf;
}

/* ntok random activations for m, prepared, with their row pointers. */
/* 1: the activations random_tokens makes are bf16 values (what a GPU host sends,
 * the avx512-bf16 set's GEMM case) */
static int bf16_tokens;

static float bf16_round(float v)
{
    uint16_t h;
    duck_f32_to_bf16(&v, 1, &h);
    uint32_t bits = (uint32_t)h << 16;
    memcpy(&v, &bits, 4);
    return v;
}

static float *random_tokens(const fp9_matrix *m, uint32_t ntok, const float **xr)
{
    uint32_t kp = m->groups * 64;
    float *x = malloc(sizeof(float) * ntok * kp), *raw = malloc(sizeof(float) * m->cols);
    for (uint32_t t = 0; t < ntok; t++) {
        for (uint32_t c = 0; c < m->cols; c++)
            raw[c] = bf16_tokens ? bf16_round(frand()) : frand();
        fp9_prepare_x_f32(raw, m->cols, kp, x + t * kp);
        xr[t] = x + t * kp;
    }
    free(raw);
    return x;
}

/* fast against ref on ntok tokens: the worst error relative to |y| plus
 * the spread of a dot of cols terms; y0, y1 hold ntok rows of m->rows. */
static double worst_vs_ref(const duck_kernels *fast, const fp9_matrix *m, uint32_t ntok, const float *const *xr,
                           float *y0, float *y1)
{
    float **yr0 = malloc(sizeof(float *) * ntok), **yr1 = malloc(sizeof(float *) * ntok);
    for (uint32_t t = 0; t < ntok; t++)
        yr0[t] = y0 + t * m->rows, yr1[t] = y1 + t * m->rows;
    duck_kernels_ref()->gemm(m, 0, m->row_pairs, ntok, xr, yr0, 0);
    fast->gemm(m, 0, m->row_pairs, ntok, xr, yr1, 0);
    double worst = 0;
    for (uint32_t i = 0; i < ntok * m->rows; i++) {
        double d = fabs((double)y0[i] - y1[i]) / (fabs(y0[i]) + sqrt((double)m->cols) * 0.1);
        worst = d > worst ? d : worst;
    }
    free(yr0), free(yr1);
    return worst;
}

/* The largest |a[i] - b[i]| over n values, and the largest |b[i]| in *top. */
static double worst_diff(const float *a, const float *b, size_t n, double *top)
{
    double worst = 0;
    *top = 0;
    for (size_t i = 0; i < n; i++) {
        worst = fmax(worst, fabs((double)a[i] - b[i]));
        *top = fmax(*top, fabs((double)b[i]));
    }
    return worst;
}

static void test_kernels_agree(const duck_kernels *fast)
{
    static const uint32_t dims[] = {1, 3, 17, 33, 127, 129, 2049, 4100};
    for (size_t a = 0; a < sizeof dims / sizeof *dims; a++) {
        for (size_t b = 0; b < sizeof dims / sizeof *dims; b++) {
            uint32_t rows = dims[a], cols = dims[b];
            if ((size_t)rows * cols > 600000)
                continue;
            fp9_matrix m;
            void *buf = pack_random(rows, cols, &m);
            uint32_t ntok = 1 + (rows + cols) % 9;
            const float *xr[16];
            float *x = random_tokens(&m, ntok, xr), *y0 = malloc(sizeof(float) * ntok * rows),
                  *y1 = malloc(sizeof(float) * ntok * rows);
            for (uint32_t n = 1; n <= ntok; n += ntok - 1 ? ntok - 1 : 1) {
                double worst = worst_vs_ref(fast, &m, n, xr, y0, y1);
                CHECK(worst < 1e-5, "%s vs ref %ux%u ntok %u: %.3g", fast->name, rows, cols, n, worst);
                if (n == ntok)
                    break;
            }
            free(x), free(y0), free(y1), free(buf);
        }
    }
}

/* fp8 codes with block scales that are not powers of two: kept per block */
static void *pack_fp8_scaled(uint32_t rows, uint32_t cols, fp9_matrix *m)
{
    uint8_t *codes = malloc((size_t)rows * cols);
    uint32_t sr = (rows + 127) / 128, sc = (cols + 127) / 128;
    float *scales = malloc(sizeof(float) * sr * sc);
    for (size_t i = 0; i < (size_t)rows * cols; i++)
        codes[i] = (uint8_t)((uint32_t)((frand() + 1.0f) * 63.0f) | (frand() < 0 ? 0x80 : 0));
    for (uint32_t i = 0; i < sr * sc; i++)
        scales[i] = 1e-3f * (3.0f + frand());
    size_t cap = fp9_pack_fp8_bound(rows, cols);
    void *buf = aligned_alloc(64, (cap + 63) / 64 * 64);
    int with = 0;
    CHECK(fp9_pack_fp8(codes, rows, cols, cols, scales, sc, buf, cap, &with, NULL) == FP9_OK && with,
          "pack fp8 %ux%u with block scales", rows, cols);
    CHECK(fp9_tensor_view(buf, fp9_tensor_bytes(rows, cols, 1), m) == FP9_OK && m->block_scales,
          "view %ux%u", rows, cols);
    free(codes), free(scales);
    return buf;
}

/* The brief's odd shapes: every token count path (registers, decode into
 * L1 with full and partial token tiles), with and without block scales,
 * against ref; and the same bits whatever row-pair split a pool would make. */
static void test_odd_shapes(const duck_kernels *fast)
{
    static const uint32_t rows_list[] = {1, 3, 17, 33}, cols_list[] = {64, 128, 192, 2048 + 64};
    static const uint32_t tokens[] = {1, 2, 5, 13, 67};
    enum { NT = sizeof tokens / sizeof *tokens, TMAX = 67 };
    for (int scaled = 0; scaled < 2; scaled++)
        for (size_t a = 0; a < 4; a++)
            for (size_t b = 0; b < 4; b++) {
                uint32_t rows = rows_list[a], cols = cols_list[b];
                fp9_matrix m;
                void *buf = scaled ? pack_fp8_scaled(rows, cols, &m) : pack_random(rows, cols, &m);
                const float **xr = malloc(sizeof(float *) * TMAX);
                float *x = random_tokens(&m, TMAX, xr), *y0 = malloc(sizeof(float) * TMAX * rows),
                      *y1 = malloc(sizeof(float) * TMAX * rows), *y2 = malloc(sizeof(float) * TMAX * rows);
                float **yr2 = malloc(sizeof(float *) * TMAX);
                for (uint32_t t = 0; t < TMAX; t++)
                    yr2[t] = y2 + t * rows;
                for (size_t n = 0; n < NT; n++) {
                    uint32_t nt = tokens[n];
                    double worst = worst_vs_ref(fast, &m, nt, xr, y0, y1);
                    CHECK(worst < 1e-5, "%s vs ref %ux%u%s ntok %u: %.3g", fast->name, rows, cols,
                          scaled ? " block-scaled" : "", nt, worst);
                    for (uint32_t cut = DUCK_ROW_PAIR_ALIGN; cut < m.row_pairs; cut += DUCK_ROW_PAIR_ALIGN) {
                        fast->gemm(&m, 0, cut, nt, xr, yr2, 0);
                        fast->gemm(&m, cut, m.row_pairs, nt, xr, yr2, 0);
                        CHECK(memcmp(y1, y2, sizeof(float) * nt * rows) == 0,
                              "%s %ux%u ntok %u: split at pair %u changed bits", fast->name, rows, cols, nt, cut);
                    }
                }
                free(x), free(y0), free(y1), free(y2), free(buf), free(xr), free(yr2);
            }
}

static void test_codec(void)
{
    for (int c = 0; c < 256; c++) {
        float v = fp9_decode((uint8_t)c, 0);
        CHECK(fp9_encode_rne(v) == c, "code %d round trip", c);
        CHECK(fp9_decode((uint8_t)c, 1) == -v, "sign of code %d", c);
    }
    CHECK(fp9_encode_rne(1e30f) == FP9_MAX_CODE, "saturation");
    float bad[2] = {1.0f, NAN};
    uint8_t out[512];
    size_t at = 99;
    CHECK(fp9_pack_f32(bad, 1, 2, 2, out, &at) == FP9_ENONFINITE && at == 1, "NaN refused at its index");
    CHECK(fp9_tensor_view(out, 10, &(fp9_matrix){0}) == FP9_EFORMAT, "short buffer refused");
}

static uint16_t bf16_rne(float v)
{
    uint16_t b;
    duck_f32_to_bf16(&v, 1, &b);
    return b;
}

static void test_bf16_rounding(void)
{
    CHECK(bf16_rne(1.0f) == 0x3F80, "1.0");
    CHECK(bf16_rne(1.0f + 0x1p-8f) == 0x3F80, "tie to even, down");
    CHECK(bf16_rne(1.0f + 3 * 0x1p-8f) == 0x3F82, "tie to even, up");
    CHECK(bf16_rne(1.0f + 0x1p-8f + 0x1p-20f) == 0x3F81, "above the tie");
    CHECK(bf16_rne(-2.0f) == 0xC000, "sign");
    CHECK(bf16_rne(3.4e38f) == 0x7F80, "rounds up to Inf past the largest bf16");
    CHECK((bf16_rne(NAN) & 0x7FC0) == 0x7FC0, "NaN stays a quiet NaN");
}

/* MoE forward with every kernel set, fp32 and bf16 in and out, on one thread
 * and on pools of 2..4 (a shared run: pieces claimed as they come), many
 * times over: the bits must not change. */
static void test_moe_pool(const duck_kernels *k)
{
    enum { H = 300, S = 64, E = 5, T = 7, K = 3, HB = 2048, SB = 192, EB = 9 };
    duck_expert_slice ex[EB];
    void *bufs[2 * EB];
    for (int e = 0; e < E; e++) {
        bufs[2 * e] = pack_random(2 * S, H, &ex[e].gate_up);
        bufs[2 * e + 1] = pack_random(H, S, &ex[e].down);
    }
    static float x[T * HB], y1[T * HB], y2[T * HB];
    static uint16_t xb[T * HB], yb[T * HB];
    float w[T * 8];
    int32_t ids[T * 8];
    for (int i = 0; i < T * HB; i++) {
        x[i] = frand();
        xb[i] = bf16_rne(x[i]);
    }
    for (int i = 0; i < T * K; i++) {
        ids[i] = (i * 7 + 3) % (E + 1) - 1;   /* includes -1 slots */
        w[i] = 0.5f + frand() * 0.25f;
    }
    duck_moe_args a = {ex, E, T, K, H, ids, w, x, DUCK_DT_F32, DUCK_DT_F32, y1};
    duck_ffn_workspace *ws = duck_ffn_workspace_create();
    uint64_t bytes = 0;
    CHECK(duck_moe_forward(NULL, k, ws, &a, &bytes) == DUCK_FFN_OK && bytes > 0, "%s: moe 1 thread", k->name);
    for (unsigned threads = 2; threads <= 4; threads++) {
        duck_pool *pool = duck_pool_create(threads, 1, 0);
        int same = 1;
        for (int rep = 0; rep < 50; rep++) {
            a.y = y2;
            memset(y2, 0xFF, sizeof y2);
            CHECK(duck_moe_forward(pool, k, ws, &a, &bytes) == DUCK_FFN_OK, "%s: moe pool", k->name);
            same &= memcmp(y1, y2, sizeof(float) * T * H) == 0;
        }
        CHECK(same, "%s: %u threads changed the result", k->name, threads);
        duck_pool_destroy(pool);
    }
    /* bf16 out is the fp32 result rounded once; bf16 in is x rounded */
    a.y = yb;
    a.y_dtype = DUCK_DT_BF16;
    CHECK(duck_moe_forward(NULL, k, ws, &a, &bytes) == DUCK_FFN_OK, "%s: bf16 out", k->name);
    int rounded = 1;
    for (int i = 0; i < T * H; i++)
        rounded &= yb[i] == bf16_rne(y1[i]);
    CHECK(rounded, "%s: bf16 output is not the fp32 sum rounded to nearest even", k->name);
    a.x = xb;
    a.x_dtype = DUCK_DT_BF16;
    a.y = y2;
    a.y_dtype = DUCK_DT_F32;
    CHECK(duck_moe_forward(NULL, k, ws, &a, &bytes) == DUCK_FFN_OK, "%s: bf16 in", k->name);
    double top, worst = worst_diff(y2, y1, (size_t)T * H, &top);
    CHECK(worst <= top * 0.02, "%s: bf16 input moved the result by %g of %g", k->name, worst, top);
    a.x_dtype = 2;
    CHECK(duck_moe_forward(NULL, k, ws, &a, &bytes) == DUCK_FFN_EINVAL, "unknown x dtype accepted");
    a.x_dtype = DUCK_DT_F32;
    a.x = x;
    ids[4] = E;
    CHECK(duck_moe_forward(NULL, k, ws, &a, &bytes) == DUCK_FFN_EEXPERT, "bad id refused");

    /* a decode shape cut into many pieces (Qwen3-30B-A3B, one of four ducks): top-8 of 9, 1 and 2 tokens */
    for (int e = 0; e < EB; e++) {
        if (e < E) {
            free(bufs[2 * e]);
            free(bufs[2 * e + 1]);
        }
        bufs[2 * e] = pack_random(2 * SB, HB, &ex[e].gate_up);
        bufs[2 * e + 1] = pack_random(HB, SB, &ex[e].down);
    }
    for (uint32_t ntok = 1; ntok <= 2; ntok++) {
        for (uint32_t i = 0; i < ntok * 8; i++) {
            ids[i] = (int32_t)((i * 5 + ntok) % EB);
            w[i] = 0.1f + 0.01f * (float)i;
        }
        duck_moe_args d = {ex, EB, ntok, 8, HB, ids, w, x, DUCK_DT_F32, DUCK_DT_F32, y1};
        CHECK(duck_moe_forward(NULL, k, ws, &d, &bytes) == DUCK_FFN_OK, "%s: decode shape", k->name);
        duck_pool *pool = duck_pool_create(3, 0, 0);
        int same = 1;
        for (int rep = 0; rep < 20; rep++) {
            d.y = y2;
            CHECK(duck_moe_forward(pool, k, ws, &d, &bytes) == DUCK_FFN_OK, "%s: decode shape, pool", k->name);
            same &= memcmp(y1, y2, sizeof(float) * ntok * HB) == 0;
        }
        CHECK(same, "%s: decode shape, %u token(s): 3 threads changed the result", k->name, ntok);
        duck_pool_destroy(pool);
    }
    duck_ffn_workspace_destroy(ws);
    for (int i = 0; i < 2 * EB; i++)
        free(bufs[i]);
}

/* A prefill chunk of DUCK_MAX_TOKENS tokens: most experts get many tokens
 * (the GEMM path), one gets a single token (the GEMV path); against the
 * reference set, the same bits on a pool; one token more is refused. */
static void test_moe_prefill(const duck_kernels *k)
{
    enum { H = 200, S = 64, E = 6, K = 2, T = DUCK_MAX_TOKENS };
    duck_expert_slice ex[E];
    void *bufs[2 * E];
    for (int e = 0; e < E; e++) {
        bufs[2 * e] = pack_random(2 * S, H, &ex[e].gate_up);
        bufs[2 * e + 1] = pack_random(H, S, &ex[e].down);
    }
    float *x = malloc(sizeof(float) * (T + 1) * H), *w = malloc(sizeof(float) * (T + 1) * K);
    float *y0 = malloc(sizeof(float) * T * H), *y1 = malloc(sizeof(float) * T * H), *y2 = malloc(sizeof(float) * T * H);
    int32_t *ids = malloc(sizeof(int32_t) * (T + 1) * K);
    for (int i = 0; i < (T + 1) * H; i++)
        x[i] = frand();
    for (int t = 0; t <= T; t++) {
        ids[t * K] = t == 5 ? E - 1 : t % (E - 1);   /* expert E - 1: token 5 alone */
        ids[t * K + 1] = t % 7 == 3 ? -1 : (t * 3 + 1) % (E - 1);
        w[t * K] = 0.5f + frand() * 0.25f;
        w[t * K + 1] = 0.25f;
    }
    duck_moe_args a = {ex, E, T, K, H, ids, w, x, DUCK_DT_F32, DUCK_DT_F32, y0};
    duck_ffn_workspace *ws = duck_ffn_workspace_create();
    uint64_t bytes = 0;
    CHECK(duck_moe_forward(NULL, duck_kernels_ref(), ws, &a, &bytes) == DUCK_FFN_OK, "prefill, ref");
    a.y = y1;
    CHECK(duck_moe_forward(NULL, k, ws, &a, &bytes) == DUCK_FFN_OK, "%s: prefill", k->name);
    double top, worst = worst_diff(y1, y0, (size_t)T * H, &top);
    CHECK(worst <= top * 1e-5, "%s: prefill of %d tokens off ref by %g of %g", k->name, T, worst, top);
    duck_pool *pool = duck_pool_create(3, 0, 0);
    a.y = y2;
    CHECK(duck_moe_forward(pool, k, ws, &a, &bytes) == DUCK_FFN_OK, "%s: prefill, pool", k->name);
    CHECK(memcmp(y1, y2, sizeof(float) * T * H) == 0, "%s: prefill, 3 threads changed the result", k->name);
    duck_pool_destroy(pool);
    a.ntok = T + 1;
    CHECK(duck_moe_forward(NULL, k, ws, &a, &bytes) == DUCK_FFN_EINVAL, "%d tokens accepted", T + 1);
    duck_ffn_workspace_destroy(ws);
    for (int i = 0; i < 2 * E; i++)
        free(bufs[i]);
    free(x), free(w), free(y0), free(y1), free(y2), free(ids);
}

static void test_synth(void)
{
    fp9_synth_desc d = {FP9_SYNTH_VERSION, 37, 2100, 35, 2000, fp9_synth_default_prescale_log2(2100), 99};
    char err[200];
    CHECK(fp9_synth_check(&d, err, sizeof err) == FP9_OK, "valid descriptor refused: %s", err);
    size_t n = (size_t)fp9_synth_bytes(&d);
    CHECK(n == fp9_tensor_bytes(37, 2100, 0), "synth size %zu", n);
    uint8_t *one = aligned_alloc(64, (n + 63) / 64 * 64), *many = aligned_alloc(64, (n + 63) / 64 * 64);
    duck_pool *pool = duck_pool_create(3, 0, 0);
    CHECK(fp9_synth_generate(&d, one, n, NULL) == FP9_OK, "generate on one thread");
    CHECK(fp9_synth_generate(&d, many, n, pool) == FP9_OK, "generate on 3 threads");
    CHECK(memcmp(one, many, n) == 0, "thread count changed the bytes");
    fp9_matrix m;
    CHECK(fp9_tensor_view(one, n, &m) == FP9_OK && m.prescale == ldexpf(1.0f, d.prescale_log2), "view, prescale");
    float *w = malloc(sizeof(float) * 37 * 2100);
    fp9_unpack_f32(&m, w, 2100);
    int outside = 0, inside = 0;
    float biggest = 0;
    for (uint32_t r = 0; r < 37; r++)
        for (uint32_t c = 0; c < 2100; c++) {
            float v = w[(size_t)r * 2100 + c];
            if (r >= d.live_rows || c >= d.live_cols)
                outside += v != 0.0f || signbit(v);
            else
                inside += v == 0.0f;
            biggest = fabsf(v) > biggest ? fabsf(v) : biggest;
        }
    CHECK(outside == 0 && inside == 0, "%d weights live outside, %d zero inside the live region", outside, inside);
    CHECK(biggest <= 1.875f / 64 && biggest > 0.9f / sqrtf(2100), "largest weight %g", biggest);
    CHECK(fp9_synth_generate(&d, one, n - 1, NULL) == FP9_EINVAL, "short buffer accepted");
    CHECK(fp9_synth_generate(&d, one + 4, n - 4, NULL) == FP9_EINVAL, "misaligned buffer accepted");
    fp9_synth_desc bad = d;
    bad.version = 2;
    CHECK(fp9_synth_check(&bad, err, sizeof err) == FP9_EFORMAT && strstr(err, "version 2"), "version: %s", err);
    bad = d;
    bad.rows = 0;
    CHECK(fp9_synth_check(&bad, err, sizeof err) == FP9_EINVAL && strstr(err, "shape 0x2100"), "rows 0: %s", err);
    bad = d;
    bad.rows = bad.cols = FP9_SYNTH_MAX_DIM;
    bad.live_rows = bad.live_cols = 0;
    CHECK(fp9_synth_check(&bad, err, sizeof err) == FP9_EINVAL && strstr(err, "byte limit"), "huge: %s", err);
    bad = d;
    bad.live_cols = 2101;
    CHECK(fp9_synth_check(&bad, err, sizeof err) == FP9_EINVAL && strstr(err, "live region"), "live: %s", err);
    bad = d;
    bad.prescale_log2 = FP9_SYNTH_PRESCALE_LOG2_MIN - 1;
    CHECK(fp9_synth_check(&bad, NULL, 0) == FP9_EINVAL, "prescale_log2 below the range accepted");
    duck_pool_destroy(pool);
    free(w), free(one), free(many);
}

int main(void)
{
    test_codec();
    test_synth();
    test_kernels_agree(duck_kernels_ref());
    const duck_kernels *avx2 = duck_kernels_avx2_variant(0);
    if (avx2) {
        for (int blend = 0; blend < 2; blend++) {
            test_kernels_agree(duck_kernels_avx2_variant(blend));
            test_odd_shapes(duck_kernels_avx2_variant(blend));
        }
    } else
        printf("note: no AVX2+FMA on this CPU; only the reference was tested\n");
    if (duck_kernels_avx512()) {
        for (int inv = 1; inv >= 0; inv--) {   /* the batch-invariant GEMM, then the FMA tiles */
            duck_kernels_set_batch_invariant(inv);
            test_kernels_agree(duck_kernels_avx512());
            test_odd_shapes(duck_kernels_avx512());
        }
        duck_kernels_set_batch_invariant(1);
    } else
        printf("note: no AVX-512 F/BW/VL on this CPU; the avx512 kernels were not tested\n");
    if (duck_kernels_avx512_bf16()) {
        bf16_tokens = 1;   /* the bf16 GEMM runs only on such activations */
        test_kernels_agree(duck_kernels_avx512_bf16());
        test_odd_shapes(duck_kernels_avx512_bf16());
        bf16_tokens = 0;
    } else
        printf("note: no AVX512_BF16 on this CPU; the avx512-bf16 kernels were not tested\n");
    /* the AMX tile program: emulated wherever AVX512_BF16 is, on the tiles where AMX is */
    const duck_kernels *amx_sets[] = {duck_kernels_amx_emulated(), duck_kernels_amx()};
    for (int i = 0; i < 2; i++)
        if (amx_sets[i]) {
            unsigned long long dots = duck_kernels_amx_emulated_dots();
            bf16_tokens = 1;
            /* the tile program as it runs, and its benchmark's orders that keep every part */
            const int orders[] = {0, DUCK_AMX_PART_SERIAL};
            for (int o = 0; o < 2; o++) {
                duck_kernels_amx_parts(orders[o]);
                test_kernels_agree(amx_sets[i]);
                test_odd_shapes(amx_sets[i]);
            }
            duck_kernels_amx_parts(0);
            bf16_tokens = 0;   /* fp32 activations, batch invariance off: the same tiles on three bf16 parts */
            duck_kernels_set_batch_invariant(0);
            dots = duck_kernels_amx_emulated_dots();
            test_kernels_agree(amx_sets[i]);
            test_odd_shapes(amx_sets[i]);
            CHECK((duck_kernels_amx_emulated_dots() > dots) == (i == 0), "%s: the emulated tiles ran %llu times",
                  amx_sets[i]->name, duck_kernels_amx_emulated_dots() - dots);
            duck_kernels_set_batch_invariant(1);   /* on: avx512's GEMM, no tile */
            dots = duck_kernels_amx_emulated_dots();
            test_kernels_agree(amx_sets[i]);
            CHECK(duck_kernels_amx_emulated_dots() == dots, "%s: fp32 activations ran on the tiles", amx_sets[i]->name);
        } else
            printf("note: no %s on this CPU; that kernel set was not tested\n", i ? "AMX-BF16" : "AVX512_BF16");
    test_bf16_rounding();
    const duck_kernels *sets[] = {duck_kernels_ref(), duck_kernels_avx2(), duck_kernels_avx512(),
                                  duck_kernels_avx512_bf16(), duck_kernels_amx_emulated(), duck_kernels_amx()};
    for (int i = 0; i < 6; i++)
        if (sets[i]) {
            test_moe_pool(sets[i]);
            test_moe_prefill(sets[i]);
        }
    printf("%d passed, %d failed\n", checks - failures, failures);
    return failures;
}
