/* Colibri paged KV cache: one pool of fixed-size blocks (CLB_KV_BLOCK positions, K and V of
 * every layer, or MLA's one latent row) shared by all sequences, in f32, f16 or q8 (int8 + one
 * f32 scale per position and kv head); optionally a second pool for the sliding-window and
 * chunked layers, whose blocks the caller gives back once they leave every window. The storage is laid out by layer, K or V, and kv head, then block, so one
 * head's blocks in order are one stream (clb_model_internal.h). Which block holds which
 * positions is decided by the caller's block tables.
 * Guarantees: every size is overflow-checked; storage comes from a memory pool (large blocks
 * are mmap'd, so pages no block has written yet cost no RAM); the codecs below are the only
 * code that knows the element formats.
 * Refuses: block counts outside 1..INT32_MAX (block ids are int32). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "clb_model_internal.h"

/* What one position caches per layer: GQA n_head_kv K heads and as many V heads of head_dim;
 * MLA one latent row of kv_lora_rank + rotary_dim, whose first kv_lora_rank values are read as
 * the values. */
typedef struct {
    int64_t n_kinds, n_heads, row_dim, v_dim;
} kv_shape;

static kv_shape shape_of(const clb_hparams *hp) {
    if (hp->attn == CLB_ATTN_MLA)
        return (kv_shape){1, 1, hp->kv_lora_rank + hp->rotary_dim, hp->kv_lora_rank};
    return (kv_shape){2, hp->n_head_kv, hp->head_dim, hp->head_dim};
}

/* Bytes of one position's row of one cached head: row_dim values, then q8's scale
 * (4-aligned). */
static size_t head_layout(const clb_hparams *hp, clb_kv_type type, size_t *scale_off) {
    size_t hd = (size_t)shape_of(hp).row_dim;
    *scale_off = 0;
    switch (type) {
    case CLB_KV_F32:
    case CLB_KV_F16: return hd * clb_kv_elem_bytes(type);
    case CLB_KV_Q8:
        *scale_off = (hd * clb_kv_elem_bytes(type) + 3) & ~(size_t)3;
        return *scale_off + sizeof(float);
    }
    return 0;
}

int64_t clb_hp_n_attn_layers(const clb_hparams *hp) {
    int64_t n = 0;
    for (int64_t il = 0; il < hp->n_layer; il++)
        n += !hp->layer_mixer || hp->layer_mixer[il] != CLB_MIX_LINEAR;
    return n;
}

int64_t clb_lin_conv_floats(const clb_hparams *hp) {
    const int64_t C = 2 * hp->lin_n_k_heads * hp->lin_k_dim + hp->lin_n_v_heads * hp->lin_v_dim;
    return (hp->lin_conv - 1) * C;
}

int64_t clb_lin_state_floats(const clb_hparams *hp) {
    return hp->lin_n_v_heads * hp->lin_k_dim * hp->lin_v_dim;
}

/* Whether layer il of hp attends over a sliding window or its own chunk only (and so, with a
 * windowed pool, caches there). Without layer_attn every layer is sliding, as at load. */
static int hp_layer_windowed(const clb_hparams *hp, int64_t il) {
    if (hp->layer_mixer && hp->layer_mixer[il] == CLB_MIX_LINEAR) return 0;
    const int32_t f = hp->layer_attn ? hp->layer_attn[il] : CLB_LAYER_SLIDING;
    return ((f & CLB_LAYER_SLIDING) && hp->sliding_window > 0) ||
           ((f & CLB_LAYER_CHUNKED) && hp->attn_chunk > 0);
}

static int64_t hp_n_windowed(const clb_hparams *hp) {
    int64_t n = 0;
    for (int64_t il = 0; il < hp->n_layer; il++) n += hp_layer_windowed(hp, il);
    return n;
}

/* Bytes of a block holding n_layers cached layers (0 if hp or type is invalid). */
static size_t block_bytes_of(const clb_hparams *hp, clb_kv_type type, int64_t n_layers) {
    if (n_layers <= 0) return 0;
    if (hp->attn != CLB_ATTN_GQA && hp->attn != CLB_ATTN_MLA) return 0;
    const kv_shape sh = shape_of(hp);
    if (sh.n_heads <= 0 || sh.n_heads > (1 << 16) || sh.row_dim <= 0 || sh.row_dim > (1 << 16) ||
        sh.v_dim <= 0 || sh.v_dim > sh.row_dim)
        return 0;
    if (type != CLB_KV_F32 && type != CLB_KV_F16 && type != CLB_KV_Q8) return 0;
    size_t off;
    size_t head = head_layout(hp, type, &off);
    /* head <= 2^19, n_heads <= 2^16 and 2 * 16 * n_layer <= 2^21: fits a 64-bit size_t */
    return head * (size_t)sh.n_heads * (size_t)(sh.n_kinds * CLB_KV_BLOCK) * (size_t)n_layers;
}

