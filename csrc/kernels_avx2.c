/* Colibri AVX2 + FMA + F16C kernels (this file alone is built with -mavx2 -mfma -mf16c).
 * Guarantees: same contracts and memory layouts as the *_ref twins in kernels_ref.c; the q8a
 * quantizer produces the same bytes as clb_quantize_q8a_ref; dot products differ from the
 * reference only by float summation order.
 * Refuses: to run on a CPU without AVX2/FMA/F16C, or the *_avxvnni products without AVX-VNNI;
 * dispatch.c never selects them there. */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "clb_att_simd.h"
#include "clb_kernels_isa.h"
#include "clb_probe.h"

/* AVX-VNNI's encoding of vpdpbusd: the EVEX form needs AVX-512 VL */
#define CLB_VNNI256_INSN "%{vex%} vpdpbusd"
#include "clb_vnni256.h"

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

/* ---- multi-row kernels: 8 weight rows in the 8 int32 lanes --------------------------------
 * The AVX-512 kernels' scheme at half width (see kernels_avx512.c): a row group of 8 rows is
 * transposed in registers per block so that v[d] lane r holds bytes 4d..4d+3 of row r's block,
 * each token's activation bytes are broadcast, and every lane ends a block with its row's
 * exact integer sum, scaled and added in the reference's order (multiply, multiply, add). So
 * every result equals clb_gemm_q8_ref / clb_gemm_q4_ref bit for bit, whatever the number of
 * rows or tokens in the call. Without VNNI the products go through vpmaddubsw (unsigned x
 * signed -> int16 pairs): q8 moves the weight's sign onto the activation (|w| * sign(w)*a, no
 * pair passes 2*128*127), q4 reads raw nibbles w + 8 (sixteen products of 15*127 fit int16,
 * so a whole block is summed in int16) and starts from corr = -8 * sum(a); q6 reads w + 32
 * (0..63, its two high bits or'ed onto the nibbles), sums pairs of products in int16 and
 * starts from corr = -32 * sum(a). Activations are clb_block_q8c rows (q8 ignores corr). */

void clb_act_pack_q8_avx2(int64_t n, const float *x, void *vy) {
    clb_quantize_q8a_avx2(n, x, vy); /* corr unused by the q8 kernel: sum kept as is */
}

static void clb_act_pack_offset(int64_t n, const float *x, void *vy, int32_t offset) {
    clb_block_q8c *y = vy;
    clb_quantize_q8a_avx2(n, x, y);
    for (int64_t b = 0; b < n / CLB_QK; b++) y[b].corr *= -offset;
}

void clb_act_pack_q4_avx2(int64_t n, const float *x, void *y) { clb_act_pack_offset(n, x, y, 8); }
void clb_act_pack_q6_avx2(int64_t n, const float *x, void *y) { clb_act_pack_offset(n, x, y, 32); }
void clb_act_pack_mxfp4_avx2(int64_t n, const float *x, void *y) {
    clb_act_pack_offset(n, x, y, CLB_MXFP4_OFFSET);
}

static inline __attribute__((always_inline)) void clb_t4x4_avx2(__m256i z[4]) {
    __m256i t0 = _mm256_unpacklo_epi32(z[0], z[1]), t1 = _mm256_unpackhi_epi32(z[0], z[1]);
    __m256i t2 = _mm256_unpacklo_epi32(z[2], z[3]), t3 = _mm256_unpackhi_epi32(z[2], z[3]);
    z[0] = _mm256_unpacklo_epi64(t0, t2);
    z[1] = _mm256_unpackhi_epi64(t0, t2);
    z[2] = _mm256_unpacklo_epi64(t1, t3);
    z[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* 16 bytes at offset off of rows k and k+4 of the group in the two 128-bit lanes */
static inline __attribute__((always_inline)) __m256i clb_load2x16(const char *const rp[8], int k,
                                                                  size_t off) {
    __m256i z = _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(rp[k] + off)));
    return _mm256_inserti128_si256(z, _mm_loadu_si128((const __m128i *)(rp[k + 4] + off)), 1);
}

/* the four transposed registers of half h (q8: bytes 16h..16h+15 of each row's block) or of
 * the whole block's nibble bytes (q4): v[d] lane r = bytes 4d..4d+3 of row r's part */
static inline __attribute__((always_inline)) void clb_load_t4(const char *const rp[8], size_t off,
                                                              __m256i v[4]) {
    for (int k = 0; k < 4; k++) v[k] = clb_load2x16(rp, k, off);
    clb_t4x4_avx2(v);
}

/* The interleaved layout (clb_types.h) with the products' own transposing loads: a block's
 * stored registers are the ones clb_pass8 builds from rows, so each group is written in
 * sequential 32-byte stores; the same bytes as clb_repack_x8_ref. */
