/* Colibri expert cache setup: enable (the slots, the tables, the readers, the pinned experts,
 * the slots' pre-fault), free and the counters' snapshot.
 * Guarantees: a cache that fails to start is freed by the model like a running one; free joins
 * the pre-fault thread and the readers before anything they touch is freed, and leaves
 * everything allocated when a read may never return; the pre-fault never writes a slot's
 * bytes, so it runs beside the readers; stats copy under the lock, safe while a forward runs.
 * Refuses: configs outside the ranges in clb_model.h; more pinned experts than a layer's slots
 * minus one. */
#define _GNU_SOURCE /* MADV_HUGEPAGE */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "clb_util.h"
#include "clb_xcache_internal.h"

#define PAGE CLB_XC_PAGE
#define HUGE_PAGE CLB_XC_HUGE_PAGE

static size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

/* Dense layers have no experts: their entries of m->experts stay empty. */
static int has_expert(const clb_model *m, int64_t idx) { return m->experts[idx].w1 != NULL; }

static void span_of(const clb_model *m, int64_t idx, clb_xspan *sp) {
    const clb_ffn_w *w = &m->experts[idx];
    const clb_tensor *t[3] = {w->w1, w->w3, w->w2};
    const clb_wfile *f = m->expert_files[idx];
    size_t off[3];
    sp->lo = SIZE_MAX;
    sp->hi = 0;
    for (int j = 0; j < 3; j++) {
        off[j] = clb_wfile_offset(f, t[j]->data);
        sp->mapped[j] = t[j]->data;
        if (off[j] < sp->lo) sp->lo = off[j];
        if (off[j] + t[j]->nbytes > sp->hi) sp->hi = off[j] + t[j]->nbytes;
    }
    for (int j = 0; j < 3; j++) sp->rel[j] = off[j] - sp->lo;
}

/* ---- pre-faulting the slots ------------------------------------------------------------ */

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; older headers lack the name */
#endif

static int layer_has_experts(const clb_xcache *xc, int64_t l) {
    return has_expert(xc->m, l * xc->E);
}

/* Faults the slots' pages in, writable, without writing them (MADV_POPULATE_WRITE), so it
 * may run beside the readers filling them: slot 0 of every layer with experts first (a layer
 * fills its slots in order), then slot 1, ... The kernel zeroes (and, on a huge-page region,
 * assembles 2 MiB pages) here instead of inside the first read into each page. Stops at
 * free, or where the kernel refuses (noted in prefault_err). */
static void *prefault_main(void *arg) {
    clb_xcache *xc = arg;
    char why[CLB_ERR_LEN] = "";
    for (int64_t i = 0; i < xc->N && !why[0]; i++)
        for (int64_t l = 0; l < xc->L && !why[0]; l++) {
            if (!layer_has_experts(xc, l)) continue;
            pthread_mutex_lock(&xc->mu);
            int stop = xc->prefault_stop;
            pthread_mutex_unlock(&xc->mu);
            if (stop) break;
            if (madvise(xc->slots[l * xc->N + i].mem, xc->slot_bytes, MADV_POPULATE_WRITE)) {
                int e = errno;
                snprintf(why, sizeof why, "the slots are not pre-faulted: %s%s", strerror(e),
                         e == EINVAL ? " (MADV_POPULATE_WRITE needs Linux 5.14 or later)" : "");
                break;
            }
            pthread_mutex_lock(&xc->mu);
            xc->prefault_done += (int64_t)xc->slot_bytes;
            pthread_mutex_unlock(&xc->mu);
        }
    pthread_mutex_lock(&xc->mu);
    snprintf(xc->prefault_err, sizeof xc->prefault_err, "%s", why);
    xc->prefault_running = 0;
    pthread_mutex_unlock(&xc->mu);
    return NULL;
}

/* Starts the pre-fault thread (cfg.prefault, slots of anonymous memory); without it the
 * pages fault in as reads fill them, as before. */
