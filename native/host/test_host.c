/* Standalone test of native/host/, built with ASan/UBSan by the test suite
 * (tests/native/test_host_c_build.py): every kernel set against _ref on odd
 * shapes with NaN beside every row, and a tiny random model decoded on a pool
 * of three threads against one thread with the ref set. Exit status = number
 * of failures. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "host_decoder.h"
#include "test_check.h"

#define PAD 5          /* NaN floats after every row: a kernel reading them returns NaN */
#define REL_TOL 4e-6f  /* fast vs ref, relative to sum |w| |x| */

/* rows x (cols + PAD) floats, the pad NaN */
static float *padded_random(uint32_t rows, uint32_t cols)
{
    float *a = malloc(sizeof(float) * rows * (cols + PAD));
    for (uint32_t r = 0; r < rows; r++)
        for (uint32_t c = 0; c < cols + PAD; c++)
            a[(size_t)r * (cols + PAD) + c] = c < cols ? frand() : NAN;
    return a;
}

/* f rounded to half (nearest even; |f| < 2^-14 to zero, which the tests' values avoid or accept) */
static uint16_t to_half(float f)
{
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    const uint32_t sign = (b >> 16) & 0x8000u, man = b & 0x7FFFFFu;
    const int32_t exp = (int32_t)((b >> 23) & 0xFFu) - 127 + 15;
    if (exp <= 0)
        return (uint16_t)sign;
    uint32_t h = ((uint32_t)exp << 10) | (man >> 13);
    const uint32_t rest = man & 0x1FFFu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u)))
        h++;
    return (uint16_t)(sign | h);
}

/* rows x (cols + PAD) halves of random values (the pad NaN), and the same widened to fp32 in *wide */
static uint16_t *padded_random_half(uint32_t rows, uint32_t cols, float **wide)
{
    uint16_t *h = malloc(sizeof(uint16_t) * rows * (cols + PAD));
    float *f = padded_random(rows, cols);
    for (size_t i = 0; i < (size_t)rows * (cols + PAD); i++) {
        h[i] = i % (cols + PAD) < cols ? to_half(f[i]) : 0x7E00u;
        f[i] = i % (cols + PAD) < cols ? duck_half_to_float(h[i]) : NAN;
    }
    *wide = f;
    return h;
}

/* Every half against its value computed in double: exact, subnormals, infinities and NaN included. */
static void test_half_to_float(void)
{
    int bad = 0;
    for (uint32_t h = 0; h < 0x10000u; h++) {
        const uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
        const double sign = h & 0x8000u ? -1.0 : 1.0;
        const float got = duck_half_to_float((uint16_t)h);
        if (exp == 0x1F) {
            bad += man ? !isnan(got) : !(isinf(got) && (got < 0) == (sign < 0));
            continue;
        }
        const double want = sign * (exp ? ldexp(1.0 + man / 1024.0, (int)exp - 15) : ldexp((double)man, -24));
        bad += (double)got != want || !!signbit(got) != (sign < 0);
    }
    CHECK(bad == 0, "duck_half_to_float: %d of 65536 halves wrong", bad);
}

/* duck_float_to_half exhaustively around every half: each half's own value, the
 * midpoints between neighbours (ties to even) and the floats next to them;
 * then each set's to_half on the same floats, and its to_float on every half. */
