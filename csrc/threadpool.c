/* Colibri thread pool: persistent pthread workers; one task runs on all threads at once.
 * Guarantees: each ith in [0, nth) runs exactly once per clb_threadpool_run; the caller is
 * worker 0; idle workers spin for up to 200 microseconds, then sleep on a condition variable; a
 * pool of one thread never touches pthreads; runs from different threads are serialized.
 * Refuses: a run issued from inside a task of any pool (CLB_E_ARG, it would deadlock). */
#define _GNU_SOURCE
#include <dirent.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clb_threadpool.h"
#include "clb_util.h"

/* spin budget before sleeping (workers waiting for a run, the caller waiting for the workers):
 * longer than the gaps between the runs of one forward pass, where a sleeping thread costs a
 * wake-up of 10 to 20 microseconds on a virtual machine; a pool left without work sleeps
 * within a fifth of a millisecond */
#define CLB_TP_SPIN_NS 200000
#define CLB_TP_MAX_THREADS 1024

typedef struct {
    struct clb_threadpool *tp;
    int ith;
} clb_tp_worker;

struct clb_threadpool {
    int n_threads;
    pthread_t *threads;      /* [n_threads - 1] */
    clb_tp_worker *workers;  /* [n_threads - 1] */
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_done;
    pthread_mutex_t run_mu;  /* serializes runs from different caller threads */
    _Atomic unsigned generation; /* bumped once per run; workers wait for a change */
    _Atomic int n_pending;   /* workers (other than 0) still inside the current task */
    _Atomic int stop;
    clb_task_fn fn;
    void *ctx;
};

static _Thread_local int clb_tp_in_task;

static void clb_cpu_relax(void) {
#ifdef CLB_HAVE_X86
    __builtin_ia32_pause();
#endif
}

/* spin until a new run (or stop) is posted or the spin budget is spent; 1 if posted */
static int clb_spin_gen(struct clb_threadpool *tp, unsigned seen) {
    int64_t t0 = clb_now_ns();
    for (int i = 1;; i++) {
        if (atomic_load_explicit(&tp->generation, memory_order_acquire) != seen) return 1;
        if (atomic_load_explicit(&tp->stop, memory_order_acquire)) return 1;
        clb_cpu_relax();
        if ((i & 63) == 0 && clb_now_ns() - t0 > CLB_TP_SPIN_NS) return 0;
    }
}

static void *clb_tp_main(void *arg) {
    clb_tp_worker *wk = arg;
    struct clb_threadpool *tp = wk->tp;
    unsigned seen = 0;
    clb_tp_in_task = 1; /* a worker thread only ever runs tasks */
    for (;;) {
        if (!clb_spin_gen(tp, seen)) {
            pthread_mutex_lock(&tp->mu);
            while (atomic_load(&tp->generation) == seen && !atomic_load(&tp->stop))
                pthread_cond_wait(&tp->cv_work, &tp->mu);
            pthread_mutex_unlock(&tp->mu);
        }
        if (atomic_load(&tp->stop)) break;
        seen = atomic_load_explicit(&tp->generation, memory_order_acquire);
        tp->fn(tp->ctx, wk->ith, tp->n_threads);
        if (atomic_fetch_sub_explicit(&tp->n_pending, 1, memory_order_acq_rel) == 1) {
            /* the lock orders this signal after the caller's check-then-wait */
            pthread_mutex_lock(&tp->mu);
            pthread_cond_signal(&tp->cv_done);
            pthread_mutex_unlock(&tp->mu);
        }
    }
    return NULL;
}

clb_status clb_threadpool_init(clb_threadpool **out, int n_threads) {
    if (!out || n_threads < 1 || n_threads > CLB_TP_MAX_THREADS) return CLB_E_ARG;
    *out = NULL;
    struct clb_threadpool *tp = calloc(1, sizeof *tp);
    if (!tp) return CLB_E_NOMEM;
    tp->n_threads = n_threads;
    if (n_threads == 1) {
        *out = tp;
        return CLB_OK;
    }
    tp->threads = calloc((size_t)n_threads - 1, sizeof *tp->threads);
    tp->workers = calloc((size_t)n_threads - 1, sizeof *tp->workers);
    if (!tp->threads || !tp->workers) {
        free(tp->threads);
        free(tp->workers);
        free(tp);
        return CLB_E_NOMEM;
    }
    pthread_mutex_init(&tp->mu, NULL);
    pthread_mutex_init(&tp->run_mu, NULL);
    pthread_cond_init(&tp->cv_work, NULL);
    pthread_cond_init(&tp->cv_done, NULL);
    for (int i = 1; i < n_threads; i++) {
        tp->workers[i - 1] = (clb_tp_worker){tp, i};
        if (pthread_create(&tp->threads[i - 1], NULL, clb_tp_main, &tp->workers[i - 1]) != 0) {
            tp->n_threads = i; /* free() joins the ones that started */
            clb_threadpool_free(tp);
            return CLB_E_NOMEM;
        }
    }
    *out = tp;
    return CLB_OK;
}

