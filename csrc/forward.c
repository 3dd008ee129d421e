/* Colibri forward pass: one call runs a whole step (all layers) for a batch of tokens from any
 * number of sequences, following the transformers math summarised in docs/INTERNALS.md.
 * Guarantees: inputs are validated before anything is computed; heavy math goes through
 * clb_matmul_jobs on the model's thread pool, with matrices that read the same input in one
 * dispatch; each expert's weights are read once per chunk for all the tokens routed to it; no
 * allocation (all scratch was sized at load).
 * Refuses: token ids, sequence ids and positions outside the model, and block tables that name
 * blocks outside the cache or let two sequences write one block. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "clb_forward.h"
#include "clb_linear.h"
#include "clb_xcache.h"
#include "clb_util.h"

/* Shape legend: T tokens in the chunk, D n_embd, H/Hkv heads, hd head_dim, E experts, K used,
 * F expert ff, Fs shared ff, V vocab, qd = H*hd, kvd = Hkv*hd. */

/* ---- MoE ------------------------------------------------------------------------------- */

/* The K best experts by score (ties: lower expert id first), skipping experts whose group
 * is not kept (keep NULL: all kept; group g holds experts [g*per, (g+1)*per)). */
static void top_k(const float *score, int64_t E, int64_t K, const uint8_t *keep, int64_t per,
                  int32_t *ids) {
    for (int64_t k = 0; k < K; k++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            if (keep && !keep[e / per]) continue;
            int taken = 0;
            for (int64_t j = 0; j < k; j++) taken |= ids[j] == e;
            if (!taken && (best < 0 || score[e] > score[best])) best = e;
        }
        ids[k] = (int32_t)best;
    }
}

/* The topk_group best of G groups by their scores gs (ties: lower index), as keep flags. */
static void keep_groups(const float *gs, int64_t G, int64_t topk_group, uint8_t *keep) {
    for (int64_t g = 0; g < G; g++) keep[g] = 0;
    for (int64_t k = 0; k < topk_group; k++) {
        int64_t best = -1;
        for (int64_t g = 0; g < G; g++)
            if (!keep[g] && (best < 0 || gs[g] > gs[best])) best = g;
        keep[best] = 1;
    }
}

/* Softmax router: softmax over E logits, then the K largest probabilities (with n_group > 1
 * only within the topk_group groups holding the largest single probability, DeepSeek-V2's
 * group-limited greedy), optionally renormalised to sum to one, times routed_scale. */
static void route_softmax(const clb_hparams *hp, float *p, int32_t *ids, float *w) {
    const int64_t E = hp->n_expert, K = hp->n_expert_used, G = hp->n_group;
    float mx = p[0];
    for (int64_t e = 1; e < E; e++) mx = p[e] > mx ? p[e] : mx;
    float sum = 0.0f;
    for (int64_t e = 0; e < E; e++) {
        p[e] = expf(p[e] - mx);
        sum += p[e];
    }
    for (int64_t e = 0; e < E; e++) p[e] /= sum;
    uint8_t keep[CLB_MAX_GROUPS];
    const uint8_t *kp = NULL;
    if (G > 1) {
        float gs[CLB_MAX_GROUPS];
        for (int64_t g = 0; g < G; g++) {
            gs[g] = p[g * (E / G)];
            for (int64_t e = g * (E / G) + 1; e < (g + 1) * (E / G); e++)
                gs[g] = p[e] > gs[g] ? p[e] : gs[g];
        }
        keep_groups(gs, G, hp->topk_group, keep);
        kp = keep;
    }
    top_k(p, E, K, kp, G > 1 ? E / G : E, ids);
    for (int64_t k = 0; k < K; k++) w[k] = p[ids[k]];
    if (hp->norm_topk_prob) {
        float ws = 0.0f;
        for (int64_t k = 0; k < K; k++) ws += w[k];
        for (int64_t k = 0; k < K; k++) w[k] /= ws;
    }
    if (hp->routed_scale != 1.0f)
        for (int64_t k = 0; k < K; k++) w[k] *= hp->routed_scale;
}

/* Grouped sigmoid router (DeepSeek-V3, GLM-4.5): scores s = sigmoid(logits); experts are chosen
 * on c = s + bias (into the scratch c [E]), only within the topk_group groups whose two best c
 * sum highest; the weights are the chosen experts' s, renormalised (+1e-20, as transformers)
 * when norm_topk_prob, times routed_scale. p holds the logits and receives s. */
static void route_sigmoid_grouped(const clb_hparams *hp, float *p, const float *bias, float *c,
                                  int32_t *ids, float *w) {
    const int64_t E = hp->n_expert, K = hp->n_expert_used, G = hp->n_group;
    const int64_t per = E / G;
    for (int64_t e = 0; e < E; e++) {
        p[e] = 1.0f / (1.0f + expf(-p[e]));
        c[e] = p[e] + bias[e];
    }
    uint8_t keep[CLB_MAX_GROUPS];
    const uint8_t *kp = NULL;
    if (G > 1) {
        float gs[CLB_MAX_GROUPS];
        for (int64_t g = 0; g < G; g++) { /* sum of the group's two best c */
            float a = -INFINITY, b = -INFINITY;
            for (int64_t e = g * per; e < (g + 1) * per; e++) {
                if (c[e] > a) {
                    b = a;
                    a = c[e];
                } else if (c[e] > b) {
                    b = c[e];
                }
            }
            gs[g] = a + b;
        }
        keep_groups(gs, G, hp->topk_group, keep);
        kp = keep;
    }
    top_k(c, E, K, kp, per, ids);
    float ws = 0.0f;
    for (int64_t k = 0; k < K; k++) {
        w[k] = p[ids[k]];
        ws += w[k];
    }
    for (int64_t k = 0; k < K; k++) {
        if (hp->norm_topk_prob) w[k] /= ws + 1e-20f;
        w[k] *= hp->routed_scale;
    }
}

