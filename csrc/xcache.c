/* Colibri expert cache: a fixed number of slots per layer holding routed experts, loaded on
 * demand for the forward pass (copied on its own thread when memory holds the expert, else by a
 * pool of reader threads it waits for, many reads in flight: xreaders.c, reading in xread.c)
 * and ahead of it by the same pool (prefetch jobs, queued behind the loads the forward waits
 * for); a layer runs each expert as soon as it lands. Setup and counters: xcache_init.c.
 * Guarantees: every table is guarded by one mutex; a slot is read into only by the thread that
 * marked it loading or the reader it handed the load to, one at a time, and its tensors' data
 * pointers change only while no one holds it; an expert is claimed (slot_of set) before it is
 * read, so a prefetch and a demand load of it never both read it; at most per_layer experts of
 * a layer are resident or loading; an open expert file is closed only while no read holds it;
 * the readers are joined before anything they read is freed. A short read (a file cut short
 * since load) fails the load with a message naming the file, and every later forward call
 * fails the same way. The forward pass never waits on storage itself: it copies only what the
 * page cache (or, mapped, memory) already holds, and waits at most read_timeout_ms for a load
 * that needs the storage, so storage that stalls (a hung mount) fails the model instead of
 * hanging the step; a thread still stuck in such a read when the cache is freed is left
 * running and the cache's memory with it, never freed under it.
 * Refuses: nothing past enable (xcache_init.c checks the config). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "clb_util.h"
#include "clb_xcache_internal.h"

/* ---- slot bookkeeping (lock held) ------------------------------------------------------ */

/* A slot of layer l that may take a new expert: an empty one, else the resident, unpinned,
 * unused expert with the least heat, the least recently used on ties; -1 if none.
 * spare_predicted: not one the latest prediction picked for the layer's coming step. */
static int64_t pick_slot_among(const clb_xcache *xc, int64_t l, int spare_prefetched,
                               int spare_predicted) {
    const int64_t LE = xc->L * xc->E;
    const int near = spare_predicted && xc->pred_step[l] > xc->step[l];
    const int far = spare_predicted && xc->pred_step[xc->L + l] > xc->step[l];
    int64_t best = -1;
    for (int64_t i = 0; i < xc->N; i++) {
        const clb_xslot *s = &xc->slots[l * xc->N + i];
        if (s->state == CLB_XS_EMPTY) return i;
        if (s->state != CLB_XS_READY || s->in_use || xc->pinned[l * xc->E + s->owner]) continue;
        if (spare_prefetched && s->prefetched && s->pf_step >= xc->step[l]) continue;
        if ((near && xc->pred[l * xc->E + s->owner]) ||
            (far && xc->pred[LE + l * xc->E + s->owner]))
            continue;
        if (best < 0) {
            best = i;
            continue;
        }
        const clb_xslot *b = &xc->slots[l * xc->N + best];
        float hs = xc->heat[l * xc->E + s->owner], hb = xc->heat[l * xc->E + b->owner];
        if (hs < hb || (hs == hb && s->last_use < b->last_use)) best = i;
    }
    return best;
}

/* A prefetched expert has no heat yet: it is spared until the step it was read for has
 * begun (or no other slot is free), so a miss of that step does not evict it first. */
int64_t clb_xc_pick_slot(const clb_xcache *xc, int64_t l) {
    int64_t i = pick_slot_among(xc, l, 1, 0);
    return i >= 0 ? i : pick_slot_among(xc, l, 0, 0);
}

/* Counts one outcome into a pair of recent counts (yes or no), halving both once they pass 32,
 * so the last few dozen outcomes decide. */
static void decayed_outcome(float *yes, float *no, int outcome) {
    *(outcome ? yes : no) += 1.0f;
    if (*yes + *no > 32.0f) {
        *yes *= 0.5f;
        *no *= 0.5f;
    }
}

/* Records whether a prefetch of layer l was used: whether the layer's predictions are worth
 * their reads (see clb_xc_prefetch). */
static void pf_outcome(clb_xcache *xc, int64_t l, int used) {
    decayed_outcome(&xc->pf_good[l], &xc->pf_bad[l], used);
}

