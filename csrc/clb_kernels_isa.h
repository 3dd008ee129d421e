/* Colibri per-ISA kernel entry points: private to csrc/ (dispatch.c builds the traits tables).
 * Guarantees: every *_avx2 / *_avxvnni / *_avx512 function has a *_ref twin with the same
 * contract and memory layout; q8a quantizers of every ISA produce identical bytes.
 * Refuses: nothing outside csrc/ should include this; use clb_get_type_traits(). */
#ifndef CLB_KERNELS_ISA_H
#define CLB_KERNELS_ISA_H

#include <math.h>
#include <string.h>

#include "clb_types.h"

/* The multi-row product of the ref and AVX2 paths: one vec_dot per (row, token), rows inner so
 * a row block's weights stay in cache while the tokens pass. Each ISA's gemm wraps it with its
 * own vec_dot (inlined there), so this loop is written once. */
static inline void clb_gemm_by_dot(clb_vec_dot_fn dot, int64_t n, int64_t n_rows, const void *w,
                                   size_t w_row, const void *act, size_t act_row, int64_t n_tok,
                                   float *y, int64_t ldy) {
    for (int64_t t = 0; t < n_tok; t++)
        for (int64_t r = 0; r < n_rows; r++)
            y[t * ldy + r] = dot(n, (const char *)w + (size_t)r * w_row,
                                 (const char *)act + (size_t)t * act_row);
}

/* Packed activation block of the SIMD multi-row kernels, which read weights as unsigned bytes
 * (weight + offset): the q8a block with corr = -offset * sum(qs) in place of the sum, so an
 * integer accumulator started at corr ends at the exact signed block sum. */
typedef struct {
    float d;
    int32_t corr;
    int8_t qs[CLB_QK];
} clb_block_q8c;
_Static_assert(sizeof(clb_block_q8c) == 40, "q8c block must be 40 bytes");

/* The quantized weight kinds of the SIMD products, a compile-time parameter of their inlined
 * templates: q8 (signed bytes), q4 (nibbles, offset 8), q6 (nibbles plus two high bits,
 * offset 32; the q4 loop with the high bits merged in), mxfp4 (interleaved only: the q4 loop
 * with each nibble looked up as its doubled value plus CLB_MXFP4_OFFSET, and e8m0 scales). */
enum { CLB_QT_Q8 = 0, CLB_QT_Q4 = 1, CLB_QT_Q6 = 2, CLB_QT_MXFP4 = 3 };
#define CLB_QT_BLOCK(QT)                                                                       \
    ((QT) == CLB_QT_Q8   ? sizeof(clb_block_q8)                                               \
     : (QT) == CLB_QT_Q4 ? sizeof(clb_block_q4)                                               \
     : (QT) == CLB_QT_Q6 ? sizeof(clb_block_q6)                                               \
                         : sizeof(clb_block_mxfp4))
/* bytes of an interleaved group's block before its quants: 8 f16 scales, or 8 e8m0 exponents */
#define CLB_QT_SCALES(QT) ((QT) == CLB_QT_MXFP4 ? 8 : 16)

/* The softmax exponent of the attention kernels (exp_sum), one definition for every ISA: the
 * argument clamped to [-87, 88] (so 2^n stays a normal float; NaN passes through), n =
 * round(x * log2(e)) to nearest even, r = x - n * ln2 in two fused steps (ln2 split so n * hi
 * is exact), a degree-7 Taylor polynomial in Horner form by fused multiply-adds (error below
 * 2 units in the last place on |r| <= ln2 / 2), times 2^n built in the exponent bits. The
 * SIMD versions run the same operations lane by lane, so every lane equals clb_exp1. */
#define CLB_EXP_LO (-87.0f)
#define CLB_EXP_HI 88.0f
#define CLB_EXP_LOG2E 1.44269502f
#define CLB_EXP_LN2_HI 0.693145752f
#define CLB_EXP_LN2_LO 1.42860677e-6f
#define CLB_EXP_LANES 16
#define CLB_EXP_C7 (1.0f / 5040.0f)
#define CLB_EXP_C6 (1.0f / 720.0f)
#define CLB_EXP_C5 (1.0f / 120.0f)
#define CLB_EXP_C4 (1.0f / 24.0f)
#define CLB_EXP_C3 (1.0f / 6.0f)