/* mxfp4 rows: each row's 16 nibble bytes reordered to q4's element order (elements 0..15 and
 * 16..31 are the low and high halves of the nibbles unpacked in order), then the same
 * transposing stores; the same bytes as clb_repack_x8_ref */
static void clb_repack_mxfp4x8_avx2(int64_t n, int64_t n_rows, const void *src, void *dst) {
    const size_t bs = sizeof(clb_block_mxfp4), row = (size_t)(n / CLB_QK) * bs;
    const __m128i low4 = _mm_set1_epi8(0x0f);
    for (int64_t g = 0; g < n_rows / 8; g++) {
        const char *s = (const char *)src + (size_t)g * 8 * row;
        char *d = (char *)dst + (size_t)g * 8 * row;
        for (int64_t b = 0; b < n / CLB_QK; b++) {
            char *db = d + (size_t)b * 8 * bs;
            __m128i q[8];
            for (int r = 0; r < 8; r++) {
                const char *sb = s + (size_t)r * row + (size_t)b * bs;
                db[r] = sb[0];
                const __m128i raw = _mm_loadu_si128((const __m128i *)(sb + 1));
                const __m128i lo = _mm_and_si128(raw, low4);
                const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
                q[r] = _mm_or_si128(_mm_unpacklo_epi8(lo, hi),
                                    _mm_slli_epi16(_mm_unpackhi_epi8(lo, hi), 4));
            }
            __m256i v[4];
            for (int k = 0; k < 4; k++)
                v[k] = _mm256_inserti128_si256(_mm256_castsi128_si256(q[k]), q[k + 4], 1);
            clb_t4x4_avx2(v);
            for (int j = 0; j < 4; j++)
                _mm256_storeu_si256((__m256i *)(db + CLB_QT_SCALES(CLB_QT_MXFP4) + 32 * j), v[j]);
        }
    }
}

void clb_repack_x8_avx2(clb_type t, int64_t n, int64_t n_rows, const void *src, void *dst) {
    if (t == CLB_TYPE_MXFP4) {
        clb_repack_mxfp4x8_avx2(n, n_rows, src, dst);
        return;
    }
    const size_t bs = clb_type_row_size(t, CLB_QK), qb = bs - sizeof(clb_f16);
    const size_t row = (size_t)(n / CLB_QK) * bs;
    for (int64_t g = 0; g < n_rows / 8; g++) {
        const char *s = (const char *)src + (size_t)g * 8 * row;
        char *d = (char *)dst + (size_t)g * 8 * row;
        const char *rp[8];
        for (int r = 0; r < 8; r++) rp[r] = s + (size_t)r * row;
        for (int64_t b = 0; b < n / CLB_QK; b++) {
            char *db = d + (size_t)b * 8 * bs;
            const size_t off = (size_t)b * bs;
            for (int r = 0; r < 8; r++) memcpy(db + 2 * r, rp[r] + off, sizeof(clb_f16));
            /* 16 quant bytes of each row at a time; q6's last 8 (its high bits) as the upper
             * half of a 16-byte read that starts 8 bytes earlier */
            for (size_t q = 0; q < qb; q += 16) {
                const size_t start = q + 16 <= qb ? q : qb - 16, skip = (q - start) / 4;
                __m256i v[4];
                clb_load_t4(rp, off + 2 + start, v);
                for (size_t j = skip; j < 4; j++)
                    _mm256_storeu_si256((__m256i *)(db + 16 + 8 * start + 32 * j), v[j]);
            }
        }
    }
}

/* the f16 scales of block b of the 8 rows as f32: eight 2-byte reads combined in general
 * registers, which these loops leave idle (cheaper than a gather), then one conversion */
static inline __attribute__((always_inline)) __m256 clb_scales8(size_t bs, const char *const rp[8],
                                                                int64_t b) {
    const size_t off = (size_t)b * bs;
    uint64_t lo = 0, hi = 0;
    for (int r = 0; r < 4; r++) {
        uint16_t d0, d1;
        memcpy(&d0, rp[r] + off, sizeof d0);
        memcpy(&d1, rp[r + 4] + off, sizeof d1);
        lo |= (uint64_t)d0 << (16 * r);
        hi |= (uint64_t)d1 << (16 * r);
    }
    return _mm256_cvtph_ps(_mm_set_epi64x((long long)hi, (long long)lo));
}

/* exact int32 sums, per lane (row), of the four dwords d of activation bytes q against the
 * transposed q8 half sg (|w| * sign(w)*a: vpmaddubsw needs its first operand unsigned).
 * SIGN is 1 in every product; 0 only in the ceiling probe (clb_int8_loop_avx2), which drops
 * the sign step to measure its cost and computes no exact product. */
