# kernels binding: owned by the kernels work (see docs/INTERNALS.md)
#
# C declarations of csrc/clb_types.h, clb_kernels.h, clb_threadpool.h and clb_pool.h (the model
# binding in _model.pxi reuses clb_status, clb_type and clb_threadpool from here), plus small
# Python-level functions that tests use to drive every kernel, ISA variant, the pool and the
# thread pool. None of these are on the serving hot path.

from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memset
from cpython.mem cimport PyMem_Free, PyMem_Malloc

import numpy as np

from colibri.engine.errors import (
    ColibriError,
    ContextOverflowError,
    FormatError,
    InputError,
    ModelFileNotFoundError,
    ShapeError,
    StorageStalledError,
    WeightFileChangedError,
)

cdef extern from "clb_types.h" nogil:
    ctypedef enum clb_status:
        CLB_OK
        CLB_E_IO
        CLB_E_FORMAT
        CLB_E_SHAPE
        CLB_E_NOMEM
        CLB_E_ARG
        CLB_E_RANGE

    ctypedef enum clb_type:
        CLB_TYPE_F32
        CLB_TYPE_F16
        CLB_TYPE_BF16
        CLB_TYPE_Q8
        CLB_TYPE_Q4
        CLB_TYPE_Q8A
        CLB_TYPE_Q8X8
        CLB_TYPE_Q4X8
        CLB_TYPE_Q6
        CLB_TYPE_Q6X8
        CLB_TYPE_MXFP4
        CLB_TYPE_MXFP4X8
        CLB_TYPE_COUNT

    int CLB_QK
    ctypedef uint16_t clb_f16
    ctypedef uint16_t clb_bf16

    ctypedef float (*clb_vec_dot_fn)(int64_t n, const void *w_row, const void *act_row)
    ctypedef void (*clb_from_float_fn)(int64_t n, const float *x, void *y)
    ctypedef void (*clb_to_float_fn)(int64_t n, const void *x, float *y)

    ctypedef struct clb_type_traits:
        const char *name
        int64_t blck_size
        size_t type_size
        clb_type act_type
        clb_to_float_fn to_float
        clb_vec_dot_fn vec_dot
        clb_from_float_fn from_float

    size_t clb_type_row_size(clb_type t, int64_t n)
    int clb_type_valid_for_file(uint32_t t)
    float clb_f16_to_f32(clb_f16 h)
    clb_f16 clb_f32_to_f16(float f)
    float clb_bf16_to_f32(clb_bf16 h)
    clb_bf16 clb_f32_to_bf16(float f)

cdef extern from "clb_threadpool.h" nogil:
    ctypedef struct clb_threadpool:
        pass
    ctypedef void (*clb_task_fn)(void *ctx, int ith, int nth) noexcept nogil
    clb_status clb_threadpool_init(clb_threadpool **out, int n_threads)
    void clb_threadpool_free(clb_threadpool *tp)
    int clb_threadpool_n_threads(const clb_threadpool *tp)
    clb_status clb_threadpool_run(clb_threadpool *tp, clb_task_fn fn, void *ctx)
    int clb_physical_cores()