/* One watched eviction of layer l ended: the expert came back (1) or stayed away (0). */
static void ev_outcome(clb_xcache *xc, int64_t l, int back) {
    decayed_outcome(&xc->ev_back[l], &xc->ev_away[l], back);
}

/* The watch on evicted experts (see ev_step) as expert e of layer l is claimed: e, when
 * watched, came back; a demand load that evicts (demand_evicts) ends the watch of every
 * other evicted expert of the layer as stayed away (without the eviction that watch is on,
 * this one would have evicted it, or another as cold). */
static void ev_watch(clb_xcache *xc, int64_t l, int64_t e, int demand_evicts) {
    const int64_t E = xc->E;
    if (xc->ev_step[l * E + e] >= 0) {
        xc->ev_step[l * E + e] = -1;
        ev_outcome(xc, l, 1);
    }
    for (int64_t j = 0; demand_evicts && j < E; j++)
        if (xc->ev_step[l * E + j] >= 0) {
            xc->ev_step[l * E + j] = -1;
            ev_outcome(xc, l, 0);
        }
}

/* Takes slot i of layer l for expert e (state loading); returns the evicted expert's index
 * (l * E + old) or -1. */
int64_t clb_xc_claim(clb_xcache *xc, int64_t l, int64_t i, int64_t e, int prefetch) {
    clb_xslot *s = &xc->slots[l * xc->N + i];
    int64_t old = -1;
    ev_watch(xc, l, e, !prefetch && s->state == CLB_XS_READY);
    if (s->state == CLB_XS_READY) {
        old = l * xc->E + s->owner;
        xc->ev_step[old] = xc->step[l];
        xc->slot_of[old] = -1;
        if (xc->cfg.load != CLB_XC_MMAP)
            for (int j = 0; j < 3; j++) xc->tens[old * 3 + j].data = NULL;
        xc->st[l].evictions++;
        if (s->prefetched) {
            xc->st[l].prefetch_wasted++;
            pf_outcome(xc, l, 0);
        }
    }
    s->owner = (int32_t)e;
    s->state = CLB_XS_LOADING;
    s->prefetched = (uint8_t)prefetch;
    s->pf_step = xc->step[l] + 1; /* the prefetch of layer l is for its next chunk */
    xc->slot_of[l * xc->E + e] = (int32_t)i;
    xc->st[l].loads++;
    if (prefetch) xc->st[l].prefetch_issued++;
    return old;
}

/* Publishes a finished load (got > 0) or frees the slot after a failed one. */
static void finish(clb_xcache *xc, int64_t l, int64_t i, size_t got, const char *msg) {
    clb_xslot *s = &xc->slots[l * xc->N + i];
    int64_t idx = l * xc->E + s->owner;
    if (got == 0) {
        xc->slot_of[idx] = -1;
        s->owner = -1;
        s->state = CLB_XS_EMPTY;
        s->in_use = 0;
        s->prefetched = 0;
        if (!xc->failed) {
            xc->failed = 1;
            snprintf(xc->fail_msg, sizeof xc->fail_msg, "%s", msg);
        }
    } else {
        if (xc->cfg.load != CLB_XC_MMAP) {
            size_t base = clb_xread_slot_base(xc, idx);
            for (int j = 0; j < 3; j++)
                xc->tens[idx * 3 + j].data = s->mem + base + xc->span[idx].rel[j];
        }
        s->state = CLB_XS_READY;
        s->last_use = ++xc->tick;
        xc->st[l].bytes_read += (int64_t)got;
    }
    pthread_cond_broadcast(&xc->loaded);
}

/* ---- storage idle time (lock held) ----------------------------------------------------- */

#define BUSY_WINDOW_NS 50000000 /* the busy share is averaged over windows of 50 ms */

/* Closes the busy window when it has run its length: the share of it with demand loads held
 * by the readers goes into the average (halved once per window elapsed, so a long idle time
 * brings it to zero). */
static void busy_roll(clb_xcache *xc, int64_t now) {
    int64_t span = now - xc->win_ns;
    if (span < BUSY_WINDOW_NS) return;
    int64_t b = xc->busy_ns + (xc->demand > 0 ? now - xc->busy_since : 0);
    float share = (float)b / (float)span, keep = 1.0f;
    for (int64_t k = span / BUSY_WINDOW_NS; k > 0 && keep > 1e-6f; k--) keep *= 0.5f;
    xc->busy = xc->busy * keep + share * (1.0f - keep);
    xc->win_ns = now;
    xc->busy_ns = 0;
    if (xc->demand > 0) xc->busy_since = now;
}

