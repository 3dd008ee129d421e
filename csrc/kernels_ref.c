/* Colibri reference kernels: plain C quantizers, to-float and dot products for every type.
 * Guarantees: quantizers are bit-exact with engine/format/quant.py (float32 arithmetic, rint =
 * nearbyintf half-to-even, f16 scales rounded to nearest even); dot products compute integer
 * sums per block, then scale. These are the twins every SIMD kernel is tested against.
 * Refuses: n that is not a multiple of 32 for block types (caller's contract, asserted). */
#include <assert.h>
#include <math.h>
#include <string.h>

#include "clb_kernels.h"
#include "clb_kernels_isa.h"

/* q4 byte -> its two values (low nibble - 8, high nibble - 8), built at compile time */
#define CLB_Q4L(b) {(int8_t)(((b) & 15) - 8), (int8_t)(((b) >> 4) - 8)}
#define CLB_Q4R4(b) CLB_Q4L(b), CLB_Q4L((b) + 1), CLB_Q4L((b) + 2), CLB_Q4L((b) + 3)
#define CLB_Q4R16(b) CLB_Q4R4(b), CLB_Q4R4((b) + 4), CLB_Q4R4((b) + 8), CLB_Q4R4((b) + 12)
#define CLB_Q4R64(b) CLB_Q4R16(b), CLB_Q4R16((b) + 16), CLB_Q4R16((b) + 32), CLB_Q4R16((b) + 48)
static const int8_t clb_q4_lut[256][2] = {CLB_Q4R64(0), CLB_Q4R64(64), CLB_Q4R64(128),
                                          CLB_Q4R64(192)};

/* fmaxf/fminf map NaN to the bound, so a NaN input can never reach a float->int cast (UB);
 * the SIMD max/min instructions behave the same way with the value as first operand. */
static float clb_clampf(float v, float lo, float hi) { return fminf(fmaxf(v, lo), hi); }

/* ---- quantizers (spec: engine/format/quant.py quantize_q8 / quantize_q4; q8a = q8 with f32 d) ---- */

static float clb_q8_scale(const float *x, float *inv) {
    float amax = 0.0f;
    for (int j = 0; j < CLB_QK; j++) {
        float a = fabsf(x[j]);
        if (a > amax) amax = a;
    }
    float d = amax / 127.0f;
    *inv = d != 0.0f ? 1.0f / d : 0.0f;
    return d;
}

void clb_quantize_q8_ref(int64_t n, const float *x, clb_block_q8 *y) {
    assert(n % CLB_QK == 0);
    for (int64_t b = 0; b < n / CLB_QK; b++) {
        const float *xb = x + b * CLB_QK;
        float inv;
        float d = clb_q8_scale(xb, &inv);
        y[b].d = clb_f32_to_f16(d);
        for (int j = 0; j < CLB_QK; j++)
            y[b].qs[j] = (int8_t)clb_clampf(nearbyintf(xb[j] * inv), -127.0f, 127.0f);
    }
}

void clb_quantize_q8a_ref(int64_t n, const float *x, clb_block_q8a *y) {
    assert(n % CLB_QK == 0);
    for (int64_t b = 0; b < n / CLB_QK; b++) {
        const float *xb = x + b * CLB_QK;
        float inv;
        y[b].d = clb_q8_scale(xb, &inv);
        int32_t sum = 0;
        for (int j = 0; j < CLB_QK; j++) {
            int8_t q = (int8_t)clb_clampf(nearbyintf(xb[j] * inv), -127.0f, 127.0f);
            y[b].qs[j] = q;
            sum += q;
        }
        y[b].sum = sum;
    }
}

/* q4 and q6: stores the block's scale d = (its value of largest magnitude, the first on ties)
 * / -levels as f16 and returns 1 / d (0 for an all-zero block) */
static float clb_signed_max_scale(const float *xb, float levels, clb_f16 *d_out) {
    float amax = 0.0f, m = 0.0f;
    for (int j = 0; j < CLB_QK; j++) { /* strict > keeps the first index on ties */
        if (fabsf(xb[j]) > amax) {
            amax = fabsf(xb[j]);
            m = xb[j];
        }
    }
    const float d = m / -levels;
    *d_out = clb_f32_to_f16(d);
    return d != 0.0f ? 1.0f / d : 0.0f;
}

