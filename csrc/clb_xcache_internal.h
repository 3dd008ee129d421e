/* Colibri expert cache, private to its files: the cache's tables (xcache.c: slots and what the
 * forward pass calls; xcache_init.c: enable, free, stats; xread.c: reading an expert's bytes
 * into its slot) and the functions they share. The readers are a pool of their own
 * (clb_xreaders.h) that sees none of this.
 * Guarantees: every table is guarded by mu; see xcache.c for the rules of a slot.
 * Refuses: nothing; not for use outside the expert cache. */
#ifndef CLB_XCACHE_INTERNAL_H
#define CLB_XCACHE_INTERNAL_H

#include <pthread.h>

#include "clb_model_internal.h"
#include "clb_uring.h"
#include "clb_xcache.h"
#include "clb_xreaders.h"

#define CLB_XC_PAGE 4096u
#define CLB_XC_HUGE_PAGE (2u << 20)
/* uring mode: each reader splits an expert's read into chunks of this size, up to
 * CLB_XC_URING_DEPTH of them in flight (4 MiB a reader) */
#define CLB_XC_URING_CHUNK (512u << 10)
#define CLB_XC_URING_DEPTH 8u
/* a prefetch read (pread, direct) goes in pieces of this size, checking between two whether a
 * load the forward waits for arrived (then it stops) */
#define CLB_XC_PF_CHUNK (1u << 20)

enum { CLB_XS_EMPTY = 0, CLB_XS_LOADING = 1, CLB_XS_READY = 2 };

typedef struct {
    int32_t owner;      /* expert of the slot's layer, -1 when empty */
    int8_t state;       /* CLB_XS_* */
    uint8_t in_use;     /* acquired by the running wave */
    uint8_t prefetched; /* loaded as a prefetch and not acquired since */
    unsigned char *mem; /* slot memory; NULL with CLB_XC_MMAP */
    uint64_t last_use;
    int64_t pf_step;    /* prefetched for this step of its layer: kept until it passes */
} clb_xslot;

typedef struct {
    size_t lo, hi;         /* file span of the expert's three tensors */
    size_t rel[3];         /* offsets of w1, w3, w2 from lo */
    const void *mapped[3]; /* their data in the mappings */
} clb_xspan;