static void test_float_to_half(const duck_host_kernels *const *sets, size_t n_sets)
{
    enum { PER = 5 };
    float *in = malloc(sizeof(float) * 0x10000u * PER);
    uint16_t *want = malloc(sizeof(uint16_t) * 0x10000u * PER), *got = malloc(sizeof(uint16_t) * 0x10000u * PER);
    size_t n = 0;
    int bad = 0;
    for (uint32_t h = 0; h < 0x10000u; h++) {
        const float f = duck_half_to_float((uint16_t)h);
        if (isnan(f)) {
            bad += !isnan(duck_half_to_float(duck_float_to_half(f)));
            continue;
        }
        in[n] = f, want[n++] = (uint16_t)h;
        if ((h & 0x7FFFu) >= 0x7C00u)   /* infinity: no neighbour above */
            continue;
        /* above the largest half (65504) the next would be 65536: the tie at 65520 goes to infinity */
        const double next = (h & 0x7FFFu) == 0x7BFFu ? copysign(65536.0, f) : duck_half_to_float((uint16_t)(h + 1));
        const float mid = (float)((f + next) / 2);
        in[n] = mid, want[n++] = (h & 1u) ? (uint16_t)(h + 1) : (uint16_t)h;
        in[n] = nextafterf(mid, 0.0f), want[n++] = (uint16_t)h;
        in[n] = nextafterf(mid, 2 * mid), want[n++] = (uint16_t)(h + 1);
    }
    in[n] = 1e30f, want[n++] = 0x7C00u;
    in[n] = -1e-30f, want[n++] = 0x8000u;
    for (size_t i = 0; i < n; i++)
        bad += duck_float_to_half(in[i]) != want[i];
    CHECK(bad == 0, "duck_float_to_half: %d of %zu floats rounded wrong", bad, n);
    for (size_t s = 0; s < n_sets; s++) {
        if (!sets[s])
            continue;
        sets[s]->to_half(in, (uint32_t)n, got);
        CHECK(memcmp(got, want, sizeof(uint16_t) * n) == 0, "%s to_half differs from duck_float_to_half",
              sets[s]->name);
        uint16_t all[0x10000];
        float wide[0x10000];
        for (uint32_t h = 0; h < 0x10000u; h++)
            all[h] = (uint16_t)h;
        sets[s]->to_float(all, 0x10000u - 3, wide);   /* a length off the vectors: the scalar tail too */
        int off = 0;
        for (uint32_t h = 0; h < 0x10000u - 3; h++) {
            const float w = duck_half_to_float((uint16_t)h);
            off += isnan(w) ? !isnan(wide[h]) : memcmp(&w, &wide[h], sizeof w) != 0;
        }
        CHECK(off == 0, "%s to_float: %d halves widened wrong", sets[s]->name, off);
    }
    free(in), free(want), free(got);
}

/* gemv_t_h on half values is gemv_t on them widened, bit for bit, whole and
 * partial 64-column blocks, and writes nothing past column n. */
static void test_gemv_t_h(const duck_host_kernels *k)
{
    static const uint32_t shapes[][2] = {{1, 1}, {7, 64}, {33, 65}, {74, 64}, {5, 130}, {3, 7}, {200, 128}};
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        const uint32_t rows = shapes[s][0], n = shapes[s][1];
        float *wide, *p = padded_random(1, rows);
        uint16_t *v = padded_random_half(rows, n, &wide);
        float *z0 = padded_random(1, n), *z1 = padded_random(1, n);
        k->gemv_t(p, wide, n + PAD, rows, n, z0);
        k->gemv_t_h(p, v, n + PAD, rows, n, z1);
        CHECK(memcmp(z0, z1, sizeof(float) * n) == 0, "%s gemv_t_h %ux%u differs from gemv_t widened", k->name,
              rows, n);
        CHECK(isnan(z1[n]), "%s gemv_t_h %ux%u wrote past column %u", k->name, rows, n, n);
        free(wide), free(p), free(v), free(z0), free(z1);
    }
}

/* halves [rows, cols] (ldw apart) packed into gemm_h's panels (a new buffer) */
static uint16_t *packed_half(const uint16_t *w, size_t ldw, uint32_t rows, uint32_t cols)
{
    uint16_t *p = malloc(sizeof(uint16_t) * duck_host_packed_halves(rows, cols));
    duck_host_pack_half(w, ldw, rows, cols, p);
    return p;
}

/* gemm_h on packed half weights gives what gemm gives on them widened (within
 * REL_TOL: the vector sets sum in another order), every token the same bits
 * alone as within the call, over whole and partial panels and every token-tile
 * size; gemm gives each token what it gives the token alone; rows past the last
 * are left alone. */
