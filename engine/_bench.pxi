# bench binding: the machine probes `colibri bench` reports (csrc/clb_bench.h), and the storage
# probe the expert cache sizes its reader pool with (csrc/clb_storage_probe.h).
#
# bandwidth_probe reads a fresh buffer with n threads and returns the best pass in GB/s; it
# releases the GIL and refuses bad arguments with a ValueError. Uses clb_status from
# _kernels.pxi.

cdef extern from "clb_bench.h" nogil:
    int CLB_BENCH_ERR_LEN
    clb_status clb_bandwidth_probe(size_t nbytes, int n_threads, int n_passes, double *gbps,
                                   char *err)
    clb_status clb_matmul_bench(clb_type t, const void *w, int64_t n_out, int64_t n_in,
                                const float *x, int64_t n_tok, int n_threads, int n_reps,
                                double *secs)
    clb_status clb_threadpool_bench(int n_threads, int n_runs, int gap_us, double *ns_per_run)
    clb_status clb_int8_loop_bench(int variant, double *gmacs)
    int CLB_INT8_LOOP_AVX2
    int CLB_INT8_LOOP_VARIANTS

cdef extern from "clb_storage_probe.h" nogil:
    clb_status clb_storage_probe(const char *const *paths, int n_paths, size_t chunk,
                                 int64_t first, int64_t n_chunks, int depth, int direct,
                                 double *gbps, int64_t *bytes, char *err)

# clb_int8_loop_bench's order: the AVX2 ones first, then the AVX-512 ones; INT8_LOOP_ISA
# names the kernel path each one needs
INT8_LOOP_VARIANTS = ("q8", "q8 without the sign step", "avx512 q8", "avx512 q4",
                      "avx512 vpdpbusd alone")
INT8_LOOP_ISA = tuple("avx2" if i < CLB_INT8_LOOP_AVX2 else "avx512"
                      for i in range(CLB_INT8_LOOP_VARIANTS))
assert len(INT8_LOOP_ISA) == len(INT8_LOOP_VARIANTS)


def bandwidth_probe(size_t nbytes, int n_threads=1, int n_passes=3) -> float:
    """Memory read bandwidth in GB/s (1e9 bytes/s): best of n_passes reads of nbytes.

    For a DRAM figure nbytes should be several times the last-level cache. Raises ValueError
    for bad arguments or a failed checksum, MemoryError when the buffer cannot be mapped.
    """
    cdef char err[512]
    cdef double gbps = 0.0
    cdef clb_status st
    err[0] = 0
    with nogil:
        st = clb_bandwidth_probe(nbytes, n_threads, n_passes, &gbps, err)
    if st != CLB_OK:
        raise _status_error(st, err)
    return gbps


def storage_probe(paths, size_t chunk, int64_t first, int64_t n_chunks, int depth,
                  bint direct=True) -> tuple:
    """(GB/s, bytes read): n_chunks reads of chunk bytes from the files at paths, depth at a time
    (chunk k from file k % len(paths), counted from first), with O_DIRECT when direct. Raises
    ValueError for bad arguments, OSError naming the file when one cannot be opened (or is not
    a regular file) or read."""
    encoded = [_fs_path(p) for p in paths]
    cdef int n = len(encoded), i
    if n < 1:
        raise ValueError("storage probe: no files")
    cdef const char **cp = <const char **>PyMem_Malloc(n * sizeof(char *))
    if cp == NULL:
        raise MemoryError()
    for i in range(n):
        cp[i] = encoded[i]
    cdef char err[512]
    cdef double gbps = 0.0
    cdef int64_t nbytes = 0
    cdef clb_status st
    err[0] = 0
    try:
        with nogil:
            st = clb_storage_probe(cp, n, chunk, first, n_chunks, depth, direct, &gbps, &nbytes,
                                   err)
    finally:
        PyMem_Free(cp)
    if st != CLB_OK:
        raise _status_error(st, err)
    return gbps, int(nbytes)


def matmul_bench(name: str, w, int n_out, int n_in, x, int n_threads=1, int n_reps=5) -> list:
    """Wall seconds of n_reps clb_matmul calls (W bytes of type `name`, x float32 [T, n_in])
    on a pool of n_threads, timed in C; the first call pays for page faults and cold caches."""
    cdef clb_type t = _kernel_type(name, True)
    cdef const float[:, ::1] xv = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, n_in)
    cdef const unsigned char[::1] wv = memoryview(w).cast("B")
    if <size_t>wv.shape[0] != _row_bytes(t, n_in) * <size_t>n_out:
        raise ValueError("weight bytes do not match n_out x n_in")
    if n_reps < 1 or xv.shape[0] < 1:
        raise ValueError("need at least one repeat and one row")
    secs = np.zeros(n_reps, dtype=np.float64)
    cdef double[::1] sv = secs
    cdef clb_status st
    cdef int64_t n_tok = xv.shape[0]
    with nogil:
        st = clb_matmul_bench(t, &wv[0], n_out, n_in, &xv[0, 0], n_tok, n_threads, n_reps,
                              &sv[0])
    if st != CLB_OK:
        raise _status_error(st, f"matmul bench failed with status {int(st)}")
    return secs.tolist()


def threadpool_bench(int n_threads, int n_runs=10000, int gap_us=0) -> float:
    """Mean nanoseconds of one empty thread-pool run (wake every worker, wait for all), each
    run gap_us microseconds after the previous one."""
    cdef double ns = 0.0
    cdef clb_status st
    with nogil:
        st = clb_threadpool_bench(n_threads, n_runs, gap_us, &ns)
    if st != CLB_OK:
        raise _status_error(st, f"thread-pool bench failed with status {int(st)}")
    return ns


def int8_loop_bench(str variant) -> float:
    """GMAC/s of one core running an int8 product's inner loop on data in L1 (no memory
    traffic). AVX2: "q8" as the kernels compute it, or "q8 without the sign step" (not an
    exact product: the ceiling that step costs). AVX-512: the interleaved "avx512 q8" and
    "avx512 q4" kernels at 8 tokens, and "avx512 vpdpbusd alone" (the instruction's own rate,
    the most any int8 product reaches). ValueError on a CPU without the variant's ISA."""
    if variant not in INT8_LOOP_VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(INT8_LOOP_VARIANTS)}")
    cdef int v = INT8_LOOP_VARIANTS.index(variant)
    cdef double g = 0.0
    cdef clb_status st
    with nogil:
        st = clb_int8_loop_bench(v, &g)
    if st != CLB_OK:
        need = {"avx2": "AVX2", "avx512": "AVX-512"}[INT8_LOOP_ISA[v]]
        raise ValueError(f"the int8 loop {variant!r} needs a CPU with {need}")
    return g
