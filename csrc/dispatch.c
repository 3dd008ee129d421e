/* Colibri run-time ISA dispatch: one traits table per instruction set, the best one picked
 * once from CPUID.
 * Guarantees: clb_kernels_init() is idempotent and thread-safe; the reference table is always
 * available; a SIMD table is only selectable when this CPU and this build support it.
 * Refuses: forcing an unsupported ISA (CLB_E_ARG). */
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <string.h>

#include "clb_kernels.h"
#include "clb_kernels_isa.h"

#ifdef CLB_HAVE_X86
#include <cpuid.h>
#endif

static clb_type_traits clb_traits[CLB_ISA_COUNT][CLB_TYPE_COUNT];
static int clb_isa_ok[CLB_ISA_COUNT];
static clb_isa clb_isa_top = CLB_ISA_REF;
static _Atomic int clb_isa_cur = CLB_ISA_REF;
static pthread_once_t clb_init_once = PTHREAD_ONCE_INIT;

static clb_stream_hint clb_stream_top = CLB_STREAM_L2;
static _Atomic int clb_stream_cur = CLB_STREAM_L2;
static const char *const clb_stream_names[CLB_STREAM_COUNT] = {"l2", "nta"};

static clb_vec_mad_fn clb_mad[CLB_ISA_COUNT];
static clb_silu_mul_fn clb_silu_mul[CLB_ISA_COUNT];
static clb_att_kernels clb_att[CLB_ISA_COUNT];

static const char *const clb_isa_names[CLB_ISA_COUNT] = {"ref", "avx2", "avxvnni", "avx512"};

/* a quantized block type of the reference table: row access, products on q8a rows */
static clb_type_traits clb_block_ref(const char *name, size_t size, clb_to_float_fn to_float,
                                     clb_vec_dot_fn dot, clb_from_float_fn from_float,
                                     clb_gemm_fn gemm) {
    return (clb_type_traits){.name = name, .blck_size = CLB_QK, .type_size = size,
                             .act_type = CLB_TYPE_Q8A, .to_float = to_float, .vec_dot = dot,
                             .from_float = from_float, .act_size = clb_act_size_q8a,
                             .act_pack = clb_from_float_q8a_ref, .gemm = gemm};
}

/* an interleaved twin: the same products, no row access */
static clb_type_traits clb_x8_ref(const char *name, size_t size, clb_gemm_fn gemm) {
    return clb_block_ref(name, size, NULL, NULL, NULL, gemm);
}