static void test_gemm_h(const duck_host_kernels *k)
{
    static const uint32_t shapes[][3] = {{1, 1, 1}, {3, 17, 2}, {5, 33, 3}, {4, 64, 1}, {7, 65, 33},
                                         {9, 576, 4}, {70, 1024, 2}, {5, 1100, 35}, {2, 2051, 1}, {64, 96, 1},
                                         {83, 40, 13}};
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        const uint32_t rows = shapes[s][0], kd = shapes[s][1], ntok = shapes[s][2];
        float *wide, *x = padded_random(ntok, kd);
        uint16_t *w = padded_random_half(rows, kd, &wide), *p = packed_half(w, kd + PAD, rows, kd);
        float *y0 = padded_random(ntok, rows), *y1 = padded_random(ntok, rows);
        k->gemm(wide, kd + PAD, rows, kd, ntok, x, kd + PAD, y0, rows + PAD);
        k->gemm_h(p, kd, rows, kd, ntok, x, kd + PAD, y1, rows + PAD);
        float worst = 0.0f;
        int past = 0, alone = 1;
        for (uint32_t t = 0; t < ntok; t++) {
            for (uint32_t r = 0; r < rows + PAD; r++) {
                const float v0 = y0[t * (rows + PAD) + r], v1 = y1[t * (rows + PAD) + r];
                if (r >= rows) {
                    past += !isnan(v1);
                    continue;
                }
                float scale = 0.0f;
                for (uint32_t c = 0; c < kd; c++)
                    scale += fabsf(wide[(size_t)r * (kd + PAD) + c] * x[(size_t)t * (kd + PAD) + c]);
                const float err = fabsf(v0 - v1) / (scale + 1e-30f);
                worst = err > worst || isnan(err) ? err : worst;
            }
            float one[83];
            k->gemm_h(p, kd, rows, kd, 1, x + (size_t)t * (kd + PAD), kd + PAD, one, rows);
            alone &= memcmp(one, y1 + (size_t)t * (rows + PAD), sizeof(float) * rows) == 0;
        }
        CHECK(worst <= REL_TOL, "%s gemm_h %ux%u x %u tokens: %g from gemm on the widened weights", k->name, rows,
              kd, ntok, worst);
        CHECK(!past, "%s gemm_h %ux%u wrote past row %u", k->name, rows, kd, rows);
        CHECK(alone, "%s gemm_h %ux%u x %u tokens differs from one token at a time", k->name, rows, kd, ntok);
        for (uint32_t t = 0; t < ntok; t++) {   /* gemm too: the sums do not depend on ntok */
            float one[83];
            k->gemm(wide, kd + PAD, rows, kd, 1, x + (size_t)t * (kd + PAD), kd + PAD, one, rows);
            alone &= memcmp(one, y0 + (size_t)t * (rows + PAD), sizeof(float) * rows) == 0;
        }
        CHECK(alone, "%s gemm %ux%u x %u tokens differs from one token at a time", k->name, rows, kd, ntok);
        free(wide), free(x), free(w), free(p), free(y0), free(y1);
    }
}

static void test_kernels(const duck_host_kernels *fast)
{
    static const uint32_t dims[] = {1, 3, 17, 33, 64, 65, 576};
    const duck_host_kernels *ref = duck_host_kernels_ref();
    const size_t nd = sizeof dims / sizeof *dims;
    for (size_t a = 0; a < nd; a++)
        for (size_t b = 0; b < nd; b++) {
            const uint32_t rows = dims[a], k = dims[b], ntok = 1 + (rows + k) % 3;
            float *w = padded_random(rows, k), *x = padded_random(ntok, k);
            float *y0 = padded_random(ntok, rows), *y1 = padded_random(ntok, rows);
            ref->gemm(w, k + PAD, rows, k, ntok, x, k + PAD, y0, rows + PAD);
            fast->gemm(w, k + PAD, rows, k, ntok, x, k + PAD, y1, rows + PAD);
            for (uint32_t t = 0; t < ntok; t++)
                for (uint32_t r = 0; r < rows + PAD; r++) {
                    const float v0 = y0[t * (rows + PAD) + r], v1 = y1[t * (rows + PAD) + r];
                    if (r >= rows) {
                        CHECK(isnan(v1), "%s gemm %ux%u wrote past row %u", fast->name, rows, k, rows);
                        continue;
                    }
                    float scale = 0.0f;
                    for (uint32_t c = 0; c < k; c++)
                        scale += fabsf(w[r * (k + PAD) + c] * x[t * (k + PAD) + c]);
                    CHECK(fabsf(v0 - v1) <= REL_TOL * scale + 1e-30f, "%s gemm %ux%u t%u r%u: %g vs ref %g",
                          fast->name, rows, k, t, r, v1, v0);
                }
            /* gemv_t: rows of p over a [rows, k] matrix */
            float *p = padded_random(1, rows), *z0 = padded_random(1, k), *z1 = padded_random(1, k);
            ref->gemv_t(p, w, k + PAD, rows, k, z0);
            fast->gemv_t(p, w, k + PAD, rows, k, z1);
            for (uint32_t c = 0; c < k; c++) {
                float scale = 0.0f;
                for (uint32_t r = 0; r < rows; r++)
                    scale += fabsf(p[r] * w[r * (k + PAD) + c]);
                CHECK(fabsf(z0[c] - z1[c]) <= REL_TOL * scale + 1e-30f, "%s gemv_t %ux%u c%u", fast->name, rows,
                      k, c);
            }
            CHECK(isnan(z1[k]), "%s gemv_t %ux%u wrote past column %u", fast->name, rows, k, k);
            CHECK(fabsf(ref->dot(w, x, k) - fast->dot(w, x, k)) <= REL_TOL * (float)k, "%s dot %u", fast->name, k);
            free(w), free(x), free(y0), free(y1), free(p), free(z0), free(z1);
        }
}

