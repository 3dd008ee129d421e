/* Colibri matrix products: y[T, n_out] = x[T, n_in] @ W[n_out, n_in]^T (+ bias).
 * Guarantees: activations are converted once per row into the layout the active ISA's kernel
 * reads (clb_act_pack), then shared by every matrix that reads the same rows; several
 * matrices run in one thread-pool dispatch (clb_matmul_jobs); the workers claim spans of
 * rows from all the jobs in turn (clb_mm_claim), each reads its weight rows once for all the
 * job's tokens; every y[t, 0..n_out) is written exactly once, with a result that does not
 * depend on the number of threads or on which worker computed it.
 * Refuses: bad shapes/pointers (CLB_E_ARG); never allocates. */
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "clb_kernels.h"

/* default weight bytes of one row block: small enough to stay in L2 while every token passes
 * (a type's traits may ask for other sizes, see gemm_block_bytes) */
#define CLB_MM_BLOCK_BYTES (96 * 1024)
/* rows are handed out in multiples of this (the SIMD kernels' row tile) */
#define CLB_MM_ROW_ALIGN 16
/* the smallest span of rows a worker claims, in weight bytes: each span is a new stream that
 * the prefetchers ramp up on */
#define CLB_MM_MIN_SPAN_BYTES (64 * 1024)

static int64_t clb_block_rows(const clb_type_traits *tr, size_t w_row) {
    size_t bytes = tr->gemm_block_bytes ? tr->gemm_block_bytes : CLB_MM_BLOCK_BYTES;
    int64_t r = (int64_t)(bytes / (w_row ? w_row : 1));
    r -= r % CLB_MM_ROW_ALIGN;
    return r < CLB_MM_ROW_ALIGN ? CLB_MM_ROW_ALIGN : r;
}

size_t clb_act_row_size(clb_type t, int64_t n_in) {
    const clb_type_traits *tr = clb_get_type_traits(t);
    if (!tr || !tr->gemm || n_in <= 0 || n_in % CLB_QK != 0) return 0;
    return tr->act_size(n_in);
}

size_t clb_act_row_size_max(clb_type t, int64_t n_in) {
    size_t best = 0;
    if (n_in <= 0 || n_in % CLB_QK != 0) return 0;
    for (int i = 0; i < CLB_ISA_COUNT; i++) {
        const clb_type_traits *tr = clb_get_type_traits_isa((clb_isa)i, t);
        size_t s = tr && tr->gemm ? tr->act_size(n_in) : 0;
        best = s > best ? s : best;
    }
    return best;
}

void clb_act_pack(clb_type t, int64_t n_in, const float *x, int64_t ldx, int64_t n_tok,
                  void *act) {
    const clb_type_traits *tr = clb_get_type_traits(t);
    size_t row = tr->act_size(n_in);
    for (int64_t i = 0; i < n_tok; i++)
        tr->act_pack(n_in, x + i * ldx, (char *)act + (size_t)i * row);
}

/* The dispatch's rows as one sequence of row tiles, job after job, handed out from one
 * counter. */
typedef struct {
    const clb_mm_job *jobs;
    int n_jobs;
    int64_t n_tiles;   /* over all jobs */
    int64_t min_span;  /* tiles per claim at least */
    _Atomic int64_t next; /* the first tile not yet claimed */
} clb_mm_ctx;

static int64_t clb_job_tiles(const clb_mm_job *j) {
    return j->n_tok > 0 ? (j->n_out + CLB_MM_ROW_ALIGN - 1) / CLB_MM_ROW_ALIGN : 0;
}

/* rows [r0, r1) of one matrix w (the job's W or W_up) into y */
static void clb_mm_rows_of(const clb_mm_job *j, const clb_type_traits *tr, size_t w_row,
                           const char *w, float *y, int64_t r0, int64_t r1) {
    if (tr->gemm) {
        size_t act_row = tr->act_size(j->n_in);
        tr->gemm(j->n_in, r1 - r0, w + (size_t)r0 * w_row, w_row, j->act, act_row, j->n_tok,
                 y + r0, j->ldy);
        return;
    }
    for (int64_t t = 0; t < j->n_tok; t++) { /* float weights: f32 activations read in place */
        const float *a = (const float *)j->act + t * j->n_in;
        float *yt = y + t * j->ldy;
        for (int64_t r = r0; r < r1; r++) yt[r] = tr->vec_dot(j->n_in, w + (size_t)r * w_row, a);
    }
}

