/* Colibri weight files: open one *.bin read-only with mmap and validate it completely.
 * Guarantees: before any tensor byte is handed out, every header field, table entry, shape,
 * byte count, offset and overlap rule of docs/INTERNALS.md has been checked with
 * overflow-safe arithmetic against the file's real size; messages name the file and tensor.
 * Refuses: anything the format does not allow (no "best effort" reading of odd files). */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "clb_model.h"
#include "clb_wfault.h"
#include "clb_util.h"

#define CLB_WF_MAGIC "CLBWGT1"
#define CLB_WF_VERSION 1u
#define CLB_WF_MAX_TENSORS 4096u
#define CLB_WF_HEADER 64u
#define CLB_WF_ENTRY 128u
#define CLB_WF_ALIGN 64u
#define CLB_WF_MAX_DIM ((int64_t)1 << 40)

struct clb_wfile {
    void *map;          /* whole file, PROT_READ */
    size_t size;
    char *path;         /* for messages after load (a fault names the file) */
    int fault_slot;     /* clb_wfault slot guarding map, -1 if unguarded */
    int n_tensors;
    clb_tensor *tensors; /* [n_tensors] */
};

/* The format is little-endian; decode bytes explicitly so header parsing is host-agnostic. */
static uint32_t rd_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t rd_u64(const uint8_t *p) {
    return (uint64_t)rd_u32(p) | (uint64_t)rd_u32(p + 4) << 32;
}

static int all_zero(const uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (p[i]) return 0;
    return 1;
}

static int host_is_little_endian(void) {
    const uint16_t one = 1;
    uint8_t b;
    memcpy(&b, &one, 1);
    return b == 1;
}

typedef struct {
    uint64_t offset, nbytes;
    int idx;
} wf_span;

static int cmp_span(const void *a, const void *b) {
    const wf_span *x = a, *y = b;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    return x->idx - y->idx;
}

