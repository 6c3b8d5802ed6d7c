/* Run-time choice of the host kernel set. */
#include "host_kernels.h"

#include <stdlib.h>
#include <string.h>

const duck_host_kernels *duck_host_kernels_best(void)
{
    const char *want = getenv("DUCK_HOST_KERNELS");
    if (want && strcmp(want, "ref") == 0)
        return duck_host_kernels_ref();
    const duck_host_kernels *k = NULL;
    if (!want || strcmp(want, "avx2") != 0)
        k = duck_host_kernels_avx512();
    if (!k)
        k = duck_host_kernels_avx2();
    return k ? k : duck_host_kernels_ref();
}
