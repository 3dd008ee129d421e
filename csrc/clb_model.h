/* Colibri model: weight files mapped read-only, validated, and the forward pass over them.
 * Guarantees: every header, offset and size is checked against the real file length before a
 * tensor byte is read; shapes and dtypes are checked against the hyper-parameters; errors come
 * back as a status plus a message naming the file and tensor.
 * Refuses: architectures other than those in clb_arch; tensors that overlap or run past EOF. */
#ifndef CLB_MODEL_H
#define CLB_MODEL_H

#include "clb_types.h"
#include "clb_threadpool.h"

#define CLB_ERR_LEN 512

typedef enum { CLB_ARCH_MIXTRAL = 0, CLB_ARCH_QWEN2_MOE = 1, CLB_ARCH_QWEN3_MOE = 2, CLB_ARCH_OLMOE = 3 } clb_arch;
typedef enum { CLB_QK_NORM_NONE = 0, CLB_QK_NORM_HEAD = 1, CLB_QK_NORM_FULL = 2 } clb_qk_norm;

/* Hyper-parameters, filled by Python from config.json (engine/config.py). */
typedef struct {
    int32_t arch;          /* clb_arch */
    int64_t n_vocab, n_embd, n_layer, n_head, n_head_kv, head_dim;
    int64_t n_ff, n_expert, n_expert_used;
    int64_t n_ff_shared;   /* 0: no shared expert */
    int32_t shared_gate;   /* shared expert scaled by sigmoid(shared_gate . x) */
    int32_t norm_topk_prob;
    int32_t qk_norm;       /* clb_qk_norm */
    int32_t qkv_bias;
    int32_t tie_embeddings;
    float clip_qkv;        /* <= 0: off */
    float rope_theta;
    int64_t rotary_dim;    /* <= head_dim, even */
    float rms_eps;
    int64_t sliding_window; /* <= 0: off */
    int64_t n_ctx;         /* KV capacity per sequence */
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

clb_status clb_wfile_open(const char *path, clb_wfile **out, char *err);
void clb_wfile_close(clb_wfile *f);
int clb_wfile_n_tensors(const clb_wfile *f);
const clb_tensor *clb_wfile_tensor(const clb_wfile *f, int i);
const clb_tensor *clb_wfile_find(const clb_wfile *f, const char *name);

typedef struct clb_model clb_model;
typedef struct clb_kv clb_kv;

/* dir: a Colibri model folder; n_threads <= 0: physical cores. */
clb_status clb_model_load(const char *dir, const clb_hparams *hp, int n_threads, clb_model **out, char *err);
void clb_model_free(clb_model *m);

/* KV cache for up to n_seq sequences of hp.n_ctx positions each. */
clb_status clb_kv_init(const clb_model *m, int n_seq, clb_kv **out);
void clb_kv_free(clb_kv *kv);
void clb_kv_clear_seq(clb_kv *kv, int seq_id);

/* One forward step over a batch of tokens. Token i belongs to sequence seq_ids[i] at position
 * positions[i]; a sequence's tokens appear in increasing position order and every position
 * before them is already in the cache. Logits are written for each token i with
 * want_logits[i] != 0 (all tokens when want_logits is NULL), in order, into
 * logits[n_out, n_vocab]. Returns CLB_E_ARG for bad ids/positions, CLB_E_RANGE past n_ctx. */
clb_status clb_forward(clb_model *m, clb_kv *kv, int64_t n_tokens, const int32_t *tokens,
                       const int32_t *seq_ids, const int32_t *positions,
                       const uint8_t *want_logits, float *logits, char *err);

/* The seeds' C API names, thin wrappers over the above. */
typedef clb_model colibri_model;

#endif
