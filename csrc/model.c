/* Colibri model loading: hyper-parameter checks, the folder layout, per-tensor dtype/shape
 * checks, and the one-time allocation of all forward scratch from the memory pool.
 * Guarantees: a loaded model has every tensor the forward pass reads, each with the shape the
 * hparams imply; a missing file or tensor, a wrong dtype or shape is an error naming both.
 * Refuses: hparams that are non-positive, inconsistent or large enough to overflow sizes. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clb_kernels.h"
#include "clb_model_internal.h"
#include "clb_xcache.h"
#include "clb_util.h"

#define CLB_PATH_MAX 4096

/* Generous caps that keep every size computed below far from overflow. */
#define CLB_MAX_EMBD ((int64_t)1 << 20)
#define CLB_MAX_VOCAB ((int64_t)1 << 24)
#define CLB_MAX_LAYER 4096
#define CLB_MAX_EXPERT 4096
#define CLB_MAX_HEADS 4096
#define CLB_MAX_CTX ((int64_t)1 << 24)

static clb_status check_hparams(const clb_hparams *hp, char *err) {
#define NEED(cond, ...)                  \
    do {                                 \
        if (!(cond)) {                   \
            clb_set_err(err, "hparams: " __VA_ARGS__); \
            return CLB_E_ARG;            \
        }                                \
    } while (0)
    NEED(hp->n_vocab > 0 && hp->n_vocab <= CLB_MAX_VOCAB, "n_vocab %lld out of range",
         (long long)hp->n_vocab);
    NEED(hp->n_embd > 0 && hp->n_embd <= CLB_MAX_EMBD, "n_embd %lld out of range",
         (long long)hp->n_embd);
    NEED(hp->n_layer > 0 && hp->n_layer <= CLB_MAX_LAYER, "n_layer %lld out of range",
         (long long)hp->n_layer);
    NEED(hp->n_head > 0 && hp->n_head <= CLB_MAX_HEADS, "n_head %lld out of range",
         (long long)hp->n_head);
    NEED(hp->n_head_kv > 0 && hp->n_head_kv <= hp->n_head, "n_head_kv %lld not in 1..n_head",
         (long long)hp->n_head_kv);
    NEED(hp->n_head % hp->n_head_kv == 0, "n_head %lld is not a multiple of n_head_kv %lld",
         (long long)hp->n_head, (long long)hp->n_head_kv);
    NEED(hp->head_dim > 0 && hp->head_dim * hp->n_head <= CLB_MAX_EMBD,
         "head_dim %lld out of range", (long long)hp->head_dim);
    NEED(hp->attn == CLB_ATTN_GQA || hp->attn == CLB_ATTN_MLA, "unknown attention kind %d",
         hp->attn);
    NEED(isfinite(hp->attn_scale) && hp->attn_scale >= 0.0f, "attn_scale must be >= 0 (0: "
         "1/sqrt(head_dim))");
    if (hp->attn == CLB_ATTN_MLA) {
        NEED(hp->n_head_kv == 1, "MLA caches one latent head: n_head_kv must be 1");
        NEED(hp->kv_lora_rank > 0 && hp->kv_lora_rank <= CLB_MAX_EMBD,
             "kv_lora_rank %lld out of range", (long long)hp->kv_lora_rank);
        NEED(hp->q_lora_rank >= 0 && hp->q_lora_rank <= CLB_MAX_EMBD,
             "q_lora_rank %lld out of range", (long long)hp->q_lora_rank);
        NEED(hp->v_head_dim > 0 && hp->v_head_dim * hp->n_head <= CLB_MAX_EMBD,
             "v_head_dim %lld out of range", (long long)hp->v_head_dim);
        NEED(hp->rotary_dim < hp->head_dim, "MLA needs head_dim (%lld) above rotary_dim (%lld)",
             (long long)hp->head_dim, (long long)hp->rotary_dim);
        NEED(hp->qk_norm == CLB_QK_NORM_NONE && !hp->qkv_bias && hp->clip_qkv <= 0.0f,
             "MLA has no q/k norm, q/k/v bias or clip");
    }
    int64_t n_moe = 0, n_dense = 0;
    for (int64_t il = 0; il < hp->n_layer; il++) {
        int32_t k = hp->layer_ffn ? hp->layer_ffn[il] : CLB_FFN_MOE;
        NEED(k == CLB_FFN_MOE || k == CLB_FFN_DENSE, "layer %lld: unknown FFN kind %d",
             (long long)il, k);
        n_moe += k == CLB_FFN_MOE;
        n_dense += k == CLB_FFN_DENSE;
    }
    NEED(n_dense == 0 || (hp->n_ff_dense > 0 && hp->n_ff_dense <= CLB_MAX_EMBD),
         "n_ff_dense %lld out of range (%lld dense layers)", (long long)hp->n_ff_dense,
         (long long)n_dense);
    if (n_moe > 0) {
        NEED(hp->n_ff > 0 && hp->n_ff <= CLB_MAX_EMBD, "n_ff %lld out of range",
             (long long)hp->n_ff);
        NEED(hp->n_expert > 0 && hp->n_expert <= CLB_MAX_EXPERT, "n_expert %lld out of range",
             (long long)hp->n_expert);
        NEED(hp->n_expert_used > 0 && hp->n_expert_used <= hp->n_expert,
             "n_expert_used %lld not in 1..n_expert (%lld)", (long long)hp->n_expert_used,
             (long long)hp->n_expert);
    } else {
        NEED(hp->n_expert == 0 && hp->n_expert_used == 0 && hp->n_ff_shared == 0,
             "n_expert, n_expert_used and n_ff_shared must be 0 without an MoE layer");
    }
    NEED(hp->router == CLB_ROUTER_SOFTMAX || hp->router == CLB_ROUTER_SIGMOID_GROUPED ||
             hp->router == CLB_ROUTER_SIGMOID_TOPK,
         "unknown router %d", hp->router);
    NEED(hp->route_input == 0 || hp->route_input == 1, "route_input %d is not 0 or 1",
         hp->route_input);
    if (n_moe > 0) {
        NEED(hp->n_group > 0 && hp->n_group <= CLB_MAX_GROUPS && hp->n_expert % hp->n_group == 0,
             "n_group %lld must be in 1..%d and divide n_expert %lld", (long long)hp->n_group,
             CLB_MAX_GROUPS, (long long)hp->n_expert);
        NEED(hp->topk_group > 0 && hp->topk_group <= hp->n_group,
             "topk_group %lld not in 1..n_group (%lld)", (long long)hp->topk_group,
             (long long)hp->n_group);
        NEED(hp->n_group == 1 || hp->router != CLB_ROUTER_SIGMOID_GROUPED ||
                 hp->n_expert / hp->n_group >= 2,
             "grouped sigmoid routing needs at least 2 experts per group");
        NEED(hp->topk_group * (hp->n_expert / hp->n_group) >= hp->n_expert_used,
             "the %lld kept groups hold fewer experts than n_expert_used %lld",
             (long long)hp->topk_group, (long long)hp->n_expert_used);
    }
    NEED(isfinite(hp->routed_scale) && hp->routed_scale > 0.0f, "routed_scale must be positive");
    NEED(isfinite(hp->rope_scale) && hp->rope_scale > 0.0f, "rope_scale must be positive");
    NEED(hp->n_ff_shared >= 0 && hp->n_ff_shared <= CLB_MAX_EMBD, "n_ff_shared %lld out of range",
         (long long)hp->n_ff_shared);
    NEED(!hp->shared_gate || hp->n_ff_shared > 0, "shared_gate set without a shared expert");
    NEED(hp->qk_norm >= CLB_QK_NORM_NONE && hp->qk_norm <= CLB_QK_NORM_FULL,
         "unknown qk_norm %d", hp->qk_norm);
    NEED(hp->rotary_dim > 0 && hp->rotary_dim <= hp->head_dim && hp->rotary_dim % 2 == 0,
         "rotary_dim %lld must be even and in 2..head_dim (%lld)", (long long)hp->rotary_dim,
         (long long)hp->head_dim);
    NEED(isfinite(hp->rope_theta) && hp->rope_theta > 0.0f, "rope_theta must be positive");
    for (int64_t i = 0; hp->rope_freqs && i < hp->rotary_dim / 2; i++)
        NEED(isfinite(hp->rope_freqs[i]) && hp->rope_freqs[i] >= 0.0f,
             "rope_freqs[%lld] is not a finite non-negative number", (long long)i);
    NEED(isfinite(hp->rms_eps) && hp->rms_eps > 0.0f, "rms_eps must be positive");
    NEED(hp->mtp_input == 0 || hp->mtp_input == 1, "mtp_input %d is not 0 or 1", hp->mtp_input);
    NEED(hp->mtp_keep_first == 0 || hp->mtp_keep_first == 1, "mtp_keep_first %d is not 0 or 1",
         hp->mtp_keep_first);
    NEED(!isnan(hp->clip_qkv), "clip_qkv is NaN");
    NEED(hp->n_ctx > 0 && hp->n_ctx <= CLB_MAX_CTX, "n_ctx %lld out of range",
         (long long)hp->n_ctx);
    NEED(hp->sliding_window >= 0, "sliding_window %lld is negative (0: off)",
         (long long)hp->sliding_window);
    NEED(hp->attn_chunk >= 0, "attn_chunk %lld is negative (0: off)", (long long)hp->attn_chunk);
    for (int64_t il = 0; hp->layer_attn && il < hp->n_layer; il++) {
        const int32_t f = hp->layer_attn[il];
        NEED(f >= 0 && f <= CLB_LAYER_ATTN_ALL, "layer %lld: layer_attn %d has unknown bits",
             (long long)il, f);
        NEED(!(f & CLB_LAYER_SLIDING) || !(f & CLB_LAYER_CHUNKED),
             "layer %lld: sliding and chunked at once", (long long)il);
        NEED(!(f & CLB_LAYER_CHUNKED) || hp->attn_chunk > 0,
             "layer %lld: chunked attention needs attn_chunk > 0", (long long)il);
        NEED(hp->attn == CLB_ATTN_GQA || !(f & (CLB_LAYER_NOPE | CLB_LAYER_QK_L2 | CLB_LAYER_TEMP)),
             "layer %lld: NoPE, q/k L2 norm and query temperature need GQA attention",
             (long long)il);
        NEED(!(f & CLB_LAYER_TEMP) ||
                 (isfinite(hp->attn_temp_floor) && hp->attn_temp_floor > 0.0f &&
                  isfinite(hp->attn_temp_scale)),
             "layer %lld: query temperature needs a positive attn_temp_floor and a finite "
             "attn_temp_scale", (long long)il);
    }
    NEED(!hp->attn_sinks || hp->attn == CLB_ATTN_GQA, "attention sinks need GQA attention");
    NEED(!hp->expert_bias || n_moe > 0, "expert_bias set without an MoE layer");
    NEED(!hp->router_bias || n_moe > 0, "router_bias set without an MoE layer");
    NEED(hp->glu == CLB_GLU_SILU || hp->glu == CLB_GLU_SWIGLU_CLAMP, "unknown glu %d", hp->glu);
    NEED(!hp->attn_gate || (hp->attn == CLB_ATTN_GQA && hp->qk_norm != CLB_QK_NORM_FULL &&
                            hp->clip_qkv <= 0.0f),
         "the attention output gate needs GQA without a whole-projection q/k norm or clip");
    int64_t n_linear = 0;
    for (int64_t il = 0; hp->layer_mixer && il < hp->n_layer; il++) {
        NEED(hp->layer_mixer[il] == CLB_MIX_ATTN || hp->layer_mixer[il] == CLB_MIX_LINEAR,
             "layer %lld: unknown token mixer %d", (long long)il, hp->layer_mixer[il]);
        n_linear += hp->layer_mixer[il] == CLB_MIX_LINEAR;
    }
    if (n_linear > 0) {
        NEED(n_linear < hp->n_layer, "at least one layer must be an attention layer");
        NEED(hp->attn == CLB_ATTN_GQA, "linear-attention layers need GQA for the others");
        NEED(hp->lin_n_k_heads > 0 && hp->lin_n_k_heads <= CLB_MAX_HEADS &&
                 hp->lin_n_v_heads > 0 && hp->lin_n_v_heads <= CLB_MAX_HEADS &&
                 hp->lin_n_v_heads % hp->lin_n_k_heads == 0,
             "linear attention: %lld value heads must be a positive multiple of %lld key heads",
             (long long)hp->lin_n_v_heads, (long long)hp->lin_n_k_heads);
        NEED(hp->lin_k_dim > 0 && hp->lin_k_dim <= 4096 && hp->lin_v_dim > 0 &&
                 hp->lin_v_dim <= 4096,
             "linear attention: head widths %lld / %lld out of range", (long long)hp->lin_k_dim,
             (long long)hp->lin_v_dim);
        NEED(hp->lin_n_v_heads * hp->lin_v_dim <= CLB_MAX_EMBD &&
                 hp->lin_n_k_heads * hp->lin_k_dim <= CLB_MAX_EMBD,
             "linear attention: projections too wide");
        NEED(hp->lin_conv >= 2 && hp->lin_conv <= 64, "linear attention: conv width %lld not in "
             "2..64", (long long)hp->lin_conv);
    }
    NEED(hp->glu != CLB_GLU_SWIGLU_CLAMP ||
             (isfinite(hp->glu_alpha) && isfinite(hp->glu_limit) && hp->glu_limit > 0.0f),
         "the clamped SwiGLU needs a finite glu_alpha and a positive glu_limit");
#undef NEED
    return CLB_OK;
}

