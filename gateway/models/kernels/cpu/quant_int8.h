/* What the two files of 8-bit activation products share: quant_int8.c (Q4_0, Q4_1, Q8_0 in
 * the kernels' layout) and kquant_int8.c (Q4_K, Q5_K, Q6_K in their file's blocks). The
 * caller (Python, which knows the level GATEWAY_CPU_ISA allows) names the path; both files
 * refuse one this CPU lacks.
 */
#ifndef GW_QUANT_INT8_H
#define GW_QUANT_INT8_H

#include "quant.h"

enum { INT8_SCALAR = 1, INT8_AVX2 = 2, INT8_VNNI = 3 };

#define KERNEL_VNNI \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

/* The sum of v's eight 32-bit lanes (the integer sums of a quantized block of x). */
KERNEL static inline int hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* The paths this CPU runs, as a bit mask (1 << path). Defined in quant_int8.c. */
int gw_int8_paths(void);

#endif