void clb_threadpool_free(clb_threadpool *tp) {
    if (!tp) return;
    if (tp->threads) {
        pthread_mutex_lock(&tp->mu);
        atomic_store(&tp->stop, 1);
        pthread_cond_broadcast(&tp->cv_work);
        pthread_mutex_unlock(&tp->mu);
        for (int i = 1; i < tp->n_threads; i++) pthread_join(tp->threads[i - 1], NULL);
        pthread_mutex_destroy(&tp->mu);
        pthread_mutex_destroy(&tp->run_mu);
        pthread_cond_destroy(&tp->cv_work);
        pthread_cond_destroy(&tp->cv_done);
    }
    free(tp->threads);
    free(tp->workers);
    free(tp);
}

int clb_threadpool_n_threads(const clb_threadpool *tp) { return tp ? tp->n_threads : 1; }

clb_status clb_threadpool_run(clb_threadpool *tp, clb_task_fn fn, void *ctx) {
    if (!tp || !fn || clb_tp_in_task) return CLB_E_ARG;
    if (tp->n_threads == 1) {
        clb_tp_in_task = 1;
        fn(ctx, 0, 1);
        clb_tp_in_task = 0;
        return CLB_OK;
    }
    pthread_mutex_lock(&tp->run_mu);
    tp->fn = fn;
    tp->ctx = ctx;
    atomic_store(&tp->n_pending, tp->n_threads - 1);
    pthread_mutex_lock(&tp->mu);
    atomic_fetch_add_explicit(&tp->generation, 1, memory_order_release);
    pthread_cond_broadcast(&tp->cv_work);
    pthread_mutex_unlock(&tp->mu);

    clb_tp_in_task = 1;
    fn(ctx, 0, tp->n_threads);
    clb_tp_in_task = 0;

    int64_t t0 = clb_now_ns();
    for (int i = 1; atomic_load_explicit(&tp->n_pending, memory_order_acquire) != 0; i++) {
        clb_cpu_relax();
        if ((i & 63) == 0 && clb_now_ns() - t0 > CLB_TP_SPIN_NS) {
            pthread_mutex_lock(&tp->mu);
            while (atomic_load(&tp->n_pending) != 0) pthread_cond_wait(&tp->cv_done, &tp->mu);
            pthread_mutex_unlock(&tp->mu);
            break;
        }
    }
    pthread_mutex_unlock(&tp->run_mu);
    return CLB_OK;
}

/* physical cores = distinct (package, core) pairs of the online CPUs this process may run on
 * (its affinity mask: taskset, a container's cpuset); SMT siblings share one */
static int clb_read_int(const char *path, long *v) {
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    int ok = fscanf(f, "%ld", v) == 1;
    fclose(f);
    return ok;
}

int clb_physical_cores(void) {
    enum { MAX_CPUS = 4096 };
    static long ids[MAX_CPUS];
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    int n = 0;
    cpu_set_t mask;
    int masked = sched_getaffinity(0, sizeof mask, &mask) == 0; /* fails past 1024 CPUs */
    pthread_mutex_lock(&mu);
    DIR *d = opendir("/sys/devices/system/cpu");
    if (d) {
        struct dirent *e;
        while ((e = readdir(d)) != NULL && n < MAX_CPUS) {
            char *end;
            if (strncmp(e->d_name, "cpu", 3) != 0 || e->d_name[3] < '0' || e->d_name[3] > '9')
                continue;
            long cpu = strtol(e->d_name + 3, &end, 10);
            if (*end != '\0') continue;
            if (masked && (cpu >= CPU_SETSIZE || !CPU_ISSET((int)cpu, &mask))) continue;
            char path[256];
            long online = 1, core, pkg;
            snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%ld/online", cpu);
            if (clb_read_int(path, &online) && !online) continue; /* cpu0 has no file */
            snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%ld/topology/core_id", cpu);
            if (!clb_read_int(path, &core)) continue;
            snprintf(path, sizeof path,
                     "/sys/devices/system/cpu/cpu%ld/topology/physical_package_id", cpu);
            if (!clb_read_int(path, &pkg)) pkg = 0;
            long id = pkg * 1000000 + core;
            int seen = 0;
            for (int i = 0; i < n && !seen; i++) seen = ids[i] == id;
            if (!seen) ids[n++] = id;
        }
        closedir(d);
    }
    pthread_mutex_unlock(&mu);
    if (n > 0) return n;
    if (masked && CPU_COUNT(&mask) > 0) return CPU_COUNT(&mask);
    long c = sysconf(_SC_NPROCESSORS_ONLN);
    return c > 0 ? (int)c : 1;
}
