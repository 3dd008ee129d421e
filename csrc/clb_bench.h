/* Colibri machine probes for `colibri bench`: the memory read bandwidth that bounds decode.
 * Guarantees: the probe reads every byte of its buffer on every pass, with the widest loads
 * the CPU has and on huge pages where the kernel grants them, and proves it with a checksum;
 * the buffer is mapped for the call only and unmapped before it returns.
 * Refuses: buffers under 64 KiB, thread counts outside 1..1024, pass counts outside 1..1000. */
#ifndef CLB_BENCH_H
#define CLB_BENCH_H

#include <stddef.h>
#include <stdint.h>

#include "clb_types.h"

#define CLB_BENCH_ERR_LEN 512 /* bytes of the err buffer clb_bandwidth_probe writes to */

/* Read a fresh nbytes buffer n_passes times with n_threads threads (a clb_threadpool of its
 * own, each thread a contiguous slice) and write the best pass in GB/s (1e9 bytes/s) to
 * *gbps. The buffer should be several times the last-level cache for a DRAM figure.
 * CLB_E_ARG for bad arguments, CLB_E_NOMEM when the buffer or pool cannot be had. */
clb_status clb_bandwidth_probe(size_t nbytes, int n_threads, int n_passes, double *gbps,
                               char *err);

/* Per-ISA read kernels (bandwidth_<isa>.c): the wrap-around sum of w[0..n). bandwidth.c picks
 * one by the active kernel ISA (clb_isa_active), so forcing "ref" forces the scalar loop. */
uint64_t clb_bw_sum_avx2(const uint64_t *w, size_t n);
uint64_t clb_bw_sum_avx512(const uint64_t *w, size_t n);

/* Micro-benchmark probes (bandwidth_kernels.c). clb_matmul_bench times n_reps calls of
 * clb_matmul(t, w, ...) on n_tok f32 rows x (a pool of n_threads of its own) into secs[n_reps];
 * clb_threadpool_bench writes the mean wall time of one empty clb_threadpool_run, each after
 * gap_us microseconds of the caller's own work (0: back to back). */
clb_status clb_matmul_bench(clb_type t, const void *w, int64_t n_out, int64_t n_in,
                            const float *x, int64_t n_tok, int n_threads, int n_reps,
                            double *secs);
clb_status clb_threadpool_bench(int n_threads, int n_runs, int gap_us, double *ns_per_run);
/* GMAC/s of an int8 loop on data in L1 (clb_kernels_isa.h), on the calling thread, the best of
 * 15 timed runs of 512 M multiply-adds each (a ceiling: the best run is the one least
 * disturbed): variants 0..1 are clb_int8_loop_avx2's, 2..4 clb_int8_loop_avx512's 0..2.
 * CLB_E_ARG for a variant outside 0..4 or a CPU without that variant's ISA. */
#define CLB_INT8_LOOP_AVX2 2     /* the AVX2 variants come first */
#define CLB_INT8_LOOP_VARIANTS 5 /* in all */
clb_status clb_int8_loop_bench(int variant, double *gmacs);

#endif
