/* Colibri model internals shared by model.c, kv.c and forward.c (not part of the public API).
 * Guarantees: every tensor pointer below was validated against the file and the hparams at
 * load; every scratch buffer is sized for CLB_MAX_BATCH tokens, so forward never allocates.
 * Refuses: nothing here is for callers outside csrc/. */
#ifndef CLB_MODEL_INTERNAL_H
#define CLB_MODEL_INTERNAL_H

#include "clb_model.h"
#include "clb_kernels.h"
#include "clb_pool.h"
#include "clb_wfault.h"

/* Tokens one internal forward chunk carries; longer calls are split (see clb_forward). */
#define CLB_MAX_BATCH 512
/* Most expert groups a grouped router may have (DeepSeek-V3 and GLM use 8 or 1). */
#define CLB_MAX_GROUPS 64
/* Tokens MLA absorbs and attends at once (bounds its per-head scratch). */
#define CLB_MLA_SUB 64

typedef struct {
    const clb_tensor *w1, *w3, *w2; /* [F, D] gate, [F, D] up, [D, F] down */
    const float *b1, *b3, *b2;      /* [F], [F], [D] biases, NULL unless expert_bias (they
                                       stay resident in the router file) */
} clb_ffn_w;

typedef struct {
    int32_t ffn;                            /* clb_ffn_kind */
    int32_t mixer;                          /* clb_mixer_kind */
    const clb_tensor *attn_norm;            /* [D] */
    const clb_tensor *wq, *wk, *wv, *wo;    /* [H*hd, D], [Hkv*hd, D] x2, [D, H*hd] */
    const clb_tensor *bq, *bk, *bv;         /* NULL unless qkv_bias */
    const clb_tensor *bo;                   /* [D] or NULL unless o_bias */
    const clb_tensor *q_norm, *k_norm;      /* NULL unless qk_norm */
    const clb_tensor *sinks;                /* [H] f32 or NULL unless attn_sinks */
    int64_t window;                         /* keys a query sees at most; 0: all */
    int64_t chunk;                          /* keys in the query's chunk of this length; 0: off */
    int32_t attn_flags;                     /* clb_layer_attn_bit */
    /* MLA (wq above when q_lora_rank is 0; ql = q_lora_rank, kl = kv_lora_rank, dn = head_dim
     * - rotary_dim, dv = v_head_dim) */
    const clb_tensor *wq_a, *q_a_norm, *wq_b; /* [ql, D], [ql], [H*hd, ql] */
    const clb_tensor *wkv_a, *kv_a_norm;    /* [kl + rotary_dim, D], [kl] */
    const clb_tensor *wk_b, *wv_b;          /* [H*kl, dn] per head k up-projection, transposed;
                                               [H*dv, kl] per head v up-projection */
    /* linear attention (nk, nv heads of dk, dv; conv channels C = 2*nk*dk + nv*dv) */
    const clb_tensor *lin_qkvz;             /* [C + nv*dv, D]: q, k, v (the conv's channels),
                                               then z (the output gate) */
    const clb_tensor *lin_ba;               /* [2*nv, D]: b (beta logits), then a (decay) */
    const clb_tensor *lin_qkv, *lin_z;      /* or lin_qkvz as two matrices [C, D], [nv*dv, D] */
    const clb_tensor *lin_b, *lin_a;        /* or lin_ba as two [nv, D] (Qwen3.5) */
    const clb_tensor *lin_conv;             /* [C, lin_conv] f32 depthwise conv weights */
    const clb_tensor *lin_dt_bias, *lin_a_log; /* [nv] f32 */
    const clb_tensor *lin_norm;             /* [dv] f32 gated RMSNorm weight */
    const clb_tensor *lin_out;              /* [D, nv*dv] */
    int64_t lin_index;                      /* this layer's place among the linear layers */
    const clb_tensor *ffn_norm;             /* [D] */
    const clb_tensor *gate_inp;             /* [E, D] f32; NULL in a dense layer */
    const clb_tensor *gate_bias;            /* [E] f32 selection bias (grouped router) or NULL */
    const clb_tensor *gate_inp_bias;        /* [E] f32 router logit bias or NULL */
    const clb_tensor *shared_gate;          /* [1, D] f32 or NULL */
    clb_ffn_w shared;                       /* all NULL unless n_ff_shared > 0 */
    clb_ffn_w *experts;                     /* [E], points into clb_model.experts */
    clb_ffn_w dense;                        /* the FFN of a dense layer ([n_ff_dense, D]) */
} clb_layer_w;

