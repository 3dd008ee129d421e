/* Colibri AVX-512 kernels (F, BW, VL, VNNI; this file alone is built with those flags).
 * Guarantees: same contracts and memory layouts as the *_ref twins in kernels_ref.c; the q8a
 * quantizer produces the same bytes as clb_quantize_q8a_ref; integer block sums use VNNI
 * (vpdpbusd) and are exact, so results differ from the reference only by float summation order.
 * Refuses: to run on a CPU without AVX-512 F/BW/VL/VNNI; dispatch.c never selects it there. */
#include <immintrin.h>
#include <string.h>

#include "clb_att_simd.h"
#include "clb_kernels.h"
#include "clb_kernels_isa.h"
#include "clb_probe.h"

/* one-token interleaved products: 256-bit vpdpbusd, EVEX-encoded (AVX-512 VNNI + VL) */
#define CLB_VNNI256_INSN "vpdpbusd"
#include "clb_vnni256.h"

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

/* ---- multi-row kernels: 16 weight rows in the 16 int32 lanes ------------------------------
 * A row group is 16 consecutive weight rows; for each 32-element block the kernel loads the
 * group's 16 blocks, transposes them in registers so that register V[d] holds, in lane r,
 * bytes 4d..4d+3 of row r's block (4x4 dword transposes inside 128-bit lanes), and multiplies
 * V[d] by token t's four activation bytes 4d..4d+3 broadcast to every lane (vpdpbusd). One
 * weight load then feeds every token, no lane ever mixes rows (no horizontal sums), and each
 * lane finishes a block with its row's exact integer block sum, which it scales and adds in
 * the reference's order: s += (d_w * d_a) * sum, a multiply, a multiply and an add (no fused
 * multiply-add). So every result equals clb_gemm_q8_ref / clb_gemm_q4_ref bit for bit, and
 * does not depend on the number of rows or tokens in the call nor on a row's place among them.
 * Packed activations (clb_block_q8c): the q8a values with corr = -(weight offset) * sum, since
 * weights are read unsigned: q8 as w + 128 (xor 0x80), q4 as its raw nibbles w + 8. */

static void clb_act_pack_q8c(int64_t n, const float *x, void *vy, int32_t offset) {
    clb_block_q8c *y = vy;
    /* q8a and q8c share their layout except the meaning of the second field */
    _Static_assert(sizeof(clb_block_q8c) == sizeof(clb_block_q8a), "q8c mirrors q8a");
    clb_quantize_q8a_avx512(n, x, y);
    for (int64_t b = 0; b < n / CLB_QK; b++) y[b].corr *= -offset;
}

void clb_act_pack_q8_avx512(int64_t n, const float *x, void *y) { clb_act_pack_q8c(n, x, y, 128); }
void clb_act_pack_q4_avx512(int64_t n, const float *x, void *y) { clb_act_pack_q8c(n, x, y, 8); }
void clb_act_pack_q6_avx512(int64_t n, const float *x, void *y) { clb_act_pack_q8c(n, x, y, 32); }
void clb_act_pack_mxfp4_avx512(int64_t n, const float *x, void *y) {
    clb_act_pack_q8c(n, x, y, CLB_MXFP4_OFFSET);
}

/* in every 128-bit lane, dword j of z[k] -> dword k of z[j] (a 4x4 transpose) */
static inline __attribute__((always_inline)) void clb_t4x4(__m512i z[4]) {
    __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    z[0] = _mm512_unpacklo_epi64(t0, t2);
    z[1] = _mm512_unpackhi_epi64(t0, t2);
    z[2] = _mm512_unpacklo_epi64(t1, t3);
    z[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* 16 bytes at offset off of rows k, k+4, k+8, k+12 of the group in 128-bit lanes 0..3 */
static inline __attribute__((always_inline)) __m512i clb_load4x16(const char *const rp[16],
                                                                  int k, size_t off) {
    __m512i z = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(rp[k] + off)));
    z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(rp[k + 4] + off)), 1);
    z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(rp[k + 8] + off)), 2);
    return _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(rp[k + 12] + off)), 3);
}