cdef extern from "clb_kernels.h" nogil:
    ctypedef enum clb_isa:
        CLB_ISA_REF
        CLB_ISA_AVX2
        CLB_ISA_AVXVNNI
        CLB_ISA_AVX512
        CLB_ISA_COUNT

    void clb_kernels_init()

    clb_isa clb_isa_best()
    int clb_isa_supported(clb_isa isa)
    clb_status clb_isa_force(clb_isa isa)
    clb_isa clb_isa_active()
    const char *clb_isa_name(clb_isa isa)
    ctypedef enum clb_stream_hint:
        CLB_STREAM_L2
        CLB_STREAM_NTA
        CLB_STREAM_COUNT
    clb_stream_hint clb_stream_hint_best()
    clb_status clb_stream_hint_force(clb_stream_hint h)
    clb_stream_hint clb_stream_hint_active()
    const char *clb_stream_hint_name(clb_stream_hint h)
    const clb_type_traits *clb_get_type_traits(clb_type t)
    void clb_dequantize_row(clb_type t, int64_t n, const void *x, float *y)
    size_t clb_matmul_scratch_size(clb_type t, int64_t n_in, int64_t n_tokens)
    clb_status clb_matmul(clb_type t, const void *w, int64_t n_out, int64_t n_in,
                          const float *x, int64_t n_tokens, float *y, int64_t ldy,
                          const float *bias, void *scratch, clb_threadpool *tp)
    void clb_get_row(clb_type t, const void *w, int64_t n, int64_t row, float *y)
    size_t clb_act_row_size(clb_type t, int64_t n_in)
    void clb_act_pack(clb_type t, int64_t n_in, const float *x, int64_t ldx, int64_t n_tok,
                      void *act)
    ctypedef struct clb_mm_job:
        clb_type type
        const void *w
        int64_t n_out, n_in
        const void *act
        int64_t n_tok
        float *y
        int64_t ldy
        const float *bias
        const void *w_up
        float *y_up
        const float *bias_up
        const void *clamp
    clb_status clb_matmul_jobs(const clb_mm_job *jobs, int n_jobs, clb_threadpool *tp)
    void clb_vec_mad_f32(int64_t n, float *y, const float *x, float a)
    void clb_silu_mul_f32(int64_t n, float *g, const float *u)
    ctypedef float (*clb_att_dots_fn)(int64_t hd, const float *q, const float *k, int64_t ldk,
                                      int64_t n, float scale, float *s)
    ctypedef void (*clb_att_mad_rows_fn)(int64_t hd, float *out, const float *v, int64_t ldv,
                                         int64_t n, const float *w)
    ctypedef float (*clb_att_exp_sum_fn)(int64_t n, float *s, float top)
    ctypedef struct clb_att_kernels:
        clb_att_dots_fn dots
        clb_att_mad_rows_fn mad_rows
        clb_att_exp_sum_fn exp_sum
    const clb_att_kernels *clb_get_att_kernels()
    clb_type clb_x8_type(clb_type t)
    int clb_kernel_wants_x8(clb_type t)
    void clb_repack_x8(clb_type t, int64_t n, int64_t n_rows, const void *src, void *dst)
    void clb_repack_x8_inplace(clb_type t, int64_t n, int64_t n_rows, void *w, void *scratch)

cdef extern from "clb_kernels_isa.h" nogil:
    void clb_repack_x8_ref(clb_type t, int64_t n, int64_t n_rows, const void *src, void *dst)

cdef extern from "clb_pool.h" nogil:
    ctypedef struct clb_pool:
        pass
    ctypedef struct clb_pool_stats:
        size_t bytes_in_use[3]
        size_t bytes_total
        size_t bytes_peak
        uint64_t n_alloc
        uint64_t n_free
    clb_pool *clb_pool_init()
    void clb_pool_free_all(clb_pool *p)
    void *clb_pool_alloc(clb_pool *p, size_t size)
    void clb_pool_free(clb_pool *p, void *ptr)
    void clb_pool_get_stats(clb_pool *p, clb_pool_stats *out)


ISA_NAMES = ("ref", "avx2", "avxvnni", "avx512")
STREAM_HINTS = ("l2", "nta")

clb_kernels_init()


cdef dict _types_by_name(bint row_access):
    """name -> clb_type from the C traits table (the names are the same in every ISA's table);
    row_access: only the types whose rows the kernels below can read (to_float), leaving out
    the interleaved layouts of q8/q4/q6 weights that only the matrix products read."""
    cdef const clb_type_traits *tr
    out = {}
    for t in range(CLB_TYPE_COUNT):
        tr = clb_get_type_traits(<clb_type>t)
        if not row_access or tr.to_float != NULL:
            out[tr.name.decode("ascii")] = t
    return out


# The C core's weight types by name: a copy of its table, never a second spelling of it.
PRODUCT_TYPES = _types_by_name(False)
KERNEL_TYPES = _types_by_name(True)


def weight_types() -> list:
    """Every weight type of the C core as (id, name, elements per block, bytes per block, whether
    weight files may hold it), from the traits table (for the contract test against
    engine/format/quant.py's WEIGHT_TYPES)."""
    cdef const clb_type_traits *tr
    out = []
    for t in range(CLB_TYPE_COUNT):
        tr = clb_get_type_traits(<clb_type>t)
        out.append((t, tr.name.decode("ascii"), tr.blck_size, tr.type_size,
                    bool(clb_type_valid_for_file(t))))
    return out