static inline __attribute__((always_inline)) __m256i clb_half_q8(const __m256i sg[4],
                                                                 const int8_t *q, int SIGN) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s = _mm256_setzero_si256();
    for (int d = 0; d < 4; d++) {
        __m256i a = clb_bcast32_avx2(q + 4 * d);
        if (SIGN) a = _mm256_sign_epi8(a, sg[d]);
        __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(sg[d]), a);
        s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
    }
    return s;
}

/* Tokens per pass over a row group: their accumulators (and q8's half-block sums) live in small
 * stack arrays, so the loop over tokens keeps only one block's transposed weights in registers
 * (AVX2 has 16) and every token of the pass reuses them. */
#define CLB_PASS_TOK 16

/* One pass of n_tok <= CLB_PASS_TOK tokens over a row group, in the files' row layout (X8 = 0:
 * rp[8] are the rows, transposed per block in registers) or interleaved (X8 = 1: g is the
 * group, whose blocks already hold the transposed bytes, see clb_types.h; one sequential
 * stream read with plain loads). pf (rows only) is the next row group (8 rows right after
 * these; its address may lie past the matrix, prefetches never fault): its bytes are
 * prefetched front to back, a little more per block than this pass consumes, so the next
 * group starts from cache; the hardware prefetcher alone serves eight interleaved row streams
 * at well under the memory's rate. An interleaved group prefetches its own stream ahead (into
 * the next group at its end), CLB_X8_PF_AHEAD blocks; passes of one or two tokens, which can
 * read as fast as the memory delivers, CLB_X8_PF_AHEAD_FEW (clb_vnni256.h; for q8, 32 blocks
 * lifted the model's decode when they were chosen, each worker's stream of a small expert
 * matrix being short, and q4, compute-bound on that CPU, ran no faster or slower with them;
 * on a Zen 5 q4 and q6 are not compute-bound and run faster with about 6 KB ahead). Passes of
 * more tokens are compute-bound and keep CLB_X8_PF_AHEAD. Both layouts do the same arithmetic,
 * so they give the same bits. */
#define CLB_PF_LINES(QT) ((8 * CLB_QT_BLOCK(QT) + 63) / 64) /* 64-byte lines per group block */

/* the nibble registers v (unsigned, 0..15) of a q6 block made whole (0..63) with its high
 * bits: h0 of elements 0..15 (v[0..3]), h1 of elements 16..31 (v[4..7]) */
static inline __attribute__((always_inline)) void clb_q6_merge(__m256i v[8], __m256i h0,
                                                               __m256i h1) {
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_or_si256(v[j], clb_q6_hi(h0, j));
        v[4 + j] = _mm256_or_si256(v[4 + j], clb_q6_hi(h1, j));
    }
}

/* per lane (row), the exact int32 sum of a block's unsigned weights v (q4: 0..15, q6: 0..63,
 * mxfp4: 0..24; v[d] elements 4d.., v[4 + d] elements 16 + 4d..) times the activation bytes qa.
 * q4: sixteen products of 15 * 127 fit int16, so the whole block sums in int16; q6 and mxfp4:
 * four (of 63 * 127, of 24 * 127) */
static inline __attribute__((always_inline)) __m256i clb_sum_u8(int QT, const __m256i v[8],
                                                                const int8_t *qa) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (QT == CLB_QT_Q4) {
        __m256i h0 = _mm256_maddubs_epi16(v[0], clb_bcast32_avx2(qa));
        __m256i h1 = _mm256_maddubs_epi16(v[4], clb_bcast32_avx2(qa + 16));
        for (int d = 1; d < 4; d++) {
            h0 = _mm256_add_epi16(h0, _mm256_maddubs_epi16(v[d], clb_bcast32_avx2(qa + 4 * d)));
            h1 = _mm256_add_epi16(
                h1, _mm256_maddubs_epi16(v[4 + d], clb_bcast32_avx2(qa + 16 + 4 * d)));
        }
        return _mm256_madd_epi16(_mm256_add_epi16(h0, h1), ones);
    }
    __m256i s = _mm256_setzero_si256();
    for (int d = 0; d < 8; d += 2) {
        const int8_t *q = qa + 4 * (d % 4) + 16 * (d / 4);
        __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(v[d], clb_bcast32_avx2(q)),
                                     _mm256_maddubs_epi16(v[d + 1], clb_bcast32_avx2(q + 4)));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
    }
    return s;
}