clb_status clb_kv_split_block_bytes(const clb_hparams *hp, clb_kv_type type, size_t *full,
                                    size_t *win) {
    if (!hp || !full || !win || hp->n_layer <= 0 || hp->n_layer > (1 << 16) ||
        hp->attn != CLB_ATTN_GQA)
        return CLB_E_ARG;
    const int64_t n_win = hp_n_windowed(hp);
    *full = block_bytes_of(hp, type, clb_hp_n_attn_layers(hp) - n_win);
    *win = block_bytes_of(hp, type, n_win);
    return *full && *win ? CLB_OK : CLB_E_ARG;
}

size_t clb_kv_block_bytes(const clb_hparams *hp, clb_kv_type type) {
    /* limits well inside what clb_model_load accepts, so the products below cannot overflow */
    if (!hp || hp->n_layer <= 0 || hp->n_layer > (1 << 16)) return 0;
    return block_bytes_of(hp, type, clb_hp_n_attn_layers(hp));
}

/* the model's hparams were checked at load (dimensions capped far below overflow) */
size_t clb_kv_state_bytes(const clb_hparams *hp) {
    if (!hp) return 0;
    const int64_t n_lin = hp->n_layer - clb_hp_n_attn_layers(hp);
    if (n_lin <= 0) return 0;
    return (size_t)(n_lin * (clb_lin_conv_floats(hp) + clb_lin_state_floats(hp))) *
           sizeof(float);
}

clb_status clb_kv_states_init(clb_kv *kv, int64_t n_slots) {
    if (!kv || kv->state || n_slots <= 0 || n_slots > INT32_MAX) return CLB_E_ARG;
    const size_t bytes = clb_kv_state_bytes(&kv->model->hp);
    if (bytes == 0) return CLB_E_ARG;
    if ((size_t)n_slots > SIZE_MAX / bytes) return CLB_E_RANGE;
    const int64_t n_lin = kv->model->hp.n_layer - clb_hp_n_attn_layers(&kv->model->hp);
    kv->state = clb_pool_alloc(kv->pool, (size_t)n_slots * bytes);
    kv->state_len = clb_pool_alloc(kv->pool, (size_t)(n_slots * n_lin) * sizeof(int64_t));
    kv->slot_user = clb_pool_alloc(kv->pool, (size_t)n_slots * sizeof(int32_t));
    if (!kv->state || !kv->state_len || !kv->slot_user) {
        kv->state = NULL;
        return CLB_E_NOMEM;
    }
    for (int64_t i = 0; i < n_slots * n_lin; i++) kv->state_len[i] = -1;
    for (int64_t i = 0; i < n_slots; i++) kv->slot_user[i] = -1;
    kv->n_lin = n_lin;
    kv->slot_floats = bytes / sizeof(float);
    kv->n_slots = n_slots;
    return CLB_OK;
}

int64_t clb_kv_n_state_slots(const clb_kv *kv) { return kv ? kv->n_slots : 0; }

clb_status clb_kv_block_copy(clb_kv *kv, int64_t dst, int64_t src) {
    if (!kv || dst < 0 || dst >= kv->n_blocks || src < 0 || src >= kv->n_blocks)
        return CLB_E_ARG;
    if (dst == src) return CLB_OK;
    /* one (cached layer, kind, kv head)'s part of a block is CLB_KV_BLOCK rows in a run; the
     * full pool's layers only (a cache with a windowed pool is never forked this way) */
    const size_t run = (size_t)CLB_KV_BLOCK * kv->head_bytes;
    for (int64_t p = 0; p < kv->n_layer * kv->n_kinds * kv->n_head_kv; p++) {
        const size_t base = (size_t)p * (size_t)kv->n_blocks;
        memcpy(kv->data + (base + (size_t)dst) * run, kv->data + (base + (size_t)src) * run,
               run);
    }
    return CLB_OK;
}