static void clb_fill_ref(clb_type_traits *t) {
    t[CLB_TYPE_F32] = (clb_type_traits){.name = "f32", .blck_size = 1, .type_size = 4,
                                        .act_type = CLB_TYPE_F32,
                                        .to_float = clb_to_float_f32_ref,
                                        .vec_dot = clb_vec_dot_f32_ref,
                                        .from_float = clb_from_float_f32_ref};
    t[CLB_TYPE_F16] = (clb_type_traits){.name = "f16", .blck_size = 1, .type_size = 2,
                                        .act_type = CLB_TYPE_F32,
                                        .to_float = clb_to_float_f16_ref,
                                        .vec_dot = clb_vec_dot_f16_ref,
                                        .from_float = clb_from_float_f16_ref};
    t[CLB_TYPE_BF16] = (clb_type_traits){.name = "bf16", .blck_size = 1, .type_size = 2,
                                         .act_type = CLB_TYPE_F32,
                                         .to_float = clb_to_float_bf16_ref,
                                         .vec_dot = clb_vec_dot_bf16_ref,
                                         .from_float = clb_from_float_bf16_ref};
    t[CLB_TYPE_Q8] = clb_block_ref("q8", sizeof(clb_block_q8), clb_to_float_q8_ref,
                                   clb_vec_dot_q8_ref, clb_from_float_q8_ref, clb_gemm_q8_ref);
    t[CLB_TYPE_Q4] = clb_block_ref("q4", sizeof(clb_block_q4), clb_to_float_q4_ref,
                                   clb_vec_dot_q4_ref, clb_from_float_q4_ref, clb_gemm_q4_ref);
    t[CLB_TYPE_Q6] = clb_block_ref("q6", sizeof(clb_block_q6), clb_to_float_q6_ref,
                                   clb_vec_dot_q6_ref, clb_from_float_q6_ref, clb_gemm_q6_ref);
    t[CLB_TYPE_Q8A] = (clb_type_traits){.name = "q8a", .blck_size = CLB_QK,
                                        .type_size = sizeof(clb_block_q8a),
                                        .act_type = CLB_TYPE_Q8A,
                                        .to_float = clb_to_float_q8a_ref,
                                        .vec_dot = NULL,
                                        .from_float = clb_from_float_q8a_ref};
    /* MXFP4 has no quantizer here: the converter copies the checkpoint's blocks as they are */
    t[CLB_TYPE_MXFP4] = clb_block_ref("mxfp4", sizeof(clb_block_mxfp4), clb_to_float_mxfp4_ref,
                                      clb_vec_dot_mxfp4_ref, NULL, clb_gemm_mxfp4_ref);
    /* interleaved weights: products only (no row access), on the row type's activations */
    t[CLB_TYPE_Q8X8] = clb_x8_ref("q8x8", sizeof(clb_block_q8), clb_gemm_q8x8_ref);
    t[CLB_TYPE_Q4X8] = clb_x8_ref("q4x8", sizeof(clb_block_q4), clb_gemm_q4x8_ref);
    t[CLB_TYPE_Q6X8] = clb_x8_ref("q6x8", sizeof(clb_block_q6), clb_gemm_q6x8_ref);
    t[CLB_TYPE_MXFP4X8] = clb_x8_ref("mxfp4x8", sizeof(clb_block_mxfp4), clb_gemm_mxfp4x8_ref);
}

#ifdef CLB_HAVE_X86
/* a SIMD product on packed q8c rows; block_bytes 0: the matmul driver's default */
static void clb_products(clb_type_traits *tr, clb_from_float_fn pack, clb_gemm_fn gemm,
                         size_t block_bytes) {
    tr->act_size = clb_act_size_q8c;
    tr->act_pack = pack;
    tr->gemm = gemm;
    tr->gemm_block_bytes = block_bytes;
}

/* the AVX2 products that the AVX-512 table uses too (every AVX-512 CPU has AVX2): the
 * interleaved layouts, and q6 rows (kept when they cannot be interleaved) */
static void clb_fill_shared_avx2(clb_type_traits *t) {
    const size_t bb = CLB_AVX2_GEMM_BLOCK_BYTES;
    clb_products(&t[CLB_TYPE_Q8X8], clb_act_pack_q8_avx2, clb_gemm_q8x8_avx2, bb);
    clb_products(&t[CLB_TYPE_Q4X8], clb_act_pack_q4_avx2, clb_gemm_q4x8_avx2, bb);
    clb_products(&t[CLB_TYPE_Q6X8], clb_act_pack_q6_avx2, clb_gemm_q6x8_avx2, bb);
    clb_products(&t[CLB_TYPE_Q6], clb_act_pack_q6_avx2, clb_gemm_q6_avx2, bb);
    t[CLB_TYPE_Q6].prefer_x8 = 1;
    /* MXFP4 rows keep their one-row dots (products of rows that do not fill groups of 8) */
    clb_products(&t[CLB_TYPE_MXFP4X8], clb_act_pack_mxfp4_avx2, clb_gemm_mxfp4x8_avx2, bb);
    t[CLB_TYPE_MXFP4].prefer_x8 = 1;
}

