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

typedef struct clb_model clb_model;
typedef struct clb_kv clb_kv;

/* dir: a Colibri model folder; n_threads <= 0: physical cores. Checks hp, opens every file
 * of the layout in docs/INTERNALS.md, checks each tensor's dtype and shape, and allocates
 * all forward scratch once. */
clb_status clb_model_load(const char *dir, const clb_hparams *hp, int n_threads, clb_model **out, char *err);
void clb_model_free(clb_model *m);

/* KV cache for up to n_seq sequences of hp.n_ctx positions each. */
clb_status clb_kv_init(const clb_model *m, int n_seq, clb_kv **out);
void clb_kv_free(clb_kv *kv);
void clb_kv_clear_seq(clb_kv *kv, int seq_id);             /* ignores ids out of range */
int64_t clb_kv_seq_len(const clb_kv *kv, int seq_id);      /* positions held; -1 if bad id */
int clb_kv_n_seq(const clb_kv *kv);

/* One forward step over a batch of tokens. Token i belongs to sequence seq_ids[i] at position
 * positions[i]; a sequence's tokens appear in increasing position order and every position
 * before them is already in the cache. Logits are written for each token i with
 * want_logits[i] != 0 (all tokens when want_logits is NULL), in order, into
 * logits[n_out, n_vocab]. Returns CLB_E_ARG for bad ids/positions, CLB_E_RANGE past n_ctx.
 * Everything is validated before any computation, so a refused call leaves the cache as it
 * was. A sequence's first token in the call may sit at a position below what the cache holds
 * (rewinding it: later positions are dropped); it may not skip ahead. Calls longer than
 * clb_forward_max_batch() tokens are run as consecutive chunks, which gives the same result.
 * Not reentrant for one model (it uses the model's scratch); never allocates.
 * A weight file truncated under the running model fails the call with CLB_E_IO and a message
 * starting "weight file changed: " that names the file; so do all later calls. */
clb_status clb_forward(clb_model *m, clb_kv *kv, int64_t n_tokens, const int32_t *tokens,
                       const int32_t *seq_ids, const int32_t *positions,
                       const uint8_t *want_logits, float *logits, char *err);

int64_t clb_forward_max_batch(void);
const clb_hparams *clb_model_hparams(const clb_model *m);
int clb_model_n_threads(const clb_model *m);

/* The seeds' C API names, thin wrappers over the above for one sequence: each
 * colibri_forward call appends tokens to that sequence and returns the logits of the last one.
 * Tokenizing and detokenizing live in Python (engine, Hugging Face tokenizers), not here. */
typedef struct colibri_model colibri_model;
colibri_model *colibri_init(const char *dir, const clb_hparams *hp, int n_threads, char *err);
clb_status colibri_forward(colibri_model *cm, const int32_t *tokens, int64_t n_tokens,
                           float *logits, char *err);
void colibri_reset(colibri_model *cm);
void colibri_free(colibri_model *cm);

#endif
