/* Colibri memory pool: small (< 4 KiB), medium (< 1 MiB) and large
 * (mmap) classes, every block 64-byte aligned, one lock per class, total/peak statistics.
 * Guarantees: clb_pool_free accepts exactly what clb_pool_alloc returned; statistics are exact.
 * Refuses: zero-size allocations (returns NULL). */
#ifndef CLB_POOL_H
#define CLB_POOL_H

#include <stddef.h>
#include <stdint.h>

typedef struct clb_pool clb_pool;

typedef struct {
    size_t bytes_in_use[3]; /* per class: small, medium, large */
    size_t bytes_total;     /* in use now, all classes */
    size_t bytes_peak;
    uint64_t n_alloc, n_free;
} clb_pool_stats;

clb_pool *clb_pool_init(void);
void clb_pool_free_all(clb_pool *p);
void *clb_pool_alloc(clb_pool *p, size_t size);
void clb_pool_free(clb_pool *p, void *ptr);
void clb_pool_get_stats(clb_pool *p, clb_pool_stats *out);

#endif
