/* Fork-join pool: a generation counter under a mutex wakes the workers, a
 * pending counter tells the caller when they are done. A shared run counts
 * instead the workers that joined it, in one 64-bit word with its
 * generation and a closed bit, so that a worker waking late can neither
 * join a closed run nor mistake a later run for it. */
#define _GNU_SOURCE
#include "pool.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

struct duck_pool {
    unsigned n;
    unsigned spin_us;
    pthread_t *threads;
    pthread_mutex_t lock;
    pthread_cond_t work_cv, done_cv;
    atomic_uint generation;
    atomic_uint pending;
    atomic_uint pinned;
    _Atomic uint64_t shared_state;   /* generation << 32 | SHARED_CLOSED | workers running fn */
    pthread_cond_t latch_cv;
    atomic_uint latch_waiters;
    int stop;
    duck_task_fn fn;
    void *arg;
    int shared;
    int pin;
};

#define SHARED_CLOSED 0x80000000ull
#define SHARED_ACTIVE 0x7FFFFFFFull

typedef struct worker_start {
    duck_pool *pool;
    unsigned index;
} worker_start;

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
}

/* A bounded spin: spin_step is 0 once us microseconds have passed. It
 * yields the CPU every few microseconds, since a spinning thread may share
 * its core with the very thread it waits for. */
typedef struct spinner {
    double deadline;
    unsigned steps;
} spinner;

static spinner spin_for(unsigned us) { return (spinner){now_us() + us, 0}; }

static int spin_step(spinner *s)
{
    if ((++s->steps & 255) == 0) {
        if (now_us() > s->deadline)
            return 0;
        sched_yield();
    }
    cpu_relax();
    return 1;
}

/* Spins until *v != value or spin_us elapse; returns whether it changed. */
static int spin_while_equal(atomic_uint *v, unsigned value, unsigned spin_us)
{
    if (!spin_us)
        return 0;
    spinner sp = spin_for(spin_us);
    while (atomic_load_explicit(v, memory_order_acquire) == value)
        if (!spin_step(&sp))
            return 0;
    return 1;
}

/* Joins the shared run of generation gen unless it is closed or over. */
static int shared_join(duck_pool *pool, unsigned gen)
{
    uint64_t s = atomic_load(&pool->shared_state);
    while ((uint32_t)(s >> 32) == gen && !(s & SHARED_CLOSED))
        if (atomic_compare_exchange_weak(&pool->shared_state, &s, s + 1))
            return 1;
    return 0;
}

static void shared_leave(duck_pool *pool)
{
    uint64_t s = atomic_fetch_sub(&pool->shared_state, 1) - 1;
    if ((s & SHARED_CLOSED) && (s & SHARED_ACTIVE) == 0) {
        pthread_mutex_lock(&pool->lock);
        pthread_cond_signal(&pool->done_cv);
        pthread_mutex_unlock(&pool->lock);
    }
}

static void pin_self(duck_pool *pool, unsigned index)
{
#ifdef __linux__
    cpu_set_t allowed, one;
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0)
        return;
    int count = CPU_COUNT(&allowed);
    if (count <= 0)
        return;
    int want = (int)(index % (unsigned)count), seen = 0;
    for (int cpu = 0; cpu < CPU_SETSIZE; cpu++) {
        if (!CPU_ISSET(cpu, &allowed))
            continue;
        if (seen++ == want) {
            CPU_ZERO(&one);
            CPU_SET(cpu, &one);
            if (pthread_setaffinity_np(pthread_self(), sizeof one, &one) == 0)
                atomic_fetch_add(&pool->pinned, 1);
            return;
        }
    }
#else
    (void)pool;
    (void)index;
#endif
}

static void *worker_main(void *p)
{
    worker_start start = *(worker_start *)p;
    free(p);
    duck_pool *pool = start.pool;
    if (pool->pin)
        pin_self(pool, start.index);
    unsigned seen = 0;
    for (;;) {
        if (!spin_while_equal(&pool->generation, seen, pool->spin_us)) {
            pthread_mutex_lock(&pool->lock);
            while (atomic_load(&pool->generation) == seen && !pool->stop)
                pthread_cond_wait(&pool->work_cv, &pool->lock);
            pthread_mutex_unlock(&pool->lock);
        }
        pthread_mutex_lock(&pool->lock);
        int stop = pool->stop, shared = pool->shared;
        duck_task_fn fn = pool->fn;
        void *arg = pool->arg;
        seen = atomic_load(&pool->generation);
        pthread_mutex_unlock(&pool->lock);
        if (stop)
            return NULL;
        if (shared) {
            if (shared_join(pool, seen)) {
                fn(arg, start.index, pool->n);
                shared_leave(pool);
            }
            continue;
        }
        fn(arg, start.index, pool->n);
        if (atomic_fetch_sub_explicit(&pool->pending, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&pool->lock);
            pthread_cond_signal(&pool->done_cv);
            pthread_mutex_unlock(&pool->lock);
        }
    }
}