/* A load the forward waits for was handed to the readers (d = 1) or left them (d = -1). */
static void demand_add(clb_xcache *xc, int d) {
    int64_t now = clb_now_ns();
    busy_roll(xc, now);
    if (xc->demand == 0 && d > 0) xc->busy_since = now;
    xc->demand += d;
    if (xc->demand == 0) xc->busy_ns += now - xc->busy_since;
}

/* Whether loads the forward waits for kept the storage busy more than prefetch_busy_pct of
 * the recent time (storage_busy_share), or that or one is queued or being read now
 * (storage_busy). A prefetch read starts only while storage_busy is not. */
static int storage_busy_share(clb_xcache *xc) {
    busy_roll(xc, clb_now_ns());
    return xc->busy * 100.0f > (float)xc->cfg.prefetch_busy_pct;
}

static int storage_busy(clb_xcache *xc) { return xc->demand > 0 || storage_busy_share(xc); }

/* Hands a claimed load to the readers, ahead of every prefetch (lock held); repack_got > 0:
 * its bytes are in the slot already, only the repack is left. */
static void push_job(clb_xcache *xc, int64_t l, int64_t i, int64_t old, size_t repack_got) {
    const clb_xjob j = {.l = l, .i = i, .old = old, .got = repack_got, .repack = repack_got > 0};
    if (!j.repack) {
        xc->st[l].reader_loads++;
        demand_add(xc, 1);
    }
    clb_xreaders_push(xc->pool, &j);
}

/* Averages a reader's read time (an eighth of each new one), for the L+2 decision. */
static void note_read(clb_xcache *xc, int64_t ns) {
    xc->read_ns = xc->read_ns ? xc->read_ns - xc->read_ns / 8 + ns / 8 : ns;
}

/* Loads expert e of layer l into slot i that the caller just claimed (lock held on entry and
 * exit, released while reading); loader 0 is the forward's own thread, 1..n_readers the
 * readers. nowait (the forward's thread): only from what memory holds, through files already
 * open; returns -1 when storage would have to answer (or a file be opened), the slot still
 * claimed, for a reader to load. Else 1 loaded (on the forward's thread: copied, and maybe
 * still loading while a reader repacks it), 0 failed. */
int clb_xc_load_claimed(clb_xcache *xc, int64_t l, int64_t i, int64_t old, int loader,
                        int nowait, int abortable) {
    clb_xslot *s = &xc->slots[l * xc->N + i];
    int64_t idx = l * xc->E + s->owner;
    char msg[CLB_ERR_LEN];
    int blocked;
    clb_xreaders_busy(xc->pool, loader, 1);
    pthread_mutex_unlock(&xc->mu);
    const int64_t t0 = clb_now_ns();
    size_t got = 0;
    blocked = old >= 0 && xc->cfg.load == CLB_XC_MMAP && !clb_xread_drop_mapped(xc, old, nowait);
    /* a copy on the forward's thread leaves the repack to a reader (when there is one): the
     * forward goes on copying (or computing) while the readers repack */
    int defer = nowait && loader == 0 && clb_xreaders_started(xc->pool) > 0 &&
                xc->cfg.load != CLB_XC_MMAP && clb_xread_repacks(xc, idx);
    if (!blocked)
        got = clb_xread_expert(xc, idx, s, loader, nowait, !defer, abortable, &blocked, msg);
    pthread_mutex_lock(&xc->mu);
    if (blocked == 2 && s->in_use) { /* the wave took it meanwhile: it is a demand load now */
        clb_xreaders_busy(xc->pool, loader, 1);
        pthread_mutex_unlock(&xc->mu);
        got = clb_xread_expert(xc, idx, s, loader, 0, 1, 0, &blocked, msg);
        pthread_mutex_lock(&xc->mu);
    }
    clb_xreaders_busy(xc->pool, loader, 0);
    if (blocked == 2) { /* a prefetch stopped for a demand load: its slot is free again */
        xc->st[l].prefetch_aborted++;
        xc->st[l].bytes_read += (int64_t)got;
        xc->slot_of[idx] = -1;
        s->owner = -1;
        s->state = CLB_XS_EMPTY;
        s->prefetched = 0;
        pthread_cond_broadcast(&xc->loaded);
        return 0;
    }
    if (blocked) return -1;
    if (loader > 0 && got > 0) note_read(xc, clb_now_ns() - t0);
    if (defer && got > 0) {
        push_job(xc, l, i, -1, got);
        return 1;
    }
    finish(xc, l, i, got, msg);
    return got > 0;
}

