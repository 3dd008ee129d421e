/* Colibri's embedding C API (colibri_init / colibri_forward / colibri_free): a thin
 * single-sequence wrapper over clb_model_load, clb_kv_init and clb_forward, with its own
 * identity block table (block j holds positions [16j, 16j+16)) and its own sequence length.
 * Guarantees: each colibri_forward appends its tokens to the one sequence and returns the logits
 * of the last token; errors come back as a status and a message, as in the clb_ API.
 * Refuses: tokenizing and detokenizing: they live in Python (engine, with Hugging Face
 * tokenizers), which owns the tokenizer.json that came with the model. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clb_model.h"

struct colibri_model {
    clb_model *model;
    clb_kv *kv;        /* f32, ceil(n_ctx / CLB_KV_BLOCK) blocks */
    int32_t *table;    /* [n_blocks] identity */
    int32_t n_blocks;
    int64_t seq_len;   /* positions held */
};

colibri_model *colibri_init(const char *dir, const clb_hparams *hp, int n_threads, char *err) {
    colibri_model *cm = calloc(1, sizeof(*cm));
    if (!cm) {
        if (err) snprintf(err, CLB_ERR_LEN, "out of memory");
        return NULL;
    }
    if (clb_model_load(dir, hp, n_threads, &cm->model, err) != CLB_OK) {
        free(cm);
        return NULL;
    }
    int64_t nb = (clb_model_hparams(cm->model)->n_ctx + CLB_KV_BLOCK - 1) / CLB_KV_BLOCK;
    cm->table = malloc((size_t)nb * sizeof(int32_t));
    if (!cm->table || clb_kv_init(cm->model, nb, CLB_KV_F32, &cm->kv) != CLB_OK ||
        (clb_kv_state_bytes(clb_model_hparams(cm->model)) > 0 &&
         clb_kv_states_init(cm->kv, 1) != CLB_OK)) {
        if (err) snprintf(err, CLB_ERR_LEN, "out of memory for the KV cache");
        colibri_free(cm);
        return NULL;
    }
    for (int64_t j = 0; j < nb; j++) cm->table[j] = (int32_t)j;
    cm->n_blocks = (int32_t)nb; /* n_ctx is bounded at load, so nb fits */
    return cm;
}

clb_status colibri_forward(colibri_model *cm, const int32_t *tokens, int64_t n_tokens,
                           float *logits, char *err) {
    if (!cm || n_tokens <= 0 || n_tokens > INT32_MAX) {
        if (err) snprintf(err, CLB_ERR_LEN, "colibri_forward: no model or no tokens");
        return CLB_E_ARG;
    }
    int64_t start = cm->seq_len;
    if (start + n_tokens > clb_model_hparams(cm->model)->n_ctx) {
        if (err) snprintf(err, CLB_ERR_LEN, "colibri_forward: %lld + %lld tokens exceed n_ctx",
                          (long long)start, (long long)n_tokens);
        return CLB_E_RANGE;
    }
    /* one small fixed-size batch at a time keeps this wrapper allocation-free */
    enum { STEP = 64 };
    int32_t seq[STEP], pos[STEP], slot = 0; /* the one sequence's state slot */
    uint8_t want[STEP];
    memset(seq, 0, sizeof seq);
    for (int64_t t0 = 0; t0 < n_tokens; t0 += STEP) {
        int64_t n = n_tokens - t0 < STEP ? n_tokens - t0 : STEP;
        for (int64_t i = 0; i < n; i++) {
            pos[i] = (int32_t)(start + t0 + i);
            want[i] = t0 + i == n_tokens - 1;
        }
        clb_batch b = {.n_tokens = n, .tokens = tokens + t0, .seq_ids = seq, .positions = pos,
                       .want_logits = want, .n_seq = 1, .max_blocks = cm->n_blocks,
                       .block_tables = cm->table, .state_slots = &slot};
        clb_status st = clb_forward(cm->model, cm->kv, &b, logits, err);
        if (st != CLB_OK) return st;
        cm->seq_len = start + t0 + n;
    }
    return CLB_OK;
}

void colibri_reset(colibri_model *cm) {
    if (cm) cm->seq_len = 0; /* rows past seq_len are never read; position 0 restarts the
                                recurrent state of a model with linear attention */
}

void colibri_free(colibri_model *cm) {
    if (!cm) return;
    clb_kv_free(cm->kv);
    free(cm->table);
    clb_model_free(cm->model);
    free(cm);
}