/* ---- file and tensor lookup ------------------------------------------------------------ */

typedef struct {
    clb_model *m;
    char *err;
} loader;

static clb_status open_file(loader *ld, const char *dir, const char *rel, clb_wfile **out) {
    char path[CLB_PATH_MAX];
    int n = snprintf(path, sizeof path, "%s/%s", dir, rel);
    if (n < 0 || n >= (int)sizeof path) {
        clb_set_err(ld->err, "path too long: %s/%s", dir, rel);
        return CLB_E_ARG;
    }
    clb_status st = clb_wfile_open(path, out, ld->err);
    if (st != CLB_OK) return st;
    ld->m->files[ld->m->n_files++] = *out;
    return CLB_OK;
}

enum { KIND_VEC_F32, KIND_MAT_F32, KIND_MAT_ANY };

/* Finds `name` in f and checks dtype and shape; rows == 0 means a 1-D tensor of `cols`. */
static clb_status want(loader *ld, const clb_wfile *f, const char *file, const char *name,
                       int kind, int64_t rows, int64_t cols, const char *what,
                       const clb_tensor **out) {
    const clb_tensor *t = clb_wfile_find(f, name);
    if (!t) {
        clb_set_err(ld->err, "%s: tensor '%s' is missing", file, name);
        return CLB_E_SHAPE;
    }
    if (kind != KIND_MAT_ANY && t->type != CLB_TYPE_F32) {
        clb_set_err(ld->err, "%s: tensor '%s' has dtype %s, must be f32", file, name,
                    clb_get_type_traits(t->type)->name);
        return CLB_E_SHAPE;
    }
    int ok = kind == KIND_VEC_F32 ? (t->n_dims == 1 && t->shape[0] == cols)
                                  : (t->n_dims == 2 && t->shape[0] == rows && t->shape[1] == cols);
    if (!ok) {
        char got[96];
        int p = snprintf(got, sizeof got, "[");
        for (int d = 0; d < t->n_dims && p < (int)sizeof got; d++)
            p += snprintf(got + p, sizeof got - (size_t)p, d ? ", %lld" : "%lld",
                          (long long)t->shape[d]);
        if (p < (int)sizeof got) snprintf(got + p, sizeof got - (size_t)p, "]");
        if (kind == KIND_VEC_F32)
            clb_set_err(ld->err, "%s: tensor '%s' has shape %s, the config wants [%lld] (%s)", file,
                        name, got, (long long)cols, what);
        else
            clb_set_err(ld->err, "%s: tensor '%s' has shape %s, the config wants [%lld, %lld] (%s)",
                        file, name, got, (long long)rows, (long long)cols, what);
        return CLB_E_SHAPE;
    }
    *out = t;
    return CLB_OK;
}

