/* Colibri matrix products: y[T, n_out] = x[T, n_in] @ W[n_out, n_in]^T (+ bias).
 * Guarantees: activations are converted to the weight type's activation type once, into the
 * caller's scratch; output rows are split over the pool's workers (ith/nth), each worker reads
 * its weight rows once for all T tokens; every y[t, 0..n_out) is written exactly once.
 * Refuses: bad shapes/pointers (CLB_E_ARG); never allocates. */
#include <string.h>

#include "clb_kernels.h"

/* rows per inner block: their weights stay in L1/L2 while every token passes over them */
#define CLB_MM_ROW_BLOCK 16

typedef struct {
    const clb_type_traits *tr;
    const char *w;          /* [n_out] rows of w_row bytes */
    size_t w_row;
    int64_t n_out, n_in, n_tokens;
    const char *act;        /* [n_tokens] rows of act_row bytes (act type) */
    size_t act_row;
    float *y;               /* [n_tokens, ldy] */
    int64_t ldy;
    const float *bias;      /* [n_out] or NULL */
} clb_mm_ctx;

static void clb_mm_task(void *vctx, int ith, int nth) {
    const clb_mm_ctx *c = vctx;
    /* contiguous row ranges, rounded to whole row blocks so workers never share a block */
    int64_t n_blocks = (c->n_out + CLB_MM_ROW_BLOCK - 1) / CLB_MM_ROW_BLOCK;
    int64_t b0 = n_blocks * ith / nth, b1 = n_blocks * (ith + 1) / nth;
    clb_vec_dot_fn dot = c->tr->vec_dot;
    for (int64_t b = b0; b < b1; b++) {
        int64_t r0 = b * CLB_MM_ROW_BLOCK;
        int64_t r1 = r0 + CLB_MM_ROW_BLOCK < c->n_out ? r0 + CLB_MM_ROW_BLOCK : c->n_out;
        for (int64_t t = 0; t < c->n_tokens; t++) {
            const void *a = c->act + (size_t)t * c->act_row;
            float *yt = c->y + t * c->ldy;
            for (int64_t r = r0; r < r1; r++) {
                float v = dot(c->n_in, c->w + (size_t)r * c->w_row, a);
                yt[r] = c->bias ? v + c->bias[r] : v;
            }
        }
    }
}

size_t clb_matmul_scratch_size(clb_type t, int64_t n_in, int64_t n_tokens) {
    const clb_type_traits *tr = clb_get_type_traits(t);
    if (!tr || tr->vec_dot == NULL || n_tokens < 0) return 0;
    if (tr->act_type == CLB_TYPE_F32) return 0; /* f32 activations are read in place */
    return clb_type_row_size(tr->act_type, n_in) * (size_t)n_tokens;
}

clb_status clb_matmul(clb_type t, const void *w, int64_t n_out, int64_t n_in,
                      const float *x, int64_t n_tokens, float *y, int64_t ldy,
                      const float *bias, void *scratch, clb_threadpool *tp) {
    const clb_type_traits *tr = clb_get_type_traits(t);
    if (!tr || tr->vec_dot == NULL) return CLB_E_ARG;
    if (n_out <= 0 || n_in <= 0 || n_tokens < 0 || ldy < n_out) return CLB_E_ARG;
    size_t w_row = clb_type_row_size(t, n_in);
    if (w_row == 0 || !w || (n_tokens > 0 && (!x || !y))) return CLB_E_ARG;
    if (n_tokens == 0) return CLB_OK;

    clb_mm_ctx c = {.tr = tr, .w = w, .w_row = w_row, .n_out = n_out, .n_in = n_in,
                    .n_tokens = n_tokens, .y = y, .ldy = ldy, .bias = bias};
    if (tr->act_type == CLB_TYPE_F32) {
        c.act = (const char *)x;
        c.act_row = (size_t)n_in * sizeof(float);
    } else {
        if (!scratch) return CLB_E_ARG;
        const clb_type_traits *at = clb_get_type_traits(tr->act_type);
        c.act_row = clb_type_row_size(tr->act_type, n_in);
        if (c.act_row == 0) return CLB_E_ARG;
        for (int64_t i = 0; i < n_tokens; i++)
            at->from_float(n_in, x + i * n_in, (char *)scratch + (size_t)i * c.act_row);
        c.act = scratch;
    }
    /* a matmul issued from inside a pool task (work already split over the workers) gets
     * CLB_E_ARG from the pool and runs on the calling worker alone */
    if (tp && clb_threadpool_n_threads(tp) > 1 &&
        clb_threadpool_run(tp, clb_mm_task, &c) == CLB_OK)
        return CLB_OK;
    clb_mm_task(&c, 0, 1);
    return CLB_OK;
}

void clb_get_row(clb_type t, const void *w, int64_t n, int64_t row, float *y) {
    size_t rs = clb_type_row_size(t, n);
    clb_dequantize_row(t, n, (const char *)w + (size_t)row * rs, y);
}
