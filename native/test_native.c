/* Standalone test of the C floor, built with ASan/UBSan by the test suite
 * (tests/native/test_c_build.py): AVX2 against _ref on odd shapes, the
 * codec, the pool and the MoE forward. Exit status = number of failures. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ffn.h"

static int failures, checks;

#define CHECK(cond, ...)                                  \
    do {                                                  \
        checks++;                                         \
        if (!(cond)) {                                    \
            failures++;                                   \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                 \
            fprintf(stderr, "\n");                        \
        }                                                 \
    } while (0)

static uint32_t rng_state = 12345;
static float frand(void)   /* deterministic, varied: xorshift in [-1, 1) */
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 17;
    rng_state ^= rng_state << 5;
    return (float)((rng_state >> 8) * (1.0 / 8388608.0)) - 1.0f;
}

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
            uint32_t ntok = 1 + (rows + cols) % 9, kp = m.groups * 64;
            float *x = malloc(sizeof(float) * ntok * kp), *y0 = malloc(sizeof(float) * ntok * rows),
                  *y1 = malloc(sizeof(float) * ntok * rows);
            const float *xr[16];
            float *yr0[16], *yr1[16];
            for (uint32_t t = 0; t < ntok; t++) {
                float raw[4100];
                for (uint32_t c = 0; c < cols; c++)
                    raw[c] = frand();
                fp9_prepare_x_f32(raw, cols, kp, x + t * kp);
                xr[t] = x + t * kp;
                yr0[t] = y0 + t * rows;
                yr1[t] = y1 + t * rows;
            }
            for (uint32_t n = 1; n <= ntok; n += ntok - 1 ? ntok - 1 : 1) {
                duck_kernels_ref()->gemm(&m, 0, m.row_pairs, n, xr, yr0, 0);
                fast->gemm(&m, 0, m.row_pairs, n, xr, yr1, 0);
                double worst = 0;
                for (uint32_t i = 0; i < n * rows; i++) {
                    double d = fabs((double)y0[i] - y1[i]) / (fabs(y0[i]) + sqrt((double)cols) * 0.1);
                    worst = d > worst ? d : worst;
                }
                CHECK(worst < 1e-5, "%s vs ref %ux%u ntok %u: %.3g", fast->name, rows, cols, n, worst);
                if (n == ntok)
                    break;
            }
            free(x), free(y0), free(y1), free(buf);
        }
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

static void test_moe_pool(void)
{
    enum { H = 300, S = 64, E = 5, T = 7, K = 3 };
    duck_expert_slice ex[E];
    void *bufs[2 * E];
    for (int e = 0; e < E; e++) {
        bufs[2 * e] = pack_random(2 * S, H, &ex[e].gate_up);
        bufs[2 * e + 1] = pack_random(H, S, &ex[e].down);
    }
    float x[T * H], y1[T * H], y2[T * H], w[T * K];
    int32_t ids[T * K];
    for (int i = 0; i < T * H; i++)
        x[i] = frand();
    for (int i = 0; i < T * K; i++) {
        ids[i] = (i * 7 + 3) % (E + 1) - 1;   /* includes -1 slots */
        w[i] = 0.5f + frand() * 0.25f;
    }
    duck_moe_args a = {ex, E, T, K, H, ids, w, x, 0, y1};
    duck_ffn_workspace *ws = duck_ffn_workspace_create();
    duck_pool *pool = duck_pool_create(3, 1, 0);
    uint64_t bytes = 0;
    CHECK(duck_moe_forward(NULL, duck_kernels_best(), ws, &a, &bytes) == DUCK_FFN_OK && bytes > 0, "moe 1 thread");
    a.y = y2;
    CHECK(duck_moe_forward(pool, duck_kernels_best(), ws, &a, &bytes) == DUCK_FFN_OK, "moe pool");
    CHECK(memcmp(y1, y2, sizeof y1) == 0, "pool result differs from one thread");
    ids[4] = E;
    CHECK(duck_moe_forward(pool, duck_kernels_best(), ws, &a, &bytes) == DUCK_FFN_EEXPERT, "bad id refused");
    duck_pool_destroy(pool);
    duck_ffn_workspace_destroy(ws);
    for (int i = 0; i < 2 * E; i++)
        free(bufs[i]);
}

int main(void)
{
    test_codec();
    test_kernels_agree(duck_kernels_ref());
    const duck_kernels *avx2 = duck_kernels_avx2_variant(0);
    if (avx2) {
        test_kernels_agree(avx2);
        test_kernels_agree(duck_kernels_avx2_variant(1));
    } else
        printf("note: no AVX2+FMA on this CPU; only the reference was tested\n");
    test_moe_pool();
    printf("%d passed, %d failed\n", checks - failures, failures);
    return failures;
}