#define TRY(expr)                         \
    do {                                  \
        clb_status st_ = (expr);          \
        if (st_ != CLB_OK) return st_;    \
    } while (0)

static clb_status load_ffn(loader *ld, const clb_wfile *f, const char *file, int64_t ff,
                           const char *what, clb_ffn_w *w) {
    int64_t d = ld->m->hp.n_embd;
    TRY(want(ld, f, file, "w1", KIND_MAT_ANY, ff, d, what, &w->w1));
    TRY(want(ld, f, file, "w3", KIND_MAT_ANY, ff, d, what, &w->w3));
    TRY(want(ld, f, file, "w2", KIND_MAT_ANY, d, ff, what, &w->w2));
    return CLB_OK;
}

static clb_status load_ffn_of(loader *ld, const char *dir, int64_t il);

/* MLA's projections (clb_model_internal.h): q straight or through its low-rank step, the
 * latent projection and its norm, the per-head up-projections and the output. */
static clb_status load_mla(loader *ld, const clb_wfile *f, const char *rel, clb_layer_w *l) {
    const clb_hparams *hp = &ld->m->hp;
    const int64_t d = hp->n_embd, H = hp->n_head, hd = hp->head_dim, ql = hp->q_lora_rank;
    const int64_t kl = hp->kv_lora_rank, rd = hp->rotary_dim, dv = hp->v_head_dim;
    if (ql > 0) {
        TRY(want(ld, f, rel, "wq_a", KIND_MAT_ANY, ql, d, "q_lora_rank, n_embd", &l->wq_a));
        TRY(want(ld, f, rel, "q_a_norm", KIND_VEC_F32, 0, ql, "q_lora_rank", &l->q_a_norm));
        TRY(want(ld, f, rel, "wq_b", KIND_MAT_ANY, H * hd, ql, "n_head*head_dim, q_lora_rank",
                 &l->wq_b));
    } else {
        TRY(want(ld, f, rel, "wq", KIND_MAT_ANY, H * hd, d, "n_head*head_dim, n_embd", &l->wq));
    }
    TRY(want(ld, f, rel, "wkv_a", KIND_MAT_ANY, kl + rd, d, "kv_lora_rank+rotary_dim, n_embd",
             &l->wkv_a));
    TRY(want(ld, f, rel, "kv_a_norm", KIND_VEC_F32, 0, kl, "kv_lora_rank", &l->kv_a_norm));
    TRY(want(ld, f, rel, "wk_b", KIND_MAT_ANY, H * kl, hd - rd,
             "n_head*kv_lora_rank, head_dim-rotary_dim", &l->wk_b));
    TRY(want(ld, f, rel, "wv_b", KIND_MAT_ANY, H * dv, kl, "n_head*v_head_dim, kv_lora_rank",
             &l->wv_b));
    TRY(want(ld, f, rel, "wo", KIND_MAT_ANY, d, H * dv, "n_embd, n_head*v_head_dim", &l->wo));
    if (hp->o_bias) TRY(want(ld, f, rel, "bo", KIND_VEC_F32, 0, d, "n_embd", &l->bo));
    return CLB_OK;
}

