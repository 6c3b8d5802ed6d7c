/* Fault injection (tests only, --enable-fault-injection): datagrams
 * dropped at random both ways, and a slow duck. */
#define _POSIX_C_SOURCE 200809L
#include "duckfw.h"

#include <time.h>

int fault_drop(duck_core *c)
{
    if (!c->cfg.faults || c->cfg.drop_rate <= 0)
        return 0;
    c->rng ^= c->rng << 13;   /* xorshift64: reproducible with --fault-seed */
    c->rng ^= c->rng >> 7;
    c->rng ^= c->rng << 17;
    if ((double)(c->rng >> 11) * 0x1p-53 >= c->cfg.drop_rate)
        return 0;
    c->stats.injected_drops++;
    return 1;
}

/* Fault injection: a slow duck, once per complete request. */
void fault_delay(const duck_core *c)
{
    if (c->cfg.faults && c->cfg.delay_us) {
        struct timespec d = {c->cfg.delay_us / 1000000u, (long)(c->cfg.delay_us % 1000000u) * 1000L};
        nanosleep(&d, NULL);
    }
}