def _status_error(int st, message=b"", arg_cls=InputError, range_cls=ContextOverflowError):
    """The Python exception for a C status and its message (the C error buffer's bytes, or a
    str): the one mapping every binding raises through. Bad arguments are InputErrors
    (ValueErrors), a limit exceeded a ContextOverflowError; a caller whose arguments are a
    configuration, not input, names other classes for those two. A failed allocation is a
    MemoryError, a corrupt file a FormatError, an I/O failure an OSError."""
    msg = message.decode("utf-8", "replace") if isinstance(message, bytes) else str(message)
    if not msg:
        msg = f"C core error {int(st)}"
    if st == CLB_E_IO:
        if msg.startswith("missing file: "):
            return ModelFileNotFoundError(msg)
        if msg.startswith("weight file changed: "):
            return WeightFileChangedError(msg)
        if msg.startswith("storage stalled: "):
            return StorageStalledError(msg)
        return OSError(msg)
    if st == CLB_E_FORMAT:
        return FormatError(msg)
    if st == CLB_E_SHAPE:
        return ShapeError(msg)
    if st == CLB_E_NOMEM:
        return MemoryError(msg)
    if st == CLB_E_RANGE:
        return range_cls(msg)
    if st == CLB_E_ARG:
        return arg_cls(msg)
    return ColibriError(msg)


cdef clb_type _kernel_type(str name, bint product=False) except *:
    types = PRODUCT_TYPES if product else KERNEL_TYPES
    if name not in types:
        raise ValueError(f"unknown type {name!r}")
    return <clb_type><int>types[name]


cdef const unsigned char[::1] _matrix_bytes(clb_type t, w, int64_t n_out, int64_t n_in) except *:
    """w's bytes, refused unless they hold exactly a [n_out, n_in] matrix of type t."""
    cdef size_t rs = _row_bytes(t, n_in)
    cdef const unsigned char[::1] wv = memoryview(w).cast("B")
    if <size_t>wv.shape[0] != rs * <size_t>n_out:
        raise ValueError(f"expected {rs * n_out} weight bytes, got {wv.shape[0]}")
    return wv


def repack_x8(name: str, w, int n_out, int n_in, bint in_place=False, bint ref=False) -> bytes:
    """The bytes of a [n_out, n_in] q8, q4, q6 or mxfp4 matrix (n_out a multiple of 8) in the
    8-row interleaved layout (type "q8x8" / "q4x8" / "q6x8" / "mxfp4x8" for matmul), through the
    copying or the in-place repack (the CPU's fastest), or the plain C reference (ref)."""
    cdef clb_type t = _kernel_type(name)
    if clb_x8_type(t) == t:
        raise ValueError(f"only q8, q4, q6 and mxfp4 weights have an interleaved layout, "
                         f"not {name!r}")
    if n_out <= 0 or n_out % 8:
        raise ValueError(f"rows must be a positive multiple of 8, got {n_out}")
    cdef size_t rs = _row_bytes(t, n_in)
    cdef const unsigned char[::1] wv = _matrix_bytes(t, w, n_out, n_in)
    out = bytearray(wv.shape[0])
    cdef unsigned char[::1] ov = out
    scratch = bytearray(8 * rs)
    cdef unsigned char[::1] sv = scratch
    if ref:
        clb_repack_x8_ref(t, n_in, n_out, &wv[0], &ov[0])
    elif in_place:
        ov[:] = wv
        clb_repack_x8_inplace(t, n_in, n_out, &ov[0], &sv[0])
    else:
        clb_repack_x8(t, n_in, n_out, &wv[0], &ov[0])
    return bytes(out)


def wants_x8(name: str) -> bool:
    """Whether the active ISA repacks weights of this type at load."""
    return bool(clb_kernel_wants_x8(_kernel_type(name)))


cdef clb_isa _isa_of(str name) except *:
    if name not in ISA_NAMES:
        raise ValueError(f"unknown ISA {name!r}")
    return <clb_isa><int>ISA_NAMES.index(name)


def isa_supported() -> list:
    """Names of the ISA variants this CPU and build can run, reference first."""
    return [ISA_NAMES[i] for i in range(<int>CLB_ISA_COUNT) if clb_isa_supported(<clb_isa>i)]


def isa_best() -> str:
    """Name of the ISA picked from CPUID at start-up."""
    return clb_isa_name(clb_isa_best()).decode()


def isa_active() -> str:
    """Name of the ISA the kernels use now."""
    return clb_isa_name(clb_isa_active()).decode()


def isa_force(name: str) -> None:
    """Make every kernel call use this ISA's table (process-wide): tests, and COLIBRI_ISA."""
    if clb_isa_force(_isa_of(name)) != CLB_OK:
        raise ValueError(f"ISA {name!r} is not supported on this CPU/build")


def stream_hint_best() -> str:
    """How the AVX-512 interleaved products prefetch weights, as picked from CPUID at start-up:
    "l2" (into L2) or "nta" (non-temporal)."""
    return clb_stream_hint_name(clb_stream_hint_best()).decode()


def stream_hint_active() -> str:
    """The prefetch hint the AVX-512 interleaved products use now."""
    return clb_stream_hint_name(clb_stream_hint_active()).decode()


