/* Lost ducks: who computes each slice of a forward. Slice d is duck d's;
 * when duck d is lost (silent past its lost deadline, answering without its
 * session, or marked by the caller), the slice goes to the other duck that
 * holds it (a replica), else to this host within its memory budget (the
 * cover, native/transport/cover.c), else to nobody, and forwards fail with a
 * message naming the lost ducks and the memory their slices need, until
 * they are back. transport_forward.c sends each slice where its route says. */
#define _GNU_SOURCE   /* struct mmsghdr in transport_impl.h */
#include "transport_impl.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void say(char *err, uint32_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void say(char *err, uint32_t errlen, const char *fmt, ...)
{
    if (!err || !errlen)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

static void clear_cover(duck_transport *t)
{
    free(t->slice_bytes);
    free(t->replica);
    free(t->route);
    t->slice_bytes = NULL;
    t->replica = NULL;
    t->route = NULL;
    memset(&t->cover, 0, sizeof t->cover);
    t->cover_err[0] = 0;
}

int duck_transport_set_cover(duck_transport *t, const duck_cover_config *c, char *err, uint32_t errlen)
{
    uint32_t nd = t->cfg.n_ducks;
    if (!c || !c->forward) {
        clear_cover(t);
        return 0;
    }
    if (!c->slice_bytes) {
        say(err, errlen, "a cover needs the bytes of every slice");
        return -1;
    }
    if (c->replica) {
        if (c->replica_layer_offset == 0 || c->replica_layer_offset >= WIRE_MAX_LAYERS) {
            say(err, errlen, "replica layer offset %u: expected 1..%d", c->replica_layer_offset, WIRE_MAX_LAYERS - 1);
            return -1;
        }
        for (uint32_t d = 0; d < nd; d++)
            if (c->replica[d] < -1 || c->replica[d] >= (int32_t)nd || c->replica[d] == (int32_t)d) {
                say(err, errlen, "the replica of slice %u is duck %d: expected another duck (0..%u) or -1", d,
                    c->replica[d], nd - 1);
                return -1;
            }
    }
    uint64_t *bytes = malloc(nd * sizeof *bytes);
    int32_t *replica = malloc(nd * sizeof *replica), *route = malloc(nd * sizeof *route);
    if (!bytes || !replica || !route) {
        free(bytes);
        free(replica);
        free(route);
        say(err, errlen, "out of memory for the routes of %u slices", nd);
        return -1;
    }
    clear_cover(t);
    for (uint32_t d = 0; d < nd; d++) {
        bytes[d] = c->slice_bytes[d];
        replica[d] = c->replica ? c->replica[d] : -1;
    }
    t->cover = *c;
    t->cover.slice_bytes = t->slice_bytes = bytes;
    t->cover.replica = t->replica = replica;
    t->route = route;
    tr_reroute(t);   /* ducks already lost stay lost; a failure shows at the next forward */
    return 0;
}

int tr_reroute(duck_transport *t)
{
    uint32_t nd = t->cfg.n_ducks;
    uint64_t need = 0;
    for (uint32_t s = 0; s < nd; s++) {
        int32_t r = t->replica[s];
        if (!t->link[s].lost) {
            t->route[s] = (int32_t)s;
        } else if (r >= 0 && !t->link[r].lost) {
            t->route[s] = r;
        } else {
            t->route[s] = DUCK_ROUTE_HOST;
            need += t->slice_bytes[s];
        }
    }
    t->cover_err[0] = 0;
    if (need <= t->cover.budget_bytes)
        return DUCK_T_OK;
    char lost[160] = "", homeless[160] = "";
    size_t ln = 0, hn = 0;
    uint32_t n_lost = 0, n_homeless = 0;
    for (uint32_t s = 0; s < nd; s++) {
        if (t->link[s].lost && ln < sizeof lost - 8)
            ln += (size_t)snprintf(lost + ln, sizeof lost - ln, "%s%u", n_lost++ ? ", " : "", s);
        if (t->route[s] != DUCK_ROUTE_HOST)
            continue;
        t->route[s] = DUCK_ROUTE_NONE;
        if (hn < sizeof homeless - 8)
            hn += (size_t)snprintf(homeless + hn, sizeof homeless - hn, "%s%u", n_homeless++ ? ", " : "", s);
    }
    snprintf(t->cover_err, sizeof t->cover_err,
             "duck%s %s lost and no live replica holds the slices of duck%s %s: computing them on this host needs "
             "%.1f MiB, more than this host's cover budget of %.1f MiB; forwards fail until they are back",
             n_lost > 1 ? "s" : "", lost, n_homeless > 1 ? "s" : "", homeless, need / 1048576.0,
             t->cover.budget_bytes / 1048576.0);
    return DUCK_T_ECOVER;
}

int duck_transport_set_lost(duck_transport *t, uint32_t duck, int lost, char *err, uint32_t errlen)
{
    if (duck >= t->cfg.n_ducks || !t->route) {
        say(err, errlen, duck >= t->cfg.n_ducks ? "no duck %u" : "duck %u: no cover is set", duck);
        return DUCK_T_EARG;
    }
    t->link[duck].lost = lost != 0;
    if (!lost)
        __atomic_store_n(&t->link[duck].lost_hint, 0, __ATOMIC_RELAXED);
    int rc = tr_reroute(t);
    if (rc != DUCK_T_OK)
        say(err, errlen, "%s", t->cover_err);
    return rc;
}

int duck_transport_lost(const duck_transport *t, uint32_t duck)
{
    return duck < t->cfg.n_ducks && t->link[duck].lost;
}

void duck_transport_hint_lost(duck_transport *t, uint32_t duck)
{
    if (duck < t->cfg.n_ducks)
        __atomic_store_n(&t->link[duck].lost_hint, 1, __ATOMIC_RELAXED);
}

uint64_t duck_transport_progress(const duck_transport *t)
{
    return __atomic_load_n(&t->progress, __ATOMIC_RELAXED);
}

int tr_hinted(const duck_transport *t, uint32_t duck)
{
    return __atomic_load_n(&t->link[duck].lost_hint, __ATOMIC_RELAXED) != 0;
}

uint32_t tr_take_hints(duck_transport *t)
{
    uint32_t found = 0;
    for (uint32_t d = 0; t->route && d < t->cfg.n_ducks; d++)
        if (!t->link[d].lost && tr_hinted(t, d)) {
            t->link[d].lost = 1;
            found++;
        }
    if (found)
        tr_reroute(t);
    return found;
}

const char *duck_transport_cover_error(const duck_transport *t)
{
    return t->cover_err;
}

int32_t duck_transport_route(const duck_transport *t, uint32_t slice)
{
    if (slice >= t->cfg.n_ducks)
        return DUCK_ROUTE_NONE;
    return t->route ? t->route[slice] : (int32_t)slice;
}

/* A forward call whose duck is gone: silent past its lost deadline (or said
 * gone by a hint), without a run of ours or without its session (a restarted duck). */
static int call_lost(const duck_call *c)
{
    wire_reply_head head;
    if (c->local)
        return 0;
    if (c->result == DUCK_T_ETIMEOUT || c->result == DUCK_T_ENORUN)
        return 1;
    if (c->result != DUCK_T_OK || c->reply_len < sizeof head)
        return 0;
    memcpy(&head, c->reply, sizeof head);
    return head.status == WIRE_E_NO_SESSION;
}

uint32_t tr_lose_failed(duck_transport *t, const duck_call *calls, uint32_t n)
{
    uint32_t found = 0;
    for (uint32_t i = 0; i < n; i++)
        if (call_lost(&calls[i]) && !t->link[calls[i].duck].lost) {
            t->link[calls[i].duck].lost = 1;
            found++;
        }
    if (found)
        tr_reroute(t);
    return found;
}
