/* Memory read-bandwidth probe (clb_bench.h): the denominator of `colibri bench`'s decode bound.
 * Guarantees: every pass sums every 64-bit word of the buffer (per-ISA read kernel) into
 * per-thread sums checked against the closed-form sum of the fill pattern, so the compiler
 * cannot drop the loads and a short read cannot pass; pages are first touched by their reader.
 * Refuses: to report a figure when the checksum disagrees (CLB_E_ARG, message says why). */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

#include "clb_bench.h"
#include "clb_kernels.h"
#include "clb_threadpool.h"
#include "clb_util.h"

#define CLB_BW_MIN_BYTES (64u * 1024u)
#define CLB_BW_MAX_THREADS 1024
#define CLB_BW_MAX_PASSES 1000
#define CLB_BW_PATTERN 0x9E3779B97F4A7C15ull /* odd: word i holds i * PATTERN, never all zero */

typedef uint64_t (*clb_bw_sum_fn)(const uint64_t *w, size_t n);

typedef struct {
    uint64_t *words;  /* [n_words] */
    size_t n_words;
    uint64_t *sums;   /* [n_threads], one slot per worker, written by the read task */
    clb_bw_sum_fn sum;
} clb_bw_ctx;

static void clb_bw_slice(size_t n, int ith, int nth, size_t *lo, size_t *hi) {
    /* split on 8-word (64-byte) lines so no two threads share a cache line */
    size_t n_lines = n / 8;
    *lo = n_lines * (size_t)ith / (size_t)nth * 8;
    *hi = ith == nth - 1 ? n : n_lines * (size_t)(ith + 1) / (size_t)nth * 8;
}

static void clb_bw_fill_task(void *p, int ith, int nth) {
    clb_bw_ctx *c = p;
    size_t lo, hi;
    clb_bw_slice(c->n_words, ith, nth, &lo, &hi);
    for (size_t i = lo; i < hi; i++) c->words[i] = (uint64_t)i * CLB_BW_PATTERN;
}

/* eight independent chains, one 64-byte line per iteration: the adds never limit the loads */
static uint64_t clb_bw_sum_ref(const uint64_t *w, size_t n) {
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        a0 += w[i];
        a1 += w[i + 1];
        a2 += w[i + 2];
        a3 += w[i + 3];
        a4 += w[i + 4];
        a5 += w[i + 5];
        a6 += w[i + 6];
        a7 += w[i + 7];
    }
    for (; i < n; i++) a0 += w[i];
    return a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
}

/* the widest loads the active kernel ISA allows: narrow loads under-report on some CPUs
 * (8.8 vs 12 GB/s measured on the machine this was written on) */
static clb_bw_sum_fn clb_bw_pick(void) {
#ifdef CLB_HAVE_X86
    switch (clb_isa_active()) {
    case CLB_ISA_AVX512: return clb_bw_sum_avx512;
    case CLB_ISA_AVX2: return clb_bw_sum_avx2;
    default: break;
    }
#endif
    return clb_bw_sum_ref;
}

static void clb_bw_read_task(void *p, int ith, int nth) {
    clb_bw_ctx *c = p;
    size_t lo, hi;
    clb_bw_slice(c->n_words, ith, nth, &lo, &hi);
    c->sums[ith] = c->sum(c->words + lo, hi - lo);
}

/* sum of i * PATTERN for i in [0, n), modulo 2^64 */
static uint64_t clb_bw_expected(size_t n) {
    uint64_t a = (uint64_t)n, b = (uint64_t)n - 1; /* n >= 1 here */
    uint64_t tri = (a % 2 == 0) ? (a / 2) * b : a * (b / 2);
    return tri * CLB_BW_PATTERN;
}

clb_status clb_bandwidth_probe(size_t nbytes, int n_threads, int n_passes, double *gbps,
                               char *err) {
    if (gbps == NULL) return CLB_E_ARG;
    *gbps = 0.0;
    if (nbytes < CLB_BW_MIN_BYTES || nbytes > SIZE_MAX / 2) {
        clb_set_err(err, "buffer of %zu bytes: need at least %u", nbytes, CLB_BW_MIN_BYTES);
        return CLB_E_ARG;
    }
    if (n_threads < 1 || n_threads > CLB_BW_MAX_THREADS) {
        clb_set_err(err, "threads %d not in 1..%d", n_threads, CLB_BW_MAX_THREADS);
        return CLB_E_ARG;
    }
    if (n_passes < 1 || n_passes > CLB_BW_MAX_PASSES) {
        clb_set_err(err, "passes %d not in 1..%d", n_passes, CLB_BW_MAX_PASSES);
        return CLB_E_ARG;
    }
    size_t n_words = nbytes / sizeof(uint64_t);
    size_t map_bytes = n_words * sizeof(uint64_t);
    /* a private anonymous mapping: freshly zeroed pages that munmap returns to the system,
     * so the probe leaves neither heap growth nor resident memory behind */
    void *mem = mmap(NULL, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) {
        clb_set_err(err, "cannot map a %zu-byte probe buffer", map_bytes);
        return CLB_E_NOMEM;
    }
#ifdef MADV_HUGEPAGE
    /* 4 KiB pages stop the hardware prefetcher at every page and cost TLB walks; the bound
     * should be the memory's, so ask for transparent huge pages (advice only: may be ignored) */
    madvise(mem, map_bytes, MADV_HUGEPAGE);
#endif
    uint64_t *sums = calloc((size_t)n_threads, sizeof(uint64_t));
    clb_threadpool *tp = NULL;
    clb_status st = sums == NULL ? CLB_E_NOMEM : clb_threadpool_init(&tp, n_threads);
    if (st != CLB_OK) {
        clb_set_err(err, "cannot start %d probe threads", n_threads);
        free(sums);
        munmap(mem, map_bytes);
        return st == CLB_E_ARG ? CLB_E_ARG : CLB_E_NOMEM;
    }
    clb_bw_ctx ctx = {mem, n_words, sums, clb_bw_pick()};
    st = clb_threadpool_run(tp, clb_bw_fill_task, &ctx);
    const uint64_t want = clb_bw_expected(n_words);
    double best = 0.0;
    for (int pass = 0; st == CLB_OK && pass < n_passes; pass++) {
        double t0 = 1e-9 * (double)clb_now_ns();
        st = clb_threadpool_run(tp, clb_bw_read_task, &ctx);
        double dt = 1e-9 * (double)clb_now_ns() - t0;
        if (st != CLB_OK) {
            clb_set_err(err, "probe run refused (status %d)", (int)st);
            break;
        }
        uint64_t got = 0;
        for (int t = 0; t < n_threads; t++) got += sums[t];
        if (got != want) {
            clb_set_err(err, "probe checksum %llu, expected %llu: the read was incomplete",
                        (unsigned long long)got, (unsigned long long)want);
            st = CLB_E_ARG;
            break;
        }
        double rate = dt > 0.0 ? (double)map_bytes / dt * 1e-9 : 0.0;
        if (rate > best) best = rate;
    }
    clb_threadpool_free(tp);
    free(sums);
    munmap(mem, map_bytes);
    if (st == CLB_OK) *gbps = best;
    return st;
}
