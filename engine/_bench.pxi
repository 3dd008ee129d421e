# bench binding: the machine probes `colibri bench` reports (csrc/clb_bench.h).
#
# bandwidth_probe reads a fresh buffer with n threads and returns the best pass in GB/s; it
# releases the GIL and refuses bad arguments with a ValueError. Uses clb_status from
# _kernels.pxi.

cdef extern from "clb_bench.h" nogil:
    int CLB_BENCH_ERR_LEN
    clb_status clb_bandwidth_probe(size_t nbytes, int n_threads, int n_passes, double *gbps,
                                   char *err)


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
    if st == CLB_E_NOMEM:
        raise MemoryError(err.decode("utf-8", "replace"))
    if st != CLB_OK:
        raise ValueError(err.decode("utf-8", "replace") or f"bandwidth probe status {int(st)}")
    return gbps