static void prefault_start(clb_xcache *xc) {
    if (!xc->cfg.prefault || !xc->region) return;
    for (int64_t l = 0; l < xc->L; l++)
        if (layer_has_experts(xc, l)) xc->prefault_total += xc->N * (int64_t)xc->slot_bytes;
    xc->prefault_running = 1;
    if (pthread_create(&xc->prefault_thread, NULL, prefault_main, xc) != 0) {
        xc->prefault_running = 0;
        snprintf(xc->prefault_err, sizeof xc->prefault_err,
                 "the slots are not pre-faulted: no thread could be started");
        return;
    }
    xc->prefault_started = 1;
}

/* Stops the pre-fault after the slot it is in (one madvise) and joins it. */
static void prefault_stop(clb_xcache *xc) {
    if (!xc->prefault_started) return;
    pthread_mutex_lock(&xc->mu);
    xc->prefault_stop = 1;
    pthread_mutex_unlock(&xc->mu);
    pthread_join(xc->prefault_thread, NULL);
    xc->prefault_started = 0;
}

size_t clb_expert_bytes(const clb_model *m) {
    size_t mx = 0;
    for (int64_t idx = 0; idx < m->hp.n_layer * m->hp.n_expert; idx++) {
        clb_xspan sp;
        if (!has_expert(m, idx)) continue;
        span_of(m, idx, &sp);
        if (sp.hi - sp.lo > mx) mx = sp.hi - sp.lo;
    }
    return mx;
}

void clb_xc_free(clb_xcache *xc) {
    if (!xc) return;
    prefault_stop(xc);
    pthread_mutex_lock(&xc->mu);
    int stuck = xc->stuck;
    pthread_mutex_unlock(&xc->mu);
    /* a reader stuck in a read keeps the cache: nothing is freed under it */
    if (clb_xreaders_stop(xc->pool, stuck)) return;
    pthread_cond_destroy(&xc->loaded);
    pthread_mutex_destroy(&xc->mu);
    if (xc->region) munmap(xc->region, xc->region_len);
    for (int k = 0; xc->scratch && k <= xc->n_readers; k++) free(xc->scratch[k]);
    for (int k = 0; xc->rings && k <= xc->n_readers; k++) clb_uring_free(xc->rings[k]);
    free(xc->rings);
    free(xc->scratch);
    free(xc->wave_of);
    free(xc->plan_miss);
    free(xc->cur_start);
    free(xc->plan_i);
    free(xc->plan_old);
    free(xc->fd_ref);
    free(xc->slots);
    free(xc->slot_of);
    free(xc->pinned);
    free(xc->heat);
    free(xc->sel);
    free(xc->span);
    free(xc->tens);
    free(xc->repack);
    free(xc->st);
    free(xc->pf_good);
    free(xc->pf_bad);
    free(xc->pf_skips);
    free(xc->pf_keep);
    free(xc->step);
    free(xc->pred);
    free(xc->pred_step);
    free(xc->pf_right);
    free(xc->pf_pred);
    free(xc->heat_sum);
    free(xc->ev_step);
    free(xc->ev_back);
    free(xc->ev_away);
    for (int64_t j = 0; xc->fd_of && j < xc->L * xc->E; j++)
        if (xc->fd_of[j] >= 0) close(xc->fd_of[j]);
    free(xc->fd_of);
    free(xc->fd_use);
    free(xc);
}