/* Llama 4's router: the K largest logits (ties: lower expert id first), each weighted by its
 * sigmoid (Llama4Router: sigmoid of the top-k logits, the other experts' scores 0). */
static void route_sigmoid_topk(const clb_hparams *hp, const float *p, int32_t *ids, float *w) {
    top_k(p, hp->n_expert, hp->n_expert_used, NULL, hp->n_expert, ids);
    for (int64_t k = 0; k < hp->n_expert_used; k++) w[k] = 1.0f / (1.0f + expf(-p[ids[k]]));
}

/* One token's routing from its router logits p [E] (overwritten): ids and weights [K]. */
static void route_token(clb_model *m, const clb_layer_w *l, float *p, int32_t *ids, float *w) {
    if (m->hp.router == CLB_ROUTER_SIGMOID_GROUPED)
        route_sigmoid_grouped(&m->hp, p, clb_f32_data(l->gate_bias), m->choice, ids, w);
    else if (m->hp.router == CLB_ROUTER_SIGMOID_TOPK)
        route_sigmoid_topk(&m->hp, p, ids, w);
    else
        route_softmax(&m->hp, p, ids, w);
}

/* FFNs of n_g groups of consecutive rows, all in two dispatches (gate/up, then down):
 * rows [off[g], off[g+1]) go through w[g]: out[r, D] = w2 @ (silu(w1 @ x_r) * (w3 @ x_r)),
 * x_r = src[idx[r]] (idx NULL: src[r]). At most CLB_MAX_BATCH rows; every w[g] has the same
 * tensor types (one group of the file layout). */
static clb_status ffn_groups(clb_model *m, clb_phase up, clb_phase down, int64_t n_g,
                             const clb_ffn_w *const *w, const int64_t *off, const uint8_t *skip,
                             const float *src, const int32_t *idx, float *out) {
    const int64_t D = m->hp.n_embd, F = w[0]->w1->shape[0];
    const clb_tensor *w1 = w[0]->w1, *w2 = w[0]->w2;
    if (w[0]->w3->type != w1->type) { /* gate and up of different types: one at a time */
        for (int64_t g = 0; g < n_g; g++) {
            int64_t r0 = off[g] - off[0], c = off[g + 1] - off[g];
            /* an expert no row chose may not even be resident; a skipped one is not yet */
            if (c == 0 || (skip && skip[g])) continue;
            for (int64_t r = 0; r < c; r++)
                memcpy(m->xg + r * D, src + (idx ? idx[off[g] + r] : off[g] + r) * D,
                       (size_t)D * sizeof(float));
            TRY(clb_fw_mm_b(m, up, w[g]->w1, m->xg, c, m->h1, F, w[g]->b1));
            TRY(clb_fw_mm_b(m, up, w[g]->w3, m->xg, c, m->h3, F, w[g]->b3));
            if (m->hp.glu == CLB_GLU_SWIGLU_CLAMP)
                clb_glu_clamp_f32(c * F, m->h1, m->h3, &m->glu_clamp);
            else
                clb_silu_mul_f32(c * F, m->h1, m->h3);
            TRY(clb_fw_mm_b(m, down, w[g]->w2, m->h1, c, out + r0 * D, D, w[g]->b2));
        }
        return CLB_OK;
    }
    /* gather (and pack) the rows in group order, each at its group's place (packing is per
     * row, so the groups that run give the same bytes whichever others run with them) */
    size_t arow = clb_act_row_size(w1->type, D);
    const void *a = arow ? m->act : (const void *)m->xg;
    for (int64_t g = 0; g < n_g; g++) {
        if (skip && skip[g]) continue;
        for (int64_t r = off[g] - off[0]; r < off[g + 1] - off[0]; r++) {
            const float *x = src + (idx ? idx[off[0] + r] : off[0] + r) * D;
            if (arow)
                clb_act_pack(w1->type, D, x, D, 1, (char *)m->act + (size_t)r * arow);
            else
                memcpy(m->xg + r * D, x, (size_t)D * sizeof(float));
        }
    }
    int64_t nj = 0;
    for (int64_t g = 0; g < n_g; g++) {
        int64_t r0 = off[g] - off[0], c = off[g + 1] - off[g];
        if (c == 0 || (skip && skip[g])) continue;
        size_t a_off = arow ? (size_t)r0 * arow : (size_t)(r0 * D) * sizeof(float);
        clb_mm_job j = clb_fw_job(w[g]->w1, (const char *)a + a_off, c, m->h1 + r0 * F, F, NULL);
        j.w_up = w[g]->w3->data;
        j.y_up = m->h3 + r0 * F;
        j.bias = w[g]->b1;
        j.bias_up = w[g]->b3;
        j.clamp = m->hp.glu == CLB_GLU_SWIGLU_CLAMP ? &m->glu_clamp : NULL;
        m->jobs[nj++] = j; /* [c, F] silu(gate) * up */
    }
    TRY(clb_fw_run_jobs(m, up, (int)nj));
    size_t hrow = clb_act_row_size(w2->type, F);
    const void *h = hrow ? m->act : (const void *)m->h1;
    for (int64_t g = 0; hrow && g < n_g; g++) {
        int64_t r0 = off[g] - off[0], c = off[g + 1] - off[g];
        if (c == 0 || (skip && skip[g])) continue;
        clb_act_pack(w2->type, F, m->h1 + r0 * F, F, c, (char *)m->act + (size_t)r0 * hrow);
    }
    nj = 0;
    for (int64_t g = 0; g < n_g; g++) {
        int64_t r0 = off[g] - off[0], c = off[g + 1] - off[g];
        if (c == 0 || (skip && skip[g])) continue;
        size_t h_off = hrow ? (size_t)r0 * hrow : (size_t)(r0 * F) * sizeof(float);
        const void *hg = (const char *)h + h_off;
        m->jobs[nj] = clb_fw_job(w[g]->w2, hg, c, out + r0 * D, D, NULL); /* [c, D] */
        m->jobs[nj++].bias = w[g]->b2;
    }
    return clb_fw_run_jobs(m, down, (int)nj);
}