static void clb_mm_rows(const clb_mm_job *j, const clb_type_traits *tr, size_t w_row,
                        int64_t r0, int64_t r1) {
    clb_mm_rows_of(j, tr, w_row, j->w, j->y, r0, r1);
    if (j->bias)
        for (int64_t t = 0; t < j->n_tok; t++) {
            float *yt = j->y + t * j->ldy;
            for (int64_t r = r0; r < r1; r++) yt[r] += j->bias[r];
        }
    if (j->w_up) {
        /* gate and up rows of a block are computed back to back by the same worker, so the
         * gated product needs no extra pass over memory and no barrier */
        clb_mm_rows_of(j, tr, w_row, j->w_up, j->y_up, r0, r1);
        for (int64_t t = 0; t < j->n_tok; t++) {
            float *g = j->y + t * j->ldy + r0, *u = j->y_up + t * j->ldy + r0;
            if (j->bias_up)
                for (int64_t r = r0; r < r1; r++) u[r - r0] += j->bias_up[r];
            if (j->clamp)
                clb_glu_clamp_f32(r1 - r0, g, u, j->clamp);
            else
                clb_silu_mul_f32(r1 - r0, g, u);
        }
    }
}

/* tiles [t0, t1) of job j, walked in blocks of the type's size */
static void clb_mm_tiles(const clb_mm_job *j, int64_t t0, int64_t t1) {
    const clb_type_traits *tr = clb_get_type_traits(j->type);
    size_t w_row = clb_type_row_size(j->type, j->n_in);
    int64_t r_end = t1 * CLB_MM_ROW_ALIGN < j->n_out ? t1 * CLB_MM_ROW_ALIGN : j->n_out;
    int64_t blk = clb_block_rows(tr, w_row);
    for (int64_t r = t0 * CLB_MM_ROW_ALIGN; r < r_end; r += blk)
        clb_mm_rows(j, tr, w_row, r, r + blk < r_end ? r + blk : r_end);
}

/* Claims the next span of tiles into [*t0, *t1); 0 when none is left. A span is a share of
 * what is left (guided scheduling: large spans first, smaller ones towards the end), so a
 * worker that started late or ran slower (a busy core, a descheduled virtual CPU) ends up with
 * fewer rows instead of keeping the others waiting at the end of the dispatch. A lone worker
 * takes everything at once: one stream per matrix. */
static int clb_mm_claim(clb_mm_ctx *c, int nth, int64_t *t0, int64_t *t1) {
    int64_t t = atomic_load_explicit(&c->next, memory_order_relaxed), n;
    do {
        const int64_t left = c->n_tiles - t;
        if (left <= 0) return 0;
        n = nth > 1 ? left / (2 * (int64_t)nth) : left;
        n = n < c->min_span ? c->min_span : n;
        n = n > left ? left : n;
    } while (!atomic_compare_exchange_weak_explicit(&c->next, &t, t + n, memory_order_relaxed,
                                                    memory_order_relaxed));
    *t0 = t;
    *t1 = t + n;
    return 1;
}

static void clb_mm_task(void *vctx, int ith, int nth) {
    clb_mm_ctx *c = vctx;
    (void)ith;
    int k = 0;
    int64_t base = 0; /* job k holds the tiles [base, base + its tiles); claims only grow */
    int64_t t0, t1;
    while (clb_mm_claim(c, nth, &t0, &t1)) {
        while (t0 < t1) { /* a span may cross from one job into the next */
            while (t0 >= base + clb_job_tiles(&c->jobs[k])) base += clb_job_tiles(&c->jobs[k++]);
            const int64_t end = base + clb_job_tiles(&c->jobs[k]);
            const int64_t stop = t1 < end ? t1 : end;
            clb_mm_tiles(&c->jobs[k], t0 - base, stop - base);
            t0 = stop;
        }
    }
}

