/* Colibri expert cache internals, used by forward.c and model.c (the public half is in
 * clb_model.h). One layer at a time, the forward pass acquires the experts a wave of its
 * tokens needs, runs them, and releases them; acquisition loads what is missing.
 * Guarantees: an acquired expert stays resident until released; its tensors' data pointers are
 * valid and final while it is acquired; at most per_layer experts of a layer are resident or
 * loading at any time.
 * Refuses: nothing here validates the model: the files were checked at load. */
#ifndef CLB_XCACHE_H
#define CLB_XCACHE_H

#include "clb_model.h"

typedef struct clb_xcache clb_xcache;

void clb_xc_free(clb_xcache *xc);

/* Start of layer il in a chunk: counts[e] tokens routed to each expert (heat, selections),
 * and drops queued prefetches for il (the forward pass loads what it still misses itself). */
void clb_xc_begin_layer(clb_xcache *xc, int64_t il, const int64_t *e_start);

/* Acquires expert e of layer il for the current wave: 1 when it is resident (loaded now if it
 * was not; the wave's first acquisition claims the slots of every expert the wave will take
 * and starts all their loads), 0 when no slot can take it until the wave's experts are released (never for the
 * wave's first expert), -1 on a load error (st set; clb_xc_failed gives the message). */
int clb_xc_acquire(clb_xcache *xc, int64_t il, int64_t e, clb_status *st);

/* clb_xc_acquire in two halves, so that a layer runs its resident experts while the others are
 * read: 2 when expert e is the wave's but still loading (counted as a miss; clb_xc_wait gives
 * it, 1, or -1 on a load error or past the read timeout), else as clb_xc_acquire. */
int clb_xc_take(clb_xcache *xc, int64_t il, int64_t e, clb_status *st);
int clb_xc_wait(clb_xcache *xc, int64_t il, int64_t e, clb_status *st);

/* Ends the wave of layer il: every expert acquired in it may be evicted again. */
void clb_xc_release(clb_xcache *xc, int64_t il);

/* Queues n experts (ids, best first) of layer il for the readers to read ahead, behind the loads
 * the forward pass waits for. No-op without prefetch. */
void clb_xc_prefetch(clb_xcache *xc, int64_t il, const int32_t *ids, int64_t n);

int clb_xc_prefetching(const clb_xcache *xc);

/* CLB_E_IO (with the message) once a load found a file changed since load; CLB_OK else. */
clb_status clb_xc_failed(const clb_xcache *xc, char *err);

#endif
