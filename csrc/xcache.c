/* Colibri expert cache: a fixed number of slots per layer holding routed experts, loaded on
 * demand for the forward pass (copied on its own thread when memory holds the expert, else by a
 * pool of reader threads it waits for, many reads in flight) and ahead of it by the same pool
 * (prefetch jobs, queued behind the loads the forward waits for).
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
 * Refuses: configs outside the ranges in clb_model.h; more pinned experts than a layer's slots
 * minus one. */
#define _GNU_SOURCE /* O_DIRECT, MADV_HUGEPAGE */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "clb_model_internal.h"
#include "clb_uring.h"
#include "clb_xcache.h"
#include "clb_util.h"

#define PAGE 4096u
#define HUGE_PAGE (2u << 20)
/* uring mode: each reader splits an expert's read into chunks of this size, up to URING_DEPTH
 * of them in flight (4 MiB a reader) */
#define URING_CHUNK (512u << 10)
#define URING_DEPTH 8u

enum { S_EMPTY = 0, S_LOADING = 1, S_READY = 2 };

typedef struct {
    int32_t owner;      /* expert of the slot's layer, -1 when empty */
    int8_t state;       /* S_* */
    uint8_t in_use;     /* acquired by the running wave */
    uint8_t prefetched; /* loaded as a prefetch and not acquired since */
    unsigned char *mem; /* slot memory; NULL with CLB_XC_MMAP */
    uint64_t last_use;
    int64_t pf_step;    /* prefetched for this step of its layer: kept until it passes */
} xslot;

typedef struct {
    int64_t l, i, old; /* a claimed load: layer, slot, the evicted expert's index or -1 */
    size_t got;        /* repack only: the bytes the forward's thread copied in */
    int repack;        /* 1: the copy is done, only the repack into the slot's layout is left */
} xjob;

typedef struct {
    struct clb_xcache *xc;
    int loader; /* 1..n_readers: its scratch and busy flag */
} xreader;

typedef struct {
    size_t lo, hi;         /* file span of the expert's three tensors */
    size_t rel[3];         /* offsets of w1, w3, w2 from lo */
    const void *mapped[3]; /* their data in the mappings */
} xspan;

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
    xslot *slots;       /* [L * N] */
    int32_t *slot_of;   /* [L * E] slot within its layer, -1: not resident */
    uint8_t *pinned;    /* [L * E] */
    float *heat;        /* [L * E] selections, decayed per token */
    int64_t *sel;       /* [L * E] selections since enable */
    xspan *span;        /* [L * E] */
    clb_tensor *tens;   /* [L * E * 3] the experts' tensors, data pointing into their slots */
    clb_xc_stats *st;   /* [L] */
    float *pf_good, *pf_bad; /* [L] recent prefetches used / evicted unused (halved at 32) */
    int64_t *pf_skips;  /* [L] requests skipped while the layer's prefetches mostly waste */
    int64_t *step;      /* [L] chunks the layer has begun */
    uint64_t tick;
    float decay;
    pthread_mutex_t mu;
    pthread_cond_t loaded; /* some load finished */
    pthread_cond_t work;   /* a job for the readers, or stop */
    int stop;
    /* the reader pool: claimed loads first (the forward waits for them), then prefetches */
    int n_readers, n_started;
    pthread_t *readers;  /* [n_readers] */
    xreader *rargs;      /* [n_readers] */
    xjob *jobs;          /* ring of claimed loads, [L * N] (a slot is claimed once at a time) */
    int64_t j_head, j_len;
    uint8_t *busy;       /* [1 + n_readers] loader inside a read */
    int stuck;           /* a read ran past the timeout: its thread may never return */
    /* open expert files, shared by every loader: [L * E] fd or -1, reads holding it, its last
     * use; at most fd_cap open (more only while every open one is being read), the least
     * recently used unheld one closed first. Only readers open files, so the step never waits
     * on an open; a file replaced after it was opened is read as opened. */
    int *fd_of;
    int32_t *fd_ref;
    uint64_t *fd_use, fd_tick;
    int64_t fd_cap, fd_count;
    int32_t *queue; /* prefetches: ring of l * E + e, [L * E] */
    uint8_t *queued;
    int64_t q_head, q_len;
    /* the running layer's wave: experts claimed for it ahead of their acquisition */
    int64_t wave;          /* current wave, counted up at each release */
    int64_t *wave_of;      /* [L * E] the wave that claimed the expert */
    uint8_t *plan_miss;    /* [L * E] claimed as a miss by the wave's plan, not acquired yet */
    int64_t *take_t0;      /* [L * E] taken while loading: when its wait began (stall time) */
    int64_t *cur_start;    /* [E + 1] the running layer's rows per expert (e_start) */
    int64_t wave_s0;       /* the wave's first row, -1 before its first claim */
    int64_t *plan_i, *plan_old; /* [N] plan_wave's claims: slot, evicted expert */
    int failed;
    char fail_msg[CLB_ERR_LEN];
};

