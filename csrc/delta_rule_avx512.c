/* The gated DeltaNet state update (clb_linear.h) with 16-float AVX512 vectors over the value
 * dimension; the body is clb_delta_simd.h's, bit-equal to clb_delta_step_ref.
 * Refuses: nothing (the caller sized every array). */
#include <immintrin.h>

#include "clb_linear.h"

#define CLB_DELTA_FN clb_delta_step_avx512
#define CLB_DELTA_W 16
#define CLB_DELTA_V __m512
#define CLB_DELTA_SET1 _mm512_set1_ps
#define CLB_DELTA_LOAD _mm512_loadu_ps
#define CLB_DELTA_STORE _mm512_storeu_ps
#define CLB_DELTA_MUL _mm512_mul_ps
#define CLB_DELTA_ADD _mm512_add_ps
#define CLB_DELTA_SUB _mm512_sub_ps
#define CLB_DELTA_ZERO _mm512_setzero_ps
#include "clb_delta_simd.h"
