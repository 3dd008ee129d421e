/* Colibri attention over the paged KV cache, and the GQA attention block (q/k/v projections,
 * norms, biases, RoPE, the output projection) that most families use.
 * Guarantees: a query attends to its own sequence's keys only, through its block table (the
 * windowed pool's for a sliding-window or chunked layer of a cache that has one); a
 * token's output does not depend on the other tokens of the call or the split over workers.
 * Refuses: nothing; clb_forward validated the batch before any block runs. */
#include <math.h>
#include <string.h>

#include "clb_forward.h"
#include "clb_kernels_isa.h"
#include "clb_util.h"

typedef struct {
    clb_model *m;
    const clb_kv *kv;
    int64_t il, T;
    const int32_t *seq, *pos;
    const int32_t *tables; /* [n_seq, max_blocks]: the pool layer il caches in */
    int64_t max_blocks;
    int64_t nh;            /* query heads per work item: a kv head's group, or 1 */
    clb_att_io io;
} att_task;

/* Widens positions [0, n) of one kv head's block part (head_bytes apart) to f32 rows of hd in
 * deq: f16 in one call of the active ISA's conversion f16 (the values are contiguous); q8
 * values stay unscaled (the scale is applied by the caller). */
static void widen_rows(const clb_kv *kv, clb_to_float_fn f16, const unsigned char *row,
                       int64_t n, float *deq) {
    const int64_t hd = kv->head_dim;
    if (kv->type == CLB_KV_F16) {
        f16(n * hd, row, deq);
        return;
    }
    for (int64_t r = 0; r < n; r++, row += kv->head_bytes)
        clb_kv_i8_to_f32(hd, (const int8_t *)row, deq + r * hd);
}

/* Asks for one kv head's part of a block ahead of its turn: blocks lie wherever their tables
 * put them, so the hardware prefetcher cannot follow from one to the next. */
static void prefetch_head(const clb_kv *kv, const unsigned char *p) {
    const size_t len = (size_t)CLB_KV_BLOCK * kv->head_bytes;
    for (size_t o = 0; o < len; o += 64) __builtin_prefetch(p + o);
}

static float q8_scale(const clb_kv *kv, const unsigned char *row) {
    return *(const float *)(const void *)(row + kv->q8_scale_off);
}

/* One block's part of a work item: positions [j, j + n) of j's block, up to p. */
typedef struct {
    int64_t n;
    const unsigned char *row0; /* kv head kvh's values (K or V) at position j */
    const float *rows;         /* its n rows as f32, hd apart: in the cache or widened in deq */
} att_block;

/* K (kind 0) or V (kind 1) of kv head kvh for the block holding position j, as the attention
 * kernels read it; the next block's part is asked for ahead. */
static att_block att_block_at(const att_task *a, const int32_t *tab, int kind, int64_t j,
                              int64_t p, int64_t kvh, clb_to_float_fn f16, float *deq) {
    const clb_kv *kv = a->kv;
    const int64_t slot = j % CLB_KV_BLOCK;
    att_block b;
    b.n = (p - j + 1 < CLB_KV_BLOCK - slot) ? p - j + 1 : CLB_KV_BLOCK - slot;
    b.row0 = clb_kv_head(kv, tab[j / CLB_KV_BLOCK], a->il, kind, kvh, slot);
    if (j + b.n <= p)
        prefetch_head(kv, clb_kv_head(kv, tab[(j + b.n) / CLB_KV_BLOCK], a->il, kind, kvh, 0));
    b.rows = (const float *)(const void *)b.row0;
    if (kv->type != CLB_KV_F32) {
        widen_rows(kv, f16, b.row0, b.n, deq);
        b.rows = deq;
    }
    return b;
}

/* A work item is (token, kv head, nh query heads of its group); each query reads the keys of
 * its own sequence in [max(0, pos - window + 1), pos] (in a chunked layer [pos - pos % chunk,
 * pos]), all already in the cache, through the
 * sequence's block table, block by block (one table lookup per block; the next block's rows
 * are prefetched). f16 and q8 rows are widened to f32 once per block for all nh heads (q8:
 * the scale multiplies the dot product and the softmax weight) and read by the active ISA's
 * attention kernels, a block's rows per call. A latent cache (one kind) keeps the values as
 * the first v_dim elements of each key row. Each head's arithmetic is the same whatever nh,
 * the split over workers or the rest of the batch, so a token's output never depends on its
 * neighbours. */