def stream_hint_force(name: str) -> None:
    """Make the AVX-512 interleaved products prefetch this way (process-wide): benchmarks,
    tests and COLIBRI_STREAM_HINT. Results do not depend on it."""
    if name not in STREAM_HINTS:
        raise ValueError(f"unknown prefetch hint {name!r}; choose one of "
                         f"{', '.join(STREAM_HINTS)}")
    clb_stream_hint_force(<clb_stream_hint><int>STREAM_HINTS.index(name))


def type_row_size(name: str, n: int) -> int:
    """Bytes of one row of n elements of any type, the interleaved layouts included (0 if n
    does not fill whole blocks)."""
    return clb_type_row_size(_kernel_type(name, product=True), n)


def type_valid_for_file(t: int) -> bool:
    return bool(clb_type_valid_for_file(<uint32_t>t))


cdef size_t _row_bytes(clb_type t, int64_t n) except 0:
    cdef size_t rs = clb_type_row_size(t, n)
    if rs == 0:
        raise ValueError(f"row length {n} does not fill whole blocks")
    return rs


def quantize(name: str, x) -> bytes:
    """A 1-D float32 array as the bytes of type `name`, with the active ISA's from_float."""
    cdef clb_type t = _kernel_type(name)
    cdef const float[::1] xv = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    cdef int64_t n = xv.shape[0]
    cdef size_t rs = _row_bytes(t, n)
    out = bytearray(rs)
    cdef unsigned char[::1] ov = out
    cdef const clb_type_traits *tr = clb_get_type_traits(t)
    if tr.from_float == NULL:
        raise ValueError(f"{name} has no quantizer in the C core")
    if n > 0:
        with nogil:
            tr.from_float(n, &xv[0], &ov[0])
    return bytes(out)


def dequantize(name: str, data, n: int):
    """Bytes of type `name` (n elements) back to a float32 array (reference to_float)."""
    cdef clb_type t = _kernel_type(name)
    cdef size_t rs = _row_bytes(t, n)
    cdef const unsigned char[::1] dv = memoryview(data).cast("B")
    if <size_t>dv.shape[0] != rs:
        raise ValueError(f"expected {rs} bytes, got {dv.shape[0]}")
    out = np.empty(n, dtype=np.float32)
    cdef float[::1] ov = out
    if n > 0:
        clb_dequantize_row(t, n, &dv[0], &ov[0])
    return out


def to_float(name: str, data, n: int):
    """Like dequantize, but through the active ISA's traits table (to_float)."""
    cdef clb_type t = _kernel_type(name)
    cdef size_t rs = _row_bytes(t, n)
    cdef const unsigned char[::1] dv = memoryview(data).cast("B")
    if <size_t>dv.shape[0] != rs:
        raise ValueError(f"expected {rs} bytes, got {dv.shape[0]}")
    out = np.empty(n, dtype=np.float32)
    cdef float[::1] ov = out
    if n > 0:
        clb_get_type_traits(t).to_float(n, &dv[0], &ov[0])
    return out


def vec_dot(name: str, w, x) -> float:
    """Dot product of one weight row (bytes of type `name`) with a float32 vector x; x is
    converted to the type's activation type with the active ISA first."""
    cdef clb_type t = _kernel_type(name)
    cdef const clb_type_traits *tr = clb_get_type_traits(t)
    if tr.vec_dot == NULL:
        raise ValueError(f"{name} has no dot product")
    cdef const float[::1] xv = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    cdef int64_t n = xv.shape[0]
    cdef size_t rs = _row_bytes(t, n)
    cdef const unsigned char[::1] wv = memoryview(w).cast("B")
    if <size_t>wv.shape[0] != rs:
        raise ValueError(f"expected {rs} weight bytes, got {wv.shape[0]}")
    cdef const clb_type_traits *at = clb_get_type_traits(tr.act_type)
    act = bytearray(_row_bytes(tr.act_type, n))
    cdef unsigned char[::1] av = act
    at.from_float(n, &xv[0], &av[0])
    return tr.vec_dot(n, &wv[0], &av[0])


def vec_mad_f32(y, x, float a):
    """y + a * x (float32 vectors of one length) with the active ISA's kernel; returns a new
    array, y is not modified."""
    out = np.array(y, dtype=np.float32).reshape(-1)
    cdef const float[::1] xv = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if xv.shape[0] != out.shape[0]:
        raise ValueError("x and y must have the same length")
    cdef float[::1] ov = out
    if out.shape[0] > 0:
        clb_vec_mad_f32(out.shape[0], &ov[0], &xv[0], a)
    return out