struct clb_model {
    clb_hparams hp;
    clb_pool *pool;
    clb_threadpool *tp;
    int n_threads;

    int n_files;
    clb_wfile **files;          /* [n_files], closed at free */

    const clb_tensor *tok_embd;    /* [V, D] */
    const clb_tensor *output_norm; /* [D] */
    const clb_tensor *output;      /* [V, D]; tok_embd when tied */
    const clb_tensor *mtp_enorm, *mtp_hnorm; /* [D] each, mtp_input only */
    const clb_tensor *mtp_eh_proj; /* [D, 2D], mtp_input only */
    clb_layer_w *layers;           /* [L] */
    clb_ffn_w *experts;            /* [L * E] */
    clb_wfile **expert_files;      /* [L * E] the file of each expert */
    struct clb_xcache *xc;         /* expert cache, NULL: every expert read through its mapping */
    int experts_x8;                /* routed experts repacked at load (clb_model_repack) */
    clb_product_stats prod;        /* the forward pass's weight products (clb_forward) */

    /* scratch, B = CLB_MAX_BATCH rows each */
    float *x;        /* [B, D] residual stream */
    float *xn;       /* [B, D] normed input of the current block */
    float *q;        /* [B, H*hd] */
    float *k, *v;    /* [B, Hkv*hd] */
    float *att;      /* [B, H*max(hd, dv)] attention output (pre o-projection) */
    /* MLA scratch (NULL otherwise); S = CLB_MLA_SUB tokens */
    float *kva;      /* [B, kl + rotary_dim] latent rows of the chunk */
    float *qlat;     /* [B, ql] query's low-rank step */
    float *qabs;     /* [S, H*(kl + rotary_dim)] queries absorbed into the latent space */
    float *ctx;      /* [S, H*kl] attention output in the latent space */
    void *head_act;  /* [H, S] per-head activation rows of one dispatch (packed or f32) */
    size_t head_act_row; /* bytes of one row in head_act */
    float *proj;     /* [B, D] o-projection / MoE output */
    float *mtp_cat;  /* [B, 2D] an mtp_input layer's normed embedding and hidden state */
    float *rope;     /* [B, rotary_dim]: cos of the rotary_dim/2 frequencies, then sin */
    float *inv_freq; /* [rotary_dim/2] (hp.rope_freqs points here after load) */
    int32_t *layer_ffn; /* [n_layer] (hp.layer_ffn points here after load) */
    int32_t *layer_attn; /* [n_layer] (hp.layer_attn points here after load) */
    int32_t *layer_mixer; /* [n_layer] (hp.layer_mixer points here after load) */
    int64_t n_linear;     /* layers with linear attention */
    int32_t *kv_layer;    /* [n_layer] index among the layers that cache K/V, -1: linear */
    /* linear-attention scratch (NULL without such layers) */
    float *lin_p;    /* [B, C + nv*dv] projected q, k, v (conv input), z */
    float *lin_ba;   /* [B, 2*nv] b, a; then beta and the decay factor exp(g) */
    float *lin_c;    /* [B, C] conv output: q, k (L2-normed, q scaled), v */
    float *lin_o;    /* [B, nv*dv] the recurrence's output, then gated-normed */
    float *lin_tmp;  /* [n_threads, 2*dk + dv] one worker's normed q, k and the delta */
    float *probs;    /* [B, E] router probabilities */
    float *choice;   /* [E] one token's selection scores (grouped router) */
    int32_t *top_id; /* [B, K] */
    float *top_w;    /* [B, K] */
    int64_t *e_start;  /* [E+1] start of each expert's group in route_* */
    int64_t *e_fill;   /* [E] fill cursor */
    int32_t *route_tok; /* [B*K] token index, grouped by expert, tokens ascending */
    float *route_w;     /* [B*K] routing weight */
    float *xg;       /* [B, D] rows gathered for one expert */
    float *xs;       /* [B*K, D] routed experts' inputs scaled by their weights (route_input) */
    float *h1, *h3;  /* [B, max(F, Fs)] */
    float *eo;       /* [B, D] expert output */
    float *sgate;    /* [B] shared expert gate logits */
    int32_t *out_rows; /* [B] chunk rows that want logits */
    float *scores;   /* [n_threads, H/Hkv, span] attention scores per worker and head */
    float *head_stat; /* [n_threads, 2, H/Hkv] per head: max score, then 1 / sum of exps */
    int64_t span;    /* most keys one query sees in any layer: n_ctx, or the window / chunk */
    clb_glu_clamp glu_clamp; /* hp's clamp, for jobs when glu is CLB_GLU_SWIGLU_CLAMP */
    void *mm_scratch;  /* [B] packed activation rows for clb_matmul (any n_in) */
    size_t mm_scratch_size;
    void *act;         /* [B] packed activation rows shared by the jobs of one dispatch */
    clb_mm_job *jobs;  /* [E + 3] jobs of one dispatch */
    const clb_ffn_w **ffn_list; /* [E] the experts of one dispatch */
    uint8_t *xc_wait;  /* [2E] experts of one dispatch still loading (expert cache), then
                        * those the next run skips */
    int32_t *pf_ids;   /* [E + K] predicted experts of the next layer, then one token's */
};

