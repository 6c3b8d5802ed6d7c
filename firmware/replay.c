/* The run a duck serves and its replay window. A host proves the fleet key
 * and the duck's current challenge once (RUN_OPEN); the link key made from
 * them keys every message that changes the duck's state, and each such
 * message is taken once: its sequence must be above the highest taken, or
 * within WIRE_REPLAY_WINDOW below it and not taken yet (RFC 4303's
 * anti-replay window: requests in flight at once may arrive out of order).
 * A restarted duck draws a new challenge and holds no run, so nothing of an
 * earlier run is taken again; a new run starts its window at the sequence of
 * its RUN_OPEN, above everything its host sent before.
 *
 * Read-only requests (HELLO with its MAC, STATS, CACHE_QUERY) change nothing
 * and are asked by several hosts and probes at once, so no window can say
 * which are fresh: each names instead the duck's query nonce, which any
 * hello hands out, and which the duck changes every query period (taking the
 * one before for one period more: a nonce handed out is good for at least a
 * period) and forgets at a restart. */
#define _GNU_SOURCE
#include "duckfw.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

static void random_bytes(uint8_t *p, size_t len)
{
    size_t got = 0;
    while (got < len) {
        ssize_t n = getrandom(p + got, len - got, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {   /* no entropy source: a duck must not run with a guessable challenge or nonce */
            dlog(DLOG_ERROR, "getrandom: %s", strerror(errno));
            abort();
        }
        got += (size_t)n;
    }
}

void run_new_challenge(duck_core *c) { random_bytes(c->challenge, sizeof c->challenge); }

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

void query_init(duck_core *c)
{
    if (!c->cfg.query_period_ms)
        c->cfg.query_period_ms = DUCK_QUERY_PERIOD_MS;
    random_bytes(c->query[0], sizeof c->query[0]);
    memset(c->query[1], 0, sizeof c->query[1]);
    c->query_prev = 0;
    c->query_epoch = 0;
    c->query_t0 = duck_now_ns();
}

/* Periods are counted from the start, not from the last request: a duck
 * nobody asked for a while draws the new nonce at the next request, and
 * keeps the one before only if it was the previous period's. */
const uint8_t *query_current(duck_core *c, uint32_t *left_ms)
{
    uint64_t period = (uint64_t)c->cfg.query_period_ms * 1000000u, age = duck_now_ns() - c->query_t0;
    uint64_t epoch = age / period;
    if (left_ms)
        *left_ms = (uint32_t)(((epoch + 2) * period - age) / 1000000u);
    if (epoch != c->query_epoch) {
        c->query_prev = epoch == c->query_epoch + 1;
        memcpy(c->query[1], c->query[0], sizeof c->query[1]);
        random_bytes(c->query[0], sizeof c->query[0]);
        c->query_epoch = epoch;
    }
    return c->query[0];
}

int query_ok(duck_core *c, const uint8_t *p, uint32_t len)
{
    if (len < sizeof(wire_query))
        return 0;
    const uint8_t *cur = query_current(c, NULL);
    /* not secret (any hello hands it out), so no constant-time compare is needed */
    return memcmp(p, cur, WIRE_NONCE_BYTES) == 0 || (c->query_prev && memcmp(p, c->query[1], WIRE_NONCE_BYTES) == 0);
}