static int cmp_name(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Parses one table entry into t; returns 0 or writes err. */
static int parse_entry(const char *path, const uint8_t *e, int i, uint64_t data_offset,
                       uint64_t file_size, clb_tensor *t, uint64_t *off_out, char *err) {
    const char *raw = (const char *)e;
    size_t len = 0;
    while (len < 64 && raw[len]) len++;
    if (len == 64) {
        clb_set_err(err, "%s: tensor #%d: name is not NUL-terminated within 64 bytes", path, i);
        return -1;
    }
    if (len == 0) {
        clb_set_err(err, "%s: tensor #%d: empty name", path, i);
        return -1;
    }
    if (!all_zero(e + len, 64 - len)) {
        clb_set_err(err, "%s: tensor #%d ('%s'): name is not NUL-padded", path, i, raw);
        return -1;
    }
    memcpy(t->name, raw, len + 1);
    const char *nm = t->name;

    uint32_t dtype = rd_u32(e + 64);
    if (!clb_type_valid_for_file(dtype)) {
        clb_set_err(err, "%s: tensor '%s': dtype %u is not a weight-file type", path, nm, dtype);
        return -1;
    }
    uint32_t n_dims = rd_u32(e + 68);
    if (n_dims < 1 || n_dims > 4) {
        clb_set_err(err, "%s: tensor '%s': n_dims %u not in 1..4", path, nm, n_dims);
        return -1;
    }
    for (int d = 0; d < 4; d++) {
        int64_t v = (int64_t)rd_u64(e + 72 + 8 * d);
        if ((uint32_t)d < n_dims) {
            if (v < 1 || v > CLB_WF_MAX_DIM) {
                clb_set_err(err, "%s: tensor '%s': shape[%d] = %lld not in 1..2^40", path, nm, d,
                            (long long)v);
                return -1;
            }
        } else if (v != 1) {
            clb_set_err(err, "%s: tensor '%s': unused shape[%d] = %lld, must be 1", path, nm, d,
                        (long long)v);
            return -1;
        }
        t->shape[d] = v;
    }
    uint64_t offset = rd_u64(e + 104);
    uint64_t nbytes = rd_u64(e + 112);
    if (!all_zero(e + 120, 8)) {
        clb_set_err(err, "%s: tensor '%s': reserved bytes are not zero", path, nm);
        return -1;
    }

    /* an interleaved layout holds whole groups of 8 rows of a matrix */
    const int x8 = dtype == CLB_TYPE_Q8X8 || dtype == CLB_TYPE_Q4X8 || dtype == CLB_TYPE_Q6X8;
    if (x8 && (n_dims != 2 || t->shape[0] % 8)) {
        clb_set_err(err, "%s: tensor '%s': dtype %u (rows interleaved 8 at a time) must be a "
                    "matrix of whole groups of 8 rows", path, nm, dtype);
        return -1;
    }
    int64_t row_len = t->shape[n_dims - 1];
    size_t row = clb_type_row_size((clb_type)dtype, row_len);
    if (row == 0) {
        clb_set_err(err, "%s: tensor '%s': row length %lld does not fill whole blocks of its type",
                    path, nm, (long long)row_len);
        return -1;
    }
    /* expected = row * product(other dims); any overflow means it cannot match the file */
    uint64_t expect = row;
    int overflow = 0;
    for (uint32_t d = 0; d + 1 < n_dims; d++) {
        uint64_t dim = (uint64_t)t->shape[d];
        if (expect > UINT64_MAX / dim) {
            overflow = 1;
            break;
        }
        expect *= dim;
    }
    if (overflow || nbytes != expect) {
        clb_set_err(err, "%s: tensor '%s': nbytes %llu does not match its shape and dtype%s", path,
                    nm, (unsigned long long)nbytes, overflow ? " (size overflows)" : "");
        return -1;
    }
    if (offset % CLB_WF_ALIGN) {
        clb_set_err(err, "%s: tensor '%s': offset %llu is not a multiple of 64", path, nm,
                    (unsigned long long)offset);
        return -1;
    }
    if (offset < data_offset) {
        clb_set_err(err, "%s: tensor '%s': offset %llu lies before the data section (%llu)", path,
                    nm, (unsigned long long)offset, (unsigned long long)data_offset);
        return -1;
    }
    if (nbytes > file_size || offset > file_size - nbytes) {
        clb_set_err(err,
                    "%s: tensor '%s': data [%llu, +%llu) runs past the end of the file "
                    "(%llu bytes)",
                    path, nm, (unsigned long long)offset, (unsigned long long)nbytes,
                    (unsigned long long)file_size);
        return -1;
    }
    if (nbytes > SIZE_MAX) {
        clb_set_err(err, "%s: tensor '%s': too large for this machine", path, nm);
        return -1;
    }
    t->type = (clb_type)dtype;
    t->n_dims = (int32_t)n_dims;
    t->nbytes = (size_t)nbytes;
    t->data = NULL;
    *off_out = offset;
    return 0;
}

static clb_status validate(const char *path, clb_wfile *f, char *err) {
    const uint8_t *b = f->map;
    size_t size = f->size;
    if (memcmp(b, CLB_WF_MAGIC, 8) != 0) {
        clb_set_err(err, "%s: bad magic (not a Colibri weight file)", path);
        return CLB_E_FORMAT;
    }
    uint32_t version = rd_u32(b + 8);
    if (version != CLB_WF_VERSION) {
        clb_set_err(err, "%s: format version %u, this build reads version %u", path, version,
                    CLB_WF_VERSION);
        return CLB_E_FORMAT;
    }
    uint32_t n = rd_u32(b + 12);
    if (n < 1 || n > CLB_WF_MAX_TENSORS) {
        clb_set_err(err, "%s: n_tensors %u not in 1..%u", path, n, CLB_WF_MAX_TENSORS);
        return CLB_E_FORMAT;
    }
    uint64_t table_offset = rd_u64(b + 16);
    uint64_t data_offset = rd_u64(b + 24);
    uint64_t file_size = rd_u64(b + 32);
    if (!all_zero(b + 40, 24)) {
        clb_set_err(err, "%s: reserved header bytes are not zero", path);
        return CLB_E_FORMAT;
    }
    if (file_size != (uint64_t)size) {
        clb_set_err(err, "%s: header says %llu bytes but the file has %llu (truncated or extended)",
                    path, (unsigned long long)file_size, (unsigned long long)size);
        return CLB_E_FORMAT;
    }
    if (table_offset != CLB_WF_HEADER) {
        clb_set_err(err,
                    "%s: table_offset %llu, must be 64", path, (unsigned long long)table_offset);
        return CLB_E_FORMAT;
    }
    uint64_t table_end = CLB_WF_HEADER + (uint64_t)n * CLB_WF_ENTRY; /* n <= 4096: no overflow */
    if (table_end > file_size) {
        clb_set_err(err, "%s: tensor table (%u entries) runs past the end of the file", path, n);
        return CLB_E_FORMAT;
    }
    if (data_offset % CLB_WF_ALIGN || data_offset < table_end || data_offset > file_size) {
        clb_set_err(err, "%s: data_offset %llu must be a multiple of 64 in [%llu, %llu]", path,
                    (unsigned long long)data_offset, (unsigned long long)table_end,
                    (unsigned long long)file_size);
        return CLB_E_FORMAT;
    }

    f->tensors = calloc(n, sizeof(clb_tensor));
    wf_span *spans = calloc(n, sizeof(wf_span));
    const char **names = calloc(n, sizeof(char *));
    if (!f->tensors || !spans || !names) {
        free(spans);
        free(names);
        clb_set_err(err, "%s: out of memory for %u tensor entries", path, n);
        return CLB_E_NOMEM;
    }
    f->n_tensors = (int)n;
    clb_status st = CLB_OK;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t off = 0;
        if (parse_entry(path, b + CLB_WF_HEADER + (uint64_t)i * CLB_WF_ENTRY, (int)i,
                        data_offset, file_size, &f->tensors[i], &off, err)) {
            st = CLB_E_FORMAT;
            goto done;
        }
        spans[i] = (wf_span){off, f->tensors[i].nbytes, (int)i};
        names[i] = f->tensors[i].name;
    }

    qsort(names, n, sizeof(char *), cmp_name);
    for (uint32_t i = 1; i < n; i++) {
        if (strcmp(names[i - 1], names[i]) == 0) {
            clb_set_err(err, "%s: tensor name '%s' appears more than once", path, names[i]);
            st = CLB_E_FORMAT;
            goto done;
        }
    }

    qsort(spans, n, sizeof(wf_span), cmp_span);
    for (uint32_t i = 1; i < n; i++) {
        /* spans are inside the file, so offset + nbytes cannot overflow */
        if (spans[i - 1].offset + spans[i - 1].nbytes > spans[i].offset) {
            clb_set_err(err, "%s: tensors '%s' and '%s' overlap", path,
                        f->tensors[spans[i - 1].idx].name, f->tensors[spans[i].idx].name);
            st = CLB_E_FORMAT;
            goto done;
        }
    }
    for (uint32_t i = 0; i < n; i++)
        f->tensors[spans[i].idx].data = b + spans[i].offset;
done:
    free(spans);
    free(names);
    return st;
}

