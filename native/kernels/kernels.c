/* Run-time choice of the kernel set. */
#include "kernels.h"

#include <stdlib.h>
#include <string.h>

/* The bf16 GEMM of avx512-bf16 measured faster than avx512's FMA on AMD Zen 5
 * (0.95 vs 0.70 of the FMA peak at 32 tokens per expert) and slower on the H200
 * host's Xeon (0.39 vs 0.59), where VDPBF16PS issues on one port: docs/fp9.md. */
static const duck_kernels *bf16_where_faster(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_is("amd"))
        return duck_kernels_avx512_bf16();
#endif
    return NULL;
}

static const duck_kernels *fastest(void)
{
    const duck_kernels *k = duck_kernels_amx();
    if (!k)
        k = bf16_where_faster();
    if (!k)
        k = duck_kernels_avx512();
    if (!k)
        k = duck_kernels_avx2();
    return k ? k : duck_kernels_ref();
}

const duck_kernels *duck_kernels_named(const char *name)
{
    if (!name)
        return NULL;
    if (strcmp(name, "best") == 0)
        return duck_kernels_best();
    if (strcmp(name, "ref") == 0)
        return duck_kernels_ref();
    if (strcmp(name, "avx2") == 0)
        return duck_kernels_avx2();
    if (strcmp(name, "avx2-xor") == 0)
        return duck_kernels_avx2_variant(0);
    if (strcmp(name, "avx2-blend") == 0)
        return duck_kernels_avx2_variant(1);
    if (strcmp(name, "avx512") == 0)
        return duck_kernels_avx512();
    if (strcmp(name, "avx512-bf16") == 0)
        return duck_kernels_avx512_bf16();
    if (strcmp(name, "amx") == 0)
        return duck_kernels_amx();
    if (strcmp(name, "amx-emu") == 0)
        return duck_kernels_amx_emulated();
    return NULL;
}

const duck_kernels *duck_kernels_best(void)
{
    const char *want = getenv("DUCK_KERNELS");
    const duck_kernels *k = want && strcmp(want, "best") != 0 ? duck_kernels_named(want) : NULL;
    return k ? k : fastest();
}
