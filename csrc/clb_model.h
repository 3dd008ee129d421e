/* Colibri model: weight files mapped read-only, validated, and the forward pass over them.
 * Guarantees: every header, offset and size is checked against the real file length before a
 * tensor byte is read; shapes and dtypes are checked against the hyper-parameters; errors come
 * back as a status plus a message naming the file and tensor.
 * Refuses: block kinds outside clb_ffn_kind / clb_router_kind; tensors that overlap or run past
 * EOF. */
#ifndef CLB_MODEL_H
#define CLB_MODEL_H

#include "clb_types.h"
#include "clb_threadpool.h"

#define CLB_ERR_LEN 512

typedef enum { CLB_QK_NORM_NONE = 0, CLB_QK_NORM_HEAD = 1, CLB_QK_NORM_FULL = 2 } clb_qk_norm;

/* The blocks a layer is made of. A model family is a choice among these, made in Python
 * (engine/models/<family>.py) and handed over through clb_hparams: which FFN each layer has,
 * how its router picks experts, which optional attention tensors exist. */
typedef enum {
    CLB_FFN_MOE = 0,   /* routed experts (+ shared experts when n_ff_shared > 0) */
    CLB_FFN_DENSE = 1, /* one SiLU-gated FFN of width n_ff_dense */
} clb_ffn_kind;
typedef enum {
    CLB_ATTN_GQA = 0, /* q/k/v heads of head_dim, n_head_kv K/V heads cached per position */
    CLB_ATTN_MLA = 1, /* multi-head latent attention (DeepSeek): one latent row of kv_lora_rank
                         + rotary_dim values cached per position; queries absorbed into it */
} clb_attn_kind;
typedef enum {
    CLB_ROUTER_SOFTMAX = 0,         /* softmax over the logits, top-k (within the best
                                       topk_group of n_group groups by their best score),
                                       optional renormalising, times routed_scale */
    CLB_ROUTER_SIGMOID_GROUPED = 1, /* sigmoid scores; selection on scores + a per-expert bias
                                       within the best topk_group of n_group groups; weights
                                       are the plain scores (optionally renormalised) times
                                       routed_scale */
    CLB_ROUTER_SIGMOID_TOPK = 2,    /* the K largest logits, each weighted by its sigmoid
                                       (Llama 4) */
} clb_router_kind;

/* Per-layer attention options: the bits of clb_hparams.layer_attn[il]. A layer sees all the
 * earlier keys of its sequence unless SLIDING or CHUNKED narrows them. */
typedef enum {
    CLB_LAYER_SLIDING = 1, /* keys of the last sliding_window positions only */
    CLB_LAYER_CHUNKED = 2, /* keys of the query's own chunk only: [p - p % attn_chunk, p] */
    CLB_LAYER_NOPE = 4,    /* no rotary embedding on q and k */
    CLB_LAYER_QK_L2 = 8,   /* each q and k head RMS-normalised without a weight, after RoPE */
    CLB_LAYER_TEMP = 16,   /* queries scaled by position (attn_temp_floor, attn_temp_scale) */
} clb_layer_attn_bit;
#define CLB_LAYER_ATTN_ALL 31

/* What mixes tokens in a layer: attention over the paged KV cache, or a gated DeltaNet linear
 * attention (Qwen3-Next) whose conv and recurrent state per sequence live in state slots
 * beside the KV cache (csrc/linear_attn.c). */
typedef enum {
    CLB_MIX_ATTN = 0,
    CLB_MIX_LINEAR = 1,
} clb_mixer_kind;

typedef enum {
    CLB_GLU_SILU = 0,         /* silu(gate) * up */
    CLB_GLU_SWIGLU_CLAMP = 1, /* gate clamped above at limit, up to [-limit, limit]:
                                 gate * sigmoid(alpha * gate) * (up + 1) (gpt-oss) */
} clb_glu_kind;