/* A tiny Qwen3-MoE-shaped model: GQA, q/k norms, biases, one dense and one routed layer. */
enum { HIDDEN = 40, HEADS = 4, KV = 2, HD = 16, LAYERS = 2, VOCAB = 37, LEN = 9, EXPERTS = 5, TOPK = 2 };

static float *random_floats(size_t n, float offset)
{
    float *a = malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++)
        a[i] = offset + 0.3f * frand();
    return a;
}

static void decode(const duck_host_kernels *k, duck_pool *pool, const duck_host_model *src, float *logits,
                   int32_t *ids_out)
{
    duck_host_model m = *src;
    duck_host_layer layers[LAYERS];
    memcpy(layers, src->layer, sizeof layers);
    const size_t size = src->kv_type == DUCK_HOST_F16 ? sizeof(uint16_t) : sizeof(float);
    for (int l = 0; l < LAYERS; l++) {   /* a fresh cache per run, in either order of its dimensions */
        layers[l].k_cache = calloc(LEN * KV * HD, size);
        layers[l].v_cache = calloc(LEN * KV * HD, size);
    }
    m.layer = layers;
    float ffn_in[3 * HIDDEN], weights[3 * TOPK], y[3 * HIDDEN];
    int32_t ids[3 * TOPK];
    duck_host_io io = {ffn_in, ids, weights};
    char err[256];
    duck_host_decoder *d = duck_host_decoder_create(&m, &io, k, pool, err, sizeof err);
    CHECK(d != NULL, "create: %s", err);
    if (!d)
        return;
    const int64_t steps[3][3] = {{3, 7, 11}, {5, 0, 0}, {8, 2, 0}}, ntoks[3] = {3, 1, 2};
    int64_t pos = 0;
    for (int s = 0; s < 3; s++) {
        int64_t positions[3] = {pos, pos + 1, pos + 2};
        CHECK(duck_host_begin(d, (uint32_t)ntoks[s], steps[s], positions) == 0, "begin: %s",
              duck_host_decoder_error(d));
        for (uint32_t l = 0; l < LAYERS; l++) {
            const int routed = duck_host_layer_step(d, l, l ? y : NULL);
            CHECK(routed == (l == 1), "layer %u: %s", l, duck_host_decoder_error(d));
            for (int i = 0; i < ntoks[s] * HIDDEN; i++)   /* a stand-in FFN: any function of ffn_in */
                y[i] = tanhf(ffn_in[i]) + (routed ? weights[0] * (float)ids[0] : 0.0f);
            if (routed)
                memcpy(ids_out, ids, sizeof ids);
        }
        int32_t top[3];
        float *out = logits + s * 3 * VOCAB;
        CHECK(duck_host_finish_argmax(d, y, NULL, (uint32_t)ntoks[s], out, top) == 0, "finish: %s",
              duck_host_decoder_error(d));
        for (int t = 0; t < ntoks[s]; t++) {   /* each row's argmax: its largest logit, the first of equal ones */
            int32_t want = 0;
            for (int v = 1; v < VOCAB; v++)
                want = out[t * VOCAB + v] > out[t * VOCAB + want] ? v : want;
            CHECK(top[t] == want, "%s: row %d's argmax %d, its largest logit is at %d", k->name, t, top[t], want);
        }
        pos += ntoks[s];
    }
    int64_t bad = LEN;
    CHECK(duck_host_begin(d, 1, steps[1], &bad) == -1 && strstr(duck_host_decoder_error(d), "beyond the KV cache"),
          "a position past the cache is refused");
    duck_host_decoder_destroy(d);
    for (int l = 0; l < LAYERS; l++)
        free(layers[l].k_cache), free(layers[l].v_cache);
}