static size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

/* ---- reading ----------------------------------------------------------------------------- */

/* O_DIRECT reads (direct and uring) into the slots. */
static int is_direct(const clb_xcache *xc) {
    return xc->cfg.load == CLB_XC_DIRECT || xc->cfg.load == CLB_XC_URING;
}

/* O_DIRECT reads start at the page holding the span's first byte. */
static size_t direct_start(const xspan *sp) { return sp->lo / PAGE * PAGE; }

/* The expert's tensors whose slot type is interleaved (set at enable) go from the file's rows
 * to that layout in the slot itself (at: the span's first byte there), through the loader's
 * scratch (8 rows of the largest such matrix, sized at enable). */
static void repack_slot(clb_xcache *xc, int64_t idx, unsigned char *at, void *scratch) {
    const clb_tensor *t = &xc->tens[idx * 3];
    for (int j = 0; j < 3; j++) {
        clb_type b = clb_x8_base(t[j].type);
        if (b != t[j].type)
            clb_repack_x8_inplace(b, t[j].shape[1], t[j].shape[0], at + xc->span[idx].rel[j],
                                  scratch);
    }
}

/* Opens an expert file for reading without ever waiting: O_NONBLOCK so that a FIFO or a
 * device put in its place fails here instead of blocking a reader
 * until something writes to it; anything but a regular file is refused. -1 with msg set. */
static int open_expert_file(const char *path, int extra_flags, char *msg) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY | extra_flags);
    if (fd < 0) {
        clb_set_err(msg, "weight file changed: %s cannot be opened any more: %s", path,
                    strerror(errno));
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        clb_set_err(msg, "weight file changed: %s is no longer a regular file; restart to load "
                    "the model again", path);
        close(fd);
        return -1;
    }
    return fd;
}

/* Whether every page of the mapped span [a, a + len) is in memory (mmap mode). */
static int span_resident(uintptr_t a, size_t len) {
    uintptr_t p0 = a / PAGE * PAGE, p1 = round_up(a + len, PAGE);
    unsigned char vec[256];
    for (uintptr_t p = p0; p < p1; p += sizeof vec * PAGE) {
        size_t n = (p1 - p) / PAGE < sizeof vec ? (p1 - p) / PAGE : sizeof vec;
        if (mincore((void *)p, n * PAGE, vec) != 0) return 0;
        for (size_t k = 0; k < n; k++)
            if (!(vec[k] & 1)) return 0;
    }
    return 1;
}

/* The open file of expert idx with a read's hold on it (fd_put after the read): opened and
 * kept unless nowait, then -1 when it is not open yet. The open itself runs without the lock
 * (it may wait on storage); two loaders opening the same file at once keep one. Past fd_cap
 * open files the least recently used one no read holds is closed. -1 with msg set when the
 * open fails. Called without the lock. */
static int expert_fd(clb_xcache *xc, int64_t idx, int nowait, int flags, char *msg) {
    pthread_mutex_lock(&xc->mu);
    int fd = xc->fd_of[idx];
    if (fd >= 0) {
        xc->fd_ref[idx]++;
        xc->fd_use[idx] = ++xc->fd_tick;
    }
    pthread_mutex_unlock(&xc->mu);
    if (fd >= 0 || nowait) return fd;
    int mine = open_expert_file(clb_wfile_path(xc->m->expert_files[idx]), flags, msg);
    if (mine < 0) return -1;
    pthread_mutex_lock(&xc->mu);
    if (xc->fd_of[idx] >= 0) { /* another loader opened it meanwhile */
        fd = xc->fd_of[idx];
    } else {
        if (xc->fd_count >= xc->fd_cap) {
            int64_t lru = -1;
            for (int64_t j = 0; j < xc->L * xc->E; j++)
                if (xc->fd_of[j] >= 0 && xc->fd_ref[j] == 0 &&
                    (lru < 0 || xc->fd_use[j] < xc->fd_use[lru]))
                    lru = j;
            if (lru >= 0) {
                close(xc->fd_of[lru]);
                xc->fd_of[lru] = -1;
                xc->fd_count--;
            }
        }
        xc->fd_of[idx] = fd = mine;
        mine = -1;
        xc->fd_count++;
    }
    xc->fd_ref[idx]++;
    xc->fd_use[idx] = ++xc->fd_tick;
    pthread_mutex_unlock(&xc->mu);
    if (mine >= 0) close(mine);
    return fd;
}

