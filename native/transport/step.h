/* A whole decode step driven from C: the GPU part of each layer is a CUDA graph
 * (engine.gpu.graphs captures them; the graph ends by copying x, ids and
 * weights into pinned host buffers and the next one begins by copying y back),
 * the FFN between two graphs is one duck_transport_forward on those buffers.
 *
 *     for each segment i: launch graph i; wait for it (spinning on the stream);
 *                         forward layer[i] (x, ids, weights -> y, pinned)
 *
 * One C call per step instead of a Python round per layer: no interpreter, no
 * event objects, the launch of graph i+1 right after the last partial is summed.
 * The CUDA driver (libcuda.so.1) is opened at the first call, so the extension
 * builds and loads on machines without it; there duck_step_run answers
 * DUCK_STEP_ENOCUDA. */
#ifndef DUCK_STEP_H
#define DUCK_STEP_H

#include <stdint.h>

#include "transport.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DUCK_STEP_ENOCUDA -20     /* no CUDA driver here (message says why) */
#define DUCK_STEP_ECUDA -21       /* a CUDA call failed (message names it and its code) */

typedef struct duck_step {
    uint64_t stream;              /* CUstream the graphs launch on */
    uint32_t n_segments;          /* graphs; the FFN calls are n_segments - 1 */
    const uint64_t *graphs;       /* [n_segments] CUgraphExec */
    const uint32_t *layers;       /* [n_segments - 1] the layer of each FFN call */
    const uint32_t *topks;        /* [n_segments - 1] its experts per token (a dense layer's call has 1) */
    duck_forward_args args;       /* x, ids, weights, y (pinned), ntok, dtypes, session; layer and topk set per call */
    uint32_t spin_yield;          /* 1: sched_yield between stream polls (a shared host); 0: busy-poll */
    /* out, each NULL or one entry per segment / call */
    int32_t *ids_log;             /* [calls][ntok * max topk] every call's expert ids, as sent (benchmarks) */
    uint32_t ids_log_stride;      /* its row length */
    uint64_t *gpu_ns;             /* [n_segments] launch to the graph seen done */
    uint64_t *ffn_ns;             /* [calls] the forward's wall time */
    uint32_t *kernel_us;          /* [calls] the slowest duck's kernel time */
} duck_step;

typedef struct duck_step_result {
    int32_t failed_call;          /* -1, or the FFN call (index) that failed */
    int32_t cuda_error;           /* the CUresult of a failed CUDA call (DUCK_STEP_ECUDA) */
    uint64_t kernel_us_sum;       /* over the calls: the slowest duck's kernel time */
    uint64_t bytes_streamed;
    uint32_t retransmits;
    uint32_t wake_ns_max;
    uint32_t mtu_fallbacks;
    uint32_t lost_new;            /* over the calls: ducks found lost (their slices went elsewhere) */
    uint64_t host_ns;             /* over the calls: this host computing lost ducks' slices */
    uint32_t host_slices;
    uint32_t reserved;
    duck_forward_result call;     /* the failed call's result (its message), else the last call's */
    char message[WIRE_MAX_ERROR_TEXT + 64];
} duck_step_result;

/* 0 when the CUDA driver can be used here, else DUCK_STEP_ENOCUDA with why in err. */
int duck_step_cuda_available(char *err, uint32_t errlen);

/* A step's account of its forward res->call that returned rc (call: its
 * index): its counters added to res; a failure recorded (failed_call, message)
 * and rc returned. Shared with the CPU host's step (host_step.h). */
int duck_step_add_call(duck_step_result *res, int rc, uint32_t call);

/* Runs one step (see above). DUCK_T_OK, a DUCK_T_* of the failing forward
 * (res->failed_call, res->call), or DUCK_STEP_E*. After a failure the stream
 * is left idle (a launched graph is waited for). */
int duck_step_run(duck_transport *t, const duck_step *s, duck_step_result *res);

#ifdef __cplusplus
}
#endif
#endif
