/* Run-time choice of the kernel set. */
#include "kernels.h"

#include <stdlib.h>
#include <string.h>

const duck_kernels *duck_kernels_best(void)
{
    const char *want = getenv("DUCK_KERNELS");
    if (want && strcmp(want, "ref") == 0)
        return duck_kernels_ref();
    const duck_kernels *k = duck_kernels_avx2();
    if (want && strcmp(want, "avx2-xor") == 0)
        k = duck_kernels_avx2_variant(0);
    else if (want && strcmp(want, "avx2-blend") == 0)
        k = duck_kernels_avx2_variant(1);
    return k ? k : duck_kernels_ref();
}