/* Pre-gating: layer target's router (il + 1, or il + 2 when far) applied to layer il's normed
 * input predicts the experts target will route to; the cache's readers read those ahead while
 * il computes. Uses probs as scratch (its routing is already in top_id). */
static clb_status prefetch_ahead(clb_model *m, int64_t il, int64_t target, int64_t T) {
    const clb_hparams *hp = &m->hp;
    const clb_layer_w *nl = &m->layers[target];
    const int64_t E = hp->n_expert, K = hp->n_expert_used;
    TRY(clb_fw_mm_tp(m, CLB_PHASE_ROUTER, nl->gate_inp, m->xn, T, m->probs, E,
                     nl->gate_inp_bias, NULL));
    /* votes per expert in e_fill (free until the grouping below) */
    int64_t *votes = m->e_fill;
    for (int64_t e = 0; e < E; e++) votes[e] = 0;
    int32_t *ids = m->pf_ids, *tok_ids = m->pf_ids + E;
    float *w = m->route_w;
    for (int64_t t = 0; t < T; t++) {
        route_token(m, nl, m->probs + t * E, tok_ids, w);
        for (int64_t k = 0; k < K; k++) votes[tok_ids[k]]++;
    }
    int64_t n = 0;
    for (int64_t e = 0; e < E; e++)
        if (votes[e] > 0) ids[n++] = (int32_t)e;
    for (int64_t a = 1; a < n; a++) { /* most votes first (insertion sort, n <= E) */
        int32_t v = ids[a];
        int64_t b = a;
        for (; b > 0 && votes[ids[b - 1]] < votes[v]; b--) ids[b] = ids[b - 1];
        ids[b] = v;
    }
    clb_xc_prefetch(m->xc, target, ids, n, target > il + 1);
    return CLB_OK;
}

/* The routed experts of layer il over the chunk's T tokens, from their routing in m->top_id /
 * m->top_w and their normed inputs in m->xn: out [T, D] = for each token the sum of its chosen
 * experts' outputs times their weights, added in expert order. mine [E] (NULL: every expert)
 * says which experts run here; the others' rows are left out (another backend adds them). */
