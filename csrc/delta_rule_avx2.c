/* The gated DeltaNet state update (clb_linear.h) with 8-float AVX2 vectors over the value
 * dimension; the body is clb_delta_simd.h's, bit-equal to clb_delta_step_ref.
 * Refuses: nothing (the caller sized every array). */
#include <immintrin.h>

#include "clb_linear.h"

#define CLB_DELTA_FN clb_delta_step_avx2
#define CLB_DELTA_W 8
#define CLB_DELTA_V __m256
#define CLB_DELTA_SET1 _mm256_set1_ps
#define CLB_DELTA_LOAD _mm256_loadu_ps
#define CLB_DELTA_STORE _mm256_storeu_ps
#define CLB_DELTA_MUL _mm256_mul_ps
#define CLB_DELTA_ADD _mm256_add_ps
#define CLB_DELTA_SUB _mm256_sub_ps
#define CLB_DELTA_ZERO _mm256_setzero_ps
#include "clb_delta_simd.h"
