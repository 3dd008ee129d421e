# linear-attention kernels: the reference state update and conv step of csrc/clb_linear.h,
# for tests that check them against numpy. Uses numpy and InputError from _model.pxi.

cdef extern from "clb_linear.h" nogil:
    void clb_delta_step_ref(int64_t dk, int64_t dv, float *S, const float *q, const float *k,
                            const float *v, float decay, float beta, float *out, float *tmp)
    ctypedef void (*clb_delta_step_fn)(int64_t dk, int64_t dv, float *S, const float *q,
                                       const float *k, const float *v, float decay, float beta,
                                       float *out, float *tmp)
    clb_delta_step_fn clb_get_delta_step()
    void clb_conv_step_ref(int64_t C, int64_t K, int64_t c0, int64_t c1, const float *w,
                           float *win, const float *x, float *y)


def delta_step_ref(float[:, ::1] S not None, const float[::1] q not None,
                   const float[::1] k not None, const float[::1] v not None, float decay,
                   float beta):
    """One token's gated delta rule on one head (clb_delta_step_ref): S [dk, dv] float32 is
    updated in place; returns out [dv]."""
    return _delta_step(clb_delta_step_ref, S, q, k, v, decay, beta)


def delta_step(float[:, ::1] S not None, const float[::1] q not None,
               const float[::1] k not None, const float[::1] v not None, float decay,
               float beta):
    """delta_step_ref with the active kernel ISA's version (isa_force picks it)."""
    return _delta_step(clb_get_delta_step(), S, q, k, v, decay, beta)


cdef _delta_step(clb_delta_step_fn fn, float[:, ::1] S, const float[::1] q,
                 const float[::1] k, const float[::1] v, float decay, float beta):
    cdef int64_t dk = S.shape[0], dv = S.shape[1]
    if dk == 0 or dv == 0 or q.shape[0] != dk or k.shape[0] != dk or v.shape[0] != dv:
        raise InputError(f"delta_step_ref: S {S.shape[0]}x{S.shape[1]} does not fit q "
                         f"{q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    out = np.full(dv, np.nan, dtype=np.float32)
    tmp = np.empty(dv, dtype=np.float32)
    cdef float[::1] o = out
    cdef float[::1] t = tmp
    fn(dk, dv, &S[0, 0], &q[0], &k[0], &v[0], decay, beta, &o[0], &t[0])
    return out


def conv_step_ref(const float[:, ::1] w not None, float[:, ::1] win not None,
                  const float[::1] x not None):
    """One token's causal depthwise conv with SiLU (clb_conv_step_ref): w [C, K], the window
    win [K-1, C] of earlier inputs (updated in place), x [C]; returns y [C]."""
    cdef int64_t C = w.shape[0], K = w.shape[1]
    if C == 0 or K < 2 or win.shape[0] != K - 1 or win.shape[1] != C or x.shape[0] != C:
        raise InputError("conv_step_ref: w [C, K], win [K-1, C] and x [C] do not fit")
    out = np.full(C, np.nan, dtype=np.float32)
    cdef float[::1] y = out
    clb_conv_step_ref(C, K, 0, C, &w[0, 0], &win[0, 0], &x[0], &y[0])
    return out