static clb_status routed_experts(clb_model *m, int64_t il, int64_t T, const uint8_t *mine,
                                 float *out) {
    const clb_hparams *hp = &m->hp;
    const clb_layer_w *l = &m->layers[il];
    const int64_t D = hp->n_embd, E = hp->n_expert, K = hp->n_expert_used;
    clb_xcache *xc = m->xc;

    /* group: counting sort by expert, tokens ascending within a group; the (token, rank)
     * pairs of experts another backend runs (mine[e] == 0) are left out */
    for (int64_t e = 0; e <= E; e++) m->e_start[e] = 0;
    for (int64_t i = 0; i < T * K; i++)
        if (!mine || mine[m->top_id[i]]) m->e_start[m->top_id[i] + 1]++;
    for (int64_t e = 0; e < E; e++) {
        m->e_start[e + 1] += m->e_start[e];
        m->e_fill[e] = m->e_start[e];
    }
    for (int64_t i = 0; i < T * K; i++) {
        if (mine && !mine[m->top_id[i]]) continue;
        int64_t slot = m->e_fill[m->top_id[i]]++;
        m->route_tok[slot] = (int32_t)(i / K);
        m->route_w[slot] = m->top_w[i];
    }
    const int64_t n_rows = m->e_start[E];

    /* route_input: each (token, expert) row is the token's input times its weight, laid out
     * in group order (Llama4TextMoe scales the hidden state before the experts) */
    const float *src = m->xn;
    const int32_t *idx = m->route_tok;
    if (hp->route_input) {
        for (int64_t r = 0; r < n_rows; r++) {
            const float *x = m->xn + (int64_t)m->route_tok[r] * D;
            float *y = m->xs + r * D, w = m->route_w[r];
            for (int64_t d = 0; d < D; d++) y[d] = x[d] * w;
        }
        src = m->xs;
        idx = NULL;
    }

    /* run each chosen expert once over its gathered rows, as many experts per dispatch as
     * fit in one batch of rows (and, with the expert cache, in the layer's slots); combine in
     * expert order, as HF does, so waves change no bit of the result */
    if (xc) clb_xc_begin_layer(xc, il, m->e_start, T);
    memset(out, 0, (size_t)(T * D) * sizeof(float));
    const clb_ffn_w **ws = m->ffn_list;
    uint8_t *wait = m->xc_wait, *skip = m->xc_wait + E;
    for (int64_t e = 0; e < E;) {
        int64_t e0 = e, s0 = m->e_start[e], n_wait = 0, n_run = 0;
        /* an expert holds at most T <= CLB_MAX_BATCH rows, so each batch takes at least one;
         * the cache never refuses the first expert of a wave */
        while (e < E && m->e_start[e + 1] - s0 <= CLB_MAX_BATCH) {
            wait[e - e0] = 0;
            if (xc && m->e_start[e + 1] > m->e_start[e]) {
                clb_status st = CLB_OK;
                int r = clb_xc_take(xc, il, e, &st);
                if (r < 0) {
                    clb_xc_release(xc, il);
                    return st;
                }
                if (r == 0) break;
                wait[e - e0] = r == 2;
                n_wait += r == 2;
                n_run++;
            }
            ws[e - e0] = &l->experts[e];
            e++;
        }
        int64_t s1 = m->e_start[e];
        if (s1 == s0) continue;
        /* the wave's resident experts run while its others are read; then each of those as
         * soon as it lands, with any others landed by then. Each group's rows are its own and
         * the combine below stays in expert order, so the bits are those of running the wave
         * at once */
        clb_status fst = CLB_OK;
        int64_t n_ran = 0;
        if (n_wait == 0 || n_wait < n_run) {
            fst = ffn_groups(m, CLB_PHASE_EXPERT_UP, CLB_PHASE_EXPERT_DOWN, e - e0, ws,
                             m->e_start + e0, n_wait > 0 ? wait : NULL, src, idx, m->eo);
            n_ran = n_run - n_wait;
        }
        while (fst == CLB_OK && n_wait > 0) {
            clb_status st = CLB_OK;
            int64_t got = clb_xc_wait_any(xc, il, e0, e - e0, n_ran, wait, skip, &st);
            if (got < 0) {
                clb_xc_release(xc, il);
                return st;
            }
            n_wait -= got;
            n_ran = got;
            fst = ffn_groups(m, CLB_PHASE_EXPERT_UP, CLB_PHASE_EXPERT_DOWN, e - e0, ws,
                             m->e_start + e0, skip, src, idx, m->eo);
        }
        if (xc) clb_xc_release(xc, il);
        TRY(fst);
        for (int64_t r = s0; r < s1; r++) {
            float *dst = out + (int64_t)m->route_tok[r] * D;
            const float *eo = m->eo + (r - s0) * D;
            if (hp->route_input) {
                for (int64_t d = 0; d < D; d++) dst[d] += eo[d];
                continue;
            }
            float w = m->route_w[r];
            for (int64_t d = 0; d < D; d++) dst[d] += eo[d] * w;
        }
    }
    return CLB_OK;
}

static clb_status moe(clb_model *m, int64_t il, int64_t T, int32_t *routes) {
    const clb_hparams *hp = &m->hp;
    const clb_layer_w *l = &m->layers[il];
    const int64_t D = hp->n_embd, E = hp->n_expert, K = hp->n_expert_used;

    for (int64_t t = 0; t < T; t++)
        clb_rmsnorm(m->x + t * D, clb_f32_data(l->ffn_norm), D, hp->rms_eps, m->xn + t * D);

    /* route: [T, E] logits -> top-K ids and weights (a small f32 product: no dispatch) */
    TRY(clb_fw_mm_tp(m, CLB_PHASE_ROUTER, l->gate_inp, m->xn, T, m->probs, E,
                     l->gate_inp_bias, NULL));
    for (int64_t t = 0; t < T; t++)
        route_token(m, l, m->probs + t * E, m->top_id + t * K, m->top_w + t * K);
    if (routes)
        for (int64_t t = 0; t < T; t++)
            memcpy(routes + (t * hp->n_layer + il) * K, m->top_id + t * K,
                   (size_t)K * sizeof(int32_t));
    /* the nearer layer first: the readers take read-aheads in the order queued */
    for (int64_t d = 1, depth = clb_xc_prefetch_depth(m->xc); d <= depth; d++)
        if (il + d < hp->n_layer && m->layers[il + d].ffn == CLB_FFN_MOE)
            TRY(prefetch_ahead(m, il, il + d, T));

    TRY(routed_experts(m, il, T, NULL, m->proj));

    if (hp->n_ff_shared > 0) {
        const clb_ffn_w *sw = &l->shared;
        int64_t off[2] = {0, T};
        TRY(ffn_groups(m, CLB_PHASE_SHARED, CLB_PHASE_SHARED, 1, &sw, off, NULL, m->xn, NULL,
                       m->eo)); /* [T, D] */
        if (l->shared_gate) {
            TRY(clb_fw_mm(m, CLB_PHASE_SHARED, l->shared_gate, m->xn, T, m->sgate, 1, NULL));
            for (int64_t t = 0; t < T; t++) {
                float g = 1.0f / (1.0f + expf(-m->sgate[t]));
                for (int64_t d = 0; d < D; d++) m->eo[t * D + d] *= g;
            }
        }
        for (int64_t i = 0; i < T * D; i++) m->proj[i] += m->eo[i];
    }
    for (int64_t i = 0; i < T * D; i++) m->x[i] += m->proj[i];
    return CLB_OK;
}

