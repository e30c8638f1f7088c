/* threadpool.h — the engine's threads: a persistent pool that runs one job at a time on every thread.
 * Internal to the engine (cffi never sees it). A job is a function that every thread runs with its index; steps
 * inside a job are ordered by strata_pool_barrier. Waits spin some microseconds, then sleep on a futex, so on a
 * busy machine a waiting thread gives its core up (to a descheduled partner, say) instead of burning it; workers
 * idle between jobs sleep the same way. Linux only (futex). */
#pragma once

typedef struct strata_pool strata_pool;

/* One job: run by thread ith of nth (0 is the caller of strata_pool_run). */
typedef void (*strata_job)(int ith, int nth, void *arg);

/* A pool of n_threads threads: n_threads - 1 workers and the calling thread. NULL when a thread could not
 * start (no thread is left running then). */
strata_pool *strata_pool_create(int n_threads);
/* Stop and join every worker. Not while a job runs. */
void strata_pool_free(strata_pool *pool);

/* CPU seconds the workers (not the calling thread) have run so far. */
double strata_pool_worker_seconds(const strata_pool *pool);
/* Run job(ith, nth, arg) on every thread; returns when all have finished. One caller at a time. */
void strata_pool_run(strata_pool *pool, strata_job job, void *arg);
/* Inside a job, every thread: wait until all have arrived. Everything written before it is visible after it. */
void strata_pool_barrier(strata_pool *pool);
/* Inside a job: the next index of a shared work counter, 0, 1, 2, ... across all threads. Every barrier resets
 * it to 0, so each loop that hands out work through it must lie between two barriers, alone. */
int strata_pool_next(strata_pool *pool);
