/* Colibri kernels: type traits, run-time ISA dispatch, quantizers and matrix products.
 * Guarantees: clb_kernels_init() picks the best ISA once from CPUID; every SIMD kernel has a
 * *_ref twin that tests compare it against; hot-path functions never allocate.
 * Refuses: no file or model knowledge here. */
#ifndef CLB_KERNELS_H
#define CLB_KERNELS_H

#include "clb_types.h"
#include "clb_threadpool.h"

/* avxvnni: AVX2 with AVX-VNNI's 256-bit int8 dot products (CPUs without AVX-512) */
typedef enum {
    CLB_ISA_REF = 0,
    CLB_ISA_AVX2 = 1,
    CLB_ISA_AVXVNNI = 2,
    CLB_ISA_AVX512 = 3,
    CLB_ISA_COUNT
} clb_isa;

void clb_kernels_init(void);               /* idempotent, thread-safe */
clb_isa clb_isa_best(void);                /* best ISA this CPU (and build) supports */
int clb_isa_supported(clb_isa isa);
clb_status clb_isa_force(clb_isa isa);      /* test hook; CLB_E_ARG if unsupported */
clb_isa clb_isa_active(void);
const char *clb_isa_name(clb_isa isa);

/* How the AVX-512 interleaved products prefetch the weights they stream: into L2 (T1), or as
 * non-temporal data (NTA: read once, so the CPU may keep it out of the outer caches). Picked
 * once from CPUID: NTA on AMD family 26 (Zen 5) and later, where it streamed faster, L2
 * elsewhere. Results never depend on it. */
typedef enum { CLB_STREAM_L2 = 0, CLB_STREAM_NTA = 1, CLB_STREAM_COUNT } clb_stream_hint;
clb_stream_hint clb_stream_hint_best(void);
clb_status clb_stream_hint_force(clb_stream_hint h); /* bench and test hook */
clb_stream_hint clb_stream_hint_active(void);
const char *clb_stream_hint_name(clb_stream_hint h);

/* traits of the active ISA */
const clb_type_traits *clb_get_type_traits(clb_type t);
/* traits of a given ISA (NULL if this CPU or build does not support it) */
const clb_type_traits *clb_get_type_traits_isa(clb_isa isa, clb_type t);

/* reference quantizers (bit-exact with engine/format/quant.py); n multiple of 32 */
void clb_quantize_q8_ref(int64_t n, const float *x, clb_block_q8 *y);
void clb_quantize_q4_ref(int64_t n, const float *x, clb_block_q4 *y);
void clb_quantize_q6_ref(int64_t n, const float *x, clb_block_q6 *y);
void clb_quantize_q8a_ref(int64_t n, const float *x, clb_block_q8a *y);
void clb_dequantize_row(clb_type t, int64_t n, const void *x, float *y);

/* The 8-row interleaved layouts (clb_types.h). clb_x8_type: the interleaved type of q8/q4/q6 (t
 * itself for any other type); clb_x8_base: back. clb_kernel_wants_x8: whether the active
 * ISA's products run faster on the interleaved layout than on rows (repack at load then).
 * clb_repack_x8 writes n_rows (a multiple of 8) rows of n columns of type t (q8, q4 or q6) from
 * src into dst (distinct buffers, same size); _inplace does it in w itself, one group at a
 * time through scratch (8 rows' bytes). */
clb_type clb_x8_type(clb_type t);
clb_type clb_x8_base(clb_type t);
int clb_kernel_wants_x8(clb_type t);
void clb_repack_x8(clb_type t, int64_t n, int64_t n_rows, const void *src, void *dst);
void clb_repack_x8_inplace(clb_type t, int64_t n, int64_t n_rows, void *w, void *scratch);

/* Scratch bytes clb_matmul needs for n_tokens rows of length n_in with weights of type t. */
size_t clb_matmul_scratch_size(clb_type t, int64_t n_in, int64_t n_tokens);

/* y[n_tokens, n_out] = x[n_tokens, n_in] @ W[n_out, n_in]^T (+ bias[n_out] if not NULL).
 * x rows are f32 with stride n_in; y rows have stride ldy (>= n_out).
 * x is converted to the weight type's activation type once into scratch (size from
 * clb_matmul_scratch_size), then output rows are split across the pool's workers.
 * tp may be NULL (single-threaded). */
clb_status clb_matmul(clb_type t, const void *w, int64_t n_out, int64_t n_in,
                      const float *x, int64_t n_tokens, float *y, int64_t ldy,
                      const float *bias, void *scratch, clb_threadpool *tp);