/* Hyper-parameters, filled by Python from config.json (engine/models/config.py). */
typedef struct {
    int64_t n_vocab, n_embd, n_layer, n_head, n_head_kv, head_dim;
    int32_t attn;          /* clb_attn_kind */
    int64_t q_lora_rank;   /* MLA: width of the query's low-rank step; 0: q straight from x */
    int64_t kv_lora_rank;  /* MLA: latent width (the cached row holds it + rotary_dim) */
    int64_t v_head_dim;    /* MLA: value width per head (GQA: head_dim) */
    float attn_scale;      /* softmax scale of q.k; 0: 1/sqrt(head_dim) */
    int64_t n_ff, n_expert, n_expert_used; /* routed experts; 0 when no layer is MoE */
    int64_t n_ff_shared;   /* 0: no shared expert */
    int64_t n_ff_dense;    /* width of the dense layers' FFN; 0 when no layer is dense */
    int32_t shared_gate;   /* shared expert scaled by sigmoid(shared_gate . x) */
    int32_t norm_topk_prob;
    int32_t router;        /* clb_router_kind */
    int64_t n_group, topk_group; /* experts in n_group groups, top-k from topk_group of them */
    float routed_scale;    /* routed experts' weights are multiplied by it (1: off) */
    int32_t qk_norm;       /* clb_qk_norm */
    int32_t qkv_bias;
    int32_t o_bias;        /* the output projection has a bias */
    int32_t tie_embeddings;
    float clip_qkv;        /* <= 0: off */
    float rope_theta;
    int64_t rotary_dim;    /* <= head_dim, even: rotary part of each head (GQA: the first
                              dims; MLA: the last, after head_dim - rotary_dim plain ones) */
    float rope_scale;      /* cos and sin are multiplied by it (1: plain RoPE) */
    float rms_eps;
    int64_t sliding_window; /* <= 0: off */
    int32_t attn_sinks;    /* GQA: a learned logit per query head (tensor "sinks" [n_head]) joins
                              every softmax's denominator (gpt-oss) */
    int64_t attn_chunk;    /* chunk length of CLB_LAYER_CHUNKED layers; 0 when none is chunked */
    float attn_temp_floor, attn_temp_scale; /* CLB_LAYER_TEMP: a query at position p is
                              multiplied by 1 + attn_temp_scale * log1p(floor((p + 1) /
                              attn_temp_floor)) (Llama 4's NoPE layers) */
    int32_t route_input;   /* routed experts compute expert(w * x) rather than w * expert(x)
                              (Llama 4; the SiLU makes the two differ) */
    int32_t router_bias;   /* the router's logits have a bias (tensor "gate_inp_bias" [n_expert]) */
    int32_t expert_bias;   /* routed experts' gate, up and down have biases (tensors "exp_b1",
                              "exp_b3" [n_expert, n_ff] and "exp_b2" [n_expert, n_embd] in the
                              router file) */
    int32_t glu;           /* clb_glu_kind: the gated activation of every FFN */
    float glu_alpha, glu_limit; /* CLB_GLU_SWIGLU_CLAMP's sigmoid gain and clamp */
    int32_t attn_gate;     /* GQA: wq gives each head's query then as many gate rows; the
                              attention output is multiplied by sigmoid(gate) (Qwen3-Next) */
    /* gated DeltaNet linear attention (layers whose layer_mixer is CLB_MIX_LINEAR) */
    int64_t lin_n_k_heads, lin_n_v_heads; /* query/key heads, value heads (a multiple) */
    int64_t lin_k_dim, lin_v_dim;         /* per-head widths */
    int64_t lin_conv;                     /* causal conv1d kernel width, >= 2 */
    int64_t n_ctx;         /* KV capacity per sequence */
    /* per-model arrays, copied at load (the caller's may go away after clb_model_load) */
    const float *rope_freqs;   /* [rotary_dim / 2] inverse frequencies (YaRN, llama3, ...);
                                  NULL: 1 / rope_theta^(2i / rotary_dim) */
    const int32_t *layer_ffn;  /* [n_layer] clb_ffn_kind; NULL: every layer CLB_FFN_MOE */
    const int32_t *layer_attn; /* [n_layer] clb_layer_attn_bit flags; NULL: every layer
                                  CLB_LAYER_SLIDING (which changes nothing while
                                  sliding_window is 0) */

    const int32_t *layer_mixer; /* [n_layer] clb_mixer_kind; NULL: every layer CLB_MIX_ATTN */
    int32_t mtp_input;     /* a multi-token-prediction layer (DeepSeek-V3, GLM-4.5, Qwen3-Next):
                              its input is mtp_eh_proj @ [rmsnorm(embed(token), mtp_enorm);
                              rmsnorm(h, mtp_hnorm)], h being clb_batch.hidden_in (the main
                              model's output after its final norm, or this layer's own); the
                              embedding half is zero at position 0, as vLLM's DeepSeek MTP,
                              unless mtp_keep_first */
    int32_t mtp_keep_first; /* 0 or 1: the embedding half is kept at position 0 too (Qwen3-Next's
                              MTP, which vLLM does not mask) */
} clb_hparams;

