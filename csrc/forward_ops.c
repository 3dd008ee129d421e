/* Colibri forward pass helpers: what every block (attention in attention.c and mla.c, FFN and
 * experts in forward.c) uses: RMSNorm, RoPE, and the weight products that count themselves in
 * the model's product statistics.
 * Guarantees: no allocation; products run on the pool they are given.
 * Refuses: nothing; the blocks' callers validated the batch. Kept apart from forward.c so the
 * blocks depend on these helpers and forward.c on the blocks, never back. */
#include <math.h>

#include "clb_forward.h"
#include "clb_util.h"

/* y = x * rsqrt(mean(x^2) + eps) * w over n elements (w NULL: no weight); y may alias x. The
 * sum is kept in double so the result does not depend on n's size. */
void clb_rmsnorm(const float *x, const float *w, int64_t n, float eps, float *y) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * (double)x[i];
    float scale = 1.0f / sqrtf((float)(ss / (double)n) + eps);
    if (!w) {
        for (int64_t i = 0; i < n; i++) y[i] = x[i] * scale;
        return;
    }
    for (int64_t i = 0; i < n; i++) y[i] = w[i] * (x[i] * scale);
}

/* Every weight product of the forward pass goes through these two, which count it in m->prod
 * (clb_model_product_stats). */
static void count_product(clb_model *m, clb_phase ph, int64_t t0, int64_t weight_bytes) {
    m->prod.phase[ph].n_calls++;
    m->prod.phase[ph].ns += clb_now_ns() - t0;
    m->prod.phase[ph].weight_bytes += weight_bytes;
}

static int64_t weight_bytes(clb_type t, int64_t n_out, int64_t n_in) {
    return (int64_t)clb_type_row_size(t, n_in) * n_out;
}

static clb_status mm_counted(clb_model *m, clb_phase ph, const clb_tensor *w, const float *x,
                             int64_t T, float *y, int64_t ldy, const float *bias,
                             clb_threadpool *tp) {
    const int64_t t0 = clb_now_ns();
    clb_status st = clb_matmul(w->type, w->data, w->shape[0], w->shape[1], x, T, y, ldy,
                               bias, m->mm_scratch, tp);
    count_product(m, ph, t0, T > 0 ? weight_bytes(w->type, w->shape[0], w->shape[1]) : 0);
    return st;
}

clb_status clb_fw_mm_tp(clb_model *m, clb_phase ph, const clb_tensor *w, const float *x,
                        int64_t T, float *y, int64_t ldy, const clb_tensor *bias,
                        clb_threadpool *tp) {
    return mm_counted(m, ph, w, x, T, y, ldy, clb_f32_data(bias), tp);
}

clb_status clb_fw_mm_b(clb_model *m, clb_phase ph, const clb_tensor *w, const float *x,
                       int64_t T, float *y, int64_t ldy, const float *bias) {
    return mm_counted(m, ph, w, x, T, y, ldy, bias, m->tp);
}

clb_status clb_fw_mm(clb_model *m, clb_phase ph, const clb_tensor *w, const float *x,
                     int64_t T, float *y, int64_t ldy, const clb_tensor *bias) {
    return clb_fw_mm_tp(m, ph, w, x, T, y, ldy, bias, m->tp);
}

clb_status clb_fw_run_jobs(clb_model *m, clb_phase ph, int n_jobs) {
    const int64_t t0 = clb_now_ns();
    clb_status st = clb_matmul_jobs(m->jobs, n_jobs, m->tp);
    int64_t bytes = 0;
    for (int k = 0; k < n_jobs; k++) {
        const clb_mm_job *j = &m->jobs[k];
        if (j->n_tok > 0) bytes += weight_bytes(j->type, j->n_out, j->n_in) * (j->w_up ? 2 : 1);
    }
    count_product(m, ph, t0, bytes);
    return st;
}

/* A job for weight w reading activations act (packed for w's type, or f32 rows). */
clb_mm_job clb_fw_job(const clb_tensor *w, const void *act, int64_t T, float *y, int64_t ldy,
                      const clb_tensor *bias) {
    return (clb_mm_job){.type = w->type, .w = w->data, .n_out = w->shape[0],
                        .n_in = w->shape[1], .act = act, .n_tok = T, .y = y, .ldy = ldy,
                        .bias = clb_f32_data(bias)};
}

/* Activations of T rows of x (row stride ldx) for weights of w's type: packed into buf, or x
 * itself for float weights (which then needs ldx == n_in). */
const void *clb_fw_act_for(const clb_tensor *w, const float *x, int64_t ldx, int64_t T,
                           void *buf) {
    if (clb_act_row_size(w->type, w->shape[1]) == 0) return x;
    clb_act_pack(w->type, w->shape[1], x, ldx, T, buf);
    return buf;
}

/* HF "rotate half" on the first rd dims of one head: pairs (x[i], x[i + rd/2]). */
void clb_rope_half(float *x, const float *cs, int64_t rd) {
    int64_t half = rd / 2;
    const float *c = cs, *s = cs + half;
    for (int64_t i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * c[i] - b * s[i];
        x[i + half] = b * c[i] + a * s[i];
    }
}
