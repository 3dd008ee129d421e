/* Colibri load-time repacking: q8/q4 matrices copied once into the interleaved layout the
 * active ISA's products read fastest (clb_kernel_wants_x8), so those products need no
 * shuffles and read each row group as one sequential stream.
 * Guarantees: products on a repacked matrix equal the row layout's bit for bit (the kernels'
 * contract), so repacking changes speed, never tokens; each copy lives in the model's pool and
 * the mapping's pages of its source are given back to the page cache; a file that changed
 * while it was copied is an error naming it. Refuses: repacking routed experts once the expert
 * cache is on (the cache repacks each expert as it loads one); matrices whose rows are not a
 * multiple of 8 stay in rows. Routed experts stored interleaved already are copied into the
 * pool as they are, with the repacked weights. */
#define _DEFAULT_SOURCE /* madvise */
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "clb_model_internal.h"
#include "clb_threadpool.h"
#include "clb_util.h"

#define CLB_HUGE_PAGE ((uintptr_t)2 << 20)

int clb_tensor_repacks(const clb_tensor *t) {
    return t && t->n_dims == 2 && clb_x8_type(t->type) != t->type &&
           clb_kernel_wants_x8(t->type) && t->shape[0] % 8 == 0;
}

/* The tensor slots a repack rewrites, in order. */
typedef struct {
    const clb_tensor ***slot; /* [n], NULL while counting */
    int64_t n;
    int64_t first_expert; /* slots from here on are routed experts' */
    size_t bytes;         /* their data, each rounded up to 64 bytes */
} plan;

/* copy_x8: also a matrix stored interleaved already (copied as it is: routed experts, which
 * the converter stores so, move onto the arena's 2 MiB pages like the repacked weights; the
 * loader took such a tensor only as a matrix of whole 8-row groups) */
static void add_copy(plan *p, const clb_tensor **tp, int copy_x8) {
    const clb_tensor *t = *tp;
    const int stored_x8 = copy_x8 && t && clb_x8_base(t->type) != t->type;
    if (!stored_x8 && !clb_tensor_repacks(t)) return;
    if (p->slot) p->slot[p->n] = tp;
    p->n++;
    p->bytes += ((*tp)->nbytes + 63) / 64 * 64;
}

static void add(plan *p, const clb_tensor **tp) { add_copy(p, tp, 0); }

static void collect(clb_model *m, int experts, plan *p) {
    if (m->output != m->tok_embd) add(p, &m->output); /* tied: rows for the lookup */
    for (int64_t il = 0; il < m->hp.n_layer; il++) {
        clb_layer_w *l = &m->layers[il];
        add(p, &l->wq);
        add(p, &l->wk);
        add(p, &l->wv);
        add(p, &l->wo);
        add(p, &l->lin_qkvz); /* linear attention's: NULL elsewhere, skipped */
        add(p, &l->lin_ba);
        add(p, &l->lin_qkv);
        add(p, &l->lin_z);
        add(p, &l->lin_b);
        add(p, &l->lin_a);
        add(p, &l->lin_out);
        add(p, &l->dense.w1); /* absent (NULL) outside dense layers: add skips them */
        add(p, &l->dense.w3);
        add(p, &l->dense.w2);
        if (l->shared.w1) {
            add(p, &l->shared.w1);
            add(p, &l->shared.w3);
            add(p, &l->shared.w2);
        }
    }
    p->first_expert = p->n;
    /* experts already in memory (an earlier call) are not copied again */
    const int copy_x8 = !m->experts_x8;
    for (int64_t i = 0; experts && i < m->hp.n_layer * m->hp.n_expert; i++) {
        add_copy(p, &m->experts[i].w1, copy_x8);
        add_copy(p, &m->experts[i].w3, copy_x8);
        add_copy(p, &m->experts[i].w2, copy_x8);
    }
}

typedef struct {
    const plan *p;
    const clb_tensor *dst; /* [p->n] the copies: type and data set, bytes not yet */
} copy_ctx;