static inline __attribute__((always_inline)) void clb_pass8(int QT, int X8, int SIGN,
                                                            int64_t n, const char *const rp[8],
                                                            const char *g, const char *act,
                                                            size_t act_row, int n_tok, float *y,
                                                            int64_t ldy, int nv, uintptr_t pf) {
    __m256 acc[CLB_PASS_TOK];
    __m256i part[CLB_PASS_TOK];
    const size_t bs = CLB_QT_BLOCK(QT), gb = 8 * bs;
    const size_t ahead =
        (n_tok <= 2 ? CLB_X8_PF_AHEAD_FEW(QT) : CLB_X8_PF_AHEAD) * gb;
    for (int t = 0; t < n_tok; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / CLB_QK; b++) {
        const char *blk = X8 ? g + (size_t)b * gb : NULL;
        const __m256i *q = X8 ? (const __m256i *)(blk + CLB_QT_SCALES(QT)) : NULL;
        const size_t off = (size_t)b * bs + 2; /* rows: the block's quants in each row */
        if (X8) {
            const uintptr_t p = (uintptr_t)blk + ahead;
            for (size_t l = 0; l < gb; l += 64) _mm_prefetch((const char *)(p + l), _MM_HINT_T0);
        } else if (pf) {
            const uintptr_t p = pf + (uintptr_t)b * gb;
            for (int l = 0; l < (int)CLB_PF_LINES(QT); l++)
                _mm_prefetch((const char *)(p + 64 * (uintptr_t)l), _MM_HINT_T0);
        }
        const __m256 ws = X8 ? clb_x8_scales(QT, blk) : clb_scales8(bs, rp, b);
        if (QT != CLB_QT_Q8) {
            /* nibbles read unsigned (w + 8, or q6's w + 32 with its high bits or'ed in) and the
             * sum started from corr = -offset * sum(a) */
            const __m256i low4 = _mm256_set1_epi8(0x0f);
            __m256i v[8];
            if (X8)
                for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_si256(q + j);
            else
                clb_load_t4(rp, off, v);
            for (int j = 0; j < 4; j++) {
                v[4 + j] = _mm256_and_si256(_mm256_srli_epi16(v[j], 4), low4);
                v[j] = _mm256_and_si256(v[j], low4);
            }
            if (QT == CLB_QT_MXFP4)
                for (int j = 0; j < 8; j++) v[j] = clb_mxfp4_u8(v[j]);
            if (QT == CLB_QT_Q6) {
                __m256i h[4]; /* h[2], h[3]: the high bits of elements 0..15 and 16..31 */
                if (X8) {
                    h[2] = _mm256_loadu_si256(q + 4);
                    h[3] = _mm256_loadu_si256(q + 5);
                } else {
                    clb_load_t4(rp, off + 8, h);
                }
                clb_q6_merge(v, h[2], h[3]);
            }
            for (int t = 0; t < n_tok; t++) {
                const clb_block_q8c *a = (const clb_block_q8c *)(act + (size_t)t * act_row) + b;
                __m256i s = clb_sum_u8(QT, v, a->qs);
                s = _mm256_add_epi32(s, _mm256_set1_epi32(a->corr));
                __m256 scale = _mm256_mul_ps(ws, _mm256_set1_ps(a->d));
                acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(scale, _mm256_cvtepi32_ps(s)));
            }
        } else {
            /* one 16-byte half of the 8 rows' blocks at a time: four registers of signed
             * weights; the first half's sums wait in part[] for the second */
            __m256i sg[4];
            if (X8)
                for (int j = 0; j < 4; j++) sg[j] = _mm256_loadu_si256(q + j);
            else
                clb_load_t4(rp, off, sg);
            for (int t = 0; t < n_tok; t++) {
                const clb_block_q8c *a = (const clb_block_q8c *)(act + (size_t)t * act_row) + b;
                part[t] = clb_half_q8(sg, a->qs, SIGN);
            }
            if (X8)
                for (int j = 0; j < 4; j++) sg[j] = _mm256_loadu_si256(q + 4 + j);
            else
                clb_load_t4(rp, off + 16, sg);
            for (int t = 0; t < n_tok; t++) {
                const clb_block_q8c *a = (const clb_block_q8c *)(act + (size_t)t * act_row) + b;
                __m256i s = _mm256_add_epi32(part[t], clb_half_q8(sg, a->qs + 16, SIGN));
                __m256 scale = _mm256_mul_ps(ws, _mm256_set1_ps(a->d));
                acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(scale, _mm256_cvtepi32_ps(s)));
            }
        }
    }
    if (nv == 8) {
        for (int t = 0; t < n_tok; t++) _mm256_storeu_ps(y + t * ldy, acc[t]);
    } else {
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(nv), lane);
        for (int t = 0; t < n_tok; t++) _mm256_maskstore_ps(y + t * ldy, keep, acc[t]);
    }
}

/* One token, row by row (the AVX-512 product's one-token q8 path): each row is one sequential
 * read. The same exact integer block sums, four blocks at a time, then the reference's scalar
 * order: s += (d_w * d_a) * sum. Bit-identical to the reference and so to the row groups. */
static inline __attribute__((always_inline)) __m256i clb_isum_q8(const char *wblk,
                                                                 const clb_block_q8c *a) {
    __m256i qa = _mm256_loadu_si256((const __m256i *)a->qs);
    __m256i qw = _mm256_loadu_si256((const __m256i *)(wblk + 2));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(qw), _mm256_sign_epi8(qa, qw)),
                             _mm256_set1_epi16(1));
}

