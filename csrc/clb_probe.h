/* Colibri ceiling probes' data (bench_kernels, clb_int8_loop_avx2/avx512): interleaved weights
 * and packed activations held in L1, and the checksum that keeps every call's result alive.
 * Guarantees: the same pattern on every path; plain C, included by the ISA kernel files. */
#ifndef CLB_PROBE_H
#define CLB_PROBE_H

#include <string.h>

#include "clb_types.h"

/* n_blk interleaved blocks of gb bytes at w: a fixed byte pattern, each block's 8 f16 scales
 * 0.0625; n_act activation blocks of varied quants and scales, corr 0 */
static inline void clb_probe_fill(unsigned char *w, size_t n_blk, size_t gb, clb_block_q8c *act,
                                  int n_act) {
    for (size_t i = 0; i < n_blk * gb; i++) w[i] = (unsigned char)(i * 7 + 3);
    for (size_t b = 0; b < n_blk; b++)
        for (int r = 0; r < 8; r++) memcpy(w + b * gb + 2 * r, &(clb_f16){0x2c00}, 2);
    for (int i = 0; i < n_act; i++) {
        act[i].d = 1.0f / (float)(i + 1);
        act[i].corr = 0;
        for (int k = 0; k < CLB_QK; k++) act[i].qs[k] = (int8_t)((i * 31 + k * 5) % 255 - 127);
    }
}

/* sum folded with one output of call c (of n_y), so no call can be left out */
static inline uint64_t clb_probe_mix(uint64_t sum, const float *y, int n_y, int64_t c) {
    uint32_t u;
    memcpy(&u, &y[c % n_y], sizeof u);
    return sum * 31 + u;
}

#endif