/* q4 and q6: x's stored level, rint(x / d) + levels clamped to 0..2 * levels - 1 */
static int clb_level(float x, float inv, float levels) {
    return (int)clb_clampf(nearbyintf(x * inv) + levels, 0.0f, 2.0f * levels - 1.0f);
}

void clb_quantize_q4_ref(int64_t n, const float *x, clb_block_q4 *y) {
    assert(n % CLB_QK == 0);
    for (int64_t b = 0; b < n / CLB_QK; b++) {
        const float *xb = x + b * CLB_QK;
        const float inv = clb_signed_max_scale(xb, 8.0f, &y[b].d);
        for (int j = 0; j < CLB_QK / 2; j++)
            y[b].qs[j] = (uint8_t)(clb_level(xb[j], inv, 8.0f) |
                                   clb_level(xb[j + CLB_QK / 2], inv, 8.0f) << 4);
    }
}

/* Where element j of a q6 block lives (clb_types.h): its low 4 bits at bit lo_shift of
 * qs[lo_byte], its high 2 bits at bit hi_shift of qs[hi_byte]. */
typedef struct {
    int lo_byte, lo_shift, hi_byte, hi_shift;
} clb_q6_pos;

static clb_q6_pos clb_q6_at(int j) {
    const int jl = j % (CLB_QK / 2), h = j / (CLB_QK / 2);
    return (clb_q6_pos){jl, 4 * h, CLB_QK / 2 + 4 * h + jl % 4, 2 * (jl / 4)};
}

/* element j of a q6 block as stored, 0..63 */
static int clb_q6_u(const clb_block_q6 *b, int j) {
    const clb_q6_pos p = clb_q6_at(j);
    return ((b->qs[p.lo_byte] >> p.lo_shift) & 15) | ((b->qs[p.hi_byte] >> p.hi_shift) & 3) << 4;
}

void clb_quantize_q6_ref(int64_t n, const float *x, clb_block_q6 *y) {
    assert(n % CLB_QK == 0);
    for (int64_t b = 0; b < n / CLB_QK; b++) {
        const float *xb = x + b * CLB_QK;
        const float inv = clb_signed_max_scale(xb, 32.0f, &y[b].d);
        memset(y[b].qs, 0, sizeof y[b].qs);
        for (int j = 0; j < CLB_QK; j++) {
            const int u = clb_level(xb[j], inv, 32.0f);
            const clb_q6_pos p = clb_q6_at(j);
            y[b].qs[p.lo_byte] |= (uint8_t)((u & 15) << p.lo_shift);
            y[b].qs[p.hi_byte] |= (uint8_t)((u >> 4) << p.hi_shift);
        }
    }
}

void clb_from_float_f32_ref(int64_t n, const float *x, void *y) {
    memcpy(y, x, (size_t)n * sizeof(float));
}

void clb_from_float_f16_ref(int64_t n, const float *x, void *y) {
    clb_f16 *h = y;
    for (int64_t i = 0; i < n; i++) h[i] = clb_f32_to_f16(x[i]);
}

void clb_from_float_bf16_ref(int64_t n, const float *x, void *y) {
    clb_bf16 *h = y;
    for (int64_t i = 0; i < n; i++) h[i] = clb_f32_to_bf16(x[i]);
}

void clb_from_float_q8_ref(int64_t n, const float *x, void *y) { clb_quantize_q8_ref(n, x, y); }
void clb_from_float_q4_ref(int64_t n, const float *x, void *y) { clb_quantize_q4_ref(n, x, y); }
void clb_from_float_q6_ref(int64_t n, const float *x, void *y) { clb_quantize_q6_ref(n, x, y); }
void clb_from_float_q8a_ref(int64_t n, const float *x, void *y) { clb_quantize_q8a_ref(n, x, y); }

/* ---- to float (spec: engine/format/quant.py decode) ---- */

void clb_to_float_f32_ref(int64_t n, const void *x, float *y) {
    memcpy(y, x, (size_t)n * sizeof(float));
}

/* Bit-identical to clb_f16_to_f32 on all 65536 inputs, NaN payloads included (tested
 * against numpy), but branch-free so the compiler vectorises it: the f16 exponent and
 * mantissa bits, shifted into an f32, are the value times 2^-112 for normal and subnormal
 * inputs alike (subnormals become f32 subnormals, scaled exactly); inf and NaN are patched. */