/* Waits on `loaded` until deadline_ns (CLOCK_MONOTONIC); 0 when it passed. */
static int wait_loaded(clb_xcache *xc, int64_t deadline_ns) {
    struct timespec ts = {.tv_sec = (time_t)(deadline_ns / 1000000000),
                          .tv_nsec = (long)(deadline_ns % 1000000000)};
    return pthread_cond_timedwait(&xc->loaded, &xc->mu, &ts) != ETIMEDOUT ||
           clb_now_ns() < deadline_ns;
}

/* A load of layer l's slot i took longer than the timeout: the model fails (lock held). */
static void timed_out(clb_xcache *xc, int64_t l, int64_t i) {
    const clb_xslot *s = &xc->slots[l * xc->N + i];
    xc->stuck = 1;
    if (!xc->failed && s->owner < 0) {
        xc->failed = 1;
        snprintf(xc->fail_msg, sizeof xc->fail_msg,
                 "storage stalled: an expert read of layer %lld took longer than %lld ms",
                 (long long)l, (long long)xc->cfg.read_timeout_ms);
    }
    if (!xc->failed) {
        xc->failed = 1;
        snprintf(xc->fail_msg, sizeof xc->fail_msg,
                 "storage stalled: reading expert %lld of layer %lld from %s took longer than "
                 "%lld ms; restart once the files can be read again",
                 (long long)s->owner, (long long)l,
                 clb_wfile_path(xc->m->expert_files[l * xc->E + s->owner]),
                 (long long)xc->cfg.read_timeout_ms);
    }
}

static int wave_empty(const clb_xcache *xc, int64_t l) {
    for (int64_t i = 0; i < xc->N; i++)
        if (xc->slots[l * xc->N + i].in_use) return 0;
    return 1;
}

/* ---- forward-pass side ------------------------------------------------------------------ */

/* Claims, in expert order from e0, the slots of every expert the running wave of layer l will
 * acquire (the forward pass's own rule: as many as fit in one batch of rows, until no slot
 * can take one), marks them in use so nothing evicts them, and starts their loads: what memory
 * holds is copied here, the rest goes to the readers as soon as it is found missing, so the
 * wave's reads are all in flight before the forward waits for its first expert. The choices
 * and their order are those of acquiring one expert at a time, so are the counters. Lock
 * held (released while copying). */
static void plan_wave(clb_xcache *xc, int64_t l, int64_t e0) {
    const int64_t E = xc->E, N = xc->N, *st = xc->cur_start;
    if (xc->wave_s0 < 0) xc->wave_s0 = st[e0];
    int64_t n = 0, t0 = clb_now_ns();
    for (int64_t e = e0; e < E && st[e + 1] - xc->wave_s0 <= CLB_MAX_BATCH; e++) {
        int64_t idx = l * E + e;
        if (st[e + 1] == st[e] || xc->wave_of[idx] == xc->wave) continue;
        int64_t i = xc->slot_of[idx];
        if (i >= 0) { /* resident or loading: acquire counts it */
            xc->slots[l * N + i].in_use = 1;
            xc->wave_of[idx] = xc->wave;
            continue;
        }
        i = clb_xc_pick_slot(xc, l);
        if (i < 0) break;
        int64_t old = clb_xc_claim(xc, l, i, e, 0);
        xc->slots[l * N + i].in_use = 1;
        xc->wave_of[idx] = xc->wave;
        xc->plan_miss[idx] = 1;
        xc->st[l].misses++;
        xc->plan_i[n] = i;
        xc->plan_old[n++] = old;
    }
    for (int64_t k = 0; k < n && !xc->failed; k++)
        if (clb_xc_load_claimed(xc, l, xc->plan_i[k], xc->plan_old[k], 0, 1, 0) < 0)
            push_job(xc, l, xc->plan_i[k], xc->plan_old[k], 0);
    if (n > 0) xc->st[l].stall_ns += clb_now_ns() - t0;
}

