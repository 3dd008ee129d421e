/* Colibri expert cache reads: one expert's three matrices from its file into its slot (pread,
 * O_DIRECT, io_uring or the mapping itself), repacked there into the layout the kernels read.
 * Guarantees: files are opened like every weight file (regular files only, non-blocking, no
 * controlling terminal); each read is bounded by the expert's span; a short read names the file;
 * nowait reads take only what memory already holds and never wait on storage.
 * Refuses: anything but a regular file; O_DIRECT where the file system does not allow it. */
#define _GNU_SOURCE /* O_DIRECT, RWF_NOWAIT */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include "clb_util.h"
#include "clb_xcache_internal.h"

#define PAGE CLB_XC_PAGE

static size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

/* O_DIRECT reads (direct and uring) into the slots. */
int clb_xread_direct(const clb_xcache *xc) {
    return xc->cfg.load == CLB_XC_DIRECT || xc->cfg.load == CLB_XC_URING;
}

/* O_DIRECT reads start at the page holding the span's first byte. */
static size_t direct_start(const clb_xspan *sp) { return sp->lo / PAGE * PAGE; }

/* The expert's tensors whose slot type is interleaved (set at enable) go from the file's rows
 * to that layout in the slot itself (at: the span's first byte there), through the loader's
 * scratch (8 rows of the largest such matrix, sized at enable). */
void clb_xread_repack(clb_xcache *xc, int64_t idx, unsigned char *at, void *scratch) {
    const clb_tensor *t = &xc->tens[idx * 3];
    for (int j = 0; j < 3; j++)
        if (xc->repack[idx * 3 + j])
            clb_repack_x8_inplace(clb_x8_base(t[j].type), t[j].shape[1], t[j].shape[0],
                                  at + xc->span[idx].rel[j], scratch);
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
/* Whether a prefetch read into slot s should stop now (lock held): a load the forward waits
 * for is queued for a reader (every reader is busy) and s is not one of the running wave's.
 * Stopping frees the slot (the expert it evicted is gone), so a read that merely shares the
 * storage with demand loads goes on: those are kept from starting instead. */
static int prefetch_yields(const clb_xcache *xc, const clb_xslot *s) {
    return xc->failed || (clb_xreaders_waiting(xc->pool) > 0 && !s->in_use);
}

static void fd_put(clb_xcache *xc, int64_t idx) {
    pthread_mutex_lock(&xc->mu);
    xc->fd_ref[idx]--;
    pthread_mutex_unlock(&xc->mu);
}

/* Loads expert idx into slot s (owned by the caller, state loading), repacking through the
 * loader's scratch. Returns the bytes read, or 0 with msg set. Called without the lock.
 * nowait: only from what memory already holds (the page cache, RWF_NOWAIT; in mmap mode
 * pages mincore finds resident); where storage would have to answer it returns 0 with
 * *blocked set and no message, and the caller hands the load to the readers. abortable (a
 * prefetch; pread and direct): read in CLB_XC_PF_CHUNK pieces, and where the cache says so
 * between two, stopped with *blocked 2, returning the bytes read so far. */
size_t clb_xread_expert(clb_xcache *xc, int64_t idx, clb_xslot *s, int loader, int nowait,
                        int repack, int abortable, int *blocked, char *msg) {
    const clb_xspan *sp = &xc->span[idx];
    const char *path = clb_wfile_path(xc->m->expert_files[idx]);
    size_t len = sp->hi - sp->lo;
    *blocked = 0;
    if (nowait && (clb_xread_direct(xc) ||
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
    int direct = clb_xread_direct(xc);
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
        int64_t r = clb_uring_read(ring, fd, s->mem, want, (off_t)off, CLB_XC_URING_CHUNK);
        if (r < 0) {
            clb_set_err(msg, "%s: read failed: %s", path, strerror((int)-r));
            fd_put(xc, idx);
            return 0;
        }
        got = (size_t)r;
    }
    while (!ring && got < want) {
        /* a prefetch reads in chunks and stops between two when a load the forward waits for
         * arrives: it never holds the storage against one for a whole expert */
        if (abortable && got > 0) {
            pthread_mutex_lock(&xc->mu);
            int yield = prefetch_yields(xc, s);
            pthread_mutex_unlock(&xc->mu);
            if (yield) {
                *blocked = 2;
                fd_put(xc, idx);
                return got;
            }
        }
        size_t part = abortable && want - got > CLB_XC_PF_CHUNK ? CLB_XC_PF_CHUNK : want - got;
        struct iovec iov = {.iov_base = s->mem + got, .iov_len = part};
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
    if (repack) clb_xread_repack(xc, idx, s->mem + (sp->lo - off), xc->scratch[loader]);
    return got;
}

/* Whether any of expert idx's tensors is repacked into the slot after its read. */
int clb_xread_repacks(const clb_xcache *xc, int64_t idx) {
    for (int j = 0; j < 3; j++)
        if (xc->repack[idx * 3 + j]) return 1;
    return 0;
}

/* Where expert idx's span starts in its slot (O_DIRECT reads start on the page before). */
size_t clb_xread_slot_base(const clb_xcache *xc, int64_t idx) {
    return clb_xread_direct(xc) ? xc->span[idx].lo - direct_start(&xc->span[idx]) : 0;
}

/* Drops an evicted expert's pages from memory (mmap mode; the other modes reuse the slot).
 * nowait: only through a file already open; 0 when it is not (the reader drops it then). */
int clb_xread_drop_mapped(clb_xcache *xc, int64_t idx, int nowait) {
    const clb_xspan *sp = &xc->span[idx];
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
