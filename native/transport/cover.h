/* The host's cover for lost ducks: each slice's expert tables per layer (the
 * same fp9 packs the host uploads to the ducks) and the same kernel the
 * ducks run (duck_moe_forward), so a slice computed here is the same bits
 * as its duck's. The transport calls duck_cover_forward through its
 * duck_cover_config (transport_lost.c) for every slice routed to the host. */
#ifndef DUCK_COVER_H
#define DUCK_COVER_H

#include <stdint.h>

#include "ffn.h"
#include "transport.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct duck_cover duck_cover;

/* pool: NULL for the calling thread alone; kernels: the set the ducks run. */
duck_cover *duck_cover_create(uint32_t n_slices, duck_pool *pool, const duck_kernels *kernels);
void duck_cover_destroy(duck_cover *c);
/* Slice `slice` of layer `layer`: n_experts entries, kept by the caller for the cover's life.
 * 0, or -1 (a slice or layer out of range, out of memory). */
int duck_cover_set_layer(duck_cover *c, uint32_t slice, uint32_t layer, const duck_expert_slice *experts,
                         uint32_t n_experts);
/* A duck_cover_fn: the reply the slice's duck would send (a complete forward reply; WIRE_R_ZERO
 * when no token of the request is routed to any expert, as the duck does). 0 on failure. */
uint32_t duck_cover_forward(void *ctx, uint32_t slice, const duck_forward_args *a, uint32_t t0, uint32_t ntok,
                            void *reply, uint32_t cap);
/* Sets cfg->forward and cfg->ctx to this cover. */
void duck_cover_attach(duck_cover *c, duck_cover_config *cfg);

#ifdef __cplusplus
}
#endif
#endif
