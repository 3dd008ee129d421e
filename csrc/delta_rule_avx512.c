/* The gated DeltaNet state update (clb_linear.h) with 16-float AVX512 vectors over the value
 * dimension: each element gets the reference's multiply, then its add, in the same order
 * (no fused multiply-add), so results equal clb_delta_step_ref bit for bit; the last dv % 16
 * columns run the reference's scalar loop.
 * Refuses: nothing (the caller sized every array). */
#include <immintrin.h>

#include "clb_linear.h"

void clb_delta_step_avx512(int64_t dk, int64_t dv, float *S, const float *q, const float *k,
                         const float *v, float decay, float beta, float *out, float *tmp) {
    const int64_t dv16 = dv - dv % 16;
    const __m512 vdecay = _mm512_set1_ps(decay), vbeta = _mm512_set1_ps(beta);
    for (int64_t j = 0; j < dv; j++) tmp[j] = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        float *row = S + i * dv;
        const float ki = k[i];
        const __m512 vk = _mm512_set1_ps(ki);
        int64_t j = 0;
        for (; j < dv16; j += 16) {
            const __m512 r = _mm512_mul_ps(_mm512_loadu_ps(row + j), vdecay);
            _mm512_storeu_ps(row + j, r);
            _mm512_storeu_ps(tmp + j, _mm512_add_ps(_mm512_loadu_ps(tmp + j), _mm512_mul_ps(r, vk)));
        }
        for (; j < dv; j++) {
            row[j] = row[j] * decay;
            tmp[j] = tmp[j] + row[j] * ki;
        }
    }
    int64_t j = 0;
    for (; j < dv16; j += 16) {
        const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(v + j), _mm512_loadu_ps(tmp + j));
        _mm512_storeu_ps(tmp + j, _mm512_mul_ps(d, vbeta));
        _mm512_storeu_ps(out + j, _mm512_setzero_ps());
    }
    for (; j < dv; j++) {
        tmp[j] = (v[j] - tmp[j]) * beta;
        out[j] = 0.0f;
    }
    for (int64_t i = 0; i < dk; i++) {
        float *row = S + i * dv;
        const float ki = k[i], qi = q[i];
        const __m512 vk = _mm512_set1_ps(ki), vq = _mm512_set1_ps(qi);
        int64_t c = 0;
        for (; c < dv16; c += 16) {
            const __m512 r = _mm512_add_ps(_mm512_loadu_ps(row + c), _mm512_mul_ps(vk, _mm512_loadu_ps(tmp + c)));
            _mm512_storeu_ps(row + c, r);
            _mm512_storeu_ps(out + c, _mm512_add_ps(_mm512_loadu_ps(out + c), _mm512_mul_ps(r, vq)));
        }
        for (; c < dv; c++) {
            row[c] = row[c] + ki * tmp[c];
            out[c] = out[c] + row[c] * qi;
        }
    }
}
