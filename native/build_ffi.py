"""cffi out-of-line API build of native/: compiled by the install, never at import.

Run by hand from the project root (`python native/build_ffi.py`, after editing
native/) it writes the file the editable install writes, native/_native.abi3.so.
cffi alone would name it for this interpreter (_native.cpython-311-....so), a
name the import system tries before abi3's: that file would shadow every later
install's build until deleted, and the tests would run stale code."""
import importlib.util
import os
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# Paths relative to the project root, where setup.py runs.
sources = _load("native_sources", HERE / "sources.py")

CDEF = """
typedef struct fp9_block { uint64_t sign[2]; uint8_t mag[2][64]; } fp9_block;
typedef struct fp9_matrix {
    uint32_t rows, cols; uint32_t row_pairs, groups; float prescale;
    const fp9_block *blocks; const float *block_scales;
} fp9_matrix;
size_t fp9_tensor_bytes(uint32_t rows, uint32_t cols, int with_block_scales);
int fp9_tensor_view(const void *buf, size_t len, fp9_matrix *out);
float fp9_decode(uint8_t code, int negative);
uint8_t fp9_encode_rne(float magnitude);
int fp9_pack_f32(const float *src, uint32_t rows, uint32_t cols, size_t stride, void *dst, size_t *bad_index);
int fp9_pack_bf16(const uint16_t *src, uint32_t rows, uint32_t cols, size_t stride, void *dst, size_t *bad_index);
int fp8_e4m3_to_f32(uint8_t code, float *out);
int fp9_pack_fp8(const uint8_t *src, uint32_t rows, uint32_t cols, size_t stride,
                 const float *scale_inv, uint32_t scale_stride,
                 void *dst, size_t dst_len, int *with_block_scales, size_t *bad_index);
size_t fp9_pack_fp8_bound(uint32_t rows, uint32_t cols);
void fp9_unpack_f32(const fp9_matrix *m, float *dst, size_t stride);

typedef void (*fp9_gemm_fn)(const fp9_matrix *m, uint32_t pair_begin, uint32_t pair_end,
                            uint32_t ntok, const float *const *x, float *const *y, int accumulate);
typedef struct duck_kernels { const char *name; fp9_gemm_fn gemm; } duck_kernels;
const duck_kernels *duck_kernels_ref(void);
const duck_kernels *duck_kernels_avx2(void);
const duck_kernels *duck_kernels_avx2_variant(int blend);
const duck_kernels *duck_kernels_avx512(void);
unsigned long long duck_kernels_amx_emulated_dots(void);
const duck_kernels *duck_kernels_best(void);
const duck_kernels *duck_kernels_named(const char *name);
void duck_kernels_set_batch_invariant(int on);
int duck_kernels_batch_invariant(void);
void fp9_prepare_x_f32(const float *x, uint32_t n, uint32_t n_padded, float *out);
void fp9_prepare_x_bf16(const uint16_t *x, uint32_t n, uint32_t n_padded, float *out);

typedef struct duck_pool duck_pool;
duck_pool *duck_pool_create(unsigned nthreads, int pin, unsigned spin_us);
unsigned duck_pool_size(const duck_pool *pool);
void duck_f32_to_bf16(const float *x, size_t n, uint16_t *out);
unsigned duck_pool_pinned(const duck_pool *pool);
void duck_pool_destroy(duck_pool *pool);

typedef struct fp9_synth_desc {
    uint32_t version; uint32_t rows, cols; uint32_t live_rows; uint32_t live_cols; int32_t prescale_log2;
    uint64_t seed;
} fp9_synth_desc;
#define FP9_SYNTH_VERSION ...
#define FP9_SYNTH_PRESCALE_LOG2_MIN ...
#define FP9_SYNTH_PRESCALE_LOG2_MAX ...
#define FP9_SYNTH_MAX_DIM ...
#define FP9_SYNTH_MAX_BYTES ...
int32_t fp9_synth_default_prescale_log2(uint32_t cols);
int fp9_synth_check(const fp9_synth_desc *d, char *err, size_t errlen);
uint64_t fp9_synth_bytes(const fp9_synth_desc *d);
int fp9_synth_generate(const fp9_synth_desc *d, void *dst, size_t len, duck_pool *pool);

typedef struct duck_expert_slice { fp9_matrix gate_up; fp9_matrix down; } duck_expert_slice;
typedef struct duck_moe_args {
    const duck_expert_slice *experts; uint32_t n_experts; uint32_t ntok; uint32_t topk; uint32_t hidden;
    const int32_t *expert_ids; const float *expert_weights; const void *x;
    uint32_t x_dtype; uint32_t y_dtype; void *y;
} duck_moe_args;
#define DUCK_DT_F32 ...
#define DUCK_MAX_TOKENS ...
#define DUCK_MAX_TOPK ...
#define DUCK_DT_BF16 ...
typedef struct duck_ffn_workspace duck_ffn_workspace;
duck_ffn_workspace *duck_ffn_workspace_create(void);
void duck_ffn_workspace_destroy(duck_ffn_workspace *ws);
int duck_moe_forward(duck_pool *pool, const duck_kernels *k, duck_ffn_workspace *ws,
                     const duck_moe_args *a, uint64_t *bytes_streamed);
int duck_fp9_matmul(duck_pool *pool, const duck_kernels *k, duck_ffn_workspace *ws,
                    const fp9_matrix *m, uint32_t ntok, const float *x, float *y);
int duck_expert_slice_check(const duck_expert_slice *e, uint32_t hidden);

uint64_t duck_bench_read(duck_pool *pool, const void *buf, size_t bytes);
#define DUCK_BENCH_SCALAR ...
#define DUCK_BENCH_AVX2 ...
#define DUCK_BENCH_AVX512 ...
int duck_bench_isa(int want);
uint64_t duck_bench_fma(duck_pool *pool, int isa, uint64_t rounds);
uint64_t duck_kernels_amx_probe(duck_pool *pool, int mode, uint64_t rounds);
#define DUCK_AMX_PART_NO_DECODE ...
#define DUCK_AMX_PART_NO_TILES ...
#define DUCK_AMX_PART_NO_OUT ...
#define DUCK_AMX_PART_NO_PREFETCH ...
#define DUCK_AMX_PART_SERIAL ...
void duck_kernels_amx_parts(int parts);
#define DUCK_FFN_PHASES ...
void duck_ffn_act(const float *gu, uint32_t pb, uint32_t pe, float scale, int bf16, float *out);
void duck_ffn_act_ref(const float *gu, uint32_t pb, uint32_t pe, float scale, int bf16, float *out);
void duck_ffn_profile(int on, uint64_t *ns);
void duck_bench_gemm(duck_pool *pool, const duck_kernels *k, const duck_expert_slice *experts, uint32_t n,
                     uint32_t ntok, const float *const *x, const float *const *h, float *const *gu, float *const *y);
int duck_bench_int8_gemv(duck_pool *pool, int isa, const int8_t *w, uint32_t n, uint32_t k,
                         const float *x, float *y);
void duck_bench_pool_wake(duck_pool *pool, uint32_t runs, uint32_t gap_us, int shared,
                          double *wake_us, double *run_us);
"""

# The wire protocol and host transport declare themselves in their own file.
transport_cdef = _load("transport_cdef", HERE / "transport" / "cdef.py")
# ... and so do the native CPU decoder's (native/host/).
host_cdef = _load("host_cdef", HERE / "host" / "cdef.py")

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.cdef(transport_cdef.CDEF)
ffibuilder.cdef(host_cdef.CDEF)
ffibuilder.cdef(transport_cdef.HOST_STEP_CDEF)
ffibuilder.set_source(
    "native._native",
    '#include "fp9.h"\n#include "fp9_synth.h"\n#include "kernels.h"\n#include "pool.h"\n#include "ffn.h"\n#include "bench.h"\n'
    + transport_cdef.INCLUDES + host_cdef.INCLUDES + transport_cdef.HOST_STEP_INCLUDES,
    sources=sources.EXTENSION,
    include_dirs=sources.INCLUDE_DIRS,
    extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-fno-strict-aliasing"],
    libraries=["pthread", "m", "dl"],
)

if __name__ == "__main__":
    built = Path(ffibuilder.compile(verbose=True))
    os.replace(built, built.with_name("_native.abi3.so"))
