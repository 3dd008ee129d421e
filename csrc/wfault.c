/* Colibri weight-file fault guard (see clb_wfault.h): a weight file truncated or rewritten
 * under a running server must fail the step that read it, not kill the process with SIGBUS.
 * Guarantees: the decode hot path pays one relaxed atomic load per forward call; the handler
 * touches only lock-free atomics, a raw mmap syscall and sigaction. Refuses: faults outside
 * registered mappings are passed on to the handler that was there before (or the default). */
#define _GNU_SOURCE
#include "clb_wfault.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/syscall.h>
#endif

/* Enough for the largest MoE layouts (Qwen3-MoE 235B: 94 layers x 128 experts + the rest) and
 * for several models in one process; static, so the handler never reads freed memory. */
#define CLB_WFAULT_SLOTS 65536

typedef struct {
    atomic_uintptr_t start; /* 0: free slot */
    atomic_size_t len;
    atomic_int faulted;
} wf_slot;

atomic_int clb_wfault_count;
static wf_slot g_slots[CLB_WFAULT_SLOTS];
static atomic_int g_high;            /* slots [0, g_high) may be in use */
static struct sigaction g_prev;      /* the handler we replaced, for faults that are not ours */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER; /* register/unregister/install */

/* Zero pages over [addr, addr + len): anonymous, read-only, same place. A raw syscall rather
 * than mmap(): it bypasses interposers (sanitizer runtimes) and libc bookkeeping, so it is as
 * async-signal-safe as any system call; POSIX does not list mmap, but on Linux the libc
 * wrapper is a bare syscall too. */
static int zero_map(void *addr, size_t len) {
#ifdef __linux__
    long r = syscall(SYS_mmap, addr, len, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED,
                     -1, 0L);
    return r == (long)(uintptr_t)addr ? 0 : -1;
#else
    return mmap(addr, len, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == addr
               ? 0 : -1;
#endif
}

/* Async-signal-safety: this runs on whichever thread touched the lost page (a compute worker
 * mid-kernel), possibly while another thread holds g_mu. It takes no lock, allocates nothing
 * and calls only zero_map (one system call) and sigaction (async-signal-safe); the slot table
 * is a static array of atomics, published with release stores in register, so a torn read
 * is impossible and a concurrently freed slot reads as start == 0. errno is preserved. A slot
 * is unregistered only when its model is freed, which never overlaps a forward on it. */
static void on_sigbus(int sig, siginfo_t *si, void *ctx) {
    int saved = errno;
    uintptr_t a = (uintptr_t)si->si_addr;
    int high = atomic_load_explicit(&g_high, memory_order_acquire);
    for (int i = 0; i < high; i++) {
        uintptr_t s = atomic_load_explicit(&g_slots[i].start, memory_order_acquire);
        size_t len = atomic_load_explicit(&g_slots[i].len, memory_order_relaxed);
        if (s == 0 || a < s || a - s >= len) continue;
        if (zero_map((void *)s, len) == 0) {
            if (!atomic_exchange(&g_slots[i].faulted, 1)) atomic_fetch_add(&clb_wfault_count, 1);
            errno = saved;
            return; /* the load runs again and now reads a zero page */
        }
        break;
    }
    errno = saved;
    /* not a weight page (or it could not be replaced): whoever handled SIGBUS before us */
    if ((g_prev.sa_flags & SA_SIGINFO) && g_prev.sa_sigaction) {
        g_prev.sa_sigaction(sig, si, ctx);
    } else if (g_prev.sa_handler != SIG_DFL && g_prev.sa_handler != SIG_IGN &&
               !(g_prev.sa_flags & SA_SIGINFO)) {
        g_prev.sa_handler(sig);
    } else {
        /* default action: restore it; returning re-runs the access, which then kills the
         * process the way it would have without us (core dump included) */
        struct sigaction dfl;
        memset(&dfl, 0, sizeof(dfl));
        dfl.sa_handler = SIG_DFL;
        sigemptyset(&dfl.sa_mask);
        sigaction(sig, &dfl, NULL);
    }
}

int clb_wfault_installed(void) {
    struct sigaction cur;
    if (sigaction(SIGBUS, NULL, &cur) != 0) return 0;
    return (cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_sigbus;
}

/* With g_mu held. Another library (Python's faulthandler, a sanitizer) may have taken SIGBUS
 * after us: take it back, chaining to it. */
static int install_locked(void) {
    if (clb_wfault_installed()) return 0;
    struct sigaction sa, prev;
    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, NULL, &prev) != 0) return -1;
    g_prev = prev; /* written before our handler can run */
    return sigaction(SIGBUS, &sa, NULL);
}

int clb_wfault_register(void *addr, size_t len) {
    if (!addr || len == 0) return -1;
    pthread_mutex_lock(&g_mu);
    int slot = -1;
    if (install_locked() == 0) {
        int high = atomic_load_explicit(&g_high, memory_order_relaxed);
        for (int i = 0; i < high && slot < 0; i++)
            if (atomic_load_explicit(&g_slots[i].start, memory_order_relaxed) == 0) slot = i;
        if (slot < 0 && high < CLB_WFAULT_SLOTS) slot = high;
        if (slot >= 0) {
            atomic_store_explicit(&g_slots[slot].faulted, 0, memory_order_relaxed);
            atomic_store_explicit(&g_slots[slot].len, len, memory_order_relaxed);
            atomic_store_explicit(&g_slots[slot].start, (uintptr_t)addr, memory_order_release);
            if (slot == high) atomic_store_explicit(&g_high, high + 1, memory_order_release);
        }
    }
    pthread_mutex_unlock(&g_mu);
    return slot;
}

void clb_wfault_unregister(int slot) {
    if (slot < 0 || slot >= CLB_WFAULT_SLOTS) return;
    pthread_mutex_lock(&g_mu);
    atomic_store_explicit(&g_slots[slot].start, 0, memory_order_release);
    if (atomic_exchange(&g_slots[slot].faulted, 0)) atomic_fetch_sub(&clb_wfault_count, 1);
    pthread_mutex_unlock(&g_mu);
}

int clb_wfault_faulted(int slot) {
    if (slot < 0 || slot >= CLB_WFAULT_SLOTS) return 0;
    return atomic_load_explicit(&g_slots[slot].faulted, memory_order_acquire);
}
