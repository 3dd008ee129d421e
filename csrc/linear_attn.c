/* The gated DeltaNet linear-attention block (Qwen3-Next) and the bookkeeping of its per
 * sequence state slots. Per token: q, k, v, z from one projection and b, a from another; a
 * causal depthwise conv with SiLU over q, k, v (window of lin_conv inputs kept per sequence);
 * q and k L2-normalised per head (q scaled by 1/sqrt(dk)); beta = sigmoid(b), decay =
 * exp(-exp(A_log) * softplus(a + dt_bias)); the delta rule on each value head's state
 * [dk, dv] (value head h reads query/key head h / (nv / nk)); an RMSNorm of the head's output
 * times silu(z); the output projection.
 * Guarantees: the conv runs channel by channel and the recurrence head by head, each over the
 * chunk's tokens in order, so no result depends on the split over workers, the chunking of a
 * prompt or the other sequences of a call.
 * Refuses: nothing here; clb_linear_check refuses bad state slots before any work. */
#include <math.h>
#include <string.h>

#include "clb_linear.h"
#include "clb_util.h"

/* Shape legend: T tokens, D n_embd, nk/nv key/value heads, dk/dv their widths, r = nv / nk,
 * C = 2*nk*dk + nv*dv conv channels (q, k, v), K conv width. */

/* Layer li's part of state slot `slot`: the conv window [K-1, C], then S [nv, dk, dv]. */
static float *slot_state(const clb_kv *kv, int64_t slot, int64_t li, int64_t per_layer) {
    return kv->state + (size_t)slot * kv->slot_floats + (size_t)(li * per_layer);
}

typedef struct {
    clb_model *m;
    const clb_kv *kv;
    const clb_batch *b;
    const clb_layer_w *l;
    int64_t T;
    const int32_t *seq;
} lin_task;

static int64_t per_layer_floats(const clb_hparams *hp) {
    return clb_lin_conv_floats(hp) + clb_lin_state_floats(hp);
}

/* Conv over a share of the channels, token after token. */
static void conv_worker(void *vctx, int ith, int nth) {
    const lin_task *a = vctx;
    const clb_hparams *hp = &a->m->hp;
    const int64_t vd = hp->lin_n_v_heads * hp->lin_v_dim;
    const int64_t C = 2 * hp->lin_n_k_heads * hp->lin_k_dim + vd, K = hp->lin_conv;
    const int64_t c0 = C * ith / nth, c1 = C * (ith + 1) / nth, pl = per_layer_floats(hp);
    const float *w = clb_f32_data(a->l->lin_conv);
    for (int64_t t = 0; t < a->T; t++) {
        const int64_t slot = a->b->state_slots[a->seq[t]];
        float *win = slot_state(a->kv, slot, a->l->lin_index, pl);
        clb_conv_step_ref(C, K, c0, c1, w, win, a->m->lin_p + t * (C + vd),
                          a->m->lin_c + t * C);
    }
}

static void l2norm(int64_t n, const float *x, float scale, float *y) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss = ss + x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss + 1e-6f);
    for (int64_t i = 0; i < n; i++) y[i] = (x[i] * inv) * scale;
}