/* A gated DeltaNet layer's tensors (clb_model_internal.h). */
static clb_status load_linear(loader *ld, const clb_wfile *f, const char *rel, clb_layer_w *l) {
    const clb_hparams *hp = &ld->m->hp;
    const int64_t d = hp->n_embd, nv = hp->lin_n_v_heads, vd = nv * hp->lin_v_dim;
    const int64_t C = 2 * hp->lin_n_k_heads * hp->lin_k_dim + vd;
    if (clb_wfile_find(f, "lin_qkvz")) { /* one matrix each (Qwen3-Next) or two (Qwen3.5) */
        TRY(want(ld, f, rel, "lin_qkvz", KIND_MAT_ANY, C + vd, d, "2*k_heads*k_dim + "
                 "2*v_heads*v_dim, n_embd", &l->lin_qkvz));
        TRY(want(ld, f, rel, "lin_ba", KIND_MAT_ANY, 2 * nv, d, "2*v_heads, n_embd", &l->lin_ba));
    } else {
        TRY(want(ld, f, rel, "lin_qkv", KIND_MAT_ANY, C, d, "2*k_heads*k_dim + v_heads*v_dim, "
                 "n_embd", &l->lin_qkv));
        TRY(want(ld, f, rel, "lin_z", KIND_MAT_ANY, vd, d, "v_heads*v_dim, n_embd", &l->lin_z));
        TRY(want(ld, f, rel, "lin_b", KIND_MAT_ANY, nv, d, "v_heads, n_embd", &l->lin_b));
        TRY(want(ld, f, rel, "lin_a", KIND_MAT_ANY, nv, d, "v_heads, n_embd", &l->lin_a));
    }
    TRY(want(ld, f, rel, "lin_conv", KIND_MAT_F32, C, hp->lin_conv, "conv channels, lin_conv",
             &l->lin_conv));
    TRY(want(ld, f, rel, "lin_dt_bias", KIND_VEC_F32, 0, nv, "v_heads", &l->lin_dt_bias));
    TRY(want(ld, f, rel, "lin_a_log", KIND_VEC_F32, 0, nv, "v_heads", &l->lin_a_log));
    TRY(want(ld, f, rel, "lin_norm", KIND_VEC_F32, 0, hp->lin_v_dim, "v_dim", &l->lin_norm));
    TRY(want(ld, f, rel, "lin_out", KIND_MAT_ANY, d, vd, "n_embd, v_heads*v_dim", &l->lin_out));
    return CLB_OK;
}