/* block b of the 16 rows as unsigned bytes: v[d] lane r = bytes 4d..4d+3 of row r's block */
static inline __attribute__((always_inline)) void clb_weights16(int Q4, const char *const rp[16],
                                                                int64_t b, __m512i v[8]) {
    if (Q4) {
        const __m512i low4 = _mm512_set1_epi8(0x0f);
        size_t off = (size_t)b * sizeof(clb_block_q4) + 2;
        for (int k = 0; k < 4; k++) v[k] = clb_load4x16(rp, k, off);
        clb_t4x4(v);
        for (int j = 0; j < 4; j++) { /* element j<16 low nibble of byte j, j+16 high nibble */
            v[4 + j] = _mm512_and_si512(_mm512_srli_epi16(v[j], 4), low4);
            v[j] = _mm512_and_si512(v[j], low4);
        }
    } else {
        const __m512i bias = _mm512_set1_epi8((char)0x80);
        size_t off = (size_t)b * sizeof(clb_block_q8) + 2;
        for (int h = 0; h < 2; h++) {
            for (int k = 0; k < 4; k++) v[4 * h + k] = clb_load4x16(rp, k, off + 16 * (size_t)h);
            clb_t4x4(v + 4 * h);
        }
        for (int d = 0; d < 8; d++) v[d] = _mm512_xor_si512(v[d], bias);
    }
}

/* the f16 scales of block b of the 16 rows as f32 (4-byte reads at each block start) */
static inline __attribute__((always_inline)) __m512 clb_scales16(int Q4, const char *rp0,
                                                                 __m512i roff, int64_t b) {
    const size_t bs = Q4 ? sizeof(clb_block_q4) : sizeof(clb_block_q8);
    __m512i g = _mm512_i32gather_epi32(roff, rp0 + (size_t)b * bs, 1);
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
}

/* acc += w (unsigned bytes) . the 4 signed bytes at p, broadcast to every lane, with the
 * broadcast folded into vpdpbusd's memory operand ({1to16}). GCC keeps _mm512_set1_epi32 +
 * _mm512_dpbusd_epi32 as two instructions; folded, the products of 8 or 16 tokens ran 18 to
 * 25% faster on one Zen 4 core (bench_kernels, L3-resident matrix). Same result bits. */
typedef struct {
    int8_t b[4];
} clb_i8x4;

static inline __attribute__((always_inline)) __m512i clb_dpbusd_bcast(__m512i acc, __m512i w,
                                                                      const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const clb_i8x4 *)p));
    return acc;
}

/* Block b of TT tokens (a constant after inlining) against 16 rows' unsigned weights v (lane r:
 * row r) with scales ws: each lane's exact integer block sum (started at corr), then the
 * reference's order, acc += (d_w * d_a) * sum, a multiply, a multiply and an add. */
static inline __attribute__((always_inline)) void clb_block_tokens(int TT, const __m512i v[8],
                                                                   __m512 ws, const char *act,
                                                                   size_t act_row, int64_t b,
                                                                   __m512 *acc) {
    for (int t = 0; t < TT; t++) {
        const clb_block_q8c *a = (const clb_block_q8c *)(act + (size_t)t * act_row) + b;
        /* two chains of four: integer sums are exact in any order */
        __m512i s0 = _mm512_set1_epi32(a->corr), s1 = _mm512_setzero_si512();
        for (int d = 0; d < 4; d++) {
            s0 = clb_dpbusd_bcast(s0, v[d], a->qs + 4 * d);
            s1 = clb_dpbusd_bcast(s1, v[4 + d], a->qs + 16 + 4 * d);
        }
        __m512 scale = _mm512_mul_ps(ws, _mm512_set1_ps(a->d));
        __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
        acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(scale, sum));
    }
}

/* TT tokens (a constant after inlining) against one row group; rp: the 16 row pointers (rows
 * past the matrix repeat a real row and are not stored), nv: rows to store */
static inline __attribute__((always_inline)) void clb_group(int Q4, int TT, int64_t n,
                                                            const char *const rp[16],
                                                            __m512i roff, const char *act,
                                                            size_t act_row, float *y,
                                                            int64_t ldy, __mmask16 keep) {
    __m512 acc[CLB_TT];
    for (int t = 0; t < TT; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < n / CLB_QK; b++) {
        __m512i v[8];
        clb_weights16(Q4, rp, b, v);
        __m512 ws = clb_scales16(Q4, rp[0], roff, b);
        clb_block_tokens(TT, v, ws, act, act_row, b, acc);
    }
    for (int t = 0; t < TT; t++) _mm512_mask_storeu_ps(y + t * ldy, keep, acc[t]);
}

