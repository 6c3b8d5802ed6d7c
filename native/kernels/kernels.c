/* Run-time choice of the kernel set. */
#include "kernels.h"

#include <stdatomic.h>

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

static const duck_kernels *avx2_xor(void) { return duck_kernels_avx2_variant(0); }
static const duck_kernels *avx2_blend(void) { return duck_kernels_avx2_variant(1); }

static const struct {
    const char *name;
    const duck_kernels *(*get)(void);
} NAMED[] = {
    {"best", duck_kernels_best}, {"ref", duck_kernels_ref}, {"avx2", duck_kernels_avx2},
    {"avx2-xor", avx2_xor}, {"avx2-blend", avx2_blend}, {"avx512", duck_kernels_avx512},
    {"avx512-bf16", duck_kernels_avx512_bf16}, {"amx", duck_kernels_amx}, {"amx-emu", duck_kernels_amx_emulated},
};

const duck_kernels *duck_kernels_named(const char *name)
{
    for (size_t i = 0; name && i < sizeof NAMED / sizeof NAMED[0]; i++)
        if (strcmp(name, NAMED[i].name) == 0)
            return NAMED[i].get();
    return NULL;
}

const duck_kernels *duck_kernels_best(void)
{
    const char *want = getenv("DUCK_KERNELS");
    const duck_kernels *k = want && strcmp(want, "best") != 0 ? duck_kernels_named(want) : NULL;
    return k ? k : fastest();
}

static atomic_int batch_invariant = 1;

void duck_kernels_set_batch_invariant(int on) { atomic_store(&batch_invariant, on != 0); }

int duck_kernels_batch_invariant(void) { return atomic_load_explicit(&batch_invariant, memory_order_relaxed); }