static clb_status load_layer(loader *ld, const char *dir, int64_t il) {
    clb_model *m = ld->m;
    const clb_hparams *hp = &m->hp;
    clb_layer_w *l = &m->layers[il];
    int64_t d = hp->n_embd, qd = hp->n_head * hp->head_dim, kvd = hp->n_head_kv * hp->head_dim;
    char rel[256];
    clb_wfile *f;

    snprintf(rel, sizeof rel, "attention/layer_%lld.bin", (long long)il);
    TRY(open_file(ld, dir, rel, &f));
    TRY(want(ld, f, rel, "attn_norm", KIND_VEC_F32, 0, d, "n_embd", &l->attn_norm));
    l->mixer = hp->layer_mixer ? hp->layer_mixer[il] : CLB_MIX_ATTN;
    if (l->mixer == CLB_MIX_LINEAR) {
        TRY(load_linear(ld, f, rel, l));
        return load_ffn_of(ld, dir, il);
    }
    if (hp->attn == CLB_ATTN_MLA) {
        TRY(load_mla(ld, f, rel, l));
        return load_ffn_of(ld, dir, il);
    }
    if (hp->attn_gate)
        TRY(want(ld, f, rel, "wq", KIND_MAT_ANY, 2 * qd, d, "2*n_head*head_dim (query and gate "
                 "per head), n_embd", &l->wq));
    else
        TRY(want(ld, f, rel, "wq", KIND_MAT_ANY, qd, d, "n_head*head_dim, n_embd", &l->wq));
    TRY(want(ld, f, rel, "wk", KIND_MAT_ANY, kvd, d, "n_head_kv*head_dim, n_embd", &l->wk));
    TRY(want(ld, f, rel, "wv", KIND_MAT_ANY, kvd, d, "n_head_kv*head_dim, n_embd", &l->wv));
    TRY(want(ld, f, rel, "wo", KIND_MAT_ANY, d, qd, "n_embd, n_head*head_dim", &l->wo));
    if (hp->qkv_bias) {
        TRY(want(ld, f, rel, "bq", KIND_VEC_F32, 0, qd, "n_head*head_dim", &l->bq));
        TRY(want(ld, f, rel, "bk", KIND_VEC_F32, 0, kvd, "n_head_kv*head_dim", &l->bk));
        TRY(want(ld, f, rel, "bv", KIND_VEC_F32, 0, kvd, "n_head_kv*head_dim", &l->bv));
    }
    if (hp->qk_norm == CLB_QK_NORM_HEAD) {
        TRY(want(ld, f, rel, "q_norm", KIND_VEC_F32, 0, hp->head_dim, "head_dim", &l->q_norm));
        TRY(want(ld, f, rel, "k_norm", KIND_VEC_F32, 0, hp->head_dim, "head_dim", &l->k_norm));
    } else if (hp->qk_norm == CLB_QK_NORM_FULL) {
        TRY(want(ld, f, rel, "q_norm", KIND_VEC_F32, 0, qd, "n_head*head_dim", &l->q_norm));
        TRY(want(ld, f, rel, "k_norm", KIND_VEC_F32, 0, kvd, "n_head_kv*head_dim", &l->k_norm));
    }

    if (hp->o_bias) TRY(want(ld, f, rel, "bo", KIND_VEC_F32, 0, d, "n_embd", &l->bo));
    if (hp->attn_sinks)
        TRY(want(ld, f, rel, "sinks", KIND_VEC_F32, 0, hp->n_head, "n_head", &l->sinks));
    return load_ffn_of(ld, dir, il);
}

/* The FFN part of layer il: a dense FFN, or the router, shared experts and routed experts. */
static clb_status load_ffn_of(loader *ld, const char *dir, int64_t il) {
    clb_model *m = ld->m;
    const clb_hparams *hp = &m->hp;
    clb_layer_w *l = &m->layers[il];
    int64_t d = hp->n_embd;
    char rel[256];
    clb_wfile *f;

    l->ffn = hp->layer_ffn ? hp->layer_ffn[il] : CLB_FFN_MOE;
    if (l->ffn == CLB_FFN_DENSE) {
        snprintf(rel, sizeof rel, "dense/layer_%lld.bin", (long long)il);
        TRY(open_file(ld, dir, rel, &f));
        TRY(want(ld, f, rel, "ffn_norm", KIND_VEC_F32, 0, d, "n_embd", &l->ffn_norm));
        return load_ffn(ld, f, rel, hp->n_ff_dense, "n_ff_dense / n_embd", &l->dense);
    }

    snprintf(rel, sizeof rel, "router/layer_%lld.bin", (long long)il);
    TRY(open_file(ld, dir, rel, &f));
    TRY(want(ld, f, rel, "ffn_norm", KIND_VEC_F32, 0, d, "n_embd", &l->ffn_norm));
    TRY(want(ld, f, rel, "gate_inp", KIND_MAT_F32, hp->n_expert, d, "n_expert, n_embd",
             &l->gate_inp));
    if (hp->router == CLB_ROUTER_SIGMOID_GROUPED)
        TRY(want(ld, f, rel, "gate_bias", KIND_VEC_F32, 0, hp->n_expert, "n_expert",
                 &l->gate_bias));
    if (hp->shared_gate)
        TRY(want(ld, f, rel, "shared_gate", KIND_MAT_F32, 1, d, "1, n_embd", &l->shared_gate));
    if (hp->router_bias)
        TRY(want(ld, f, rel, "gate_inp_bias", KIND_VEC_F32, 0, hp->n_expert, "n_expert",
                 &l->gate_inp_bias));
    const clb_tensor *eb[3] = {NULL, NULL, NULL}; /* [E, F], [E, F], [E, D] */
    if (hp->expert_bias) {
        TRY(want(ld, f, rel, "exp_b1", KIND_MAT_F32, hp->n_expert, hp->n_ff, "n_expert, n_ff",
                 &eb[0]));
        TRY(want(ld, f, rel, "exp_b3", KIND_MAT_F32, hp->n_expert, hp->n_ff, "n_expert, n_ff",
                 &eb[1]));
        TRY(want(ld, f, rel, "exp_b2", KIND_MAT_F32, hp->n_expert, d, "n_expert, n_embd",
                 &eb[2]));
    }

    if (hp->n_ff_shared > 0) {
        snprintf(rel, sizeof rel, "shared/layer_%lld.bin", (long long)il);
        TRY(open_file(ld, dir, rel, &f));
        TRY(load_ffn(ld, f, rel, hp->n_ff_shared, "n_ff_shared / n_embd", &l->shared));
    }

    l->experts = &m->experts[il * hp->n_expert];
    for (int64_t e = 0; e < hp->n_expert; e++) {
        snprintf(rel, sizeof rel, "experts/layer_%lld_expert_%lld.bin", (long long)il,
                 (long long)e);
        TRY(open_file(ld, dir, rel, &f));
        m->expert_files[il * hp->n_expert + e] = f;
        TRY(load_ffn(ld, f, rel, hp->n_ff, "n_ff / n_embd", &l->experts[e]));
        if (hp->expert_bias) {
            l->experts[e].b1 = (const float *)eb[0]->data + e * hp->n_ff;
            l->experts[e].b3 = (const float *)eb[1]->data + e * hp->n_ff;
            l->experts[e].b2 = (const float *)eb[2]->data + e * d;
        }
    }
    return CLB_OK;
}