clb_status clb_wfile_open(const char *path, clb_wfile **out, char *err) {
    *out = NULL;
    if (!host_is_little_endian()) {
        clb_set_err(err, "%s: weight files are little-endian; this host is not", path);
        return CLB_E_FORMAT;
    }
    /* O_NONBLOCK: opening a FIFO put in place of a weight file must not wait for a writer;
     * the fstat below then refuses it (and devices) before anything is read or mapped */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) {
        if (errno == ENOENT)
            clb_set_err(err, "missing file: %s", path);
        else
            clb_set_err(err, "%s: cannot open: %s", path, strerror(errno));
        return CLB_E_IO;
    }
    struct stat stt;
    if (fstat(fd, &stt) != 0) {
        clb_set_err(err, "%s: cannot stat: %s", path, strerror(errno));
        close(fd);
        return CLB_E_IO;
    }
    if (!S_ISREG(stt.st_mode)) {
        clb_set_err(err, "%s: not a regular file", path);
        close(fd);
        return CLB_E_IO;
    }
    if ((uint64_t)stt.st_size < CLB_WF_HEADER) {
        clb_set_err(err, "%s: %lld bytes, shorter than the 64-byte header (truncated)", path,
                    (long long)stt.st_size);
        close(fd);
        return CLB_E_FORMAT;
    }
    if ((uint64_t)stt.st_size > SIZE_MAX) {
        clb_set_err(err, "%s: too large to map on this machine", path);
        close(fd);
        return CLB_E_IO;
    }
    clb_wfile *f = calloc(1, sizeof(*f));
    if (!f) {
        close(fd);
        clb_set_err(err, "%s: out of memory", path);
        return CLB_E_NOMEM;
    }
    f->size = (size_t)stt.st_size;
    f->fault_slot = -1;
    f->path = strdup(path);
    if (!f->path) {
        close(fd);
        clb_wfile_close(f);
        clb_set_err(err, "%s: out of memory", path);
        return CLB_E_NOMEM;
    }
    f->map = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
    int map_errno = errno;
    close(fd); /* the mapping keeps the file; thousands of expert files must not hold fds */
    if (f->map == MAP_FAILED) {
        f->map = NULL;
        clb_wfile_close(f);
        clb_set_err(err, "%s: mmap failed: %s", path, strerror(map_errno));
        return CLB_E_IO;
    }
    /* guarded before the first byte is read: a file cut short from here on reads as zeros
     * and is reported, instead of killing the process (csrc/wfault.c) */
    f->fault_slot = clb_wfault_register(f->map, f->size);
    clb_status st = validate(path, f, err);
    if (clb_wfile_changed(f)) {
        clb_set_err(err, "weight file changed: %s was truncated while it was being read", path);
        st = CLB_E_IO;
    }
    if (st != CLB_OK) {
        clb_wfile_close(f);
        return st;
    }
    *out = f;
    return CLB_OK;
}

void clb_wfile_close(clb_wfile *f) {
    if (!f) return;
    clb_wfault_unregister(f->fault_slot);
    if (f->map) munmap(f->map, f->size);
    free(f->path);
    free(f->tensors);
    free(f);
}

int clb_wfile_n_tensors(const clb_wfile *f) { return f ? f->n_tensors : 0; }

const clb_tensor *clb_wfile_tensor(const clb_wfile *f, int i) {
    if (!f || i < 0 || i >= f->n_tensors) return NULL;
    return &f->tensors[i];
}

const clb_tensor *clb_wfile_find(const clb_wfile *f, const char *name) {
    if (!f || !name) return NULL;
    for (int i = 0; i < f->n_tensors; i++)
        if (strcmp(f->tensors[i].name, name) == 0) return &f->tensors[i];
    return NULL;
}

const char *clb_wfile_changed(const clb_wfile *f) {
    return f && clb_wfault_faulted(f->fault_slot) ? f->path : NULL;
}

const char *clb_wfile_path(const clb_wfile *f) { return f ? f->path : NULL; }

size_t clb_wfile_offset(const clb_wfile *f, const void *p) {
    return (size_t)((const char *)p - (const char *)f->map);
}
