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

/* ---- multi-row kernels on packed activations ----------------------------------------------
 * Packed activation row: one clb_q8x2 per pair of 32-element blocks (an odd last block is
 * paired with an all-zero block). qs holds the q8a values of both blocks in the order the
 * weight pair unpacks to; corr holds, per int32 lane of vpdpbusd, minus the offset the weights
 * are read with times the sum of that lane's four activation bytes, so vpdpbusd starting from
 * corr yields the exact signed lane sum; sc holds each lane's activation block scale.
 *   q8 weights are read as unsigned w + 128 (xor 0x80): lanes 0-7 block 0, 8-15 block 1.
 *   q4 weights are unsigned nibbles n = w + 8: bytes [b0 lo, b1 lo, b0 hi, b1 hi] (16 each),
 *   so lanes 0-3 and 8-11 are block 0, lanes 4-7 and 12-15 block 1.
 * Every (row, token) result runs the same instruction sequence whatever the tile shape, so
 * outputs do not depend on how rows and tokens are split. Reference: clb_gemm_q8_ref /
 * clb_gemm_q4_ref (vec_dot on q8a). */
typedef struct {
    int8_t qs[64];
    int32_t corr[16];
    float sc[16];
} clb_q8x2;
_Static_assert(sizeof(clb_q8x2) == 192, "packed pair must be 192 bytes");

size_t clb_act_size_avx512(int64_t n) {
    return (size_t)((n / CLB_QK + 1) / 2) * sizeof(clb_q8x2);
}

/* q8a-quantizes blocks 2i and 2i+1 (the second zero when past the end) */
static void clb_pair_q8a(int64_t n, const float *x, int64_t i, clb_block_q8a b[2]) {
    const int64_t nb = n / CLB_QK;
    int64_t cnt = 2 * i + 1 < nb ? 2 : 1;
    clb_quantize_q8a_avx512(cnt * CLB_QK, x + 2 * i * CLB_QK, b);
    if (cnt == 1) {
        b[1].d = 0.0f;
        b[1].sum = 0;
        for (int j = 0; j < CLB_QK; j++) b[1].qs[j] = 0;
    }
}

static __m512i clb_lane_sums(__m512i q) {
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), q);
}

void clb_act_pack_q8_avx512(int64_t n, const float *x, void *vy) {
    clb_q8x2 *y = vy;
    for (int64_t i = 0; i < (n / CLB_QK + 1) / 2; i++) {
        clb_block_q8a b[2];
        clb_pair_q8a(n, x, i, b);
        __m512i q = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)b[0].qs)),
            _mm256_loadu_si256((const __m256i *)b[1].qs), 1);
        __m512i corr = _mm512_sub_epi32(_mm512_setzero_si512(),
                                        _mm512_slli_epi32(clb_lane_sums(q), 7));
        __m512 sc = _mm512_castpd_ps(_mm512_insertf64x4(
            _mm512_castps_pd(_mm512_set1_ps(b[0].d)), _mm256_castps_pd(_mm256_set1_ps(b[1].d)),
            1));
        _mm512_storeu_si512(y[i].qs, q);
        _mm512_storeu_si512(y[i].corr, corr);
        _mm512_storeu_ps(y[i].sc, sc);
    }
}

void clb_act_pack_q4_avx512(int64_t n, const float *x, void *vy) {
    clb_q8x2 *y = vy;
    for (int64_t i = 0; i < (n / CLB_QK + 1) / 2; i++) {
        clb_block_q8a b[2];
        clb_pair_q8a(n, x, i, b);
        __m512i q = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)b[0].qs));
        q = _mm512_inserti32x4(q, _mm_loadu_si128((const __m128i *)b[1].qs), 1);
        q = _mm512_inserti32x4(q, _mm_loadu_si128((const __m128i *)(b[0].qs + 16)), 2);
        q = _mm512_inserti32x4(q, _mm_loadu_si128((const __m128i *)(b[1].qs + 16)), 3);
        __m512i corr = _mm512_sub_epi32(_mm512_setzero_si512(),
                                        _mm512_slli_epi32(clb_lane_sums(q), 3));
        __m128 s0 = _mm_set1_ps(b[0].d), s1 = _mm_set1_ps(b[1].d);
        __m512 sc = _mm512_castps128_ps512(s0);
        sc = _mm512_insertf32x4(sc, s1, 1);
        sc = _mm512_insertf32x4(sc, s0, 2);
        sc = _mm512_insertf32x4(sc, s1, 3);
        _mm512_storeu_si512(y[i].qs, q);
        _mm512_storeu_si512(y[i].corr, corr);
        _mm512_storeu_ps(y[i].sc, sc);
    }
}