struct clb_kv {
    clb_pool *pool;
    const clb_model *model; /* the model this cache was made for */
    clb_kv_type type;
    int64_t n_blocks;
    int64_t n_layer, n_head_kv, head_dim; /* cached layers of the full pool (the attention ones
                                             outside the windowed pool), cached heads per
                                             position and their row width */
    const int32_t *kv_layer; /* [model n_layer] a layer's index among the cached ones of its
                                pool (-1: a linear-attention layer, which caches nothing per
                                position) */
    /* the windowed pool (n_win_blocks > 0): layers whose queries see a sliding window or their
     * own chunk keep their rows here, in blocks of their own addressed by clb_batch.win_tables,
     * so blocks that left every window can go back while the full layers' blocks stay */
    int64_t n_win_blocks;
    const uint8_t *win_layer; /* [model n_layer] 1: the layer caches in the windowed pool; NULL
                                 when there is no such pool */
    int64_t win_window, win_chunk; /* largest window / chunk among the windowed layers (0: none) */
    size_t win_block_bytes;   /* one windowed-pool block: the windowed layers' rows */
    unsigned char *win_data;  /* [L_win, n_kinds, n_head_kv, n_win_blocks, CLB_KV_BLOCK, head_bytes] */
    int32_t *win_writer;      /* [n_win_blocks] forward's validation scratch: -1 between calls */
    int32_t *seq_lo;          /* [n_blocks] forward's validation scratch: a sequence's first
                                 windowed-pool entry read in the call */
    int64_t n_kinds;        /* 2: K and V rows; 1: one latent row (MLA), values its first v_dim */
    int64_t v_dim;          /* value width read by attention */
    size_t head_bytes;      /* one position's K (or V) values of one kv head, q8 scale included */
    size_t q8_scale_off;    /* q8: offset of the f32 scale in a head's values */
    size_t block_bytes;     /* head_bytes * CLB_KV_BLOCK * n_head_kv * n_kinds * n_layer */
    /* [L, n_kinds (K, V), n_head_kv, n_blocks, CLB_KV_BLOCK, head_bytes]: one kv head's positions of
     * a block are contiguous and the next block's follow them, so attention over a sequence
     * whose blocks are numbered in order reads one stream per head, as the hardware
     * prefetchers like */
    unsigned char *data;
    int32_t *writer;        /* [n_blocks] forward's validation scratch: -1 between calls */
    int32_t *seq_next;      /* [n_blocks] forward's validation scratch (one per sequence) */
    float *deq;             /* [n_threads, CLB_KV_BLOCK, head_dim] one block's widened rows */
    /* recurrent-state slots (models with linear attention; clb_kv_states_init) */
    int64_t n_slots;
    int64_t n_lin;          /* linear layers (each keeps its part of every slot) */
    size_t slot_floats;     /* floats per slot: per linear layer conv window, then S */
    float *state;           /* [n_slots, slot_floats] */
    int64_t *state_len;     /* [n_slots, n_lin] positions each linear layer absorbed; -1:
                             * unusable until position 0 (a span of layers advances its own) */
    int32_t *slot_user;     /* [n_slots] forward's validation scratch: -1 between calls */
};

