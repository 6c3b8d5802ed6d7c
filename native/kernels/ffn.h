/* One duck's share of an FFN: a tensor-parallel slice of S intermediate
 * units of every expert (a dense MLP is one expert of weight 1).
 *   y[t] = sum_e w[t,e] * down_e( silu(gate_e x[t]) * up_e x[t] )
 * One shared pool run (duck_pool_run_shared): the work is cut into pieces,
 * gate/up row pairs of one expert, then down row pairs of one expert (each
 * a long run of one expert's weights), a few per thread, claimed in that
 * order as threads come. A down piece waits only for its own expert's
 * gate/up pieces (a latch per expert, normally long done); the thread that
 * finishes the last expert of a block of rows sums the experts' partial
 * outputs there in expert order. How the rows are cut never changes how a
 * row is computed, so the result does not depend on the thread count. */
#ifndef DUCK_FFN_H
#define DUCK_FFN_H

#include "kernels.h"
#include "pool.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DUCK_MAX_TOPK 32

/* Pieces of work a thread claims: a few per thread and phase, so that the
 * threads end a phase together (one that wakes late, or shares its core,
 * takes fewer); not smaller than this many bytes of weights, which stream
 * well and make the claim's atomic add free. */
#define DUCK_FFN_PIECES_PER_THREAD 3
#define DUCK_FFN_MIN_PIECE_BYTES (32u << 10)

/* Activation and output types (the wire's WIRE_X_F32 / WIRE_X_BF16 have
 * the same values). */
#define DUCK_DT_F32 0
#define DUCK_DT_BF16 1

typedef struct duck_expert_slice {
    fp9_matrix gate_up;   /* [2S, H]: rows gate_0, up_0, gate_1, up_1, ... */
    fp9_matrix down;      /* [H, S]: the slice's columns of down_proj */
} duck_expert_slice;

typedef struct duck_moe_args {
    const duck_expert_slice *experts;
    uint32_t n_experts;
    uint32_t ntok;                  /* 0 .. DUCK_MAX_TOKENS */
    uint32_t topk;                  /* slots per token, 0 .. DUCK_MAX_TOPK */
    uint32_t hidden;
    const int32_t *expert_ids;      /* [ntok][topk]; a negative id skips the slot */
    const float *expert_weights;    /* [ntok][topk] */
    const void *x;                  /* [ntok][hidden], in x_dtype */
    uint32_t x_dtype;               /* DUCK_DT_F32 or DUCK_DT_BF16; on bf16 the experts' intermediate
                                       silu(gate) * up is rounded to bf16 too (a bf16 model's own
                                       precision), and the routing weight scales each expert's output */
    uint32_t y_dtype;               /* DUCK_DT_F32 or DUCK_DT_BF16 */
    void *y;                        /* [ntok][hidden] in y_dtype, overwritten; summed in fp32,
                                       rounded to bf16 (nearest even) once at the end */
} duck_moe_args;

#define DUCK_FFN_OK 0
#define DUCK_FFN_EINVAL -1    /* counts out of range, NULL pointers, or an unknown dtype */
#define DUCK_FFN_EEXPERT -2   /* expert id >= n_experts */
#define DUCK_FFN_ESHAPE -3    /* an expert's shapes do not fit hidden/each other */
#define DUCK_FFN_ENOMEM -4

typedef struct duck_ffn_workspace duck_ffn_workspace;
duck_ffn_workspace *duck_ffn_workspace_create(void);
void duck_ffn_workspace_destroy(duck_ffn_workspace *ws);

/* Returns DUCK_FFN_OK or a negative error; on success *bytes_streamed (if
 * non-NULL) receives the fp9 bytes read. pool may be NULL (one thread). */
int duck_moe_forward(duck_pool *pool, const duck_kernels *k, duck_ffn_workspace *ws,
                     const duck_moe_args *a, uint64_t *bytes_streamed);

/* y[t] = W x[t] for t < ntok (<= DUCK_MAX_TOKENS): a plain matmul split by
 * row pairs over the pool; x fp32 [ntok][cols], y [ntok][rows]. */
int duck_fp9_matmul(duck_pool *pool, const duck_kernels *k, duck_ffn_workspace *ws,
                    const fp9_matrix *m, uint32_t ntok, const float *x, float *y);

/* out[p] = silu(gu[2p]) * gu[2p + 1] (rounded to bf16 where bf16), times scale,
 * for p in [pb, pe): the expert FFN's intermediate from its gate/up rows
 * (act.c). _ref is the scalar reference; the other its AVX2 form where the CPU
 * has it, the same bits. */
void duck_ffn_act(const float *gu, uint32_t pb, uint32_t pe, float scale, int bf16, float *out);
void duck_ffn_act_ref(const float *gu, uint32_t pb, uint32_t pe, float scale, int bf16, float *out);

/* Bench only: where duck_moe_forward's time goes, summed over its threads
 * (nanoseconds of thread time per phase) while on. duck_ffn_profile(1, NULL)
 * zeroes and starts it, (0, ns) stops it and gives ns[DUCK_FFN_PHASES]. */
#define DUCK_FFN_PHASES 7   /* setup (one thread), gate_up GEMM, SiLU, down wait, down GEMM, reduce, the pool run (wall) */
void duck_ffn_profile(int on, uint64_t *ns);

/* Checks one expert slice against the hidden size (also used on upload). */
int duck_expert_slice_check(const duck_expert_slice *e, uint32_t hidden);

#ifdef __cplusplus
}
#endif
#endif
