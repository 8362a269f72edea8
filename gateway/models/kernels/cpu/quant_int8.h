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

/* The paths this CPU runs, as a bit mask (1 << path). Defined in quant_int8.c. */
int gw_int8_paths(void);

#endif
