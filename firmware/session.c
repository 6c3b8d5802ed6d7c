/* A persistent session: the layer plans of a model stay resident (expert
 * tables pointing into the cache) between forwards, so a forward is a
 * table lookup and one duck_moe_forward on the parked worker pool. */
#include "duckfw.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void layer_free(duck_layer *l)
{
    if (!l)
        return;
    for (uint32_t i = 0; i < 2 * l->n_experts; i++)
        if (l->refs[i])
            l->refs[i]->refs--;
    free(l->refs);
    free(l->experts);
    free(l);
}

void session_close(duck_session *s)
{
    for (uint32_t i = 0; i < WIRE_MAX_LAYERS; i++) {
        layer_free(s->layers[i]);
        s->layers[i] = NULL;
    }
    s->id = 0;
    s->hidden = 0;
    s->n_layers = 0;
}

static void hex16(const uint8_t *d, char *out)
{
    for (int i = 0; i < WIRE_DIGEST_BYTES; i++)
        sprintf(out + 2 * i, "%02x", d[i]);
}

int session_set_layer(duck_session *s, duck_cache *c, const wire_layer_plan *p,
                      const uint8_t *digests, char *err, size_t errlen)
{
    if (p->layer >= WIRE_MAX_LAYERS || p->n_experts > WIRE_MAX_EXPERTS || p->hidden != s->hidden) {
        snprintf(err, errlen, "layer plan %u: layer < %u, experts <= %u and hidden == %u (session) required; "
                 "got %u experts, hidden %u", p->layer, WIRE_MAX_LAYERS, WIRE_MAX_EXPERTS, s->hidden,
                 p->n_experts, p->hidden);
        return WIRE_E_RANGE;
    }
    duck_layer *l = calloc(1, sizeof *l);
    if (!l || !(l->experts = calloc(p->n_experts + 1, sizeof *l->experts)) ||
        !(l->refs = calloc(2 * (size_t)p->n_experts + 1, sizeof *l->refs))) {
        layer_free(l);
        snprintf(err, errlen, "layer plan %u: out of memory", p->layer);
        return WIRE_E_NOMEM;
    }
    l->hidden = p->hidden;
    for (uint32_t e = 0; e < p->n_experts; e++) {
        for (int k = 0; k < 2; k++) {
            const uint8_t *d = digests + (2 * (size_t)e + (size_t)k) * WIRE_DIGEST_BYTES;
            cache_entry *ce = cache_find(c, d);
            if (!ce) {
                char name[2 * WIRE_DIGEST_BYTES + 1];
                hex16(d, name);
                snprintf(err, errlen, "layer %u expert %u: %s %s is not in the cache; upload it first",
                         p->layer, e, k ? "down" : "gate_up", name);
                layer_free(l);
                return WIRE_E_UNKNOWN_DIGEST;
            }
            ce->refs++;
            l->refs[2 * e + k] = ce;
            l->n_experts = e + 1;   /* layer_free releases what was taken */
        }
        l->experts[e].gate_up = l->refs[2 * e]->m;
        l->experts[e].down = l->refs[2 * e + 1]->m;
        if (duck_expert_slice_check(&l->experts[e], p->hidden) != DUCK_FFN_OK) {
            snprintf(err, errlen, "layer %u expert %u: gate_up %ux%u and down %ux%u do not form a slice of "
                     "hidden %u", p->layer, e, l->experts[e].gate_up.rows, l->experts[e].gate_up.cols,
                     l->experts[e].down.rows, l->experts[e].down.cols, p->hidden);
            layer_free(l);
            return WIRE_E_BAD_TENSOR;
        }
    }
    l->n_experts = p->n_experts;
    if (s->layers[p->layer])
        layer_free(s->layers[p->layer]);
    else
        s->n_layers++;
    s->layers[p->layer] = l;
    return WIRE_OK;
}