/* got's logits within 1e-5 of want's largest, and the router's same choices */
static void check_close(const float *want, const float *got, size_t n, const int32_t *want_ids,
                        const int32_t *got_ids, const char *what)
{
    float worst = 0.0f, top = 0.0f;
    for (size_t i = 0; i < n; i++) {
        worst = fmaxf(worst, fabsf(want[i] - got[i]));
        top = fmaxf(top, fabsf(want[i]));
    }
    CHECK(worst <= 1e-5f * top, "%s vs ref: %g of %g", what, worst, top);
    CHECK(memcmp(want_ids, got_ids, sizeof(int32_t) * 3 * TOPK) == 0, "%s: the router chose other experts", what);
}

/* The projections and lm_head as halves (wtype F16) give what the fp32 decoder
 * gives on them widened: the same bits with the ref set, within 1e-5 with the
 * best set on three threads. */
static void test_decoder_half(const duck_host_model *src)
{
    duck_host_model wide = *src, half = *src;
    duck_host_layer wl[LAYERS], hl[LAYERS];
    memcpy(wl, src->layer, sizeof wl);
    memcpy(hl, src->layer, sizeof hl);
    void *owned[4 * LAYERS * 3 + 3];
    size_t n_owned = 0;
    for (int l = 0; l < LAYERS; l++) {
        const void **w[] = {&wl[l].wq, &wl[l].wk, &wl[l].wv, &wl[l].wo};
        const void **h[] = {&hl[l].wq, &hl[l].wk, &hl[l].wv, &hl[l].wo};
        const size_t sizes[] = {HEADS * HD * HIDDEN, KV * HD * HIDDEN, KV * HD * HIDDEN, HIDDEN * HEADS * HD};
        for (int i = 0; i < 4; i++) {
            uint16_t *hv = malloc(sizeof(uint16_t) * sizes[i]);
            float *fv = malloc(sizeof(float) * sizes[i]);
            for (size_t j = 0; j < sizes[i]; j++)
                hv[j] = to_half(((const float *)*w[i])[j]), fv[j] = duck_half_to_float(hv[j]);
            const uint32_t cols = i == 3 ? HEADS * HD : HIDDEN, rows = (uint32_t)(sizes[i] / cols);
            uint16_t *pv = packed_half(hv, cols, rows, cols);
            *h[i] = pv, *w[i] = fv;
            owned[n_owned++] = hv, owned[n_owned++] = fv, owned[n_owned++] = pv;
        }
    }
    uint16_t *lm_half = malloc(sizeof(uint16_t) * VOCAB * HIDDEN);
    float *lm_wide = malloc(sizeof(float) * VOCAB * HIDDEN);
    for (size_t j = 0; j < VOCAB * HIDDEN; j++)
        lm_half[j] = to_half(((const float *)src->lm_head)[j]), lm_wide[j] = duck_half_to_float(lm_half[j]);
    uint16_t *lm_packed = packed_half(lm_half, HIDDEN, VOCAB, HIDDEN);
    owned[n_owned++] = lm_half, owned[n_owned++] = lm_wide, owned[n_owned++] = lm_packed;
    wide.layer = wl, wide.lm_head = lm_wide;
    half.layer = hl, half.lm_head = lm_packed, half.wtype = DUCK_HOST_F16;
    static float want[3 * 3 * VOCAB], got[3 * 3 * VOCAB];
    int32_t want_ids[3 * TOPK], got_ids[3 * TOPK];
    decode(duck_host_kernels_ref(), NULL, &wide, want, want_ids);
    decode(duck_host_kernels_ref(), NULL, &half, got, got_ids);
    CHECK(memcmp(want, got, sizeof want) == 0, "ref decoder: half weights differ from them widened to fp32");
    duck_pool *pool = duck_pool_create(3, 0, 0);
    decode(duck_host_kernels_best(), pool, &half, got, got_ids);
    duck_pool_destroy(pool);
    check_close(want, got, sizeof want / sizeof *want, want_ids, got_ids, "half decoder, best set on 3 threads");
    half.wtype = 7;
    char err[256];
    float ffn_in[HIDDEN];
    int32_t ids[TOPK];
    float weights[TOPK];
    duck_host_io io = {ffn_in, ids, weights};
    CHECK(!duck_host_decoder_create(&half, &io, duck_host_kernels_ref(), NULL, err, sizeof err) &&
              strstr(err, "wtype"), "an unknown weight type is refused");
    for (size_t i = 0; i < n_owned; i++)
        free(owned[i]);
}