/* Ends a read's hold on expert idx's file (from expert_fd). */
static void fd_put(clb_xcache *xc, int64_t idx) {
    pthread_mutex_lock(&xc->mu);
    xc->fd_ref[idx]--;
    pthread_mutex_unlock(&xc->mu);
}

/* Loads expert idx into slot s (owned by the caller, state loading), repacking through the
 * loader's scratch. Returns the bytes read, or 0 with msg set. Called without the lock.
 * nowait: only from what memory already holds (the page cache, RWF_NOWAIT; in mmap mode
 * pages mincore finds resident); where storage would have to answer it returns 0 with
 * *blocked set and no message, and the caller hands the load to the readers. */
static size_t read_expert(clb_xcache *xc, int64_t idx, xslot *s, int loader, int nowait,
                          int repack, int *blocked, char *msg) {
    const xspan *sp = &xc->span[idx];
    const char *path = clb_wfile_path(xc->m->expert_files[idx]);
    size_t len = sp->hi - sp->lo;
    *blocked = 0;
    if (nowait && (is_direct(xc) ||
                   (xc->cfg.load == CLB_XC_MMAP &&
                    !span_resident((uintptr_t)sp->mapped[0] - sp->rel[0], len)))) {
        *blocked = 1;
        return 0;
    }
    if (xc->cfg.load == CLB_XC_MMAP) {
        uintptr_t a = (uintptr_t)sp->mapped[0] - (sp->rel[0]);
        uintptr_t p0 = a / PAGE * PAGE, p1 = round_up(a + len, PAGE);
        madvise((void *)p0, p1 - p0, MADV_WILLNEED);
        unsigned sum = 0;
        for (uintptr_t p = a; p < a + len; p = (p / PAGE + 1) * PAGE)
            sum += *(const volatile unsigned char *)p;
        (void)sum;
        return len; /* a file cut short reads as zeros and is reported after the step */
    }
    int direct = is_direct(xc);
    int fd = expert_fd(xc, idx, nowait, direct ? O_DIRECT : 0, msg);
    if (fd < 0) {
        *blocked = nowait;
        return 0;
    }
    size_t off = direct ? direct_start(sp) : sp->lo;
    size_t need = sp->hi - off, want = direct ? round_up(need, PAGE) : need, got = 0;
    int again = 0;
    clb_uring *ring = xc->rings ? xc->rings[loader] : NULL;
    if (ring && !nowait) { /* the whole span in chunks, all in flight */
        int64_t r = clb_uring_read(ring, fd, s->mem, want, (off_t)off, URING_CHUNK);
        if (r < 0) {
            clb_set_err(msg, "%s: read failed: %s", path, strerror((int)-r));
            fd_put(xc, idx);
            return 0;
        }
        got = (size_t)r;
    }
    while (!ring && got < want) {
        struct iovec iov = {.iov_base = s->mem + got, .iov_len = want - got};
        ssize_t r = nowait ? preadv2(fd, &iov, 1, (off_t)(off + got), RWF_NOWAIT)
                           : pread(fd, iov.iov_base, iov.iov_len, (off_t)(off + got));
        if (r < 0 && errno == EINTR) continue;
        /* EAGAIN: pages not in the page cache, or a readahead mark the kernel clears as it
         * answers (so one more try); a file system without RWF_NOWAIT: the reader reads */
        if (nowait && r < 0 && errno == EAGAIN && !again++) continue;
        if (nowait && r < 0 && (errno == EAGAIN || errno == EOPNOTSUPP || errno == ENOSYS)) {
            *blocked = 1;
            fd_put(xc, idx);
            return 0;
        }
        if (r < 0) {
            const char *hint = direct && errno == EINVAL
                                   ? " (this file system refuses O_DIRECT reads; use another "
                                     "expert load mode)"
                                   : "";
            clb_set_err(msg, "%s: read failed: %s%s", path, strerror(errno), hint);
            fd_put(xc, idx);
            return 0;
        }
        if (r == 0) break;
        got += (size_t)r;
        again = 0;
    }
    fd_put(xc, idx);
    if (got < need) {
        clb_set_err(msg, "weight file changed: %s is shorter than when the model was loaded "
                    "(truncated or overwritten); restart to load it again", path);
        return 0;
    }
    if (repack) repack_slot(xc, idx, s->mem + (sp->lo - off), xc->scratch[loader]);
    return got;
}

/* Whether any of expert idx's tensors is repacked into the slot after its read. */
static int expert_repacks(const clb_xcache *xc, int64_t idx) {
    for (int j = 0; j < 3; j++)
        if (clb_x8_base(xc->tens[idx * 3 + j].type) != xc->tens[idx * 3 + j].type) return 1;
    return 0;
}