clb_status clb_xcache_enable(clb_model *m, const clb_xc_config *cfg, const uint8_t *pinned,
                             char *err) {
    if (err) err[0] = '\0';
    if (!m || !cfg) {
        clb_set_err(err, "clb_xcache_enable: NULL argument");
        return CLB_E_ARG;
    }
    const int64_t L = m->hp.n_layer, E = m->hp.n_expert;
    if (m->xc) {
        clb_set_err(err, "the expert cache is already enabled");
        return CLB_E_ARG;
    }
    if (m->experts_x8) {
        clb_set_err(err, "the experts were repacked in memory: enable the expert cache first");
        return CLB_E_ARG;
    }
    if (cfg->per_layer < 1 || cfg->per_layer > E || cfg->load < CLB_XC_PREAD ||
        cfg->load > CLB_XC_URING || cfg->prefetch_window < 1 || cfg->read_timeout_ms < 0 ||
        cfg->read_timeout_ms > 86400000 || cfg->readers < 0 || cfg->readers > 64 ||
        cfg->prefetch_depth < 0 || cfg->prefetch_depth > 2 || cfg->prefetch_busy_pct < 0 ||
        cfg->prefetch_busy_pct > 100) {
        clb_set_err(err,
                    "expert cache: %lld slots per layer must be in 1..%lld (load mode %d, "
                    "prefetch window %lld, %d readers: 1..64, prefetch depth %d: 0..2, "
                    "prefetch busy share %d%%: 0..100)",
                    (long long)cfg->per_layer, (long long)E, (int)cfg->load,
                    (long long)cfg->prefetch_window, (int)cfg->readers,
                    (int)cfg->prefetch_depth, (int)cfg->prefetch_busy_pct);
        return CLB_E_ARG;
    }
    const int64_t N = cfg->per_layer;
    if (pinned)
        for (int64_t l = 0; l < L; l++) {
            int64_t np = 0;
            for (int64_t e = 0; e < E; e++) np += pinned[l * E + e] != 0;
            if (np > N - 1) {
                clb_set_err(err,
                            "expert cache: %lld experts pinned in layer %lld, at most %lld fit "
                            "(slots per layer minus one)", (long long)np, (long long)l,
                            (long long)(N - 1));
                return CLB_E_ARG;
            }
        }
    clb_xcache *xc = calloc(1, sizeof(*xc));
    if (!xc) {
        clb_set_err(err, "out of memory for the expert cache");
        return CLB_E_NOMEM;
    }
    xc->m = m;
    xc->cfg = *cfg;
    xc->L = L;
    xc->E = E;
    xc->N = N;
    xc->decay = 1.0f - 1.0f / (float)cfg->prefetch_window;
    pthread_mutex_init(&xc->mu, NULL);
    pthread_condattr_t monotonic;
    pthread_condattr_init(&monotonic);
    pthread_condattr_setclock(&monotonic, CLOCK_MONOTONIC);
    pthread_cond_init(&xc->loaded, &monotonic); /* timed waits: see wait_loaded */
    pthread_condattr_destroy(&monotonic);
    if (xc->cfg.read_timeout_ms == 0) xc->cfg.read_timeout_ms = 30000;
    if (xc->cfg.readers == 0) xc->cfg.readers = 4;
    if (xc->cfg.prefetch_busy_pct == 0) xc->cfg.prefetch_busy_pct = 50;
    xc->win_ns = clb_now_ns();
    const int R = xc->cfg.readers;
    xc->n_readers = R;
    xc->wave_s0 = -1;
    xc->last_begin_l = -1;
    size_t LE = (size_t)(L * E);
    xc->slots = calloc((size_t)(L * N), sizeof(clb_xslot));
    xc->slot_of = malloc(LE * sizeof(int32_t));
    xc->pinned = calloc(LE, 1);
    xc->heat = calloc(LE, sizeof(float));
    xc->sel = calloc(LE, sizeof(int64_t));
    xc->span = calloc(LE, sizeof(clb_xspan));
    xc->tens = calloc(LE * 3, sizeof(clb_tensor));
    xc->repack = calloc(LE * 3, 1);
    xc->st = calloc((size_t)L, sizeof(clb_xc_stats));
    xc->pf_good = calloc((size_t)L, sizeof(float));
    xc->pf_bad = calloc((size_t)L, sizeof(float));
    xc->pf_skips = calloc((size_t)L, sizeof(int64_t));
    xc->pf_keep = calloc((size_t)E, 1);
    xc->step = calloc((size_t)L, sizeof(int64_t));
    xc->pred = calloc(2 * LE, 1);
    xc->pred_step = malloc((size_t)(2 * L) * sizeof(int64_t));
    xc->pf_right = calloc((size_t)(2 * L), sizeof(float));
    xc->pf_pred = calloc((size_t)(2 * L), sizeof(float));
    xc->heat_sum = calloc((size_t)L, sizeof(float));
    xc->ev_step = malloc(LE * sizeof(int64_t));
    xc->ev_back = calloc((size_t)L, sizeof(float));
    xc->ev_away = calloc((size_t)L, sizeof(float));
    for (int64_t l = 0; xc->pred_step && l < 2 * L; l++) xc->pred_step[l] = -1;
    xc->fd_of = malloc(LE * sizeof(int));
    xc->fd_use = calloc(LE, sizeof(uint64_t));
    xc->fd_ref = calloc(LE, sizeof(int32_t));
    xc->scratch = calloc((size_t)R + 1, sizeof(void *));
    const clb_xreader_fns fns = {xc, clb_xc_reader_run, clb_xc_reader_prefetch};
    /* each pushed load holds a slot in state loading: at most L * N at once */
    xc->pool = clb_xreaders_new(R, L * N, (int64_t)LE, &xc->mu, &fns);
    xc->wave_of = malloc(LE * sizeof(int64_t));
    xc->plan_miss = calloc(LE, 1);
    xc->cur_start = calloc((size_t)E + 1, sizeof(int64_t));
    xc->plan_i = calloc((size_t)N, sizeof(int64_t));
    xc->plan_old = calloc((size_t)N, sizeof(int64_t));
    for (size_t j = 0; xc->wave_of && j < LE; j++) xc->wave_of[j] = -1;
    for (size_t j = 0; xc->fd_of && j < LE; j++) xc->fd_of[j] = -1;
    for (size_t j = 0; xc->ev_step && j < LE; j++) xc->ev_step[j] = -1;
    /* a quarter of the process's file limit for kept expert files, 16 to 4096 (the soft limit
     * raised to the hard one first, as far as it allows) */
    struct rlimit nofile;
    rlim_t lim = 64;
    if (getrlimit(RLIMIT_NOFILE, &nofile) == 0) {
        if (nofile.rlim_cur < nofile.rlim_max) {
            rlim_t want = nofile.rlim_max == RLIM_INFINITY ? 65536 : nofile.rlim_max;
            struct rlimit raised = {.rlim_cur = want, .rlim_max = nofile.rlim_max};
            if (want > nofile.rlim_cur && setrlimit(RLIMIT_NOFILE, &raised) == 0)
                nofile.rlim_cur = want;
        }
        lim = nofile.rlim_cur / 4;
    }
    xc->fd_cap = lim < 16 ? 16 : lim > 4096 ? 4096 : (int64_t)lim;
    if (!xc->step || !xc->pf_good || !xc->pf_bad || !xc->pf_skips || !xc->slots ||
        !xc->slot_of || !xc->pinned || !xc->heat || !xc->sel || !xc->span || !xc->tens || !xc->repack ||
        !xc->st || !xc->pf_keep || !xc->fd_of || !xc->fd_use || !xc->fd_ref || !xc->scratch ||
        !xc->pool || !xc->wave_of || !xc->plan_miss || !xc->cur_start || !xc->plan_i ||
        !xc->plan_old || !xc->pred || !xc->pred_step || !xc->pf_right || !xc->pf_pred ||
        !xc->heat_sum || !xc->ev_step || !xc->ev_back || !xc->ev_away) {
        clb_xc_free(xc);
        clb_set_err(err, "out of memory for the expert cache tables");
        return CLB_E_NOMEM;
    }
    size_t span_max = 0;
    for (size_t idx = 0; idx < LE; idx++) {
        xc->slot_of[idx] = -1;
        if (!has_expert(m, (int64_t)idx)) continue; /* its span stays zero */
        span_of(m, (int64_t)idx, &xc->span[idx]);
        size_t len = xc->span[idx].hi - xc->span[idx].lo;
        if (len > span_max) span_max = len;
    }
    for (int64_t i = 0; i < L * N; i++) xc->slots[i].owner = -1;
    if (cfg->load != CLB_XC_MMAP) {
        /* O_DIRECT reads whole pages around the span */
        size_t need = clb_xread_direct(xc) ? span_max + 2 * PAGE : span_max;
        /* slots are packed at page granularity; huge pages back the whole region, so a slot
         * need not start on one (rounding each slot up to 2 MiB would cost up to 2 MiB a slot
         * beyond the budget) */
        xc->slot_bytes = round_up(need, PAGE);
        size_t n_slots = (size_t)(L * N);
        if (n_slots > (SIZE_MAX - 2 * HUGE_PAGE) / xc->slot_bytes) {
            clb_xc_free(xc);
            clb_set_err(err, "expert cache: size overflows");
            return CLB_E_RANGE;
        }
        size_t used = n_slots * xc->slot_bytes;
        size_t len = cfg->huge_pages ? round_up(used, HUGE_PAGE) + HUGE_PAGE : used;
        void *r = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (r == MAP_FAILED) {
            clb_xc_free(xc);
            clb_set_err(err, "out of memory for %zu expert slots of %zu bytes", n_slots,
                        xc->slot_bytes);
            return CLB_E_NOMEM;
        }
        xc->region = r;
        xc->region_len = len;
        unsigned char *base = r;
        if (cfg->huge_pages) {
            base = (unsigned char *)round_up((uintptr_t)r, HUGE_PAGE);
            madvise(base, round_up(used, HUGE_PAGE), MADV_HUGEPAGE);
        }
        for (size_t i = 0; i < n_slots; i++) xc->slots[i].mem = base + i * xc->slot_bytes;
    } else {
        xc->slot_bytes = span_max;
    }
    /* the loaders' repack scratch, before the experts point into the cache */
    size_t group_max = 0;
    for (size_t idx = 0; cfg->load != CLB_XC_MMAP && idx < LE; idx++) {
        if (!has_expert(m, (int64_t)idx)) continue;
        const clb_ffn_w *w = &m->experts[idx];
        const clb_tensor *t[3] = {w->w1, w->w3, w->w2};
        for (int j = 0; j < 3; j++) {
            size_t g = 8 * clb_type_row_size(t[j]->type, t[j]->shape[1]);
            if (clb_tensor_repacks(t[j]) && g > group_max) group_max = g;
        }
    }
    for (int k = 0; group_max > 0 && k <= R; k++) {
        xc->scratch[k] = malloc(group_max);
        if (!xc->scratch[k]) {
            clb_xc_free(xc);
            clb_set_err(err, "out of memory for the expert cache's repack scratch");
            return CLB_E_NOMEM;
        }
    }
    if (cfg->load == CLB_XC_URING) {
        xc->rings = calloc((size_t)R + 1, sizeof(clb_uring *));
        char why[CLB_ERR_LEN] = "out of memory";
        for (int k = 1; xc->rings && k <= R; k++)
            if (!(xc->rings[k] = clb_uring_init(CLB_XC_URING_DEPTH, why, sizeof why))) break;
        if (!xc->rings || !xc->rings[R]) {
            clb_xc_free(xc);
            clb_set_err(err, "expert load mode uring: %s; use direct", why);
            return CLB_E_ARG;
        }
    }
    for (size_t idx = 0; idx < LE; idx++) {
        if (!has_expert(m, (int64_t)idx)) continue;
        clb_ffn_w *w = &m->experts[idx];
        const clb_tensor *t[3] = {w->w1, w->w3, w->w2};
        for (int j = 0; j < 3; j++) {
            clb_tensor *c = &xc->tens[idx * 3 + j];
            *c = *t[j];
            if (cfg->load == CLB_XC_MMAP) continue; /* the mapping's rows, read in place */
            c->data = NULL;
            /* slots are repacked as they are read when the kernels want the interleaved
             * layout; fixed here, so the type never changes under a reader */
            if (clb_tensor_repacks(c)) {
                c->type = clb_x8_type(c->type);
                xc->repack[idx * 3 + j] = 1;
            }
        }
        w->w1 = &xc->tens[idx * 3];
        w->w3 = &xc->tens[idx * 3 + 1];
        w->w2 = &xc->tens[idx * 3 + 2];
    }
    m->xc = xc;
    if (pinned) {
        pthread_mutex_lock(&xc->mu);
        for (int64_t l = 0; l < L; l++)
            for (int64_t e = 0; e < E; e++) {
                if (!pinned[l * E + e] || !has_expert(m, l * E + e)) continue;
                int64_t i = clb_xc_pick_slot(xc, l); /* an empty slot: fewer pinned than slots */
                int64_t old = clb_xc_claim(xc, l, i, e, 0);
                if (clb_xc_load_claimed(xc, l, i, old, 0, 0, 0) == 0) {
                    clb_set_err(err, "%s", xc->fail_msg);
                    pthread_mutex_unlock(&xc->mu);
                    return CLB_E_IO; /* m->xc stays: the model frees it */
                }
                xc->pinned[l * E + e] = 1;
            }
        memset(xc->st, 0, (size_t)L * sizeof(clb_xc_stats));
        pthread_mutex_unlock(&xc->mu);
    }
    int started = clb_xreaders_start(xc->pool);
    if (started < R) {
        clb_set_err(err, "cannot start the expert reader threads (%d of %d started)", started,
                    R);
        return CLB_E_NOMEM; /* m->xc stays: the model frees it, joining those started */
    }
    prefault_start(xc);
    return CLB_OK;
}