int clb_xc_take(clb_xcache *xc, int64_t l, int64_t e, clb_status *st) {
    const int64_t idx = l * xc->E + e;
    pthread_mutex_lock(&xc->mu);
    if (!xc->failed && xc->wave_of[idx] != xc->wave) plan_wave(xc, l, e);
    int64_t t0 = 0, deadline = 0;
    if (xc->plan_miss[idx]) { /* counted as a miss when the wave claimed it */
        xc->plan_miss[idx] = 0;
        t0 = clb_now_ns();
    }
    for (;;) {
        if (xc->failed) break;
        int64_t i = xc->slot_of[idx];
        if (i >= 0) {
            clb_xslot *s = &xc->slots[l * xc->N + i];
            s->in_use = 1;
            if (s->state == CLB_XS_READY) {
                if (t0) {
                    xc->st[l].stall_ns += clb_now_ns() - t0;
                } else {
                    xc->st[l].hits++;
                }
                if (s->prefetched) {
                    xc->st[l].prefetch_used++;
                    pf_outcome(xc, l, 1);
                }
                s->prefetched = 0;
                s->last_use = ++xc->tick;
                pthread_mutex_unlock(&xc->mu);
                return 1;
            }
            /* a load of this expert is in flight (a reader's, for this wave or a prefetch):
             * it is the wave's, clb_xc_wait_any waits for it */
            if (!t0) {
                xc->st[l].misses++;
                if (s->prefetched) xc->st[l].prefetch_late++;
            } else {
                xc->st[l].stall_ns += clb_now_ns() - t0;
            }
            pthread_mutex_unlock(&xc->mu);
            return 2;
        }
        i = clb_xc_pick_slot(xc, l);
        if (i < 0) {
            if (!wave_empty(xc, l)) {
                pthread_mutex_unlock(&xc->mu);
                return 0;
            }
            if (!t0) t0 = clb_now_ns();
            /* every free slot is loading: wait, at most the timeout */
            if (!deadline) deadline = clb_now_ns() + xc->cfg.read_timeout_ms * 1000000;
            if (!wait_loaded(xc, deadline)) {
                for (i = 0; i < xc->N && xc->slots[l * xc->N + i].state != CLB_XS_LOADING; i++) {
                }
                timed_out(xc, l, i < xc->N ? i : 0);
                break;
            }
            continue;
        }
        if (!t0) {
            t0 = clb_now_ns();
            xc->st[l].misses++;
        }
        /* what memory already holds is copied here; a read that needs the storage goes to
         * the readers, and the loop above then hands it to clb_xc_wait_any like any other load */
        int64_t old = clb_xc_claim(xc, l, i, e, 0);
        xc->slots[l * xc->N + i].in_use = 1;
        xc->wave_of[idx] = xc->wave;
        int done = clb_xc_load_claimed(xc, l, i, old, 0, 1, 0);
        if (done == 0) break;
        if (done < 0) push_job(xc, l, i, old, 0);
    }
    pthread_mutex_unlock(&xc->mu);
    *st = CLB_E_IO;
    return -1;
}

