/* What the standalone C tests (test_native.c, host/test_host.c) share: CHECK
 * counts checks and reports each failure with its place; frand gives
 * deterministic, varied data. Each test binary includes it once. */
#ifndef DUCK_TEST_CHECK_H
#define DUCK_TEST_CHECK_H

#include <stdint.h>
#include <stdio.h>

static int failures, checks;

#define CHECK(cond, ...)                                         \
    do {                                                         \
        checks++;                                                \
        if (!(cond)) {                                           \
            failures++;                                          \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                        \
            fprintf(stderr, "\n");                               \
        }                                                        \
    } while (0)

static uint32_t rng_state = 12345;
static float frand(void)   /* deterministic, varied: xorshift in [-1, 1) */
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 17;
    rng_state ^= rng_state << 5;
    return (float)((rng_state >> 8) * (1.0 / 8388608.0)) - 1.0f;
}

#endif