static void att_worker(void *vctx, int ith, int nth) {
    const att_task *a = vctx;
    const clb_model *m = a->m;
    const clb_kv *kv = a->kv;
    const clb_att_io *io = &a->io;
    const int64_t win = m->layers[a->il].window, chunk = m->layers[a->il].chunk;
    const float *sinks = clb_f32_data(m->layers[a->il].sinks); /* [H] or NULL */
    const int64_t H = m->hp.n_head, Hkv = kv->n_head_kv, kd = kv->head_dim, vd = kv->v_dim;
    const int v_kind = kv->n_kinds == 2 ? 1 : 0;
    const int64_t group = H / Hkv, nh = a->nh, per_kv = group / nh, span = m->span;
    const float scale = io->scale;
    const int64_t n_items = a->T * Hkv * per_kv;
    const int64_t i0 = n_items * ith / nth, i1 = n_items * (ith + 1) / nth;
    float *sc = m->scores + (int64_t)ith * group * span;        /* [nh, span] */
    float *mx = m->head_stat + (int64_t)ith * 2 * group, *inv = mx + group;
    float *deq = kv->deq + (int64_t)ith * CLB_KV_BLOCK * kd;    /* [CLB_KV_BLOCK, kd] */
    const clb_att_kernels *ak = clb_get_att_kernels();
    const clb_to_float_fn f16 = clb_get_type_traits(CLB_TYPE_F16)->to_float;
    const clb_kv_type ty = kv->type;
    const size_t rb = kv->head_bytes; /* q8: a position's values and scale */
    float wr[CLB_KV_BLOCK];

    for (int64_t it = i0; it < i1; it++) {
        const int64_t t = it / (Hkv * per_kv), r = it % (Hkv * per_kv);
        const int64_t kvh = r / per_kv, h0 = kvh * group + (r % per_kv) * nh;
        const int32_t *tab = a->tables + (int64_t)a->seq[t] * a->max_blocks;
        const int64_t p = a->pos[t];
        int64_t lo = 0;
        if (win > 0 && p - win + 1 > 0) lo = p - win + 1;
        if (chunk > 0) lo = p - p % chunk;
        const float *q0 = io->q + t * io->q_stride + h0 * io->q_head;
        float *out0 = io->out + t * io->out_stride + h0 * io->out_head;

        for (int64_t g = 0; g < nh; g++) mx[g] = -INFINITY;
        for (int64_t j = lo; j <= p;) {
            const att_block bk = att_block_at(a, tab, 0, j, p, kvh, f16, deq);
            const int64_t n = bk.n;
            const unsigned char *row0 = bk.row0;
            const float *rows = bk.rows;
            for (int64_t g = 0; g < nh; g++) {
                float *s = sc + g * span + (j - lo);
                if (ty != CLB_KV_Q8) { /* the kernel scales and returns the block's maximum */
                    const float top = ak->dots(kd, q0 + g * io->q_head, rows, kd, n, scale, s);
                    mx[g] = top > mx[g] ? top : mx[g];
                    continue;
                }
                ak->dots(kd, q0 + g * io->q_head, rows, kd, n, 1.0f, s);
                /* the running maximum in a local (mx[g] could alias s, so the compiler kept
                 * it in memory) */
                float top = mx[g];
                for (int64_t k = 0; k < n; k++) {
                    s[k] = s[k] * q8_scale(kv, row0 + (size_t)k * rb) * scale;
                    top = s[k] > top ? s[k] : top;
                }
                mx[g] = top;
            }
            j += n;
        }
        for (int64_t g = 0; g < nh; g++) {
            /* sum >= 1: the maximum contributes exp(0) = 1. A sink is one more logit in the
             * denominator that weighs no value row */
            if (sinks) {
                const float sk = sinks[h0 + g], top = sk > mx[g] ? sk : mx[g];
                inv[g] = 1.0f / (ak->exp_sum(p - lo + 1, sc + g * span, top) +
                                 clb_exp1(sk - top));
            } else {
                inv[g] = 1.0f / ak->exp_sum(p - lo + 1, sc + g * span, mx[g]);
            }
            for (int64_t d = 0; d < vd; d++) out0[g * io->out_head + d] = 0.0f;
        }
        for (int64_t j = lo; j <= p;) {
            const att_block bk = att_block_at(a, tab, v_kind, j, p, kvh, f16, deq);
            const int64_t n = bk.n;
            const unsigned char *row0 = bk.row0;
            const float *rows = bk.rows;
            for (int64_t g = 0; g < nh; g++) {
                const float *s = sc + g * span + (j - lo);
                const float ig = inv[g];
                if (ty == CLB_KV_Q8)
                    for (int64_t k = 0; k < n; k++)
                        wr[k] = s[k] * ig * q8_scale(kv, row0 + (size_t)k * rb);
                else
                    for (int64_t k = 0; k < n; k++) wr[k] = s[k] * ig;
                ak->mad_rows(vd, out0 + g * io->out_head, rows, kd, n, wr);
            }
            j += n;
        }
    }
}

