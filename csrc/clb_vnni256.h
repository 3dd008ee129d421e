/* The interleaved products (q8x8, q4x8, q6x8, mxfp4x8 weights, clb_block_q8c activations)
 * with 256-bit vpdpbusd, one 8-row group per pass, shared by two kernel files: kernels_avx2.c
 * for CPUs with AVX-VNNI (VEX encoding) and kernels_avx512.c for one-token products (EVEX
 * encoding, AVX-512 VNNI + VL). The includer defines CLB_VNNI256_INSN, the instruction's
 * spelling, and is built with at least AVX2, FMA and F16C.
 * Weights are read unsigned (q8 xor 0x80, q4 raw nibbles, q6 nibbles with their high bits or'ed
 * in, mxfp4 nibbles looked up as their doubled values + 12) and the activations carry
 * corr = -offset * sum (q8 128, q4 8, q6 32, mxfp4 12), so each lane's block sum is exact; it
 * is scaled and added in the reference's order (a multiply, a multiply and an add), so every
 * result equals the reference's bits. The instruction is written in assembly so that an AVX2
 * file can hold it; only the dispatcher's CPUID checks decide where it runs. */
#ifndef CLB_VNNI256_H
#define CLB_VNNI256_H

#include <immintrin.h>
#include <string.h>

#include "clb_kernels_isa.h"

#ifndef CLB_VNNI256_INSN
#error "define CLB_VNNI256_INSN before including clb_vnni256.h"
#endif

/* blocks an interleaved group's pass prefetches ahead (kernels_avx2.c explains the values) */
#define CLB_X8_PF_AHEAD 8
#define CLB_X8_PF_AHEAD_Q8_FEW 32
/* An interleaved group's blocks ahead in passes of one or two tokens (this file's pass and the
 * AVX2 pass), which read as fast as the memory delivers: about 6 KB of the stream for q4 and
 * q6 (q8 keeps CLB_X8_PF_AHEAD_Q8_FEW, 8.7 KB). On a Zen 5, colibri bench on builds with 40
 * and with 8 q4 blocks ahead, alternated: one thread 1.22x as fast (benchmark model, q4), two
 * threads 90.7% of the same minutes' read against 63.6% (wider model, q4); the AVX2 pass
 * (COLIBRI_ISA=avx2, benchmark model, q4) 1.20x and 1.21x on one thread, 0.93x to 1.16x
 * (median 1.09x of 5) on two. */
#define CLB_X8_PF_AHEAD_FEW(QT)                                                              \
    ((QT) == CLB_QT_Q8 ? CLB_X8_PF_AHEAD_Q8_FEW                                              \
     : (QT) == CLB_QT_Q4 ? 40                                                                \
     : (QT) == CLB_QT_Q6 ? 28                                                                \
                         : 44) /* mxfp4: the same 6 KB */

static inline __attribute__((always_inline)) __m256i clb_bcast32_avx2(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

/* (h >> 2j) & 3 moved to bits 4..5 of every byte: q6's high bits for nibble register j (16-bit
 * shifts: what crosses into a neighbouring byte lands outside bits 4..5 and is masked off) */
static inline __attribute__((always_inline)) __m256i clb_q6_hi(__m256i h, int j) {
    const __m256i m = _mm256_set1_epi8(0x30);
    switch (j) {
    case 0: return _mm256_and_si256(_mm256_slli_epi16(h, 4), m);
    case 1: return _mm256_and_si256(_mm256_slli_epi16(h, 2), m);
    case 2: return _mm256_and_si256(h, m);
    default: return _mm256_and_si256(_mm256_srli_epi16(h, 2), m);
    }
}

/* 8 e8m0 exponents at p as 2^(e - 128), bit for bit clb_e8m0_half: (e - 1) << 23 for e >= 2,
 * the subnormals 2^-128 and 2^-127 (0x00200000 << e) below */
static inline __attribute__((always_inline)) __m256 clb_e8m0_half8(const char *p) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i norm = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(norm, sub, small));
}

/* the 8 rows' scales of an interleaved group's block as f32 */
static inline __attribute__((always_inline)) __m256 clb_x8_scales(int QT, const char *blk) {
    if (QT == CLB_QT_MXFP4) return clb_e8m0_half8(blk);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
}

/* mxfp4's nibbles (0..15 in every byte) as their doubled values plus CLB_MXFP4_OFFSET */
static inline __attribute__((always_inline)) __m256i clb_mxfp4_u8(__m256i nib) {
    return _mm256_shuffle_epi8(_mm256_setr_epi8(CLB_MXFP4_UVALUES, CLB_MXFP4_UVALUES), nib);
}

