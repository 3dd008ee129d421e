/* Colibri thread pool: persistent pthread workers that run one task on all threads.
 * Guarantees: the caller thread takes part as worker 0; clb_threadpool_run returns after every
 * worker finished; workers spin briefly, then sleep on a condition variable.
 * Refuses: nested runs from inside a task (returns CLB_E_ARG). */
#ifndef CLB_THREADPOOL_H
#define CLB_THREADPOOL_H

#include "clb_types.h"

typedef struct clb_threadpool clb_threadpool;

/* fn(ctx, ith, nth): ith in [0, nth) */
typedef void (*clb_task_fn)(void *ctx, int ith, int nth);

clb_status clb_threadpool_init(clb_threadpool **out, int n_threads);
void clb_threadpool_free(clb_threadpool *tp);
int clb_threadpool_n_threads(const clb_threadpool *tp);
clb_status clb_threadpool_run(clb_threadpool *tp, clb_task_fn fn, void *ctx);
int clb_physical_cores(void);

#endif