static inline __attribute__((always_inline)) void clb_gemm16(int Q4, int64_t n, int64_t n_rows,
                                                             const void *w, size_t w_row,
                                                             const void *act, size_t act_row,
                                                             int64_t n_tok, float *y,
                                                             int64_t ldy) {
    const char *wb = w;
    if (n_tok == 1 && !Q4) {
        /* nothing to share: one sequential read per row (kernels_avx2.c) measured faster for q8;
         * for q4 the row group stays ahead (its nibble unpacking is shared by 16 rows) */
        clb_rows1_q8_avx2(n, n_rows, w, w_row, act, y);
        return;
    }
    for (int64_t r0 = 0; r0 < n_rows; r0 += 16) {
        const int64_t nv = n_rows - r0 < 16 ? n_rows - r0 : 16;
        const char *rp[16];
        int32_t offs[16];
        for (int r = 0; r < 16; r++) {
            int64_t row = r < nv ? r : nv - 1;
            rp[r] = wb + (size_t)(r0 + row) * w_row;
            /* the matmul caller keeps 16 rows of a matrix under 2 GiB */
            offs[r] = (int32_t)((size_t)row * w_row);
        }
        const __m512i roff = _mm512_loadu_si512(offs);
        const __mmask16 keep = (__mmask16)((1u << nv) - 1u);
#define CLB_GROUP_PASS(TT, AT, YT) clb_group(Q4, TT, n, rp, roff, AT, act_row, YT, ldy, keep)
        CLB_PASSES(CLB_GROUP_PASS)
#undef CLB_GROUP_PASS
    }
}

void clb_gemm_q8_avx512(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,
                        size_t act_row, int64_t n_tok, float *y, int64_t ldy) {
    clb_gemm16(0, n, n_rows, w, w_row, act, act_row, n_tok, y, ldy);
}

void clb_gemm_q4_avx512(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,
                        size_t act_row, int64_t n_tok, float *y, int64_t ldy) {
    clb_gemm16(1, n, n_rows, w, w_row, act, act_row, n_tok, y, ldy);
}

/* ---- interleaved weights (q8x8, q4x8, q6x8, mxfp4x8): two 8-row groups in 256-bit halves -
 * The layout (clb_types.h) already holds, per group and block, the registers the row-group
 * kernel above builds by transposing: 32 bytes whose dword r is row r's bytes 4d..4d+3. Two
 * neighbouring groups' registers side by side make the 16-lane register, one 256-bit insert
 * each, shared by every token of the pass; so the products need no transposes and no sign
 * step (weights read unsigned: q8 xor 0x80, q4 raw nibbles, q6 nibbles with its high bits
 * or'ed in, mxfp4 nibbles looked up as doubled values + 12 by one vpshufb per register, its
 * scales 2^(e - 128) built from the exponent bytes; corr in the activations), and each token
 * costs one vpdpbusd per 64 weight bytes
 * (clb_dpbusd_bcast). Each group is one sequential stream, prefetched about 3.3 KB ahead
 * (chosen on Zen 4's decode when this pass also took one token: q8 ran alike from 6 to 32
 * blocks ahead; q4 one thread ran 30% faster 24 blocks ahead than 12, and no faster at 36 or
 * 48; q6 and mxfp4 take the same distance in bytes, not measured on their own). It now takes
 * two tokens
 * or more; one token goes through clb_vnni256.h's pass (clb_gemm_x16). A matrix with an odd
 * number of groups pairs its last group with itself and stores the low half. Same per-lane
 * arithmetic as clb_group, so the same bits as the reference. */

/* blocks ahead: about 3.3 KB of each stream for every type */
#define CLB_X16_PF_AHEAD(QT)                                                                 \
    ((QT) == CLB_QT_Q8 ? 12 : (QT) == CLB_QT_Q4 || (QT) == CLB_QT_MXFP4 ? 24 : 16)

/* (h >> 2j) & 3 moved to bits 4..5 of every byte: q6's high bits for nibble register j
 * (clb_vnni256.h's clb_q6_hi at double width) */