/* After a step during which some mapping faulted (clb_wfault_any()): CLB_E_IO naming the
 * first of m's files that changed (the step's K/V rows and logits are void: they were
 * computed from zeros); CLB_OK when the fault was in another model's files. */
clb_status clb_model_weight_fault(const clb_model *m, char *err);

/* Whether matrix t is copied into the interleaved layout (repack.c): a q8/q4 matrix of whole
 * 8-row groups that the active ISA's products read faster interleaved. The load-time repack
 * and the expert cache's in-slot repack both ask this. */
int clb_tensor_repacks(const clb_tensor *t);

/* bytes of one cached value: f32, f16, or q8's int8 (whose scales follow the values) */
static inline size_t clb_kv_elem_bytes(clb_kv_type t) {
    return t == CLB_KV_F32 ? sizeof(float) : t == CLB_KV_F16 ? sizeof(clb_f16) : 1;
}

/* K (kind 0) or V (kind 1) values of kv head kvh of layer il in block blk, slot `slot`
 * (head_dim values of the cache's type, then q8's scale); the block's next slots follow,
 * head_bytes apart, then block blk + 1's. */
static inline unsigned char *clb_kv_head(const clb_kv *kv, int64_t blk, int64_t il, int kind,
                                         int64_t kvh, int64_t slot) {
    const int win = kv->win_layer && kv->win_layer[il];
    const int64_t nb = win ? kv->n_win_blocks : kv->n_blocks;
    il = kv->kv_layer[il];
    size_t r = (size_t)((((il * kv->n_kinds + kind) * kv->n_head_kv + kvh) * nb + blk) *
                            CLB_KV_BLOCK + slot); /* < nb * its pool's block bytes / head_bytes */
    return (win ? kv->win_data : kv->data) + r * kv->head_bytes;
}

/* The block tables layer il reads and writes through: the windowed pool's for a layer cached
 * there, else the full pool's ([n_seq, max_blocks] either way). */
static inline const int32_t *clb_kv_tables(const clb_kv *kv, const clb_batch *b, int64_t il) {
    return kv->win_layer && kv->win_layer[il] ? b->win_tables : b->block_tables;
}

/* Lowest position a query at p reads in any windowed layer of kv (its windowed-pool blocks
 * below this one's are never read again by later positions either). */
static inline int64_t clb_kv_win_lo(const clb_kv *kv, int64_t p) {
    int64_t lo = p;
    if (kv->win_window > 0) lo = p - kv->win_window + 1 > 0 ? p - kv->win_window + 1 : 0;
    if (kv->win_chunk > 0 && p - p % kv->win_chunk < lo) lo = p - p % kv->win_chunk;
    return lo;
}

/* Stores one position's f32 values (n_head_kv heads of head_dim) as K (kind 0) or V (kind 1)
 * of layer il in block blk, slot `slot`, in the cache's format (kv.c). */
void clb_kv_store(const clb_kv *kv, int64_t blk, int64_t il, int kind, int64_t slot,
                  const float *x);
/* q8 KV values widened for attention (kv.c): n values into y (f16 rows go through the F16
 * type's to_float of the active ISA). */
void clb_kv_i8_to_f32(int64_t n, const int8_t *restrict x, float *restrict y);

/* Layers of hp that cache K/V (every layer but the linear-attention ones). */
int64_t clb_hp_n_attn_layers(const clb_hparams *hp);
/* Floats one linear layer keeps per state slot: its conv window, then its DeltaNet state. */
int64_t clb_lin_conv_floats(const clb_hparams *hp);
int64_t clb_lin_state_floats(const clb_hparams *hp);

#endif