static void clb_fill_avx2(clb_type_traits *t) {
    clb_fill_ref(t);
    t[CLB_TYPE_F32].vec_dot = clb_vec_dot_f32_avx2;
    t[CLB_TYPE_F16].vec_dot = clb_vec_dot_f16_avx2;
    t[CLB_TYPE_F16].to_float = clb_to_float_f16_avx2;
    t[CLB_TYPE_BF16].vec_dot = clb_vec_dot_bf16_avx2;
    t[CLB_TYPE_Q8].vec_dot = clb_vec_dot_q8_avx2;
    t[CLB_TYPE_Q4].vec_dot = clb_vec_dot_q4_avx2;
    t[CLB_TYPE_Q8A].from_float = clb_quantize_q8a_avx2;
    clb_products(&t[CLB_TYPE_Q8], clb_act_pack_q8_avx2, clb_gemm_q8_avx2,
                 CLB_AVX2_GEMM_BLOCK_BYTES);
    clb_products(&t[CLB_TYPE_Q4], clb_act_pack_q4_avx2, clb_gemm_q4_avx2,
                 CLB_AVX2_GEMM_BLOCK_BYTES);
    /* the row groups' loads, inserts and unpacks are a third of a one-token product's vector
     * work; the interleaved layout has none */
    t[CLB_TYPE_Q8].prefer_x8 = 1;
    t[CLB_TYPE_Q4].prefer_x8 = 1;
    clb_fill_shared_avx2(t);
    /* MXFP4 reads q8a rows on every path, packed by the ISA's q8a quantizer (same bytes) */
    t[CLB_TYPE_MXFP4].vec_dot = clb_vec_dot_mxfp4_avx2;
    t[CLB_TYPE_MXFP4].act_pack = clb_quantize_q8a_avx2;
    t[CLB_TYPE_MXFP4].gemm = clb_gemm_mxfp4_avx2;
}

/* AVX2 with AVX-VNNI: the interleaved products (every weight the loader repacks) take
 * vpdpbusd; everything else is the AVX2 table */
static void clb_fill_avxvnni(clb_type_traits *t) {
    clb_fill_avx2(t);
    const size_t bb = CLB_AVX2_GEMM_BLOCK_BYTES;
    clb_products(&t[CLB_TYPE_Q8X8], clb_act_pack_q8u_avx2, clb_gemm_q8x8_avxvnni, bb);
    clb_products(&t[CLB_TYPE_Q4X8], clb_act_pack_q4_avx2, clb_gemm_q4x8_avxvnni, bb);
    clb_products(&t[CLB_TYPE_Q6X8], clb_act_pack_q6_avx2, clb_gemm_q6x8_avxvnni, bb);
    clb_products(&t[CLB_TYPE_MXFP4X8], clb_act_pack_mxfp4_avx2, clb_gemm_mxfp4x8_avxvnni, bb);
}

static void clb_fill_avx512(clb_type_traits *t) {
    clb_fill_ref(t);
    t[CLB_TYPE_F32].vec_dot = clb_vec_dot_f32_avx512;
    t[CLB_TYPE_F16].vec_dot = clb_vec_dot_f16_avx512;
    t[CLB_TYPE_F16].to_float = clb_to_float_f16_avx2;
    t[CLB_TYPE_BF16].vec_dot = clb_vec_dot_bf16_avx512;
    t[CLB_TYPE_Q8].vec_dot = clb_vec_dot_q8_avx512;
    t[CLB_TYPE_Q4].vec_dot = clb_vec_dot_q4_avx512;
    t[CLB_TYPE_Q8A].from_float = clb_quantize_q8a_avx512;
    clb_products(&t[CLB_TYPE_Q8], clb_act_pack_q8_avx512, clb_gemm_q8_avx512, 0);
    clb_products(&t[CLB_TYPE_Q4], clb_act_pack_q4_avx512, clb_gemm_q4_avx512, 0);
    /* the interleaved layout spares the row groups' transposes (a dozen shuffles per block of
     * 16 rows) and the one-token path's horizontal sums */
    t[CLB_TYPE_Q8].prefer_x8 = 1;
    t[CLB_TYPE_Q4].prefer_x8 = 1;
    clb_fill_shared_avx2(t);
    const size_t bb = CLB_AVX2_GEMM_BLOCK_BYTES; /* as the AVX2 interleaved products */
    /* corr = -offset * sum: q8 128, q4 8, q6 32 */
    clb_products(&t[CLB_TYPE_Q8X8], clb_act_pack_q8_avx512, clb_gemm_q8x8_avx512, bb);
    clb_products(&t[CLB_TYPE_Q4X8], clb_act_pack_q4_avx512, clb_gemm_q4x8_avx512, bb);
    clb_products(&t[CLB_TYPE_Q6X8], clb_act_pack_q6_avx512, clb_gemm_q6x8_avx512, bb);
    clb_products(&t[CLB_TYPE_MXFP4X8], clb_act_pack_mxfp4_avx512, clb_gemm_mxfp4x8_avx512, bb);
    t[CLB_TYPE_MXFP4].vec_dot = clb_vec_dot_mxfp4_avx512;
    t[CLB_TYPE_MXFP4].act_pack = clb_quantize_q8a_avx512;
    t[CLB_TYPE_MXFP4].gemm = clb_gemm_mxfp4_avx512;
}
#endif