static inline __attribute__((always_inline)) __m512i clb_q6_hi16(__m512i h, int j) {
    const __m512i m = _mm512_set1_epi8(0x30);
    switch (j) {
    case 0: return _mm512_and_si512(_mm512_slli_epi16(h, 4), m);
    case 1: return _mm512_and_si512(_mm512_slli_epi16(h, 2), m);
    case 2: return _mm512_and_si512(h, m);
    default: return _mm512_and_si512(_mm512_srli_epi16(h, 2), m);
    }
}

/* the 8 e8m0 exponents at p0 and the 8 at p1 as 2^(e - 128), bit for bit clb_e8m0_half (see
 * clb_e8m0_half8) */
static inline __attribute__((always_inline)) __m512 clb_e8m0_half16(const char *p0,
                                                                    const char *p1) {
    uint64_t e0, e1;
    memcpy(&e0, p0, sizeof e0);
    memcpy(&e1, p1, sizeof e1);
    const __m512i e = _mm512_cvtepu8_epi32(_mm_set_epi64x((long long)e1, (long long)e0));
    const __m512i norm = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i sub = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    const __mmask16 small = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(small, norm, sub));
}

static inline __attribute__((always_inline)) __m512i clb_pair256(const char *p0, const char *p1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p0)),
                              _mm256_loadu_si256((const __m256i *)p1), 1);
}

static inline __attribute__((always_inline)) void clb_pass_x16(int QT, int NTA, int TT, int64_t n,
                                                               const char *g0, const char *g1,
                                                               const char *act, size_t act_row,
                                                               float *y, int64_t ldy,
                                                               __mmask16 keep) {
    const size_t gb = 8 * CLB_QT_BLOCK(QT);
    const int64_t nb = n / CLB_QK;
    /* past a group's end its prefetch goes on one group further: the first group's into the
     * second (read already by the other stream), the second's into the next pair's first
     * group. Aiming both at the next pair measured slower on Zen 5. */
    const uintptr_t next = (uintptr_t)nb * gb, ahead = CLB_X16_PF_AHEAD(QT) * gb;
    __m512 acc[CLB_TT]; /* 8 accumulators + 8 weight registers */
    for (int t = 0; t < TT; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const char *p0 = g0 + (size_t)b * gb, *p1 = g1 + (size_t)b * gb;
        /* prefetches never fault, so the addresses may lie past the matrix (computed as
         * integers, not as pointers past their object). Near its end each stream moves on one
         * group, so the next pass starts with one of its two groups in cache. Into L2 (T1):
         * measured faster than into L1 on Zen 4's decode, where each core has two streams to
         * keep in flight; non-temporal (NTA) where clb_stream_hint_active() says so. */
        const uintptr_t pf = ahead + (b + CLB_X16_PF_AHEAD(QT) >= nb ? next : 0);
        for (size_t l = 0; l < gb; l += 64) {
            if (NTA) {
                _mm_prefetch((const char *)((uintptr_t)p0 + pf + l), _MM_HINT_NTA);
                _mm_prefetch((const char *)((uintptr_t)p1 + pf + l), _MM_HINT_NTA);
            } else {
                _mm_prefetch((const char *)((uintptr_t)p0 + pf + l), _MM_HINT_T1);
                _mm_prefetch((const char *)((uintptr_t)p1 + pf + l), _MM_HINT_T1);
            }
        }
        const __m512 ws = QT == CLB_QT_MXFP4
            ? clb_e8m0_half16(p0, p1)
            : _mm512_cvtph_ps(_mm256_inserti128_si256(
                  _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p0)),
                  _mm_loadu_si128((const __m128i *)p1), 1));
        __m512i v[8];
        if (QT != CLB_QT_Q8) {
            const __m512i low4 = _mm512_set1_epi8(0x0f);
            const size_t qo = CLB_QT_SCALES(QT);
            for (int j = 0; j < 4; j++) {
                __m512i z = clb_pair256(p0 + qo + 32 * j, p1 + qo + 32 * j);
                v[j] = _mm512_and_si512(z, low4);
                v[4 + j] = _mm512_and_si512(_mm512_srli_epi16(z, 4), low4);
            }
            if (QT == CLB_QT_MXFP4) {
                const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(CLB_MXFP4_UVALUES));
                for (int j = 0; j < 8; j++) v[j] = _mm512_shuffle_epi8(lut, v[j]);
            }
            if (QT == CLB_QT_Q6) { /* the high bits of elements 0..15, then of 16..31 */
                const __m512i h0 = clb_pair256(p0 + 144, p1 + 144);
                const __m512i h1 = clb_pair256(p0 + 176, p1 + 176);
                for (int j = 0; j < 4; j++) {
                    v[j] = _mm512_or_si512(v[j], clb_q6_hi16(h0, j));
                    v[4 + j] = _mm512_or_si512(v[4 + j], clb_q6_hi16(h1, j));
                }
            }
        } else {
            const __m512i bias = _mm512_set1_epi8((char)0x80);
            for (int d = 0; d < 8; d++)
                v[d] = _mm512_xor_si512(clb_pair256(p0 + 16 + 32 * d, p1 + 16 + 32 * d), bias);
        }
        clb_block_tokens(TT, v, ws, act, act_row, b, acc);
    }
    for (int t = 0; t < TT; t++) _mm512_mask_storeu_ps(y + t * ldy, keep, acc[t]);
}

