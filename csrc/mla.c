/* Multi-head latent attention (DeepSeek-V2/V3, Kimi K2), in the absorbed form: per position
 * the cache holds one latent row c = norm(W_kv_a x)[:kl] and the roped key part k_pe; head h
 * scores q_h against it as (W_uk_h^T q_nope_h) . c + q_pe_h . k_pe, takes the softmax-weighted
 * sum of the c rows, and only then maps it up with W_uv_h. A long context costs what the latent
 * costs (kl + rotary_dim values per layer), never full keys and values.
 * Guarantees: the same arithmetic for prompt and decode tokens, so cached decode equals the
 * full forward; a token's result does not depend on the other tokens of the call.
 * Refuses: nothing; clb_model_load checked the shapes and clb_forward the batch. */
#include <math.h>
#include <string.h>

#include "clb_forward.h"

/* Shape legend: T tokens, S <= CLB_MLA_SUB of them at a time, D n_embd, H heads, hd = dn + dr
 * per query head (dn plain, dr = rotary_dim roped), ql q_lora_rank, kl kv_lora_rank, kd = kl +
 * dr the cached row, dv v_head_dim. */

/* Activation rows for a per-head product: T rows of n_in floats, row stride ldx, in w's packed
 * type, or copied into contiguous f32 rows for float weights. */
static const void *head_rows(const clb_tensor *w, int64_t n_in, const float *x, int64_t ldx,
                             int64_t T, void *buf) {
    if (clb_act_row_size(w->type, n_in) > 0) {
        clb_act_pack(w->type, n_in, x, ldx, T, buf);
        return buf;
    }
    float *y = buf;
    for (int64_t t = 0; t < T; t++) memcpy(y + t * n_in, x + t * ldx, (size_t)n_in * sizeof(float));
    return buf;
}

/* One job per head: y_h[S, ldy] = x_h @ W_h^T, W_h rows [h * n_out, (h + 1) * n_out) of w,
 * x_h n_in floats at x + h * x_head (row stride ldx), y_h at y + h * y_head. */
static clb_status per_head(clb_model *m, const clb_tensor *w, int64_t n_out, int64_t n_in,
                           const float *x, int64_t ldx, int64_t x_head, int64_t S, float *y,
                           int64_t ldy, int64_t y_head) {
    const int64_t H = m->hp.n_head;
    const size_t w_head = clb_type_row_size(w->type, n_in) * (size_t)n_out;
    for (int64_t h = 0; h < H; h++) {
        void *buf = (char *)m->head_act + (size_t)(h * S) * m->head_act_row;
        const void *a = head_rows(w, n_in, x + h * x_head, ldx, S, buf);
        m->jobs[h] = (clb_mm_job){.type = w->type, .w = (const char *)w->data + h * w_head,
                                  .n_out = n_out, .n_in = n_in, .act = a, .n_tok = S,
                                  .y = y + h * y_head, .ldy = ldy};
    }
    return clb_fw_run_jobs(m, CLB_PHASE_ATTN_PROJ, (int)H);
}

