/* Colibri internal helpers shared by the C core: error messages and a monotonic clock.
 * Guarantees: clb_set_err never writes past CLB_UTIL_ERR_LEN bytes and always terminates;
 * clb_now_ns is monotonic. Refuses: nothing (a NULL err is ignored). */
#ifndef CLB_UTIL_H
#define CLB_UTIL_H

#include <stdint.h>

/* the size of every err buffer the C API fills (CLB_ERR_LEN, CLB_BENCH_ERR_LEN) */
#define CLB_UTIL_ERR_LEN 512

/* printf into err (CLB_UTIL_ERR_LEN bytes); nothing when err is NULL */
void clb_set_err(char *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* CLOCK_MONOTONIC in nanoseconds */
int64_t clb_now_ns(void);

#endif