/* weight pair i of a q8 row as unsigned bytes (w ^ 0x80); the second block is all zero when
 * `one` (odd tail: it is never read past the row) */
static inline __attribute__((always_inline)) __m512i clb_w8_pair(const clb_block_q8 *b, int one) {
    __m256i lo = _mm256_loadu_si256((const __m256i *)b[0].qs);
    __m256i hi = one ? _mm256_setzero_si256() : _mm256_loadu_si256((const __m256i *)b[1].qs);
    return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1),
                            _mm512_set1_epi8((char)0x80));
}

/* weight pair i of a q4 row as unsigned nibbles [b0 lo, b1 lo, b0 hi, b1 hi] */
static inline __attribute__((always_inline)) __m512i clb_w4_pair(const clb_block_q4 *b, int one) {
    __m128i r0 = _mm_loadu_si128((const __m128i *)b[0].qs);
    __m128i r1 = one ? _mm_setzero_si128() : _mm_loadu_si128((const __m128i *)b[1].qs);
    __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(r0), r1, 1);
    __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
    return _mm512_and_si512(z, _mm512_set1_epi8(0x0f));
}

/* The f32 scales of blocks k0 .. k0+nv-1 (nv <= 16) of a row, zero past nv: one gather of
 * the 16 f16 scales (4-byte reads at each block start, inside the block) instead of
 * broadcasting two scales per pair. */
static inline __attribute__((always_inline)) __m512 clb_row_scales(int Q4, const char *row,
                                                                  int64_t k0, int64_t nv) {
    const int bs = Q4 ? (int)sizeof(clb_block_q4) : (int)sizeof(clb_block_q8);
    const __m512i off = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(bs));
    __mmask16 k = nv >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nv) - 1u);
    __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), k, off,
                                            row + (size_t)k0 * (size_t)bs, 1);
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
}

/* lane -> block (within a 16-block chunk) of pair 0; pair j adds 2j */
static inline __m512i clb_pair_lanes(int Q4) {
    return Q4 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1)
              : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
}

/* one weight pair of R rows against T tokens, accumulated into acc[r][t]; sc[r] holds the
 * chunk's block scales of row r, lanes selects this pair's */
static inline __attribute__((always_inline)) void clb_tile_step(int Q4, int R, int T, int one,
                                                                int64_t i, const char *w,
                                                                size_t w_row, const char *act,
                                                                size_t act_row, __m512i lanes,
                                                                const __m512 sc[4],
                                                                __m512 acc[4][4]) {
    __m512i wq[4];
    __m512 ws[4];
    for (int r = 0; r < R; r++) {
        /* the same spot of the next row tile: decode streams weights from DRAM once, and the
         * hardware prefetcher alone leaves the memory bus idle at page boundaries (a
         * prefetch never faults, so running past the matrix is harmless) */
        _mm_prefetch(w + (size_t)(r + R) * w_row + (size_t)i * (Q4 ? 36 : 68), _MM_HINT_T0);
        if (Q4)
            wq[r] = clb_w4_pair((const clb_block_q4 *)(w + (size_t)r * w_row) + 2 * i, one);
        else
            wq[r] = clb_w8_pair((const clb_block_q8 *)(w + (size_t)r * w_row) + 2 * i, one);
        ws[r] = _mm512_permutexvar_ps(lanes, sc[r]);
    }
    for (int t = 0; t < T; t++) {
        const clb_q8x2 *a = (const clb_q8x2 *)(act + (size_t)t * act_row) + i;
        __m512i aq = _mm512_loadu_si512(a->qs);
        __m512i ac = _mm512_loadu_si512(a->corr);
        __m512 as = _mm512_loadu_ps(a->sc);
        for (int r = 0; r < R; r++) {
            __m512i p = _mm512_dpbusd_epi32(ac, wq[r], aq);
            acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(ws[r], as),
                                        acc[r][t]);
        }
    }
}

