/* The cut of a forward: tokens per request, requests in flight
 * (transport_forward.c sends and sums them). */
#define _GNU_SOURCE   /* struct mmsghdr in transport_impl.h */
#include "transport_impl.h"

/* The most tokens per request: the ducks' limit, then every duck's message
 * bound at its datagram size and at the fallback size (both ways), then the receive buffer, which must
 * hold every duck's reply twice over (the kernel's bookkeeping); then the
 * requests in flight that the buffer holds at that size. Requests are made
 * even: 100 tokens at 64 go as 50 + 50. Then the requests per kernel pass:
 * as many as group_tokens holds, all in flight together. */
void duck_transport_plan(const duck_transport *t, const duck_forward_args *a, duck_forward_result *res)
{
    uint32_t nd = t->cfg.n_ducks, n = a->request_tokens ? a->request_tokens : WIRE_TOKENS_DEFAULT;
    n = n < WIRE_MAX_TOKENS ? n : WIRE_MAX_TOKENS;
    /* a message must also fit the fragments of the fallback datagram size (a NACK names them all) */
    uint32_t limit = wire_max_message(tr_small_mtu(t));
    for (uint32_t d = 0; d < nd; d++) {
        uint32_t own = wire_max_message(t->link[d].mtu);
        limit = own < limit ? own : limit;
    }
    if (n > 1 && (tr_request_bytes(a, n) > limit || tr_reply_bytes(a, n) > limit)) {
        uint64_t per = (uint64_t)a->hidden * (wire_dtype_bytes(a->x_dtype) > wire_dtype_bytes(a->y_dtype)
                                              ? wire_dtype_bytes(a->x_dtype) : wire_dtype_bytes(a->y_dtype)) + 8u * a->topk;
        uint64_t fit = (limit - sizeof(wire_forward) - TR_REPLY_HEAD) / per;
        n = fit < n ? (fit > 1 ? (uint32_t)fit : 1) : n;
        while (n > 1 && (tr_request_bytes(a, n) > limit || tr_reply_bytes(a, n) > limit))
            n--;
    }
    uint64_t room = t->rcvbuf / 2, per_token = (uint64_t)nd * a->hidden * wire_dtype_bytes(a->y_dtype);
    if (n > 1 && nd * tr_reply_bytes(a, n) > room) {
        uint64_t fit = (room > nd * TR_REPLY_HEAD ? room - nd * TR_REPLY_HEAD : 0) / per_token;
        n = fit > 1 ? (uint32_t)fit : 1;
    }
    res->rcvbuf_short = nd * tr_reply_bytes(a, n) > room;
    uint32_t nreq = (a->ntok + n - 1) / n;
    n = (a->ntok + nreq - 1) / nreq;
    uint32_t w = a->pipeline ? a->pipeline : DUCK_PIPELINE_DEFAULT;
    w = w > DUCK_PIPELINE_MAX ? DUCK_PIPELINE_MAX : w;
    w = w > nreq ? nreq : w;
    while (w > 1 && w * nd * tr_reply_bytes(a, n) > room)
        w--;
    /* groups of requests run in one pass on the ducks: all of a group in flight at once */
    uint32_t g = a->group_tokens && nreq > 1 ? a->group_tokens / n : 1;
    g = g > w ? w : g;
    g = g > WIRE_HOLD_MAX ? WIRE_HOLD_MAX : g;
    res->request_tokens = n;
    res->requests = nreq;
    res->pipeline = w;
    res->group = g ? g : 1;
}