/* The recurrence of a share of the value heads, token after token, with the gated norm. */
static void head_worker(void *vctx, int ith, int nth) {
    const lin_task *a = vctx;
    clb_model *m = a->m;
    const clb_hparams *hp = &m->hp;
    const clb_layer_w *l = a->l;
    const int64_t nk = hp->lin_n_k_heads, nv = hp->lin_n_v_heads, dk = hp->lin_k_dim;
    const int64_t dv = hp->lin_v_dim, vd = nv * dv, C = 2 * nk * dk + vd, r = nv / nk;
    const int64_t h0 = nv * ith / nth, h1 = nv * (ith + 1) / nth, pl = per_layer_floats(hp);
    const int64_t conv_f = clb_lin_conv_floats(hp);
    float *qn = m->lin_tmp + (int64_t)ith * (2 * dk + dv), *kn = qn + dk, *tmp = kn + dk;
    const float *dt_bias = clb_f32_data(l->lin_dt_bias), *a_log = clb_f32_data(l->lin_a_log);
    const float *nw = clb_f32_data(l->lin_norm);
    const float qscale = 1.0f / sqrtf((float)dk);
    const clb_delta_step_fn step = clb_get_delta_step();
    for (int64_t h = h0; h < h1; h++) {
        const int64_t kh = h / r;
        const float A = -expf(a_log[h]);
        for (int64_t t = 0; t < a->T; t++) {
            const float *c = m->lin_c + t * C, *ba = m->lin_ba + t * 2 * nv;
            const float *z = m->lin_p + t * (C + vd) + C + h * dv;
            float *out = m->lin_o + t * vd + h * dv;
            l2norm(dk, c + kh * dk, qscale, qn);
            l2norm(dk, c + nk * dk + kh * dk, 1.0f, kn);
            const float beta = 1.0f / (1.0f + expf(-ba[h]));
            float sp = ba[nv + h] + dt_bias[h];
            sp = sp > 20.0f ? sp : log1pf(expf(sp)); /* softplus, torch's threshold */
            const float decay = expf(A * sp);
            const int64_t slot = a->b->state_slots[a->seq[t]];
            float *S = slot_state(a->kv, slot, l->lin_index, pl) + conv_f + h * dk * dv;
            step(dk, dv, S, qn, kn, c + 2 * nk * dk + h * dv, decay, beta, out, tmp);
            /* gated RMSNorm: w * norm(out) * silu(z) */
            float ss = 0.0f;
            for (int64_t j = 0; j < dv; j++) ss = ss + out[j] * out[j];
            const float inv = 1.0f / sqrtf(ss / (float)dv + hp->rms_eps);
            for (int64_t j = 0; j < dv; j++)
                out[j] = (nw[j] * (out[j] * inv)) * (z[j] / (1.0f + expf(-z[j])));
        }
    }
}

clb_status clb_linear_attn(clb_model *m, clb_kv *kv, const clb_batch *b, int64_t il, int64_t T,
                           const int32_t *seq, const int32_t *pos) {
    (void)pos;
    const clb_hparams *hp = &m->hp;
    const clb_layer_w *l = &m->layers[il];
    const int64_t D = hp->n_embd, nv = hp->lin_n_v_heads, vd = nv * hp->lin_v_dim;
    const int64_t C = 2 * hp->lin_n_k_heads * hp->lin_k_dim + vd;

    for (int64_t t = 0; t < T; t++)
        clb_rmsnorm(m->x + t * D, clb_f32_data(l->attn_norm), D, hp->rms_eps, m->xn + t * D);
    /* the input projections into lin_p [T, C+vd] (q, k, v, z) and lin_ba [T, 2nv] (b, a): two
     * matrices or four; xn packed once and all in one dispatch when their types agree */
    const clb_tensor *w[4] = {l->lin_qkvz, l->lin_ba, NULL, NULL};
    float *y[4] = {m->lin_p, m->lin_ba, NULL, NULL};
    const int64_t ldy[4] = {C + vd, 2 * nv, C + vd, 2 * nv};
    int nw = 2;
    if (!l->lin_qkvz) {
        w[0] = l->lin_qkv, w[1] = l->lin_b, w[2] = l->lin_z, w[3] = l->lin_a;
        y[1] = m->lin_ba, y[2] = m->lin_p + C, y[3] = m->lin_ba + nv;
        nw = 4;
    }
    int same = 1;
    for (int i = 1; i < nw; i++) same &= w[i]->type == w[0]->type;
    if (same) {
        const void *act = clb_fw_act_for(w[0], m->xn, D, T, m->act);
        for (int i = 0; i < nw; i++) m->jobs[i] = clb_fw_job(w[i], act, T, y[i], ldy[i], NULL);
        TRY(clb_fw_run_jobs(m, CLB_PHASE_ATTN_PROJ, nw));
    } else {
        for (int i = 0; i < nw; i++)
            TRY(clb_fw_mm(m, CLB_PHASE_ATTN_PROJ, w[i], m->xn, T, y[i], ldy[i], NULL));
    }
    lin_task task = {m, kv, b, l, T, seq};
    const int64_t t0 = clb_now_ns();
    TRY(clb_threadpool_run(m->tp, conv_worker, &task));
    TRY(clb_threadpool_run(m->tp, head_worker, &task));
    m->prod.attention_ns += clb_now_ns() - t0;
    TRY(clb_fw_mm(m, CLB_PHASE_ATTN_PROJ, l->lin_out, m->lin_o, T, m->proj, D, NULL)); /* [T, D] */
    for (int64_t i = 0; i < T * D; i++) m->x[i] += m->proj[i];
    return CLB_OK;
}