static inline __attribute__((always_inline)) float clb_dot_row_q8(int64_t n, const char *w,
                                                                  const clb_block_q8c *a) {
    const size_t bs = sizeof(clb_block_q8);
    const int64_t nb = n / CLB_QK;
    float s = 0.0f;
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        __m256i i0 = clb_isum_q8(w + (size_t)b * bs, a + b);
        __m256i i1 = clb_isum_q8(w + (size_t)(b + 1) * bs, a + b + 1);
        __m256i i2 = clb_isum_q8(w + (size_t)(b + 2) * bs, a + b + 2);
        __m256i i3 = clb_isum_q8(w + (size_t)(b + 3) * bs, a + b + 3);
        /* lane sums of the four blocks: hadd pairs, then fold the 128-bit halves */
        __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(i0, i1), _mm256_hadd_epi32(i2, i3));
        __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        float f[4];
        _mm_storeu_ps(f, _mm_cvtepi32_ps(sum));
        for (int k = 0; k < 4; k++) {
            clb_f16 d;
            memcpy(&d, w + (size_t)(b + k) * bs, sizeof d);
            s += _cvtsh_ss(d) * a[b + k].d * f[k];
        }
    }
    for (; b < nb; b++) {
        __m256i i0 = clb_isum_q8(w + (size_t)b * bs, a + b);
        __m128i h = _mm_add_epi32(_mm256_castsi256_si128(i0), _mm256_extracti128_si256(i0, 1));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(1, 0, 3, 2)));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(2, 3, 0, 1)));
        clb_f16 d;
        memcpy(&d, w + (size_t)b * bs, sizeof d);
        s += _cvtsh_ss(d) * a[b].d * (float)_mm_cvtsi128_si32(h);
    }
    return s;
}

void clb_rows1_q8_avx2(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,
                       float *y) {
    for (int64_t r = 0; r < n_rows; r++)
        y[r] = clb_dot_row_q8(n, (const char *)w + (size_t)r * w_row, act);
}

/* ---- AVX-VNNI: the interleaved products with vpdpbusd at 256 bits ------------------------
 * On CPUs with AVX-VNNI but no AVX-512 (Intel's Alder Lake and later client cores) one VEX
 * vpdpbusd does what vpmaddubsw + vpmaddwd (+ the q8 sign step) do above (clb_vnni256.h, where
 * the passes are). q8's activations carry corr = -128 * sum (clb_act_pack_q8u_avx2); q4's and
 * q6's are the AVX2 packs. */

void clb_act_pack_q8u_avx2(int64_t n, const float *x, void *y) {
    clb_act_pack_offset(n, x, y, 128);
}

#define CLB_GEMM8_VNNI(NAME, QT)                                                             \
    void NAME(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,       \
              size_t act_row, int64_t n_tok, float *y, int64_t ldy) {                        \
        clb_gemm8_vnni(QT, n, n_rows, w, w_row, act, act_row, n_tok, y, ldy);                 \
    }
CLB_GEMM8_VNNI(clb_gemm_q8x8_avxvnni, CLB_QT_Q8)
CLB_GEMM8_VNNI(clb_gemm_q4x8_avxvnni, CLB_QT_Q4)
CLB_GEMM8_VNNI(clb_gemm_q6x8_avxvnni, CLB_QT_Q6)
CLB_GEMM8_VNNI(clb_gemm_mxfp4x8_avxvnni, CLB_QT_MXFP4)

/* Row groups of 8, tokens CLB_PASS_TOK at a time inside each group, so a group's weights are
 * read from memory once for all tokens and its later passes hit the cache. One token goes
 * through the same row groups: streamed with prefetching they run faster than rows read one
 * by one, and the float work per block is one vector add per 8 rows instead of 8 dependent
 * scalar adds. X8: interleaved weights (whole groups only; the matmul driver checks). */
