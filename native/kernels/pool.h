/* A persistent pool of worker threads for the kernels. Workers are pinned
 * to CPUs where the OS allows and park between jobs: they spin for at most
 * spin_us microseconds (0 on shared machines: block at once), then sleep. */
#ifndef DUCK_POOL_H
#define DUCK_POOL_H

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

#ifdef __cplusplus
}
#endif
#endif
