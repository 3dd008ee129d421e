/* Colibri expert reader pool (clb_xreaders.h): threads that take the cache's pushed loads in
 * order, then its read-ahead requests, and run each through the cache's callbacks.
 * Guarantees: the queues are touched only under the caller's mutex; a read-ahead key is queued
 * at most once at a time; stop wakes every reader and joins them (or, with a read that may
 * never return, detaches them and frees nothing).
 * Refuses: nothing. */
#include <stdlib.h>

#include "clb_xreaders.h"

typedef struct {
    clb_xreaders *p;
    int loader; /* 1..n */
} xreader_arg;

struct clb_xreaders {
    pthread_mutex_t *mu; /* the cache's */
    pthread_cond_t work; /* a job or a read-ahead for the readers, or stop */
    clb_xreader_fns fns;
    int n, n_started, stop;
    pthread_t *threads; /* [n] */
    xreader_arg *args;  /* [n] */
    uint8_t *busy;      /* [1 + n] loader inside a read */
    clb_xjob *jobs;     /* ring of pushed loads, [job_cap] */
    int64_t job_cap, j_head, j_len;
    int32_t *queue;     /* ring of read-ahead keys, [n_keys] */
    uint8_t *queued;    /* [n_keys] */
    int64_t n_keys, q_head, q_len;
};

clb_xreaders *clb_xreaders_new(int n, int64_t job_cap, int64_t n_keys, pthread_mutex_t *mu,
                               const clb_xreader_fns *fns) {
    clb_xreaders *p = calloc(1, sizeof(*p));
    if (!p) return NULL;
    p->mu = mu;
    p->fns = *fns;
    p->n = n;
    p->job_cap = job_cap;
    p->n_keys = n_keys;
    p->threads = calloc((size_t)n, sizeof(pthread_t));
    p->args = calloc((size_t)n, sizeof(xreader_arg));
    p->busy = calloc((size_t)n + 1, 1);
    p->jobs = calloc((size_t)job_cap, sizeof(clb_xjob));
    p->queue = calloc((size_t)n_keys, sizeof(int32_t));
    p->queued = calloc((size_t)n_keys, 1);
    pthread_cond_init(&p->work, NULL);
    if (!p->threads || !p->args || !p->busy || !p->jobs || !p->queue || !p->queued) {
        clb_xreaders_stop(p, 0);
        return NULL;
    }
    return p;
}

/* A reader: the pushed loads in order, then the read-aheads. */
static void *reader_main(void *arg) {
    const xreader_arg *a = arg;
    clb_xreaders *p = a->p;
    pthread_mutex_lock(p->mu);
    for (;;) {
        while (!p->stop && p->j_len == 0 && p->q_len == 0) pthread_cond_wait(&p->work, p->mu);
        if (p->stop) break;
        if (p->j_len > 0) {
            clb_xjob j = p->jobs[p->j_head];
            p->j_head = (p->j_head + 1) % p->job_cap;
            p->j_len--;
            p->fns.run(p->fns.ctx, &j, a->loader);
            continue;
        }
        int32_t key = p->queue[p->q_head];
        p->q_head = (p->q_head + 1) % p->n_keys;
        p->q_len--;
        p->queued[key] = 0;
        p->fns.prefetch(p->fns.ctx, key, a->loader);
    }
    pthread_mutex_unlock(p->mu);
    return NULL;
}

int clb_xreaders_start(clb_xreaders *p) {
    for (int k = 0; k < p->n; k++) {
        p->args[k].p = p;
        p->args[k].loader = k + 1;
        if (pthread_create(&p->threads[k], NULL, reader_main, &p->args[k]) != 0) break;
        p->n_started = k + 1;
    }
    return p->n_started;
}

int clb_xreaders_started(const clb_xreaders *p) { return p ? p->n_started : 0; }

void clb_xreaders_push(clb_xreaders *p, const clb_xjob *j) {
    /* each job holds a slot in state loading, claimed once: the ring never overflows */
    if (p->j_len >= p->job_cap) abort();
    p->jobs[(p->j_head + p->j_len) % p->job_cap] = *j;
    p->j_len++;
    pthread_cond_signal(&p->work);
}

int clb_xreaders_queue(clb_xreaders *p, int32_t key) {
    if (p->queued[key] || p->q_len >= p->n_keys) return 0;
    p->queued[key] = 1;
    p->queue[(p->q_head + p->q_len) % p->n_keys] = key;
    p->q_len++;
    return 1;
}

int clb_xreaders_queued(const clb_xreaders *p, int32_t key) { return p->queued[key]; }

int64_t clb_xreaders_waiting(const clb_xreaders *p) { return p->j_len; }

void clb_xreaders_wake(clb_xreaders *p, int n) {
    /* as many readers as there are new reads: the others sleep on */
    if (n >= p->n_started)
        pthread_cond_broadcast(&p->work);
    else
        for (int k = 0; k < n; k++) pthread_cond_signal(&p->work);
}

int64_t clb_xreaders_drop(clb_xreaders *p, int32_t lo, int32_t hi, const uint8_t *keep) {
    int64_t kept = 0, dropped = 0;
    for (int64_t k = 0; k < p->q_len; k++) {
        int32_t v = p->queue[(p->q_head + k) % p->n_keys];
        if (v >= lo && v < hi && !(keep && keep[v - lo])) {
            p->queued[v] = 0;
            dropped++;
            continue;
        }
        p->queue[(p->q_head + kept) % p->n_keys] = v;
        kept++;
    }
    p->q_len = kept;
    return dropped;
}

void clb_xreaders_busy(clb_xreaders *p, int loader, int on) { p->busy[loader] = (uint8_t)on; }

int clb_xreaders_stop(clb_xreaders *p, int stuck) {
    if (!p) return 0;
    pthread_mutex_lock(p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->work);
    /* a thread stuck in a read that ran past the timeout may never come back: it keeps the
     * pool and the cache (it writes into a slot and takes the lock when its read ends). The
     * others finish the read they are in (a bounded one) and stop. */
    int abandon = 0;
    for (int k = 0; stuck && p->busy && k <= p->n; k++) abandon |= p->busy[k];
    pthread_mutex_unlock(p->mu);
    if (abandon) {
        for (int k = 0; k < p->n_started; k++) pthread_detach(p->threads[k]);
        return 1;
    }
    for (int k = 0; k < p->n_started; k++) pthread_join(p->threads[k], NULL);
    pthread_cond_destroy(&p->work);
    free(p->threads);
    free(p->args);
    free(p->busy);
    free(p->jobs);
    free(p->queue);
    free(p->queued);
    free(p);
    return 0;
}