static inline float clb_exp1(float x) {
    if (x != x) return x;
    x = x < CLB_EXP_LO ? CLB_EXP_LO : x;
    x = x > CLB_EXP_HI ? CLB_EXP_HI : x;
    const float n = rintf(x * CLB_EXP_LOG2E);
    float r = fmaf(n, -CLB_EXP_LN2_HI, x);
    r = fmaf(n, -CLB_EXP_LN2_LO, r);
    float p = fmaf(CLB_EXP_C7, r, CLB_EXP_C6);
    p = fmaf(p, r, CLB_EXP_C5);
    p = fmaf(p, r, CLB_EXP_C4);
    p = fmaf(p, r, CLB_EXP_C3);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* the 16 running sums of exp_sum folded in a fixed tree: lanes i and i + w, w = 8, 4, 2, 1 */
static inline float clb_exp_fold(float part[CLB_EXP_LANES]) {
    for (int w = CLB_EXP_LANES / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) part[i] += part[i + w];
    return part[0];
}

/* MXFP4's nibbles as doubled values (sign bit 3): every ISA's table */
#define CLB_MXFP4_VALUES 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12
/* the same plus CLB_MXFP4_OFFSET (0..24): unsigned bytes for vpdpbusd / vpmaddubsw, the
 * offset taken back out through corr = -12 * sum of the activations (clb_block_q8c) */
#define CLB_MXFP4_OFFSET 12
#define CLB_MXFP4_UVALUES 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0

/* an MXFP4 block's scale for the doubled values: 2^(e - 128), exact (a subnormal float for
 * e < 2) */
static inline float clb_e8m0_half(uint8_t e) {
    uint32_t bits = e >= 2 ? (uint32_t)(e - 1) << 23 : 0x00200000u << e;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* reference (kernels_ref.c) */
void clb_to_float_f32_ref(int64_t n, const void *x, float *y);
void clb_to_float_f16_ref(int64_t n, const void *x, float *y);
void clb_to_float_bf16_ref(int64_t n, const void *x, float *y);
void clb_to_float_q8_ref(int64_t n, const void *x, float *y);
void clb_to_float_q4_ref(int64_t n, const void *x, float *y);
void clb_to_float_q6_ref(int64_t n, const void *x, float *y);
void clb_to_float_q8a_ref(int64_t n, const void *x, float *y);
void clb_from_float_f32_ref(int64_t n, const float *x, void *y);
void clb_from_float_f16_ref(int64_t n, const float *x, void *y);
void clb_from_float_bf16_ref(int64_t n, const float *x, void *y);
void clb_from_float_q8_ref(int64_t n, const float *x, void *y);
void clb_from_float_q4_ref(int64_t n, const float *x, void *y);
void clb_from_float_q6_ref(int64_t n, const float *x, void *y);
void clb_from_float_q8a_ref(int64_t n, const float *x, void *y);
float clb_vec_dot_f32_ref(int64_t n, const void *w, const void *x);
float clb_vec_dot_f16_ref(int64_t n, const void *w, const void *x);
float clb_vec_dot_bf16_ref(int64_t n, const void *w, const void *x);
float clb_vec_dot_q8_ref(int64_t n, const void *w, const void *x);
float clb_vec_dot_q4_ref(int64_t n, const void *w, const void *x);
float clb_vec_dot_q6_ref(int64_t n, const void *w, const void *x);
void clb_vec_mad_f32_ref(int64_t n, float *y, const float *x, float a);
void clb_silu_mul_f32_ref(int64_t n, float *g, const float *u);
float clb_att_exp_sum_ref(int64_t n, float *s, float top);
float clb_att_dots_f32_ref(int64_t hd, const float *q, const float *k, int64_t ldk,
                          int64_t n, float scale, float *s);
void clb_att_mad_rows_f32_ref(int64_t hd, float *out, const float *v, int64_t ldv, int64_t n,
                              const float *w);
size_t clb_act_size_q8a(int64_t n); /* q8a row bytes: the packed layout of the reference */
size_t clb_act_size_q8c(int64_t n); /* q8c row bytes: the packed layout of AVX2 and AVX-512 */
void clb_gemm_q8_ref(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,
                     size_t act_row, int64_t n_tok, float *y, int64_t ldy);
void clb_gemm_q4_ref(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,
                     size_t act_row, int64_t n_tok, float *y, int64_t ldy);
void clb_gemm_q6_ref(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,
                     size_t act_row, int64_t n_tok, float *y, int64_t ldy);
/* MXFP4 rows against q8a rows (every ISA's packed layout for it): each block's integer sum of
 * doubled values times activations, then s += (2^(e - 128) * d_a) * sum in block order */
void clb_to_float_mxfp4_ref(int64_t n, const void *x, float *y);
float clb_vec_dot_mxfp4_ref(int64_t n, const void *w, const void *x);
void clb_gemm_mxfp4_ref(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,
                        size_t act_row, int64_t n_tok, float *y, int64_t ldy);
void clb_gemm_mxfp4_avx2(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,
                         size_t act_row, int64_t n_tok, float *y, int64_t ldy);
void clb_gemm_mxfp4_avx512(int64_t n, int64_t n_rows, const void *w, size_t w_row,
                           const void *act, size_t act_row, int64_t n_tok, float *y, int64_t ldy);
float clb_vec_dot_mxfp4_avx2(int64_t n, const void *w, const void *x);
float clb_vec_dot_mxfp4_avx512(int64_t n, const void *w, const void *x);
/* the interleaved twin (mxfp4x8): the reference on q8a rows, the SIMD products on q8c rows with
 * corr = -CLB_MXFP4_OFFSET * sum; the same bits as the row products */
void clb_gemm_mxfp4x8_ref(int64_t n, int64_t n_rows, const void *w, size_t w_row,
                          const void *act, size_t act_row, int64_t n_tok, float *y, int64_t ldy);
void clb_act_pack_mxfp4_avx2(int64_t n, const float *x, void *y);
void clb_act_pack_mxfp4_avx512(int64_t n, const float *x, void *y);
void clb_gemm_mxfp4x8_avx2(int64_t n, int64_t n_rows, const void *w, size_t w_row,
                           const void *act, size_t act_row, int64_t n_tok, float *y, int64_t ldy);
void clb_gemm_mxfp4x8_avxvnni(int64_t n, int64_t n_rows, const void *w, size_t w_row,
                              const void *act, size_t act_row, int64_t n_tok, float *y,
                              int64_t ldy);
void clb_gemm_mxfp4x8_avx512(int64_t n, int64_t n_rows, const void *w, size_t w_row,
                             const void *act, size_t act_row, int64_t n_tok, float *y,
                             int64_t ldy);

/* the interleaved twins (q8x8, q4x8, q6x8 weights, q8a rows): same results as the row products */
void clb_gemm_q8x8_ref(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,
                       size_t act_row, int64_t n_tok, float *y, int64_t ldy);
void clb_gemm_q4x8_ref(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,
                       size_t act_row, int64_t n_tok, float *y, int64_t ldy);
void clb_gemm_q6x8_ref(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,
                       size_t act_row, int64_t n_tok, float *y, int64_t ldy);
/* the interleaved layout's specification, one 4-byte copy at a time (clb_repack_x8 picks it or
 * the AVX2 twin, which writes the same bytes) */
void clb_repack_x8_ref(clb_type t, int64_t n, int64_t n_rows, const void *src, void *dst);

/* AVX2 + FMA + F16C (kernels_avx2.c) */
/* weight bytes per call of the AVX2 q8/q4 products: each call's first row group is the only
 * one not prefetched by its predecessor, so calls should span many groups */
#define CLB_AVX2_GEMM_BLOCK_BYTES (1024 * 1024)
void clb_repack_x8_avx2(clb_type t, int64_t n, int64_t n_rows, const void *src, void *dst);
float clb_vec_dot_f32_avx2(int64_t n, const void *w, const void *x);
float clb_vec_dot_f16_avx2(int64_t n, const void *w, const void *x);
float clb_vec_dot_bf16_avx2(int64_t n, const void *w, const void *x);
float clb_vec_dot_q8_avx2(int64_t n, const void *w, const void *x);
float clb_vec_dot_q4_avx2(int64_t n, const void *w, const void *x);
void clb_quantize_q8a_avx2(int64_t n, const float *x, void *y);
void clb_vec_mad_f32_avx2(int64_t n, float *y, const float *x, float a);
void clb_silu_mul_f32_avx2(int64_t n, float *g, const float *u);
void clb_to_float_f16_avx2(int64_t n, const void *x, float *y); /* NaN stays NaN (quieted) */
/* attention rows (clb_kernels.h), also the AVX-512 table's: hd is at most a few hundred */
float clb_att_exp_sum_avx2(int64_t n, float *s, float top);
float clb_att_dots_f32_avx2(int64_t hd, const float *q, const float *k, int64_t ldk,
                          int64_t n, float scale, float *s);
void clb_att_mad_rows_f32_avx2(int64_t hd, float *out, const float *v, int64_t ldv, int64_t n,
                               const float *w);
void clb_act_pack_q8_avx2(int64_t n, const float *x, void *y); /* clb_block_q8c rows */
/* the ceiling probe of the q8 products (bench_kernels): n_calls runs of the interleaved q8
 * kernel on one 8-row group and 8 tokens held in L1, CLB_INT8_LOOP_MACS_PER_CALL
 * multiply-adds each; variant 0 as the products compute, 1 without the sign step (not an
 * exact product). Returns a checksum of the outputs. */
uint64_t clb_int8_loop_avx2(int variant, int64_t n_calls);
#define CLB_INT8_LOOP_MACS_PER_CALL (8 * 1024 * 8)
/* the same for AVX-512: variant 0 the interleaved q8 kernel, 1 the interleaved q4 kernel (two
 * 8-row groups, 512 values, 8 tokens, in L1), 2 vpdpbusd alone (the instruction's own rate:
 * 8 independent sums, nothing else); CLB_INT8_LOOP_MACS_PER_CALL multiply-adds per call */
uint64_t clb_int8_loop_avx512(int variant, int64_t n_calls);
void clb_act_pack_q4_avx2(int64_t n, const float *x, void *y);
void clb_act_pack_q6_avx2(int64_t n, const float *x, void *y);
/* one packed activation row (clb_block_q8c) against n_rows q8 rows: y[r]; bit-identical to the
 * reference, read row by row (the one-token q8 path of the AVX-512 product) */
void clb_rows1_q8_avx2(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,
                       float *y);
void clb_gemm_q8_avx2(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,
                      size_t act_row, int64_t n_tok, float *y, int64_t ldy);
void clb_gemm_q4_avx2(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,
                      size_t act_row, int64_t n_tok, float *y, int64_t ldy);
void clb_gemm_q6_avx2(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,
                      size_t act_row, int64_t n_tok, float *y, int64_t ldy);
/* interleaved weights (q8x8, q4x8, q6x8), n_rows a multiple of 8, q8c rows */
/* AVX2 + AVX-VNNI (kernels_avx2.c, run only where CPUID reports AVX-VNNI): the interleaved
 * products with 256-bit vpdpbusd, on clb_block_q8c rows with corr = -offset * sum (q8: 128,
 * clb_act_pack_q8u_avx2; q4 and q6: the AVX2 packs) */
void clb_act_pack_q8u_avx2(int64_t n, const float *x, void *y);
void clb_gemm_q8x8_avxvnni(int64_t n, int64_t n_rows, const void *w, size_t w_row,
                           const void *act, size_t act_row, int64_t n_tok, float *y,
                           int64_t ldy);
void clb_gemm_q4x8_avxvnni(int64_t n, int64_t n_rows, const void *w, size_t w_row,
                           const void *act, size_t act_row, int64_t n_tok, float *y,
                           int64_t ldy);
void clb_gemm_q6x8_avxvnni(int64_t n, int64_t n_rows, const void *w, size_t w_row,
                           const void *act, size_t act_row, int64_t n_tok, float *y,
                           int64_t ldy);
void clb_gemm_q8x8_avx2(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,
                        size_t act_row, int64_t n_tok, float *y, int64_t ldy);
void clb_gemm_q4x8_avx2(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,
                        size_t act_row, int64_t n_tok, float *y, int64_t ldy);
void clb_gemm_q6x8_avx2(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,
                        size_t act_row, int64_t n_tok, float *y, int64_t ldy);

/* AVX-512 F/BW/VL/VNNI (kernels_avx512.c) */
float clb_vec_dot_f32_avx512(int64_t n, const void *w, const void *x);
float clb_vec_dot_f16_avx512(int64_t n, const void *w, const void *x);
float clb_vec_dot_bf16_avx512(int64_t n, const void *w, const void *x);
float clb_vec_dot_q8_avx512(int64_t n, const void *w, const void *x);
float clb_vec_dot_q4_avx512(int64_t n, const void *w, const void *x);
void clb_quantize_q8a_avx512(int64_t n, const float *x, void *y);
void clb_vec_mad_f32_avx512(int64_t n, float *y, const float *x, float a);
float clb_att_dots_f32_avx512(int64_t hd, const float *q, const float *k, int64_t ldk,
                             int64_t n, float scale, float *s);
void clb_att_mad_rows_f32_avx512(int64_t hd, float *out, const float *v, int64_t ldv, int64_t n,
                                 const float *w);
/* packed activations (clb_block_q8c rows) and the kernels that read them */
void clb_act_pack_q8_avx512(int64_t n, const float *x, void *y);
void clb_act_pack_q4_avx512(int64_t n, const float *x, void *y);
void clb_act_pack_q6_avx512(int64_t n, const float *x, void *y);
void clb_gemm_q8_avx512(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,
                        size_t act_row, int64_t n_tok, float *y, int64_t ldy);
void clb_gemm_q4_avx512(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,
                        size_t act_row, int64_t n_tok, float *y, int64_t ldy);
/* interleaved weights (q8x8, q4x8, q6x8), n_rows a multiple of 8, q8c rows with
 * corr = -offset * sum */
void clb_gemm_q8x8_avx512(int64_t n, int64_t n_rows, const void *w, size_t w_row,
                          const void *act, size_t act_row, int64_t n_tok, float *y, int64_t ldy);
void clb_gemm_q4x8_avx512(int64_t n, int64_t n_rows, const void *w, size_t w_row,
                          const void *act, size_t act_row, int64_t n_tok, float *y, int64_t ldy);
void clb_gemm_q6x8_avx512(int64_t n, int64_t n_rows, const void *w, size_t w_row,
                          const void *act, size_t act_row, int64_t n_tok, float *y, int64_t ldy);

/* tokens per pass of the vpdpbusd products over a row group (AVX-512: 8 accumulators + 8 weight
 * registers stay in zmm; AVX-VNNI: half a block's weights and 8 accumulators in ymm) */
#define CLB_TT 8
_Static_assert(CLB_TT == 8, "CLB_PASSES spells out passes of 1 to 7 tokens");

/* The passes of n_tok tokens, CLB_TT at a time, each through PASS(tt, at, yt) with tt a
 * compile-time constant (so a pass's accumulators stay in registers): at, yt are the pass's
 * first activation row and output row (the caller names its rows r0 and the call's act,
 * act_row, y, ldy, n_tok); one spelling for every such product. */
#define CLB_PASSES(PASS)                                                                    \
    for (int64_t t = 0; t < n_tok; t += CLB_TT) {                                           \
        const char *at = (const char *)act + (size_t)t * act_row;                           \
        float *yt = y + t * ldy + r0;                                                       \
        switch (n_tok - t < CLB_TT ? n_tok - t : CLB_TT) {                                  \
        case 1: PASS(1, at, yt); break;                                                     \
        case 2: PASS(2, at, yt); break;                                                     \
        case 3: PASS(3, at, yt); break;                                                     \
        case 4: PASS(4, at, yt); break;                                                     \
        case 5: PASS(5, at, yt); break;                                                     \
        case 6: PASS(6, at, yt); break;                                                     \
        case 7: PASS(7, at, yt); break;                                                     \
        default: PASS(CLB_TT, at, yt); break;                                               \
        }                                                                                   \
    }

#endif
