/* One thread's io_uring, for the expert cache's readers: a long read split into chunks that are
 * all in flight at once (the queue depth one thread can give storage that answers many
 * requests together), through raw system calls (no liburing).
 * Guarantees: clb_uring_read returns only once every request it submitted has completed, so the
 * buffer is never written after it returns; short reads are resumed, a read past the end of the
 * file stops there.
 * Refuses: nothing is retried on a hard error; where the kernel has no io_uring (or forbids it),
 * clb_uring_init fails and says why. */
#ifndef CLB_URING_H
#define CLB_URING_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

typedef struct clb_uring clb_uring;

/* A ring of `depth` entries (1..64) for one thread; NULL with msg set when the kernel refuses. */
clb_uring *clb_uring_init(unsigned depth, char *msg, size_t msg_len);
void clb_uring_free(clb_uring *r);

/* Reads len bytes of fd at off into buf, in chunks of `chunk` bytes, up to the ring's depth in
 * flight. Returns the bytes read (fewer only at the end of the file), or -errno. */
int64_t clb_uring_read(clb_uring *r, int fd, void *buf, size_t len, off_t off, size_t chunk);

#endif