clb_status clb_attend(clb_model *m, const clb_kv *kv, const clb_batch *b, int64_t il, int64_t T,
                      const int32_t *seq, const int32_t *pos, const clb_att_io *io) {
    /* as many of a kv head's query heads per work item as still give every worker something
     * to do: rows are widened once per item, so a decode step of a model with one cached head
     * (MLA) splits its heads in a few large groups rather than one per head */
    const int64_t H = m->hp.n_head, Hkv = kv->n_head_kv, group = H / Hkv;
    const int64_t n_threads = clb_threadpool_n_threads(m->tp);
    int64_t nh = group;
    while (nh > 1 && T * Hkv * (group / nh) < n_threads) {
        do nh--;
        while (group % nh);
    }
    att_task task = {m, kv, il, T, seq, pos, clb_kv_tables(kv, b, il), b->max_blocks, nh, *io};
    const int64_t t0 = clb_now_ns();
    clb_status st = clb_threadpool_run(m->tp, att_worker, &task);
    m->prod.attention_ns += clb_now_ns() - t0;
    return st;
}

/* Llama 4's per-layer query and key options, after RoPE: each q and k head divided by its
 * RMS (no weight), and queries scaled by 1 + s * log1p(floor((p + 1) / floor)), in float32 as
 * transformers computes them (Llama4TextAttention). Query head h starts at q + h * qh. */
static void llama4_qk(const clb_hparams *hp, int32_t fl, int64_t p, float *q, int64_t qh,
                      float *k) {
    const int64_t H = hp->n_head, Hkv = hp->n_head_kv, hd = hp->head_dim;
    if (fl & CLB_LAYER_QK_L2) {
        for (int64_t h = 0; h < H; h++) clb_rmsnorm(q + h * qh, NULL, hd, hp->rms_eps, q + h * qh);
        for (int64_t h = 0; h < Hkv; h++)
            clb_rmsnorm(k + h * hd, NULL, hd, hp->rms_eps, k + h * hd);
    }
    if (fl & CLB_LAYER_TEMP) {
        const float s =
            log1pf(floorf(((float)p + 1.0f) / hp->attn_temp_floor)) * hp->attn_temp_scale + 1.0f;
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < hd; i++) q[h * qh + i] *= s;
    }
}

