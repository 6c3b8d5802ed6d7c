/* A step of the CPU host decoder (native/host/host_decoder.h) with its FFNs on
 * the fleet, driven from C: per layer the decoder's attention part, then the
 * layer's FFN as one duck_transport_forward on the decoder's own buffers
 * (ffn_in, its expert ids and weights -> ffn_out, all in the wire's types).
 *
 *     duck_host_begin_slots(d, ...)              (the caller: the step's tokens)
 *     duck_host_step_run(t, s, res)              for each layer: duck_host_layer_step; forward
 *     duck_host_finish_rows(d, s->args.y, ...)   (the caller: logits)
 *
 * One C call for every layer of a step instead of two per layer from Python:
 * the thread that runs a step takes no interpreter lock between them, so a
 * daemon's other threads (its event loop, streaming tokens to many clients)
 * cannot hold a step up at every layer. The step.h result reports it. */
#ifndef DUCK_HOST_STEP_H
#define DUCK_HOST_STEP_H

#include <stdint.h>

#include "host_decoder.h"
#include "step.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DUCK_STEP_EHOST -22       /* the host decoder refused a layer step (message says why) */

typedef struct duck_host_step {
    duck_host_decoder *decoder;   /* begun for this step's tokens */
    uint32_t n_layers;            /* the decoder's layers, all run */
    duck_forward_args args;       /* session, hidden, ntok; x the decoder's ffn_in (fp32), y the FFN output
                                     [ntok][hidden] (fp32: the next layer step reads it); request_tokens,
                                     pipeline, group_tokens; layer, topk, expert ids and weights set per call */
    uint32_t routed_topk;         /* a routed layer's experts per token */
    const int32_t *routed_ids;    /* the decoder's io: [ntok][routed_topk], filled by a routed layer's step */
    const float *routed_weights;
    const int32_t *dense_ids;     /* [ntok] all 0: a dense layer's one expert */
    const float *dense_weights;   /* [ntok] all 1 */
    /* out, each NULL or one entry per layer */
    uint64_t *ffn_ns;             /* the forward's wall time */
    uint32_t *kernel_us;          /* its slowest duck's kernel time */
} duck_host_step;

/* Runs every layer (see above). DUCK_T_OK; DUCK_STEP_EHOST with the decoder's
 * message (res->failed_call: the layer); a DUCK_T_* of the failing forward
 * (res->failed_call its layer, res->call its result); DUCK_T_EARG for a bad step. */
int duck_host_step_run(duck_transport *t, const duck_host_step *s, duck_step_result *res);

#ifdef __cplusplus
}
#endif
#endif