static inline __attribute__((always_inline)) void clb_gemm_x16_hint(int QT, int NTA, int64_t n,
                                                                    int64_t n_rows,
                                                                    const void *w, size_t w_row,
                                                                    const void *act,
                                                                    size_t act_row,
                                                                    int64_t n_tok, float *y,
                                                                    int64_t ldy) {
    for (int64_t r0 = 0; r0 + 8 <= n_rows; r0 += 16) {
        const int two = n_rows - r0 >= 16;
        const char *g0 = (const char *)w + (size_t)r0 * w_row;
        const char *g1 = two ? g0 + 8 * w_row : g0;
        const __mmask16 keep = two ? (__mmask16)0xffff : (__mmask16)0x00ff;
#define CLB_X16_PASS(TT, AT, YT) \
    clb_pass_x16(QT, NTA, TT, n, g0, g1, AT, act_row, YT, ldy, keep)
        CLB_PASSES(CLB_X16_PASS)
#undef CLB_X16_PASS
    }
}

/* One token goes through the 256-bit pass of clb_vnni256.h instead: one 8-row group, one
 * stream per pass, prefetched into L1 about 6 KB ahead. On a Zen 5 (colibri bench, this build
 * and the one with the 16-row pass for every count, alternated): decode 1.14x as fast on the
 * benchmark model's q8 and 1.11x on its q4 with one thread; the wider model's q4 at 90.7% of
 * the same minutes' read against 73.2%. The products of several tokens, which share each
 * weight load between tokens, keep the 16-row pass. */
static inline __attribute__((always_inline)) void clb_gemm_x16(int QT, int64_t n, int64_t n_rows,
                                                               const void *w, size_t w_row,
                                                               const void *act, size_t act_row,
                                                               int64_t n_tok, float *y,
                                                               int64_t ldy) {
    if (n_tok == 1)
        clb_gemm8_vnni(QT, n, n_rows, w, w_row, act, act_row, n_tok, y, ldy);
    else if (clb_stream_hint_active() == CLB_STREAM_NTA)
        clb_gemm_x16_hint(QT, 1, n, n_rows, w, w_row, act, act_row, n_tok, y, ldy);
    else
        clb_gemm_x16_hint(QT, 0, n, n_rows, w, w_row, act, act_row, n_tok, y, ldy);
}

void clb_gemm_q8x8_avx512(int64_t n, int64_t n_rows, const void *w, size_t w_row,
                          const void *act, size_t act_row, int64_t n_tok, float *y, int64_t ldy) {
    clb_gemm_x16(CLB_QT_Q8, n, n_rows, w, w_row, act, act_row, n_tok, y, ldy);
}

void clb_gemm_q4x8_avx512(int64_t n, int64_t n_rows, const void *w, size_t w_row,
                          const void *act, size_t act_row, int64_t n_tok, float *y, int64_t ldy) {
    clb_gemm_x16(CLB_QT_Q4, n, n_rows, w, w_row, act, act_row, n_tok, y, ldy);
}

void clb_gemm_q6x8_avx512(int64_t n, int64_t n_rows, const void *w, size_t w_row,
                          const void *act, size_t act_row, int64_t n_tok, float *y, int64_t ldy) {
    clb_gemm_x16(CLB_QT_Q6, n, n_rows, w, w_row, act, act_row, n_tok, y, ldy);
}