clb_status clb_attention_gqa(clb_model *m, clb_kv *kv, const clb_batch *b, int64_t il, int64_t T,
                             const int32_t *seq, const int32_t *pos) {
    const clb_hparams *hp = &m->hp;
    const clb_layer_w *l = &m->layers[il];
    const int64_t D = hp->n_embd, H = hp->n_head, Hkv = hp->n_head_kv, hd = hp->head_dim;
    const int64_t qd = H * hd, kvd = Hkv * hd, rd = hp->rotary_dim;
    /* with attn_gate, q holds each head's query then its gate: head h at h * qh */
    const int64_t qh = hp->attn_gate ? 2 * hd : hd, qs = H * qh;

    for (int64_t t = 0; t < T; t++)
        clb_rmsnorm(m->x + t * D, clb_f32_data(l->attn_norm), D, hp->rms_eps, m->xn + t * D);
    if (l->wk->type == l->wq->type && l->wv->type == l->wq->type) {
        /* xn is packed once and q, k, v run in one dispatch */
        const void *a = clb_fw_act_for(l->wq, m->xn, D, T, m->act);
        m->jobs[0] = clb_fw_job(l->wq, a, T, m->q, qs, l->bq);  /* [T, qs] */
        m->jobs[1] = clb_fw_job(l->wk, a, T, m->k, kvd, l->bk); /* [T, kvd] */
        m->jobs[2] = clb_fw_job(l->wv, a, T, m->v, kvd, l->bv); /* [T, kvd] */
        TRY(clb_fw_run_jobs(m, CLB_PHASE_ATTN_PROJ, 3));
    } else {
        TRY(clb_fw_mm(m, CLB_PHASE_ATTN_PROJ, l->wq, m->xn, T, m->q, qs, l->bq));
        TRY(clb_fw_mm(m, CLB_PHASE_ATTN_PROJ, l->wk, m->xn, T, m->k, kvd, l->bk));
        TRY(clb_fw_mm(m, CLB_PHASE_ATTN_PROJ, l->wv, m->xn, T, m->v, kvd, l->bv));
    }

    for (int64_t t = 0; t < T; t++) {
        float *q = m->q + t * qs, *k = m->k + t * kvd, *v = m->v + t * kvd;
        if (hp->qk_norm == CLB_QK_NORM_HEAD) {
            for (int64_t h = 0; h < H; h++) clb_rmsnorm(q + h * qh, clb_f32_data(l->q_norm), hd, hp->rms_eps, q + h * qh);
            for (int64_t h = 0; h < Hkv; h++) clb_rmsnorm(k + h * hd, clb_f32_data(l->k_norm), hd, hp->rms_eps, k + h * hd);
        } else if (hp->qk_norm == CLB_QK_NORM_FULL) {
            clb_rmsnorm(q, clb_f32_data(l->q_norm), qd, hp->rms_eps, q);
            clb_rmsnorm(k, clb_f32_data(l->k_norm), kvd, hp->rms_eps, k);
        }
        if (hp->clip_qkv > 0.0f) {
            const float c = hp->clip_qkv;
            for (int64_t i = 0; i < qd; i++) q[i] = fminf(fmaxf(q[i], -c), c);
            for (int64_t i = 0; i < kvd; i++) {
                k[i] = fminf(fmaxf(k[i], -c), c);
                v[i] = fminf(fmaxf(v[i], -c), c);
            }
        }
        const int32_t fl = l->attn_flags;
        if (!(fl & CLB_LAYER_NOPE)) {
            const float *cs = m->rope + t * rd;
            for (int64_t h = 0; h < H; h++) clb_rope_half(q + h * qh, cs, rd);
            for (int64_t h = 0; h < Hkv; h++) clb_rope_half(k + h * hd, cs, rd);
        }
        if (fl & (CLB_LAYER_QK_L2 | CLB_LAYER_TEMP)) llama4_qk(hp, fl, pos[t], q, qh, k);
        int64_t blk = clb_kv_tables(kv, b, il)[(int64_t)seq[t] * b->max_blocks +
                                               pos[t] / CLB_KV_BLOCK];
        clb_kv_store(kv, blk, il, 0, pos[t] % CLB_KV_BLOCK, k);
        clb_kv_store(kv, blk, il, 1, pos[t] % CLB_KV_BLOCK, v);
    }

    /* every K/V row of this chunk is stored first, so in-chunk causal attention sees them (and
     * a token reads its own row back in the cache's format, as later tokens will) */
    const float scale = hp->attn_scale > 0.0f ? hp->attn_scale : 1.0f / sqrtf((float)hd);
    const clb_att_io io = {m->q, qs, qh, m->att, qd, hd, scale};
    TRY(clb_attend(m, kv, b, il, T, seq, pos, &io));
    if (hp->attn_gate) /* out *= sigmoid(gate), the gate beside each head's query */
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++) {
                float *o = m->att + t * qd + h * hd;
                const float *g = m->q + t * qs + h * qh + hd;
                for (int64_t d = 0; d < hd; d++) o[d] = o[d] * (1.0f / (1.0f + expf(-g[d])));
            }

    TRY(clb_fw_mm(m, CLB_PHASE_ATTN_PROJ, l->wo, m->att, T, m->proj, D, l->bo)); /* [T, D] */
    for (int64_t i = 0; i < T * D; i++) m->x[i] += m->proj[i];
    return CLB_OK;
}

