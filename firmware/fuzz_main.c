/* A bounded random-mutation driver for fuzz_parser.c where clang's
 * libFuzzer is missing: gcc + ASan/UBSan, no coverage guidance.
 *   duckfw-fuzz-gcc [-max_total_time=SECONDS] [-seed=N] [corpus files...] */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define POOL 64
#define MAX_INPUT 4096

static uint64_t rng_state = 88172645463325252ull;
static uint64_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    static uint8_t pool[POOL][MAX_INPUT];
    static size_t lens[POOL];
    unsigned npool = 0;
    double seconds = 10;
    for (int i = 1; i < argc; i++) {
        if (strncmp(argv[i], "-max_total_time=", 16) == 0) {
            seconds = atof(argv[i] + 16);
        } else if (strncmp(argv[i], "-seed=", 6) == 0) {
            rng_state ^= strtoull(argv[i] + 6, NULL, 10) * 0x9E3779B97F4A7C15ull;
        } else if (argv[i][0] != '-' && npool < POOL) {
            FILE *f = fopen(argv[i], "rb");
            if (f) {
                lens[npool] = fread(pool[npool], 1, MAX_INPUT, f);
                fclose(f);
                npool++;
            }
        }
    }
    while (npool < POOL) {   /* random seeds for each mode */
        lens[npool] = 1 + rnd() % 256;
        for (size_t k = 0; k < lens[npool]; k++)
            pool[npool][k] = (uint8_t)rnd();
        npool++;
    }
    uint8_t buf[MAX_INPUT];
    uint64_t runs = 0;
    double until = now_s() + seconds;
    while (now_s() < until) {
        for (int burst = 0; burst < 256; burst++, runs++) {
            unsigned src = (unsigned)(rnd() % npool);
            size_t n = lens[src];
            memcpy(buf, pool[src], n);
            for (int m = 1 + (int)(rnd() % 4); m > 0; m--) {
                switch (rnd() % 5) {
                case 0: if (n) buf[rnd() % n] ^= (uint8_t)(1u << (rnd() % 8)); break;
                case 1: if (n) buf[rnd() % n] = (uint8_t)rnd(); break;
                case 2: if (n > 1) n = 1 + rnd() % n; break;
                case 3: if (n < MAX_INPUT) buf[n++] = (uint8_t)rnd(); break;
                default: if (n >= 4) { size_t a = rnd() % (n - 3); uint32_t v = (uint32_t)rnd(); memcpy(buf + a, &v, 4); } break;
                }
            }
            LLVMFuzzerTestOneInput(buf, n);
            if (rnd() % 16 == 0) {   /* keep some mutants as new seeds */
                unsigned dst = (unsigned)(rnd() % npool);
                memcpy(pool[dst], buf, n);
                lens[dst] = n;
            }
        }
    }
    fprintf(stderr, "fuzz-gcc: %llu runs in %.0f s, no crash\n", (unsigned long long)runs, seconds);
    return 0;
}
