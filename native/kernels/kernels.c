/* Run-time choice of the kernel set. */
#include "kernels.h"

#include <stdlib.h>
#include <string.h>

static const duck_kernels *fastest(void)
{
    const duck_kernels *k = duck_kernels_avx512_bf16();
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
    return NULL;
}

const duck_kernels *duck_kernels_best(void)
{
    const char *want = getenv("DUCK_KERNELS");
    const duck_kernels *k = want && strcmp(want, "best") != 0 ? duck_kernels_named(want) : NULL;
    return k ? k : fastest();
}
