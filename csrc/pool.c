/* Colibri memory pool: size-classed free lists for small (< 4 KiB) and medium (< 1 MiB)
 * blocks carved from 64-byte-aligned slabs, large blocks straight from mmap.
 * Guarantees: every pointer is 64-byte aligned; each size class has its own mutex; the
 * statistics count requested bytes exactly (in use per class, total, peak, alloc/free counts).
 * Refuses: size 0 and sizes whose rounding would overflow (NULL); foreign pointers (assert). */
#define _GNU_SOURCE
#include <assert.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "clb_pool.h"

#define CLB_POOL_ALIGN 64
#define CLB_POOL_SMALL_MAX 4096         /* small: size < 4 KiB */
#define CLB_POOL_MEDIUM_MAX (1u << 20)  /* medium: size < 1 MiB */
#define CLB_POOL_N_SMALL (CLB_POOL_SMALL_MAX / CLB_POOL_ALIGN)  /* 64-byte steps up to 4 KiB */
#define CLB_POOL_N_MEDIUM 9                                    /* powers of two 8 KiB .. 1 MiB */
#define CLB_POOL_N_CLASSES (CLB_POOL_N_SMALL + CLB_POOL_N_MEDIUM)
#define CLB_POOL_LARGE_CLASS CLB_POOL_N_CLASSES
#define CLB_POOL_MAGIC 0xC01B0001u
#define CLB_POOL_SLAB_SMALL (256u << 10)
#define CLB_POOL_SLAB_MIN_BLOCKS 4

/* Every block is preceded by one 64-byte header, so the payload keeps the 64-byte alignment
 * and free() learns the class and the requested size without searching. */
typedef struct clb_pool_hdr {
    uint32_t magic;
    uint32_t cls;                /* size class, or CLB_POOL_LARGE_CLASS */
    size_t size;                 /* requested bytes */
    size_t map_len;              /* large only: bytes mapped */
    struct clb_pool_hdr *next;   /* free list (small/medium) or live large list */
    struct clb_pool_hdr *prev;   /* live large list */
} clb_pool_hdr;
_Static_assert(sizeof(clb_pool_hdr) <= CLB_POOL_ALIGN, "pool header must fit 64 bytes");

typedef struct clb_pool_slab {
    struct clb_pool_slab *next;
} clb_pool_slab;

typedef struct {
    pthread_mutex_t mu;
    size_t stride;        /* header + payload capacity */
    clb_pool_hdr *free;
    clb_pool_slab *slabs; /* each slab starts with one 64-byte slot holding the link */
} clb_pool_class;

struct clb_pool {
    clb_pool_class cls[CLB_POOL_N_CLASSES];
    pthread_mutex_t large_mu;
    clb_pool_hdr *large; /* live large blocks, so free_all can unmap them */
    _Atomic size_t in_use[3];
    _Atomic size_t total, peak;
    _Atomic uint64_t n_alloc, n_free;
};

static size_t clb_pool_capacity(int c) {
    if (c < CLB_POOL_N_SMALL) return (size_t)(c + 1) * CLB_POOL_ALIGN;
    return (size_t)8192 << (c - CLB_POOL_N_SMALL);
}

static int clb_pool_class_of(size_t size) {
    if (size < CLB_POOL_SMALL_MAX) return (int)((size + CLB_POOL_ALIGN - 1) / CLB_POOL_ALIGN) - 1;
    if (size < CLB_POOL_MEDIUM_MAX) {
        int c = CLB_POOL_N_SMALL;
        while (clb_pool_capacity(c) < size) c++;
        return c;
    }
    return CLB_POOL_LARGE_CLASS;
}

static int clb_pool_kind(int c) { return c < CLB_POOL_N_SMALL ? 0 : c < CLB_POOL_N_CLASSES ? 1 : 2; }

clb_pool *clb_pool_init(void) {
    clb_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    for (int c = 0; c < CLB_POOL_N_CLASSES; c++) {
        pthread_mutex_init(&p->cls[c].mu, NULL);
        p->cls[c].stride = CLB_POOL_ALIGN + clb_pool_capacity(c);
    }
    pthread_mutex_init(&p->large_mu, NULL);
    return p;
}

void clb_pool_free_all(clb_pool *p) {
    if (!p) return;
    for (int c = 0; c < CLB_POOL_N_CLASSES; c++) {
        clb_pool_slab *s = p->cls[c].slabs;
        while (s) {
            clb_pool_slab *next = s->next;
            free(s);
            s = next;
        }
        pthread_mutex_destroy(&p->cls[c].mu);
    }
    clb_pool_hdr *h = p->large;
    while (h) {
        clb_pool_hdr *next = h->next;
        munmap(h, h->map_len);
        h = next;
    }
    pthread_mutex_destroy(&p->large_mu);
    free(p);
}