clb_status clb_kv_state_copy(clb_kv *kv, int64_t dst, int64_t src) {
    if (!kv || dst < 0 || dst >= kv->n_slots || src < 0 || src >= kv->n_slots) return CLB_E_ARG;
    if (dst != src)
        memcpy(kv->state + (size_t)dst * kv->slot_floats,
               kv->state + (size_t)src * kv->slot_floats, kv->slot_floats * sizeof(float));
    for (int64_t li = 0; li < kv->n_lin; li++)
        kv->state_len[dst * kv->n_lin + li] = kv->state_len[src * kv->n_lin + li];
    return CLB_OK;
}

int64_t clb_kv_state_len(const clb_kv *kv, int64_t slot) {
    if (!kv || slot < 0 || slot >= kv->n_slots) return -1;
    int64_t n = kv->state_len[slot * kv->n_lin];
    for (int64_t li = 1; li < kv->n_lin; li++) {
        const int64_t v = kv->state_len[slot * kv->n_lin + li];
        n = v < n ? v : n;
    }
    return n;
}

/* The windowed pool's layer map of kv (pool storage from kv->pool): kv_layer becomes each
 * layer's index within its own pool. */
static clb_status split_layers(clb_kv *kv, const clb_model *m) {
    const clb_hparams *hp = &m->hp;
    int32_t *idx = clb_pool_alloc(kv->pool, (size_t)hp->n_layer * sizeof(int32_t));
    uint8_t *win = clb_pool_alloc(kv->pool, (size_t)hp->n_layer);
    if (!idx || !win) return CLB_E_NOMEM;
    int32_t n_full = 0, n_win = 0;
    for (int64_t il = 0; il < hp->n_layer; il++) {
        win[il] = (uint8_t)hp_layer_windowed(hp, il);
        idx[il] = m->kv_layer[il] < 0 ? -1 : win[il] ? n_win++ : n_full++;
        const clb_layer_w *l = &m->layers[il];
        if (win[il] && l->window > kv->win_window) kv->win_window = l->window;
        if (win[il] && l->chunk > kv->win_chunk) kv->win_chunk = l->chunk;
    }
    kv->kv_layer = idx;
    kv->win_layer = win;
    kv->n_layer = n_full; /* the full pool's cached layers */
    return CLB_OK;
}

clb_status clb_kv_init(const clb_model *m, int64_t n_blocks, clb_kv_type type, clb_kv **out) {
    return clb_kv_init_windowed(m, n_blocks, 0, type, out);
}

clb_status clb_kv_init_windowed(const clb_model *m, int64_t n_blocks, int64_t n_win_blocks,
                                clb_kv_type type, clb_kv **out) {
    if (!out) return CLB_E_ARG;
    *out = NULL;
    if (!m || n_blocks <= 0 || n_blocks > INT32_MAX || n_win_blocks < 0 ||
        n_win_blocks > INT32_MAX)
        return CLB_E_ARG;
    const clb_hparams *hp = &m->hp;
    size_t block_bytes = clb_kv_block_bytes(hp, type), win_bytes = 0;
    if (block_bytes == 0) return CLB_E_ARG;
    if (n_win_blocks > 0 && clb_kv_split_block_bytes(hp, type, &block_bytes, &win_bytes) != CLB_OK)
        return CLB_E_ARG;
    if ((size_t)n_blocks > SIZE_MAX / block_bytes) return CLB_E_RANGE;
    if (win_bytes && (size_t)n_win_blocks > SIZE_MAX / win_bytes) return CLB_E_RANGE;
    clb_kv *kv = calloc(1, sizeof(*kv));
    if (!kv) return CLB_E_NOMEM;
    kv->pool = clb_pool_init();
    if (!kv->pool) {
        free(kv);
        return CLB_E_NOMEM;
    }
    kv->model = m;
    kv->type = type;
    kv->n_blocks = n_blocks;
    const kv_shape sh = shape_of(hp);
    kv->n_layer = clb_hp_n_attn_layers(hp);
    kv->kv_layer = m->kv_layer;
    kv->n_head_kv = sh.n_heads;
    kv->head_dim = sh.row_dim;
    kv->n_kinds = sh.n_kinds;
    kv->v_dim = sh.v_dim;
    kv->head_bytes = head_layout(hp, type, &kv->q8_scale_off);
    kv->block_bytes = block_bytes;
    kv->data = clb_pool_alloc(kv->pool, (size_t)n_blocks * block_bytes);
    kv->writer = clb_pool_alloc(kv->pool, (size_t)n_blocks * sizeof(int32_t));
    kv->seq_next = clb_pool_alloc(kv->pool, (size_t)n_blocks * sizeof(int32_t));
    kv->deq = clb_pool_alloc(kv->pool, (size_t)clb_model_n_threads(m) * CLB_KV_BLOCK *
                                           (size_t)sh.row_dim * sizeof(float));
    if (!kv->data || !kv->writer || !kv->seq_next || !kv->deq) {
        clb_kv_free(kv);
        return CLB_E_NOMEM;
    }
    for (int64_t i = 0; i < n_blocks; i++) kv->writer[i] = -1;
    if (n_win_blocks > 0) {
        kv->n_win_blocks = n_win_blocks;
        kv->win_block_bytes = win_bytes;
        kv->win_data = clb_pool_alloc(kv->pool, (size_t)n_win_blocks * win_bytes);
        kv->win_writer = clb_pool_alloc(kv->pool, (size_t)n_win_blocks * sizeof(int32_t));
        kv->seq_lo = clb_pool_alloc(kv->pool, (size_t)n_blocks * sizeof(int32_t));
        if (!kv->win_data || !kv->win_writer || !kv->seq_lo || split_layers(kv, m) != CLB_OK) {
            clb_kv_free(kv);
            return CLB_E_NOMEM;
        }
        for (int64_t i = 0; i < n_win_blocks; i++) kv->win_writer[i] = -1;
    }
    *out = kv;
    return CLB_OK;
}