duck_pool *duck_pool_create(unsigned nthreads, int pin, unsigned spin_us)
{
    if (nthreads == 0) {
        errno = EINVAL;
        return NULL;
    }
    duck_pool *pool = calloc(1, sizeof *pool);
    if (!pool)
        return NULL;
    pool->n = nthreads;
    pool->spin_us = spin_us;
    pool->pin = pin;
    pthread_mutex_init(&pool->lock, NULL);
    pthread_cond_init(&pool->work_cv, NULL);
    pthread_cond_init(&pool->done_cv, NULL);
    pthread_cond_init(&pool->latch_cv, NULL);
    pool->threads = calloc(nthreads, sizeof(pthread_t));
    if (!pool->threads) {
        free(pool);
        return NULL;
    }
    for (unsigned i = 1; i < nthreads; i++) {
        worker_start *start = malloc(sizeof *start);
        if (!start || (start->pool = pool, start->index = i,
                       pthread_create(&pool->threads[i], NULL, worker_main, start) != 0)) {
            free(start);
            pool->n = i;  /* destroy joins only the started ones */
            duck_pool_destroy(pool);
            errno = EAGAIN;
            return NULL;
        }
    }
    return pool;
}

void duck_pool_run(duck_pool *pool, duck_task_fn fn, void *arg)
{
    if (pool->n == 1) {
        fn(arg, 0, 1);
        return;
    }
    atomic_store(&pool->pending, pool->n - 1);
    pthread_mutex_lock(&pool->lock);
    pool->fn = fn;
    pool->arg = arg;
    pool->shared = 0;
    atomic_fetch_add_explicit(&pool->generation, 1, memory_order_release);
    pthread_cond_broadcast(&pool->work_cv);
    pthread_mutex_unlock(&pool->lock);
    fn(arg, 0, pool->n);
    spinner sp = spin_for(pool->spin_us);
    while (pool->spin_us && atomic_load_explicit(&pool->pending, memory_order_acquire) && spin_step(&sp))
        ;
    if (atomic_load_explicit(&pool->pending, memory_order_acquire)) {
        pthread_mutex_lock(&pool->lock);
        while (atomic_load(&pool->pending))
            pthread_cond_wait(&pool->done_cv, &pool->lock);
        pthread_mutex_unlock(&pool->lock);
    }
}

void duck_pool_run_shared(duck_pool *pool, duck_task_fn fn, void *arg)
{
    if (pool->n == 1) {
        fn(arg, 0, 1);
        return;
    }
    pthread_mutex_lock(&pool->lock);
    pool->fn = fn;
    pool->arg = arg;
    pool->shared = 1;
    unsigned gen = atomic_load(&pool->generation) + 1;
    atomic_store(&pool->shared_state, (uint64_t)gen << 32);
    atomic_store_explicit(&pool->generation, gen, memory_order_release);
    pthread_cond_broadcast(&pool->work_cv);
    pthread_mutex_unlock(&pool->lock);
    fn(arg, 0, pool->n);
    uint64_t s = atomic_fetch_or(&pool->shared_state, SHARED_CLOSED) | SHARED_CLOSED;
    spinner sp = spin_for(pool->spin_us);
    while ((s & SHARED_ACTIVE) && pool->spin_us && spin_step(&sp))
        s = atomic_load(&pool->shared_state);
    if (s & SHARED_ACTIVE) {
        pthread_mutex_lock(&pool->lock);
        while (atomic_load(&pool->shared_state) & SHARED_ACTIVE)
            pthread_cond_wait(&pool->done_cv, &pool->lock);
        pthread_mutex_unlock(&pool->lock);
    }
}

