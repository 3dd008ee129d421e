/* Colibri matrix products: y[T, n_out] = x[T, n_in] @ W[n_out, n_in]^T (+ bias).
 * Guarantees: activations are converted once per row into the layout the active ISA's kernel
 * reads (clb_act_pack), then shared by every matrix that reads the same rows; several
 * matrices run in one thread-pool dispatch (clb_matmul_jobs); each job's rows are split over
 * the workers (ith/nth), each worker reads its weight rows once for all the job's tokens;
 * every y[t, 0..n_out) is written exactly once, with a result that does not depend on the
 * number of threads. Refuses: bad shapes/pointers (CLB_E_ARG); never allocates. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "clb_kernels.h"

/* default weight bytes of one row block: small enough to stay in L2 while every token passes
 * (a type's traits may ask for other sizes, see gemm_block_bytes) */
#define CLB_MM_BLOCK_BYTES (96 * 1024)
/* rows are handed out in multiples of this (the SIMD kernels' row tile) */
#define CLB_MM_ROW_ALIGN 16

static int64_t clb_block_rows(const clb_type_traits *tr, size_t w_row) {
    size_t bytes = tr->gemm_block_bytes ? tr->gemm_block_bytes : CLB_MM_BLOCK_BYTES;
    int64_t r = (int64_t)(bytes / (w_row ? w_row : 1));
    r -= r % CLB_MM_ROW_ALIGN;
    return r < CLB_MM_ROW_ALIGN ? CLB_MM_ROW_ALIGN : r;
}

size_t clb_act_row_size(clb_type t, int64_t n_in) {
    const clb_type_traits *tr = clb_get_type_traits(t);
    if (!tr || !tr->gemm || n_in <= 0 || n_in % CLB_QK != 0) return 0;
    return tr->act_size(n_in);
}

size_t clb_act_row_size_max(clb_type t, int64_t n_in) {
    size_t best = 0;
    if (n_in <= 0 || n_in % CLB_QK != 0) return 0;
    for (int i = 0; i < CLB_ISA_COUNT; i++) {
        const clb_type_traits *tr = clb_get_type_traits_isa((clb_isa)i, t);
        size_t s = tr && tr->gemm ? tr->act_size(n_in) : 0;
        best = s > best ? s : best;
    }
    return best;
}

void clb_act_pack(clb_type t, int64_t n_in, const float *x, int64_t ldx, int64_t n_tok,
                  void *act) {
    const clb_type_traits *tr = clb_get_type_traits(t);
    size_t row = tr->act_size(n_in);
    for (int64_t i = 0; i < n_tok; i++)
        tr->act_pack(n_in, x + i * ldx, (char *)act + (size_t)i * row);
}

typedef struct {
    const clb_mm_job *jobs;
    int n_jobs;
} clb_mm_ctx;

static float clb_silu(float x) { return x / (1.0f + expf(-x)); }

/* rows [r0, r1) of one matrix w (the job's W or W_up) into y */
static void clb_mm_rows_of(const clb_mm_job *j, const clb_type_traits *tr, size_t w_row,
                           const char *w, float *y, int64_t r0, int64_t r1) {
    if (tr->gemm) {
        size_t act_row = tr->act_size(j->n_in);
        tr->gemm(j->n_in, r1 - r0, w + (size_t)r0 * w_row, w_row, j->act, act_row, j->n_tok,
                 y + r0, j->ldy);
        return;
    }
    for (int64_t t = 0; t < j->n_tok; t++) { /* float weights: f32 activations read in place */
        const float *a = (const float *)j->act + t * j->n_in;
        float *yt = y + t * j->ldy;
        for (int64_t r = r0; r < r1; r++) yt[r] = tr->vec_dot(j->n_in, w + (size_t)r * w_row, a);
    }
}

static void clb_mm_rows(const clb_mm_job *j, const clb_type_traits *tr, size_t w_row,
                        int64_t r0, int64_t r1) {
    clb_mm_rows_of(j, tr, w_row, j->w, j->y, r0, r1);
    if (j->w_up) {
        /* gate and up rows of a block are computed back to back by the same worker, so the
         * gated product needs no extra pass over memory and no barrier */
        clb_mm_rows_of(j, tr, w_row, j->w_up, j->y_up, r0, r1);
        for (int64_t t = 0; t < j->n_tok; t++) {
            float *g = j->y + t * j->ldy;
            const float *u = j->y_up + t * j->ldy;
            for (int64_t r = r0; r < r1; r++) g[r] = clb_silu(g[r]) * u[r];
        }
    }
    if (j->bias)
        for (int64_t t = 0; t < j->n_tok; t++) {
            float *yt = j->y + t * j->ldy;
            for (int64_t r = r0; r < r1; r++) yt[r] += j->bias[r];
        }
}