static void copy_task(void *vctx, int ith, int nth) {
    const copy_ctx *c = vctx;
    for (int64_t i = 0; i < c->p->n; i++) {
        const clb_tensor *t = *c->p->slot[i];
        const int64_t groups = t->shape[0] / 8, g0 = groups * ith / nth,
                      g1 = groups * (ith + 1) / nth;
        const size_t row = clb_type_row_size(t->type, t->shape[1]), off = (size_t)g0 * 8 * row;
        if (g1 <= g0) continue;
        if (clb_x8_base(t->type) != t->type) /* stored interleaved: a plain copy */
            memcpy((char *)c->dst[i].data + off, (const char *)t->data + off,
                   (size_t)(g1 - g0) * 8 * row);
        else
            clb_repack_x8(t->type, t->shape[1], (g1 - g0) * 8, (const char *)t->data + off,
                          (char *)c->dst[i].data + off);
    }
}

clb_status clb_model_repack(clb_model *m, int experts, int64_t *n_repacked, char *err) {
    if (err) err[0] = '\0';
    if (n_repacked) *n_repacked = 0;
    if (!m) return CLB_E_ARG;
    if (experts && m->xc) {
        clb_set_err(err, "the expert cache repacks the experts it loads; repack the other "
                         "weights only");
        return CLB_E_ARG;
    }
    plan p = {0};
    collect(m, experts, &p); /* count */
    if (p.n == 0) return CLB_OK;
    /* one arena for every copy, on 2 MiB pages where the kernel grants them (weights are
     * streamed end to end; 4 KiB pages cost a TLB miss every 4 KiB) */
    p.slot = clb_pool_alloc(m->pool, (size_t)p.n * sizeof *p.slot);
    clb_tensor *tens = clb_pool_alloc(m->pool, (size_t)p.n * sizeof *tens);
    unsigned char *arena = clb_pool_alloc(m->pool, p.bytes + CLB_HUGE_PAGE);
    if (!p.slot || !tens || !arena) {
        clb_pool_free(m->pool, p.slot);
        clb_pool_free(m->pool, tens);
        clb_pool_free(m->pool, arena);
        clb_set_err(err, "out of memory repacking the weights (%zu bytes)", p.bytes);
        return CLB_E_NOMEM;
    }
    unsigned char *dst = (unsigned char *)(((uintptr_t)arena + CLB_HUGE_PAGE - 1) /
                                           CLB_HUGE_PAGE * CLB_HUGE_PAGE);
#ifdef MADV_HUGEPAGE
    madvise(dst, (p.bytes + CLB_HUGE_PAGE - 1) / CLB_HUGE_PAGE * CLB_HUGE_PAGE, MADV_HUGEPAGE);
#endif
    p.n = 0;
    p.bytes = 0;
    collect(m, experts, &p); /* fill the slots */
    for (int64_t i = 0; i < p.n; i++) {
        const clb_tensor *t = *p.slot[i];
        tens[i] = *t;
        tens[i].type = clb_x8_type(t->type);
        tens[i].data = dst;
        dst += (t->nbytes + 63) / 64 * 64;
    }
    /* every worker copies its share of each matrix's row groups */
    copy_ctx c = {&p, tens};
    if (!m->tp || clb_threadpool_run(m->tp, copy_task, &c) != CLB_OK) copy_task(&c, 0, 1);
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    for (int64_t i = 0; i < p.n; i++) {
        const clb_tensor *t = *p.slot[i];
        /* the source's whole pages: no one reads them again */
        uintptr_t p0 = ((uintptr_t)t->data + page - 1) / page * page;
        uintptr_t p1 = ((uintptr_t)t->data + t->nbytes) / page * page;
        if (p1 > p0) madvise((void *)p0, p1 - p0, MADV_DONTNEED);
        *p.slot[i] = &tens[i];
    }
    clb_pool_free(m->pool, p.slot);
    if (p.n > p.first_expert) m->experts_x8 = 1; /* some now live outside their mappings */
    if (n_repacked) *n_repacked = p.n;
    /* a file cut short while it was copied read as zeros: the copies are void */
    for (int i = 0; i < m->n_files; i++) {
        const char *path = clb_wfile_changed(m->files[i]);
        if (path) {
            clb_set_err(err, "weight file changed: %s changed while the model was loading; "
                             "restart to load it again", path);
            return CLB_E_IO;
        }
    }
    return CLB_OK;
}