/* A dense layer's FFN: x += w2 @ (silu(w1 @ xn) * (w3 @ xn)), xn = clb_rmsnorm(x). */
static clb_status dense_ffn(clb_model *m, int64_t il, int64_t T, int32_t *routes) {
    const clb_hparams *hp = &m->hp;
    const clb_layer_w *l = &m->layers[il];
    const int64_t D = hp->n_embd, K = hp->n_expert_used;
    for (int64_t t = 0; t < T; t++)
        clb_rmsnorm(m->x + t * D, clb_f32_data(l->ffn_norm), D, hp->rms_eps, m->xn + t * D);
    const clb_ffn_w *w = &l->dense;
    int64_t off[2] = {0, T};
    TRY(ffn_groups(m, CLB_PHASE_DENSE, CLB_PHASE_DENSE, 1, &w, off, NULL, m->xn, NULL, m->proj));
    for (int64_t i = 0; i < T * D; i++) m->x[i] += m->proj[i];
    if (routes) /* no expert chosen in this layer */
        for (int64_t t = 0; t < T; t++)
            for (int64_t k = 0; k < K; k++) routes[(t * hp->n_layer + il) * K + k] = -1;
    return CLB_OK;
}

/* ---- one chunk ------------------------------------------------------------------------- */

/* An MTP layer's input (mtp_input): x = eh_proj @ [rmsnorm(embed(token), enorm);
 * rmsnorm(h, hnorm)] per token, h its row of hidden_in [T, D]; the embedding half is zero at
 * position 0 (vLLM's and SGLang's DeepSeek MTP mask it there) unless mtp_keep_first (their
 * Qwen3-Next MTP does not). */
static clb_status mtp_input(clb_model *m, int64_t T, const int32_t *tokens, const int32_t *pos,
                            const float *hidden_in) {
    const clb_hparams *hp = &m->hp;
    const int64_t D = hp->n_embd;
    for (int64_t t = 0; t < T; t++) {
        float *cat = m->mtp_cat + t * 2 * D;
        if (pos[t] == 0 && !hp->mtp_keep_first) {
            memset(cat, 0, (size_t)D * sizeof(float));
        } else {
            clb_get_row(m->tok_embd->type, m->tok_embd->data, D, tokens[t], m->xn + t * D);
            clb_rmsnorm(m->xn + t * D, clb_f32_data(m->mtp_enorm), D, hp->rms_eps, cat);
        }
        clb_rmsnorm(hidden_in + t * D, clb_f32_data(m->mtp_hnorm), D, hp->rms_eps, cat + D);
    }
    return clb_fw_mm(m, CLB_PHASE_ATTN_PROJ, m->mtp_eh_proj, m->mtp_cat, T, m->x, D, NULL);
}

/* Layers [il0, il1) of one chunk: from the embeddings (an MTP layer: from mtp_input) when
 * il0 == 0, else from the hidden states x_io [T, D]; the states after layer il1 - 1 go back to
 * x_io (when given); hidden_out, the final norm and lm_head run when il1 == n_layer. */
static clb_status forward_chunk(clb_model *m, clb_kv *kv, const clb_batch *b, int64_t T,
                                const int32_t *tokens,
                                const int32_t *seq, const int32_t *pos, const uint8_t *want,
                                int32_t *routes, const float *hidden_in, float *hidden_out,
                                float *logits, int64_t *n_out, int64_t il0, int64_t il1,
                                float *x_io) {
    const clb_hparams *hp = &m->hp;
    const int64_t D = hp->n_embd, rd = hp->rotary_dim, half = rd / 2;

    if (il0 > 0)
        memcpy(m->x, x_io, (size_t)(T * D) * sizeof(float));
    else if (hp->mtp_input)
        TRY(mtp_input(m, T, tokens, pos, hidden_in));
    else
        for (int64_t t = 0; t < T; t++)
            clb_get_row(m->tok_embd->type, m->tok_embd->data, D, tokens[t], m->x + t * D);
    for (int64_t t = 0; t < T; t++) {
        float *cs = m->rope + t * rd;
        for (int64_t i = 0; i < half; i++) {
            float ang = (float)pos[t] * m->inv_freq[i]; /* f32, as transformers computes it */
            cs[i] = cosf(ang) * hp->rope_scale;
            cs[half + i] = sinf(ang) * hp->rope_scale;
        }
    }
    for (int64_t il = il0; il < il1; il++) {
        if (m->layers[il].mixer == CLB_MIX_LINEAR)
            TRY(clb_linear_attn(m, kv, b, il, T, seq, pos));
        else
            TRY(hp->attn == CLB_ATTN_MLA ? clb_attention_mla(m, kv, b, il, T, seq, pos)
                                         : clb_attention_gqa(m, kv, b, il, T, seq, pos));
        TRY(m->layers[il].ffn == CLB_FFN_DENSE ? dense_ffn(m, il, T, routes)
                                               : moe(m, il, T, routes));
    }
    if (x_io) memcpy(x_io, m->x, (size_t)(T * D) * sizeof(float));
    *n_out = 0;
    if (il1 < hp->n_layer) return CLB_OK;
    if (hidden_out && b->hidden_out_normed)
        for (int64_t t = 0; t < T; t++)
            clb_rmsnorm(m->x + t * D, clb_f32_data(m->output_norm), D, hp->rms_eps,
                        hidden_out + t * D);
    else if (hidden_out)
        memcpy(hidden_out, m->x, (size_t)(T * D) * sizeof(float));

    int64_t n = 0;
    for (int64_t t = 0; t < T; t++)
        if (!want || want[t]) m->out_rows[n++] = (int32_t)t;
    for (int64_t r = 0; r < n; r++)
        clb_rmsnorm(m->x + (int64_t)m->out_rows[r] * D, clb_f32_data(m->output_norm), D, hp->rms_eps,
                m->xn + r * D);
    if (n > 0) /* [n, V] */
        TRY(clb_fw_mm(m, CLB_PHASE_LM_HEAD, m->output, m->xn, n, logits, hp->n_vocab, NULL));
    *n_out = n;
    return CLB_OK;
}