void clb_gemm_mxfp4x8_avx512(int64_t n, int64_t n_rows, const void *w, size_t w_row,
                             const void *act, size_t act_row, int64_t n_tok, float *y,
                             int64_t ldy) {
    clb_gemm_x16(CLB_QT_MXFP4, n, n_rows, w, w_row, act, act_row, n_tok, y, ldy);
}

/* ---- the ceiling of the interleaved products' arithmetic (bench_kernels) -----------------
 * n_calls products of clb_gemm_x16 (as clb_gemm_q8x8_avx512 / clb_gemm_q4x8_avx512 run it, the
 * token count read at run time as in a real call) on two 8-row groups of CLB_LOOP512_N values
 * against 8 tokens, all in L1: what the kernel's instruction mix allows with no memory in the
 * way; or vpdpbusd alone on 8 accumulators, the most any int8 product reaches on this core.
 * Each call sees a different input and feeds a checksum, so none can be left out. */
#define CLB_LOOP512_N 512
_Static_assert(16 * CLB_LOOP512_N * 8 == CLB_INT8_LOOP_MACS_PER_CALL, "probe size");

/* QT a constant after inlining, as in the real products */
static inline __attribute__((always_inline)) uint64_t clb_loop512_kernel(int QT,
                                                                         int64_t n_calls) {
    enum { NB = CLB_LOOP512_N / CLB_QK };
    const size_t gb = 8 * CLB_QT_BLOCK(QT);
    unsigned char w[2 * NB * 8 * sizeof(clb_block_q8)] __attribute__((aligned(64)));
    clb_block_q8c act[8 * NB];
    float y[8 * 16];
    clb_probe_fill(w, 2 * NB, gb, act, 8 * NB);
    volatile int64_t n_tok = 8;
    uint64_t sum = 0;
    for (int64_t c = 0; c < n_calls; c++) {
        act[0].d = (float)(c & 1023); /* a new input for every call */
        clb_gemm_x16(QT, CLB_LOOP512_N, 16, w, NB * gb / 8, act, NB * sizeof(clb_block_q8c),
                     n_tok, y, 16);
        sum = clb_probe_mix(sum, y, 8 * 16, c);
    }
    return sum;
}

static uint64_t clb_loop512_dpbusd(int64_t n_calls) {
    __m512i s0 = _mm512_set1_epi32(0), s1 = _mm512_set1_epi32(1), s2 = _mm512_set1_epi32(2),
            s3 = _mm512_set1_epi32(3), s4 = _mm512_set1_epi32(4), s5 = _mm512_set1_epi32(5),
            s6 = _mm512_set1_epi32(6), s7 = _mm512_set1_epi32(7);
    const __m512i w = _mm512_set1_epi8(3);
    uint64_t sum = 0;
    for (int64_t c = 0; c < n_calls; c++) {
        const int8_t a[4] = {(int8_t)c, 1, 2, 3};
        /* CLB_INT8_LOOP_MACS_PER_CALL / 64 instructions, 8 independent chains */
        for (int i = 0; i < CLB_INT8_LOOP_MACS_PER_CALL / 64 / 8; i++) {
            s0 = clb_dpbusd_bcast(s0, w, a);
            s1 = clb_dpbusd_bcast(s1, w, a);
            s2 = clb_dpbusd_bcast(s2, w, a);
            s3 = clb_dpbusd_bcast(s3, w, a);
            s4 = clb_dpbusd_bcast(s4, w, a);
            s5 = clb_dpbusd_bcast(s5, w, a);
            s6 = clb_dpbusd_bcast(s6, w, a);
            s7 = clb_dpbusd_bcast(s7, w, a);
        }
        __m512i t = _mm512_add_epi32(_mm512_add_epi32(s0, s1), _mm512_add_epi32(s2, s3));
        t = _mm512_add_epi32(t, _mm512_add_epi32(_mm512_add_epi32(s4, s5),
                                                 _mm512_add_epi32(s6, s7)));
        sum = sum * 31 + (uint32_t)_mm512_reduce_add_epi32(t);
    }
    return sum;
}

