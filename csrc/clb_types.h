/* Colibri weight types: the one table that describes every type.
 * Guarantees: block structs have compile-time size checks; the traits table is the only
 * place that knows a type's block size, bytes per block and the activation type it wants.
 * Refuses: nothing here allocates or touches files. */
#ifndef CLB_TYPES_H
#define CLB_TYPES_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    CLB_OK = 0,
    CLB_E_IO = -1,     /* open/stat/mmap failed, file missing */
    CLB_E_FORMAT = -2, /* bad magic, version, table, offsets: a corrupt or truncated file */
    CLB_E_SHAPE = -3,  /* tensor present but shape/dtype disagree with the config */
    CLB_E_NOMEM = -4,
    CLB_E_ARG = -5,    /* caller passed something invalid (token id, position, sequence) */
    CLB_E_RANGE = -6,  /* a context or capacity limit was exceeded */
} clb_status;

typedef enum {
    CLB_TYPE_F32 = 0,
    CLB_TYPE_F16 = 1,
    CLB_TYPE_BF16 = 2,
    CLB_TYPE_Q8 = 3,
    CLB_TYPE_Q4 = 4,
    CLB_TYPE_Q8A = 5, /* activation-only type, never stored in files */
    /* q8 / q4 rows repacked in memory for a kernel that reads 8 rows at once (never stored in
     * files, see clb_repack_x8): per group of 8 rows and per block, the 8 rows' f16 scales,
     * then their quant bytes 4 at a time, row after row (bytes 4c..4c+3 of row r at
     * 4 * (8c + r)). A group takes exactly the bytes of its 8 rows, so row r0 (a multiple
     * of 8) still starts at r0 * row size. */
    CLB_TYPE_Q8X8 = 6,
    CLB_TYPE_Q4X8 = 7,
    CLB_TYPE_Q6 = 8,
    CLB_TYPE_Q6X8 = 9, /* q6 rows interleaved like q8x8 / q4x8 (never stored in files) */
    CLB_TYPE_MXFP4 = 10, /* OCP microscaling FP4, as gpt-oss checkpoints ship their experts */
    /* mxfp4 rows interleaved like q4x8 (never stored in files): per group of 8 rows and per
     * block, the 8 rows' exponents (byte r: row r's), then each row's 16 nibble bytes in q4's
     * element order (byte j: element j in its low nibble, j + 16 in its high one), 4 bytes at
     * a time, row after row (bytes 4c..4c+3 of row r at 8 + 4 * (8c + r)) */
    CLB_TYPE_MXFP4X8 = 11,
    CLB_TYPE_COUNT
} clb_type;

#define CLB_QK 32 /* elements per quantized block */

typedef uint16_t clb_f16;
typedef uint16_t clb_bf16;

typedef struct {
    clb_f16 d;
    int8_t qs[CLB_QK];
} clb_block_q8;
_Static_assert(sizeof(clb_block_q8) == 34, "q8 block must be 34 bytes");

typedef struct {
    clb_f16 d;
    uint8_t qs[CLB_QK / 2]; /* element j<16: low nibble of qs[j]; element j+16: high nibble */
} clb_block_q4;
_Static_assert(sizeof(clb_block_q4) == 18, "q4 block must be 18 bytes");

/* 6 bits: u = lo | hi << 4 in 0..63, value d * (u - 32). lo as in q4 (element j<16: low nibble
 * of qs[j], element j+16: high nibble); hi of element 16h + 4k + i (h 0..1, k 0..3, i 0..3):
 * bits 2k..2k+1 of qs[16 + 4h + i]. So each 4 quant bytes are whole (the interleaved layout
 * moves them as dwords) and the hi parts of one dword of nibble bytes sit in one dword. */
typedef struct {
    clb_f16 d;
    uint8_t qs[CLB_QK / 2 + CLB_QK / 4];
} clb_block_q6;
_Static_assert(sizeof(clb_block_q6) == 26, "q6 block must be 26 bytes");

