/* The host's cover for lost ducks (cover.h): one duck_moe_forward per slice
 * and request, the firmware's forward handler (firmware/forward.c
 * forward_request) without the wire around it. */
#include "cover.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct cover_layer {
    const duck_expert_slice *experts;
    uint32_t n_experts;
} cover_layer;

struct duck_cover {
    uint32_t n_slices;
    duck_pool *pool;
    const duck_kernels *kernels;
    duck_ffn_workspace *ws;
    cover_layer **layers;         /* [slice][layer] */
    uint32_t *n_layers;           /* [slice]: entries of layers[slice] */
};

duck_cover *duck_cover_create(uint32_t n_slices, duck_pool *pool, const duck_kernels *kernels)
{
    if (!n_slices || !kernels)
        return NULL;
    duck_cover *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->n_slices = n_slices;
    c->pool = pool;
    c->kernels = kernels;
    c->ws = duck_ffn_workspace_create();
    c->layers = calloc(n_slices, sizeof *c->layers);
    c->n_layers = calloc(n_slices, sizeof *c->n_layers);
    if (!c->ws || !c->layers || !c->n_layers) {
        duck_cover_destroy(c);
        return NULL;
    }
    return c;
}

void duck_cover_destroy(duck_cover *c)
{
    if (!c)
        return;
    for (uint32_t s = 0; c->layers && s < c->n_slices; s++)
        free(c->layers[s]);
    free(c->layers);
    free(c->n_layers);
    if (c->ws)
        duck_ffn_workspace_destroy(c->ws);
    free(c);
}

int duck_cover_set_layer(duck_cover *c, uint32_t slice, uint32_t layer, const duck_expert_slice *experts,
                         uint32_t n_experts)
{
    if (slice >= c->n_slices || layer >= WIRE_MAX_LAYERS || (n_experts && !experts) || n_experts > WIRE_MAX_EXPERTS)
        return -1;
    if (layer >= c->n_layers[slice]) {
        uint32_t n = layer + 1;
        cover_layer *l = realloc(c->layers[slice], n * sizeof *l);
        if (!l)
            return -1;
        memset(l + c->n_layers[slice], 0, (n - c->n_layers[slice]) * sizeof *l);
        c->layers[slice] = l;
        c->n_layers[slice] = n;
    }
    c->layers[slice][layer] = (cover_layer){experts, n_experts};
    return 0;
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint32_t duck_cover_forward(void *ctx, uint32_t slice, const duck_forward_args *a, uint32_t t0, uint32_t ntok,
                            void *reply, uint32_t cap)
{
    duck_cover *c = ctx;
    const uint32_t head_bytes = sizeof(wire_reply_head) + sizeof(wire_forward_reply);
    uint64_t y_bytes = (uint64_t)ntok * a->hidden * wire_dtype_bytes(a->y_dtype);
    if (slice >= c->n_slices || a->layer >= c->n_layers[slice] || !c->layers[slice][a->layer].experts ||
        cap < head_bytes + y_bytes || ntok > WIRE_MAX_TOKENS)
        return 0;
    const cover_layer *l = &c->layers[slice][a->layer];
    const int32_t *ids = a->expert_ids + (size_t)t0 * a->topk;
    int any = 0;
    for (size_t i = 0; i < (size_t)ntok * a->topk; i++) {
        if (ids[i] >= 0 && (uint32_t)ids[i] >= l->n_experts)
            return 0;
        any |= ids[i] >= 0;
    }
    wire_reply_head head = {WIRE_OK, 0};
    wire_forward_reply fr;
    memset(&fr, 0, sizeof fr);
    fr.layer = a->layer;
    fr.ntok = (uint16_t)ntok;
    fr.y_dtype = (uint8_t)a->y_dtype;
    fr.hidden = a->hidden;
    uint8_t *out = reply;
    if (!any || ntok == 0) {
        head.flags = WIRE_R_ZERO;   /* as the duck answers: nothing routed to this slice */
        y_bytes = 0;
    } else {
        size_t xrow = (size_t)a->hidden * wire_dtype_bytes(a->x_dtype);
        duck_moe_args m = {0};
        m.experts = l->experts;
        m.n_experts = l->n_experts;
        m.ntok = ntok;
        m.topk = a->topk;
        m.hidden = a->hidden;
        m.expert_ids = ids;
        m.expert_weights = a->expert_weights + (size_t)t0 * a->topk;
        m.x = (const uint8_t *)a->x + (size_t)t0 * xrow;
        m.x_dtype = a->x_dtype;
        m.y_dtype = a->y_dtype;
        m.y = out + head_bytes;
        uint64_t start = now_ns(), bytes = 0;
        if (duck_moe_forward(c->pool, c->kernels, c->ws, &m, &bytes) != DUCK_FFN_OK)
            return 0;
        fr.kernel_us = (uint32_t)((now_ns() - start) / 1000u);
        fr.bytes_streamed = bytes;
    }
    memcpy(out, &head, sizeof head);
    memcpy(out + sizeof head, &fr, sizeof fr);
    return head_bytes + (uint32_t)y_bytes;
}

void duck_cover_attach(duck_cover *c, duck_cover_config *cfg)
{
    cfg->forward = duck_cover_forward;
    cfg->ctx = c;
}