int64_t clb_xc_wait_any(clb_xcache *xc, int64_t l, int64_t e0, int64_t n, int64_t n_ran,
                        uint8_t *wait, uint8_t *skip, clb_status *st) {
    pthread_mutex_lock(&xc->mu);
    const int64_t t0 = clb_now_ns(), deadline = t0 + xc->cfg.read_timeout_ms * 1000000;
    xc->st[l].overlapped += n_ran; /* they ran while these loaded */
    int64_t landed = 0, loading = -1;
    int gone = 0; /* a failed load freed a slot the wave waits for */
    while (!xc->failed && !gone) {
        landed = 0;
        loading = -1;
        for (int64_t g = 0; g < n && !gone; g++) {
            skip[g] = 1;
            if (!wait[g]) continue;
            int64_t i = xc->slot_of[l * xc->E + e0 + g];
            gone = i < 0;
            if (gone) break;
            if (xc->slots[l * xc->N + i].state == CLB_XS_READY) {
                skip[g] = 0;
                landed++;
            } else if (loading < 0) {
                loading = i;
            }
        }
        if (gone || landed > 0 || loading < 0) break;
        if (!wait_loaded(xc, deadline)) {
            timed_out(xc, l, loading);
            break;
        }
    }
    if (!gone && !xc->failed && loading < 0 && landed == 0) { /* nothing was loading */
        pthread_mutex_unlock(&xc->mu);
        return 0;
    }
    if (landed > 0 && !gone && !xc->failed) {
        for (int64_t g = 0; g < n; g++) {
            if (skip[g]) continue;
            clb_xslot *s = &xc->slots[l * xc->N + xc->slot_of[l * xc->E + e0 + g]];
            wait[g] = 0;
            if (s->prefetched) {
                xc->st[l].prefetch_used++;
                pf_outcome(xc, l, 1);
            }
            s->prefetched = 0;
            s->last_use = ++xc->tick;
        }
        xc->st[l].stall_ns += clb_now_ns() - t0;
        pthread_mutex_unlock(&xc->mu);
        return landed;
    }
    pthread_mutex_unlock(&xc->mu);
    *st = CLB_E_IO;
    return -1;
}

void clb_xc_release(clb_xcache *xc, int64_t l) {
    pthread_mutex_lock(&xc->mu);
    for (int64_t i = 0; i < xc->N; i++) xc->slots[l * xc->N + i].in_use = 0;
    /* a wave cut short by an error leaves claims it never acquired */
    memset(xc->plan_miss + l * xc->E, 0, (size_t)xc->E);
    xc->wave++;
    xc->wave_s0 = -1;
    pthread_mutex_unlock(&xc->mu);
}

void clb_xc_begin_layer(clb_xcache *xc, int64_t l, const int64_t *e_start, int64_t n_tokens) {
    const int64_t E = xc->E;
    float d = powf(xc->decay, (float)n_tokens);
    pthread_mutex_lock(&xc->mu);
    xc->step[l]++;
    memcpy(xc->cur_start, e_start, (size_t)(E + 1) * sizeof(int64_t));
    float hs = 0.0f;
    for (int64_t e = 0; e < E; e++) {
        int64_t c = e_start[e + 1] - e_start[e];
        xc->heat[l * E + e] = xc->heat[l * E + e] * d + (float)c;
        hs += xc->heat[l * E + e];
        xc->sel[l * E + e] += c;
    }
    xc->heat_sum[l] = hs;
    /* the predictions made for this step (one layer ahead, and two), judged now */
    for (int64_t far = 0; far < 2; far++) {
        const int64_t k = far * xc->L + l;
        if (xc->pred_step[k] != xc->step[l]) continue;
        const uint8_t *pr = xc->pred + k * E;
        int64_t n_pred = 0, n_right = 0, n_cand = 0, n_cand_right = 0;
        for (int64_t e = 0; e < E; e++) {
            int used = e_start[e + 1] > e_start[e];
            n_pred += pr[e] != 0;
            n_right += pr[e] != 0 && used;
            n_cand += pr[e] == 2;
            n_cand_right += pr[e] == 2 && used;
        }
        if (!far) { /* what the readers were last told for this step */
            xc->st[l].predicted += n_pred;
            xc->st[l].predicted_right += n_right;
        }
        if (n_cand == 0) continue;
        /* a chunk of many tokens weighs at most what one token's prediction may (K) */
        const int64_t w = n_cand < xc->m->hp.n_expert_used ? n_cand : xc->m->hp.n_expert_used;
        xc->pf_pred[k] += (float)w;
        xc->pf_right[k] += (float)w * (float)n_cand_right / (float)n_cand;
        if (xc->pf_pred[k] > 64.0f) {
            xc->pf_pred[k] *= 0.5f;
            xc->pf_right[k] *= 0.5f;
        }
    }
    /* evicted experts not asked for again within the heat's window stayed away */
    for (int64_t e = 0; e < E; e++) {
        int64_t *w = &xc->ev_step[l * E + e];
        if (*w >= 0 && xc->step[l] - *w > xc->cfg.prefetch_window) {
            *w = -1;
            ev_outcome(xc, l, 0);
        }
    }
    /* what is still queued for this layer is late: the forward pass loads its misses itself */
    xc->st[l].prefetch_cancelled += clb_xreaders_drop(xc->pool, (int32_t)(l * E),
                                                      (int32_t)((l + 1) * E), NULL);
    /* a layer's compute time, for the L+2 decision: from the previous layer's start, less
     * what that layer waited for loads, per layer in between (dense layers have no cache) */
    int64_t now = clb_now_ns(), pl = xc->last_begin_l;
    if (pl >= 0 && pl < l) {
        int64_t ns = (now - xc->last_begin_ns - (xc->st[pl].stall_ns - xc->stall_mark)) / (l - pl);
        if (ns > 0) xc->layer_ns = xc->layer_ns ? xc->layer_ns - xc->layer_ns / 8 + ns / 8 : ns;
    }
    xc->last_begin_l = l;
    xc->last_begin_ns = now;
    xc->stall_mark = xc->st[l].stall_ns;
    pthread_mutex_unlock(&xc->mu);
}

