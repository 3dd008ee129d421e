/* AVX2 probes of the machine (this file alone is built with AVX2 flags): the read kernel of
 * the bandwidth probe and the int8 products' inner loop on data in L1.
 * Guarantees: clb_bw_sum_avx2 returns the same 64-bit wrap-around sum of w[0..n) as the scalar
 * loop in bandwidth.c, reading each word once with 32-byte loads and four independent
 * accumulators; clb_int8_loop_avx2 runs the arithmetic of n_blocks blocks and returns a
 * checksum of its results.
 * Refuses: to run on a CPU without AVX2; the callers only call them when dispatch allows. */
#include <immintrin.h>
#include <string.h>

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

/* ---- the int8 products' inner loop on data in L1 --------------------------------------------
 * The arithmetic of one block of kernels_avx2.c's row-group passes (8 rows x 32 values against
 * CLB_LOOP_TOK tokens), with weights and activations cycling through 16 blocks that stay in L1,
 * so the figure is what the instruction mix itself allows, with no memory in the way. Variant
 * 0 is q8 as the kernels compute it (the weight's sign moved onto the activation, because
 * vpmaddubsw multiplies unsigned by signed bytes); 1 is the same without that sign step (not
 * an exact product: the ceiling the step costs).
 * Returns a checksum of the results so that no work can be left out. */
#define CLB_LOOP_TOK 8
#define CLB_LOOP_BLOCKS 16

static inline __attribute__((always_inline)) __m256i clb_bcast32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

static inline __attribute__((always_inline)) uint64_t clb_int8_loop(int variant, int64_t n_blocks,
                                                                    const __m256i *wq,
                                                                    const int8_t *aq,
                                                                    const float *ad) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256 ws = _mm256_set1_ps(0.25f);
    __m256 acc[CLB_LOOP_TOK];
    for (int t = 0; t < CLB_LOOP_TOK; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < n_blocks; b++) {
        const int64_t k = b % CLB_LOOP_BLOCKS;
        const __m256i *q = wq + k * 8;
        __m256i part[CLB_LOOP_TOK];
        for (int h = 0; h < 2; h++) {
            __m256i sg[4], ab[4];
            for (int j = 0; j < 4; j++) {
                sg[j] = _mm256_loadu_si256(q + 4 * h + j);
                ab[j] = _mm256_abs_epi8(sg[j]);
            }
            for (int t = 0; t < CLB_LOOP_TOK; t++) {
                const int8_t *a = aq + (k * CLB_LOOP_TOK + t) * 32 + 16 * h;
                __m256i s = h ? part[t] : _mm256_setzero_si256();
                for (int d = 0; d < 4; d++) {
                    __m256i x = clb_bcast32(a + 4 * d);
                    if (variant == 0) x = _mm256_sign_epi8(x, sg[d]);
                    __m256i p = _mm256_maddubs_epi16(ab[d], x);
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
                }
                if (h == 0) {
                    part[t] = s;
                } else {
                    __m256 sc = _mm256_mul_ps(ws, _mm256_set1_ps(ad[k * CLB_LOOP_TOK + t]));
                    acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(sc, _mm256_cvtepi32_ps(s)));
                }
            }
        }
    }
    uint64_t sum = 0;
    for (int t = 0; t < CLB_LOOP_TOK; t++) {
        float f[8];
        _mm256_storeu_ps(f, acc[t]);
        for (int i = 0; i < 8; i++) {
            uint32_t u;
            memcpy(&u, &f[i], sizeof u);
            sum = sum * 31 + u;
        }
    }
    return sum;
}

uint64_t clb_int8_loop_avx2(int variant, int64_t n_blocks) {
    __m256i wq[CLB_LOOP_BLOCKS * 8];
    int8_t aq[CLB_LOOP_BLOCKS * CLB_LOOP_TOK * 32];
    float ad[CLB_LOOP_BLOCKS * CLB_LOOP_TOK];
    for (int i = 0; i < CLB_LOOP_BLOCKS * 8; i++) wq[i] = _mm256_set1_epi8((char)(i * 7 - 60));
    for (int i = 0; i < CLB_LOOP_BLOCKS * CLB_LOOP_TOK * 32; i++) aq[i] = (int8_t)(i % 255 - 127);
    for (int i = 0; i < CLB_LOOP_BLOCKS * CLB_LOOP_TOK; i++) ad[i] = 1.0f / (float)(i + 1);
    return variant == 0 ? clb_int8_loop(0, n_blocks, wq, aq, ad)
                        : clb_int8_loop(1, n_blocks, wq, aq, ad);
}
