/* Leveled log lines on stderr: "duckfw[3] INFO 12.345678 session 7 opened"; and the
 * monotonic clock they and the rest of the duck read. */
#define _POSIX_C_SOURCE 200809L
#include "duckfw.h"

#include <stdio.h>
#include <time.h>

static uint32_t log_duck;
static int log_level = DLOG_INFO;

void dlog_init(uint32_t duck_id, int level)
{
    log_duck = duck_id;
    log_level = level;
}

int dlog_enabled(int level) { return level <= log_level; }

void dlog(int level, const char *fmt, ...)
{
    static const char *const names[] = {"ERROR", "WARN", "INFO", "DEBUG"};
    if (level > log_level)
        return;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    /* one fprintf per line: lines of several ducks on one terminal stay whole */
    fprintf(stderr, "duckfw[%u] %s %ld.%06ld %s\n", log_duck, names[level < 0 ? 0 : level > 3 ? 3 : level],
            (long)ts.tv_sec, ts.tv_nsec / 1000L, line);
}

uint64_t duck_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
