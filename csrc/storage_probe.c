/* Colibri storage probe (clb_storage_probe.h): chunked reads of the expert files from depth
 * threads at once, timed from the first read's start to the last one's end.
 * Guarantees: files are opened like every weight file (regular files only, O_NONBLOCK, no
 * controlling terminal) and all closed before return; a thread never reads past its chunk; the
 * threads start together (on one signal), so thread creation is not timed.
 * Refuses: see the header; a short read is not an error (the last chunk of a file). */
#define _GNU_SOURCE /* O_DIRECT */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "clb_storage_probe.h"
#include "clb_util.h"

#define PROBE_ALIGN 4096u
#define PROBE_MAX_CHUNK (64u << 20)
#define PROBE_MAX_DEPTH 64
#define PROBE_MAX_CHUNKS 1000000

typedef struct {
    const int *fds;
    const size_t *sizes;
    int n_paths;
    size_t chunk;
    int64_t first, n_chunks;
    pthread_mutex_t mu;
    pthread_cond_t go_cv;
    int go;          /* 1: read, under mu */
    int64_t next;    /* the next chunk to read, under mu */
    int64_t bytes;   /* read so far, under mu */
    int64_t t_end;   /* the last read's end, under mu */
    int err_no;      /* the first read error, under mu */
    int err_file;    /* the file of err_no, -1: not a file's */
} probe_ctx;

static void *probe_main(void *arg) {
    probe_ctx *c = arg;
    void *buf = mmap(NULL, c->chunk, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    pthread_mutex_lock(&c->mu);
    while (!c->go) pthread_cond_wait(&c->go_cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
    int64_t got = 0;
    int err_no = buf == MAP_FAILED ? ENOMEM : 0, err_file = -1;
    for (;;) {
        pthread_mutex_lock(&c->mu);
        int64_t k = err_no || c->err_no ? c->n_chunks : c->next++;
        pthread_mutex_unlock(&c->mu);
        if (k >= c->n_chunks) break;
        int64_t g = c->first + k;
        int f = (int)(g % c->n_paths);
        size_t per_file = c->sizes[f] / c->chunk > 0 ? c->sizes[f] / c->chunk : 1;
        off_t off = (off_t)((size_t)(g / c->n_paths) % per_file * c->chunk);
        ssize_t r;
        do {
            r = pread(c->fds[f], buf, c->chunk, off);
        } while (r < 0 && errno == EINTR);
        if (r < 0) {
            err_no = errno;
            err_file = f;
            break;
        }
        got += r;
    }
    int64_t t = clb_now_ns();
    pthread_mutex_lock(&c->mu);
    c->bytes += got;
    if (t > c->t_end) c->t_end = t;
    if (err_no && !c->err_no) {
        c->err_no = err_no;
        c->err_file = err_file;
    }
    pthread_mutex_unlock(&c->mu);
    if (buf != MAP_FAILED) munmap(buf, c->chunk);
    return NULL;
}

clb_status clb_storage_probe(const char *const *paths, int n_paths, size_t chunk, int64_t first,
                             int64_t n_chunks, int depth, int direct, double *gbps,
                             int64_t *bytes, char *err) {
    if (err) err[0] = '\0';
    if (!paths || !gbps || !bytes || n_paths < 1 || depth < 1 || depth > PROBE_MAX_DEPTH ||
        chunk == 0 || chunk % PROBE_ALIGN != 0 || chunk > PROBE_MAX_CHUNK || first < 0 ||
        n_chunks < 1 || n_chunks > PROBE_MAX_CHUNKS) {
        clb_set_err(err, "storage probe: needs files, a depth in 1..%d, a chunk that is a "
                    "multiple of %u bytes up to %u, and 1..%d chunks", PROBE_MAX_DEPTH,
                    PROBE_ALIGN, PROBE_MAX_CHUNK, PROBE_MAX_CHUNKS);
        return CLB_E_ARG;
    }
    int *fds = malloc((size_t)n_paths * sizeof(int));
    size_t *sizes = malloc((size_t)n_paths * sizeof(size_t));
    pthread_t *th = malloc((size_t)depth * sizeof(pthread_t));
    if (!fds || !sizes || !th) {
        free(fds);
        free(sizes);
        free(th);
        clb_set_err(err, "storage probe: out of memory");
        return CLB_E_NOMEM;
    }
    clb_status st = CLB_OK;
    int n_open = 0;
    for (; n_open < n_paths; n_open++) {
        int flags = O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY | (direct ? O_DIRECT : 0);
        int fd = open(paths[n_open], flags);
        struct stat sb;
        if (fd >= 0 && (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode))) {
            close(fd);
            fd = -1;
            errno = EINVAL;
        }
        if (fd < 0) {
            clb_set_err(err, "storage probe: %s cannot be read%s: %s", paths[n_open],
                        direct ? " with O_DIRECT" : "",
                        errno == EINVAL ? "not a regular file, or O_DIRECT refused"
                                        : strerror(errno));
            st = CLB_E_IO;
            break;
        }
        fds[n_open] = fd;
        sizes[n_open] = (size_t)sb.st_size;
    }
    probe_ctx c = {.fds = fds, .sizes = sizes, .n_paths = n_paths,
                   .chunk = chunk, .first = first, .n_chunks = n_chunks};
    int started = 0;
    if (st == CLB_OK) {
        pthread_mutex_init(&c.mu, NULL);
        pthread_cond_init(&c.go_cv, NULL);
        for (; started < depth; started++)
            if (pthread_create(&th[started], NULL, probe_main, &c) != 0) break;
        pthread_mutex_lock(&c.mu);
        if (started < depth) { /* those started stop at once */
            c.err_no = EAGAIN;
            c.err_file = -1;
        }
        const int64_t t0 = clb_now_ns();
        c.go = 1;
        pthread_cond_broadcast(&c.go_cv);
        pthread_mutex_unlock(&c.mu);
        for (int k = 0; k < started; k++) pthread_join(th[k], NULL);
        pthread_cond_destroy(&c.go_cv);
        pthread_mutex_destroy(&c.mu);
        if (c.err_no) {
            clb_set_err(err, "storage probe: %s: %s",
                        c.err_file >= 0 ? paths[c.err_file] : "its threads",
                        strerror(c.err_no));
            st = c.err_file >= 0 ? CLB_E_IO : CLB_E_NOMEM;
        } else {
            int64_t ns = c.t_end - t0;
            *bytes = c.bytes;
            *gbps = (double)c.bytes / (double)(ns > 0 ? ns : 1);
        }
    }
    for (int k = 0; k < n_open; k++) close(fds[k]);
    free(fds);
    free(sizes);
    free(th);
    return st;
}