/* ---- scratch ---------------------------------------------------------------------------- */

static void *palloc(clb_model *m, size_t n, int *fail) {
    if (*fail) return NULL;
    void *p = clb_pool_alloc(m->pool, n ? n : 1);
    if (!p) *fail = 1;
    return p;
}

static size_t mm_need(const clb_tensor *t, size_t cur) {
    if (!t) return cur;
    size_t s = clb_matmul_scratch_size(t->type, t->shape[1], CLB_MAX_BATCH);
    return s > cur ? s : cur;
}

static clb_status alloc_scratch(clb_model *m, char *err) {
    const clb_hparams *hp = &m->hp;
    const size_t B = CLB_MAX_BATCH, F = sizeof(float);
    size_t d = (size_t)hp->n_embd, qd = (size_t)(hp->n_head * hp->head_dim);
    size_t kvd = (size_t)(hp->n_head_kv * hp->head_dim), e = (size_t)hp->n_expert;
    size_t k = (size_t)hp->n_expert_used;
    size_t ff = (size_t)(hp->n_ff > hp->n_ff_shared ? hp->n_ff : hp->n_ff_shared);
    if ((size_t)hp->n_ff_dense > ff) ff = (size_t)hp->n_ff_dense;
    m->span = 0;
    for (int64_t il = 0; il < hp->n_layer; il++) {
        const int32_t f = hp->layer_attn ? hp->layer_attn[il] : CLB_LAYER_SLIDING;
        clb_layer_w *l = &m->layers[il];
        l->window = f & CLB_LAYER_SLIDING ? hp->sliding_window : 0;
        l->chunk = f & CLB_LAYER_CHUNKED ? hp->attn_chunk : 0;
        l->attn_flags = l->window > 0 ? f : f & ~CLB_LAYER_SLIDING;
        int64_t w = l->window > 0 ? l->window : l->chunk;
        int64_t span = w > 0 && w < hp->n_ctx ? w : hp->n_ctx;
        if (span > m->span) m->span = span;
    }
    m->glu_clamp = (clb_glu_clamp){hp->glu_alpha, hp->glu_limit};

    size_t mm = mm_need(m->mtp_eh_proj, mm_need(m->output, mm_need(m->tok_embd, 0)));
    for (int64_t il = 0; il < hp->n_layer; il++) {
        const clb_layer_w *l = &m->layers[il];
        mm = mm_need(l->wq, mm);
        mm = mm_need(l->wk, mm);
        mm = mm_need(l->wv, mm);
        mm = mm_need(l->wo, mm);
        mm = mm_need(l->wq_a, mm);
        mm = mm_need(l->wq_b, mm);
        mm = mm_need(l->wkv_a, mm);
        mm = mm_need(l->lin_qkvz, mm);
        mm = mm_need(l->lin_ba, mm);
        mm = mm_need(l->lin_qkv, mm);
        mm = mm_need(l->lin_z, mm);
        mm = mm_need(l->lin_b, mm);
        mm = mm_need(l->lin_a, mm);
        mm = mm_need(l->lin_out, mm);
        mm = mm_need(l->dense.w1, mm);
        mm = mm_need(l->dense.w3, mm);
        mm = mm_need(l->dense.w2, mm);
        mm = mm_need(l->gate_inp, mm);
        mm = mm_need(l->shared_gate, mm);
        mm = mm_need(l->shared.w1, mm);
        mm = mm_need(l->shared.w3, mm);
        mm = mm_need(l->shared.w2, mm);
        for (int64_t j = 0; l->experts && j < hp->n_expert; j++) {
            mm = mm_need(l->experts[j].w1, mm);
            mm = mm_need(l->experts[j].w3, mm);
            mm = mm_need(l->experts[j].w2, mm);
        }
    }
    int fail = 0;
    m->x = palloc(m, B * d * F, &fail);
    m->xn = palloc(m, B * d * F, &fail);
    m->q = palloc(m, B * qd * (hp->attn_gate ? 2 : 1) * F, &fail); /* attn_gate: query, gate */
    m->k = palloc(m, B * kvd * F, &fail);
    m->v = palloc(m, B * kvd * F, &fail);
    const int mla = hp->attn == CLB_ATTN_MLA;
    const size_t H = (size_t)hp->n_head, dv = mla ? (size_t)hp->v_head_dim : 0;
    const size_t kl = (size_t)hp->kv_lora_rank, kd = kl + (size_t)hp->rotary_dim;
    m->att = palloc(m, B * (qd > H * dv ? qd : H * dv) * F, &fail);
    if (mla) {
        const size_t S = CLB_MLA_SUB < B ? CLB_MLA_SUB : B;
        const size_t dn = (size_t)(hp->head_dim - hp->rotary_dim);
        const clb_layer_w *l0 = &m->layers[0];
        size_t row = 0; /* one per-head activation row: packed for the type, or f32 */
        for (int pass = 0; pass < 2; pass++) {
            const clb_tensor *w = pass ? l0->wv_b : l0->wk_b;
            size_t n_in = pass ? kl : dn;
            size_t r = clb_act_row_size_max(w->type, (int64_t)n_in);
            if (n_in * F > r) r = n_in * F;
            if (r > row) row = r;
        }
        m->head_act_row = (row + 63) / 64 * 64;
        m->kva = palloc(m, B * kd * F, &fail);
        m->qlat = palloc(m, B * (size_t)(hp->q_lora_rank > 0 ? hp->q_lora_rank : 1) * F, &fail);
        m->qabs = palloc(m, S * H * kd * F, &fail);
        m->ctx = palloc(m, S * H * kl * F, &fail);
        m->head_act = palloc(m, S * H * m->head_act_row, &fail);
    }
    m->n_linear = 0;
    for (int64_t il = 0; il < hp->n_layer; il++)
        if (m->layers[il].mixer == CLB_MIX_LINEAR) m->layers[il].lin_index = m->n_linear++;
    if (m->n_linear > 0) {
        const size_t vd = (size_t)(hp->lin_n_v_heads * hp->lin_v_dim);
        const size_t C = (size_t)(2 * hp->lin_n_k_heads * hp->lin_k_dim) + vd;
        m->lin_p = palloc(m, B * (C + vd) * F, &fail);
        m->lin_ba = palloc(m, B * 2 * (size_t)hp->lin_n_v_heads * F, &fail);
        m->lin_c = palloc(m, B * C * F, &fail);
        m->lin_o = palloc(m, B * vd * F, &fail);
        m->lin_tmp = palloc(m, (size_t)m->n_threads *
                                   (size_t)(2 * hp->lin_k_dim + hp->lin_v_dim) * F, &fail);
    }
    m->layer_mixer = palloc(m, (size_t)hp->n_layer * sizeof(int32_t), &fail);
    m->kv_layer = palloc(m, (size_t)hp->n_layer * sizeof(int32_t), &fail);
    m->proj = palloc(m, B * d * F, &fail);
    m->mtp_cat = palloc(m, hp->mtp_input ? B * 2 * d * F : 1, &fail);
    m->rope = palloc(m, B * (size_t)hp->rotary_dim * F, &fail);
    m->inv_freq = palloc(m, (size_t)hp->rotary_dim / 2 * F, &fail);
    m->layer_ffn = palloc(m, (size_t)hp->n_layer * sizeof(int32_t), &fail);
    m->layer_attn = palloc(m, (size_t)hp->n_layer * sizeof(int32_t), &fail);
    m->probs = palloc(m, B * e * F, &fail);
    m->choice = palloc(m, e * F, &fail);
    m->top_id = palloc(m, B * k * sizeof(int32_t), &fail);
    m->top_w = palloc(m, B * k * F, &fail);
    m->e_start = palloc(m, (e + 1) * sizeof(int64_t), &fail);
    m->e_fill = palloc(m, e * sizeof(int64_t), &fail);
    m->route_tok = palloc(m, B * k * sizeof(int32_t), &fail);
    m->route_w = palloc(m, B * k * F, &fail);
    m->xg = palloc(m, B * d * F, &fail);
    m->xs = palloc(m, hp->route_input ? B * k * d * F : 1, &fail);
    m->h1 = palloc(m, B * ff * F, &fail);
    m->h3 = palloc(m, B * ff * F, &fail);
    m->eo = palloc(m, B * d * F, &fail);
    m->sgate = palloc(m, B * F, &fail);
    m->out_rows = palloc(m, B * sizeof(int32_t), &fail);
    size_t group = (size_t)(hp->n_head / hp->n_head_kv);
    m->scores = palloc(m, (size_t)m->n_threads * group * (size_t)m->span * F, &fail);
    m->head_stat = palloc(m, (size_t)m->n_threads * 2 * group * F, &fail);
    m->mm_scratch_size = mm;
    m->mm_scratch = palloc(m, mm, &fail);
    m->act = palloc(m, mm, &fail);
    size_t n_jobs = e + 3 > (size_t)hp->n_head ? e + 3 : (size_t)hp->n_head; /* MLA: a head each */
    if (n_jobs < 4) n_jobs = 4; /* a linear layer's four input projections */
    m->jobs = palloc(m, n_jobs * sizeof(clb_mm_job), &fail);
    m->ffn_list = palloc(m, e * sizeof(*m->ffn_list), &fail);
    m->xc_wait = palloc(m, 2 * e, &fail);
    m->pf_ids = palloc(m, (e + k) * sizeof(int32_t), &fail);
    if (fail) {
        clb_set_err(err, "out of memory allocating forward scratch");
        return CLB_E_NOMEM;
    }
    /* same float32 arithmetic as transformers' default rope: 1 / theta^(2i/rd); other rope
     * types come as frequencies computed by the model's family module */
    for (int64_t i = 0; i < hp->rotary_dim / 2; i++)
        m->inv_freq[i] = hp->rope_freqs ? hp->rope_freqs[i]
                                        : 1.0f / powf(hp->rope_theta,
                                                      (float)(2 * i) / (float)hp->rotary_dim);
    for (int64_t il = 0; il < hp->n_layer; il++) m->layer_ffn[il] = m->layers[il].ffn;
    m->hp.rope_freqs = m->inv_freq; /* the caller's arrays may go away after load */
    m->hp.layer_ffn = m->layer_ffn;
    for (int64_t il = 0; il < hp->n_layer; il++) m->layer_attn[il] = m->layers[il].attn_flags;
    m->hp.layer_attn = m->layer_attn;
    int32_t n_cached = 0;
    for (int64_t il = 0; il < hp->n_layer; il++) {
        m->layer_mixer[il] = m->layers[il].mixer;
        m->kv_layer[il] = m->layers[il].mixer == CLB_MIX_LINEAR ? -1 : n_cached++;
    }
    m->hp.layer_mixer = m->layer_mixer;
    return CLB_OK;
}