def silu_mul(g, u):
    """silu(g) * u = g / (1 + exp(-g)) * u (float32 vectors of one length) with the active
    ISA's kernel, as the gated expert products apply it; returns a new array."""
    out = np.array(g, dtype=np.float32).reshape(-1)
    cdef const float[::1] uv = np.ascontiguousarray(u, dtype=np.float32).reshape(-1)
    if uv.shape[0] != out.shape[0]:
        raise ValueError("g and u must have the same length")
    cdef float[::1] ov = out
    if out.shape[0] > 0:
        clb_silu_mul_f32(out.shape[0], &ov[0], &uv[0])
    return out


def att_dots(q, k, float scale=1.0):
    """Attention scores (q . k[r]) * scale for every row of k ([n, hd] float32, n >= 1) with the
    active ISA's kernel, one call over all rows; returns (scores, the largest score)."""
    cdef const float[::1] qv = np.ascontiguousarray(q, dtype=np.float32).reshape(-1)
    cdef const float[:, ::1] kv = np.ascontiguousarray(k, dtype=np.float32)
    if kv.shape[0] < 1 or kv.shape[1] != qv.shape[0] or qv.shape[0] < 1:
        raise ValueError("k must be [n >= 1, len(q)] and q not empty")
    out = np.empty(kv.shape[0], dtype=np.float32)
    cdef float[::1] ov = out
    cdef float top = clb_get_att_kernels().dots(qv.shape[0], &qv[0], &kv[0, 0], kv.shape[1],
                                                kv.shape[0], scale, &ov[0])
    return out, top


def att_mad_rows(out, v, w):
    """out + sum over r of w[r] * v[r] (v [n, hd], w [n], float32) with the active ISA's
    kernel, one call over all rows; returns a new array."""
    res = np.array(out, dtype=np.float32).reshape(-1)
    cdef const float[:, ::1] vv = np.ascontiguousarray(v, dtype=np.float32)
    cdef const float[::1] wv = np.ascontiguousarray(w, dtype=np.float32).reshape(-1)
    if (vv.shape[0] < 1 or vv.shape[1] != res.shape[0] or wv.shape[0] != vv.shape[0]
            or res.shape[0] < 1):
        raise ValueError("v must be [n >= 1, len(out)] and w [n]")
    cdef float[::1] rv = res
    clb_get_att_kernels().mad_rows(rv.shape[0], &rv[0], &vv[0, 0], vv.shape[1], vv.shape[0],
                                   &wv[0])
    return res


def att_exp_sum(s, float top):
    """(exp(s - top), their sum) for float32 scores s [n >= 1] with the active ISA's softmax
    kernel; s itself is not changed."""
    res = np.array(s, dtype=np.float32).reshape(-1)
    if res.shape[0] < 1:
        raise ValueError("s must hold at least one score")
    cdef float[::1] rv = res
    cdef float total = clb_get_att_kernels().exp_sum(rv.shape[0], &rv[0], top)
    return res, total


cdef dict _pools_by_threads = {}


cdef class ThreadPool:
    """Owns one clb_threadpool (the model binding may wrap its own)."""
    cdef clb_threadpool *tp

    def __cinit__(self, int n_threads):
        cdef clb_status st = clb_threadpool_init(&self.tp, n_threads)
        if st != CLB_OK:
            raise _status_error(st, f"cannot start a thread pool of {n_threads} threads")

    def __dealloc__(self):
        clb_threadpool_free(self.tp)
        self.tp = NULL

    @property
    def n_threads(self) -> int:
        return clb_threadpool_n_threads(self.tp)


cdef ThreadPool _shared_pool(int n_threads):
    if n_threads not in _pools_by_threads:
        _pools_by_threads[n_threads] = ThreadPool(n_threads)
    return _pools_by_threads[n_threads]


