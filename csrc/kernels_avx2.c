/* Colibri AVX2 + FMA + F16C kernels (this file alone is built with -mavx2 -mfma -mf16c).
 * Guarantees: same contracts and memory layouts as the *_ref twins in kernels_ref.c; the q8a
 * quantizer produces the same bytes as clb_quantize_q8a_ref; dot products differ from the
 * reference only by float summation order.
 * Refuses: to run on a CPU without AVX2/FMA/F16C; dispatch.c never selects it there. */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "clb_kernels_isa.h"

static float clb_hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static int32_t clb_hsum256_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

/* 8 bf16 -> 8 f32: bf16 is the upper half of an f32 */
static __m256 clb_load_bf16x8(const clb_bf16 *p) {
    __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}

static __m256 clb_load_f16x8(const clb_f16 *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* float weights: four independent FMA chains hide the FMA latency; scalar tail */
#define CLB_DOT_FLOAT_AVX2(NAME, WT, LOAD, SCALAR)                                           \
    float NAME(int64_t n, const void *w, const void *x) {                                    \
        const WT *a = w;                                                                      \
        const float *b = x;                                                                   \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();                        \
        __m256 acc2 = _mm256_setzero_ps(), acc3 = _mm256_setzero_ps();                        \
        int64_t i = 0;                                                                        \
        for (; i + 32 <= n; i += 32) {                                                        \
            acc0 = _mm256_fmadd_ps(LOAD(a + i), _mm256_loadu_ps(b + i), acc0);               \
            acc1 = _mm256_fmadd_ps(LOAD(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);       \
            acc2 = _mm256_fmadd_ps(LOAD(a + i + 16), _mm256_loadu_ps(b + i + 16), acc2);     \
            acc3 = _mm256_fmadd_ps(LOAD(a + i + 24), _mm256_loadu_ps(b + i + 24), acc3);     \
        }                                                                                     \
        for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(LOAD(a + i), _mm256_loadu_ps(b + i), acc0); \
        float s = clb_hsum256(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3))); \
        for (; i < n; i++) s += SCALAR(a[i]) * b[i];                                          \
        return s;                                                                             \
    }

#define CLB_ID(v) (v)
CLB_DOT_FLOAT_AVX2(clb_vec_dot_f32_avx2, float, _mm256_loadu_ps, CLB_ID)
CLB_DOT_FLOAT_AVX2(clb_vec_dot_f16_avx2, clb_f16, clb_load_f16x8, clb_f16_to_f32)
CLB_DOT_FLOAT_AVX2(clb_vec_dot_bf16_avx2, clb_bf16, clb_load_bf16x8, clb_bf16_to_f32)

/* q8 . q8a: maddubs wants unsigned x signed, so move w's sign onto the activation
 * (|w| * sign(w)*a); pairs stay below 2*128*127 and cannot saturate int16. */
float clb_vec_dot_q8_avx2(int64_t n, const void *w, const void *x) {
    const clb_block_q8 *a = w;
    const clb_block_q8a *b = x;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / CLB_QK; i++) {
        __m256i qw = _mm256_loadu_si256((const __m256i *)a[i].qs);
        __m256i qa = _mm256_loadu_si256((const __m256i *)b[i].qs);
        __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qa, qw));
        __m256i p32 = _mm256_madd_epi16(p16, ones);
        __m256 d = _mm256_set1_ps(_cvtsh_ss(a[i].d) * b[i].d);
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(p32), acc);
    }
    return clb_hsum256(acc);
}

/* q4 . q8a: nibbles are read unsigned (0..15) so maddubs applies directly; the -8 offset is
 * folded in afterwards as -8 * sum(qa), which q8a carries precomputed. */
float clb_vec_dot_q4_avx2(int64_t n, const void *w, const void *x) {
    const clb_block_q4 *a = w;
    const clb_block_q8a *b = x;
    const __m256i ones = _mm256_set1_epi16(1);
    const __m128i low4 = _mm_set1_epi8(0x0f);
    __m256 acc = _mm256_setzero_ps();
    float corr = 0.0f;
    for (int64_t i = 0; i < n / CLB_QK; i++) {
        __m128i raw = _mm_loadu_si128((const __m128i *)a[i].qs);
        __m128i lo = _mm_and_si128(raw, low4);
        __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
        __m256i qw = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
        __m256i qa = _mm256_loadu_si256((const __m256i *)b[i].qs);
        __m256i p32 = _mm256_madd_epi16(_mm256_maddubs_epi16(qw, qa), ones);
        float d = _cvtsh_ss(a[i].d) * b[i].d;
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(p32), acc);
        corr += d * (float)(-8 * b[i].sum);
    }
    return clb_hsum256(acc) + corr;
}

/* Same arithmetic as clb_quantize_q8a_ref: exact max, scalar d and 1/d, one f32 multiply,
 * round-half-even, clamp with the value as first operand of max/min (NaN -> bound). */
void clb_quantize_q8a_avx2(int64_t n, const float *x, void *vy) {
    clb_block_q8a *y = vy;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t bi = 0; bi < n / CLB_QK; bi++) {
        const float *xb = x + bi * CLB_QK;
        __m256 v[4];
        __m256 m = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) {
            v[k] = _mm256_loadu_ps(xb + 8 * k);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[k]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float amax = _mm_cvtss_f32(m4);
        float d = amax / 127.0f;
        float inv = d != 0.0f ? 1.0f / d : 0.0f;
        __m256 vinv = _mm256_set1_ps(inv);
        __m256i q[4];
        for (int k = 0; k < 4; k++) {
            __m256 r = _mm256_round_ps(_mm256_mul_ps(v[k], vinv),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
            q[k] = _mm256_cvtps_epi32(r);
        }
        int32_t sum = clb_hsum256_i32(
            _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
        /* packs work per 128-bit lane; the permute puts the 32 bytes back in order */
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        p = _mm256_permutevar8x32_epi32(p, perm);
        y[bi].d = d;
        y[bi].sum = sum;
        _mm256_storeu_si256((__m256i *)y[bi].qs, p);
    }
}

/* multi-row products on q8a rows (reference: clb_gemm_q8_ref / _q4_ref) */
void clb_gemm_q8_avx2(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,
                      size_t act_row, int64_t n_tok, float *y, int64_t ldy) {
    clb_gemm_by_dot(clb_vec_dot_q8_avx2, n, n_rows, w, w_row, act, act_row, n_tok, y, ldy);
}

void clb_gemm_q4_avx2(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,
                      size_t act_row, int64_t n_tok, float *y, int64_t ldy) {
    clb_gemm_by_dot(clb_vec_dot_q4_avx2, n, n_rows, w, w_row, act, act_row, n_tok, y, ldy);
}

/* y += a * x (reference: clb_vec_mad_f32_ref; fused multiply-add, one rounding per element) */
void clb_vec_mad_f32_avx2(int64_t n, float *y, const float *x, float a) {
    const __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i,
                         _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] = fmaf(a, x[i], y[i]);
}
