/* The native CPU decoder of the Llama family (Llama, Qwen3, Qwen3-MoE): the
 * host part of a decode step over the model's own fp32 weights and a KV cache
 * (engine.layers.KVCache: k, v [layers, max_len, kv_heads, head_dim], fp32 or
 * half, in that order or with the heads outer), read and written in place.
 * The FFNs stay outside: each layer step leaves the FFN's input (and for a
 * routed layer the router's choice) in the caller's buffers, and the next
 * step adds the FFN's output into the residual.
 *
 *   duck_host_begin(d, ntok, ids, positions)      embeddings, rotary tables (_slots: tokens of several
 *                                                  sequences, each in its slot of a batched cache)
 *   for layer: duck_host_layer_step(d, layer, y)   y: the previous layer's FFN output (NULL at layer 0)
 *              ... caller runs the FFN on io.ffn_in -> y
 *   duck_host_finish(d, y, logits)                 final norm + lm_head: logits [ntok, vocab] (_argmax:
 *                                                  and each row's argmax)
 */
#ifndef DUCK_HOST_DECODER_H
#define DUCK_HOST_DECODER_H

#include "host_ops.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DUCK_HOST_MAX_TOKENS 1024 /* tokens in one step: decode steps, verification steps, prefill chunks */
#define DUCK_HOST_MAX_TOPK 32     /* the wire's limit on experts per token */

/* One decoder layer's tensors, row-major [out, in] as torch nn.Linear keeps them. */
typedef struct duck_host_layer {
    const float *input_norm, *post_norm;       /* [hidden] */
    const void *wq, *wk, *wv, *wo;            /* [heads*D, hidden], [kv*D, hidden] x2, [hidden, heads*D]; model.wtype */
    const float *bq, *bk, *bv, *bo;           /* the biases, or NULL (attention_bias) */
    const float *q_norm, *k_norm;             /* [head_dim] per-head RMSNorm (Qwen3), or NULL */
    const float *router;                      /* [n_experts, hidden] softmax router, or NULL: a dense FFN */
    void *k_cache, *v_cache;                  /* this layer's cache (model.kv_type): slot s, position p, kv head
                                                 h at s * slot_stride + p * pos_stride + h * head_stride */
} duck_host_layer;

typedef struct duck_host_model {
    uint32_t hidden, heads, kv_heads, head_dim, layers, vocab;
    uint32_t max_len;                         /* the KV cache's positions (per slot) */
    uint32_t slots;                           /* sequences the cache holds (0 or 1: one) */
    uint64_t slot_stride;                     /* elements from one slot's cache to the next's */
    uint64_t pos_stride, head_stride;         /* elements between positions, between kv heads: kv_heads * head_dim
                                                 and head_dim ([max_len, kv_heads, head_dim], what 0 and 0 mean),
                                                 or head_dim and at least max_len * head_dim (heads outer: each
                                                 head's positions one run, which attention reads as one stream) */
    uint32_t kv_type;                         /* the cache's elements: DUCK_HOST_F32, or DUCK_HOST_F16 (IEEE halves,
                                                 rounded to nearest even as they are written: half the bytes
                                                 attention reads) */
    uint32_t max_tokens;                      /* most tokens per step, <= DUCK_HOST_MAX_TOKENS */
    uint32_t n_experts, topk;                 /* routed layers: experts, experts per token */
    int32_t norm_topk;                        /* norm_topk_prob */
    float eps;                                /* rms_norm_eps */
    const float *inv_freq;                    /* [head_dim / 2], engine.layers.rope_inv_freq */
    const float *embed;                       /* [vocab, hidden] */
    const float *final_norm;                  /* [hidden] */
    const void *lm_head;                      /* [vocab, hidden] (the embedding when tied); wtype */
    uint32_t wtype;                           /* the projections' and lm_head's: DUCK_HOST_F32 or DUCK_HOST_F16
                                                 (packed: duck_host_pack_half; head_dim a multiple of
                                                 DUCK_HOST_PANEL); everything else is fp32 */
    const duck_host_layer *layer;             /* [layers], copied by create */
} duck_host_model;

/* What the caller reads after a layer step (its FFN's inputs); it owns them. */
typedef struct duck_host_io {
    float *ffn_in;                            /* [max_tokens, hidden] */
    int32_t *expert_ids;                      /* [max_tokens, topk], routed layers only (NULL if none) */
    float *expert_weights;                    /* [max_tokens, topk] */
} duck_host_io;

typedef struct duck_host_decoder duck_host_decoder;

/* NULL with a message in err when the description is inconsistent. pool
 * NULL: everything on the calling thread. The pool must outlive the decoder. */
duck_host_decoder *duck_host_decoder_create(const duck_host_model *m, const duck_host_io *io,
                                            const duck_host_kernels *k, duck_pool *pool, char *err,
                                            uint32_t errlen);
void duck_host_decoder_destroy(duck_host_decoder *d);
/* The last failure's message (empty when none). */
const char *duck_host_decoder_error(const duck_host_decoder *d);

/* Each returns 0, or -1 with a message in duck_host_decoder_error. */
int duck_host_begin(duck_host_decoder *d, uint32_t ntok, const int64_t *ids, const int64_t *positions);
/* The same for tokens of several sequences: token t belongs to slot slots[t]
 * (NULL: all slot 0), is written at its position there and attends to that
 * slot's positions 0..its own. A batch of decode steps, prefill chunks, or both. */
int duck_host_begin_slots(duck_host_decoder *d, uint32_t ntok, const int64_t *ids, const int64_t *positions,
                          const uint32_t *slots);
/* Attention part of layer `layer` (steps go 0, 1, ... in order); ffn_out is
 * the previous layer's FFN output [ntok, hidden] (NULL at layer 0). Returns 1
 * when the layer is routed (io's expert ids / weights filled), 0 when dense. */
int duck_host_layer_step(duck_host_decoder *d, uint32_t layer, const float *ffn_out);
/* After the last layer: final norm and lm_head into logits [ntok, vocab]. */
int duck_host_finish(duck_host_decoder *d, const float *ffn_out, float *logits);
/* The same for some tokens only: rows [nrows], increasing token indices of the
 * step (NULL: the first nrows); logits [nrows, vocab]. A batch needs the logits
 * of each sequence's last token, a prefill chunk of its last one or none. */
int duck_host_finish_rows(duck_host_decoder *d, const float *ffn_out, const uint32_t *rows, uint32_t nrows,
                          float *logits);
/* The same, and each row's argmax (its largest logit's index, the first of equal ones:
 * torch.argmax's) into argmax [nrows]: a greedy token without reading the logits again. */
int duck_host_finish_argmax(duck_host_decoder *d, const float *ffn_out, const uint32_t *rows, uint32_t nrows,
                            float *logits, int32_t *argmax);

#ifdef __cplusplus
}
#endif
#endif
