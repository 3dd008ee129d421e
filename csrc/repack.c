/* Colibri load-time repacking: q8/q4 matrices copied once into the interleaved layout the
 * active ISA's products read fastest (clb_kernel_wants_x8), so those products need no
 * shuffles and read each row group as one sequential stream.
 * Guarantees: products on a repacked matrix equal the row layout's bit for bit (the kernels'
 * contract), so repacking changes speed, never tokens; each copy lives in the model's pool and
 * the mapping's pages of its source are given back to the page cache; a file that changed
 * while it was copied is an error naming it. Refuses: repacking routed experts once the expert
 * cache is on (the cache repacks each expert as it loads one); matrices whose rows are not a
 * multiple of 8 stay in rows. */
#define _DEFAULT_SOURCE /* madvise */
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "clb_model_internal.h"
#include "clb_util.h"

/* *tp, when its type wants it, becomes a pool copy in the interleaved layout. */
static clb_status repack_one(clb_model *m, const clb_tensor **tp, int64_t *n_done) {
    const clb_tensor *t = *tp;
    if (!t || t->n_dims != 2 || clb_x8_type(t->type) == t->type ||
        !clb_kernel_wants_x8(t->type) || t->shape[0] % 8 != 0)
        return CLB_OK;
    clb_tensor *c = clb_pool_alloc(m->pool, sizeof *c);
    void *data = clb_pool_alloc(m->pool, t->nbytes);
    if (!c || !data) {
        clb_pool_free(m->pool, c);
        clb_pool_free(m->pool, data);
        return CLB_E_NOMEM;
    }
    clb_repack_x8(t->type, t->shape[1], t->shape[0], t->data, data);
    *c = *t;
    c->type = clb_x8_type(t->type);
    c->data = data;
    /* the whole pages of the source: no one reads them again */
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t p0 = ((uintptr_t)t->data + page - 1) / page * page;
    uintptr_t p1 = ((uintptr_t)t->data + t->nbytes) / page * page;
    if (p1 > p0) madvise((void *)p0, p1 - p0, MADV_DONTNEED);
    *tp = c;
    (*n_done)++;
    return CLB_OK;
}

static clb_status repack_ffn(clb_model *m, clb_ffn_w *f, int64_t *n_done) {
    clb_status st = repack_one(m, &f->w1, n_done);
    if (st == CLB_OK) st = repack_one(m, &f->w3, n_done);
    if (st == CLB_OK) st = repack_one(m, &f->w2, n_done);
    return st;
}

clb_status clb_model_repack(clb_model *m, int experts, int64_t *n_repacked, char *err) {
    if (err) err[0] = '\0';
    if (!m) return CLB_E_ARG;
    if (experts && m->xc) {
        clb_set_err(err, "the expert cache repacks the experts it loads; repack the other "
                         "weights only");
        return CLB_E_ARG;
    }
    int64_t n = 0;
    clb_status st = CLB_OK;
    if (m->output != m->tok_embd) st = repack_one(m, &m->output, &n); /* tied: rows for lookup */
    for (int64_t il = 0; il < m->hp.n_layer && st == CLB_OK; il++) {
        clb_layer_w *l = &m->layers[il];
        const clb_tensor **att[4] = {&l->wq, &l->wk, &l->wv, &l->wo};
        for (int k = 0; k < 4 && st == CLB_OK; k++) st = repack_one(m, att[k], &n);
        if (st == CLB_OK && l->shared.w1) st = repack_ffn(m, &l->shared, &n);
    }
    if (experts) {
        const int64_t before = n;
        for (int64_t i = 0; i < m->hp.n_layer * m->hp.n_expert && st == CLB_OK; i++)
            st = repack_ffn(m, &m->experts[i], &n);
        if (n > before) m->experts_x8 = 1; /* some now live outside their mappings */
    }
    if (st == CLB_E_NOMEM) {
        clb_set_err(err, "out of memory repacking the weights (%lld matrices done)",
                    (long long)n);
        return st;
    }
    if (n_repacked) *n_repacked = n;
    /* a file cut short while it was copied read as zeros: the copies are void */
    for (int i = 0; i < m->n_files; i++) {
        const char *path = clb_wfile_changed(m->files[i]);
        if (path) {
            clb_set_err(err, "weight file changed: %s changed while the model was loading; "
                             "restart to load it again", path);
            return CLB_E_IO;
        }
    }
    return st;
}