/* One weight file mapped read-only. */
typedef struct {
    char name[64];
    clb_type type;
    int32_t n_dims;
    int64_t shape[4];
    const void *data;
    size_t nbytes;
} clb_tensor;

typedef struct clb_wfile clb_wfile;

/* err buffers passed to the functions below hold CLB_ERR_LEN bytes. A file that does not exist
 * is CLB_E_IO with a message starting "missing file: " (the binding maps it to
 * FileNotFoundError); any other open/stat/mmap failure is CLB_E_IO with strerror's text. */
clb_status clb_wfile_open(const char *path, clb_wfile **out, char *err);
void clb_wfile_close(clb_wfile *f);
int clb_wfile_n_tensors(const clb_wfile *f);
const clb_tensor *clb_wfile_tensor(const clb_wfile *f, int i);
const clb_tensor *clb_wfile_find(const clb_wfile *f, const char *name);
/* The file's path when it was truncated under its mapping since it was opened (its data now
 * reads as zeros, see csrc/wfault.c), else NULL. */
const char *clb_wfile_changed(const clb_wfile *f);
/* The file's path as opened, and the file offset of a byte of its mapping (p must point into
 * one of its tensors). */
const char *clb_wfile_path(const clb_wfile *f);
size_t clb_wfile_offset(const clb_wfile *f, const void *p);

typedef struct clb_model clb_model;
typedef struct clb_kv clb_kv;

/* dir: a Colibri model folder; n_threads <= 0: physical cores. Checks hp, opens every file
 * of the layout in docs/INTERNALS.md, checks each tensor's dtype and shape, and allocates
 * all forward scratch once. */
clb_status clb_model_load(const char *dir, const clb_hparams *hp, int n_threads, clb_model **out, char *err);
void clb_model_free(clb_model *m);

/* Paged KV cache: one pool of n_blocks blocks shared by every sequence. A block holds the K
 * and V rows of CLB_KV_BLOCK consecutive positions of one sequence, for every layer; which
 * block holds which positions is the caller's business (a block table per sequence, passed
 * with each forward call). The cache keeps no per-sequence state (but for the recurrent-state
 * slots of a model with linear attention, below): sequence lengths, block allocation and
 * prefix sharing live with the caller. */
#define CLB_KV_BLOCK 16 /* positions per block */

typedef enum {
    CLB_KV_F32 = 0,
    CLB_KV_F16 = 1, /* round to nearest even */
    CLB_KV_Q8 = 2,  /* int8 with one f32 scale per (position, kv head) row of head_dim */
} clb_kv_type;

/* Bytes of one block (K and V, all layers); 0 if hp or type is invalid or the size overflows. */
size_t clb_kv_block_bytes(const clb_hparams *hp, clb_kv_type type);
/* n_blocks in 1..INT32_MAX; the storage comes from a pool (mmap'd when large, so blocks never
 * written cost no RAM). CLB_E_ARG for bad arguments, CLB_E_RANGE if the size overflows. */
clb_status clb_kv_init(const clb_model *m, int64_t n_blocks, clb_kv_type type, clb_kv **out);
/* The same with the layers whose queries see only a sliding window or their own chunk
 * (sliding_window / attn_chunk) in a second pool of n_win_blocks blocks, addressed through
 * clb_batch.win_tables: a sequence needs only the blocks of that pool its window still covers,
 * so their count stays bounded however long it grows. n_win_blocks 0 is clb_kv_init.
 * CLB_E_ARG when n_win_blocks > 0 and the model has no windowed layer or no other attention
 * layer, or is not GQA. */
clb_status clb_kv_init_windowed(const clb_model *m, int64_t n_blocks, int64_t n_win_blocks,
                                clb_kv_type type, clb_kv **out);
/* Bytes of one block of the full pool (*full: the layers every query sees whole) and of the
 * windowed pool (*win) when the windowed layers are split off; CLB_E_ARG when hp has no such
 * split (see clb_kv_init_windowed) or the type is invalid. */