uint64_t clb_int8_loop_avx512(int variant, int64_t n_calls) {
    if (variant == 0) return clb_loop512_kernel(CLB_QT_Q8, n_calls);
    if (variant == 1) return clb_loop512_kernel(CLB_QT_Q4, n_calls);
    return clb_loop512_dpbusd(n_calls);
}

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

/* The AVX2 dots with 16-lane accumulators (lane j: elements j, j + 16, ...; a tail of fewer
 * than 16 read through a mask, its other lanes adding zeros), folded to 8 lanes (j + 8 onto
 * j) and then reduced, scaled and compared as there: half the multiply-adds. The rows' sums
 * differ from the AVX2 ones only in the order of their additions, and each row's sum is the
 * same in any call. */
float clb_att_dots_f32_avx512(int64_t hd, const float *q, const float *k, int64_t ldk,
                              int64_t n, float scale, float *s) {
    const int64_t hv = hd - hd % 16;
    const __mmask16 tail = (__mmask16)((1u << (hd - hv)) - 1u);
    __m256 top = _mm256_set1_ps(-INFINITY);
    for (int64_t r0 = 0; r0 < n; r0 += 8) {
        const float *kr[8];
        clb_rows8(k, ldk, r0, n, kr);
        __m512 a[8];
        for (int i = 0; i < 8; i++) a[i] = _mm512_setzero_ps();
        for (int64_t d = 0; d < hv; d += 16) {
            const __m512 qd = _mm512_loadu_ps(q + d);
            for (int i = 0; i < 8; i++) a[i] = _mm512_fmadd_ps(_mm512_loadu_ps(kr[i] + d), qd, a[i]);
        }
        if (tail) {
            const __m512 qd = _mm512_maskz_loadu_ps(tail, q + hv);
            for (int i = 0; i < 8; i++)
                a[i] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, kr[i] + hv), qd, a[i]);
        }
        __m256 h[8];
        for (int i = 0; i < 8; i++)
            h[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[i]), 1)));
        top = clb_scores8(clb_sum8x8(h), hd, hd, q, kr, scale, r0, n, s, top);
    }
    return clb_max8(top);
}

/* clb_att_mad_rows_f32_avx2 at double width: 64 output values at a time in registers across
 * all the rows, then 16, then a masked tail; each element sees the same fused multiply-adds,
 * in row order, as clb_vec_mad_f32_avx512 called once per row, so the bits are the AVX2
 * kernel's too. */
void clb_att_mad_rows_f32_avx512(int64_t hd, float *out, const float *v, int64_t ldv, int64_t n,
                                 const float *w) {
    int64_t d = 0;
    for (; d + 64 <= hd; d += 64) {
        __m512 o[4];
        for (int j = 0; j < 4; j++) o[j] = _mm512_loadu_ps(out + d + 16 * j);
        for (int64_t r = 0; r < n; r++) {
            const float *vr = v + r * ldv + d;
            const __m512 wr = _mm512_set1_ps(w[r]);
            for (int j = 0; j < 4; j++) o[j] = _mm512_fmadd_ps(wr, _mm512_loadu_ps(vr + 16 * j), o[j]);
        }
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(out + d + 16 * j, o[j]);
    }
    for (; d < hd; d += 16) {
        const __mmask16 km = hd - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (hd - d)) - 1u);
        __m512 o = _mm512_maskz_loadu_ps(km, out + d);
        for (int64_t r = 0; r < n; r++)
            o = _mm512_fmadd_ps(_mm512_set1_ps(w[r]), _mm512_maskz_loadu_ps(km, v + r * ldv + d), o);
        _mm512_mask_storeu_ps(out + d, km, o);
    }
}

/* ---- MXFP4 rows against q8a rows ---------------------------------------------------------
 * Four blocks per register, one in each 128-bit lane: low and high nibbles unpacked side by
 * side give a block's elements 0..15 (A) and 16..31 (B), a shuffle their doubled values plus
 * 12 (0..24, unsigned for vpdpbusd); the offset comes back out as 12 * the activations' sum,
 * which q8a carries. Each block's sum is exact, and the four are added into s in the
 * reference's order, s += (2^(e - 128) * d_a) * sum: bit for bit clb_gemm_mxfp4_ref. */
