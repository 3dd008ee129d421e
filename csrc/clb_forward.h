/* The forward pass's shared block library (internal to csrc/): the helpers every block uses
 * (norms, counted weight products, RoPE; in forward_ops.c) and the blocks a family's layer
 * plan chooses from: attention (GQA in attention.c, MLA in mla.c) and, in forward.c, dense FFN
 * and routed experts. A block reads and writes the model's scratch (clb_model_internal.h)
 * and never allocates.
 * Refuses: nothing; clb_forward validated the batch before any block runs. */
#ifndef CLB_FORWARD_H
#define CLB_FORWARD_H

#include "clb_kernels.h"
#include "clb_model_internal.h"

#define TRY(expr)                         \
    do {                                  \
        clb_status st_ = (expr);          \
        if (st_ != CLB_OK) return st_;    \
    } while (0)

static inline const float *clb_f32_data(const clb_tensor *t) {
    return t ? (const float *)t->data : NULL;
}

/* y = x * rsqrt(mean(x^2) + eps) * w over n elements (w NULL: no weight); y may alias x. */
void clb_rmsnorm(const float *x, const float *w, int64_t n, float eps, float *y);

/* y[T, ldy] = x[T, n_in] @ w^T (+ bias) on the model's pool (tp: another pool or NULL for the
 * calling thread), counted in phase ph of the model's product statistics. */
clb_status clb_fw_mm_tp(clb_model *m, clb_phase ph, const clb_tensor *w, const float *x,
                        int64_t T, float *y, int64_t ldy, const clb_tensor *bias,
                        clb_threadpool *tp);
clb_status clb_fw_mm(clb_model *m, clb_phase ph, const clb_tensor *w, const float *x,
                     int64_t T, float *y, int64_t ldy, const clb_tensor *bias);
/* clb_fw_mm with the bias as an array [n_out] (NULL: none). */
clb_status clb_fw_mm_b(clb_model *m, clb_phase ph, const clb_tensor *w, const float *x,
                       int64_t T, float *y, int64_t ldy, const float *bias);
/* Runs m->jobs[0..n_jobs) in one dispatch, counted in phase ph. */
clb_status clb_fw_run_jobs(clb_model *m, clb_phase ph, int n_jobs);
/* A job for weight w reading activations act (packed for w's type, or f32 rows). */
clb_mm_job clb_fw_job(const clb_tensor *w, const void *act, int64_t T, float *y, int64_t ldy,
                      const clb_tensor *bias);
/* Activations of T rows of x (row stride ldx) for weights of w's type: packed into buf, or x
 * itself for float weights (which then needs ldx == n_in). */
const void *clb_fw_act_for(const clb_tensor *w, const float *x, int64_t ldx, int64_t T,
                           void *buf);
/* HF "rotate half" on the first rd dims of one head: pairs (x[i], x[i + rd/2]); cs holds the
 * rd/2 cosines, then the sines. */
void clb_rope_half(float *x, const float *cs, int64_t rd);

/* Where one attention call reads its queries and writes its outputs: head h of token t reads
 * q[t * q_stride + h * q_head ..] (the cache's key width) and writes out[t * out_stride +
 * h * out_head ..] (its value width); scores are multiplied by scale. */
typedef struct {
    const float *q;
    int64_t q_stride, q_head;
    float *out;
    int64_t out_stride, out_head;
    float scale;
} clb_att_io;

/* Causal attention of T tokens over their sequences' cached rows of layer il (already stored
 * for this chunk's positions). */
clb_status clb_attend(clb_model *m, const clb_kv *kv, const clb_batch *b, int64_t il, int64_t T,
                      const int32_t *seq, const int32_t *pos, const clb_att_io *io);

/* The attention blocks: x += attention(norm(x)) for layer il, the chunk's K/V (or latent)
 * rows stored into the cache on the way. */
clb_status clb_attention_gqa(clb_model *m, clb_kv *kv, const clb_batch *b, int64_t il, int64_t T,
                             const int32_t *seq, const int32_t *pos);
clb_status clb_attention_mla(clb_model *m, clb_kv *kv, const clb_batch *b, int64_t il, int64_t T,
                             const int32_t *seq, const int32_t *pos);

#endif