/* ---- load / free ----------------------------------------------------------------------- */

static clb_status load_all(clb_model *m, const char *dir, char *err) {
    const clb_hparams *hp = &m->hp;
    loader ld = {m, err};
    int64_t n_files = 1 + hp->n_layer * (2 + (hp->n_ff_shared > 0) + hp->n_expert);
    int64_t n_experts = hp->n_layer * hp->n_expert;
    m->files = calloc((size_t)n_files, sizeof(clb_wfile *));
    m->layers = calloc((size_t)hp->n_layer, sizeof(clb_layer_w));
    m->experts = calloc((size_t)(n_experts ? n_experts : 1), sizeof(clb_ffn_w));
    m->expert_files = calloc((size_t)(n_experts ? n_experts : 1), sizeof(clb_wfile *));
    if (!m->files || !m->layers || !m->experts || !m->expert_files) {
        clb_set_err(err, "out of memory for the model tables");
        return CLB_E_NOMEM;
    }
    clb_wfile *f;
    const char *rel = "embeddings.bin";
    TRY(open_file(&ld, dir, rel, &f));
    TRY(want(&ld, f, rel, "tok_embd", KIND_MAT_ANY, hp->n_vocab, hp->n_embd, "n_vocab, n_embd",
             &m->tok_embd));
    TRY(want(&ld, f, rel, "output_norm", KIND_VEC_F32, 0, hp->n_embd, "n_embd", &m->output_norm));
    if (hp->tie_embeddings) {
        if (clb_wfile_find(f, "output")) {
            clb_set_err(err, "%s: has an 'output' tensor but the config says tie_embeddings", rel);
            return CLB_E_SHAPE;
        }
        m->output = m->tok_embd;
    } else {
        TRY(want(&ld, f, rel, "output", KIND_MAT_ANY, hp->n_vocab, hp->n_embd, "n_vocab, n_embd",
                 &m->output));
    }
    if (hp->mtp_input) {
        TRY(want(&ld, f, rel, "mtp_enorm", KIND_VEC_F32, 0, hp->n_embd, "n_embd", &m->mtp_enorm));
        TRY(want(&ld, f, rel, "mtp_hnorm", KIND_VEC_F32, 0, hp->n_embd, "n_embd", &m->mtp_hnorm));
        TRY(want(&ld, f, rel, "mtp_eh_proj", KIND_MAT_ANY, hp->n_embd, 2 * hp->n_embd,
                 "n_embd, 2*n_embd", &m->mtp_eh_proj));
    }
    for (int64_t il = 0; il < hp->n_layer; il++) TRY(load_layer(&ld, dir, il));
    return alloc_scratch(m, err);
}