clb_status clb_kv_split_block_bytes(const clb_hparams *hp, clb_kv_type type, size_t *full,
                                    size_t *win);
void clb_kv_free(clb_kv *kv);
int64_t clb_kv_n_blocks(const clb_kv *kv);
/* Blocks of the windowed pool (0: none) and the bytes one block of each pool holds. */
int64_t clb_kv_n_win_blocks(const clb_kv *kv);
size_t clb_kv_pool_block_bytes(const clb_kv *kv, int windowed);
clb_kv_type clb_kv_get_type(const clb_kv *kv);

/* Recurrent-state slots of a model with linear-attention layers: per slot and linear layer
 * the conv window (lin_conv - 1 inputs) and the DeltaNet state [lin_n_v_heads, lin_k_dim,
 * lin_v_dim], f32. A forward call names each sequence's slot (clb_batch.state_slots); a
 * sequence whose first position in a call is 0 starts from a zero state, any other first
 * position must equal the positions its slot has absorbed (the state cannot be rewound).
 * clb_kv_state_bytes: one slot's bytes (0 without linear layers). clb_kv_states_init
 * allocates n_slots slots (once, 1..INT32_MAX; CLB_E_ARG without linear layers).
 * clb_kv_state_copy makes dst what src is (n > 1 sequences forked from one prompt);
 * clb_kv_state_len: positions every linear layer of slot has absorbed (-1: none usable, after
 * a failed call). */
size_t clb_kv_state_bytes(const clb_hparams *hp);
/* Copies every layer's rows of block src into block dst (a fork's copy of a partly filled
 * block it would otherwise share with the sequence it forks from). CLB_E_ARG for bad ids. */
clb_status clb_kv_block_copy(clb_kv *kv, int64_t dst, int64_t src);
clb_status clb_kv_states_init(clb_kv *kv, int64_t n_slots);
int64_t clb_kv_n_state_slots(const clb_kv *kv);
clb_status clb_kv_state_copy(clb_kv *kv, int64_t dst, int64_t src);
int64_t clb_kv_state_len(const clb_kv *kv, int64_t slot);

/* One forward call's tokens and the block tables of its sequences. */
typedef struct {
    int64_t n_tokens;
    const int32_t *tokens;       /* [n_tokens] */
    const int32_t *seq_ids;      /* [n_tokens]: index into this call's sequences, 0..n_seq-1 */
    const int32_t *positions;    /* [n_tokens] */
    const uint8_t *want_logits;  /* [n_tokens], NULL: every token */
    int32_t n_seq;               /* rows of block_tables, 1..n_blocks */
    int32_t max_blocks;          /* row length of block_tables */
    const int32_t *block_tables; /* [n_seq, max_blocks]: block id holding positions [16j, 16j+16)
                                    of sequence s; -1 = none */
    int32_t *routes;             /* [n_tokens, n_layer, n_expert_used] or NULL: receives the
                                    experts each token chose in each layer, in rank order */
    const int32_t *state_slots;  /* [n_seq] each sequence's recurrent-state slot: needed by a
                                    model with linear-attention layers, ignored otherwise */
    const int32_t *win_tables;   /* [n_seq, max_blocks] windowed-pool block of positions
                                    [16j, 16j+16) of sequence s, -1 = none (a block that left
                                    every window was given back): needed by a cache with a
                                    windowed pool (clb_kv_init_windowed), ignored otherwise */
    const float *hidden_in;      /* [n_tokens, n_embd]: needed by an mtp_input model (each
                                    token's previous hidden state), ignored otherwise */
    float *hidden_out;           /* [n_tokens, n_embd] or NULL: receives every token's hidden
                                    state after the last layer, before the final norm, or after
                                    it with hidden_out_normed */
    int32_t hidden_out_normed;
} clb_batch;

