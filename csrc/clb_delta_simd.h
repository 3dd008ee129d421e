/* The body of the gated DeltaNet state update's vector paths (clb_linear.h), written once for
 * delta_rule_avx2.c and delta_rule_avx512.c. The including file defines CLB_DELTA_FN (the
 * function's name), CLB_DELTA_W (floats per vector), CLB_DELTA_V (the vector type) and the
 * operations CLB_DELTA_SET1, _LOAD, _STORE, _MUL, _ADD, _SUB and _ZERO for that width.
 * Each element gets the reference's multiply, then its add, in the same order (no fused
 * multiply-add), so results equal clb_delta_step_ref bit for bit; the last dv % W columns run
 * the reference's scalar loop.
 * Refuses: nothing (the caller sized every array). */

void CLB_DELTA_FN(int64_t dk, int64_t dv, float *S, const float *q, const float *k,
                  const float *v, float decay, float beta, float *out, float *tmp) {
    const int64_t dvw = dv - dv % CLB_DELTA_W;
    const CLB_DELTA_V vdecay = CLB_DELTA_SET1(decay), vbeta = CLB_DELTA_SET1(beta);
    for (int64_t j = 0; j < dv; j++) tmp[j] = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        float *row = S + i * dv;
        const float ki = k[i];
        const CLB_DELTA_V vk = CLB_DELTA_SET1(ki);
        int64_t j = 0;
        for (; j < dvw; j += CLB_DELTA_W) {
            const CLB_DELTA_V r = CLB_DELTA_MUL(CLB_DELTA_LOAD(row + j), vdecay);
            CLB_DELTA_STORE(row + j, r);
            CLB_DELTA_STORE(tmp + j, CLB_DELTA_ADD(CLB_DELTA_LOAD(tmp + j), CLB_DELTA_MUL(r, vk)));
        }
        for (; j < dv; j++) {
            row[j] = row[j] * decay;
            tmp[j] = tmp[j] + row[j] * ki;
        }
    }
    int64_t j = 0;
    for (; j < dvw; j += CLB_DELTA_W) {
        const CLB_DELTA_V d = CLB_DELTA_SUB(CLB_DELTA_LOAD(v + j), CLB_DELTA_LOAD(tmp + j));
        CLB_DELTA_STORE(tmp + j, CLB_DELTA_MUL(d, vbeta));
        CLB_DELTA_STORE(out + j, CLB_DELTA_ZERO());
    }
    for (; j < dv; j++) {
        tmp[j] = (v[j] - tmp[j]) * beta;
        out[j] = 0.0f;
    }
    for (int64_t i = 0; i < dk; i++) {
        float *row = S + i * dv;
        const float ki = k[i], qi = q[i];
        const CLB_DELTA_V vk = CLB_DELTA_SET1(ki), vq = CLB_DELTA_SET1(qi);
        int64_t c = 0;
        for (; c < dvw; c += CLB_DELTA_W) {
            const CLB_DELTA_V r =
                CLB_DELTA_ADD(CLB_DELTA_LOAD(row + c), CLB_DELTA_MUL(vk, CLB_DELTA_LOAD(tmp + c)));
            CLB_DELTA_STORE(row + c, r);
            CLB_DELTA_STORE(out + c, CLB_DELTA_ADD(CLB_DELTA_LOAD(out + c), CLB_DELTA_MUL(r, vq)));
        }
        for (; c < dv; c++) {
            row[c] = row[c] + ki * tmp[c];
            out[c] = out[c] + row[c] * qi;
        }
    }
}