/* Where expert idx's span starts in its slot (O_DIRECT reads start on the page before). */
static size_t slot_base(const clb_xcache *xc, int64_t idx) {
    return is_direct(xc) ? xc->span[idx].lo - direct_start(&xc->span[idx]) : 0;
}

/* Drops an evicted expert's pages from memory (mmap mode; the other modes reuse the slot).
 * nowait: only through a file already open; 0 when it is not (the reader drops it then). */
static int drop_mapped(clb_xcache *xc, int64_t idx, int nowait) {
    const xspan *sp = &xc->span[idx];
    char ignored[CLB_ERR_LEN];
    int fd = expert_fd(xc, idx, nowait, 0, ignored);
    if (fd < 0 && nowait) return 0;
    uintptr_t a = (uintptr_t)sp->mapped[0] - sp->rel[0];
    uintptr_t p0 = round_up(a, PAGE), p1 = (a + (sp->hi - sp->lo)) / PAGE * PAGE;
    if (p1 > p0) madvise((void *)p0, p1 - p0, MADV_DONTNEED);
    if (fd >= 0) {
        posix_fadvise(fd, (off_t)sp->lo, (off_t)(sp->hi - sp->lo), POSIX_FADV_DONTNEED);
        fd_put(xc, idx);
    }
    return 1;
}

/* ---- slot bookkeeping (lock held) ------------------------------------------------------ */

/* A slot of layer l that may take a new expert: an empty one, else the resident, unpinned,
 * unused expert with the least heat, the least recently used on ties; -1 if none. */
static int64_t pick_slot_among(const clb_xcache *xc, int64_t l, int spare_prefetched) {
    int64_t best = -1;
    for (int64_t i = 0; i < xc->N; i++) {
        const xslot *s = &xc->slots[l * xc->N + i];
        if (s->state == S_EMPTY) return i;
        if (s->state != S_READY || s->in_use || xc->pinned[l * xc->E + s->owner]) continue;
        if (spare_prefetched && s->prefetched && s->pf_step >= xc->step[l]) continue;
        if (best < 0) {
            best = i;
            continue;
        }
        const xslot *b = &xc->slots[l * xc->N + best];
        float hs = xc->heat[l * xc->E + s->owner], hb = xc->heat[l * xc->E + b->owner];
        if (hs < hb || (hs == hb && s->last_use < b->last_use)) best = i;
    }
    return best;
}

/* A prefetched expert has no heat yet: it is spared until the step it was read for has
 * begun (or no other slot is free), so a miss of that step does not evict it first. */
static int64_t pick_slot(const clb_xcache *xc, int64_t l) {
    int64_t i = pick_slot_among(xc, l, 1);
    return i >= 0 ? i : pick_slot_among(xc, l, 0);
}

/* Records whether a prefetch of layer l was used; the last few dozen outcomes decide
 * whether the layer's predictions are worth their reads (see clb_xc_prefetch). */
static void pf_outcome(clb_xcache *xc, int64_t l, int used) {
    if (used)
        xc->pf_good[l] += 1.0f;
    else
        xc->pf_bad[l] += 1.0f;
    if (xc->pf_good[l] + xc->pf_bad[l] > 32.0f) {
        xc->pf_good[l] *= 0.5f;
        xc->pf_bad[l] *= 0.5f;
    }
}

/* Takes slot i of layer l for expert e (state loading); returns the evicted expert's index
 * (l * E + old) or -1. */