/* One forward step over a batch of tokens. Token i (sequence s = seq_ids[i], position
 * p = positions[i]) writes its K/V rows into block block_tables[s][p / 16], slot p % 16, then
 * attends over positions [lo, p] of s (lo > 0 only with a sliding window), read through s's
 * table. The caller guarantees that every position of s below its first position in this call
 * was written by an earlier call into the blocks the table names now (blocks may be shared
 * read-only between sequences, e.g. a common prompt prefix).
 * Everything is validated before any computation, so a refused call changes nothing: token ids
 * in the vocabulary; seq ids in 0..n_seq-1; positions in 0..n_ctx-1 (CLB_E_RANGE past n_ctx);
 * a sequence's positions consecutive and increasing within the call; every table entry a token
 * needs (blocks 0..p/16 of its sequence) in 0..n_blocks-1; no block written by two sequences or
 * at two table indices of one sequence. Errors are CLB_E_ARG / CLB_E_RANGE with a message in
 * err. Logits are written for each token i with want_logits[i] != 0 (all tokens when
 * want_logits is NULL), in order, into logits[n_out, n_vocab]. Calls longer than
 * clb_forward_max_batch() tokens are run as consecutive chunks, which gives the same result.
 * A token's result does not depend on the other tokens of the call.
 * Not reentrant for one model or one cache (it uses their scratch); never allocates.
 * A weight file truncated under the running model fails the call with CLB_E_IO and a message
 * starting "weight file changed: " that names the file; so do all later calls. */
clb_status clb_forward(clb_model *m, clb_kv *kv, const clb_batch *b, float *logits, char *err);

/* Layers [il0, il1) of one step, so that another backend can run the layers between: x holds
 * the hidden states [n_tokens, n_embd] (f32, row-major). il0 == 0 starts from the tokens'
 * embeddings (x not read), else from x; x receives the states after layer il1 - 1; il1 ==
 * n_layer ends as clb_forward does (final norm, lm_head into logits). Spans [0, a), [a, b), ...,
 * [z, n_layer) called in order give clb_forward's logits bit for bit. The batch is validated
 * at each call, as clb_forward's. The linear-attention layers of the span check, start and
 * advance their own part of each sequence's state slot (each layer counts the positions it
 * absorbed), so the spans of one step may come in any number of calls. CLB_E_ARG for a span
 * outside the model. */
clb_status clb_forward_span(clb_model *m, clb_kv *kv, const clb_batch *b, int64_t il0,
                            int64_t il1, float *x, float *logits, char *err);

int64_t clb_forward_max_batch(void);

/* The routed experts of MoE layer il alone, for a step whose other work runs on another
 * backend: xn [n_tokens, n_embd] the tokens' normed FFN inputs, ids and w [n_tokens,
 * n_expert_used] their chosen experts and weights (as the router gives them), mine [n_expert]
 * (NULL: all) 1 for the experts run here. out [n_tokens, n_embd] receives per token the sum of
 * weight * expert(x) over its chosen experts with mine[e] != 0, added in expert order (zero
 * where there is none): exactly the share those experts add in clb_forward's layer. Goes
 * through the expert cache when one is enabled. Uses the model's scratch: not at the same time
 * as a forward call on the same model. CLB_E_ARG for a layer without routed experts or an
 * expert id outside 0..n_expert-1 (nothing computed). */
clb_status clb_moe_experts(clb_model *m, int64_t il, int64_t n_tokens, const float *xn,
                           const int32_t *ids, const float *w, const uint8_t *mine, float *out,
                           char *err);

/* 1 when each of the n floats is finite (no NaN, no infinity), else 0: the check of a step's
 * logits, a few microseconds where numpy's isfinite allocates and reduces a mask */
int clb_all_finite(const float *x, int64_t n);

const clb_hparams *clb_model_hparams(const clb_model *m);
int clb_model_n_threads(const clb_model *m);

/* The weight products of every forward call since load, timed in place on the calling thread:
 * calls, wall time (activation packing and the thread pool's hand-offs included) and weight
 * bytes they read, in all and per phase of a layer; with them the time of attention over the
 * KV cache (its dispatch) and of the forward calls themselves, so that what a decoded token
 * spends elsewhere (norms, routing, the caller's own work) follows. Read it between forward
 * calls. */
typedef enum {
    CLB_PHASE_ATTN_PROJ = 0, /* q, k, v and output projections */
    CLB_PHASE_ROUTER,        /* the router's logits (and the next layer's, when pre-gating) */
    CLB_PHASE_EXPERT_UP,     /* routed experts' gate and up */
    CLB_PHASE_EXPERT_DOWN,   /* routed experts' down */
    CLB_PHASE_SHARED,        /* the shared expert and its gate */
    CLB_PHASE_DENSE,         /* dense layers' FFN */
    CLB_PHASE_LM_HEAD,
    CLB_PHASE_COUNT
} clb_phase;
typedef struct {
    int64_t n_calls;
    int64_t ns;
    int64_t weight_bytes;
} clb_phase_stats;
typedef struct {
    clb_phase_stats phase[CLB_PHASE_COUNT]; /* every product is in exactly one phase */
    int64_t attention_ns; /* attention over the KV cache */
    int64_t forward_ns;   /* clb_forward calls, whole */
} clb_product_stats;
void clb_model_product_stats(const clb_model *m, clb_product_stats *out);

