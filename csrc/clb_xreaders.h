/* Colibri expert reader pool: the threads that load the expert cache's experts, many reads in
 * flight. Two queues, both under the cache's mutex: loads the forward pass waits for (first,
 * in the order pushed) and read-ahead requests (after them; the cache drops those it no longer
 * wants before a reader starts them).
 * Guarantees: every callback runs on a reader with the mutex held (it may release it while it
 * reads); clb_xreaders_stop joins every reader before it returns, unless a read may never come
 * back, then it detaches them and says so, and nothing they use may be freed.
 * Refuses: nothing; the caller sizes the queues so that they cannot overflow. */
#ifndef CLB_XREADERS_H
#define CLB_XREADERS_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    int64_t l, i, old; /* a claimed load: layer, slot, the evicted expert's index or -1 */
    size_t got;        /* repack only: the bytes the forward's thread copied in */
    int repack;        /* 1: the copy is done, only the repack into the slot's layout is left */
} clb_xjob;

/* What the readers run, with the mutex held on entry and exit; loader: 1..n, the reader's
 * index (0 is the forward's own thread, which loads without the pool). */
typedef struct {
    void *ctx;
    void (*run)(void *ctx, const clb_xjob *j, int loader);     /* a pushed load */
    void (*prefetch)(void *ctx, int32_t key, int loader); /* a queued read-ahead */
} clb_xreader_fns;

typedef struct clb_xreaders clb_xreaders;

/* n readers (not started), room for job_cap pushed loads and keys 0..n_keys-1 of read-ahead.
 * NULL when out of memory. */
clb_xreaders *clb_xreaders_new(int n, int64_t job_cap, int64_t n_keys, pthread_mutex_t *mu,
                               const clb_xreader_fns *fns);
/* Starts the threads: how many started (all n, or fewer when the system refused one). */
int clb_xreaders_start(clb_xreaders *p);
int clb_xreaders_started(const clb_xreaders *p);

/* Mutex held: a load for the next free reader, ahead of every read-ahead. */
void clb_xreaders_push(clb_xreaders *p, const clb_xjob *j);
/* Mutex held: queues read-ahead key unless queued already (1 queued, 0 not); then wake as
 * many readers as keys were queued (n; none for 0). */
int clb_xreaders_queue(clb_xreaders *p, int32_t key);
int clb_xreaders_queued(const clb_xreaders *p, int32_t key);
void clb_xreaders_wake(clb_xreaders *p, int n);
/* Mutex held: drops the queued read-aheads with keys in [lo, hi), except those whose keep[key -
 * lo] is set (keep may be NULL); returns how many were dropped. */
int64_t clb_xreaders_drop(clb_xreaders *p, int32_t lo, int32_t hi, const uint8_t *keep);
/* Mutex held: pushed loads not yet taken by a reader. */
int64_t clb_xreaders_waiting(const clb_xreaders *p);
/* Mutex held: loader (0..n) is inside a read (on = 1) or out of it. */
void clb_xreaders_busy(clb_xreaders *p, int loader, int on);

/* Stops the readers after the read each is in; stuck: a read ran past its timeout and may never
 * return. 1 when some loader was inside a read while stuck: the readers are detached, p and
 * everything they use stay allocated; else 0, joined and freed. */
int clb_xreaders_stop(clb_xreaders *p, int stuck);

#endif
