/* Colibri weight-file fault guard: survives a mapped weight file that shrinks under the process.
 * Guarantees: a SIGBUS whose address lies in a registered mapping replaces that mapping with
 * zero pages (so the faulting load completes), marks the mapping faulted and returns; callers
 * learn of it after the step through clb_wfault_any(), one relaxed atomic load.
 * Refuses: nothing is recovered: a faulted mapping stays faulted (zeros) until it is closed. */
#ifndef CLB_WFAULT_H
#define CLB_WFAULT_H

#include <stdatomic.h>
#include <stddef.h>

/* Mappings that have faulted since the process started; 0 on the normal path. */
extern atomic_int clb_wfault_count;

static inline int clb_wfault_any(void) {
    return atomic_load_explicit(&clb_wfault_count, memory_order_relaxed) != 0;
}

/* Guard [addr, addr + len) (a whole mmap of a weight file). Installs the SIGBUS handler on
 * first use, and again if someone replaced it since. Returns a slot >= 0, or -1 when the
 * table is full or the handler cannot be installed (the mapping is then unguarded). */
int clb_wfault_register(void *addr, size_t len);
/* Stop guarding slot (before the mapping is unmapped); ignores slot < 0. */
void clb_wfault_unregister(int slot);
/* 1 when slot's mapping faulted (it now reads as zeros). */
int clb_wfault_faulted(int slot);
/* 1 when the SIGBUS handler in force is this module's. */
int clb_wfault_installed(void);

#endif
