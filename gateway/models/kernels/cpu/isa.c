/* Which of the kernels' instruction sets run: every kernel needs AVX2, FMA and F16C
 * (gw_supported); the AVX-512 bfloat16 ones (KERNEL512) run where the CPU has AVX-512
 * with AVX512_BF16 and the level Python allows reaches it (gw_set_isa_level, from
 * gateway/platforms/cpu_isa.py, where GATEWAY_CPU_ISA can cap it below the CPU's own).
 */
#include "kernels.h"

/* The instruction-set level Python's cpu_isa() allows (3: AVX512_BF16). */
static int isa_level = 0;
/* 0 while the tests forbid the AVX-512 bfloat16 kernels, to run the AVX2 ones. */
static int wide_rows_allowed = 1;

/* 1 where this CPU runs the kernels. */
int gw_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
        && __builtin_cpu_supports("f16c");
}

void gw_set_isa_level(int level) { isa_level = level; }

INTERNAL int gw_runs_avx512_bf16(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
            && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
    }
    return known && isa_level >= 3 && wide_rows_allowed;
}

/* Allow (1) or forbid (0) the AVX-512 bfloat16 kernels (the tests run both); returns
 * whether they run now. */
int gw_wide_bf16_rows(int allow) {
    wide_rows_allowed = allow;
    return gw_runs_avx512_bf16();
}