def matmul(name: str, w, int n_out, int n_in, x, bias=None, int n_threads=1, int ldy=0):
    """y[T, n_out] = x[T, n_in] @ W[n_out, n_in]^T (+ bias) with W given as bytes of type
    `name`. The output is pre-filled with NaN (and the ldy padding columns with a sentinel),
    so an element the kernel fails to write shows up; returns the [T, ldy] buffer's first
    n_out columns when ldy == 0, else the whole [T, ldy] buffer."""
    cdef clb_type t = _kernel_type(name, True)
    cdef const float[:, ::1] xv = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, n_in)
    cdef int64_t n_tok = xv.shape[0]
    cdef const unsigned char[::1] wv = _matrix_bytes(t, w, n_out, n_in)
    cdef int64_t stride = ldy if ldy > 0 else n_out
    y = np.full((n_tok, stride), np.nan, dtype=np.float32)
    if stride > n_out:
        y[:, n_out:] = 12345.0
    cdef float[:, ::1] yv = y
    cdef const float[::1] bv
    cdef const float *bp = NULL
    if bias is not None:
        bv = np.ascontiguousarray(bias, dtype=np.float32).reshape(-1)
        if bv.shape[0] != n_out:
            raise ValueError("bias must have n_out elements")
        bp = &bv[0]
    scratch = bytearray(max(<size_t>1, clb_matmul_scratch_size(t, n_in, n_tok)))
    cdef unsigned char[::1] sv = scratch
    cdef ThreadPool pool = _shared_pool(n_threads)
    cdef const float *xp = &xv[0, 0] if n_tok > 0 else NULL
    cdef float *yp = &yv[0, 0] if n_tok > 0 else NULL
    cdef clb_status st
    with nogil:
        st = clb_matmul(t, &wv[0], n_out, n_in, xp, n_tok, yp, stride, bp, &sv[0], pool.tp)
    if st != CLB_OK:
        raise _status_error(st, f"clb_matmul failed with status {int(st)}")
    return y if ldy > 0 else y[:, :n_out]


def matmul_jobs(jobs, int n_threads=1):
    """Several products in one thread-pool dispatch, as the forward pass runs them. jobs: a list
    of (name, w, n_out, n_in, x, w_up), w_up None or the up matrix of a gated job (then the
    result is silu(x @ W^T) * (x @ W_up^T)). Returns one [T, n_out] array per job."""
    cdef int n = len(jobs)
    cdef clb_mm_job *js = <clb_mm_job *>PyMem_Malloc(max(1, n) * sizeof(clb_mm_job))
    if js == NULL:
        raise MemoryError()
    keep = []  # the buffers the jobs point into, alive until the dispatch returns
    outs = []
    cdef clb_type t
    cdef const unsigned char[::1] wv
    cdef const unsigned char[::1] uv
    cdef const float[:, ::1] xv
    cdef unsigned char[::1] av
    cdef float[:, ::1] yv
    cdef float[:, ::1] upv
    cdef size_t arow
    cdef int k
    cdef clb_status st
    cdef clb_threadpool *tp
    try:
        for k in range(n):
            name, w, n_out, n_in, x, w_up = jobs[k]
            t = _kernel_type(name, True)
            wv = _matrix_bytes(t, w, n_out, n_in)
            xa = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, n_in)
            xv = xa
            y = np.full((xa.shape[0], n_out), np.nan, dtype=np.float32)
            yv = y
            js[k] = clb_mm_job(type=t, w=&wv[0], n_out=n_out, n_in=n_in, act=NULL,
                               n_tok=xa.shape[0], y=NULL, ldy=n_out, bias=NULL, w_up=NULL,
                               y_up=NULL, bias_up=NULL, clamp=NULL)
            if xa.shape[0] > 0:
                js[k].y = &yv[0, 0]
                arow = clb_act_row_size(t, n_in)
                if arow:
                    act = bytearray(arow * <size_t>xa.shape[0])
                    av = act
                    clb_act_pack(t, n_in, &xv[0, 0], n_in, xa.shape[0], &av[0])
                    js[k].act = &av[0]
                    keep.append(act)
                else:
                    js[k].act = &xv[0, 0]
            if w_up is not None:  # the up product's own output: scratch for the gated result
                uv = _matrix_bytes(t, w_up, n_out, n_in)
                up = np.empty_like(y)
                upv = up
                js[k].w_up = &uv[0]
                if xa.shape[0] > 0:
                    js[k].y_up = &upv[0, 0]
                keep.extend((w_up, up))
            keep.extend((w, xa))
            outs.append(y)
        tp = _shared_pool(n_threads).tp
        with nogil:
            st = clb_matmul_jobs(js, n, tp)
        if st != CLB_OK:
            raise _status_error(st, f"clb_matmul_jobs failed with status {int(st)}")
        return outs
    finally:
        PyMem_Free(js)


def get_row(name: str, w, int n, int row):
    """Row `row` of a [rows, n] weight matrix given as bytes of type `name`, as float32."""
    cdef clb_type t = _kernel_type(name)
    cdef size_t rs = _row_bytes(t, n)
    cdef const unsigned char[::1] wv = memoryview(w).cast("B")
    if row < 0 or <size_t>(row + 1) * rs > <size_t>wv.shape[0]:
        raise IndexError("row out of range")
    out = np.empty(n, dtype=np.float32)
    cdef float[::1] ov = out
    clb_get_row(t, &wv[0], n, row, &ov[0])
    return out