void clb_to_float_f16_ref(int64_t n, const void *vx, float *vy) {
    const clb_f16 *restrict x = vx;
    float *restrict y = vy;
    for (int64_t i = 0; i < n; i++) {
        uint32_t h = x[i], em = h & 0x7fffu;
        uint32_t u = em << 13, r;
        float f;
        memcpy(&f, &u, sizeof f);
        f *= 0x1p112f;
        memcpy(&r, &f, sizeof r);
        uint32_t special = 0u - (uint32_t)(em >= 0x7c00u); /* all ones for inf / NaN */
        r = (r & ~special) | ((0x7f800000u | u) & special);
        r |= (h & 0x8000u) << 16;
        memcpy(&y[i], &r, sizeof r);
    }
}

void clb_to_float_bf16_ref(int64_t n, const void *x, float *y) {
    const clb_bf16 *h = x;
    for (int64_t i = 0; i < n; i++) y[i] = clb_bf16_to_f32(h[i]);
}

void clb_to_float_q8_ref(int64_t n, const void *x, float *y) {
    const clb_block_q8 *b = x;
    for (int64_t i = 0; i < n / CLB_QK; i++) {
        float d = clb_f16_to_f32(b[i].d);
        for (int j = 0; j < CLB_QK; j++) y[i * CLB_QK + j] = d * (float)b[i].qs[j];
    }
}

void clb_to_float_q4_ref(int64_t n, const void *x, float *y) {
    const clb_block_q4 *b = x;
    for (int64_t i = 0; i < n / CLB_QK; i++) {
        float d = clb_f16_to_f32(b[i].d);
        float *yb = y + i * CLB_QK;
        for (int j = 0; j < CLB_QK / 2; j++) {
            const int8_t *v = clb_q4_lut[b[i].qs[j]];
            yb[j] = d * (float)v[0];
            yb[j + CLB_QK / 2] = d * (float)v[1];
        }
    }
}

void clb_to_float_q6_ref(int64_t n, const void *x, float *y) {
    const clb_block_q6 *b = x;
    for (int64_t i = 0; i < n / CLB_QK; i++) {
        float d = clb_f16_to_f32(b[i].d);
        for (int j = 0; j < CLB_QK; j++) y[i * CLB_QK + j] = d * (float)(clb_q6_u(&b[i], j) - 32);
    }
}

void clb_to_float_q8a_ref(int64_t n, const void *x, float *y) {
    const clb_block_q8a *b = x;
    for (int64_t i = 0; i < n / CLB_QK; i++)
        for (int j = 0; j < CLB_QK; j++) y[i * CLB_QK + j] = b[i].d * (float)b[i].qs[j];
}

static const int8_t clb_mxfp4_lut[16] = {CLB_MXFP4_VALUES};

void clb_to_float_mxfp4_ref(int64_t n, const void *x, float *y) {
    const clb_block_mxfp4 *b = x;
    for (int64_t i = 0; i < n / CLB_QK; i++) {
        const float d = clb_e8m0_half(b[i].e);
        float *yb = y + i * CLB_QK;
        for (int k = 0; k < CLB_QK / 2; k++) {
            yb[2 * k] = d * (float)clb_mxfp4_lut[b[i].qs[k] & 15];
            yb[2 * k + 1] = d * (float)clb_mxfp4_lut[b[i].qs[k] >> 4];
        }
    }
}

void clb_dequantize_row(clb_type t, int64_t n, const void *x, float *y) {
    switch (t) {
    case CLB_TYPE_F32: clb_to_float_f32_ref(n, x, y); break;
    case CLB_TYPE_F16: clb_to_float_f16_ref(n, x, y); break;
    case CLB_TYPE_BF16: clb_to_float_bf16_ref(n, x, y); break;
    case CLB_TYPE_Q8: clb_to_float_q8_ref(n, x, y); break;
    case CLB_TYPE_Q4: clb_to_float_q4_ref(n, x, y); break;
    case CLB_TYPE_Q6: clb_to_float_q6_ref(n, x, y); break;
    case CLB_TYPE_Q8A: clb_to_float_q8a_ref(n, x, y); break;
    case CLB_TYPE_MXFP4: clb_to_float_mxfp4_ref(n, x, y); break;
    default: assert(!"clb_dequantize_row: invalid type");
    }
}

/* ---- dot products: weight row (its type) . activation row (f32 or q8a) ---- */