struct clb_xcache {
    clb_model *m;
    clb_xc_config cfg;
    int64_t L, E, N;
    size_t slot_bytes;
    unsigned char *region;
    size_t region_len;
    /* 8-row scratch of the in-slot repack, one per loader (0: the forward's own thread, 1..:
     * the readers), sized at enable; entries NULL when no slot is repacked */
    void **scratch;     /* [1 + n_readers] */
    clb_uring **rings;  /* [1 + n_readers] uring mode: each reader's ring (none for loader 0) */
    clb_xslot *slots;   /* [L * N] */
    int32_t *slot_of;   /* [L * E] slot within its layer, -1: not resident */
    uint8_t *pinned;    /* [L * E] */
    float *heat;        /* [L * E] selections, decayed per token */
    int64_t *sel;       /* [L * E] selections since enable */
    clb_xspan *span;    /* [L * E] */
    clb_tensor *tens;   /* [L * E * 3] the experts' tensors, data pointing into their slots */
    uint8_t *repack;    /* [L * E * 3] 1: the file's rows are repacked into the slot's layout
                         * as they are read (0: stored as the products read them) */
    clb_xc_stats *st;   /* [L] */
    float *pf_good, *pf_bad; /* [L] recent prefetches used / evicted unused (halved at 32) */
    int64_t *pf_skips;  /* [L] requests skipped while the layer's prefetches mostly waste */
    uint8_t *pf_keep;   /* [E] scratch of clb_xc_prefetch: the experts it was asked for */
    int64_t *step;      /* [L] chunks the layer has begun */
    /* the precision of the read-ahead predictions, one layer ahead (first half of each table)
     * and two: pred marks the experts the last such prediction for layer l picked for its
     * step pred_step[l] (2: not resident then, what a prefetch reads; 1: resident); when that
     * step begins, pf_right / pf_pred (halved past 64) count how many of the former it routed
     * to, a chunk counting at most K of them (scaled): a prompt's prediction names most
     * experts of a layer that starts empty, nearly all right, and counted in full it would
     * outweigh the decode steps' for long */
    uint8_t *pred;      /* [2][L * E] */
    int64_t *pred_step; /* [2][L] */
    float *pf_right, *pf_pred; /* [2][L] */
    /* what an eviction costs the layer: an evicted expert is watched (ev_step: the layer's
     * step when it was evicted, -1 none) until it is loaded again (it came back: ev_back),
     * or a demand load evicts another expert first or prefetch_window steps pass (it stayed
     * away: ev_away; both halved past 32). Came back: the eviction cost a read and a miss
     * that keeping the expert would have saved. A layer that holds nearly every expert its
     * tokens use gets nearly every evicted expert back */
    int64_t *ev_step;   /* [L * E] */
    float *ev_back, *ev_away; /* [L] */
    float *heat_sum;    /* [L] the layer's total heat: K times the tokens it stands for */
    /* storage idle time: demand counts the loads the forward waits for that the readers hold
     * (queued or being read); busy_ns the time within the current window (since win_ns) with
     * demand > 0, counted up to busy_since while it is; busy the share of time busy, averaged
     * over windows */
    int64_t demand, busy_since, busy_ns, win_ns;
    float busy;
    uint64_t tick;
    float decay;
    pthread_mutex_t mu;
    pthread_cond_t loaded; /* some load finished */
    int n_readers;
    clb_xreaders *pool;    /* loads the forward waits for first, then prefetches */
    int stuck;             /* a read ran past the timeout: its thread may never return */
    /* the slots' memory faulted in ahead of the reads (cfg.prefault), on a thread of its own:
     * bytes done of the total, whether it runs, was told to stop, and why it stopped early */
    pthread_t prefault_thread;
    int prefault_started, prefault_running, prefault_stop;
    int64_t prefault_done, prefault_total;
    char prefault_err[CLB_ERR_LEN];
    /* L+2 read-ahead (prefetch_depth 0: automatic): how long a reader's read takes and how
     * long a layer computes, both averaged (ns, 0 until measured) */
    int64_t read_ns, layer_ns, last_begin_ns, last_begin_l;
    int64_t stall_mark; /* the stall_ns of layer last_begin_l when it began */
    /* open expert files, shared by every loader: [L * E] fd or -1, reads holding it, its last
     * use; at most fd_cap open (more only while every open one is being read), the least
     * recently used unheld one closed first. Only readers open files, so the step never waits
     * on an open; a file replaced after it was opened is read as opened. */
    int *fd_of;
    int32_t *fd_ref;
    uint64_t *fd_use, fd_tick;
    int64_t fd_cap, fd_count;
    /* the running layer's wave: experts claimed for it ahead of their acquisition */
    int64_t wave;          /* current wave, counted up at each release */
    int64_t *wave_of;      /* [L * E] the wave that claimed the expert */
    uint8_t *plan_miss;    /* [L * E] claimed as a miss by the wave's plan, not acquired yet */
    int64_t *cur_start;    /* [E + 1] the running layer's rows per expert (e_start) */
    int64_t wave_s0;       /* the wave's first row, -1 before its first claim */
    int64_t *plan_i, *plan_old; /* [N] plan_wave's claims: slot, evicted expert */
    int failed;
    char fail_msg[CLB_ERR_LEN];
};

/* xread.c, called without the lock unless said otherwise */
int clb_xread_direct(const clb_xcache *xc); /* O_DIRECT reads (direct and uring) */
size_t clb_xread_slot_base(const clb_xcache *xc, int64_t idx);
int clb_xread_repacks(const clb_xcache *xc, int64_t idx);
void clb_xread_repack(clb_xcache *xc, int64_t idx, unsigned char *at, void *scratch);
/* *blocked: 1 nowait and storage would have to answer; 2 a prefetch read (abortable) stopped
 * for a load the forward waits for */
size_t clb_xread_expert(clb_xcache *xc, int64_t idx, clb_xslot *s, int loader, int nowait,
                        int repack, int abortable, int *blocked, char *msg);
int clb_xread_drop_mapped(clb_xcache *xc, int64_t idx, int nowait);

/* xcache.c, lock held */
int64_t clb_xc_pick_slot(const clb_xcache *xc, int64_t l);
int64_t clb_xc_claim(clb_xcache *xc, int64_t l, int64_t i, int64_t e, int prefetch);
/* abortable: a prefetch, stopped part-way (its slot freed, 0 returned) when a load the
 * forward waits for arrives meanwhile */
int clb_xc_load_claimed(clb_xcache *xc, int64_t l, int64_t i, int64_t old, int loader,
                        int nowait, int abortable);
/* the reader pool's callbacks (ctx: the cache) */
void clb_xc_reader_run(void *ctx, const clb_xjob *j, int loader);
void clb_xc_reader_prefetch(void *ctx, int32_t key, int loader);

#endif