static inline __attribute__((always_inline)) __m256i clb_dpbusd256(__m256i acc, __m256i w,
                                                                   const int8_t *p) {
    const __m256i a = clb_bcast32_avx2(p);
    __asm__(CLB_VNNI256_INSN " %2, %1, %0" : "+x"(acc) : "x"(w), "x"(a));
    return acc;
}

/* half h of an interleaved block as 4 registers of unsigned weights: elements 16h..16h+15, v[d]
 * lane r = row r's elements 16h + 4d..16h + 4d + 3 (q points at the block's quants) */
static inline __attribute__((always_inline)) void clb_half_u8(int QT, const __m256i *q, int h,
                                                              __m256i v[4]) {
    if (QT == CLB_QT_Q8) {
        const __m256i bias = _mm256_set1_epi8((char)0x80);
        for (int d = 0; d < 4; d++)
            v[d] = _mm256_xor_si256(_mm256_loadu_si256(q + 4 * h + d), bias);
        return;
    }
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    for (int d = 0; d < 4; d++) {
        const __m256i z = _mm256_loadu_si256(q + d);
        v[d] = _mm256_and_si256(h ? _mm256_srli_epi16(z, 4) : z, low4);
        if (QT == CLB_QT_MXFP4) v[d] = clb_mxfp4_u8(v[d]);
    }
    if (QT == CLB_QT_Q6) {
        const __m256i hb = _mm256_loadu_si256(q + 4 + h);
        for (int d = 0; d < 4; d++) v[d] = _mm256_or_si256(v[d], clb_q6_hi(hb, d));
    }
}

/* TT tokens (a constant after inlining) over one interleaved group g of n values: per half
 * block, each token's integer sum runs on (started at corr); per block, the float work */
static inline __attribute__((always_inline)) void clb_pass8_vnni(int QT, int TT, int64_t n,
                                                                 const char *g, const char *act,
                                                                 size_t act_row, float *y,
                                                                 int64_t ldy) {
    const size_t gb = 8 * CLB_QT_BLOCK(QT);
    const size_t ahead = (TT <= 2 ? CLB_X8_PF_AHEAD_FEW(QT) : CLB_X8_PF_AHEAD) * gb;
    __m256 acc[CLB_TT];
    __m256i sum[CLB_TT];
    for (int t = 0; t < TT; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / CLB_QK; b++) {
        const char *blk = g + (size_t)b * gb;
        const uintptr_t p = (uintptr_t)blk + ahead;
        for (size_t l = 0; l < gb; l += 64) _mm_prefetch((const char *)(p + l), _MM_HINT_T0);
        const __m256i *q = (const __m256i *)(blk + CLB_QT_SCALES(QT));
        for (int h = 0; h < 2; h++) {
            __m256i v[4];
            clb_half_u8(QT, q, h, v);
            for (int t = 0; t < TT; t++) {
                const clb_block_q8c *a = (const clb_block_q8c *)(act + (size_t)t * act_row) + b;
                __m256i s = h ? sum[t] : _mm256_set1_epi32(a->corr);
                for (int d = 0; d < 4; d++) s = clb_dpbusd256(s, v[d], a->qs + 16 * h + 4 * d);
                sum[t] = s;
            }
        }
        const __m256 ws = clb_x8_scales(QT, blk);
        for (int t = 0; t < TT; t++) {
            const clb_block_q8c *a = (const clb_block_q8c *)(act + (size_t)t * act_row) + b;
            __m256 scale = _mm256_mul_ps(ws, _mm256_set1_ps(a->d));
            acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(scale, _mm256_cvtepi32_ps(sum[t])));
        }
    }
    for (int t = 0; t < TT; t++) _mm256_storeu_ps(y + t * ldy, acc[t]);
}

static inline __attribute__((always_inline)) void clb_gemm8_vnni(int QT, int64_t n,
                                                                 int64_t n_rows, const void *w,
                                                                 size_t w_row, const void *act,
                                                                 size_t act_row, int64_t n_tok,
                                                                 float *y, int64_t ldy) {
    for (int64_t r0 = 0; r0 + 8 <= n_rows; r0 += 8) { /* whole groups only (checked before) */
        const char *g = (const char *)w + (size_t)r0 * w_row;
#define CLB_VNNI_PASS(TT, AT, YT) clb_pass8_vnni(QT, TT, n, g, AT, act_row, YT, ldy)
        CLB_PASSES(CLB_VNNI_PASS)
#undef CLB_VNNI_PASS
    }
}

#endif