/* Checks every token of b before any work, so a refused call leaves the cache untouched.
 * kv->seq_next[s] is one past the last position of s seen so far (-1: not yet in the call);
 * kv->writer[blk] is the sequence that writes blk in this call (-1: none). Both are scratch
 * of the cache; writer is back to all -1 when this returns. A sequence's table entries are
 * range-checked when it first appears (entries 0..p/16) and when it enters a new block. */
static clb_status validate(const clb_model *m, clb_kv *kv, const clb_batch *b, char *err) {
    const clb_hparams *hp = &m->hp;
    const int64_t n = b->n_tokens, nb = b->max_blocks;
    const int32_t *tokens = b->tokens, *seq = b->seq_ids, *pos = b->positions;
    clb_status st = CLB_OK;
    int64_t i = 0;
    for (int32_t s = 0; s < b->n_seq; s++) kv->seq_next[s] = -1;
    for (; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= hp->n_vocab) {
            clb_set_err(err, "token %d at index %lld is not in 0..%lld (n_vocab - 1)", tokens[i],
                        (long long)i, (long long)(hp->n_vocab - 1));
            st = CLB_E_ARG;
            break;
        }
        if (seq[i] < 0 || seq[i] >= b->n_seq) {
            clb_set_err(err, "sequence id %d at index %lld is not in 0..%d", seq[i], (long long)i,
                        b->n_seq - 1);
            st = CLB_E_ARG;
            break;
        }
        if (pos[i] < 0) {
            clb_set_err(err, "position %d at index %lld is negative", pos[i], (long long)i);
            st = CLB_E_ARG;
            break;
        }
        if (pos[i] >= hp->n_ctx) {
            clb_set_err(err, "position %d at index %lld is past the context (n_ctx %lld)", pos[i],
                        (long long)i, (long long)hp->n_ctx);
            st = CLB_E_RANGE;
            break;
        }
        const int32_t s = seq[i];
        const int64_t p = pos[i], jb = p / CLB_KV_BLOCK, next = kv->seq_next[s];
        const int32_t *row = b->block_tables + (int64_t)s * nb;
        if (next >= 0 && p != next) {
            clb_set_err(err,
                        "sequence %d: position %lld at index %lld, expected %lld (positions of a "
                        "sequence must be consecutive and increasing in a call)", s, (long long)p,
                        (long long)i, (long long)next);
            st = CLB_E_ARG;
            break;
        }
        if (jb >= nb) {
            clb_set_err(err,
                        "sequence %d: position %lld needs block table entry %lld, but the rows "
                        "have %lld entries", s, (long long)p, (long long)jb, (long long)nb);
            st = CLB_E_ARG;
            break;
        }
        if (next < 0 || p % CLB_KV_BLOCK == 0) { /* entering a block: check the entries */
            for (int64_t j = next < 0 ? 0 : jb; j <= jb && st == CLB_OK; j++) {
                if (row[j] < 0 || row[j] >= kv->n_blocks) {
                    clb_set_err(err,
                                "sequence %d: block table entry %lld (positions %lld..%lld) is "
                                "%d, not a block in 0..%lld", s, (long long)j,
                                (long long)(j * CLB_KV_BLOCK), (long long)(j * CLB_KV_BLOCK + 15),
                                row[j], (long long)(kv->n_blocks - 1));
                    st = CLB_E_ARG;
                }
            }
            if (st != CLB_OK) break;
            for (int64_t j = 0; j < jb; j++) {
                if (row[j] == row[jb]) {
                    clb_set_err(err, "sequence %d: block %d is at table entries %lld and %lld", s,
                                row[jb], (long long)j, (long long)jb);
                    st = CLB_E_ARG;
                    break;
                }
            }
            if (st != CLB_OK) break;
            if (kv->writer[row[jb]] >= 0) {
                clb_set_err(err, "block %d is written by sequences %d and %d in one call", row[jb],
                            kv->writer[row[jb]], s);
                st = CLB_E_ARG;
                break;
            }
            kv->writer[row[jb]] = s;
        }
        kv->seq_next[s] = (int32_t)(p + 1);
    }
    /* tokens [0, i) passed every check, so their write blocks are valid ids */
    for (int64_t t = 0; t < i; t++)
        kv->writer[b->block_tables[(int64_t)seq[t] * nb + pos[t] / CLB_KV_BLOCK]] = -1;
    return st;
}

/* The windowed pool's tables (a cache with one), after validate() passed: every entry a token
 * reads in a windowed layer (from the block of the lowest position any windowed layer lets its
 * first token in the call see, to the block it writes) is a windowed-pool block, none twice in
 * that range of one table, and no block written by two sequences. Entries below that range
 * are never read and may be -1. kv->seq_lo[s]: the first entry s reads (-1: not seen yet). */