clb_status clb_model_load(const char *dir, const clb_hparams *hp, int n_threads, clb_model **out,
                          char *err) {
    if (err) err[0] = '\0';
    if (!out || !dir || !hp) {
        clb_set_err(err, "clb_model_load: NULL argument");
        return CLB_E_ARG;
    }
    *out = NULL;
    clb_kernels_init();
    clb_status st = check_hparams(hp, err);
    if (st != CLB_OK) return st;
    clb_model *m = calloc(1, sizeof(*m));
    if (!m) {
        clb_set_err(err, "out of memory");
        return CLB_E_NOMEM;
    }
    m->hp = *hp;
    if (n_threads <= 0) n_threads = clb_physical_cores();
    if (n_threads <= 0) n_threads = 1;
    if (n_threads > 256) n_threads = 256;
    m->pool = clb_pool_init();
    if (!m->pool) {
        free(m);
        clb_set_err(err, "out of memory creating the memory pool");
        return CLB_E_NOMEM;
    }
    st = clb_threadpool_init(&m->tp, n_threads);
    if (st != CLB_OK) {
        clb_set_err(err, "cannot start %d worker threads", n_threads);
        clb_model_free(m);
        return st;
    }
    m->n_threads = clb_threadpool_n_threads(m->tp);
    st = load_all(m, dir, err);
    if (st != CLB_OK) {
        clb_model_free(m);
        return st;
    }
    *out = m;
    return CLB_OK;
}

void clb_model_free(clb_model *m) {
    if (!m) return;
    clb_xc_free(m->xc); /* joins its readers before the files they read are closed */
    if (m->tp) clb_threadpool_free(m->tp);
    if (m->files)
        for (int i = 0; i < m->n_files; i++) clb_wfile_close(m->files[i]);
    free(m->files);
    free(m->layers);
    free(m->experts);
    free(m->expert_files);
    if (m->pool) clb_pool_free_all(m->pool); /* releases every scratch buffer at once */
    free(m);
}

const clb_hparams *clb_model_hparams(const clb_model *m) { return &m->hp; }

void clb_model_product_stats(const clb_model *m, clb_product_stats *out) { *out = m->prod; }

int clb_model_n_threads(const clb_model *m) { return m->n_threads; }

int64_t clb_forward_max_batch(void) { return CLB_MAX_BATCH; }

clb_status clb_model_weight_fault(const clb_model *m, char *err) {
    for (int i = 0; i < m->n_files; i++) {
        const char *path = clb_wfile_changed(m->files[i]);
        if (!path) continue;
        clb_set_err(err, "weight file changed: %s was truncated or overwritten while the model was "
                    "loaded; restart to load it again", path);
        return CLB_E_IO;
    }
    return CLB_OK;
}