static void clb_pool_account(clb_pool *p, int kind, size_t size, int add) {
    if (add) {
        atomic_fetch_add(&p->in_use[kind], size);
        size_t now = atomic_fetch_add(&p->total, size) + size;
        size_t peak = atomic_load(&p->peak);
        while (now > peak && !atomic_compare_exchange_weak(&p->peak, &peak, now)) {
        }
        atomic_fetch_add(&p->n_alloc, 1);
    } else {
        atomic_fetch_sub(&p->in_use[kind], size);
        atomic_fetch_sub(&p->total, size);
        atomic_fetch_add(&p->n_free, 1);
    }
}

/* carve a new slab into the class's free list; called with the class lock held */
static int clb_pool_grow(clb_pool_class *k) {
    size_t n_blocks = CLB_POOL_SLAB_SMALL / k->stride;
    if (n_blocks < CLB_POOL_SLAB_MIN_BLOCKS) n_blocks = CLB_POOL_SLAB_MIN_BLOCKS;
    size_t bytes = CLB_POOL_ALIGN + n_blocks * k->stride; /* both multiples of 64 */
    clb_pool_slab *s = aligned_alloc(CLB_POOL_ALIGN, bytes);
    if (!s) return 0;
    s->next = k->slabs;
    k->slabs = s;
    char *base = (char *)s + CLB_POOL_ALIGN;
    for (size_t i = n_blocks; i-- > 0;) {
        clb_pool_hdr *h = (clb_pool_hdr *)(base + i * k->stride);
        h->next = k->free;
        k->free = h;
    }
    return 1;
}

void *clb_pool_alloc(clb_pool *p, size_t size) {
    if (!p || size == 0 || size > SIZE_MAX / 2) return NULL;
    int c = clb_pool_class_of(size);
    clb_pool_hdr *h;
    if (c == CLB_POOL_LARGE_CLASS) {
        size_t len = (CLB_POOL_ALIGN + size + 4095) & ~(size_t)4095;
        void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) return NULL;
        h = m;
        h->map_len = len;
        h->prev = NULL;
        pthread_mutex_lock(&p->large_mu);
        h->next = p->large;
        if (p->large) p->large->prev = h;
        p->large = h;
        pthread_mutex_unlock(&p->large_mu);
    } else {
        clb_pool_class *k = &p->cls[c];
        pthread_mutex_lock(&k->mu);
        if (!k->free && !clb_pool_grow(k)) {
            pthread_mutex_unlock(&k->mu);
            return NULL;
        }
        h = k->free;
        k->free = h->next;
        pthread_mutex_unlock(&k->mu);
        h->map_len = 0;
        h->next = h->prev = NULL;
    }
    h->magic = CLB_POOL_MAGIC;
    h->cls = (uint32_t)c;
    h->size = size;
    clb_pool_account(p, clb_pool_kind(c), size, 1);
    return (char *)h + CLB_POOL_ALIGN;
}

void clb_pool_free(clb_pool *p, void *ptr) {
    if (!p || !ptr) return;
    clb_pool_hdr *h = (clb_pool_hdr *)((char *)ptr - CLB_POOL_ALIGN);
    assert(h->magic == CLB_POOL_MAGIC && "clb_pool_free: not a pool block (or double free)");
    int c = (int)h->cls;
    h->magic = 0; /* a second free of the same block trips the assert above */
    clb_pool_account(p, clb_pool_kind(c), h->size, 0);
    if (c == CLB_POOL_LARGE_CLASS) {
        pthread_mutex_lock(&p->large_mu);
        if (h->prev) h->prev->next = h->next;
        else p->large = h->next;
        if (h->next) h->next->prev = h->prev;
        pthread_mutex_unlock(&p->large_mu);
        munmap(h, h->map_len);
        return;
    }
    clb_pool_class *k = &p->cls[c];
    pthread_mutex_lock(&k->mu);
    h->next = k->free;
    k->free = h;
    pthread_mutex_unlock(&k->mu);
}

void clb_pool_get_stats(clb_pool *p, clb_pool_stats *out) {
    memset(out, 0, sizeof *out);
    if (!p) return;
    for (int i = 0; i < 3; i++) out->bytes_in_use[i] = atomic_load(&p->in_use[i]);
    out->bytes_total = atomic_load(&p->total);
    out->bytes_peak = atomic_load(&p->peak);
    out->n_alloc = atomic_load(&p->n_alloc);
    out->n_free = atomic_load(&p->n_free);
}
