/* The CPU host decoder's step with its FFNs on the fleet: host_step.h says what and why. */
#define _GNU_SOURCE   /* transport_impl.h: struct mmsghdr */
#include "host_step.h"

#include <stdio.h>
#include <string.h>

#include "transport_impl.h"   /* tr_now_ns */

int duck_host_step_run(duck_transport *t, const duck_host_step *s, duck_step_result *res)
{
    memset(res, 0, sizeof *res);
    res->failed_call = -1;
    if (!t || !s || !s->decoder || !s->n_layers || !s->args.x || !s->args.y || !s->dense_ids || !s->dense_weights ||
        (s->routed_topk && (!s->routed_ids || !s->routed_weights))) {
        snprintf(res->message, sizeof res->message, "bad host step: %u layers, decoder %p, x %p, y %p",
                 s ? s->n_layers : 0, s ? (void *)s->decoder : NULL, s ? s->args.x : NULL, s ? s->args.y : NULL);
        return DUCK_T_EARG;
    }
    if (s->args.x_dtype != DUCK_DT_F32 || s->args.y_dtype != DUCK_DT_F32) {
        snprintf(res->message, sizeof res->message, "bad host step: the decoder's FFN buffers are fp32");
        return DUCK_T_EARG;
    }
    duck_forward_args a = s->args;
    for (uint32_t layer = 0; layer < s->n_layers; layer++) {
        const int routed = duck_host_layer_step(s->decoder, layer, layer ? (const float *)a.y : NULL);
        const uint64_t t1 = tr_now_ns();
        if (routed < 0 || (routed && !s->routed_topk)) {
            res->failed_call = (int32_t)layer;
            snprintf(res->message, sizeof res->message, "%s", routed < 0 ? duck_host_decoder_error(s->decoder)
                     : "a routed layer in a step given no routed top-k");
            return DUCK_STEP_EHOST;
        }
        a.layer = layer;
        a.topk = routed ? s->routed_topk : 1;
        a.expert_ids = routed ? s->routed_ids : s->dense_ids;
        a.expert_weights = routed ? s->routed_weights : s->dense_weights;
        const int frc = duck_transport_forward(t, &a, &res->call);
        const uint64_t t2 = tr_now_ns();
        if (duck_step_add_call(res, frc, layer) != DUCK_T_OK)
            return frc;
        if (s->ffn_ns)
            s->ffn_ns[layer] = t2 - t1;
        if (s->kernel_us)
            s->kernel_us[layer] = res->call.kernel_us_max;
    }
    return DUCK_T_OK;
}
