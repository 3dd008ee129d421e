/* Kernel-side probes for the micro-benchmark (clb_bench.h): time clb_matmul on one matrix, an
 * empty thread-pool run and the int8 products' inner loop on L1 data, from C, so the figures
 * hold no Python overhead.
 * Guarantees: every timed product runs the same call the forward pass makes (clb_matmul with
 * the model's kind of pool); buffers are allocated before the clock starts and freed after.
 * Refuses: bad shapes or counts (CLB_E_ARG); it measures, it asserts nothing about speed. */
#define _GNU_SOURCE
#include <stdlib.h>

#include "clb_bench.h"
#include "clb_kernels.h"
#include "clb_kernels_isa.h"
#include "clb_threadpool.h"
#include "clb_util.h"

clb_status clb_matmul_bench(clb_type t, const void *w, int64_t n_out, int64_t n_in,
                            const float *x, int64_t n_tok, int n_threads, int n_reps,
                            double *secs) {
    if (!w || !x || !secs || n_out <= 0 || n_in <= 0 || n_tok <= 0 || n_reps < 1 ||
        n_reps > 100000 || n_threads < 1 || n_threads > 1024)
        return CLB_E_ARG;
    size_t ssz = clb_matmul_scratch_size(t, n_in, n_tok);
    void *scratch = malloc(ssz ? ssz : 1);
    float *y = malloc((size_t)(n_out * n_tok) * sizeof(float));
    clb_threadpool *tp = NULL;
    clb_status st = scratch && y ? clb_threadpool_init(&tp, n_threads) : CLB_E_NOMEM;
    for (int r = 0; st == CLB_OK && r < n_reps; r++) {
        double t0 = 1e-9 * (double)clb_now_ns();
        st = clb_matmul(t, w, n_out, n_in, x, n_tok, y, n_out, NULL, scratch, tp);
        secs[r] = 1e-9 * (double)clb_now_ns() - t0;
    }
    clb_threadpool_free(tp);
    free(y);
    free(scratch);
    return st;
}

static void clb_kb_empty(void *ctx, int ith, int nth) {
    (void)ctx;
    (void)ith;
    (void)nth;
}

clb_status clb_threadpool_bench(int n_threads, int n_runs, int gap_us, double *ns_per_run) {
    if (!ns_per_run || n_threads < 1 || n_threads > 1024 || n_runs < 1 || n_runs > 10000000 ||
        gap_us < 0 || gap_us > 1000000)
        return CLB_E_ARG;
    clb_threadpool *tp = NULL;
    clb_status st = clb_threadpool_init(&tp, n_threads);
    if (st != CLB_OK) return st;
    double total = 0.0;
    for (int r = 0; st == CLB_OK && r < n_runs; r++) {
        if (gap_us > 0) { /* idle between runs as the forward pass does between layers */
            double until = 1e-9 * (double)clb_now_ns() + 1e-6 * gap_us;
            while (1e-9 * (double)clb_now_ns() < until) {
            }
        }
        double t0 = 1e-9 * (double)clb_now_ns();
        st = clb_threadpool_run(tp, clb_kb_empty, NULL);
        total += 1e-9 * (double)clb_now_ns() - t0;
    }
    clb_threadpool_free(tp);
    *ns_per_run = total / n_runs * 1e9;
    return st;
}

#ifdef CLB_HAVE_X86
/* variants [0, CLB_INT8_LOOP_AVX2) on AVX2 (clb_int8_loop_avx2), the rest on AVX-512
 * (clb_int8_loop_avx512 from 0) */
static uint64_t clb_int8_loop(int variant, int64_t n_calls) {
    return variant < CLB_INT8_LOOP_AVX2
               ? clb_int8_loop_avx2(variant, n_calls)
               : clb_int8_loop_avx512(variant - CLB_INT8_LOOP_AVX2, n_calls);
}
#endif

clb_status clb_int8_loop_bench(int variant, double *gmacs) {
    if (!gmacs || variant < 0 || variant >= CLB_INT8_LOOP_VARIANTS) return CLB_E_ARG;
#ifdef CLB_HAVE_X86
    if (!clb_isa_supported(variant < CLB_INT8_LOOP_AVX2 ? CLB_ISA_AVX2 : CLB_ISA_AVX512))
        return CLB_E_ARG;
    const int64_t n_calls = 8192; /* 512 M multiply-adds: about 10 ms at 50 GMAC/s */
    volatile uint64_t sink = clb_int8_loop(variant, n_calls / 10); /* warm-up */
    double best = 0.0;
    for (int r = 0; r < 15; r++) {
        int64_t t0 = clb_now_ns();
        sink ^= clb_int8_loop(variant, n_calls);
        double s = 1e-9 * (double)(clb_now_ns() - t0);
        double g = s > 0.0 ? (double)n_calls * CLB_INT8_LOOP_MACS_PER_CALL / s / 1e9 : 0.0;
        best = g > best ? g : best;
    }
    (void)sink;
    *gmacs = best;
    return CLB_OK;
#else
    return CLB_E_ARG;
#endif
}
