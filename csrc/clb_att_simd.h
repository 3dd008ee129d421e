/* The attention score kernels' shared tail (kernels_avx2.c and kernels_avx512.c: both
 * compile with AVX2): eight rows' sums reduced by one addition tree, scaled, stored and
 * folded into the running maximum, so both ISAs finish a group of eight rows alike. */
#ifndef CLB_ATT_SIMD_H
#define CLB_ATT_SIMD_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* the rows r0.. r0 + 7 of k (ldk apart); past row n - 1 the last row again */
static inline __attribute__((always_inline)) void clb_rows8(const float *k, int64_t ldk,
                                                            int64_t r0, int64_t n,
                                                            const float *kr[8]) {
    for (int i = 0; i < 8; i++) kr[i] = k + (r0 + i < n ? r0 + i : n - 1) * ldk;
}

/* [a0..a7] -> lane i = sum of a[i]: pairs, quads within 128-bit halves, then halves */
static inline __attribute__((always_inline)) __m256 clb_sum8x8(const __m256 a[8]) {
    const __m256 h03 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 h47 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(h03, h47, 0x20),
                         _mm256_permute2f128_ps(h03, h47, 0x31));
}

/* Scales eight rows' sums (lane i: row r0 + i, whose last hd - hv elements are still to add),
 * stores the n - r0 real ones and folds them into the running maximum top (lanes past n hold
 * the last row again, which changes no maximum). max_ps returns its second operand when
 * either is NaN, so a NaN score never replaces the maximum, as in the reference. */
static inline __attribute__((always_inline)) __m256
clb_scores8(__m256 sums, int64_t hd, int64_t hv, const float *q, const float *const kr[8],
            float scale, int64_t r0, int64_t n, float *s, __m256 top) {
    const int64_t m = n - r0 < 8 ? n - r0 : 8;
    if (hv == hd) {
        const __m256 v = _mm256_mul_ps(sums, _mm256_set1_ps(scale));
        if (m == 8) {
            _mm256_storeu_ps(s + r0, v);
        } else {
            float t[8];
            _mm256_storeu_ps(t, v);
            memcpy(s + r0, t, (size_t)m * sizeof(float));
        }
        return _mm256_max_ps(v, top);
    }
    float t[8];
    _mm256_storeu_ps(t, sums);
    for (int i = 0; i < 8; i++) {
        for (int64_t d = hv; d < hd; d++) t[i] = fmaf(kr[i][d], q[d], t[i]);
        t[i] *= scale;
    }
    memcpy(s + r0, t, (size_t)m * sizeof(float));
    return _mm256_max_ps(_mm256_loadu_ps(t), top);
}

/* the largest lane of top */
static inline __attribute__((always_inline)) float clb_max8(__m256 top) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    return _mm_cvtss_f32(h);
}

#endif