int clb_xcache_stats(const clb_model *m, clb_xc_stats *per_layer, int8_t *state, float *heat,
                     int64_t *selections) {
    clb_xcache *xc = m ? m->xc : NULL;
    if (!xc) return 0;
    const int64_t LE = xc->L * xc->E;
    pthread_mutex_lock(&xc->mu);
    if (per_layer) memcpy(per_layer, xc->st, (size_t)xc->L * sizeof(clb_xc_stats));
    if (heat) memcpy(heat, xc->heat, (size_t)LE * sizeof(float));
    if (selections) memcpy(selections, xc->sel, (size_t)LE * sizeof(int64_t));
    if (state)
        for (int64_t idx = 0; idx < LE; idx++) {
            int64_t i = xc->slot_of[idx];
            int8_t s = 0;
            if (i >= 0) {
                const clb_xslot *sl = &xc->slots[(idx / xc->E) * xc->N + i];
                s = sl->state == CLB_XS_LOADING ? 1 : xc->pinned[idx] ? 3 : 2;
            }
            state[idx] = s;
        }
    pthread_mutex_unlock(&xc->mu);
    return 1;
}

int clb_xcache_timing(const clb_model *m, int64_t *read_ns, int64_t *layer_ns) {
    clb_xcache *xc = m ? m->xc : NULL;
    if (!xc) return -1;
    pthread_mutex_lock(&xc->mu);
    *read_ns = xc->read_ns;
    *layer_ns = xc->layer_ns;
    pthread_mutex_unlock(&xc->mu);
    return clb_xc_prefetch_depth(xc);
}

int clb_xcache_prefault(const clb_model *m, int64_t *done_bytes, int64_t *total_bytes,
                        char *err) {
    clb_xcache *xc = m ? m->xc : NULL;
    if (!xc) return -1;
    pthread_mutex_lock(&xc->mu);
    *done_bytes = xc->prefault_done;
    *total_bytes = xc->prefault_total;
    int running = xc->prefault_running;
    if (err) snprintf(err, CLB_ERR_LEN, "%s", xc->prefault_err);
    pthread_mutex_unlock(&xc->mu);
    return running;
}