/* Expert cache: with it enabled, routed experts are no longer read through their mappings but
 * kept in a fixed number of slots per layer and loaded on demand (csrc/xcache.c). Every other
 * weight stays mapped. A step that routes several tokens to one expert loads it once; an
 * expert the running step still uses is never evicted; when a step needs more experts in a
 * layer than fit, the layer runs in waves, in expert order, so results are bit-identical to the
 * all-resident model whatever the budget. Victims: an empty slot, else the unpinned expert with
 * the least heat (selections over the last prefetch_window tokens, decayed), oldest use first on
 * ties. Loads run on a pool of reader threads, many at once: a layer claims the slots of
 * all the experts its wave needs before it waits for any, runs the resident ones while the
 * others are read, then each of those as soon as it lands. With prefetch, the pool also reads
 * ahead the experts that layer L+1's router picks for layer L's input while layer L computes
 * (and L+2's, when prefetch_depth says so), queued behind the loads a layer waits for; those
 * not started when their layer begins, or no longer predicted by a nearer layer, are dropped.
 * A layer whose prefetches are mostly evicted unused prefetches only one step in eight until
 * that changes. Prefetch reads fill only the storage's idle time: none starts while a load the
 * forward pass waits for is queued or being read, or while such loads kept the storage busy
 * more than prefetch_busy_pct of the recent time; one in flight (pread, direct) stops between
 * chunks when such a load waits for a reader; and none evicts an expert the prediction picked
 * too, or for a prediction right at most half the time (the layer's measured precision), or
 * no more often than the layer's evicted experts come back before it would have evicted them
 * anyway (nearly always in a layer that holds nearly all the experts its tokens use), or
 * likelier to be used in the next step (by its heat) than the prediction is to be right. With
 * prefault the slots' pages are faulted in at enable, on a thread of their own. */
typedef enum {
    CLB_XC_PREAD = 0,  /* pread into slots of anonymous memory */
    CLB_XC_DIRECT = 1, /* O_DIRECT reads into 4 KiB-aligned slots (bypasses the page cache) */
    CLB_XC_MMAP = 2,   /* the mappings themselves: madvise(WILLNEED) + touch to load,
                          madvise(DONTNEED) + fadvise(DONTNEED) to evict */
    CLB_XC_URING = 3,  /* as direct, each reader's read split into chunks all in flight at
                          once through its own io_uring */
} clb_xc_load;

typedef struct {
    int64_t per_layer;       /* slots per layer, 1..n_expert */
    int32_t load;            /* clb_xc_load */
    int32_t prefetch;        /* 1: pre-gating prefetch, on the reader threads */
    int32_t huge_pages;      /* 1: ask for 2 MiB transparent huge pages on the slots */
    int64_t prefetch_window; /* tokens of routing history that make heat, >= 1 */
    int64_t read_timeout_ms; /* a load that takes longer fails the model; 0: 30 s */
    int32_t readers;         /* reader threads that load in parallel, 1..64; 0: 4 */
    int32_t prefetch_depth;  /* layers read ahead, 1 or 2; 0: 2 while a read takes longer
                              * than a layer's compute, else 1 */
    int32_t prefetch_busy_pct; /* 1..100: no prefetch read starts while loads the forward
                                * waits for kept the storage busy more than this share (%) of
                                * the recent time; 0: 50 */
    int32_t prefault;          /* 1: fault the slots' memory in once, on a thread of its own
                                * started at enable, so that no read into a slot waits for
                                * the kernel to zero its pages (slots of the first use first) */
} clb_xc_config;