void clb_xc_prefetch(clb_xcache *xc, int64_t l, const int32_t *ids, int64_t n, int far) {
    if (!xc->cfg.prefetch) return;
    const int64_t E = xc->E;
    pthread_mutex_lock(&xc->mu);
    /* the prediction is judged when the step it is for begins (the nearer one, when two are) */
    const int64_t pk = (far ? xc->L : 0) + l;
    memset(xc->pred + pk * E, 0, (size_t)E);
    for (int64_t k = 0; k < n; k++) /* 2: not resident, what a prefetch would read */
        xc->pred[pk * E + ids[k]] = xc->slot_of[l * E + ids[k]] < 0 ? 2 : 1;
    xc->pred_step[pk] = xc->step[l] + 1;
    /* a layer whose prefetches are mostly evicted unused (predictions that miss, or a budget
     * too small to hold them) reads ahead only one step in eight, to notice when that
     * changes, and never two layers ahead */
    int wasteful = xc->pf_bad[l] > xc->pf_good[l];
    if (wasteful && (far || xc->pf_skips[l]++ % 8 != 0)) {
        pthread_mutex_unlock(&xc->mu);
        return;
    }
    /* what an earlier, farther prediction queued for l and this one no longer names is
     * dropped before a reader starts it */
    memset(xc->pf_keep, 0, (size_t)E);
    for (int64_t k = 0; k < n; k++) xc->pf_keep[ids[k]] = 1;
    xc->st[l].prefetch_cancelled += clb_xreaders_drop(xc->pool, (int32_t)(l * E),
                                                      (int32_t)((l + 1) * E), xc->pf_keep);
    /* storage kept busy by loads the forward waits for: nothing is queued (the readers would
     * drop it at its start anyway), and no reader is woken. A demand load in flight right now
     * is not enough to refuse: the layer's own loads are about to end, and a reader checks
     * again when it would start the read */
    int busy = storage_busy_share(xc), added = 0;
    for (int64_t k = 0; k < n; k++) {
        int64_t idx = l * E + ids[k];
        if (xc->slot_of[idx] >= 0 || clb_xreaders_queued(xc->pool, (int32_t)idx)) continue;
        if (busy) {
            xc->st[l].prefetch_busy++;
            continue;
        }
        added += clb_xreaders_queue(xc->pool, (int32_t)idx);
    }
    if (far) xc->st[l].prefetch_far += added;
    clb_xreaders_wake(xc->pool, added);
    pthread_mutex_unlock(&xc->mu);
}

int clb_xc_prefetch_depth(clb_xcache *xc) {
    if (!xc || !xc->cfg.prefetch) return 0;
    if (xc->cfg.prefetch_depth > 0) return xc->cfg.prefetch_depth;
    pthread_mutex_lock(&xc->mu);
    /* one measured predicate: two layers ahead when one read takes longer than a layer */
    int two = xc->layer_ns > 0 && xc->read_ns > xc->layer_ns;
    pthread_mutex_unlock(&xc->mu);
    return two ? 2 : 1;
}

