/* AVX2 read kernel of the bandwidth probe (this file alone is built with AVX2 flags).
 * Guarantees: returns the same 64-bit wrap-around sum of w[0..n) as the scalar loop in
 * bandwidth.c, reading each word once with 32-byte loads and four independent accumulators.
 * Refuses: to run on a CPU without AVX2; bandwidth.c only calls it when dispatch allows. */
#include <immintrin.h>

#include "clb_bench.h"

uint64_t clb_bw_sum_avx2(const uint64_t *w, size_t n) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        a0 = _mm256_add_epi64(a0, _mm256_loadu_si256((const __m256i *)(w + i)));
        a1 = _mm256_add_epi64(a1, _mm256_loadu_si256((const __m256i *)(w + i + 4)));
        a2 = _mm256_add_epi64(a2, _mm256_loadu_si256((const __m256i *)(w + i + 8)));
        a3 = _mm256_add_epi64(a3, _mm256_loadu_si256((const __m256i *)(w + i + 12)));
    }
    __m256i t = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, t);
    uint64_t s = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    for (; i < n; i++) s += w[i];
    return s;
}
