/* A persistent pool of worker threads for the kernels. Workers are pinned
 * to CPUs where the OS allows and park between jobs: they spin for at most
 * spin_us microseconds (0 on shared machines: block at once), then sleep. */
#ifndef DUCK_POOL_H
#define DUCK_POOL_H

#include <stdatomic.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct duck_pool duck_pool;

/* Work split: called once per worker with worker in [0, nworkers). */
typedef void (*duck_task_fn)(void *arg, unsigned worker, unsigned nworkers);

/* nthreads counts the calling thread, which runs worker 0; nthreads - 1
 * threads are started. Returns NULL on failure (errno set). */
duck_pool *duck_pool_create(unsigned nthreads, int pin, unsigned spin_us);
/* Runs fn on every worker and returns when all have finished. Not
 * reentrant: one caller at a time. */
void duck_pool_run(duck_pool *pool, duck_task_fn fn, void *arg);
/* For tasks that share their work out themselves (workers claim pieces
 * from an atomic counter until none is left): fn runs on the calling thread
 * and on every worker that wakes up before the calling thread's fn has
 * returned; one that wakes later does not run it at all. So the caller
 * never waits for a worker to wake up (tens of microseconds in a VM), only
 * for those already running to finish. fn must do all the work whoever
 * runs it, and may not rely on worker numbers being all present. */
void duck_pool_run_shared(duck_pool *pool, duck_task_fn fn, void *arg);

/* fn(ctx, i) for every i in [0, n), the items claimed one at a time from a
 * counter by the calling thread and every worker that joins in time
 * (duck_pool_run_shared); in order on the calling thread where pool is NULL. */
typedef void (*duck_item_fn)(void *ctx, unsigned item);
void duck_pool_for(duck_pool *pool, unsigned n, duck_item_fn fn, void *ctx);

/* A latch for the phases of a shared task: a count of finished pieces that
 * workers wait on. Waiting spins for a bounded time (the pool's spin_us, at
 * least DUCK_POOL_LATCH_SPIN_US: the wait is normally one piece of work
 * long), then sleeps until duck_pool_latch_add brings the count to target. */
#define DUCK_POOL_LATCH_SPIN_US 50
void duck_pool_latch_add(duck_pool *pool, atomic_uint *count, unsigned target);
void duck_pool_latch_wait(duck_pool *pool, atomic_uint *count, unsigned target);

unsigned duck_pool_size(const duck_pool *pool);
/* How many workers got the CPU they were meant to be pinned to. */
unsigned duck_pool_pinned(const duck_pool *pool);
void duck_pool_destroy(duck_pool *pool);

/* Even split of n items: the range of worker w. */
static inline void duck_split(unsigned long n, unsigned w, unsigned nw,
                              unsigned long *begin, unsigned long *end)
{
    *begin = n * w / nw;
    *end = n * (w + 1) / nw;
}

/* The same with boundaries at multiples of align (the last one at n), so
 * that kernels grouping rows see the same groups whatever the split. */
static inline void duck_split_aligned(unsigned long n, unsigned w, unsigned nw, unsigned long align,
                                      unsigned long *begin, unsigned long *end)
{
    unsigned long units = (n + align - 1) / align;
    duck_split(units, w, nw, begin, end);
    *begin = *begin * align < n ? *begin * align : n;
    *end = *end * align < n ? *end * align : n;
}

/* A buffer of at least bytes (64-byte aligned) of the calling thread, one per
 * slot (0: duck_bf16_rows; 1, 2: the amx GEMM; 3: avx512's many-token GEMM), kept
 * and reused until the thread ends; NULL when out of memory or slot >= 4. */
void *duck_thread_scratch(unsigned slot, size_t bytes);

#ifdef __cplusplus
}
#endif
#endif