static inline __attribute__((always_inline)) void clb_gemm8(int QT, int X8, int SIGN,
                                                            int64_t n, int64_t n_rows, const void *w,
                                                            size_t w_row, const void *act,
                                                            size_t act_row, int64_t n_tok,
                                                            float *y, int64_t ldy) {
    const char *wb = w;
    for (int64_t r0 = 0; r0 < n_rows; r0 += 8) {
        const int nv = n_rows - r0 < 8 ? (int)(n_rows - r0) : 8;
        if (X8 && nv < 8) return; /* never a partial group: refused before */
        const char *rp[8];
        for (int r = 0; r < 8; r++) /* rows past the matrix repeat a real one, unstored */
            rp[r] = wb + (size_t)(r0 + (r < nv ? r : nv - 1)) * w_row;
        const char *g = wb + (size_t)r0 * w_row; /* the interleaved group */
        /* the caller's next rows follow these in memory: the last group prefetches them too */
        const uintptr_t pf = (uintptr_t)wb + (uintptr_t)(r0 + 8) * w_row;
        for (int64_t t = 0; t < n_tok; t += CLB_PASS_TOK) {
            const int tt = n_tok - t < CLB_PASS_TOK ? (int)(n_tok - t) : CLB_PASS_TOK;
            const char *at = (const char *)act + (size_t)t * act_row;
            float *yt = y + t * ldy + r0;
            const uintptr_t pt = t == 0 ? pf : 0;
            /* a few tokens (the expert groups of a decode step), and 4 or 8 (batched decode
             * steps): the count is a constant, so the loops over tokens unroll and the
             * accumulators stay in registers (a Zen 5 on this path, 2 threads: q8x8 with 4
             * tokens 15% faster, 8 tokens 4%, q4x8 with 8 tokens 4%; 6 and 16 tokens ran no
             * faster as constants, so they keep the general loop) */
            switch (tt) {
            case 1: clb_pass8(QT, X8, SIGN, n, rp, g, at, act_row, 1, yt, ldy, nv, pt); break;
            case 2: clb_pass8(QT, X8, SIGN, n, rp, g, at, act_row, 2, yt, ldy, nv, pt); break;
            case 3: clb_pass8(QT, X8, SIGN, n, rp, g, at, act_row, 3, yt, ldy, nv, pt); break;
            case 4: clb_pass8(QT, X8, SIGN, n, rp, g, at, act_row, 4, yt, ldy, nv, pt); break;
            case 8: clb_pass8(QT, X8, SIGN, n, rp, g, at, act_row, 8, yt, ldy, nv, pt); break;
            default: clb_pass8(QT, X8, SIGN, n, rp, g, at, act_row, tt, yt, ldy, nv, pt); break;
            }
        }
    }
}

#define CLB_GEMM8_AVX2(NAME, QT, X8)                                                         \
    void NAME(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,       \
              size_t act_row, int64_t n_tok, float *y, int64_t ldy) {                        \
        clb_gemm8(QT, X8, 1, n, n_rows, w, w_row, act, act_row, n_tok, y, ldy);               \
    }
CLB_GEMM8_AVX2(clb_gemm_q8_avx2, CLB_QT_Q8, 0)
CLB_GEMM8_AVX2(clb_gemm_q4_avx2, CLB_QT_Q4, 0)
CLB_GEMM8_AVX2(clb_gemm_q6_avx2, CLB_QT_Q6, 0)
CLB_GEMM8_AVX2(clb_gemm_q8x8_avx2, CLB_QT_Q8, 1)
CLB_GEMM8_AVX2(clb_gemm_q4x8_avx2, CLB_QT_Q4, 1)
CLB_GEMM8_AVX2(clb_gemm_q6x8_avx2, CLB_QT_Q6, 1)
CLB_GEMM8_AVX2(clb_gemm_mxfp4x8_avx2, CLB_QT_MXFP4, 1)

/* ---- the ceiling of the q8 products' arithmetic -----------------------------------------
 * n_calls products of the interleaved q8 kernel (clb_gemm8 as clb_gemm_q8x8_avx2 runs it, the
 * token count read at run time as in a real call) on one 8-row group of CLB_LOOP_N values
 * against CLB_LOOP_TOK tokens, all in L1: what the kernel's instruction mix allows with no
 * memory in the way. Variant 1 drops the sign step (SIGN = 0: no exact product, the ceiling
 * that step costs). Returns a checksum of the outputs, and each call sees a different input,
 * so no call can be left out. */
#define CLB_LOOP_N 1024
#define CLB_LOOP_TOK 8
_Static_assert(CLB_LOOP_N * CLB_LOOP_TOK * 8 == CLB_INT8_LOOP_MACS_PER_CALL, "probe size");

static inline __attribute__((always_inline)) uint64_t clb_loop_run(int SIGN, int64_t n_calls) {
    enum { NB = CLB_LOOP_N / CLB_QK, GB = 8 * sizeof(clb_block_q8) };
    /* the group, then room for the blocks its prefetches ask for past its end */
    unsigned char w[(NB + CLB_X8_PF_AHEAD_Q8_FEW) * GB] __attribute__((aligned(64)));
    clb_block_q8c act[CLB_LOOP_TOK * NB];
    float y[CLB_LOOP_TOK * 8];
    clb_probe_fill(w, NB + CLB_X8_PF_AHEAD_Q8_FEW, GB, act, CLB_LOOP_TOK * NB);
    volatile int64_t n_tok = CLB_LOOP_TOK;
    uint64_t sum = 0;
    for (int64_t c = 0; c < n_calls; c++) {
        act[0].d = (float)(c & 1023); /* a new input for every call */
        clb_gemm8(CLB_QT_Q8, 1, SIGN, CLB_LOOP_N, 8, w, NB * sizeof(clb_block_q8), act,
                  NB * sizeof(clb_block_q8c), n_tok, y, 8);
        sum = clb_probe_mix(sum, y, CLB_LOOP_TOK * 8, c);
    }
    return sum;
}

