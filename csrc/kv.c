/* Colibri KV cache: K and V rows (f32) for n_seq sequences of n_ctx positions, every layer.
 * Guarantees: storage is addressed through a per-sequence block table of CLB_KV_BLOCK-position
 * blocks (today a fixed identity mapping), so a shared paged pool or an f16/q8 block format can
 * come later without changing the forward pass, which only uses clb_kv_row().
 * Refuses: sizes that overflow; the memory comes from a pool (large blocks are mmap'd, so
 * untouched positions cost no RAM). */
#include <stdlib.h>

#include "clb_model_internal.h"

clb_status clb_kv_init(const clb_model *m, int n_seq, clb_kv **out) {
    if (!out) return CLB_E_ARG;
    *out = NULL;
    if (!m || n_seq <= 0 || n_seq > 65536) return CLB_E_ARG;
    const clb_hparams *hp = &m->hp;
    int64_t n_blk_seq = (hp->n_ctx + CLB_KV_BLOCK - 1) / CLB_KV_BLOCK;
    int64_t n_blk = n_blk_seq * n_seq;
    int64_t kv_dim = hp->n_head_kv * hp->head_dim;
    if (n_blk > INT32_MAX) return CLB_E_RANGE; /* block ids are int32 */
    /* elements = L * n_blk * 2 * BLOCK * kv_dim; check it fits a size_t of bytes */
    size_t elems = 1;
    const int64_t factors[] = {hp->n_layer, n_blk, 2 * CLB_KV_BLOCK, kv_dim};
    for (int i = 0; i < 4; i++) {
        if ((size_t)factors[i] > SIZE_MAX / sizeof(float) / elems) return CLB_E_RANGE;
        elems *= (size_t)factors[i];
    }
    clb_kv *kv = calloc(1, sizeof(*kv));
    if (!kv) return CLB_E_NOMEM;
    kv->pool = clb_pool_init();
    if (!kv->pool) {
        free(kv);
        return CLB_E_NOMEM;
    }
    kv->model = m;
    kv->n_seq = n_seq;
    kv->n_layer = hp->n_layer;
    kv->n_ctx = hp->n_ctx;
    kv->kv_dim = kv_dim;
    kv->n_blk_seq = n_blk_seq;
    kv->n_blk = n_blk;
    kv->blk_table = clb_pool_alloc(kv->pool, (size_t)n_blk * sizeof(int32_t));
    kv->seq_len = clb_pool_alloc(kv->pool, (size_t)n_seq * sizeof(int64_t));
    kv->seq_next = clb_pool_alloc(kv->pool, (size_t)n_seq * sizeof(int64_t));
    kv->data = clb_pool_alloc(kv->pool, elems * sizeof(float));
    if (!kv->blk_table || !kv->seq_len || !kv->seq_next || !kv->data) {
        clb_kv_free(kv);
        return CLB_E_NOMEM;
    }
    for (int64_t i = 0; i < n_blk; i++) kv->blk_table[i] = (int32_t)i;
    for (int s = 0; s < n_seq; s++) kv->seq_len[s] = 0;
    *out = kv;
    return CLB_OK;
}

void clb_kv_free(clb_kv *kv) {
    if (!kv) return;
    clb_pool_free_all(kv->pool);
    free(kv);
}

void clb_kv_clear_seq(clb_kv *kv, int seq_id) {
    if (!kv || seq_id < 0 || seq_id >= kv->n_seq) return;
    kv->seq_len[seq_id] = 0; /* rows past seq_len are never read, so no need to zero them */
}

int64_t clb_kv_seq_len(const clb_kv *kv, int seq_id) {
    if (!kv || seq_id < 0 || seq_id >= kv->n_seq) return -1;
    return kv->seq_len[seq_id];
}

int clb_kv_n_seq(const clb_kv *kv) { return kv ? kv->n_seq : 0; }