static clb_status validate_win(clb_kv *kv, const clb_batch *b, char *err) {
    const int64_t n = b->n_tokens, nb = b->max_blocks, nw = kv->n_win_blocks;
    const int32_t *seq = b->seq_ids, *pos = b->positions;
    clb_status st = CLB_OK;
    int64_t i = 0;
    for (int32_t s = 0; s < b->n_seq; s++) kv->seq_lo[s] = -1;
    for (; i < n; i++) {
        const int32_t s = seq[i];
        const int64_t p = pos[i], jb = p / CLB_KV_BLOCK;
        const int32_t *row = b->win_tables + (int64_t)s * nb;
        const int first = kv->seq_lo[s] < 0;
        if (!first && p % CLB_KV_BLOCK != 0) continue;
        if (first) kv->seq_lo[s] = (int32_t)(clb_kv_win_lo(kv, p) / CLB_KV_BLOCK);
        for (int64_t j = first ? kv->seq_lo[s] : jb; j <= jb && st == CLB_OK; j++) {
            if (row[j] < 0 || row[j] >= nw) {
                clb_set_err(err,
                            "sequence %d: windowed block table entry %lld (positions "
                            "%lld..%lld) is %d, not a block in 0..%lld", s, (long long)j,
                            (long long)(j * CLB_KV_BLOCK), (long long)(j * CLB_KV_BLOCK + 15),
                            row[j], (long long)(nw - 1));
                st = CLB_E_ARG;
            }
        }
        if (st != CLB_OK) break;
        for (int64_t j = kv->seq_lo[s]; j < jb; j++) {
            if (row[j] == row[jb]) {
                clb_set_err(err, "sequence %d: windowed block %d is at table entries %lld and "
                            "%lld", s, row[jb], (long long)j, (long long)jb);
                st = CLB_E_ARG;
                break;
            }
        }
        if (st != CLB_OK) break;
        if (kv->win_writer[row[jb]] >= 0) {
            clb_set_err(err, "windowed block %d is written by sequences %d and %d in one call",
                        row[jb], kv->win_writer[row[jb]], s);
            st = CLB_E_ARG;
            break;
        }
        kv->win_writer[row[jb]] = s;
    }
    /* tokens [0, i) passed every check, so their write blocks are valid ids */
    for (int64_t t = 0; t < i; t++)
        kv->win_writer[b->win_tables[(int64_t)seq[t] * nb + pos[t] / CLB_KV_BLOCK]] = -1;
    return st;
}

int clb_all_finite(const float *x, int64_t n) {
    uint32_t bad = 0; /* or-reduced in integers, which the compiler vectorizes */
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, sizeof u);
        bad |= (uint32_t)((u & 0x7f800000u) == 0x7f800000u); /* exponent all ones */
    }
    return bad == 0;
}

static clb_status forward_run(clb_model *m, clb_kv *kv, const clb_batch *b, int64_t il0,
                              int64_t il1, float *x_io, float *logits, char *err) {
    if (err) err[0] = '\0';
    if (!m || !kv || kv->model != m) {
        clb_set_err(err, "clb_forward: model missing or the KV cache belongs to another model");
        return CLB_E_ARG;
    }
    if (!b || b->n_tokens < 0 ||
        (b->n_tokens > 0 && (!b->tokens || !b->seq_ids || !b->positions))) {
        clb_set_err(err, "clb_forward: bad token arrays (n_tokens %lld)",
                    b ? (long long)b->n_tokens : -1LL);
        return CLB_E_ARG;
    }
    if (b->n_tokens == 0) return CLB_OK;
    if (m->hp.mtp_input && !b->hidden_in) {
        clb_set_err(err, "clb_forward: a multi-token-prediction layer needs hidden_in");
        return CLB_E_ARG;
    }
    /* every sequence of a call writes a block of its own, so n_seq <= n_blocks; that bound
     * lets the validation scratch be sized once at init */
    if (b->n_seq <= 0 || b->n_seq > kv->n_blocks || b->max_blocks <= 0 || !b->block_tables) {
        clb_set_err(err, "clb_forward: bad block tables (n_seq %d, max_blocks %d; n_seq must be in "
                    "1..%lld, the cache's block count)", b->n_seq, b->max_blocks,
                    (long long)kv->n_blocks);
        return CLB_E_ARG;
    }
    if (kv->n_win_blocks > 0 && (!b->win_tables || b->n_seq > kv->n_win_blocks)) {
        clb_set_err(err, "clb_forward: this cache keeps its windowed layers in a pool of their "
                    "own: win_tables is needed, and n_seq (%d) must be in 1..%lld (that pool's "
                    "block count)", b->n_seq, (long long)kv->n_win_blocks);
        return CLB_E_ARG;
    }
    clb_status st = validate(m, kv, b, err);
    if (st == CLB_OK && kv->n_win_blocks > 0) st = validate_win(kv, b, err);
    if (st == CLB_OK) st = clb_linear_check(m, kv, b, il0, il1, err);
    if (st != CLB_OK) return st;
    if ((st = clb_xc_failed(m->xc, err)) != CLB_OK) return st; /* a weight file changed */
    const uint8_t *want_logits = b->want_logits;
    int any_out = il1 == m->hp.n_layer && !want_logits;
    for (int64_t i = 0; i < b->n_tokens && !any_out && want_logits && il1 == m->hp.n_layer; i++)
        any_out = want_logits[i] != 0;
    if (any_out && !logits) {
        clb_set_err(err, "clb_forward: logits requested but no output buffer given");
        return CLB_E_ARG;
    }

    const int64_t n_tokens = b->n_tokens;
    clb_linear_begin(m, kv, b, il0, il1);
    for (int64_t t0 = 0; t0 < n_tokens; t0 += CLB_MAX_BATCH) {
        int64_t T = n_tokens - t0 < CLB_MAX_BATCH ? n_tokens - t0 : CLB_MAX_BATCH, n_out = 0;
        int32_t *routes = b->routes ? b->routes + t0 * m->hp.n_layer * m->hp.n_expert_used
                                    : NULL;
        const int64_t c0 = clb_now_ns();
        const int64_t D = m->hp.n_embd;
        st = forward_chunk(m, kv, b, T, b->tokens + t0, b->seq_ids + t0, b->positions + t0,
                           want_logits ? want_logits + t0 : NULL, routes,
                           m->hp.mtp_input ? b->hidden_in + t0 * D : NULL,
                           b->hidden_out ? b->hidden_out + t0 * D : NULL, logits, &n_out, il0,
                           il1, x_io ? x_io + t0 * D : NULL);
        m->prod.forward_ns += clb_now_ns() - c0;
        if (st != CLB_OK) {
            clb_linear_end(m, kv, b, il0, il1, 0);
            if (clb_xc_failed(m->xc, err) != CLB_OK) return CLB_E_IO;
            clb_set_err(err, "forward failed in a kernel (status %d); the KV rows of this call's "
                        "positions may be partly written", (int)st);
            return st;
        }
        if (n_out > 0) logits += n_out * m->hp.n_vocab;
    }
    if (clb_wfault_any() && (st = clb_model_weight_fault(m, err)) != CLB_OK) {
        clb_linear_end(m, kv, b, il0, il1, 0);
        return st;
    }
    clb_linear_end(m, kv, b, il0, il1, 1);
    return CLB_OK;
}