float clb_vec_dot_f32_ref(int64_t n, const void *w, const void *x) {
    const float *a = w, *b = x;
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

float clb_vec_dot_f16_ref(int64_t n, const void *w, const void *x) {
    const clb_f16 *a = w;
    const float *b = x;
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += clb_f16_to_f32(a[i]) * b[i];
    return s;
}

float clb_vec_dot_bf16_ref(int64_t n, const void *w, const void *x) {
    const clb_bf16 *a = w;
    const float *b = x;
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += clb_bf16_to_f32(a[i]) * b[i];
    return s;
}

float clb_vec_dot_q8_ref(int64_t n, const void *w, const void *x) {
    const clb_block_q8 *a = w;
    const clb_block_q8a *b = x;
    float s = 0.0f;
    for (int64_t i = 0; i < n / CLB_QK; i++) {
        int32_t sumi = 0;
        for (int j = 0; j < CLB_QK; j++) sumi += (int32_t)a[i].qs[j] * (int32_t)b[i].qs[j];
        s += clb_f16_to_f32(a[i].d) * b[i].d * (float)sumi;
    }
    return s;
}

float clb_vec_dot_q4_ref(int64_t n, const void *w, const void *x) {
    const clb_block_q4 *a = w;
    const clb_block_q8a *b = x;
    float s = 0.0f;
    for (int64_t i = 0; i < n / CLB_QK; i++) {
        int32_t sumi = 0;
        for (int j = 0; j < CLB_QK / 2; j++) {
            const int8_t *v = clb_q4_lut[a[i].qs[j]];
            sumi += (int32_t)v[0] * b[i].qs[j] + (int32_t)v[1] * b[i].qs[j + CLB_QK / 2];
        }
        s += clb_f16_to_f32(a[i].d) * b[i].d * (float)sumi;
    }
    return s;
}

float clb_vec_dot_q6_ref(int64_t n, const void *w, const void *x) {
    const clb_block_q6 *a = w;
    const clb_block_q8a *b = x;
    float s = 0.0f;
    for (int64_t i = 0; i < n / CLB_QK; i++) {
        int32_t sumi = 0;
        for (int j = 0; j < CLB_QK; j++) sumi += (int32_t)(clb_q6_u(&a[i], j) - 32) * b[i].qs[j];
        s += clb_f16_to_f32(a[i].d) * b[i].d * (float)sumi;
    }
    return s;
}

float clb_vec_dot_mxfp4_ref(int64_t n, const void *w, const void *x) {
    const clb_block_mxfp4 *a = w;
    const clb_block_q8a *b = x;
    float s = 0.0f;
    for (int64_t i = 0; i < n / CLB_QK; i++) {
        int32_t sumi = 0;
        for (int k = 0; k < CLB_QK / 2; k++)
            sumi += (int32_t)clb_mxfp4_lut[a[i].qs[k] & 15] * b[i].qs[2 * k] +
                    (int32_t)clb_mxfp4_lut[a[i].qs[k] >> 4] * b[i].qs[2 * k + 1];
        s += clb_e8m0_half(a[i].e) * b[i].d * (float)sumi;
    }
    return s;
}

/* ---- multi-row products on q8a rows (the packed layout of the reference) ---- */

size_t clb_act_size_q8a(int64_t n) { return (size_t)(n / CLB_QK) * sizeof(clb_block_q8a); }
size_t clb_act_size_q8c(int64_t n) { return (size_t)(n / CLB_QK) * sizeof(clb_block_q8c); }

void clb_gemm_q8_ref(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,
                     size_t act_row, int64_t n_tok, float *y, int64_t ldy) {
    clb_gemm_by_dot(clb_vec_dot_q8_ref, n, n_rows, w, w_row, act, act_row, n_tok, y, ldy);
}

void clb_gemm_q4_ref(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,
                     size_t act_row, int64_t n_tok, float *y, int64_t ldy) {
    clb_gemm_by_dot(clb_vec_dot_q4_ref, n, n_rows, w, w_row, act, act_row, n_tok, y, ldy);
}

void clb_gemm_q6_ref(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,
                     size_t act_row, int64_t n_tok, float *y, int64_t ldy) {
    clb_gemm_by_dot(clb_vec_dot_q6_ref, n, n_rows, w, w_row, act, act_row, n_tok, y, ldy);
}

void clb_gemm_mxfp4_ref(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,
                        size_t act_row, int64_t n_tok, float *y, int64_t ldy) {
    clb_gemm_by_dot(clb_vec_dot_mxfp4_ref, n, n_rows, w, w_row, act, act_row, n_tok, y, ldy);
}

/* ---- 8-row interleaved layouts (q8x8, q4x8, q6x8; see clb_types.h) ---- */

clb_type clb_x8_type(clb_type t) {
    switch (t) {
    case CLB_TYPE_Q8: return CLB_TYPE_Q8X8;
    case CLB_TYPE_Q4: return CLB_TYPE_Q4X8;
    case CLB_TYPE_Q6: return CLB_TYPE_Q6X8;
    case CLB_TYPE_MXFP4: return CLB_TYPE_MXFP4X8;
    default: return t;
    }
}

clb_type clb_x8_base(clb_type t) {
    switch (t) {
    case CLB_TYPE_Q8X8: return CLB_TYPE_Q8;
    case CLB_TYPE_Q4X8: return CLB_TYPE_Q4;
    case CLB_TYPE_Q6X8: return CLB_TYPE_Q6;
    case CLB_TYPE_MXFP4X8: return CLB_TYPE_MXFP4;
    default: return t;
    }
}

/* An mxfp4 block's 16 nibble bytes in q4's element order (byte j: element j low, j + 16 high)
 * from the checkpoints' (byte k: element 2k low, 2k + 1 high), and back. */
static int clb_mxfp4_nib(const uint8_t *qs, int e) { return (qs[e / 2] >> (4 * (e % 2))) & 15; }

static void clb_mxfp4_to_q4_order(const uint8_t *qs, uint8_t *out) {
    for (int j = 0; j < CLB_QK / 2; j++)
        out[j] = (uint8_t)(clb_mxfp4_nib(qs, j) | clb_mxfp4_nib(qs, j + CLB_QK / 2) << 4);
}

static void clb_mxfp4_from_q4_order(const uint8_t *q4, uint8_t *qs) {
    int nib[CLB_QK];
    for (int j = 0; j < CLB_QK / 2; j++) {
        nib[j] = q4[j] & 15;
        nib[j + CLB_QK / 2] = q4[j] >> 4;
    }
    for (int k = 0; k < CLB_QK / 2; k++) qs[k] = (uint8_t)(nib[2 * k] | nib[2 * k + 1] << 4);
}

/* a row type's scale bytes per block: f16, or mxfp4's one exponent */
static size_t clb_x8_scale_bytes(clb_type t) { return t == CLB_TYPE_MXFP4 ? 1 : sizeof(clb_f16); }

void clb_repack_x8_ref(clb_type t, int64_t n, int64_t n_rows, const void *src, void *dst) {
    assert(clb_x8_type(t) != t && n_rows % 8 == 0 && n % CLB_QK == 0);
    const size_t bs = clb_type_row_size(t, CLB_QK), sc = clb_x8_scale_bytes(t);
    const size_t qb = bs - sc, row = (size_t)(n / CLB_QK) * bs;
    for (int64_t g = 0; g < n_rows / 8; g++) {
        const char *s = (const char *)src + (size_t)g * 8 * row;
        char *d = (char *)dst + (size_t)g * 8 * row;
        for (int64_t b = 0; b < n / CLB_QK; b++) {
            char *db = d + (size_t)b * 8 * bs;
            for (int r = 0; r < 8; r++) {
                const char *sb = s + (size_t)r * row + (size_t)b * bs;
                uint8_t q[CLB_QK / 2];
                const char *qs = sb + sc;
                if (t == CLB_TYPE_MXFP4) {
                    clb_mxfp4_to_q4_order((const uint8_t *)qs, q);
                    qs = (const char *)q;
                }
                memcpy(db + sc * (size_t)r, sb, sc);
                for (size_t c = 0; c < qb / 4; c++)
                    memcpy(db + 8 * sc + 32 * c + 4 * (size_t)r, qs + 4 * c, 4);
            }
        }
    }
}

/* block b of row r (0..7) of an interleaved group of row type t, back in the row layout */
static void clb_x8_block(clb_type t, const char *grp, int64_t b, int r, char *out) {
    const size_t bs = clb_type_row_size(t, CLB_QK), sc = clb_x8_scale_bytes(t);
    const char *db = grp + (size_t)b * 8 * bs;
    memcpy(out, db + sc * (size_t)r, sc);
    for (size_t c = 0; c < (bs - sc) / 4; c++)
        memcpy(out + sc + 4 * c, db + 8 * sc + 32 * c + 4 * (size_t)r, 4);
    if (t == CLB_TYPE_MXFP4) {
        uint8_t q4[CLB_QK / 2];
        memcpy(q4, out + sc, sizeof q4);
        clb_mxfp4_from_q4_order(q4, (uint8_t *)out + sc);
    }
}

/* The row layout's reference dot, block by block in the same order (s += d_w * d_a * sum), so
 * an interleaved matrix gives bit for bit the results of its rows. */
static void clb_gemm_x8_ref(clb_vec_dot_fn dot, clb_type t, int64_t n, int64_t n_rows,
                            const void *w, size_t w_row, const void *act, size_t act_row,
                            int64_t n_tok, float *y, int64_t ldy) {
    assert(n_rows % 8 == 0);
    char blk[sizeof(clb_block_q8)];
    for (int64_t tk = 0; tk < n_tok; tk++) {
        const clb_block_q8a *a = (const clb_block_q8a *)((const char *)act + (size_t)tk * act_row);
        for (int64_t r = 0; r < n_rows; r++) {
            const char *grp = (const char *)w + (size_t)(r / 8) * 8 * w_row;
            float s = 0.0f;
            for (int64_t b = 0; b < n / CLB_QK; b++) {
                clb_x8_block(t, grp, b, (int)(r % 8), blk);
                s += dot(CLB_QK, blk, a + b);
            }
            y[tk * ldy + r] = s;
        }
    }
}

void clb_gemm_q8x8_ref(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,
                       size_t act_row, int64_t n_tok, float *y, int64_t ldy) {
    clb_gemm_x8_ref(clb_vec_dot_q8_ref, CLB_TYPE_Q8, n, n_rows, w, w_row, act, act_row,
                    n_tok, y, ldy);
}

void clb_gemm_q4x8_ref(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,
                       size_t act_row, int64_t n_tok, float *y, int64_t ldy) {
    clb_gemm_x8_ref(clb_vec_dot_q4_ref, CLB_TYPE_Q4, n, n_rows, w, w_row, act, act_row,
                    n_tok, y, ldy);
}

void clb_gemm_q6x8_ref(int64_t n, int64_t n_rows, const void *w, size_t w_row, const void *act,
                       size_t act_row, int64_t n_tok, float *y, int64_t ldy) {
    clb_gemm_x8_ref(clb_vec_dot_q6_ref, CLB_TYPE_Q6, n, n_rows, w, w_row, act, act_row,
                    n_tok, y, ldy);
}

void clb_gemm_mxfp4x8_ref(int64_t n, int64_t n_rows, const void *w, size_t w_row,
                          const void *act, size_t act_row, int64_t n_tok, float *y, int64_t ldy) {
    clb_gemm_x8_ref(clb_vec_dot_mxfp4_ref, CLB_TYPE_MXFP4, n, n_rows, w, w_row, act, act_row,
                    n_tok, y, ldy);
}

/* ---- small f32 vector ops (attention) ---- */

void clb_vec_mad_f32_ref(int64_t n, float *y, const float *x, float a) {
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

float clb_att_dots_f32_ref(int64_t hd, const float *q, const float *k, int64_t ldk, int64_t n,
                           float scale, float *s) {
    float top = -INFINITY;
    for (int64_t r = 0; r < n; r++) {
        s[r] = clb_vec_dot_f32_ref(hd, k + r * ldk, q) * scale;
        top = s[r] > top ? s[r] : top;
    }
    return top;
}

void clb_silu_mul_f32_ref(int64_t n, float *g, const float *u) {
    for (int64_t i = 0; i < n; i++) g[i] = g[i] / (1.0f + clb_exp1(-g[i])) * u[i];
}

void clb_glu_clamp_f32(int64_t n, float *g, const float *u, const clb_glu_clamp *c) {
    for (int64_t i = 0; i < n; i++) {
        const float x = fminf(g[i], c->limit), up = fminf(fmaxf(u[i], -c->limit), c->limit);
        g[i] = x / (1.0f + clb_exp1(-c->alpha * x)) * (up + 1.0f);
    }
}

float clb_att_exp_sum_ref(int64_t n, float *s, float top) {
    float part[CLB_EXP_LANES] = {0};
    for (int64_t j = 0; j < n; j++) {
        s[j] = clb_exp1(s[j] - top);
        part[j % CLB_EXP_LANES] += s[j];
    }
    return clb_exp_fold(part);
}

void clb_att_mad_rows_f32_ref(int64_t hd, float *out, const float *v, int64_t ldv, int64_t n,
                              const float *w) {
    for (int64_t r = 0; r < n; r++) clb_vec_mad_f32_ref(hd, out, v + r * ldv, w[r]);
}
