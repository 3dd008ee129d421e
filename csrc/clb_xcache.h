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

/* Start of layer il in a chunk of n_tokens tokens: e_start[e + 1] - e_start[e] rows routed to
 * each expert run here (heat, selections; with experts run on another backend, only a share
 * of the chunk's rows, so the heat decays by n_tokens, not by the rows), and drops queued
 * prefetches for il (the forward pass loads what it still misses itself). */
void clb_xc_begin_layer(clb_xcache *xc, int64_t il, const int64_t *e_start, int64_t n_tokens);

/* Acquires expert e of layer il for the current wave: 1 when it is resident, 2 when it is the
 * wave's but still loading (counted as a miss; clb_xc_wait_any gives it), 0 when no slot can
 * take it until the wave's experts are released (never for the wave's first expert), -1 on a
 * load error (st set; clb_xc_failed gives the message). The wave's first acquisition claims
 * the slots of every expert the wave will take and starts all their loads; what memory holds
 * is copied on the caller's thread, the rest is read by the reader pool. */
int clb_xc_take(clb_xcache *xc, int64_t il, int64_t e, clb_status *st);

/* Waits for the first of the wave's loading experts to land: wait[g] (g < n) marks expert e0 + g
 * as taken with 2 and not yet given. Returns how many landed (>= 1; their wait[g] cleared,
 * skip[g] 0, every other skip[g] 1), 0 when none was waited for, -1 on a load error or past
 * the read timeout (st set). n_ran: experts of the wave that ran since the previous wait while
 * these loaded (the overlapped counter). */
int64_t clb_xc_wait_any(clb_xcache *xc, int64_t il, int64_t e0, int64_t n, int64_t n_ran,
                        uint8_t *wait, uint8_t *skip, clb_status *st);

/* Ends the wave of layer il: every expert acquired in it may be evicted again. */
void clb_xc_release(clb_xcache *xc, int64_t il);

/* Queues n experts (ids, best first) of layer il for the readers to read ahead, behind the loads
 * the forward pass waits for; what an earlier call queued for il and this one leaves out is
 * dropped (prefetch_cancelled). far: il is two layers ahead (counted in prefetch_far, skipped
 * while il's prefetches mostly waste). No-op without prefetch. */
void clb_xc_prefetch(clb_xcache *xc, int64_t il, const int32_t *ids, int64_t n, int far);

/* Layers read ahead: 0 without prefetch, else 1 or 2 (cfg.prefetch_depth, or with 0 there, 2
 * while one reader's read takes longer on average than one layer's compute). */
int clb_xc_prefetch_depth(clb_xcache *xc);

/* CLB_E_IO (with the message) once a load found a file changed since load; CLB_OK else. */
clb_status clb_xc_failed(const clb_xcache *xc, char *err);

#endif
