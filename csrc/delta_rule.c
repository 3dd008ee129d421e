/* The reference kernels of the gated DeltaNet layer (clb_linear.h): one token's state update
 * on one value head, and one token's causal depthwise conv; and the choice of the state
 * update's version for the active ISA. Plain C, the specification every faster version
 * (delta_rule_avx2.c, delta_rule_avx512.c) equals bit for bit; tests/test_linear_attn.py
 * checks them against numpy and against each other.
 * Refuses: nothing (the caller sized every array). */
#include <math.h>
#include <string.h>

#include "clb_linear.h"

void clb_delta_step_ref(int64_t dk, int64_t dv, float *S, const float *q, const float *k,
                        const float *v, float decay, float beta, float *out, float *tmp) {
    for (int64_t j = 0; j < dv; j++) tmp[j] = 0.0f;
    for (int64_t i = 0; i < dk; i++) { /* decay, and what the state predicts for k */
        float *row = S + i * dv;
        const float ki = k[i];
        for (int64_t j = 0; j < dv; j++) {
            row[j] = row[j] * decay;
            tmp[j] = tmp[j] + row[j] * ki;
        }
    }
    for (int64_t j = 0; j < dv; j++) {
        tmp[j] = (v[j] - tmp[j]) * beta; /* the correction the delta rule writes */
        out[j] = 0.0f;
    }
    for (int64_t i = 0; i < dk; i++) {
        float *row = S + i * dv;
        const float ki = k[i], qi = q[i];
        for (int64_t j = 0; j < dv; j++) {
            row[j] = row[j] + ki * tmp[j];
            out[j] = out[j] + row[j] * qi;
        }
    }
}

clb_delta_step_fn clb_get_delta_step(void) {
#ifdef CLB_HAVE_X86
    switch (clb_isa_active()) {
    case CLB_ISA_AVX512: return clb_delta_step_avx512;
    case CLB_ISA_AVX2:
    case CLB_ISA_AVXVNNI: return clb_delta_step_avx2;
    default: break;
    }
#endif
    return clb_delta_step_ref;
}

void clb_conv_step_ref(int64_t C, int64_t K, int64_t c0, int64_t c1, const float *w,
                       float *win, const float *x, float *y) {
    for (int64_t c = c0; c < c1; c++) {
        const float *wc = w + c * K;
        float s = 0.0f;
        for (int64_t j = 0; j < K - 1; j++) s = s + wc[j] * win[j * C + c];
        s = s + wc[K - 1] * x[c];
        y[c] = s / (1.0f + expf(-s));
        for (int64_t j = 0; j + 1 < K - 1; j++) win[j * C + c] = win[(j + 1) * C + c];
        win[(K - 2) * C + c] = x[c];
    }
}