#ifdef CLB_HAVE_X86
/* the CPU family of an AMD processor (base plus extended family, as AMD numbers them), 0 for
 * any other vendor */
static unsigned clb_amd_family(void) {
    unsigned a, b, c, d;
    if (!__builtin_cpu_is("amd") || !__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const unsigned base = (a >> 8) & 0xf;
    return base == 0xf ? base + ((a >> 20) & 0xff) : base;
}
#endif

static void clb_init_impl(void) {
    clb_fill_ref(clb_traits[CLB_ISA_REF]);
    clb_mad[CLB_ISA_REF] = clb_vec_mad_f32_ref;
    clb_silu_mul[CLB_ISA_REF] = clb_silu_mul_f32_ref;
    clb_att[CLB_ISA_REF] = (clb_att_kernels){clb_att_dots_f32_ref, clb_att_mad_rows_f32_ref,
                                             clb_att_exp_sum_ref};
    clb_isa_ok[CLB_ISA_REF] = 1;
    clb_isa_top = CLB_ISA_REF;
#ifdef CLB_HAVE_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        /* F16C has no __builtin_cpu_supports name in older compilers; every AVX2 CPU has it */
        clb_fill_avx2(clb_traits[CLB_ISA_AVX2]);
        clb_mad[CLB_ISA_AVX2] = clb_vec_mad_f32_avx2;
        clb_silu_mul[CLB_ISA_AVX2] = clb_silu_mul_f32_avx2;
        clb_att[CLB_ISA_AVX2] = (clb_att_kernels){clb_att_dots_f32_avx2,
                                                  clb_att_mad_rows_f32_avx2,
                                                  clb_att_exp_sum_avx2};
        clb_isa_ok[CLB_ISA_AVX2] = 1;
        clb_isa_top = CLB_ISA_AVX2;
        if (__builtin_cpu_supports("avxvnni")) {
            clb_fill_avxvnni(clb_traits[CLB_ISA_AVXVNNI]);
            clb_mad[CLB_ISA_AVXVNNI] = clb_mad[CLB_ISA_AVX2];
            clb_silu_mul[CLB_ISA_AVXVNNI] = clb_silu_mul[CLB_ISA_AVX2];
            clb_att[CLB_ISA_AVXVNNI] = clb_att[CLB_ISA_AVX2];
            clb_isa_ok[CLB_ISA_AVXVNNI] = 1;
            clb_isa_top = CLB_ISA_AVXVNNI;
        }
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni")) {
            clb_fill_avx512(clb_traits[CLB_ISA_AVX512]);
            clb_mad[CLB_ISA_AVX512] = clb_vec_mad_f32_avx512;
            clb_silu_mul[CLB_ISA_AVX512] = clb_silu_mul_f32_avx2;
            clb_att[CLB_ISA_AVX512] = (clb_att_kernels){clb_att_dots_f32_avx512,
                                                    clb_att_mad_rows_f32_avx512,
                                                    clb_att_exp_sum_avx2};
            clb_isa_ok[CLB_ISA_AVX512] = 1;
            clb_isa_top = CLB_ISA_AVX512;
            clb_stream_top = clb_amd_family() >= 0x1a ? CLB_STREAM_NTA : CLB_STREAM_L2;
        }
    }
