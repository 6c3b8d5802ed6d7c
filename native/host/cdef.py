"""cffi declarations of native/host/ (the native CPU decoder's kernels, ops and
decoder), imported by native/build_ffi.py. Struct layouts end in `...;` so
cffi checks them against the C headers."""

INCLUDES = '#include "host_decoder.h"\n'

CDEF = """
#define DUCK_HOST_MAX_TOKENS ...
#define DUCK_HOST_MAX_TOPK ...

typedef void (*duck_host_gemm_fn)(const float *w, size_t ldw, uint32_t rows, uint32_t k,
                                  uint32_t ntok, const float *x, size_t ldx, float *y, size_t ldy);
typedef float (*duck_host_dot_fn)(const float *a, const float *b, uint32_t n);
typedef void (*duck_host_gemv_t_fn)(const float *p, const float *v, size_t ldv, uint32_t rows, uint32_t n,
                                    float *y);
typedef void (*duck_host_gemm_h_fn)(const uint16_t *w, size_t ldw, uint32_t rows, uint32_t k,
                                    uint32_t ntok, const float *x, size_t ldx, float *y, size_t ldy);
typedef float (*duck_host_softmax_exp_fn)(float *s, uint32_t n, float scale);
typedef void (*duck_host_gemv_t_h_fn)(const float *p, const uint16_t *v, size_t ldv, uint32_t rows, uint32_t n,
                                      float *y);
typedef void (*duck_host_to_half_fn)(const float *x, uint32_t n, uint16_t *out);
typedef void (*duck_host_to_float_fn)(const uint16_t *h, uint32_t n, float *out);
typedef uint32_t (*duck_host_argmax_fn)(const float *x, uint32_t n);
typedef struct duck_host_kernels {
    const char *name; duck_host_gemm_fn gemm; duck_host_dot_fn dot; duck_host_gemv_t_fn gemv_t;
    duck_host_gemm_h_fn gemm_h; duck_host_softmax_exp_fn softmax_exp; duck_host_gemv_t_h_fn gemv_t_h;
    duck_host_to_half_fn to_half; duck_host_to_float_fn to_float; duck_host_argmax_fn argmax; ...;
} duck_host_kernels;
float duck_half_to_float(uint16_t h);
uint16_t duck_float_to_half(float f);
size_t duck_host_packed_halves(uint32_t rows, uint32_t k);
void duck_host_pack_half(const uint16_t *w, size_t ldw, uint32_t rows, uint32_t k, uint16_t *out);
const duck_host_kernels *duck_host_kernels_ref(void);
const duck_host_kernels *duck_host_kernels_avx2(void);
const duck_host_kernels *duck_host_kernels_avx512(void);
const duck_host_kernels *duck_host_kernels_best(void);

void duck_host_rmsnorm(const duck_host_kernels *k, const float *x, const float *w, uint32_t n, float eps, float *y);
void duck_host_add_rmsnorm(const duck_host_kernels *k, float *x, const float *add, const float *w, uint32_t n,
                           float eps, float *y);
void duck_host_rope_table(int64_t position, const float *inv_freq, uint32_t half, float *cos_out, float *sin_out);
void duck_host_rope(const duck_host_kernels *k, float *x, uint32_t heads, uint32_t head_dim, const float *cos,
                    const float *sin, const float *norm_w, float eps);
#define DUCK_HOST_ATTN_ROWS ...
void duck_host_attend(const duck_host_kernels *k, uint32_t kv_type, const float *q, uint32_t nq, const void *keys,
                      const void *values, size_t ld, uint32_t n_ctx, uint32_t head_dim, float scale, float *scores,
                      float *widen, float *out);
void duck_host_topk_softmax(const float *logits, uint32_t n, uint32_t topk, int normalize, int32_t *ids,
                            float *weights);
#define DUCK_HOST_F32 ...
#define DUCK_HOST_F16 ...
#define DUCK_HOST_PANEL ...
void duck_host_gemm(duck_pool *pool, const duck_host_kernels *k, uint32_t wtype, const void *w, uint32_t rows,
                    uint32_t kdim, uint32_t ntok, const float *x, float *y);

typedef struct duck_host_layer {
    const float *input_norm, *post_norm;
    const void *wq, *wk, *wv, *wo;
    const float *bq, *bk, *bv, *bo;
    const float *q_norm, *k_norm;
    const float *router;
    void *k_cache, *v_cache;
    ...;
} duck_host_layer;
typedef struct duck_host_model {
    uint32_t hidden, heads, kv_heads, head_dim, layers, vocab, max_len, slots, max_tokens, n_experts, topk;
    uint64_t slot_stride, pos_stride, head_stride; uint32_t kv_type; int32_t norm_topk; float eps;
    const float *inv_freq; const float *embed; const float *final_norm; const void *lm_head; uint32_t wtype;
    const duck_host_layer *layer;
    ...;
} duck_host_model;
typedef struct duck_host_io { float *ffn_in; int32_t *expert_ids; float *expert_weights; ...; } duck_host_io;
typedef struct duck_host_decoder duck_host_decoder;
duck_host_decoder *duck_host_decoder_create(const duck_host_model *m, const duck_host_io *io,
                                            const duck_host_kernels *k, duck_pool *pool, char *err,
                                            uint32_t errlen);
void duck_host_decoder_destroy(duck_host_decoder *d);
const char *duck_host_decoder_error(const duck_host_decoder *d);
int duck_host_begin(duck_host_decoder *d, uint32_t ntok, const int64_t *ids, const int64_t *positions);
int duck_host_begin_slots(duck_host_decoder *d, uint32_t ntok, const int64_t *ids, const int64_t *positions,
                          const uint32_t *slots);
int duck_host_layer_step(duck_host_decoder *d, uint32_t layer, const float *ffn_out);
int duck_host_finish(duck_host_decoder *d, const float *ffn_out, float *logits);
int duck_host_finish_rows(duck_host_decoder *d, const float *ffn_out, const uint32_t *rows, uint32_t nrows,
                          float *logits);
int duck_host_finish_argmax(duck_host_decoder *d, const float *ffn_out, const uint32_t *rows, uint32_t nrows,
                            float *logits, int32_t *argmax);
"""