clb_status clb_xc_failed(const clb_xcache *xc, char *err) {
    if (!xc) return CLB_OK;
    pthread_mutex_lock((pthread_mutex_t *)&xc->mu);
    int failed = xc->failed;
    if (failed) clb_set_err(err, "%s", xc->fail_msg);
    pthread_mutex_unlock((pthread_mutex_t *)&xc->mu);
    return failed ? CLB_E_IO : CLB_OK;
}

/* ---- the reader pool's callbacks (lock held) --------------------------------------------- */

void clb_xc_reader_run(void *ctx, const clb_xjob *j, int loader) {
    clb_xcache *xc = ctx;
    if (!j->repack) {
        clb_xc_load_claimed(xc, j->l, j->i, j->old, loader, 0, 0);
        demand_add(xc, -1);
        return;
    }
    clb_xslot *s = &xc->slots[j->l * xc->N + j->i];
    int64_t idx = j->l * xc->E + s->owner;
    pthread_mutex_unlock(&xc->mu);
    clb_xread_repack(xc, idx, s->mem + clb_xread_slot_base(xc, idx), xc->scratch[loader]);
    pthread_mutex_lock(&xc->mu);
    finish(xc, j->l, j->i, j->got, "");
}

/* Whether evicting expert v of layer l to prefetch e loses more than it may gain. p, the
 * chance that e is used, is the layer's measured precision of predictions of missing experts
 * (one layer ahead when the latest such prediction named e, else two; one right and one
 * wrong assumed, so an unmeasured layer starts at one half). q, the chance that v is asked
 * for again before a demand load would have evicted it anyway, is the share of the layer's
 * evicted experts that came back that soon (unmeasured: the share of its experts the layer
 * holds). A right prediction saves e's miss and no read (e is read either way, only
 * earlier); a wrong one costs e's read, and with chance q v's read and miss. So v is kept
 * when p is at most one half, or at most q: the trade is made only for an expert likelier
 * to be used than the one it evicts to come back. In a layer that holds all but one or two
 * of the experts its tokens use, q is near 1 (whatever it evicts is the next expert it
 * misses) and prefetch adds no reads there; in a small cache evicted experts seldom come
 * back in time, and right predictions turn misses into hits. Kept too when v's own chance
 * of a use in the next step (its share of the layer's heat, times K experts per token) is
 * at least p. */
static int likelier_kept(const clb_xcache *xc, int64_t l, int64_t e, int64_t v) {
    const int64_t E = xc->E;
    int near = xc->pred_step[l] > xc->step[l] && xc->pred[l * E + e];
    int64_t k = near ? l : xc->L + l;
    float p = (xc->pf_right[k] + 1.0f) / (xc->pf_pred[k] + 2.0f);
    float q0 = (float)xc->N / (float)E; /* unmeasured: the share of the experts it holds */
    float q = (xc->ev_back[l] + q0) / (xc->ev_back[l] + xc->ev_away[l] + 1.0f);
    float hs = xc->heat_sum[l];
    float p_v = hs > 0.0f ? (float)xc->m->hp.n_expert_used * xc->heat[l * E + v] / hs : 0.0f;
    return p <= 0.5f || p <= q || p_v >= p;
}

/* A read-ahead, claimed only now that it starts: skipped when its expert got resident or
 * claimed meanwhile, no slot can take it, the storage is busy with loads the forward waits
 * for, or the expert it would evict is likelier to be used. */
void clb_xc_reader_prefetch(void *ctx, int32_t key, int loader) {
    clb_xcache *xc = ctx;
    int64_t l = key / xc->E, e = key % xc->E;
    if (xc->failed || xc->slot_of[key] >= 0) return;
    if (storage_busy(xc)) {
        xc->st[l].prefetch_busy++;
        return;
    }
    /* never an expert the prediction picked too, nor one it just read for that step */
    int64_t i = pick_slot_among(xc, l, 1, 1);
    if (i < 0) {
        xc->st[l].prefetch_spared += clb_xc_pick_slot(xc, l) >= 0;
        return;
    }
    const clb_xslot *s = &xc->slots[l * xc->N + i];
    if (s->state == CLB_XS_READY && likelier_kept(xc, l, e, s->owner)) {
        xc->st[l].prefetch_spared++;
        return;
    }
    int64_t old = clb_xc_claim(xc, l, i, e, 1);
    clb_xc_load_claimed(xc, l, i, old, loader, 0, 1);
}
