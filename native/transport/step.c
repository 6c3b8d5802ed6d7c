/* A decode step driven from C: step.h says what and why. */
#define _GNU_SOURCE
#include "step.h"
#include "transport_impl.h"   /* tr_now_ns */

#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>

/* The few CUDA driver entry points used, by their documented C signatures
 * (handles are pointers; CUresult an int; 600 is CUDA_ERROR_NOT_READY). */
typedef int (*cu_graph_launch_fn)(void *exec, void *stream);
typedef int (*cu_stream_query_fn)(void *stream);
typedef int (*cu_stream_sync_fn)(void *stream);
typedef int (*cu_stream_get_ctx_fn)(void *stream, void **ctx);
typedef int (*cu_ctx_set_current_fn)(void *ctx);
typedef int (*cu_get_error_name_fn)(int err, const char **name);
#define CU_SUCCESS 0
#define CU_ERROR_NOT_READY 600

static struct {
    pthread_once_t once;
    int ok;
    char why[160];
    cu_graph_launch_fn graph_launch;
    cu_stream_query_fn stream_query;
    cu_stream_sync_fn stream_sync;
    cu_stream_get_ctx_fn stream_get_ctx;
    cu_ctx_set_current_fn ctx_set_current;
    cu_get_error_name_fn error_name;
} cu = {.once = PTHREAD_ONCE_INIT};

static void cu_open(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(cu.why, sizeof cu.why, "no CUDA driver: %s", dlerror());
        return;
    }
    struct { const char *name; void **fn; } want[] = {
        {"cuGraphLaunch", (void **)&cu.graph_launch},
        {"cuStreamQuery", (void **)&cu.stream_query},
        {"cuStreamSynchronize", (void **)&cu.stream_sync},
        {"cuStreamGetCtx", (void **)&cu.stream_get_ctx},
        {"cuCtxSetCurrent", (void **)&cu.ctx_set_current},
        {"cuGetErrorName", (void **)&cu.error_name},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        *want[i].fn = dlsym(h, want[i].name);
        if (!*want[i].fn) {
            snprintf(cu.why, sizeof cu.why, "the CUDA driver has no %s", want[i].name);
            return;
        }
    }
    cu.ok = 1;
}

int duck_step_cuda_available(char *err, uint32_t errlen)
{
    pthread_once(&cu.once, cu_open);
    if (cu.ok)
        return 0;
    if (err && errlen)
        snprintf(err, errlen, "%s", cu.why);
    return DUCK_STEP_ENOCUDA;
}

static int cuda_failed(duck_step_result *res, const char *what, uint32_t segment, int rc)
{
    const char *name = NULL;
    if (cu.error_name(rc, &name) != CU_SUCCESS || !name)
        name = "?";
    res->cuda_error = rc;
    snprintf(res->message, sizeof res->message, "%s of graph %u failed: %s (%d)", what, segment, name, rc);
    return DUCK_STEP_ECUDA;
}

/* Waits for the stream by polling it: the graph's end is seen within a poll
 * (a microsecond), where a blocking wait may sleep through it. */
static int wait_stream(void *stream, int yield)
{
    for (;;) {
        int rc = cu.stream_query(stream);
        if (rc != CU_ERROR_NOT_READY)
            return rc;
        if (yield)
            sched_yield();
        else
            __builtin_ia32_pause();
    }
}

int duck_step_add_call(duck_step_result *res, int rc, uint32_t call)
{
    const duck_forward_result *fr = &res->call;
    res->retransmits += fr->retransmits;
    res->mtu_fallbacks += fr->mtu_fallbacks;
    res->lost_new += fr->lost_new;
    res->host_ns += fr->host_ns;
    res->host_slices += fr->host_slices;
    if (rc != DUCK_T_OK) {
        res->failed_call = (int32_t)call;
        snprintf(res->message, sizeof res->message, "%s", fr->message);
        return rc;
    }
    res->kernel_us_sum += fr->kernel_us_max;
    res->bytes_streamed += fr->bytes_streamed;
    if (fr->wake_ns_max > res->wake_ns_max)
        res->wake_ns_max = fr->wake_ns_max;
    return DUCK_T_OK;
}

int duck_step_run(duck_transport *t, const duck_step *s, duck_step_result *res)
{
    memset(res, 0, sizeof *res);
    res->failed_call = -1;
    if (duck_step_cuda_available(res->message, sizeof res->message) != 0)
        return DUCK_STEP_ENOCUDA;
    if (!t || !s || s->n_segments < 1 || !s->graphs || (s->n_segments > 1 && (!s->layers || !s->topks)) || !s->stream) {
        snprintf(res->message, sizeof res->message, "bad step: %u segments, graphs %p, layers %p, stream %llx",
                 s ? s->n_segments : 0, s ? (const void *)s->graphs : NULL, s ? (const void *)s->layers : NULL,
                 s ? (unsigned long long)s->stream : 0ull);
        return DUCK_T_EARG;
    }
    void *stream = (void *)(uintptr_t)s->stream;
    void *ctx = NULL;
    int rc = cu.stream_get_ctx(stream, &ctx);
    if (rc == CU_SUCCESS)
        rc = cu.ctx_set_current(ctx);   /* the caller's thread may not have made it current */
    if (rc != CU_SUCCESS)
        return cuda_failed(res, "finding the context", 0, rc);
    duck_forward_args a = s->args;
    for (uint32_t i = 0; i < s->n_segments; i++) {
        uint64_t t0 = tr_now_ns();
        rc = cu.graph_launch((void *)(uintptr_t)s->graphs[i], stream);
        if (rc != CU_SUCCESS)
            return cuda_failed(res, "launch", i, rc);
        rc = wait_stream(stream, (int)s->spin_yield);
        if (rc != CU_SUCCESS)
            return cuda_failed(res, "replay", i, rc);
        uint64_t t1 = tr_now_ns();
        if (s->gpu_ns)
            s->gpu_ns[i] = t1 - t0;
        if (i + 1 == s->n_segments)
            break;
        a.layer = s->layers[i];
        a.topk = s->topks[i];
        if (s->ids_log && a.ntok * a.topk <= s->ids_log_stride)
            memcpy(s->ids_log + (size_t)i * s->ids_log_stride, a.expert_ids, a.ntok * a.topk * sizeof(int32_t));
        duck_forward_result *fr = &res->call;
        int frc = duck_transport_forward(t, &a, fr);
        uint64_t t2 = tr_now_ns();
        if (duck_step_add_call(res, frc, i) != DUCK_T_OK)
            return frc;
        if (s->ffn_ns)
            s->ffn_ns[i] = t2 - t1;
        if (s->kernel_us)
            s->kernel_us[i] = fr->kernel_us_max;
    }
    return DUCK_T_OK;
}
