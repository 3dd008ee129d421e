/* io_uring through raw system calls, for one thread: see clb_uring.h. The ring's memory is
 * shared with the kernel; the submission tail and the completion head are published with
 * release stores, the kernel's indices read with acquire loads. */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/io_uring.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "clb_uring.h"

struct clb_uring {
    int fd;
    unsigned depth; /* requests in flight at most (<= the ring's entries) */
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    void *sq_map, *cq_map, *sqe_map;
    size_t sq_len, cq_len, sqe_len;
    /* per request slot [depth]: next byte to read and end (relative to the read), pos -1:
     * free; want: to submit (new or resumed after a short read) */
    int64_t *pos, *end;
    uint8_t *want;
};

static int sys_setup(unsigned entries, struct io_uring_params *p) {
    return (int)syscall(__NR_io_uring_setup, entries, p);
}

static int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
    return (int)syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, NULL, 0);
}

void clb_uring_free(clb_uring *r) {
    if (!r) return;
    if (r->sqe_map) munmap(r->sqe_map, r->sqe_len);
    if (r->cq_map && r->cq_map != r->sq_map) munmap(r->cq_map, r->cq_len);
    if (r->sq_map) munmap(r->sq_map, r->sq_len);
    if (r->fd >= 0) close(r->fd);
    free(r->pos);
    free(r->end);
    free(r->want);
    free(r);
}

static void *map_ring(int fd, size_t len, off_t what) {
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, what);
    return p == MAP_FAILED ? NULL : p;
}

clb_uring *clb_uring_init(unsigned depth, char *msg, size_t msg_len) {
    if (depth < 1 || depth > 64) {
        snprintf(msg, msg_len, "io_uring depth %u must be in 1..64", depth);
        return NULL;
    }
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    int fd = sys_setup(depth, &p);
    if (fd < 0) {
        snprintf(msg, msg_len, "io_uring is not available here: %s", strerror(errno));
        return NULL;
    }
    clb_uring *r = calloc(1, sizeof *r);
    if (!r) {
        close(fd);
        snprintf(msg, msg_len, "out of memory for an io_uring");
        return NULL;
    }
    r->fd = fd;
    r->depth = depth < p.sq_entries ? depth : p.sq_entries;
    r->sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    r->sqe_len = p.sq_entries * sizeof(struct io_uring_sqe);
    int single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single) {
        if (r->cq_len > r->sq_len) r->sq_len = r->cq_len;
        r->cq_len = r->sq_len;
    }
    r->sq_map = map_ring(fd, r->sq_len, IORING_OFF_SQ_RING);
    r->cq_map = single ? r->sq_map : map_ring(fd, r->cq_len, IORING_OFF_CQ_RING);
    r->sqe_map = map_ring(fd, r->sqe_len, IORING_OFF_SQES);
    r->pos = calloc(r->depth, sizeof(int64_t));
    r->end = calloc(r->depth, sizeof(int64_t));
    r->want = calloc(r->depth, 1);
    if (!r->sq_map || !r->cq_map || !r->sqe_map || !r->pos || !r->end || !r->want) {
        snprintf(msg, msg_len, "io_uring: cannot map its rings: %s", strerror(errno));
        clb_uring_free(r);
        return NULL;
    }
    unsigned char *sq = r->sq_map, *cq = r->cq_map;
    r->sq_head = (unsigned *)(sq + p.sq_off.head);
    r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->cq_head = (unsigned *)(cq + p.cq_off.head);
    r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    r->sqes = r->sqe_map;
    return r;
}

int64_t clb_uring_read(clb_uring *r, int fd, void *buf, size_t len, off_t off, size_t chunk) {
    const int64_t n = (int64_t)len;
    int64_t next = 0, got = 0, eof_at = n;
    unsigned inflight = 0;
    int err = 0;
    if (chunk == 0) chunk = len ? len : 1;
    for (unsigned k = 0; k < r->depth; k++) {
        r->pos[k] = -1;
        r->want[k] = 0;
    }
    for (;;) {
        /* fill the ring: resumed requests, then new chunks into free slots */
        unsigned tail = *r->sq_tail, mask = *r->sq_mask, queued = 0;
        for (unsigned k = 0; k < r->depth; k++) {
            if (!err && r->pos[k] < 0 && next < eof_at) {
                r->pos[k] = next;
                r->end[k] = next + (int64_t)chunk < n ? next + (int64_t)chunk : n;
                next = r->end[k];
                r->want[k] = 1;
            }
            if (!r->want[k]) continue;
            r->want[k] = 0;
            if (err || r->pos[k] >= eof_at) { /* nothing more to read there */
                r->pos[k] = -1;
                continue;
            }
            struct io_uring_sqe *e = &r->sqes[tail & mask];
            memset(e, 0, sizeof *e);
            e->opcode = IORING_OP_READ;
            e->fd = fd;
            e->addr = (uint64_t)(uintptr_t)((unsigned char *)buf + r->pos[k]);
            e->len = (uint32_t)(r->end[k] - r->pos[k]);
            e->off = (uint64_t)off + (uint64_t)r->pos[k];
            e->user_data = k;
            r->sq_array[tail & mask] = tail & mask;
            tail++;
            queued++;
            inflight++;
        }
        if (queued) __atomic_store_n(r->sq_tail, tail, __ATOMIC_RELEASE);
        if (inflight == 0) break;
        unsigned pending = tail - __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE);
        if (sys_enter(r->fd, pending, 1, IORING_ENTER_GETEVENTS) < 0 && errno != EINTR &&
            errno != EAGAIN && errno != EBUSY) {
            /* the ring itself failed: what was submitted may still write into buf, so the
             * read fails but returns only once it has all completed */
            if (!err) err = errno;
            usleep(1000);
        }
        unsigned head = *r->cq_head, ctail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
        for (; head != ctail; head++) {
            const struct io_uring_cqe *c = &r->cqes[head & *r->cq_mask];
            unsigned k = (unsigned)c->user_data;
            int res = c->res;
            inflight--;
            if (k >= r->depth) continue; /* not ours: cannot happen */
            if (res == -EINTR || res == -EAGAIN) {
                r->want[k] = 1;
            } else if (res < 0) {
                if (!err) err = -res;
                r->pos[k] = -1;
            } else if (res == 0) {
                if (r->pos[k] < eof_at) eof_at = r->pos[k];
                r->pos[k] = -1;
            } else {
                got += res;
                r->pos[k] += res;
                if (r->pos[k] < r->end[k])
                    r->want[k] = 1; /* a short read: the rest */
                else
                    r->pos[k] = -1;
            }
        }
        __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
    }
    return err ? -(int64_t)err : got;
}