clb_status clb_forward(clb_model *m, clb_kv *kv, const clb_batch *b, float *logits, char *err) {
    return forward_run(m, kv, b, 0, m ? m->hp.n_layer : 0, NULL, logits, err);
}

clb_status clb_forward_span(clb_model *m, clb_kv *kv, const clb_batch *b, int64_t il0,
                            int64_t il1, float *x, float *logits, char *err) {
    if (err) err[0] = '\0';
    if (!m || !x || il0 < 0 || il1 <= il0 || il1 > m->hp.n_layer) {
        clb_set_err(err, "clb_forward_span: layers [%lld, %lld) are not a span of the model's "
                    "%lld, or no hidden-state buffer", (long long)il0, (long long)il1,
                    m ? (long long)m->hp.n_layer : 0LL);
        return CLB_E_ARG;
    }
    return forward_run(m, kv, b, il0, il1, x, logits, err);
}

clb_status clb_moe_experts(clb_model *m, int64_t il, int64_t n_tokens, const float *xn,
                           const int32_t *ids, const float *w, const uint8_t *mine, float *out,
                           char *err) {
    if (err) err[0] = '\0';
    if (!m || il < 0 || il >= m->hp.n_layer || m->layers[il].ffn != CLB_FFN_MOE) {
        clb_set_err(err, "clb_moe_experts: layer %lld is not a layer with routed experts of "
                    "this model", (long long)il);
        return CLB_E_ARG;
    }
    if (n_tokens < 0 || (n_tokens > 0 && (!xn || !ids || !w || !out))) {
        clb_set_err(err, "clb_moe_experts: bad arrays (n_tokens %lld)", (long long)n_tokens);
        return CLB_E_ARG;
    }
    const int64_t D = m->hp.n_embd, E = m->hp.n_expert, K = m->hp.n_expert_used;
    for (int64_t i = 0; i < n_tokens * K; i++) {
        if (ids[i] < 0 || ids[i] >= E) {
            clb_set_err(err, "clb_moe_experts: expert id %d at index %lld is not in 0..%lld",
                        ids[i], (long long)i, (long long)(E - 1));
            return CLB_E_ARG;
        }
    }
    clb_status st = clb_xc_failed(m->xc, err);
    if (st != CLB_OK) return st;
    for (int64_t t0 = 0; t0 < n_tokens; t0 += CLB_MAX_BATCH) {
        const int64_t T = n_tokens - t0 < CLB_MAX_BATCH ? n_tokens - t0 : CLB_MAX_BATCH;
        memcpy(m->xn, xn + t0 * D, (size_t)(T * D) * sizeof(float));
        memcpy(m->top_id, ids + t0 * K, (size_t)(T * K) * sizeof(int32_t));
        memcpy(m->top_w, w + t0 * K, (size_t)(T * K) * sizeof(float));
        st = routed_experts(m, il, T, mine, out + t0 * D);
        if (st != CLB_OK) {
            if (clb_xc_failed(m->xc, err) != CLB_OK) return CLB_E_IO;
            clb_set_err(err, "clb_moe_experts: a kernel failed (status %d)", (int)st);
            return st;
        }
    }
    if (clb_wfault_any() && (st = clb_model_weight_fault(m, err)) != CLB_OK) return st;
    return CLB_OK;
}
