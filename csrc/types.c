/* Colibri scalar type helpers: f16/bf16 <-> f32 conversion and row sizes.
 * Guarantees: f32 -> f16 rounds to nearest even exactly like numpy's astype(float16)
 * (overflow to inf, subnormals, NaN kept quiet); f32 -> bf16 matches engine/format/quant.py.
 * Refuses: row sizes for lengths that do not fill whole blocks (returns 0). */
#include <string.h>

#include "clb_types.h"

static uint32_t clb_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float clb_bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

float clb_f16_to_f32(clb_f16 h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0) {
        /* zero or subnormal: mant * 2^-24, exact in f32 */
        float v = (float)mant * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    if (exp == 31) return clb_bits_f32(sign | 0x7f800000u | (mant << 13));
    return clb_bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

clb_f16 clb_f32_to_f16(float f) {
    uint32_t x = clb_f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) {
        if (ax > 0x7f800000u) return (clb_f16)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
        return (clb_f16)(sign | 0x7c00u);
    }
    /* 65520 = halfway between 65504 (max f16, odd mantissa) and 2^16: ties to even -> inf */
    if (ax >= 0x477ff000u) return (clb_f16)(sign | 0x7c00u);
    if (ax >= 0x38800000u) { /* normal f16 range, >= 2^-14 */
        uint32_t odd = (ax >> 13) & 1u;
        ax += 0xfffu + odd; /* round to nearest even on the 13 dropped bits; carries are fine */
        return (clb_f16)(sign | ((ax - 0x38000000u) >> 13));
    }
    uint32_t e = ax >> 23;
    if (e < 102) return sign; /* below 2^-25: rounds to zero */
    /* subnormal f16: value in units of 2^-24 is m >> (126 - e) */
    uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - e; /* 14 .. 24 */
    uint32_t q = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) q++; /* q may reach 0x400: smallest normal */
    return (clb_f16)(sign | q);
}

float clb_bf16_to_f32(clb_bf16 h) { return clb_bits_f32((uint32_t)h << 16); }

clb_bf16 clb_f32_to_bf16(float f) {
    uint32_t u = clb_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (clb_bf16)((u >> 16) | 0x40u);
    return (clb_bf16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static const struct {
    int64_t blck;
    size_t bytes;
} clb_type_sizes[CLB_TYPE_COUNT] = {
    [CLB_TYPE_F32] = {1, 4},
    [CLB_TYPE_F16] = {1, 2},
    [CLB_TYPE_BF16] = {1, 2},
    [CLB_TYPE_Q8] = {CLB_QK, sizeof(clb_block_q8)},
    [CLB_TYPE_Q4] = {CLB_QK, sizeof(clb_block_q4)},
    [CLB_TYPE_Q8A] = {CLB_QK, sizeof(clb_block_q8a)},
    [CLB_TYPE_Q8X8] = {CLB_QK, sizeof(clb_block_q8)},
    [CLB_TYPE_Q4X8] = {CLB_QK, sizeof(clb_block_q4)},
    [CLB_TYPE_Q6] = {CLB_QK, sizeof(clb_block_q6)},
    [CLB_TYPE_Q6X8] = {CLB_QK, sizeof(clb_block_q6)},
    [CLB_TYPE_MXFP4] = {CLB_QK, sizeof(clb_block_mxfp4)},
    [CLB_TYPE_MXFP4X8] = {CLB_QK, sizeof(clb_block_mxfp4)},
};

size_t clb_type_row_size(clb_type t, int64_t n) {
    if ((int)t < 0 || t >= CLB_TYPE_COUNT || n < 0) return 0;
    int64_t bs = clb_type_sizes[t].blck;
    if (n % bs) return 0;
    /* n <= 2^40 per the file format, so this cannot overflow size_t on 64-bit */
    return (size_t)(n / bs) * clb_type_sizes[t].bytes;
}

int clb_type_valid_for_file(uint32_t t) {
    return t < (uint32_t)CLB_TYPE_Q8A || t == (uint32_t)CLB_TYPE_Q6 ||
           t == (uint32_t)CLB_TYPE_MXFP4 || t == (uint32_t)CLB_TYPE_Q8X8 ||
           t == (uint32_t)CLB_TYPE_Q4X8 || t == (uint32_t)CLB_TYPE_Q6X8;
}