static void clb_mm_task(void *vctx, int ith, int nth) {
    const clb_mm_ctx *c = vctx;
    for (int k = 0; k < c->n_jobs; k++) {
        const clb_mm_job *j = &c->jobs[k];
        if (j->n_tok == 0) continue;
        const clb_type_traits *tr = clb_get_type_traits(j->type);
        size_t w_row = clb_type_row_size(j->type, j->n_in);
        /* contiguous row ranges in whole row tiles; each worker walks its range in blocks */
        int64_t n_units = (j->n_out + CLB_MM_ROW_ALIGN - 1) / CLB_MM_ROW_ALIGN;
        int64_t u0 = n_units * ith / nth, u1 = n_units * (ith + 1) / nth;
        int64_t r_end = u1 * CLB_MM_ROW_ALIGN < j->n_out ? u1 * CLB_MM_ROW_ALIGN : j->n_out;
        int64_t blk = clb_block_rows(tr, w_row);
        for (int64_t r = u0 * CLB_MM_ROW_ALIGN; r < r_end; r += blk)
            clb_mm_rows(j, tr, w_row, r, r + blk < r_end ? r + blk : r_end);
    }
}

static clb_status clb_job_check(const clb_mm_job *j) {
    const clb_type_traits *tr = clb_get_type_traits(j->type);
    if (!tr || (tr->vec_dot == NULL && tr->gemm == NULL)) return CLB_E_ARG;
    if (j->n_out <= 0 || j->n_in <= 0 || j->n_tok < 0 || j->ldy < j->n_out) return CLB_E_ARG;
    if (clb_x8_base(j->type) != j->type && j->n_out % 8 != 0) return CLB_E_ARG; /* whole groups */
    size_t w_row = clb_type_row_size(j->type, j->n_in);
    /* the SIMD kernels address a row group of CLB_MM_ROW_ALIGN rows with 32-bit offsets */
    if (w_row == 0 || w_row > (size_t)INT32_MAX / CLB_MM_ROW_ALIGN || !j->w) return CLB_E_ARG;
    if (j->n_tok > 0 && (!j->act || !j->y)) return CLB_E_ARG;
    if (j->w_up && (j->bias || (j->n_tok > 0 && !j->y_up))) return CLB_E_ARG;
    return CLB_OK;
}

clb_status clb_matmul_jobs(const clb_mm_job *jobs, int n_jobs, clb_threadpool *tp) {
    if (n_jobs < 0 || (n_jobs > 0 && !jobs)) return CLB_E_ARG;
    int64_t work = 0;
    for (int k = 0; k < n_jobs; k++) {
        clb_status st = clb_job_check(&jobs[k]);
        if (st != CLB_OK) return st;
        work += jobs[k].n_tok;
    }
    if (work == 0) return CLB_OK;
    clb_mm_ctx c = {jobs, n_jobs};
    /* a matmul issued from inside a pool task (work already split over the workers) gets
     * CLB_E_ARG from the pool and runs on the calling worker alone */
    if (tp && clb_threadpool_n_threads(tp) > 1 &&
        clb_threadpool_run(tp, clb_mm_task, &c) == CLB_OK)
        return CLB_OK;
    clb_mm_task(&c, 0, 1);
    return CLB_OK;
}

size_t clb_matmul_scratch_size(clb_type t, int64_t n_in, int64_t n_tokens) {
    const clb_type_traits *tr = clb_get_type_traits(t);
    if (!tr || (tr->vec_dot == NULL && tr->gemm == NULL) || n_tokens < 0) return 0;
    return clb_act_row_size_max(t, n_in) * (size_t)n_tokens; /* 0: f32 read in place */
}

clb_status clb_matmul(clb_type t, const void *w, int64_t n_out, int64_t n_in,
                      const float *x, int64_t n_tokens, float *y, int64_t ldy,
                      const float *bias, void *scratch, clb_threadpool *tp) {
    clb_mm_job j = {.type = t, .w = w, .n_out = n_out, .n_in = n_in, .act = x,
                    .n_tok = n_tokens, .y = y, .ldy = ldy, .bias = bias};
    clb_status st = clb_job_check(&j);
    if (st != CLB_OK || n_tokens == 0) return st;
    if (clb_get_type_traits(t)->gemm) {
        if (!scratch) return CLB_E_ARG;
        clb_act_pack(t, n_in, x, n_in, n_tokens, scratch);
        j.act = scratch;
    }
    return clb_matmul_jobs(&j, 1, tp);
}

void clb_get_row(clb_type t, const void *w, int64_t n, int64_t row, float *y) {
    size_t rs = clb_type_row_size(t, n);
    clb_dequantize_row(t, n, (const char *)w + (size_t)row * rs, y);
}
