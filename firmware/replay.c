/* The run a duck serves and its replay window. A host proves the fleet key
 * and the duck's current challenge once (RUN_OPEN); the link key made from
 * them keys every message that changes the duck's state, and each such
 * message is taken once: its sequence must be above the highest taken, or
 * within WIRE_REPLAY_WINDOW below it and not taken yet (RFC 4303's
 * anti-replay window: requests in flight at once may arrive out of order).
 * A restarted duck draws a new challenge and holds no run, so nothing of an
 * earlier run is taken again; a new run starts its window at the sequence of
 * its RUN_OPEN, above everything its host sent before. */
#define _GNU_SOURCE
#include "duckfw.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

void run_new_challenge(duck_core *c)
{
    size_t got = 0;
    while (got < sizeof c->challenge) {
        ssize_t n = getrandom(c->challenge + got, sizeof c->challenge - got, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {   /* no entropy source: a duck must not run with a guessable challenge */
            dlog(DLOG_ERROR, "getrandom: %s", strerror(errno));
            abort();
        }
        got += (size_t)n;
    }
}

void run_open(duck_core *c, const uint8_t run[WIRE_NONCE_BYTES], uint32_t seq)
{
    wire_link_set(&c->cfg.key, run, c->challenge);
    memset(c->win, 0, sizeof c->win);
    c->win_top = seq;
    c->win[(seq % WIRE_REPLAY_WINDOW) / 64] |= 1ull << (seq % 64);
    run_new_challenge(c);
    dlog(DLOG_INFO, "run %02x%02x%02x%02x… opened at sequence %u", run[0], run[1], run[2], run[3], seq);
}

static int taken(const duck_core *c, uint32_t seq)
{
    return (c->win[(seq % WIRE_REPLAY_WINDOW) / 64] >> (seq % 64)) & 1;
}

int run_window_ok(const duck_core *c, uint32_t seq)
{
    if (!c->cfg.key.has_link)
        return 0;
    if (seq > c->win_top)
        return 1;
    return c->win_top - seq < WIRE_REPLAY_WINDOW && !taken(c, seq);
}

void run_window_take(duck_core *c, uint32_t seq)
{
    if (seq > c->win_top) {
        if (seq - c->win_top >= WIRE_REPLAY_WINDOW)
            memset(c->win, 0, sizeof c->win);
        else
            for (uint32_t s = c->win_top + 1; s != seq; s++)   /* the sequences passed over: not taken */
                c->win[(s % WIRE_REPLAY_WINDOW) / 64] &= ~(1ull << (s % 64));
        c->win[(seq % WIRE_REPLAY_WINDOW) / 64] &= ~(1ull << (seq % 64));
        c->win_top = seq;
    }
    c->win[(seq % WIRE_REPLAY_WINDOW) / 64] |= 1ull << (seq % 64);
}