static inline __attribute__((always_inline)) __m128i clb_mxfp4_quad(const clb_block_mxfp4 *w,
                                                                    const clb_block_q8a *a,
                                                                    __m512i lut) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512i raw = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)w[0].qs));
    raw = _mm512_inserti32x4(raw, _mm_loadu_si128((const __m128i *)w[1].qs), 1);
    raw = _mm512_inserti32x4(raw, _mm_loadu_si128((const __m128i *)w[2].qs), 2);
    raw = _mm512_inserti32x4(raw, _mm_loadu_si128((const __m128i *)w[3].qs), 3);
    __m512i lo = _mm512_and_si512(raw, m4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
    __m512i wa = _mm512_shuffle_epi8(lut, _mm512_unpacklo_epi8(lo, hi)); /* elements 0..15 */
    __m512i wb = _mm512_shuffle_epi8(lut, _mm512_unpackhi_epi8(lo, hi)); /* 16..31 */
    __m512i qa = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)a[0].qs));
    __m512i qb = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(a[0].qs + 16)));
    for (int k = 1; k < 4; k++) { /* the lane index of an insert must be a constant */
        const __m128i x = _mm_loadu_si128((const __m128i *)a[k].qs);
        const __m128i z = _mm_loadu_si128((const __m128i *)(a[k].qs + 16));
        if (k == 1) {
            qa = _mm512_inserti32x4(qa, x, 1);
            qb = _mm512_inserti32x4(qb, z, 1);
        } else if (k == 2) {
            qa = _mm512_inserti32x4(qa, x, 2);
            qb = _mm512_inserti32x4(qb, z, 2);
        } else {
            qa = _mm512_inserti32x4(qa, x, 3);
            qb = _mm512_inserti32x4(qb, z, 3);
        }
    }
    __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wa, qa);
    acc = _mm512_dpbusd_epi32(acc, wb, qb);
    /* each lane's four dwords summed into its first: lane k is block k */
    acc = _mm512_add_epi32(acc, _mm512_shuffle_epi32(acc, _MM_PERM_BADC));
    acc = _mm512_add_epi32(acc, _mm512_shuffle_epi32(acc, _MM_PERM_CDAB));
    const __m512i pick = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    __m128i sums = _mm512_castsi512_si128(_mm512_permutexvar_epi32(pick, acc));
    const __m128i corr = _mm_mullo_epi32(_mm_setr_epi32(a[0].sum, a[1].sum, a[2].sum, a[3].sum),
                                         _mm_set1_epi32(12));
    return _mm_sub_epi32(sums, corr);
}

float clb_vec_dot_mxfp4_avx512(int64_t n, const void *vw, const void *vx) {
    const clb_block_mxfp4 *w = vw;
    const clb_block_q8a *a = vx;
    const __m512i lut = _mm512_broadcast_i32x4(
        _mm_add_epi8(_mm_setr_epi8(CLB_MXFP4_VALUES), _mm_set1_epi8(12)));
    const int64_t nb = n / CLB_QK;
    float s = 0.0f;
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        int32_t sum[4];
        _mm_storeu_si128((__m128i *)sum, clb_mxfp4_quad(w + b, a + b, lut));
        for (int k = 0; k < 4; k++) s += clb_e8m0_half(w[b + k].e) * a[b + k].d * (float)sum[k];
    }
    if (b < nb) { /* the last one to three blocks, the missing lanes copies of the last */
        clb_block_mxfp4 wq[4];
        clb_block_q8a aq[4];
        for (int k = 0; k < 4; k++) {
            const int64_t i = b + k < nb ? b + k : nb - 1;
            wq[k] = w[i];
            aq[k] = a[i];
        }
        int32_t sum[4];
        _mm_storeu_si128((__m128i *)sum, clb_mxfp4_quad(wq, aq, lut));
        for (int k = 0; b + k < nb; k++)
            s += clb_e8m0_half(w[b + k].e) * a[b + k].d * (float)sum[k];
    }
    return s;
}

void clb_gemm_mxfp4_avx512(int64_t n, int64_t n_rows, const void *w, size_t w_row,
                           const void *act, size_t act_row, int64_t n_tok, float *y, int64_t ldy) {
    clb_gemm_by_dot(clb_vec_dot_mxfp4_avx512, n, n_rows, w, w_row, act, act_row, n_tok, y, ldy);
}