uint64_t clb_int8_loop_avx2(int variant, int64_t n_calls) {
    return variant == 0 ? clb_loop_run(1, n_calls) : clb_loop_run(0, n_calls);
}

/* f16 -> f32 with F16C: exact for every number; a NaN stays a NaN (signalling ones come back
 * quiet, where the reference keeps the payload as it is) */
void clb_to_float_f16_avx2(int64_t n, const void *x, float *y) {
    const clb_f16 *h = x;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, clb_load_f16x8(h + i));
    for (; i < n; i++) y[i] = clb_f16_to_f32(h[i]);
}

/* Eight keys at a time, one accumulator each (lane j: the sum of elements j, j+8, ...), then
 * one transposing reduction that gives every row the same addition tree; a call of fewer
 * than eight rows repeats its last row, so a row's score is the same in any group. */
float clb_att_dots_f32_avx2(int64_t hd, const float *q, const float *k, int64_t ldk, int64_t n,
                            float scale, float *s) {
    const int64_t hv = hd - hd % 8;
    __m256 top = _mm256_set1_ps(-INFINITY);
    for (int64_t r0 = 0; r0 < n; r0 += 8) {
        const float *kr[8];
        clb_rows8(k, ldk, r0, n, kr);
        __m256 a[8];
        for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
        for (int64_t d = 0; d < hv; d += 8) {
            const __m256 qd = _mm256_loadu_ps(q + d);
            for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(kr[i] + d), qd, a[i]);
        }
        top = clb_scores8(clb_sum8x8(a), hd, hv, q, kr, scale, r0, n, s, top);
    }
    return clb_max8(top);
}

/* clb_exp1 on 8 lanes, the same operations in the same order (max/min return their second
 * operand, x, when it is NaN, as clb_exp1 passes NaN through) */
static inline __m256 clb_exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(CLB_EXP_LO), x);
    x = _mm256_min_ps(_mm256_set1_ps(CLB_EXP_HI), x);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(CLB_EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-CLB_EXP_LN2_HI), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-CLB_EXP_LN2_LO), r);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(CLB_EXP_C7), r, _mm256_set1_ps(CLB_EXP_C6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(CLB_EXP_C5));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(CLB_EXP_C4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(CLB_EXP_C3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* clb_att_exp_sum_ref's results: whole groups of 16 by two registers (lanes j % 16), the rest
 * by clb_exp1 into the same running sums */
float clb_att_exp_sum_avx2(int64_t n, float *s, float top) {
    const __m256 t = _mm256_set1_ps(top);
    __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + CLB_EXP_LANES <= n; j += CLB_EXP_LANES) {
        const __m256 e0 = clb_exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), t));
        const __m256 e1 = clb_exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j + 8), t));
        _mm256_storeu_ps(s + j, e0);
        _mm256_storeu_ps(s + j + 8, e1);
        sum0 = _mm256_add_ps(sum0, e0);
        sum1 = _mm256_add_ps(sum1, e1);
    }
    float part[CLB_EXP_LANES];
    _mm256_storeu_ps(part, sum0);
    _mm256_storeu_ps(part + 8, sum1);
    for (; j < n; j++) {
        s[j] = clb_exp1(s[j] - top);
        part[j % CLB_EXP_LANES] += s[j];
    }
    return clb_exp_fold(part);
}

/* clb_silu_mul_f32_ref's operations, 8 lanes at a time (the sign flipped exactly, as unary
 * minus does) */
void clb_silu_mul_f32_avx2(int64_t n, float *g, const float *u) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 e = clb_exp8(_mm256_xor_ps(x, sign));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)),
                                              _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) g[i] = g[i] / (1.0f + clb_exp1(-g[i])) * u[i];
}

/* 32 output values at a time in registers across all the rows (then 8, then one by one):
 * each element sees the same fused multiply-adds, in row order, as clb_vec_mad_f32_avx2
 * called once per row */
