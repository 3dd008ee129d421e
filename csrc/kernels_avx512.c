/* Colibri AVX-512 kernels (F, BW, VL, VNNI; this file alone is built with those flags).
 * Guarantees: same contracts and memory layouts as the *_ref twins in kernels_ref.c; the q8a
 * quantizer produces the same bytes as clb_quantize_q8a_ref; integer block sums use VNNI
 * (vpdpbusd) and are exact, so results differ from the reference only by float summation order.
 * Refuses: to run on a CPU without AVX-512 F/BW/VL/VNNI; dispatch.c never selects it there. */
#include <immintrin.h>

#include "clb_kernels_isa.h"

/* float weights: masked loads handle the tail, so every n runs through the vector loop */
static __m512 clb_load_f32x16(const float *p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }

static __m512 clb_load_f16x16(const clb_f16 *p, __mmask16 k) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p));
}

static __m512 clb_load_bf16x16(const clb_bf16 *p, __mmask16 k) {
    __m512i u = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}

#define CLB_DOT_FLOAT_AVX512(NAME, WT, LOAD)                                                  \
    float NAME(int64_t n, const void *w, const void *x) {                                    \
        const WT *a = w;                                                                      \
        const float *b = x;                                                                   \
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();                        \
        __m512 acc2 = _mm512_setzero_ps(), acc3 = _mm512_setzero_ps();                        \
        const __mmask16 all = 0xffff;                                                         \
        int64_t i = 0;                                                                        \
        for (; i + 64 <= n; i += 64) {                                                        \
            acc0 = _mm512_fmadd_ps(LOAD(a + i, all), _mm512_loadu_ps(b + i), acc0);          \
            acc1 = _mm512_fmadd_ps(LOAD(a + i + 16, all), _mm512_loadu_ps(b + i + 16), acc1); \
            acc2 = _mm512_fmadd_ps(LOAD(a + i + 32, all), _mm512_loadu_ps(b + i + 32), acc2); \
            acc3 = _mm512_fmadd_ps(LOAD(a + i + 48, all), _mm512_loadu_ps(b + i + 48), acc3); \
        }                                                                                     \
        for (; i < n; i += 16) {                                                              \
            __mmask16 k = n - i >= 16 ? all : (__mmask16)((1u << (n - i)) - 1u);              \
            acc0 = _mm512_fmadd_ps(LOAD(a + i, k), _mm512_maskz_loadu_ps(k, b + i), acc0);   \
        }                                                                                     \
        return _mm512_reduce_add_ps(                                                          \
            _mm512_add_ps(_mm512_add_ps(acc0, acc1), _mm512_add_ps(acc2, acc3)));             \
    }

CLB_DOT_FLOAT_AVX512(clb_vec_dot_f32_avx512, float, clb_load_f32x16)
CLB_DOT_FLOAT_AVX512(clb_vec_dot_f16_avx512, clb_f16, clb_load_f16x16)
CLB_DOT_FLOAT_AVX512(clb_vec_dot_bf16_avx512, clb_bf16, clb_load_bf16x16)

/* per-block scales of two blocks: low 256 bits get d0, high 256 bits d1 */
static __m512 clb_scale2(float d0, float d1) {
    return _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_castps_si256(
                                                      _mm256_set1_ps(d0))),
                                                  _mm256_castps_si256(_mm256_set1_ps(d1)), 1));
}

/* q8 . q8a: vpdpbusd multiplies unsigned x signed bytes, so w's sign moves onto the
 * activation: |w| * (sign(w) * a). Two blocks per 512-bit register. */