void clb_kv_free(clb_kv *kv) {
    if (!kv) return;
    clb_pool_free_all(kv->pool);
    free(kv);
}

int64_t clb_kv_n_blocks(const clb_kv *kv) { return kv ? kv->n_blocks : 0; }

int64_t clb_kv_n_win_blocks(const clb_kv *kv) { return kv ? kv->n_win_blocks : 0; }

size_t clb_kv_pool_block_bytes(const clb_kv *kv, int windowed) {
    if (!kv) return 0;
    return windowed ? kv->win_block_bytes : kv->block_bytes;
}

clb_kv_type clb_kv_get_type(const clb_kv *kv) { return kv ? kv->type : CLB_KV_F32; }

/* One kv head's head_dim f32 values in the cache's format. q8: scale = max|x| / 127 and
 * q = round-half-even(x / scale), so dequantizing (q * scale) is within scale / 2 of x; an
 * all-zero head stores scale 0. */
static void store_head(const clb_kv *kv, unsigned char *dst, const float *x) {
    const int64_t hd = kv->head_dim;
    switch (kv->type) {
    case CLB_KV_F32:
        memcpy(dst, x, (size_t)hd * sizeof(float));
        break;
    case CLB_KV_F16: {
        clb_f16 *h = (clb_f16 *)(void *)dst;
        for (int64_t i = 0; i < hd; i++) h[i] = clb_f32_to_f16(x[i]);
        break;
    }
    case CLB_KV_Q8: {
        int8_t *q = (int8_t *)dst;
        float amax = 0.0f;
        for (int64_t i = 0; i < hd; i++) amax = fmaxf(amax, fabsf(x[i]));
        float d = amax / 127.0f;
        float id = d > 0.0f ? 1.0f / d : 0.0f;
        for (int64_t i = 0; i < hd; i++) {
            float v = nearbyintf(x[i] * id); /* |v| <= 127 up to rounding of id */
            q[i] = (int8_t)fminf(fmaxf(v, -127.0f), 127.0f);
        }
        memcpy(dst + kv->q8_scale_off, &d, sizeof d);
        break;
    }
    }
}

void clb_kv_store(const clb_kv *kv, int64_t blk, int64_t il, int kind, int64_t slot,
                  const float *x) {
    for (int64_t h = 0; h < kv->n_head_kv; h++)
        store_head(kv, clb_kv_head(kv, blk, il, kind, h, slot), x + h * kv->head_dim);
}

/* int8 -> f32 (q8 rows before the scale is applied) */
void clb_kv_i8_to_f32(int64_t n, const int8_t *restrict x, float *restrict y) {
    for (int64_t i = 0; i < n; i++) y[i] = (float)x[i];
}