#endif
    atomic_store(&clb_isa_cur, (int)clb_isa_top);
    atomic_store(&clb_stream_cur, (int)clb_stream_top);
}

void clb_kernels_init(void) { pthread_once(&clb_init_once, clb_init_impl); }

clb_isa clb_isa_best(void) {
    clb_kernels_init();
    return clb_isa_top;
}

int clb_isa_supported(clb_isa isa) {
    clb_kernels_init();
    return (int)isa >= 0 && isa < CLB_ISA_COUNT && clb_isa_ok[isa];
}

clb_status clb_isa_force(clb_isa isa) {
    if (!clb_isa_supported(isa)) return CLB_E_ARG;
    atomic_store(&clb_isa_cur, (int)isa);
    return CLB_OK;
}

clb_isa clb_isa_active(void) {
    clb_kernels_init();
    return (clb_isa)atomic_load(&clb_isa_cur);
}

clb_stream_hint clb_stream_hint_best(void) {
    clb_kernels_init();
    return clb_stream_top;
}

clb_status clb_stream_hint_force(clb_stream_hint h) {
    if ((int)h < 0 || h >= CLB_STREAM_COUNT) return CLB_E_ARG;
    clb_kernels_init();
    atomic_store(&clb_stream_cur, (int)h);
    return CLB_OK;
}

clb_stream_hint clb_stream_hint_active(void) {
    clb_kernels_init();
    return (clb_stream_hint)atomic_load_explicit(&clb_stream_cur, memory_order_relaxed);
}

const char *clb_stream_hint_name(clb_stream_hint h) {
    if ((int)h < 0 || h >= CLB_STREAM_COUNT) return "unknown";
    return clb_stream_names[h];
}

const char *clb_isa_name(clb_isa isa) {
    if ((int)isa < 0 || isa >= CLB_ISA_COUNT) return "unknown";
    return clb_isa_names[isa];
}

const clb_type_traits *clb_get_type_traits(clb_type t) {
    if ((int)t < 0 || t >= CLB_TYPE_COUNT) return NULL;
    return &clb_traits[clb_isa_active()][t];
}

const clb_type_traits *clb_get_type_traits_isa(clb_isa isa, clb_type t) {
    if ((int)t < 0 || t >= CLB_TYPE_COUNT || !clb_isa_supported(isa)) return NULL;
    return &clb_traits[isa][t];
}

void clb_repack_x8(clb_type t, int64_t n, int64_t n_rows, const void *src, void *dst) {
#ifdef CLB_HAVE_X86
    if (clb_isa_supported(CLB_ISA_AVX2)) {
        clb_repack_x8_avx2(t, n, n_rows, src, dst);
        return;
    }
#endif
    clb_repack_x8_ref(t, n, n_rows, src, dst);
}

/* Here rather than beside clb_repack_x8_ref: it goes through the dispatcher, and the reference
 * kernels depend on nothing above them. */
void clb_repack_x8_inplace(clb_type t, int64_t n, int64_t n_rows, void *w, void *scratch) {
    const size_t group = 8 * clb_type_row_size(t, n);
    for (int64_t g = 0; g < n_rows / 8; g++) {
        char *p = (char *)w + (size_t)g * group;
        memcpy(scratch, p, group);
        clb_repack_x8(t, n, 8, scratch, p);
    }
}

int clb_kernel_wants_x8(clb_type t) {
    const clb_type_traits *tr = clb_get_type_traits(t);
    return tr && tr->prefer_x8;
}

float clb_vec_dot_f32(int64_t n, const float *x, const float *y) {
    return clb_traits[clb_isa_active()][CLB_TYPE_F32].vec_dot(n, x, y);
}

void clb_vec_mad_f32(int64_t n, float *y, const float *x, float a) {
    clb_mad[clb_isa_active()](n, y, x, a);
}

void clb_silu_mul_f32(int64_t n, float *g, const float *u) {
    clb_silu_mul[clb_isa_active()](n, g, u);
}

const clb_att_kernels *clb_get_att_kernels(void) { return &clb_att[clb_isa_active()]; }