static int64_t claim(clb_xcache *xc, int64_t l, int64_t i, int64_t e, int prefetch) {
    xslot *s = &xc->slots[l * xc->N + i];
    int64_t old = -1;
    if (s->state == S_READY) {
        old = l * xc->E + s->owner;
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
    s->state = S_LOADING;
    s->prefetched = (uint8_t)prefetch;
    s->pf_step = xc->step[l] + 1; /* the prefetch of layer l is for its next chunk */
    xc->slot_of[l * xc->E + e] = (int32_t)i;
    xc->st[l].loads++;
    if (prefetch) xc->st[l].prefetch_issued++;
    return old;
}

/* Publishes a finished load (got > 0) or frees the slot after a failed one. */
static void finish(clb_xcache *xc, int64_t l, int64_t i, size_t got, const char *msg) {
    xslot *s = &xc->slots[l * xc->N + i];
    int64_t idx = l * xc->E + s->owner;
    if (got == 0) {
        xc->slot_of[idx] = -1;
        s->owner = -1;
        s->state = S_EMPTY;
        s->in_use = 0;
        s->prefetched = 0;
        if (!xc->failed) {
            xc->failed = 1;
            snprintf(xc->fail_msg, sizeof xc->fail_msg, "%s", msg);
        }
    } else {
        if (xc->cfg.load != CLB_XC_MMAP) {
            size_t base = slot_base(xc, idx);
            for (int j = 0; j < 3; j++)
                xc->tens[idx * 3 + j].data = s->mem + base + xc->span[idx].rel[j];
        }
        s->state = S_READY;
        s->last_use = ++xc->tick;
        xc->st[l].bytes_read += (int64_t)got;
    }
    pthread_cond_broadcast(&xc->loaded);
}

/* Loads expert e of layer l into slot i that the caller just claimed (lock held on entry and
 * exit, released while reading); loader 0 is the forward's own thread, 1..n_readers the
 * readers. nowait (the forward's thread): only from what memory holds, through files already
 * open; returns -1 when storage would have to answer (or a file be opened), the slot still
 * claimed, for a reader to load. Else 1 loaded (on the forward's thread: copied, and maybe
 * still loading while a reader repacks it), 0 failed. */
static void push_job(clb_xcache *xc, int64_t l, int64_t i, int64_t old, size_t repack_got);

static int load_claimed(clb_xcache *xc, int64_t l, int64_t i, int64_t old, int loader,
                        int nowait) {
    xslot *s = &xc->slots[l * xc->N + i];
    int64_t idx = l * xc->E + s->owner;
    char msg[CLB_ERR_LEN];
    int blocked;
    xc->busy[loader] = 1;
    pthread_mutex_unlock(&xc->mu);
    size_t got = 0;
    blocked = old >= 0 && xc->cfg.load == CLB_XC_MMAP && !drop_mapped(xc, old, nowait);
    /* a copy on the forward's thread leaves the repack to a reader (when there is one): the
     * forward goes on copying (or computing) while the readers repack */
    int defer = nowait && loader == 0 && xc->n_started > 0 && xc->cfg.load != CLB_XC_MMAP &&
                expert_repacks(xc, idx);
    if (!blocked) got = read_expert(xc, idx, s, loader, nowait, !defer, &blocked, msg);
    pthread_mutex_lock(&xc->mu);
    xc->busy[loader] = 0;
    if (blocked) return -1;
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
    const xslot *s = &xc->slots[l * xc->N + i];
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

/* Hands a claimed load to the readers, ahead of every prefetch (lock held); repack_got > 0:
 * its bytes are in the slot already, only the repack is left. */
static void push_job(clb_xcache *xc, int64_t l, int64_t i, int64_t old, size_t repack_got) {
    const int64_t cap = xc->L * xc->N;
    /* each job holds a slot in state loading, claimed once: the ring never overflows */
    if (xc->j_len >= cap) abort();
    xjob *j = &xc->jobs[(xc->j_head + xc->j_len) % cap];
    j->l = l;
    j->i = i;
    j->old = old;
    j->got = repack_got;
    j->repack = repack_got > 0;
    xc->j_len++;
    if (!j->repack) xc->st[l].reader_loads++;
    pthread_cond_signal(&xc->work);
}

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
        i = pick_slot(xc, l);
        if (i < 0) break;
        int64_t old = claim(xc, l, i, e, 0);
        xc->slots[l * N + i].in_use = 1;
        xc->wave_of[idx] = xc->wave;
        xc->plan_miss[idx] = 1;
        xc->st[l].misses++;
        xc->plan_i[n] = i;
        xc->plan_old[n++] = old;
    }
    for (int64_t k = 0; k < n && !xc->failed; k++)
        if (load_claimed(xc, l, xc->plan_i[k], xc->plan_old[k], 0, 1) < 0)
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
            xslot *s = &xc->slots[l * xc->N + i];
            s->in_use = 1;
            if (s->state == S_READY) {
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
             * it is the wave's, clb_xc_wait waits for it */
            if (!t0) {
                t0 = clb_now_ns();
                xc->st[l].misses++;
                if (s->prefetched) xc->st[l].prefetch_late++;
            }
            xc->take_t0[idx] = t0;
            pthread_mutex_unlock(&xc->mu);
            return 2;
        }
        i = pick_slot(xc, l);
        if (i < 0) {
            if (!wave_empty(xc, l)) {
                pthread_mutex_unlock(&xc->mu);
                return 0;
            }
            if (!t0) t0 = clb_now_ns();
            /* every free slot is loading: wait, at most the timeout */
            if (!deadline) deadline = clb_now_ns() + xc->cfg.read_timeout_ms * 1000000;
            if (!wait_loaded(xc, deadline)) {
                for (i = 0; i < xc->N && xc->slots[l * xc->N + i].state != S_LOADING; i++) {
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
         * the readers, and the loop above then hands it to clb_xc_wait like any other load */
        int64_t old = claim(xc, l, i, e, 0);
        xc->slots[l * xc->N + i].in_use = 1;
        xc->wave_of[idx] = xc->wave;
        int done = load_claimed(xc, l, i, old, 0, 1);
        if (done == 0) break;
        if (done < 0) push_job(xc, l, i, old, 0);
    }
    pthread_mutex_unlock(&xc->mu);
    *st = CLB_E_IO;
    return -1;
}

int clb_xc_wait(clb_xcache *xc, int64_t l, int64_t e, clb_status *st) {
    const int64_t idx = l * xc->E + e;
    pthread_mutex_lock(&xc->mu);
    const int64_t deadline = clb_now_ns() + xc->cfg.read_timeout_ms * 1000000;
    for (;;) {
        int64_t i = xc->slot_of[idx];
        if (xc->failed || i < 0) break; /* a failed load freed its slot */
        xslot *s = &xc->slots[l * xc->N + i];
        if (s->state == S_READY) {
            xc->st[l].stall_ns += clb_now_ns() - xc->take_t0[idx];
            if (s->prefetched) {
                xc->st[l].prefetch_used++;
                pf_outcome(xc, l, 1);
            }
            s->prefetched = 0;
            s->last_use = ++xc->tick;
            pthread_mutex_unlock(&xc->mu);
            return 1;
        }
        if (!wait_loaded(xc, deadline)) {
            timed_out(xc, l, i);
            break;
        }
    }
    pthread_mutex_unlock(&xc->mu);
    *st = CLB_E_IO;
    return -1;
}

int clb_xc_acquire(clb_xcache *xc, int64_t l, int64_t e, clb_status *st) {
    int r = clb_xc_take(xc, l, e, st);
    return r == 2 ? clb_xc_wait(xc, l, e, st) : r;
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

void clb_xc_begin_layer(clb_xcache *xc, int64_t l, const int64_t *e_start) {
    const int64_t E = xc->E;
    int64_t rows = e_start[E] - e_start[0];
    int64_t tokens = rows / xc->m->hp.n_expert_used;
    float d = powf(xc->decay, (float)tokens);
    pthread_mutex_lock(&xc->mu);
    xc->step[l]++;
    memcpy(xc->cur_start, e_start, (size_t)(E + 1) * sizeof(int64_t));
    for (int64_t e = 0; e < E; e++) {
        int64_t c = e_start[e + 1] - e_start[e];
        xc->heat[l * E + e] = xc->heat[l * E + e] * d + (float)c;
        xc->sel[l * E + e] += c;
    }
    /* what is still queued for this layer is late: the forward pass loads its misses itself */
    int64_t cap = xc->L * E, kept = 0;
    for (int64_t k = 0; k < xc->q_len; k++) {
        int32_t v = xc->queue[(xc->q_head + k) % cap];
        if (v / E == l) {
            xc->queued[v] = 0;
            xc->st[l].prefetch_cancelled++;
            continue;
        }
        xc->queue[(xc->q_head + kept) % cap] = v;
        kept++;
    }
    xc->q_len = kept;
    pthread_mutex_unlock(&xc->mu);
}

void clb_xc_prefetch(clb_xcache *xc, int64_t l, const int32_t *ids, int64_t n) {
    if (!xc->cfg.prefetch) return;
    const int64_t cap = xc->L * xc->E;
    pthread_mutex_lock(&xc->mu);
    /* a layer whose prefetches are mostly evicted unused (predictions that miss, or a budget
     * too small to hold them) reads ahead only one step in eight, to notice when that
     * changes */
    if (xc->pf_bad[l] > xc->pf_good[l] && xc->pf_skips[l]++ % 8 != 0) {
        pthread_mutex_unlock(&xc->mu);
        return;
    }
    int added = 0;
    for (int64_t k = 0; k < n; k++) {
        int64_t idx = l * xc->E + ids[k];
        if (xc->slot_of[idx] >= 0 || xc->queued[idx] || xc->q_len >= cap) continue;
        xc->queued[idx] = 1;
        xc->queue[(xc->q_head + xc->q_len) % cap] = (int32_t)idx;
        xc->q_len++;
        added = 1;
    }
    if (added) pthread_cond_broadcast(&xc->work); /* as many readers as there are reads */
    pthread_mutex_unlock(&xc->mu);
}

int clb_xc_prefetching(const clb_xcache *xc) { return xc && xc->cfg.prefetch; }

clb_status clb_xc_failed(const clb_xcache *xc, char *err) {
    if (!xc) return CLB_OK;
    pthread_mutex_lock((pthread_mutex_t *)&xc->mu);
    int failed = xc->failed;
    if (failed) clb_set_err(err, "%s", xc->fail_msg);
    pthread_mutex_unlock((pthread_mutex_t *)&xc->mu);
    return failed ? CLB_E_IO : CLB_OK;
}

/* ---- reader pool ------------------------------------------------------------------------ */

/* A reader: the loads the forward pass waits for, in the order claimed, then prefetches, each
 * claimed here when it starts (skipped when its expert got resident or claimed meanwhile). */
static void *reader_main(void *arg) {
    const xreader *rd = arg;
    clb_xcache *xc = rd->xc;
    const int64_t cap = xc->L * xc->E, jcap = xc->L * xc->N;
    pthread_mutex_lock(&xc->mu);
    for (;;) {
        while (!xc->stop && xc->j_len == 0 && xc->q_len == 0)
            pthread_cond_wait(&xc->work, &xc->mu);
        if (xc->stop) break;
        if (xc->j_len > 0) {
            xjob j = xc->jobs[xc->j_head];
            xc->j_head = (xc->j_head + 1) % jcap;
            xc->j_len--;
            if (j.repack) {
                xslot *s = &xc->slots[j.l * xc->N + j.i];
                int64_t idx = j.l * xc->E + s->owner;
                pthread_mutex_unlock(&xc->mu);
                repack_slot(xc, idx, s->mem + slot_base(xc, idx), xc->scratch[rd->loader]);
                pthread_mutex_lock(&xc->mu);
                finish(xc, j.l, j.i, j.got, "");
            } else {
                load_claimed(xc, j.l, j.i, j.old, rd->loader, 0);
            }
            continue;
        }
        int32_t idx = xc->queue[xc->q_head];
        xc->q_head = (xc->q_head + 1) % cap;
        xc->q_len--;
        xc->queued[idx] = 0;
        int64_t l = idx / xc->E, e = idx % xc->E;
        if (xc->failed || xc->slot_of[idx] >= 0) continue;
        int64_t i = pick_slot(xc, l);
        if (i < 0) continue;
        int64_t old = claim(xc, l, i, e, 1);
        load_claimed(xc, l, i, old, rd->loader, 0);
    }
    pthread_mutex_unlock(&xc->mu);
    return NULL;
}

/* ---- setup ------------------------------------------------------------------------------- */

/* Dense layers have no experts: their entries of m->experts stay empty. */
static int has_expert(const clb_model *m, int64_t idx) { return m->experts[idx].w1 != NULL; }

static void span_of(const clb_model *m, int64_t idx, xspan *sp) {
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

size_t clb_expert_bytes(const clb_model *m) {
    size_t mx = 0;
    for (int64_t idx = 0; idx < m->hp.n_layer * m->hp.n_expert; idx++) {
        xspan sp;
        if (!has_expert(m, idx)) continue;
        span_of(m, idx, &sp);
        if (sp.hi - sp.lo > mx) mx = sp.hi - sp.lo;
    }
    return mx;
}

void clb_xc_free(clb_xcache *xc) {
    if (!xc) return;
    pthread_mutex_lock(&xc->mu);
    xc->stop = 1;
    pthread_cond_broadcast(&xc->work);
    /* a thread stuck in a read that ran past the timeout may never come back: it keeps the
     * cache (it writes into a slot and takes the lock when its read ends), so nothing is freed.
     * The others finish the read they are in (a bounded one) and stop. */
    int abandon = 0;
    for (int k = 0; xc->stuck && xc->busy && k <= xc->n_readers; k++) abandon |= xc->busy[k];
    pthread_mutex_unlock(&xc->mu);
    if (abandon) {
        for (int k = 0; k < xc->n_started; k++) pthread_detach(xc->readers[k]);
        return;
    }
    for (int k = 0; k < xc->n_started; k++) pthread_join(xc->readers[k], NULL);
    pthread_cond_destroy(&xc->work);
    pthread_cond_destroy(&xc->loaded);
    pthread_mutex_destroy(&xc->mu);
    if (xc->region) munmap(xc->region, xc->region_len);
    for (int k = 0; xc->scratch && k <= xc->n_readers; k++) free(xc->scratch[k]);
    for (int k = 0; xc->rings && k <= xc->n_readers; k++) clb_uring_free(xc->rings[k]);
    free(xc->rings);
    free(xc->scratch);
    free(xc->readers);
    free(xc->rargs);
    free(xc->jobs);
    free(xc->busy);
    free(xc->wave_of);
    free(xc->plan_miss);
    free(xc->take_t0);
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
    free(xc->st);
    free(xc->queue);
    free(xc->queued);
    free(xc->pf_good);
    free(xc->pf_bad);
    free(xc->pf_skips);
    free(xc->step);
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
        cfg->read_timeout_ms > 86400000 || cfg->readers < 0 || cfg->readers > 64) {
        clb_set_err(err,
                    "expert cache: %lld slots per layer must be in 1..%lld (load mode %d, "
                    "prefetch window %lld, %d readers: 1..64)", (long long)cfg->per_layer,
                    (long long)E, (int)cfg->load, (long long)cfg->prefetch_window,
                    (int)cfg->readers);
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
    pthread_cond_init(&xc->work, NULL);
    if (xc->cfg.read_timeout_ms == 0) xc->cfg.read_timeout_ms = 30000;
    if (xc->cfg.readers == 0) xc->cfg.readers = 4;
    const int R = xc->cfg.readers;
    xc->n_readers = R;
    xc->wave_s0 = -1;
    size_t LE = (size_t)(L * E);
    xc->slots = calloc((size_t)(L * N), sizeof(xslot));
    xc->slot_of = malloc(LE * sizeof(int32_t));
    xc->pinned = calloc(LE, 1);
    xc->heat = calloc(LE, sizeof(float));
    xc->sel = calloc(LE, sizeof(int64_t));
    xc->span = calloc(LE, sizeof(xspan));
    xc->tens = calloc(LE * 3, sizeof(clb_tensor));
    xc->st = calloc((size_t)L, sizeof(clb_xc_stats));
    xc->queue = calloc(LE, sizeof(int32_t));
    xc->queued = calloc(LE, 1);
    xc->pf_good = calloc((size_t)L, sizeof(float));
    xc->pf_bad = calloc((size_t)L, sizeof(float));
    xc->pf_skips = calloc((size_t)L, sizeof(int64_t));
    xc->step = calloc((size_t)L, sizeof(int64_t));
    xc->fd_of = malloc(LE * sizeof(int));
    xc->fd_use = calloc(LE, sizeof(uint64_t));
    xc->fd_ref = calloc(LE, sizeof(int32_t));
    xc->scratch = calloc((size_t)R + 1, sizeof(void *));
    xc->readers = calloc((size_t)R, sizeof(pthread_t));
    xc->rargs = calloc((size_t)R, sizeof(xreader));
    xc->jobs = calloc((size_t)(L * N), sizeof(xjob));
    xc->busy = calloc((size_t)R + 1, 1);
    xc->wave_of = malloc(LE * sizeof(int64_t));
    xc->plan_miss = calloc(LE, 1);
    xc->take_t0 = calloc(LE, sizeof(int64_t));
    xc->cur_start = calloc((size_t)E + 1, sizeof(int64_t));
    xc->plan_i = calloc((size_t)N, sizeof(int64_t));
    xc->plan_old = calloc((size_t)N, sizeof(int64_t));
    for (size_t j = 0; xc->wave_of && j < LE; j++) xc->wave_of[j] = -1;
    for (size_t j = 0; xc->fd_of && j < LE; j++) xc->fd_of[j] = -1;
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
        !xc->slot_of || !xc->pinned || !xc->heat || !xc->sel || !xc->span || !xc->tens ||
        !xc->st || !xc->queue || !xc->queued || !xc->fd_of || !xc->fd_use || !xc->fd_ref ||
        !xc->scratch || !xc->readers || !xc->rargs || !xc->jobs || !xc->busy || !xc->wave_of ||
        !xc->plan_miss || !xc->take_t0 || !xc->cur_start || !xc->plan_i || !xc->plan_old) {
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
        size_t need = is_direct(xc) ? span_max + 2 * PAGE : span_max;
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
            if (!(xc->rings[k] = clb_uring_init(URING_DEPTH, why, sizeof why))) break;
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
            if (clb_tensor_repacks(c)) c->type = clb_x8_type(c->type);
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
                int64_t i = pick_slot(xc, l); /* an empty slot: fewer pinned than slots */
                int64_t old = claim(xc, l, i, e, 0);
                if (load_claimed(xc, l, i, old, 0, 0) == 0) {
                    clb_set_err(err, "%s", xc->fail_msg);
                    pthread_mutex_unlock(&xc->mu);
                    return CLB_E_IO; /* m->xc stays: the model frees it */
                }
                xc->pinned[l * E + e] = 1;
            }
        memset(xc->st, 0, (size_t)L * sizeof(clb_xc_stats));
        pthread_mutex_unlock(&xc->mu);
    }
    for (int k = 0; k < R; k++) {
        xc->rargs[k].xc = xc;
        xc->rargs[k].loader = k + 1;
        if (pthread_create(&xc->readers[k], NULL, reader_main, &xc->rargs[k]) != 0) {
            clb_set_err(err, "cannot start the expert reader threads (%d of %d started)", k,
                        R);
            return CLB_E_NOMEM; /* m->xc stays: the model frees it, joining those started */
        }
        xc->n_started = k + 1;
    }
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
                const xslot *sl = &xc->slots[(idx / xc->E) * xc->N + i];
                s = sl->state == S_LOADING ? 1 : xc->pinned[idx] ? 3 : 2;
            }
            state[idx] = s;
        }
    pthread_mutex_unlock(&xc->mu);
    return 1;
}