void clb_att_mad_rows_f32_avx2(int64_t hd, float *out, const float *v, int64_t ldv, int64_t n,
                               const float *w) {
    int64_t d = 0;
    for (; d + 32 <= hd; d += 32) {
        __m256 o0 = _mm256_loadu_ps(out + d), o1 = _mm256_loadu_ps(out + d + 8);
        __m256 o2 = _mm256_loadu_ps(out + d + 16), o3 = _mm256_loadu_ps(out + d + 24);
        for (int64_t r = 0; r < n; r++) {
            const float *vr = v + r * ldv + d;
            const __m256 wr = _mm256_set1_ps(w[r]);
            o0 = _mm256_fmadd_ps(wr, _mm256_loadu_ps(vr), o0);
            o1 = _mm256_fmadd_ps(wr, _mm256_loadu_ps(vr + 8), o1);
            o2 = _mm256_fmadd_ps(wr, _mm256_loadu_ps(vr + 16), o2);
            o3 = _mm256_fmadd_ps(wr, _mm256_loadu_ps(vr + 24), o3);
        }
        _mm256_storeu_ps(out + d, o0);
        _mm256_storeu_ps(out + d + 8, o1);
        _mm256_storeu_ps(out + d + 16, o2);
        _mm256_storeu_ps(out + d + 24, o3);
    }
    for (; d + 8 <= hd; d += 8) {
        __m256 o = _mm256_loadu_ps(out + d);
        for (int64_t r = 0; r < n; r++)
            o = _mm256_fmadd_ps(_mm256_set1_ps(w[r]), _mm256_loadu_ps(v + r * ldv + d), o);
        _mm256_storeu_ps(out + d, o);
    }
    for (; d < hd; d++) {
        float o = out[d];
        for (int64_t r = 0; r < n; r++) o = fmaf(w[r], v[r * ldv + d], o);
        out[d] = o;
    }
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

/* ---- MXFP4 rows against q8a rows ---------------------------------------------------------
 * Two blocks per register: each 128-bit lane holds one block's 16 nibble bytes; low and high
 * nibbles unpacked side by side give its 32 elements in order, 0..15 (A) and 16..31 (B); a
 * shuffle turns each nibble into its doubled value. The signed products go through maddubs as
 * q8's do (|w| unsigned, the activation taking w's sign), so each block's sum is exact; four
 * blocks' sums are then added into s in the reference's order, s += (2^(e - 128) * d_a) * sum:
 * bit for bit clb_gemm_mxfp4_ref. */
static inline __attribute__((always_inline)) __m256i clb_mxfp4_pair(const clb_block_mxfp4 *w,
                                                                    const clb_block_q8a *a,
                                                                    __m256i lut) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256i raw = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)w[0].qs)),
        _mm_loadu_si128((const __m128i *)w[1].qs), 1);
    __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
    __m256i wa = _mm256_shuffle_epi8(lut, _mm256_unpacklo_epi8(lo, hi)); /* elements 0..15 */
    __m256i wb = _mm256_shuffle_epi8(lut, _mm256_unpackhi_epi8(lo, hi)); /* 16..31 */
    __m256i q0 = _mm256_loadu_si256((const __m256i *)a[0].qs);
    __m256i q1 = _mm256_loadu_si256((const __m256i *)a[1].qs);
    __m256i qa = _mm256_permute2x128_si256(q0, q1, 0x20), qb = _mm256_permute2x128_si256(q0, q1, 0x31);
    __m256i pa = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(wa), _mm256_sign_epi8(qa, wa)), ones);
    __m256i pb = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(wb), _mm256_sign_epi8(qb, wb)), ones);
    return _mm256_add_epi32(pa, pb); /* dwords 0..3: block 0's partial sums, 4..7 block 1's */
}

float clb_vec_dot_mxfp4_avx2(int64_t n, const void *vw, const void *vx) {
    const clb_block_mxfp4 *w = vw;
    const clb_block_q8a *a = vx;
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_setr_epi8(CLB_MXFP4_VALUES));
    const int64_t nb = n / CLB_QK;
    float s = 0.0f;
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        __m256i p01 = clb_mxfp4_pair(w + b, a + b, lut), p23 = clb_mxfp4_pair(w + b + 2, a + b + 2, lut);
        /* hadd twice: dwords [b0, b2, b0, b2 | b1, b3, b1, b3] */
        __m256i h = _mm256_hadd_epi32(p01, p23);
        h = _mm256_hadd_epi32(h, h);
        int32_t v[8];
        _mm256_storeu_si256((__m256i *)v, h);
        const int32_t sum[4] = {v[0], v[4], v[1], v[5]};
        for (int k = 0; k < 4; k++) s += clb_e8m0_half(w[b + k].e) * a[b + k].d * (float)sum[k];
    }
    for (; b < nb; b++) { /* the last blocks one at a time, the second lane a copy */
        const clb_block_mxfp4 wp[2] = {w[b], w[b]};
        const clb_block_q8a ap[2] = {a[b], a[b]};
        __m256i p = clb_mxfp4_pair(wp, ap, lut);
        s += clb_e8m0_half(w[b].e) * a[b].d * (float)(clb_hsum256_i32(p) / 2);
    }
    return s;
}

void clb_gemm_mxfp4_avx2(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,
                         size_t act_row, int64_t n_tok, float *y, int64_t ldy) {
    clb_gemm_by_dot(clb_vec_dot_mxfp4_avx2, n, n_rows, w, w_row, act, act_row, n_tok, y, ldy);
}