/* The cache with the heads outer gives the same bits as [max_len, kv_heads,
 * head_dim], fp32 or half; a half cache stays within 1e-2 of the fp32 one (its
 * keys and values rounded), and the best set on three threads within 2e-3 of
 * the ref set on it (a key a set computes a bit apart may round to the next
 * half); strides that overlap and unknown cache types are refused. */
static void test_decoder_caches(const duck_host_model *src)
{
    static float want[3 * 3 * VOCAB], got[3 * 3 * VOCAB], half[3 * 3 * VOCAB], ref_half[3 * 3 * VOCAB];
    int32_t want_ids[3 * TOPK], got_ids[3 * TOPK], half_ids[3 * TOPK];
    duck_host_model outer = *src, h = *src;
    outer.pos_stride = HD, outer.head_stride = LEN * HD;
    duck_pool *pool = duck_pool_create(3, 0, 0);
    for (int best = 0; best < 2; best++) {
        const duck_host_kernels *k = best ? duck_host_kernels_best() : duck_host_kernels_ref();
        duck_pool *p = best ? pool : NULL;
        outer.kv_type = DUCK_HOST_F32;
        decode(k, p, src, want, want_ids);
        decode(k, p, &outer, got, got_ids);
        CHECK(memcmp(want, got, sizeof want) == 0, "%s: heads outer differ from [max_len, kv_heads, head_dim]",
              k->name);
        h.kv_type = outer.kv_type = DUCK_HOST_F16;
        decode(k, p, &h, half, half_ids);
        decode(k, p, &outer, got, got_ids);
        CHECK(memcmp(half, got, sizeof half) == 0, "%s: a half cache with the heads outer differs", k->name);
        float worst = 0.0f, top = 0.0f;
        for (size_t i = 0; i < sizeof want / sizeof *want; i++)
            worst = fmaxf(worst, fabsf(want[i] - half[i])), top = fmaxf(top, fabsf(want[i]));
        CHECK(worst <= 1e-2f * top, "%s: the half cache's logits are %g off the fp32 cache's (of %g)", k->name,
              worst, top);
        if (!best) {
            memcpy(ref_half, half, sizeof half);
            continue;
        }
        /* the sets' keys and values differ in their last bits, which may round to neighbouring halves */
        worst = 0.0f;
        for (size_t i = 0; i < sizeof half / sizeof *half; i++)
            worst = fmaxf(worst, fabsf(ref_half[i] - half[i]));
        CHECK(worst <= 2e-3f * top, "half cache, best set vs ref: %g of %g", worst, top);
    }
    duck_pool_destroy(pool);
    char err[256];
    float ffn_in[HIDDEN];
    int32_t ids[TOPK];
    float weights[TOPK];
    duck_host_io io = {ffn_in, ids, weights};
    outer.head_stride = HD;
    CHECK(!duck_host_decoder_create(&outer, &io, duck_host_kernels_ref(), NULL, err, sizeof err) &&
              strstr(err, "strides"), "overlapping cache strides are refused");
    h.kv_type = 9;
    CHECK(!duck_host_decoder_create(&h, &io, duck_host_kernels_ref(), NULL, err, sizeof err) &&
              strstr(err, "kv_type"), "an unknown cache type is refused");
}