clb_status clb_attention_mla(clb_model *m, clb_kv *kv, const clb_batch *b, int64_t il, int64_t T,
                             const int32_t *seq, const int32_t *pos) {
    const clb_hparams *hp = &m->hp;
    const clb_layer_w *l = &m->layers[il];
    const int64_t D = hp->n_embd, H = hp->n_head, hd = hp->head_dim, dr = hp->rotary_dim;
    const int64_t dn = hd - dr, kl = hp->kv_lora_rank, kd = kl + dr, dv = hp->v_head_dim;
    const int64_t ql = hp->q_lora_rank, qd = H * hd;

    for (int64_t t = 0; t < T; t++)
        clb_rmsnorm(m->x + t * D, clb_f32_data(l->attn_norm), D, hp->rms_eps, m->xn + t * D);
    /* the query (through its low-rank step) and the latent rows both read xn */
    const clb_tensor *first = ql > 0 ? l->wq_a : l->wq;
    if (first->type == l->wkv_a->type) {
        const void *a = clb_fw_act_for(first, m->xn, D, T, m->act);
        m->jobs[0] = clb_fw_job(first, a, T, ql > 0 ? m->qlat : m->q, ql > 0 ? ql : qd, NULL);
        m->jobs[1] = clb_fw_job(l->wkv_a, a, T, m->kva, kd, NULL); /* [T, kd] */
        TRY(clb_fw_run_jobs(m, CLB_PHASE_ATTN_PROJ, 2));
    } else {
        TRY(clb_fw_mm(m, CLB_PHASE_ATTN_PROJ, first, m->xn, T, ql > 0 ? m->qlat : m->q,
                      ql > 0 ? ql : qd, NULL));
        TRY(clb_fw_mm(m, CLB_PHASE_ATTN_PROJ, l->wkv_a, m->xn, T, m->kva, kd, NULL));
    }
    if (ql > 0) { /* [T, ql] -> [T, H*hd] */
        for (int64_t t = 0; t < T; t++)
            clb_rmsnorm(m->qlat + t * ql, clb_f32_data(l->q_a_norm), ql, hp->rms_eps,
                        m->qlat + t * ql);
        TRY(clb_fw_mm(m, CLB_PHASE_ATTN_PROJ, l->wq_b, m->qlat, T, m->q, qd, NULL));
    }

    /* latent rows: normed c, roped k_pe, stored before any query of the chunk reads them */
    for (int64_t t = 0; t < T; t++) {
        float *c = m->kva + t * kd;
        const float *cs = m->rope + t * dr;
        clb_rmsnorm(c, clb_f32_data(l->kv_a_norm), kl, hp->rms_eps, c);
        clb_rope_half(c + kl, cs, dr);
        for (int64_t h = 0; h < H; h++) clb_rope_half(m->q + t * qd + h * hd + dn, cs, dr);
        int64_t blk = b->block_tables[(int64_t)seq[t] * b->max_blocks + pos[t] / CLB_KV_BLOCK];
        clb_kv_store(kv, blk, il, 0, pos[t] % CLB_KV_BLOCK, c);
    }

    const float scale = hp->attn_scale > 0.0f ? hp->attn_scale : 1.0f / sqrtf((float)hd);
    for (int64_t t0 = 0; t0 < T; t0 += CLB_MLA_SUB) {
        const int64_t S = T - t0 < CLB_MLA_SUB ? T - t0 : CLB_MLA_SUB;
        const float *q = m->q + t0 * qd;
        /* absorb: qabs_h = [W_uk_h^T q_nope_h, q_pe_h]   [S, H*kd] */
        TRY(per_head(m, l->wk_b, kl, dn, q, qd, hd, S, m->qabs, H * kd, kd));
        for (int64_t t = 0; t < S; t++)
            for (int64_t h = 0; h < H; h++)
                memcpy(m->qabs + (t * H + h) * kd + kl, q + t * qd + h * hd + dn,
                       (size_t)dr * sizeof(float));
        const clb_att_io io = {m->qabs, H * kd, kd, m->ctx, H * kl, kl, scale};
        TRY(clb_attend(m, kv, b, il, S, seq + t0, pos + t0, &io)); /* [S, H*kl] */
        /* up: att_h = W_uv_h ctx_h   [S, H*dv] */
        TRY(per_head(m, l->wv_b, dv, kl, m->ctx, H * kl, kl, S, m->att + t0 * H * dv, H * dv, dv));
    }
    TRY(clb_fw_mm(m, CLB_PHASE_ATTN_PROJ, l->wo, m->att, T, m->proj, D, l->bo)); /* [T, D] */
    for (int64_t i = 0; i < T * D; i++) m->x[i] += m->proj[i];
    return CLB_OK;
}
