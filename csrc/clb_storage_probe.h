/* Colibri storage probe: how fast the files a model's experts live in read with a given number
 * of reads in flight (queue depth), so that the expert cache starts as many readers as the
 * storage answers in parallel, and no more.
 * Guarantees: only regular files are read, opened non-blocking; each read is one chunk at most,
 * at an offset inside its file; buffers are page-aligned (O_DIRECT); every thread is joined and
 * every file closed before the call returns.
 * Refuses: no files, depths outside 1..64, chunks that are not a multiple of 4 KiB or exceed
 * 64 MiB, chunk counts outside 1..1e6. */
#ifndef CLB_STORAGE_PROBE_H
#define CLB_STORAGE_PROBE_H

#include <stddef.h>
#include <stdint.h>

#include "clb_types.h"

/* Reads n_chunks chunks of `chunk` bytes with depth threads at once: chunk k (counted from
 * first) from file k % n_paths, at the (k / n_paths)-th chunk-aligned offset of that file
 * (wrapping within it), with O_DIRECT when direct. *gbps: bytes read per second (1e9), from the
 * first read's start to the last read's end; *bytes: bytes read. CLB_E_ARG for bad arguments,
 * CLB_E_IO when a file cannot be opened or read (err names it), CLB_E_NOMEM. */
clb_status clb_storage_probe(const char *const *paths, int n_paths, size_t chunk, int64_t first,
                             int64_t n_chunks, int depth, int direct, double *gbps,
                             int64_t *bytes, char *err);

#endif
