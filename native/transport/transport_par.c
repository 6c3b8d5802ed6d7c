/* The transport's helper threads. A prefill chunk is megabytes per duck, and
 * the host touches every byte of it several times on one thread: the copy
 * into a datagram, the CRC and the Poly1305 MAC of each datagram it sends to
 * every duck, the same for every reply datagram, the copy into the reply, the
 * sum of the partials. At four ducks and 512 tokens of hidden 2048 that is
 * 16 MiB each way and layer, milliseconds at a few GB/s. The datagrams are
 * independent of one another, as are the rows of a sum, so a large message's
 * are shared out over a small pool; small messages (a decode step) stay on
 * the calling thread, where waking helpers would cost more than they save. */
#define _GNU_SOURCE
#include "transport_impl.h"

#include <sched.h>

/* Work below this many bytes runs on the calling thread: a blocked helper takes
 * tens of microseconds to wake, a 64 KiB datagram about 20 to seal or check. */
#define PAR_MIN_BYTES ((size_t)256 << 10)
#define PAR_MAX_WORKERS 8

static unsigned workers_wanted(const duck_transport *t)
{
    if (t->cfg.workers)
        return t->cfg.workers < PAR_MAX_WORKERS ? t->cfg.workers : PAR_MAX_WORKERS;
    cpu_set_t set;
    unsigned n = sched_getaffinity(0, sizeof set, &set) == 0 ? (unsigned)CPU_COUNT(&set) : 1;
    return n < PAR_MAX_WORKERS ? n : PAR_MAX_WORKERS;
}

void tr_parallel(duck_transport *t, uint32_t n, size_t bytes, tr_item_fn fn, void *ctx)
{
    if (n > 1 && bytes >= PAR_MIN_BYTES && !t->pool_tried) {
        t->pool_tried = 1;
        unsigned w = workers_wanted(t);
        /* unpinned, blocking when idle: the ducks may share this host's cores */
        t->pool = w > 1 ? duck_pool_create(w, 0, 0) : NULL;
    }
    duck_pool_for(bytes >= PAR_MIN_BYTES ? t->pool : NULL, n, fn, ctx);
}

unsigned duck_transport_workers(const duck_transport *t)
{
    return t->pool ? duck_pool_size(t->pool) : 1;
}
