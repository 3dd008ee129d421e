/* Gated DeltaNet linear attention (Qwen3-Next): the recurrent state update as a kernel of its
 * own (reference in delta_rule.c) and the layer block over it (linear_attn.c).
 * Guarantees: a sequence's state moves one token at a time in position order, so a prompt fed
 * in any number of calls or chunks gives the same bits as one pass, and a token's result never
 * depends on the other sequences of its call.
 * Refuses: nothing; clb_forward validated the batch and the state slots first. */
#ifndef CLB_LINEAR_H
#define CLB_LINEAR_H

#include "clb_forward.h"

/* One token's gated delta rule on one value head, state S [dk, dv] row-major (row i: key
 * dimension i), in place:
 *   S *= decay;  mem[j] = sum_i S[i, j] k[i];  delta[j] = (v[j] - mem[j]) * beta;
 *   S[i, j] += k[i] delta[j];  out[j] = sum_i S[i, j] q[i]
 * Sums run over i in order, each element with one multiply then one add (no fused
 * multiply-add), so every implementation gives the reference's bits. tmp: dv floats. */
typedef void (*clb_delta_step_fn)(int64_t dk, int64_t dv, float *S, const float *q,
                                  const float *k, const float *v, float decay, float beta,
                                  float *out, float *tmp);
void clb_delta_step_ref(int64_t dk, int64_t dv, float *S, const float *q, const float *k,
                        const float *v, float decay, float beta, float *out, float *tmp);
void clb_delta_step_avx2(int64_t dk, int64_t dv, float *S, const float *q, const float *k,
                         const float *v, float decay, float beta, float *out, float *tmp);
void clb_delta_step_avx512(int64_t dk, int64_t dv, float *S, const float *q, const float *k,
                           const float *v, float decay, float beta, float *out, float *tmp);
/* The active kernel ISA's version (clb_isa_active: every one equals the reference). */
clb_delta_step_fn clb_get_delta_step(void);

/* One channel-by-channel causal conv step: window [K-1, C] holds the channels' previous K-1
 * inputs, oldest row first; y[c] = silu(sum_j w[c, j] win[j, c] + w[c, K-1] x[c]) for the C
 * channels in [c0, c1), then the window moves on by x. */
void clb_conv_step_ref(int64_t C, int64_t K, int64_t c0, int64_t c1, const float *w,
                       float *win, const float *x, float *y);

/* x += linear_attention(norm(x)) for layer il, each sequence's conv window and DeltaNet
 * state read and advanced in its slot of kv (b->state_slots). */
clb_status clb_linear_attn(clb_model *m, clb_kv *kv, const clb_batch *b, int64_t il, int64_t T,
                           const int32_t *seq, const int32_t *pos);

/* Around clb_forward over layers [il0, il1), for the linear layers among them (no-ops when
 * there are none): check checks each sequence's state slot (named, in range, its own, each of
 * the span's linear layers holding exactly the positions before the sequence's first one in
 * the call, or that position is 0) and changes nothing; begin zeroes those layers' state of
 * sequences that start at position 0; end records the positions those layers hold (ok 0: the
 * call failed midway, the slots are unusable until their sequence restarts). */
clb_status clb_linear_check(const clb_model *m, clb_kv *kv, const clb_batch *b, int64_t il0,
                            int64_t il1, char *err);
void clb_linear_begin(const clb_model *m, clb_kv *kv, const clb_batch *b, int64_t il0,
                      int64_t il1);
void clb_linear_end(const clb_model *m, clb_kv *kv, const clb_batch *b, int64_t il0,
                    int64_t il1, int ok);

#endif