/* Packed activations: the layout the active ISA's kernel for weights of type t reads, one row
 * of clb_act_row_size(t, n_in) bytes per token (0: t is a float type, whose products read
 * f32 rows in place). clb_act_row_size_max is the largest over every ISA this CPU supports
 * (for sizing scratch before a test forces another ISA). clb_act_pack packs n_tok rows of x
 * (row stride ldx floats); pack and product must run under the same active ISA. */
size_t clb_act_row_size(clb_type t, int64_t n_in);
size_t clb_act_row_size_max(clb_type t, int64_t n_in);
void clb_act_pack(clb_type t, int64_t n_in, const float *x, int64_t ldx, int64_t n_tok,
                  void *act);

/* The clamped SwiGLU of gpt-oss: g = min(g, limit), u = clamp(u, -limit, limit),
 * g[i] = g * sigmoid(alpha * g) * (u + 1), the sigmoid's exponent clb_exp1's; one scalar
 * definition that every ISA calls, so results never depend on the ISA. */
typedef struct {
    float alpha, limit;
} clb_glu_clamp;
void clb_glu_clamp_f32(int64_t n, float *g, const float *u, const clb_glu_clamp *c);

/* One matrix of a batched product: y[n_tok, ldy] (first n_out columns) = act @ W^T (+ bias).
 * act: n_tok packed rows (clb_act_pack) for quantized types, f32 rows of n_in otherwise. */
typedef struct {
    clb_type type;
    const void *w;       /* [n_out, n_in] of type */
    int64_t n_out, n_in;
    const void *act;     /* [n_tok] packed or f32 rows */
    int64_t n_tok;
    float *y;            /* [n_tok, ldy] */
    int64_t ldy;
    const float *bias;   /* [n_out] or NULL */
    /* gated (SwiGLU) job when w_up is set: y = glu(act @ W^T + bias, act @ W_up^T + bias_up),
     * W_up of the same type and shape as W; y_up [n_tok, ldy] is scratch for the second
     * product; glu is silu(g) * u, or the clamped form when clamp is set */
    const void *w_up;
    float *y_up;
    const float *bias_up;           /* [n_out] or NULL; only with w_up */
    const clb_glu_clamp *clamp;     /* NULL: silu(g) * u */
} clb_mm_job;

/* Runs every job in one thread-pool dispatch (jobs must not write each other's inputs). */
clb_status clb_matmul_jobs(const clb_mm_job *jobs, int n_jobs, clb_threadpool *tp);

/* f32 vector helpers of the active ISA: x . y; y += a * x; and the gated product's
 * g[i] = silu(g[i]) * u[i] = g[i] / (1 + exp(-g[i])) * u[i], its exponent clb_exp1's
 * (clb_kernels_isa.h), so every ISA gives the same bits */
typedef void (*clb_vec_mad_fn)(int64_t n, float *y, const float *x, float a);
typedef void (*clb_silu_mul_fn)(int64_t n, float *g, const float *u);
float clb_vec_dot_f32(int64_t n, const float *x, const float *y);
void clb_vec_mad_f32(int64_t n, float *y, const float *x, float a);
void clb_silu_mul_f32(int64_t n, float *g, const float *u);

/* Attention's inner loops over the rows of one KV block, for the active ISA:
 * dots: s[r] = (q . k_r) * scale for n >= 1 rows k_r = k + r * ldk (hd floats each),
 *   returning the largest s[r] (a NaN score is never the largest). Each row's sum is computed
 *   the same way whatever n and its place among the rows, so a query's scores do not depend
 *   on how its keys are split into calls.
 * mad_rows: out[d] += w[r] * v_r[d] for r = 0..n-1 in order, rows v_r = v + r * ldv: the same
 *   result as n successive clb_vec_mad_f32 calls.
 * exp_sum: s[j] = exp(s[j] - top) for j < n, returning their sum (softmax's numerator and
 *   denominator). Every ISA computes each exponent with the same operations (clb_exp1 in
 *   clb_kernels_isa.h) and sums them in the same order (16 running sums, lane j % 16, then a
 *   fixed tree), so the result depends on n and the values alone, bit for bit. */
typedef float (*clb_att_dots_fn)(int64_t hd, const float *q, const float *k, int64_t ldk,
                                 int64_t n, float scale, float *s);
typedef void (*clb_att_mad_rows_fn)(int64_t hd, float *out, const float *v, int64_t ldv,
                                    int64_t n, const float *w);
typedef float (*clb_att_exp_sum_fn)(int64_t n, float *s, float top);
typedef struct {
    clb_att_dots_fn dots;
    clb_att_mad_rows_fn mad_rows;
    clb_att_exp_sum_fn exp_sum;
} clb_att_kernels;
const clb_att_kernels *clb_get_att_kernels(void);

/* Copy row `row` of a [n_rows, n] weight matrix into y as f32 (embedding lookup). */
void clb_get_row(clb_type t, const void *w, int64_t n, int64_t row, float *y);

#endif