float clb_vec_dot_q8_avx512(int64_t n, const void *w, const void *x) {
    const clb_block_q8 *a = w;
    const clb_block_q8a *b = x;
    const int64_t nb = n / CLB_QK;
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2) {
        __m512i qw = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a[i].qs)),
            _mm256_loadu_si256((const __m256i *)a[i + 1].qs), 1);
        __m512i qa = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)b[i].qs)),
            _mm256_loadu_si256((const __m256i *)b[i + 1].qs), 1);
        __mmask64 neg = _mm512_movepi8_mask(qw);
        __m512i sa = _mm512_mask_sub_epi8(qa, neg, _mm512_setzero_si512(), qa);
        __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(qw), sa);
        __m512 d = clb_scale2(_cvtsh_ss(a[i].d) * b[i].d, _cvtsh_ss(a[i + 1].d) * b[i + 1].d);
        acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(p), acc);
    }
    float s = _mm512_reduce_add_ps(acc);
    if (i < nb) {
        __m256i qw = _mm256_loadu_si256((const __m256i *)a[i].qs);
        __m256i qa = _mm256_loadu_si256((const __m256i *)b[i].qs);
        __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(qw, qw),
                                        _mm256_sign_epi8(qa, qw));
        __m256 pf = _mm256_cvtepi32_ps(p);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(pf), _mm256_extractf128_ps(pf, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        s += _cvtsh_ss(a[i].d) * b[i].d * _mm_cvtss_f32(h);
    }
    return s;
}

/* one q4 block's 32 unsigned nibbles in element order: low nibbles, then high nibbles */
static __m256i clb_q4_nibbles(const clb_block_q4 *blk) {
    const __m128i low4 = _mm_set1_epi8(0x0f);
    __m128i raw = _mm_loadu_si128((const __m128i *)blk->qs);
    __m128i lo = _mm_and_si128(raw, low4);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

/* q4 . q8a: unsigned nibbles feed vpdpbusd directly; -8 * sum(qa) restores the offset. */
float clb_vec_dot_q4_avx512(int64_t n, const void *w, const void *x) {
    const clb_block_q4 *a = w;
    const clb_block_q8a *b = x;
    const int64_t nb = n / CLB_QK;
    __m512 acc = _mm512_setzero_ps();
    float corr = 0.0f;
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2) {
        __m512i qw = _mm512_inserti64x4(_mm512_castsi256_si512(clb_q4_nibbles(&a[i])),
                                        clb_q4_nibbles(&a[i + 1]), 1);
        __m512i qa = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)b[i].qs)),
            _mm256_loadu_si256((const __m256i *)b[i + 1].qs), 1);
        __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), qw, qa);
        float d0 = _cvtsh_ss(a[i].d) * b[i].d, d1 = _cvtsh_ss(a[i + 1].d) * b[i + 1].d;
        acc = _mm512_fmadd_ps(clb_scale2(d0, d1), _mm512_cvtepi32_ps(p), acc);
        corr += d0 * (float)(-8 * b[i].sum) + d1 * (float)(-8 * b[i + 1].sum);
    }
    float s = _mm512_reduce_add_ps(acc);
    if (i < nb) {
        __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), clb_q4_nibbles(&a[i]),
                                        _mm256_loadu_si256((const __m256i *)b[i].qs));
        __m256 pf = _mm256_cvtepi32_ps(p);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(pf), _mm256_extractf128_ps(pf, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        float d = _cvtsh_ss(a[i].d) * b[i].d;
        s += d * _mm_cvtss_f32(h) + d * (float)(-8 * b[i].sum);
    }
    return s + corr;
}

/* Same arithmetic as clb_quantize_q8a_ref: exact max, scalar d and 1/d, one f32 multiply,
 * round-half-even, clamp with the value as first operand of max/min (NaN -> bound). */
void clb_quantize_q8a_avx512(int64_t n, const float *x, void *vy) {
    clb_block_q8a *y = vy;
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    for (int64_t bi = 0; bi < n / CLB_QK; bi++) {
        const float *xb = x + bi * CLB_QK;
        __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        float d = amax / 127.0f;
        float inv = d != 0.0f ? 1.0f / d : 0.0f;
        __m512 vinv = _mm512_set1_ps(inv);
        __m512 r0 = _mm512_roundscale_ps(_mm512_mul_ps(v0, vinv),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512 r1 = _mm512_roundscale_ps(_mm512_mul_ps(v1, vinv),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512i q0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r0, lo), hi));
        __m512i q1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r1, lo), hi));
        y[bi].d = d;
        y[bi].sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        _mm_storeu_si128((__m128i *)y[bi].qs, _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(y[bi].qs + 16), _mm512_cvtsepi32_epi8(q1));
    }
}