void duck_pool_latch_add(duck_pool *pool, atomic_uint *count, unsigned target)
{
    if (atomic_fetch_add(count, 1) + 1 == target && pool && atomic_load(&pool->latch_waiters)) {
        pthread_mutex_lock(&pool->lock);
        pthread_cond_broadcast(&pool->latch_cv);
        pthread_mutex_unlock(&pool->lock);
    }
}

void duck_pool_latch_wait(duck_pool *pool, atomic_uint *count, unsigned target)
{
    if (atomic_load_explicit(count, memory_order_acquire) >= target)
        return;
    spinner sp = spin_for(pool && pool->spin_us > DUCK_POOL_LATCH_SPIN_US ? pool->spin_us : DUCK_POOL_LATCH_SPIN_US);
    while (atomic_load_explicit(count, memory_order_acquire) < target && spin_step(&sp))
        ;
    if (!pool || atomic_load_explicit(count, memory_order_acquire) >= target)
        return;
    /* seq_cst: either the adder sees this waiter, or this waiter sees the count */
    atomic_fetch_add(&pool->latch_waiters, 1);
    pthread_mutex_lock(&pool->lock);
    while (atomic_load(count) < target)
        pthread_cond_wait(&pool->latch_cv, &pool->lock);
    pthread_mutex_unlock(&pool->lock);
    atomic_fetch_sub(&pool->latch_waiters, 1);
}

unsigned duck_pool_size(const duck_pool *pool) { return pool->n; }

unsigned duck_pool_pinned(const duck_pool *pool) { return atomic_load(&((duck_pool *)pool)->pinned); }

void duck_pool_destroy(duck_pool *pool)
{
    if (!pool)
        return;
    pthread_mutex_lock(&pool->lock);
    pool->stop = 1;
    atomic_fetch_add(&pool->generation, 1);
    pthread_cond_broadcast(&pool->work_cv);
    pthread_mutex_unlock(&pool->lock);
    for (unsigned i = 1; i < pool->n; i++)
        pthread_join(pool->threads[i], NULL);
    pthread_cond_destroy(&pool->work_cv);
    pthread_cond_destroy(&pool->done_cv);
    pthread_cond_destroy(&pool->latch_cv);
    pthread_mutex_destroy(&pool->lock);
    free(pool->threads);
    free(pool);
}

/* A thread's scratch buffers (duck_thread_scratch), freed when the thread ends:
 * a pool's threads come and go with the pool. */
#define SCRATCH_SLOTS 4

typedef struct scratch {
    void *mem[SCRATCH_SLOTS];
    size_t cap[SCRATCH_SLOTS];
} scratch;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_free(void *p)
{
    scratch *b = p;
    for (int i = 0; i < SCRATCH_SLOTS; i++)
        free(b->mem[i]);
    free(b);
}

static void scratch_key_create(void) { (void)pthread_key_create(&scratch_key, scratch_free); }

void *duck_thread_scratch(unsigned slot, size_t bytes)
{
    if (slot >= SCRATCH_SLOTS)
        return NULL;
    (void)pthread_once(&scratch_once, scratch_key_create);
    scratch *b = pthread_getspecific(scratch_key);
    if (!b) {
        if (!(b = calloc(1, sizeof *b)) || pthread_setspecific(scratch_key, b) != 0) {
            free(b);
            return NULL;
        }
    }
    if (bytes > b->cap[slot]) {
        void *grown = NULL;
        if (posix_memalign(&grown, 64, bytes) != 0)
            return NULL;
        free(b->mem[slot]);
        b->mem[slot] = grown;
        b->cap[slot] = bytes;
    }
    return b->mem[slot];
}

typedef struct item_job {
    atomic_uint next;
    unsigned n;
    duck_item_fn fn;
    void *ctx;
} item_job;

static void item_task(void *arg, unsigned worker, unsigned nworkers)
{
    (void)worker;
    (void)nworkers;
    item_job *j = arg;
    for (unsigned i; (i = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed)) < j->n;)
        j->fn(j->ctx, i);
}

void duck_pool_for(duck_pool *pool, unsigned n, duck_item_fn fn, void *ctx)
{
    if (!pool || n < 2) {
        for (unsigned i = 0; i < n; i++)
            fn(ctx, i);
        return;
    }
    item_job j = {0, n, fn, ctx};
    duck_pool_run_shared(pool, item_task, &j);
}