typedef struct {
    int64_t hits, misses;         /* expert acquisitions found resident / loaded on demand */
    int64_t loads, evictions;     /* all loads (prefetch included), evictions */
    int64_t prefetch_issued;      /* prefetch loads started */
    int64_t prefetch_used;        /* prefetched experts used before eviction */
    int64_t prefetch_wasted;      /* prefetched experts evicted unused */
    int64_t prefetch_late;        /* acquisitions that waited for a prefetch in flight */
    int64_t bytes_read;           /* bytes loaded from the files */
    int64_t stall_ns;             /* forward time spent waiting for loads */
    int64_t reader_loads;         /* misses the reader threads loaded: not in memory, or the
                                   * expert's file not open yet */
    int64_t prefetch_cancelled;   /* prefetches dropped before their read started: the layer
                                   * began first and loads what it needs itself, or a nearer
                                   * layer's prediction left them out */
    int64_t prefetch_far;         /* prefetches queued two layers ahead */
    int64_t overlapped;           /* experts whose rows ran while another expert of their
                                   * wave was still loading */
    int64_t prefetch_busy;        /* prefetches not started: a load the forward waits for was
                                   * queued or being read, or such loads kept the storage busy */
    int64_t prefetch_aborted;     /* prefetch reads stopped part-way for such a load (their
                                   * slot freed, the bytes read so far in bytes_read) */
    int64_t prefetch_spared;      /* prefetches not started: every expert they could evict
                                   * was likelier to be used next than the prediction right */
    int64_t predicted;            /* experts the layer's router, run ahead on an earlier
                                   * layer's input, picked for the layer's next step */
    int64_t predicted_right;      /* of those, the experts that step then routed to */
} clb_xc_stats;

/* Copies the q8/q4 matrices the forward pass multiplies into the interleaved layout the active
 * ISA reads fastest (a no-op where the rows are its best layout): attention, shared experts
 * and an untied lm_head, and the routed experts too when experts is set (only before and
 * instead of the expert cache, which repacks what it loads). Tokens do not change. Call
 * before the first forward, from one thread. *n_repacked (may be NULL): matrices copied. */
clb_status clb_model_repack(clb_model *m, int experts, int64_t *n_repacked, char *err);

/* Bytes one expert occupies in a slot (its three matrices as laid out in its file). */
size_t clb_expert_bytes(const clb_model *m);
/* Turns the cache on (once, before the first forward); pinned: [n_layer * n_expert] flags or
 * NULL; pinned experts are loaded now and never evicted (at most per_layer - 1 per layer).
 * CLB_E_ARG for a bad config, CLB_E_IO when a load fails (message names the file). */
clb_status clb_xcache_enable(clb_model *m, const clb_xc_config *cfg, const uint8_t *pinned,
                             char *err);
/* 0 when no cache is enabled; else fills per_layer [n_layer] counters, state [n_layer *
 * n_expert] (0 absent, 1 loading, 2 resident, 3 pinned), heat and selections [n_layer *
 * n_expert] (each may be NULL) and returns 1. Safe to call while a forward runs. */
int clb_xcache_stats(const clb_model *m, clb_xc_stats *per_layer, int8_t *state, float *heat,
                     int64_t *selections);
/* -1 when no cache is enabled; else the averages the L+2 read-ahead is decided on (ns, 0 until
 * measured: one reader's read of one expert, one layer's compute) and returns the layers read
 * ahead now (0 without prefetch, 1 or 2). */
int clb_xcache_timing(const clb_model *m, int64_t *read_ns, int64_t *layer_ns);
/* -1 when no cache is enabled; else the slot memory faulted in so far and in all (bytes: the
 * slots of the layers with experts) and returns 1 while the pre-fault runs, 0 once it has
 * ended (done, not asked for, mmap mode which has no slots, or stopped: then *err, when not
 * NULL, says why: the kernel refused MADV_POPULATE_WRITE, Linux 5.14 or later). */
int clb_xcache_prefault(const clb_model *m, int64_t *done_bytes, int64_t *total_bytes,
                        char *err);

/* The embedding C API, for programs that link the core directly: thin wrappers over the
 * above for one sequence (f32 KV, its own block table): each colibri_forward call appends
 * tokens to that sequence and returns the logits of the last one; colibri_reset starts the
 * sequence again.
 * Tokenizing and detokenizing live in Python (engine, Hugging Face tokenizers), not here. */
typedef struct colibri_model colibri_model;
colibri_model *colibri_init(const char *dir, const clb_hparams *hp, int n_threads, char *err);
clb_status colibri_forward(colibri_model *cm, const int32_t *tokens, int64_t n_tokens,
                           float *logits, char *err);
void colibri_reset(colibri_model *cm);
void colibri_free(colibri_model *cm);

#endif