static void test_decoder(void)
{
    duck_host_layer layers[LAYERS];
    memset(layers, 0, sizeof layers);
    for (int l = 0; l < LAYERS; l++) {
        duck_host_layer *x = &layers[l];
        x->input_norm = random_floats(HIDDEN, 1.0f), x->post_norm = random_floats(HIDDEN, 1.0f);
        x->wq = random_floats(HEADS * HD * HIDDEN, 0), x->wk = random_floats(KV * HD * HIDDEN, 0);
        x->wv = random_floats(KV * HD * HIDDEN, 0), x->wo = random_floats(HIDDEN * HEADS * HD, 0);
        x->bq = random_floats(HEADS * HD, 0), x->bk = random_floats(KV * HD, 0);
        x->bv = random_floats(KV * HD, 0), x->bo = random_floats(HIDDEN, 0);
        x->q_norm = random_floats(HD, 1.0f), x->k_norm = random_floats(HD, 1.0f);
        x->router = l == 1 ? random_floats(EXPERTS * HIDDEN, 0) : NULL;
    }
    float inv_freq[HD / 2];
    for (int i = 0; i < HD / 2; i++)
        inv_freq[i] = powf(10000.0f, -2.0f * i / HD);
    float *embed = random_floats(VOCAB * HIDDEN, 0), *final_norm = random_floats(HIDDEN, 1.0f);
    duck_host_model m = {.hidden = HIDDEN, .heads = HEADS, .kv_heads = KV, .head_dim = HD, .layers = LAYERS,
                         .vocab = VOCAB, .max_len = LEN, .max_tokens = 3, .n_experts = EXPERTS, .topk = TOPK,
                         .norm_topk = 1, .eps = 1e-6f, .inv_freq = inv_freq, .embed = embed,
                         .final_norm = final_norm, .lm_head = embed, .layer = layers};
    static float want[3 * 3 * VOCAB], got[3 * 3 * VOCAB];
    int32_t want_ids[3 * TOPK], got_ids[3 * TOPK];
    decode(duck_host_kernels_ref(), NULL, &m, want, want_ids);
    duck_pool *pool = duck_pool_create(3, 0, 0);
    decode(duck_host_kernels_best(), pool, &m, got, got_ids);
    duck_pool_destroy(pool);
    check_close(want, got, sizeof want / sizeof *want, want_ids, got_ids, "decoder, best set on 3 threads");
    test_decoder_half(&m);
    test_decoder_caches(&m);
    m.heads = 3;
    char err[256];
    float ffn_in[HIDDEN];
    duck_host_io io = {ffn_in, NULL, NULL};
    CHECK(!duck_host_decoder_create(&m, &io, duck_host_kernels_ref(), NULL, err, sizeof err) &&
              strstr(err, "multiple of kv_heads"), "bad head counts refused");
    for (int l = 0; l < LAYERS; l++) {
        const void *w[] = {layers[l].input_norm, layers[l].post_norm, layers[l].wq, layers[l].wk,
                           layers[l].wv, layers[l].wo, layers[l].bq, layers[l].bk, layers[l].bv,
                           layers[l].bo, layers[l].q_norm, layers[l].k_norm, layers[l].router};
        for (size_t i = 0; i < sizeof w / sizeof *w; i++)
            free((void *)w[i]);
    }
    free(embed), free(final_norm);
}

int main(void)
{
    test_half_to_float();
    test_gemm_h(duck_host_kernels_ref());
    test_gemv_t_h(duck_host_kernels_ref());
    const duck_host_kernels *sets[] = {duck_host_kernels_avx2(), duck_host_kernels_avx512()};
    const duck_host_kernels *all[] = {duck_host_kernels_ref(), sets[0], sets[1]};
    test_float_to_half(all, 3);
    for (size_t i = 0; i < 2; i++) {
        if (sets[i]) {
            test_kernels(sets[i]);
            test_gemm_h(sets[i]);
            test_gemv_t_h(sets[i]);
        } else
            printf("skipped: this CPU lacks the %s host kernels' instructions\n", i ? "avx512" : "avx2");
    }
    test_decoder();
    printf("%d checks, %d failed\n", checks, failures);
    return failures;
}