def f32_to_f16_bits(x):
    """float32 array -> IEEE half bit patterns (uint16) via clb_f32_to_f16."""
    cdef const float[::1] xv = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    out = np.empty(xv.shape[0], dtype=np.uint16)
    cdef uint16_t[::1] ov = out
    cdef Py_ssize_t i
    for i in range(xv.shape[0]):
        ov[i] = clb_f32_to_f16(xv[i])
    return out


def f16_bits_to_f32(h):
    """IEEE half bit patterns (uint16) -> float32 via clb_f16_to_f32."""
    cdef const uint16_t[::1] hv = np.ascontiguousarray(h, dtype=np.uint16).reshape(-1)
    out = np.empty(hv.shape[0], dtype=np.float32)
    cdef float[::1] ov = out
    cdef Py_ssize_t i
    for i in range(hv.shape[0]):
        ov[i] = clb_f16_to_f32(hv[i])
    return out


def f32_to_bf16_bits(x):
    """float32 array -> bfloat16 bit patterns (uint16) via clb_f32_to_bf16."""
    cdef const float[::1] xv = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    out = np.empty(xv.shape[0], dtype=np.uint16)
    cdef uint16_t[::1] ov = out
    cdef Py_ssize_t i
    for i in range(xv.shape[0]):
        ov[i] = clb_f32_to_bf16(xv[i])
    return out


def bf16_bits_to_f32(h):
    """bfloat16 bit patterns (uint16) -> float32 via clb_bf16_to_f32."""
    cdef const uint16_t[::1] hv = np.ascontiguousarray(h, dtype=np.uint16).reshape(-1)
    out = np.empty(hv.shape[0], dtype=np.float32)
    cdef float[::1] ov = out
    cdef Py_ssize_t i
    for i in range(hv.shape[0]):
        ov[i] = clb_bf16_to_f32(hv[i])
    return out


def physical_cores() -> int:
    """Physical cores of this machine (SMT siblings counted once)."""
    return clb_physical_cores()


# ---- thread pool exerciser ----

ctypedef struct _tp_count_ctx:
    int32_t *counts   # [nth] times each ith ran in this run
    int32_t *nth_seen # [nth] the nth each worker was given


cdef void _tp_count_task(void *vctx, int ith, int nth) noexcept nogil:
    cdef _tp_count_ctx *c = <_tp_count_ctx *>vctx
    c.counts[ith] += 1
    c.nth_seen[ith] = nth


def threadpool_exercise(int n_threads, int n_runs):
    """Runs a task n_runs times on a fresh pool; returns (counts[n_runs, n_threads],
    nth_seen[n_runs, n_threads]) where counts[r, i] is how often worker i ran in run r."""
    cdef ThreadPool pool = ThreadPool(n_threads)
    counts = np.zeros((n_runs, n_threads), dtype=np.int32)
    seen = np.zeros((n_runs, n_threads), dtype=np.int32)
    cdef int32_t[:, ::1] cv = counts
    cdef int32_t[:, ::1] sv = seen
    cdef _tp_count_ctx ctx
    cdef int r
    cdef clb_status st = CLB_OK
    with nogil:
        for r in range(n_runs):
            ctx.counts = &cv[r, 0]
            ctx.nth_seen = &sv[r, 0]
            st = clb_threadpool_run(pool.tp, _tp_count_task, &ctx)
            if st != CLB_OK:
                break
    if st != CLB_OK:
        raise _status_error(st, f"clb_threadpool_run failed with status {int(st)}")
    return counts, seen


ctypedef struct _tp_nested_ctx:
    clb_threadpool *tp
    int32_t *status   # [nth]


cdef void _tp_nested_task(void *vctx, int ith, int nth) noexcept nogil:
    cdef _tp_nested_ctx *c = <_tp_nested_ctx *>vctx
    c.status[ith] = <int32_t>clb_threadpool_run(c.tp, _tp_count_task, NULL)


def threadpool_nested_status(int n_threads):
    """Status each worker gets when it tries to start a run from inside a task."""
    cdef ThreadPool pool = ThreadPool(n_threads)
    out = np.full(n_threads, 99, dtype=np.int32)
    cdef int32_t[::1] ov = out
    cdef _tp_nested_ctx ctx
    ctx.tp = pool.tp
    ctx.status = &ov[0]
    with nogil:
        clb_threadpool_run(pool.tp, _tp_nested_task, &ctx)
    return out


# ---- memory pool exercisers ----

