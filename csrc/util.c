/* Colibri internal helpers: error messages and the monotonic clock (see clb_util.h). */
#define _POSIX_C_SOURCE 200809L
#include <stdarg.h>
#include <stdio.h>
#include <time.h>

#include "clb_bench.h"
#include "clb_model.h"
#include "clb_util.h"

_Static_assert(CLB_ERR_LEN == CLB_UTIL_ERR_LEN, "err buffers share one size");
_Static_assert(CLB_BENCH_ERR_LEN == CLB_UTIL_ERR_LEN, "err buffers share one size");

void clb_set_err(char *err, const char *fmt, ...) {
    if (!err) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, CLB_UTIL_ERR_LEN, fmt, ap);
    va_end(ap);
}

int64_t clb_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}
