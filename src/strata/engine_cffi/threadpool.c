/* threadpool.c — a persistent pool of threads for the forward pass (see threadpool.h).
 * Why not OpenMP: libgomp's barrier spins for milliseconds, so when another process takes one of the cores a
 * waiting thread burns its timeslice while the partner it waits for sits descheduled. Here a wait spins some
 * microseconds (on an idle machine the partner is about to arrive), then sleeps on a futex: the core goes to
 * whoever is runnable, the descheduled partner included, and the wake-up puts the sleeper back at once.
 * Waits never sched_yield: with a busy process on the same core a yield hands it a whole timeslice
 * (milliseconds), where a sleeper woken through the futex preempts it. Measured with bench/threads.py (2 threads,
 * one or two busy competitors): decode ran at 5-12 tok/s with a wait that yields, 55-67 with spin-then-sleep. */
#define _GNU_SOURCE
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "threadpool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
static void cpu_relax(void) { _mm_pause(); }
#elif defined(__aarch64__)
static void cpu_relax(void) { __asm__ __volatile__("yield"); }
#else
static void cpu_relax(void) {}
#endif

#define BARRIER_SPIN_NS 20000  /* a barrier wait spins this long before it sleeps: more than a step's imbalance */
#define IDLE_SPIN_NS 100000    /* an idle worker spins this long for the next job: the gap between decode steps */
#define CACHE_LINE 64

// --- waiting: spin, then sleep on a futex

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void futex_wait(atomic_uint *addr, unsigned expected) {
    syscall(SYS_futex, addr, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void futex_wake_all(atomic_uint *addr) {
    syscall(SYS_futex, addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

/* Wait until *word differs from `seen` and return its new value: spinning for spin_ns, then asleep on the futex.
 * Invariant: n_sleeping is raised before futex_wait reads *word, and whoever changes *word does so before it
 * reads n_sleeping (both sequentially consistent), so either the writer sees the sleeper and wakes it, or the
 * sleeper sees the new value and does not sleep. */
static unsigned wait_change(atomic_uint *word, unsigned seen, atomic_int *n_sleeping, long long spin_ns) {
    long long deadline = now_ns() + spin_ns;
    unsigned now;
    for (int step = 1; (now = atomic_load_explicit(word, memory_order_acquire)) == seen; step++) {
        if (step % 16 != 0 || now_ns() < deadline) {  // the clock only every 16 pauses: a read costs about one
            cpu_relax();
            continue;
        }
        atomic_fetch_add(n_sleeping, 1);
        futex_wait(word, seen);
        atomic_fetch_sub(n_sleeping, 1);
    }
    return now;
}

/* *word = value (a release), then wake whoever sleeps on it. */
static void publish(atomic_uint *word, unsigned value, atomic_int *n_sleeping) {
    atomic_store(word, value);
    if (atomic_load(n_sleeping) > 0) futex_wake_all(word);
}

// --- pool

typedef struct {
    strata_pool *pool;
    int ith;
    pthread_t thread;
} worker;

struct strata_pool {
    int n_threads;
    worker *workers;                           // (n_threads - 1,)
    strata_job job;                            /* the current job and its argument, published by job_seq */
    void *arg;
    int stop;                                  /* set before the last bump of job_seq: workers return */
    _Alignas(CACHE_LINE) atomic_uint job_seq;  /* bumped once per job; idle workers sleep on it */
    atomic_int n_idle_sleeping;                /* workers asleep on job_seq */
    _Alignas(CACHE_LINE) atomic_int arrived;   /* threads at the current barrier */
    atomic_uint sense;                         /* flips each time a barrier opens; waiters sleep on it */
    atomic_int n_barrier_sleeping;             /* threads asleep on sense */
    _Alignas(CACHE_LINE) atomic_int next;      /* the shared work counter */
};

static void *worker_main(void *arg) {
    worker *w = arg;
    strata_pool *p = w->pool;
    for (unsigned seen = 0;;) {
        seen = wait_change(&p->job_seq, seen, &p->n_idle_sleeping, IDLE_SPIN_NS);
        if (p->stop) return NULL;
        p->job(w->ith, p->n_threads, p->arg);
        strata_pool_barrier(p);  // the job's end, which strata_pool_run waits for
    }
}

/* Tell the first n_started workers to return, and join them. */
static void stop_workers(strata_pool *p, int n_started) {
    p->stop = 1;
    publish(&p->job_seq, atomic_load(&p->job_seq) + 1, &p->n_idle_sleeping);
    for (int i = 0; i < n_started; i++) pthread_join(p->workers[i].thread, NULL);
}

/* Start the workers with every signal blocked, so signals go to the process's own threads (Python's handlers
 * run on the main thread); returns how many started. */
static int start_workers(strata_pool *p) {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int n = 0;
    for (; n < p->n_threads - 1; n++) {
        p->workers[n] = (worker){.pool = p, .ith = n + 1};
        if (pthread_create(&p->workers[n].thread, NULL, worker_main, &p->workers[n]) != 0) break;
        pthread_setname_np(p->workers[n].thread, "strata-engine");  // tells them apart in ps, top and tests
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return n;
}

strata_pool *strata_pool_create(int n_threads) {
    size_t size = (sizeof(strata_pool) + CACHE_LINE - 1) / CACHE_LINE * CACHE_LINE;
    strata_pool *p = n_threads > 0 ? aligned_alloc(CACHE_LINE, size) : NULL;
    if (!p) return NULL;
    memset(p, 0, size);  // every counter starts at 0
    p->n_threads = n_threads;
    p->workers = calloc(n_threads, sizeof(worker));
    int started = p->workers ? start_workers(p) : 0;
    if (!p->workers || started < n_threads - 1) {
        stop_workers(p, started);
        free(p->workers);
        free(p);
        return NULL;
    }
    return p;
}

void strata_pool_free(strata_pool *p) {
    if (!p) return;
    stop_workers(p, p->n_threads - 1);
    free(p->workers);
    free(p);
}

double strata_pool_worker_seconds(const strata_pool *p) {
    double seconds = 0.0;
    for (int i = 0; i < p->n_threads - 1; i++) {
        clockid_t clock;
        struct timespec ts;
        if (pthread_getcpuclockid(p->workers[i].thread, &clock) == 0 && clock_gettime(clock, &ts) == 0)
            seconds += (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
    }
    return seconds;
}

// --- jobs

void strata_pool_run(strata_pool *p, strata_job job, void *arg) {
    p->job = job;
    p->arg = arg;
    publish(&p->job_seq, atomic_load(&p->job_seq) + 1, &p->n_idle_sleeping);
    job(0, p->n_threads, arg);
    strata_pool_barrier(p);
}

/* A sense-reversing barrier: each thread notes the sense on arrival; the last to arrive resets the count (and the
 * work counter) and flips the sense, which releases the others. The acq_rel arrivals and the flip carry every
 * thread's writes to every thread past the barrier. */
void strata_pool_barrier(strata_pool *p) {
    unsigned sense = atomic_load_explicit(&p->sense, memory_order_relaxed);
    if (atomic_fetch_add_explicit(&p->arrived, 1, memory_order_acq_rel) == p->n_threads - 1) {
        atomic_store_explicit(&p->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&p->next, 0, memory_order_relaxed);
        publish(&p->sense, !sense, &p->n_barrier_sleeping);
        return;
    }
    wait_change(&p->sense, sense, &p->n_barrier_sleeping, BARRIER_SPIN_NS);
}

int strata_pool_next(strata_pool *p) { return atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed); }