/* MXFP4 (OCP Microscaling): 32 e2m1 values sharing one power-of-two scale. e is an e8m0
 * exponent, scale 2^(e - 127); element 2k is the low nibble of qs[k], 2k + 1 its high nibble
 * (the nibble order of the checkpoints' *_blocks tensors, whose 16 bytes per block are copied
 * as they are). A nibble is sign (bit 3) and magnitude 0, 0.5, 1, 1.5, 2, 3, 4, 6 (bits 0-2).
 * The kernels read the doubled magnitudes (integers 0..12) with scale 2^(e - 128): the same
 * values, and integer products with q8 activations. */
typedef struct {
    uint8_t e;
    uint8_t qs[CLB_QK / 2];
} clb_block_mxfp4;
_Static_assert(sizeof(clb_block_mxfp4) == 17, "mxfp4 block must be 17 bytes");

typedef struct {
    float d;
    int32_t sum; /* sum of qs, used by kernels that read weights as unsigned */
    int8_t qs[CLB_QK];
} clb_block_q8a;
_Static_assert(sizeof(clb_block_q8a) == 40, "q8a block must be 40 bytes");

/* dot product of one weight row (n elements, type-specific blocks) with one activation row
 * already converted to the type's act_type. */
typedef float (*clb_vec_dot_fn)(int64_t n, const void *w_row, const void *act_row);
/* activation row (f32, n elements) -> act_type row */
typedef void (*clb_from_float_fn)(int64_t n, const float *x, void *y);
/* weight row -> f32 (n elements) */
typedef void (*clb_to_float_fn)(int64_t n, const void *x, float *y);

/* Multi-row kernel: y[t * ldy + r] = dot(weight row r, packed activation row t) for r < n_rows,
 * t < n_tok; weight rows are w_row bytes apart, packed activation rows act_row bytes apart.
 * Each (r, t) result is computed with the same arithmetic whatever n_rows and n_tok are, so
 * splitting rows or tokens differently never changes a bit of the output. */
typedef void (*clb_gemm_fn)(int64_t n, int64_t n_rows, const void *w, size_t w_row,
                            const void *act, size_t act_row, int64_t n_tok, float *y, int64_t ldy);
/* bytes of one packed activation row of n elements */
typedef size_t (*clb_act_size_fn)(int64_t n);

typedef struct {
    const char *name;
    int64_t blck_size;
    size_t type_size;        /* bytes per block */
    clb_type act_type;       /* what vec_dot wants on its activation side */
    clb_to_float_fn to_float;
    clb_vec_dot_fn vec_dot;     /* NULL for q8a (activation-only) */
    clb_from_float_fn from_float; /* f32 row -> this type (quantizer / converter) */
    /* Optional fast path for weight types (all three set, or all NULL): act_pack turns an f32
     * row into the ISA's packed activation layout (q8a values, rearranged for the kernel),
     * act_size gives its bytes, gemm multiplies several weight rows by several packed rows. */
    clb_act_size_fn act_size;
    clb_from_float_fn act_pack;
    clb_gemm_fn gemm;
    /* weight bytes per gemm call the matmul driver hands out; 0: its default, sized to keep a
     * row block in L2 while every token passes (what a kernel with tokens outside its row loop
     * needs). Kernels that pass every token over a row group before the next one and
     * prefetch across groups want long row ranges instead. */
    size_t gemm_block_bytes;
    /* 1: this ISA's products are faster on the interleaved twin (clb_x8_type), so weights of
     * this type are repacked once at load */
    int prefer_x8;
} clb_type_traits;

/* bytes of one row of n elements; 0 if n is not a multiple of the block size or type invalid */
size_t clb_type_row_size(clb_type t, int64_t n);
int clb_type_valid_for_file(uint32_t t);

float clb_f16_to_f32(clb_f16 h);
clb_f16 clb_f32_to_f16(float f);   /* round to nearest even */
float clb_bf16_to_f32(clb_bf16 h);
clb_bf16 clb_f32_to_bf16(float f); /* round to nearest even; NaN stays NaN (quiet) */

#endif