/* ---- state slots around a forward call ---------------------------------------------------- */

/* The linear layers of layers [il0, il1) are those with lin_index in [*lo, *hi). */
static void lin_range(const clb_model *m, int64_t il0, int64_t il1, int64_t *lo, int64_t *hi) {
    *lo = *hi = 0;
    for (int64_t il = 0; il < il1; il++)
        if (m->layers[il].mixer == CLB_MIX_LINEAR) {
            *lo += il < il0;
            *hi += 1;
        }
}

clb_status clb_linear_check(const clb_model *m, clb_kv *kv, const clb_batch *b, int64_t il0,
                            int64_t il1, char *err) {
    int64_t lo, hi;
    lin_range(m, il0, il1, &lo, &hi);
    if (lo == hi) return CLB_OK;
    if (!kv->state || !b->state_slots) {
        clb_set_err(err, "this model has linear-attention layers: the call needs state slots "
                    "(%s)", kv->state ? "none given" : "the cache has none");
        return CLB_E_ARG;
    }
    clb_status st = CLB_OK;
    int64_t i = 0;
    for (; i < b->n_tokens; i++) {
        const int32_t s = b->seq_ids[i], slot = b->state_slots[s];
        const int64_t p = b->positions[i];
        if (slot < 0 || slot >= kv->n_slots) {
            clb_set_err(err, "sequence %d: state slot %d is not in 0..%lld", s, slot,
                        (long long)(kv->n_slots - 1));
            st = CLB_E_ARG;
            break;
        }
        if (kv->slot_user[slot] == s) continue;
        if (kv->slot_user[slot] >= 0) {
            clb_set_err(err, "state slot %d is used by sequences %d and %d in one call", slot,
                        kv->slot_user[slot], s);
            st = CLB_E_ARG;
            break;
        }
        for (int64_t li = lo; li < hi && p != 0; li++) { /* the sequence's first token */
            const int64_t have = kv->state_len[slot * kv->n_lin + li];
            if (p == have) continue;
            clb_set_err(err,
                        "sequence %d starts at position %lld but its state slot %d holds %lld "
                        "positions: a linear-attention state cannot be rewound (start again at "
                        "position 0)", s, (long long)p, slot, (long long)have);
            st = CLB_E_ARG;
            break;
        }
        if (st != CLB_OK) break;
        kv->slot_user[slot] = s;
    }
    for (int64_t t = 0; t < i; t++) kv->slot_user[b->state_slots[b->seq_ids[t]]] = -1;
    return st;
}

void clb_linear_begin(const clb_model *m, clb_kv *kv, const clb_batch *b, int64_t il0,
                      int64_t il1) {
    int64_t lo, hi;
    lin_range(m, il0, il1, &lo, &hi);
    if (lo == hi) return;
    const int64_t pl = per_layer_floats(&m->hp);
    for (int64_t i = 0; i < b->n_tokens; i++)
        if (b->positions[i] == 0) {
            const int32_t slot = b->state_slots[b->seq_ids[i]];
            memset(slot_state(kv, slot, lo, pl), 0, (size_t)((hi - lo) * pl) * sizeof(float));
        }
}

void clb_linear_end(const clb_model *m, clb_kv *kv, const clb_batch *b, int64_t il0,
                    int64_t il1, int ok) {
    int64_t lo, hi;
    lin_range(m, il0, il1, &lo, &hi);
    for (int64_t i = 0; i < b->n_tokens && lo < hi; i++) {
        int64_t *len = kv->state_len + (size_t)b->state_slots[b->seq_ids[i]] * kv->n_lin;
        for (int64_t li = lo; li < hi; li++) len[li] = ok ? b->positions[i] + 1 : -1;
    }
}
