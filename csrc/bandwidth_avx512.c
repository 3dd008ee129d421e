/* AVX-512 read kernel of the bandwidth probe (this file alone is built with AVX-512 flags).
 * Guarantees: returns the same 64-bit wrap-around sum of w[0..n) as the scalar loop in
 * bandwidth.c, reading each word once with 64-byte loads and four independent accumulators.
 * Refuses: to run on a CPU without AVX-512 F; bandwidth.c only calls it when dispatch allows. */
#include <immintrin.h>

#include "clb_bench.h"

uint64_t clb_bw_sum_avx512(const uint64_t *w, size_t n) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        a0 = _mm512_add_epi64(a0, _mm512_loadu_si512((const void *)(w + i)));
        a1 = _mm512_add_epi64(a1, _mm512_loadu_si512((const void *)(w + i + 8)));
        a2 = _mm512_add_epi64(a2, _mm512_loadu_si512((const void *)(w + i + 16)));
        a3 = _mm512_add_epi64(a3, _mm512_loadu_si512((const void *)(w + i + 24)));
    }
    uint64_t s = (uint64_t)_mm512_reduce_add_epi64(
        _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
    for (; i < n; i++) s += w[i];
    return s;
}