/* R rows x T tokens; Q4 selects the weight type (a constant after inlining). Blocks go in
 * chunks of 16 (8 pairs) that share one scale gather per row. */
static inline __attribute__((always_inline)) void clb_tile(int Q4, int R, int T, int64_t n,
                                                           const char *w, size_t w_row,
                                                           const char *act, size_t act_row,
                                                           float *y, int64_t ldy) {
    const int64_t nb = n / CLB_QK;
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < nb; k0 += 16) {
        const int64_t nv = nb - k0 < 16 ? nb - k0 : 16;
        __m512 sc[4];
        for (int r = 0; r < R; r++) sc[r] = clb_row_scales(Q4, w + (size_t)r * w_row, k0, nv);
        __m512i lanes = clb_pair_lanes(Q4);
        const __m512i two = _mm512_set1_epi32(2);
        for (int64_t j = 0; j < nv / 2; j++) {
            clb_tile_step(Q4, R, T, 0, k0 / 2 + j, w, w_row, act, act_row, lanes, sc, acc);
            lanes = _mm512_add_epi32(lanes, two);
        }
        if (nv & 1)
            clb_tile_step(Q4, R, T, 1, k0 / 2 + nv / 2, w, w_row, act, act_row, lanes, sc, acc);
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) y[t * ldy + r] = _mm512_reduce_add_ps(acc[r][t]);
}

/* rows in tiles of 4, tokens in tiles of 4; the remainders get smaller tiles */
#define CLB_TILE_ROWS(Q4, T)                                                                   \
    do {                                                                                       \
        int64_t r = 0;                                                                         \
        for (; r + 4 <= n_rows; r += 4)                                                        \
            clb_tile(Q4, 4, T, n, wb + (size_t)r * w_row, w_row, ab, act_row, yb + r, ldy); \
        for (; r < n_rows; r++)                                                                \
            clb_tile(Q4, 1, T, n, wb + (size_t)r * w_row, w_row, ab, act_row, yb + r, ldy); \
    } while (0)

#define CLB_GEMM_AVX512(NAME, Q4)                                                              \
    void NAME(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,        \
              size_t act_row, int64_t n_tok, float *y, int64_t ldy) {                          \
        const char *wb = w;                                                                    \
        int64_t t = 0;                                                                         \
        for (; t + 4 <= n_tok; t += 4) {                                                       \
            const char *ab = (const char *)act + (size_t)t * act_row;                          \
            float *yb = y + t * ldy;                                                           \
            CLB_TILE_ROWS(Q4, 4);                                                              \
        }                                                                                      \
        const char *ab = (const char *)act + (size_t)t * act_row;                              \
        float *yb = y + t * ldy;                                                               \
        switch (n_tok - t) {                                                                   \
        case 3: CLB_TILE_ROWS(Q4, 3); break;                                                   \
        case 2: CLB_TILE_ROWS(Q4, 2); break;                                                   \
        case 1: CLB_TILE_ROWS(Q4, 1); break;                                                   \
        default: break;                                                                        \
        }                                                                                      \
    }

CLB_GEMM_AVX512(clb_gemm_q8_avx512, 0)
CLB_GEMM_AVX512(clb_gemm_q4_avx512, 1)

/* y += a * x (reference: clb_vec_mad_f32_ref; fused multiply-add, masked tail) */
void clb_vec_mad_f32_avx512(int64_t n, float *y, const float *x, float a) {
    const __m512 va = _mm512_set1_ps(a);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 k = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        __m512 r = _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(k, x + i),
                                   _mm512_maskz_loadu_ps(k, y + i));
        _mm512_mask_storeu_ps(y + i, k, r);
    }
}