cdef class Pool:
    """A clb_pool for tests: alloc returns the address as an int."""
    cdef clb_pool *p

    def __cinit__(self):
        self.p = clb_pool_init()
        if self.p == NULL:
            raise MemoryError()

    def __dealloc__(self):
        clb_pool_free_all(self.p)
        self.p = NULL

    def alloc(self, size_t size) -> int:
        return <size_t>clb_pool_alloc(self.p, size)

    def free(self, size_t addr) -> None:
        clb_pool_free(self.p, <void *>addr)

    def fill(self, size_t addr, size_t size, int value) -> None:
        """Writes `value` into every byte of [addr, addr + size) (touches the whole block)."""
        memset(<void *>addr, value, size)

    def check(self, size_t addr, size_t size, int value) -> bool:
        """True if every byte of [addr, addr + size) equals `value`."""
        cdef const uint8_t *b = <const uint8_t *>addr
        cdef size_t i
        for i in range(size):
            if b[i] != <uint8_t>value:
                return False
        return True

    def stats(self) -> dict:
        cdef clb_pool_stats s
        clb_pool_get_stats(self.p, &s)
        return {"small": s.bytes_in_use[0], "medium": s.bytes_in_use[1],
                "large": s.bytes_in_use[2], "total": s.bytes_total, "peak": s.bytes_peak,
                "n_alloc": s.n_alloc, "n_free": s.n_free}


ctypedef struct _pool_stress_ctx:
    clb_pool *p
    int n_iters
    int n_slots
    size_t max_size
    int64_t *errors   # [nth]


cdef inline uint32_t _xorshift(uint32_t *s) noexcept nogil:
    s[0] ^= s[0] << 13
    s[0] ^= s[0] >> 17
    s[0] ^= s[0] << 5
    return s[0]


cdef void _pool_stress_task(void *vctx, int ith, int nth) noexcept nogil:
    """Each worker keeps n_slots live blocks, replaces random ones, stamps every block with
    its own byte pattern and checks it is intact (and 64-byte aligned) before freeing."""
    cdef _pool_stress_ctx *c = <_pool_stress_ctx *>vctx
    cdef uint32_t seed = <uint32_t>(1234 + 7919 * ith)
    cdef uint8_t *ptrs[64]
    cdef size_t sizes[64]
    cdef int i, k, slot
    cdef size_t j, size
    cdef uint8_t tag
    cdef int64_t errors = 0
    cdef int n_slots = c.n_slots if c.n_slots <= 64 else 64
    for i in range(n_slots):
        ptrs[i] = NULL
        sizes[i] = 0
    for k in range(c.n_iters + n_slots):
        slot = k % n_slots if k >= c.n_iters else <int>(_xorshift(&seed) % <uint32_t>n_slots)
        if ptrs[slot] != NULL:
            tag = <uint8_t>((<size_t>ptrs[slot] >> 6) ^ <size_t>ith)
            for j in range(sizes[slot]):
                if ptrs[slot][j] != tag:
                    errors += 1
                    break
            clb_pool_free(c.p, ptrs[slot])
            ptrs[slot] = NULL
        if k >= c.n_iters:
            continue
        # mostly small/medium sizes, an occasional large block
        if _xorshift(&seed) % 256 == 0:
            size = (1 << 20) + <size_t>(_xorshift(&seed) % 100000)
        else:
            size = 1 + <size_t>(_xorshift(&seed) % c.max_size)
        ptrs[slot] = <uint8_t *>clb_pool_alloc(c.p, size)
        sizes[slot] = size
        if ptrs[slot] == NULL or (<size_t>ptrs[slot]) % 64 != 0:
            errors += 1
            ptrs[slot] = NULL
            continue
        tag = <uint8_t>((<size_t>ptrs[slot] >> 6) ^ <size_t>ith)
        memset(ptrs[slot], tag, size)
    c.errors[ith] = errors


def pool_stress(int n_threads, int n_iters, int n_slots=32, size_t max_size=300000):
    """Multi-threaded random alloc/free on one pool; returns (errors per worker, stats)."""
    cdef Pool pool = Pool()
    cdef ThreadPool tp = ThreadPool(n_threads)
    errors = np.zeros(n_threads, dtype=np.int64)
    cdef int64_t[::1] ev = errors
    cdef _pool_stress_ctx ctx
    ctx.p = pool.p
    ctx.n_iters = n_iters
    ctx.n_slots = n_slots
    ctx.max_size = max_size
    ctx.errors = &ev[0]
    with nogil:
        clb_threadpool_run(tp.tp, _pool_stress_task, &ctx)
    return errors, pool.stats()