static clb_status clb_job_check(const clb_mm_job *j) {
    const clb_type_traits *tr = clb_get_type_traits(j->type);
    if (!tr || (tr->vec_dot == NULL && tr->gemm == NULL)) return CLB_E_ARG;
    if (j->n_out <= 0 || j->n_in <= 0 || j->n_tok < 0 || j->ldy < j->n_out) return CLB_E_ARG;
    if (clb_x8_base(j->type) != j->type && j->n_out % 8 != 0) return CLB_E_ARG; /* whole groups */
    size_t w_row = clb_type_row_size(j->type, j->n_in);
    /* the SIMD kernels address a row group of CLB_MM_ROW_ALIGN rows with 32-bit offsets */
    if (w_row == 0 || w_row > (size_t)INT32_MAX / CLB_MM_ROW_ALIGN || !j->w) return CLB_E_ARG;
    if (j->n_tok > 0 && (!j->act || !j->y)) return CLB_E_ARG;
    if (j->w_up && j->n_tok > 0 && !j->y_up) return CLB_E_ARG;
    if (!j->w_up && (j->bias_up || j->clamp)) return CLB_E_ARG;
    return CLB_OK;
}

clb_status clb_matmul_jobs(const clb_mm_job *jobs, int n_jobs, clb_threadpool *tp) {
    if (n_jobs < 0 || (n_jobs > 0 && !jobs)) return CLB_E_ARG;
    clb_mm_ctx c = {.jobs = jobs, .n_jobs = n_jobs, .min_span = 1};
    size_t w_row = 0;
    for (int k = 0; k < n_jobs; k++) {
        clb_status st = clb_job_check(&jobs[k]);
        if (st != CLB_OK) return st;
        c.n_tiles += clb_job_tiles(&jobs[k]);
        if (jobs[k].n_tok > 0 && w_row == 0)
            w_row = clb_type_row_size(jobs[k].type, jobs[k].n_in);
    }
    if (c.n_tiles == 0) return CLB_OK;
    const size_t tile_bytes = w_row * CLB_MM_ROW_ALIGN; /* of the first job: spans are rough */
    if (tile_bytes < CLB_MM_MIN_SPAN_BYTES)
        c.min_span = (int64_t)(CLB_MM_MIN_SPAN_BYTES / tile_bytes);
    atomic_init(&c.next, 0);
    /* a matmul issued from inside a pool task (work already split over the workers) gets
     * CLB_E_ARG from the pool and runs on the calling worker alone */
    if (tp && clb_threadpool_n_threads(tp) > 1 &&
        clb_threadpool_run(tp, clb_mm_task, &c) == CLB_OK)
        return CLB_OK;
    clb_mm_task(&c, 0, 1);
    return CLB_OK;
}

size_t clb_matmul_scratch_size(clb_type t, int64_t n_in, int64_t n_tokens) {
    const clb_type_traits *tr = clb_get_type_traits(t);
    if (!tr || (tr->vec_dot == NULL && tr->gemm == NULL) || n_tokens < 0) return 0;
    return clb_act_row_size_max(t, n_in) * (size_t)n_tokens; /* 0: f32 read in place */
}

clb_status clb_matmul(clb_type t, const void *w, int64_t n_out, int64_t n_in,
                      const float *x, int64_t n_tokens, float *y, int64_t ldy,
                      const float *bias, void *scratch, clb_threadpool *tp) {
    clb_mm_job j = {.type = t, .w = w, .n_out = n_out, .n_in = n_in, .act = x,
                    .n_tok = n_tokens, .y = y, .ldy = ldy, .bias = bias};
    clb_status st = clb_job_check(&j);
    if (st != CLB_OK || n_tokens == 0) return st;
    if (clb_get_type_traits(t)->gemm) {
        if (!scratch) return CLB_E_ARG;
        clb_act_pack(t, n_in, x, n_in, n_tokens, scratch);
        j.act = scratch;
    }
    return clb_matmul_jobs(&j, 1, tp);
}

void clb_get_row(clb_type t, const void *w, int64_t n, int64_t row, float *y) {
    size_t rs = clb_type_row_size(t, n);
    clb_dequantize_row(t, n, (const char *)w + (size_t)row * rs, y);
}
